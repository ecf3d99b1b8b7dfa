"""The ``dataspace`` Spark source: batch and streaming reads, offsets, partitions,
admission control, Trigger.AvailableNow, the schema and the Arrow path.

The stream reader's planning (``latestOffset``/``partitions``) is also driven directly,
without a query, where exact offsets are checked; everything else runs real Spark
(``spark`` fixture: one local[2] session for the whole test run)."""

from __future__ import annotations

import json
import time

import pytest

from dataspace.streams import open_store
from dataspace.values import Record, Symbol, encode, parse, stringify
from spark_support import run_query

pytest.importorskip("pyspark")

from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, ReadMinRows

from dataspace.pipeline.spark._store import store_for
from dataspace.pipeline.spark.offsets import make_offset, offset_ranges
from dataspace.pipeline.spark.source import (
    OptionError,
    _StreamReader,
    parse_options,
    read_partition,
)

VALUES = [parse('<Says "alice" "hi">'), 42, "plain", parse("[1 2 3]"), parse('<Present "bob">')]


def reader(path, **opts):
    o = {"path": str(path), **{k: str(v) for k, v in opts.items()}}
    return _StreamReader(parse_options(o))


def test_batch_read_rows_and_schema(spark, tmp_path):
    t0 = time.time_ns()
    with open_store(tmp_path) as s:
        s.append_many("chat", VALUES)
    df = spark.read.format("dataspace").option("path", str(tmp_path)).option("stream", "chat").load()
    assert [f.name for f in df.schema.fields] == [
        "stream", "index", "seq", "time", "value", "text", "label", "fields"]
    assert {f.name: f.dataType.simpleString() for f in df.schema.fields}["fields"] == "array<string>"
    rows = sorted(df.collect(), key=lambda r: r["index"])
    assert [r["index"] for r in rows] == list(range(5))
    assert [bytes(r["value"]) for r in rows] == [encode(v) for v in VALUES]
    assert [r["text"] for r in rows] == [stringify(v) for v in VALUES]
    assert [r["label"] for r in rows] == ["Says", None, None, None, "Present"]
    assert rows[0]["fields"] == ['"alice"', '"hi"'] and rows[1]["fields"] is None
    assert all(r["stream"] == "chat" for r in rows)
    assert [r["seq"] for r in rows] == sorted(r["seq"] for r in rows)
    assert abs(rows[0]["time"].timestamp() - t0 / 1e9) < 60


def test_batch_read_ranges_partitions_and_options(spark, tmp_path):
    with open_store(tmp_path) as s:
        s.append_many("a", range(10))
        s.append_many("b", range(100, 103))
    base = spark.read.format("dataspace").option("path", str(tmp_path))
    df = (base.option("streams", "a,b").option("partitionRows", 3)
          .option("startingOffsets", json.dumps({"a": 2}))
          .option("endingOffsets", json.dumps({"a": 9})).option("decode", "false").load())
    assert df.columns == ["stream", "index", "seq", "time", "value"]
    assert df.rdd.getNumPartitions() == 4  # a: [2,5) [5,8) [8,9); b: [0,3)
    got = sorted((r["stream"], r["index"]) for r in df.collect())
    assert got == [("a", i) for i in range(2, 9)] + [("b", i) for i in range(3)]
    meta = base.option("stream", "a").option("includeMeta", "true").load()
    assert "meta" in meta.columns and meta.where("meta is not null").count() == 0
    # the tuple path gives the same rows as the Arrow path
    arrow = base.option("stream", "a").load().orderBy("index").collect()
    plain = base.option("stream", "a").option("arrow", "false").load().orderBy("index").collect()
    assert [tuple(r) for r in arrow] == [tuple(r) for r in plain]


def test_bad_options_say_what_is_wrong(tmp_path):
    with pytest.raises(OptionError, match=r"needs .option\('store'"):
        parse_options({"stream": "x"})
    with pytest.raises(OptionError, match=r"needs .option\('stream'"):
        parse_options({"path": str(tmp_path)})
    with pytest.raises(OptionError, match="mode: one of each, join, alts"):
        parse_options({"path": str(tmp_path), "stream": "x", "mode": "zip"})
    with pytest.raises(OptionError, match="maxRowsPerBatch: expected a whole number"):
        parse_options({"path": str(tmp_path), "stream": "x", "maxRowsPerBatch": "lots"})
    with pytest.raises(OptionError, match="startingOffsets"):
        parse_options({"path": str(tmp_path), "stream": "x", "startingOffsets": "[1]"})
    assert parse_options({"path": str(tmp_path), "stream": "x", "maxRowsPerBatch": "all"}).max_rows is None


def test_errors_through_spark_are_one_line(spark, tmp_path):
    """What a program calling spark.read/readStream sees: the connector's message, not an
    AssertionError or a worker traceback ending in SQLSTATE: 38000."""
    from pyspark.errors import AnalysisException

    with open_store(tmp_path) as s:
        s.append("chat", 1)
        s.create_stream("empty")
    db = tmp_path / "streams.sqlite3"

    def error(make):
        with pytest.raises(AnalysisException) as e:
            make().collect()
        return str(e.value)

    def read():  # a DataFrameReader keeps its options: a new one each time
        return spark.read.format("dataspace").option("path", str(tmp_path))

    assert error(lambda: read().option("stream", "chta").load()) == (
        f"no stream named 'chta' in {db} (dataspace stream ls lists them)")
    assert error(lambda: read().option("stream", "chat").option("mode", "both").load()) == (
        "option mode: one of each, join, alts, not 'both'")
    with pytest.raises(AnalysisException) as e:
        (spark.readStream.format("dataspace").option("path", str(tmp_path))
         .option("stream", "chat").option("maxRowsPerBatch", "many").load())
    assert str(e.value) == "option maxRowsPerBatch: expected a whole number, not 'many'"
    nowhere = spark.read.format("dataspace").option("path", str(tmp_path / "nowhere"))
    assert error(lambda: nowhere.option("stream", "chat").load()).startswith(
        f"no stream store at {tmp_path / 'nowhere' / 'streams.sqlite3'}; check")
    assert read().option("stream", "empty").load().collect() == []  # empty, not an error


def test_error_line_finds_the_connectors_message():
    from dataspace.pipeline.spark.errors import error_line

    text = ("[PYTHON_DATA_SOURCE_ERROR] Failed to create Python data source instance: "
            "Traceback (most recent call last):\n  File \"x.py\", line 1, in schema\n"
            "    raise OptionError(...)\ndataspace.pipeline.spark.source.OptionError: "
            "option mode: one of each, join, alts, not 'both'\n SQLSTATE: 38000")
    assert error_line(text) == "option mode: one of each, join, alts, not 'both'"
    assert error_line("ValueError: not ours") is None


def test_offsets_admission_control_and_available_now(tmp_path):
    """latestOffset: offsets are stream indices, each batch says where it starts; the
    read limit caps rows; ReadAllAvailable ignores the option; AvailableNow stops at the
    ends seen when it was prepared; no new data returns the start offset unchanged."""
    with open_store(tmp_path) as s:
        s.append_many("a", range(10))
        r = reader(tmp_path, stream="a", maxRowsPerBatch=4, waitMs=0)
        start = r.initialOffset()
        assert start == make_offset({"a": 0}, {"a": 0})
        assert r.getDefaultReadLimit() == ReadMaxRows(4)
        o1 = r.latestOffset(start, ReadMaxRows(4))
        assert offset_ranges(o1) == {"a": (0, 4)}
        o2 = r.latestOffset(o1, ReadMaxRows(4))
        assert offset_ranges(o2) == {"a": (4, 8)}
        assert offset_ranges(r.latestOffset(o2, ReadAllAvailable())) == {"a": (8, 10)}
        assert r.latestOffset(o2, ReadMinRows(5)) == o2  # only 2 new rows: wait for more
        r.prepareForTriggerAvailableNow()
        s.append_many("a", range(10, 15))
        o3 = r.latestOffset(o2, ReadAllAvailable())
        assert offset_ranges(o3) == {"a": (8, 10)}  # not beyond the target
        assert r.latestOffset(o3, ReadMaxRows(4)) == o3  # nothing new for this query
        # a new reader (the next query) sees the new rows; latest starts at the end
        assert offset_ranges(reader(tmp_path, stream="a", waitMs=0).latestOffset(o3, ReadMaxRows(100))) == {"a": (10, 15)}
        late = reader(tmp_path, stream="a", startingOffsets="latest", waitMs=0)
        assert late.initialOffset() == make_offset({"a": 15}, {"a": 15})


def test_idle_latest_offset_wakes_on_append(tmp_path, monkeypatch):
    """With no new data latestOffset sleeps on the store's wake-ups (bounded by waitMs)
    and answers as soon as another process appends."""
    import subprocess
    import sys

    with open_store(tmp_path) as s:
        s.append_many("a", [1])
    r = reader(tmp_path, stream="a", waitMs=60_000)
    start = make_offset({"a": 1}, {"a": 1})
    proc = subprocess.Popen([sys.executable, "-c",
                             "import sys; from dataspace.streams import open_store; "
                             "s = open_store(sys.argv[1]); sys.stdin.read(1); s.append('a', 2)",
                             str(tmp_path)], stdin=subprocess.PIPE)
    # The child appends only once the reader is in wait_change (it found nothing new),
    # and each wait records whether the store changed or the wait timed out.
    store = store_for(str(tmp_path))
    real_wait = store.wait_change
    woken: list[bool] = []

    def wait_change(generation, timeout):
        proc.stdin.write(b"x")
        proc.stdin.flush()
        g = real_wait(generation, timeout)
        woken.append(g != generation)
        return g

    monkeypatch.setattr(store, "wait_change", wait_change)
    try:
        off = r.latestOffset(start, ReadMaxRows(10))
        assert woken == [True]  # waited once, and was woken rather than timed out
        assert offset_ranges(off) == {"a": (1, 2)}
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
        proc.stdin.close()


def test_modes_join_alts_each_and_retention(tmp_path):
    with open_store(tmp_path) as s:
        for i in range(6):
            s.append("x", i)
            if i % 2 == 0:
                s.append("y", 100 + i)  # y: 3 entries, committed between x's
        z = reader(tmp_path, streams="x,y", mode="join", waitMs=0)
        o = z.latestOffset(z.initialOffset(), ReadMaxRows(10))
        assert offset_ranges(o) == {"x": (0, 3), "y": (0, 3)}  # one from each per set
        parts = z.partitions(z.initialOffset(), o)
        assert [p.ranges for p in parts] == [[("x", 0, 3), ("y", 0, 3)]]
        a = reader(tmp_path, streams="x,y", mode="alts", waitMs=0, partitionRows=2)
        o = a.latestOffset(a.initialOffset(), ReadMaxRows(4))
        # commit order: x0 y100 x1 x2 y102 ...: the first four are x0, y0, x1, x2
        assert offset_ranges(o) == {"x": (0, 3), "y": (0, 1)}
        parts = a.partitions(a.initialOffset(), o)
        assert [p.ranges for p in parts] == [[("x", 0, 1), ("y", 0, 1)], [("x", 1, 3)]]
        e = reader(tmp_path, streams="x,y", waitMs=0)
        o = e.latestOffset(e.initialOffset(), ReadMaxRows(5))
        assert offset_ranges(o) == {"x": (0, 3), "y": (0, 2)} or offset_ranges(o) == {"x": (0, 2), "y": (0, 3)}
        # retention removed x's first entries: a batch from 0 starts at the first stored one
        s.create_stream("x", max_count=2)
        s.apply_retention()
        o = e.latestOffset(make_offset({"x": 0, "y": 3}, {"x": 0, "y": 3}), ReadMaxRows(10))
        assert offset_ranges(o) == {"x": (0, 6), "y": (3, 3)}
        rows = [b for p in e.partitions(make_offset({"x": 0, "y": 3}, {"x": 0, "y": 3}), o)
                for b in read_partition(e.o, p)]
        assert sum(b.num_rows for b in rows) == 2
        assert rows[0].column("index").to_pylist() == [4, 5]


def test_pinned_first_batch(tmp_path):
    """The engine pins the first batch to a step recovery must retry."""
    with open_store(tmp_path) as s:
        s.append_many("a", range(10))
    r = reader(tmp_path, stream="a", startingOffsets=json.dumps({"a": 3}), waitMs=0,
               firstBatch=json.dumps({"starts": {"a": 3}, "ends": {"a": 5}}))
    o = r.latestOffset(r.initialOffset(), ReadMaxRows(100))
    assert offset_ranges(o) == {"a": (3, 5)}
    assert offset_ranges(r.latestOffset(o, ReadMaxRows(100))) == {"a": (5, 10)}


def test_streaming_batches_follow_admission_control(spark, tmp_path):
    """A real query: AvailableNow with maxRowsPerBatch=4 over 10 rows is three batches
    whose offsets are index ranges; Trigger.Once (ReadAllAvailable) is one batch."""
    with open_store(tmp_path) as s:
        s.append_many("a", [Record(Symbol("n"), [i]) for i in range(10)])
    seen = []

    def record(df, batch_id):
        seen.append((batch_id, sorted(r["index"] for r in df.select("index").collect())))

    src = (spark.readStream.format("dataspace").option("path", str(tmp_path)).option("stream", "a")
           .option("maxRowsPerBatch", 4).option("waitMs", 0))
    q = (src.load().writeStream.foreachBatch(record)
         .option("checkpointLocation", str(tmp_path / "ck1")).trigger(availableNow=True).start())
    run_query(q)
    assert q.exception() is None
    assert seen == [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7]), (2, [8, 9])]
    ends = [p["sources"][0]["endOffset"] for p in q.recentProgress if p["numInputRows"]]
    assert [offset_ranges(json.loads(e) if isinstance(e, str) else e) for e in ends] == [
        {"a": (0, 4)}, {"a": (4, 8)}, {"a": (8, 10)}]
    seen.clear()
    q = (src.load().writeStream.foreachBatch(record)
         .option("checkpointLocation", str(tmp_path / "ck2")).trigger(once=True).start())
    run_query(q)
    assert seen == [(0, list(range(10)))]
    # The `tailer` option: a named tailer follows each committed batch (its commit was
    # once unreachable, nested in another function, and the position never moved).
    seen.clear()
    q = (src.option("tailer", "follower").load().writeStream.foreachBatch(record)
         .option("checkpointLocation", str(tmp_path / "ck3")).trigger(availableNow=True).start())
    run_query(q)
    assert [b for _i, b in seen] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with open_store(tmp_path) as s:
        # Spark tells a source that a batch committed when it plans the next one, so the
        # position trails the last batch of a query that stopped (docs/spark.md).
        assert s.position("a", "follower") in (8, 10)


def test_the_connector_reads_and_writes_a_postgresql_store(spark, pg_url):
    """.option("store", URL) on a PostgreSQL store: a batch read on the executors (Python
    workers open the store by URL), the password given apart as storePassword (an option
    Spark redacts), and a batch write."""
    from dataspace.pipeline.spark._store import split_password, store_options

    with open_store(pg_url) as s:
        s.append_many("a", range(10))
    bare, password = split_password(pg_url)
    assert password and password not in bare
    assert store_options(pg_url) == {"store": bare, "storePassword": password}
    df = (spark.read.format("dataspace").options(**store_options(pg_url))
          .option("stream", "a").option("partitionRows", 4).load())
    assert df.rdd.getNumPartitions() == 3
    assert sorted(r["index"] for r in df.collect()) == list(range(10))
    (df.select("value").write.format("dataspace").option("store", pg_url).option("stream", "b")
     .mode("append").save())
    with open_store(pg_url) as s:
        assert sorted(e.value for e in s.read("b")) == list(range(10))
    from pyspark.errors import AnalysisException

    with pytest.raises(AnalysisException) as e:
        spark.read.format("dataspace").option("store", pg_url).option("stream", "chta").load().collect()
    assert "no stream named 'chta' in postgresql://" in str(e.value) and password not in str(e.value)
