"""How long the test suite takes: wall time, test counts and the slowest tests, as JSON.

    python benchmarks/suite_time.py --json                    # `make test`
    python benchmarks/suite_time.py --json --target check     # `make check`; `--target test-slow` or `test-all` too
    python benchmarks/suite_time.py --workers 0               # `make test` in one process, no pytest-xdist

Runs the Makefile's own target, adding only a durations table (and `--workers`) through its PYTEST_ARGS,
so the figure is the one a contributor waits for, and reads pytest's own summary line and its
`--durations` table from the output. The wall time includes pytest's start-up and collection but not
`make`'s install step (the README's figures are measured after the first install).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|error|errors|xfailed|xpassed)")
_DURATION = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)")


def make_command(target: str, workers: int | None, slowest: int) -> list[str]:
    """`make TARGET` with a durations table; `workers` overrides the Makefile's `-n` (pytest takes the last)."""
    extra = f"-p no:cacheprovider --durations={slowest} --durations-min=0"
    if workers is not None:
        extra += f" -n {workers}"
    return ["make", "-s", target, f"PYTEST_ARGS={extra}"]


def parse_counts(output: str) -> dict[str, int]:
    """pytest's closing line ('1038 passed, 2 deselected in 400.1s') as {'passed': 1038, ...}."""
    lines = [line for line in output.splitlines() if " in " in line and _COUNT.search(line)]
    if not lines:
        return {}
    counts = {}
    for number, word in _COUNT.findall(lines[-1]):
        counts["errors" if word == "error" else word] = int(number)
    return counts


def parse_durations(output: str, slowest: int) -> list[dict]:
    """The `--durations` table's rows, slowest first, setup and call kept apart (a fixture's cost shows on
    its first user's setup row)."""
    rows = []
    for line in output.splitlines():
        match = _DURATION.match(line)
        if match:
            rows.append({"seconds": float(match.group(1)), "phase": match.group(2), "test": match.group(3)})
    return sorted(rows, key=lambda row: -row["seconds"])[:slowest]


def parse_failures(output: str) -> list[str]:
    """pytest's short summary lines for what failed (`FAILED tests/x.py::test - why`, `ERROR ...`), so a
    measurement of a failing suite says which tests to look at."""
    return [line.strip() for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="test", choices=["test", "check", "test-slow", "test-all"], help="the make target")
    parser.add_argument("--workers", type=int, default=None,
                        help="pytest-xdist workers instead of the Makefile's (0: one process)")
    parser.add_argument("--slowest", type=int, default=20, help="how many of the slowest tests to list")
    parser.add_argument("--json", action="store_true", help="print only the JSON figures")
    args = parser.parse_args()

    command = make_command(args.target, args.workers, args.slowest)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    output = done.stdout + done.stderr
    figures = {
        "command": " ".join(command),
        "exit_code": done.returncode,
        "wall_s": round(wall, 1),
        "counts": parse_counts(output),
        "failures": parse_failures(output),
        "slowest": parse_durations(output, args.slowest),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "processor": platform.machine()},
    }
    if not args.json:
        print(output[-4000:], file=sys.stderr)
    print(json.dumps(figures, indent=2))
    return 0 if done.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
