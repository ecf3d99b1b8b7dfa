"""What the route modules of the HTTP port share: the context, errors, middlewares.

Route modules import this module (never :mod:`dataspace.web.app`, which imports them).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from aiohttp import web

from ..streams.base import Store
from .auth import Access, ApiError, Authorizer

__all__ = ["CONTEXT", "RouteModule", "WebContext", "guarded", "json_error", "json_response"]

T = TypeVar("T")


class RouteModule(Protocol):
    """A part of the HTTP port: anything with ``setup(app, ctx)`` that adds its routes,
    its hooks (``app.on_startup``, ``on_shutdown``, ``on_cleanup``) and its state."""

    def setup(self, app: web.Application, ctx: WebContext) -> None: ...


@dataclass
class WebContext:
    """What the route modules share (``app[CONTEXT]``).

    ``store`` is the stream store (None when the server has none), ``publish`` the
    streams remote readers may read, ``server`` the broker
    (:class:`dataspace.broker.Server`, or None), ``settings`` the keyword arguments
    :func:`~dataspace.web.start_http` got beyond its own (each module documents its
    keys).
    """

    store: Store | None
    publish: tuple[str, ...] = ()
    server: Any = None
    settings: dict[str, Any] = field(default_factory=dict)
    store_threads: int = 2
    open_access: bool = False
    """Every request may see everything, without a token (``--http-open``, loopback)."""
    recorders: tuple[Any, ...] = ()
    """The server's stream recorders (:class:`~dataspace.streams.Recorder`)."""
    _executor: ThreadPoolExecutor | None = field(default=None, repr=False)
    _authorizer: Authorizer | None = field(default=None, repr=False)

    def access(self, request: web.Request) -> Access:
        """What ``request`` may see (its bearer token checked against the server's
        bindings; see :mod:`dataspace.web.auth`); raises :class:`ApiError` (401, 503)."""
        a = self._authorizer
        if a is None:
            a = self._authorizer = Authorizer(self.server, self.open_access)
        return a.access(request)

    async def run_store(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the port's store threads, never on the event loop: the store
        serialises its calls with a lock that a writer holds for a whole transaction
        (its fsync, or up to the busy timeout while another process writes), so a store
        call on the event loop could stall every connection of the broker."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.store_threads, thread_name_prefix="dataspace-http-store"
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    async def close(self) -> None:
        """Stop the store threads (waiting for a call in progress, off the event loop)."""
        ex, self._executor = self._executor, None
        if ex is not None:
            await asyncio.to_thread(ex.shutdown, True, cancel_futures=True)


CONTEXT = web.AppKey("dataspace.web.context", WebContext)


def json_response(data: Any, status: int = 200, **headers: str) -> web.Response:
    """``data`` as a UTF-8 JSON answer, not to be cached."""
    return web.Response(
        status=status, body=json.dumps(data, ensure_ascii=False).encode(),
        content_type="application/json", charset="utf-8",
        headers={"Cache-Control": "no-store", **headers},
    )


def json_error(
    status: int, message: str, *, headers: dict[str, str] | None = None, **extra: Any
) -> web.Response:
    """A JSON error answer: ``{"error": message, ...extra}`` with ``status``."""
    return json_response({"error": message, **extra}, status, **(headers or {}))


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def guarded(
    ctx: WebContext, fn: Callable[[web.Request, Access], Awaitable[web.StreamResponse]]
) -> Handler:
    """A handler that checks the request's token first (``fn(request, access)``) and
    answers :class:`ApiError` as JSON (``{"error": ...}`` with its status)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request, ctx.access(request))
        except ApiError as e:
            return json_error(e.status, str(e), headers=e.headers, **e.extra)

    handler.__name__ = getattr(fn, "__name__", "handler")
    handler.__doc__ = fn.__doc__
    return handler


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (no such route, wrong method ...) as JSON too."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = {404: f"no such path: {request.path}",
                   405: f"method {request.method} is not allowed here"}.get(e.status, e.reason)
        resp = json_error(e.status, message)
        for k in ("Allow", "Retry-After"):
            if k in e.headers:
                resp.headers[k] = e.headers[k]
        return resp


@web.middleware
async def headers_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Headers every answer carries (a streaming answer sets its own before it starts)."""
    resp = await handler(request)
    if not resp.prepared:
        resp.headers.setdefault("X-Content-Type-Options", "nosniff")
    return resp
