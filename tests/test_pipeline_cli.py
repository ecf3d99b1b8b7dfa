"""``dataspace pipeline run|status|check`` end to end, on the local engine (``--engine
local``; the Spark engine, the default, is tested in test_spark_engine.py)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading

import pytest

from dataspace.cli import main
from dataspace.cli.pipeline import LOG_GAP, _Progress, format_progress
from dataspace.pipeline import ProcStats
from dataspace.streams import open_store
from dataspace.values import parse

LONG = 60.0

GRAPH = """
from dataspace.pipeline import Graph
from dataspace.values import Record, Symbol

graph = Graph("shout", error_stream="shout.errors")
graph.source("chat")

@graph.map("upper", "chat", "loud")
def upper(v):
    who, text = v.fields
    return Record(Symbol("Shout"), [who, text.upper()])
"""


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("DATASPACE_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "graph.py").write_text(GRAPH)
    return tmp_path


def test_check_and_run_until_idle(env, capsys):
    assert main(["stream", "append", "chat", '<Says "alice" "hi">', "42"]) == 0
    assert main(["pipeline", "check", str(env / "graph.py")]) == 0
    assert "graph 'shout' is valid: 1 processor, 3 streams" in capsys.readouterr().out
    assert main(["pipeline", "run", str(env / "graph.py"), "--until-idle", "--engine", "local"]) == 0
    out = capsys.readouterr().out
    assert "running graph 'shout' (1 processor, exactly-once, engine local" in out
    assert "upper in 2 out 1 err 1 lag chat:0" in out  # the plain progress line (no tty)
    assert "idle: 2 messages in, 1 out" in out
    with open_store(env / "data") as s:
        assert [e.value for e in s.read("loud")] == [parse('<Shout "alice" "HI">')]
        assert s.read("shout.errors")[0].value.fields[1] == "AttributeError"
    assert main(["pipeline", "status", str(env / "graph.py")]) == 0
    out = capsys.readouterr().out
    assert "not running" in out and "last step delivered (1d+3a)" in out and "lag 0" in out
    assert "error stream shout.errors: 1 record\n" in out


def test_status_and_check_as_json(env, capsys):
    """`pipeline status --json` and `check --json`: one object each, what the text says."""
    import json

    assert main(["stream", "append", "chat", '<Says "alice" "hi">', "42", "7"]) == 0
    capsys.readouterr()
    assert main(["pipeline", "status", str(env / "graph.py"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["graph"] == "shout" and doc["running"] is False and doc["holder"] is None
    [p] = doc["processors"]
    assert (p["name"], p["kind"], p["last_step"], p["recovery"]) == ("upper", "map", "never ran", "1a")
    assert p["inputs"] == [{"stream": "chat", "position": None, "next": 3, "lag": None}]
    assert main(["pipeline", "run", str(env / "graph.py"), "--until-idle", "--engine", "local",
                 "-q", "--batch", "2"]) == 0
    assert main(["stream", "append", "chat", '<Says "bob" "yo">']) == 0
    capsys.readouterr()
    assert main(["pipeline", "status", str(env / "graph.py"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    [p] = doc["processors"]
    assert (p["last_step"], p["recovery"], p["spark"]) == ("delivered", "1e+3a", None)
    assert p["inputs"] == [{"stream": "chat", "position": 3, "next": 4, "lag": 1}]
    assert doc["error_stream"] == {"name": "shout.errors", "records": 2}
    assert main(["pipeline", "check", str(env / "graph.py"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["graph"] == "shout" and doc["valid"] is True
    assert doc["processors"] == [{"name": "upper", "kind": "map", "inputs": ["chat"],
                                  "outputs": ["loud"]}]
    # The text says the same.
    assert main(["pipeline", "status", str(env / "graph.py")]) == 0
    out = capsys.readouterr().out
    assert "last step delivered (1e+3a)" in out and "position 3        lag 1" in out
    assert "error stream shout.errors: 2 records" in out


@pytest.mark.parametrize("text, message", [
    ("graph = 1 +", "syntax error"),
    ("raise RuntimeError('no config')", "loading the graph raised RuntimeError: no config"),
    ("x = 1", "does not define a graph"),
    ("from dataspace.pipeline import Graph\ngraph = Graph('g')\ngraph.source('a')\n"
     "graph.map('m', 'b', 'c', lambda v: v)", "reads unknown stream 'b'"),
    ("from dataspace.pipeline import Graph\ngraph = Graph('g')\ngraph.source('a')\n"
     "graph.alts('m', ['a', 'c'], 'b', lambda v: v)\ngraph.map('n', 'b', 'c', lambda v: v)",
     "cycle"),
])
def test_bad_graph_files_are_rejected_before_running(env, capsys, text, message):
    (env / "bad.py").write_text(text)
    assert main(["pipeline", "run", str(env / "bad.py"), "--engine", "local"]) == 2
    assert message in capsys.readouterr().err
    assert not (env / "data" / "streams.sqlite3").exists()  # nothing ran


def test_missing_graph_file(env, capsys):
    assert main(["pipeline", "check", str(env / "nope.py")]) == 2
    assert "no graph file" in capsys.readouterr().err


def test_failing_processor_without_error_stream(env, capsys):
    (env / "g.py").write_text(
        "from dataspace.pipeline import Graph\ngraph = Graph('g')\ngraph.source('in')\n"
        "graph.map('inv', 'in', 'out', lambda v: 1 // v)\n"
    )
    main(["stream", "append", "in", "1", "0", "2"])
    capsys.readouterr()
    assert main(["pipeline", "run", str(env / "g.py"), "--until-idle", "--batch", "1", "--engine", "local"]) == 1
    err = capsys.readouterr().err
    # Which processor, which entry, which line of the user's code, what it raised: said
    # once, by its full name (the engine's log said "g/inv stopped", then the command
    # "inv stopped" again).
    assert ("processor g/inv stopped: map 'inv' failed on entry in/1: g.py:4: ZeroDivisionError: "
            "integer division or modulo by zero (its input is kept") in err
    assert err.count("stopped") == 1, err
    main(["stream", "append", "in", "0"])
    r = subprocess.run([sys.executable, "-m", "dataspace.cli", "pipeline", "run", str(env / "g.py"),
                        "--until-idle", "--batch", "1", "--engine", "local"],
                       capture_output=True, text=True, timeout=LONG)
    assert r.returncode == 1 and r.stderr.count(" stopped: ") == 1, r.stderr
    assert r.stderr.startswith("dataspace pipeline: processor g/inv stopped: "), r.stderr
    assert "-v shows the traceback" in err and "Traceback" not in err
    with open_store(env / "data") as s:
        assert [e.value for e in s.read("out")] == [1]
        assert s.position("in", "g/inv") == 1
    r = subprocess.run([sys.executable, "-m", "dataspace.cli", "pipeline", "run", str(env / "g.py"),
                        "--until-idle", "--engine", "local", "-v"],
                       capture_output=True, text=True, timeout=LONG)
    assert r.returncode == 1
    assert "Traceback (most recent call last):" in r.stderr and f'{env / "g.py"}", line 4, in <lambda>' in r.stderr
    assert "dataspace/pipeline/local.py" not in r.stderr  # the user's frames only


def test_format_progress():
    stats = [ProcStats("j", "join", 1200, 600, 3, 2, {"a": 0, "b": 12}),
             ProcStats("f", "fork", 5, 0, 0, 1, {"x": 1}, state="failed")]
    assert format_progress(stats, 1234.4) == (
        "j in 1,200 out 600 err 3 lag a:0 b:12 | f in 5 out 0 lag x:1 FAILED | 1,234 msg/s"
    )


def test_progress_in_a_log_prints_only_changes():
    out = io.StringIO()
    show = _Progress(out, quiet=False)
    idle = [ProcStats("p", "map", 0, 0, 0, 0, {"a": 5})]
    for _ in range(3):  # e.g. while Spark starts: one line, not three
        show(idle)
    show([ProcStats("p", "map", 5, 5, 0, 1, {"a": 0})])
    show([ProcStats("p", "map", 5, 5, 0, 1, {"a": 0})])
    lines = out.getvalue().splitlines()
    assert [x.split(" | ")[0] for x in lines] == ["p in 0 out 0 lag a:5", "p in 5 out 5 lag a:0"]


def test_a_failed_read_counts_nothing_it_did_not_commit(tmp_path):
    """Issue 28: after a read that failed (a damaged entry) the progress said "m in 5,000
    out 0" though nothing was committed: the steps planned before it were counted."""
    import sqlite3

    from dataspace.pipeline import Graph, LocalEngine
    from dataspace.streams import StoreCorrupt

    g = Graph("g")
    g.source("in")
    g.map("m", "in", "out", lambda v: v + 1)
    with open_store(tmp_path) as s:
        s.append_many("in", range(5000))
    raw = sqlite3.connect(tmp_path / "streams.sqlite3")
    raw.execute("UPDATE entries SET value = X'a1' WHERE idx = 4000")  # its checksum fails
    raw.commit()
    raw.close()
    reports: list[list[ProcStats]] = []
    # One group of steps (a long group time): 4,000 messages planned, then the read fails.
    with open_store(tmp_path) as s, LocalEngine(g, s, batch=1000, group_ms=600_000) as e:
        with pytest.raises(StoreCorrupt):
            e.run(until_idle=True, on_progress=reports.append)
        [m] = reports[-1]
        assert (m.consumed, m.produced, m.errors, m.steps) == (0, 0, 0, 0), m
        assert m.lag == {"in": 5000}  # the positions are the store's again
        assert s.position("in", "g/m") in (None, 0) and not s.next_index("out")
        assert format_progress(reports[-1]).startswith("m in 0 out 0 lag in:5,000")
    # What is committed counts, once.
    with open_store(tmp_path / "sound") as s, LocalEngine(g, s, batch=1000) as e:
        s.append_many("in", range(5000))
        [m] = e.run(until_idle=True)
        assert (m.consumed, m.produced, m.steps, m.lag) == (5000, 5000, 5, {"in": 0})


def test_run_follows_input_and_stops_cleanly_on_ctrl_c(env, store_url):
    data = store_url
    at = ["--store", store_url]
    main(["stream", "append", "chat", '<Says "a" "x">', *at])
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataspace.cli", "pipeline", "run", str(env / "graph.py"),
         "--interval", "0.1", "--engine", "local", *at],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    cond = threading.Condition()

    def pump():
        for line in proc.stdout:
            with cond:
                lines.append(line)
                cond.notify_all()

    threading.Thread(target=pump, daemon=True).start()
    try:
        with cond:
            assert cond.wait_for(lambda: any("running graph" in x for x in lines), LONG), proc.stderr
        with open_store(data) as s:
            s.append("chat", parse('<Says "b" "y">'))
            assert s.wait_until(lambda: s.next_index("loud") == 2, timeout=LONG)
        # A second run of the same graph is refused while this one runs.
        r = subprocess.run([sys.executable, "-m", "dataspace.cli", "pipeline", "run",
                            str(env / "graph.py"), "--engine", "local", *at],
                           capture_output=True, text=True, timeout=LONG)
        assert r.returncode == 1 and "already running" in r.stderr
        r = subprocess.run([sys.executable, "-m", "dataspace.cli", "pipeline", "status",
                            str(env / "graph.py"), *at], capture_output=True, text=True, timeout=LONG)
        assert f"running (pid {proc.pid}" in r.stdout
        if store_url.startswith("postgresql:"):
            assert "***" in r.stdout and store_url not in r.stdout  # the password masked
        proc.send_signal(signal.SIGINT)
        assert proc.wait(LONG) == 0
        with cond:
            assert cond.wait_for(lambda: any("interrupted" in x for x in lines), LONG)
        assert any("upper in 2 out 2" in x for x in lines)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_documented_example_graph_runs(env, capsys, monkeypatch):
    """docs/pipelines.md's complete example, as written there."""
    doc = (os.path.dirname(__file__) + "/../docs/pipelines.md")
    text = open(doc).read().split("<!-- example-graph -->", 1)[1]
    (env / "orders.py").write_text(text.split("```python", 1)[1].split("```", 1)[0])
    monkeypatch.chdir(env)  # the example's ledger.db is relative
    main(["stream", "append", "orders", '<order 1 "ann" 250>', '<order 2 "bob" 20>'])
    main(["stream", "append", "payments", "<payment 1 250>", "<payment 2 25>"])
    assert main(["pipeline", "check", "orders.py"]) == 0
    capsys.readouterr()
    assert main(["pipeline", "run", "orders.py", "--until-idle", "-q", "--engine", "local"]) == 0
    with open_store(env / "data") as s:
        assert [e.value for e in s.read("notifications")] == [parse('<alert <paid 1 "ann" 250>>')]
        assert s.read("orders.errors")[0].value.fields[2] == "payment 2/25 does not match order 2/20"
    import sqlite3

    assert sqlite3.connect(env / "ledger.db").execute("select * from paid").fetchall() == [(1, "ann", 250)]


def test_ctrl_c_while_the_graph_loads_is_a_clean_stop(env):
    """The first Ctrl-C is a clean stop (exit 0) from the very start: here while the graph
    file is being run (a KeyboardInterrupt inside it once ended the command with 130)."""
    (env / "slow.py").write_text(GRAPH + "\nimport sys\nprint('loading', flush=True)\n"
                                 "sys.stdin.readline()  # the test says when to go on\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataspace.cli", "pipeline", "run", str(env / "slow.py")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        first: list[str] = []
        t = threading.Thread(target=lambda: first.append(proc.stdout.readline()), daemon=True)
        t.start()
        t.join(LONG)
        assert first == ["loading\n"]
        proc.send_signal(signal.SIGINT)
        # Said at once, while the graph file still waits (it goes on only when told).
        t = threading.Thread(target=lambda: first.append(proc.stdout.readline()), daemon=True)
        t.start()
        t.join(LONG)
        assert first[1] == STOPPING
        out, err = proc.communicate("go on\n", timeout=LONG)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, err) == (0, "")
    assert out == "dataspace pipeline: interrupted before the graph started: nothing ran\n"


STOPPING = ("dataspace pipeline: stopping ... (Ctrl-C again stops at once; the next run "
            "recovers)\n")


@pytest.mark.parametrize("after", ["hashlib", "dataspace.cli", "dataspace.broker.server",
                                   "dataspace.pipeline.loader"])
def test_ctrl_c_in_the_first_second_is_one_line_not_a_traceback(env, after):
    """Ctrl-C while the command's modules are still importing (the console script, told
    by Python's import log when it got this far): one line and exit 130, or -- once the
    run took Ctrl-C over -- its clean stop; never a KeyboardInterrupt traceback.
    ``hashlib`` is imported first by the package's choice of its core (_build), which
    runs before the command's own modules (a traceback there once)."""
    script = os.path.join(os.path.dirname(sys.executable), "dataspace")
    proc = subprocess.Popen([script, "pipeline", "run", str(env / "graph.py"), "--engine", "local",
                             "--until-idle"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    try:
        err: list[str] = []
        while True:
            line = proc.stderr.readline()
            assert line, "".join(err)
            err.append(line)
            if line.startswith("import time:") and line.split("|")[-1].strip() == after:
                break
        proc.send_signal(signal.SIGINT)
        out, rest = proc.communicate(timeout=LONG)
    finally:
        if proc.poll() is None:
            proc.kill()
    said = [x for x in (err + rest.splitlines(True)) if not x.startswith("import time:")]
    assert "Traceback" not in "".join(said) and "KeyboardInterrupt" not in "".join(said), said
    if proc.returncode == 130:
        assert [x.rstrip("\n") for x in said] == ["dataspace: interrupted"]
    else:
        assert proc.returncode == 0 and out.startswith(STOPPING), (out, said)


def test_the_help_example_graph_works_on_the_readme_data(env, capsys, monkeypatch):
    """`pipeline --help` shows a graph file; it once wrote nothing for <Says ...> records."""
    with pytest.raises(SystemExit):
        main(["pipeline", "--help"])
    text = capsys.readouterr().out.split("A graph file is Python", 1)[1]
    code = "\n".join(x[2:] for x in text.splitlines() if x.startswith("  "))
    (env / "help.py").write_text(code)
    assert main(["stream", "append", "chat", '<Says "alice" "hi">', '<Says "bob" "yo">']) == 0
    assert main(["pipeline", "run", str(env / "help.py"), "--engine", "local", "--until-idle",
                 "-q"]) == 0
    with open_store(env / "data") as s:
        assert [e.value for e in s.read("loud")] == ["HI", "YO"]


def test_the_documented_progress_rule_is_the_one_followed(capsys):
    """Not on a terminal a line is printed only when something changed (the test above);
    docs/pipelines.md said "a plain line is printed per interval"."""
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "pipelines.md")).read()
    bullet = " ".join(doc.split("- **Progress**", 1)[1].split("\n- ", 1)[0].split())
    assert ("otherwise (a log file, a pipe) a plain line is printed only when something "
            "changed (counts, lag, state or the batch), at most one every 10 intervals") in bullet
    assert f"at most one every {LOG_GAP} intervals" in bullet
    with pytest.raises(SystemExit):
        main(["pipeline", "run", "--help"])
    assert ("not on a terminal, a line is printed only when something changed, at most one "
            f"every {LOG_GAP} intervals") in " ".join(capsys.readouterr().out.split())


def test_a_killed_run_releases_its_graph(env, store_url):
    """kill -9 of a running graph: the next run starts (and finishes the work), whatever
    the store -- the flock beside SQLite and PostgreSQL's session advisory lock both go
    with the process."""
    from store_support import wait_lock_free

    at = ["--store", store_url]
    main(["stream", "append", "chat", '<Says "a" "x">', *at])
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataspace.cli", "pipeline", "run", str(env / "graph.py"),
         "--engine", "local", *at],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = ""
        while "running graph" not in line:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
        proc.kill()
        assert proc.wait(LONG) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_lock_free(store_url, "graph:shout")
    r = subprocess.run([sys.executable, "-m", "dataspace.cli", "pipeline", "status",
                        str(env / "graph.py"), *at], capture_output=True, text=True, timeout=LONG)
    assert "not running" in r.stdout, r.stdout + r.stderr
    main(["stream", "append", "chat", '<Says "b" "y">', *at])
    r = subprocess.run([sys.executable, "-m", "dataspace.cli", "pipeline", "run",
                        str(env / "graph.py"), "--engine", "local", "--until-idle", *at],
                       capture_output=True, text=True, timeout=LONG)
    assert r.returncode == 0, r.stderr
    with open_store(store_url) as s:
        assert [e.value.fields[1] for e in s.read("loud")] == ["X", "Y"]


# -- a typo is an error, and leaves nothing behind -------------------------------------------

TYPO = GRAPH.replace('"chat"', '"chta"')


def _names(store_dir, internal=True):
    with open_store(store_dir, create=False) as s:
        return [i.name for i in s.streams(include_internal=internal)]


@pytest.mark.parametrize("engine", ["local", "spark"])
@pytest.mark.parametrize("until_idle", [True, False])
def test_a_missing_source_stops_check_and_run_and_leaves_no_trace(env, capsys, engine, until_idle):
    """`graph.source("chta")` passed `check`; `run --until-idle` printed `lag chta:0 ...
    idle` and exited 0, `run` waited forever, and both made an empty `chta` with a tailer
    that silenced `stream tail chta`.  On either engine (Spark refuses before it starts)."""
    (env / "typo.py").write_text(TYPO)
    main(["stream", "append", "chat", '<Says "alice" "hi">'])
    capsys.readouterr()
    line = (f"dataspace pipeline: source stream 'chta' does not exist in {env / 'data' / 'streams.sqlite3'} "
            "(streams there: chat; did you mean 'chat'?); create it with `dataspace stream "
            "create chta` or declare it with graph.source('chta', create=True)\n")
    assert main(["pipeline", "check", str(env / "typo.py")]) == 1
    assert capsys.readouterr() == ("", line)
    argv = ["pipeline", "run", str(env / "typo.py"), "--engine", engine]
    assert main([*argv, *(["--until-idle"] if until_idle else [])]) == 1
    out, err = capsys.readouterr()
    assert err == line and "starting Spark" not in out
    assert _names(env / "data") == ["chat"]
    assert not (env / "data" / "spark").exists()
    assert main(["stream", "tail", "chta"]) == 1
    assert "no stream named 'chta'" in capsys.readouterr().err


def test_check_without_a_store_and_the_two_ways_to_declare_a_source(env, capsys):
    (env / "typo.py").write_text(TYPO)
    # No store at all: check says so (and creates none); --no-store checks the file only.
    assert main(["pipeline", "check", str(env / "typo.py")]) == 1
    assert "no stream store at" in capsys.readouterr().err
    assert not (env / "data").exists()
    assert main(["pipeline", "check", str(env / "typo.py"), "--no-store"]) == 0
    assert "is valid" in capsys.readouterr().out
    # `stream create` makes the source exist (empty): the run is legitimate.
    assert main(["stream", "create", "chta"]) == 0
    assert main(["pipeline", "check", str(env / "typo.py")]) == 0
    assert main(["pipeline", "run", str(env / "typo.py"), "--engine", "local", "--until-idle"]) == 0
    # graph.source(..., create=True): created by the run, with --create-store even the store.
    (env / "later.py").write_text(GRAPH.replace('graph.source("chat")',
                                                'graph.source("chat", create=True)'))
    other = env / "other"
    argv = ["pipeline", "run", str(env / "later.py"), "--engine", "local", "--until-idle",
            "--data-dir", str(other)]
    assert main(argv) == 1
    assert not other.exists()
    assert main([*argv, "--create-store"]) == 0
    assert _names(other, internal=False) == ["chat", "loud", "shout.errors"]


@pytest.mark.parametrize("command", [["run", "--engine", "local", "--until-idle"],
                                     ["run"], ["status"], ["check"], ["reset"]])
def test_a_mistyped_data_dir_is_an_error_not_a_new_store(env, capsys, command):
    """`pipeline run --data-dir <typo>` quietly made a new store and exited 0."""
    main(["stream", "append", "chat", '<Says "alice" "hi">'])
    capsys.readouterr()
    typo = env / "dta"
    assert main(["pipeline", command[0], str(env / "graph.py"), *command[1:],
                 "--data-dir", str(typo)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dataspace pipeline: no stream store at {typo} (the data directory "
                          "does not exist); check --data-dir, or create one with `dataspace "
                          "stream create NAME`"), err
    assert err.count("\n") == 1
    assert ("--create-store" in err) == (command[0] == "run")
    assert not typo.exists()
    (typo).mkdir()
    assert main(["pipeline", command[0], str(env / "graph.py"), *command[1:],
                 "--data-dir", str(typo)]) == 1
    assert "(the data directory holds no store)" in capsys.readouterr().err
    assert os.listdir(typo) == []


def test_a_database_without_a_store_is_not_laid_out_by_a_reading_command(env, capsys, pg_url):
    """A PostgreSQL database that exists but holds no store: reading commands say so and
    leave the database as it is; writing ones create the store."""
    import psycopg

    at = ["--store", pg_url]
    for argv in (["pipeline", "status", str(env / "graph.py"), *at],
                 ["pipeline", "run", str(env / "graph.py"), "--engine", "local", *at],
                 ["stream", "ls", *at], ["stream", "tail", "chat", *at]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "(the database holds no stream store); check --store" in err, err
    with psycopg.connect(pg_url) as c:
        assert c.execute("SELECT count(*) FROM information_schema.schemata "
                         "WHERE schema_name = 'dataspace'").fetchone() == (0,)
    assert main(["stream", "append", "chat", '<Says "a" "x">', *at]) == 0
    assert main(["pipeline", "run", str(env / "graph.py"), "--engine", "local", "--until-idle",
                 "-q", *at]) == 0


# -- pipeline reset ---------------------------------------------------------------------------

CHAIN = GRAPH + """
@graph.map("exclaim", "loud", "louder")
def exclaim(v):
    return Record(Symbol("Exclaim"), [v])
"""


def _values(store_dir, stream):
    with open_store(store_dir, create=False) as s:
        return [e.value for e in s.iter_entries(stream)] if s.has_stream(stream) else None


def test_reset_reprocesses_from_the_start_and_never_duplicates_silently(env, capsys):
    (env / "chain.py").write_text(CHAIN)
    graph = str(env / "chain.py")
    data = env / "data"
    main(["stream", "append", "chat", '<Says "a" "x">', '<Says "b" "y">'])
    run = ["pipeline", "run", graph, "--engine", "local", "--until-idle", "-q"]
    assert main(run) == 0
    first = _values(data, "louder")
    assert len(first) == 2
    # A leftover Spark checkpoint of the graph goes too (the Spark test runs it for real).
    (data / "spark" / "shout" / "upper" / "checkpoint").mkdir(parents=True)
    capsys.readouterr()
    # Outputs with entries: the user says what becomes of them.
    assert main(["pipeline", "reset", graph]) == 1
    assert capsys.readouterr().err == (
        "dataspace pipeline: graph 'shout' has written results to loud (2 entries), louder "
        "(2 entries); reprocessing writes them again: add --delete-outputs to remove those "
        "streams (each result then once), or --keep-outputs to append the new results after "
        "the old ones\n")
    assert main(["pipeline", "reset", graph, "--delete-outputs", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("would reset graph 'shout'")
    assert _values(data, "louder") == first and (data / "spark" / "shout").exists()
    # Delete: the next run writes every result once, from the start.
    assert main(["pipeline", "reset", graph, "--delete-outputs"]) == 0
    out = capsys.readouterr().out
    assert "positions: chat (shout/upper)" in out
    assert "backing streams: __backing/shout/exclaim, __backing/shout/upper" in out
    assert "output streams removed: loud (2 entries), louder (2 entries), shout.errors (0 entries)" in out
    assert _names(data) == ["chat"] and not (data / "spark" / "shout").exists()
    assert main(["stream", "info", "chat"]) == 0
    assert "tailers     none" in capsys.readouterr().out
    assert main(run) == 0
    assert _values(data, "louder") == first
    # Keep: the new results follow the old ones -- once more each, not twice (the second
    # processor reads its intermediate input from where it ended).
    assert main(["pipeline", "reset", graph, "--keep-outputs"]) == 0
    out = capsys.readouterr().out
    assert "intermediate streams kept, read from their end: loud at 2" in out
    assert main(run) == 0
    assert _values(data, "louder") == first + first
    assert _values(data, "loud") == _values(data, "loud")[:2] * 2
    # Nothing to reset for a graph that never ran.
    (env / "other.py").write_text(GRAPH.replace('Graph("shout"', 'Graph("other"'))
    capsys.readouterr()
    assert main(["pipeline", "reset", str(env / "other.py")]) == 0
    assert "nothing to reset (it never ran here)" in capsys.readouterr().out


def test_reset_is_refused_while_the_graph_runs(env, capsys):
    main(["stream", "append", "chat", '<Says "a" "x">'])
    assert main(["pipeline", "run", str(env / "graph.py"), "--engine", "local", "--until-idle",
                 "-q"]) == 0
    with open_store(env / "data") as s, s.lock("graph:shout"):
        capsys.readouterr()
        assert main(["pipeline", "reset", str(env / "graph.py"), "--delete-outputs"]) == 1
        err = capsys.readouterr().err
        assert "graph 'shout' is running on this store (pid" in err and "stop it first" in err
    assert _values(env / "data", "loud") is not None  # nothing was removed
    with open_store(env / "data") as s:
        assert s.position("chat", "shout/upper") == 1


def test_reset_help_has_examples(capsys):
    with pytest.raises(SystemExit):
        main(["pipeline", "reset", "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "--delete-outputs" in out and "--keep-outputs" in out


def test_log_records_are_said_in_the_commands_voice(capsys):
    """A warning of the library reaches the user as a line of the command (no time, level
    or logger name: "a raw timestamped log line" was the complaint), on one line."""
    import logging

    from dataspace.cli._voice import speak_as

    h = logging.StreamHandler(sys.stderr)  # what logging.basicConfig makes in main()
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(h)
    try:
        speak_as("dataspace pipeline", 0)
        log = logging.getLogger("dataspace.pipeline.spark.engine")
        log.warning("processor %s: the store moved on", "g/x")
        log.warning("two\nlines")
        try:
            raise ValueError("bad")
        except ValueError:
            log.error("it failed", exc_info=True)
    finally:
        root.removeHandler(h)
    assert capsys.readouterr().err.splitlines() == [
        "dataspace pipeline: processor g/x: the store moved on",
        "dataspace pipeline: two (-v says more)",
        "dataspace pipeline: it failed (ValueError: bad) (-v says more)",
    ]
