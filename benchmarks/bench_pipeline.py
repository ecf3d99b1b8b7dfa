"""Pipeline throughput: exactly-once vs at-most-once vs the storage ceiling; join -> fork.

    .venv/bin/python benchmarks/bench_pipeline.py            # the full run (about 1 minute)
    .venv/bin/python benchmarks/bench_pipeline.py --quick    # a smoke run

Measured, all with durable commits (SQLite WAL, synchronous=FULL: every commit fsynced):

1. A 1-in/1-out processor (``<Says who text n>`` -> ``<Out who n+1>``) over M pre-loaded
   messages, exactly-once (the default: snapshot, delivery hash in every output's
   metadata, attempt record, group commit) -- best of 3 runs on fresh stores.
2. The same graph at-most-once, in the same run (target: exactly-once >= 80% of it).
3. Raw batched SQLite inserts of the same output rows into the same table layout, 1,000
   rows per transaction: the storage ceiling on this machine (and, for scale, minimal
   rows: an integer key and a 20-byte blob).
4. 1,000,000 messages through join -> fork: two sources of 1M messages each, a join
   writing 1M pairs, a fork copying each pair to two streams (2M rows).  End to end: an
   appender process writes the sources (10,000 per transaction) while the graph runs in
   this process, timed from the first append to the last output committed (target:
   <= 30 s).  Also: the processing time alone, over pre-loaded sources.
5. The same 1-in/1-out processor (exactly-once and at-most-once) and the pre-loaded
   join -> fork (200,000 messages by default) on the PostgreSQL store, side by side: a
   PostgreSQL server started for the run on loopback (Debian's server binaries; the
   store's own commits are synchronous, the test server itself runs without fsync, so
   this measures the store's protocol and queries, not the disk).  ``--no-postgres``
   skips it; it is skipped with a note where no server binaries are installed.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sqlite3
import sys
import tempfile
import time

from bench_steps import finish, say, skip, start_steps, step
from dataspace.pipeline import Graph, LocalEngine
from dataspace.pipeline.exactly_once import MetaEncoder, delivery_hash
from dataspace.streams import open_store
from dataspace.values import Record, Symbol, encode

SAYS = Symbol("Says")
OUT = Symbol("Out")
PAIR = Symbol("Pair")

def settle() -> None:
    """Start each measurement from the same state: the previous run's files written back
    to disk (its writeback would otherwise slow this run's fsyncs) and garbage collected."""
    os.sync()
    gc.collect()


def inputs(n: int) -> list[bytes]:
    return [encode(Record(SAYS, [f"user-{i % 1000}", "hello world", i])) for i in range(n)]


def transform(v: Record) -> Record:
    return Record._make(OUT, (v.fields[0], v.fields[2] + 1))


class Postgres:
    """A fresh database per measurement on one throwaway server (dataspace.streams.pgserver)."""

    def __init__(self) -> None:
        from dataspace.streams.pgserver import TempPostgres

        self.server = TempPostgres().start()
        self.n = 0

    def fresh(self) -> str:
        self.n += 1
        return self.server.create_database(f"bench_{self.n}")

    def stop(self) -> None:
        self.server.stop()


def one_in_one_out(datas: list[bytes], guarantee: str, batch: int, url: str | None = None,
                   ) -> tuple[float, int]:
    d = tempfile.mkdtemp(prefix="bench-pipeline-")
    try:
        with open_store(url or d) as store:
            with store.transaction() as tx:
                tx.append_encoded("in", datas)
            g = Graph("bench")
            g.source("in")
            g.map("transform", "in", "out", transform)
            with LocalEngine(g, store, guarantee=guarantee, batch=batch) as e:
                e.start()
                settle()
                t = time.perf_counter()
                e.drain()
                dt = time.perf_counter() - t
                commits = e.commits
            assert store.next_index("out") == len(datas)
        return dt, commits
    finally:
        shutil.rmtree(d, ignore_errors=True)


def raw_inserts(datas: list[bytes], rows_per_tx: int = 1000) -> float:
    """The same output rows (value + metadata with the hash) straight into SQLite."""
    out = [encode(transform(Record(SAYS, ["user-1", "hello world", i]))) for i in range(1000)]
    h = delivery_hash("bench/transform", {"in": 0}, {"in": 1000})
    m = MetaEncoder(["in"])
    pre, suf = m.prefix_one("in"), m.suffix(h)
    metas = [pre + encode(i) + suf for i in range(len(datas))]
    d = tempfile.mkdtemp(prefix="bench-raw-")
    try:
        c = sqlite3.connect(os.path.join(d, "raw.db"), isolation_level=None)
        c.execute("PRAGMA journal_mode = WAL")
        c.execute("PRAGMA synchronous = FULL")
        c.execute("CREATE TABLE entries (stream INTEGER NOT NULL, idx INTEGER NOT NULL, "
                  "seq INTEGER NOT NULL, time_ns INTEGER NOT NULL, value BLOB NOT NULL, "
                  "meta BLOB, PRIMARY KEY (stream, idx)) WITHOUT ROWID")
        n = len(datas)
        now = time.time_ns()
        settle()
        t = time.perf_counter()
        for s in range(0, n, rows_per_tx):
            c.execute("BEGIN IMMEDIATE")
            c.executemany("INSERT INTO entries VALUES (1, ?, ?, ?, ?, ?)",
                          [(i, i, now, out[i % 1000], metas[i]) for i in range(s, min(n, s + rows_per_tx))])
            c.execute("COMMIT")
        dt = time.perf_counter() - t
        c.close()
        return dt
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _produce(directory: str, n: int, chunk: int) -> None:
    """The appender process: both sources, alternating chunks, one transaction each
    (``directory``: a data directory or a store URL)."""
    with open_store(directory) as store:
        for lo in range(0, n, chunk):
            for s in ("left", "right"):
                datas = [encode(Record._make(SAYS, (s, "hello", i)))
                         for i in range(lo, min(n, lo + chunk))]
                with store.transaction() as tx:
                    tx.append_encoded(s, datas)


def _graph() -> Graph:
    g = Graph("jf")
    g.source("left", "right")
    g.join("pair", ["left", "right"], "pairs",
           lambda a, b: Record._make(PAIR, (a.fields[2], b.fields[2])))
    g.fork("copy", "pairs", ["a", "b"])
    return g


def raw_minimal(n: int, rows_per_tx: int = 1000) -> float:
    """The simplest rows (an integer key and a 20-byte blob), for scale."""
    d = tempfile.mkdtemp(prefix="bench-raw-")
    try:
        c = sqlite3.connect(os.path.join(d, "raw.db"), isolation_level=None)
        c.execute("PRAGMA journal_mode = WAL")
        c.execute("PRAGMA synchronous = FULL")
        c.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v BLOB)")
        blob = b"x" * 20
        settle()
        t = time.perf_counter()
        for s in range(0, n, rows_per_tx):
            c.execute("BEGIN IMMEDIATE")
            c.executemany("INSERT INTO t VALUES (?, ?)", [(i, blob) for i in range(s, min(n, s + rows_per_tx))])
            c.execute("COMMIT")
        dt = time.perf_counter() - t
        c.close()
        return dt
    finally:
        shutil.rmtree(d, ignore_errors=True)


def join_fork_end_to_end(n: int, batch: int) -> float:
    """An appender process writes the sources while the engine runs: the time from the
    first append to the last output committed."""
    import multiprocessing
    import threading

    d = tempfile.mkdtemp(prefix="bench-joinfork-")
    try:
        with open_store(d) as store:
            store.create_stream("left")
            store.create_stream("right")  # sources must exist before the graph starts
            with LocalEngine(_graph(), store, batch=batch) as e:
                e.start()
                done = threading.Event()

                def watch() -> None:
                    store.wait_until(lambda: store.next_index("b") >= n, timeout=600)
                    e.stop()
                    done.set()

                settle()
                t = time.perf_counter()
                producer = multiprocessing.get_context("spawn").Process(target=_produce, args=(d, n, 10_000))
                producer.start()
                threading.Thread(target=watch, daemon=True).start()
                e.run()
                total = time.perf_counter() - t
                producer.join()
                assert done.is_set() and store.next_index("a") == n
        return total
    finally:
        shutil.rmtree(d, ignore_errors=True)


def join_fork_preloaded(n: int, batch: int, url: str | None = None) -> tuple[float, float]:
    """Load the sources first (one process), then time the processing alone."""
    d = tempfile.mkdtemp(prefix="bench-joinfork-")
    try:
        settle()
        t0 = time.perf_counter()
        _produce(url or d, n, 100_000)
        load = time.perf_counter() - t0
        with open_store(url or d) as store:
            with LocalEngine(_graph(), store, batch=batch) as e:
                e.start()
                settle()
                t = time.perf_counter()
                e.drain()
                proc = time.perf_counter() - t
            assert store.next_index("a") == n and store.next_index("b") == n
        return load, proc
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=300_000, help="1-in/1-out messages (default 300,000)")
    ap.add_argument("--join-fork", type=int, default=1_000_000, help="join -> fork messages (default 1,000,000)")
    ap.add_argument("--batch", type=int, default=1000, help="message sets per step (default 1000)")
    ap.add_argument("--repeat", type=int, default=3, help="best of N for 1-in/1-out (default 3)")
    ap.add_argument("--pg-join-fork", type=int, default=200_000,
                    help="join -> fork messages on PostgreSQL (default 200,000)")
    ap.add_argument("--no-postgres", action="store_true", help="skip the PostgreSQL store")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repetition")
    args = ap.parse_args()
    if args.quick:
        args.messages, args.join_fork, args.repeat, args.pg_join_fork = 30_000, 100_000, 1, 30_000
    m = args.messages
    # Steps: each repetition's four runs, the two join -> fork runs, and on PostgreSQL
    # each repetition's two runs and the join -> fork.
    start_steps(4 * args.repeat + 2 + (not args.no_postgres) * (2 * args.repeat + 1))
    say(f"pipeline benchmark: {m:,} messages 1-in/1-out (best of {args.repeat}), "
          f"{args.join_fork:,} through join -> fork; durable commits (fsync); "
          f"batch {args.batch}; python {sys.version.split()[0]}, sqlite {sqlite3.sqlite_version}")
    datas = inputs(m)
    eo = amo = raw = minimal = float("inf")
    eo_commits = amo_commits = 0
    for i in range(args.repeat):  # interleaved, so machine noise hits both alike
        run = f"run {i + 1}/{args.repeat}"
        t, c = one_in_one_out(datas, "exactly-once", args.batch)
        if t < eo:
            eo, eo_commits = t, c
        step(f"1-in/1-out exactly-once, {run}")
        t, c = one_in_one_out(datas, "at-most-once", args.batch)
        if t < amo:
            amo, amo_commits = t, c
        step(f"1-in/1-out at-most-once, {run}")
        raw = min(raw, raw_inserts(datas))
        step(f"raw SQLite inserts, {run}")
        minimal = min(minimal, raw_minimal(m))
        step(f"raw SQLite inserts, minimal rows, {run}")
    say()
    say("1-in/1-out processor                          messages/s   commits")
    say(f"  exactly-once (default)                      {m / eo:>10,.0f}   {eo_commits:>7}")
    say(f"  at-most-once, same graph                    {m / amo:>10,.0f}   {amo_commits:>7}")
    say(f"  raw batched SQLite inserts, same rows       {m / raw:>10,.0f}   {m // 1000:>7}"
          "   (storage ceiling, rows/s)")
    say(f"  raw batched SQLite inserts, minimal rows    {m / minimal:>10,.0f}   {m // 1000:>7}"
          "   (integer key + 20-byte blob, rows/s)")
    ratio = amo / eo
    say(f"  exactly-once / at-most-once: {ratio:.0%} (target >= 80%)   "
          f"exactly-once / raw: {raw / eo:.0%}   target >= 100,000 msg/s: "
          f"{'met' if m / eo >= 100_000 else 'NOT met'}")
    n = args.join_fork
    e2e = join_fork_end_to_end(n, args.batch)
    step("join -> fork, end to end")
    load, proc = join_fork_preloaded(n, args.batch)
    step("join -> fork, pre-loaded")
    say()
    say(f"join -> fork, {n:,} messages (2 x {n:,} in, {n:,} pairs, 2 x {n:,} out)")
    say("  end to end: an appender process writes both sources while the graph runs")
    target = f"   (target <= 30 s: {'met' if e2e <= 30 else 'NOT met'})" if n == 1_000_000 else ""
    say(f"                     {e2e:6.1f} s{target}")
    say(f"  pre-loaded sources: load {load:.1f} s ({2 * n / load:,.0f} messages/s), then process "
          f"{proc:.1f} s ({n / proc:,.0f} pairs/s)")
    if not args.no_postgres:
        postgres(args, datas, m / eo, m / amo, 2 * n / load, n / proc)
    finish()
    return 0


def postgres(args: argparse.Namespace, datas: list[bytes], sq_eo: float, sq_amo: float,
             sq_load: float, sq_pairs: float) -> None:
    """Section 5: the PostgreSQL store beside the SQLite figures above."""
    from dataspace.streams.pgserver import PostgresNotFound

    say()
    try:
        pg = Postgres()
    except PostgresNotFound as e:
        say(f"PostgreSQL store: skipped ({e})")
        skip(2 * args.repeat + 1)
        return
    try:
        m = len(datas)
        eo = amo = float("inf")
        for i in range(args.repeat):
            run = f"run {i + 1}/{args.repeat}"
            eo = min(eo, one_in_one_out(datas, "exactly-once", args.batch, pg.fresh())[0])
            step(f"PostgreSQL: 1-in/1-out exactly-once, {run}")
            amo = min(amo, one_in_one_out(datas, "at-most-once", args.batch, pg.fresh())[0])
            step(f"PostgreSQL: 1-in/1-out at-most-once, {run}")
        n = args.pg_join_fork
        load, proc = join_fork_preloaded(n, args.batch, pg.fresh())
        step("PostgreSQL: join -> fork, pre-loaded")
        version = pg.server.execute("postgres", "SHOW server_version")[0][0]
    finally:
        pg.stop()
    say(f"PostgreSQL store (server {version} on loopback), side by side with SQLite above")
    say("                                              PostgreSQL       SQLite   ratio")
    rows = [("1-in/1-out exactly-once, messages/s", m / eo, sq_eo),
            ("1-in/1-out at-most-once, messages/s", m / amo, sq_amo),
            (f"join -> fork load ({n:,}), messages/s", 2 * n / load, sq_load),
            (f"join -> fork process ({n:,}), pairs/s", n / proc, sq_pairs)]
    for name, a, b in rows:
        say(f"  {name:<42} {a:>10,.0f}   {b:>10,.0f}   {a / b:5.0%}")


if __name__ == "__main__":
    sys.exit(main())
