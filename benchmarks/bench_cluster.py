"""Broker clusters benchmark (issue 23, section 3): a cluster of `dataspace serve`
members beside a NATS cluster of the same size (Debian's ``nats-server``, ``-cluster``
and ``-routes``) doing the same work in the same run.

(1) Messages/s across members: a publisher on member 0, a subscriber on member 1 (one
    route hop), three members; batched turns of 100 / NATS publishes.
(2) Route bytes at 1% interest: two members whose routes go through counting TCP
    proxies (each member advertises its proxy); a publisher on A sends 20,200
    messages ``<Says "user-N" TEXT>`` (101 users); a subscriber on B wants one user, then
    everything: the route's bytes for the first as a share of the second (target <= 3%).
(3) Failover: three members; a client connected to member 0 (given all three
    addresses) asserts ``<Present "probe">`` and sends a probe message every 2 ms; an
    observer on member 2.  kill -9 of member 0: the time until the observer has the
    client's probes again (a probe sent after the kill), and until it sees the client's
    assertion re-asserted after its retraction (ours).  NATS: the publisher given the
    three servers (``reconnect_time_wait`` 50 ms, as our client's first backoff), the
    subscriber on server 2.  Each run restarts the killed member; the median of
    ``--repeat`` runs.
(4) 10,000 subscriptions converging after a route cut: two members through the proxies,
    10,000 distinct patterns observed on B (10 connections); the proxies close every
    connection; the time until A's new route holds the 10,000 (``/api/cluster``, polled;
    NATS: ``/routez``), and the control messages per subscription on the new route.
(5) Scaling on this machine (ours alone): 1, 2 and 4 members; 1 -> N (one publisher on
    member 0, a subscriber wanting everything on each member) and N -> N (a publisher on
    each member, and on each member a subscriber wanting the messages of the next
    member's publisher: every message crosses a route), and N -> N local (each
    subscriber wants its own member's publisher: the cluster spreads clients over
    processes, nothing crosses a route but the interest); messages delivered per
    second, all subscribers together.  Clients run in worker processes of their own (this
    script with ``--worker``), one per publisher and per subscriber.

Every server listens on 127.0.0.1 (free ports) in a temporary directory; all are stopped
at the end, on failure too.

Needs ``apt-get install -y nats-server`` and ``pip install -e '.[bench]'`` (nats-py);
``--no-nats`` runs our side alone.

Run:  .venv/bin/python benchmarks/bench_cluster.py          (a few minutes)
      .venv/bin/python benchmarks/bench_cluster.py --quick  (a smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_link
from bench_link import (
    NATS_HINT,
    NATS_PY_HINT,
    NATS_SERVER,
    Counting,
    NotConverged,
    Proc,
    Proxy,
    SyndicateTap,
    nats_rate,
    ours_rate,
    text,
)
from bench_steps import finish, say, start_steps, step
from dataspace.broker.cluster import make_secret
from dataspace.client import RemoteDataspace, connect
from dataspace.datadir import KEY_BYTES
from dataspace.values import Record, Symbol

SAYS = Symbol("Says")
DONE = Symbol("Done")
PROBE = Symbol("Probe")
WANTED = 7
WAIT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_get(port: int, path: str) -> Any:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
    data = await r.read()
    w.close()
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


async def poll(pred: Callable[[], Any], what: str, timeout: float = WAIT,
               every: float = 0.02) -> float:
    """Poll the async ``pred`` (bounded) until it holds; the time it did."""
    deadline = time.monotonic() + timeout
    while not await pred():
        if time.monotonic() > deadline:
            raise NotConverged(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(every)
    return time.perf_counter()


# ---------------------------------------------------------------------------------------
# Our members and NATS nodes


class Member(Proc):
    """A `dataspace serve` cluster member (HTTP port open on loopback for its status)."""

    def __init__(self, name: str, shared: Path, routes: list[str], *, port: int = 0,
                 cluster_port: int = 0, advertise: str | None = None) -> None:
        super().__init__(name)
        self.name = name
        self.shared = shared
        self.data = self.dir / "data"
        self.data.mkdir()
        (self.data / "root.key").write_bytes((shared / "root.key").read_bytes())
        self.routes = routes
        self.port = port
        self.cluster_port = cluster_port or free_port()
        self.advertise = advertise
        self.address = self.cap = ""
        self.http = 0

    async def start(self) -> Member:
        argv = [sys.executable, "-m", "dataspace.cli", "serve", "--tcp",
                f"127.0.0.1:{self.port}", "--data-dir", str(self.data),
                "--max-assertions", "1000000", "--max-observers", "100000",
                "--http", "127.0.0.1:0", "--http-open",
                "--cluster", f"127.0.0.1:{self.cluster_port}",
                "--cluster-secret", str(self.shared / "cluster.secret")]
        if self.routes:
            argv += ["--routes", ",".join(self.routes)]
        if self.advertise:
            argv += ["--cluster-advertise", self.advertise]
        self.log.write_bytes(b"")
        self.spawn(argv)
        await self.wait_log(r"Ctrl-C stops", f"dataspace serve ({self.name})")
        log = self.log.read_text()
        self.cap = re.search(r"sturdyref: (.*)", log).group(1).strip()  # type: ignore[union-attr]
        self.address = re.search(r"listening on (127\.0\.0\.1:\d+)", log).group(1)  # type: ignore[union-attr]
        self.port = int(self.address.rsplit(":", 1)[1])
        self.http = int(re.search(r"HTTP on http://127\.0\.0\.1:(\d+)/", log).group(1))  # type: ignore[union-attr]
        return self

    @property
    def cluster_address(self) -> str:
        return f"127.0.0.1:{self.cluster_port}"

    async def status(self) -> dict[str, Any]:
        return await http_get(self.http, "/api/cluster")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    async def connect(self, *others: Member, **kw: Any) -> RemoteDataspace:
        return await connect([self.address, *(o.address for o in others)], self.cap, **kw)


async def meshed(ms: list[Member], settled: bool = True) -> None:
    """Every member has a route up to every other (and nothing pending, if ``settled``)."""
    async def ok() -> bool:
        for m in ms:
            st = await m.status()
            up = [r for r in st["routes"] if r.get("connected")]
            if len(up) != len(ms) - 1:
                return False
            if settled and any(r.get("pending") or r.get("peer_everything") for r in up):
                return False
        return True

    await poll(ok, f"{len(ms)} members to mesh", every=0.05)


def shared_dir() -> Path:
    import secrets
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    (d / "root.key").write_bytes(secrets.token_bytes(KEY_BYTES))
    (d / "cluster.secret").write_text(make_secret())
    os.chmod(d / "cluster.secret", 0o600)
    return d


async def our_cluster(shared: Path, n: int, proxies: list[Proxy] | None = None) -> list[Member]:
    """``n`` members; each given the first as a route; with ``proxies``, member i is
    reached (and advertised) through proxy i."""
    ms: list[Member] = []
    ports = [free_port() for _ in range(n)]
    for i in range(n):
        adv = None
        if proxies is not None:
            proxies[i].target = ("127.0.0.1", ports[i])
            adv = proxies[i].address
        first = (proxies[0].address if proxies is not None else f"127.0.0.1:{ports[0]}")
        ms.append(await Member(f"m{i}", shared, [first] if i else [], cluster_port=ports[i],
                               advertise=adv).start())
    await meshed(ms)
    return ms


class NatsNode(Proc):
    """nats-server in a cluster: ``-cluster`` on a known port, ``-routes`` to the others
    (``advertise``: the cluster address the others are told of)."""

    def __init__(self, name: str, cluster_port: int, routes: list[str],
                 advertise: str | None = None) -> None:
        super().__init__(f"nats-{name}")
        self.name = name
        self.cluster_port = cluster_port
        self.routes = routes
        self.advertise = advertise
        self.port = 0
        self.http = 0

    async def start(self) -> NatsNode:
        argv = [NATS_SERVER, "-a", "127.0.0.1", "-p", str(self.port or -1), "-m", "-1",
                "-n", self.name, "--cluster_name", "bench",
                "-cluster", f"nats://127.0.0.1:{self.cluster_port}"]
        if self.routes:
            argv += ["-routes", ",".join(f"nats://{r}" for r in self.routes)]
        if self.advertise:
            argv += ["--cluster_advertise", self.advertise]
        self.log.write_bytes(b"")
        self.spawn(argv)
        await self.wait_log(r"Server is ready", f"nats-server ({self.name})")
        log = self.log.read_text()
        self.port = int(re.search(r"client connections on 127\.0\.0\.1:(\d+)", log).group(1))  # type: ignore[union-attr]
        self.http = int(re.search(r"http monitor on 127\.0\.0\.1:(\d+)", log).group(1))  # type: ignore[union-attr]
        return self

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def routez(self) -> dict[str, Any]:
        return await http_get(self.http, "/routez")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


async def nats_cluster(n: int, proxies: list[Proxy] | None = None) -> list[NatsNode]:
    ports = [free_port() for _ in range(n)]
    ns: list[NatsNode] = []
    for i in range(n):
        adv = None
        if proxies is not None:
            proxies[i].target = ("127.0.0.1", ports[i])
            adv = proxies[i].address
        first = proxies[0].address if proxies is not None else f"127.0.0.1:{ports[0]}"
        ns.append(await NatsNode(f"n{i}", ports[i], [first] if i else [], adv).start())

    async def ok() -> bool:
        for x in ns:
            if len((await x.routez()).get("routes") or []) < n - 1:
                return False
        return True

    await poll(ok, f"{n} NATS servers to route", every=0.05)
    return ns


async def nats_connect(node: NatsNode, *others: NatsNode, **kw: Any) -> Any:
    import nats

    servers = [node.url, *(o.url for o in others)]
    kw.setdefault("allow_reconnect", False)
    return await nats.connect(servers=servers, dont_randomize=True, pending_size=64 << 20, **kw)


class NatsRouteTap:
    """Counts the protocol lines of one direction of a NATS route (``control``: RS+ and
    RS-, interest; RMSG: messages)."""

    TOKENS = (b"RS+ ", b"RS- ", b"RMSG ")

    def __init__(self, counts: Counter[str]) -> None:
        self.tail = b"\n"
        self.counts = counts

    def feed(self, data: bytes) -> None:
        buf = self.tail + data
        c = self.counts
        for t in self.TOKENS:
            k = buf.count(b"\n" + t)
            c[t.decode().strip()] += k
            if t != b"RMSG ":
                c["control"] += k
        self.tail = buf[-6:]


class ControlTimes(SyndicateTap):
    """A :class:`SyndicateTap` that also notes when it last saw a control message (the
    proxies' ``times``): convergence is timed by the last request or confirmation, not
    by when a poll of the status happened to see it."""

    times: dict[str, float] = {}

    def feed(self, data: bytes) -> None:
        before = self.counts["control"]
        super().feed(data)
        if self.counts["control"] != before:
            ControlTimes.times["last"] = time.perf_counter()


def proxy_bytes(ps: list[Proxy]) -> int:
    return sum(p.bytes["dn"] + p.bytes["up"] for p in ps)


def proxy_control(ps: list[Proxy]) -> int:
    return sum(p.counts[d]["control"] for p in ps for d in ("dn", "up"))


# ---------------------------------------------------------------------------------------
# (1) Messages/s across members


async def section_1(args: argparse.Namespace, shared: Path, use_nats: bool) -> None:
    n = 20_000 if args.quick else 100_000
    rep = 1 if args.quick else args.repeat
    ms = await our_cluster(shared, 3)
    try:
        pub, sub = await ms[0].connect(), await ms[1].connect()
        cnt = Counting()
        sub.observe(f'<Says "user-{WANTED}" $text>', on_message=cnt.hit)
        await sub.sync()
        await meshed(ms)
        ours = 0.0
        for _ in range(rep):
            ours = max(ours, await ours_rate(pub, cnt, n, 100))
        ours1 = 0.0
        for _ in range(rep):
            ours1 = max(ours1, await ours_rate(pub, cnt, n // 2, 1))
        for c in (pub, sub):
            await c.close()
    finally:
        for m in ms:
            m.stop()
    step("(1) ours")
    theirs = None
    if use_nats:
        ns = await nats_cluster(3)
        try:
            npub, nsub = await nats_connect(ns[0]), await nats_connect(ns[1])
            ncnt = Counting()
            await nsub.subscribe(f"says.user-{WANTED}", cb=ncnt.ahit)
            await nsub.flush()
            await poll(lambda: _nats_interest(ns[0], 1), "the subscription to cross the route")
            theirs = 0.0
            for _ in range(rep):
                theirs = max(theirs, await nats_rate(npub, ncnt, n))
            await npub.close()
            await nsub.close()
        finally:
            for x in ns:
                x.stop()
    step("(1) NATS")
    say("(1) messages/s across members (publisher on member 0, subscriber on member 1, "
        "3 members)")
    say(f"    dataspace: batched {ours:,.0f}/s, one per packet {ours1:,.0f}/s"
        + (f"; NATS: {theirs:,.0f}/s (ratio {ours / theirs:.2f}x)" if theirs else ""))


async def _nats_interest(node: NatsNode, at_least: int) -> bool:
    rz = await node.routez()
    return sum(r.get("subscriptions", 0) for r in rz.get("routes") or []) >= at_least


# ---------------------------------------------------------------------------------------
# (2) Route bytes at 1% interest


async def _ours_bytes(ms: list[Member], ps: list[Proxy], want_all: bool, run: int,
                      users: int, per_user: int) -> tuple[int, int]:
    pub, sub = await ms[0].connect(), await ms[1].connect()
    got = 0
    done = asyncio.Event()

    def hit(*_a: Any) -> None:
        nonlocal got
        got += 1

    if want_all:
        sub.observe("<Says $who $text>", on_message=hit)
    else:
        sub.observe(f'<Says "user-{WANTED}" $text>', on_message=hit)
    sub.observe("<Done $n>", on_message=lambda x: done.set() if x == run else None)
    await sub.sync()
    await meshed(ms)
    b0 = proxy_bytes(ps)
    names = [f"user-{u}" for u in range(users)]
    for j in range(per_user):
        with pub.turn():
            for who in names:
                pub.send(Record._make(SAYS, (who, text(j))))
        if j % 10 == 9:
            await pub.drain()
    pub.send(Record._make(DONE, (run,)))
    await asyncio.wait_for(done.wait(), WAIT)
    b = proxy_bytes(ps) - b0
    want = users * per_user if want_all else per_user
    if got != want:
        raise SystemExit(f"(2) the subscriber got {got} messages, wanted {want}")
    await pub.close()
    await sub.close()
    return b, got


async def _nats_bytes(ns: list[NatsNode], ps: list[Proxy], want_all: bool, run: int,
                      users: int, per_user: int) -> tuple[int, int]:
    pub, sub = await nats_connect(ns[0]), await nats_connect(ns[1])
    got = 0
    done = asyncio.Event()

    async def hit(_m: Any) -> None:
        nonlocal got
        got += 1

    async def on_done(m: Any) -> None:
        if m.data == str(run).encode():
            done.set()

    base = sum(r.get("subscriptions", 0) for r in (await ns[0].routez()).get("routes") or [])
    await sub.subscribe("says.*" if want_all else f"says.user-{WANTED}", cb=hit)
    await sub.subscribe("done", cb=on_done)
    await sub.flush()
    await poll(lambda: _nats_interest(ns[0], base + 2), "NATS interest to cross the route")
    b0 = proxy_bytes(ps)
    names = [f"says.user-{u}" for u in range(users)]
    for j in range(per_user):
        t = text(j).encode()
        for subj in names:
            await pub.publish(subj, t)
    await pub.publish("done", str(run).encode())
    await pub.flush()
    await asyncio.wait_for(done.wait(), WAIT)
    b = proxy_bytes(ps) - b0
    want = users * per_user if want_all else per_user
    if got != want:
        raise SystemExit(f"(2) NATS: the subscriber got {got} messages, wanted {want}")
    await pub.close()
    await sub.close()
    return b, got


async def section_2(args: argparse.Namespace, shared: Path, use_nats: bool) -> None:
    users, per_user = 101, (50 if args.quick else 200)
    ps = [await Proxy(("127.0.0.1", 0), SyndicateTap).start() for _ in range(2)]
    try:
        ms = await our_cluster(shared, 2, ps)
        try:
            one, _ = await _ours_bytes(ms, ps, False, 1, users, per_user)
            every, _ = await _ours_bytes(ms, ps, True, 2, users, per_user)
        finally:
            for m in ms:
                m.stop()
    finally:
        for p in ps:
            await p.close()
    step("(2) ours")
    line = (f"    dataspace: {one / every:.2%} ({one:,} / {every:,} B; "
            f"{every / (users * per_user):.1f} B per forwarded message)")
    if use_nats:
        nps = [await Proxy(("127.0.0.1", 0), NatsRouteTap).start() for _ in range(2)]
        try:
            ns = await nats_cluster(2, nps)
            try:
                none, _ = await _nats_bytes(ns, nps, False, 1, users, per_user)
                nevery, _ = await _nats_bytes(ns, nps, True, 2, users, per_user)
            finally:
                for x in ns:
                    x.stop()
        finally:
            for p in nps:
                await p.close()
        line += (f"; NATS: {none / nevery:.2%} ({none:,} / {nevery:,} B; "
                 f"{nevery / (users * per_user):.1f} B per message)")
    step("(2) NATS")
    say(f"(2) route bytes when member B wants 1% of {users * per_user:,} messages published "
        "on A, as a share of all of them (target <= 3%)")
    say(line)


# ---------------------------------------------------------------------------------------
# (3) Failover


async def _ours_failover(ms: list[Member]) -> tuple[float, float]:
    cli = await ms[0].connect(ms[1], ms[2])
    obs = await ms[2].connect()
    loop = asyncio.get_running_loop()
    t_kill = 0.0
    first_probe = loop.create_future()
    reasserted = loop.create_future()
    retracted = [False]

    def on_probe(sent: float) -> None:
        if t_kill and sent > t_kill and not first_probe.done():
            first_probe.set_result(time.perf_counter())

    def on_assert(_who: Any) -> None:
        if t_kill and retracted[0] and not reasserted.done():
            reasserted.set_result(time.perf_counter())

    def on_retract(_who: Any) -> None:
        if t_kill:
            retracted[0] = True

    obs.observe("<Probe $t>", on_message=on_probe)
    obs.observe('<Present "probe">', on_assert=lambda: on_assert(None),
                on_retract=lambda: on_retract(None))
    await obs.sync()
    cli.assert_(Record._make(Symbol("Present"), ("probe",)))
    await cli.sync()
    await meshed(ms)
    stop = asyncio.Event()

    async def probes() -> None:
        while not stop.is_set():
            cli.send(Record._make(PROBE, (time.perf_counter(),)))
            await asyncio.sleep(0.002)

    task = asyncio.ensure_future(probes())
    await asyncio.sleep(0.2)
    t_kill = time.perf_counter()
    ms[0].kill9()
    try:
        t_msg = await asyncio.wait_for(first_probe, 30)
        try:
            t_assert = await asyncio.wait_for(reasserted, 10)
        except TimeoutError:  # its new copy came before the old one went: no gap seen
            t_assert = float("nan")
    finally:
        stop.set()
        await task
    await cli.close()
    await obs.close()
    return t_msg - t_kill, t_assert - t_kill


async def _nats_failover(ns: list[NatsNode]) -> float:
    async def quiet(_e: Exception) -> None:  # (the kill is on purpose)
        pass

    pub = await nats_connect(ns[0], ns[1], ns[2], allow_reconnect=True,
                             reconnect_time_wait=0.05, max_reconnect_attempts=-1,
                             error_cb=quiet)
    sub = await nats_connect(ns[2])
    loop = asyncio.get_running_loop()
    t_kill = 0.0
    first = loop.create_future()

    async def on_probe(m: Any) -> None:
        sent = float(m.data)
        if t_kill and sent > t_kill and not first.done():
            first.set_result(time.perf_counter())

    await sub.subscribe("probe", cb=on_probe)
    await sub.flush()
    await poll(lambda: _nats_interest(ns[0], 1), "NATS interest to cross the route")
    stop = asyncio.Event()

    async def probes() -> None:
        while not stop.is_set():
            try:
                await pub.publish("probe", repr(time.perf_counter()).encode())
            except Exception:  # (disconnected: nats-py buffers or refuses)
                pass
            await asyncio.sleep(0.002)

    task = asyncio.ensure_future(probes())
    await asyncio.sleep(0.2)
    t_kill = time.perf_counter()
    ns[0].kill9()
    try:
        t = await asyncio.wait_for(first, 30)
    finally:
        stop.set()
        await task
    await pub.close()
    await sub.close()
    return t - t_kill


async def section_3(args: argparse.Namespace, shared: Path, use_nats: bool) -> None:
    rep = 1 if args.quick else args.repeat
    msg, asr = [], []
    ms = await our_cluster(shared, 3)
    try:
        for _ in range(rep):
            a, b = await _ours_failover(ms)
            msg.append(a)
            asr.append(b)
            await ms[0].start()
            await meshed(ms)
    finally:
        for m in ms:
            m.stop()
    step("(3) ours")
    nmsg: list[float] = []
    if use_nats:
        ns = await nats_cluster(3)
        try:
            for _ in range(rep):
                nmsg.append(await _nats_failover(ns))
                await ns[0].start()

                async def ok() -> bool:
                    for x in ns:
                        if len((await x.routez()).get("routes") or []) < 2:
                            return False
                    return True

                await poll(ok, "NATS to route again", every=0.05)
        finally:
            for x in ns:
                x.stop()
    step("(3) NATS")
    say(f"(3) failover: kill -9 of the client's server, until another member has the client "
        f"again (median of {rep})")
    ms_ = statistics.median
    say(f"    dataspace: its messages {ms_(msg) * 1000:.0f} ms, its assertion re-asserted "
        f"{ms_(asr) * 1000:.0f} ms (runs: {', '.join(f'{x * 1000:.0f}' for x in asr)} ms)"
        + (f"; NATS: its messages {ms_(nmsg) * 1000:.0f} ms" if nmsg else ""))


# ---------------------------------------------------------------------------------------
# (4) 10,000 subscriptions after a route cut


async def section_4(args: argparse.Namespace, shared: Path, use_nats: bool) -> None:
    n = 2_000 if args.quick else 10_000
    conns_n = 10
    ps = [await Proxy(("127.0.0.1", 0), ControlTimes).start() for _ in range(2)]
    try:
        ms = await our_cluster(shared, 2, ps)
        try:
            conns = [await ms[1].connect() for _ in range(conns_n)]
            for i in range(n):
                conns[i % conns_n].observe(f'<Says "user-{i}" $text>', on_message=lambda t: None)
            for c in conns:
                await c.sync(timeout=WAIT)

            async def holds(since: float = 0.0) -> bool:
                st = await ms[0].status()
                return any(r.get("connected") and r.get("peer_wants") == n
                           and r.get("since", 0) > since for r in st["routes"])

            # (Polled slowly: a status of 10,000 entries is not free for the member.)
            await poll(holds, f"A to hold B's {n:,} subscriptions", every=0.25)
            await meshed(ms)
            c0 = proxy_control(ps)
            wall = time.time()
            t0 = time.perf_counter()
            for p in ps:
                p.cut()
            await poll(lambda: holds(wall), f"A's new route to hold the {n:,} again",
                       every=0.25)
            await meshed(ms)
            ours_t = ControlTimes.times["last"] - t0
            ours_c = (proxy_control(ps) - c0) / n
            for c in conns:
                await c.close()
        finally:
            for m in ms:
                m.stop()
    finally:
        for p in ps:
            await p.close()
    step("(4) ours")
    line = f"    dataspace: {ours_t:.2f} s, {ours_c:.2f} control messages per subscription"
    if use_nats:
        nps = [await Proxy(("127.0.0.1", 0), NatsRouteTap).start() for _ in range(2)]
        try:
            ns = await nats_cluster(2, nps)
            try:
                subs = [await nats_connect(ns[1]) for _ in range(conns_n)]

                async def nop(_m: Any) -> None:
                    pass

                for i in range(n):
                    await subs[i % conns_n].subscribe(f"says.user-{i}", cb=nop)
                for s in subs:
                    await s.flush()
                await poll(lambda: _nats_interest(ns[0], n), f"NATS's {n:,} subscriptions")
                c0 = proxy_control(nps)
                t0 = time.perf_counter()
                for p in nps:
                    p.cut()

                async def gone() -> bool:
                    return not await _nats_interest(ns[0], n)

                await poll(gone, "the NATS route to go", timeout=10)
                t1 = await poll(lambda: _nats_interest(ns[0], n), "NATS's route to return")
                line += (f"; NATS: {t1 - t0:.2f} s, {(proxy_control(nps) - c0) / n:.2f} "
                         "control messages per subscription (it waits 1 s before it "
                         "reconnects a route)")
                for s in subs:
                    await s.close()
            finally:
                for x in ns:
                    x.stop()
        finally:
            for p in nps:
                await p.close()
    step("(4) NATS")
    say(f"(4) {n:,} subscriptions on member B converging on A after the route is cut "
        "(from the cut; the new route's control messages)")
    say(line)


# ---------------------------------------------------------------------------------------
# (5) Scaling: 1 -> N and N -> N, clients in worker processes


async def worker(args: argparse.Namespace) -> None:
    """A client in a process of its own: ``sub`` prints ``ready``, then the perf_counter
    times of its first and last message once it has ``--count``; ``pub`` waits for a
    line on stdin, sends ``--count`` messages of ``--topic`` (turns of 100) and prints
    its start time."""
    ds = await connect(args.server, args.cap)
    if args.worker == "sub":
        first = last = 0.0
        n = 0
        done = asyncio.Event()

        def hit(*_a: Any) -> None:
            nonlocal first, last, n
            n += 1
            if n == 1:
                first = time.perf_counter()
            if n == args.count:
                last = time.perf_counter()
                done.set()

        pattern = "<T $t $i>" if args.topic == "*" else f"<T {args.topic} $i>"
        ds.observe(pattern, on_message=hit)
        await ds.sync()
        print("ready", flush=True)
        await asyncio.wait_for(done.wait(), WAIT)
        print(f"{first} {last}", flush=True)
    else:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        t0 = time.perf_counter()
        topic = int(args.topic)
        for i in range(0, args.count, 100):
            with ds.turn():
                for j in range(i, min(args.count, i + 100)):
                    ds.send(Record._make(Symbol("T"), (topic, j)))
            await ds.drain()
        await ds.sync()
        print(f"{t0}", flush=True)
    await ds.close()


async def _spawn_worker(kind: str, m: Member, topic: str, count: int) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--worker", kind, "--server", m.address, "--cap", m.cap,
        "--topic", topic, "--count", str(count), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE)


async def _run_shape(ms: list[Member], shape: str, per_pub: int) -> float:
    """Messages delivered per second, all subscribers together."""
    n = len(ms)
    if shape == "1->N":
        pubs = [(ms[0], "0")]
        subs = [(m, "*", per_pub) for m in ms]
    elif shape == "N->N local":
        pubs = [(m, str(i)) for i, m in enumerate(ms)]
        subs = [(m, str(i), per_pub) for i, m in enumerate(ms)]
    else:
        pubs = [(m, str(i)) for i, m in enumerate(ms)]
        subs = [(m, str((i + 1) % n), per_pub) for i, m in enumerate(ms)]
    sp = [await _spawn_worker("sub", m, t, c) for m, t, c in subs]
    for p in sp:
        line = await asyncio.wait_for(p.stdout.readline(), WAIT)  # type: ignore[union-attr]
        assert line.strip() == b"ready", line
    await meshed(ms)
    pp = [await _spawn_worker("pub", m, t, per_pub) for m, t in pubs]
    for p in pp:
        p.stdin.write(b"go\n")  # type: ignore[union-attr]
        await p.stdin.drain()  # type: ignore[union-attr]
    starts = [float((await asyncio.wait_for(p.stdout.readline(), WAIT)).decode())  # type: ignore[union-attr]
              for p in pp]
    ends = []
    for p in sp:
        _first, last = (await asyncio.wait_for(p.stdout.readline(), WAIT)).decode().split()  # type: ignore[union-attr]
        ends.append(float(last))
    for p in (*sp, *pp):
        await asyncio.wait_for(p.wait(), WAIT)
    return sum(c for _m, _t, c in subs) / (max(ends) - min(starts))


async def section_5(args: argparse.Namespace, shared: Path) -> None:
    per_pub = 20_000 if args.quick else 100_000
    say("(5) scaling on this machine (2 cores): messages delivered per second, all "
        "subscribers together (clients in worker processes)")
    base: dict[str, float] = {}
    for n in (1, 2, 4):
        ms = await our_cluster(shared, n)
        try:
            row = []
            for shape in ("1->N", "N->N", "N->N local"):
                r = await _run_shape(ms, shape, per_pub)
                base.setdefault(shape, r)
                row.append(f"{shape} {r:,.0f}/s ({r / base[shape]:.2f}x)")
            say(f"    {n} member{'s' if n > 1 else ''}: " + ", ".join(row))
        finally:
            for m in ms:
                m.stop()
        step(f"(5) {n} members")


# ---------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> None:
    sections = set(args.sections.split(","))
    use_nats = not args.no_nats
    if use_nats:
        if not os.path.exists(NATS_SERVER):
            raise SystemExit(NATS_HINT)
        try:
            import nats as _nats  # noqa: F401
        except ImportError:
            raise SystemExit(NATS_PY_HINT) from None
    start_steps(sum(2 for s in "1234" if s in sections) + 3 * ("5" in sections))
    shared = shared_dir()
    t0 = time.perf_counter()
    version = ""
    if use_nats:
        version = subprocess.run([NATS_SERVER, "--version"], capture_output=True,
                                 text=True).stdout.strip()
    say(f"broker clusters benchmark (Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
        + (f"; NATS: {version}, a cluster of the same size, nats-py client" if use_nats
           else "") + ")")
    try:
        for name, fn in (("1", section_1), ("2", section_2), ("3", section_3),
                         ("4", section_4)):
            if name in sections:
                await fn(args, shared, use_nats)
        if "5" in sections:
            await section_5(args, shared)
    except NotConverged as e:
        raise SystemExit(f"bench_cluster: {e}") from None
    finally:
        for p in list(bench_link._LIVE):
            p.stop()
        import shutil

        shutil.rmtree(shared, ignore_errors=True)
    finish()
    say(f"({time.perf_counter() - t0:.0f} s) command: .venv/bin/python "
        "benchmarks/bench_cluster.py" + (" --quick" if args.quick else "")
        + (" --no-nats" if args.no_nats else "")
        + (f" --sections {args.sections}" if args.sections != "1,2,3,4,5" else ""))


def _interrupted(signum: int, _frame: Any) -> None:
    print(f"\nbench_cluster: {signal.Signals(signum).name}: stopping the servers",
          file=sys.stderr)
    for p in list(bench_link._LIVE):
        p.stop()
    os._exit(128 + signum)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per figure (default 3; --quick: 1)")
    ap.add_argument("--no-nats", action="store_true", help="our side alone")
    ap.add_argument("--sections", default="1,2,3,4,5", metavar="1,2,3,4,5",
                    help="which sections to run (default all)")
    ap.add_argument("--worker", choices=["pub", "sub"], help=argparse.SUPPRESS)
    ap.add_argument("--server", help=argparse.SUPPRESS)
    ap.add_argument("--cap", help=argparse.SUPPRESS)
    ap.add_argument("--topic", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        asyncio.run(worker(a))
    else:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _interrupted)
        asyncio.run(main(a))
