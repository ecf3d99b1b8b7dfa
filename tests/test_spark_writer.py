"""The ``dataspace`` Spark sink: each micro-batch is committed with its attempt record in
one store transaction, keyed by the delivery hash of the batch's offsets, and a re-commit
of the same batch (Spark re-running it after a crash between our commit and its commit
log) writes nothing."""

from __future__ import annotations

import datetime
import json
import os

import pytest

from dataspace.pipeline.exactly_once import backing_stream, delivery_hash, recover
from dataspace.streams import open_store
from dataspace.values import Dictionary, Record, Symbol, decode, encode, parse
from spark_support import run_query

pytest.importorskip("pyspark")

import pyarrow as pa

from dataspace.pipeline.spark.sink import (
    CommitError,
    StreamWriter,
    batch_offsets,
    rows_to_values,
)

N = Symbol("n")


def offset_log(ck, batch, *lines):
    """An entry of Spark's offset log (format v1: version, metadata, one line per source)."""
    os.makedirs(ck / "offsets", exist_ok=True)
    (ck / "offsets" / str(batch)).write_text(
        "v1\n" + json.dumps({"batchWatermarkMs": 0}) + "\n" + "\n".join(lines) + "\n")


def ds(**ranges):
    return json.dumps({"dataspace": {s: {"start": a, "end": b} for s, (a, b) in ranges.items()}})


def test_batch_offsets_from_the_offset_log(tmp_path):
    ck = tmp_path / "ck"
    offset_log(ck, 3, '{"logOffset": 7}', "-", ds(a=(4, 9)), ds(b=(0, 2)))
    assert batch_offsets(str(ck), 3) == ({"a": 4, "b": 0}, {"a": 9, "b": 2})
    assert batch_offsets("file:" + str(ck), 3)[1] == {"a": 9, "b": 2}
    offset_log(ck, 4, '{"logOffset": 7}')
    with pytest.raises(CommitError, match="reads no dataspace stream"):
        batch_offsets(str(ck), 4)
    with pytest.raises(CommitError, match="cannot read Spark's offset log"):
        batch_offsets(str(ck), 5)
    with pytest.raises(CommitError, match="mounted on the driver"):
        batch_offsets("hdfs://nn/ck", 0)


def test_the_same_batch_committed_twice_is_written_once(tmp_path):
    """The writer's commit, called as Spark calls it: the second call (Spark re-running
    batch 0 after a crash before its commit log) writes nothing."""
    ck = tmp_path / "ck"
    offset_log(ck, 0, ds(**{"in": (0, 4)}))
    with open_store(tmp_path) as s:
        s.append_many("in", range(4))
    w = StreamWriter({"path": str(tmp_path), "stream": "out", "checkpointLocation": str(ck),
                      "id": "g/p"}, None)
    batch = pa.RecordBatch.from_arrays(
        [pa.array(["in"] * 4), pa.array(range(4), pa.int64()),
         pa.array([encode(v * 10) for v in range(4)], pa.binary())],
        names=["stream", "index", "value"])
    parts = [w.write(iter([batch.slice(0, 2)])), w.write(iter([batch.slice(2)]))]
    w.commit(parts, 0)
    w.commit(parts, 0)
    with open_store(tmp_path) as s:
        out = s.read("out")
        assert [e.value for e in out] == [0, 10, 20, 30]
        h = delivery_hash("g/p", {"in": 0}, {"in": 4})
        assert [e.meta for e in out] == [
            Dictionary({Symbol("src"): Dictionary({"in": i}), Symbol("hash"): h}) for i in range(4)]
        assert len(s.read(backing_stream("g/p"))) == 2  # snapshot + attempt-output
        assert recover(s, "g/p").branch == "1d+3a"
        assert s.position("in", "g/p") == 4
    # the next batch must start where the store's last step ended
    offset_log(ck, 1, ds(**{"in": (2, 4)}))
    with pytest.raises(CommitError, match="does not belong to this store's state"):
        w.commit([], 1)
    offset_log(ck, 1, ds(**{"in": (4, 4)}))
    w.commit([], 1)  # a batch without rows: an attempt-nil step
    with open_store(tmp_path) as s:
        assert recover(s, "g/p").branch == "1f+3a" and len(s.read("out")) == 4


def query(spark, tmp_path, ck, out="out", **opts):
    src = (spark.readStream.format("dataspace").option("path", str(tmp_path)).option("stream", "in")
           .option("waitMs", 0).option("decode", "false"))
    for k, v in opts.items():
        src = src.option(k, v)
    return (src.load().select("stream", "index", "value").writeStream.format("dataspace")
            .option("path", str(tmp_path)).option("stream", out).option("id", "t/copy")
            .option("checkpointLocation", str(ck)).trigger(availableNow=True).start())


def test_spark_re_running_a_committed_batch_duplicates_nothing(spark, tmp_path):
    """A real query; then the commit log's last entry is removed -- the state after a
    crash between our commit and Spark's commit log -- and Spark re-runs that batch with
    the same offsets: our commit recognises the step and writes nothing."""
    with open_store(tmp_path) as s:
        s.append_many("in", [Record(N, [i]) for i in range(10)])
    ck = tmp_path / "ck"
    q = query(spark, tmp_path, ck, maxRowsPerBatch=4)
    run_query(q)
    assert q.exception() is None
    with open_store(tmp_path) as s:
        first = [(e.data, e.meta_data) for e in s.read("out")]
        backing = [e.data for e in s.read(backing_stream("t/copy"))]
    assert [decode(d) for d, _m in first] == [Record(N, [i]) for i in range(10)]
    last = max(int(n) for n in os.listdir(ck / "commits") if n.isdigit())
    assert last == 2
    os.remove(ck / "commits" / str(last))
    crc = ck / "commits" / f".{last}.crc"
    if crc.exists():
        os.remove(crc)
    q = query(spark, tmp_path, ck, maxRowsPerBatch=4)
    run_query(q)
    assert q.exception() is None
    assert [p["batchId"] for p in q.recentProgress if p["numInputRows"]] == [2]  # re-run
    assert (ck / "commits" / str(last)).exists()
    with open_store(tmp_path) as s:
        assert [(e.data, e.meta_data) for e in s.read("out")] == first
        assert [e.data for e in s.read(backing_stream("t/copy"))] == backing


def test_a_checkpoint_that_does_not_match_the_store_is_refused(spark, tmp_path):
    with open_store(tmp_path) as s:
        s.append_many("in", range(10))
    q = query(spark, tmp_path, tmp_path / "ck1", maxRowsPerBatch=3)
    run_query(q)
    assert q.exception() is None
    # A new checkpoint starting over from the beginning, same processor id: refused.
    q = query(spark, tmp_path, tmp_path / "ck2", maxRowsPerBatch=4)
    with pytest.raises(Exception, match="does not belong to this store's state"):
        run_query(q)
    with open_store(tmp_path) as s:
        assert [e.value for e in s.read("out")] == list(range(10))


def test_a_dataframe_transformation_keeps_its_sources(spark, tmp_path):
    """Rows keeping ``index`` (and ``stream``) name their source in the metadata; other
    rows become dictionaries of their columns; a text column is parsed."""
    with open_store(tmp_path) as s:
        s.append_many("in", [Record(N, [i]) for i in range(6)])
    src = (spark.readStream.format("dataspace").option("path", str(tmp_path)).option("stream", "in")
           .option("waitMs", 0).load())
    q = (src.where("index % 2 = 0").select("stream", "index", "value").writeStream
         .format("dataspace").option("path", str(tmp_path)).option("stream", "even")
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    run_query(q)
    assert q.exception() is None
    with open_store(tmp_path) as s:
        got = s.read("even")
        assert [e.value for e in got] == [Record(N, [i]) for i in (0, 2, 4)]
        assert [e.meta[Symbol("src")] for e in got] == [Dictionary({"in": i}) for i in (0, 2, 4)]
        # The write tasks staged the rows (their commit hash spliced in by the commit when
        # they could not know it): one batch, one delivery hash.
        assert len({e.meta[Symbol("hash")] for e in got}) == 1
    assert_staged_and_taken(tmp_path)


def assert_staged_and_taken(d):
    """The write tasks staged rows in the store's shard files, and commits took them all."""
    import sqlite3

    shards = [p for p in d.iterdir() if p.name.endswith("-stage", 0, -1)]
    assert shards, "nothing was staged"
    for p in shards:
        assert sqlite3.connect(p).execute("select count(*) from staged").fetchone()[0] == 0


def test_a_users_column_named_staged_is_data(tmp_path):
    """Only the engine's staged query hands the sink summaries to unpickle; a column of
    that name in a user's rows is written as a value like any other."""
    w = StreamWriter({"path": str(tmp_path), "stream": "out",
                      "checkpointLocation": str(tmp_path / "ck")}, None)
    part = w.write(iter([pa.RecordBatch.from_arrays([pa.array([b"\x80\x04junk"], pa.binary())],
                                                    names=["staged"])]))
    assert part.staged is None
    assert [decode(d) for d in part.outputs["out"][0]] == [Dictionary({Symbol("staged"): b"\x80\x04junk"})]


def test_rows_to_values():
    datas, srcs = rows_to_values({"value": [encode(1), encode("x")], "index": [3, 4]}, ("in",))
    assert [decode(d) for d in datas] == [1, "x"] and srcs == [{"in": 3}, {"in": 4}]
    datas, srcs = rows_to_values({"text": ['<a 1>', "[2]"]})
    assert [decode(d) for d in datas] == [parse("<a 1>"), parse("[2]")] and srcs == [{}, {}]
    t = datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    datas, _ = rows_to_values({"window": [{"start": t, "end": t}], "n": [7], "tags": [["a"]],
                               "gone": [None]})
    assert decode(datas[0]) == parse(
        '{window: {start: "2024-01-02T03:04:05+00:00" end: "2024-01-02T03:04:05+00:00"} '
        'n: 7 tags: ["a"]}')
    with pytest.raises(CommitError, match="not canonical Preserves"):
        rows_to_values({"value": [b"\xff\xff"]})
    with pytest.raises(CommitError, match="not Preserves text"):
        rows_to_values({"text": ["<unclosed"]})


def test_batch_writer_appends_a_job(spark, tmp_path):
    df = spark.createDataFrame([("<a 1>",), ("<b 2>",)], "text string")
    df.write.format("dataspace").option("path", str(tmp_path)).option("stream", "t").mode("append").save()
    with open_store(tmp_path) as s:
        assert sorted(str(e.value) for e in s.read("t")) == ["<a 1>", "<b 2>"]
    assert_staged_and_taken(tmp_path)
