"""SIGKILL crash test: a graph (join -> fork -> sink, plus alts) killed at random moments
in a child process, restarted, repeated; the outputs must be exactly the expected
multisets -- on the SQLite store (50 kills) and on PostgreSQL (20 kills, a database per
campaign on the session's server).  The long soak is ``python -m
dataspace.testing.pipeline_crash --kills 1000`` (``make soak``; ``--store postgresql://...``
on PostgreSQL); both use the same harness."""

from __future__ import annotations

import os
import sqlite3

import pytest

from dataspace.streams import open_store
from dataspace.testing.pipeline_crash import STORE_ENV, child, soak, verify

SEED = int(os.environ.get("CRASH_SEED", "20240611"))


KILLS = {"sqlite": 50, "postgresql": 20}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_sigkills_and_still_exactly_once(tmp_path, backend, request):
    lines = []
    extra = {}
    kills = KILLS[backend]
    if backend == "postgresql":
        pg = request.getfixturevalue("pg_server")
        name = f"crash_{os.getpid()}"
        extra = {"stores": lambda c: pg.create_database(f"{name}_{c}"),
                 "drop": lambda c: pg.drop_database(f"{name}_{c}")}
    done, results = soak(kills, base=str(tmp_path), seed=SEED, say=lines.append,
                         campaign_kills=min(kills, 50), **extra)
    assert not [p for r in results for p in r.problems], "\n".join(lines)
    assert done >= kills, "\n".join(lines)
    assert sum(r.kills_before_ready for r in results) >= 1  # some kills hit start-up/recovery
    assert sum(r.commits_seen for r in results) > done  # ...most hit a running graph


def test_the_checker_sees_duplicates_and_losses(tmp_path, store_url, monkeypatch, capsys):
    d = str(tmp_path)
    monkeypatch.setenv(STORE_ENV, store_url)
    assert child(d, 300, 3, 0, 50) == 0  # one uninterrupted run
    assert verify(d, 300, 3, store_url) == []
    with open_store(store_url) as s:
        dup = s.read("merged", 0, 1)[0]
        s.append("merged", dup.value)
    db = sqlite3.connect(tmp_path / "sink.db")
    db.execute("DELETE FROM pairs WHERE rowid = (SELECT min(rowid) FROM pairs)")
    db.commit()
    problems = verify(d, 300, 3, store_url)
    assert any(p.startswith("merged: 0 lost, 1 unexpected (1 duplicates)") for p in problems)
    assert any(p.startswith("table: 1 lost") for p in problems)


def test_a_passed_run_leaves_nothing_in_the_temporary_directory(tmp_path, monkeypatch, capsys):
    """python -m dataspace.testing.pipeline_crash once left its stores (14 MB) behind."""
    import tempfile

    from dataspace.testing.pipeline_crash import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["--kills", "2", "--campaign-kills", "2", "--messages", "200", "--seed", "1"]) == 0
    assert "PASSED: 2 SIGKILLs" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_the_harness_runs_as_python_m(tmp_path):
    """``python -m dataspace.testing.pipeline_crash`` (make soak) starts its children as
    ``python -m`` of its own module, not of ``__main__``."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "dataspace.testing.pipeline_crash", "--kills", "2",
                        "--campaign-kills", "2", "--messages", "200", "--seed", "1",
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "PASSED: 2 SIGKILLs" in r.stdout, r.stdout + r.stderr
