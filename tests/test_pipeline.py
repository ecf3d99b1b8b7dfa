"""The local engine: every processor kind, metadata, errors, restarts, at-most-once."""

from __future__ import annotations

import doctest
import sqlite3
import threading

import pytest

import dataspace.pipeline
import dataspace.pipeline.exactly_once
import dataspace.pipeline.graph
import dataspace.streams
from dataspace.pipeline import (
    Delivery,
    EngineError,
    Graph,
    LocalEngine,
    Message,
    MissingSource,
    delivery_hash,
    get_engine,
)
from dataspace.pipeline.exactly_once import backing_stream, meta_hash, parse_record
from dataspace.pipeline.sinks import SQLiteSink
from dataspace.streams import open_store
from dataspace.values import Dictionary, Record, Symbol, parse


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path)
    yield s
    s.close()


def values(store, stream):
    return [e.value for e in store.read(stream, 0, 1_000_000)]


def run(graph, store, **opts):
    with LocalEngine(graph, store, **opts) as e:
        stats = e.drain()
        return e, {s.name: s for s in stats}


@pytest.mark.parametrize("module", [dataspace.pipeline, dataspace.pipeline.exactly_once,
                                    dataspace.pipeline.graph, dataspace.streams])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_map_with_metadata_and_hash(store):
    g = Graph("g")
    g.source("in")
    g.map("inc", "in", "out", lambda v: None if v == 2 else v + 1)
    store.append_many("in", range(5))
    _e, stats = run(g, store)
    assert values(store, "out") == [1, 2, 4, 5]
    assert stats["inc"].consumed == 5 and stats["inc"].produced == 4
    out = store.read("out")
    h = delivery_hash("g/inc", {"in": 0}, {"in": 5})
    assert out[2].meta == Dictionary({Symbol("src"): Dictionary({"in": 3}), Symbol("hash"): h})
    assert meta_hash(out[2].meta_data) == h
    # The backing stream: the snapshot, then the attempt naming the last output.
    recs = [parse_record(x.data) for x in store.read(backing_stream("g/inc"))]
    assert [r.kind.name for r in recs] == ["snapshot", "attempt-output"]
    assert recs[0].starts == {"in": 0} and recs[0].ends == {"in": 5}
    assert (recs[1].stream, recs[1].index, recs[1].hash) == ("out", 3, h)
    assert store.position("in", "g/inc") == 5


def test_join_takes_one_from_each_input(store):
    g = Graph("g")
    g.source("l", "r")
    g.join("pair", ["l", "r"], "pairs", lambda a, b: [a, b])
    store.append_many("l", range(3))
    store.create_stream("r")  # a source must exist (tests/test_pipeline_cli.py)
    _e, stats = run(g, store)
    assert values(store, "pairs") == []
    assert stats["pair"].state == "waiting" and stats["pair"].lag == {"l": 3, "r": 0}
    store.append_many("r", ["a", "b"])
    run(g, store)
    assert values(store, "pairs") == [(0, "a"), (1, "b")]
    meta = store.read("pairs")[1].meta
    assert meta[Symbol("src")] == Dictionary({"l": 1, "r": 1})


def test_alts_takes_whichever_first_in_commit_order(store):
    g = Graph("g")
    g.source("x", "y")
    g.alts("merge", ["x", "y"], "merged")
    store.append("y", "y0")
    store.append("x", "x0")
    with store.transaction() as tx:
        tx.append("x", "x1")
        tx.append("y", "y1")
    run(g, store)
    assert values(store, "merged") == ["y0", "x0", "x1", "y1"]
    srcs = [dict(e.meta[Symbol("src")]) for e in store.read("merged")]
    assert srcs == [{"y": 0}, {"x": 0}, {"x": 1}, {"y": 1}]
    recs = [parse_record(x.data) for x in store.read(backing_stream("g/merge"))]
    assert [r.kind.name for r in recs] == ["snapshot", "snapshot-alts", "attempt-output"]
    assert recs[1].order == ("y", "x", "x", "y")


def test_alts_with_a_function_and_messages(store):
    g = Graph("g")
    g.source("x", "y")
    g.alts("tag", ["x", "y"], "tagged", lambda m: [m.stream, m.index, m.value], messages=True)
    store.append("x", 10)
    store.append("y", 20)
    run(g, store)
    assert values(store, "tagged") == [("x", 0, 10), ("y", 0, 20)]


def test_fork_writes_several_streams_in_one_step(store):
    g = Graph("g")
    g.source("in")
    g.fork("split", "in", ["even", "odd", "all"],
           lambda v: {"even" if v % 2 == 0 else "odd": v, "all": [v, v]})
    g.fork("copy", "in", ["c1", "c2"])
    store.append_many("in", range(4))
    run(g, store)
    assert values(store, "even") == [0, 2]
    assert values(store, "odd") == [1, 3]
    assert values(store, "all") == [0, 0, 1, 1, 2, 2, 3, 3]
    assert values(store, "c1") == values(store, "c2") == [0, 1, 2, 3]


def test_fork_returning_a_tuple_per_output(store):
    g = Graph("g")
    g.source("in")
    g.fork("split", "in", ["a", "b"], lambda v: (v, None))
    store.append_many("in", [1])
    run(g, store)
    assert values(store, "a") == [1] and values(store, "b") == []


def test_imperative_processor_emits_many(store):
    g = Graph("g")
    g.source("in")

    def explode(ctx, v):
        assert isinstance(ctx.delivery, Delivery)
        for i in range(v):
            ctx.emit("out" if i % 2 == 0 else "side", [v, i])

    g.processor("explode", "in", ["out", "side"], explode)
    store.append_many("in", [0, 3])
    run(g, store)
    assert values(store, "out") == [(3, 0), (3, 2)]
    assert values(store, "side") == [(3, 1)]


def test_sinks_receive_the_delivery_hash(store):
    g = Graph("g")
    g.source("in", "in2")
    seen = []
    batches = []
    g.sink("each", "in", lambda v, d: seen.append((v, d.hash, d.seq, dict(d.positions))))
    g.sink("batch", "in", lambda vs, d: batches.append((list(vs), d.hash)), batch=True)
    g.sink("pairs", ["in", "in2"], lambda a, b, d: seen.append(((a, b), d.seq)))
    store.append_many("in", ["a", "b"])
    store.append_many("in2", ["z"])
    run(g, store)
    h = delivery_hash("g/each", {"in": 0}, {"in": 2})
    assert seen[:2] == [("a", h, 0, {"in": 0}), ("b", h, 1, {"in": 1})]
    assert seen[2] == (("a", "z"), 0)
    assert batches == [(["a", "b"], delivery_hash("g/batch", {"in": 0}, {"in": 2}))]
    recs = [parse_record(x.data) for x in store.read(backing_stream("g/each"))]
    assert [r.kind.name for r in recs] == ["snapshot", "attempt-nil"]


def test_sqlite_sink_is_idempotent_by_delivery_hash(store, tmp_path):
    db = tmp_path / "out.db"
    sink = SQLiteSink(db, "results")
    d = Delivery(b"h" * 16, "g/db")
    sink([parse("<a 1>"), parse("<a 2>")], d)
    sink([parse("<a 1>"), parse("<a 2>")], d)  # a retry of the same step: skipped
    sink([parse("<a 3>")], Delivery(b"i" * 16, "g/db"))
    rows = sqlite3.connect(db).execute("select text from results order by rowid").fetchall()
    assert rows == [("<a 1>",), ("<a 2>",), ("<a 3>",)]
    assert (sink.written, sink.skipped) == (3, 2)
    with pytest.raises(ValueError, match="SQL identifier"):
        SQLiteSink(db, "drop table x")


def test_sqlite_sink_in_a_graph(store, tmp_path):
    db = tmp_path / "out.db"
    g = Graph("g")
    g.source("in")
    g.sink("db", "in", SQLiteSink(db, "nums", ["n INTEGER"], to_row=lambda v: (v,)), batch=True)
    store.append_many("in", range(10))
    run(g, store)
    c = sqlite3.connect(db)
    assert [r[0] for r in c.execute("select n from nums order by n")] == list(range(10))
    assert c.execute("select count(*), sum(rows) from dataspace_deliveries").fetchone() == (1, 10)


def test_errors_go_to_the_error_stream_and_count_as_delivered(store):
    g = Graph("g", error_stream="errors")
    g.source("in")
    g.map("inv", "in", "out", lambda v: 100 // v)
    g.map("obj", "out", "out2", lambda v: object() if v == 50 else v)  # not a Preserves value
    store.append_many("in", [1, 0, 2])
    e, stats = run(g, store)
    assert values(store, "out") == [100, 50]
    assert values(store, "out2") == [100]
    errs = values(store, "errors")
    assert [(r.label, r.fields[0], r.fields[1], r.fields[3]) for r in errs] == [
        (Symbol("error"), "g/inv", "ZeroDivisionError", (0,)),
        (Symbol("error"), "g/obj", "TypeError", (50,)),
    ]
    # The traceback of the user's code comes last: a frame of the lambda for the first;
    # none for the second (the function returned; its result was refused).
    assert errs[0].fields[4].startswith("Traceback (most recent call last):\n  File ")
    assert "in <lambda>" in errs[0].fields[4] and "dataspace/pipeline" not in errs[0].fields[4]
    assert errs[1].fields[4].startswith("TypeError: ")
    assert stats["inv"].errors == 1 and stats["inv"].consumed == 3
    assert store.read("errors")[0].meta[Symbol("src")] == Dictionary({"in": 1})
    assert e.failed == {}


def test_an_all_error_step_writes_attempt_error(store):
    g = Graph("g", error_stream="errors")
    g.source("in")
    g.map("boom", "in", "out", lambda v: 1 // 0)
    store.append_many("in", [1, 2])
    run(g, store)
    recs = [parse_record(x.data) for x in store.read(backing_stream("g/boom"))]
    assert [r.kind.name for r in recs] == ["snapshot", "attempt-error"]
    assert (recs[1].stream, recs[1].index) == ("errors", 1)
    e, _ = run(g, store)
    assert e.recovery()["boom"] == "1e+3a"


def test_unhandled_error_stops_the_processor_and_keeps_its_input(store):
    broken = {"on": True}

    def f(v):
        if broken["on"] and v == 3:
            raise ValueError("bad input 3")
        return v * 10

    g = Graph("g")
    g.source("in")
    g.map("f", "in", "out", f)
    g.map("other", "in", "copy", lambda v: v)
    store.append_many("in", [1, 2, 3, 4])
    with LocalEngine(g, store) as e:
        stats = {s.name: s for s in e.drain()}
        line = f.__code__.co_firstlineno + 2  # the raise
        assert e.failed == {"f": f"map 'f' failed on entry in/2: test_pipeline.py:{line}: "
                                 "ValueError: bad input 3"}
    assert stats["f"].state == "failed"
    tb = stats["f"].detail  # the user's frames only
    assert tb.splitlines()[1:] == [f'  File "{__file__}", line {line}, in f',
                                   '    raise ValueError("bad input 3")',
                                   "ValueError: bad input 3"]
    assert values(store, "out") == []  # the failing step delivered nothing
    assert values(store, "copy") == [1, 2, 3, 4]  # the other processor carried on
    assert store.position("in", "g/f") == 0  # input kept
    # Fixed and restarted: the same step is retried (recovery 1b) and delivered once.
    broken["on"] = False
    e, stats = run(g, store)
    assert e.recovery()["f"] == "1b"
    assert values(store, "out") == [10, 20, 30, 40]
    recs = [parse_record(x.data) for x in store.read(backing_stream("g/f"))]
    assert [r.kind.name for r in recs] == ["snapshot", "attempt-output"]  # one snapshot


def test_restart_continues_without_duplicates(store):
    g = Graph("g")
    g.source("in")
    g.map("id", "in", "out", lambda v: v)
    store.append_many("in", range(3))
    e, _ = run(g, store)
    assert e.recovery()["id"] == "1a"
    store.append_many("in", range(3, 6))
    e, _ = run(g, store)
    assert e.recovery()["id"] == "1d+3a"
    e, _ = run(g, store)
    assert values(store, "out") == list(range(6))


def test_nil_steps_recover_as_delivered(store):
    g = Graph("g")
    g.source("in")
    g.map("drop", "in", "out", lambda v: None)
    store.append_many("in", range(3))
    run(g, store)
    e, _ = run(g, store)
    assert e.recovery()["drop"] == "1f+3a"
    assert values(store, "out") == []


def test_group_commit_runs_many_steps_per_transaction(store):
    g = Graph("g")
    g.source("in")
    g.map("a", "in", "mid", lambda v: v + 1)
    g.map("b", "mid", "out", lambda v: v * 2)
    store.append_many("in", range(1000))
    with LocalEngine(g, store, batch=10, group_ms=10_000) as e:
        stats = {s.name: s for s in e.drain()}
        assert stats["a"].steps == 100 and stats["b"].steps == 100
        # 200 steps, 2 transactions: one per stage (a stage reads what the one before
        # it committed, since functions run outside the write transaction).
        assert e.commits == 2
    assert values(store, "out") == [(i + 1) * 2 for i in range(1000)]


def test_at_most_once_gives_the_same_output_without_records(store):
    g = Graph("g", error_stream="errors")
    g.source("l", "r")
    g.join("j", ["l", "r"], "pairs", lambda a, b: 1 // 0 if a == 2 else [a, b])
    g.fork("f", "pairs", ["x", "y"], lambda v: {"x": v[0], "y": v[1]})
    seen = []
    g.sink("s", "y", lambda v, d: seen.append(v))
    store.append_many("l", range(5))
    store.append_many("r", range(10, 15))
    _e, _ = run(g, store, guarantee="at-most-once")
    assert values(store, "x") == [0, 1, 3, 4]
    assert seen == [10, 11, 13, 14]
    assert len(values(store, "errors")) == 1
    assert store.read(backing_stream("g/j")) == []
    assert Symbol("hash") not in store.read("x")[0].meta


def test_run_follows_appends_and_stops_cleanly(store):
    g = Graph("g")
    g.source("in", create=True)  # appended to once the graph runs
    g.map("sq", "in", "out", lambda v: v * v)
    e = LocalEngine(g, store)
    progress = []
    t = threading.Thread(target=lambda: e.run(on_progress=progress.append, progress_interval=0.05))
    t.start()
    try:
        for i in range(5):
            store.append("in", i)
        assert store.wait_until(lambda: store.next_index("out") == 5, timeout=30)
    finally:
        e.stop()
        t.join(30)
        e.close()
    assert not t.is_alive()
    assert values(store, "out") == [0, 1, 4, 9, 16]
    assert progress and progress[-1][0].consumed == 5


def test_a_graph_runs_once_at_a_time(store):
    g = Graph("g")
    g.source("in", create=True)
    g.map("m", "in", "out", lambda v: v)
    with LocalEngine(g, store) as e:
        e.start()
        with pytest.raises(EngineError, match="already running"):
            LocalEngine(g, store).start()
    with LocalEngine(g, store) as e:
        e.start()  # released


@pytest.mark.parametrize("engine", ["local", "spark"])
def test_a_missing_source_is_refused_before_anything_is_created(store, engine):
    """A typo (`source("chta")`) once ran over an empty stream the engine made up, with a
    tailer that then hid the typo from `stream tail` and the connector.  Both engines now
    refuse, before they claim the graph, create a stream or start Spark."""
    g = Graph("shout")
    g.source("chta")
    g.map("upper", "chta", "loud", lambda v: v)
    store.append("chat", "hi")
    e = get_engine(engine)(g, store)
    with pytest.raises(MissingSource) as err:
        e.start()
    e.close()
    assert str(err.value) == (
        f"source stream 'chta' does not exist in {store.display} (streams there: chat; did "
        "you mean 'chat'?); create it with `dataspace stream create chta` or declare it with "
        "graph.source('chta', create=True)")
    assert err.value.missing == ["chta"]
    assert [s.name for s in store.streams(include_internal=True)] == ["chat"]
    assert store.stream_info("chat").tailers == ()
    assert store.lock_holder("graph:shout") is None
    assert getattr(e, "spark", None) is None  # Spark never started


def test_every_missing_source_is_named_and_create_true_makes_one_legitimate(store):
    g = Graph("g")
    g.source("ordrs", "paymnts")
    g.source("alerts", create=True)  # written later by another program: created empty
    g.alts("m", ["ordrs", "paymnts", "alerts"], "out")
    store.append_many("orders", [1])
    store.append_many("payments", [2])
    with pytest.raises(MissingSource) as err:
        LocalEngine(g, store).start()
    assert str(err.value) == (
        f"source streams 'ordrs', 'paymnts' do not exist in {store.display} (streams there: "
        "orders, payments; did you mean 'orders' for 'ordrs', 'payments' for 'paymnts'?); "
        "create them with `dataspace stream create NAME` or declare them with "
        "graph.source(NAME, create=True)")
    store.create_stream("ordrs")  # the other way out: the stream exists (empty)
    store.append("paymnts", 7)
    _e, stats = run(g, store)
    assert values(store, "out") == [7] and store.has_stream("alerts")
    assert stats["m"].lag == {"ordrs": 0, "paymnts": 0, "alerts": 0}


def test_engine_registry():
    assert get_engine("local") is LocalEngine
    with pytest.raises(EngineError, match="unknown engine"):
        get_engine("flink")
    try:  # the spark engine arrives with the next issue
        get_engine("spark")
    except EngineError as e:
        assert "not available" in str(e)


def test_message_objects(store):
    g = Graph("g")
    g.source("a", "b")
    got = []
    g.join("j", ["a", "b"], "o", lambda x, y: got.append((x, y)) or [x.value, y.value], messages=True)
    store.append("a", parse("<x>"))
    store.append("b", 2)
    run(g, store)
    (x, _y), = got
    assert isinstance(x, Message) and (x.stream, x.index, x.value) == ("a", 0, Record(Symbol("x"), []))
    assert values(store, "o") == [(Record(Symbol("x"), []), 2)]


def test_oversized_outputs_are_errors_of_the_function(store):
    from dataspace.streams.base import MAX_VALUE_SIZE

    g = Graph("g", error_stream="errors")
    g.source("in")
    g.map("blow", "in", "out", lambda v: b"x" * MAX_VALUE_SIZE if v == 1 else v)
    store.append_many("in", [0, 1, 2])
    run(g, store)
    assert values(store, "out") == [0, 2]
    err = values(store, "errors")[0]
    assert err.fields[1] == "ValueError" and "limit" in err.fields[2]


def test_metadata_encoder_is_canonical():
    from dataspace.pipeline.exactly_once import MetaEncoder, enc_int
    from dataspace.values import encode

    names = ["b", "a", "orders", "zz-top", "é", "a" * 130]
    m = MetaEncoder(names)
    for h in (None, b"\x01" * 16):
        for positions in ([0] * 6, [1, 127, 128, 2**31, 2**62, 255]):
            want = {Symbol("src"): Dictionary(dict(zip(names, positions)))}
            if h is not None:
                want[Symbol("hash")] = h
            assert m.encode_all(positions, m.suffix(h)) == encode(Dictionary(want))
            single = m.prefix_one("orders") + enc_int(positions[2]) + m.suffix(h)
            want1 = {Symbol("src"): Dictionary({"orders": positions[2]})}
            if h is not None:
                want1[Symbol("hash")] = h
            assert single == encode(Dictionary(want1))


def test_commit_step_writes_a_batch_once_like_the_engine(tmp_path):
    """The helper for engines that compute elsewhere (a Spark micro-batch): the same
    records as the local engine, and a re-commit of the same batch writes nothing."""
    from dataspace.pipeline.exactly_once import commit_step, recover
    from dataspace.values import encode

    g = Graph("g")
    g.source("in")
    g.map("p", "in", "out", lambda v: v * 10)
    with open_store(tmp_path / "engine") as a:
        a.append_many("in", range(4))
        run(g, a, batch=4)
        engine_out = [(e.data, e.meta_data) for e in a.read("out")]
        engine_backing = [e.data for e in a.read(backing_stream("g/p"))]
    with open_store(tmp_path / "batch") as b:
        b.append_many("in", range(4))
        batch = [(encode(v * 10), {"in": v}) for v in range(4)]
        for expect in (True, False):  # the second commit is Spark re-running the batch
            with b.transaction() as tx:
                assert commit_step(tx, "g/p", {"in": 0}, {"in": 4}, {"out": batch}) is expect
        assert [(e.data, e.meta_data) for e in b.read("out")] == engine_out
        assert [e.data for e in b.read(backing_stream("g/p"))] == engine_backing
        assert b.position("in", "g/p") == 4
        assert recover(b, "g/p").branch == "1d+3a"
        with b.transaction() as tx:  # the next batch, nothing written by it
            assert commit_step(tx, "g/p", {"in": 4}, {"in": 4}, {})
        assert recover(b, "g/p").branch == "1f+3a"


def test_sinks_run_without_holding_the_store_write_lock(store, tmp_path):
    """A side effect may write to the same store (here: another connection with a short
    busy timeout): the engine holds no write transaction while the function runs."""
    g = Graph("g")
    g.source("in")
    other = open_store(tmp_path, busy_timeout=0.5)

    def audit(v, d):
        other.append("audit", v)

    g.sink("audit", "in", audit)
    store.append_many("in", range(3))
    try:
        e, _ = run(g, store)
        assert e.failed == {}
    finally:
        other.close()
    assert values(store, "audit") == [0, 1, 2]


def test_a_traceback_from_another_machine_gets_its_source_lines_here(tmp_path):
    """A Spark executor elsewhere cannot read the graph file: the driver fills the lines in."""
    from dataspace.pipeline.failure import with_source

    f = tmp_path / "g.py"
    f.write_text("def f(v):\n    return 1 // v\n")
    tb = f'Traceback (most recent call last):\n  File "{f}", line 2, in f\nZeroDivisionError: x'
    assert with_source(tb).splitlines() == [
        "Traceback (most recent call last):", f'  File "{f}", line 2, in f',
        "    return 1 // v", "ZeroDivisionError: x"]
    assert with_source(with_source(tb)) == with_source(tb)
