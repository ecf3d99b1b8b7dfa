"""The pipeline on Spark: our connector vs Spark's own file source and Parquet sink; the
per-micro-batch overhead; the read path (Arrow or not); routing at 1,000 and 100,000
patterns.

    .venv/bin/python benchmarks/bench_spark.py            # the full run (about 6 minutes)
    .venv/bin/python benchmarks/bench_spark.py --quick    # a smoke run

One SparkSession (local[*]) for everything, started first (not timed).  Measured:

1. **1-in/1-out processor, 100,000-row micro-batches.**  ``<Says who text n>`` ->
   ``<Out who n+1>`` over M pre-loaded messages:
   * ours: the Spark engine's query -- the ``dataspace`` source (index ranges, Arrow
     batches), the graph's function applied in the write tasks (the local engine's step
     code), the ``dataspace`` sink committing each batch with its attempt record in one
     fsynced SQLite transaction;
   * Spark's native file path: the same canonical values in Parquet files (one file of
     100,000 rows per micro-batch), Spark's file stream source (``maxFilesPerTrigger=1``),
     the same function through ``mapInArrow`` (decode, call, encode -- the same Python
     work per row), Spark's Parquet file sink.
   Both run with ``Trigger.AvailableNow`` from a fresh checkpoint; the time is from
   query start to the last batch committed.  Target: ours >= 50% of native.
2. **Per-micro-batch overhead**: 1-row micro-batches through each path.
3. **The read path**: a batch read of M rows into Spark's no-op sink, Arrow record
   batches vs Python tuples, without and with the decoded columns.
4. **Routing**: V values ``<order i "customer-k" amount>`` against P patterns
   ``<order $id "customer-j" $amount>`` (each value matches one pattern), P = 1,000 and
   100,000; the first job builds the index in each worker, a second job over the same
   table reuses it.  Cost per row of the warm job; target: flat within 1.5x.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import tempfile
import time
from typing import Any

from dataspace.pipeline import Graph
from dataspace.streams import open_store
from dataspace.values import Record, Symbol, decode, encode

SAYS = Symbol("Says")
OUT = Symbol("Out")
ORDER = Symbol("order")


def transform(v: Record) -> Record:
    return Record._make(OUT, (v.fields[0], v.fields[2] + 1))


def inputs(n: int) -> list[bytes]:
    return [encode(Record(SAYS, [f"user-{i % 1000}", "hello world", i])) for i in range(n)]


def settle() -> None:
    os.sync()
    gc.collect()


class Run:
    """One timed query: ``total`` seconds from query start to the last batch committed,
    and Spark's own duration of each micro-batch that read rows (``triggerExecution``)."""

    def __init__(self, total: float, progress: list[dict[str, Any]]) -> None:
        self.total = total
        self.batches = [p["durationMs"]["triggerExecution"] / 1000 for p in progress
                        if p["numInputRows"]]

    @property
    def steady(self) -> float:
        """Seconds in micro-batches: the run without the query's start-up."""
        return sum(self.batches)


def ours(spark: Any, datas: list[bytes], batch: int) -> Run:
    """The Spark engine's 1-in/1-out query over ``datas``."""
    from dataspace.pipeline.spark.engine import SparkEngine

    d = tempfile.mkdtemp(prefix="bench-spark-")
    try:
        with open_store(d) as store:
            with store.transaction() as tx:
                tx.append_encoded("in", datas)
            g = Graph("bench")
            g.source("in")
            g.map("transform", "in", "out", transform)
            with SparkEngine(g, store, spark=spark, batch=batch) as e:
                e.start()
                settle()
                t = time.perf_counter()
                stats = e.drain()
                dt = time.perf_counter() - t
                progress = e.queries[0].query.recentProgress
            assert store.next_index("out") == len(datas), store.next_index("out")
            assert stats[0].steps == len(Run(dt, progress).batches)
        return Run(dt, progress)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _native_fn(batches: Any) -> Any:
    import pyarrow as pa

    for b in batches:
        vals = b.column(1).to_pylist()
        out = [encode(transform(decode(v))) for v in vals]
        yield pa.RecordBatch.from_arrays([b.column(0), pa.array(out, pa.binary())],
                                         names=["index", "value"])


def native(spark: Any, datas: list[bytes], batch: int) -> Run:
    """Spark's file source -> the same function (mapInArrow) -> Parquet file sink."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tempfile.mkdtemp(prefix="bench-native-")
    try:
        src = os.path.join(d, "in")
        os.makedirs(src)
        for k, a in enumerate(range(0, len(datas), batch)):
            chunk = datas[a:a + batch]
            t = pa.table({"index": pa.array(range(a, a + len(chunk)), pa.int64()),
                          "value": pa.array(chunk, pa.binary())})
            pq.write_table(t, os.path.join(src, f"part-{k:05d}.parquet"))
        settle()
        t0 = time.perf_counter()
        q = (spark.readStream.schema("index bigint, value binary").option("maxFilesPerTrigger", 1)
             .parquet(src).mapInArrow(_native_fn, "index bigint, value binary")
             .writeStream.format("parquet").option("path", os.path.join(d, "out"))
             .option("checkpointLocation", os.path.join(d, "ck")).trigger(availableNow=True).start())
        q.awaitTermination()
        dt = time.perf_counter() - t0
        n = spark.read.parquet(os.path.join(d, "out")).count()
        assert n == len(datas), n
        return Run(dt, q.recentProgress)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def read_path(spark: Any, datas: list[bytes], arrow: bool, decode_cols: bool) -> float:
    d = tempfile.mkdtemp(prefix="bench-read-")
    try:
        with open_store(d) as store, store.transaction() as tx:
            tx.append_encoded("in", datas)
        df = (spark.read.format("dataspace").option("path", d).option("stream", "in")
              .option("arrow", str(arrow).lower()).option("decode", str(decode_cols).lower())
              .option("partitionRows", len(datas) // 2 + 1).load())
        t = time.perf_counter()
        df.write.format("noop").mode("overwrite").save()
        return time.perf_counter() - t
    finally:
        shutil.rmtree(d, ignore_errors=True)


def routing(spark: Any, n_values: int, n_patterns: int) -> tuple[float, float, int]:
    """(first job s, warm job s, matches) for V values against P patterns."""
    from dataspace.pipeline.spark.route import route

    rng = random.Random(n_patterns)
    vals = [(i, encode(Record(ORDER, [i, f"customer-{rng.randrange(n_patterns)}", i % 997])))
            for i in range(n_values)]
    vdf = spark.createDataFrame(vals, "index bigint, value binary").repartition(2).cache()
    vdf.count()
    pats = [(str(j), f'<order $id "customer-{j}" $amount>') for j in range(n_patterns)]
    times = []
    n = 0
    for _ in range(3):  # the first job builds the index in its workers; later ones reuse it
        t = time.perf_counter()
        n = route(spark, pats, vdf).count()
        times.append(time.perf_counter() - t)
    vdf.unpersist()
    assert n == n_values, n
    return times[0], min(times[1:]), n


def index_build(n_patterns: int) -> float:
    from dataspace.index import Index
    from dataspace.pattern import parse_pattern

    ix = Index([])
    t = time.perf_counter()
    for j in range(n_patterns):
        ix.add_handler(parse_pattern(f'<order $id "customer-{j}" $amount>'), j)  # type: ignore[arg-type]
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (small sizes)")
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--only", default="1234", help="which sections to run (e.g. 14)")
    args = ap.parse_args()
    m = 100_000 if args.quick else 1_000_000
    batch = 100_000 if not args.quick else 50_000
    routing_rows = 20_000 if args.quick else 200_000

    from dataspace.pipeline.spark.session import get_session

    t = time.perf_counter()
    spark, _ = get_session(args.master, app_name="bench_spark")
    print(f"Spark {spark.version} on {spark.sparkContext.master} "
          f"({spark.sparkContext.defaultParallelism} cores); session start {time.perf_counter() - t:.1f}s")
    datas = inputs(m)

    if "1" in args.only:
        section1(spark, datas, m, batch)
    if "2" in args.only:
        section2(spark, args.quick)
    if "3" in args.only:
        section3(spark, datas, m)
    if "4" in args.only:
        section4(spark, routing_rows)


def section1(spark: Any, datas: list[bytes], m: int, batch: int) -> None:
    print(f"\n1. 1-in/1-out processor, {m:,} messages in micro-batches of {batch:,} (AvailableNow)")
    native(spark, datas[:batch], batch)  # warm up both paths (Python workers, daemons)
    ours(spark, datas[:batch], batch)
    runs_o = [ours(spark, datas, batch) for _ in range(2)]
    runs_n = [native(spark, datas, batch) for _ in range(2)]
    o_tot, n_tot = min(r.total for r in runs_o), min(r.total for r in runs_n)
    o_st, n_st = min(r.steady for r in runs_o), min(r.steady for r in runs_n)
    print("   rows/s                                              end to end   in micro-batches")
    print(f"   ours (dataspace source -> function -> dataspace sink, fsynced) "
          f"{m / o_tot:>10,.0f} {m / o_st:>13,.0f}")
    print(f"   Spark native (Parquet files -> mapInArrow -> Parquet sink)     "
          f"{m / n_tot:>10,.0f} {m / n_st:>13,.0f}")
    print(f"   ratio ours/native (target >= 50%)                              "
          f"{n_tot / o_tot:>10.0%} {n_st / o_st:>13.0%}")
    print(f"   per 100,000-row batch: ours {o_st / (m / batch):.2f}s, native {n_st / (m / batch):.2f}s; "
          f"query start-up: ours {o_tot - o_st:.2f}s, native {n_tot - n_st:.2f}s")


def section2(spark: Any, quick: bool) -> None:
    k = 10 if quick else 20
    tiny = inputs(k)
    r_o, r_n = ours(spark, tiny, 1), native(spark, tiny, 1)
    t_ours, b_ours = r_o.steady, len(r_o.batches)
    t_nat, b_nat = r_n.steady, len(r_n.batches)
    print(f"\n2. per-micro-batch overhead ({k} one-row batches, Spark's duration of each)")
    print(f"   ours: {t_ours / b_ours * 1000:,.0f} ms per batch; native: {t_nat / b_nat * 1000:,.0f} ms per batch")



def section3(spark: Any, datas: list[bytes], m: int) -> None:
    print(f"\n3. read path: spark.read.format('dataspace') of {m:,} rows into the no-op sink")
    for decode_cols in (False, True):
        ta = min(read_path(spark, datas, True, decode_cols) for _ in range(2))
        tt = min(read_path(spark, datas, False, decode_cols) for _ in range(2))
        what = "with decoded columns (text, label, fields)" if decode_cols else "raw columns (index, time, value...)"
        print(f"   {what}: Arrow {m / ta:,.0f} rows/s, tuples {m / tt:,.0f} rows/s ({tt / ta:.1f}x)")



def section4(spark: Any, routing_rows: int) -> None:
    print(f"\n4. routing {routing_rows:,} values (each matches one pattern)")
    per_row = {}
    for p in (1_000, 100_000):
        first, warm, n = routing(spark, routing_rows, p)
        per_row[p] = warm / routing_rows
        print(f"   {p:>7,} patterns: index build {index_build(p):.2f}s per worker; first job "
              f"{first:.2f}s, warm job {warm:.2f}s = {warm / routing_rows * 1e6:.1f} us/row ({n:,} matches)")
    print(f"   cost per row, 100,000 vs 1,000 patterns: {per_row[100_000] / per_row[1_000]:.2f}x  (target <= 1.5x)")


if __name__ == "__main__":
    main()
