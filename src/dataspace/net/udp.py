"""UDP for sans-IO datagram machines (scry): an asyncio endpoint that hands each datagram
to a callback and sends what it is given.  Nothing here knows the protocol."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["Datagrams", "open_udp"]

log = logging.getLogger(__name__)


class Datagrams(asyncio.DatagramProtocol):
    """One UDP socket: ``on_datagram(data, addr)`` for each datagram received."""

    def __init__(self, on_datagram: Callable[[bytes, Hashable], Any]) -> None:
        self.on_datagram = on_datagram
        self.transport: asyncio.DatagramTransport | None = None
        self.sent = 0
        self.received = 0
        self.errors = 0
        self.closed = asyncio.get_event_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.received += 1
        try:
            self.on_datagram(data, addr)
        except Exception:  # a bug in the machine's host must not close the socket
            log.exception("handling a datagram from %s failed", addr)

    def error_received(self, exc: Exception) -> None:
        # ICMP errors (a peer that is not listening, say): datagrams are unreliable anyway.
        self.errors += 1
        log.debug("UDP error: %s", exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def send(self, data: bytes, addr: Any = None) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        self.sent += 1
        if addr is None:
            t.sendto(data)
        else:
            t.sendto(data, addr)

    @property
    def address(self) -> tuple[str, int]:
        assert self.transport is not None
        return self.transport.get_extra_info("sockname")[:2]

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def open_udp(
    on_datagram: Callable[[bytes, Hashable], Any],
    *,
    local: tuple[str, int] | None = None,
    remote: tuple[str, int] | None = None,
) -> Datagrams:
    """Bind ``local`` (a server), or connect to ``remote`` (a client); returns the
    endpoint.  Raises OSError with the system's reason (address in use, say)."""
    loop = asyncio.get_running_loop()
    _t, proto = await loop.create_datagram_endpoint(
        lambda: Datagrams(on_datagram), local_addr=local, remote_addr=remote
    )
    return proto
