"""Consumer groups over streams (issue 32) beside Redis Streams' consumer groups, in one run.

(1) Entries/s consumed and acknowledged by a group of 1 and of 4 consumers: N entries
    (``<job N>``; for Redis a field ``v`` holding the same text) appended before, then
    the consumers -- each a process of its own, released together -- read batches of
    --batch (100, then 1000) and acknowledge what they read every --ack-every entries (fsynced
    acknowledgements in batches: a crash redelivers at most that many) until the group is
    drained; the rate is N over the time from the release to the last consumer's end.
    Each side acknowledges with its next read, its own way: ours ``read(B, ack=held)``
    (one transaction, one commit), Redis ``XACK`` and the next ``XREADGROUP ... COUNT B``
    pipelined (one round trip), through redis-py.  Ours on the SQLite store (every
    acknowledgement fsynced: ``synchronous=FULL``, the store's default) and on PostgreSQL
    (a throwaway server on this machine, acknowledgements with ``synchronous_commit``
    on); Redis with its defaults (no persistence: nothing fsynced).
(2) Redelivery after kill -9 with a 1 s idle timeout: a consumer process reads 10 entries
    and is killed with SIGKILL at once; another consumer (in this process) waiting in a
    blocking read gets them when they have been idle 1 s -- the time from the kill to
    that read's return.  Redis has no blocking claim: its consumer does what ours does
    inside a read, with ``XPENDING`` (how long the oldest entry has been idle), a sleep
    until it reaches 1 s and ``XAUTOCLAIM``.  Over --kills kills: the median and the worst.

Needs Debian's redis-server (/usr/bin/redis-server) and redis-py (the test extra),
PostgreSQL's server binaries for the PostgreSQL figures (--no-postgres leaves them out).

Run:  .venv/bin/python benchmarks/bench_groups_streams.py            (about two minutes)
      .venv/bin/python benchmarks/bench_groups_streams.py --quick    (smaller, a smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench_broker import RedisServer
from bench_steps import finish, say, skip, start_steps, step
from dataspace.streams import open_store
from dataspace.values import Record, Symbol

JOB = Symbol("job")
STREAM = "jobs"
GROUP = "g"
WAIT = 120.0


# ---------------------------------------------------------------------------------------
# the consumer processes (this script with --worker ...)


def worker_ours(url: str, name: str, batch: int, every: int) -> None:
    with open_store(url) as s:
        c = s.group(STREAM, GROUP, create=False).consumer(name)
        print("ready", flush=True)
        sys.stdin.readline()  # go
        n = 0
        held: list[Any] = []
        got = c.read(batch)
        while got:
            n += len(got)
            held += got
            if len(held) >= every:  # acknowledged with the next read: one fsynced commit
                got = c.read(batch, ack=held)
                held = []
            else:
                got = c.read(batch)
        if held:
            c.ack(held)
        print(json.dumps({"n": n, "end": time.monotonic()}), flush=True)


def worker_redis(port: int, name: str, batch: int, every: int) -> None:
    import redis

    r = redis.Redis(port=port)
    print("ready", flush=True)
    sys.stdin.readline()
    n = 0
    held: list[bytes] = []
    got = r.xreadgroup(GROUP, name, {STREAM: ">"}, count=batch)
    while got and got[0][1]:
        ids = [i for i, _f in got[0][1]]
        n += len(ids)
        held += ids
        if len(held) >= every:  # XACK and the next read: one round trip
            pipe = r.pipeline(transaction=False)
            pipe.xack(STREAM, GROUP, *held)
            pipe.xreadgroup(GROUP, name, {STREAM: ">"}, count=batch)
            _acked, got = pipe.execute()
            held = []
        else:
            got = r.xreadgroup(GROUP, name, {STREAM: ">"}, count=batch)
    if held:
        r.xack(STREAM, GROUP, *held)
    print(json.dumps({"n": n, "end": time.monotonic()}), flush=True)


def worker_take(kind: str, where: str, name: str) -> None:
    """Read 10 entries, say so, then wait to be killed."""
    if kind == "ours":
        with open_store(where) as s:
            got = s.group(STREAM, GROUP, create=False).consumer(name).read(10)
            print(json.dumps(sorted(d.index for d in got)), flush=True)
            time.sleep(3600)  # until killed
    else:
        import redis

        r = redis.Redis(port=int(where))
        got = r.xreadgroup(GROUP, name, {STREAM: ">"}, count=10)
        print(json.dumps(sorted(i.decode() for i, _f in got[0][1])), flush=True)
        time.sleep(3600)


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, "--worker", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _release(procs: list[subprocess.Popen[str]]) -> float:
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"a consumer did not start: {line!r}")
    t0 = time.monotonic()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    return t0


def _collect(procs: list[subprocess.Popen[str]], t0: float, n: int) -> float:
    done = 0
    end = t0
    for p in procs:
        assert p.stdout is not None
        r = json.loads(p.stdout.readline())
        done += r["n"]
        end = max(end, r["end"])
        p.wait(WAIT)
    if done != n:
        raise SystemExit(f"the consumers took {done} entries of {n}")
    return n / (end - t0)


# ---------------------------------------------------------------------------------------
# (1) throughput


def ours_rate(url: str, n: int, consumers: int, batch: int, every: int) -> float:
    with open_store(url) as s:
        for name in list(s.streams(include_internal=True)):
            s.delete_stream(name.name)
        for k in range(0, n, 5000):
            s.append_many(STREAM, [Record(JOB, [i]) for i in range(k, min(n, k + 5000))])
        s.create_group(STREAM, GROUP)
    procs = [_spawn("rate", "ours", url, f"c{k}", str(batch), str(every))
             for k in range(consumers)]
    return _collect(procs, _release(procs), n)


def redis_rate(port: int, n: int, consumers: int, batch: int, every: int) -> float:
    import redis

    r = redis.Redis(port=port)
    r.delete(STREAM)
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(STREAM, {"v": f"<job {i}>"})
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()
    r.xgroup_create(STREAM, GROUP, id="0")
    procs = [_spawn("rate", "redis", str(port), f"c{k}", str(batch), str(every))
             for k in range(consumers)]
    return _collect(procs, _release(procs), n)


# ---------------------------------------------------------------------------------------
# (2) redelivery after kill -9


def ours_redelivery(url: str, kills: int) -> list[float]:
    out = []
    with open_store(url) as s:
        for name in list(s.streams(include_internal=True)):
            s.delete_stream(name.name)
        s.create_group(STREAM, GROUP, idle_timeout=1.0)
        b = s.group(STREAM, GROUP, create=False).consumer("b")
        for k in range(kills):
            s.append_many(STREAM, [Record(JOB, [i]) for i in range(10 * k, 10 * k + 10)])
            p = _spawn("take", "ours", url, f"a{k}")
            assert p.stdout is not None
            taken = json.loads(p.stdout.readline())
            p.send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
            p.wait(WAIT)
            got: list[int] = []
            while sorted(got) != taken:
                more = b.read(10, block=WAIT)
                if not more:
                    raise SystemExit("the killed consumer's entries were not redelivered")
                got += [d.index for d in more]
                b.ack(more)
            out.append(time.monotonic() - t_kill)
    return out


def redis_redelivery(port: int, kills: int) -> list[float]:
    import redis

    r = redis.Redis(port=port)
    r.delete(STREAM)
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    out = []
    for k in range(kills):
        for i in range(10 * k, 10 * k + 10):
            r.xadd(STREAM, {"v": f"<job {i}>"})
        p = _spawn("take", "redis", str(port), f"a{k}")
        assert p.stdout is not None
        taken = json.loads(p.stdout.readline())
        p.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        p.wait(WAIT)
        got: list[str] = []
        deadline = time.monotonic() + WAIT
        while sorted(got) != taken and time.monotonic() < deadline:
            # What a consumer does in place of a blocking claim: how long until the oldest
            # pending entry has been idle 1 s, a sleep that long, then XAUTOCLAIM.
            pend = r.xpending_range(STREAM, GROUP, min="-", max="+", count=1)
            if pend:
                time.sleep(max(0.0, 1.0 - pend[0]["time_since_delivered"] / 1000))
            _next, claimed, *_ = r.xautoclaim(STREAM, GROUP, "b", 1000, "0-0", count=10)
            ids = [i.decode() for i, _f in claimed]
            got += ids
            if ids:
                r.xack(STREAM, GROUP, *ids)
        out.append(time.monotonic() - t_kill)
    return out


# ---------------------------------------------------------------------------------------


def best(rep: int, fn: Callable[[], float]) -> float:
    return max(fn() for _ in range(rep))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        what, kind, where, name, *rest = sys.argv[2:]
        if what == "rate":
            (worker_ours if kind == "ours" else worker_redis)(  # type: ignore[operator]
                where if kind == "ours" else int(where), name, int(rest[0]), int(rest[1]))
        else:
            worker_take(kind, where, name)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=100_000, help="entries per run (default 100,000)")
    ap.add_argument("--batch", type=int, default=0,
                    help="entries per read (default: reads of 100, then of 1000)")
    ap.add_argument("--ack-every", type=int, default=1000, metavar="N",
                    help="acknowledge once N entries are read (default 1000; --batch: each read's)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per figure, the best kept (default 2)")
    ap.add_argument("--kills", type=int, default=5, help="kills for (2) (default 5)")
    ap.add_argument("--quick", action="store_true", help="small numbers: a smoke test")
    ap.add_argument("--no-postgres", action="store_true", help="leave PostgreSQL out")
    args = ap.parse_args()
    if args.quick:
        args.entries, args.repeat, args.kills = 5_000, 1, 2
    n, rep = args.entries, args.repeat
    batches = [args.batch] if args.batch else [100, 1000]
    start_steps(len(batches) * 2 * 3 + 3)
    red = RedisServer().start()
    with contextlib.ExitStack() as stack:
        stack.callback(red.stop)
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-groups-"))
        sqlite = os.path.join(tmp, "data")
        pg = None
        if not args.no_postgres:
            from dataspace.streams.pgserver import TempPostgres

            server = stack.enter_context(TempPostgres())
            pg = server.create_database("bench")
        say(f"consumer groups: {n:,} entries, reads of {' and '.join(map(str, batches))}, "
            f"acknowledged every {max(args.ack_every, max(batches)):,} or so with the next read, "
            f"best of {rep}; Redis through redis-py (no persistence), ours fsyncing each "
            "acknowledgement")
        say("(1) entries/s consumed and acknowledged")
        for batch, consumers in ((b, c) for b in batches for c in (1, 4)):
            every = max(args.ack_every, batch)
            theirs = best(rep, lambda c=consumers, b=batch, e=every: redis_rate(red.port, n, c, b, e))
            step(f"redis, {consumers} consumers")
            ours = best(rep, lambda c=consumers, b=batch, e=every: ours_rate(sqlite, n, c, b, e))
            step(f"sqlite, {consumers} consumers")
            line = (f"  reads of {batch:<5} {consumers} consumer{'s' if consumers > 1 else ' '}   "
                    f"SQLite {ours:>9,.0f}   Redis {theirs:>9,.0f}   ({ours / theirs:.2f}x)")
            if pg is not None:
                theirs_pg = best(rep, lambda c=consumers, b=batch, e=every: ours_rate(pg, n, c, b, e))
                step(f"postgresql, {consumers} consumers")
                line += f"   PostgreSQL {theirs_pg:>9,.0f} ({theirs_pg / theirs:.2f}x)"
            else:
                skip(1)
            say(line)
        say(f"(2) kill -9 to redelivery, idle timeout 1 s, {args.kills} kills: median / worst")
        red_times = redis_redelivery(red.port, args.kills)
        step("redis redelivery")
        our_times = ours_redelivery(sqlite, args.kills)
        step("sqlite redelivery")

        def fmt(xs: list[float]) -> str:
            return f"{statistics.median(xs):.3f} s / {max(xs):.3f} s"

        line = f"  SQLite {fmt(our_times)}   Redis {fmt(red_times)}"
        if pg is not None:
            pg_times = ours_redelivery(pg, args.kills)
            step("postgresql redelivery")
            line += f"   PostgreSQL {fmt(pg_times)}"
        else:
            skip(1)
        say(line)
    finish()


if __name__ == "__main__":
    main()
