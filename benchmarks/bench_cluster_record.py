"""Recording in a cluster (issue 30, section 6), beside one server in the same run.

Three ``dataspace serve`` members of one cluster recording ``chat:<Says $who $n>`` into
one PostgreSQL database, and one server recording the same into another database of the
same PostgreSQL server (a throwaway one: this machine's server binaries, as the tests'),
doing the same work:

(1) Recording throughput: 6 clients (spread over the members; all on the one server)
    each send their share of the messages in turns of 100, then ``sync()``: a sync is
    answered once what came before is committed, so the time to the last answer is the
    time to record them all.  The stream is then checked: every message once.  Each
    side runs twice, alternately; the better run of each is shown (target: the cluster
    at least 0.9x one server).
(2) ``sync()`` latency: 1 and 10 clients each sending one message and waiting for its
    sync, over and over; p50 and p99.
(3) Failover: 3 clients given every member's address, on member 0 first, sending one
    message and a sync after another; kill -9 of member 0: the time from the kill to each
    client's next acknowledged message on another member (its sync answered on the
    connection that sent it).  Member 0 is restarted between rounds; the median and the
    worst of ``--repeat`` rounds.  (One server has no such figure: its clients wait for
    it to come back.)

Run:  .venv/bin/python benchmarks/bench_cluster_record.py          (about 3 minutes)
      .venv/bin/python benchmarks/bench_cluster_record.py --quick  (a smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_steps import finish, say, start_steps, step
from dataspace.client import RemoteDataspace, connect
from dataspace.protocol.sturdy import SturdyRef
from dataspace.streams import open_store
from dataspace.streams.pgserver import PostgresNotFound, TempPostgres
from dataspace.testing.cluster_record import Member, start_cluster
from dataspace.values import Record, Symbol, parse

SAYS = Symbol("Says")
SPECS = ("chat:<Says $who $n>",)
TURN = 100


def cap_of(m: Member) -> SturdyRef:
    return SturdyRef.from_value(parse((m.dir / "root.sturdyref").read_text()))


async def clients_on(ms: list[Member], n: int) -> list[RemoteDataspace]:
    cap = cap_of(ms[0])
    out = []
    for i in range(n):
        addrs = [m.address for m in ms]
        k = i % len(ms)
        out.append(await connect(addrs[k:] + addrs[:k], cap))
    return out


def recorded(url: str) -> int:
    """Distinct messages in the stream (each once: as many entries)."""
    s = open_store(url, create=False)
    try:
        keys = [(str(e.value.fields[0]), e.value.fields[1]) for e in s.iter_entries("chat")]
    finally:
        s.close()
    return len(set(keys)) if len(set(keys)) == len(keys) else -len(keys)


async def throughput(ms: list[Member], url: str, total: int, start: int) -> float:
    """Messages recorded per second: 6 clients, turns of 100, a sync at the end."""
    cs = await clients_on(ms, 6)
    per = total // len(cs)

    async def one(i: int, c: RemoteDataspace) -> None:
        for b in range(0, per, TURN):
            with c.turn():
                for k in range(b, min(per, b + TURN)):
                    c.send(Record(SAYS, [f"t{start}-{i}", k]))
            await c.drain()
        await c.sync(timeout=300)

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, c) for i, c in enumerate(cs)))
        took = time.perf_counter() - t0
    finally:
        for c in cs:
            await c.close()
    return per * len(cs) / took


async def latencies(ms: list[Member], n: int, seconds: float) -> list[float]:
    cs = await clients_on(ms, n)
    out: list[float] = []
    end = time.monotonic() + seconds

    async def one(i: int, c: RemoteDataspace) -> None:
        k = 0
        while time.monotonic() < end:
            c.send(Record(SAYS, [f"l{n}-{i}", k]))
            k += 1
            t0 = time.perf_counter()
            await c.sync(timeout=60)
            out.append(time.perf_counter() - t0)

    try:
        await asyncio.gather(*(one(i, c) for i, c in enumerate(cs)))
    finally:
        for c in cs:
            await c.close()
    return out


async def failover_round(ms: list[Member], r: int) -> list[float]:
    """One kill -9 of member 0 under 3 clients on it: each one's time to its next
    acknowledged message on another member."""
    if not ms[0].alive:
        await ms[0].start()
    cap = cap_of(ms[0])
    cs = [await connect([m.address for m in ms], cap) for _ in range(3)]
    killed_at: list[float] = []
    after: dict[int, float] = {}
    stop = asyncio.Event()

    async def one(i: int, c: RemoteDataspace) -> None:
        k = 0
        while not stop.is_set():
            if not c.connected:
                with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                    await asyncio.wait_for(c.wait_connected(), 1.0)
                continue
            r0 = c.reconnects
            c.send(Record(SAYS, [f"f{r}-{i}", k]))
            k += 1
            try:
                await c.sync(timeout=30)
            except (ConnectionError, TimeoutError):
                continue
            if c.reconnects == r0 and killed_at and i not in after and c.failovers:
                after[i] = time.monotonic() - killed_at[0]
                if len(after) == len(cs):
                    stop.set()

    tasks = [asyncio.ensure_future(one(i, c)) for i, c in enumerate(cs)]
    try:
        await asyncio.sleep(1.0)
        assert all(str(c.address) == ms[0].address for c in cs)
        killed_at.append(time.monotonic())
        await ms[0].kill()
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 60)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in cs:
            await c.close()
    if len(after) < len(cs):
        say(f"  round {r + 1}: only {len(after)} of {len(cs)} clients acknowledged again "
            "within 60 s")
    return list(after.values())


async def failover(ms: list[Member], rounds: int) -> list[float]:
    out: list[float] = []
    for r in range(rounds):
        out += await failover_round(ms, r)
    return out


def ms_(x: float) -> str:
    return f"{1000 * x:.1f} ms"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main(args: argparse.Namespace) -> None:
    total = 6_000 if args.quick else 60_000
    seconds = 2.0 if args.quick else 8.0
    rounds = 1 if args.quick else args.repeat
    start_steps(4 + 4 + 1)
    try:
        pg = TempPostgres(max_connections=300).start()
    except PostgresNotFound as e:
        sys.exit(f"bench_cluster_record: {e}")
    base = Path(tempfile.mkdtemp(prefix="bench-clusterrec-"))
    one_url = pg.create_database("one")
    cl_url = pg.create_database("cluster")
    one = start_cluster(base / "one", 1, one_url, SPECS, cluster=False)
    cl = start_cluster(base / "cluster", 3, cl_url, SPECS)
    try:
        for m in one + cl:
            await m.start()
        await asyncio.sleep(3.0)  # (the members' routes up and settled)
        say(f"recording in a cluster: 3 members into PostgreSQL beside one server into "
            f"another database of the same PostgreSQL server ({total:,} messages)")
        rates: dict[str, list[float]] = {"one": [], "cluster": []}
        for run in range(2):
            for name, ms in (("one", one), ("cluster", cl)):
                r = await throughput(ms, one_url if name == "one" else cl_url, total,
                                     run)
                rates[name].append(r)
                step(f"throughput {name} {run + 1}")
        for name, url in (("one", one_url), ("cluster", cl_url)):
            n = recorded(url)
            if n != 2 * (total // 6) * 6:
                say(f"  PROBLEM: {name}: {n} messages recorded (negative: some twice) of "
                    f"{2 * (total // 6) * 6}")
        best_one, best_cl = max(rates["one"]), max(rates["cluster"])
        say(f"(1) recording throughput, messages/s (best of 2): one server {best_one:,.0f} "
            f"({', '.join(f'{r:,.0f}' for r in rates['one'])}); 3-member cluster "
            f"{best_cl:,.0f} ({', '.join(f'{r:,.0f}' for r in rates['cluster'])}): "
            f"{best_cl / best_one:.2f}x (target >= 0.9x)")
        for n in (1, 10):
            lat: dict[str, list[float]] = {}
            for name, ms in (("one", one), ("cluster", cl)):
                lat[name] = await latencies(ms, n, seconds)
                step(f"sync latency {name} {n}")
            say(f"(2) sync() latency, {n} client{'s' if n > 1 else ''} sending one message and "
                f"a sync after another: one server p50 {ms_(pct(lat['one'], 0.5))} p99 "
                f"{ms_(pct(lat['one'], 0.99))} ({len(lat['one']):,} syncs); cluster p50 "
                f"{ms_(pct(lat['cluster'], 0.5))} p99 {ms_(pct(lat['cluster'], 0.99))} "
                f"({len(lat['cluster']):,} syncs)")
        fo = await failover(cl, rounds)
        step("failover")
        if fo:
            say(f"(3) failover: kill -9 of the clients' member until each client's next "
                f"acknowledged message on another member: median {ms_(statistics.median(fo))}, "
                f"worst {ms_(max(fo))} ({len(fo)} clients over {rounds} round(s))")
        say("reproduce: .venv/bin/python benchmarks/bench_cluster_record.py"
            + (" --quick" if args.quick else ""))
    finally:
        for m in one + cl:
            await m.stop()
        pg.stop()
        finish()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke test (small counts)")
    ap.add_argument("--repeat", type=int, default=3, help="failover rounds (default 3)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))

