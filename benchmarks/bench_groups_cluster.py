"""Groups of observers across a cluster (issue 31, phase 3): three ``dataspace serve``
members in processes of their own (one root key, one cluster secret), on loopback;
workers and publishers are clients in this process.

(1) Messages/s to a group of 3 workers, one on each member, the publisher on the first
    (each message picked where it enters and, for the two far workers, sent on over a
    route), beside the same 3 workers all on the first member (nothing crosses); 20,000
    messages of 16 bytes, 100 per turn; and the spread between the workers.
(2) Jobs: 40 jobs held on the third member, two workers on each member.  The second
    member (not the coordinator) killed with kill -9, then started again: the time from
    the kill until every job is held by exactly one live worker.  Over --kills rounds:
    the median and the worst.
(3) The coordinator (the first member, the oldest) silenced with SIGSTOP: the time until
    every job is held by one worker of the other two members (the routes' keepalive gives
    the silent member up after 3 s), and how many jobs were then held twice (one holder
    behind the silent member, which cannot be told, one under the new coordinator); then
    SIGCONT, and the time until every job has one holder again.
(4) The coordinator killed with kill -9: the time until every job is assigned again.

Run:  .venv/bin/python benchmarks/bench_groups_cluster.py            (about a minute)
      .venv/bin/python benchmarks/bench_groups_cluster.py --quick    (a smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import statistics
import sys
import time
from typing import Any

from bench_groups import PAYLOAD, WORK, send_work
from bench_link import _LIVE, Proc
from bench_steps import finish, say, start_steps, step
from dataspace.client import RemoteDataspace, connect
from dataspace.testing.common import free_port
from dataspace.values import Record, Symbol

JOB = Symbol("Job")
JOBS = 40
WAIT = 60.0


class Member(Proc):
    """A cluster member; ``start`` again after a kill keeps its ports and data."""

    def __init__(self, name: str, key: bytes, secret: str, routes: list[str]) -> None:
        super().__init__(name)
        self.name = name
        self.data = self.dir / "data"
        self.data.mkdir()
        (self.data / "root.key").write_bytes(key)
        (self.data / "root.key").chmod(0o600)
        (self.data / "cluster.secret").write_text(secret)
        (self.data / "cluster.secret").chmod(0o600)
        self.port = free_port()
        self.cluster = f"127.0.0.1:{free_port()}"
        self.routes = routes
        self.cap = ""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> Member:
        argv = [sys.executable, "-m", "dataspace.cli", "serve", "--tcp", self.address,
                "--data-dir", str(self.data), "--cluster", self.cluster]
        if self.routes:
            argv += ["--routes", ",".join(self.routes)]
        if self.log.exists():
            self.log.unlink()
        self.spawn(argv)
        m = await self.wait_log(r"sturdyref: (.*)", f"member {self.name}")
        self.cap = m.group(1).strip()
        await self.wait_log(r"Ctrl-C stops", f"member {self.name}")
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)

    async def client(self, name: str) -> RemoteDataspace:
        return await connect(self.address, self.cap, reconnect=False, name=name)


class Watch:
    """Workers' jobs, and waits on them."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.held: list[set[int]] = []
        self.at: list[int] = []
        self.clients: list[RemoteDataspace] = []

    async def worker(self, m: Member, at: int) -> None:
        c = await m.client(f"w{len(self.at)}")
        mine: set[int] = set()

        def add(i: int) -> None:
            mine.add(i)
            self.event.set()

        def drop(i: int) -> None:
            mine.discard(i)
            self.event.set()

        c.observe("<Job $i>", on_assert=add, on_retract=drop, group="jobs")
        await c.sync()
        self.held.append(mine)
        self.at.append(at)
        self.clients.append(c)

    def holders(self, members: set[int]) -> dict[int, int]:
        out: dict[int, int] = {}
        for at, mine in zip(self.at, self.held):
            if at in members:
                for j in mine:
                    out[j] = out.get(j, 0) + 1
        return out

    def once_on(self, members: set[int]) -> bool:
        h = self.holders(members)
        return len(h) == JOBS and all(n == 1 for n in h.values())

    async def until(self, pred: Any) -> float:
        t0 = time.perf_counter()

        async def loop() -> None:
            while not pred():
                self.event.clear()
                await self.event.wait()

        await asyncio.wait_for(loop(), WAIT)
        return time.perf_counter() - t0


async def meshed(ms: list[Member]) -> None:
    """Each member sees a value asserted on each other one: every route is up."""
    cs = [await m.client(f"mark{i}") for i, m in enumerate(ms)]
    seen = [set() for _ in ms]
    ev = asyncio.Event()
    for i, c in enumerate(cs):
        c.assert_(Record(Symbol("Mark"), [i]))
        c.observe("<Mark $i>", on_assert=lambda i, s=seen[i]: (s.add(i), ev.set()))

    async def loop() -> None:
        while not all(len(s) == len(ms) for s in seen):
            ev.clear()
            await ev.wait()

    await asyncio.wait_for(loop(), WAIT)
    for c in cs:
        await c.close()


async def rate(ms: list[Member], where: list[int], n: int) -> tuple[float, list[int]]:
    counts = [0] * len(where)
    probes = [0]
    left = [n]
    done = asyncio.Event()
    subs = []
    for k, at in enumerate(where):
        s = await ms[at].client(f"rate{k}")

        def on_message(i: int, p: str, k: int = k) -> None:
            if i < 0:  # (a probe: see below)
                probes[0] += 1
                return
            counts[k] += 1
            left[0] -= 1
            if not left[0]:
                done.set()

        s.observe("<Work $i $p>", on_message=on_message, group="rate")
        await s.sync()
        subs.append(s)
    pub = await ms[0].client("pub")
    # Every member counts every worker before the clock starts: probes until each
    # reaches a worker (while a far member's count is on its way, one can reach none).
    sent = 0
    for _ in range(200):
        pub.send(Record._make(WORK, (-1, PAYLOAD)))
        sent += 1
        await pub.sync()
        await asyncio.sleep(0.01)  # (a probe crosses a route: polled, bounded)
        if probes[0] == sent and sent >= 3 * len(where):
            break
    dt = await send_work(pub, n, 100, done, WAIT)
    for c in (*subs, pub):
        await c.close()
    return n / dt, counts


def spread(counts: list[int]) -> str:
    share = sum(counts) / len(counts)
    return f"{100 * (max(counts) - min(counts)) / share:.1f}%"


async def main(args: argparse.Namespace) -> None:
    start_steps(3 + args.kills + 2)
    key = secrets.token_bytes(32)
    secret = secrets.token_hex(32) + "\n"
    a = Member("a", key, secret, [])
    b = Member("b", key, secret, [a.cluster])
    c = Member("c", key, secret, [a.cluster])
    ms = [a, b, c]
    try:
        for m in ms:  # (in turn: a is the oldest, the coordinator)
            await m.start()
        await meshed(ms)
        say(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; 3 members in processes "
            "of their own, clients in this process")
        n = 5_000 if args.quick else 20_000
        r1, c1 = await rate(ms, [0, 1, 2], n)
        step("one worker per member")
        r0, c0 = await rate(ms, [0, 0, 0], n)
        step("three workers on one member")
        say(f"(1) messages/s to a group of 3 workers, publisher on member a ({n:,} messages "
            f"of 16 bytes, 100 per turn)")
        say(f"  one worker on each member   {r1:>9,.0f}/s  spread {spread(c1)}")
        say(f"  three workers on member a   {r0:>9,.0f}/s  spread {spread(c0)}")

        w = Watch()
        for i, m in enumerate(ms):
            for _ in range(2):
                await w.worker(m, i)
        producer = await c.client("producer")
        for j in range(JOBS):
            producer.assert_(Record(JOB, [j]))
        await producer.sync()
        await w.until(lambda: w.once_on({0, 1, 2}))
        step("jobs assigned")

        kills = []
        for _round in range(args.kills):
            t0 = time.perf_counter()
            b.signal(signal.SIGKILL)
            await w.until(lambda: w.once_on({0, 2}))
            kills.append(time.perf_counter() - t0)
            step("a member killed")
            for k, at in enumerate(w.at):  # (its workers are gone with it)
                if at == 1:
                    w.at[k] = -1
            await b.start()
            for _ in range(2):
                await w.worker(b, 1)
            await w.until(lambda: w.once_on({0, 1, 2}))
        say(f"(2) kill -9 of a member with 2 of the 6 workers, 40 jobs ({args.kills} kills): "
            f"every job with a live worker again after median "
            f"{1000 * statistics.median(kills):.1f} ms, worst {1000 * max(kills):.1f} ms")

        t0 = time.perf_counter()
        a.signal(signal.SIGSTOP)
        try:
            await w.until(lambda: w.once_on({1, 2}))
            silent = time.perf_counter() - t0
            twice = sum(1 for n in w.holders({0, 1, 2}).values() if n > 1)
        finally:
            a.signal(signal.SIGCONT)
        healed = await w.until(lambda: w.once_on({0, 1, 2}) and
                               all(len(h) for at, h in zip(w.at, w.held) if at == 0))
        step("the coordinator silenced")
        say(f"(3) the coordinator stopped (SIGSTOP): every job with a worker of another "
            f"member after {silent:.2f} s (the routes' keepalive: 3 s), {twice} of {JOBS} "
            f"jobs then held twice (a worker behind the silent member and one under the new "
            f"coordinator); after SIGCONT one holder each again after {1000 * healed:.0f} ms")

        t0 = time.perf_counter()
        a.signal(signal.SIGKILL)
        await w.until(lambda: w.once_on({1, 2}))
        step("the coordinator killed")
        say(f"(4) kill -9 of the coordinator: every job assigned again after "
            f"{1000 * (time.perf_counter() - t0):.1f} ms")
        for cl in (*w.clients, producer):
            await cl.close()
    finally:
        for m in ms:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.send_signal(signal.SIGCONT)
            m.stop()
        finish()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller (a smoke test)")
    p.add_argument("--kills", type=int, default=None, help="kill -9 rounds (default 5)")
    args = p.parse_args()
    if args.kills is None:
        args.kills = 2 if args.quick else 5
    try:
        asyncio.run(main(args))
    finally:
        for proc in list(_LIVE):
            proc.stop()
