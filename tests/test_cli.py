"""The ``dataspace`` command line: help, the demo (the current main job) and errors."""

from __future__ import annotations

import subprocess
import sys

from dataspace.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataspace.cli", *args],
        capture_output=True, text=True, timeout=120,
    )


def test_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    assert "demo" in r.stdout and "examples:" in r.stdout


def test_every_command_has_help():
    from dataspace.cli import COMMANDS

    for name in COMMANDS:
        name = name.rstrip("_")  # assert_.py registers `assert` (a keyword in Python)
        r = run_cli(name, "--help")
        assert r.returncode == 0, (name, r.stderr)
        assert "usage: dataspace" in r.stdout


def test_demo_shows_presence_messages_and_departures():
    r = run_cli("demo", "--users", "3", "--messages", "6")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for who in ("alice", "bob", "carol"):
        assert f"+ {who} is present" in out
        assert f"- {who} left" in out
        assert f"[late-alice] sees {who}" in out
    assert out.count("  [room]     ") >= 3 + 6 + 3  # joins, messages, departures
    assert "someone is listening to carol" in out
    assert out.rstrip().endswith("done: 0 assertion(s) left besides subscriptions")


def test_demo_rejects_bad_arguments(capsys):
    assert main(["demo", "--users", "0"]) == 2
    assert "--users must be >= 1" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "usage: dataspace" in capsys.readouterr().out
