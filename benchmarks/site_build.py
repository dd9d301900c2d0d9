"""How long `moelab lab site` takes on a large lab, and what a live rebuild touches.

    python benchmarks/site_build.py --json                      # 200 experiments, 20 evals each
    python benchmarks/site_build.py --experiments 50 --evals 5

Writes a ledger of EXPERIMENTS registered specs (a tenth amended, a tenth failed mid-run, a tenth abandoned,
a tenth still running, the rest finished), each with EVALS eval records, a mixture entry and its run events
(as `lab run` appends them; no training runs), then times: the first full build, a rebuild with nothing new,
and, after one new eval of a running experiment, the live rebuild (`only=` that experiment, what `lab run
--site` does) and a full one, with the files each wrote. Bundles are left out: these experiments have no
run folders to bundle. Prints JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import yaml

from moelab.lab.ledger import append, open_ledger
from moelab.lab.registry import amend, register
from moelab.lab.site import build_site


def spec(exp_id: str, high: float) -> dict:
    return {"id": exp_id, "title": f"Experiment {exp_id}", "owner": "bench", "question": f"Is {exp_id} below {high}?",
            "hypothesis": f"eval/mean ends below {high}.", "config": {"preset": "tiny"},
            "prediction": {"metric": "eval/mean", "band": [None, high], "decision_rule": f"Below {high}."}}


def fill(ledger, folder: Path, experiments: int, evals: int) -> list[str]:
    """The lab described above; returns the ids of the running experiments."""
    running = []
    for i in range(experiments):
        exp_id = f"exp-{i:04d}"
        path = folder / f"{exp_id}.yaml"
        path.write_text(yaml.safe_dump(spec(exp_id, 3.0 if i % 2 else 2.0)))
        register(ledger, path)
        kind = ("amended", "failed", "abandoned", "running")[i % 10] if i % 10 < 4 else "finished"
        if kind == "amended":
            path.write_text(yaml.safe_dump(spec(exp_id, 2.5)))
            amend(ledger, exp_id, path, "the band moves after a pilot")
        if kind == "abandoned":
            append(ledger, "run", exp_id, {"event": "abandoned", "reason": "budget moved"})
            continue
        step = {"step": "train", "version": "0" * 64, "output_dir": f"/nonexistent/{exp_id}", "attempt": 1}
        append(ledger, "run", exp_id, {**step, "event": "started"})
        append(ledger, "mixture", exp_id, {"run": "tiny", "step": 0, "kind": "change", "phase": "pretrain",
                                           "weights": {"code": 0.45, "prose": 0.45, "arithmetic": 0.1}})
        for k in range(evals):
            loss = 5.5 * (1 + k) ** -0.3
            append(ledger, "metric", exp_id, {"run": "tiny", "step": 10 * k, "loss": loss, "eval/mean": loss,
                                              "eval/code": loss * 0.95, "eval/prose": loss * 1.05})
        if kind == "failed":
            append(ledger, "run", exp_id, {**step, "event": "failed", "error": "RuntimeError: node lost"})
        elif kind in ("finished", "amended"):
            append(ledger, "run", exp_id, {**step, "event": "finished", "result": {"step": 10 * evals}})
        else:
            running.append(exp_id)
    return running


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", type=int, default=200)
    parser.add_argument("--evals", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ledger = open_ledger(folder / "lab.sqlite", create=True)
        running, fill_s = timed(lambda: fill(ledger, folder, args.experiments, args.evals))
        root, out = folder / "runs", folder / "site"
        first, first_s = timed(lambda: build_site(ledger, root, out, bundles=False))
        again, again_s = timed(lambda: build_site(ledger, root, out, bundles=False))
        target = running[0]
        append(ledger, "metric", target, {"run": "tiny", "step": 10 * args.evals, "loss": 1.9, "eval/mean": 1.9})
        live, live_s = timed(lambda: build_site(ledger, root, out, only=target, bundles=False))
        append(ledger, "metric", target, {"run": "tiny", "step": 10 * args.evals + 10, "loss": 1.8, "eval/mean": 1.8})
        full, full_s = timed(lambda: build_site(ledger, root, out, bundles=False))
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    result = {
        "machine": f"{platform.machine()} {platform.system()}, Python {platform.python_version()}",
        "experiments": args.experiments, "evals_each": args.evals, "ledger_records": first.head_seq,
        "fill_ledger_s": round(fill_s, 2),
        "first_build_s": round(first_s, 3), "first_build_files": len(first.written), "site_bytes": size,
        "rebuild_nothing_new_s": round(again_s, 3), "rebuild_nothing_new_written": again.written,
        "live_rebuild_after_one_eval_s": round(live_s, 3), "live_rebuild_written": live.written,
        "full_rebuild_after_one_eval_s": round(full_s, 3), "full_rebuild_written": full.written,
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
