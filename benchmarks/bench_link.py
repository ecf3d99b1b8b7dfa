"""Linked brokers benchmark (issue 10, section 4): what a link carries, how fast, and how
subscription changes cross it -- with NATS (two servers joined by a leaf node
connection) doing the same work in the same run.

Two servers: U (upstream, where the publisher is) and D (downstream, started with
``--link U --link-cap U's root.sturdyref``, where the subscribers are).

(1) Link efficiency.  A publisher on U sends 20,200 messages ``<Says "user-N" "TEXT">``
    (101 users, 200 each, interleaved); a subscriber on D wants one user
    (``<Says "user-7" $text>``: 200 messages, 1%).  The bytes on the link -- counted by
    an asyncio TCP proxy placed between D and U (D links to the proxy) -- are compared
    with the same run where D's subscriber wants everything (``<Says $who $text>``).
    Target: <= 3%.  The subscriber must receive exactly the wanted messages (no loss, no
    duplicate); the run ends on a ``<Done N>`` message published after the others (a link
    keeps order), never on a sleep.
(2) Throughput U -> D of wanted messages as a ratio to one server alone (publisher and
    subscriber on one unlinked server; target >= 0.7x), and the latency a hop adds: a
    request/response (requester on D, responder on U: the round trip crosses the link
    twice) against the same on one server, p50 / p99.  A direct link (no proxy).
(3) Subscription churn.  1,000, then 10,000 subscribers on D (10 connections) subscribe
    to distinct patterns ``<Says "user-I" $text>``; the proxy cuts the link (D redials and
    subscribes again); then every one unsubscribes.  For each phase: control messages per
    change (the link's requests and CONFIRMs, counted by decoding the proxied stream,
    cross-checked with the link's status counters in DATA_DIR/links.json) and the time
    until the producer's trie on U has converged (U's ``peer_wants`` equals the number of
    distinct subscriptions and D has nothing pending: links.json polled with a bounded
    wait, --churn-timeout; the time is that of the last control byte the proxy saw).
(4) NATS side by side: Debian's ``nats-server`` (2.9), U a hub accepting leaf nodes and D
    a leaf node dialing it through the same counting proxy, driven by the ``nats-py``
    asyncio client: subjects ``says.user-N``; the same workloads (1), (2) and (3) (NATS
    propagates interest as LS+ / LS- lines on the leaf connection; its convergence is
    read from the hub's /leafz monitoring endpoint).

Every server listens on 127.0.0.1 on a free port and lives in a temporary directory;
all of them are stopped at the end, on failure too.  Clients (and the proxy) run in this
process's asyncio event loop, as in bench_broker.py.

Needs: ``apt-get install -y nats-server`` and ``pip install -e '.[bench]'`` (nats-py);
``--no-nats`` runs our side alone.

Run:  .venv/bin/python benchmarks/bench_link.py            (about a minute; each wait
                                                             for convergence is bounded
                                                             by --churn-timeout)
      .venv/bin/python benchmarks/bench_link.py --quick    (smaller, a smoke test)
      make bench-link
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_steps import finish, say, start_steps, step
from dataspace.client import RemoteDataspace, connect
from dataspace.values import Decoder, Record, Sequence, Symbol

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"
NATS_HINT = ("nats-server not found: this benchmark runs NATS beside us as the reference; "
             "install it with `apt-get install -y nats-server` (or pass --no-nats)")
NATS_PY_HINT = ("the nats-py client is not installed: `.venv/bin/pip install -e '.[bench]'` "
                "(or pass --no-nats)")

SAYS = Symbol("Says")
DONE = Symbol("Done")
REQ = Symbol("Req")
RESP = Symbol("Resp")
WANTED = 7                     # the user the 1% subscriber wants
CONTROL = {"subscribe", "reject", "reset", "confirm"}
WAIT = 120.0                   # bound of every wait on an event or a status


def text(j: int) -> str:
    return f"{j:05d} hello there"  # 16 bytes, distinct per message of a user


# ---------------------------------------------------------------------------------------
# Processes


_LIVE: list[Proc] = []
"""Every server process running, for the signal handler."""


class Proc:
    """A server process with its logs in a temporary directory."""

    def __init__(self, prefix: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"bench-link-{prefix}-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.dir / "log"
        _LIVE.append(self)

    def spawn(self, argv: list[str]) -> None:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    async def wait_log(self, pattern: str, what: str, timeout: float = 30.0) -> re.Match[str]:
        """Poll the log for ``pattern`` (bounded), failing early if the process died."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.log.read_text(errors="replace")
            m = re.search(pattern, text)
            if m:
                return m
            assert self.proc is not None
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{what} did not start (exit {self.proc.poll()}):\n{text}")
            await asyncio.sleep(0.02)

    def stop(self) -> None:
        if self in _LIVE:
            _LIVE.remove(self)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class OurServer(Proc):
    def __init__(self, name: str, link: tuple[str, str] | None = None) -> None:
        super().__init__(name)
        self.name = name
        self.link = link
        self.data = self.dir / "data"
        self.address = ""
        self.cap = ""

    async def start(self) -> OurServer:
        argv = [sys.executable, "-m", "dataspace.cli", "serve", "--tcp", "127.0.0.1:0",
                "--data-dir", str(self.data), "--max-assertions", "1000000"]
        if self.link is not None:
            argv += ["--link", self.link[0], "--link-cap", self.link[1]]
        self.spawn(argv)
        await self.wait_log(r"Ctrl-C stops", f"dataspace serve ({self.name})")
        log = self.log.read_text()
        self.cap = re.search(r"sturdyref: (.*)", log).group(1).strip()  # type: ignore[union-attr]
        self.address = re.search(r"listening on (127\.0\.0\.1:\d+)", log).group(1)  # type: ignore[union-attr]
        return self

    def status(self) -> dict[str, Any]:
        """This server's only link row of DATA_DIR/links.json ({} before there is one)."""
        try:
            doc = json.loads((self.data / "links.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}
        rows = doc.get("links", [])
        return rows[0] if len(rows) == 1 else {}

    async def connect(self) -> RemoteDataspace:
        return await connect(self.address, self.cap, reconnect=False)


class NotConverged(Exception):
    """A bounded wait ended before its condition held."""


async def until_status(pred: Callable[[], bool], what: str, show: Callable[[], Any],
                       timeout: float = WAIT) -> float:
    """Poll the status files (written by the servers every 2 s, and 0.2 s after a link
    comes or goes) until ``pred`` holds; returns when it did (perf_counter).  Raises
    :class:`NotConverged` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise NotConverged(f"timed out after {timeout:.0f} s waiting for {what}; "
                               f"status: {json.dumps(show())}")
        await asyncio.sleep(0.05)
    return time.perf_counter()


class Pair:
    """U and D, D linked to U (through a counting proxy or directly)."""

    def __init__(self, u: OurServer, d: OurServer) -> None:
        self.u, self.d = u, d

    def rows(self) -> dict[str, dict[str, Any]]:
        return {"U": self.u.status(), "D": self.d.status()}

    async def settled(self, d_wants: int, u_wants: int = 0, what: str = "",
                      since: float = 0.0, timeout: float = WAIT) -> float:
        """Both sides connected (since ``since``, wall clock), nothing pending, no root
        artifact, and each producer's trie holding what the other side wants
        (``peer_wants``)."""
        def ok() -> bool:
            u, d = self.u.status(), self.d.status()
            return bool(u and d) and all(
                r.get("connected") and r.get("pending") == 0 and not r.get("peer_everything")
                and r.get("since", 0) > since for r in (u, d)) and \
                u.get("peer_wants") == d_wants and d.get("peer_wants") == u_wants and \
                d.get("canonical") == d_wants and u.get("canonical") == u_wants
        return await until_status(ok, what or f"the link to settle (U's producer trie holding "
                                  f"{d_wants} entries)", self.rows, timeout)


# ---------------------------------------------------------------------------------------
# The counting proxy


class SyndicateTap:
    """Decodes one direction of one Syndicate-protocol connection, counting its events
    into ``counts`` (``control``: the link's requests and CONFIRMs)."""

    def __init__(self, counts: Counter[str]) -> None:
        self.dec = Decoder(embedded=lambda v: v, max_value_size=64 << 20)
        self.counts = counts

    def feed(self, data: bytes) -> None:
        self.dec.feed(data)
        c = self.counts
        for pkt in self.dec:
            c["packets"] += 1
            if type(pkt) is not Sequence:
                continue
            for ev in pkt:
                e = ev[1]
                lab = e.label.name
                if lab == "M":
                    body = e.fields[0]
                    if type(body) is Record and type(body.label) is Symbol \
                            and body.label.name in CONTROL:
                        c["control"] += 1
                        c[body.label.name] += 1
                    else:
                        c["messages"] += 1
                else:
                    c[lab] += 1


class NatsTap:
    """Counts the protocol lines of one direction of a NATS leaf node connection
    (``control``: LS+ and LS-, the leaf's interest; LMSG: messages)."""

    TOKENS = (b"LS+ ", b"LS- ", b"LMSG ")

    def __init__(self, counts: Counter[str]) -> None:
        self.tail = b"\n"
        self.counts = counts

    def feed(self, data: bytes) -> None:
        buf = self.tail + data
        c = self.counts
        for t in self.TOKENS:
            n = buf.count(b"\n" + t)
            c[t.decode().strip()] += n
            if t != b"LMSG ":
                c["control"] += n
        self.tail = buf[-6:]


class Proxy:
    """A TCP proxy on 127.0.0.1 that counts the bytes each way (``dn``: from the dialing
    server D to U, ``up``: from U to D), when the last ones passed, and (with a tap) the
    protocol's messages.  :meth:`cut` closes its connections (the link is cut)."""

    def __init__(self, target: tuple[str, int], tap: Callable[[Counter[str]], Any] | None = None) -> None:
        self.target = target
        self.tap = tap
        self.bytes = {"dn": 0, "up": 0}
        self.last = {"dn": 0.0, "up": 0.0}
        self.counts: dict[str, Counter[str]] = {"dn": Counter(), "up": Counter()}
        self.port = 0
        self.connections = 0
        self.connected_at = 0.0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.connected_at = time.perf_counter()
        try:
            ur, uw = await asyncio.open_connection(*self.target)
        except OSError:
            w.close()
            return
        self._writers += [w, uw]
        for src, dst, d in ((r, uw, "dn"), (ur, w, "up")):
            tap = self.tap(self.counts[d]) if self.tap is not None else None
            t = asyncio.ensure_future(self._pump(src, dst, d, tap))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, d: str,
                    tap: Any) -> None:
        try:
            while data := await src.read(1 << 16):
                self.bytes[d] += len(data)
                self.last[d] = time.perf_counter()
                if tap is not None:
                    tap.feed(data)
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            dst.close()

    def cut(self) -> None:
        """Close every connection through the proxy, both ways (a link cut)."""
        for w in self._writers:
            w.close()
        self._writers.clear()

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dn": self.bytes["dn"], "up": self.bytes["up"]}
        out["total"] = out["dn"] + out["up"]
        for d in ("dn", "up"):
            out[f"{d}_counts"] = Counter(self.counts[d])
        return out

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)


def delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: b[k] - a[k] for k in ("dn", "up", "total")}
    for d in ("dn", "up"):
        out[f"{d}_counts"] = b[f"{d}_counts"] - a[f"{d}_counts"]
    return out


# ---------------------------------------------------------------------------------------
# NATS


class NatsServer(Proc):
    """nats-server on free loopback ports; ``leaf_listen``: accepts leaf nodes (telling
    them to reconnect to ``advertise``: the proxy, else a leaf node that reconnects goes
    straight to the hub's port); ``remote``: a leaf node of the hub at that address."""

    def __init__(self, name: str, leaf_listen: bool = False, remote: str | None = None,
                 advertise: str | None = None) -> None:
        super().__init__(f"nats-{name}")
        self.name = name
        conf = ['listen: "127.0.0.1:-1"', 'http: "127.0.0.1:-1"', f'server_name: "{name}"']
        if leaf_listen:
            adv = f', advertise: "{advertise}"' if advertise else ""
            conf.append(f'leafnodes {{ listen: "127.0.0.1:-1"{adv} }}')
        if remote is not None:
            conf.append("leafnodes { reconnect: 1, remotes: [ { url: \"nats-leaf://"
                        + remote + "\" } ] }")
        (self.dir / "nats.conf").write_text("\n".join(conf) + "\n")
        self.port = self.http = self.leaf_port = 0
        self.leaf_ports: list[int] = []

    async def start(self) -> NatsServer:
        self.spawn([NATS_SERVER, "-c", str(self.dir / "nats.conf")])
        await self.wait_log(r"Server is ready", f"nats-server ({self.name})")
        log = self.log.read_text()
        self.port = int(re.search(r"client connections on 127\.0\.0\.1:(\d+)", log).group(1))  # type: ignore[union-attr]
        self.http = int(re.search(r"http monitor on 127\.0\.0\.1:(\d+)", log).group(1))  # type: ignore[union-attr]
        m = re.search(r"leafnode connections on 127\.0\.0\.1:(\d+)", log)
        self.leaf_port = int(m.group(1)) if m else 0
        return self

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def get(self, path: str) -> dict[str, Any]:
        r, w = await asyncio.open_connection("127.0.0.1", self.http)
        w.write(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
        data = await r.read()
        w.close()
        return json.loads(data.split(b"\r\n\r\n", 1)[1])

    async def leaf_subs(self, subjects: bool = False) -> tuple[int, int, list[str]]:
        """(leaf connections, how many subscriptions the leaf node(s) told this hub of,
        and, if asked, their subjects)."""
        doc = await self.get("/leafz?subs=1" if subjects else "/leafz")
        leafs = doc.get("leafs") or []
        self.leaf_ports = [lf.get("port") for lf in leafs]
        subs = [s for lf in leafs for s in (lf.get("subscriptions_list") or [])]
        return len(leafs), sum(lf.get("subscriptions", 0) for lf in leafs), subs

    async def until_leaf(self, pred: Callable[[int, int, list[str]], bool], what: str,
                         subjects: bool = False, timeout: float = WAIT) -> float:
        """Poll the hub's /leafz (bounded) until ``pred(leafs, count, subjects)`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            n, count, subs = await self.leaf_subs(subjects)
            if pred(n, count, subs):
                return time.perf_counter()
            if time.monotonic() > deadline:
                raise NotConverged(f"timed out after {timeout:.0f} s waiting for {what} "
                                   f"(leafs {n}, {count} subscriptions)")
            await asyncio.sleep(0.02)


async def nats_connect(srv: NatsServer) -> Any:
    import nats

    return await nats.connect(srv.url, allow_reconnect=False, max_reconnect_attempts=0,
                              pending_size=64 << 20)


# ---------------------------------------------------------------------------------------
# (1) Link efficiency


async def ours_efficiency(pair: Pair, proxy: Proxy, users: int, per_user: int,
                          want_all: bool, run: int) -> dict[str, Any]:
    sub = await pair.d.connect()
    pub = await pair.u.connect()
    await pair.settled(0)
    got: list[tuple[str, str]] = []
    done = asyncio.Event()
    b0 = proxy.snapshot()
    if want_all:
        sub.observe("<Says $who $text>", on_message=lambda w, t: got.append((w, t)))
    else:
        sub.observe(f'<Says "user-{WANTED}" $text>',
                    on_message=lambda t: got.append((f"user-{WANTED}", t)))
    sub.observe("<Done $n>", on_message=lambda n: done.set() if n == run else None)
    await sub.sync()
    await pair.settled(2)       # the Says pattern's prefix and <Done>'s
    b1 = proxy.snapshot()
    names = [f"user-{u}" for u in range(users)]
    t0 = time.perf_counter()
    for j in range(per_user):
        t = text(j)
        with pub.turn():
            for who in names:
                pub.send(Record._make(SAYS, (who, t)))
        if j % 10 == 9:
            await pub.drain()
    pub.send(Record._make(DONE, (run,)))
    await asyncio.wait_for(done.wait(), WAIT)
    dt = time.perf_counter() - t0
    b2 = proxy.snapshot()
    wanted = ({(w, text(j)) for w in names for j in range(per_user)} if want_all
              else {(f"user-{WANTED}", text(j)) for j in range(per_user)})
    if len(got) != len(wanted) or set(got) != wanted:
        raise SystemExit(f"(1) the subscriber on D got {len(got)} messages "
                         f"({len(set(got))} distinct, {len(set(got) - wanted)} unwanted, "
                         f"{len(wanted - set(got))} missing); it wanted {len(wanted)}")
    await sub.close()
    await pub.close()
    await pair.settled(0)
    return {"received": len(got), "subscribe": delta(b0, b1), "data": delta(b1, b2),
            "all": delta(b0, b2), "seconds": dt}


async def nats_efficiency(hub: NatsServer, proxy: Proxy, leaf: NatsServer, users: int,
                          per_user: int, want_all: bool, run: int) -> dict[str, Any]:
    sub = await nats_connect(leaf)
    pub = await nats_connect(hub)
    await hub.until_leaf(lambda n, c, s: n == 1, "the leaf node")
    _n, subs0, _ = await hub.leaf_subs()
    got: list[tuple[str, str]] = []
    done = asyncio.Event()
    b0 = proxy.snapshot()

    async def on_says(m: Any) -> None:
        got.append((m.subject[5:], m.data.decode()))

    async def on_done(m: Any) -> None:
        if m.data == str(run).encode():
            done.set()

    await sub.subscribe("says.*" if want_all else f"says.user-{WANTED}", cb=on_says)
    await sub.subscribe("done", cb=on_done)
    await sub.flush()
    await hub.until_leaf(lambda n, c, s: c == subs0 + 2,
                         "the leaf node's interest to reach the hub")
    b1 = proxy.snapshot()
    names = [f"says.user-{u}" for u in range(users)]
    t0 = time.perf_counter()
    for j in range(per_user):
        t = text(j).encode()
        for subj in names:
            await pub.publish(subj, t)
    await pub.publish("done", str(run).encode())
    await pub.flush()
    await asyncio.wait_for(done.wait(), WAIT)
    dt = time.perf_counter() - t0
    await sub.flush()
    b2 = proxy.snapshot()
    wanted = ({(w[5:], text(j)) for w in names for j in range(per_user)} if want_all
              else {(f"user-{WANTED}", text(j)) for j in range(per_user)})
    if len(got) != len(wanted) or set(got) != wanted:
        raise SystemExit(f"(1) NATS: the subscriber on the leaf got {len(got)} messages; "
                         f"it wanted {len(wanted)}")
    await sub.close()
    await pub.close()
    await hub.until_leaf(lambda n, c, s: c == subs0, "the leaf's interest to go")
    return {"received": len(got), "subscribe": delta(b0, b1), "data": delta(b1, b2),
            "all": delta(b0, b2), "seconds": dt}


# ---------------------------------------------------------------------------------------
# (2) Throughput and latency


class Counting:
    def __init__(self) -> None:
        self.target = 0
        self.n = 0
        self.done = asyncio.Event()

    def reset(self, n: int) -> None:
        self.n, self.target = 0, n
        self.done.clear()

    def hit(self, *_: Any) -> None:
        self.n += 1
        if self.n == self.target:
            self.done.set()

    async def ahit(self, _m: Any) -> None:
        self.hit()


async def ours_rate(pub: RemoteDataspace, counter: Counting, n: int, batch: int) -> float:
    """Messages/s from ``pub`` until the subscriber behind ``counter`` has all ``n``."""
    who = f"user-{WANTED}"
    msgs = [Record._make(SAYS, (who, text(i % 100_000))) for i in range(n)]
    counter.reset(n)
    gc.collect()
    t0 = time.perf_counter()
    if batch <= 1:
        for i, m in enumerate(msgs):
            pub.send(m)
            if i % 100 == 99:
                await pub.drain()
                await asyncio.sleep(0)
    else:
        for i in range(0, n, batch):
            with pub.turn():
                for m in msgs[i:i + batch]:
                    pub.send(m)
            await pub.drain()
            await asyncio.sleep(0)
    await asyncio.wait_for(counter.done.wait(), WAIT)
    return n / (time.perf_counter() - t0)


async def nats_rate(pub: Any, counter: Counting, n: int) -> float:
    subj = f"says.user-{WANTED}"
    payloads = [text(i % 100_000).encode() for i in range(n)]
    counter.reset(n)
    gc.collect()
    t0 = time.perf_counter()
    for i, p in enumerate(payloads):
        await pub.publish(subj, p)
        if i % 1000 == 999:
            await asyncio.sleep(0)
    await pub.flush()
    await asyncio.wait_for(counter.done.wait(), WAIT)
    return n / (time.perf_counter() - t0)


async def ours_latency(requester: RemoteDataspace, responder: RemoteDataspace,
                       n: int, settle: Callable[[], Awaitable[Any]] | None) -> list[float]:
    subs = [responder.observe("<Req $i>",
                              on_message=lambda i: responder.send(Record._make(RESP, (i,))))]
    fut: list[asyncio.Future[None]] = []
    subs.append(requester.observe("<Resp $i>", on_message=lambda i: fut[0].set_result(None)
                                  if fut and not fut[0].done() else None))
    await responder.sync()
    await requester.sync()
    if settle is not None:
        await settle()
    loop = asyncio.get_running_loop()
    out = []
    for i in range(n):
        fut[:] = [loop.create_future()]
        t = time.perf_counter()
        requester.send(Record._make(REQ, (i,)))
        await asyncio.wait_for(fut[0], 30)
        out.append(time.perf_counter() - t)
    for s in subs:
        s.cancel()
    await responder.sync()
    await requester.sync()
    return out


async def nats_latency(requester: Any, responder: Any, n: int) -> list[float]:
    async def respond(m: Any) -> None:
        await responder.publish("resp", m.data)

    fut: list[asyncio.Future[None]] = []

    async def on_resp(m: Any) -> None:
        if fut and not fut[0].done():
            fut[0].set_result(None)

    s1 = await responder.subscribe("req", cb=respond)
    s2 = await requester.subscribe("resp", cb=on_resp)
    await responder.flush()
    await requester.flush()
    loop = asyncio.get_running_loop()
    # NATS drops a message nobody wants: retry (with a timeout) until the interest of
    # both sides has crossed the leaf connection.
    for _ in range(200):
        fut[:] = [loop.create_future()]
        await requester.publish("req", b"warmup")
        try:
            await asyncio.wait_for(asyncio.shield(fut[0]), 0.05)
            break
        except TimeoutError:
            continue
    else:
        raise SystemExit("NATS: the request/response never crossed the leaf connection")
    out = []
    for i in range(n):
        fut[:] = [loop.create_future()]
        t = time.perf_counter()
        await requester.publish("req", str(i).encode())
        await asyncio.wait_for(fut[0], 30)
        out.append(time.perf_counter() - t)
    await s1.unsubscribe()
    await s2.unsubscribe()
    return out


# ---------------------------------------------------------------------------------------
# (3) Subscription churn


def _counts(d: dict[str, Any]) -> dict[str, Any]:
    return {"requests": d["dn_counts"]["control"], "confirms": d["up_counts"]["control"],
            "bytes": d["total"]}


async def ours_churn(pair: Pair, proxy: Proxy, n: int, conns_n: int,
                     timeout: float) -> dict[str, dict[str, Any]]:
    """``n`` distinct subscriptions on D: subscribe, cut the link (D reconnects), and
    unsubscribe; each phase until U's producer trie has converged (bounded wait)."""
    conns = [await pair.d.connect() for _ in range(conns_n)]
    await pair.settled(0)
    out: dict[str, dict[str, Any]] = {}
    subs = []
    for phase in ("subscribe", "reconnect", "unsubscribe"):
        s0 = pair.rows()
        p0 = proxy.snapshot()
        wall = time.time()
        t0 = time.perf_counter()
        if phase == "subscribe":
            for i in range(n):
                c = conns[i % conns_n]
                subs.append(c.observe(f'<Says "user-{i}" $text>', on_message=lambda t: None))
                if i % 500 == 499:
                    await c.drain()
        elif phase == "reconnect":
            proxy.cut()
        else:
            for s in subs:
                s.cancel()
        row: dict[str, Any] = {}
        out[phase] = row
        try:
            if phase != "reconnect":
                for c in conns:  # D has applied every change
                    await c.sync(timeout=timeout)
            row["issued"] = time.perf_counter() - t0
            seen = await pair.settled(
                0 if phase == "unsubscribe" else n, since=wall if phase == "reconnect" else 0,
                what=f"U's producer trie to converge ({phase}, {n:,} subscriptions)",
                timeout=timeout)
        except (NotConverged, TimeoutError):
            row.setdefault("issued", float("nan"))
            s1 = pair.rows()
            row.update(_counts(delta(p0, proxy.snapshot())))
            row.update(converged=None, peer_wants=s1["U"].get("peer_wants"),
                       pending=s1["D"].get("pending"),
                       retransmissions=s1["D"].get("retransmissions", 0)
                       - (0 if phase == "reconnect" else s0["D"].get("retransmissions", 0)),
                       waited=time.perf_counter() - t0)
            break
        s1 = pair.rows()
        row.update(_counts(delta(p0, proxy.snapshot())))
        last = max(proxy.last.values())
        fresh = phase == "reconnect"  # a new session: its counters start at 0
        row.update(
            converged=last - t0, seen=seen - t0,
            from_connect=last - proxy.connected_at,
            status_requests=s1["D"]["requests_sent"] - (0 if fresh else s0["D"]["requests_sent"]),
            retransmissions=s1["D"]["retransmissions"] - (0 if fresh else s0["D"]["retransmissions"]),
            u_requests=s1["U"]["requests_sent"] - (0 if fresh else s0["U"]["requests_sent"]))
    for c in conns:
        await c.close()
    return out


async def nats_churn(hub: NatsServer, leaf: NatsServer, proxy: Proxy, n: int,
                     conns_n: int, timeout: float) -> dict[str, dict[str, Any]]:
    conns = [await nats_connect(leaf) for _ in range(conns_n)]
    for c in conns:
        await c.flush()
    _, base, _ = await hub.leaf_subs()
    out: dict[str, dict[str, Any]] = {}
    subs: list[Any] = []
    for phase in ("subscribe", "reconnect", "unsubscribe"):
        p0 = proxy.snapshot()
        t0 = time.perf_counter()
        if phase == "subscribe":
            for i in range(n):
                subs.append(await conns[i % conns_n].subscribe(f"says.user-{i}"))
        elif phase == "reconnect":
            before = proxy.connections
            old_port = hub.leaf_ports
            proxy.cut()
        else:
            for s in subs:
                await s.unsubscribe()
        if phase != "reconnect":
            for c in conns:
                await c.flush()
        row: dict[str, Any] = {"issued": time.perf_counter() - t0}
        out[phase] = row
        want = base + n if phase != "unsubscribe" else base
        try:
            if phase == "reconnect":
                seen = await hub.until_leaf(
                    lambda nl, c, _s, want=want, before=before, old=old_port:
                    proxy.connections > before and nl == 1 and c == want
                    and hub.leaf_ports != old,
                    "the leaf node to reconnect and send its interest again", timeout=timeout)
            else:
                seen = await hub.until_leaf(lambda _n, c, _s, want=want: c == want,
                                            f"the hub to hear of the leaf's interest ({phase})",
                                            timeout=timeout)
        except NotConverged:
            row.update(_counts(delta(p0, proxy.snapshot())))
            row.update(converged=None, waited=time.perf_counter() - t0)
            break
        row.update(_counts(delta(p0, proxy.snapshot())))
        last = max(proxy.last.values())
        row.update(converged=last - t0, seen=seen - t0, from_connect=last - proxy.connected_at)
    for c in conns:
        await c.close()
    return out


# ---------------------------------------------------------------------------------------


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def cpu_seconds(p: Proc) -> float:
    """User + system CPU time of a server process so far."""
    assert p.proc is not None
    with open(f"/proc/{p.proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_run(fn: Callable[[], Awaitable[float]], procs: list[Proc],
                  n: int) -> tuple[float, list[float]]:
    """One run's rate, and the CPU per message (seconds) each of ``procs`` spent in it,
    then this process (the clients)."""
    c0 = [cpu_seconds(p) for p in procs]
    t0 = time.process_time()
    rate = await fn()
    mine = (time.process_time() - t0) / n
    return rate, [(cpu_seconds(p) - a) / n for p, a in zip(procs, c0)] + [mine]


@dataclass
class Paired:
    """Runs in pairs, linked then alone (a pair sees the same load of a shared machine):
    the best rate of each, the pairs' ratios, the least CPU per message of each process."""

    linked: float
    alone: float
    ratios: list[float]
    cpu_linked: list[float]
    cpu_alone: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    def ratio_text(self) -> str:
        return (f"ratio {self.linked / self.alone:.2f}x (pairs: median {self.median:.2f}x, "
                f"{min(self.ratios):.2f}-{max(self.ratios):.2f}x)")


async def paired(repeat: int, linked: Callable[[], Awaitable[float]], procs_l: list[Proc],
                 alone: Callable[[], Awaitable[float]], procs_a: list[Proc], n: int) -> Paired:
    out = Paired(0.0, 0.0, [], [float("inf")] * (len(procs_l) + 1),
                 [float("inf")] * (len(procs_a) + 1))
    for _ in range(repeat):
        r1, c1 = await one_run(linked, procs_l, n)
        r2, c2 = await one_run(alone, procs_a, n)
        out.ratios.append(r1 / r2)
        out.linked, out.alone = max(out.linked, r1), max(out.alone, r2)
        out.cpu_linked = [min(a, b) for a, b in zip(out.cpu_linked, c1)]
        out.cpu_alone = [min(a, b) for a, b in zip(out.cpu_alone, c2)]
    return out


class Servers:
    """Every process and proxy of the run, stopped at the end (on failure too)."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []
        self.proxies: list[Proxy] = []

    def add(self, p: Any) -> Any:
        (self.proxies if isinstance(p, Proxy) else self.procs).append(p)
        return p

    async def close(self) -> None:
        for x in self.proxies:
            await x.close()
        for p in reversed(self.procs):
            p.stop()


def us(x: float) -> str:
    return f"{x * 1e6:,.1f} µs" if abs(x) < 1e-5 else f"{x * 1e6:,.0f} µs"


async def section_1(srv: dict[str, Any], args: argparse.Namespace) -> None:
    users, per_user = 101, (40 if args.quick else 200)
    pair, px = srv["pair1"], srv["px1"]
    total = users * per_user
    say(f"(1) link efficiency: {total:,} messages <Says \"user-N\" TEXT> published on U "
          f"({users} users x {per_user}), the subscriber on D wanting one user "
          f"(<Says \"user-{WANTED}\" $text>) or all (<Says $who $text>); bytes on the link, "
          f"both ways, from the subscription to the last message (a counting proxy between D and U)")
    e_one = await ours_efficiency(pair, px, users, per_user, False, 1)
    e_all = await ours_efficiency(pair, px, users, per_user, True, 2)
    rows = [("dataspace", e_one, e_all)]
    if srv["nats"]:
        n_one = await nats_efficiency(srv["hub1"], srv["npx1"], srv["leaf1"], users, per_user,
                                      False, 1)
        n_all = await nats_efficiency(srv["hub1"], srv["npx1"], srv["leaf1"], users, per_user,
                                      True, 2)
        rows.append(("NATS", n_one, n_all))
    for name, one, every in rows:
        say(f"  {name:9s} wants 1%: {one['all']['total']:>7,} B (subscribing "
              f"{one['subscribe']['total']:,} B + {one['received']} messages "
              f"{one['data']['total']:,} B);  wants all: {every['all']['total']:>9,} B "
              f"({every['received']:,} messages)  ->  {one['all']['total'] / every['all']['total']:.2%}"
              f"  (data alone {one['data']['total'] / every['data']['total']:.2%})")
    ratio = e_one["all"]["total"] / e_all["all"]["total"]
    say(f"  target: dataspace <= 3%: {ratio:.2%}, {'met' if ratio <= 0.03 else 'MISSED'} "
          f"(ideal: 1% plus the subscription traffic); each subscriber received exactly the "
          f"messages it wanted, once")
    c1 = e_one["all"]["dn_counts"] + e_one["all"]["up_counts"]
    say(f"  dataspace, 1% run, events on the link: {c1['messages']:,} data messages, "
          f"{c1['control']} control messages ({c1['subscribe']} subscribe, {c1['reject']} "
          f"reject, {c1['reset']} reset, {c1['confirm']} confirm)")
    if srv["nats"]:
        say(f"  bytes dataspace / NATS: wants 1% {e_one['all']['total'] / n_one['all']['total']:.2f}x,"
              f" wants all {e_all['all']['total'] / n_all['all']['total']:.2f}x (per forwarded "
              f"message: dataspace {e_all['data']['total'] / e_all['received']:.1f} B, NATS "
              f"{n_all['data']['total'] / n_all['received']:.1f} B)")
    step("link efficiency")
    say()


async def section_2(srv: dict[str, Any], args: argparse.Namespace) -> None:
    n = 5_000 if args.quick else args.messages
    n_lat = 300 if args.quick else 2_000
    rep = 1 if args.quick else args.repeat
    pair, u2, d2, lone = srv["pair2"], srv["u2"], srv["d2"], srv["alone"]
    say(f"(2) throughput of wanted messages U -> D ({n:,} <Says \"user-{WANTED}\" TEXT> a "
          f"run) vs publisher and subscriber on one server alone; a direct link; {rep} pairs "
          f"of runs, linked then alone, for each rate: the best of each, and the median of "
          f"the pairs' ratios (the machine is shared: a pair sees the same load); server "
          f"CPU per message (least of the runs)")
    sub_l, pub_l = await d2.connect(), await u2.connect()
    sub_s, pub_s = await lone.connect(), await lone.connect()
    cnt_l, cnt_s = Counting(), Counting()
    sub_l.observe(f'<Says "user-{WANTED}" $text>', on_message=cnt_l.hit)
    sub_s.observe(f'<Says "user-{WANTED}" $text>', on_message=cnt_s.hit)
    await sub_l.sync()
    await sub_s.sync()
    await pair.settled(1)
    ratios = []
    linked_rates = {}
    for label, batch in (("batched turns (100/turn)", 100), ("one message per packet", 1)):
        pr = await paired(rep, lambda b=batch: ours_rate(pub_l, cnt_l, n, b), [u2, d2],
                          lambda b=batch: ours_rate(pub_s, cnt_s, n, b), [lone], n)
        ratios.append(pr.median)
        linked_rates[label] = pr.linked
        (cu, cd, kl), (ca, ka) = pr.cpu_linked, pr.cpu_alone
        say(f"  dataspace {label:25s} linked {pr.linked:>8,.0f}/s  one server "
              f"{pr.alone:>8,.0f}/s  {pr.ratio_text()};  CPU/msg U {us(cu)} + D {us(cd)} "
              f"vs {us(ca)}; the clients {us(kl)} vs {us(ka)}")
    for c in (sub_l, pub_l):
        await c.close()
    await pair.settled(0)
    if srv["nats"]:
        hub2, leaf2, nlone = srv["hub2"], srv["leaf2"], srv["nalone"]
        nsub_l, npub_l = await nats_connect(leaf2), await nats_connect(hub2)
        nsub_s, npub_s = await nats_connect(nlone), await nats_connect(nlone)
        ncnt_l, ncnt_s = Counting(), Counting()
        await nsub_l.subscribe(f"says.user-{WANTED}", cb=ncnt_l.ahit)
        await nsub_s.subscribe(f"says.user-{WANTED}", cb=ncnt_s.ahit)
        await nsub_l.flush()
        await nsub_s.flush()
        await hub2.until_leaf(lambda _n, _c, s: f"says.user-{WANTED}" in s,
                              "the leaf's interest to reach the hub", subjects=True)
        pr = await paired(rep, lambda: nats_rate(npub_l, ncnt_l, n), [hub2, leaf2],
                          lambda: nats_rate(npub_s, ncnt_s, n), [nlone], n)
        nl, ns = pr.linked, pr.alone
        (cu, cd, kl), (ca, ka) = pr.cpu_linked, pr.cpu_alone
        say(f"  NATS      {'publish loop (buffered)':25s} linked {nl:>8,.0f}/s  one server "
              f"{ns:>8,.0f}/s  {pr.ratio_text()};  CPU/msg hub {us(cu)} + leaf {us(cd)} vs "
              f"{us(ca)}; the clients {us(kl)} vs {us(ka)}")
        # One server each, in pairs too: ours batched against NATS (issue 22: >= 2x).
        vs = await paired(rep, lambda: ours_rate(pub_s, cnt_s, n, 100), [lone],
                          lambda: nats_rate(npub_s, ncnt_s, n), [nlone], n)
        say(f"  one server, dataspace batched vs NATS: {vs.linked:,.0f} vs {vs.alone:,.0f}/s, "
              f"ratio {vs.linked / vs.alone:.2f}x (pairs: median {vs.median:.2f}x, "
              f"{min(vs.ratios):.2f}-{max(vs.ratios):.2f}x; target >= 2x: "
              f"{'met' if vs.median >= 2 else 'MISSED'})")
        for c in (nsub_l, npub_l, nsub_s, npub_s):
            await c.close()
        say(f"  linked, dataspace / NATS: batched {linked_rates['batched turns (100/turn)'] / nl:.2f}x, "
              f"one per packet {linked_rates['one message per packet'] / nl:.2f}x (NATS: as fast "
              f"as its nats-py clients in this process go, linked or not)")
    for c in (sub_s, pub_s):
        await c.close()
    worst = min(ratios)
    say(f"  target (issue 22): linked >= 0.85x one server: median ratio {worst:.2f}x at worst, "
          f"{'met' if worst >= 0.85 else 'MISSED'}")
    say()
    step("throughput")
    say(f"    request/response round trips ({n_lat:,}, one outstanding): requester on D, "
          f"responder on U (the round trip crosses the link twice) vs both on one server")
    rq, rs = await d2.connect(), await u2.connect()
    lat_l = await ours_latency(rq, rs, n_lat, lambda: pair.settled(1, 1))
    for c in (rq, rs):
        await c.close()
    rq, rs = await lone.connect(), await lone.connect()
    lat_s = await ours_latency(rq, rs, n_lat, None)
    for c in (rq, rs):
        await c.close()
    lats = [("dataspace", lat_l, lat_s)]
    if srv["nats"]:
        rq, rs = await nats_connect(srv["leaf2"]), await nats_connect(srv["hub2"])
        nlat_l = await nats_latency(rq, rs, n_lat)
        for c in (rq, rs):
            await c.close()
        rq, rs = await nats_connect(srv["nalone"]), await nats_connect(srv["nalone"])
        nlat_s = await nats_latency(rq, rs, n_lat)
        for c in (rq, rs):
            await c.close()
        lats.append(("NATS", nlat_l, nlat_s))
    for name, ll, ls in lats:
        say(f"  {name:9s} linked p50 {us(pct(ll, 50)):>7s} p99 {us(pct(ll, 99)):>8s} | one "
              f"server p50 {us(pct(ls, 50)):>7s} p99 {us(pct(ls, 99)):>8s} | added per hop "
              f"p50 {us((pct(ll, 50) - pct(ls, 50)) / 2):>7s} p99 "
              f"{us((pct(ll, 99) - pct(ls, 99)) / 2):>8s}")
    step("latency")
    await pair.settled(0)
    say()


def _churn_line(name: str, phase: str, x: dict[str, Any], n: int) -> str:
    msgs = x["requests"] + x["confirms"]
    what = (f"{x['requests']:,} requests + {x['confirms']:,} confirms" if name == "dataspace"
            else f"{x['requests']:,} LS+/LS- lines")
    head = f"    {name:9s} {phase:11s}"
    if x["converged"] is None:
        extra = (f"; U's trie holds {x['peer_wants']:,} of {n:,}, D has {x['pending']:,} pending, "
                 f"{x['retransmissions']:,} retransmissions" if "peer_wants" in x else "")
        issued = "" if phase == "reconnect" else f" (issued in {x['issued']:.1f} s)"
        return (f"{head} NOT converged after {x['waited']:.0f} s{issued}, the bound being "
                f"--churn-timeout; so far {msgs:,} control messages ({what}){extra}")
    since = (f" ({x['from_connect']:.2f} s after the new connection)"
             if phase == "reconnect" else f", issued in {x['issued']:.2f} s")
    return (f"{head} converged after {x['converged']:6.2f} s{since}; {msgs / n:.2f} control "
            f"messages per change ({what}), {x['bytes'] / n:.0f} B per change")


async def section_3(srv: dict[str, Any], args: argparse.Namespace) -> None:
    sizes = [500, 2_000] if args.quick else [1_000, 10_000]
    conns = 10
    say(f"(3) subscription churn: distinct subscriptions <Says \"user-I\" $text> made on D "
          f"({conns} connections), the link cut and re-established (D redials), then every one "
          f"cancelled; each phase until U's producer trie has converged (bounded by "
          f"--churn-timeout {args.churn_timeout:.0f} s); ideal for dataspace: 2 control messages "
          f"per change (a request and its CONFIRM), for NATS 1")
    results = []
    for n in sizes:
        say(f"  {n:,} subscriptions")
        if srv["nats"]:
            r = await nats_churn(srv["hub1"], srv["leaf1"], srv["npx1"], n, conns,
                                 args.churn_timeout)
            for phase, x in r.items():
                say(_churn_line("NATS", phase, x, n))
        ours = await ours_churn(srv["pair1"], srv["px1"], n, conns, args.churn_timeout)
        results.append((n, ours))
        for phase, x in ours.items():
            say(_churn_line("dataspace", phase, x, n))
        for phase, x in ours.items():
            if x["converged"] is not None:
                say(f"    dataspace {phase:11s} links.json: D sent {x['status_requests']:,} "
                      f"requests ({x['retransmissions']:,} retransmitted), U sent "
                      f"{x['u_requests']:,}; seen converged after {x['seen']:.2f} s")
        step(f"churn of {n:,}")
        if any(x["converged"] is None for x in ours.values()):
            say("    (stopping the churn here: the servers are still busy)")
            break
    say()


async def start_servers(srv: dict[str, Any], sections: set[str], nats: bool) -> None:
    s: Servers = srv["all"]
    if sections & {"1", "3"}:
        u1 = s.add(await OurServer("u1").start())
        px = s.add(await Proxy(("127.0.0.1", int(u1.address.rsplit(":", 1)[1])),
                               SyndicateTap).start())
        d1 = s.add(await OurServer("d1", (px.address, u1.cap)).start())
        srv.update(pair1=Pair(u1, d1), px1=px)
        if nats:
            npx = s.add(await Proxy(("127.0.0.1", 0), NatsTap).start())
            hub1 = s.add(await NatsServer("hub1", leaf_listen=True, advertise=npx.address).start())
            npx.target = ("127.0.0.1", hub1.leaf_port)
            leaf1 = s.add(await NatsServer("leaf1", remote=npx.address).start())
            srv.update(hub1=hub1, npx1=npx, leaf1=leaf1)
    if "2" in sections:
        u2 = s.add(await OurServer("u2").start())
        d2 = s.add(await OurServer("d2", (u2.address, u2.cap)).start())
        srv.update(u2=u2, d2=d2, pair2=Pair(u2, d2), alone=s.add(await OurServer("alone").start()))
        if nats:
            hub2 = s.add(await NatsServer("hub2", leaf_listen=True).start())
            leaf2 = s.add(await NatsServer("leaf2", remote=f"127.0.0.1:{hub2.leaf_port}").start())
            srv.update(hub2=hub2, leaf2=leaf2, nalone=s.add(await NatsServer("alone").start()))
    for k in ("pair1", "pair2"):
        if k in srv:
            await srv[k].settled(0, what="the link to come up")
    for k in ("hub1", "hub2"):
        if k in srv:
            await srv[k].until_leaf(lambda n, _c, _s: n == 1, "the NATS leaf node to connect")


async def main(args: argparse.Namespace) -> None:
    sections = set(args.sections.split(","))
    nats = not args.no_nats
    if nats:
        if not os.path.exists(NATS_SERVER):
            raise SystemExit(NATS_HINT)
        try:
            import nats as _nats  # noqa: F401
        except ImportError:
            raise SystemExit(NATS_PY_HINT) from None
    srv: dict[str, Any] = {"all": Servers(), "nats": nats}
    start_steps(("1" in sections) + 2 * ("2" in sections) + 2 * ("3" in sections))
    t0 = time.perf_counter()
    try:
        await start_servers(srv, sections, nats)
        version = ""
        if nats:
            version = subprocess.run([NATS_SERVER, "--version"], capture_output=True,
                                     text=True).stdout.strip()
        say(f"linked brokers benchmark (Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
              + (f"; NATS: {version}, a hub and a leaf node, nats-py client" if nats else "")
              + ")")
        say("U = the upstream server (the publisher's), D = the downstream server linked to U "
              "(the subscribers'); NATS: U = the hub, D = the leaf node")
        say()
        for name, fn in (("1", section_1), ("2", section_2), ("3", section_3)):
            if name in sections:
                await fn(srv, args)
    except NotConverged as e:
        raise SystemExit(f"bench_link: {e}") from None
    finally:
        await srv["all"].close()
        for p in list(_LIVE):  # one that failed to start
            p.stop()
    finish()
    say(f"({time.perf_counter() - t0:.0f} s) command: .venv/bin/python benchmarks/bench_link.py"
          + (" --quick" if args.quick else "") + (" --no-nats" if args.no_nats else "")
          + (f" --sections {args.sections}" if args.sections != "1,2,3" else ""))


def _interrupted(signum: int, _frame: Any) -> None:
    """SIGINT / SIGTERM: stop every server and leave at once (a client library waiting
    in the event loop may swallow the cancellation asyncio.run would send)."""
    print(f"\nbench_link: {signal.Signals(signum).name}: stopping the servers", file=sys.stderr)
    for p in list(_LIVE):
        p.stop()
    os._exit(128 + signum)


if __name__ == "__main__":
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupted)
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    ap.add_argument("--messages", type=int, default=60_000, metavar="N",
                    help="messages per throughput run in section 2 (default 60,000)")
    ap.add_argument("--repeat", type=int, default=5,
                    help="runs per throughput figure (default 3; --quick: 1)")
    ap.add_argument("--no-nats", action="store_true",
                    help="measure our links alone (no nats-server needed)")
    ap.add_argument("--sections", default="1,2,3", metavar="1,2,3",
                    help="which sections to run (default all)")
    ap.add_argument("--churn-timeout", type=float, default=120.0, metavar="SECONDS",
                    help="bound of each wait for a producer trie to converge in (3) (default 120)")
    asyncio.run(main(ap.parse_args()))
