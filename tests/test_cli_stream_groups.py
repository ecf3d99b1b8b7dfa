"""``dataspace stream group ...`` and ``dataspace stream consume`` (issue 32): consumer
groups on the command line, in-process (main) and as real processes where Ctrl-C and
restarts matter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest

from dataspace.cli import main
from dataspace.streams import open_store
from dataspace.values import parse
from test_pipeline_cli import GRAPH  # chat -> upper -> loud, errors to shout.errors

LONG = 30.0


@pytest.fixture
def data_dir(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("DATASPACE_DATA_DIR", str(tmp_path))
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def jobs(data_dir: Any, n: int) -> None:
    with open_store(data_dir) as s:
        s.append_many("jobs", [parse(f"<job {i}>") for i in range(n)])


def test_create_consume_ack_ls_info_rm(data_dir: Any, capsys: pytest.CaptureFixture[str]) -> None:
    jobs(data_dir, 5)
    code, out, _ = run(capsys, "stream", "group", "create", "jobs", "workers", "--max-deliveries", "3")
    assert code == 0
    assert out == ("created group workers on jobs, first delivering index 0 (idle timeout 30s, "
                   "after 3 deliveries to jobs.dead, holds retention)\n")
    code, out, err = run(capsys, "stream", "consume", "jobs", "-g", "workers", "-c", "w1", "-n", "2")
    assert code == 0 and out == "0  <job 0>\n1  <job 1>\n"
    assert "delivered 2 entries to w1 of group workers, left pending" in err
    code, out, err = run(capsys, "stream", "consume", "jobs", "-g", "workers", "-c", "w2", "--ack",
                         "--timeout", "0.2", "--json")
    assert code == 0
    got = [json.loads(line) for line in out.splitlines()]
    assert [(r["index"], r["text"], r["value"], r["deliveries"]) for r in got] == [
        (i, f"<job {i}>", {"@record": "job", "@fields": [i]}, 1) for i in (2, 3, 4)]
    assert "delivered 3 entries to w2 of group workers, 3 acknowledged" in err
    code, out, _ = run(capsys, "stream", "group", "ls")
    assert code == 0
    assert out.splitlines()[0].split() == ["STREAM", "GROUP", "POSITION", "LAG", "PENDING",
                                           "CONSUMERS", "OLDEST"]
    assert out.splitlines()[1].split()[:6] == ["jobs", "workers", "5", "0", "2", "1"]
    code, out, _ = run(capsys, "stream", "group", "ls", "jobs", "workers")
    assert "consumers\n  w1 " in out and "pending entries\n  0 " in out
    code, out, _ = run(capsys, "stream", "group", "ls", "jobs", "workers", "--json")
    (g,) = json.loads(out)
    assert (g["next"], g["lag"], g["pending"], g["max_deliveries"]) == (5, 0, 2, 3)
    assert [e["index"] for e in g["entries"]] == [0, 1] and g["consumers"][0]["name"] == "w1"
    code, out, _ = run(capsys, "stream", "info", "jobs")
    assert "groups\n  workers " in out and "pending 2" in out and "\n    w1 " in out
    code, out, _ = run(capsys, "stream", "info", "jobs", "--check")
    assert code == 0 and "1 consumer group (2 pending entries) read and verified" in out
    code, out, _ = run(capsys, "stream", "ls", "--json")
    assert json.loads(out)[0]["groups"][0]["pending"] == 2
    code, out, _ = run(capsys, "stream", "group", "ack", "jobs", "workers", "1", "4")
    assert code == 0 and out == "acknowledged 1 of 2 (1 was not pending)\n"
    code, out, _ = run(capsys, "stream", "rm", "jobs")
    assert code == 0
    assert out == "removed jobs (5 entries, 0 tailers, 1 consumer group with 1 pending entry)\n"


def test_mistakes_are_one_line_errors(data_dir: Any, capsys: pytest.CaptureFixture[str]) -> None:
    jobs(data_dir, 1)
    code, _, err = run(capsys, "stream", "consume", "jobs", "-g", "nope", "-c", "x")
    assert code == 1
    assert err == ("dataspace stream: no consumer group 'nope' on 'jobs'; create it: dataspace "
                   "stream group create jobs nope\n")
    code, _, err = run(capsys, "stream", "consume", "jbos", "-g", "w", "-c", "x")
    assert code == 1 and "no stream named 'jbos'" in err
    code, _, err = run(capsys, "stream", "group", "create", "jobs", "w", "--start", "9")
    assert code == 1 and "cannot start at index 9: the stream's next index is 1" in err
    code, _, err = run(capsys, "stream", "group", "create", "jobs", "w", "--start", "first")
    assert code == 1 and "give earliest, latest or an index" in err
    assert run(capsys, "stream", "group", "create", "jobs", "w")[0] == 0
    code, _, err = run(capsys, "stream", "group", "create", "jobs", "w")
    assert code == 1 and "has a consumer group 'w' already" in err
    code, _, err = run(capsys, "stream", "group", "rm", "jobs", "v")
    assert code == 1 and "no consumer group 'v'" in err and len(err.splitlines()) == 1
    code, _, err = run(capsys, "stream", "group", "create", "__x", "w")
    assert code == 1 and "reserved" in err
    with pytest.raises(SystemExit) as e:
        main(["stream", "consume", "jobs", "-g", "w"])  # no consumer
    assert e.value.code == 2


def cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "dataspace.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def first_line(p: subprocess.Popen[str]) -> str:
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(p.stdout.readline()))  # type: ignore[union-attr]
    t.start()
    t.join(LONG)
    assert got and got[0], "nothing printed"
    return got[0]


def test_consume_follows_appends_stops_on_ctrl_c_and_a_restart_gets_its_own_first(data_dir: Any) -> None:
    jobs(data_dir, 0)
    assert main(["stream", "group", "create", "jobs", "workers"]) == 0
    p = cli("stream", "consume", "jobs", "-g", "workers", "-c", "w1")
    with open_store(data_dir) as s:
        s.append("jobs", parse("<job 0>"))  # woken by the append
        assert first_line(p) == "0  <job 0>\n"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=LONG)
        assert p.returncode == 0 and out == ""
        assert "delivered 1 entry to w1 of group workers, left pending" in err
        assert "(interrupted)" in err and "Traceback" not in err
        s.append("jobs", parse("<job 1>"))
    # w1 again: its pending entry 0 first, delivered a second time, then 1.
    r = subprocess.run([sys.executable, "-m", "dataspace.cli", "stream", "consume", "jobs", "-g",
                        "workers", "-c", "w1", "--ack", "--timeout", "0.3", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["index"], x["deliveries"]) for x in got] == [(0, 2), (1, 1)]
    with open_store(data_dir) as s:
        assert s.group_info("jobs", "workers").pending == 0


def test_pipeline_reset_says_what_becomes_of_consumer_groups(data_dir: Any, tmp_path: Any,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "graph.py").write_text(GRAPH)
    graph = str(tmp_path / "graph.py")
    assert main(["stream", "append", "chat", '<Says "a" "x">', '<Says "b" "y">']) == 0
    assert main(["pipeline", "run", graph, "--engine", "local", "--until-idle", "-q"]) == 0
    with open_store(data_dir) as s:
        s.group("loud", "mailers").consumer("m").read(1)  # one pending
        s.group("chat", "audit")
    capsys.readouterr()
    assert main(["pipeline", "reset", graph, "--keep-outputs", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ("consumer groups of kept outputs, left where they are (they get the reprocessed "
            "results as new entries): loud (mailers with 1 pending)") in out
    assert "consumer groups of its sources, not touched: chat (audit)" in out
    assert main(["pipeline", "reset", graph, "--delete-outputs"]) == 0
    out = capsys.readouterr().out
    assert "consumer groups removed with their streams: loud (mailers with 1 pending)" in out
    with open_store(data_dir) as s:
        assert [g.name for g in s.groups()] == ["audit"]
