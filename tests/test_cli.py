"""The command line as a user meets it: outputs, JSON, and bad input as exit 2 with one clear message."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_cli



def test_flops_json_has_exactly_the_documented_keys(monkeypatch, capsys):
    code, out, _ = run_cli(["flops", "--preset", "frontier-535b", "--json"], monkeypatch, capsys)
    assert code == 0
    figures = json.loads(out)
    assert set(figures) == {"total_params", "active_params", "embedding_params", "flops_per_token", "tokens",
                            "train_flops"}
    assert round(figures["total_params"] / 1e9) == 535 and round(figures["active_params"] / 1e9) == 23


def test_flops_tokens_option_sets_the_token_count(monkeypatch, capsys):
    code, out, _ = run_cli(["flops", "--preset", "tiny", "--tokens", "1000", "--json"], monkeypatch, capsys)
    figures = json.loads(out)
    assert code == 0 and figures["tokens"] == 1000
    assert figures["train_flops"] == figures["flops_per_token"] * 1000


def test_presets_lists_every_preset(monkeypatch, capsys):
    code, out, _ = run_cli(["presets", "--json"], monkeypatch, capsys)
    assert code == 0 and {"tiny", "frontier-535b", "ladder-d768", "ladder-d2048"} <= set(json.loads(out))


@pytest.mark.parametrize(
    "args, message",
    [
        (["flops", "--preset", "nope"], "unknown preset 'nope'"),
        (["train", "--preset", "tiny", "--set", "model.num_heads=3"], "model.num_heads=3"),
        (["train", "--preset", "tiny", "--set", "model.num_kv_heads=3"], "model.num_kv_heads=3"),
        (["train", "--preset", "tiny", "--set", "model.moe.num_experts_per_token=9"], "num_experts_per_token=9"),
        (["train", "--preset", "tiny", "--set", "model.moe.capacity_factor=0"], "capacity_factor=0"),
        (["train", "--preset", "tiny", "--set", "model.moe.bogus=1"], "Unknown key model.moe.bogus"),
        (["train", "--preset", "tiny", "--set", "train.steps"], "section.field=value"),
        # issue 54: the value of a `--set` without '=' became CONFIG; now the message is about the '='
        (["train", "--preset", "tiny", "--set", "model.d_model", "128"],
         "--set model.d_model has no '=': write --set model.d_model=VALUE (section.field=value, no spaces; here "
         "--set model.d_model=128)"),
        (["train", "--preset", "tiny", "--set", "model.moe.top_k=2"], "(did you mean num_experts_per_token?)"),
        (["train", "--preset", "tiny", "--set", "train.stpes=2"], "(did you mean steps?)"),
        (["train", "--preset", "tinny"], "unknown preset 'tinny' (did you mean tiny?)"),
        (["train", "--preset", "tiny", "--mesh", "expert=3"], "mesh.expert that would work: 1, 2, 4, 8"),
        (["train", "--preset", "tiny", "--set", "model.vocab_size=100"], "model.vocab_size=100"),
        (["train"], "exactly one of CONFIG.yaml or --preset"),
        (["train", "--preset", "tiny", "--set", "model.seq_len=100000"], "fewer than one row of seq_len + 1"),
        (["train", "--preset", "tiny", "--mesh", "expert=2", "--set", "model.moe.dispatch=capacity"],
         "model.moe.dispatch='capacity' cannot run with mesh.expert=2"),
        (["train", "--preset", "tiny", "--steps", "4", "--profile", "3:2"], "--profile='3:2' is invalid"),
        (["train", "--preset", "tiny", "--steps", "4", "--profile", "2:9"], "STOP <= train.steps (4)"),
        (["train", "--preset", "tiny", "--profile", "ten"], "e.g. --profile 10:15"),
    ],
)
def test_bad_input_exits_2_with_one_message_and_writes_nothing(args, message, monkeypatch, capsys, tmp_path):
    out_dir = tmp_path / "out"
    code, _, err = run_cli([*args, "--out", str(out_dir)] if args[0] == "train" else args, monkeypatch, capsys)
    assert code == 2
    assert message in " ".join(err.split())
    assert "Traceback" not in err
    assert not out_dir.exists()


def test_mesh_with_experts_selects_dispatch_ep_unless_set_names_a_dispatch():
    """`--mesh expert>1` is a shortcut for `--set model.moe.dispatch=ep`; a dispatch given with --set is left
    to RunConfig, which refuses one the mesh cannot run (the bad-input case above)."""
    from moelab.cli.common import mesh_fields as _mesh_fields

    assert _mesh_fields("replica=2,expert=4", None) == {"mesh.replica": 2, "mesh.expert": 4,
                                                        "model.moe.dispatch": "ep"}
    assert _mesh_fields("expert=4", ["model.moe.dispatch=capacity"]) == {"mesh.expert": 4}
    assert _mesh_fields("replica=2,expert=1", None) == {"mesh.replica": 2, "mesh.expert": 1}


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--preset", "tiny", "--steps", "abc"], "Invalid value for '--steps'"),
        (["train", "--bogus"], "No such option: --bogus"),
        (["nosuchcmd"], "No such command 'nosuchcmd'"),
        (["lab", "amend", "demo-tiny", "experiments/demo-spec.yaml"], "Missing option '--reason'"),
    ],
)
def test_command_line_usage_errors_exit_2_with_a_usage_message(args, message, monkeypatch, capsys):
    """Parsing errors from click (or the copy newer typer releases bundle) print usage, not a traceback."""
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 2
    assert message in " ".join(err.split())
    assert "Traceback" not in err


def test_flops_tokens_accepts_scientific_notation_and_refuses_fractions(monkeypatch, capsys):
    code, out, _ = run_cli(["flops", "--preset", "tiny", "--tokens", "1e9", "--json"], monkeypatch, capsys)
    assert code == 0 and json.loads(out)["tokens"] == 10**9
    code, _, err = run_cli(["flops", "--preset", "tiny", "--tokens", "1.5"], monkeypatch, capsys)
    assert code == 2 and "--tokens=1.5 is invalid" in err


def test_malformed_and_unknown_key_yaml_exit_2(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    code, _, err = run_cli(["train", str(bad), "--out", str(tmp_path / "o")], monkeypatch, capsys)
    assert code == 2 and "not valid YAML" in err
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("model:\n  d_model: 64\n  widht: 3\n")
    code, _, err = run_cli(["train", str(unknown), "--out", str(tmp_path / "o")], monkeypatch, capsys)
    assert code == 2 and "model.widht" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content, message", [(None, "does not exist"), ("", "empty")])
def test_missing_or_empty_data_file_exits_2_naming_it(content, message, tmp_path, monkeypatch, capsys):
    data = tmp_path / "corpus.txt"
    if content is not None:
        data.write_text(content)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "data:\n  domains:\n    - {name: mine, kind: files, paths: [" + str(data) + "]}\n"
        "  phases:\n    - {name: all, fraction: 1.0, weights: {mine: 1.0}}\n"
    )
    code, _, err = run_cli(["train", str(cfg), "--out", str(tmp_path / "o")], monkeypatch, capsys)
    assert code == 2 and "corpus.txt" in err and message in err.lower()
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_train_command_writes_config_metrics_and_summary(tmp_path):
    """End to end through the installed entry point, as a user runs it.

    `slow` (issue 27): a cold subprocess, ~35 s on 2 cores. The fast suite keeps the train command's files
    in process (test_checkpoint) and `moelab lab run` training a registered config (test_executor)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "moelab.cli", "train", "--preset", "tiny", "--steps", "4", "--out", str(out),
         "--set", "train.log_every=2", "--set", "train.eval_batches=1"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for key in ("step", "loss", "lr", "tokens", "grad_norm", "tokens_per_s", "drop_fraction"):
        assert key in records[-1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 4 and set(summary["eval"]) == {"code", "prose", "arithmetic", "mean"}
    assert "moe:" in (out / "config.yaml").read_text()


def test_train_shows_mfu_where_the_peak_is_known_and_profile_writes_a_trace_perfetto_opens(tmp_path, monkeypatch,
                                                                                         capsys):
    """A CPU has no datasheet (no MFU, rather than a guess); with one (1 TFLOP/s, patched in) every record and the
    summary carry MFU = training FLOPs per token x tokens/s / peak, and the progress line says it. `--profile 1:3`
    traces steps 2-3: a gzipped Perfetto JSON with the steps' events, its path printed."""
    import gzip

    from moelab import accounting, presets
    from moelab.train import run_length

    assert run_length.datasheet_peak_flops("cpu") is None
    assert run_length.datasheet_peak_flops("NVIDIA H200") == run_length.DEVICES["h200"].peak_flops
    assert run_length.datasheet_peak_flops("NVIDIA H100 PCIe") is None  # slower than the SXM sheet: no guess
    monkeypatch.setattr(run_length, "datasheet_peak_flops", lambda kind: 1e12)
    out = tmp_path / "run"
    code, stdout, _ = run_cli(["train", "--preset", "tiny", "--steps", "3", "--out", str(out), "--profile", "1:3",
                               "--set", "train.log_every=1", "--set", "train.eval_batches=1"], monkeypatch, capsys)
    assert code == 0
    per_token = accounting.flops_per_token(presets.get("tiny").model)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        assert record["mfu"] == pytest.approx(per_token * record["tokens_per_s"] / 1e12, rel=1e-9)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mfu"] == pytest.approx(per_token * summary["tokens_per_s"] / 1e12, rel=1e-9)
    assert "MFU" in stdout and "Profile of steps 2-3" in stdout
    (trace,) = (out / "profile").rglob("perfetto_trace.json.gz")
    assert str(trace) in stdout
    events = json.loads(gzip.decompress(trace.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert len(events) > 10 and any(e.get("dur", 0) > 0 for e in events)


def test_train_dry_run_prints_the_config_and_plan_and_writes_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    code, stdout, _ = run_cli(["train", "--preset", "tiny", "--set", "model.d_model=128", "--dry-run",
                               "--out", str(out)], monkeypatch, capsys)
    assert code == 0 and not out.exists()
    assert "d_model: 128" in stdout  # the config as resolved, overrides applied
    assert "per device" in stdout and "total" in stdout  # the plan's memory table
    assert "No step time: no datasheet here for 'cpu'" in stdout
    assert "links:" not in stdout  # one device: no link carries anything
    assert "settings that lower it" not in stdout  # no memory limit here to get under: no tips


README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_preset_table_names_every_preset_and_points_at_nothing_outside_the_repository():
    from moelab import presets

    text = README.read_text()
    table = text[text.index("| preset | what |"):]
    table = table[: table.index("\n\n")]
    assert all(f"`{name}`" in table for name in presets.describe()), set(presets.describe())
    assert "../" not in text  # a clone holds only the repository: a link out of it is dead


@pytest.mark.parametrize("command", [["flops"], ["presets"], ["lab", "show"], ["lab", "run"]])
def test_help_shows_flags_without_a_value_placeholder(command, monkeypatch, capsys):
    """typer labelled `--json` and `--help` as `<bool>`, as if they took a value (`--json true` then read
    `true` as the next argument)."""
    code, out, _ = run_cli([*command, "--help"], monkeypatch, capsys)
    assert code == 0 and "--json" in out and "--help" in out
    assert "<bool>" not in out


@pytest.mark.parametrize("args, shown", [
    (["train", "--preset", "tiny", "--steps", "ten"], "'ten'"),
    (["flops", "--preset", "tiny", "--tokens", "abc"], "'abc'"),
])
def test_a_value_of_the_wrong_type_is_repeated_in_the_usage_error(args, shown, monkeypatch, capsys):
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and shown in err and "Traceback" not in err


def test_the_command_starts_without_scipy_or_jax():
    """Every `moelab` command pays for what `moelab.cli` imports; fits and the model load when a command needs them."""
    code = "import sys, moelab.cli.main\nprint(sorted(m for m in ('scipy', 'jax') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_summary_line_of_a_run_resumed_at_its_last_step_says_what_it_did_not_measure():
    """Killed after its last checkpoint, before summary.json: the rerun trains no step, so the summary has no
    throughput (None) and may have no loss; the line says so instead of failing to format None."""
    from moelab.cli.train import summary_line

    line = summary_line({"step": 16, "loss": None, "tokens_per_s": None, "eval": {"mean": 2.5}, "incidents": 0},
                        Path("runs/x"))
    assert "no step trained here" in line and "throughput not measured" in line and "2.500" in line
    assert "1,234 tokens/s" in summary_line({"step": 16, "loss": 2.0, "tokens_per_s": 1234.4}, Path("runs/x"))


def test_the_command_line_doc_names_every_flag_of_train_and_plan():
    """Issue 62: docs/command-line.md claimed every flag and left out `plan`'s; now it says which commands it lists
    in full, and this keeps them so."""
    import typer

    from moelab.cli.main import app

    doc = (Path(__file__).resolve().parents[1] / "docs" / "command-line.md").read_text()
    commands = typer.main.get_command(app).commands
    for name in ("train", "plan"):
        flags = {opt for p in commands[name].params for opt in p.opts if opt.startswith("--") and opt != "--help"}
        assert flags and not {f for f in flags if not re.search(rf"{re.escape(f)}\b", doc)}, name
