"""Data domains as lists of documents: the embedded ones (stdlib code, pydoc prose, arithmetic) and user files.

Every Python install carries enough text to train a small language model (architecture §3b), so `make demo` and
the tests need no download:

- `code`: the standard library's `.py` files, one file per document, in sorted path order;
- `prose`: the documentation topics of `pydoc_data.topics`, then the module docstrings of the standard
  library, read from source (never imported: importing runs code and is slow);
- `arithmetic`: synthetic problems with their answers (`"417 + 86 = 503"`), generated from `data.seed`.

A `files` domain reads the user's `.txt` (one file per document), `.jsonl` (one document per line, from its
`text` field) or `.parquet` files (a `text` column); `.txt` and `.jsonl` may be compressed (`.gz`, `.zst`), a
path may be a glob (`data/*.jsonl`), a directory written by Hugging Face `datasets`' `save_to_disk`, or
`hf:owner/name[:split]` on the Hub. Files are read as streams, so `moelab data prepare` holds one at a time. Anything malformed raises `DataError` naming the file,
and the line where there is one, and saying what to do.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import gzip
import io
import json
import os
import sysconfig
import tokenize
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from moelab.config import DomainConfig
from moelab.errors import DataError

__all__ = ["load_documents", "iter_documents", "iter_file_documents", "source_files", "stdlib_python_files"]

# Directories of the stdlib tree that are not the library itself: third-party packages and test suites
# (test data there includes deliberately broken or oddly encoded files), generated codec tables
# (`encodings/` is ~0.8 MB of lookup tables, not code anyone writes) and the deprecated `distutils`.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
                           "encodings", "distutils"})
_ARITHMETIC_MAX_BYTES = 1_000_000  # more of the same problems would add start-up time, not information
_ARITHMETIC_LINES_PER_DOCUMENT = 32
_CHUNKS_FOR_A_SINGLE_DOCUMENT = 20  # a lone user document is cut into this many pieces so a held-out split exists
_FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
_COMPRESSIONS = (".gz", ".zst")  # for .txt and .jsonl: decompressed as they are read
_HF_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes
_HF_PREFIX = "hf:"  # hf:owner/name[:split], a dataset on the Hugging Face Hub
_ROWS_PER_BATCH = 4096  # Parquet rows read at a time


def load_documents(domain: DomainConfig, max_bytes: int, seed: int = 0, digits: int | None = None) -> list[str]:
    """The documents of one domain, in a deterministic order.

    Args:
        domain: an embedded domain (`code`, `prose`, `arithmetic`) or a `files` domain.
        max_bytes: budget of UTF-8 bytes for an embedded domain: whole documents are taken in order and the
            last one is cut at a line boundary, so the total never exceeds it. The arithmetic domain stops at
            1 MB even under a larger budget. User files are never cut: their data is read in full.
        seed: seeds the arithmetic problems (`data.seed`); the other domains do not depend on it.
        digits: the arithmetic problems' difficulty (`data.arithmetic_digits`).

    Returns:
        The documents; a `files` domain that holds a single document is split into contiguous chunks at line
        boundaries so that a held-out split exists.

    Raises:
        DataError: a user file is missing, empty, malformed or of an unknown type.
    """
    if domain.kind == "files":
        return _load_files(domain)
    if domain.name == "code":
        return _take_within(_read_code_documents(), max_bytes)
    if domain.name == "prose":
        return _take_within(_read_prose_documents(), max_bytes)
    if domain.name == "arithmetic":
        budget = min(max_bytes, _ARITHMETIC_MAX_BYTES)
        return _take_within(_generate_arithmetic_documents(budget, seed, digits), budget)
    raise DataError(f"data.domains[{domain.name}]: no embedded domain of that name; use code, prose or arithmetic.")


def iter_documents(domain: DomainConfig, max_bytes: int, seed: int = 0, digits: int | None = None) -> Iterator[str]:
    """`load_documents` as a stream, for `moelab data prepare`: a `files` domain is read file by file and a lone
    document is not split (the token store holds out whole documents as they stream by); an embedded domain,
    small by construction, is the same list."""
    if domain.kind == "files":
        return iter_file_documents(domain)
    return iter(load_documents(domain, max_bytes, seed, digits))


def _take_within(documents: Iterable[str], max_bytes: int) -> list[str]:
    """Whole documents while they fit in `max_bytes`; the first that does not is cut at a line boundary."""
    taken: list[str] = []
    left = max_bytes
    for doc in documents:
        size = len(doc.encode("utf-8"))
        if size <= left:
            taken.append(doc)
            left -= size
            continue
        cut = doc.encode("utf-8")[:left]
        head = cut[: cut.rfind(b"\n") + 1].decode("utf-8")  # a line ends on "\n", so no character is split
        if head:
            taken.append(head)
        break
    return taken


# ----------------------------------------------------------------------------------------------
# embedded: code and prose from the running interpreter's standard library


def stdlib_python_files() -> list[Path]:
    """The `.py` files of the running interpreter's standard library, sorted by relative path.

    Third-party packages (`site-packages`) and test suites are left out.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        found += [Path(dirpath, f).relative_to(root) for f in filenames if f.endswith(".py")]
    return [root / rel for rel in sorted(found, key=lambda p: p.parts)]


def _read_code_documents() -> Iterator[str]:
    for path in stdlib_python_files():
        try:
            with tokenize.open(path) as f:  # honours a PEP 263 encoding line
                text = f.read()
        except (SyntaxError, UnicodeDecodeError):
            continue  # a file this interpreter cannot decode is no use as training text
        if text.strip():
            yield text


def _read_prose_documents() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics  # some Linux distributions ship Python without pydoc_data
    except ImportError:
        topics = {}
    for key in sorted(topics):
        if topics[key].strip():
            yield topics[key]
    for path in stdlib_python_files():
        docstring = _module_docstring(path.read_bytes())
        if docstring:
            yield docstring + "\n"


def _module_docstring(source: bytes) -> str | None:
    """`ast.get_docstring` of a module, parsing only the lines up to its first statement.

    Parsing the whole standard library takes about a second; the docstring, when there is one, is the first
    statement, so parsing the lines that hold it gives the same answer twenty times faster.
    """
    try:
        for tok in tokenize.tokenize(io.BytesIO(source).readline):
            if tok.type in (tokenize.ENCODING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
                continue
            if tok.type != tokenize.STRING:
                return None
            head = b"".join(source.splitlines(keepends=True)[: tok.end[0]])
            try:
                return ast.get_docstring(ast.parse(head))
            except SyntaxError:  # the statement goes on past the string, e.g. `"..." % x`
                return ast.get_docstring(ast.parse(source))
    except (SyntaxError, tokenize.TokenError):
        return None  # not valid Python for this interpreter: no docstring to read
    return None


# ----------------------------------------------------------------------------------------------
# embedded: arithmetic


def _generate_arithmetic_documents(max_bytes: int, seed: int, digits: int | None = None) -> Iterator[str]:
    """Documents of `a op b = c` lines (op in +, -, *), enough to fill `max_bytes`.

    With `digits` None, addition and subtraction use operands below 1000; multiplication keeps the second
    operand below 100 so products stay at most five digits. With `digits` N, each operand first draws its
    digit count from 1..N (the second operand of a product from 1..max(1, N - 1)), then a number of at most
    that many digits: an easy problem is as common as a hard one, which is what a task that small models
    should start to solve needs.
    """
    rng = np.random.default_rng(seed)
    num_lines = max_bytes // len("0 + 0 = 0\n") + _ARITHMETIC_LINES_PER_DOCUMENT  # the shortest line bounds it
    ops = rng.integers(0, 3, num_lines)
    if digits is None:
        a = rng.integers(0, 1000, num_lines)
        b = np.where(ops == 2, rng.integers(0, 100, num_lines), rng.integers(0, 1000, num_lines))
    else:
        a = _operands(rng, np.full(num_lines, digits))
        b = _operands(rng, np.where(ops == 2, max(1, digits - 1), digits))
    answers = np.select([ops == 0, ops == 1], [a + b, a - b], a * b)
    symbols = np.array(["+", "-", "*"])[ops]
    lines = [f"{x} {s} {y} = {z}\n" for x, s, y, z in zip(a.tolist(), symbols.tolist(), b.tolist(), answers.tolist())]
    for start in range(0, num_lines - _ARITHMETIC_LINES_PER_DOCUMENT + 1, _ARITHMETIC_LINES_PER_DOCUMENT):
        yield "".join(lines[start : start + _ARITHMETIC_LINES_PER_DOCUMENT])


def _operands(rng: np.random.Generator, max_digits: np.ndarray) -> np.ndarray:
    """Per entry, a digit count uniform in 1..max_digits, then an integer uniform below 10 ** that count."""
    count = rng.integers(1, max_digits + 1)
    return (rng.random(len(max_digits)) * 10.0 ** count).astype(np.int64)


# ----------------------------------------------------------------------------------------------
# user files


def source_files(domain: DomainConfig) -> list[str]:
    """The files (or Hugging Face dataset directories / `hf:` names) a `files` domain reads, globs expanded.

    A pattern (`data/*.jsonl`, `shards/**/*.zst`) expands to its matches in sorted order; one that matches
    nothing raises DataError naming it.
    """
    where = f"data.domains[{domain.name}].paths"
    found: list[str] = []
    for name in domain.paths:
        if name.startswith(_HF_PREFIX) or not any(c in name for c in "*?["):
            found.append(name)
            continue
        matches = sorted(glob.glob(name, recursive=True))
        if not matches:
            raise DataError(f"{where}: the pattern {name} matches no file; fix the pattern (it is read relative to "
                            "the config file's folder) or remove it from the list.")
        found += matches
    return found


def iter_file_documents(domain: DomainConfig) -> Iterator[str]:
    """The documents of a `files` domain, streamed file by file in order (nothing held but the current file
    or row batch). Empty and whitespace-only documents are dropped.

    Raises:
        DataError: a file is missing, empty, malformed, of an unknown type, or a pattern matches nothing.
    """
    where = f"data.domains[{domain.name}].paths"
    for name in source_files(domain):
        count = 0
        for doc in _read_source(name, where):
            if doc.strip():
                count += 1
                yield doc
        if not count:
            raise DataError(f"{where}: file {name} is empty (no document with text); add text to it or remove it "
                            "from the list.")


def _load_files(domain: DomainConfig) -> list[str]:
    where = f"data.domains[{domain.name}].paths"
    documents = list(iter_file_documents(domain))
    if len(documents) == 1:
        documents = _split_at_lines(documents[0], _CHUNKS_FOR_A_SINGLE_DOCUMENT)
        if len(documents) < 2:
            raise DataError(
                f"{where}: file {domain.paths[0]} holds a single line of text, too little to hold part of it out "
                "for evaluation; add more lines, documents or files."
            )
    return documents


def _file_kind(path: Path) -> tuple[str, str | None]:
    """(`.txt` / `.jsonl` / `.parquet`, compression `.gz` / `.zst` or None) from a file's suffixes."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    if suffixes and suffixes[-1] in _COMPRESSIONS:
        return (suffixes[0] if len(suffixes) == 2 else ""), suffixes[-1]
    return (suffixes[-1] if suffixes else ""), None


def _read_source(name: str, where: str) -> Iterator[str]:
    if name.startswith(_HF_PREFIX):
        yield from _read_hf_hub(name[len(_HF_PREFIX):], where)
        return
    path = Path(name)
    if path.is_dir():
        if any((path / marker).is_file() for marker in _HF_DATASET_MARKERS):
            yield from _read_hf_dataset(path, where)
            return
        inside = sorted(str(p) for p in path.iterdir() if _file_kind(p)[0] in _FILE_SUFFIXES)[:3]
        example = f" (it holds e.g. {', '.join(inside)})" if inside else ""
        raise DataError(f"{where}: {path} is a directory, not a file; list the {', '.join(_FILE_SUFFIXES)} files "
                        f"inside it one by one, or a pattern such as {path}/*.jsonl{example}.")
    if not path.is_file():
        raise DataError(f"{where}: file {path} does not exist; fix the path or remove it from the list.")
    kind, compression = _file_kind(path)
    if kind == ".parquet" and compression is None:
        yield from _read_parquet(path, where)
    elif kind == ".txt":
        with _open_text(path, compression, where) as f:
            yield _decoded(path, where, f.read)
    elif kind == ".jsonl":
        with _open_text(path, compression, where) as f:
            yield from _read_jsonl(path, where, f)
    else:
        raise DataError(f"{where}: file {path} has an unknown type {''.join(path.suffixes[-2:])!r}; use one of "
                        f"{', '.join(_FILE_SUFFIXES)}, optionally compressed as .gz or .zst (.jsonl.zst), or a "
                        "Hugging Face dataset directory.")


@contextlib.contextmanager
def _open_text(path: Path, compression: str | None, where: str):
    """A UTF-8 text stream over `path`, decompressing `.gz` / `.zst` on the fly."""
    if compression == ".zst":
        try:
            import zstandard  # optional: only .zst users need it
        except ImportError:
            raise DataError(f"{where}: reading {path} needs zstandard; run `pip install 'moelab[data]'`.") from None
        with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as stream:
            yield io.TextIOWrapper(stream, encoding="utf-8")
    elif compression == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            yield f
    else:
        with open(path, encoding="utf-8") as f:
            yield f


def _decoded(path: Path, where: str, read: Callable[[], Any]) -> Any:
    """`read()`, with a decoding or decompression failure turned into DataError naming `path`."""
    try:
        return read()
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where}: file {path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8."
        ) from e
    except Exception as e:  # gzip: BadGzipFile (an OSError), zlib.error, EOFError when truncated; zstandard: ZstdError
        if isinstance(e, (OSError, EOFError, zlib.error)) or type(e).__name__ == "ZstdError":
            raise DataError(f"{where}: file {path} could not be decompressed ({e}); it is truncated or not "
                            f"{path.suffix} data: write it again.") from e
        raise


def _read_jsonl(path: Path, where: str, stream: IO[str]) -> Iterator[str]:
    lines = iter(stream)
    lineno = 0
    while True:
        line = _decoded(path, where, lambda: next(lines, None))
        if line is None:
            return
        lineno += 1
        if not line.strip():
            continue  # blank lines, such as a trailing one, hold no document
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f'{where}: file {path} line {lineno} is not valid JSON ({e.msg}); write one object such as '
                '{"text": "..."} per line.'
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(
                f'{where}: file {path} line {lineno} has no "text" string; write one object such as '
                '{"text": "..."} per line.'
            )
        yield record["text"]


def _read_parquet(path: Path, where: str) -> Iterator[str]:
    try:
        import pyarrow as pa  # optional: only Parquet users need it
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{where}: reading {path} needs pyarrow; run `pip install 'moelab[parquet]'`.") from None
    try:
        schema = pq.read_schema(path)
        if "text" not in schema.names:
            raise DataError(
                f"{where}: file {path} has no 'text' column (its columns: {', '.join(schema.names)}); "
                "store one document per row in a string column named 'text'."
            )
        batches = pq.ParquetFile(path).iter_batches(columns=["text"], batch_size=_ROWS_PER_BATCH)
        row = 0
        for batch in batches:
            for doc in batch.column(0).to_pylist():
                if not isinstance(doc, str):
                    raise DataError(f"{where}: file {path} row {row} has text={doc!r}, not a string; drop the row "
                                    "or fill in its text.")
                row += 1
                yield doc
    except pa.ArrowException as e:
        raise DataError(f"{where}: file {path} is not a readable Parquet file ({e}); rewrite it with pyarrow.") from e


def _text_rows(dataset: Any, name: str, where: str) -> Iterator[str]:
    """The `text` column of a Hugging Face `datasets.Dataset` (or IterableDataset), row by row."""
    columns = getattr(dataset, "column_names", None) or []
    if "text" not in columns:
        raise DataError(f"{where}: dataset {name} has no 'text' column (its columns: {', '.join(columns)}); "
                        "rename the text column to 'text' (dataset.rename_column).")
    for row, record in enumerate(dataset):
        doc = record["text"]
        if not isinstance(doc, str):
            raise DataError(f"{where}: dataset {name} row {row} has text={doc!r}, not a string; drop the row "
                            "or fill in its text.")
        yield doc


def _import_datasets(name: str, where: str) -> Any:
    try:
        import datasets  # optional: only Hugging Face dataset users need it
    except ImportError:
        raise DataError(f"{where}: reading {name} needs the datasets package; run `pip install "
                        "'moelab[data]'`.") from None
    return datasets


def _read_hf_dataset(path: Path, where: str) -> Iterator[str]:
    """A dataset saved with `datasets`' `save_to_disk`; a DatasetDict's `train` split."""
    datasets = _import_datasets(str(path), where)
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{where}: dataset {path} has splits {', '.join(loaded)} but no 'train'; give the "
                            f"split's own folder, e.g. {path / next(iter(loaded))}.")
        loaded = loaded["train"]
    yield from _text_rows(loaded, str(path), where)


def _read_hf_hub(name: str, where: str) -> Iterator[str]:
    """`hf:owner/name` (its train split) or `hf:owner/name:split`, streamed from the Hugging Face Hub."""
    datasets = _import_datasets(name, where)
    repo, _, split = name.partition(":")
    try:
        dataset = datasets.load_dataset(repo, split=split or "train", streaming=True)
    except Exception as e:  # datasets raises many types for an unknown name or no network
        raise DataError(f"{where}: the Hugging Face dataset {repo} could not be opened ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'no message'}); check the name and the network, "
                        "or save it with save_to_disk and list that folder.") from None
    yield from _text_rows(dataset, _HF_PREFIX + name, where)


def _split_at_lines(text: str, num_chunks: int) -> list[str]:
    """Cut `text` into at most `num_chunks` contiguous pieces of about equal size, at line boundaries."""
    lines = text.splitlines(keepends=True)
    target = len(text) / num_chunks
    chunks, current, size = [], [], 0
    for line in lines:
        current.append(line)
        size += len(line)
        if size >= target * (len(chunks) + 1):
            chunks.append("".join(current))
            current = []
    if current:
        chunks.append("".join(current))
    return chunks
