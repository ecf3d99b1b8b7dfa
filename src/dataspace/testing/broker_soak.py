"""A soak of the broker: a real ``dataspace serve`` under a mix of good and bad peers.

``python -m dataspace.testing.broker_soak --seconds 600`` (``make soak-broker``) starts a
server in a subprocess (on a free loopback port, in a temporary data directory) and, for
the set time, runs at once, each on its own schedule:

* **well-behaved clients** (:func:`dataspace.client.connect`): each holds
  ``<Present NAME>`` and a ``<Status NAME K>`` it replaces now and then, and sends
  ``<Says NAME SEQ>`` messages; every client checks that it sees every other client's
  presence, the latest status, and every message in order, within a bound;
* a **round-trip probe** on its own thread and event loop: ``await ds.sync()`` every
  50 ms with a 5 s timeout (latencies and failures are recorded);
* the **attacks** the server defends against, each from its own loopback source address:
  thousands of catch-all observers one per packet (``catch-all-observers``), the same
  batched in one turn (``big-turn``), a connection making work for its own catch-all
  observers (``work-loop``), connections from one address up to the per-address limit,
  then idling (``per-address``), a tight reconnect loop (``reconnect-loop``), a client
  with an observe-only capability sending and asserting to the observer references it
  learns (``observe-only-cap``), and 40 connections from 10 addresses asserting 2 KB
  values as fast as the server takes them (``memory``: refused once the server's memory
  budget is full, ``--max-memory 64M`` here; the server's RSS must grow by less than
  :data:`PEAK_ALLOWANCE` times it over the whole run, and be back within
  :data:`SETTLE_MIB` of its start once the attacks have ended);
* **malformed input** on fresh connections: random bytes, mutated packets, truncated
  packets, oversized declared lengths, deep nesting, valid packets with wrong events;
* **kill -9 of clients**: ``dataspace assert '<Victim NAME>'`` subprocesses killed with
  SIGKILL at random; an observer checks that their assertions are retracted in time;
* **the cluster port** (issue 29): the server is a cluster member with a second member
  (a subprocess); strangers hold more than every waiting slot of both cluster ports,
  reconnecting as soon as they are closed (``cluster-port``), while the second member is
  killed with SIGKILL and restarted again and again: each time a client of it must be
  seen on the server within 15 s; and a **rogue member** holding the secret gossips
  100,000 members that do not exist (``rogue-member``): the server keeps its table
  bounded and its route to the second member;
* **TLS** (issue 29): a third server, with a certificate and an HTTPS port, under 200
  connections that never start a TLS handshake, 100 that finish it and send nothing and
  200 idle HTTPS ones (``tls``): the idle HTTPS ones must be closed within 35 s, and its
  RSS must be back within 40 MB of where it was within 30 s of each attack's end.

At the end it prints the probe's count, p50/p99 and failures, the checks that failed,
the server's peak RSS, the attacks' outcomes by kind (the detail of the server's
``<error ...>`` packet), the fuzz cases, the kills, and every line of the server's log at
level ERROR or CRITICAL or holding a traceback.  The exit status is 0 only when no probe
failed, no check failed (its RSS back near its start after the attacks is one), the
server still answered at the end, logged no error, its peak RSS grew by less than
:data:`PEAK_ALLOWANCE` times its memory budget, and it exited with status 0 on SIGTERM.

Everything is bounded in count and time; checks wait on events with timeouts (delays are
used only to pace actions).  Randomness is seeded (``--seed``; the seed is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..broker.config import ConfigError, parse_size
from ..cli._voice import plural
from ..client import RemoteDataspace, _SyncPeer, connect
from ..dataspace import Entity
from ..pattern import parse_pattern, to_preserves
from ..progress import Progress
from ..protocol.relay import Relay, RelayLimits, RemoteEntity
from ..protocol.sturdy import SturdyRef, attenuate
from ..protocol.wire import WireRef
from ..values import (
    DecodeError,
    Decoder,
    Embedded,
    Record,
    Sequence,
    Symbol,
    Value,
    decode_prefix,
    encode,
    parse,
    stringify,
)
from .common import free_port, write_secret

__all__ = [
    "ATTACKS",
    "MemoryHog",
    "PARTS",
    "SERVER_LIMITS",
    "RawConnection",
    "RogueMember",
    "RogueProcess",
    "StrangerFlood",
    "TLSFlood",
    "SoakConfig",
    "SoakResult",
    "ServerUnderTest",
    "main",
    "memory_attack",
    "run",
]

log = logging.getLogger(__name__)

PY = sys.executable
MIB = 1 << 20

# Limits the soak's server runs with (on top of the defaults): tighter than the defaults
# where an attack would otherwise take minutes to reach the limit, so that each attack
# is stopped within seconds and repeats many times in a run.
SERVER_LIMITS: dict[str, float] = {
    "max-matches": 50_000,
    "max-turn-events": 20_000,
    "work-rate": 5_000,
    "throttle-limit": 1.0,
    "max-connections-per-address": 64,
    "connect-rate": 20.0,
    "idle-timeout": 5.0,
    "handshake-timeout": 5.0,
    "max-memory": 64 << 20,
}

PEAK_ALLOWANCE = 1.25
"""The server's RSS may grow, at its peak, by its memory budget times this.  The budget
counts what clients make the server hold, and beyond what it refuses (assertions) what it
cannot refuse: each connection's buffers, the strangers on the cluster port (32 KiB each,
256 at once: 8 MiB), output on its way; so what it counted reached 74 MiB of a 64 MiB
budget at the memory attack's peak here, with the RSS 57-67 MiB above its start (the check
at 1.0 failed one run in three, a flake once the cluster port's attackers were added).
What a leak keeps is caught by :data:`SETTLE_MIB` (tests/test_soak_broker.py: a server
that keeps 256 KiB for each closed connection fails it)."""

SETTLE_MIB = 20.0
"""Once the attacks have ended, the server's RSS must come back to within this many MiB
of where it started (what the well-behaved clients and the cluster's member hold, and the
allocator's fragments: 7.4 MiB, 4 s after the attacks, in a run watched for the whole
time), within :data:`SETTLE_SECONDS`: memory that attackers made it hold and it never gave
back is a leak."""

SETTLE_SECONDS = 20.0
"""How long the server has to give memory back after the attacks (it does at most every
10 s, after connections close)."""

ATTACKS = (
    "catch-all-observers",
    "big-turn",
    "work-loop",
    "per-address",
    "reconnect-loop",
    "observe-only-cap",
    "memory",
)
CLUSTER_PARTS = ("cluster-port", "rogue-member")
PARTS = (*ATTACKS, *CLUSTER_PARTS, "tls", "fuzz", "kills")
"""What runs besides the well-behaved clients and the probe (``--only`` picks some)."""

# Loopback source addresses: the well-behaved clients, the probe and the victims use
# 127.0.0.1; each attack has its own, and the fuzzers share a few, so that the
# per-address limits an attack reaches never refuse a well-behaved client.
_ATTACK_SOURCE = {
    "per-address": "127.0.0.2",
    "reconnect-loop": "127.0.0.3",
    "catch-all-observers": "127.0.0.4",
    "big-turn": "127.0.0.5",
    "work-loop": "127.0.0.6",
    "observe-only-cap": "127.0.0.7",
    "cluster-port": "127.0.0.8",
    "tls": "127.0.0.9",
}
_FUZZ_SOURCES = tuple(f"127.0.1.{i}" for i in range(1, 9))

OBSERVE = Symbol("Observe")
PRESENT = Symbol("Present")
STATUS = Symbol("Status")
SAYS = Symbol("Says")
VICTIM = Symbol("Victim")
RESOLVE = Symbol("resolve")
ACCEPTED = Symbol("accepted")
ERROR = Symbol("error")
POISON = "mallory"

_CATCH_ALL = to_preserves(parse_pattern("$x"))
_OBSERVE_ANY = to_preserves(parse_pattern("<Observe $p $o>"))
_OBSERVE_ONLY = parse("<rewrite <bind <rec Observe [<_> <_>]>> <ref 0>>")
_ERROR_MARK = b"\xb4\xb3\x05error"
_LOG_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
_LOG_ERROR = re.compile(r"^\S+ \S+ (ERROR|CRITICAL) ")


# ---------------------------------------------------------------------------------------
# Configuration and results


@dataclass
class SoakConfig:
    """What to run, and for how long."""

    seconds: float = 600.0
    clients: int = 4
    seed: int | None = None
    quiet: bool = False
    probe_interval: float = 0.05
    probe_timeout: float = 5.0
    check_timeout: float = 10.0
    progress_every: float = 10.0
    fuzz_workers: int = 4
    victims: int = 2
    server_args: list[str] = field(default_factory=list)
    limits: dict[str, float] = field(default_factory=lambda: dict(SERVER_LIMITS))
    log_path: str | None = None
    json_path: str | None = None
    only: list[str] = field(default_factory=list)  # parts to run (default: all of PARTS)


@dataclass
class AttackStats:
    runs: int = 0
    stopped: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)


class Tally:
    """Everything the soak counts and the checks that failed."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.failures: list[str] = []
        self.checks = 0
        self.poison_seen = 0
        self.chat_sent = 0
        self.chat_received = 0
        self.status_changes = 0
        self.attacks: dict[str, AttackStats] = {name: AttackStats() for name in ATTACKS}
        self.fuzz_cases = 0
        self.fuzz_generators: Counter[str] = Counter()
        self.fuzz_outcomes: Counter[str] = Counter()
        self.kills = 0
        self.early_kills = 0
        self.kill_latencies: list[float] = []
        self.rss_kib: list[int] = []
        self.hwm_kib = 0
        self.settled_kib: int | None = None  # the RSS once the attacks ended (and after)
        self.settle_s = 0.0
        self.rejoins: list[float] = []  # seconds for a restarted member to be seen again
        self.stranger_flood: dict[str, int] = {}
        self.rogue_runs: list[dict[str, Any]] = []
        self.tls_runs: list[dict[str, float]] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def fail(self, message: str) -> None:
        text = f"[{self.elapsed():6.1f}s] {message}"
        self.failures.append(text)
        log.warning("check failed: %s", message)

    def check(self, ok: bool, message: str) -> bool:
        if ok:
            self.checks += 1
        else:
            self.fail(message)
        return ok


@dataclass
class SoakResult:
    """The figures of a run (``summary()`` is what the JSON file holds)."""

    ok: bool
    reason: str
    summary: dict[str, Any]


# ---------------------------------------------------------------------------------------
# Waiting without sleeping


class Notifier:
    """Wakes every waiter when something changed; waiters re-check their condition."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def until(self, pred: Callable[[], bool], timeout: float) -> bool:
        """True once ``pred()`` holds; False if it does not within ``timeout`` seconds."""

        async def loop() -> None:
            while not pred():
                await self._event.wait()

        try:
            await asyncio.wait_for(loop(), timeout)
        except TimeoutError:
            return pred()
        return True


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    """A pacing delay between actions that ends early when ``stop`` is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), max(0.0, seconds))


# ---------------------------------------------------------------------------------------
# The server in a subprocess


class ServerUnderTest:
    """``dataspace serve`` in a subprocess; its log is read continuously by a thread."""

    def __init__(self, data_dir: Path, extra_args: Iterable[str] = (), *,
                 verbose: bool = True) -> None:
        self.data_dir = data_dir
        self.args = [PY, "-m", "dataspace.cli", "serve", "--tcp", "127.0.0.1:0",
                     "--data-dir", str(data_dir), *(["-v"] if verbose else []), *extra_args]
        self.proc: subprocess.Popen[bytes] | None = None
        self.sturdyref = ""
        self.port = 0
        self.log: list[str] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._readers: list[threading.Thread] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def start(self, timeout: float = 30.0) -> None:
        """Start the server (again, after it stopped); returns once it prints its
        sturdyref and port."""
        for t in self._readers:  # (a previous run's: they end with its output)
            t.join(10.0)
        self._readers.clear()
        with self._lock:
            self._ready.clear()
            self.sturdyref = ""
            self.port = 0
        self.proc = subprocess.Popen(
            self.args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for stream, name in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr")):
            t = threading.Thread(target=self._read, args=(stream, name),
                                 name=f"soak-server-{name}", daemon=True)
            t.start()
            self._readers.append(t)
        if not self._ready.wait(timeout) or not self.sturdyref or not self.port:
            tail = "\n".join(self.lines()[-20:])
            self.kill()
            raise RuntimeError(f"the server did not start within {timeout:g} s; its log:\n{tail}")

    def _read(self, stream: Any, name: str) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._lock:
                if name == "stdout" and line.startswith("sturdyref: "):
                    self.sturdyref = line[len("sturdyref: "):].strip()
                else:
                    self.log.append(line)
                m = re.search(r"listening on (?:tls://)?127\.0\.0\.1:(\d+)", line)
                if m and not self.port:
                    self.port = int(m.group(1))
                if self.sturdyref and self.port:
                    self._ready.set()
        stream.close()
        if name == "stderr":
            self._ready.set()  # the server ended: start() stops waiting

    def lines(self) -> list[str]:
        with self._lock:
            return list(self.log)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def descriptors(self) -> int:
        """The server's open file descriptors now (0 once it is gone)."""
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except OSError:
            return 0

    def memory_kib(self) -> tuple[int, int] | None:
        """``(VmRSS, VmHWM)`` of the server in KiB, or None once it is gone."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])
        except (OSError, KeyError, ValueError):
            return None

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then wait; None if it had to be killed (it did not stop in time)."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is not None:
            code: int | None = p.returncode
        else:
            p.send_signal(signal.SIGTERM)
            try:
                code = p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                code = None
        for t in self._readers:
            t.join(5.0)
        return code

    def kill(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10.0)

    def error_lines(self) -> list[str]:
        """Log lines at level ERROR or CRITICAL, or holding a traceback, each with the
        lines that continue it (a traceback's frames)."""
        out: list[str] = []
        lines = self.lines()
        i = 0
        while i < len(lines):
            line = lines[i]
            if _LOG_ERROR.match(line) or "Traceback" in line or "Exception in callback" in line:
                out.append(line)
                j = i + 1
                while j < len(lines) and j - i <= 60 and not _LOG_START.match(lines[j]):
                    out.append("    " + lines[j])
                    j += 1
                i = j
            else:
                i += 1
        return out


# ---------------------------------------------------------------------------------------
# A raw protocol client


@dataclass
class Outcome:
    """How a connection ended: ``kind`` is the detail of the server's ``<error ...>``
    (``connect-rate``, ``turn-too-large`` ...), or ``closed`` (no error packet),
    ``reset``, or ``open`` (still open when we stopped waiting)."""

    kind: str
    message: str = ""

    @property
    def by_server(self) -> bool:
        """The server ended the connection."""
        return self.kind != "open"

    @property
    def error(self) -> bool:
        return self.kind not in ("open", "closed", "reset")


class Refused(Exception):
    """The server refused or closed a connection while it resolved its capability."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(f"{outcome.kind}: {outcome.message}")
        self.outcome = outcome


def error_kind(message: str, detail: Value) -> str:
    """A short name for an ``<error message detail>``: the detail when it is a symbol
    (``too-many-matches``) or a short string, else the message's first words."""
    if type(detail) is Symbol:
        return detail.name
    if type(detail) is str and 0 < len(detail) <= 40:
        return detail.replace(" ", "-")
    head = message.split(":", 1)[0]
    head = re.sub(r"-?\d+", "N", head)
    return "-".join(head.split()[:4])[:40] or "error"


class _Answer(Entity):
    def __init__(self, notify: Callable[[], None]) -> None:
        self.value: Value = None
        self._notify = notify

    def on_assert(self, value: Value, handle: int) -> None:
        self.value = value
        self._notify()


class RawConnection:
    """A TCP connection driven by hand: a sans-IO :class:`Relay` for resolving a
    capability (and, for some attacks, for talking through references), raw bytes for
    everything else.  Reading raw keeps only the tail of the input, to find the server's
    final ``<error ...>`` packet."""

    TAIL = 2 << 20

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 name: str = "raw") -> None:
        self.reader = reader
        self.writer = writer
        self.notifier = Notifier()
        self.relay = Relay(limits=RelayLimits(strict=False, max_packet_size=64 << 20),
                           name=name)
        self._tail = bytearray()
        self.bytes_in = 0
        self.eof = False
        self.reset = False

    @classmethod
    async def open(cls, address: str, source: str | None = None,
                   timeout: float = 10.0) -> RawConnection:
        """Connect to ``HOST:PORT`` (from the loopback ``source`` address if given)."""
        host, port = address.rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if source is not None:
                sock.bind((source, 0))
            sock.setblocking(False)
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_connect(sock, (host, int(port))), timeout)
            reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
        except BaseException:
            sock.close()
            raise
        return cls(reader, writer, name=f"{source or 'raw'}->{address}")

    def write(self, data: bytes) -> None:
        if data and not self.writer.is_closing():
            self.writer.write(data)

    async def send(self, data: bytes) -> bool:
        """Write and wait for the socket to take it; False once the connection is gone."""
        try:
            self.write(data)
            await self.writer.drain()
            return True
        except (ConnectionError, OSError):
            return False

    def flush_relay(self) -> None:
        self.write(self.relay.data_to_send())

    async def _read_chunk(self) -> bytes:
        try:
            data = await self.reader.read(1 << 16)
        except (ConnectionResetError, BrokenPipeError):
            self.reset = True
            data = b""
        if not data:
            self.eof = True
        return data

    async def resolve(self, cap: SturdyRef, timeout: float = 10.0) -> RemoteEntity:
        """Resolve ``cap`` at the server's gatekeeper; the dataspace reference.  Raises
        :class:`Refused` when the server refuses the connection or the capability."""
        answer = _Answer(self.notifier.notify)
        gk = self.relay.import_ref(0)
        # Handle 1 is the resolve's; raw events use handles from 2 up.
        gk.on_assert(Record(RESOLVE, [cap.to_value(), Embedded(answer)]), 1)
        self.flush_relay()

        async def loop() -> None:
            while answer.value is None and self.relay.peer_error is None:
                data = await self._read_chunk()
                if not data:
                    return
                self.relay.receive_data(data)
                self.flush_relay()

        try:
            await asyncio.wait_for(loop(), timeout)
        except TimeoutError:
            raise Refused(Outcome("open", "no answer to resolve")) from None
        v = answer.value
        if isinstance(v, Record) and v.label == ACCEPTED and v.fields:
            ref = v.fields[0].value
            assert isinstance(ref, RemoteEntity)
            return ref
        if self.relay.peer_error is None and not self.eof:
            with contextlib.suppress(TimeoutError):  # (the server closes it, with a reason)
                await asyncio.wait_for(self.pump(), timeout)
        raise Refused(self._relay_outcome())

    def _relay_outcome(self) -> Outcome:
        err = self.relay.peer_error
        if err is not None:
            return Outcome(error_kind(*err), err[0])
        if self.reset:
            return Outcome("reset")
        return Outcome("closed" if self.eof else "open")

    async def pump(self) -> Outcome:
        """Feed the relay until the connection closes (run as a task)."""
        while not self.eof:
            data = await self._read_chunk()
            if data:
                self.relay.receive_data(data)
                self.flush_relay()
            self.notifier.notify()
        return self._relay_outcome()

    async def read_until_closed(self, timeout: float) -> Outcome:
        """Read raw (keeping up, so the server never sees a slow consumer) until the
        server closes the connection or ``timeout`` passes."""

        async def loop() -> None:
            while True:
                data = await self._read_chunk()
                if not data:
                    return
                self.bytes_in += len(data)
                tail = self._tail
                tail += data
                if len(tail) > 2 * self.TAIL:
                    del tail[: len(tail) - self.TAIL]

        try:
            await asyncio.wait_for(loop(), timeout)
        except TimeoutError:
            return Outcome("open")
        found = _last_error(bytes(self._tail))
        if found is not None:
            return Outcome(error_kind(*found), found[0])
        return Outcome("reset" if self.reset else "closed")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


def _last_error(data: bytes) -> tuple[str, Value] | None:
    """The ``<error message detail>`` packet that ends ``data``, if it does."""
    end = len(data)
    tries = 0
    while tries < 32:
        i = data.rfind(_ERROR_MARK, 0, end)
        if i < 0:
            return None
        try:
            v, stop = decode_prefix(data, i)
        except (DecodeError, ValueError, RecursionError):
            v, stop = None, -1
        if (stop == len(data) and isinstance(v, Record) and v.label == ERROR
                and len(v.fields) == 2 and type(v.fields[0]) is str):
            return v.fields[0], v.fields[1]
        end = i
        tries += 1
    return None


def _refs_out(w: Any) -> Value:
    return w.to_value()


def _turn(events: list[Value]) -> bytes:
    return encode(Sequence(events), embedded=_refs_out)


def _assert_event(oid: int, value: Value, handle: int) -> Value:
    return Sequence([oid, Record(Symbol("A"), [value, handle])])


def _observe_event(oid: int, handle: int, observer_oid: int, pattern: Value = _CATCH_ALL) -> Value:
    return _assert_event(oid, Record(OBSERVE, [pattern, Embedded(WireRef(True, observer_oid))]),
                         handle)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _poisoned(v: Any) -> bool:
    """True when ``v`` holds a value an attacker planted (a string starting with
    ``mallory``)."""
    if type(v) is str:
        return v.startswith(POISON)
    if isinstance(v, tuple | list):
        return any(_poisoned(x) for x in v)
    if isinstance(v, Record):
        return _poisoned(v.fields)
    return False


# ---------------------------------------------------------------------------------------
# The memory attack (issue 21): many connections from several addresses, each within its
# own limits, asserting large values as fast as the server takes them

MEMORY_SOURCES = tuple(f"127.0.2.{i}" for i in range(1, 11))
"""The loopback addresses the memory attack's connections come from (10)."""
HOG = Symbol("MemoryHog")
_REFUSED = Symbol("refused")


# ---------------------------------------------------------------------------------------
# Attacks on a cluster's ports and on TLS (issue 29)


async def _hold_until_closed(conn: RawConnection, stop: asyncio.Event) -> bool:
    """Read (and drop) what the server sends until it closes ``conn`` (True) or ``stop``
    is set (False)."""
    closed = asyncio.ensure_future(conn.read_until_closed(3600.0))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({closed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (closed, stopped):
            t.cancel()
    return closed.done() and not closed.cancelled()


class StrangerFlood:
    """Strangers on cluster ports: ``per_port`` idle connections on each of
    ``addresses``, each opened again as soon as the server closes it (the attack that
    kept a restarted member out of its cluster while the port had 16 waiting slots).
    ``source``: the loopback address to connect from (default: the system's choice)."""

    def __init__(self, addresses: Iterable[str], per_port: int = 16,
                 source: str | None = None) -> None:
        self.addresses = list(addresses)
        self.per_port = per_port
        self.source = source
        self.opened = 0
        self.closed_by_server = 0
        self.not_listening = 0
        self.open_now = 0
        self.notifier = Notifier()
        """Notified as connections open and close."""
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for a in self.addresses:
            for _ in range(self.per_port):
                self._tasks.append(asyncio.ensure_future(self._hold(a)))

    async def _hold(self, address: str) -> None:
        stop = self._stop
        while not stop.is_set():
            try:
                conn = await RawConnection.open(address, self.source, timeout=5.0)
            except (OSError, TimeoutError):
                self.not_listening += 1  # (a member down: knock again soon)
                await _pause(stop, 0.2)
                continue
            self.opened += 1
            self.open_now += 1
            self.notifier.notify()
            try:
                if await _hold_until_closed(conn, stop):
                    self.closed_by_server += 1
            finally:
                self.open_now -= 1
                self.notifier.notify()
                conn.close()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def summary(self) -> dict[str, int]:
        return {"opened": self.opened, "closed_by_server": self.closed_by_server,
                "not_listening": self.not_listening}


class _RouteControl(Entity):
    """The rogue's control entity: keeps the member's answer, ignores the rest."""

    def __init__(self, notify: Callable[[], None]) -> None:
        self.answer: Value = None
        self._notify = notify

    def on_message(self, value: Value) -> None:
        if self.answer is None:
            self.answer = value
            self._notify()


class RogueMember:
    """A member holding the cluster's real secret that gossips members that do not
    exist: on a route to each of ``addresses`` it sends ``messages`` ``<route-members>``
    of ``batch`` made-up members each (ids sorted above every real one, so the members
    dial them at once), then pings each route every second until stopped.  The made-up
    members' addresses are ``fake_address(i)`` (default: loopback addresses where
    nothing listens, refused at once), except the first ``holes`` at black holes it
    keeps (listeners that accept and never answer: a dial waits there until it times
    out)."""

    def __init__(self, addresses: Iterable[str], secret: bytes, cluster: str = "dataspace",
                 *, messages: int = 100, batch: int = 1_000, holes: int = 32,
                 fake_address: Callable[[int], str] | None = None) -> None:
        self.addresses = list(addresses)
        self.secret = secret
        self.cluster = cluster
        self.messages = messages
        self.batch = batch
        self.holes = holes
        self.fake_address = fake_address or self._refused_address
        self.id = "ffff" + os.urandom(6).hex()
        self.routes = 0
        self.sent = 0
        self.closed_by_server = 0
        self.errors: list[str] = []
        self._hole_addresses: list[str] = []
        self._hole_servers: list[asyncio.Server] = []
        self._held: list[asyncio.StreamWriter] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._done = 0
        self.sent_all = asyncio.Event()
        """Set once every route has had its gossip (or ended)."""

    @staticmethod
    def _refused_address(i: int) -> str:
        return f"127.{100 + i // 62_500 % 100}.{i // 250 % 250}.{1 + i % 250}:9"

    async def start(self) -> None:
        for k in range(self.holes):
            srv = await asyncio.start_server(self._swallow, f"127.0.99.{1 + k % 250}", 0)
            self._hole_servers.append(srv)
            self._hole_addresses.append(f"127.0.99.{1 + k % 250}:"
                                        f"{srv.sockets[0].getsockname()[1]}")
        for a in self.addresses:
            self._tasks.append(asyncio.ensure_future(self._route(a)))
        if not self.addresses:
            self.sent_all.set()

    def _gossiped(self) -> None:
        self._done += 1
        if self._done >= len(self.addresses):
            self.sent_all.set()

    async def _swallow(self, _r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self._held.append(w)  # (held open, never answered, until the rogue stops)

    def _fake(self, i: int) -> tuple[str, str]:
        address = (self._hole_addresses[i] if i < len(self._hole_addresses)
                   else self.fake_address(i))
        return f"ffffffff{i:08x}", address

    async def _route(self, address: str) -> None:
        from ..protocol.cluster import (
            ROUTE_ACCEPT,
            ROUTE_REQUEST,
            RouteInfo,
            members_message,
            route_key,
            route_oid,
        )
        from ..protocol.sturdy import mint

        stop = self._stop
        try:
            conn = await RawConnection.open(address, timeout=10.0)
        except (OSError, TimeoutError) as e:
            self.errors.append(f"{address}: {e}")
            self._gossiped()
            return
        pump: asyncio.Task[Outcome] | None = None
        told = False
        try:
            cap = mint(route_oid(self.cluster), route_key(self.secret, self.cluster))
            ref = await conn.resolve(cap)
            ctl, data = _RouteControl(conn.notifier.notify), Entity()
            info = RouteInfo(self.cluster, self.id, "", (time.time(), os.urandom(8).hex()),
                             self.id, os.urandom(8).hex())
            ref.on_assert(Record(ROUTE_REQUEST, [info.to_value(), Embedded(ctl),
                                                 Embedded(data)]), 2)
            conn.flush_relay()
            pump = asyncio.ensure_future(conn.pump())
            if not await conn.notifier.until(lambda: ctl.answer is not None or conn.eof, 10.0):
                raise Refused(Outcome("open", "no answer to the route request"))
            v = ctl.answer
            if not (isinstance(v, Record) and v.label == ROUTE_ACCEPT and len(v.fields) == 3):
                raise Refused(Outcome("refused", stringify(v)[:200]))
            peer = v.fields[1].value
            self.routes += 1
            for k in range(self.messages):
                if stop.is_set() or conn.eof:
                    break
                base = k * self.batch
                peer.on_message(members_message(
                    [self._fake(base + i) for i in range(self.batch)]))
                if not await conn.send(conn.relay.data_to_send()):
                    break
                self.sent += 1
            told = True
            self._gossiped()
            while not stop.is_set() and not conn.eof:
                peer.on_message(Record(Symbol("route-ping"), []))
                conn.flush_relay()
                await _pause(stop, 1.0)
            if conn.eof:
                self.closed_by_server += 1
        except Refused as e:
            self.errors.append(f"{address}: {e}")
        finally:
            if not told:
                self._gossiped()
            if pump is not None:
                pump.cancel()
            conn.close()

    async def stop(self) -> None:
        """The rogue is gone: its routes close (its black holes too)."""
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for w in self._held:
            w.transport.abort()
        self._held.clear()
        for srv in self._hole_servers:
            srv.close()
        self._hole_servers.clear()

    def summary(self) -> dict[str, Any]:
        return {"routes": self.routes, "gossip_messages": self.sent,
                "closed_by_server": self.closed_by_server, "errors": self.errors[:5]}


class RogueProcess:
    """A :class:`RogueMember` in a process of its own (what it encodes does not stall
    the caller's event loop): :meth:`start` returns once its gossip is sent, :meth:`stop`
    once it is gone; :attr:`summary` is its :meth:`RogueMember.summary`."""

    def __init__(self, addresses: Iterable[str], secret: bytes, cluster: str = "dataspace",
                 **settings: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._out = ctx.Queue()
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_rogue_process, name="soak-rogue", daemon=True,
                                 args=(list(addresses), secret, cluster, settings,
                                       self._out, self._stop))
        self.summary: dict[str, Any] = {}

    def start(self, timeout: float = 60.0) -> dict[str, Any]:
        """Start it; returns when its gossip is sent (its summary then)."""
        self._proc.start()
        self.summary = self._out.get(timeout=timeout)
        return self.summary

    def stop(self, timeout: float = 30.0) -> dict[str, Any]:
        if self._proc.is_alive():
            self._stop.set()
            with contextlib.suppress(Exception):
                self.summary = self._out.get(timeout=timeout)
            self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)
        return self.summary


def _rogue_process(addresses: list[str], secret: bytes, cluster: str,
                   settings: dict[str, Any], out: Any, stop: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle

    async def main() -> None:
        rogue = RogueMember(addresses, secret, cluster, **settings)
        await rogue.start()
        await rogue.sent_all.wait()
        out.put(rogue.summary())
        await asyncio.to_thread(stop.wait)
        await rogue.stop()
        out.put(rogue.summary())

    asyncio.run(main())


class TLSFlood:
    """Peers that cost a TLS server memory, each opened again when the server closes it:
    on the TLS port ``tls_address``, ``bare`` connections that never start a TLS
    handshake and ``idle`` ones that finish it and send nothing; on the HTTPS port
    ``https_address`` (if any), ``https`` ones that finish it and send no request.
    ``context`` is the client side's TLS (it trusts the server's certificate).
    :attr:`lifetimes` holds, by kind, how long the server kept each connection open."""

    KINDS = ("bare", "idle", "https")

    def __init__(self, tls_address: str, https_address: str | None, context: Any,
                 *, bare: int = 200, idle: int = 100, https: int = 200,
                 source: str | None = None) -> None:
        self.targets = {"bare": (tls_address, bare), "idle": (tls_address, idle),
                        "https": (https_address, https if https_address else 0)}
        self.context = context
        self.source = source
        self.opened: Counter[str] = Counter()
        self.closed_by_server: Counter[str] = Counter()
        self.open_now: Counter[str] = Counter()
        self.lifetimes: dict[str, list[float]] = {k: [] for k in self.KINDS}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for kind, (address, n) in self.targets.items():
            for _ in range(n):
                assert address is not None
                self._tasks.append(asyncio.ensure_future(self._hold(kind, address)))

    async def _open(self, kind: str, address: str) -> tuple[asyncio.StreamReader,
                                                            asyncio.StreamWriter]:
        host, port = address.rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if self.source is not None:
                sock.bind((self.source, 0))
            sock.setblocking(False)
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_connect(sock, (host, int(port))), 10.0)
            if kind == "bare":
                return await asyncio.open_connection(sock=sock)
            return await asyncio.wait_for(asyncio.open_connection(
                sock=sock, ssl=self.context, server_hostname=host), 15.0)
        except BaseException:
            sock.close()
            raise

    async def _hold(self, kind: str, address: str) -> None:
        stop = self._stop
        while not stop.is_set():
            try:
                r, w = await self._open(kind, address)
            except (OSError, TimeoutError):
                await _pause(stop, 0.2)
                continue
            self.opened[kind] += 1
            self.open_now[kind] += 1
            t0 = time.monotonic()
            reading = asyncio.ensure_future(self._read_until_closed(r))
            stopped = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({reading, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if reading.done():
                    self.closed_by_server[kind] += 1
                    self.lifetimes[kind].append(time.monotonic() - t0)
            finally:
                for t in (reading, stopped):
                    t.cancel()
                self.open_now[kind] -= 1
                w.transport.abort()

    @staticmethod
    async def _read_until_closed(r: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while await r.read(1 << 16):
                pass

    async def stop(self) -> None:
        """The attack ends: every connection it holds is closed."""
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def summary(self) -> dict[str, Any]:
        return {k: {"opened": self.opened[k], "closed_by_server": self.closed_by_server[k],
                    "longest_s": round(max(self.lifetimes[k], default=0.0), 1)}
                for k in self.KINDS}


@dataclass
class HogStats:
    """What one connection of the memory attack did, and how it ended (``kind`` as in
    :class:`Outcome`: ``open`` while it was never closed)."""

    sent: int = 0
    refused: int = 0
    kind: str = "open"
    message: str = ""


class MemoryHog:
    """One connection of the memory attack: asserts ``<MemoryHog K I "xxx...">`` values of
    ``value_size`` bytes in turns of ``batch``, as fast as the server reads them, and
    retracts each one the server refuses (``<refused handle ...>``), as a client that
    keeps within its limits does (then waits ``backoff`` seconds before trying again, or
    with ``backoff=None`` holds what it has without asserting more); until ``stop`` is
    set or the server closes it."""

    def __init__(self, raw: RawConnection, ref: RemoteEntity, k: int, value_size: int,
                 batch: int = 50, notify: Callable[[], None] | None = None,
                 backoff: float | None = 0.0) -> None:
        self.raw = raw
        self.notify = notify
        self.backoff = backoff
        self.oid = ref.oid
        self.k = k
        self.text = "x" * value_size
        self.batch = batch
        self.stats = HogStats()
        self._refused: list[int] = []
        self._wake = asyncio.Event()
        self._closing = False  # we close it (then a reset is ours, not the server's)

    async def run(self, stop: asyncio.Event) -> HogStats:
        reader = asyncio.ensure_future(self._read())
        try:
            handle = 1000
            st = self.stats
            while not stop.is_set() and not reader.done():
                packet = _turn([_assert_event(self.oid, Record(HOG, [self.k, h, self.text]), h)
                                for h in range(handle, handle + self.batch)])
                handle += self.batch
                st.sent += self.batch
                if not await self.raw.send(packet):
                    break
                if self._refused:
                    # Refused: retract what was refused, and send no more until the
                    # refusals of what was in flight have stopped coming (at most 1 s).
                    for _ in range(50):
                        gone, self._refused = self._refused, []
                        if gone and not await self.raw.send(_turn(
                                [Sequence([self.oid, Record(Symbol("R"), [h])]) for h in gone])):
                            break
                        self._wake.clear()
                        try:
                            await asyncio.wait_for(self._wake.wait(), 0.02)
                        except TimeoutError:
                            if not self._refused:
                                break
                    if self.backoff is None:  # hold, until the end
                        await stop.wait()
                    elif self.backoff:  # a pause before trying again
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), self.backoff)
            return st
        finally:
            if not reader.done():
                self._closing = True
                self.raw.close()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(reader, 10.0)

    async def _read(self) -> None:
        dec = Decoder(embedded=lambda v: v, max_value_size=64 << 20)
        st = self.stats
        while True:
            data = await self.raw._read_chunk()
            if not data:
                st.kind = "reset" if self.raw.reset and not self._closing else "closed"
                return
            dec.feed(data)
            try:
                while (v := dec.try_next()) is not None:
                    if type(v) is not Record:
                        continue
                    if v.label == _REFUSED and v.fields and type(v.fields[0]) is int:
                        st.refused += 1
                        self._refused.append(v.fields[0])
                        self._wake.set()
                        if st.refused == 1 and self.notify is not None:
                            self.notify()
                    elif v.label == ERROR and len(v.fields) == 2:
                        st.kind = error_kind(str(v.fields[0]), v.fields[1])
                        st.message = str(v.fields[0])
            except DecodeError as e:
                st.kind, st.message = "undecodable", str(e)
                return


async def memory_attack(address: str, cap: SturdyRef, stop: asyncio.Event, *,
                        connections: int = 40, sources: tuple[str, ...] = MEMORY_SOURCES,
                        value_size: int = 2048,
                        on_open: Callable[[list[MemoryHog]], None] | None = None,
                        notify: Callable[[], None] | None = None,
                        backoff: float | None = 0.0) -> list[HogStats]:
    """Run the memory attack until ``stop`` is set (or every connection is closed):
    ``connections`` connections, from ``sources`` in turn, each asserting values of
    ``value_size`` bytes as fast as the server takes them.  The figures per connection
    (one that could not even resolve its capability has the outcome's kind).
    ``on_open(hogs)`` is called once they are connected, ``notify()`` when one of them is
    refused for the first time."""
    hogs: list[MemoryHog] = []
    runs: list[asyncio.Future[HogStats]] = []
    out: list[HogStats] = []
    try:
        for k in range(connections):  # each starts at once (else the idle timeout ...)
            if stop.is_set():
                break
            raw = await RawConnection.open(address, sources[k % len(sources)])
            try:
                ref = await raw.resolve(cap)
            except Refused as e:
                raw.close()
                out.append(HogStats(kind=e.outcome.kind, message=e.outcome.message))
                continue
            hog = MemoryHog(raw, ref, k, value_size, notify=notify, backoff=backoff)
            hogs.append(hog)
            runs.append(asyncio.ensure_future(hog.run(stop)))
        if on_open is not None:
            on_open(hogs)
        if notify is not None:
            notify()
        out += await asyncio.gather(*runs)
    finally:
        for r in runs:
            r.cancel()
        for h in hogs:
            h.raw.close()
    return out


# ---------------------------------------------------------------------------------------
# Well-behaved clients


class GoodClient:
    """A client that holds ``<Present NAME>`` and ``<Status NAME K>``, chats, and checks
    what every other client does."""

    def __init__(self, name: str, tally: Tally, notifier: Notifier) -> None:
        self.name = name
        self.tally = tally
        self.notifier = notifier
        self.ds: RemoteDataspace | None = None
        self.present: Counter[str] = Counter()
        self.status: dict[str, set[int]] = {}
        self.last_seq: dict[str, int] = {}
        self.seq = 0
        self.k = 0
        self._status_handle: int | None = None
        self.lost = 0

    async def start(self, address: str, cap: str) -> None:
        ds = self.ds = await connect(address, cap)
        ds.on_disconnect.append(self._on_lost)
        ds.observe("<Present $who>", on_assert=self._present_add, on_retract=self._present_del)
        ds.observe("<Says $who $n>", on_message=self._says)
        ds.observe("<Status $who $k>", on_assert=self._status_add, on_retract=self._status_del)
        ds.assert_(Record(PRESENT, [self.name]))
        self._status_handle = ds.assert_(Record(STATUS, [self.name, 0]))
        await ds.sync()

    # -- callbacks: what this client sees ----------------------------------------------

    def _on_lost(self) -> None:
        self.lost += 1
        self.tally.fail(f"{self.name}: a well-behaved client lost its connection")

    def _odd(self, what: str, caps: tuple[Any, ...], arity: int) -> bool:
        if _poisoned(caps):
            self.tally.poison_seen += 1
            self.tally.fail(f"{self.name}: {what} observer received an injected value "
                            f"{_show(caps)}")
            return True
        if len(caps) != arity:
            self.tally.fail(f"{self.name}: {what} observer received {_show(caps)}")
            return True
        return False

    def _present_add(self, *caps: Any) -> None:
        if not self._odd("presence", caps, 1) and type(caps[0]) is str:
            self.present[caps[0]] += 1
        self.notifier.notify()

    def _present_del(self, *caps: Any) -> None:
        if not self._odd("presence", caps, 1) and type(caps[0]) is str:
            who = caps[0]
            self.present[who] -= 1
            if self.present[who] <= 0:
                del self.present[who]
        self.notifier.notify()

    def _status_add(self, *caps: Any) -> None:
        if not self._odd("status", caps, 2) and type(caps[0]) is str:
            self.status.setdefault(caps[0], set()).add(caps[1])
        self.notifier.notify()

    def _status_del(self, *caps: Any) -> None:
        if not self._odd("status", caps, 2) and type(caps[0]) is str:
            self.status.get(caps[0], set()).discard(caps[1])
        self.notifier.notify()

    def _says(self, *caps: Any) -> None:
        if not self._odd("chat", caps, 2):
            who, n = caps
            self.tally.chat_received += 1
            if type(who) is str and who.startswith("good-"):
                last = self.last_seq.get(who, 0)
                if n != last + 1:
                    self.tally.fail(f"{self.name}: message {n!r} from {who} after {last} "
                                    "(lost or out of order)")
                self.last_seq[who] = n if type(n) is int else last
        self.notifier.notify()

    # -- actions -----------------------------------------------------------------------

    async def chat_round(self, peers: list[GoodClient], timeout: float) -> None:
        """Send one message; every client (this one too) must receive it in time."""
        ds = self.ds
        assert ds is not None
        self.seq += 1
        seq = self.seq
        ds.send(Record(SAYS, [self.name, seq]))
        self.tally.chat_sent += 1
        try:
            await ds.sync(timeout=timeout)
        except (TimeoutError, ConnectionError) as e:
            self.tally.fail(f"{self.name}: sync after message {seq} failed: {e}")
            return
        ok = await self.notifier.until(
            lambda: all(p.last_seq.get(self.name, 0) >= seq for p in peers), timeout)
        late = [p.name for p in peers if p.last_seq.get(self.name, 0) < seq]
        self.tally.check(ok, f"{self.name}: message {seq} not received within {timeout:g} s "
                         f"by {', '.join(late)}")

    async def status_round(self, peers: list[GoodClient], timeout: float) -> None:
        """Replace the status assertion in one turn; every client must see just the new one."""
        ds = self.ds
        assert ds is not None
        self.k += 1
        k = self.k
        with ds.turn():
            if self._status_handle is not None:
                ds.retract(self._status_handle)
            self._status_handle = ds.assert_(Record(STATUS, [self.name, k]))
        self.tally.status_changes += 1
        ok = await self.notifier.until(
            lambda: all(p.status.get(self.name) == {k} for p in peers), timeout)
        wrong = [f"{p.name} sees {sorted(p.status.get(self.name, set()))}" for p in peers
                 if p.status.get(self.name) != {k}]
        self.tally.check(ok, f"{self.name}: status {k} not seen alone within {timeout:g} s: "
                         + "; ".join(wrong))

    async def close(self) -> None:
        if self.ds is not None:
            self.ds.on_disconnect.clear()
            await self.ds.close()


def _show(v: Any, width: int = 120) -> str:
    try:
        s = stringify(Sequence(v) if isinstance(v, tuple) else v, embedded=lambda o: repr(o))
    except Exception:
        s = repr(v)
    return s if len(s) <= width else s[: width - 3] + "..."


# ---------------------------------------------------------------------------------------
# The probe, on a thread of its own


class Probe:
    """``sync()`` round trips every ``interval`` seconds on a connection of its own, in a
    process of its own (so that the soak's own work never delays it: its latencies are
    the server's).  The process sends its figures back through a pipe; :meth:`drain`
    reads them."""

    def __init__(self, address: str, cap: str, interval: float, timeout: float) -> None:
        self.latencies: list[float] = []
        self.failures = 0
        self.failure_messages: list[str] = []
        self.ready = False
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=False)
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_probe_process, name="soak-probe", daemon=True,
                                 args=(address, cap, interval, timeout, child, self._stop))
        self._child = child
        self._started = time.monotonic()

    def start(self, timeout: float = 30.0) -> bool:
        """Start the process; True once its connection is up."""
        self._proc.start()
        self._child.close()
        deadline = time.monotonic() + timeout
        while not self.ready and time.monotonic() < deadline and self._proc.is_alive():
            self.drain(0.1)
        self.drain()
        return self.ready

    def drain(self, timeout: float = 0.0) -> None:
        """Take in what the probe process has sent (waiting up to ``timeout`` for it)."""
        try:
            while self._conn.poll(timeout):
                timeout = 0.0
                kind, data = self._conn.recv()
                if kind == "ready":
                    self.ready = True
                elif kind == "lat":
                    self.latencies.extend(data)
                elif kind == "fail":
                    self.failures += 1
                    if len(self.failure_messages) < 20:
                        self.failure_messages.append(
                            f"[{time.monotonic() - self._started:6.1f}s] {data}")
        except (EOFError, OSError):
            pass

    def stop(self, timeout: float = 15.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout
        while self._proc.is_alive() and time.monotonic() < deadline:
            self.drain(0.1)
        if self._proc.is_alive():
            self._proc.kill()
            self.failures += 1
            self.failure_messages.append("the probe process did not stop")
        self._proc.join(5.0)
        self.drain()
        self._conn.close()


def _probe_process(address: str, cap: str, interval: float, timeout: float, out: Any,
                   stop: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the soak's to handle
    asyncio.run(_probe_main(address, cap, interval, timeout, out, stop))


async def _probe_main(address: str, cap: str, interval: float, timeout: float, out: Any,
                      stop: Any) -> None:
    try:
        ds = await connect(address, cap)
    except Exception as e:
        out.send(("fail", f"cannot connect: {e}"))
        return
    out.send(("ready", None))
    batch: list[float] = []
    sent = time.monotonic()
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                await ds.sync(timeout=timeout)
                batch.append(time.perf_counter() - t0)
            except Exception as e:
                out.send(("fail", f"{type(e).__name__}: {e}"))
            if time.monotonic() - sent >= 0.5:
                out.send(("lat", batch))
                batch, sent = [], time.monotonic()
            await asyncio.sleep(interval)  # pacing
        out.send(("lat", batch))
    finally:
        await ds.close()
        out.close()


# ---------------------------------------------------------------------------------------
# Malformed input


def fuzz_corpus(cap: str) -> list[bytes]:
    """Valid packets (the first resolves ``cap``); mutated into bad ones."""
    texts = [
        f"[[0 <A <resolve {cap} #:[0 1]> 1>]]",
        '[[1 <A <Fuzz 1 "x"> 2>]]',
        "[[1 <R 2>]]",
        '[[1 <M <Fuzz "m">>]]',
        "[[1 <A <Observe <group <rec Fuzz> {0: <bind <_>>}> #:[0 3]> 4>]]",
        "[[1 <A <Observe <bind <_>> #:[0 6]> 7>]]",
        "[[1 <S #:[0 5]>]]",
        "[[1 <M #:[1 1]>]]",
        "[[1 <A [#:[1 0] #:[0 9] {a: 1.5 b: #t}] 8>]]",
        "[[1 <A <Observe <group <arr> {0: <lit 1>}> #:[0 10]> 11>] [1 <R 11>]]",
        "[[1 <A <Fuzz #[AAEC] [1 2 3] #{1 2}> 12>] [1 <M <Fuzz 2>>] [1 <R 12>]]",
        "#f",
        '<error "fuzz" 1>',
        "<extension 1 2>",
        "[]",
    ]
    return [encode(parse(t)) for t in texts]


# Events that are well-formed packets but wrong: each must get an <error> and a close.
_WRONG_EVENTS = [
    "[[99 <A 1 1>]]",                        # unknown OID
    "[[1 <R 12345>]]",                       # retraction of an unknown handle
    "[[1 <A 1 5>] [1 <A 2 5>]]",             # a handle used twice
    '[[1 <A 1 "h">]]',                       # a handle that is not an integer
    "[[1 <S 5>]]",                           # a sync without a reference
    "[[1 <M #:[2 1]>]]",                     # a malformed wire reference
    "[[1 <M #:[1 999]>]]",                   # a reference to an unknown object
    "[[1 <X 1>]]",                           # no such event
    "[[1]]",                                 # not [oid event]
    "[[-1 <M 1>]]",                          # a negative OID
    '"a string is not a packet"',
    '[[0 <A <resolve <ref {oid: "root" sig: #x"00000000000000000000000000000000"}> '
    "#:[0 1]> 1>]]",                         # a forged capability
]


@dataclass
class FuzzCase:
    generator: str
    chunks: list[bytes]
    expect_close: bool = False  # the server must end the connection
    wait: float = 0.3


def mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    """``data`` with 1-4 random byte edits (flip, insert, delete, truncate, repeat, append
    another packet, splice noise): malformed input for fuzzing."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        if op == 0 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1:
            b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
        elif op == 2 and b:
            del b[rng.randrange(len(b))]
        elif op == 3 and b:
            del b[rng.randrange(len(b)):]
        elif op == 4 and b:
            i = rng.randrange(len(b))
            j = min(len(b), i + rng.randint(1, 16))
            b[i:i] = b[i:j] * rng.randint(1, 8)
        elif op == 5:
            b += rng.choice(pool)
        else:
            b[rng.randrange(len(b) + 1):rng.randrange(len(b) + 1)] = bytes(
                rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return bytes(b)


def fuzz_case(rng: random.Random, pool: list[bytes], handshake_timeout: float) -> FuzzCase:
    """One malformed-input case: what to send on a fresh connection, and what to expect."""
    resolve = pool[0]
    g = rng.choice(["garbage", "mutated", "mixed", "truncated", "oversized", "deep",
                    "wrong-event", "wrong-event", "mutated"])
    expect, wait = False, 0.3
    if g == "garbage":
        data = rng.randbytes(rng.randint(1, 300))
    elif g == "mutated":
        data = mutate(rng, rng.choice(pool), pool)
    elif g == "mixed":  # resolve for real, then valid and mutated packets
        data = resolve + b"".join(
            rng.choice(pool[1:11]) if rng.random() < 0.6 else mutate(rng, rng.choice(pool), pool)
            for _ in range(rng.randint(1, 6)))
    elif g == "truncated":
        whole = rng.choice(pool[:11])
        data = whole[: rng.randint(1, len(whole) - 1)]
        if rng.random() < 0.3:  # wait for the handshake timeout to close it
            expect, wait = True, handshake_timeout + 5.0
    elif g == "oversized":
        big = rng.choice([(1 << 20) + 1, 1 << 31, 1 << 62])
        data = rng.choice([
            b"\xb1" + _varint(big) + b"abc",                              # a string
            b"\xb5\xb5\xb0\x01\x01\xb4\xb3\x01M\xb2" + _varint(big) + b"x",  # in a turn
            b"\xb0" + _varint(big) + b"\x01",                             # an integer
        ])
        if rng.random() < 0.1:  # a packet of many small items, over 1 MiB
            data = b"\xb5" + b"\xb0\x01\x01" * 360_000
        expect, wait = True, 5.0
    elif g == "deep":
        n = rng.choice([201, 300, 1000, 20_000])
        if rng.random() < 0.5:
            data = b"\xb5" * n + b"\x84" * n
        else:
            data = (resolve + b"\xb5\xb5\xb0\x01\x01\xb4\xb3\x01M" + b"\xb5" * n + b"\x84" * n
                    + b"\x84\x84\x84")
        expect, wait = True, 5.0
    else:  # wrong-event, after resolving or before
        bad = encode(parse(rng.choice(_WRONG_EVENTS)))
        data = (resolve if rng.random() < 0.8 else b"") + bad
        expect, wait = True, 5.0
    chunks = [data]
    if len(data) > 1 and rng.random() < 0.3:  # cut into pieces at random points
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 3))))
        chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    return FuzzCase(g, chunks, expect, wait)


# ---------------------------------------------------------------------------------------
# The soak


async def _wait_for(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()``'s first value that is not None within ``timeout`` s (re-asked every 0.1 s:
    what a subprocess writes to its log is what there is to wait on), else None."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v is not None or time.monotonic() >= deadline:
            return v
        await asyncio.sleep(0.1)


class Soak:
    """One run against one server (see the module docstring)."""

    def __init__(self, config: SoakConfig, server: ServerUnderTest, rng_seed: int,
                 secret: Path | None = None) -> None:
        self.cfg = config
        self.secret = secret
        """The cluster secret's file (the cluster parts run with one)."""
        self.server = server
        self.address = server.address
        self.cap_text = server.sturdyref
        self.cap = SturdyRef.parse(server.sturdyref)
        self.seed = rng_seed
        self.tally = Tally()
        self.notifier = Notifier()
        self.stop = asyncio.Event()
        self.abort: str | None = None
        self.goods: list[GoodClient] = []
        self.probe: Probe | None = None
        self.watcher: RemoteDataspace | None = None
        self.victims: Counter[str] = Counter()
        self.hogs_present: Counter[Any] = Counter()
        self.victim_procs: set[asyncio.subprocess.Process] = set()
        self.cap_file = server.data_dir.parent / "soak.sturdyref"
        self.progress_tty = sys.stderr.isatty()
        self.answered_at_end = False
        self._pool: list[bytes] | None = None
        self._victim_count = 0

    def rng(self, name: str) -> random.Random:
        return random.Random(f"{self.seed}:{name}")

    @property
    def limit(self) -> dict[str, float]:
        return self.cfg.limits

    # -- the whole run -------------------------------------------------------------------

    async def run(self) -> None:
        """Set up, run the mix for the set time, check the end state, tear down."""
        try:
            await self._setup()
        except Exception as e:
            self.abort = f"setting up failed: {type(e).__name__}: {e}"
            self.tally.fail(self.abort)
            await self._teardown()
            return
        try:
            await self._mix()
            if self.abort is None:
                await self._final_checks()
            if self.abort is None:
                await self._memory_back()
        finally:
            await self._teardown()

    async def _setup(self) -> None:
        cfg = self.cfg
        self.cap_file.write_text(self.cap_text + "\n")
        self.goods = [GoodClient(f"good-{i}", self.tally, self.notifier)
                      for i in range(cfg.clients)]
        for g in self.goods:
            await g.start(self.address, self.cap_text)
        names = {g.name for g in self.goods}
        ok = await self.notifier.until(
            lambda: all(set(g.present) == names for g in self.goods), cfg.check_timeout)
        self.tally.check(ok, "the well-behaved clients did not all see each other at start")
        self.watcher = await connect(self.address, self.cap_text)
        self.watcher.on_disconnect.append(
            lambda: self.tally.fail("the victims' watcher lost its connection"))
        self.watcher.observe("<Victim $name>", on_assert=self._victim_add,
                             on_retract=self._victim_del)
        # The memory attack's connections, by what they hold (one capture each: cheap).
        self.watcher.observe("<MemoryHog $k _ _>", on_assert=self._hog_add,
                             on_retract=self._hog_del)
        await self.watcher.sync()
        self.probe = Probe(self.address, self.cap_text, cfg.probe_interval, cfg.probe_timeout)
        if not await asyncio.to_thread(self.probe.start):
            raise ConnectionError("the probe did not connect within 30 s")

    async def _mix(self) -> None:
        cfg = self.cfg
        loops: list[Callable[[], Awaitable[None]]] = [self._monitor, self._progress]
        for g in self.goods:
            loops.append(lambda g=g: self._cycles(g.name, self._good_round, g, (0.05, 0.3)))
        attacks = {
            "catch-all-observers": (self._attack_catch_all, (2.0, 6.0)),
            "big-turn": (self._attack_big_turn, (1.0, 4.0)),
            "work-loop": (self._attack_work_loop, (2.0, 6.0)),
            "per-address": (self._attack_per_address, (1.0, 3.0)),
            "reconnect-loop": (self._attack_reconnect_loop, (3.0, 8.0)),
            "observe-only-cap": (self._attack_observe_only, (1.0, 4.0)),
            "memory": (self._attack_memory, (15.0, 25.0)),
        }
        parts = set(cfg.only or PARTS)
        for name, (fn, pause) in attacks.items():
            if name in parts:
                loops.append(lambda name=name, fn=fn, pause=pause:
                             self._cycles(name, self._attack, (name, fn), pause, 2.0))
        for w in range(cfg.fuzz_workers if "fuzz" in parts else 0):
            loops.append(lambda w=w: self._cycles(f"fuzz-{w}", self._fuzz_round, w,
                                                  (0.01, 0.05)))
        if parts & set(CLUSTER_PARTS) and self.secret is not None:
            loops.append(self._cluster)
        if "tls" in parts:
            loops.append(self._tls)
        for v in range(cfg.victims if "kills" in parts else 0):
            loops.append(lambda v=v: self._cycles(f"kill-{v}", self._victim, v, (0.3, 1.5),
                                                  2.0))
        tasks = [asyncio.ensure_future(fn()) for fn in loops]
        deadline = time.monotonic() + cfg.seconds
        while time.monotonic() < deadline and self.abort is None:
            await _pause(self.stop, min(1.0, deadline - time.monotonic()))
        self.stop.set()
        # Cycles under way finish (each is bounded); any still running after this are
        # cancelled, and not counted.
        _, pending = await asyncio.wait(tasks, timeout=25.0)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _cycles(self, name: str, fn: Callable[[random.Random, Any], Awaitable[None]],
                      arg: Any, pause: tuple[float, float], first: float = 0.0) -> None:
        """Run ``fn(rng, arg)`` again and again until the end, with a random pause
        between runs; an unexpected exception is a failed check, and the runs go on."""
        rng = self.rng(name)
        await _pause(self.stop, rng.uniform(0.0, first))
        while not self.stop.is_set():
            try:
                await fn(rng, arg)
            except Exception as e:
                if self._server_gone():
                    return
                log.debug("%s failed", name, exc_info=True)
                self.tally.fail(f"{name}: {type(e).__name__}: {e}")
            await _pause(self.stop, rng.uniform(*pause))

    async def _teardown(self) -> None:
        for p in list(self.victim_procs):
            await self._kill(p)
        if self.probe is not None:
            await asyncio.to_thread(self.probe.stop)
        with contextlib.suppress(Exception):
            if self.watcher is not None:
                self.watcher.on_disconnect.clear()
                await self.watcher.close()
        for g in self.goods:
            with contextlib.suppress(Exception):
                await g.close()

    def _hog_add(self, *caps: Any) -> None:
        self.hogs_present[caps] += 1
        self.notifier.notify()

    def _hog_del(self, *caps: Any) -> None:
        self.hogs_present[caps] -= 1
        if self.hogs_present[caps] <= 0:
            del self.hogs_present[caps]
        self.notifier.notify()

    def _victim_add(self, *caps: Any) -> None:
        if _poisoned(caps):
            self.tally.poison_seen += 1
            self.tally.fail(f"the victims' watcher received an injected value {_show(caps)}")
        elif len(caps) == 1 and type(caps[0]) is str:
            self.victims[caps[0]] += 1
        self.notifier.notify()

    def _victim_del(self, *caps: Any) -> None:
        if len(caps) == 1 and type(caps[0]) is str:
            self.victims[caps[0]] -= 1
            if self.victims[caps[0]] <= 0:
                del self.victims[caps[0]]
        self.notifier.notify()

    async def _final_checks(self) -> None:
        t = self.cfg.check_timeout
        names = {g.name for g in self.goods}
        for g in self.goods:
            assert g.ds is not None
            try:
                await g.ds.sync(timeout=t)
            except (TimeoutError, ConnectionError) as e:
                self.tally.fail(f"{g.name}: final sync failed: {e}")
        ok = await self.notifier.until(
            lambda: all(set(g.present) == names
                        and all(g.status.get(o.name) == {o.k} for o in self.goods)
                        for g in self.goods), t)
        self.tally.check(ok, "at the end, the well-behaved clients do not see exactly each "
                         "other's presence and latest status: " + "; ".join(
                             f"{g.name} sees {sorted(g.present)}" for g in self.goods))
        ok = await self.notifier.until(lambda: not self.victims, t)
        self.tally.check(ok, "assertions of killed clients still present at the end: "
                         + ", ".join(sorted(self.victims)))
        # A new client is served, and the dataspace holds exactly what the well-behaved
        # clients hold: nothing of any attacker, fuzzer or killed client is left.
        try:
            final = await connect(self.address, self.cap_text, reconnect=False)
        except Exception as e:
            self.tally.fail(f"the server does not accept a new client at the end: {e}")
            return
        try:
            await final.sync(timeout=t)
            self.answered_at_end = True
            self.tally.checks += 1
            seen: Counter[Any] = Counter()

            def add(v: Any) -> None:
                seen[v] += 1
                self.notifier.notify()

            def drop(v: Any) -> None:
                seen[v] -= 1
                if seen[v] <= 0:
                    del seen[v]
                self.notifier.notify()

            final.observe("$v", on_assert=add, on_retract=drop)
            expected_observers = 3 * len(self.goods) + 3  # the watcher's two, and this one
            expected = {Record(PRESENT, [g.name]) for g in self.goods}
            expected |= {Record(STATUS, [g.name, g.k]) for g in self.goods}

            def unexpected() -> list[Any]:
                return [v for v in seen if not (v in expected or (
                    isinstance(v, Record) and v.label == OBSERVE))]

            def clean() -> bool:
                observers = sum(1 for v in seen if isinstance(v, Record) and v.label == OBSERVE)
                return (not unexpected() and observers == expected_observers
                        and all(v in seen for v in expected))

            ok = await self.notifier.until(clean, t)
            observers = sum(1 for v in seen if isinstance(v, Record) and v.label == OBSERVE)
            self.tally.check(ok, f"at the end the dataspace holds {plural(len(seen), 'assertion')}, "
                             f"{plural(observers, 'observer')} (expected {expected_observers}); "
                             f"unexpected: {', '.join(_show(v, 80) for v in unexpected()[:10])}")
        except (TimeoutError, ConnectionError) as e:
            self.tally.fail(f"the server does not answer a new client at the end: {e}")
        finally:
            await final.close()

    # -- the cluster port and TLS (issue 29) --------------------------------------------

    def _cluster_address(self, server: ServerUnderTest) -> str | None:
        for line in server.lines():
            m = re.search(r"routes on (127\.0\.0\.1:\d+) \(member", line)
            if m:
                return m.group(1)
        return None

    async def _cluster(self) -> None:
        """The second member, the strangers on both cluster ports and its restarts, and
        the rogue member's runs (see the module docstring)."""
        assert self.secret is not None
        parts = set(self.cfg.only or PARTS)
        rng = self.rng("cluster")
        here = await _wait_for(lambda: self._cluster_address(self.server), 10.0)
        if here is None:
            self.tally.fail("cluster: the server did not say where it listens for routes")
            return
        port = free_port()
        # One root key: the soak's capability works on both members.
        from ..datadir import ROOT_KEY

        data = self.server.data_dir.parent / "second"
        data.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.server.data_dir / ROOT_KEY, data / ROOT_KEY)
        (data / ROOT_KEY).chmod(0o600)
        second = ServerUnderTest(data, [
            "--cluster", f"127.0.0.1:{port}", "--cluster-secret", str(self.secret),
            "--routes", here], verbose=False)
        flood: StrangerFlood | None = None
        watcher: RemoteDataspace | None = None
        seen: set[int] = set()
        try:
            await asyncio.to_thread(second.start, 30.0)
            watcher = await connect(self.address, self.cap_text)
            watcher.observe("<SoakRejoin $k>", on_assert=lambda k: (seen.add(k),
                                                                   self.notifier.notify()))
            await watcher.sync()
            if "cluster-port" in parts:
                from ..broker.cluster import MAX_STRANGERS

                flood = StrangerFlood([here, f"127.0.0.1:{port}"], per_port=MAX_STRANGERS,
                                      source=_ATTACK_SOURCE["cluster-port"])
                flood.start()
            k = 0
            while not self.stop.is_set():
                await _pause(self.stop, rng.uniform(3.0, 8.0))
                if self.stop.is_set():
                    break
                if "cluster-port" in parts:
                    k += 1
                    await self._rejoin(second, k, seen)
                if "rogue-member" in parts and not self.stop.is_set():
                    await self._rogue(here)
        except Exception as e:
            if not self._server_gone():
                self.tally.fail(f"cluster: {type(e).__name__}: {e}")
        finally:
            if flood is not None:
                await flood.stop()
                self.tally.stranger_flood = flood.summary()
            if watcher is not None:
                with contextlib.suppress(Exception):
                    await watcher.close()
            await asyncio.to_thread(second.stop, 20.0)

    async def _rejoin(self, second: ServerUnderTest, k: int, seen: set[int]) -> None:
        """kill -9 of the second member, restarted at once: a client of it is seen here
        within 15 s (while strangers hold the cluster ports)."""
        second.kill()
        await asyncio.to_thread(second.start, 30.0)
        t0 = time.monotonic()
        client = await connect(second.address, self.cap_text, reconnect=False)
        try:
            client.assert_(Record(Symbol("SoakRejoin"), [k]))
            ok = await self.notifier.until(lambda: k in seen, 15.0)
            took = time.monotonic() - t0
            if self.tally.check(ok, f"cluster-port: a restarted member's client was not seen "
                                    f"on the other member within 15 s (round {k})"):
                self.tally.rejoins.append(took)
        finally:
            await client.close()

    async def _rogue(self, here: str) -> None:
        """A rogue member's gossip for a few seconds: this member keeps its table
        bounded, its route to the second member, and answers (the probe)."""
        assert self.secret is not None
        from ..broker.cluster import read_secret

        rogue = RogueProcess([here], read_secret(self.secret))
        try:
            summary = await asyncio.to_thread(rogue.start)
            await _pause(self.stop, 5.0)
        finally:
            summary = await asyncio.to_thread(rogue.stop)
        try:
            doc = json.loads((self.server.data_dir / "cluster.json").read_text())
        except (OSError, ValueError) as e:
            self.tally.fail(f"rogue-member: cannot read the member's cluster status: {e}")
            return
        kept = len(doc.get("members", []))
        self.tally.check(kept <= doc.get("max_members", 64) + 2,
                         f"rogue-member: the member keeps {kept} members after a rogue's "
                         "gossip (more than its table holds)")
        self.tally.rogue_runs.append({**summary, "members_kept": kept,
                                      "members_ignored": doc.get("members_ignored", 0)})

    async def _tls(self) -> None:
        """A TLS server of its own under the TLS flood, again and again."""
        rng = self.rng("tls")
        tmp = self.server.data_dir.parent / "tls"
        try:
            import trustme
        except ImportError:
            self.tally.fail("tls: needs trustme to make certificates (pip install "
                            "'dataspace[test]')")
            return
        ca = trustme.CA()
        tmp.mkdir(parents=True, exist_ok=True)
        leaf = ca.issue_cert("127.0.0.1")
        leaf.cert_chain_pems[0].write_to_path(str(tmp / "server.crt"))
        leaf.private_key_pem.write_to_path(str(tmp / "server.key"))
        ca.cert_pem.write_to_path(str(tmp / "ca.crt"))
        server = ServerUnderTest(tmp / "data", [
            "--http", "127.0.0.1:0", "--tls-cert", str(tmp / "server.crt"),
            "--tls-key", str(tmp / "server.key"), "--handshake-timeout", "5"], verbose=False)
        try:
            await asyncio.to_thread(server.start, 30.0)
            https = await _wait_for(lambda: next(
                (m.group(1) for line in server.lines()
                 if (m := re.search(r"HTTP on https://([\d.:]+)/", line))), None), 10.0)
            if https is None:
                self.tally.fail("tls: the TLS server did not say where its HTTPS port is")
                return
            import ssl

            ctx = ssl.create_default_context(cafile=str(tmp / "ca.crt"))
            while not self.stop.is_set():
                await self._tls_round(server, https, ctx)
                await _pause(self.stop, rng.uniform(2.0, 6.0))
        except Exception as e:
            if not self._server_gone():
                self.tally.fail(f"tls: {type(e).__name__}: {e}")
        finally:
            await asyncio.to_thread(server.stop, 20.0)

    async def _tls_round(self, server: ServerUnderTest, https: str, ctx: Any) -> None:
        def rss() -> float:
            mem = server.memory_kib()
            return mem[0] / 1024 if mem else 0.0

        baseline = rss()
        flood = TLSFlood(server.address, https, ctx, bare=200, idle=100, https=200,
                         source=_ATTACK_SOURCE["tls"])
        flood.start()
        t0 = time.monotonic()
        peak = baseline
        try:
            while (flood.closed_by_server["https"] < 200 and time.monotonic() - t0 < 40.0
                   and not self.stop.is_set()):
                peak = max(peak, rss())
                await asyncio.sleep(0.5)  # (sampling)
        finally:
            await flood.stop()
        if self.stop.is_set():
            return
        self.tally.check(flood.closed_by_server["https"] >= 200 and
                         max(flood.lifetimes["https"], default=99.0) <= 35.0,
                         f"tls: idle HTTPS connections not closed within 35 s: "
                         f"{flood.summary()['https']}")
        ended = time.monotonic()
        now = rss()
        while now - baseline >= 40 and time.monotonic() - ended < 30.0:
            await asyncio.sleep(0.5)  # (sampling)
            now = rss()
        back = time.monotonic() - ended
        self.tally.check(now - baseline < 40, f"tls: the TLS server's RSS was {now:.0f} MiB "
                         f"30 s after an attack ended, {now - baseline:.0f} MiB above where it "
                         "started (the bound is 40)")
        self.tally.tls_runs.append({"peak_growth_mib": round(peak - baseline, 1),
                                    "back_after_s": round(back, 1),
                                    "https_closed_max_s": round(max(
                                        flood.lifetimes["https"], default=0.0), 1)})

    # -- watching the server ------------------------------------------------------------

    async def _monitor(self) -> None:
        while not self.stop.is_set():
            if self.probe is not None:
                self.probe.drain()
            mem = self.server.memory_kib()
            if mem is not None:
                self.tally.rss_kib.append(mem[0])
                self.tally.hwm_kib = max(self.tally.hwm_kib, mem[1])
            if self._server_gone():
                return
            await _pause(self.stop, 1.0)

    async def _memory_back(self) -> None:
        """The attacks have ended: within :data:`SETTLE_SECONDS` the server's RSS must come
        back within :data:`SETTLE_MIB` of where it started (a leak keeps it up).  It is
        watched until it is within half of that, or for the whole time (the lowest seen
        counts: the server gives memory back on its own timer)."""
        t = self.tally
        if not t.rss_kib:
            return
        start = t.rss_kib[0]
        t0 = time.monotonic()
        while True:
            mem = self.server.memory_kib()
            if mem is None:
                return
            if t.settled_kib is None or mem[0] < t.settled_kib:
                t.settled_kib, t.settle_s = mem[0], time.monotonic() - t0
            if (t.settled_kib - start) / 1024 < SETTLE_MIB / 2 or \
                    time.monotonic() - t0 >= SETTLE_SECONDS:
                break
            await asyncio.sleep(0.5)  # (sampling: the server gives memory back on its own)
        grown = (t.settled_kib - start) / 1024
        t.check(grown < SETTLE_MIB,
                f"memory: {SETTLE_SECONDS:g} s after the attacks ended the server's RSS was "
                f"still {grown:.0f} MiB above its start (at most {SETTLE_MIB:g}): what they "
                "made it hold was not given back (a leak?)")

    def rss_growth(self) -> int | None:
        """Bytes the server's peak RSS (VmHWM) is above its first sample, if sampled."""
        t = self.tally
        return (t.hwm_kib - t.rss_kib[0]) * 1024 if t.rss_kib else None

    def _server_gone(self) -> bool:
        """True (and the run stops) once the server process has ended."""
        if self.abort is not None:
            return True
        if self.server.alive():
            return False
        code = self.server.proc.returncode if self.server.proc else None
        self.abort = f"the server exited during the soak (status {code})"
        self.tally.fail(self.abort)
        self.stop.set()
        return True

    def progress_line(self) -> str:
        t = self.tally
        p = self.probe
        lat = sorted(p.latencies) if p else []
        p99 = _pct(lat, 0.99) * 1000 if lat else 0.0
        attacks = sum(a.runs for a in t.attacks.values())
        rss = t.rss_kib[-1] / 1024 if t.rss_kib else 0.0
        errors = len(self.server.error_lines())
        return (f"probes {len(lat)} "
                f"(p99 {p99:.1f} ms, {p.failures if p else 0} failed)  checks "
                f"{t.checks} ok {len(t.failures)} failed  attacks {attacks}  fuzz "
                f"{t.fuzz_cases}  kills {t.kills}  rss {rss:.0f} MiB  log errors {errors}")

    async def _progress(self) -> None:
        if self.cfg.quiet:
            return
        # A bar with the time left on a terminal, a line per progress_every otherwise.
        total = max(1, round(self.cfg.seconds))
        bar = Progress(sys.stderr, total=total, what="s", verb="soak", rate=False,
                       interval=0.0, redraw=0.0, tty=self.progress_tty)
        while not self.stop.is_set():
            await _pause(self.stop, self.cfg.progress_every)
            bar.update(min(total, int(self.tally.elapsed())), note=self.progress_line())
        bar.finish(note=self.progress_line())

    # -- well-behaved clients ----------------------------------------------------------

    async def _good_round(self, rng: random.Random, g: GoodClient) -> None:
        await g.chat_round(self.goods, self.cfg.check_timeout)
        if g.seq % 5 == 0:
            await g.status_round(self.goods, self.cfg.check_timeout)

    # -- attacks -------------------------------------------------------------------------

    async def _attack(self, rng: random.Random,
                      which: tuple[str, Callable[[random.Random], Awaitable[bool]]]) -> None:
        name, fn = which
        stats = self.tally.attacks[name]
        stats.runs += 1
        if await fn(rng):
            stats.stopped += 1

    async def _open(self, source: str) -> RawConnection:
        return await RawConnection.open(self.address, source)

    async def _flood(self, raw: RawConnection, packets: list[bytes], timeout: float) -> Outcome:
        """Send ``packets`` while reading everything the server sends, until it closes
        the connection (or ``timeout``)."""

        async def send() -> None:
            for i in range(0, len(packets), 200):
                if not await raw.send(b"".join(packets[i:i + 200])):
                    return

        sender = asyncio.ensure_future(send())
        try:
            return await raw.read_until_closed(timeout)
        finally:
            sender.cancel()
            with contextlib.suppress(BaseException):
                await sender

    def _record(self, name: str, outcome: Outcome, expect: str | None = None) -> bool:
        """Count an attack connection's outcome; it must have been ended by the server."""
        self.tally.attacks[name].outcomes[outcome.kind] += 1
        return self.tally.check(
            outcome.by_server,
            f"attack {name}: the server did not stop it"
            + (f" (expected {expect})" if expect else ""))

    async def _flood_attack(self, name: str, packets: Callable[[int], list[bytes]],
                            timeout: float, expect: str) -> bool:
        """Open an attack connection from the attack's address, resolve the capability,
        flood it with ``packets(ref.oid)`` and count how it ended (refused at the
        resolve counts too)."""
        raw = await self._open(_ATTACK_SOURCE[name])
        try:
            ref = await raw.resolve(self.cap)
            outcome = await self._flood(raw, packets(ref.oid), timeout)
            return self._record(name, outcome, expect)
        except Refused as e:
            return self._record(name, e.outcome)
        finally:
            raw.close()

    async def _attack_catch_all(self, rng: random.Random) -> bool:
        """(a) thousands of catch-all observers, one per packet, from one connection."""
        def packets(oid: int) -> list[bytes]:
            n = rng.randint(2000, 4000)
            return [_turn([_observe_event(oid, 100 + i, 10 + i)]) for i in range(n)]

        return await self._flood_attack("catch-all-observers", packets, 60.0,
                                        "too-many-matches")

    async def _attack_big_turn(self, rng: random.Random) -> bool:
        """(b) the same batched in one turn: refused as a whole (turn-too-large); the
        ``<Present "mallory-b">`` it also holds must never be seen."""
        def packets(oid: int) -> list[bytes]:
            n = rng.randint(300, 600)
            events = [_assert_event(oid, Record(PRESENT, [f"{POISON}-b"]), 2)]
            events += [_observe_event(oid, 100 + i, 10 + i) for i in range(n)]
            return [_turn(events)]

        return await self._flood_attack("big-turn", packets, 30.0, "turn-too-large")

    async def _attack_work_loop(self, rng: random.Random) -> bool:
        """(c) catch-all observers, then assertions and retractions: each costs events
        back to the same connection (the work budget)."""
        def packets(oid: int) -> list[bytes]:
            out = [_turn([_observe_event(oid, 10 + i, 10 + i)]) for i in range(10)]
            for i in range(rng.randint(20_000, 30_000)):
                h = 1000 + i
                out.append(_turn([_assert_event(oid, Record(Symbol("n"), [i]), h)]))
                out.append(_turn([Sequence([oid, Record(Symbol("R"), [h])])]))
            return out

        return await self._flood_attack("work-loop", packets, 60.0, "work-limit")

    async def _attack_per_address(self, rng: random.Random) -> bool:
        """(d) connections from one address up to the per-address limit, then one more
        (refused), then idling (closed by the idle timeout)."""
        name = "per-address"
        source = _ATTACK_SOURCE[name]
        limit = int(self.limit["max-connections-per-address"])
        held: list[RawConnection] = []
        try:
            refused: Outcome | None = None
            t0 = time.monotonic()
            for _ in range(limit + 1):
                raw = await self._open(source)
                held.append(raw)
                try:
                    await raw.resolve(self.cap)
                except Refused as e:
                    refused = e.outcome
                    held.pop().close()
                    break
            idle = self.limit["idle-timeout"]
            if refused is None and idle and time.monotonic() - t0 >= idle:
                # Opening them took longer than the idle timeout (a loaded machine): the
                # first may have been closed before the last came, which is then rightly
                # accepted.
                self.tally.attacks[name].outcomes["slower-than-idle-timeout"] += 1
                ok = True
            else:
                ok = self.tally.check(
                    refused is not None,
                    f"attack {name}: {limit + 1} connections from {source} were all accepted "
                    f"(the limit is {limit})")
            if refused is not None:
                self.tally.attacks[name].outcomes[refused.kind] += 1
                ok = self.tally.check(refused.error, f"attack {name}: refused without an "
                                      f"error ({refused.kind})") and ok
            if not self.limit["idle-timeout"]:
                return ok  # no idle timeout configured: nothing closes them
            # The ones that got in hold nothing: the idle timeout must close them.
            wait = self.limit["idle-timeout"] + 10.0
            outcomes = await asyncio.gather(*(raw.read_until_closed(wait) for raw in held))
            for o in outcomes:
                self.tally.attacks[name].outcomes[o.kind] += 1
            still = sum(1 for o in outcomes if not o.by_server)
            return self.tally.check(
                still == 0, f"attack {name}: {plural(still, 'idle connection')} still open "
                f"{wait:g} s after connecting") and ok
        finally:
            for raw in held:
                raw.close()

    async def _attack_reconnect_loop(self, rng: random.Random) -> bool:
        """(e) connect, resolve, close, again, as fast as possible: refused by the
        connect rate."""
        name = "reconnect-loop"
        rate = self.limit["connect-rate"]
        if not rate:  # no connect rate configured: nothing to reach
            self.tally.attacks[name].outcomes["not-limited"] += 1
            return True
        bound = int(10 * rate) + 200
        t0 = time.monotonic()
        for _ in range(bound):
            raw = await self._open(_ATTACK_SOURCE[name])
            try:
                await raw.resolve(self.cap)
            except Refused as e:
                return self._record(name, e.outcome, "connect-rate")
            finally:
                raw.close()
        if bound <= 10 * rate + rate * (time.monotonic() - t0):
            # So slow (a loaded machine) that the rate was never passed: rightly accepted.
            self.tally.attacks[name].outcomes["slower-than-the-rate"] += 1
            return True
        self.tally.attacks[name].outcomes["open"] += 1
        self.tally.fail(f"attack {name}: {bound} connections in a row were all accepted "
                        f"(connect rate {rate:g}/s)")
        return False

    async def _attack_observe_only(self, rng: random.Random) -> bool:
        """(f) an observe-only capability: observe ``<Observe $p $o>``, then send and
        assert to every observer reference learned, and through the capability itself.
        No well-behaved client may receive any of it."""
        name = "observe-only-cap"
        cap = attenuate(self.cap, _OBSERVE_ONLY)
        raw = await self._open(_ATTACK_SOURCE[name])
        pump: asyncio.Future[Outcome] | None = None
        try:
            try:
                ref = await raw.resolve(cap)
            except Refused as e:
                return self._record(name, e.outcome)
            learned: list[RemoteEntity] = []

            class Learner(Entity):
                def on_assert(self, value: Value, handle: int) -> None:
                    if isinstance(value, Sequence) and len(value) == 2:
                        o = value[1]
                        if isinstance(o, Embedded) and isinstance(o.value, RemoteEntity):
                            learned.append(o.value)
                    raw.notifier.notify()

            handles = itertools.count(2)
            ref.on_assert(Record(OBSERVE, [_OBSERVE_ANY, Embedded(Learner())]), next(handles))
            raw.flush_relay()
            pump = asyncio.ensure_future(raw.pump())
            await raw.notifier.until(lambda: len(learned) >= 3 * len(self.goods) or raw.eof,
                                     self.cfg.check_timeout)
            if raw.eof:
                return self._record(name, await pump)
            before = self.tally.poison_seen
            sends = 0
            for r in learned:
                for body in ([POISON], [f"{POISON}-f", 1], [f"{POISON}-f", "x", 2]):
                    r.on_message(Sequence(body))
                    r.on_assert(Sequence(body), next(handles))
                    sends += 2
            ref.on_message(Record(SAYS, [f"{POISON}-f", 1]))
            ref.on_assert(Record(PRESENT, [f"{POISON}-f"]), next(handles))
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            raw.relay.send_sync(ref, _SyncPeer(fut))
            raw.flush_relay()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(fut), self.cfg.check_timeout)
            # Whatever the server forwarded to a well-behaved client is there by the time
            # that client's own round trip returns.
            for g in self.goods:
                assert g.ds is not None
                with contextlib.suppress(TimeoutError, ConnectionError):
                    await g.ds.sync(timeout=self.cfg.check_timeout)
            if raw.relay.peer_error is not None or raw.eof:
                outcome = raw._relay_outcome()
            else:
                outcome = Outcome("dropped", f"{sends} events to {len(learned)} observer "
                                  "references dropped")
            self.tally.attacks[name].outcomes[outcome.kind] += 1
            ok = self.tally.check(fut.done() or raw.eof,
                                  f"attack {name}: no answer to sync from the server")
            return self.tally.check(self.tally.poison_seen == before,
                                    f"attack {name}: injected values reached well-behaved "
                                    "clients") and ok
        finally:
            raw.close()
            if pump is not None:
                pump.cancel()
                with contextlib.suppress(BaseException):
                    await pump

    async def _attack_memory(self, rng: random.Random) -> bool:
        """(g) the memory attack of issue 21: 40 connections from 10 addresses assert
        2 KB values as fast as the server takes them.  Each must be refused (the memory
        budget), never closed with an error; the budget is held full for a moment
        while the well-behaved clients, victims and probe go on."""
        name = "memory"
        stop = asyncio.Event()
        hogs: list[list[MemoryHog]] = []
        attack = asyncio.ensure_future(memory_attack(
            self.address, self.cap, stop, on_open=hogs.append, notify=self.notifier.notify,
            backoff=None))
        attack.add_done_callback(lambda _f: self.notifier.notify())
        try:
            # All connected (slowly, on a loaded machine) and the budget full (a first
            # refusal), then a few seconds for the others to be refused too.
            await self.notifier.until(
                lambda: attack.done() or self.stop.is_set()
                or bool(hogs and any(h.stats.refused for h in hogs[0])), 60.0)
            await self.notifier.until(
                lambda: attack.done() or self.stop.is_set()
                or bool(hogs and all(h.stats.refused for h in hogs[0])), 5.0)
            await _pause(self.stop, rng.uniform(0.2, 0.5))  # held full a moment
        finally:
            stop.set()
            stats = await attack
        # What they held goes with them (before the next attack, or the final checks; a
        # connection the server is not reading meanwhile -- in debt -- is seen closed
        # once it is read again).
        t = 3 * self.cfg.check_timeout
        gone = await self.notifier.until(lambda: not self.hogs_present, t)
        self.tally.check(gone, f"attack {name}: {plural(len(self.hogs_present), 'closed connection')}' "
                         f"assertions still held {t:g} s later")
        outcomes = self.tally.attacks[name].outcomes
        for st in stats:  # "held": not refused before the attack ended (under its share)
            outcomes["refused" if st.refused else "held" if st.sent else st.kind] += 1
        errors = [f"{st.kind}: {st.message}" for st in stats if st.kind not in ("open", "closed")]
        ok = self.tally.check(not errors, f"attack {name}: connections closed with an error "
                              f"(expected refusals only): {errors[:3]}")
        return self.tally.check(any(st.refused for st in stats) or self.stop.is_set(),
                                f"attack {name}: {len(stats)} connections asserting 2 KB "
                                "values as fast as they could were never refused") and ok

    # -- malformed input -----------------------------------------------------------------

    async def _fuzz_round(self, rng: random.Random, worker: int) -> None:
        if self._pool is None:
            self._pool = fuzz_corpus(self.cap_text)
        case = fuzz_case(rng, self._pool, self.limit["handshake-timeout"])
        t = self.tally
        source = _FUZZ_SOURCES[(worker + t.fuzz_cases) % len(_FUZZ_SOURCES)]
        outcome = await self._fuzz_one(source, case)
        t.fuzz_cases += 1
        t.fuzz_generators[case.generator] += 1
        t.fuzz_outcomes[outcome.kind] += 1
        if case.expect_close:
            t.check(outcome.by_server,
                    f"fuzz {case.generator}: the server neither answered nor closed within "
                    f"{case.wait:g} s; sent {b''.join(case.chunks)[:64].hex()}")

    async def _fuzz_one(self, source: str, case: FuzzCase) -> Outcome:
        try:
            raw = await self._open(source)
        except (OSError, TimeoutError) as e:
            if not self._server_gone():
                self.tally.fail(f"fuzz: cannot connect: {e}")
            return Outcome("no-connection")
        try:
            for c in case.chunks:
                if not await raw.send(c):
                    break
            return await raw.read_until_closed(case.wait)
        finally:
            raw.close()

    # -- kill -9 -------------------------------------------------------------------------

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 10.0)
        self.victim_procs.discard(proc)

    async def _victim(self, rng: random.Random, slot: int) -> None:
        """Start a client holding ``<Victim name>``, kill it with SIGKILL, and check that
        its assertion goes."""
        t = self.cfg.check_timeout
        self._victim_count += 1
        name = f"victim-{slot}-{self._victim_count}"
        proc = await asyncio.create_subprocess_exec(
            PY, "-m", "dataspace.cli", "assert", f'<Victim "{name}">',
            "--server", self.address, "--cap", f"@{self.cap_file}",
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.victim_procs.add(proc)
        try:
            early = rng.random() < 0.2
            if early:  # killed at a random moment, perhaps before it asserted
                await _pause(self.stop, rng.uniform(0.0, 1.0))
            else:
                exited = asyncio.ensure_future(proc.wait())
                exited.add_done_callback(lambda _f: self.notifier.notify())
                await self.notifier.until(lambda: name in self.victims or exited.done(), 3 * t)
                if name not in self.victims:
                    if self._server_gone():
                        return
                    if exited.done() and proc.stderr is not None:
                        err = (await proc.stderr.read()).decode("utf-8", "replace")
                        why = f"its client exited with status {proc.returncode}: {err[-300:].strip()!r}"
                    else:
                        why = f"not within {3 * t:g} s"
                    self.tally.fail(f"kill: <Victim {name!r}> never appeared: {why}")
                    return
                await _pause(self.stop, rng.uniform(0.1, 2.0))
            seen = name in self.victims
            t0 = time.monotonic()
            await self._kill(proc)
            self.tally.kills += 1
            if early:
                self.tally.early_kills += 1
            if seen:
                gone = await self.notifier.until(lambda: name not in self.victims, t)
                if self.tally.check(gone, f"kill: <Victim {name!r}> still present {t:g} s "
                                    "after its client was killed with SIGKILL"):
                    self.tally.kill_latencies.append(time.monotonic() - t0)
        finally:
            await self._kill(proc)

    # -- the summary ---------------------------------------------------------------------

    def summary(self, exit_status: int | None, error_lines: list[str],
                log_lines: list[str]) -> dict[str, Any]:
        t = self.tally
        p = self.probe
        lat = sorted(p.latencies) if p else []
        kills = sorted(t.kill_latencies)
        rss = sorted(t.rss_kib)
        warnings = sum(1 for line in log_lines if re.match(r"^\S+ \S+ WARNING ", line))
        return {
            "seconds": self.cfg.seconds,
            "elapsed": round(t.elapsed(), 1),
            "seed": self.seed,
            "clients": self.cfg.clients,
            "server_limits": self.cfg.limits,
            "probe": {
                "count": len(lat),
                "p50_ms": round(_pct(lat, 0.50) * 1000, 2),
                "p99_ms": round(_pct(lat, 0.99) * 1000, 2),
                "max_ms": round((lat[-1] if lat else 0.0) * 1000, 2),
                "failures": p.failures if p else 0,
                "failure_messages": p.failure_messages if p else [],
            },
            "checks": {"passed": t.checks, "failed": list(t.failures)},
            "clients_traffic": {
                "chat_sent": t.chat_sent, "chat_received": t.chat_received,
                "status_changes": t.status_changes,
            },
            "attacks": {
                name: {"runs": a.runs, "stopped": a.stopped, "outcomes": dict(a.outcomes)}
                for name, a in t.attacks.items()
            },
            "fuzz": {
                "cases": t.fuzz_cases,
                "generators": dict(t.fuzz_generators),
                "outcomes": dict(t.fuzz_outcomes),
            },
            "cluster": {
                "rejoins": len(t.rejoins),
                "rejoin_max_s": round(max(t.rejoins, default=0.0), 1),
                "stranger_flood": t.stranger_flood,
                "rogue_runs": t.rogue_runs,
            },
            "tls": {
                "runs": len(t.tls_runs),
                "peak_growth_mib": max((r["peak_growth_mib"] for r in t.tls_runs), default=0.0),
                "back_after_s": max((r["back_after_s"] for r in t.tls_runs), default=0.0),
                "https_closed_max_s": max((r["https_closed_max_s"] for r in t.tls_runs),
                                          default=0.0),
            },
            "kills": {
                "count": t.kills,
                "early": t.early_kills,
                "retraction_p50_ms": round(_pct(kills, 0.5) * 1000, 1),
                "retraction_max_ms": round((kills[-1] if kills else 0.0) * 1000, 1),
            },
            "server": {
                "pid": self.server.pid,
                "peak_rss_mib": round(t.hwm_kib / 1024, 1),
                "rss_growth_mib": round((self.rss_growth() or 0) / MIB, 1),
                "memory_budget_mib": round(self.limit.get("max-memory", 0) / MIB, 1),
                "rss_growth_limit_mib": round(
                    self.limit.get("max-memory", 0) * PEAK_ALLOWANCE / MIB, 1),
                "rss_settled_mib": (round((t.settled_kib - t.rss_kib[0]) / 1024, 1)
                                    if t.settled_kib is not None and t.rss_kib else None),
                "settled_after_s": round(t.settle_s, 1),
                "settle_limit_mib": SETTLE_MIB,
                "rss_mib": {
                    "first": round(t.rss_kib[0] / 1024, 1) if rss else 0.0,
                    "median": round(_pct(rss, 0.5) / 1024, 1) if rss else 0.0,
                    "max": round(rss[-1] / 1024, 1) if rss else 0.0,
                    "last": round(t.rss_kib[-1] / 1024, 1) if rss else 0.0,
                    "samples": len(rss),
                },
                "answered_at_end": self.answered_at_end,
                "log_lines": len(log_lines),
                "warnings": warnings,
                "error_lines": error_lines,
                "exit_status": exit_status,
            },
        }


def _say(text: str) -> None:
    """Progress output (standard error, flushed)."""
    sys.stderr.write(text)
    sys.stderr.flush()


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * (len(sorted_values) - 1) + 0.5))]


def verdict(summary: dict[str, Any], abort: str | None) -> tuple[bool, str]:
    """``(ok, reason)``: the one-line reason of a failure, or ``"pass"``."""
    server = summary["server"]
    probe = summary["probe"]
    failed = summary["checks"]["failed"]
    if abort:
        return False, abort
    if probe["failures"]:
        return False, f"{probe['failures']} probe failure(s): {probe['failure_messages'][0]}"
    if probe["count"] == 0:
        return False, "the probe made no round trip"
    if server["error_lines"]:
        return False, f"the server logged an error: {server['error_lines'][0]}"
    budget, limit = server.get("memory_budget_mib"), server.get("rss_growth_limit_mib")
    if budget and limit and server["rss_growth_mib"] >= limit:
        return False, (f"the server's RSS grew by {server['rss_growth_mib']:.0f} MiB during the "
                       f"run, more than {PEAK_ALLOWANCE:g} times its memory budget "
                       f"({budget:.0f} MiB, --max-memory)")
    if failed:
        return False, f"{len(failed)} failed check(s): {failed[0]}"
    if not server["answered_at_end"]:
        return False, "the server did not answer a new client at the end"
    if server["exit_status"] is None:
        return False, "the server did not stop within 20 s of SIGTERM (killed)"
    if server["exit_status"] != 0:
        return False, f"the server exited with status {server['exit_status']} on SIGTERM"
    return True, "pass"


# ---------------------------------------------------------------------------------------
# Running it


def run(config: SoakConfig) -> SoakResult:
    """Run a soak; the server is started and stopped here."""
    seed = config.seed if config.seed is not None else random.SystemRandom().randrange(1 << 32)
    tmp = Path(tempfile.mkdtemp(prefix="dataspace-soak-"))
    args = [*_limit_args(config.limits), *config.server_args]
    secret: Path | None = None
    if set(config.only or PARTS) & set(CLUSTER_PARTS):
        secret = write_secret(tmp / "cluster.secret")
        args += ["--cluster", "127.0.0.1:0", "--cluster-secret", str(secret)]
    server = ServerUnderTest(tmp / "data", args)
    soak: Soak | None = None
    try:
        server.start()
        soak = Soak(config, server, seed, secret)
        log.info("server pid %d on %s", server.pid, server.address)
        if not config.quiet:
            _say(f"soak: seed {seed} (repeat with --seed {seed}); {config.seconds:g} s, "
                 f"{config.clients} well-behaved clients; server pid {server.pid} on "
                 f"{server.address}: dataspace serve {' '.join(args)}\n")
        asyncio.run(soak.run())
        mem = server.memory_kib()
        if mem is not None:
            soak.tally.rss_kib.append(mem[0])
            soak.tally.hwm_kib = max(soak.tally.hwm_kib, mem[1])
    finally:
        exit_status = server.stop()
        log_lines = server.lines()
        if config.log_path:
            Path(config.log_path).write_text("\n".join(log_lines) + "\n")
        shutil.rmtree(tmp, ignore_errors=True)
    summary = soak.summary(exit_status, server.error_lines(), log_lines)
    ok, reason = verdict(summary, soak.abort)
    summary["result"] = "pass" if ok else "fail"
    summary["reason"] = reason
    return SoakResult(ok, reason, summary)


def _limit_args(limits: dict[str, float]) -> list[str]:
    out = []
    for k, v in limits.items():
        out += [f"--{k}", str(int(v)) if v == int(v) and abs(v) >= 1e6 else f"{v:g}"]
    return out


def format_summary(s: dict[str, Any]) -> str:
    """The summary as the lines printed at the end."""
    p, k, srv, ch = s["probe"], s["kills"], s["server"], s["checks"]
    lines = [
        f"soak: {s['elapsed']:g} s (asked {s['seconds']:g} s), seed {s['seed']}, "
        f"{s['clients']} well-behaved clients",
        f"probe: {p['count']} round trips, p50 {p['p50_ms']:.2f} ms, p99 {p['p99_ms']:.2f} ms, "
        f"max {p['max_ms']:.1f} ms, failures {p['failures']}",
    ]
    lines += [f"  probe failure: {m}" for m in p["failure_messages"]]
    tr = s["clients_traffic"]
    lines.append(f"checks: {ch['passed']} passed, {len(ch['failed'])} failed "
                 f"(chat {tr['chat_sent']} sent / {tr['chat_received']} received, "
                 f"{tr['status_changes']} status changes)")
    lines += [f"  FAILED {m}" for m in ch["failed"][:50]]
    if len(ch["failed"]) > 50:
        lines.append(f"  ... and {len(ch['failed']) - 50} more")
    rss = srv["rss_mib"]
    lines.append(f"server memory: peak RSS (VmHWM) {srv['peak_rss_mib']:.1f} MiB; VmRSS first "
                 f"{rss['first']:.1f}, median {rss['median']:.1f}, max {rss['max']:.1f}, last "
                 f"{rss['last']:.1f} MiB ({rss['samples']} samples)")
    if srv.get("memory_budget_mib"):
        lines.append(f"  grown by {srv['rss_growth_mib']:.1f} MiB at its peak (at most "
                     f"{srv['rss_growth_limit_mib']:.0f}: {PEAK_ALLOWANCE:g} x the memory budget, "
                     f"{srv['memory_budget_mib']:.0f} MiB)")
    if srv.get("rss_settled_mib") is not None:
        lines.append(f"  {srv['rss_settled_mib']:.1f} MiB above its start "
                     f"{srv['settled_after_s']:.0f} s after the attacks ended (at most "
                     f"{srv['settle_limit_mib']:g}: what they made it hold is given back)")
    lines.append("attacks (runs, stopped by the server, outcomes by error kind):")
    for name, a in s["attacks"].items():
        outcomes = ", ".join(f"{kind} {n}" for kind, n in sorted(a["outcomes"].items()))
        lines.append(f"  {name:20} {a['runs']:4} runs, {a['stopped']:4} stopped: {outcomes}")
    f = s["fuzz"]
    lines.append(f"fuzz: {f['cases']} cases ("
                 + ", ".join(f"{g} {n}" for g, n in sorted(f["generators"].items())) + ")")
    lines.append("  outcomes: " + ", ".join(
        f"{kind} {n}" for kind, n in sorted(f["outcomes"].items(), key=lambda kv: -kv[1])))
    c, tl = s["cluster"], s["tls"]
    fl = c["stranger_flood"]
    lines.append(f"cluster: {c['rejoins']} restarts of a member rejoined (slowest "
                 f"{c['rejoin_max_s']:.1f} s) with strangers on the cluster ports "
                 f"({plural(fl.get('opened', 0), 'connection')}, {fl.get('closed_by_server', 0)} closed "
                 f"by the members); {plural(len(c['rogue_runs']), 'rogue member')}' gossip runs")
    lines.append(f"tls: {tl['runs']} floods of a TLS server; RSS grew by at most "
                 f"{tl['peak_growth_mib']:.0f} MiB, back within {tl['back_after_s']:.1f} s; idle "
                 f"HTTPS connections closed after at most {tl['https_closed_max_s']:.1f} s")
    lines.append(f"kills: {k['count']} clients killed with SIGKILL ({k['early']} at a random "
                 f"moment); retraction seen after p50 {k['retraction_p50_ms']:.0f} ms, max "
                 f"{k['retraction_max_ms']:.0f} ms")
    lines.append(f"server log: {plural(srv['log_lines'], 'line')}, "
                 f"{plural(srv['warnings'], 'warning')}, "
                 f"{plural(len(srv['error_lines']), 'error line')}")
    lines += [f"  {line}" for line in srv["error_lines"][:200]]
    if len(srv["error_lines"]) > 200:
        lines.append(f"  ... and {len(srv['error_lines']) - 200} more")
    lines.append(f"server exit status after SIGTERM: {srv['exit_status']}")
    lines.append(f"result: {'PASS' if s['result'] == 'pass' else 'FAIL: ' + s['reason']}")
    return "\n".join(lines)


EXAMPLES = """\
examples:
  the long soak, 600 s (make soak-broker), and the short run of the tests:
    python -m dataspace.testing.broker_soak
    python -m dataspace.testing.broker_soak --seconds 45
  more clients and a seed; the summary as JSON and the server's whole log kept:
    python -m dataspace.testing.broker_soak --seconds 300 --clients 8 --seed 42
    python -m dataspace.testing.broker_soak --json s.json --log server.log
  some parts only, to find a culprit:
    python -m dataspace.testing.broker_soak --seconds 30 --only tls --only fuzz

The server runs with these limits (besides its defaults), so that each attack
reaches its limit within seconds:
""" + textwrap.fill(" ".join(_limit_args(SERVER_LIMITS)), 78, initial_indent="  ",
                    subsequent_indent="  ", break_on_hyphens=False) + """
Pass more `dataspace serve` options with --serve-arg (repeatable).

Exit status: 0 when no probe failed, no check failed (the server's RSS back
within """ + f"{SETTLE_MIB:g}" + """ MiB of its start once the attacks ended is one), the server
answered a new client at the end, logged nothing at ERROR or CRITICAL (nor a
traceback), its peak RSS grew by less than """ + f"{PEAK_ALLOWANCE:g}" + """ x --max-memory, and it
exited with status 0 on SIGTERM; 1 otherwise (the last line says why); 2 for bad
arguments.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dataspace.testing.broker_soak",
        description=textwrap.fill(
            "Run a real `dataspace serve` for a set time under well-behaved clients (with a "
            "round-trip probe), attacks, malformed input and kill -9 of clients; print the "
            "probe's latencies and failures, the server's peak memory, the attacks' "
            "outcomes and any error in the server's log.", 78),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seconds", type=float, default=600.0, metavar="N",
                   help="how long to run the mix (default 600)")
    p.add_argument("--clients", type=int, default=4, metavar="N",
                   help="well-behaved clients (default 4)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="random seed (default: a new one, printed)")
    p.add_argument("--only", action="append", choices=PARTS, default=[], metavar="PART",
                   help="run only this part besides the well-behaved clients and the probe "
                   f"(repeatable; one of: {', '.join(PARTS)}; default: all)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines; just the summary at the end")
    p.add_argument("--json", dest="json_path", metavar="FILE",
                   help="also write the summary to FILE as JSON")
    p.add_argument("--log", dest="log_path", metavar="FILE",
                   help="write the server's whole log to FILE")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="an extra option for `dataspace serve` (repeatable; e.g. "
                   "--serve-arg=--max-observers=500; the limits above are changed with "
                   "--serve-arg=--NAME=VALUE)")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log the soak's own steps (-v info, -vv debug)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m dataspace.testing.broker_soak``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.clients < 2:
        parser.error("--seconds must be positive and --clients at least 2")
    level = logging.ERROR if args.verbose == 0 else logging.INFO if args.verbose == 1 \
        else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limits = dict(SERVER_LIMITS)
    extra: list[str] = []
    for a in args.serve_arg:
        k, eq, v = a.partition("=")
        if eq and k.startswith("--") and k[2:] in limits:
            try:  # a limit the soak itself relies on: the attacks must know it too
                limits[k[2:]] = float(parse_size(v) if k == "--max-memory" else v)
                continue
            except (ValueError, ConfigError):
                parser.error(f"--serve-arg {a}: {v!r} is not a number")
        extra.append(a)
    cfg = SoakConfig(seconds=args.seconds, clients=args.clients, seed=args.seed,
                     quiet=args.quiet, server_args=extra, limits=limits, only=args.only,
                     log_path=args.log_path, json_path=args.json_path)
    try:
        result = run(cfg)
    except KeyboardInterrupt:
        _say("soak: interrupted\n")
        return 130
    except RuntimeError as e:
        _say(f"soak: {e}\n")
        return 1
    sys.stdout.write(format_summary(result.summary) + "\n")
    sys.stdout.flush()
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(result.summary, indent=2) + "\n")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
