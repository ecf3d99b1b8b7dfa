"""The Spark engine: graphs give the local engine's outputs; DataFrame processors; the
error stream; side-effecting sinks with the delivery hash; restarts, checkpoints and
their reconciliation with the store; progress and ``pipeline status``; the CLI."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from dataspace.cli import main
from dataspace.pipeline import Crash, EngineError, Graph, LocalEngine, delivery_hash
from dataspace.pipeline.exactly_once import recover
from dataspace.pipeline.sinks import SQLiteSink
from dataspace.streams import open_store
from dataspace.testing.pipeline_common import build_graph, inputs, verify
from dataspace.values import Record, Symbol, encode, parse

pytest.importorskip("pyspark")

from dataspace.pipeline.spark.engine import SparkEngine

LONG = 120.0
P, N = Symbol("p"), Symbol("n")


def spark_run(g, store, spark, **opts):
    opts.setdefault("batch", 6)
    with SparkEngine(g, store, spark=spark, **opts) as e:
        stats = e.drain()
        return e, {s.name: s for s in stats}


def datas(store, stream):
    return [e.data for e in store.read(stream, 0, 10**6)]


def test_the_crash_graph_gives_exactly_the_local_engines_outputs(spark, tmp_path):
    """join -> fork -> SQLite sink (idempotent by the delivery hash) + alts, with errors:
    the expected multisets (the local engine's) on both engines, and the same sequences
    where the order is determined (join, fork, the error stream of a map)."""
    out = {}
    for name in ("local", "spark"):
        d = tmp_path / name
        d.mkdir()
        g = build_graph(d)
        with open_store(d) as store:
            for s, vals in inputs(120, 7).items():
                store.append_many(s, vals)
            if name == "local":
                with LocalEngine(g, store, batch=7) as e:
                    e.drain()
            else:
                e, stats = spark_run(g, store, spark, batch=25, partition_rows=10)
                assert not e.failed
                assert stats["pair"].consumed == 240 and stats["pair"].errors >= 1
            out[name] = {s: datas(store, s) for s in ("pairs", "even", "odd", "merged")}
            out[name]["errors"] = [e.value.fields[:3] for e in store.read("errors", 0, 10**6)]
        assert verify(d, 120, 7) == []
    for s in ("pairs", "even", "odd"):
        assert out["spark"][s] == out["local"][s]
    assert Counter(out["spark"]["merged"]) == Counter(out["local"]["merged"])
    assert Counter(map(tuple, out["spark"]["errors"])) == Counter(map(tuple, out["local"]["errors"]))


def test_every_processor_kind_matches_the_local_engine(spark, tmp_path):
    def build(d):
        g = Graph("kinds", error_stream="errs")
        g.source("in", "in2")
        g.map("inc", "in", "inc", lambda v: None if v % 5 == 0 else (1 // 0 if v == 7 else v + 1))
        g.map("msg", "in", "msgs", lambda m: Record(Symbol("m"), [m.stream, m.index, m.value]),
              messages=True)
        g.join("zip", ["in", "in2"], "zipped", lambda a, b: [a, b])
        g.alts("either", ["in", "in2"], "either")
        g.fork("split", "in", ["lo", "hi"], lambda v: {"lo": v} if v < 6 else {"hi": [v, v]})

        @g.processor("emit", "in", ["e1", "e2"])
        def emit(ctx, v):
            ctx.emit("e1", v)
            ctx.emit("e2", Record(Symbol("h"), [ctx.delivery.hash, ctx.delivery.seq]))

        g.sink("each", "in", lambda v, dl: open(d / "each.txt", "a").write(f"{v} {dl.key}\n"))
        g.sink("db", "inc", SQLiteSink(d / "sink.db", "t", ["v INTEGER"], to_row=lambda v: (v,)),
               batch=True)
        return g

    res = {}
    # Spark: the pure processors' read tasks stage their outputs (the default), or the
    # rows go through Spark to the write tasks and the outputs to the driver.
    for name in ("local", "spark", "spark-through"):
        d = tmp_path / name
        d.mkdir()
        g = build(d)
        with open_store(d) as store:
            store.append_many("in", range(12))
            store.append_many("in2", ["a", "b", "c"])
            if name == "local":
                with LocalEngine(g, store, batch=4) as e:
                    e.drain()
            else:
                if name == "spark":  # what a task attempt that lost left: never visible
                    store.stage("kinds/inc", "kinds/inc/lost", {"inc": ([encode(99)], [None])})
                e, _ = spark_run(g, store, spark, batch=4, partition_rows=3,
                                 staged=name == "spark")
                assert not e.failed
            # values and metadata (sources and delivery hashes): the same on every path
            res[name] = {s: [(x.data, x.meta_data) for x in store.read(s, 0, 10**6)] for s in
                         ("inc", "msgs", "zipped", "either", "lo", "hi", "e1", "e2", "errs")}
        res[name]["each"] = sorted((d / "each.txt").read_text().splitlines())
        res[name]["db"] = sorted(sqlite3.connect(d / "sink.db").execute("select v from t").fetchall())
        shards = [p for p in d.iterdir() if p.name.endswith("-stage", 0, -1)]
        if name == "spark":  # staged, and every part taken by a commit
            assert shards
            for p in shards:
                assert sqlite3.connect(p).execute("select count(*) from staged").fetchone()[0] == 0
        else:
            assert shards == []
    for k, v in res["local"].items():
        assert res["spark"][k] == v, k
        assert res["spark-through"][k] == v, k
    # the delivery hash: a step = a micro-batch of 4 (batch=4 on both engines)
    assert res["spark"]["each"][0].endswith(delivery_hash("kinds/each", {"in": 0}, {"in": 4}).hex() + ":0")


def test_dataframe_processors(spark, tmp_path):
    from pyspark.sql import functions as F

    g = Graph("df")
    g.source("orders", "customers")

    @g.dataframe("big", "orders", "big")
    def big(df):  # Spark SQL over the decoded columns; rows keep value and index
        return df.where("label = 'order' and cast(fields[1] as int) >= 100").select("index", "value")

    @g.dataframe("totals", "orders", "totals", output_mode="complete")
    def totals(df):
        return df.groupBy(F.col("fields")[0].alias("customer")).agg(
            F.sum(F.col("fields")[1].cast("int")).alias("total"))

    @g.dataframe("windows", "orders", "windows")
    def windows(df):  # event time from the values; a window is written once it closes
        t = F.col("fields")[2].cast("long").cast("timestamp")
        return (df.withColumn("t", t).withWatermark("t", "0 seconds")
                .groupBy(F.window("t", "10 seconds")).agg(F.count("*").alias("n"))
                .select(F.col("window.start").cast("long").alias("start"), "n"))

    @g.dataframe("named", ["orders", "customers"], "named")
    def named(o, c):
        j = o.alias("o").join(c.alias("c"), F.expr("o.fields[0] = c.fields[0]"))
        return j.select(F.format_string("<named %s %s>", F.col("c.fields")[1],
                                        F.col("o.fields")[1]).alias("text"))

    with open_store(tmp_path) as store:
        store.append_many("orders", [parse(f'<order "c{i % 3}" {i * 30} {i * 4}>') for i in range(8)])
        store.append_many("customers", [parse(f'<customer "c{i}" "name{i}">') for i in range(3)])
        e, _stats = spark_run(g, store, spark, batch=100)
        assert not e.failed, e.failed
        assert [x.value for x in store.read("big")] == [parse(f'<order "c{i % 3}" {i * 30} {i * 4}>') for i in range(4, 8)]
        assert [x.meta[Symbol("src")] for x in store.read("big")] == [{"orders": i} for i in range(4, 8)]
        tot = {x.value[Symbol("customer")]: x.value[Symbol("total")] for x in store.read("totals")}
        assert tot == {'"c0"': 270, '"c1"': 360, '"c2"': 210}
        # times 0..28: windows [0,10) [10,20) closed by the watermark (28), [20,30) open
        assert [(x.value[Symbol("start")], x.value[Symbol("n")]) for x in store.read("windows")] == [(0, 3), (10, 2)]
        assert sorted(str(x.value) for x in store.read("named")) == sorted(
            f'<named "name{i % 3}" {i * 30}>' for i in range(8))
        # more input: only the new rows are processed (complete mode rewrites totals)
        store.append_many("orders", [parse('<order "c0" 1000 100>')])
        spark_run(g, store, spark, batch=100)
        assert [x.value for x in store.read("big")][-1] == parse('<order "c0" 1000 100>')
        assert [x.value[Symbol("start")] for x in store.read("windows")] == [0, 10, 20]
        assert len(store.read("big")) == 5
        last = {x.value[Symbol("customer")]: x.value[Symbol("total")] for x in store.read("totals")[-3:]}
        assert last['"c0"'] == 1270
    with open_store(tmp_path) as store, pytest.raises(Exception, match="Spark only"):
        LocalEngine(g, store)


def test_unhandled_error_stops_the_processor_and_keeps_the_input(spark, tmp_path):
    g = Graph("g")
    g.source("in")
    inv = lambda v: 1 // v  # noqa: E731
    g.map("inv", "in", "out", inv)
    line = inv.__code__.co_firstlineno
    with open_store(tmp_path) as store:
        store.append_many("in", [1, 2, 0, 4])
        e, stats = spark_run(g, store, spark, batch=2)
        # Said once, as the local engine says it: which processor, which entry, which line
        # of the user's code, what it raised; the traceback of the user's code comes back
        # from the executor (the engine and the CLI say the processor stopped).
        assert e.failed["inv"] == (f"map 'inv' failed on entry in/2: test_spark_engine.py:{line}: "
                                   "ZeroDivisionError: integer division or modulo by zero")
        tb = stats["inv"].detail
        assert tb.startswith("Traceback (most recent call last):"), tb
        assert f'test_spark_engine.py", line {line}, in <lambda>' in tb, tb
        assert tb.endswith("ZeroDivisionError: integer division or modulo by zero"), tb
        assert "dataspace/pipeline" not in tb  # the engine's frames say nothing to its author
        with open_store(tmp_path / "local") as ls:
            ls.append_many("in", [0])
            with LocalEngine(g, ls) as le:
                le.drain()
                assert le.failed["inv"] == e.failed["inv"].replace("in/2", "in/0")
                assert le.stats()[0].detail == tb
        assert stats["inv"].state == "failed"
        assert [x.value for x in store.read("out")] == [1, 0]
        assert store.position("in", "g/inv") == 2  # the failed batch [2, 4) is kept
        g2 = Graph("g")
        g2.source("in")
        g2.map("inv", "in", "out", lambda v: 1 // v if v else None)  # fixed
        e, _ = spark_run(g2, store, spark, batch=2)
        assert not e.failed and [x.value for x in store.read("out")] == [1, 0, 0]


def test_restarts_checkpoints_and_engine_switches(spark, tmp_path, caplog):
    """Spark resumes from its checkpoint; after the local engine moved the store on, the
    stale checkpoint is set aside; an interrupted local step is retried with its hash."""
    g = Graph("g")
    g.source("in")
    log = tmp_path / "sink.log"  # the sink runs in Spark's worker processes: effects go to a file
    g.map("x", "in", "out", lambda v: v * 10)
    g.sink("s", "out", lambda vs, d: open(log, "a").write(f"{list(vs)} {d.hex}\n"), batch=True)
    with open_store(tmp_path) as store:
        store.append_many("in", range(5))
        e, _ = spark_run(g, store, spark, batch=3)
        assert e.checkpoints()["x"] == "new checkpoint"
        store.append_many("in", range(5, 8))
        e, _ = spark_run(g, store, spark, batch=3)
        assert e.checkpoints()["x"].startswith("checkpoint at batch")
        assert [x.value for x in store.read("out")] == [v * 10 for v in range(8)]
        store.append_many("in", range(8, 10))
        with LocalEngine(g, store) as le:
            le.drain()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dataspace.pipeline.spark.engine"):
            e, _ = spark_run(g, store, spark, batch=3)
        assert e.checkpoints()["x"] == "stale checkpoint set aside"
        # Said in words, one line (the command prints it as its own: cli/_voice.py).
        said = [r.getMessage() for r in caplog.records if "processor g/x:" in r.getMessage()]
        assert len(said) == 1 and re.fullmatch(
            r"processor g/x: the store moved on since its Spark checkpoint \(another engine ran "
            r"it, or the store was replaced\); Spark starts from the store's positions \(the old "
            r"checkpoint is kept as checkpoint\.stale-\d{8}-\d{6}-\d+\)", said[0]), said
        assert [x.value for x in store.read("out")] == [v * 10 for v in range(10)]
        # The local engine crashes a sink step before its function: Spark retries it.
        store.append_many("in", [10, 11])

        def crash(proc, point):
            if proc == "g/s" and point == "before-function":
                raise Crash(point)

        with LocalEngine(g, store, fault=crash) as le, pytest.raises(Crash):
            le.drain()
        rec = recover(store, "g/s")
        assert rec.branch == "1b"
        log.write_text("")
        e, _ = spark_run(g, store, spark, batch=3)
        assert e.recovery()["s"] == "1b"
        assert log.read_text().splitlines() == [
            f"[100, 110] {delivery_hash('g/s', rec.starts, rec.ends).hex()}"]
        assert recover(store, "g/s").branch == "1f+3a"


def test_a_reset_graph_reprocesses_on_spark_from_fresh_checkpoints(spark, tmp_path):
    """`pipeline reset` removes the graph's checkpoints with its positions and backing
    streams: the next Spark run starts new queries at the first stored entries (not a
    checkpoint set aside as stale), and with the outputs removed writes each result once."""
    from dataspace.pipeline.reset import reset_graph

    g = Graph("again")
    g.source("in")
    g.map("x", "in", "mid", lambda v: v * 10)
    g.map("y", "mid", "out", lambda v: v + 1)
    with open_store(tmp_path) as store:
        store.append_many("in", range(7))
        e, _ = spark_run(g, store, spark, batch=3)
        root = e.root
        assert (root / "x" / "checkpoint").is_dir()
        want = [v * 10 + 1 for v in range(7)]
        assert [x.value for x in store.read("out")] == want
        plan = reset_graph(store, g, outputs="delete", spark_dirs=[root])
        assert plan.spark_dirs == [root] and not root.exists()
        assert sorted(x.name for x in store.streams(include_internal=True)) == ["in"]
        e, _ = spark_run(g, store, spark, batch=3)
        assert e.checkpoints() == {"x": "new checkpoint", "y": "new checkpoint"}
        assert [x.value for x in store.read("out")] == want
        # Kept outputs: the results once more each, after the old ones -- y reads only
        # what x writes again (its intermediate input from where it ended).
        reset_graph(store, g, outputs="keep", spark_dirs=[root])
        e, _ = spark_run(g, store, spark, batch=3)
        assert [x.value for x in store.read("out")] == want + want


def test_continuous_run_follows_appends_and_reports_progress(spark, tmp_path):
    g = Graph("live")
    g.source("in")
    g.map("up", "in", "out", lambda v: v.upper())
    reports = []
    stop = threading.Event()
    with open_store(tmp_path) as store:
        store.append("in", "a")
        e = SparkEngine(g, store, spark=spark)
        e.start()
        t = threading.Thread(target=e.run, args=(stop,),
                             kwargs={"on_progress": reports.append, "progress_interval": 0.2})
        t.start()
        try:
            assert store.wait_until(lambda: store.next_index("out") == 1, timeout=LONG)
            store.append("in", "b")
            assert store.wait_until(lambda: store.next_index("out") == 2, timeout=LONG)
        finally:
            stop.set()
            t.join(LONG)
            e.close()
        assert not t.is_alive()
        assert [x.value for x in store.read("out")] == ["A", "B"]
        assert reports and reports[-1][0].consumed == 2 and reports[-1][0].produced == 2
        assert (tmp_path / "spark" / "live" / "up" / "progress.json").exists()


def test_a_long_batch_shows_it_works_and_the_rate_is_messages_over_wall_time(spark, tmp_path):
    """While a slow batch runs, the progress says so and moves (starting the query, the
    batch's number and messages, its tasks, its seconds); afterwards the rate is the
    messages over the wall time they took, not the batch's messages in the second its
    commit landed (13,989 msg/s was once shown for about 89)."""
    import io

    from dataspace.cli.pipeline import _Progress

    def crawl(v):  # made here: Spark's workers get it by value
        time.sleep(0.1)  # the workload: a slow function (an API call per message, say)
        return v

    g = Graph("slow")
    g.source("in")
    g.map("crawl", "in", "out", crawl)
    out = io.StringIO()
    show = _Progress(out)
    seen = []

    def on_progress(stats):
        seen.append(stats[0])
        show(stats)

    n = 30
    with open_store(tmp_path) as store:
        store.append_many("in", range(n))
        t0 = time.monotonic()
        with SparkEngine(g, store, spark=spark, batch=n, partition_rows=n) as e:
            stats = e.run(until_idle=True, on_progress=on_progress, progress_interval=0.2)
        wall = time.monotonic() - t0
        assert stats[0].consumed == n and not e.failed
    assert seen[0].activity == "starting its query"
    during = [s for s in seen if s.activity.startswith(f"batch 0: {n} messages") and s.consumed == 0]
    assert len(during) >= 3, [s.activity for s in seen]
    assert during[-1].activity_s > during[0].activity_s  # its seconds move
    assert any("tasks 0/1" in s.activity for s in during), [s.activity for s in during]
    assert seen[-1].activity == ""
    last = out.getvalue().splitlines()[-1]
    assert last.startswith(f"crawl in {n} out {n} lag in:0 |"), last
    rate = float(last.rsplit("| ", 1)[1].split(" msg/s")[0].replace(",", ""))
    # n messages in the run's wall time (which includes starting the query): the rate is
    # between that and what the batch alone allows (n x 0.1 s of work at least).
    assert n / wall / 2 <= rate <= n / (n * 0.1), (rate, n / wall, last)


GRAPH = """
from dataspace.pipeline import Graph
graph = Graph("shout", error_stream="shout.errors")
graph.source("chat")
graph.map("upper", "chat", "loud", lambda v: v.upper())
"""


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("DATASPACE_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "graph.py").write_text(GRAPH)
    return tmp_path


def test_cli_runs_on_spark_by_default_and_status_shows_the_queries(spark, env, capsys, store_url):
    """On the data directory's SQLite store and on PostgreSQL (--store): the connector's
    reads on the executors, its commits, the graph's lock, status."""
    at = ["--store", store_url]
    assert main(["stream", "append", "chat", '"hi"', "42", *at]) == 0
    capsys.readouterr()
    assert main(["pipeline", "run", str(env / "graph.py"), "--until-idle", *at]) == 0
    out = capsys.readouterr().out
    assert "engine spark on local[2]" in out
    assert "upper in 2 out 1 err 1 lag chat:0" in out
    with open_store(store_url) as s:
        assert [e.value for e in s.read("loud")] == ["HI"]
    assert main(["pipeline", "status", str(env / "graph.py"), *at]) == 0
    out = capsys.readouterr().out
    assert "last step delivered (1d+3a)" in out
    assert re.search(r"\n      last Spark run \(until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\): batch 0 "
                     r"committed; 1 batch, 2 in, 1 out, 1 error\n", out), out
    # While the local engine runs the graph, status says so, and Spark's figures (stale
    # by then) are not shown.
    from dataspace.pipeline.loader import load_graph

    with open_store(store_url) as s, LocalEngine(load_graph(str(env / "graph.py")), s) as le:
        le.start()
        assert main(["pipeline", "status", str(env / "graph.py"), *at]) == 0
        out = capsys.readouterr().out
    assert f"running (pid {os.getpid()}" in out and ", engine local)" in out, out
    assert "last Spark run" not in out and "spark:" not in out, out


def test_cli_without_java_says_what_to_install(env, capsys, monkeypatch):
    monkeypatch.setenv("JAVA_HOME", str(env / "no-java-here"))
    assert main(["pipeline", "run", str(env / "graph.py")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "Java 17 or newer is needed for Spark: install openjdk-17-jre" in err
    assert "--engine local" in err


GATED = """
import os
import time

from dataspace.pipeline import Graph

graph = Graph("shout", error_stream="shout.errors")
graph.source("chat")
GATE = {gate!r}
CRASH = {crash!r}


def upper(v):
    if v == "slow":  # a long step: it goes on once the test makes the gate (at most 60 s)
        if CRASH and not os.path.exists(GATE + ".crashed"):
            open(GATE + ".crashed", "w").close()
            os._exit(1)  # the first attempt's worker dies, as with an executor lost
        deadline = time.monotonic() + 60
        while not os.path.exists(GATE) and time.monotonic() < deadline:
            time.sleep(0.05)
    return v.upper()


graph.map("upper", "chat", "loud", upper)
"""


class Run:
    """A real `dataspace pipeline run` (its own JVM) of the gated graph, in a session of
    its own so that Ctrl-C goes to its process group, as a terminal sends it."""

    def __init__(self, env, *extra: str, crash: bool = False, master: str | None = None) -> None:
        self.gate = env / "gate"
        (env / "gated.py").write_text(GATED.format(gate=str(self.gate), crash=crash))
        if master is None:
            master = "local[1,2]" if crash else "local[1]"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dataspace.cli", "pipeline", "run", str(env / "gated.py"),
             "--master", master, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.lines.append("EOF")
            self.cond.notify_all()

    def wait_line(self, pred, after: int = 0) -> int:
        with self.cond:
            assert self.cond.wait_for(lambda: any(pred(x) for x in self.lines[after:]), LONG), \
                self.lines
            return next(i for i, x in enumerate(self.lines) if i >= after and pred(x))

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def close(self) -> None:
        self.gate.touch()  # a worker still waiting goes on (and is stopped with its JVM)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(LONG)


def test_cli_process_is_quiet_and_ctrl_c_mid_batch_finishes_the_batch(env):
    """A real `dataspace pipeline run` process (its own JVM): no Spark log noise on the
    terminal, a live progress line, and Ctrl-C in the middle of a batch lets the batch
    finish and commit -- as the docs say -- then stops cleanly (exit 0).  It once stopped
    the queries at once, dropping the batch for the next run to do again.  The batch's
    first attempt loses its worker (local[1,2]: Spark tries a task twice): the progress
    says so, and estimates the ETA anew."""
    main(["stream", "append", "chat", '"x"'])
    run = Run(env, "--interval", "0.2", crash=True)
    try:
        with open_store(env / "data") as s:
            assert s.wait_until(lambda: s.next_index("loud") == 1, timeout=LONG)
            run.wait_line(lambda x: "upper in 1 out 1" in x)
            s.append("chat", "slow")
        at = run.wait_line(lambda x: "[batch 1: 1 message" in x)  # the batch runs (and waits)
        at = run.wait_line(lambda x: "1 failed and retried" in x and "estimating ETA" in x, at)
        run.ctrl_c()
        at = run.wait_line(lambda x: x == STOPPING, at)
        run.wait_line(lambda x: "[finishing batch 1: 1 message" in x, at)
        assert run.proc.poll() is None  # it waits for the batch
        run.gate.touch()
        assert run.proc.wait(LONG) == 0
        err = run.proc.stderr.read()
        run.wait_line(lambda x: x == "EOF")
    finally:
        run.close()
    assert "WARN" not in err and "log4j" not in err and "incubator" not in err, err
    assert err == "", err
    assert any("interrupted: 2 messages in, 2 out" in x for x in run.lines), run.lines
    with open_store(env / "data") as s:
        assert [e.value for e in s.read("loud")] == ["X", "SLOW"]


def test_a_worker_lost_under_a_batch_is_said_as_such_not_as_the_functions_error(env):
    """local[1]: Spark tries a task once, so a worker that dies under a batch (killed, or
    the kernel's out-of-memory killer) stops the processor.  The last line says that the
    batch was lost with the worker and to run again (and how Spark retries it by itself)
    -- it said "fix the function or configure an error stream", about a function that
    did nothing wrong."""
    main(["stream", "append", "chat", '"slow"'])
    run = Run(env, "--until-idle", crash=True, master="local[1]")
    try:
        assert run.proc.wait(LONG) == 1
        err = run.proc.stderr.read()
    finally:
        run.close()
    line = [x for x in err.splitlines() if x.startswith("dataspace pipeline: processor ")]
    assert len(line) == 1 and "/upper stopped: " in line[0], err  # once, GRAPH/PROCESSOR
    assert "Spark lost the worker running its batch" in line[-1], line
    assert "run again and the batch is retried, exactly once" in line[-1], line
    assert "--master 'local[1,4]'" in line[-1], line
    assert "fix the function" not in line[-1] and "Consider setting" not in line[-1], line
    assert (env / "gate.crashed").exists()  # (the worker did die)


def _children(pid: int) -> list[int]:
    kids = []
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/children") as f:
            kids += [int(x) for x in f.read().split()]
    return kids


def test_cli_second_ctrl_c_mid_batch_stops_at_once_in_one_line(env):
    """While the first Ctrl-C waits for the batch, a second stops at once: exit 130 and
    one line -- it once printed "KeyboardInterrupt while sending command" and a py4j
    traceback (the KeyboardInterrupt landed in a py4j call).  The JVM goes too; the
    batch is left for the next run (nothing of it committed)."""
    main(["stream", "append", "chat", '"slow"'])
    run = Run(env, "--interval", "0.2")
    try:
        at = run.wait_line(lambda x: "[batch 0: 1 message" in x)
        jvms = _children(run.proc.pid)
        assert jvms
        run.ctrl_c()
        run.wait_line(lambda x: x == STOPPING, at)
        run.wait_line(lambda x: "[finishing batch 0" in x, at)
        run.ctrl_c()
        assert run.proc.wait(LONG) == 130
        err = run.proc.stderr.read()
        run.wait_line(lambda x: x == "EOF")
        for pid in jvms:  # gone with the driver (their standard input closed)
            with contextlib.suppress(ProcessLookupError):
                fd = os.pidfd_open(pid)
                try:
                    assert select.select([fd], [], [], LONG)[0], f"process {pid} still runs"
                finally:
                    os.close(fd)
    finally:
        run.close()
    assert err == "dataspace pipeline: stopped at once (the next run recovers)\n", err
    out = "\n".join(run.lines)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    with open_store(env / "data") as s:
        assert s.next_index("loud") == 0


def test_the_documented_example_graph_runs_on_spark(spark, env, capsys, monkeypatch):
    doc = os.path.join(os.path.dirname(__file__), "..", "docs", "pipelines.md")
    text = open(doc).read().split("<!-- example-graph -->", 1)[1]
    (env / "orders.py").write_text(text.split("```python", 1)[1].split("```", 1)[0])
    monkeypatch.chdir(env)
    main(["stream", "append", "orders", '<order 1 "ann" 250>', '<order 2 "bob" 20>'])
    main(["stream", "append", "payments", "<payment 1 250>", "<payment 2 25>"])
    capsys.readouterr()
    assert main(["pipeline", "run", "orders.py", "--until-idle", "-q"]) == 0
    with open_store(env / "data") as s:
        assert [e.value for e in s.read("notifications")] == [parse('<alert <paid 1 "ann" 250>>')]
        assert s.read("orders.errors")[0].value.fields[2] == "payment 2/25 does not match order 2/20"
    assert sqlite3.connect(env / "ledger.db").execute("select * from paid").fetchall() == [(1, "ann", 250)]


STOPPING = ("dataspace pipeline: stopping ... (Ctrl-C again stops at once; the next run "
            "recovers)")


@pytest.mark.parametrize("after, twice", [
    ("dataspace pipeline: starting Spark (local[1]) ...", False),  # the JVM starts
    ("dataspace pipeline: JVM up", False),  # the Spark context starts
    ("dataspace pipeline: starting Spark (local[1]) ...", True),
])
def test_cli_ctrl_c_while_spark_starts_is_said_at_once_and_stops(env, after, twice):
    """Every phase of starting Spark is said as it ends (a long one every ten seconds
    while it lasts); Ctrl-C is said at once -- the next line, before any other phase --
    and stops the start-up after the phase under way: exit 0, nothing ran, no traceback
    (it once gave four py4j/PySpark tracebacks, and said nothing for seconds).  A second
    Ctrl-C stops at once: exit 130."""
    main(["stream", "append", "chat", '"x"'])
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataspace.cli", "pipeline", "run", str(env / "graph.py"),
         "--master", "local[1]"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    cond = threading.Condition()

    def pump():
        for line in proc.stdout:
            with cond:
                lines.append(line.rstrip("\n"))
                cond.notify_all()
        with cond:
            lines.append("EOF")
            cond.notify_all()

    threading.Thread(target=pump, daemon=True).start()
    try:
        with cond:
            assert cond.wait_for(lambda: any(x.startswith(after) for x in lines), LONG), lines
            at = len(lines)
        proc.send_signal(signal.SIGINT)
        with cond:
            assert cond.wait_for(lambda: len(lines) > at, LONG)
            assert lines[at] == STOPPING, lines  # said before the phase under way ends
        if twice:
            proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
        assert proc.wait(LONG) == (130 if twice else 0), (lines, err)
        with cond:
            assert cond.wait_for(lambda: lines[-1] == "EOF", LONG)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    if twice:
        assert err.strip() == "dataspace pipeline: stopped at once (the next run recovers)"
    else:
        assert err == ""
        assert lines[-2] == "dataspace pipeline: interrupted before the graph started: nothing ran"
        nxt = {"dataspace pipeline: starting Spark (local[1]) ...": "Spark context ready",
               "dataspace pipeline: JVM up": "Spark session ready"}[after]
        assert not any(nxt in x for x in lines), lines  # no phase after the one under way
    assert not any("running graph" in x for x in lines)
    with open_store(env / "data") as s:
        assert s.next_index("loud") == 0


def test_a_bad_source_option_of_a_dataframe_processor_is_one_line(spark, tmp_path):
    g = Graph("g")
    g.source("in")
    g.dataframe("d", "in", "out", lambda df: df.select("index", "value"), maxRowsPerBatch="many")
    with open_store(tmp_path) as store:
        store.append("in", 1)
        with SparkEngine(g, store, spark=spark) as e, pytest.raises(EngineError) as err:
            e.drain()
    assert str(err.value) == "dataframe 'd': option maxRowsPerBatch: expected a whole number, not 'many'"
