"""The token store: `moelab data prepare`, its manifest and hashes, a killed prepare resumed, training from a
store with exact resume, refusal of a changed store, and bad stores named with exit code 2."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_run, run_cli

from moelab import presets
from moelab.config import DataConfig, DomainConfig, PhaseConfig, override
from moelab.data import store as store_lib
from moelab.data.mixture import build_corpus, eval_batches, sample_batch
from moelab.data.sources import iter_file_documents
from moelab.data.tokenizer import ByteTokenizer
from moelab.errors import ConfigError, DataError
from moelab.files import sha256_file

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly zebras".split()


def _text(rng: np.random.Generator, words: int) -> str:
    lines = [" ".join(rng.choice(WORDS, size=8)) for _ in range(words // 8)]
    return "\n".join(lines) + "\n"


def write_corpus(folder: Path, seed: int = 0) -> Path:
    """Two domains of generated text: `web` (two .jsonl files) and `books` (.txt files); returns a data YAML."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for part in range(2):
        with open(folder / f"web-{part}.jsonl", "w") as f:
            for _ in range(40):
                f.write(json.dumps({"text": _text(rng, 48)}) + "\n")
    (folder / "books").mkdir(exist_ok=True)
    for i in range(12):
        (folder / "books" / f"book-{i:02d}.txt").write_text(_text(rng, 160))
    (folder / "data.yaml").write_text(
        "data:\n"
        "  domains:\n"
        "    - {name: web, kind: files, paths: ['web-*.jsonl']}\n"
        "    - {name: books, kind: files, paths: [books/*.txt]}\n"
        "  phases:\n"
        "    - {name: pretrain, fraction: 0.5, weights: {web: 0.8, books: 0.2}}\n"
        "    - {name: midtrain, fraction: 0.5, weights: {web: 0.2, books: 0.8}}\n")
    return folder / "data.yaml"


def data_config(folder: Path) -> DataConfig:
    from moelab.config import read_data_yaml, from_dict

    return from_dict(read_data_yaml(folder / "data.yaml"), DataConfig)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    write_corpus(folder)
    return folder


@pytest.fixture(scope="module")
def prepared(corpus_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("stores") / "store"
    manifest = store_lib.prepare(data_config(corpus_dir), out, shard_tokens=2000)
    return out, manifest


# ----------------------------------------------------------------------------------------------
# prepare and the format


def test_the_heldout_rule_picks_evenly_spaced_whole_documents_at_the_fraction():
    held = [i for i in range(100) if store_lib.is_heldout(i, 0.1)]
    assert held == [4, 14, 24, 34, 44, 54, 64, 74, 84, 94]
    splits = [split for _, split, _ in store_lib.split_stream(["a", "b", "c"], 0.1, "d")]
    assert splits == ["train", "train", "heldout"]  # too few for the rule: the last one is held out
    chunks = list(store_lib.split_stream(["".join(f"line {i}\n" for i in range(40))], 0.1, "d"))
    assert len(chunks) == 20 and "".join(doc for _, _, doc in chunks).count("\n") == 40


def test_prepare_writes_shards_whose_streams_are_the_documents_in_order_with_eos(prepared, corpus_dir):
    out, manifest = prepared
    cfg = data_config(corpus_dir)
    store = store_lib.open_store(out)
    assert store.store_hash == manifest["store_hash"] and store.domains == ("web", "books")
    byte = ByteTokenizer()
    for domain in cfg.domains:
        docs = list(store_lib.split_stream(iter_file_documents(domain), cfg.heldout_fraction, domain.name))
        train, heldout = store.streams(domain.name)
        for split, stream in (("train", train), ("heldout", heldout)):
            expected = np.concatenate([np.append(byte.encode(d), byte.eos_id) for _, s, d in docs if s == split])
            np.testing.assert_array_equal(stream[np.arange(len(stream))], expected)
            entry = manifest["domains"][domain.name]["splits"][split]
            assert entry["num_tokens"] == len(expected)
            assert entry["num_documents"] == sum(s == split for _, s, _ in docs)
        assert len(manifest["domains"][domain.name]["splits"]["train"]["shards"]) > 1  # shard_tokens=2000
        sources = manifest["domains"][domain.name]["sources"]
        assert all(Path(s["path"]).is_file() and len(s["sha256"]) == 64 for s in sources)
    for name, entry in manifest["files"].items():
        assert sha256_file(out / name) == entry["sha256"]
    assert store_lib.prepare(cfg, out, shard_tokens=2000) == manifest  # a finished store: nothing to do


def test_a_window_across_a_shard_boundary_reads_both_shards(prepared):
    store = store_lib.open_store(prepared[0])
    train, _ = store.streams("web")
    first = np.load(prepared[0] / store.manifest["domains"]["web"]["splits"]["train"]["shards"][0]["tokens"])
    edge = len(first)
    window = train[np.arange(edge - 5, edge + 5)]
    assert window.dtype == np.int32 and list(window[:5]) == list(first[-5:])
    assert np.array_equal(train[edge - 5: edge + 5], window)


def test_a_killed_prepare_resumes_without_redoing_finished_shards(corpus_dir, prepared, tmp_path, monkeypatch):
    cfg = data_config(corpus_dir)
    monkeypatch.setattr(store_lib, "_BATCH_BYTES", 2000)
    out = tmp_path / "store"
    calls = []

    def kill_after_a_few_batches(tokens, read):
        calls.append(tokens)
        if len(calls) == 6:
            raise KeyboardInterrupt  # stands in for a kill between two batches

    with pytest.raises(KeyboardInterrupt):
        store_lib.prepare(cfg, out, shard_tokens=2000, on_progress=kill_after_a_few_batches)
    finished = sorted((out / "web").glob("*.json"))
    assert finished and not (out / "manifest.json").exists()
    # A kill inside a write leaves a .tmp array and an array without its record: neither is a shard.
    (out / "web" / "train-00099.tokens.npy.tmp").write_bytes(b"half")
    next_index = len(list((out / "web").glob("train-*.json")))
    (out / "web" / f"train-{next_index:05d}.tokens.npy").write_bytes(b"half-written")
    with pytest.raises(DataError, match="did not finish; rerun the same command"):
        store_lib.open_store(out)
    stamps = {p: p.stat().st_mtime_ns for p in finished}

    manifest = store_lib.prepare(cfg, out, shard_tokens=2000)

    assert {p: p.stat().st_mtime_ns for p in finished} == stamps  # finished shards were not rewritten
    assert manifest["store_hash"] == prepared[1]["store_hash"]  # the same store as an uninterrupted prepare
    assert not list(out.rglob("*.tmp"))


def test_prepare_refuses_a_folder_prepared_from_other_sources(corpus_dir, prepared, tmp_path):
    out = tmp_path / "store"
    shutil.copytree(prepared[0], out)
    with pytest.raises(DataError, match="prepared from other sources or settings"):
        store_lib.prepare(data_config(corpus_dir), out, shard_tokens=4000)


def test_a_bpe_tokenizer_is_trained_once_saved_in_the_store_and_used_from_it(corpus_dir, tmp_path):
    cfg = DataConfig(domains=data_config(corpus_dir).domains, tokenizer="bpe", bpe_vocab_size=300)
    manifest = store_lib.prepare(cfg, tmp_path / "store")
    assert manifest["tokenizer"]["kind"] == "hf" and "tokenizer.json" in manifest["files"]
    corpus = build_corpus(DataConfig(domains=cfg.domains, tokenizer="bpe", store=str(tmp_path / "store")))
    assert corpus.tokenizer.vocab_size == manifest["tokenizer"]["vocab_size"] <= 300
    text = corpus.tokenizer.decode(corpus.heldout["web"][:200])
    assert text and all(word in WORDS for word in text.split()[1:-1])


# ----------------------------------------------------------------------------------------------
# training from a store


def _store_run(corpus_dir: Path, store: Path, steps: int = 6):
    from moelab.cli.common import resolve_config

    # The shapes of helpers.train_args, so the session's compilation cache already holds the steps.
    return resolve_config(None, "tiny", ["data.store=" + str(store), "train.log_every=2", "train.eval_every=12",
                                         "train.eval_batches=1"],
                          corpus_dir / "data.yaml", **{"train.steps": steps, "checkpoint.every": 3})


def test_a_store_corpus_samples_as_an_in_memory_one_would(prepared, corpus_dir):
    cfg = _store_run(corpus_dir, prepared[0]).data
    corpus = build_corpus(cfg)
    assert corpus.provenance["store_hash"] == prepared[1]["store_hash"]
    batch = sample_batch(corpus, {"web": 0.5, "books": 0.5}, seed=3, step=7, batch_size=8, seq_len=32)
    in_memory = type(corpus)(corpus.domains, {d: np.asarray(s) for d, s in corpus.train.items()},
                             {d: np.asarray(s) for d, s in corpus.heldout.items()}, corpus.tokenizer)
    same = sample_batch(in_memory, {"web": 0.5, "books": 0.5}, seed=3, step=7, batch_size=8, seq_len=32)
    np.testing.assert_array_equal(batch.tokens, same.tokens)
    for a, b in zip(eval_batches(corpus, "books", 2, 4, 32), eval_batches(in_memory, "books", 2, 4, 32)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_training_from_a_store_resumes_exactly_and_refuses_another_store(prepared, corpus_dir, tmp_path):
    """`slow` (issue 27): three trainings of their own shape, ~35 s on 2 cores. The fast suite keeps a store
    sampling as the in-memory corpus would, its hash in the step version, and test_checkpoint's resumes."""
    from moelab.train.loop import Hooks, train

    cfg = _store_run(corpus_dir, prepared[0])
    train(cfg, tmp_path / "straight")
    data = json.loads((tmp_path / "straight" / "data.json").read_text())
    assert data["store_hash"] == prepared[1]["store_hash"]
    assert data["stores"][0]["domains"]["web"]["tokens"]["train"] == prepared[1]["domains"]["web"]["splits"]["train"]["num_tokens"]

    class Killed(Exception):
        pass

    def kill_at_3(done):
        if done == 3:
            raise Killed

    with pytest.raises(Killed):
        train(cfg, tmp_path / "resumed", Hooks(on_step=kill_at_3))
    other = tmp_path / "other"
    write_corpus(other, seed=1)
    store_lib.prepare(data_config(other), tmp_path / "other-store")
    changed = override(cfg, {"data.store": str(tmp_path / "other-store")})
    with pytest.raises(ConfigError, match="cannot resume the checkpoint at step 3") as error:
        train(changed, tmp_path / "resumed")
    assert prepared[1]["store_hash"] in str(error.value)
    assert store_lib.open_store(tmp_path / "other-store").store_hash in str(error.value)
    moved = tmp_path / "moved-store"  # the same content elsewhere is the same data
    shutil.copytree(prepared[0], moved)
    summary = train(override(cfg, {"data.store": str(moved)}), tmp_path / "resumed")
    assert summary["resumed_from"] == 3
    assert_same_run(tmp_path / "straight", tmp_path / "resumed", 6)


# ----------------------------------------------------------------------------------------------
# bad input


def _damaged_store(prepared, tmp_path, damage) -> Path:
    out = tmp_path / "store"
    shutil.copytree(prepared[0], out)
    shard = out / prepared[1]["domains"]["books"]["splits"]["train"]["shards"][1]["tokens"]
    damage(out, shard)
    return out


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES = {
    "truncated shard": (lambda out, shard: shard.write_bytes(shard.read_bytes()[:-10]), "is truncated or damaged"),
    "corrupted shard": (lambda out, shard: _flip(shard), "is corrupted (SHA-256"),
    "missing shard": (lambda out, shard: shard.unlink(), "listed in manifest.json but missing"),
    "unlisted shard": (lambda out, shard: shutil.copyfile(shard, shard.with_name("train-00042.tokens.npy")),
                       "does not match its shards"),
    "no manifest": (lambda out, shard: (out / "manifest.json").unlink(), "did not finish"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_store_is_named_with_exit_2_and_nothing_trained(prepared, corpus_dir, tmp_path, monkeypatch, capsys,
                                                                  damage):
    change, message = DAMAGES[damage]
    out = _damaged_store(prepared, tmp_path, change)
    code, _, err = run_cli(["train", "--preset", "tiny", "--data", str(corpus_dir / "data.yaml"), "--set",
                            f"data.store={out}", "--steps", "2", "--out", str(tmp_path / "run")],
                           monkeypatch, capsys)
    assert code == 2 and message in err, err
    assert "books/train-000" in err or damage == "no manifest"
    assert not (tmp_path / "run").exists()


def test_a_corrupted_shard_is_caught_even_after_the_store_was_verified_once(prepared, tmp_path):
    out = tmp_path / "store"
    shutil.copytree(prepared[0], out)
    store_lib.open_store(out)  # verified: the next open only stats the files
    shard = out / prepared[1]["domains"]["web"]["splits"]["heldout"]["shards"][0]["tokens"]
    _flip(shard)
    with pytest.raises(DataError, match="web/heldout-00000.tokens.npy is corrupted"):
        store_lib.open_store(out)


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(corpus_dir, tmp_path, monkeypatch, capsys):
    cfg = DataConfig(domains=data_config(corpus_dir).domains, tokenizer="bpe", bpe_vocab_size=600)
    store_lib.prepare(cfg, tmp_path / "store")
    code, _, err = run_cli(["train", "--preset", "tiny", "--data", str(corpus_dir / "data.yaml"), "--set",
                            f"data.store={tmp_path / 'store'}", "--set", "data.tokenizer=bpe", "--set",
                            "model.vocab_size=300", "--out", str(tmp_path / "run")], monkeypatch, capsys)
    assert code == 2 and "model.vocab_size=300 is smaller than the tokenizer's vocabulary" in err


def test_an_empty_domain_after_filtering_and_a_missing_domain_are_named(corpus_dir, prepared, tmp_path):
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": "   "}) + "\n" + json.dumps({"text": "\n"}) + "\n")
    cfg = DataConfig(domains=(DomainConfig("blank", "files", (str(tmp_path / "blank.jsonl"),)),))
    with pytest.raises(DataError, match=r"data.domains\[blank\].*blank.jsonl is empty"):
        store_lib.prepare(cfg, tmp_path / "store")
    missing = DataConfig(domains=(DomainConfig("poetry", "store"),), store=str(prepared[0]),
                         phases=(PhaseConfig("all", 1.0, {"poetry": 1.0}),))
    with pytest.raises(DataError, match="has no domain poetry .*holds web, books"):
        build_corpus(missing)


def test_prepare_on_the_command_line_shows_the_store_and_a_wrong_tokenizer_kind_is_refused(corpus_dir, tmp_path,
                                                                                          monkeypatch, capsys):
    code, out, err = run_cli(["data", "prepare", "--preset", "tiny", "--data", str(corpus_dir / "data.yaml"), "--out",
                              str(tmp_path / "store"), "--json"], monkeypatch, capsys)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["tokens"]["web"]["train"] > 0 and "tokens/s" in err
    code, out, _ = run_cli(["data", "show", str(tmp_path / "store"), "--json"], monkeypatch, capsys)
    assert code == 0 and json.loads(out)["store_hash"] == shown["store_hash"]
    with pytest.raises(DataError, match="data.tokenizer='bpe', but the token store .* byte tokenizer"):
        build_corpus(DataConfig(domains=data_config(corpus_dir).domains, tokenizer="bpe", store=str(tmp_path / "store")))


def test_the_store_content_hash_is_part_of_a_training_steps_version(prepared, corpus_dir, tmp_path):
    from moelab.lab.dag import step_versions
    from moelab.lab.experiment import training_step

    out = tmp_path / "store"
    shutil.copytree(prepared[0], out)
    cfg = _store_run(corpus_dir, out)
    before = step_versions([training_step("train", cfg)])["train"]
    assert step_versions([training_step("train", cfg)])["train"] == before
    shutil.rmtree(out)  # the same path, prepared again from other text: other tokens, another version
    other = tmp_path / "other"
    write_corpus(other, seed=2)
    store_lib.prepare(data_config(other), out)
    assert step_versions([training_step("train", cfg)])["train"] != before
    assert "store_hashes" not in training_step("train", presets.get("tiny")).config  # in memory: versions as before


def test_the_benchmark_compares_the_libraries_on_the_same_windows(prepared, tmp_path):
    from helpers import load_benchmark

    bench = load_benchmark("data_store")
    result = bench.bench_libraries(prepared[0], tmp_path, num_tokens=20_000)  # each reader checked against numpy
    assert set(result) >= {"moelab_tokenstream_pread_npy", "numpy_memmap_npy", "tensorstore_zarr", "arrow_ipc_mmap"}
    assert all(r["random_batches_per_s"] > 0 and r["scan_tokens_per_s"] > 0 for r in result.values() if isinstance(r, dict))


def test_a_flipped_byte_with_its_mtime_put_back_is_caught_by_the_ctime_and_by_verify(prepared, tmp_path, monkeypatch,
                                                                                     capsys):
    """Issue 31: the cache once keyed on size and mtime only, so a byte flipped and its mtime restored passed."""
    import os

    out = tmp_path / "store"
    shutil.copytree(prepared[0], out)
    store_lib.open_store(out)  # verified once: the cache now holds each shard's stat
    shard = out / prepared[1]["domains"]["web"]["splits"]["train"]["shards"][0]["tokens"]
    stat = shard.stat()
    _flip(shard)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the mtime put back; the ctime moves regardless
    with pytest.raises(DataError, match="is corrupted"):
        store_lib.open_store(out)
    code, _, err = run_cli(["data", "show", str(out), "--verify"], monkeypatch, capsys)
    assert code == 2 and "is corrupted" in err and "nothing was trained" not in err
    # --verify re-hashes even when the cache matches: make the cache claim the damaged file is the verified one
    cache = json.loads((out / store_lib.VERIFIED).read_text()) if (out / store_lib.VERIFIED).exists() else {}
    entry = prepared[1]["files"][str(shard.relative_to(out))]
    now = shard.stat()
    cache[str(shard.relative_to(out))] = [now.st_size, now.st_mtime_ns, now.st_ino, now.st_ctime_ns, entry["sha256"]]
    (out / store_lib.VERIFIED).write_text(json.dumps(cache))
    store_lib.open_store(out)  # the cache is trusted without --verify (one stat per file)...
    with pytest.raises(DataError, match="is corrupted"):
        store_lib.open_store(out, rehash=True)  # ...and re-hashing finds the damage
    monkeypatch.setenv(store_lib.REHASH_ENV, "1")  # what `moelab train --verify-data` sets
    with pytest.raises(DataError, match="is corrupted"):
        store_lib.open_store(out)


def test_every_mutation_of_a_store_is_refused_by_name_never_a_traceback(prepared, tmp_path_factory):
    """Fuzzed (issue 29): the manifest and the shards truncated, junk-appended, keys dropped or retyped, bytes
    flipped, lines swapped, files deleted or replaced by a directory or a symlink out of the store."""
    from hypothesis import HealthCheck, given, settings

    from mutations import fresh_copy, mutations

    root, manifest = prepared
    shards = [s["tokens"] for d in manifest["domains"].values() for sp in d["splits"].values() for s in sp["shards"]]
    tmp = tmp_path_factory.mktemp("store-fuzz")

    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(mutation=mutations(["manifest.json", *shards[:2]]))
    def run(mutation):
        copy = fresh_copy(root, tmp / "store")
        (copy / store_lib.VERIFIED).unlink(missing_ok=True)
        changed = mutation.apply(copy)
        try:
            store_lib.open_store(copy)
        except DataError as e:
            assert "manifest.json" in str(e) or mutation.file in str(e), e
            return
        assert not changed, mutation  # every byte of the store is under the manifest, and the manifest under its hash

    run()
