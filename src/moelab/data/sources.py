"""Data domains as lists of documents: the embedded ones (stdlib code, pydoc prose, arithmetic) and user files.

Every Python install carries enough text to train a small language model (design §3b), so `make demo` and
the tests need no download:

- `code`: the standard library's `.py` files, one file per document, in sorted path order;
- `prose`: the documentation topics of `pydoc_data.topics`, then the module docstrings of the standard
  library, read from source (never imported: importing runs code and is slow);
- `arithmetic`: synthetic problems with their answers (`"417 + 86 = 503"`), generated from `data.seed`.

A `files` domain reads the user's `.txt` (one file per document), `.jsonl` (one document per line, from its
`text` field) or `.parquet` files (a `text` column). Anything malformed raises `DataError` naming the file,
and the line where there is one, and saying what to do.
"""

from __future__ import annotations

import ast
import io
import json
import os
import sysconfig
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from moelab.config import DomainConfig
from moelab.errors import DataError

__all__ = ["load_documents", "stdlib_python_files"]

# Directories of the stdlib tree that are not the library itself: third-party packages and test suites
# (test data there includes deliberately broken or oddly encoded files), generated codec tables
# (`encodings/` is ~0.8 MB of lookup tables, not code anyone writes) and the deprecated `distutils`.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
                           "encodings", "distutils"})
_ARITHMETIC_MAX_BYTES = 1_000_000  # more of the same problems would add start-up time, not information
_ARITHMETIC_LINES_PER_DOCUMENT = 32
_CHUNKS_FOR_A_SINGLE_DOCUMENT = 20  # a lone user document is cut into this many pieces so a held-out split exists
_FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")


def load_documents(domain: DomainConfig, max_bytes: int, seed: int = 0) -> list[str]:
    """The documents of one domain, in a deterministic order.

    Args:
        domain: an embedded domain (`code`, `prose`, `arithmetic`) or a `files` domain.
        max_bytes: budget of UTF-8 bytes for an embedded domain: whole documents are taken in order and the
            last one is cut at a line boundary, so the total never exceeds it. The arithmetic domain stops at
            1 MB even under a larger budget. User files are never cut: their data is read in full.
        seed: seeds the arithmetic problems (`data.seed`); the other domains do not depend on it.

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
        return _take_within(_generate_arithmetic_documents(budget, seed), budget)
    raise DataError(f"data.domains[{domain.name}]: no embedded domain of that name; use code, prose or arithmetic.")


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


def _generate_arithmetic_documents(max_bytes: int, seed: int) -> Iterator[str]:
    """Documents of `a op b = c` lines (op in +, -, *), enough to fill `max_bytes`.

    Addition and subtraction use operands below 1000; multiplication keeps the second operand below 100 so
    products stay at most five digits.
    """
    rng = np.random.default_rng(seed)
    num_lines = max_bytes // len("0 + 0 = 0\n") + _ARITHMETIC_LINES_PER_DOCUMENT  # the shortest line bounds it
    ops = rng.integers(0, 3, num_lines)
    a = rng.integers(0, 1000, num_lines)
    b = np.where(ops == 2, rng.integers(0, 100, num_lines), rng.integers(0, 1000, num_lines))
    answers = np.select([ops == 0, ops == 1], [a + b, a - b], a * b)
    symbols = np.array(["+", "-", "*"])[ops]
    lines = [f"{x} {s} {y} = {z}\n" for x, s, y, z in zip(a.tolist(), symbols.tolist(), b.tolist(), answers.tolist())]
    for start in range(0, num_lines - _ARITHMETIC_LINES_PER_DOCUMENT + 1, _ARITHMETIC_LINES_PER_DOCUMENT):
        yield "".join(lines[start : start + _ARITHMETIC_LINES_PER_DOCUMENT])


# ----------------------------------------------------------------------------------------------
# user files


def _load_files(domain: DomainConfig) -> list[str]:
    where = f"data.domains[{domain.name}].paths"
    documents: list[str] = []
    for name in domain.paths:
        path = Path(name)
        if path.is_dir():
            inside = sorted(str(p) for p in path.iterdir() if p.suffix.lower() in _FILE_SUFFIXES)[:3]
            example = f" (it holds e.g. {', '.join(inside)})" if inside else ""
            raise DataError(f"{where}: {path} is a directory, not a file; list the {', '.join(_FILE_SUFFIXES)} files "
                            f"inside it one by one{example}.")
        if not path.is_file():
            raise DataError(f"{where}: file {path} does not exist; fix the path or remove it from the list.")
        suffix = path.suffix.lower()
        if suffix == ".txt":
            docs = [_read_text(path, where)]
        elif suffix == ".jsonl":
            docs = _read_jsonl(path, where)
        elif suffix == ".parquet":
            docs = _read_parquet(path, where)
        else:
            raise DataError(
                f"{where}: file {path} has an unknown type {path.suffix!r}; use one of {', '.join(_FILE_SUFFIXES)}."
            )
        if not docs or not any(doc.strip() for doc in docs):
            raise DataError(f"{where}: file {path} is empty; add text to it or remove it from the list.")
        documents += docs
    if len(documents) == 1:
        documents = _split_at_lines(documents[0], _CHUNKS_FOR_A_SINGLE_DOCUMENT)
        if len(documents) < 2:
            raise DataError(
                f"{where}: file {domain.paths[0]} holds a single line of text, too little to hold part of it out "
                "for evaluation; add more lines, documents or files."
            )
    return documents


def _read_text(path: Path, where: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where}: file {path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8."
        ) from e


def _read_jsonl(path: Path, where: str) -> list[str]:
    documents = []
    for lineno, line in enumerate(_read_text(path, where).splitlines(), start=1):
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
        documents.append(record["text"])
    return documents


def _read_parquet(path: Path, where: str) -> list[str]:
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
        column = pq.read_table(path, columns=["text"]).column("text")
    except pa.ArrowException as e:
        raise DataError(f"{where}: file {path} is not a readable Parquet file ({e}); rewrite it with pyarrow.") from e
    documents = column.to_pylist()
    for row, doc in enumerate(documents):
        if not isinstance(doc, str):
            raise DataError(
                f"{where}: file {path} row {row} has text={doc!r}, not a string; drop the row or fill in its text."
            )
    return documents


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
