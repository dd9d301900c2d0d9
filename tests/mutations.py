"""Hypothesis strategies that damage a real artefact the way a download, a disk or a forger would (issue 29).

    @given(mutation=mutations(["ledger/chain.jsonl", "bundle.json"]))
    def test_x(mutation): changed = mutation.apply(folder)      # True when some file's bytes differ

Each mutation names one file and one operation: truncate, append a junk line, drop / rename a key or change
a value's type on a JSON line, flip a byte, swap or duplicate lines, delete the file, replace it by a
directory or by a symlink pointing outside the folder.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

OPERATIONS = ("truncate", "append", "drop_key", "rename_key", "retype", "flip", "swap", "duplicate", "delete",
              "directory", "symlink")
JUNK = ('{"step": 1, "loss": 0.1}', "not json", "[1, 2, 3]", "null", '{"seq": "7"}', "\x00\xff", "")
OUTSIDE = Path("/etc/hostname")  # a file outside any artefact, present on every Linux machine


@dataclass(frozen=True)
class Mutation:
    file: str
    operation: str
    where: float  # a position in [0, 1): which byte, line or key
    junk: str
    retype_to: object

    def apply(self, folder: Path) -> bool:
        """Damage `folder / file`; True when that changed what is on disk (a no-op leaves the artefact valid)."""
        path = folder / self.file
        before = path.read_bytes() if path.is_file() else None
        if self.operation == "delete":
            path.unlink()
            return True
        if self.operation == "directory":
            path.unlink()
            path.mkdir()
            return True
        if self.operation == "symlink":
            path.unlink()
            os.symlink(OUTSIDE, path)
            return True
        data = before
        if self.operation == "truncate":
            data = before[:int(self.where * len(before))]
        elif self.operation == "append":
            data = before + ("" if before.endswith(b"\n") or not before else "\n").encode() + (self.junk + "\n").encode(
                "utf-8", "surrogateescape")
        elif self.operation == "flip":
            if before:
                i = int(self.where * len(before))
                data = before[:i] + bytes([before[i] ^ 0x01]) + before[i + 1:]
        else:
            data = self._lines(before)
        path.write_bytes(data)
        return data != before

    def _lines(self, before: bytes) -> bytes:
        lines = before.split(b"\n")
        i = int(self.where * len(lines))
        if self.operation == "swap" and len(lines) > 1:
            j = (i + 1) % len(lines)
            lines[i], lines[j] = lines[j], lines[i]
        elif self.operation == "duplicate":
            lines.insert(i, lines[i])
        elif self.operation in ("drop_key", "rename_key", "retype"):
            whole = self.file.endswith(".json")  # one JSON document, not JSON lines
            try:
                row = json.loads(before if whole else lines[i])
            except ValueError:
                return before
            if not isinstance(row, dict) or not row:
                return before
            key = sorted(row)[int(self.where * len(row))]
            if self.operation == "drop_key":
                del row[key]
            elif self.operation == "rename_key":
                row[key + "_"] = row.pop(key)
            else:
                row[key] = self.retype_to
            if whole:
                return json.dumps(row).encode()
            lines[i] = json.dumps(row).encode()
        return b"\n".join(lines)


def mutations(files: list[str]) -> st.SearchStrategy[Mutation]:
    return st.builds(Mutation, st.sampled_from(files), st.sampled_from(OPERATIONS),
                     st.floats(0, 1, exclude_max=True), st.sampled_from(JUNK),
                     st.sampled_from(["7", 7, 7.5, None, True, [], {}, "x" * 64]))


def fresh_copy(source: Path, dest: Path) -> Path:
    """`source` copied to a new `dest` (removed first), for one example."""
    if dest.exists() or dest.is_symlink():
        shutil.rmtree(dest)
    shutil.copytree(source, dest, symlinks=True)
    return dest
