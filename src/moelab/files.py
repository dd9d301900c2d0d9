"""Files a reader never sees half-written, and their content hashes.

Every module that writes a file another process may read at any moment (a status file, a prediction
the watcher reloads, a ledger export, a store shard) writes it here: into a temporary name beside the
target, renamed onto it only once complete, so a reader finds the old file or the new one and a crash
leaves the target untouched. Each temporary name is unique to its writer (process and thread), so two
writers never interleave in one, and ends in `.tmp`, so a cleanup can find what a killed writer left.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_path", "atomic_open", "write_text", "write_bytes", "write_json", "sha256_file"]


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` for any writer (`np.save`, `tokenizer.save`, a copy), renamed onto
    `path` when the block ends cleanly; on an error it is removed and `path` keeps what it held."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", newline: str | None = None) -> Iterator[IO[Any]]:
    """`open(path, mode)` through `atomic_path`: the file appears whole when the block ends."""
    with atomic_path(path) as tmp, open(tmp, mode, newline=newline) as f:
        yield f


def write_text(path: str | Path, text: str) -> Path:
    with atomic_open(path) as f:
        f.write(text)
    return Path(path)


def write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def write_json(path: str | Path, data: Any, indent: int | None = 1, sort_keys: bool = True) -> Path:
    return write_text(path, json.dumps(data, indent=indent, sort_keys=sort_keys))


def sha256_file(path: str | Path) -> str:
    """The file's SHA-256 in hex, read in 1 MiB blocks (store shards and checkpoints do not fit memory twice)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
