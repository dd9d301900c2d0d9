"""Live tracking: the mixture log adds up, samples appear at each eval, the ledger and W&B get every output.

`slow` (issue 27): a 20-step training of its own shape in the module fixture and two more, ~50 s on 2 cores.
The fast suite keeps the mixture's phases (test_data) and `lab run` putting every step on
the ledger (test_executor)."""

import json

import pytest
from helpers import run_cli

from moelab import presets
from moelab.config import override
from moelab.data.mixture import MixtureLog, change_message, phase_at, realized_tokens, sample_batch
from moelab.lab import ledger as ledger_lib
from moelab.lab import tracking
from moelab.train.loop import prepare_corpus, train

pytestmark = pytest.mark.slow
STEPS, EVAL_EVERY, SNAPSHOT_EVERY = 20, 10, 5


def _cfg():
    return override(presets.get("tiny"), {
        "train.steps": STEPS, "train.eval_every": EVAL_EVERY, "train.eval_batches": 1, "train.log_every": 5,
        "train.batch_size": 8, "train.mixture_snapshot_every": SNAPSHOT_EVERY, "data.max_bytes_per_domain": 200_000})


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory, monkeypatch_module):
    """One 20-step tiny run with a ledger sink and an offline W&B sink."""
    monkeypatch_module.delenv("WANDB_MODE", raising=False)
    monkeypatch_module.delenv("WANDB_API_KEY", raising=False)
    out = tmp_path_factory.mktemp("run")
    cfg = _cfg()
    sinks = [tracking.LedgerSink(out / "ledger.sqlite", "exp-1", cfg.name),
             tracking.WandbSink(out, {"name": cfg.name}, cfg.name)]
    summary = train(cfg, out, sinks=sinks)
    return cfg, out, summary


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_mixture_log_publishes_the_phase_switch_and_snapshots_that_add_up(run):
    cfg, out, summary = run
    entries = _read(out / "mixture_log.jsonl")
    changes = [e for e in entries if e["kind"] == "change"]
    assert [(e["step"], e["phase"]) for e in changes] == [(0, "pretrain"), (16, "midtrain")]
    assert changes[1]["weights"] == {"code": 0.25, "prose": 0.25, "arithmetic": 0.5}
    assert changes[1]["message"] == ("phase pretrain -> midtrain at step 16 (80% of 20 steps): arithmetic 0.10 -> "
                                     "0.50, code 0.45 -> 0.25, prose 0.45 -> 0.25")
    snapshots = [e for e in entries if e["kind"] == "snapshot"]
    assert [s["step"] for s in snapshots] == [5, 10, 15, 20]
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    for s in snapshots:
        assert sum(s["tokens"].values()) == s["total"] == s["step"] * tokens_per_step
    # Oracle: the realized tokens of the very batches the sampler draws.
    corpus = prepare_corpus(cfg)
    expected = dict.fromkeys(corpus.domains, 0)
    for step in range(STEPS):
        batch = sample_batch(corpus, phase_at(cfg.data, step, STEPS)[1].weights, cfg.train.seed, step,
                             cfg.train.batch_size, cfg.model.seq_len)
        for d, n in realized_tokens(batch, corpus.domains).items():
            expected[d] += n
    assert snapshots[-1]["tokens"] == expected
    assert summary["tokens"] == snapshots[-1]["total"]


def test_samples_are_stored_at_each_eval(run):
    _, out, _ = run
    rows = _read(out / "samples.jsonl")
    assert sorted({r["step"] for r in rows}) == [0, 10, 20]
    assert {(r["step"], r["domain"]) for r in rows} == {(s, d) for s in (0, 10, 20)
                                                         for d in ("code", "prose", "arithmetic")}
    prompts = {r["domain"]: r["prompt"] for r in rows if r["step"] == 0}
    assert all(r["prompt"] == prompts[r["domain"]] for r in rows)  # fixed for the run
    assert prompts["arithmetic"][:1].isdigit() and all(len(p) > 0 for p in prompts.values())
    assert all(isinstance(r["continuation"], str) and r["continuation"] for r in rows)


def test_the_ledger_gets_every_kind_and_still_verifies(run):
    cfg, out, _ = run
    ledger = ledger_lib.open_ledger(out / "ledger.sqlite")
    assert ledger_lib.verify(ledger).ok
    by_kind = {k: ledger_lib.records(ledger, kind=k, key="exp-1") for k in ("metric", "mixture", "sample")}
    metrics = _read(out / "metrics.jsonl")
    assert [r.body["step"] for r in by_kind["metric"]] == [r["step"] for r in metrics]
    assert all(r.body["run"] == cfg.name for rows in by_kind.values() for r in rows)
    assert [{k: v for k, v in r.body.items() if k != "run"} for r in by_kind["mixture"]] == \
        _read(out / "mixture_log.jsonl")
    assert len(by_kind["sample"]) == len(_read(out / "samples.jsonl"))


def test_an_incident_goes_to_the_ledger(tmp_path):
    sink = tracking.LedgerSink(tmp_path / "ledger.sqlite", "exp-2", "r")
    sink.incident({"step": 3, "rule": "loss_spike", "module": "loss", "values": {"loss": float("nan")}})
    ledger = ledger_lib.open_ledger(tmp_path / "ledger.sqlite")
    [record] = ledger_lib.records(ledger, kind="incident")
    assert record.body["rule"] == "loss_spike" and record.body["values"]["loss"] == "NaN"
    assert ledger_lib.verify(ledger).ok


def test_wandb_offline_run_holds_the_metrics_under_out(run):
    _, out, _ = run
    [run_dir] = list((out / "wandb").glob("offline-run-*"))
    [record_file] = run_dir.glob("run-*.wandb")  # the offline run's record, synced with `wandb sync`
    # wandb>=0.19 has no Python reader for this protobuf log; its history items spell each key in plain bytes.
    logged = record_file.read_bytes()
    for key in ("train/loss", "train/lr", "throughput/tokens_per_s", "router/maxvio", "norm/params/",
                "eval/mean", "mixture/tokens/code", "mixture/weight/arithmetic"):
        assert key.encode() in logged, key
    tables = list((run_dir / "files" / "media" / "table").glob("samples_*.table.json"))
    assert len(tables) == 3  # one per eval: steps 0, 10, 20
    last = max(tables, key=lambda p: int(p.name.split("_")[1]))
    assert len(json.loads(last.read_text())["data"]) == 9  # every row so far: 3 evals x 3 domains


def test_wandb_sink_made_again_for_the_same_out_continues_the_same_run(run, tmp_path, monkeypatch):
    """A resumed training makes its sinks again: W&B must continue the run, not start a second one."""
    _, out, _ = run
    first_id = (out / "wandb" / "moelab_run_id").read_text().strip()
    [run_dir] = list((out / "wandb").glob("offline-run-*"))
    assert run_dir.name.endswith(first_id)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    sink = tracking.WandbSink(tmp_path / "a", {"name": "x"}, "x")
    first = sink.run.id
    sink.close()  # finished, as at a preemption: W&B would otherwise hand back the active run whatever the id
    again = tracking.WandbSink(tmp_path / "a", {"name": "x"}, "x")
    assert again.run.id == first != first_id
    again.close()
    fresh = tracking.WandbSink(tmp_path / "b", {"name": "x"}, "x")
    assert fresh.run.id != first, "another OUT is another run"
    fresh.close()


def test_counts_rebuilt_for_a_resume_match_the_sampled_batches():
    """A checkpoint without `realized_tokens` is rebuilt from the phase schedule; the batches are the oracle."""
    cfg = override(_cfg(), {"train.batch_size": 7})  # 7 rows: the largest-remainder split is uneven
    corpus = prepare_corpus(cfg)
    log = MixtureLog(cfg, corpus.domains)
    for step in range(STEPS):
        log.before_step(step)
        batch = sample_batch(corpus, phase_at(cfg.data, step, STEPS)[1].weights, cfg.train.seed, step,
                             cfg.train.batch_size, cfg.model.seq_len)
        log.after_step(step + 1, batch)
        rebuilt = MixtureLog(cfg, corpus.domains, start=step + 1)
        assert rebuilt.counts == log.counts, step
    assert sum(log.counts.values()) == STEPS * 7 * cfg.model.seq_len


def test_a_resume_publishes_no_second_initial_change():
    cfg = _cfg()
    kept = [{"step": 0, "kind": "change", "phase": "pretrain", "weights": dict(cfg.data.phases[0].weights),
             "message": "..."}]
    log = MixtureLog(cfg, ("code", "prose", "arithmetic"), start=8, kept=kept)
    assert log.before_step(8) is None
    assert log.before_step(16)["message"].startswith("phase pretrain -> midtrain at step 16")


def test_change_message_lists_only_changed_domains():
    msg = change_message(("a", {"x": 0.5, "y": 0.5}), ("b", {"x": 0.5, "y": 0.25, "z": 0.25}), 240, 300)
    assert msg == "phase a -> b at step 240 (80% of 300 steps): y 0.50 -> 0.25, z 0.00 -> 0.25"


@pytest.mark.slow
def test_moelab_train_wandb_names_the_run_keeps_readme_metric_names_and_a_resume_continues_it(
        tmp_path, monkeypatch, capsys):
    """`moelab train --wandb --name`: offline under OUT/wandb, the run named as asked, router_bias/max_abs
    under its README name (not train/router_bias/...), and a resumed run logs into the same W&B run (one
    id, kept in OUT/wandb/moelab_run_id); MFU, where the device's peak is known, as throughput/mfu.

    `slow` (issue 27): two trainings of their own, ~25 s on 2 cores; the module fixture's W&B sink stays."""
    from moelab.train import run_length

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setattr(run_length, "datasheet_peak_flops", lambda kind: 1e12)  # a device whose peak is known
    out = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--set", "train.eval_every=2", "--set", "train.eval_batches=1",
            "--checkpoint-every", "2", "--wandb", "--name", "exp-wandb", "--out", str(out)]
    code, _, err = run_cli(args + ["--steps", "2"], monkeypatch, capsys)
    assert code == 0, err
    run_id = (out / "wandb" / "moelab_run_id").read_text().strip()
    code, _, err = run_cli(args + ["--steps", "4"], monkeypatch, capsys)  # resumes from step 2
    assert code == 0, err
    assert (out / "wandb" / "moelab_run_id").read_text().strip() == run_id
    run_dirs = list((out / "wandb").glob("offline-run-*"))
    assert run_dirs and all(d.name.endswith(run_id) for d in run_dirs)
    logged = b"".join(f.read_bytes() for d in run_dirs for f in d.glob("run-*.wandb"))
    assert b"exp-wandb" in logged and b"router_bias/max_abs" in logged
    assert b"train/router_bias" not in logged and b"train/loss" in logged
    assert b"throughput/mfu" in logged and b"train/mfu" not in logged


def test_moelab_train_name_without_wandb_is_a_usage_error(tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(["train", "--preset", "tiny", "--name", "x", "--out", str(tmp_path / "r")],
                           monkeypatch, capsys)
    assert code == 2 and "--name names the W&B run; add --wandb" in err
