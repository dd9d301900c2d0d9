"""The README is a guide that works (issue 37): its quick start runs as written in a fresh copy of the
repository, it stays short, and its links lead somewhere.

The quick start is the one ```bash block under "## Quick start": one shell command a line, run in order
from the repository root."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 500


def quick_start() -> list[str]:
    """The quick start's commands, comments and blank lines dropped."""
    text = README.read_text()
    section = text[text.index("\n## Quick start\n"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README: no ```bash block under '## Quick start'"
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_quick_start_opens_with_the_two_commands_and_each_line_is_one_command():
    commands = quick_start()
    assert commands[:2] == ["make demo", "make test"]
    assert len(commands) >= 4 and not any(line.endswith("\\") for line in commands)


def test_the_readme_is_a_guide_of_at_most_500_lines():
    assert len(README.read_text().splitlines()) <= MAX_LINES


def test_every_relative_link_in_the_readme_leads_to_a_file_or_heading_that_exists():
    text = README.read_text()
    anchors = {re.sub(r"[^a-z0-9 _-]", "", h.lower()).strip().replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", text, re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        if path:
            assert (ROOT / path).exists(), f"README links to {path}, which is not in the repository"
        elif anchor:
            assert anchor in anchors, f"README links to #{anchor}, which no heading makes"


def _fresh_copy(where: Path) -> Path:
    """The files a clone of this tree would hold (tracked, and untracked but not ignored), with their times kept,
    and this session's venv as `.venv`: the install step itself is the `network` test's (a fresh venv's pip
    install); here the commands after it are what is checked."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        if (ROOT / name).is_file():
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, where / name)
    venv = Path(sys.prefix)
    stamp = venv / ".installed"
    assert stamp.exists() and stamp.stat().st_mtime >= (ROOT / "pyproject.toml").stat().st_mtime, (
        "the venv is older than pyproject.toml: run make test (which reinstalls it) rather than pytest alone")
    (where / ".venv").symlink_to(venv)
    return where


@pytest.mark.slow
def test_every_quick_start_command_runs_as_written_in_a_fresh_copy(tmp_path):
    """Slow: `make demo` trains the demo's ladder and target (about 2 minutes on 2 cores). `make test` is run
    dry (`make -n`): CI's first line is `make test` itself (tests/test_setup.py checks .ci/run), and a suite
    inside the suite would only run it twice. Every other line runs as written, in order."""
    clone = _fresh_copy(tmp_path / "moelab")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "XLA_FLAGS"))}  # a user's shell
    for command in quick_start():
        if command == "make test":
            done = subprocess.run(["make", "-n", "test"], cwd=clone, env=env, capture_output=True, text=True)
            assert done.returncode == 0 and "pytest" in done.stdout, done.stderr
            continue
        start = time.monotonic()
        done = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"README quick start: `{command}` exited {done.returncode}\n{done.stderr[-3000:]}"
        print(f"{command}: {time.monotonic() - start:.1f} s")
