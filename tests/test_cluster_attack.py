"""Attacks on a cluster (issue 29), on loopback with real `dataspace serve` members:

* strangers holding every waiting slot of every cluster port, each reconnecting as soon as
  the member closes it, while a member is killed with SIGKILL and restarted: it has its
  routes back, and its clients are seen cluster-wide, within 15 s;
* a rogue member holding the real secret gossiping 100,000 members that do not exist: a
  probe (a message every 0.25 s from member a to an observer on member c) loses under
  5% with p99 under 1 s, no member exceeds 1,000 descriptors or 300 MB or writes 200 log
  lines, and 15 s after the rogue is gone every member has its routes and the probe's
  p99 is under 100 ms.

The bounds are the issue's, checked here as behaviour (a machine loaded by other tests
stays far within them); the sans-IO bounds of gossip are in test_protocol_cluster.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from broker_support import PY, Changes, async_test
from dataspace.broker.cluster import MAX_STRANGERS, read_secret
from dataspace.client import RemoteDataspace, connect
from dataspace.datadir import KEY_BYTES
from dataspace.protocol.sturdy import SturdyRef
from dataspace.testing.broker_soak import Notifier, RogueProcess, ServerUnderTest, StrangerFlood
from dataspace.testing.common import free_port, write_root_key
from dataspace.values import Record, Symbol, parse

TIMEOUT = 30.0


class Member:
    """A member in a subprocess on a fixed cluster port (kept across restarts), its log
    read all along (its lines counted), with no -v: as a user runs it."""

    def __init__(self, data_dir: Path, secret: Path, root_key: bytes, port: int,
                 routes: list[str]) -> None:
        write_root_key(data_dir, root_key)
        self.data_dir = data_dir
        self.cluster_address = f"127.0.0.1:{port}"
        self.extra = ["--cluster", self.cluster_address, "--cluster-secret", str(secret),
                      *(["--routes", ",".join(routes)] if routes else [])]
        self.proc: ServerUnderTest | None = None
        self.started_lines = 0

    async def start(self) -> Member:
        self.proc = ServerUnderTest(self.data_dir, self.extra, verbose=False)
        await asyncio.to_thread(self.proc.start, TIMEOUT)
        self.started_lines = len(self.proc.lines())
        return self

    @property
    def server(self) -> ServerUnderTest:
        assert self.proc is not None
        return self.proc

    @property
    def address(self) -> str:
        return self.server.address

    def log_lines(self) -> list[str]:
        """What it logged since it started (the start-up lines not counted)."""
        return self.server.lines()[self.started_lines:]

    def routes_up(self) -> set[str]:
        try:
            doc = json.loads((self.data_dir / "cluster.json").read_text())
        except (OSError, ValueError):
            return set()
        if doc.get("pid") != self.server.pid:
            return set()
        return {r["peer_id"] for r in doc.get("routes", []) if r.get("connected")}

    def member_id(self) -> str:
        return (self.data_dir / "server.id").read_text().strip()

    async def kill9(self) -> None:
        p = self.server.proc
        assert p is not None
        p.send_signal(signal.SIGKILL)
        await asyncio.to_thread(p.wait, TIMEOUT)

    async def stop(self) -> None:
        if self.proc is not None:
            await asyncio.to_thread(self.proc.stop, TIMEOUT)


@contextlib.asynccontextmanager
async def three_members(tmp_path: Path, secret: Path) -> AsyncIterator[list[Member]]:
    """a, b and c as docs/cluster.md sets them up (b and c dial a)."""
    root_key = os.urandom(KEY_BYTES)
    ports = [free_port() for _ in range(3)]
    a = f"127.0.0.1:{ports[0]}"
    ms = [Member(tmp_path / x, secret, root_key, p, [] if x == "a" else [a])
          for x, p in zip("abc", ports)]
    try:
        await asyncio.gather(*(m.start() for m in ms))
        yield ms
    finally:
        await asyncio.gather(*(m.stop() for m in ms), return_exceptions=True)


async def until(pred: Any, timeout: float, every: float = 0.2) -> bool:
    """Whether ``pred()`` holds within ``timeout`` s (re-checked every ``every`` s: the
    members are other processes, whose status files are what there is to wait on)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            return bool(pred())
        await asyncio.sleep(every)
    return True


async def meshed(ms: list[Member], timeout: float) -> bool:
    ids = {m.member_id() for m in ms}
    return await until(lambda: all(m.routes_up() == ids - {m.member_id()} for m in ms),
                       timeout)


# ---------------------------------------------------------------------------------------
# 1. Strangers holding the cluster ports while a member restarts


@async_test
async def test_a_restarted_member_rejoins_while_strangers_hold_every_cluster_port(
        tmp_path, secret):
    async with three_members(tmp_path, secret) as ms:
        a, b, c = ms
        assert await meshed(ms, TIMEOUT)
        cap = SturdyRef.parse(a.server.sturdyref)
        watchers: list[RemoteDataspace] = []
        seen: list[Changes] = []
        for m in (a, c):
            ds = await connect(m.address, cap)
            ch = Changes()
            ds.observe("<Present $who>", **ch.kw())
            await ds.sync()
            watchers.append(ds)
            seen.append(ch)
        # More strangers than a port holds, on every port, reconnecting at once.
        flood = StrangerFlood([m.cluster_address for m in ms], per_port=MAX_STRANGERS + 16)
        flood.start()
        try:
            assert await flood.notifier.until(
                lambda: flood.opened >= 3 * flood.per_port, TIMEOUT), flood.summary()
            await b.kill9()
            await b.start()
            t0 = time.monotonic()
            client = await connect(b.address, cap)
            client.assert_(parse('<Present "after the restart">'))
            for ch in seen:
                await ch.until(lambda c: ("after the restart",) in c.present, 15.0)
            took = time.monotonic() - t0
            assert took <= 15.0, took
            assert await until(lambda: len(b.routes_up()) == 2, 15.0 - took), b.routes_up()
            assert flood.closed_by_server > 0 and flood.open_now > 0, flood.summary()
            await client.close()
        finally:
            await flood.stop()
            for ds in watchers:
                await ds.close()


# ---------------------------------------------------------------------------------------
# 2. A rogue member's gossip


class Probe:
    """A message every 0.25 s from a client of member a to an observer on member c: what
    arrives, and how late."""

    def __init__(self, sender: RemoteDataspace, observer: RemoteDataspace) -> None:
        self.sender = sender
        self.sent: dict[int, float] = {}
        self.latency: dict[int, float] = {}
        self.notifier = Notifier()
        observer.observe("<Probe $n>", on_message=self._got)
        self._task: asyncio.Task[None] | None = None
        self._n = 0

    def _got(self, n: Any) -> None:
        if n in self.sent and n not in self.latency:
            self.latency[n] = time.monotonic() - self.sent[n]
            self.notifier.notify()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            self._n += 1
            self.sent[self._n] = time.monotonic()
            self.sender.send(Record(Symbol("Probe"), [self._n]))
            await asyncio.sleep(0.25)  # (pacing, not waiting for anything)

    def mark(self) -> int:
        return self._n

    async def window(self, first: int, last: int) -> tuple[float, float]:
        """Loss (a fraction) and p99 latency (seconds) of probes ``first..last``, once
        each has arrived or had 5 s to."""
        await self.notifier.until(lambda: all(
            n in self.latency or time.monotonic() - self.sent[n] > 5.0
            for n in range(first, last + 1)), 10.0)
        ns = range(first, last + 1)
        got = sorted(self.latency[n] for n in ns if n in self.latency)
        lost = len(ns) - len(got)
        p99 = got[min(len(got) - 1, int(0.99 * len(got)))] if got else float("inf")
        return lost / len(ns), p99

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@async_test
async def test_a_rogue_members_gossip_does_not_take_the_cluster_down(tmp_path, secret):
    async with three_members(tmp_path, secret) as ms:
        a, _b, c = ms
        assert await meshed(ms, TIMEOUT)
        cap = SturdyRef.parse(a.server.sturdyref)
        sender, observer = await connect(a.address, cap), await connect(c.address, cap)
        probe = Probe(sender, observer)
        await observer.sync()
        probe.start()
        # (In a process of its own: what it encodes does not stall this one's probe.)
        rogue = RogueProcess([m.cluster_address for m in ms], read_secret(secret))
        descriptors = {m.cluster_address: 0 for m in ms}
        try:
            first = probe.mark() + 1
            summary = await asyncio.to_thread(rogue.start)
            assert summary["routes"] == 3 and summary["gossip_messages"] == 300, summary
            t0 = time.monotonic()
            # 10 s of its presence after its gossip: sample the members.
            while time.monotonic() - t0 < 10.0:
                for m in ms:
                    descriptors[m.cluster_address] = max(descriptors[m.cluster_address],
                                                         m.server.descriptors())
                await asyncio.sleep(0.5)  # (sampling)
            loss, p99 = await probe.window(first, probe.mark())
            assert loss < 0.05 and p99 < 1.0, (loss, p99)
            await asyncio.to_thread(rogue.stop)
            gone = time.monotonic()
            # 15 s after the rogue is gone, every member has its routes.
            assert await meshed(ms, 15.0), [m.routes_up() for m in ms]
            assert time.monotonic() - gone <= 15.0
            first = probe.mark() + 1
            await asyncio.sleep(3.0)  # (three seconds of probes)
            loss, p99 = await probe.window(first, probe.mark())
            assert loss == 0 and p99 < 0.1, (loss, p99)
            for m in ms:
                assert descriptors[m.cluster_address] <= 1_000, descriptors
                mem = m.server.memory_kib()
                assert mem is not None and mem[1] <= 300 << 10, mem  # VmHWM
                lines = m.log_lines()
                assert len(lines) < 200, (len(lines), lines[:20], lines[-20:])
                doc = json.loads((m.data_dir / "cluster.json").read_text())
                assert doc["members_ignored"] > 0 and len(doc["members"]) <= 64 + 2, \
                    (doc["members_ignored"], len(doc["members"]))
            # What an operator sees.
            r = await asyncio.to_thread(subprocess.run, [
                PY, "-m", "dataspace.cli", "cluster", "status", "--data-dir", str(a.data_dir)],
                capture_output=True, text=True, timeout=TIMEOUT)
            assert r.returncode == 0, r.stdout + r.stderr
            # (the made-up members it keeps are listed, down, until forgotten after 30 s)
            assert re.search(r"; 3 of (\d+) members up", r.stdout), r.stdout[:300]
            assert "members named by gossip past the table (64): " in r.stdout, r.stdout[-300:]
        finally:
            await probe.stop()
            await asyncio.to_thread(rogue.stop)
            for ds in (sender, observer):
                await ds.close()
