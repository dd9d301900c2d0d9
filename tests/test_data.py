"""Data: embedded and user sources, tokenizers, held-out splits, phases and the (seed, step) sampler."""

from __future__ import annotations

import ast
import json
import math
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from moelab.config import DataConfig, DomainConfig, PhaseConfig
from moelab.errors import ConfigError, DataError
from moelab.data.mixture import (
    Batch,
    Corpus,
    build_corpus,
    eval_batches,
    phase_at,
    phase_boundaries,
    realized_tokens,
    sample_batch,
    split_documents,
    unigram_entropy,
)
from moelab.data.sources import _module_docstring, load_documents, stdlib_python_files
from moelab.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

SMALL_BYTES = 200_000  # enough documents in every embedded domain, small enough to keep each test fast
UNICODE_TEXT = "héllo wörld — 日本語 🙂\n\tdef f(x):\n  return x ** 2  # ünïcode\n"


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return build_corpus(DataConfig(max_bytes_per_domain=SMALL_BYTES))


def _utf8_size(documents: list[str]) -> int:
    return sum(len(doc.encode("utf-8")) for doc in documents)


# ----------------------------------------------------------------------------------------------
# embedded sources


@pytest.mark.parametrize("name", ["code", "prose", "arithmetic"])
def test_embedded_domain_loads_the_same_documents_twice_within_its_byte_budget(name):
    first = load_documents(DomainConfig(name), SMALL_BYTES)
    assert len(first) >= 2 and all(doc.strip() for doc in first)
    assert first == load_documents(DomainConfig(name), SMALL_BYTES)
    assert 0.9 * SMALL_BYTES <= _utf8_size(first) <= SMALL_BYTES  # the cap is filled, never exceeded


def test_code_documents_are_the_stdlib_source_files_in_sorted_order():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_python_files()
    relative = [path.relative_to(stdlib) for path in files]
    assert relative == sorted(relative, key=lambda p: p.parts)
    assert not any({"site-packages", "test", "tests"} & set(p.parts) for p in relative)

    documents = load_documents(DomainConfig("code"), SMALL_BYTES)
    texts = [path.read_text(encoding="utf-8") for path in files[: len(documents)]]
    assert documents[:-1] == texts[:-1]
    assert texts[-1].startswith(documents[-1])  # the last one is cut to fit the budget


def test_prose_documents_start_with_pydoc_topics_and_include_module_docstrings():
    from pydoc_data.topics import topics

    documents = load_documents(DomainConfig("prose"), 10_000_000)
    first_topic = sorted(topics)[0]
    assert documents[0] == topics[first_topic]
    json_doc = ast.get_docstring(ast.parse((Path(sysconfig.get_paths()["stdlib"]) / "json/__init__.py").read_text()))
    assert json_doc + "\n" in documents


def test_module_docstring_from_the_first_lines_matches_ast_on_the_whole_stdlib():
    """The fast path parses only the lines up to the docstring; `ast` on the full source is the oracle."""
    for path in stdlib_python_files():
        source = path.read_bytes()
        assert _module_docstring(source) == ast.get_docstring(ast.parse(source)), path


@pytest.mark.parametrize("digits", [None, 3])
def test_arithmetic_documents_hold_32_correct_problems_each(digits):
    """Right answers at either difficulty; `data.arithmetic_digits` N draws each operand's digit count from 1..N,
    so one-digit operands are about a third of them at N = 3 (1% when operands are uniform below 1000)."""
    documents = load_documents(DomainConfig("arithmetic"), SMALL_BYTES, seed=3, digits=digits)
    line = re.compile(r"^(\d+) ([-+*]) (\d+) = (-?\d+)$")
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    seen_ops, operands = set(), []
    for doc in documents[:-1]:  # the last one may be cut short by the budget
        lines = doc.splitlines()
        assert len(lines) == 32
        for text in lines:
            a, op, b, answer = line.match(text).groups()
            assert ops[op](int(a), int(b)) == int(answer), text
            seen_ops.add(op)
            operands.append(int(a))
    assert seen_ops == {"+", "-", "*"}
    assert max(operands) < 1000
    one_digit = np.mean(np.array(operands) < 10)
    assert (0.25 < one_digit < 0.42) if digits == 3 else one_digit < 0.03


def test_arithmetic_digits_must_be_a_digit_count():
    for bad in (0, 7, 2.5, True, "3"):
        with pytest.raises(ConfigError, match="data.arithmetic_digits"):
            DataConfig(arithmetic_digits=bad)


def test_arithmetic_documents_depend_on_the_seed_and_stop_at_one_megabyte():
    assert load_documents(DomainConfig("arithmetic"), 10_000, seed=0) != load_documents(
        DomainConfig("arithmetic"), 10_000, seed=1
    )
    total = _utf8_size(load_documents(DomainConfig("arithmetic"), 4_000_000))
    assert 990_000 <= total <= 1_000_000


def test_train_seed_leaves_the_corpus_alone_and_data_seed_changes_only_the_arithmetic(corpus):
    """Seeds compared on one held-out set must see the same set (architecture §4): `train.seed` is init and data
    order; the generated content is `data.seed`'s. Checked through the loop's own `prepare_corpus`."""
    from moelab import presets
    from moelab.config import override
    from moelab.train.loop import prepare_corpus

    def corpus_of(**sets) -> Corpus:
        return prepare_corpus(override(presets.get("tiny"), {"data.max_bytes_per_domain": SMALL_BYTES, **sets}))

    for other_train_seed in (corpus_of(**{"train.seed": 1}), corpus_of(**{"train.seed": 7})):
        for domain in corpus.domains:
            assert np.array_equal(other_train_seed.heldout[domain], corpus.heldout[domain]), domain
            assert np.array_equal(other_train_seed.train[domain], corpus.train[domain]), domain
    other_data_seed = corpus_of(**{"data.seed": 1})
    assert not np.array_equal(other_data_seed.heldout["arithmetic"], corpus.heldout["arithmetic"])
    for domain in ("code", "prose"):
        assert np.array_equal(other_data_seed.heldout[domain], corpus.heldout[domain]), domain


# ----------------------------------------------------------------------------------------------
# user files


def _write_parquet(path: Path, **columns) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


def test_user_txt_jsonl_and_parquet_files_load_one_document_per_file_line_and_row(tmp_path):
    (tmp_path / "a.txt").write_text("first file\n")
    (tmp_path / "b.txt").write_text("second file\n")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "line one"}) + "\n\n" + json.dumps({"text": "ü two"}) + "\n")
    _write_parquet(tmp_path / "d.parquet", text=["row one", "row two"], id=[1, 2])
    paths = tuple(str(tmp_path / name) for name in ("a.txt", "b.txt", "c.jsonl", "d.parquet"))

    documents = load_documents(DomainConfig("mine", kind="files", paths=paths), max_bytes=1)

    assert documents == ["first file\n", "second file\n", "line one", "ü two", "row one", "row two"]


def test_a_single_user_document_is_split_at_line_boundaries_so_a_heldout_split_exists(tmp_path):
    text = "".join(f"line {i}\n" for i in range(100))
    (tmp_path / "one.txt").write_text(text)

    documents = load_documents(DomainConfig("mine", kind="files", paths=(str(tmp_path / "one.txt"),)), 10)

    assert len(documents) >= 2
    assert "".join(documents) == text
    assert all(doc.endswith("\n") for doc in documents)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.txt", None, "does not exist"),
        ("empty.txt", "", "is empty"),
        ("blank.jsonl", "\n\n", "is empty"),
        ("bad.jsonl", '{"text": "ok"}\n{"text": oops}\n', "line 2 is not valid JSON"),
        ("no_text.jsonl", '{"text": "ok"}\n{"body": "x"}\n', 'line 2 has no "text" string'),
        ("number.jsonl", '{"text": 3}\n', 'line 1 has no "text" string'),
        ("notes.md", "# hi\n", "unknown type"),
        ("no_text.parquet", "parquet-without-text", "no 'text' column"),
        ("broken.parquet", "not parquet at all", "not a readable Parquet file"),
        ("one_line.txt", "just one line", "single line"),
    ],
)
def test_bad_user_file_raises_data_error_naming_the_file(tmp_path, name, content, message):
    path = tmp_path / name
    if content == "parquet-without-text":
        _write_parquet(path, body=["x", "y"])
    elif content is not None:
        path.write_text(content)

    with pytest.raises(DataError, match=re.escape(message)) as error:
        load_documents(DomainConfig("mine", kind="files", paths=(str(path),)), 1000)

    assert str(path) in str(error.value)
    assert "data.domains[mine]" in str(error.value)


def test_a_directory_given_as_a_data_path_is_named_as_a_directory_with_the_files_to_list_instead(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("one\ntwo\n")
    (folder / "notes.md").write_text("# not data\n")
    with pytest.raises(DataError, match=r"corpus is a directory, not a file; list the .* files inside it") as error:
        load_documents(DomainConfig("mine", kind="files", paths=(str(folder),)), 1000)
    assert str(folder / "a.txt") in str(error.value) and "notes.md" not in str(error.value)
    assert "does not exist" not in str(error.value)


# ----------------------------------------------------------------------------------------------
# tokenizers


def test_byte_tokenizer_round_trips_unicode_and_drops_eos():
    tok = ByteTokenizer()
    ids = tok.encode(UNICODE_TEXT)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert len(ids) == len(UNICODE_TEXT.encode("utf-8"))
    assert tok.decode(ids) == UNICODE_TEXT
    assert tok.decode(np.concatenate([ids, [tok.eos_id]])) == UNICODE_TEXT
    assert (tok.vocab_size, tok.eos_id) == (257, 256)


def test_bpe_trains_round_trips_text_and_loads_back_from_its_tokenizer_json(tmp_path):
    documents = load_documents(DomainConfig("prose"), 100_000)
    tok = HFTokenizer.train_bpe(documents, vocab_size=400)
    ids = tok.encode(UNICODE_TEXT + documents[0])

    assert tok.vocab_size == 400
    assert ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < tok.vocab_size
    assert len(ids) < len((UNICODE_TEXT + documents[0]).encode("utf-8"))  # merges were learned
    assert tok.decode(ids) == UNICODE_TEXT + documents[0]
    assert tok.decode(np.concatenate([ids, [tok.eos_id]])) == UNICODE_TEXT + documents[0]

    tok.save(tmp_path / "tokenizer.json")
    loaded = HFTokenizer.load(tmp_path / "tokenizer.json")
    assert (loaded.vocab_size, loaded.eos_id) == (tok.vocab_size, tok.eos_id)
    np.testing.assert_array_equal(loaded.encode(UNICODE_TEXT), tok.encode(UNICODE_TEXT))


@pytest.mark.parametrize("content, message", [(None, "does not exist"), ("{not json", "not a valid tokenizer.json")])
def test_loading_a_missing_or_invalid_tokenizer_json_raises_data_error_naming_it(tmp_path, content, message):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=message) as error:
        HFTokenizer.load(path)
    assert str(path) in str(error.value)


def test_build_tokenizer_picks_byte_bpe_or_a_saved_json(tmp_path):
    documents = {"prose": load_documents(DomainConfig("prose"), 50_000)}
    assert isinstance(build_tokenizer(DataConfig(), documents), ByteTokenizer)

    bpe = build_tokenizer(DataConfig(tokenizer="bpe", bpe_vocab_size=300), documents)
    assert isinstance(bpe, HFTokenizer) and bpe.vocab_size == 300

    bpe.save(tmp_path / "tok.json")
    loaded = build_tokenizer(DataConfig(tokenizer=str(tmp_path / "tok.json")), {})
    np.testing.assert_array_equal(loaded.encode("print(1)"), bpe.encode("print(1)"))


# ----------------------------------------------------------------------------------------------
# corpus and held-out split


def test_heldout_documents_never_appear_among_train_documents():
    documents = load_documents(DomainConfig("code"), SMALL_BYTES)
    train, heldout = split_documents(documents, heldout_fraction=0.1)
    assert len(heldout) == round(0.1 * len(documents))
    assert not set(heldout) & set(train)
    assert sorted(train + heldout) == sorted(documents)


@pytest.mark.parametrize("num_documents, expected", [(2, 1), (3, 1), (10, 1), (40, 4)])
def test_split_holds_out_at_least_one_and_leaves_at_least_one_document(num_documents, expected):
    documents = [f"doc {i}" for i in range(num_documents)]
    train, heldout = split_documents(documents, heldout_fraction=0.1)
    assert len(heldout) == expected and len(train) == num_documents - expected


def test_corpus_streams_are_documents_followed_by_eos_with_heldout_documents_kept_out(corpus):
    tok = corpus.tokenizer
    for domain in DataConfig().domains:
        _, heldout = split_documents(load_documents(domain, SMALL_BYTES), 0.1)
        expected = np.concatenate([np.append(tok.encode(doc), tok.eos_id) for doc in heldout])
        np.testing.assert_array_equal(corpus.heldout[domain.name], expected)
        assert corpus.train[domain.name].dtype == np.int32 and corpus.train[domain.name][-1] == tok.eos_id
    assert corpus.domains == ("code", "prose", "arithmetic")


def test_build_corpus_with_bpe_keeps_every_token_below_the_vocab_size():
    corpus = build_corpus(DataConfig(tokenizer="bpe", bpe_vocab_size=300, max_bytes_per_domain=30_000))
    assert corpus.tokenizer.vocab_size == 300
    for name in corpus.domains:
        assert corpus.heldout[name].size > 0
        assert corpus.train[name].max() < 300 and corpus.heldout[name].max() < 300


# ----------------------------------------------------------------------------------------------
# phases


@pytest.mark.parametrize("total_steps", [10, 100, 1000, 2500])
def test_phase_switches_from_pretrain_to_midtrain_exactly_at_80_percent_of_the_steps(total_steps):
    cfg = DataConfig()
    edge = total_steps * 8 // 10
    assert phase_boundaries(cfg, total_steps) == [0, edge]
    assert phase_at(cfg, 0, total_steps) == (0, cfg.phases[0])
    assert phase_at(cfg, edge - 1, total_steps) == (0, cfg.phases[0])
    assert phase_at(cfg, edge, total_steps) == (1, cfg.phases[1])
    assert phase_at(cfg, total_steps - 1, total_steps)[1].name == "midtrain"


def test_phase_at_rejects_steps_outside_the_run():
    with pytest.raises(ValueError, match="step=10"):
        phase_at(DataConfig(), 10, 10)


def test_a_phase_that_rounds_to_zero_steps_is_skipped():
    phases = (
        PhaseConfig("a", 0.5, {"code": 1.0}),
        PhaseConfig("blink", 0.01, {"prose": 1.0}),
        PhaseConfig("c", 0.49, {"arithmetic": 1.0}),
    )
    cfg = DataConfig(phases=phases)
    assert phase_boundaries(cfg, 10) == [0, 5, 5]
    assert phase_at(cfg, 5, 10)[1].name == "c"


# ----------------------------------------------------------------------------------------------
# sampling


PRETRAIN = {"code": 0.45, "prose": 0.45, "arithmetic": 0.10}


def test_sample_batch_depends_only_on_seed_and_step(corpus):
    batch = sample_batch(corpus, PRETRAIN, seed=7, step=3, batch_size=16, seq_len=32)
    again = sample_batch(corpus, PRETRAIN, seed=7, step=3, batch_size=16, seq_len=32)
    np.testing.assert_array_equal(batch.tokens, again.tokens)
    np.testing.assert_array_equal(batch.domain, again.domain)
    assert not np.array_equal(batch.tokens, sample_batch(corpus, PRETRAIN, 7, 4, 16, 32).tokens)
    assert not np.array_equal(batch.tokens, sample_batch(corpus, PRETRAIN, 8, 3, 16, 32).tokens)


@pytest.mark.parametrize(
    "weights, batch_size, expected_rows",
    [
        # quotas 7.2, 7.2, 1.6: floors 7, 7, 1 and the one leftover row goes to the largest remainder (.6)
        (PRETRAIN, 16, [7, 7, 2]),
        # quotas 4, 4, 8: exact
        ({"code": 0.25, "prose": 0.25, "arithmetic": 0.5}, 16, [4, 4, 8]),
        # quotas 3.33 each: the leftover row goes to the first of the tied domains
        ({"code": 1.0, "prose": 1.0, "arithmetic": 1.0}, 10, [4, 3, 3]),
        # unnormalized weights, and a weight-0 domain that gets nothing
        ({"code": 3.0, "prose": 0.0, "arithmetic": 1.0}, 6, [5, 0, 1]),
    ],
)
def test_rows_per_domain_follow_the_largest_remainder_allocation(corpus, weights, batch_size, expected_rows):
    for step in range(3):
        batch = sample_batch(corpus, weights, seed=0, step=step, batch_size=batch_size, seq_len=16)
        assert np.bincount(batch.domain, minlength=3).tolist() == expected_rows


def test_a_weight_zero_domain_gets_no_rows_at_any_step(corpus):
    weights = {"code": 1.0, "prose": 0.0, "arithmetic": 1.0}
    for step in range(20):
        batch = sample_batch(corpus, weights, seed=0, step=step, batch_size=5, seq_len=16)
        assert 1 not in batch.domain


def test_every_sampled_row_is_a_window_of_its_own_domains_train_stream(corpus):
    batch = sample_batch(corpus, PRETRAIN, seed=1, step=0, batch_size=16, seq_len=24)
    assert batch.tokens.shape == (16, 25) and batch.tokens.dtype == np.int32 and batch.domain.dtype == np.int32
    assert batch.tokens.min() >= 0 and batch.tokens.max() < corpus.tokenizer.vocab_size
    for row, domain in zip(batch.tokens, batch.domain):
        stream = corpus.train[corpus.domains[domain]]
        windows = np.lib.stride_tricks.sliding_window_view(stream, len(row))
        assert (windows == row).all(axis=1).any()


def test_sampling_from_a_domain_shorter_than_one_row_raises_data_error_naming_it():
    tiny = Corpus(
        domains=("big", "tiny"),
        train={"big": np.zeros(100, np.int32), "tiny": np.zeros(5, np.int32)},
        heldout={"big": np.zeros(10, np.int32), "tiny": np.zeros(5, np.int32)},
        tokenizer=ByteTokenizer(),
    )
    with pytest.raises(DataError, match="domain tiny has 5 train tokens"):
        sample_batch(tiny, {"big": 1.0, "tiny": 1.0}, seed=0, step=0, batch_size=4, seq_len=8)
    assert sample_batch(tiny, {"big": 1.0, "tiny": 0.0}, seed=0, step=0, batch_size=4, seq_len=8).tokens.shape == (4, 9)


def test_realized_tokens_counts_seq_len_tokens_per_row_for_every_domain():
    batch = Batch(tokens=np.zeros((5, 9), np.int32), domain=np.array([0, 2, 0, 0, 2], np.int32))
    assert realized_tokens(batch, ("code", "prose", "arithmetic")) == {"code": 24, "prose": 0, "arithmetic": 16}


# ----------------------------------------------------------------------------------------------
# evaluation


def test_eval_batches_are_fixed_disjoint_heldout_windows(corpus):
    batches = eval_batches(corpus, "prose", num_batches=3, batch_size=4, seq_len=32)
    assert len(batches) == 3 and all(b.shape == (4, 33) and b.dtype == np.int32 for b in batches)
    for b, again in zip(batches, eval_batches(corpus, "prose", 3, 4, 32)):
        np.testing.assert_array_equal(b, again)
    rows = np.concatenate(batches)
    np.testing.assert_array_equal(rows[0], corpus.heldout["prose"][:33])
    assert len({row.tobytes() for row in rows}) == len(rows)


def test_eval_batches_wrap_around_a_short_heldout_stream_and_fail_below_one_row():
    stream = np.arange(10, dtype=np.int32)
    tiny = Corpus(domains=("d",), train={"d": stream}, heldout={"d": stream}, tokenizer=ByteTokenizer())

    batches = eval_batches(tiny, "d", num_batches=2, batch_size=3, seq_len=3)

    rows = np.concatenate(batches)
    assert rows.shape == (6, 4)
    np.testing.assert_array_equal(rows[2], [8, 9, 0, 1])  # read as a ring
    with pytest.raises(DataError, match="domain d has 10 held-out tokens"):
        eval_batches(tiny, "d", num_batches=1, batch_size=1, seq_len=10)


def test_unigram_entropy_of_a_known_stream_matches_the_hand_computed_value():
    # tokens 0, 0, 1, 2: p = 1/2, 1/4, 1/4, so H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2
    corpus = Corpus(
        domains=("a", "b"),
        train={"a": np.zeros(1, np.int32), "b": np.zeros(1, np.int32)},
        heldout={"a": np.array([0, 0], np.int32), "b": np.array([1, 2], np.int32)},
        tokenizer=ByteTokenizer(),
    )
    assert unigram_entropy(corpus) == pytest.approx(1.5 * math.log(2), rel=1e-12)
    assert unigram_entropy(corpus, "a") == 0.0
    assert unigram_entropy(corpus, "b") == pytest.approx(math.log(2), rel=1e-12)


def test_unigram_entropy_of_the_embedded_corpus_is_below_uniform_over_bytes(corpus):
    for name in corpus.domains:
        assert 0 < unigram_entropy(corpus, name) < math.log(256)


# ----------------------------------------------------------------------------------------------
# dependencies


def test_the_data_package_imports_neither_jax_nor_tokenizers_for_the_byte_path():
    code = (
        "import sys\n"
        "from moelab.config import DataConfig\n"
        "from moelab.data.mixture import build_corpus\n"
        "build_corpus(DataConfig(max_bytes_per_domain=20_000))\n"
        "print(sorted(m for m in ('jax', 'tokenizers', 'pyarrow') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------------------
# sources: compressed files, globs, Hugging Face dataset folders (the token store reads the same streams)


def test_compressed_txt_and_jsonl_globs_and_a_saved_hf_dataset_load_like_plain_files(tmp_path):
    import gzip

    import datasets
    import zstandard

    (tmp_path / "a.txt.gz").write_bytes(gzip.compress("gz text\nline two\n".encode()))
    lines = "".join(json.dumps({"text": f"zst doc {i}"}) + "\n" for i in range(3))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    for name in ("c-1.jsonl", "c-2.jsonl"):
        (tmp_path / name).write_text(json.dumps({"text": name}) + "\n")
    datasets.Dataset.from_dict({"text": ["hf one", "hf two"], "id": [1, 2]}).save_to_disk(str(tmp_path / "hf"))
    paths = (str(tmp_path / "a.txt.gz"), str(tmp_path / "b.jsonl.zst"), str(tmp_path / "c-*.jsonl"),
             str(tmp_path / "hf"))

    documents = load_documents(DomainConfig("mine", kind="files", paths=paths), max_bytes=1)

    assert documents == ["gz text\nline two\n", "zst doc 0", "zst doc 1", "zst doc 2", "c-1.jsonl", "c-2.jsonl",
                         "hf one", "hf two"]


@pytest.mark.parametrize("name, content, message", [
    ("none-*.jsonl", None, "matches no file"),
    ("broken.jsonl.gz", b"\x1f\x8b\x08\x00 not really gzip", "could not be decompressed"),
    ("broken.txt.zst", b"\x28\xb5\x2f\xfd garbage", "could not be decompressed"),
    ("notes.csv.gz", b"", "unknown type"),
])
def test_bad_compressed_files_and_empty_globs_are_named(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=re.escape(message)) as error:
        load_documents(DomainConfig("mine", kind="files", paths=(str(tmp_path / name),)), 1000)
    assert name in str(error.value) and "data.domains[mine]" in str(error.value)


def test_a_hf_dataset_without_a_text_column_is_named(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"body": ["x", "y"]}).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(DataError, match="has no 'text' column .*body"):
        load_documents(DomainConfig("mine", kind="files", paths=(str(tmp_path / "hf"),)), 1000)
