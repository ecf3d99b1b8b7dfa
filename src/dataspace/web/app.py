"""The HTTP port of the server: one aiohttp application on the broker's event loop.

The application is assembled from *route modules*: each is an object (usually a Python
module) with a ``setup(app, ctx)`` function that adds its routes, its startup and
shutdown hooks and its state to the :class:`aiohttp.web.Application`.  They are the
scry gateway (:mod:`dataspace.web.scry`), metrics, the JSON endpoints and the
inspector's pages (:mod:`dataspace.web.inspector`), each in its own module::

    server = await start_http("127.0.0.1", 7480, store=store, publish=["chat"],
                              server=broker, modules=[scry, metrics])

Everything a route module needs is in the :class:`WebContext` (``app[CONTEXT]``): the
stream store, the published stream names, the broker :class:`~dataspace.broker.Server`
and :meth:`WebContext.run_store`, which runs a store call on the port's own threads --
the store serialises its calls with a lock that a writer holds for a whole transaction
(fsync included, or up to the busy timeout when another process writes), so a store
call on the event loop could stall every connection of the broker.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..net.tls import server_protocol
from ..streams.base import Store, check_stream_name
from . import broker, dataspaces, inspector, metrics, scry, streams
from .auth import is_loopback
from .context import CONTEXT, RouteModule, WebContext, errors_middleware, headers_middleware

__all__ = ["DEFAULT_MODULES", "FIRST_REQUEST_TIMEOUT", "HttpServer", "make_app", "start_http"]

log = logging.getLogger(__name__)


class _QuietBadRequests(logging.Filter):
    """A malformed request (bad request line, headers too long ...) is the peer's
    mistake: aiohttp answers it 400 and would log a traceback at ERROR for each; here it
    is one debug line, so a peer cannot fill the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            log.debug("%s: %s", record.getMessage(), exc.message)
            return False
        return True


_server_log = logging.getLogger("dataspace.web.server")
_server_log.addFilter(_QuietBadRequests())

DEFAULT_MODULES: tuple[RouteModule, ...] = (scry, broker, dataspaces, streams, metrics,
                                            inspector)
"""The route modules :func:`start_http` serves unless told otherwise: the scry gateway,
the server's state (``/healthz``, ``/api/server``, ``/api/connections``, ``/api/links``),
the dataspaces (``/api/subscriptions``, ``/api/assertions``, ``/api/watch``), the stream
store (``/api/streams``, ``/api/pipelines``, ``/api/stream/NAME``), ``/metrics`` and the
web inspector's pages (``/``, ``/inspector/PAGE``)."""


def make_app(ctx: WebContext, modules: Iterable[RouteModule] | None = None) -> web.Application:
    """The HTTP application: ``ctx`` and the routes of every module in ``modules``
    (default: :data:`DEFAULT_MODULES`)."""
    app = web.Application(middlewares=[headers_middleware, errors_middleware],
                          client_max_size=64 * 1024)
    app[CONTEXT] = ctx
    for m in DEFAULT_MODULES if modules is None else modules:
        m.setup(app, ctx)

    async def _close_context(app: web.Application) -> None:
        await ctx.close()

    app.on_cleanup.append(_close_context)
    return app


FIRST_REQUEST_TIMEOUT = 30.0
"""Seconds a connection to the HTTP port has to send its first request (after its TLS
handshake, which has :data:`dataspace.net.tls.HANDSHAKE_TIMEOUT`) before it is closed: the
server's handshake timeout (``--handshake-timeout``), as for its other listeners."""


class _Idle:
    """Connections that sent nothing yet, closed after the first-request deadline."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.closed = 0


class _FirstRequest(asyncio.Protocol):
    """aiohttp's protocol for one connection, closed if no byte of a request arrives
    within the deadline (aiohttp itself waits for a first request for ever; its
    keep-alive timeout starts after a response)."""

    def __init__(self, inner: asyncio.Protocol, idle: _Idle) -> None:
        self.inner = inner
        self.idle = idle
        self.transport: asyncio.BaseTransport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self.idle.timeout > 0:
            self.timer = asyncio.get_running_loop().call_later(self.idle.timeout, self._expire)
        self.inner.connection_made(transport)

    def _expire(self) -> None:
        self.timer = None
        t = self.transport
        if t is not None and not t.is_closing():
            self.idle.closed += 1
            log.debug("HTTP: closing a connection that sent no request within %g s",
                      self.idle.timeout)
            t.abort()

    def data_received(self, data: bytes) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.transport = None
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class _Site(web.TCPSite):
    """aiohttp's TCP site, with the first-request deadline and the server's TLS
    connections (their buffers bounded and counted: :mod:`dataspace.net.tls`)."""

    __slots__ = ("_idle",)

    def __init__(self, runner: web.AppRunner, host: str, port: int, *,
                 ssl_context: ssl.SSLContext | None, idle: _Idle) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context)
        self._idle = idle

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        idle = self._idle

        def plain() -> asyncio.Protocol:
            return _FirstRequest(server(), idle)

        factory: Callable[[], asyncio.BaseProtocol] = plain
        if self._ssl_context is not None:
            factory = server_protocol(plain, self._ssl_context)
        self._server = await asyncio.get_running_loop().create_server(
            factory, self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]
        else:
            self._bound_port = self._port


class HttpServer:
    """A running HTTP port: :attr:`url`, :attr:`host`, :attr:`port` (the real one when
    0 was asked), :attr:`app`, :attr:`secure` (HTTPS); :meth:`close` stops it;
    :attr:`idle_closed` counts the connections closed for sending no request in time."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, secure: bool = False,
                 idle: _Idle | None = None) -> None:
        self.runner = runner
        self.host = host
        self.port = port
        self.secure = secure
        self._idle = idle or _Idle(0.0)

    @property
    def idle_closed(self) -> int:
        return self._idle.closed

    @property
    def app(self) -> web.Application:
        app = self.runner.app
        assert isinstance(app, web.Application)
        return app

    @property
    def url(self) -> str:
        """``http://HOST:PORT/`` or ``https://HOST:PORT/`` (an IPv6 host in brackets)."""
        scheme = "https" if self.secure else "http"
        return f"{scheme}://{_url_host(self.host)}:{self.port}/"

    async def close(self) -> None:
        """Stop listening, end every request in progress (event streams end cleanly,
        long polls answer 503), release the store threads.  Idempotent."""
        await self.runner.cleanup()

    def __repr__(self) -> str:
        return f"<HttpServer {self.url}>"


def _url_host(host: str) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    except ValueError:
        pass
    return host


async def start_http(
    host: str,
    port: int,
    *,
    store: Store | None,
    publish: Sequence[str],
    server: Any = None,
    modules: Iterable[RouteModule] | None = None,
    shutdown_timeout: float = 5.0,
    open_access: bool = False,
    recorders: Sequence[Any] = (),
    ssl_context: ssl.SSLContext | None = None,
    first_request_timeout: float = FIRST_REQUEST_TIMEOUT,
    **settings: Any,
) -> HttpServer:
    """Serve HTTP on ``host:port`` (port 0: a free one) in the running event loop; HTTPS
    with ``ssl_context`` (the broker's :attr:`~dataspace.net.tls.ServerTLS.http_context`,
    so that a reloaded certificate is served here too).

    ``store`` and ``publish`` (stream names) are what the scry gateway serves; ``server``
    is the broker (for the routes that describe it) and ``recorders`` its stream
    recorders (for ``/metrics`` and ``/api/server``).  The monitoring routes ask for a
    capability of ``server`` as a bearer token unless ``open_access`` (allowed on a
    loopback address only).  ``settings`` go to the route modules through the context
    (e.g. ``scry_limits=ScryLimits(max_waiting=10)``).  A connection that sends no
    request within ``first_request_timeout`` seconds of being made (0: none) is closed,
    and counted (:attr:`HttpServer.idle_closed`).  Raises ``OSError`` when the
    address cannot be bound, ``ValueError`` for a bad stream name in ``publish`` or
    ``open_access`` on an address that is not loopback.
    """
    names = tuple(dict.fromkeys(check_stream_name(s) for s in publish))
    if names and store is None:
        raise ValueError("publishing streams needs a store")
    if open_access and not is_loopback(host):
        raise ValueError(f"--http-open serves the server's state to anyone without a token: "
                         f"it is allowed on a loopback address only, not {host}")
    ctx = WebContext(store=store, publish=names, server=server, settings=dict(settings),
                     open_access=open_access, recorders=tuple(recorders))
    app = make_app(ctx, modules)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, logger=_server_log,
                           handler_cancellation=True, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    idle = _Idle(first_request_timeout)
    try:
        site = _Site(runner, host, port, ssl_context=ssl_context, idle=idle)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    addrs = runner.addresses
    real_port = addrs[0][1] if addrs else port
    http = HttpServer(runner, host, real_port, secure=ssl_context is not None, idle=idle)
    log.info("HTTP on %s", http.url)
    return http
