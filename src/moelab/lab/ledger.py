"""The lab ledger: an append-only SQLite record whose rows form a SHA-256 hash chain.

    from moelab.lab.ledger import append, open_ledger, records, verify
    ledger = open_ledger("lab/ledger.sqlite", create=True)
    append(ledger, "run", "demo", {"event": "started", "step": "train"})
    verify(ledger)  # ChainCheck(num_records=1, broken_seq=None, ...)

Every record (experiment registrations, amendments, runs, metrics, incidents, mixture-log entries,
samples) is one row of the `records` table, numbered 1, 2, 3, ... Its hash is

    hash_n = sha256(hash_{n-1} + canonical_json({seq, kind, key, created_at, body}))

with hash_0 = 64 zeros, so editing, inserting or deleting any row breaks the chain at that row and
`verify` names it. Nothing is written onto a broken chain: `append` checks the chain first (in full
the first time a handle from `open_ledger` appends, then only the rows added since) and refuses with
`ChainBroken`, so new rows cannot bury an edit under fresh, valid hashes.

The chain alone cannot see rows cut off its end: a shorter chain is still a valid one. So the head
hash (the last record's hash) and the record count travel outside the ledger: `moelab lab verify`,
`moelab lab show` and every report print them. Whoever kept one can later prove that those records
are still there with `moelab lab verify --head HASH` (`find_record`), which fails once the ledger was
truncated below that head or rewritten.

Writers are safe to run concurrently (several steps of one experiment, on one host or on a shared
filesystem that honours POSIX locks): the database is in WAL mode and each append reads the head and
inserts the next row inside one `BEGIN IMMEDIATE` transaction, so the chain stays linear. Per-kind
views (`experiments`, `runs`, `metrics`, ...) make the file easy to query with the `sqlite3` shell.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import math
import numbers
import random
import re
import sqlite3
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

from moelab.errors import ConfigError, DataError
from moelab.files import atomic_open

__all__ = ["KINDS", "GENESIS_HASH", "MIN_HASH_PREFIX", "Ledger", "Record", "ChainCheck", "DuplicateRecord",
           "ChainBroken", "canonical_json", "record_hash", "open_ledger", "append", "records", "verify", "check_chain",
           "find_record", "record_line", "export_jsonl"]

FORMAT = "moelab-ledger"
FORMAT_VERSION = 1
GENESIS_HASH = "0" * 64
# Record kinds and the view each one gets. Later issues fill metrics, incidents, mixture and samples.
KINDS = {
    "experiment": "experiments",
    "amendment": "amendments",
    "run": "runs",
    "metric": "metrics",
    "incident": "incidents",
    "mixture": "mixture_log",
    "sample": "samples",
}
_SQLITE_MAGIC = b"SQLite format 3\x00"
MIN_HASH_PREFIX = 12  # hex digits of a published head that `find_record` accepts: 48 bits, no accidental match
_BUSY_TIMEOUT_MS = 60_000  # writers queue behind BEGIN IMMEDIATE; a training step's append is milliseconds

_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS records (
        seq INTEGER PRIMARY KEY,   -- 1, 2, 3, ... in chain order
        kind TEXT NOT NULL,        -- one of KINDS
        key TEXT NOT NULL,         -- what the record is about, usually an experiment id
        created_at TEXT NOT NULL,  -- UTC, ISO 8601
        body TEXT NOT NULL,        -- canonical JSON object
        prev_hash TEXT NOT NULL,
        hash TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS records_by_kind_key ON records (kind, key)",
    # An experiment id is registered once; amendments change it afterwards. The index also settles
    # two concurrent registrations of one id.
    "CREATE UNIQUE INDEX IF NOT EXISTS one_registration_per_id ON records (key) WHERE kind = 'experiment'",
    *(f"CREATE VIEW IF NOT EXISTS {view} AS SELECT seq, key, created_at, body FROM records WHERE kind = '{kind}'"
      for kind, view in KINDS.items()),
]


class DuplicateRecord(ConfigError):
    """A second registration of an experiment id (the unique index refused it)."""


class ChainBroken(ConfigError):
    """An append refused because the chain does not check out: new rows would hide the edit."""


@dataclass(eq=False)
class Ledger:
    """A handle on a ledger file that `open_ledger` has checked; functions below take it."""

    path: Path
    # (seq, hash) of the newest record this handle has checked the chain up to; None: not checked yet.
    # Appends through the handle then check only the rows after it, so a run's many appends stay linear.
    checked: tuple[int, str] | None = None


@dataclass(frozen=True)
class Record:
    seq: int
    kind: str
    key: str
    created_at: str
    body: dict
    prev_hash: str
    hash: str


@dataclass(frozen=True)
class ChainCheck:
    """What `verify` found: the number of records, the head hash, and the first broken record if any."""

    num_records: int
    head_hash: str
    broken_seq: int | None = None  # None: the whole chain checks out
    problem: str | None = None  # why `broken_seq` is broken, in one sentence

    @property
    def ok(self) -> bool:
        return self.broken_seq is None

    @property
    def status(self) -> str:
        """"chain intact", or where it breaks: the words `lab show` and reports put beside the head hash."""
        return "chain intact" if self.ok else f"chain broken at record {self.broken_seq}"


# ----------------------------------------------------------------------------------------------
# canonical JSON and the chain


def _plain(value: Any, where: str) -> Any:
    """JSON-ready data: tuples become lists, paths and dates strings, numpy scalars Python numbers.

    Non-finite floats become the strings "NaN", "Infinity", "-Infinity": strict JSON has no
    spelling for them, and a diverged run's NaN loss must still go on the record.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        x = float(value)
        if math.isfinite(x):
            return x
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    raise TypeError(f"{where} holds a {type(value).__name__}, which has no JSON form; store plain data.")


def canonical_json(value: Any) -> str:
    """The one JSON spelling of `value`: sorted keys, no spaces, UTF-8; the input of every hash."""
    return json.dumps(_plain(value, "value"), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def record_hash(prev_hash: str, seq: int, kind: str, key: str, created_at: str, body: dict) -> str:
    content = canonical_json({"seq": seq, "kind": kind, "key": key, "created_at": created_at, "body": body})
    return hashlib.sha256((prev_hash + content).encode()).hexdigest()


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


# ----------------------------------------------------------------------------------------------
# opening


def _connect(path: Path) -> sqlite3.Connection:
    # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
    conn = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None)
    conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
    return conn


def _not_a_ledger(path: Path, why: str) -> ConfigError:
    return ConfigError(
        f"{path} is not a moelab ledger ({why}). Point --ledger (or MOELAB_LEDGER) at a ledger file, or at a "
        "path that does not exist yet to start a new one."
    )


def _init_schema(conn: sqlite3.Connection, path: Path) -> None:
    """Create the tables (idempotent) and switch to WAL, safe while other processes do the same.

    The tables go first, under BEGIN IMMEDIATE, whose lock wait honours the busy timeout. Switching
    to WAL needs every other connection out of the file, and SQLite may answer "locked" at once
    instead of waiting, so that step retries until the busy timeout runs out.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        (has_meta,) = conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'meta'").fetchone()
        (others,) = conn.execute("SELECT count(*) FROM sqlite_master WHERE name != 'meta'").fetchone()
        if others and not has_meta:  # checked under the lock: another creator may have finished meanwhile
            raise _not_a_ledger(path, "an SQLite database without moelab's meta table")
        for statement in _SCHEMA:
            conn.execute(statement)
        conn.execute("INSERT OR IGNORE INTO meta VALUES ('format', ?), ('version', ?)", (FORMAT, str(FORMAT_VERSION)))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    deadline = time.monotonic() + _BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")  # persistent; lets readers run beside the one writer
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.02 + 0.03 * random.random())


def open_ledger(path: str | Path, create: bool = False) -> Ledger:
    """Check that `path` is a moelab ledger (creating an empty one if `create` and it does not exist).

    Raises ConfigError naming the path when it is missing (and not `create`), is not an SQLite
    file, is an SQLite file of something else, or is a ledger of a newer format.
    """
    path = Path(path)
    if path.is_dir():
        raise _not_a_ledger(path, "it is a directory")
    # A zero-byte file is a ledger another process is creating this instant (sqlite makes the file
    # before its first write); treat it like a missing one.
    exists = path.is_file() and path.stat().st_size > 0
    if not exists and not create:
        raise ConfigError(
            f"no ledger at {path}. Register an experiment first (`moelab lab register SPEC.yaml`), or point "
            "--ledger (or MOELAB_LEDGER) at an existing ledger."
        )
    if exists:
        with open(path, "rb") as f:
            if f.read(len(_SQLITE_MAGIC)) != _SQLITE_MAGIC:
                raise _not_a_ledger(path, "not an SQLite database")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    conn = _connect(path)
    try:
        try:
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.DatabaseError:
            meta = None
        if not meta:
            if not create:
                raise _not_a_ledger(path, "an SQLite database without moelab's meta table")
            _init_schema(conn, path)
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("format") != FORMAT:
            raise _not_a_ledger(path, f"its meta table says format={meta.get('format')!r}")
        if meta.get("version") != str(FORMAT_VERSION):
            raise ConfigError(f"{path} is a moelab ledger of format version {meta.get('version')}; this moelab "
                              f"reads version {FORMAT_VERSION}. Upgrade moelab to read it.")
    finally:
        conn.close()
    return Ledger(path)


# ----------------------------------------------------------------------------------------------
# writing and reading


def append(ledger: Ledger, kind: str, key: str, body: dict) -> Record:
    """Append one record at the head of the chain, atomically with respect to other writers.

    Raises DuplicateRecord (a ConfigError) for a second `experiment` record with the same key.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not a ledger record kind; use one of {', '.join(KINDS)}.")
    if not isinstance(body, dict):
        raise TypeError(f"a ledger record's body must be a dict, got {type(body).__name__}.")
    body = json.loads(canonical_json(body))  # the stored form, so the returned Record hashes the same
    conn = _connect(ledger.path)
    try:
        conn.execute("BEGIN IMMEDIATE")  # takes the write lock before reading the head: no forks
        try:
            check = _check_since(conn, ledger.checked)
            if not check.ok:
                raise _chain_broken(ledger, check)
            seq, prev = check.num_records + 1, check.head_hash
            created_at = _now()
            digest = record_hash(prev, seq, kind, key, created_at, body)
            conn.execute("INSERT INTO records VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (seq, kind, key, created_at, canonical_json(body), prev, digest))
            conn.execute("COMMIT")
        except sqlite3.IntegrityError:
            conn.execute("ROLLBACK")
            raise DuplicateRecord(f"an {kind} record with key {key!r} is already in {ledger.path}.") from None
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    finally:
        conn.close()
    ledger.checked = (seq, digest)
    return Record(seq, kind, key, created_at, body, prev, digest)


_SELECT = "SELECT seq, kind, key, created_at, body, prev_hash, hash FROM records"


def _rows(ledger: Ledger, where: str = "", params: tuple = ()) -> Iterator[tuple]:
    """The ledger's rows; DataError naming the file when SQLite cannot read it (a damaged page, a cut file)."""
    conn = _connect(ledger.path)
    try:
        yield from conn.execute(f"{_SELECT} {where} ORDER BY seq", params)
    except sqlite3.DatabaseError as e:
        raise DataError(f"{ledger.path} cannot be read as an SQLite database ({e}): the file was damaged or cut "
                        "short. Restore the ledger from a copy (a published bundle proves what it held).") from None
    finally:
        conn.close()


def _record(row: tuple) -> Record:
    seq, kind, key, created_at, body, prev, digest = row
    try:
        parsed = json.loads(body)
    except (TypeError, ValueError):
        parsed = None
    if not (isinstance(parsed, dict) and isinstance(seq, int) and all(isinstance(v, str) for v in
                                                                      (kind, key, created_at, prev, digest))):
        raise DataError(f"ledger record {seq!r} is not a moelab record (a field of the wrong type, or a body that is "
                        "not a JSON object): it was edited outside moelab. `moelab lab verify` names where the "
                        "chain breaks.")
    return Record(seq, kind, key, created_at, parsed, prev, digest)


def records(ledger: Ledger, kind: str | None = None, key: str | None = None) -> list[Record]:
    """Records in chain order, optionally only one kind and / or one key."""
    clauses, params = [], []
    if kind is not None:
        clauses.append("kind = ?")
        params.append(kind)
    if key is not None:
        clauses.append("key = ?")
        params.append(key)
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    return [_record(row) for row in _rows(ledger, where, tuple(params))]


def _walk(rows: Iterator[tuple], after: int = 0, prev: str = GENESIS_HASH) -> ChainCheck:
    """Check `rows` (in seq order) as the chain's continuation after record `after`, whose hash is `prev`."""
    expected_seq = after + 1
    for seq, kind, key, created_at, body_text, prev_hash, digest in rows:
        def broken(at: int, problem: str) -> ChainCheck:
            return ChainCheck(expected_seq - 1, prev, at, problem)

        if seq != expected_seq:
            return broken(expected_seq, f"record {expected_seq} is missing (the next one is numbered {seq})")
        try:
            body = json.loads(body_text)
            canonical = isinstance(body, dict) and canonical_json(body) == body_text
        except (ValueError, TypeError):
            canonical = False
        if not canonical:
            return broken(seq, f"record {seq} ({kind} {key!r}) has a body that is not canonical JSON: it was "
                               "edited outside moelab")
        if prev_hash != prev:
            return broken(seq, f"record {seq} ({kind} {key!r}) does not link to record {seq - 1}: its prev_hash "
                               f"{str(prev_hash)[:12]}... is not {prev[:12]}...")
        if kind not in KINDS or not isinstance(created_at, str) or not isinstance(key, str) or \
                record_hash(prev, seq, kind, key, created_at, body) != digest:
            return broken(seq, f"record {seq} ({kind} {key!r}) does not match its hash: a field was changed "
                               "after it was written")
        expected_seq, prev = seq + 1, digest
    return ChainCheck(expected_seq - 1, prev)


def verify(ledger: Ledger) -> ChainCheck:
    """Recompute the chain from the first record and stop at the first one that does not check out (a file
    SQLite cannot read breaks it at record 1)."""
    try:
        return _walk(_rows(ledger))
    except DataError as e:
        return ChainCheck(0, GENESIS_HASH, 1, str(e))


def _check_since(conn: sqlite3.Connection, checked: tuple[int, str] | None) -> ChainCheck:
    """The chain checked from `checked` (seq, hash) on, or in full when None; call inside a transaction.

    A record checked before that is now gone or different means the end was cut off or rewritten
    under this handle: the whole chain is checked again to name the first bad row, or, if what is
    left is a valid (shorter) chain, that record is named as cut off.
    """
    seq, prev = checked or (0, GENESIS_HASH)
    if seq:
        row = conn.execute("SELECT hash FROM records WHERE seq = ?", (seq,)).fetchone()
        if row is None or row[0] != prev:
            check = _walk(conn.execute(f"{_SELECT} ORDER BY seq"))
            if check.ok:
                check = replace(check, broken_seq=seq, problem=(
                    f"record {seq} (sha256 {prev[:12]}...), which this process checked before, is no longer "
                    f"in the ledger: the chain now ends at record {check.num_records}, so rows were cut off the end "
                    "or rewritten"))
            return check
    return _walk(conn.execute(f"{_SELECT} WHERE seq > ? ORDER BY seq", (seq,)), seq, prev)


def _chain_broken(ledger: Ledger, check: ChainCheck) -> ChainBroken:
    return ChainBroken(
        f"the ledger {ledger.path} fails its hash check at record {check.broken_seq}: {check.problem}. Nothing was "
        "written to it: new rows on a broken chain would hide the damage. Restore the ledger from a copy you "
        f"trust, then retry; `moelab lab verify --ledger {ledger.path}` shows the details."
    )


def check_chain(ledger: Ledger) -> ChainCheck:
    """Refuse (ChainBroken) a ledger whose chain does not check out, before a batch of appends.

    `append` checks too; calling this first refuses before any work (a training step) starts. The
    handle remembers the head it checked, so the appends after it check only what is new.
    """
    conn = _connect(ledger.path)
    try:
        conn.execute("BEGIN")  # one snapshot for the checked record and the rows after it
        try:
            check = _check_since(conn, ledger.checked)
        finally:
            conn.execute("ROLLBACK")
    finally:
        conn.close()
    if not check.ok:
        raise _chain_broken(ledger, check)
    ledger.checked = (check.num_records, check.head_hash) if check.num_records else None
    return check


def record_line(record: Record) -> str:
    """One record as export_jsonl and a bundle write it: canonical JSON of every field, one line."""
    return canonical_json(dataclasses.asdict(record)) + "\n"


def export_jsonl(ledger: Ledger, path: str | Path) -> Path:
    """Write every record, in order, one JSON object a line (seq, kind, key, created_at, body, prev_hash, hash):
    a copy anyone can check with the chain rule (`record_hash`) without SQLite. Written to a temporary name
    and renamed, so the file is whole."""
    path = Path(path)
    with atomic_open(path) as f:
        for record in records(ledger):
            f.write(record_line(record))
    return path


def find_record(ledger: Ledger, hash_prefix: str, up_to: int | None = None) -> Record | None:
    """The record whose hash is `hash_prefix` (full hex or at least MIN_HASH_PREFIX digits); None if none is.

    `up_to` limits the search to records 1..up_to (those a `verify` found intact). ConfigError for a
    prefix that is too short, not hex, or matches several records.
    """
    prefix = hash_prefix.strip().lower()
    if not re.fullmatch(f"[0-9a-f]{{{MIN_HASH_PREFIX},64}}", prefix):
        raise ConfigError(f"--head {hash_prefix!r} is not a record hash: give the head's sha256 as printed by "
                          f"`moelab lab verify`, `lab show` or a report, in full or its first {MIN_HASH_PREFIX} or "
                          "more hex digits.")
    where, params = "WHERE substr(hash, 1, ?) = ?", (len(prefix), prefix)
    if up_to is not None:
        where, params = where + " AND seq <= ?", params + (up_to,)
    found = [_record(row) for row in _rows(ledger, where, params)]
    if len(found) > 1:
        raise ConfigError(f"--head {hash_prefix!r} matches records {found[0].seq} and {found[1].seq}; give more of "
                          "the hash (the full 64 hex digits never match twice).")
    return found[0] if found else None
