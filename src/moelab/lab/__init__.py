"""The open lab: every experiment pre-registered, executed reproducibly and kept on the record.

- `ledger`: the append-only, hash-chained SQLite record (experiments, amendments, runs, metrics, ...).
- `registry`: experiment specs, pre-registration, amendments and their issue-ready Markdown.
- `dag`: steps with versioned configs in content-hashed directories; local and Ray backends.
- `experiment`: an experiment's spec turned into such a DAG (ladder rungs, fit, main run) and run
  with its events on the ledger.
- `demo`: one spec registered (once), run and reported: what `moelab demo` does.

The `moelab lab` and `moelab demo` commands live in `moelab.cli`.

Nothing here imports Ray or JAX at import time: Ray loads only for `--backend ray`, JAX only when a
training step runs.
"""
