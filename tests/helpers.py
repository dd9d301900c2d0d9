"""Helpers shared by test modules (importable because pytest puts tests/ on sys.path for conftest.py)."""

import sys


def run_cli(args, monkeypatch, capsys):
    """Run `moelab ARGS` in-process as a user would; returns (exit code, stdout, stderr)."""
    from moelab import cli

    monkeypatch.setattr(sys, "argv", ["moelab", *args])
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err
