"""Thin asyncio adapters that move bytes between sockets and the protocol machines.

* :mod:`.address` -- parsing ``HOST:PORT``, ``unix:PATH`` and ``ws://`` addresses;
* :mod:`.flow` -- flow control: per-connection accounts (credit/debt) and the hub that
  flushes relays after each inbound chunk, charging the connection that caused the work;
* :mod:`.connection` -- a connection (send queue, back-pressure, slow-consumer
  disconnection) over TCP and Unix stream sockets;
* :mod:`.websocket` -- the same over WebSocket (one packet per binary message).

No protocol logic lives here: bytes go into a :class:`~dataspace.protocol.relay.Relay`
and packets come out of it.
"""

from .address import DEFAULT_HOST, DEFAULT_PORT, Address, AddressError, parse_address
from .connection import Connection, StreamConnection, connect_stream, listen_tcp, listen_unix
from .flow import Account, FlowLimits, Hub
from .websocket import WebSocketConnection, connect_ws, listen_ws

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "Account",
    "Address",
    "AddressError",
    "Connection",
    "FlowLimits",
    "Hub",
    "StreamConnection",
    "WebSocketConnection",
    "connect_stream",
    "connect_ws",
    "listen_tcp",
    "listen_unix",
    "listen_ws",
    "parse_address",
]
