"""The open lab: every experiment pre-registered, executed reproducibly and kept on the record.

Modules, each importing only those above it (and lower layers):

- `ledger`: the append-only, hash-chained SQLite record (experiments, amendments, runs, metrics, ...).
- `registry`: experiment specs, pre-registration, amendments and their issue-ready Markdown; the verdict
  (`verdict`, CONFIRMED / REFUTED / INCONCLUSIVE) and how a band is printed (`band_text`).
- `dag`: steps with versioned configs in content-hashed directories; local and Ray backends.
- `tracking`: sinks that stream a run's metrics, incidents and mixture log onto the ledger (and W&B).
- `experiment`: an experiment's spec turned into such a DAG (ladder rungs, fit, main run) and run
  with its events on the ledger.
- `view`: the data layer: what an experiment's records and run directory say, read once for the report,
  the site and `lab verify` (the one reader of prediction.csv, the run-directory lookup, metric series and
  a run's observed value).
- `plots`: the one plot stack, SVG as text: the site's curves and the report's figures.
- `report`: the report's sections as report.json, and report.html / report.md rendered from it.
- `compare`: what two experiments differ in (`lab show --diff`).
- `bundle`: an experiment exported as a portable bundle (`lab export`), and opening one.
- `site`: the static notebook of every experiment on a ledger (index, timeline, a page each, inline SVG).
- `verify`: checking a bundle alone (`lab verify BUNDLE`): hashes, chain, steps, report.json.
- `reproduce`: rerunning a bundle's training steps at the recorded commit and comparing (`lab reproduce`).
- `demo`: one spec registered (once), run and reported: what `moelab demo` does.

The `moelab lab` and `moelab demo` commands live in `moelab.cli`.

Nothing here imports Ray or JAX at import time: Ray loads only for `--backend ray`, JAX only when a
training step runs.
"""
