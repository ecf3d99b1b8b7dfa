"""Groups of observers that share work (issue 31) beside NATS queue groups, in one run.

(1) Messages/s delivered to a group of 1, 2 and 4 workers (``observe(..., group=)`` /
    nats-py's ``subscribe(subject, queue=)``), one publisher sending 100,000 messages of
    16 bytes of payload, 100 per turn for us (one PUBLISH at a time for NATS, which
    batches its writes itself); every client in this process's event loop, as
    bench_broker.py runs them; and the spread between the workers: (most - fewest) /
    an equal share.  Then ours to one plain subscriber (no group), for reference.
(2) A killed worker's share: three worker processes, a publisher sending 2,000 messages
    a second for 1.5 s, one worker killed with kill -9 after 0.5 s.  The messages sent
    after the kill that no surviving worker received went to the dead one; the time from
    the kill to the last of them is how long the dead worker still got its share.  Over
    --kills runs: the median and the worst, and the messages lost per run.
(3) Jobs (ours only: a NATS queue group carries messages, not state): 20,000 assertions
    ``<Job N>`` asserted 1,000 per turn, four workers in this process; assignments/s
    until every job is held by a worker.
(4) Reassignment after kill -9 (ours only): four worker processes share 400 jobs; one is
    killed; each of its jobs is assigned to a survivor, which notes the time.  The
    times from the kill to each moved job's assignment (CLOCK_MONOTONIC, one machine),
    over --kills kills: p50 and p99, and the last job per kill.

Servers: ours ``dataspace serve`` and Debian's ``nats-server``, each in its own process
on a free loopback port; worker processes are this script run with ``--worker``.

Needs: ``apt-get install -y nats-server`` and ``pip install -e '.[bench]'`` (nats-py);
``--no-nats`` runs our side alone.

Run:  .venv/bin/python benchmarks/bench_groups.py            (about a minute)
      .venv/bin/python benchmarks/bench_groups.py --quick    (smaller, a smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from bench_link import (
    _LIVE,
    NATS_HINT,
    NATS_PY_HINT,
    NATS_SERVER,
    NatsServer,
    OurServer,
    nats_connect,
)
from bench_steps import finish, say, start_steps, step
from dataspace.client import RemoteDataspace, connect
from dataspace.values import Record, Symbol

WORK = Symbol("Work")
JOB = Symbol("Job")
REPORT = Symbol("Report")
PAYLOAD = "0123456789abcdef"  # 16 bytes in every message, ours and NATS's
WAIT = 120.0  # bound of every wait


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


def ms(x: float) -> str:
    return f"{x * 1000:.1f} ms"


# ---------------------------------------------------------------------------------------
# (1) messages/s to a group of N workers, every client in this process


async def send_work(pub: RemoteDataspace, n: int, batch: int, done: asyncio.Event,
                    timeout: float = WAIT) -> float:
    """Send ``<Work I PAYLOAD>`` for I from 0 to ``n - 1``, ``batch`` per turn, and wait
    until ``done`` (every one delivered): the seconds it took, from a collected heap
    (bench_groups_cluster.py times its cluster's workers so too)."""
    gc.collect()
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        with pub.turn():
            for j in range(i, min(n, i + batch)):
                pub.send(Record._make(WORK, (j, PAYLOAD)))
        await pub.drain()
        await asyncio.sleep(0)
    await asyncio.wait_for(done.wait(), timeout)
    return time.perf_counter() - t0


async def ours_rate(srv: OurServer, n: int, workers: int, batch: int = 100,
                    group: str | None = "bench") -> tuple[float, list[int]]:
    subs = [await srv.connect() for _ in range(workers)]
    counts = [0] * workers
    left = [n]
    done = asyncio.Event()

    def worker(k: int) -> Any:
        def on_message(i: int, p: str) -> None:
            counts[k] += 1
            left[0] -= 1
            if not left[0]:
                done.set()
        return on_message

    for k, s in enumerate(subs):
        s.observe("<Work $i $p>", on_message=worker(k), group=group)
        await s.sync()
    pub = await srv.connect()
    await pub.sync()
    dt = await send_work(pub, n, batch, done)
    for c in (*subs, pub):
        await c.close()
    return n / dt, counts


async def nats_rate(srv: NatsServer, n: int, workers: int) -> tuple[float, list[int]]:
    subs = [await nats_connect(srv) for _ in range(workers)]
    counts = [0] * workers
    left = [n]
    done = asyncio.Event()

    def worker(k: int) -> Any:
        async def cb(msg: Any) -> None:
            counts[k] += 1
            left[0] -= 1
            if not left[0]:
                done.set()
        return cb

    for k, nc in enumerate(subs):
        await nc.subscribe("work", queue="bench", cb=worker(k))
        await nc.flush()
    pub = await nats_connect(srv)
    payload = PAYLOAD.encode()
    gc.collect()
    t0 = time.perf_counter()
    for i in range(n):
        await pub.publish("work", payload)
        if i % 1000 == 999:
            await asyncio.sleep(0)
    await pub.flush()
    await asyncio.wait_for(done.wait(), WAIT)
    dt = time.perf_counter() - t0
    for nc in (*subs, pub):
        await nc.close()
    return n / dt, counts


def spread(counts: list[int]) -> float:
    """(most - fewest) / an equal share."""
    share = sum(counts) / len(counts)
    return (max(counts) - min(counts)) / share if share else 0.0


# ---------------------------------------------------------------------------------------
# Worker processes (this script with --worker): one JSON object per line on stdout


async def worker_main(kind: str, mode: str, address: str, cap: str, name: str) -> None:
    out = sys.stdout

    def emit(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    if kind == "nats":
        import nats

        nc = await nats.connect(address, allow_reconnect=False, max_reconnect_attempts=0,
                                pending_size=64 << 20)
        got: list[int] = []

        async def work(msg: Any) -> None:
            got.append(int(msg.data))

        sub = await nc.subscribe("work", queue="bench", cb=work)

        async def report(msg: Any) -> None:
            while sub.pending_msgs:  # (the work before the report, handled first)
                await asyncio.sleep(0)
            emit({"name": name, "run": int(msg.data), "got": got})
            got.clear()

        await nc.subscribe("report", cb=report)
        await nc.flush()
        emit({"ready": name})
        await asyncio.Event().wait()
    ds = await connect(address, cap, reconnect=False, name=name)
    if mode == "msgs":
        seen: list[int] = []
        ds.observe("<Work $i $p>", on_message=lambda i, p: seen.append(i), group="bench")

        def on_report(run: int) -> None:
            emit({"name": name, "run": run, "got": seen})
            seen.clear()
    else:
        held: dict[int, float] = {}
        ds.observe("<Job $i>", on_assert=lambda i: held.__setitem__(i, time.monotonic()),
                   on_retract=lambda i: held.pop(i, None), group="jobs")

        def on_report(run: int) -> None:
            emit({"name": name, "run": run, "held": held})

    ds.observe("<Report $run>", on_message=on_report)
    await ds.sync()
    emit({"ready": name})
    await asyncio.Event().wait()


class Worker:
    """A worker process and the JSON lines it prints."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.task = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, kind: str, mode: str, address: str, cap: str, name: str) -> Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--worker", kind, mode, address, cap, name,
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        return cls(proc, name)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.lines.put_nowait(json.loads(line))

    async def next(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.lines.get(), WAIT)

    def kill9(self) -> float:
        os.kill(self.proc.pid, signal.SIGKILL)
        return time.monotonic()

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        self.task.cancel()


async def workers(kind: str, mode: str, address: str, cap: str, n: int) -> list[Worker]:
    ws = [await Worker.start(kind, mode, address, cap, f"w{k}") for k in range(n)]
    for w in ws:
        line = await w.next()
        assert line.get("ready") == w.name, line
    return ws


# ---------------------------------------------------------------------------------------
# (2) a killed worker's share of the messages


class Publisher:
    """Ours or NATS's: send message N, and a report request every worker hears."""

    def __init__(self, kind: str, client: Any) -> None:
        self.kind = kind
        self.c = client

    async def send(self, i: int) -> None:
        if self.kind == "ours":
            self.c.send(Record._make(WORK, (i, PAYLOAD)))
        else:
            await self.c.publish("work", str(i).encode())

    async def report(self, run: int) -> None:
        if self.kind == "ours":
            self.c.send(Record._make(REPORT, (run,)))
            await self.c.sync()
        else:
            await self.c.publish("report", str(run).encode())
            await self.c.flush()

    async def close(self) -> None:
        await self.c.close()


async def killed_share(kind: str, address: str, cap: str, rng: random.Random, rate: int,
                       seconds: float) -> tuple[float, int]:
    """(time from the kill to the last message sent that no survivor got, how many)."""
    ws = await workers(kind, "msgs", address, cap, 3)
    if kind == "ours":
        pub = Publisher(kind, await connect(address, cap, reconnect=False))
    else:
        import nats

        pub = Publisher(kind, await nats.connect(address, allow_reconnect=False))
    try:
        n = int(rate * seconds)
        sent_at: list[float] = []
        victim = rng.choice(ws)
        t_kill = 0.0
        t0 = time.monotonic()
        i = 0
        while i < n:
            due = min(n, int((time.monotonic() - t0) * rate) + 1)
            while i < due:
                sent_at.append(time.monotonic())
                await pub.send(i)
                i += 1
            if not t_kill and time.monotonic() - t0 >= seconds / 3:
                t_kill = victim.kill9()
            if pub.kind == "ours":
                await pub.c.drain()
            await asyncio.sleep(0.001)
        await pub.report(1)
        got: set[int] = set()
        for w in ws:
            if w is not victim:
                got.update((await w.next())["got"])
        lost = [s for s in range(n) if s not in got and sent_at[s] >= t_kill]
        last = max((sent_at[s] - t_kill for s in lost), default=0.0)
        return last, len(lost)
    finally:
        await pub.close()
        for w in ws:
            await w.stop()


# ---------------------------------------------------------------------------------------
# (3) assignments/s and (4) reassignment after kill -9 (ours)


async def ours_assignments(srv: OurServer, n: int, workers_n: int = 4, batch: int = 1000
                           ) -> tuple[float, list[int]]:
    subs = [await srv.connect() for _ in range(workers_n)]
    counts = [0] * workers_n
    left = [n]
    done = asyncio.Event()

    def worker(k: int) -> Any:
        def on_assert(i: int) -> None:
            counts[k] += 1
            left[0] -= 1
            if not left[0]:
                done.set()
        return on_assert

    for k, s in enumerate(subs):
        s.observe("<Job $i>", on_assert=worker(k), group="jobs")
        await s.sync()
    prod = await srv.connect()
    await prod.sync()
    gc.collect()
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        with prod.turn():
            for j in range(i, min(n, i + batch)):
                prod.assert_(Record._make(JOB, (j,)))
        await prod.drain()
        await asyncio.sleep(0)
    await asyncio.wait_for(done.wait(), WAIT)
    dt = time.perf_counter() - t0
    # The jobs go before the workers (else each worker leaving moves them all), and the
    # server is through with them before the next run.
    await prod.close()
    for _ in range(1000):
        if not await subs[0].query("<Job _>"):
            break
    for c in subs:
        await c.close()
    return n / dt, counts


async def reassignment(srv: OurServer, rng: random.Random, jobs: int, run: int
                       ) -> list[float]:
    """Times from a kill -9 to each of the victim's jobs assigned to a survivor."""
    ws = await workers("ours", "jobs", srv.address, srv.cap, 4)
    prod: RemoteDataspace = await srv.connect()
    try:
        with prod.turn():
            for j in range(jobs):
                prod.assert_(Record._make(JOB, (j,)))
        await prod.sync()

        async def held() -> dict[str, dict[str, float]]:
            nonlocal run
            run += 1
            prod.send(Record._make(REPORT, (run,)))
            await prod.sync()
            out = {}
            for w in ws:
                if w.proc.returncode is None and w is not victim:
                    line = await w.next()
                    out[w.name] = line["held"]
            return out

        victim: Worker | None = None
        for _ in range(200):  # (until every job is held: the workers have them all)
            before = await held()
            if sum(map(len, before.values())) == jobs:
                break
        victim = rng.choice(ws)
        mine = {int(j) for j in before[victim.name]}
        t_kill = victim.kill9()
        await victim.proc.wait()
        for _ in range(1000):  # bounded: until the survivors hold every job
            after = await held()
            if sum(map(len, after.values())) == jobs:
                break
        else:
            raise SystemExit(f"(4) jobs not reassigned: {sum(map(len, after.values()))} of {jobs}")
        times = [t - t_kill for h in after.values() for j, t in h.items() if int(j) in mine]
        if len(times) != len(mine):
            raise SystemExit(f"(4) {len(mine)} jobs of the killed worker, {len(times)} moved")
        return times
    finally:
        await prod.close()
        for w in ws:
            await w.stop()


# ---------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> None:
    quick = args.quick
    n = 20_000 if quick else 100_000
    sizes = (1, 2, 4)
    use_nats = not args.no_nats
    if use_nats:
        if not os.access(NATS_SERVER, os.X_OK):
            raise SystemExit(NATS_HINT)
        try:
            import nats  # noqa: F401
        except ImportError:
            raise SystemExit(NATS_PY_HINT) from None
    start_steps((len(sizes) * (2 if use_nats else 1) + 1) * args.repeat + args.kills * (
        3 if use_nats else 2) + 1)
    ours = await OurServer("groups").start()
    nsrv = await NatsServer("groups").start() if use_nats else None
    rng = random.Random(31)
    try:
        say(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; clients in this process "
            f"(workers of (2) and (4) in processes of their own)")
        say(f"(1) messages/s delivered to a group of N workers ({n:,} messages of "
            f"{len(PAYLOAD)} bytes; best of {args.repeat}); spread = (most - fewest) / share")
        for k in sizes:
            best_o: tuple[float, list[int]] = (0.0, [])
            best_n: tuple[float, list[int]] = (0.0, [])
            for _ in range(args.repeat):
                r = await ours_rate(ours, n, k)
                best_o = max(best_o, r, key=lambda x: x[0])
                step(f"ours, {k} workers")
                if nsrv is not None:
                    r = await nats_rate(nsrv, n, k)
                    best_n = max(best_n, r, key=lambda x: x[0])
                    step(f"NATS, {k} workers")
            line = (f"  {k} worker{'s' if k > 1 else ' '}  ours {best_o[0]:>9,.0f}/s "
                    f"spread {spread(best_o[1]):5.1%}")
            if nsrv is not None:
                line += (f" | NATS queue group {best_n[0]:>9,.0f}/s spread "
                         f"{spread(best_n[1]):5.1%} | ours/NATS {best_o[0] / best_n[0]:.2f}x")
            say(line)
        plain = 0.0
        for _ in range(args.repeat):
            plain = max(plain, (await ours_rate(ours, n, 1, group=None))[0])
            step("ours, a plain subscriber")
        say(f"  (a plain subscriber, no group: ours {plain:,.0f}/s)")

        say(f"(2) a killed worker's share: 3 worker processes, 2,000 messages/s, kill -9 one; "
            f"time from the kill to the last message lost ({args.kills} kills)")
        for kind, address, cap in (("ours", ours.address, ours.cap),
                                   *((("nats", nsrv.url, ""),) if nsrv is not None else ())):
            times: list[float] = []
            lost: list[int] = []
            for _ in range(args.kills):
                t, k = await killed_share(kind, address, cap, rng, 2000, 0.75 if quick else 1.5)
                times.append(t)
                lost.append(k)
                step(f"{kind}: a worker killed")
            name = "ours" if kind == "ours" else "NATS"
            say(f"  {name:<5} median {ms(statistics.median(times))}, worst {ms(max(times))}; "
                f"messages lost per kill: median {statistics.median(lost):.0f}, most {max(lost)}")

        jobs = 5_000 if quick else 20_000
        rate, counts = await ours_assignments(ours, jobs)
        step("ours: assignments")
        say(f"(3) jobs: {rate:,.0f} assignments/s ({jobs:,} assertions <Job N>, 1,000 per "
            f"turn, 4 workers; spread {spread(counts):.1%}); NATS: no equivalent (a queue "
            "group shares messages, not state)")

        per = 100 if quick else 400
        all_times: list[float] = []
        lasts: list[float] = []
        run = 0
        for _ in range(args.kills):
            ts = await reassignment(ours, rng, per, run)
            run += 1000
            all_times += ts
            lasts.append(max(ts))
            step("ours: jobs moved")
        say(f"(4) reassignment after kill -9: 4 worker processes, {per} jobs, one killed "
            f"({args.kills} kills, {len(all_times)} jobs moved): p50 {ms(pct(all_times, 50))}, "
            f"p99 {ms(pct(all_times, 99))}; the last job of a kill: median "
            f"{ms(statistics.median(lasts))}, worst {ms(max(lasts))}")
    finally:
        ours.stop()
        if nsrv is not None:
            nsrv.stop()
        for p in list(_LIVE):
            p.stop()
        finish()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        try:
            asyncio.run(worker_main(*sys.argv[2:7]))
        except (KeyboardInterrupt, ConnectionError):
            pass
        sys.exit(0)
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of (1) per figure; the best")
    ap.add_argument("--kills", type=int, default=10, help="kills in (2) and (4)")
    ap.add_argument("--no-nats", action="store_true", help="our side alone")
    asyncio.run(main(ap.parse_args()))
