"""Connections over WebSocket (the ``websockets`` library): one packet per binary message.

A reader task feeds each message to the relay (pausing while the connection's account
is over its debt limit); a writer task sends the queued packets and repays the accounts
that were charged for them.  Keepalive pings detect dead peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from ssl import SSLContext
from typing import Any

from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidMessage,
    InvalidStatus,
    InvalidURI,
)

from ..values import Symbol
from .connection import Connection, SessionFactory
from .flow import Account, FlowLimits, Hub
from .sniff import HEAD_BYTES

__all__ = ["WebSocketConnection", "connect_ws", "listen_ws"]

log = logging.getLogger(__name__)


class WebSocketConnection(Connection):
    """A connection over an open WebSocket (client or server side)."""

    def __init__(self, hub: Hub, flow: FlowLimits, ws: Any, name: str = "ws") -> None:
        super().__init__(hub, flow, name)
        self.ws = ws
        self._wake = asyncio.Event()
        self._readable = asyncio.Event()
        self._readable.set()
        self._writer: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._closer: asyncio.Task[None] | None = None
        self._final: list[bytes] = []

    def start(self, session: SessionFactory) -> None:
        self.attach(session(self))
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())

    async def run(self) -> None:
        """Read until the connection ends (the server's per-connection handler)."""
        relay = self.relay
        assert relay is not None
        try:
            while not self.closed:
                if not self._readable.is_set():
                    await self._readable.wait()
                    continue
                msg = await self.ws.recv()
                if self.bytes_in < HEAD_BYTES and isinstance(msg, bytes):
                    self.head = (self.head + msg)[:HEAD_BYTES]
                self.bytes_in += len(msg)
                if isinstance(msg, str):
                    self.fail("text WebSocket message: send each packet as one binary message",
                              Symbol("text-message"))
                    break
                self.receive(relay.receive_packet, msg)
                if self._should_yield():
                    await asyncio.sleep(0)  # let the other connections have their turn
        except ConnectionClosed as e:
            self._close(f"connection closed ({e.rcvd.code if e.rcvd else 'no close frame'})")
        except asyncio.CancelledError:
            self._close("cancelled")
            raise
        finally:
            self._close("connection ended")
            if self._closer is not None:
                with contextlib.suppress(Exception):
                    await self._closer

    def start_reading(self) -> None:
        """Run :meth:`run` as a task (clients)."""
        self._reader = asyncio.get_running_loop().create_task(self.run())

    def _pause_reading(self) -> None:
        self._readable.clear()

    def _resume_reading(self) -> None:
        self._readable.set()

    def _send(self, packets: list[bytes], account: Account | None) -> None:
        self._idle.clear()
        for p in packets:
            self._enqueue(p, account)
        self._wake.set()

    def _write_now(self, packets: list[bytes]) -> None:
        # Last words (an error packet): the writer sends these once the queue is done.
        self._final += packets
        self._wake.set()

    async def _write_loop(self) -> None:
        q = self._queue
        try:
            while True:
                if not q:
                    if self._final:
                        final, self._final = self._final, []
                        for data in final:
                            await self.ws.send(data)
                        continue
                    self._idle.set()
                    if self.closed:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                data, acc = q.popleft()
                n = len(data)
                self.queued -= n
                self._drained = True
                self.bytes_out += n
                try:
                    await self.ws.send(data)
                finally:
                    if acc is not None:
                        acc.repay(n)
        except ConnectionClosed:
            self._close("connection closed while sending")
        except asyncio.CancelledError:
            pass

    def _close_transport(self) -> None:
        self._wake.set()
        self._readable.set()
        self._idle.set()
        if self._closer is None:
            self._closer = asyncio.get_running_loop().create_task(self._close_ws())

    async def _close_ws(self) -> None:
        # Let the last packets (an error, typically) go out, briefly, then close.
        if self._writer is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._writer), 2.0)
            self._writer.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self.ws.close(), 2.0)

    @property
    def writable(self) -> bool:
        return not self._queue

    async def wait_writable(self) -> None:
        """Wait until every queued packet has been handed to the WebSocket."""
        if not self.closed:
            await self._idle.wait()


_NOT_HTTP_BODY = b"this is a WebSocket port of a dataspace server: connect to ws://HOST:PORT/\n"
NOT_HTTP_RESPONSE = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_NOT_HTTP_BODY), _NOT_HTTP_BODY))
"""What a WebSocket listener answers to a peer whose first byte cannot start an HTTP
request: a client of the Syndicate protocol over TCP, or TLS to a ``ws`` listener.  The
WebSocket layer would wait for the end of a request line that never comes (10 s); this
way the client learns at once that the port speaks HTTP (see :mod:`.sniff`)."""


class _ServerConnection(ServerConnection):
    """The WebSocket layer's connection, answering at once a peer that does not speak HTTP."""

    _first = True

    def data_received(self, data: bytes) -> None:
        if self._first and data:
            self._first = False
            # Every HTTP request starts with its method, ASCII letters (GET).
            if not data[:1].isalpha():
                log.info("ws: a peer sent %r first, not an HTTP request: answered 400",
                         data[:HEAD_BYTES // 4])
                self.transport.write(NOT_HTTP_RESPONSE)
                self.transport.close()
                return
        super().data_received(data)


async def listen_ws(
    host: str, port: int, hub: Hub, flow: FlowLimits, session: SessionFactory, max_packet: int,
    *, ssl: SSLContext | None = None, ssl_handshake_timeout: float | None = None,
) -> Server:
    """Serve WebSocket connections on ``host:port`` (any path); ``wss`` when ``ssl`` is
    given (see :mod:`.tls`)."""

    async def handler(ws: ServerConnection) -> None:
        peer = ws.remote_address
        name = f"ws:{peer[0]}:{peer[1]}" if peer else "ws"
        conn = WebSocketConnection(hub, flow, ws, name)
        if peer:
            conn.peer_host = str(peer[0])
        try:
            conn.start(session)
        except Exception:
            log.exception("%s: cannot set up the session", name)
            return
        await conn.run()

    ping = flow.ws_ping_interval or None
    tls: dict[str, Any] = {}
    if ssl is not None:
        tls = {"ssl": ssl, "ssl_handshake_timeout": ssl_handshake_timeout}
    return await serve(
        handler,
        host,
        port,
        **tls,
        # Messages up to twice the packet limit reach the relay, which answers those over
        # the limit with an <error>; larger ones are refused by the WebSocket layer (1009).
        max_size=2 * max_packet,
        compression=None,
        ping_interval=ping,
        ping_timeout=ping,
        write_limit=flow.write_buffer,
        create_connection=_ServerConnection,
    )


async def connect_ws(
    url: str, hub: Hub, flow: FlowLimits, session: SessionFactory, max_packet: int,
    *, ssl: SSLContext | None = None, server_hostname: str | None = None,
) -> WebSocketConnection:
    """Open a WebSocket connection to ``url`` (``wss://`` with ``ssl``, whose certificate
    is checked against ``server_hostname``, by default the URL's host) and start reading
    it."""
    ping = flow.ws_ping_interval or None
    tls: dict[str, Any] = {}
    if ssl is not None:
        tls = {"ssl": ssl}
        if server_hostname:
            tls["server_hostname"] = server_hostname
    try:
        ws = await ws_connect(
            url,
            **tls,
            max_size=2 * max_packet,
            compression=None,
            ping_interval=ping,
            ping_timeout=ping,
            write_limit=flow.write_buffer,
        )
    except InvalidStatus as e:
        status = e.response.status_code
        raise ConnectionError(
            f"{url} is not a WebSocket port: that port speaks HTTP but answered the "
            f"WebSocket request with HTTP {status} (is it the --http port? connect to the "
            "server's --ws port, or to its TCP port as HOST:PORT)") from e
    except InvalidMessage as e:
        raise ConnectionError(
            f"{url} is not a WebSocket port: that port does not answer in HTTP (is it the "
            "broker's TCP port? then connect as HOST:PORT, without ws://)") from e
    except (InvalidHandshake, InvalidURI) as e:
        raise ConnectionError(f"WebSocket handshake with {url} failed: {e}") from e
    conn = WebSocketConnection(hub, flow, ws, f"ws:{url}")
    conn.start(session)
    conn.start_reading()
    return conn
