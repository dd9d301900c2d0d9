"""The CSV contract: the files a ladder's curves come in and its prediction goes out in.

    moelab ladder fit --curves CURVES.csv --target TARGET.csv --out PRED.csv

    CURVES.csv  run,params,step,tokens,lr,loss     every checkpoint of every rung (>= 2 runs)
    TARGET.csv  run,params,step,tokens,lr          the planned schedule of the run(s) to predict
    PRED.csv    TARGET.csv's rows and columns + loss_pred,lo80,hi80,lo95,hi95

`params` is the run's active non-embedding parameter count (`accounting.count_params(...).active`),
`tokens` what the run has trained on once that step is done, `lr` the LR used at that step. Rows of
one run have strictly increasing steps; the LR is taken as linear between rows, so log a row at the
end of warmup and at each schedule break (or at every logged step). Extra columns are ignored and
carried into PRED.csv. A band value is "nan" where the law says nothing (no tokens trained yet).

Beside PRED.csv lies its sidecar, PRED.json (`sidecar_path`): the fit's summary (`predict.fit_curves`),
whose `noise` the on-track watcher and whose `self_check` the report read back. Each file is written
whole (`moelab.files`): a reader finds the old one or the new one, never half of either.

This module owns the prediction: its file name (`PREDICTION`, what `moelab ladder run` writes and what a
run watched against it keeps a copy under, `keep_copy`), its columns, and its readers: `load_prediction`
(the rows), `read_band` (the band a page draws), `read_sidecar` and `self_check`. Nothing else parses
these files.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from moelab.errors import DataError
from moelab.files import atomic_open, atomic_path, write_text
from moelab.ladder.curve import Run

__all__ = [
    "PREDICTION",
    "CURVE_COLUMNS",
    "TARGET_COLUMNS",
    "INTERVAL_COLUMNS",
    "BAND_COLUMNS",
    "BAND_SERIES",
    "read_band",
    "read_sidecar",
    "self_check",
    "trust",
    "trust_text",
    "keep_copy",
    "read_curves",
    "read_target",
    "TargetTable",
    "read_target_table",
    "write_prediction",
    "load_prediction",
    "sidecar_path",
    "size_scale_of",
]

CURVE_COLUMNS = ("run", "params", "step", "tokens", "lr", "loss")
TARGET_COLUMNS = ("run", "params", "step", "tokens", "lr")
INTERVAL_COLUMNS = ("lo80", "hi80", "lo95", "hi95")
BAND_COLUMNS = ("loss_pred", *INTERVAL_COLUMNS)
BAND_SERIES = ("step", *BAND_COLUMNS)  # what a plot of the band reads, by `read_band`
PREDICTION = "prediction.csv"  # a ladder run's PRED.csv, and the copy a run watched against it keeps


def _load(path: str | Path, columns: Sequence[str], what: str) -> tuple[list[str], list[tuple[int, dict]]]:
    """(header, [(line number, row)]) of a CSV that has at least `columns`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} file {path} does not exist; pass a CSV with columns {','.join(columns)}.")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames:
            raise DataError(f"{path} is empty; expected a header row {','.join(columns)} and one row per step.")
        header = [name.strip() for name in reader.fieldnames]
        reader.fieldnames = header
        missing = [c for c in columns if c not in header]
        if missing:
            raise DataError(f"{path} lacks column(s) {', '.join(missing)}; it has {', '.join(header)}. "
                            f"The {what} file needs {','.join(columns)}.")
        table = []
        for row in reader:
            if None in row or None in row.values():
                raise DataError(f"{path} line {reader.line_num}: the row has a different number of fields "
                                f"than the header ({len(header)}).")
            table.append((reader.line_num, row))
    if not table:
        raise DataError(f"{path} has a header but no rows; the {what} file needs one row per step.")
    return header, table


def _number(path: Path, line: int, row: dict, column: str, allow_nan: bool = False) -> float:
    text = row[column].strip()
    try:
        value = float(text)
    except ValueError:
        raise DataError(f"{path} line {line}, column {column!r}: {text!r} is not a number.") from None
    if not math.isfinite(value) and not (allow_nan and math.isnan(value)):
        raise DataError(f"{path} line {line}, column {column!r}: {text!r} is not finite; drop that row.")
    return value


def _to_runs(path: str | Path, table: list[tuple[int, dict]],
             with_loss: bool) -> tuple[list[Run], dict[str, list[int]]]:
    """Runs in order of first appearance, and for each run the indices of its rows in `table`."""
    path = Path(path)
    where: dict[str, list[int]] = {}
    for i, (line, row) in enumerate(table):
        name = row["run"].strip()
        if not name:
            raise DataError(f"{path} line {line}: column 'run' is empty; every row names its run.")
        where.setdefault(name, []).append(i)
    columns = ("params", "step", "tokens", "lr") + (("loss",) if with_loss else ())
    runs = []
    for name, indices in where.items():
        values = {c: np.array([_number(path, *table[i][:2], c) for i in indices]) for c in columns}
        params = values["params"]
        if np.any(params != params[0]):
            j = int(np.argmax(params != params[0]))
            raise DataError(f"{path} line {table[indices[j]][0]}: run {name!r} changes params from {params[0]:g} "
                            f"to {params[j]:g}; a run has one size (split it into two runs).")
        try:
            runs.append(Run(name, float(params[0]), values["step"], values["tokens"], values["lr"],
                            values["loss"] if with_loss else None))
        except DataError as err:
            raise DataError(f"{path}: {err}") from err
    return runs, where


def read_curves(path: str | Path) -> list[Run]:
    """The rungs' checkpoints from CURVES.csv (`CURVE_COLUMNS`), validated."""
    return _to_runs(path, _load(path, CURVE_COLUMNS, "curves")[1], with_loss=True)[0]


def read_target(path: str | Path) -> list[Run]:
    """The planned run(s) from TARGET.csv (`TARGET_COLUMNS`), validated."""
    return read_target_table(path).runs


class TargetTable(NamedTuple):
    """TARGET.csv as PRED.csv copies it: its columns and rows, extra ones included, and the runs they plan."""

    header: list[str]
    rows: list[dict]  # as read, text
    runs: list[Run]
    where: dict[str, list[int]]  # each run's rows, as indices into `rows`


def read_target_table(path: str | Path) -> TargetTable:
    """TARGET.csv's rows and its planned runs (`read_target`), validated."""
    header, table = _load(path, TARGET_COLUMNS, "target")
    runs, where = _to_runs(path, table, with_loss=False)
    return TargetTable(header, [row for _, row in table], runs, where)


def write_prediction(path: Path, target: TargetTable, predictions: Mapping[str, Mapping[str, np.ndarray]],
                     summary: dict) -> None:
    """PRED.csv, TARGET.csv's rows with each run's `predictions` (BAND_COLUMNS -> one value per row), and its
    sidecar holding `summary`; each appears whole."""
    rows = [dict(row) for row in target.rows]
    for name, indices in target.where.items():
        for k, i in enumerate(indices):
            rows[i].update({c: _format(float(predictions[name][c][k])) for c in BAND_COLUMNS})
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(sidecar_path(path), json.dumps(summary, indent=2) + "\n")
    with atomic_open(path, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=target.header + list(BAND_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)


def _format(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.6f}"


def load_prediction(path: str | Path) -> list[dict]:
    """PRED.csv's rows: `run` as text, every other contract column as a float (bands may be NaN)."""
    path = Path(path)
    _, table = _load(path, TARGET_COLUMNS + BAND_COLUMNS, "prediction")
    numeric = TARGET_COLUMNS[1:] + BAND_COLUMNS
    return [{"run": row["run"].strip(), **{c: _number(path, line, row, c, allow_nan=c in BAND_COLUMNS)
                                           for c in numeric}} for line, row in table]


def sidecar_path(pred_path: str | Path) -> Path:
    """PRED.csv's sidecar JSON (the fit summary, the noise and the self-check): PRED.json beside it."""
    return Path(pred_path).with_suffix(".json")


def read_band(path: str | Path) -> dict[str, list[float]]:
    """`BAND_SERIES` -> one value per row of PRED.csv: the predicted band a page draws. DataError when the
    file is not a prediction or holds no rows."""
    rows = load_prediction(path)
    if not rows:
        raise DataError(f"prediction file {path} holds no rows; refit with `moelab ladder fit`.")
    return {c: [float(r[c]) for r in rows] for c in BAND_SERIES}


def read_sidecar(pred_path: str | Path) -> dict | None:
    """PRED.csv's sidecar as written by `write_prediction`; None when there is none, DataError naming the file
    when it is not that JSON object."""
    path = sidecar_path(pred_path)
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{path} is not the sidecar `moelab ladder fit` writes ({err}); delete it or refit.") from None
    if not isinstance(summary, dict):
        raise DataError(f"{path} is not the sidecar `moelab ladder fit` writes (not a JSON object); delete it or refit.")
    return summary


def self_check(pred_path: str | Path) -> dict | None:
    """The fit's leave-largest-out self-check from PRED.csv's sidecar; None when the sidecar or the check is
    missing or unreadable (a page then says nothing about trust rather than failing)."""
    try:
        summary = read_sidecar(pred_path)
    except DataError:
        return None
    check = (summary or {}).get("self_check")
    return check if isinstance(check, dict) else None


def trust(pred_path: str | Path) -> dict | None:
    """What a verdict should carry about the prediction behind it: the predicted final value of the (first) target,
    its 95% band, and the self-check's verdict ("passed", "failed", "uninformative" or "skipped"; `trusted` only
    when passed). None when the sidecar is missing or unreadable."""
    try:
        summary = read_sidecar(pred_path)
    except DataError:
        return None
    targets = (summary or {}).get("targets") or []
    if not targets or not isinstance(targets[0], dict):
        return None
    final, check = targets[0], (summary.get("self_check") or {})
    status = "skipped" if "skipped" in check else check.get("verdict") or ("passed" if check.get("trusted") else "failed")
    return {"predicted": final.get("loss_pred"), "lo95": final.get("lo95"), "hi95": final.get("hi95"),
            "self_check": status, "trusted": status == "passed"}


def trust_text(t: dict | None, verdict: str | None = None) -> str:
    """`trust` as one sentence for a terminal, a page or a report; with the experiment's `verdict` ("confirmed",
    "refuted"), a second one when the prediction is not trusted: the verdict is the pre-registered threshold's
    alone, so a reader does not take a CONFIRMED beside an untrusted prediction as the ladder's success."""
    if t is None:
        return "No ladder prediction stands behind this run."
    if verdict in ("confirmed", "refuted") and t["self_check"] != "passed":
        return (f"{trust_text(t)} The verdict, {verdict.upper()}, is the pre-registered threshold's alone: the "
                "ladder's prediction beside it is not trusted, so it neither supports nor undercuts it.")
    status = t["self_check"]
    meaning = {"passed": "trusted", "failed": "not trusted (the law missed its own largest rung)",
               "uninformative": "not trusted (the check's band is too wide to tell a good recipe from a bad one)",
               "skipped": "unchecked (too few rung sizes to hold one out)"}.get(status, "not trusted")
    return (f"Ladder prediction {t['predicted']:.3f} (95% band {t['lo95']:.3f}-{t['hi95']:.3f}); self-check "
            f"{status.upper()}, so {meaning}.")


def keep_copy(pred_path: str | Path, run_dir: str | Path) -> Path:
    """Copy PRED.csv and its sidecar into `run_dir` as `PREDICTION` (each written whole), the name every reader
    of a run's prediction looks up; returns the copy's path. A file already there is the copy itself."""
    source, copy = Path(pred_path), Path(run_dir) / PREDICTION
    copy.parent.mkdir(parents=True, exist_ok=True)
    for src, dst in ((source, copy), (sidecar_path(source), sidecar_path(copy))):
        if src.is_file() and src.resolve() != dst.resolve():
            with atomic_path(dst) as tmp:
                shutil.copyfile(src, tmp)
    return copy


def size_scale_of(noise: dict) -> tuple[float, float]:
    """(size_exponent, ref_params) of a sidecar's `noise`, for `fit.noise_scale`: (0, 1), no scaling,
    for a sidecar written before noise scaled with size. ValueError for values `ladder fit` never writes."""
    exponent, ref = noise.get("size_exponent", 0.0), noise.get("ref_params", 1.0)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (exponent, ref)) \
            or ref <= 0:
        raise ValueError(f"noise.size_exponent={exponent!r}, noise.ref_params={ref!r}")
    return float(exponent), float(ref)
