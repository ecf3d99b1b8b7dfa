"""The dataspace server: dataspaces behind a gatekeeper, reachable over the network.

>>> import asyncio
>>> async def main():
...     server = Server(ServerConfig(tcp=["127.0.0.1:0"]), data_dir=tmp)   # doctest: +SKIP
...     await server.start()
...     print(server.sturdyref, server.addresses)
...     await server.close()

Each connection gets a :class:`~dataspace.protocol.relay.Relay` exporting a
:class:`~dataspace.protocol.gatekeeper.Gatekeeper` at OID 0.  A client resolves a
sturdyref there and receives a reference to a dataspace (the root one, or one a config
binding names), through which it asserts, observes and sends.  When a connection ends --
closed, timed out, killed, or cut for a protocol error -- everything it asserted is
retracted.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any, Protocol

from ..datadir import ROOT_KEY, ROOT_STURDYREF, load_or_create_key, resolve_data_dir
from ..dataspace import Dataspace, DataspaceEntity
from ..groups import Groups
from ..net.address import Address
from ..net.connection import Connection, listen_tcp, listen_unix
from ..net.flow import Hub
from ..net.reclaim import malloc_trim
from ..net.tls import HANDSHAKE_TIMEOUT, CertInfo, ServerTLS
from ..net.websocket import listen_ws
from ..protocol.budget import MemoryBudget, format_bytes
from ..protocol.gatekeeper import Binding, Bindings, Gatekeeper
from ..protocol.groups import Rank
from ..protocol.relay import Quota, Relay
from ..protocol.route import MessageRouter
from ..protocol.sturdy import SturdyRef, mint
from ..values import Symbol
from .cluster import CLUSTER_STATUS_FILE, Cluster, CountedWarnings
from .config import ConfigError, ServerConfig
from .grouplinks import GroupLinks
from .link import STATUS_FILE, LinkDialer, LinkHub, load_server_id, write_status_file

__all__ = ["ERROR_KINDS", "DurableSource", "ListenError", "Server", "SyncGate", "error_kind",
           "listen_error"]

log = logging.getLogger(__name__)


class ListenError(OSError):
    """A listener could not start; the message says why and what to do."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


_LISTEN_HINTS = {
    errno.EADDRINUSE: "address already in use (is another `dataspace serve` running? stop "
    "it, or choose another port)",
    errno.EACCES: "permission denied (ports below 1024 need privileges: use a port above "
    "1023, or another path)",
    errno.EADDRNOTAVAIL: "that address is not one of this machine's (use 127.0.0.1, 0.0.0.0 "
    "or an address of one of its interfaces)",
}


def listen_error(e: OSError, where: str, option: str) -> ListenError:
    """The one-line error for a listener that could not start: the address, the option
    that asked for it (``--tcp``, ``--http``, ``--scry-udp`` ...) and what to do."""
    why = _LISTEN_HINTS.get(e.errno) if e.errno is not None else None
    if why is None:
        why = (e.strerror or str(e)).lower() if e.errno is not None else str(e)
    return ListenError(e.errno or 0, f"cannot listen on {where} for {option}: {why}")


class DurableSource(Protocol):
    """Something that makes what a server is told durable (a stream recorder)."""

    def mark(self) -> Any:
        """A token for everything received so far."""

    def reached(self, mark: Any) -> bool:
        """Whether everything up to ``mark`` is durable (or cannot become so: failed)."""

    @property
    def failed(self) -> BaseException | None:
        """Why it stopped making things durable, if it did."""


class SyncGate:
    """Holds a peer's sync answer until what it sent before is durable in every source.

    With no source every sync is answered at once.  Held answers are released in the
    order they were held (each mark is at or past the one before it), when
    :meth:`progress` (thread-safe) reports that a source moved.  If a source fails, the
    held syncs' connections are closed with a ``store-failed`` error instead: their
    peers must not believe that what they sent is durable.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.sources: list[DurableSource] = []
        self._held: deque[tuple[tuple[Any, ...], Callable[[], None], Relay]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self.held_total = 0
        """Syncs whose answer had to wait for durability (a counter)."""

    def hold(self, answer: Callable[[], None], relay: Relay) -> bool:
        sources = self.sources
        if not sources:
            return False
        marks = tuple(s.mark() for s in sources)
        if not self._held and all(s.reached(m) for s, m in zip(sources, marks)):
            return False
        self._held.append((marks, answer, relay))
        self.held_total += 1
        return True

    def progress(self) -> None:
        """A source made more durable (call from any thread)."""
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self.release)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def release(self) -> None:
        """Answer every held sync whose marks are reached, in order."""
        with self._lock:
            self._scheduled = False
        held = self._held
        sources = self.sources
        while held:
            marks, answer, relay = held[0]
            failed = next((s.failed for s in sources if s.failed is not None), None)
            if failed is not None:
                held.popleft()
                relay.fail(
                    f"the stream store failed ({failed}); what this connection sent may not "
                    "be recorded", Symbol("store-failed"))
                continue
            if not all(s.reached(m) for s, m in zip(sources, marks)):
                return
            held.popleft()
            answer()

    def __len__(self) -> int:
        return len(self._held)


RECLAIM_AFTER = 10_000
"""A connection that held more assertions than this makes the server give memory back to
the operating system once they are gone (a full garbage collection, then ``malloc_trim``)."""
RECLAIM_BYTES = 32 << 20
"""So do connections closing when what the memory budget counts has fallen by this much
(or an eighth of the budget, if more) since its high point."""
RECLAIM_CLOSES = 64
"""And so do this many connections closing, however little each held, or one the server
closed for an error (at most every 10 s, as for TLS connections): a connection's objects
hold each other in cycles (an error's traceback holds the input that caused it), which the
collector, tuned to run seldom (``cli/serve.py``), frees only at a full collection --
under a churn of short connections (malformed input, reconnect loops, attackers closed for
a limit) that garbage grew a server by 17-22 MB before one came."""


ERROR_KINDS = ("protocol", "limit", "slow_consumer", "timeout", "capability", "store",
               "internal", "peer")
"""The kinds of errors that close connections, as counted in :attr:`Server.errors`."""

_ERROR_KIND = {
    "packet-too-large": "limit", "too-many-assertions": "limit", "too-many-references": "limit",
    "too-many-observers": "limit", "too-many-matches": "limit", "turn-too-large": "limit",
    "server-full": "limit", "work-limit": "limit", "memory-full": "limit",
    "slow-consumer": "slow_consumer",
    "idle-timeout": "timeout", "handshake-timeout": "timeout",
    "store-failed": "store",
    "internal-error": "internal",
}


def error_kind(detail: Any) -> str:
    """The kind (one of :data:`ERROR_KINDS`) of a protocol error's ``detail``."""
    if type(detail) is Symbol:
        return _ERROR_KIND.get(detail.name, "protocol")
    return "protocol"


_TOTALS = ("bytes_in", "bytes_out", "messages_in", "messages_out", "turns_in")

CONNECTION_OVERHEAD = 16 << 10
"""Bytes the memory budget counts for each open connection besides what it holds (its
relay, tables and transport: measured about 12 KiB)."""
MEMORY_REFRESH = 0.5
"""Seconds between updates of the memory budget's view of buffers and connections."""

STATUS_SOON = 0.2
"""Seconds from a change of the links to its status written (``links.json``, read by
``dataspace link status``); changes meanwhile are written together."""
STATUS_EVERY = 2.0
"""Seconds between status writes while there are links (their counters move)."""


class _Arrivals:
    """New connections per source address, as token buckets (bounded in size)."""

    MAX_ADDRESSES = 10_000

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.burst = max(1.0, 10 * rate)
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, time)

    def admit(self, address: str, now: float) -> bool:
        if not self.rate:
            return True
        b = self._buckets
        tokens, then = b.pop(address, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        ok = tokens >= 1.0
        if ok:
            tokens -= 1.0
        b[address] = (tokens, now)  # most recent last: the oldest go first below
        if len(b) > self.MAX_ADDRESSES:
            for stale in list(b)[: len(b) // 10]:
                del b[stale]
        return ok


class Server:
    """A running (after :meth:`start`) dataspace server.

    * ``config`` -- a :class:`~dataspace.broker.config.ServerConfig`;
    * ``data_dir`` -- overrides the configured data directory.

    After :meth:`start`: :attr:`sturdyref` (the root capability), :attr:`addresses`
    (where it listens, with real port numbers), :attr:`dataspaces`.
    """

    def __init__(self, config: ServerConfig | None = None, *, data_dir: str | Path | None = None) -> None:
        self.config = config or ServerConfig()
        self.relay_limits = self.config.relay_limits()
        self.flow = self.config.flow_limits()
        self._data_dir_arg = data_dir if data_dir is not None else self.config.data_dir
        self.data_dir: Path | None = None
        self.dataspaces: dict[str, Dataspace] = {}
        self._entities: dict[str, DataspaceEntity] = {}
        self.bindings = Bindings()
        self.root_binding: Binding | None = None
        """The binding of the root capability (its oid and key): full authority."""
        self.sturdyref: SturdyRef | None = None
        self.addresses: list[Address] = []
        self.connections: set[Connection] = set()
        limit = self.config.memory_limit()
        self.memory: MemoryBudget | None = MemoryBudget(limit) if limit else None
        """The memory budget (``max-memory``; None when it is off): charged by every
        connection's relay, refreshed with buffers and :attr:`memory_sources`."""
        self.memory_sources: list[Callable[[], int]] = []
        """Bytes held for clients outside the connections (scry readers: the serve
        command adds these), counted in the memory budget."""
        self._memory_timer: asyncio.TimerHandle | None = None
        self._held_high = 0  # the most the budget's relays held since memory was given back
        self._reclaimed_at = 0.0
        self._closes = 0  # connections closed since memory was last given back
        self.quota = Quota(self.config.max_total_assertions, self.memory)
        self._per_address: dict[str, int] = {}
        self._arrivals = _Arrivals(self.config.connect_rate)
        # Connections closed for a timeout: one warning per cause, then a count a minute
        # (a flood of idle clients is a few lines, not one each).
        self._timeouts = CountedWarnings(log)
        self._gatekeepers: dict[Connection, Gatekeeper] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._reclaim_timer: asyncio.TimerHandle | None = None
        self.reclaimed = 0
        """Times the server gave memory back after a large connection went."""
        self.refused = 0
        """Connections refused (limits, connect rate, shutting down)."""
        self.accepted = 0
        """Connections accepted since the start."""
        self.errors: dict[str, int] = dict.fromkeys(ERROR_KINDS, 0)
        """Connections closed for an error, by kind (see :data:`ERROR_KINDS`)."""
        self.closed_totals: dict[str, int] = dict.fromkeys(_TOTALS, 0)
        """Bytes, messages and turns of the connections that have closed (see
        :meth:`totals`)."""
        self.started_at: float | None = None
        """When :meth:`start` ran (seconds since the epoch)."""
        self.resolved: dict[Connection, list[tuple[str, bool]]] = {}
        """Per open connection, the dataspaces it resolved a capability for, with whether
        that capability carries caveats."""
        self.hub: Hub | None = None
        self.links: dict[str, LinkHub] = {}
        """The link hub of each dataspace (see broker.link), made by :meth:`start`."""
        self.server_id = ""
        self.cluster: Cluster | None = None
        """This member's routes, when the server is in a cluster (``--cluster``)."""
        self.cluster_status_extra: list[Callable[[], dict[str, Any]]] = []
        """What others add to :meth:`cluster_status` (the serve command: recording)."""
        self.before_listening: list[Callable[[], None]] = []
        """Called by :meth:`start` once the dataspaces exist, before links, routes and
        listeners start: what must see everything clients and peers send (the serve
        command's recorders, so that no sync is answered before they are in place)."""
        self._status_timer: asyncio.TimerHandle | None = None
        self.sync_gate: SyncGate | None = None
        """Holds sync answers until recorded messages are durable (see
        :meth:`add_durable_source`); made by :meth:`start`."""
        self.tls: ServerTLS | None = None
        """The certificate every TCP, WebSocket and HTTP listener serves (None: no TLS);
        made by :meth:`start`, reloaded by :meth:`reload_tls`."""
        self.route_tls: ServerTLS | None = None
        """The same certificate for the cluster port (its own connections' accounts); made
        by :meth:`start` on a cluster member with a certificate, reloaded with the others."""
        self._listeners: list[Any] = []
        self._unix_paths: list[str] = []
        self._turn: Callable[[], AbstractContextManager[Any]] | None = None
        self._stopping = False

    # -- setup ---------------------------------------------------------------------------

    def _dataspace(self, name: str) -> DataspaceEntity:
        ent = self._entities.get(name)
        if ent is None:
            ds = self.dataspaces[name] = Dataspace(name)
            ds.max_turn_events = self.config.max_turn_events
            MessageRouter(ds)  # messages from peers are routed on their bytes
            Groups.of(ds)  # groups of observers: <ObserveGroup ...> (docs/broker.md)
            ent = self._entities[name] = DataspaceEntity(ds)
        return ent

    def _setup(self) -> None:
        cfg = self.config
        self.data_dir = resolve_data_dir(self._data_dir_arg)
        key = cfg.root_key if cfg.root_key is not None else load_or_create_key(self.data_dir / ROOT_KEY)
        root = self._dataspace("root")
        self.root_binding = self.bindings.bind(cfg.root_oid, key, root, "root")
        for b in cfg.bind:
            if not b.key:
                log.warning(
                    "binding for %r uses an empty key: anyone can make sturdyrefs for it", b.oid
                )
            self.bindings.bind(b.oid, b.key, self._dataspace(b.dataspace), b.dataspace)
        dss = list(self.dataspaces.values())
        if len(dss) == 1:
            self._turn = dss[0].turn
        else:
            self._turn = lambda: _all_turns(dss)
        self.sturdyref = mint(cfg.root_oid, key)
        _write_private(self.data_dir / ROOT_STURDYREF, str(self.sturdyref) + "\n")

    async def start(self) -> None:
        """Create the dataspaces, write ``root.sturdyref`` and start every listener.

        Raises ``OSError`` (with a message saying what to do) when a listener cannot
        start, and :class:`~dataspace.broker.config.ConfigError` for bad settings.
        """
        self.config.check()
        self.tls = self.config.server_tls()
        if self.tls is not None:  # its connections' buffers (net.tls.TLSConnections)
            self.memory_sources.append(self.tls.connections.held_bytes)
        warning = self.config.clear_text_warning()
        if warning is not None:
            log.warning("%s", warning)
        self._setup()
        self.started_at = time.time()
        loop = asyncio.get_running_loop()
        self.hub = Hub(loop, max_buffered=self.config.buffered_limit())
        self.sync_gate = SyncGate(loop)
        for fn in self.before_listening:
            fn()
        self._schedule_sweep()
        if self.memory is None:
            log.warning("max-memory is off: clients can make the server hold memory without "
                        "bound (set --max-memory, e.g. 1G)")
        else:
            log.info("memory budget for clients: %s (--max-memory)",
                     format_bytes(self.memory.limit))
            self._refresh_memory()
        self._start_links(loop)
        try:
            await self._start_cluster()
            for addr in self.config.listeners():
                await self._listen(addr)
        except BaseException:
            await self.close()
            raise

    async def _listen(self, addr: Address) -> None:
        assert self.hub is not None
        ssl = self.tls.context if self.tls is not None and addr.secure else None
        try:
            if addr.kind in ("tcp", "tls"):
                srv = await listen_tcp(addr.host, addr.port, self.hub, self.flow, self._session,
                                       ssl=ssl, ssl_handshake_timeout=HANDSHAKE_TIMEOUT)
                for sock in srv.sockets:
                    host, port = sock.getsockname()[:2]
                    self.addresses.append(Address(addr.kind, host, port))
            elif addr.kind == "unix":
                srv = await listen_unix(addr.path, self.hub, self.flow, self._session)
                self._unix_paths.append(addr.path)
                self.addresses.append(addr)
            elif addr.kind in ("ws", "wss"):
                srv = await listen_ws(
                    addr.host, addr.port, self.hub, self.flow, self._session,
                    self.relay_limits.max_packet_size, ssl=ssl,
                    ssl_handshake_timeout=HANDSHAKE_TIMEOUT,
                )
                for sock in srv.sockets:
                    host, port = sock.getsockname()[:2]
                    self.addresses.append(Address(addr.kind, host, port, addr.path or "/"))
            else:  # pragma: no cover - parse_address only makes these kinds
                raise ConfigError(f"unknown listener kind {addr.kind}")
        except OSError as e:
            where = f"{addr.host}:{addr.port}" if addr.kind == "ws" else str(addr)
            raise listen_error(e, where, f"--{addr.kind}") from None
        self._listeners.append(srv)
        log.info("listening on %s", self.addresses[-1])

    def reload_tls(self) -> CertInfo | None:
        """Read the certificate, key and CA files again (SIGHUP) for every listener that
        serves them -- TCP, WebSocket, HTTP and the cluster port -- and for the routes
        this member dials (the certificate it shows, the CA it checks): connections made
        from now on get them, open ones keep theirs.  Raises
        :class:`~dataspace.net.tls.TLSConfigError` (saying why; every previous
        certificate stays in service) when the files cannot be used; does nothing without
        TLS."""
        if self.tls is None:
            return None
        # (The routes' client context first: it reads the CA file too, and if it cannot
        # be made nothing has changed yet.)
        dial = self.config.route_client_tls() if self.route_tls is not None else None
        info = self.tls.reload()
        if self.route_tls is not None:
            self.route_tls.reload()
        if self.cluster is not None and dial is not None:
            self.cluster.ssl_client = dial
        return info

    # -- links to other servers ---------------------------------------------------------

    def _start_links(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.data_dir is not None and self.hub is not None
        self.server_id = load_server_id(self.data_dir)
        # Groups across links and routes: this server's rank to coordinate a group's jobs
        # (a cluster member before a leaf, then the older: its start, which is also its
        # routes' incarnation, then its id).
        assert self.started_at is not None
        rank = Rank(not self.config.cluster, self.started_at, self.server_id)
        for name, ent in self._entities.items():
            h = LinkHub(ent.dataspace, server_id=self.server_id, bindings=self.bindings,
                        loop=loop, name=name, connections=lambda: list(self.connections))
            h.status_writer = self._links_changed
            h.groups = GroupLinks(h, Groups.of(ent.dataspace), rank)
            self.links[name] = h
        root = self.links["root"]
        for spec in self.config.link_specs():
            d = LinkDialer(root, spec, self.hub, self._turn)
            if self.memory is not None:  # what the peer asserts to us is held for clients
                d.quota = Quota(sys.maxsize, self.memory)
            root.dialers.append(d)
            d.start()
            log.info("linking to %s", spec.address)
        if root.dialers:
            self._links_changed()

    async def _start_cluster(self) -> None:
        assert self.data_dir is not None and self.hub is not None
        spec = self.config.cluster_spec(self.data_dir)
        if spec is None:
            return
        self.route_tls, ssl_client = self.config.route_tls()
        ssl_server = self.route_tls.context if self.route_tls is not None else None
        root = self.links["root"]
        self.cluster = Cluster(root, spec, self.hub, turn=root.route_turn(self._turn),
                               ssl_server=ssl_server, ssl_client=ssl_client)
        assert self.started_at is not None  # (the incarnation is the groups' rank too)
        self.cluster.incarnation = (self.started_at, self.cluster.incarnation[1])
        if self.memory is not None:  # what other members assert here is held for clients
            self.cluster.quota = Quota(sys.maxsize, self.memory)
        self.memory_sources.append(self.cluster.held_bytes)  # (strangers on its port)
        try:
            await self.cluster.start()
        except OSError as e:
            raise listen_error(e, spec.listen, "--cluster") from None
        self._links_changed()

    def cluster_status(self) -> dict[str, Any] | None:
        """The cluster's members and routes (``dataspace cluster status``), or None;
        with what each of :attr:`cluster_status_extra` adds (recording in a cluster)."""
        if self.cluster is None:
            return None
        st = self.cluster.status()
        for fn in self.cluster_status_extra:
            try:
                st.update(fn())
            except Exception:  # a monitor's bug must not stop the status
                log.exception("a cluster status source failed")
        return st

    def _links_changed(self) -> None:
        """Write the links' status soon: within 0.2 s of a change, changes meanwhile
        written together (and every 2 s while there are links)."""
        if self._stopping:
            return
        loop = asyncio.get_running_loop()
        soon = loop.time() + STATUS_SOON
        timer = self._status_timer
        if timer is not None:
            if timer.when() <= soon:
                return
            timer.cancel()  # the 2-second write: a change does not wait for it
        self._status_timer = loop.call_at(soon, self._write_links)

    def _write_links(self) -> None:
        self._status_timer = None
        if self.data_dir is None or self._stopping:
            return
        try:
            write_status_file(self.data_dir / STATUS_FILE, list(self.links.values()))
        except OSError as e:
            log.warning("cannot write %s: %s", self.data_dir / STATUS_FILE, e)
        if self.cluster is not None:
            try:
                _write_json(self.data_dir / CLUSTER_STATUS_FILE, self.cluster_status())
            except OSError as e:
                log.warning("cannot write %s: %s", self.data_dir / CLUSTER_STATUS_FILE, e)
        if self.cluster is not None or any(h.dialers or h.sessions or h.gone
                                           for h in self.links.values()):
            self._status_timer = asyncio.get_running_loop().call_later(
                STATUS_EVERY, self._write_links)

    @property
    def stopping(self) -> bool:
        """True once :meth:`close` has begun."""
        return self._stopping

    def entity(self, name: str) -> DataspaceEntity:
        """The entity through which peers reach dataspace ``name`` (KeyError if none)."""
        return self._entities[name]

    def link_status(self) -> list[dict[str, Any]]:
        """Every link of every dataspace (what ``dataspace link status`` shows)."""
        return [row for h in self.links.values() for row in h.status()]

    def add_durable_source(self, source: DurableSource) -> None:
        """From now on a peer's sync is answered only once everything it sent before is
        durable in ``source`` too (a stream recorder: call :meth:`SyncGate.progress`
        when it commits).  Call after :meth:`start`."""
        assert self.sync_gate is not None, "start() the server first"
        self.sync_gate.sources.append(source)

    # -- connections ---------------------------------------------------------------------

    def _session(self, conn: Connection) -> Relay:
        relay = Relay(limits=self.relay_limits, name=conn.name, turn=self._turn, quota=self.quota)
        gate = self.sync_gate
        if gate is not None:
            relay.sync_gate = lambda answer: gate.hold(answer, relay)
        gk = Gatekeeper(self.bindings, on_rejected=relay.fail,
                        on_accepted=lambda b, ref: self._resolved(conn, b.name, bool(ref.caveats)),
                        on_name=lambda name: self._named(conn, name))
        relay.export_at(0, gk)
        refusal = self._refusal(conn)
        if refusal is not None:
            self.refused += 1
            conn.on_released.append(self._released)  # (its garbage counts too)
            relay.fail(*refusal)
            return relay
        self.accepted += 1
        self.connections.add(conn)
        host = conn.peer_host
        if host is not None:
            self._per_address[host] = self._per_address.get(host, 0) + 1
        self._gatekeepers[conn] = gk
        conn.on_close.append(self._closed)
        conn.on_released.append(self._released)
        t = self.flow.handshake_timeout
        if t:
            timer = asyncio.get_running_loop().call_later(t, self._handshake_check, conn, gk)
            conn.on_close.append(lambda _c: timer.cancel())
        log.info("%s: connected", conn.name)
        return relay

    def _refusal(self, conn: Connection) -> tuple[str, Symbol] | None:
        """Why a new connection is refused, or None (checked before it costs anything)."""
        cfg = self.config
        if self._stopping:
            return ("the server is shutting down", Symbol("shutdown"))
        host = conn.peer_host
        if host is not None and not self._arrivals.admit(host, time.monotonic()):
            log.debug("%s: refused: connecting too often", conn.name)
            return (f"too many new connections from {host} (more than {cfg.connect_rate:g} "
                    "per second); wait before reconnecting", Symbol("connect-rate"))
        if len(self.connections) >= cfg.max_connections:
            log.warning("%s: refused: %d connections already", conn.name, len(self.connections))
            return (f"too many connections ({cfg.max_connections}); try again later",
                    Symbol("too-many-connections"))
        limit = cfg.per_address_limit()
        if host is not None and self._per_address.get(host, 0) >= limit:
            log.warning("%s: refused: %d connections from %s already", conn.name, limit, host)
            return (f"too many connections from {host} (the limit is {limit} per address); "
                    "close some, or raise --max-connections-per-address",
                    Symbol("too-many-connections"))
        return None

    def _named(self, conn: Connection, name: str | None) -> None:
        if name is not None and name != conn.client_name:
            log.info("%s: the client calls itself %r", conn.name, name)
        conn.client_name = name

    def _resolved(self, conn: Connection, dataspace: str, attenuated: bool) -> None:
        if conn in self.connections:
            self.resolved.setdefault(conn, []).append((dataspace, attenuated))

    def _closed(self, conn: Connection) -> None:
        self.connections.discard(conn)
        gk = self._gatekeepers.pop(conn, None)
        self.resolved.pop(conn, None)
        t = self.closed_totals
        t["bytes_in"] += conn.bytes_in
        t["bytes_out"] += conn.bytes_out
        relay = conn.relay
        if relay is not None:
            t["messages_in"] += relay.messages_in
            t["messages_out"] += relay.messages_out
            t["turns_in"] += relay.turns_in
            if relay.error is not None:
                kind = "capability" if gk is not None and gk.rejected else error_kind(relay.error[1])
                self.errors[kind] += 1
            elif relay.peer_error is not None:
                self.errors["peer"] += 1
        host = conn.peer_host
        if host is not None:
            n = self._per_address.get(host, 0) - 1
            if n > 0:
                self._per_address[host] = n
            else:
                self._per_address.pop(host, None)
        log.info("%s: disconnected (%s)", conn.name, conn.close_reason)
        if self.hub is not None:  # its memberships of groups end now: their jobs move
            self.hub.run(None, self._reap_groups)

    def _reap_groups(self) -> None:
        for ds in self.dataspaces.values():
            g = Groups.find(ds)
            if g is not None:
                g.reap()

    def _released(self, conn: Connection) -> None:
        self._closes += 1
        if self._reclaim_timer is not None:
            return
        delay = 0.5 if conn.held_at_close > RECLAIM_AFTER else None
        b = self.memory
        many = self._closes >= RECLAIM_CLOSES
        fallen = b is not None and self._held_high - b.held > max(RECLAIM_BYTES, b.limit >> 3)
        # One the server closed for an error (a limit, malformed input): what it made the
        # server hold (its output refused, its observers' matches, the input that failed)
        # waits in cycles too -- 3 catch-all attackers left 14 MB until a collection.
        failed = conn.relay is not None and conn.relay.error is not None
        if delay is None and (many or fallen or failed):
            # Many smaller ones went (a large part of the budget, or many connections), or
            # an offender: not more often than every 10 s (a collection stalls the server
            # for a moment).
            delay = max(0.5, self._reclaimed_at + 10.0 - time.monotonic())
        if delay is not None:
            self._reclaim_timer = asyncio.get_running_loop().call_later(delay, self._reclaim)

    def _reclaim(self) -> None:
        """Give memory back: what a large peer held is retracted by now."""
        self._reclaim_timer = None
        self._closes = 0
        t0 = time.perf_counter()
        for ent in self._entities.values():
            ent.compact()
        gc.collect()
        trim = malloc_trim()
        if trim is not None:
            trim(0)
        self.reclaimed += 1
        self._reclaimed_at = time.monotonic()
        if self.memory is not None:
            self.memory.trimmed()
        self._held_high = self.memory.held if self.memory is not None else 0
        log.info("gave memory back to the system in %.0f ms", 1000 * (time.perf_counter() - t0))

    # -- the memory budget ---------------------------------------------------------------

    def _refresh_memory(self) -> None:
        """Count what the relays do not charge themselves: each connection's unread
        input, a fixed cost per connection, and :attr:`memory_sources`; and tell each
        relay how much of its output is still held (it drains without telling)."""
        self._memory_timer = None
        budget = self.memory
        if budget is None or self._stopping:
            return
        extra = 0
        for conn in self.connections:
            extra += CONNECTION_OVERHEAD
            relay = conn.relay
            if relay is not None:
                extra += relay.buffered
                relay.output_held(conn.pending_output)
        for source in self.memory_sources:
            try:
                extra += source()
            except Exception:  # a source's bug must not stop the accounting
                log.exception("a memory source failed")
        budget.extra = extra
        if budget.held > self._held_high:
            self._held_high = budget.held
        if budget.used > budget.peak:  # (the relays update it only past three quarters)
            budget.peak = budget.used
        self._memory_timer = asyncio.get_running_loop().call_later(
            MEMORY_REFRESH, self._refresh_memory)

    def memory_stats(self) -> dict[str, Any]:
        """The memory budget: ``limit`` (0: off), ``used``, ``held`` (assertions and
        deliveries), ``output`` (waiting for peers), ``refused`` assertions and ``peak``
        used."""
        b = self.memory
        if b is None:
            return {"limit": 0, "used": 0, "held": 0, "output": 0, "refused": 0, "peak": 0}
        return {"limit": b.limit, "used": b.used, "held": b.held, "output": b.output,
                "refused": b.refused, "peak": b.peak}

    # -- idle connections ----------------------------------------------------------------

    def _schedule_sweep(self) -> None:
        t = self.config.idle_timeout
        if t:
            self._sweeper = asyncio.get_running_loop().call_later(
                min(5.0, max(0.05, t / 4)), self._sweep
            )

    def _sweep(self) -> None:
        """Close resolved connections that hold nothing and sent nothing for
        ``idle_timeout`` seconds."""
        t = self.config.idle_timeout
        now = time.monotonic()
        for conn, gk in list(self._gatekeepers.items()):
            relay = conn.relay
            if conn.closed or relay is None or not gk.accepted:
                continue
            if now - conn.last_input < t:
                continue
            if relay.stats()["assertions_in"] > gk.pending:
                continue  # it holds assertions (or observers): not idle
            why = f"idle: the connection held nothing and sent nothing for {t:g} s"
            self._timeouts.say("idle-timeout", f"{conn.name}: closing: {why}", now,
                               debug=False)  # (conn.fail says each at DEBUG)
            conn.fail(why, Symbol("idle-timeout"), quiet=True)
        if not self._stopping:
            self._schedule_sweep()

    def _handshake_check(self, conn: Connection, gk: Gatekeeper) -> None:
        if not conn.closed and gk.accepted == 0:
            why = f"no sturdyref resolved within {self.flow.handshake_timeout:g} s"
            self._timeouts.say("handshake-timeout", f"{conn.name}: closing: {why}",
                               time.monotonic(), debug=False)  # (conn.fail: at DEBUG)
            conn.fail(why, Symbol("handshake-timeout"), quiet=True)

    # -- running and stopping ------------------------------------------------------------

    async def close(self) -> None:
        """Stop listening and close every connection (their assertions are retracted)."""
        self._stopping = True
        for timer in (self._sweeper, self._reclaim_timer, self._status_timer, self._memory_timer):
            if timer is not None:
                timer.cancel()
        self._sweeper = self._reclaim_timer = self._status_timer = self._memory_timer = None
        if self.cluster is not None:
            await self.cluster.close()
        for h in self.links.values():
            h.close()
        for h in self.links.values():
            for d in h.dialers:
                await d.wait_stopped()
        for srv in self._listeners:
            srv.close()
        for conn in list(self.connections):
            conn.close("the server is shutting down")
        for srv in self._listeners:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(srv.wait_closed(), 5.0)
        self._listeners.clear()
        for p in self._unix_paths:
            with contextlib.suppress(OSError):
                os.unlink(p)
        self._unix_paths.clear()

    def totals(self) -> dict[str, int]:
        """Bytes in and out, messages in (sent by peers) and out (delivered to peers) and
        turns applied, over every connection since the start (open and closed)."""
        out = dict(self.closed_totals)
        for conn in self.connections:
            out["bytes_in"] += conn.bytes_in
            out["bytes_out"] += conn.bytes_out
            relay = conn.relay
            if relay is not None:
                out["messages_in"] += relay.messages_in
                out["messages_out"] += relay.messages_out
                out["turns_in"] += relay.turns_in
        return out

    def resolve_requests(self, conn: Connection) -> tuple[int, int]:
        """The protocol's own part of ``conn``'s assertion counts: its live gatekeeper
        ``resolve`` requests (among the assertions it holds), and the answers to them
        asserted back to it (among what it is sent).  A client that resolved one
        capability and asserted one value holds 2 and is sent 1; the user's counts are
        the relay's tables minus these (see docs/operations.md)."""
        gk = self._gatekeepers.get(conn)
        if gk is None:
            return 0, 0
        relay = conn.relay
        answers = sum(1 for o in gk.answered() if getattr(o, "relay", None) is relay)
        return gk.pending, answers

    def stats(self) -> dict[str, Any]:
        """Connections, assertions held by peers, buffered bytes, refusals, and per
        dataspace the number of distinct assertions."""
        return {
            "connections": len(self.connections),
            "assertions": self.quota.assertions,
            "buffered": self.hub.buffered if self.hub is not None else 0,
            "refused": self.refused,
            "memory": self.memory_stats(),
            "dataspaces": {n: len(ds.assertions()) for n, ds in self.dataspaces.items()},
        }


@contextlib.contextmanager
def _all_turns(dss: list[Dataspace]) -> Iterator[None]:
    with ExitStack() as stack:
        for ds in dss:
            stack.enter_context(ds.turn())
        yield


def _write_json(path: Path, doc: Any) -> None:
    import json

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")
    os.replace(tmp, path)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable by the owner only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
