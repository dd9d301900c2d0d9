"""The ledger: a hash chain that names the first edited row, refuses to grow on a broken chain, proves a
published head is still in it, is safe under concurrent writers, and is strict about what it opens."""

import json
import multiprocessing
import sqlite3

import pytest

from helpers import run_cli

from moelab.errors import ConfigError
from moelab.lab.ledger import (GENESIS_HASH, ChainBroken, DuplicateRecord, append, canonical_json, open_ledger,
                               record_hash, records, verify)

NUM_RECORDS = 5


def filled_ledger(path, n=NUM_RECORDS):
    ledger = open_ledger(path, create=True)
    kinds = ["experiment", "amendment", "run", "metric", "incident"]
    for i in range(n):
        append(ledger, kinds[i % len(kinds)], "exp-a", {"i": i, "loss": 3.0 - 0.1 * i, "tags": ["x", "y"]})
    return ledger


def execute_sql(path, sql, params=()):
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(sql, params)
    conn.close()


def test_each_record_hashes_its_predecessors_hash_and_its_own_canonical_json(tmp_path):
    ledger = filled_ledger(tmp_path / "ledger.sqlite")
    rows = records(ledger)
    assert [r.seq for r in rows] == list(range(1, NUM_RECORDS + 1))
    prev = GENESIS_HASH
    for r in rows:
        assert r.prev_hash == prev
        assert r.hash == record_hash(prev, r.seq, r.kind, r.key, r.created_at, r.body)
        prev = r.hash
    check = verify(ledger)
    assert check.ok and check.num_records == NUM_RECORDS and check.head_hash == rows[-1].hash


# Each edit changes one field of one row the way someone with the sqlite3 shell would.
EDITS = {
    "kind": "UPDATE records SET kind = CASE kind WHEN 'run' THEN 'metric' ELSE 'run' END WHERE seq = ?",
    "key": "UPDATE records SET key = 'exp-b' WHERE seq = ?",
    "created_at": "UPDATE records SET created_at = '2020-01-01T00:00:00.000000Z' WHERE seq = ?",
    "body value": "UPDATE records SET body = replace(body, '\"i\":', '\"i\":1') WHERE seq = ?",
    "body spacing": "UPDATE records SET body = replace(body, ',', ', ') WHERE seq = ?",
    "prev_hash": "UPDATE records SET prev_hash = CASE substr(prev_hash, 1, 1) WHEN 'f' THEN 'e' ELSE 'f' END "
                 "|| substr(prev_hash, 2) WHERE seq = ?",
    "hash": "UPDATE records SET hash = CASE substr(hash, 1, 1) WHEN 'f' THEN 'e' ELSE 'f' END || substr(hash, 2) "
            "WHERE seq = ?",
}


@pytest.mark.parametrize("row", [1, 3, NUM_RECORDS])
@pytest.mark.parametrize("edit", list(EDITS))
def test_editing_any_field_of_any_row_is_caught_and_the_row_is_named(edit, row, tmp_path, monkeypatch, capsys):
    path = tmp_path / "ledger.sqlite"
    ledger = filled_ledger(path)
    before = records(ledger)[row - 1]
    execute_sql(path, EDITS[edit], (row,))
    after = sqlite3.connect(path).execute("SELECT kind, key, created_at, body, prev_hash, hash FROM records "
                                          "WHERE seq = ?", (row,)).fetchone()
    assert after != (before.kind, before.key, before.created_at, canonical_json(before.body), before.prev_hash,
                     before.hash), "the edit must change the row, or the test proves nothing"

    check = verify(ledger)
    assert not check.ok and check.broken_seq == row and check.num_records == row - 1
    assert f"record {row} " in check.problem
    code, out, err = run_cli(["lab", "verify", "--ledger", str(path)], monkeypatch, capsys)
    assert code == 1 and f"record {row} " in err and out == ""


def test_a_row_rehashed_by_a_forger_breaks_the_link_from_the_next_row(tmp_path):
    """Recomputing an edited row's own hash is not enough: the next row still links to the old hash."""
    path = tmp_path / "ledger.sqlite"
    ledger = filled_ledger(path)
    r = records(ledger)[1]
    body = {**r.body, "loss": 0.01}
    forged = record_hash(r.prev_hash, r.seq, r.kind, r.key, r.created_at, body)
    execute_sql(path, "UPDATE records SET body = ?, hash = ? WHERE seq = 2", (canonical_json(body), forged))
    check = verify(ledger)
    assert check.broken_seq == 3 and "does not link to record 2" in check.problem


def test_a_deleted_row_is_named_as_missing(tmp_path):
    path = tmp_path / "ledger.sqlite"
    ledger = filled_ledger(path)
    execute_sql(path, "DELETE FROM records WHERE seq = 2")
    check = verify(ledger)
    assert check.broken_seq == 2 and "record 2 is missing" in check.problem


@pytest.mark.parametrize("edit", ["body value", "prev_hash", "hash"])
def test_append_refuses_a_broken_chain_naming_the_first_bad_row_and_adds_nothing(edit, tmp_path):
    """Appending after an edit would bury it under new rows whose hashes all check out from there on."""
    path = tmp_path / "ledger.sqlite"
    filled_ledger(path)
    execute_sql(path, EDITS[edit], (3,))
    before = records(open_ledger(path))
    with pytest.raises(ChainBroken, match=r"at record 3: record 3 \(.*moelab lab verify"):
        append(open_ledger(path), "run", "exp-a", {"event": "started"})
    assert records(open_ledger(path)) == before


@pytest.mark.parametrize("damage", ["a newer row edited", "rows cut off below it"])
def test_a_handle_that_has_appended_still_catches_damage_done_since(damage, tmp_path):
    """A handle checks only the rows after the last one it checked, yet still sees the end rewritten."""
    path = tmp_path / "ledger.sqlite"
    mine = filled_ledger(path)  # has appended (and so checked) records 1..5
    append(open_ledger(path), "metric", "exp-a", {"i": 5})  # another writer's record 6
    if damage == "a newer row edited":
        execute_sql(path, EDITS["body value"], (6,))
        message = "record 6 .* does not match its hash"
    else:
        execute_sql(path, "DELETE FROM records WHERE seq >= 4")
        message = "record 5 .* is no longer in the ledger: the chain now ends at record 3"
    with pytest.raises(ChainBroken, match=message):
        append(mine, "metric", "exp-a", {"i": 6})


def test_verify_head_finds_a_published_head_after_more_rows_and_fails_once_the_ledger_is_cut_below_it(
        tmp_path, monkeypatch, capsys):
    path = tmp_path / "ledger.sqlite"
    ledger = filled_ledger(path)
    published = verify(ledger).head_hash  # what a report or `lab show` printed at record NUM_RECORDS
    for i in range(3):
        append(ledger, "metric", "exp-a", {"i": 10 + i})

    def verify_head(given, *extra):
        return run_cli(["lab", "verify", "--ledger", str(path), "--head", given, *extra], monkeypatch, capsys)

    for given in (published, published[:12].upper()):
        code, out, err = verify_head(given)
        assert code == 0, err
        assert f"is record {NUM_RECORDS}: 3 records came after it" in out
    code, out, _ = verify_head(published, "--json")
    assert code == 0 and json.loads(out)["published_head"] == {"hash": published, "found": True,
                                                                "seq": NUM_RECORDS, "records_after": 3}

    execute_sql(path, "DELETE FROM records WHERE seq >= ?", (NUM_RECORDS,))
    assert verify(ledger).ok, "a truncated chain is still a valid chain: only the published head shows the cut"
    code, out, err = verify_head(published)
    assert code == 1 and out == ""
    assert f"no record of {path} has hash {published}" in err and "cut off the end" in err
    code, out, _ = verify_head(published, "--json")
    result = json.loads(out)
    assert code == 1 and not result["ok"] and result["published_head"]["found"] is False


@pytest.mark.parametrize("given", ["3f2a9c0e", "not-a-hash-at-all", "g" * 64])
def test_verify_head_that_is_not_a_long_enough_hex_hash_exits_2(given, tmp_path, monkeypatch, capsys):
    path = tmp_path / "ledger.sqlite"
    filled_ledger(path)
    code, out, err = run_cli(["lab", "verify", "--ledger", str(path), "--head", given], monkeypatch, capsys)
    assert code == 2 and out == "" and "is not a record hash" in err and "12 or more hex digits" in err


def test_non_finite_numbers_and_tuples_are_stored_as_plain_json_and_still_verify(tmp_path):
    ledger = open_ledger(tmp_path / "ledger.sqlite", create=True)
    record = append(ledger, "metric", "exp-a", {"loss": float("nan"), "grad": float("-inf"), "shape": (2, 3)})
    assert record.body == {"loss": "NaN", "grad": "-Infinity", "shape": [2, 3]}
    assert records(ledger)[0] == record and verify(ledger).ok


def test_an_experiment_id_can_be_registered_only_once(tmp_path):
    ledger = open_ledger(tmp_path / "ledger.sqlite", create=True)
    append(ledger, "experiment", "exp-a", {"v": 1})
    with pytest.raises(DuplicateRecord, match="exp-a"):
        append(ledger, "experiment", "exp-a", {"v": 2})
    append(ledger, "amendment", "exp-a", {"v": 2})  # other kinds repeat keys freely
    assert [r.kind for r in records(ledger)] == ["experiment", "amendment"] and verify(ledger).ok


def _append_many(path, writer, count):
    ledger = open_ledger(path, create=True)
    for i in range(count):
        append(ledger, "metric", f"writer-{writer}", {"writer": writer, "i": i})


def test_concurrent_writers_in_separate_processes_keep_one_linear_chain(tmp_path):
    path, num_writers, count = tmp_path / "lab" / "ledger.sqlite", 4, 25
    ctx = multiprocessing.get_context("spawn")  # no fork: the test session may have JAX threads running
    procs = [ctx.Process(target=_append_many, args=(path, w, count)) for w in range(num_writers)]
    for p in procs:  # every writer creates the ledger if it is missing: the creation itself races too
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * num_writers
    ledger = open_ledger(path)
    check = verify(ledger)
    assert check.ok and check.num_records == num_writers * count
    rows = records(ledger)
    for w in range(num_writers):
        assert [r.body["i"] for r in rows if r.key == f"writer-{w}"] == list(range(count))
    assert len({r.prev_hash for r in rows}) == len(rows), "two records claim the same predecessor: a fork"


def _not_a_ledger(tmp_path):
    text = tmp_path / "notes.sqlite"
    text.write_text("just some notes\n")
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE people (name TEXT)")
    conn.commit()
    conn.close()
    foreign = tmp_path / "foreign.sqlite"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.execute("INSERT INTO meta VALUES ('format', 'someone-else')")
    conn.commit()
    conn.close()
    return {"text file": (text, "not an SQLite database"),
            "other database": (other, "without moelab's meta table"),
            "foreign meta": (foreign, "format='someone-else'"),
            "directory": (tmp_path, "is a directory")}


@pytest.mark.parametrize("case", ["text file", "other database", "foreign meta", "directory"])
@pytest.mark.parametrize("command", [["verify"], ["show", "demo"], ["run", "demo", "--dry-run"]])
def test_a_file_that_is_not_a_moelab_ledger_exits_2_and_is_left_untouched(case, command, tmp_path, monkeypatch,
                                                                          capsys):
    path, message = _not_a_ledger(tmp_path)[case]
    before = path.read_bytes() if path.is_file() else None
    with pytest.raises(ConfigError, match="is not a moelab ledger"):
        open_ledger(path, create=True)
    code, out, err = run_cli(["lab", *command, "--ledger", str(path)], monkeypatch, capsys)
    assert code == 2 and "is not a moelab ledger" in err and message in err and "Traceback" not in err
    assert (path.read_bytes() if path.is_file() else None) == before


def test_a_missing_ledger_is_not_created_by_commands_that_only_read(tmp_path, monkeypatch, capsys):
    path = tmp_path / "lab" / "ledger.sqlite"
    code, _, err = run_cli(["lab", "verify", "--ledger", str(path)], monkeypatch, capsys)
    assert code == 2 and "no ledger at" in err and not path.exists()


def test_the_ledger_path_comes_from_moelab_ledger_when_no_option_is_given(tmp_path, monkeypatch, capsys):
    path = tmp_path / "elsewhere.sqlite"
    filled_ledger(path)
    monkeypatch.setenv("MOELAB_LEDGER", str(path))
    code, out, _ = run_cli(["lab", "verify", "--json"], monkeypatch, capsys)
    assert code == 0 and f'"num_records": {NUM_RECORDS}' in out
