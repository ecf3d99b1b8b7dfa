"""Connections: a relay, a send queue with back-pressure, and a transport.

:class:`Connection` holds what every transport shares -- the per-connection send queue,
its account (:mod:`.flow`), the slow-consumer rules and the orderly close (which retracts
everything the peer asserted).  :class:`StreamConnection` runs it over an asyncio stream
transport (TCP or a Unix socket), where packets are simply concatenated.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import stat
import time
from collections import deque
from collections.abc import Callable
from ssl import SSLContext
from typing import Any, cast

from ..protocol.relay import Relay
from ..values import Symbol
from .flow import Account, FlowLimits, Hub
from .sniff import HEAD_BYTES
from .tls import HANDSHAKE_TIMEOUT, server_protocol

__all__ = ["Connection", "SessionFactory", "StreamConnection", "connect_stream", "listen_tcp", "listen_unix"]

log = logging.getLogger(__name__)

SessionFactory = Callable[["Connection"], Relay]
"""Makes the relay for a new connection (the server sets up its gatekeeper there)."""

CLOSE_GRACE = 2.0
"""Seconds a closing connection has to take its last bytes before it is aborted."""

_ids = itertools.count(1)

THROTTLE_WINDOW = 60.0
"""Seconds over which the time a connection spent slowed is added up (see
``FlowLimits.throttle_limit``)."""


class Connection:
    """One peer: its relay, send queue, account and lifecycle (transport-independent)."""

    def __init__(self, hub: Hub, flow: FlowLimits, name: str = "peer") -> None:
        self.hub = hub
        self.flow = flow
        self.name = name
        self.id = next(_ids)
        """A number for this connection, unique in the process (for monitoring)."""
        self.since = time.time()
        """When the connection was made (seconds since the epoch)."""
        self.account = Account(
            name, flow.max_debt, lambda: self._hold("debt"), lambda: self._release("debt")
        )
        # Why reading is paused: "debt" (flow control), "input" (fair scheduling: input
        # waits for its next slice), "work" (over the work budget).
        self._holds: set[str] = set()
        self._slice_end = 0.0
        self._work_tokens = float(flow.work_burst)
        self._work_time = time.monotonic()
        self._throttled_at: float | None = None
        self._throttled: deque[tuple[float, float]] = deque()  # (end, seconds)
        self._work_timer: asyncio.TimerHandle | None = None
        self.throttled_seconds = 0.0
        """Seconds this connection spent slowed for exceeding its work budget."""
        self.peer_host: str | None = None
        """The peer's network address (no port), when it has one."""
        self.last_input = time.monotonic()
        """When input from the peer was last processed (``time.monotonic()``)."""
        self.relay: Relay | None = None
        self._queue: deque[tuple[bytes, Account | None]] = deque()
        self.queued = 0
        """Bytes waiting in the send queue (beyond what the transport buffers)."""
        self._drained = False
        self._stall: asyncio.TimerHandle | None = None
        self.closed = False
        self.close_reason: str | None = None
        self.bytes_in = 0
        self.bytes_out = 0
        self.max_input: int | None = None
        """Bytes the peer may send in all (None: no limit): a listener's bound on what a
        peer it does not know yet makes it hold (the cluster port's strangers)."""
        self.head = b""
        """The first bytes the peer sent (up to ``sniff.HEAD_BYTES``): what answered, when
        a handshake fails (:func:`dataspace.net.sniff.what_answered`)."""
        self.client_name: str | None = None
        """The name the peer gave itself (``<client-name "...">`` to the gatekeeper), if
        any: shown beside its address in monitoring."""
        self._closed_waiters: list[asyncio.Future[None]] = []
        self.on_close: list[Callable[[Connection], Any]] = []
        self.on_released: list[Callable[[Connection], Any]] = []
        """Called once everything the peer asserted has been retracted after a close."""
        self.held_at_close = 0
        """Assertions held in both directions when the connection closed."""

    # -- relay plumbing ------------------------------------------------------------------

    def attach(self, relay: Relay) -> None:
        self.relay = relay
        relay.on_dirty = self._relay_dirty
        relay.should_yield = self._should_yield
        relay.retract_chunk = self.flow.retract_chunk
        self.hub.connections.add(self)
        # Whatever the session set-up already produced (an error refusing the connection,
        # say) was queued before this hook existed: flush it now.
        self._relay_dirty(relay)

    def _relay_dirty(self, relay: Relay) -> None:
        if not self.closed:
            self.hub.mark_dirty(self)

    def flush_output(self, account: Account | None) -> None:
        """Send the relay's pending packets (called by the hub)."""
        relay = self.relay
        if relay is None:
            return
        packets = relay.take_packets()
        if self.closed:
            return
        if relay.wants_close:
            # A protocol error (or the peer's own error): the error packet goes out ahead
            # of anything still queued, then the connection closes.
            self._drop_queue()
            if packets:
                self._write_now(packets)
            msg = relay.error[0] if relay.error else "the peer reported an error"
            self._close(msg)
            return
        if packets:
            self._send(packets, account)
            relay.output_held(self.pending_output)  # the memory budget's account

    def fail(self, message: str, detail: Any = False, *, quiet: bool = False) -> None:
        """Close with ``<error message detail>``: for local decisions such as a slow
        consumer or a handshake timeout (the error skips the send queue).  ``quiet``:
        not worth a warning (a stranger turned away; the caller counts them)."""
        if self.closed or self.relay is None:
            return
        (log.debug if quiet else log.warning)("%s: closing: %s", self.name, message)
        self.hub.run(None, self._fail, message, detail)

    def _fail(self, message: str, detail: Any) -> None:
        self._drop_queue()
        relay = self.relay
        assert relay is not None
        relay.fail(message, detail)
        self.flush_output(None)

    # -- send queue ----------------------------------------------------------------------

    def _send(self, packets: list[bytes], account: Account | None) -> None:  # pragma: no cover
        raise NotImplementedError

    def _write_now(self, packets: list[bytes]) -> None:  # pragma: no cover
        raise NotImplementedError

    def _enqueue(self, data: bytes, account: Account | None) -> None:
        n = len(data)
        acc = account if account is not None and account is not self.account else None
        if acc is not None:
            acc.charge(n)
        self._queue.append((data, acc))
        self.queued += n
        hub = self.hub
        hub.buffered += n
        if hub.max_buffered is not None and hub.buffered > hub.max_buffered:
            hub.over_buffered()
            if self.closed:
                return
        if self.queued > self.flow.max_send_queue:
            self.fail(
                f"slow consumer: more than {self.flow.max_send_queue} bytes waiting to be sent",
                Symbol("slow-consumer"),
            )
            return
        if self._stall is None and self.flow.send_timeout:
            self._stall = asyncio.get_running_loop().call_later(
                self.flow.send_timeout, self._check_stall
            )

    def _dequeue(self) -> bytes:
        data, acc = self._queue.popleft()
        n = len(data)
        self.queued -= n
        self.hub.buffered -= n
        self._drained = True
        if acc is not None:
            acc.repay(n)
        return data

    def _drop_queue(self) -> None:
        q = self._queue
        while q:
            data, acc = q.popleft()
            if acc is not None:
                acc.repay(len(data))
        self.hub.buffered -= self.queued
        self.queued = 0

    def _check_stall(self) -> None:
        self._stall = None
        if self.closed or not self._queue:
            return
        if self._drained:
            self._drained = False
            self._stall = asyncio.get_running_loop().call_later(
                self.flow.send_timeout, self._check_stall
            )
            return
        self.fail(
            f"slow consumer: nothing could be sent for {self.flow.send_timeout:g} s",
            Symbol("slow-consumer"),
        )

    # -- reading -------------------------------------------------------------------------

    def _pause_reading(self) -> None:
        """Stop reading this peer (the transport's part of :meth:`_hold`)."""

    def _resume_reading(self) -> None:
        """Read this peer again (the transport's part of :meth:`_release`)."""

    def _hold(self, reason: str) -> None:
        if not self._holds:
            self._pause_reading()
        self._holds.add(reason)

    def _release(self, reason: str) -> None:
        holds = self._holds
        if reason in holds:
            holds.discard(reason)
            if not holds and not self.closed:
                self._resume_reading()

    def _should_yield(self) -> bool:
        return time.monotonic() >= self._slice_end

    def receive(self, fn: Callable[..., Any], *args: Any) -> None:
        """Process the peer's input (``fn(*args)``, e.g. ``relay.receive_data(chunk)``) in
        a time slice, charging what it costs; input left over when the slice ends is
        read in later slices, after every other connection has had its turn."""
        relay = self.relay
        assert relay is not None
        before = relay.events_out
        now = self.last_input = time.monotonic()
        self._slice_end = now + self.flow.quantum
        self.hub.run(self.account, fn, *args)
        self._charge_work(relay.events_out - before)
        if relay.input_paused and not self.closed:
            self._hold("input")
            asyncio.get_running_loop().call_soon(self._continue_input)

    def _continue_input(self) -> None:
        relay = self.relay
        if self.closed or relay is None:
            return
        if "work" in self._holds:
            return  # over budget: _work_refilled goes on
        self.receive(relay.resume_input)
        if not relay.input_paused:
            self._release("input")

    def _charge_work(self, events: int) -> None:
        """Charge the events this peer's own input made the server deliver back to it."""
        if not events or self.closed:
            return
        flow = self.flow
        now = time.monotonic()
        tokens = min(
            float(flow.work_burst), self._work_tokens + (now - self._work_time) * flow.work_rate
        )
        self._work_time = now
        tokens -= events
        self._work_tokens = tokens
        if tokens >= 0 or "work" in self._holds:
            return
        self._hold("work")
        self._throttled_at = now
        delay = -tokens / flow.work_rate
        self._work_timer = asyncio.get_running_loop().call_later(delay, self._work_refilled)

    def _work_refilled(self) -> None:
        self._work_timer = None
        now = time.monotonic()
        if self._throttled_at is not None:
            spent = now - self._throttled_at
            self._throttled_at = None
            self.throttled_seconds += spent
            window = self._throttled
            window.append((now, spent))
            while window and window[0][0] < now - THROTTLE_WINDOW:
                window.popleft()
            limit = self.flow.throttle_limit
            if limit and sum(w[1] for w in window) > limit:
                flow = self.flow
                self.fail(
                    f"too much work: this connection's own requests made the server deliver "
                    f"more than {flow.work_rate} events per second back to it, and it was "
                    f"slowed for over {limit:g} s of the last {THROTTLE_WINDOW:g} s; observe "
                    "narrower patterns, or use fewer observers of everything",
                    Symbol("work-limit"),
                )
                return
        self._release("work")
        relay = self.relay
        if relay is not None and relay.input_paused and not self.closed:
            self._continue_input()

    # -- closing -------------------------------------------------------------------------

    def _close_transport(self) -> None:  # pragma: no cover
        raise NotImplementedError

    def _close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        log.debug("%s: closed: %s", self.name, reason)
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self._work_timer is not None:
            self._work_timer.cancel()
            self._work_timer = None
        self._drop_queue()
        self.hub.connections.discard(self)
        relay = self.relay
        retracting = False
        if relay is not None:
            st = relay.stats()
            self.held_at_close = st["assertions_in"] + st["assertions_out"]
            # Retract everything the peer asserted, and tell the other connections now
            # (a peer holding very many assertions: a chunk per loop iteration).
            self.hub.run(None, relay.close)
            if relay.retracting:
                retracting = True
                asyncio.get_running_loop().call_soon(self._retract_more)
        with contextlib.suppress(Exception):
            self._close_transport()
        for fut in self._closed_waiters:
            if not fut.done():
                fut.set_result(None)
        self._closed_waiters.clear()
        for cb in self.on_close:
            try:
                cb(self)
            except Exception:
                log.exception("%s: close callback failed", self.name)
        if not retracting:
            self._released()

    def _released(self) -> None:
        for cb in self.on_released:
            try:
                cb(self)
            except Exception:
                log.exception("%s: release callback failed", self.name)

    def _retract_more(self) -> None:
        relay = self.relay
        if relay is None:
            return
        self.hub.run(None, relay.retract_more)
        if relay.retracting:
            asyncio.get_running_loop().call_soon(self._retract_more)
        else:
            self._released()

    def close(self, reason: str = "closed locally") -> None:
        """Close the connection (what the peer asserted is retracted)."""
        self._close(reason)

    async def wait_closed(self) -> None:
        if self.closed:
            return
        fut = asyncio.get_running_loop().create_future()
        self._closed_waiters.append(fut)
        await fut

    @property
    def writable(self) -> bool:
        """False while the transport is over its buffer limit or the queue is non-empty."""
        return not self._queue

    # -- monitoring ----------------------------------------------------------------------

    @property
    def pending_output(self) -> int:
        """Bytes waiting to go to the peer (the send queue, and what the transport holds)."""
        return self.queued

    @property
    def held_reasons(self) -> tuple[str, ...]:
        """Why the peer is not being read now: ``debt`` (flow control), ``work`` (over its
        work budget), ``input`` (waiting for its next time slice); empty when it is."""
        return tuple(sorted(self._holds))

    def throttled_total(self) -> float:
        """Seconds this connection has spent slowed for its work budget, now included."""
        t = self._throttled_at
        return self.throttled_seconds + (time.monotonic() - t if t is not None else 0.0)


class StreamConnection(Connection, asyncio.Protocol):
    """A connection over a stream transport (TCP, Unix socket): concatenated packets.

    ``coalesce`` buffers what is sent during one iteration of the event loop into one
    write (clients, which send many small packets); servers write once per inbound chunk
    anyway.
    """

    def __init__(
        self,
        hub: Hub,
        flow: FlowLimits,
        session: SessionFactory,
        *,
        name: str | None = None,
        coalesce: bool = False,
    ) -> None:
        super().__init__(hub, flow, name or "stream")
        self._session = session
        self._coalesce = coalesce
        self._wbuf: list[bytes] = []
        self._wsize = 0
        self._can_write = True
        self.transport: asyncio.Transport | None = None
        self._writable_waiters: list[asyncio.Future[None]] = []
        self._abort_timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not subclasses of asyncio.Transport).
        self.transport = cast(asyncio.Transport, transport)
        transport = self.transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer_host = str(peer[0])
        if peer and self.name in ("stream", "peer"):
            self.name = _peer_name(peer)
        self.account.name = self.name
        transport.set_write_buffer_limits(high=self.flow.write_buffer)
        _set_keepalive(transport.get_extra_info("socket"), self.flow.keepalive)
        try:
            relay = self._session(self)
        except Exception:
            log.exception("%s: cannot set up the session", self.name)
            transport.abort()
            self.closed = True
            return
        self.attach(relay)
        log.debug("%s: connected", self.name)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.bytes_in < HEAD_BYTES:
            self.head = (self.head + data)[:HEAD_BYTES]
        self.bytes_in += len(data)
        relay = self.relay
        assert relay is not None
        if self.max_input is not None and self.bytes_in > self.max_input:
            self.fail(f"more than {self.max_input} bytes sent before the handshake was done",
                      Symbol("packet-too-large"), quiet=True)
            return
        self.receive(relay.receive_data, data)

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._abort_timer is not None:
            self._abort_timer.cancel()
            self._abort_timer = None
        self.transport = None
        self._close(f"connection lost: {exc}" if exc else "connection closed by the peer")

    def pause_writing(self) -> None:
        self._can_write = False

    def resume_writing(self) -> None:
        self._can_write = True
        q = self._queue
        transport = self.transport
        while q and self._can_write and not self.closed and transport is not None:
            data = self._dequeue()
            self.bytes_out += len(data)
            transport.write(data)
        if not q:
            self._wake_writable()
        if self.relay is not None:
            self.relay.output_held(self.pending_output)

    def _pause_reading(self) -> None:
        if not self.closed and self.transport is not None:
            with contextlib.suppress(Exception):
                self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if not self.closed and self.transport is not None:
            with contextlib.suppress(Exception):
                self.transport.resume_reading()

    # sending

    def _send(self, packets: list[bytes], account: Account | None) -> None:
        if self._coalesce and not self._queue:
            wbuf = self._wbuf
            if not wbuf:
                asyncio.get_running_loop().call_soon(self._write_wbuf)
            for p in packets:
                wbuf.append(p)
                self._wsize += len(p)
            if self._wsize >= self.flow.write_buffer:
                self._write_wbuf()
            return
        data = packets[0] if len(packets) == 1 else b"".join(packets)
        if self._can_write and not self._queue and self.transport is not None:
            self.bytes_out += len(data)
            self.transport.write(data)
        else:
            self._enqueue(data, account)

    def _write_wbuf(self) -> None:
        wbuf = self._wbuf
        if not wbuf or self.closed:
            wbuf.clear()
            self._wsize = 0
            return
        data = b"".join(wbuf)
        wbuf.clear()
        self._wsize = 0
        if self._can_write and not self._queue and self.transport is not None:
            self.bytes_out += len(data)
            self.transport.write(data)
        else:
            self._enqueue(data, None)

    def _write_now(self, packets: list[bytes]) -> None:
        if self._wbuf:
            packets = [*self._wbuf, *packets]
            self._wbuf.clear()
            self._wsize = 0
        if self.transport is not None:
            data = b"".join(packets)
            self.bytes_out += len(data)
            self.transport.write(data)

    @property
    def writable(self) -> bool:
        return self._can_write and not self._queue

    @property
    def pending_output(self) -> int:
        t = self.transport
        held = 0
        if t is not None:
            with contextlib.suppress(Exception):
                held = t.get_write_buffer_size()
        return self.queued + self._wsize + held

    async def wait_writable(self) -> None:
        """Wait until the transport is below its buffer limit and the queue is empty."""
        if self._wbuf:
            self._write_wbuf()
        if self.closed or self.writable:
            return
        fut = asyncio.get_running_loop().create_future()
        self._writable_waiters.append(fut)
        await fut

    def _wake_writable(self) -> None:
        ws = self._writable_waiters
        self._writable_waiters = []
        for f in ws:
            if not f.done():
                f.set_result(None)

    def _close_transport(self) -> None:
        self._wake_writable()
        t = self.transport
        if t is None:
            return
        if self._wbuf:
            self._write_now([])
        pending = t.get_write_buffer_size()
        t.close()
        if pending:
            # Aborted unless it finishes first (connection_lost cancels this: aborting a
            # transport that has already gone fails inside asyncio).
            self._abort_timer = asyncio.get_running_loop().call_later(CLOSE_GRACE, t.abort)


def _peer_name(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = peer[0]
        return f"[{host}]:{peer[1]}" if ":" in str(host) else f"{host}:{peer[1]}"
    return f"unix:{peer}" if peer else "unix"


def _set_keepalive(sock: socket.socket | None, idle: float) -> None:
    if sock is None or not idle or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(idle)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    except OSError as e:  # pragma: no cover - platform-dependent
        log.debug("cannot set TCP keepalive: %s", e)


# ---------------------------------------------------------------------------------------
# Listening and connecting


async def listen_tcp(
    host: str, port: int, hub: Hub, flow: FlowLimits, session: SessionFactory,
    *, ssl: SSLContext | None = None, ssl_handshake_timeout: float | None = None,
) -> asyncio.Server:
    """Listen on TCP (with TLS when ``ssl`` is given: see :mod:`.tls`, whose buffers are
    bounded and counted there); each connection gets a relay from ``session`` once its
    TLS handshake is done."""
    loop = asyncio.get_running_loop()

    def plain() -> StreamConnection:
        return StreamConnection(hub, flow, session)

    if ssl is None:
        return await loop.create_server(plain, host, port, reuse_address=True)
    return await loop.create_server(
        server_protocol(plain, ssl, ssl_handshake_timeout or HANDSHAKE_TIMEOUT), host, port,
        reuse_address=True)


async def listen_unix(path: str, hub: Hub, flow: FlowLimits, session: SessionFactory) -> asyncio.Server:
    """Listen on a Unix stream socket at ``path`` (a stale socket file is replaced; a live
    one is an error)."""
    _remove_stale_socket(path)
    loop = asyncio.get_running_loop()
    return await loop.create_unix_server(
        lambda: StreamConnection(hub, flow, session, name=f"unix:{path}"), path
    )


def _remove_stale_socket(path: str) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} exists and is not a socket; choose another --unix path")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a leftover from a server that died
        return
    finally:
        s.close()
    raise OSError(f"another server is listening on {path}")


async def connect_stream(
    kind: str,
    where: tuple[str, int] | str,
    hub: Hub,
    flow: FlowLimits,
    session: SessionFactory,
    *,
    coalesce: bool = True,
    ssl: SSLContext | None = None,
    server_hostname: str | None = None,
    ssl_handshake_timeout: float | None = None,
) -> StreamConnection:
    """Connect over TCP (``where = (host, port)``) or a Unix socket (``where = path``);
    with TLS when ``ssl`` is given (the certificate is checked against
    ``server_hostname``, by default the host)."""
    loop = asyncio.get_running_loop()
    if kind == "unix":
        assert isinstance(where, str)
        _t, proto = await loop.create_unix_connection(
            lambda: StreamConnection(hub, flow, session, name=f"unix:{where}", coalesce=coalesce),
            where,
        )
    else:
        assert isinstance(where, tuple)
        tls: dict[str, Any] = {}
        if ssl is not None:
            tls = {"ssl": ssl, "server_hostname": server_hostname or where[0],
                   "ssl_handshake_timeout": ssl_handshake_timeout}
        _t, proto = await loop.create_connection(
            lambda: StreamConnection(hub, flow, session, coalesce=coalesce), where[0], where[1],
            **tls,
        )
    return proto
