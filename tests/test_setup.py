"""The set-up behind `make test` (issue 37): Chromium, which the report and site tests load pages in, is
installed by the make targets where the machine can, and otherwise the run stops before its first test with
one line that says what to install. Checked with stand-ins for `id`, `apt-get` and `chromium` on a PATH of
their own, so nothing is installed and the real machine's browser is out of sight."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "need-chromium"


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!{shutil.which('bash')}\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def bin_dir(tmp_path):
    """A PATH with bash, env and make only: no chromium, no apt-get, unless a test adds a stand-in."""
    where = tmp_path / "bin"
    where.mkdir()
    for tool in ("bash", "env", "make"):
        (where / tool).symlink_to(shutil.which(tool))
    return where


def _run(bin_dir: Path, *args: str, uid: int = 1000) -> subprocess.CompletedProcess:
    _fake(bin_dir, "id", f"echo {uid}")
    return subprocess.run(list(args), env={"PATH": str(bin_dir), "HOME": str(bin_dir)},
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_a_machine_with_chromium_passes_silently(bin_dir):
    _fake(bin_dir, "chromium", "exit 0")
    done = _run(bin_dir, str(bin_dir / "bash"), str(SCRIPT))
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_without_root_it_stops_with_one_line_that_says_what_to_install(bin_dir):
    _fake(bin_dir, "apt-get", f"touch {bin_dir}/apt-ran; exit 0")
    done = _run(bin_dir, str(bin_dir / "bash"), str(SCRIPT), uid=1000)
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "apt-get install chromium" in done.stderr
    assert not (bin_dir / "apt-ran").exists()


def test_as_root_with_apt_it_installs_debians_chromium_once(bin_dir):
    """The stand-in apt-get records its arguments and, on install, puts a chromium on the PATH."""
    _fake(bin_dir, "apt-get", f'echo "$*" >> {bin_dir}/apt.log; '
                              f'[ "$1" = install ] && printf "#!/bin/sh\\n" > {bin_dir}/chromium && '
                              f'chmod +x {bin_dir}/chromium; exit 0')
    done = _run(bin_dir, str(bin_dir / "bash"), str(SCRIPT), uid=0)
    assert done.returncode == 0, done.stderr
    calls = (bin_dir / "apt.log").read_text().splitlines()
    assert calls[0].startswith("update") and calls[1].split()[-1] == "chromium" and "-y" in calls[1]
    again = _run(bin_dir, str(bin_dir / "bash"), str(SCRIPT), uid=0)  # now present: apt is not asked again
    assert again.returncode == 0 and len((bin_dir / "apt.log").read_text().splitlines()) == 2


def test_as_root_a_failed_install_stops_with_one_line(bin_dir):
    _fake(bin_dir, "apt-get", "exit 100")
    done = _run(bin_dir, str(bin_dir / "bash"), str(SCRIPT), uid=0)
    *progress, error = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(progress) == 1 and error.startswith("error:")  # what it tried, then why not
    assert "failed" in error and "apt-get install chromium" in done.stderr


@pytest.mark.parametrize("target", ["test", "test-slow", "test-all"])
def test_make_stops_before_the_first_test_when_chromium_cannot_be_had(bin_dir, target):
    """The make targets, not .ci/run, own the set-up: a test target without a browser never starts pytest."""
    ran = bin_dir / "pytest-ran"
    done = _run(bin_dir, str(bin_dir / "make"), "-s", target, "STAMP=", f"PYTEST=touch {ran}", uid=1000)
    assert done.returncode != 0 and not ran.exists()
    assert "apt-get install chromium" in done.stderr


def test_ci_runs_make_test_and_installs_nothing_itself():
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert "make test" in commands and "make test-slow" in commands
    assert not any(word in line for line in commands for word in ("apt-get", "pip ", "install"))
