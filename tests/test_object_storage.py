"""Token stores and run publishing on object storage, against a real S3-compatible server (moto's standalone
server, started on localhost by this module): no client is patched, every byte goes over HTTP."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from helpers import run_cli
from test_store import data_config, write_corpus

from moelab.data import store as store_lib

BUCKET = "moelab-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on a free localhost port, with a bucket; yields its endpoint URL."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, "moto server did not start"
            time.sleep(0.05)
    endpoint = f"http://127.0.0.1:{port}"
    yield endpoint
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """Credentials and endpoint for the local server (as a user sets them), a fresh client cache, a bucket."""
    import s3fs

    for key, value in {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1",
                       "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
                       "AWS_EC2_METADATA_DISABLED": "true", "MOELAB_STORE_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    yield fs
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.slow
def test_a_store_prepared_into_a_bucket_trains_like_the_local_one(s3, tmp_path, monkeypatch, capsys):
    """`slow` (issue 27): two trainings, ~10 s on 2 cores; the fast suite keeps a run publishing its files to
    the bucket as it goes and `lab run` publishing the ledger export and the report."""
    data_yaml = write_corpus(tmp_path / "corpus")
    url = f"s3://{BUCKET}/stores/web"
    code, out, err = run_cli(["data", "prepare", "--preset", "tiny", "--data", str(data_yaml), "--out", url,
                              "--shard-tokens", "4000", "--json"], monkeypatch, capsys)
    assert code == 0, err
    prepared = json.loads(out)
    listed = s3.find(f"{BUCKET}/stores/web")
    assert f"{BUCKET}/stores/web/manifest.json" in listed and any(p.endswith(".tokens.npy") for p in listed)
    local = store_lib.prepare(data_config(data_yaml.parent), tmp_path / "local", shard_tokens=4000)
    assert local["store_hash"] == prepared["store_hash"]  # same bytes wherever the store lies

    code, out, err = run_cli(["train", "--preset", "tiny", "--data", str(data_yaml), "--set", f"data.store={url}",
                              "--steps", "2", "--set", "train.eval_batches=1", "--out", str(tmp_path / "run")],
                             monkeypatch, capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "data.json").read_text())["store_hash"] == prepared["store_hash"]

    # A shard damaged in the bucket is caught by its hash when fetched, and named.
    shard = next(p for p in listed if p.endswith("train-00001.tokens.npy"))
    s3.pipe(shard, s3.cat(shard)[:-1] + b"\x00")
    s3.invalidate_cache()
    code, _, err = run_cli(["data", "show", url], monkeypatch, capsys)
    assert code == 0  # the cached copy is intact and matches the manifest: nothing is fetched again
    monkeypatch.setenv("MOELAB_STORE_CACHE", str(tmp_path / "fresh-cache"))
    code, _, err = run_cli(["data", "show", url], monkeypatch, capsys)
    assert code == 2 and "train-00001.tokens.npy is corrupted" in err, err


def test_train_publishes_its_files_to_the_bucket_as_it_goes(s3, tmp_path, monkeypatch, capsys):
    url = f"s3://{BUCKET}/runs/tiny"
    code, _, err = run_cli(["train", "--preset", "tiny", "--steps", "4", "--set", "train.log_every=1",
                            "--set", "train.eval_batches=1", "--set", "train.mixture_snapshot_every=2",
                            "--out", str(tmp_path / "run"), "--publish", url, "--publish-every", "0"],
                           monkeypatch, capsys)
    assert code == 0, err
    s3.invalidate_cache()
    for name in ("mixture_log.jsonl", "metrics.jsonl", "incidents.jsonl", "config.yaml", "summary.json"):
        assert s3.cat(f"{BUCKET}/runs/tiny/{name}") == (tmp_path / "run" / name).read_bytes(), name
    mixture = [json.loads(line) for line in s3.cat(f"{BUCKET}/runs/tiny/mixture_log.jsonl").decode().splitlines()]
    assert mixture[0]["kind"] == "change" and mixture[-1]["kind"] == "snapshot"


def test_a_publisher_publishes_on_its_cadence_and_whole_files_only(tmp_path):
    from moelab.train.publish import Publisher

    now = [0.0]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    publisher = Publisher(tmp_path, str(tmp_path / "published"), every_s=3600, clock=lambda: now[0])
    publisher.check()
    publisher.log({})
    assert publisher.uploads == 1
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    now[0] = 1800.0
    publisher.log({})
    assert publisher.uploads == 1 and (tmp_path / "published" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    now[0] = 3600.0
    publisher.log({})
    assert (tmp_path / "published" / "metrics.jsonl").read_text().count("\n") == 2
    assert not list((tmp_path / "published").glob(".*part"))  # written under a temporary name, then renamed


@pytest.mark.parametrize("problem, message", [("unreachable", "unreachable"), ("no credentials", "credentials"),
                                              ("no bucket", "does not exist")])
def test_an_unreachable_url_missing_credentials_or_bucket_exit_2_before_training(s3, tmp_path, monkeypatch, capsys,
                                                                                 problem, message):
    import s3fs

    url = f"s3://{BUCKET}/runs/x"
    if problem == "unreachable":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")
    elif problem == "no credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    else:
        url = "s3://no-such-bucket/runs/x"
    s3fs.S3FileSystem.clear_instance_cache()
    code, _, err = run_cli(["train", "--preset", "tiny", "--steps", "2", "--out", str(tmp_path / "run"),
                            "--publish", url], monkeypatch, capsys)
    assert code == 2 and message in err and url in err, err
    assert not (tmp_path / "run").exists()
    code, _, err = run_cli(["data", "show", url.replace("runs", "stores")], monkeypatch, capsys)
    assert code == 2 and message in err, err


@pytest.mark.slow
def test_lab_run_publishes_the_runs_files_the_ledger_export_and_the_report(s3, tmp_path, monkeypatch, capsys):
    """`slow` (issue 27): a `lab run` and its report, ~25 s on 2 cores; the fast suite keeps a training run
    publishing its files to the bucket as it goes (the same publisher)."""
    import yaml
    from test_executor import _tiny_spec

    from moelab.lab.ledger import open_ledger, record_hash, records

    monkeypatch.chdir(tmp_path)
    spec = _tiny_spec("tiny-pub", "Two published steps", "Does lab run publish?", steps=2)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    lab = ["--ledger", str(tmp_path / "ledger.sqlite")]
    assert run_cli(["lab", "register", "spec.yaml", *lab], monkeypatch, capsys)[0] == 0
    url = f"s3://{BUCKET}/lab/tiny-pub"
    code, _, err = run_cli(["lab", "run", "tiny-pub", "--publish", url, "--publish-every", "0", *lab],
                           monkeypatch, capsys)
    assert code == 0, err
    s3.invalidate_cache()
    run_dir = next((tmp_path / "runs" / "lab" / "tiny-pub").glob("train-*"))
    assert s3.cat(f"{BUCKET}/lab/tiny-pub/metrics.jsonl") == (run_dir / "metrics.jsonl").read_bytes()
    exported = [json.loads(line) for line in s3.cat(f"{BUCKET}/lab/tiny-pub/ledger.jsonl").decode().splitlines()]
    held = records(open_ledger(tmp_path / "ledger.sqlite"))
    assert [r["seq"] for r in exported] == [r.seq for r in held[:len(exported)]]  # as of the run's last upload
    assert exported[0]["kind"] == "experiment" and any(r["kind"] == "metric" for r in exported)
    final = [json.loads(line) for line in s3.cat(f"{BUCKET}/lab/tiny-pub/report/ledger.jsonl").decode().splitlines()]
    assert [r["hash"] for r in final] == [r.hash for r in held] and final[-1]["body"]["event"] == "finished"
    assert all(record_hash(r["prev_hash"], r["seq"], r["kind"], r["key"], r["created_at"], r["body"]) == r["hash"]
               for r in final)  # the export checks out without SQLite
    assert b"<html" in s3.cat(f"{BUCKET}/lab/tiny-pub/report/report.html")


def test_lab_site_publishes_to_a_bucket_and_then_only_the_files_that_changed(s3, tmp_path, monkeypatch, capsys):
    """Issue 30: `lab site --publish s3://...` over HTTP to the local server; a second publication copies
    nothing, and after one more ledger event only that experiment's page, the index and the timeline."""
    import yaml

    ledger = tmp_path / "lab.sqlite"
    for exp_id in ("pub-a", "pub-b"):
        spec = {"id": exp_id, "title": f"Publish {exp_id}", "question": "Does it publish?", "owner": "tests",
                "hypothesis": "It does.", "config": {"preset": "tiny"},
                "prediction": {"metric": "eval/mean", "band": [None, 9.0], "decision_rule": "Below 9."}}
        (tmp_path / f"{exp_id}.yaml").write_text(yaml.safe_dump(spec))
        assert run_cli(["lab", "register", str(tmp_path / f"{exp_id}.yaml"), "--ledger", str(ledger)],
                       monkeypatch, capsys)[0] == 0
    site, url = tmp_path / "site", f"s3://{BUCKET}/site"

    def publish():
        code, out, err = run_cli(["lab", "site", "--root", str(tmp_path / "runs"), "--out", str(site), "--ledger",
                                  str(ledger), "--publish", url, "--json"], monkeypatch, capsys)
        assert code == 0, err
        return json.loads(out)["published"]

    assert sorted(publish()) == ["exp/pub-a.html", "exp/pub-b.html", "index.html", "timeline.html"]
    s3.invalidate_cache()
    assert s3.cat(f"{BUCKET}/site/index.html") == (site / "index.html").read_bytes()
    assert json.loads(s3.cat(f"{BUCKET}/site/site.json"))["files"]["index.html"]
    assert publish() == []
    assert run_cli(["lab", "abandon", "pub-b", "--reason", "superseded by pub-a", "--ledger", str(ledger)],
                   monkeypatch, capsys)[0] == 0
    assert sorted(publish()) == ["exp/pub-b.html", "index.html", "timeline.html"]
    s3.invalidate_cache()
    assert b"superseded by pub-a" in s3.cat(f"{BUCKET}/site/exp/pub-b.html")
