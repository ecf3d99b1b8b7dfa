"""Flow control: send buffers, credit/debt accounts and the hub that flushes relays.

The model follows the Rust syndicate-server.  Every connection has an :class:`Account`.
When a connection's inbound bytes are processed (:meth:`Hub.run`), everything that work
queues for *other* connections and that cannot be handed to their sockets at once is
charged to the sender's account; the debt is repaid as those bytes drain to the sockets.
A connection whose debt exceeds ``max_debt`` is no longer read until the debt falls to
half of it, so a fast publisher slows down to what its consumers take, and the server's
memory stays bounded.

A consumer that does not keep up is disconnected (with an ``<error ...>`` packet), which
releases the publishers it was holding back:

* at once, when its send queue exceeds ``max_send_queue`` bytes;
* when its send queue has been non-empty for ``send_timeout`` seconds without draining.

Defaults (see :class:`FlowLimits`): 1 MiB of debt, 16 MiB of send queue, 30 s.

Work, not only bytes, is bounded too:

* **fair scheduling** -- a connection's input is processed for at most ``quantum``
  seconds at a time; the rest waits (the connection is not read meanwhile) until every
  other connection has had its turn;
* **work budget** -- the events a connection's own requests make the server deliver back
  to that same connection (its observers hearing its own assertions: a peer with many
  catch-all observers adding more of them costs the square of their number) are charged
  to a token bucket (``work_rate`` per second, ``work_burst`` at once); a connection over
  it is not read until the bucket refills, and one slowed for more than
  ``throttle_limit`` seconds within a minute is closed with a ``work-limit`` error;
* **server-wide buffers** -- the :class:`Hub` caps the bytes queued to all connections
  together (``max_buffered``): past it, the connection with the longest queue is
  disconnected as a slow consumer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..values import Symbol

__all__ = ["Account", "FlowLimits", "Hub", "Peer"]


@dataclass(frozen=True)
class FlowLimits:
    """Per-connection buffer and timing limits of the asyncio layer.

    * ``max_debt`` -- bytes a connection's turns may have queued, undrained, at other
      connections before it stops being read (default 1 MiB);
    * ``max_send_queue`` -- bytes queued to one connection beyond its socket buffer
      before it is disconnected as a slow consumer (default 16 MiB);
    * ``send_timeout`` -- seconds a connection's send queue may stay non-empty without
      draining before it is disconnected (default 30);
    * ``write_buffer`` -- bytes handed to the transport before queuing starts (default
      64 KiB);
    * ``handshake_timeout`` -- seconds a new server connection has to resolve a
      sturdyref (default 30; 0 disables);
    * ``keepalive`` -- seconds of TCP idleness before keepalive probes start (default
      60; dead peers are detected about 30 s later; 0 disables);
    * ``ws_ping_interval`` -- seconds between WebSocket pings (default 20; a peer that
      does not answer within the same time is disconnected; 0 disables);
    * ``quantum`` -- seconds of a connection's input processed before the others get a
      turn (default 0.01);
    * ``work_rate``, ``work_burst`` -- events per second (sustained, and at once) that a
      connection's own requests may make the server deliver back to it (defaults
      100,000 and 1,000,000);
    * ``throttle_limit`` -- seconds a connection may be slowed for exceeding its work
      budget within a minute before it is closed (default 10; 0 never closes);
    * ``retract_chunk`` -- a closing connection's assertions are retracted this many per
      turn, so that one holding very many does not stall the others (default 5,000).
    """

    max_debt: int = 1 << 20
    max_send_queue: int = 16 << 20
    send_timeout: float = 30.0
    write_buffer: int = 64 * 1024
    handshake_timeout: float = 30.0
    keepalive: float = 60.0
    ws_ping_interval: float = 20.0
    quantum: float = 0.01
    work_rate: int = 100_000
    work_burst: int = 1_000_000
    throttle_limit: float = 10.0
    retract_chunk: int = 5_000

    def __post_init__(self) -> None:
        for name in ("max_debt", "max_send_queue", "write_buffer", "work_rate", "work_burst",
                     "retract_chunk"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be a positive integer, not {v!r}")
        for name in ("send_timeout", "handshake_timeout", "keepalive", "ws_ping_interval",
                     "quantum", "throttle_limit"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative number of seconds, not {v!r}")


class Account:
    """The debt of one connection: bytes its turns queued, not yet drained, elsewhere."""

    __slots__ = ("debt", "limit", "name", "on_pause", "on_resume", "paused", "total_charged")

    def __init__(
        self,
        name: str,
        limit: int,
        on_pause: Callable[[], Any] | None = None,
        on_resume: Callable[[], Any] | None = None,
    ) -> None:
        self.name = name
        self.limit = limit
        self.debt = 0
        self.paused = False
        self.on_pause = on_pause
        self.on_resume = on_resume
        self.total_charged = 0

    def charge(self, n: int) -> None:
        self.debt += n
        self.total_charged += n
        if not self.paused and self.debt > self.limit:
            self.paused = True
            if self.on_pause is not None:
                self.on_pause()

    def repay(self, n: int) -> None:
        self.debt -= n
        if self.paused and self.debt <= self.limit >> 1:
            self.paused = False
            if self.on_resume is not None:
                self.on_resume()

    def __repr__(self) -> str:
        return f"<Account {self.name} debt={self.debt} paused={self.paused}>"


class Peer(Protocol):
    """What the hub needs of a connection (net.connection.Connection is one)."""

    queued: int

    def flush_output(self, account: Account | None) -> None: ...

    def fail(self, message: str, detail: Any = False) -> None: ...


class Hub:
    """Collects connections with pending output and flushes them.

    :meth:`run` processes one inbound chunk for a connection and then flushes every
    connection that work made dirty, charging the sender's account.  Output that becomes
    pending outside :meth:`run` (timers, client API calls) is flushed on the next
    iteration of the event loop.

    ``max_buffered`` caps the bytes queued to all its connections together (None: no
    cap); :attr:`buffered` is that total.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop | None = None, *, max_buffered: int | None = None
    ) -> None:
        self._loop = loop
        self._dirty: list[Peer] = []
        self._depth = 0
        self._scheduled = False
        self.max_buffered = max_buffered
        self.buffered = 0
        """Bytes queued to all connections, beyond what their transports hold."""
        self.connections: set[Peer] = set()
        """Open connections (each adds itself, and goes when it closes)."""

    def over_buffered(self) -> None:
        """The server-wide buffer cap is passed: disconnect the longest queue."""
        if not self.connections:
            return
        worst = max(self.connections, key=lambda c: c.queued)
        if worst.queued:
            worst.fail(
                f"slow consumer: the server's buffers are full ({self.max_buffered} bytes) "
                f"and this connection had the most waiting ({worst.queued} bytes)",
                Symbol("slow-consumer"),
            )

    @property
    def active(self) -> bool:
        """True while inside :meth:`run` (output is flushed when it returns)."""
        return self._depth > 0

    def mark_dirty(self, conn: Peer) -> None:
        self._dirty.append(conn)
        if self._depth == 0 and not self._scheduled:
            self._scheduled = True
            loop = self._loop or asyncio.get_running_loop()
            loop.call_soon(self._flush_scheduled)

    def run(self, account: Account | None, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)``, then flush the connections it made dirty (charging
        ``account`` for what they cannot send at once)."""
        self._depth += 1
        try:
            fn(*args)
        finally:
            try:
                self.flush(account)
            finally:
                self._depth -= 1

    def _flush_scheduled(self) -> None:
        self._scheduled = False
        self._depth += 1
        try:
            self.flush(None)
        finally:
            self._depth -= 1

    def flush(self, account: Account | None) -> None:
        """Flush every dirty connection now."""
        dirty = self._dirty
        while dirty:
            self._dirty = []
            for conn in dirty:
                conn.flush_output(account)
            dirty = self._dirty
