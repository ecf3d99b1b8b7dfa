"""Broker benchmarks: our server and client over loopback, with Redis as the reference.

(a) messages/s delivered, 1 publisher -> 1 subscriber and -> 10 subscribers, with one
    message per packet and with batched turns (100 messages per turn);
(b) assertions + retractions/s, seen by an observer;
(c) round-trip latency (p50/p99) of a request/response through the server;
(d) server memory with 1,000 connected clients holding 10 assertions each;
(e) what durable acknowledgement costs: send + sync() round trips against a plain server
    and against one recording every message into a stream (sync answered only once the
    message is committed and fsynced), with 1 and 10 clients (group commit);
(f) what TLS costs: (a)'s 1 -> 1 rates and (c)'s round trip over TLS beside plain TCP,
    and the time to open a connection (TCP or TLS handshake, then the capability
    resolved), two fresh servers side by side (certificates made with trustme);
and, in the same run, (a) and (c) against Redis pub/sub (Debian's redis-server on a free
loopback port, driven by redis-py's asyncio client, one PUBLISH at a time and pipelined),
printing the ratios.

The server runs in its own process (``dataspace serve``); every client runs in this
process, in one asyncio event loop (the way a Python program would use either system).

Run:  .venv/bin/python benchmarks/bench_broker.py            (about 1-2 minutes)
      .venv/bin/python benchmarks/bench_broker.py --quick    (smaller, a smoke test)
      .venv/bin/python benchmarks/bench_broker.py --tls      ((f) alone)

Each throughput figure is the best of --repeat runs (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from dataspace.client import RemoteDataspace, connect
from dataspace.progress import Progress
from dataspace.values import Record, Symbol

MSG = Symbol("Msg")
PAYLOAD = "0123456789abcdef"  # 16 bytes in every message, for us and for Redis
REDIS = "/usr/bin/redis-server"


# ---------------------------------------------------------------------------------------
# Servers


class OurServer:
    def __init__(self, *extra: str, tls: Certificates | None = None) -> None:
        self.extra = extra
        self.dir = tempfile.mkdtemp(prefix="bench-broker-")
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.cap = ""
        self.tls = tls
        self.kw: dict[str, Any] = {"tls_ca": tls.ca} if tls else {}
        """What connect() needs besides the address and capability."""

    def start(self) -> OurServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dataspace.cli", "serve", "--tcp", "127.0.0.1:0",
             "--data-dir", self.dir, "--max-assertions", "1000000", *self.extra,
             *(["--tls-cert", self.tls.cert, "--tls-key", self.tls.key] if self.tls else [])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout and self.proc.stderr
        line = self.proc.stdout.readline()
        if not line.startswith("sturdyref: "):
            raise SystemExit(f"server did not start: {line}{self.proc.stderr.read()}")
        self.cap = line[len("sturdyref: "):].strip()
        for line in self.proc.stderr:
            m = re.search(r"listening on ((?:tls://)?127\.0\.0\.1:\d+)", line)
            if m:
                self.address = m.group(1)
            if "Ctrl-C stops" in line:
                break
        return self

    def rss_kib(self) -> int:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the server process has used so far."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class Certificates:
    """A CA and a server certificate for 127.0.0.1 (ECDSA P-256), in a temporary directory."""

    def __init__(self) -> None:
        try:
            import trustme
        except ImportError:
            raise SystemExit("the TLS figures need trustme (the test extra: make setup)") from None
        self.dir = tempfile.mkdtemp(prefix="bench-tls-")
        ca = trustme.CA(organization_name="bench CA")
        leaf = ca.issue_cert("127.0.0.1", common_name="bench server")
        self.ca = os.path.join(self.dir, "ca.crt")
        self.cert = os.path.join(self.dir, "server.crt")
        self.key = os.path.join(self.dir, "server.key")
        ca.cert_pem.write_to_path(self.ca)
        leaf.cert_chain_pems[0].write_to_path(self.cert)
        leaf.private_key_pem.write_to_path(self.key)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> RedisServer:
        if not os.path.exists(REDIS):
            raise SystemExit(
                f"{REDIS} not found: the benchmark runs Redis beside us as the reference; "
                "install it (Debian: apt-get install redis-server)"
            )
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.proc = subprocess.Popen(
            [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return self
            time.sleep(0.05)
        raise SystemExit("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


# ---------------------------------------------------------------------------------------
# Measurements against our server


def msg(i: int) -> Record:
    return Record._make(MSG, (i, PAYLOAD))


async def ours_fanout(srv: OurServer, n: int, subscribers: int, batch: int) -> float:
    """Messages/s delivered to each subscriber (n messages, ``batch`` per turn)."""
    subs = [await connect(srv.address, srv.cap, **srv.kw) for _ in range(subscribers)]
    pub = await connect(srv.address, srv.cap, **srv.kw)
    remaining = [n * subscribers]
    done = asyncio.Event()

    def on_message(i: int, p: str) -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            done.set()

    for s in subs:
        s.observe("<Msg $i $p>", on_message=on_message)
        await s.sync()
    gc.collect()
    t0 = time.perf_counter()
    # The publisher yields to the event loop regularly (as a program doing anything else
    # would), and waits whenever its socket is full (back-pressure).
    if batch <= 1:
        for i in range(n):
            pub.send(msg(i))
            if i % 100 == 99:
                await pub.drain()
                await asyncio.sleep(0)
    else:
        for i in range(0, n, batch):
            with pub.turn():
                for j in range(i, min(n, i + batch)):
                    pub.send(msg(j))
            await pub.drain()
            await asyncio.sleep(0)
    await asyncio.wait_for(done.wait(), 300)
    dt = time.perf_counter() - t0
    for c in [*subs, pub]:
        await c.close()
    return n / dt


async def ours_assert_retract(srv: OurServer, n: int, batch: int) -> float:
    """(assertions + retractions)/s, until an observer has seen every retraction."""
    obs = await connect(srv.address, srv.cap, **srv.kw)
    actor = await connect(srv.address, srv.cap, **srv.kw)
    seen = [0, 0]
    added, removed = asyncio.Event(), asyncio.Event()

    def on_assert(i: int) -> None:
        seen[0] += 1
        if seen[0] == n:
            added.set()

    def on_retract(i: int) -> None:
        seen[1] += 1
        if seen[1] == n:
            removed.set()

    obs.observe("<Item $i _>", on_assert=on_assert, on_retract=on_retract)
    await obs.sync()
    item = Symbol("Item")
    gc.collect()
    t0 = time.perf_counter()
    handles = []
    for i in range(0, n, batch):
        with actor.turn():
            for j in range(i, min(n, i + batch)):
                handles.append(actor.assert_(Record._make(item, (j, PAYLOAD))))
        await actor.drain()
    await asyncio.wait_for(added.wait(), 300)
    for i in range(0, n, batch):
        with actor.turn():
            for h in handles[i : i + batch]:
                actor.retract(h)
        await actor.drain()
    await asyncio.wait_for(removed.wait(), 300)
    dt = time.perf_counter() - t0
    await obs.close()
    await actor.close()
    return 2 * n / dt


async def ours_latency(srv: OurServer, n: int) -> list[float]:
    """Round trips requester -> server -> responder -> server -> requester (seconds)."""
    responder = await connect(srv.address, srv.cap, **srv.kw)
    requester = await connect(srv.address, srv.cap, **srv.kw)
    resp = Symbol("Resp")
    responder.observe("<Req $i>", on_message=lambda i: responder.send(Record._make(resp, (i,))))
    await responder.sync()
    fut: list[asyncio.Future[None]] = []
    requester.observe("<Resp $i>", on_message=lambda i: fut[0].set_result(None))
    await requester.sync()
    req = Symbol("Req")
    loop = asyncio.get_running_loop()
    out = []
    for i in range(n):
        fut[:] = [loop.create_future()]
        t = time.perf_counter()
        requester.send(Record._make(req, (i,)))
        await asyncio.wait_for(fut[0], 30)
        out.append(time.perf_counter() - t)
    await responder.close()
    await requester.close()
    return out


async def ours_setup(srv: OurServer, n: int) -> list[float]:
    """Seconds from nothing to a usable connection: TCP (and TLS) handshake, then the
    capability resolved at the gatekeeper (what connect() returns after)."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        ds = await connect(srv.address, srv.cap, reconnect=False, **srv.kw)
        out.append(time.perf_counter() - t)
        await ds.close()
    return out


async def cpu_measured(srv: OurServer, fa: tuple[int, int, int]) -> tuple[float, float, float]:
    """(messages/s, server CPU µs per message, this process's CPU µs per message)."""
    s0, c0 = srv.cpu_seconds(), time.process_time()
    rate = await ours_fanout(srv, *fa)
    s1, c1 = srv.cpu_seconds(), time.process_time()
    n = fa[0]
    return rate, (s1 - s0) / n * 1e6, (c1 - c0) / n * 1e6


async def tls_costs(args: argparse.Namespace, out: Callable[..., None], bar: Progress) -> None:
    """(f): plain and TLS servers side by side, the same workloads in turn."""
    n = 20_000 if args.quick else 100_000
    n_one = 10_000 if args.quick else 50_000
    n_lat = 500 if args.quick else 3_000
    n_setup = 50 if args.quick else 300
    rep = args.repeat
    certs = Certificates()
    plain = OurServer().start()
    tls = OurServer(tls=certs).start()
    try:
        out(f"(f) TLS beside plain TCP ({tls.address}: TLS 1.3, ECDSA P-256; two fresh servers)")
        out("  messages/s (best of runs alternating plain and TLS), and CPU per message of the "
            "server and of the client process (least of the runs: the machine's load slows "
            "the rates, less the CPU)")
        rows = [("1 -> 1, batched turns (100/turn)", (n, 1, 100)),
                ("1 -> 1, one message per packet", (n_one, 1, 1))]
        for label, fa in rows:
            got: dict[str, list[tuple[float, float, float]]] = {"plain": [], "tls": []}
            for _ in range(rep):
                for name, srv in (("plain", plain), ("tls", tls)):
                    got[name].append(await cpu_measured(srv, fa))
            bar.advance(note=f"TLS: {label}")
            (p, ps, pc), (t, ts, tc) = [
                (max(r[0] for r in got[k]), min(r[1] for r in got[k]),
                 min(r[2] for r in got[k])) for k in ("plain", "tls")]
            out(f"  {label:36s} plain {p:>9,.0f}/s ({ps:4.1f} + {pc:4.1f} µs)   tls {t:>9,.0f}/s "
                f"({ts:4.1f} + {tc:4.1f} µs)   tls/plain {t / p:4.2f}x rate, "
                f"{(ts + tc) / (ps + pc):4.2f}x CPU")
        lp = await ours_latency(plain, n_lat)
        lt = await ours_latency(tls, n_lat)
        bar.advance(note="TLS: round trips")
        out(f"  round trip p50 / p99                 plain {pct(lp, 50) * 1e6:5.0f} / "
            f"{pct(lp, 99) * 1e6:5.0f} µs   tls {pct(lt, 50) * 1e6:5.0f} / "
            f"{pct(lt, 99) * 1e6:5.0f} µs")
        sp = await ours_setup(plain, n_setup)
        st = await ours_setup(tls, n_setup)
        bar.advance(note="TLS: connection set-up")
        out(f"  connection set-up p50 / p99 ({n_setup})    plain {pct(sp, 50) * 1e3:5.2f} / "
            f"{pct(sp, 99) * 1e3:5.2f} ms   tls {pct(st, 50) * 1e3:5.2f} / "
            f"{pct(st, 99) * 1e3:5.2f} ms")
    finally:
        plain.stop()
        tls.stop()
        certs.remove()
    out()


async def ours_acked(srv: OurServer, n: int, clients: int) -> tuple[float, list[float]]:
    """``clients`` clients each send ``n`` messages, awaiting sync() after each: messages
    acknowledged per second (all clients), and the round-trip times (seconds)."""
    says = Symbol("Says")
    conns = [await connect(srv.address, srv.cap, **srv.kw) for _ in range(clients)]
    rtts: list[float] = []

    async def one(ds: RemoteDataspace, c: int) -> None:
        for i in range(n):
            t = time.perf_counter()
            ds.send(Record._make(says, (f"client-{c}", i)))
            await ds.sync()
            rtts.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(ds, c) for c, ds in enumerate(conns)))
    dt = time.perf_counter() - t0
    for ds in conns:
        await ds.close()
    return clients * n / dt, rtts


async def ours_memory(srv: OurServer, clients: int, each: int) -> tuple[int, int]:
    """Server RSS (KiB) before and after ``clients`` connections holding ``each``."""
    gc.collect()
    before = srv.rss_kib()
    conns: list[RemoteDataspace] = []
    present = Symbol("Present")
    for c in range(clients):
        ds = await connect(srv.address, srv.cap, **srv.kw)
        with ds.turn():
            for k in range(each):
                ds.assert_(Record._make(present, (f"client-{c}", k, PAYLOAD)))
        conns.append(ds)
    for ds in conns:
        await ds.sync()
    after = srv.rss_kib()
    for ds in conns:
        await ds.close()
    return before, after


# ---------------------------------------------------------------------------------------
# The same against Redis


async def redis_fanout(port: int, n: int, subscribers: int, pipelined: bool) -> float:
    import redis.asyncio as aioredis

    payloads = [f"{i} {PAYLOAD}".encode() for i in range(n)]
    subs = []
    remaining = [n * subscribers]
    done = asyncio.Event()

    async def reader(ps: Any) -> None:
        async for m in ps.listen():  # redis-py's fastest way to read a subscription
            if m["type"] == "message":
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()
                    return

    for _ in range(subscribers):
        r = aioredis.Redis(port=port)
        ps = r.pubsub()
        await ps.subscribe("bench")
        await ps.get_message(timeout=1.0)  # the subscribe confirmation
        subs.append((r, ps))
    tasks = [asyncio.ensure_future(reader(ps)) for _r, ps in subs]
    pub = aioredis.Redis(port=port)
    gc.collect()
    t0 = time.perf_counter()
    if pipelined:
        for i in range(0, n, 100):
            async with pub.pipeline(transaction=False) as p:
                for j in range(i, min(n, i + 100)):
                    p.publish("bench", payloads[j])
                await p.execute()
    else:
        for i in range(n):
            await pub.publish("bench", payloads[i])
    await asyncio.wait_for(done.wait(), 300)
    dt = time.perf_counter() - t0
    for t in tasks:
        t.cancel()
    for r, ps in subs:
        await ps.aclose()
        await r.aclose()
    await pub.aclose()
    return n / dt


async def redis_latency(port: int, n: int) -> list[float]:
    import redis.asyncio as aioredis

    r_req, r_resp = aioredis.Redis(port=port), aioredis.Redis(port=port)
    ps_req = r_req.pubsub()
    ps_resp = r_resp.pubsub()
    await ps_req.subscribe("req")
    await ps_resp.subscribe("resp")
    await ps_req.get_message(timeout=1.0)
    await ps_resp.get_message(timeout=1.0)
    pub_req, pub_resp = aioredis.Redis(port=port), aioredis.Redis(port=port)

    async def responder() -> None:
        async for m in ps_req.listen():
            if m["type"] == "message":
                await pub_resp.publish("resp", m["data"])

    task = asyncio.ensure_future(responder())
    replies = ps_resp.listen()
    out = []
    for i in range(n):
        t = time.perf_counter()
        await pub_req.publish("req", str(i))
        while (await anext(replies))["type"] != "message":
            pass
        out.append(time.perf_counter() - t)
    task.cancel()
    for c in (ps_req, ps_resp):
        await c.aclose()
    for c in (r_req, r_resp, pub_req, pub_resp):
        await c.aclose()
    return out


# ---------------------------------------------------------------------------------------


async def best(repeat: int, fn: Callable[[], Awaitable[float]]) -> float:
    return max([await fn() for _ in range(repeat)])


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


async def main(args: argparse.Namespace) -> None:
    n = 20_000 if args.quick else 100_000
    n_one = 10_000 if args.quick else 50_000
    n10 = 5_000 if args.quick else 20_000
    n_lat = 500 if args.quick else 3_000
    n_ar = 10_000 if args.quick else 50_000
    clients = 200 if args.quick else 1_000
    rep = args.repeat
    # A bar with the time left on a terminal (standard error), plain lines in a log.
    bar = Progress(sys.stderr, total=4 if args.tls else 15, what="steps", verb="benchmark",
                   rate=False)
    out = bar.echo
    if args.tls:
        await tls_costs(args, out, bar)
        out("command: .venv/bin/python benchmarks/bench_broker.py --tls"
            + (" --quick" if args.quick else ""))
        bar.finish()
        return

    srv = OurServer().start()
    red = RedisServer().start()
    try:
        out(f"dataspace broker benchmark (server pid {srv.proc.pid}, Python "  # type: ignore[union-attr]
              f"{sys.version.split()[0]}, {os.cpu_count()} CPUs); best of {rep}")
        out()
        out("(a) messages/s (1 -> 10: each message reaches all 10 subscribers; "
              "deliveries/s = 10x)")
        rows = [
            ("1 -> 1, batched turns (100/turn)", ours_fanout, (n, 1, 100), redis_fanout, (n, 1, True),
             "pipelined"),
            ("1 -> 1, one message per packet", ours_fanout, (n_one, 1, 1), redis_fanout, (n_one // 5, 1, False),
             "one at a time"),
            ("1 -> 10, batched turns (100/turn)", ours_fanout, (n10, 10, 100), redis_fanout, (n10, 10, True),
             "pipelined"),
            ("1 -> 10, one message per packet", ours_fanout, (n10, 10, 1), redis_fanout, (n10 // 5, 10, False),
             "one at a time"),
        ]
        results: dict[str, float] = {}
        for label, fn, fa, rfn, ra, rlabel in rows:
            ours = await best(rep, lambda fn=fn, fa=fa: fn(srv, *fa))
            theirs = await best(rep, lambda rfn=rfn, ra=ra: rfn(red.port, *ra))
            results[label] = ours
            bar.advance(note=label)
            out(f"  {label:36s} dataspace {ours:>10,.0f}   redis ({rlabel:13s}) {theirs:>9,.0f}"
                  f"   ratio {ours / theirs:5.1f}x")
        redis_one = await best(rep, lambda: redis_fanout(red.port, n_one // 5, 1, False))
        redis_pipe = await best(rep, lambda: redis_fanout(red.port, n, 1, True))
        bar.advance(note="redis references")
        out(f"  targets: >= 100,000/s batched (got {results[rows[0][0]]:,.0f}), "
              f">= 30,000/s one per packet (got {results[rows[1][0]]:,.0f})")
        out(f"  vs redis-py: batched/pipelined {results[rows[0][0]] / redis_pipe:.1f}x, "
              f"one per packet/one at a time {results[rows[1][0]] / redis_one:.1f}x")
        out()
        out("(b) assertions + retractions/s (observer sees every change)")
        ar = await best(rep, lambda: ours_assert_retract(srv, n_ar, 100))
        bar.advance(note="assertions, batched")
        ar1 = await best(rep, lambda: ours_assert_retract(srv, n_ar // 5, 1))
        bar.advance(note="assertions, one per packet")
        out(f"  batched turns (100/turn)             {ar:>10,.0f}")
        out(f"  one per packet                       {ar1:>10,.0f}")
        out()
        out("(c) request/response round trip through the server (one outstanding)")
        lat = await ours_latency(srv, n_lat)
        rlat = await redis_latency(red.port, n_lat)
        bar.advance(note="round trips")
        out(f"  dataspace  p50 {pct(lat, 50) * 1e6:7.0f} µs   p99 {pct(lat, 99) * 1e6:7.0f} µs"
              f"   mean {statistics.fmean(lat) * 1e6:7.0f} µs")
        out(f"  redis      p50 {pct(rlat, 50) * 1e6:7.0f} µs   p99 {pct(rlat, 99) * 1e6:7.0f} µs"
              f"   mean {statistics.fmean(rlat) * 1e6:7.0f} µs")
        out(f"  ratio (redis / dataspace, higher is better for us): p50 "
              f"{pct(rlat, 50) / pct(lat, 50):.2f}x  p99 {pct(rlat, 99) / pct(lat, 99):.2f}x")
        out()
    finally:
        srv.stop()
        red.stop()
    out(f"(d) server memory, {clients:,} clients x 10 assertions (a fresh server)")
    fresh = OurServer().start()
    try:
        before, after = await ours_memory(fresh, clients, 10)
        bar.advance(note="memory")
        out(f"  RSS idle {before / 1024:6.1f} MiB, with the clients {after / 1024:6.1f} MiB: "
              f"{(after - before) / clients:.1f} KiB per client")
    finally:
        fresh.stop()
    out()
    n_ack = 300 if args.quick else 2_000
    out(f"(e) durable acknowledgement: send + sync() per message ({n_ack:,} per client)")
    plain = OurServer().start()
    recording = OurServer("--record", "chat:<Says $who $text>").start()
    try:
        for clients_n in (1, 10):
            (p_rate, p_rtt), (r_rate, r_rtt) = [
                await ours_acked(s, n_ack // clients_n if clients_n > 1 else n_ack, clients_n)
                for s in (plain, recording)
            ]
            out(f"  {clients_n:2d} client(s)  plain    {p_rate:>8,.0f} acked msgs/s   "
                  f"p50 {pct(p_rtt, 50) * 1e6:6.0f} µs  p99 {pct(p_rtt, 99) * 1e6:6.0f} µs")
            out(f"               recorded {r_rate:>8,.0f} acked msgs/s   "
                  f"p50 {pct(r_rtt, 50) * 1e6:6.0f} µs  p99 {pct(r_rtt, 99) * 1e6:6.0f} µs"
                  f"   ({r_rate / p_rate:.0%} of plain)")
            bar.advance(note=f"durable acknowledgement, {clients_n} client(s)")
    finally:
        plain.stop()
        recording.stop()
    out()
    await tls_costs(args, out, bar)
    out("command: .venv/bin/python benchmarks/bench_broker.py" + (" --quick" if args.quick else ""))
    bar.finish()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per throughput figure (default 3)")
    ap.add_argument("--tls", action="store_true", help="only (f): what TLS costs")
    asyncio.run(main(ap.parse_args()))
