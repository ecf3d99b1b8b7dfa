"""The scry HTTP gateway: remote readers follow published streams by path.

Routes (only streams named in ``publish`` are readable; any other name is answered
404 ``{"error": "stream 'x' is not published here"}``, never data):

``GET /scry/STREAM/INDEX``
    Entry INDEX of STREAM, held until it exists (a long poll): 200 with the entry,
    204 when ``?timeout=SECONDS`` (default 30, at most 300) elapses first, 410 when
    retention removed it (the body says which entry is the first kept).  The body is
    JSON ``{"stream", "index", "time", "value"}`` with the value in Preserves text, or
    the entry's canonical binary with ``Accept: application/preserves`` or
    ``?format=binary`` (then the ``Scry-Index`` and ``Scry-Time`` headers say which).
``GET /scry/STREAM?from=N`` (or ``from=start``, ``from=next``; or ``Accept: text/event-stream``)
    Server-Sent Events, one per entry in order (``id: INDEX``, ``data: <the JSON>``),
    resuming after ``Last-Event-ID``; a comment every 15 s keeps the connection alive.
``GET /scry/STREAM``
    The stream's head: ``{"stream", "next", "first"}``.
``GET /scry/``
    The published streams with their heads.

A ``/`` inside a stream name is written ``%2F`` (``/scry/logs%2Fweb/3``).

How waiting works: one task per HTTP port (:class:`HeadWatch`) knows where each
published stream ends.  While anyone waits, it reads the heads of the streams waited on
after every store change (the store's wake-ups: appends by any process, no polling) and
wakes the requests whose entry now exists; with nobody waiting it reads nothing.  A new
waiter causes a fresh read too (waiters arriving together share it), so an append can
never slip between a request's own look and its wait.  Entries are read on
the port's store threads, a batch at a time, and kept in a small cache of recent
entries, with concurrent reads of the same place shared: an entry broadcast to a
thousand waiting readers is read and converted once.

Bounds (:class:`ScryLimits`): requests that may wait (long polls and event streams
together) are capped (503 past it); an event stream holds at most one batch (a few
entries, fewer when entries are large) beyond the socket's buffer, and a client that
takes nothing for ``send_timeout`` seconds is disconnected; the cache is bounded in
entries and bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..streams.base import MAX_INDEX, Entry, Store, StoreError, check_stream_name
from ..values import stringify
from .context import WebContext, json_error, json_response

__all__ = ["SCRY", "HeadWatch", "ScryGateway", "ScryLimits", "entry_json", "setup"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScryLimits:
    """The gateway's bounds and timings (``start_http(..., scry_limits=ScryLimits(...))``)."""

    max_waiting: int = 1000
    """Long polls and event streams served at once; more are answered 503."""
    default_timeout: float = 30.0
    """Seconds a long poll waits when the request gives no ``timeout``."""
    max_timeout: float = 300.0
    """The longest ``timeout`` a request may ask for (larger ones are cut to this)."""
    keepalive: float = 15.0
    """Seconds between keep-alive comments on a quiet event stream."""
    send_timeout: float = 30.0
    """An event stream whose client takes nothing for this long is closed."""
    batch: int = 32
    """Most entries read (and sent to an event stream) at once ..."""
    batch_bytes: int = 1 << 20
    """... and fewer when the stream's entries are large: about this many bytes."""
    cache_entries: int = 1024
    """Recent entries kept in memory (all streams together) ..."""
    cache_bytes: int = 16 << 20
    """... and their total size at most (entries larger than a sixteenth are not kept)."""


_INDEX_RE = re.compile(r"[0-9]{1,19}")


def _parse_index(text: str, what: str) -> int:
    if not _INDEX_RE.fullmatch(text) or int(text) > MAX_INDEX:
        raise _BadRequest(f"{what} {text!r} is not an entry index (0 to {MAX_INDEX})")
    return int(text)


class _Refused(Exception):
    """A request answered with an error: ``status`` and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _BadRequest(_Refused):
    def __init__(self, message: str) -> None:
        super().__init__(400, message)


class _Busy(Exception):
    pass


# ------------------------------------------------------------------------------------
# Entries as sent


@dataclass(frozen=True, slots=True)
class _Item:
    """One entry, ready to send: the canonical binary and the JSON object."""

    index: int
    time: float
    data: bytes
    json: bytes

    @property
    def size(self) -> int:
        return len(self.data) + len(self.json) + 64


def entry_json(stream: str, entry: Entry) -> dict[str, Any]:
    """The JSON form of an entry: ``{"stream", "index", "time", "value"}``, the value in
    Preserves text (an embedded reference in its readable text form; a damaged value as
    ``#!undecodable (...)``, as ``dataspace stream tail`` shows it)."""
    try:
        text = stringify(entry.value)
    except Exception as e:
        text = f"#!undecodable ({e}): {entry.data[:32].hex()}"
    return {"stream": stream, "index": entry.index, "time": entry.time, "value": text}


def _item(stream: str, e: Entry) -> _Item:
    body = json.dumps(entry_json(stream, e), ensure_ascii=False).encode()
    return _Item(e.index, e.time, e.data, body)


def _read_items(store: Store, stream: str, start: int, limit: int) -> tuple[list[_Item], int]:
    """Up to ``limit`` entries from ``start`` (store threads), and, when there are none,
    the stream's next index (else -1)."""
    entries = store.read(stream, start, limit)
    if not entries:
        return [], store.next_index(stream)
    return [_item(stream, e) for e in entries], -1


def _heads(store: Store, names: list[str]) -> dict[str, int]:
    return {s: store.next_index(s) for s in names}


def _head(store: Store, stream: str) -> dict[str, Any]:
    nxt = store.next_index(stream)
    first = store.first_index(stream) if nxt else None
    return {"stream": stream, "next": nxt, "first": first}


# ------------------------------------------------------------------------------------
# Where the streams end


class _Waiter:
    __slots__ = ("fut", "index")

    def __init__(self, index: int, fut: asyncio.Future[bool]) -> None:
        self.index = index
        self.fut = fut


class HeadWatch:
    """Knows where each waited-on stream ends and wakes whoever waits for an entry.

    One task reads the heads of the streams someone waits on after every store change
    (:meth:`Store.wait_change_async`: appends by any process) and after new waiters
    arrive; with no waiter it sleeps and reads nothing.
    """

    def __init__(self, ctx: WebContext) -> None:
        assert ctx.store is not None
        self.ctx = ctx
        self.store = ctx.store
        self.heads: dict[str, int] = {}
        self.refreshes = 0
        self._waiters: dict[str, set[_Waiter]] = {}
        self._count = 0
        self._poke = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self.on_shrink: list[Any] = []  # callbacks(stream) when a head went down
        self.on_change: list[Any] = []  # callbacks() when a waiter comes or goes

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="scry-heads")

    async def close(self) -> None:
        self._closed = True
        self._resolve_all(False)
        t, self._task = self._task, None
        if t is not None:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t

    @property
    def waiting(self) -> int:
        return self._count

    async def wait_past(self, stream: str, index: int, timeout: float | None) -> bool:
        """True once a read of the heads shows ``stream``'s next index above ``index``
        (entry ``index`` was appended); False after ``timeout`` seconds or when the
        watch closes.  Every call causes such a read, so an entry appended just before
        the call is not waited for.  Raises the store's error if the read fails."""
        if self._closed:
            return False
        w = _Waiter(index, asyncio.get_running_loop().create_future())
        self._waiters.setdefault(stream, set()).add(w)
        self._count += 1
        self._poke.set()
        self._changed()
        try:
            async with asyncio.timeout(timeout):
                return await w.fut
        except TimeoutError:
            return False
        finally:
            ws = self._waiters.get(stream)
            if ws is not None:
                ws.discard(w)
                if not ws:
                    del self._waiters[stream]
            self._count -= 1
            self._changed()

    def _changed(self) -> None:
        for cb in self.on_change:
            cb()

    def _resolve_all(self, result: bool | BaseException) -> None:
        for ws in self._waiters.values():
            for w in ws:
                if not w.fut.done():
                    if isinstance(result, BaseException):
                        w.fut.set_exception(result)
                    else:
                        w.fut.set_result(result)

    async def _run(self) -> None:
        while not self._closed:
            if not self._count:
                self._poke.clear()
                await self._poke.wait()  # nobody waits: read nothing
                continue
            self._poke.clear()
            names = list(self._waiters)
            try:
                gen = self.store.generation()
                heads = await self.ctx.run_store(_heads, self.store, names)
            except Exception as e:  # the store failed (or closed): tell the waiters
                if self._closed:
                    return
                log.warning("scry gateway: cannot read the stream heads: %s", e)
                err = e if isinstance(e, StoreError) else StoreError(str(e))
                self._resolve_all(err)
                self._poke.clear()
                await self._poke.wait()  # retried for the next waiter, not in a loop
                continue
            self.refreshes += 1
            for s, h in heads.items():
                old = self.heads.get(s)
                self.heads[s] = h
                if old is not None and h < old:  # deleted and created again
                    for cb in self.on_shrink:
                        cb(s)
                for w in self._waiters.get(s, ()):
                    if h > w.index and not w.fut.done():
                        w.fut.set_result(True)
            if self._poke.is_set():
                continue  # waiters arrived during the read: refresh for them
            change = asyncio.ensure_future(self.store.wait_change_async(gen, None))
            poke = asyncio.ensure_future(self._poke.wait())
            try:
                await asyncio.wait((change, poke), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (change, poke):
                    t.cancel()
                for t in (change, poke):
                    with contextlib.suppress(asyncio.CancelledError, StoreError):
                        await t


# ------------------------------------------------------------------------------------
# The gateway


class ScryGateway:
    """The scry routes' state: the head watch, the cache of recent entries, the
    count of waiting requests and counters (:meth:`stats`)."""

    def __init__(self, ctx: WebContext, limits: ScryLimits | None = None) -> None:
        self.ctx = ctx
        self.limits = limits or ScryLimits()
        self.publish = frozenset(ctx.publish)
        self.active = 0
        self.counters: Counter[str] = Counter()
        self.watch: HeadWatch | None = None
        self._cache: OrderedDict[tuple[str, int], _Item] = OrderedDict()
        self._cache_size = 0
        self._inflight: dict[tuple[str, int], asyncio.Task[tuple[list[_Item], int]]] = {}
        self._avg_size: dict[str, float] = {}
        self._closing = False
        self._changed = asyncio.Event()

    # -- life ------------------------------------------------------------------------

    async def start(self) -> None:
        if self.ctx.store is not None and self.publish:
            self.watch = HeadWatch(self.ctx)
            self.watch.on_shrink.append(self._forget)
            self.watch.on_change.append(self._changed.set)
            self.watch.start()

    async def close(self) -> None:
        """End every wait: event streams finish, long polls answer 503."""
        self._closing = True
        if self.watch is not None:
            await self.watch.close()

    def held_bytes(self) -> int:
        """What remote readers make the server hold, for its memory budget: the cache of
        recent entries, and about 16 KiB per waiting request (its task, request and
        response)."""
        return self._cache_size + (self.active << 14)

    def stats(self) -> dict[str, Any]:
        """Counters for monitoring: requests by outcome, entries sent, cache use."""
        return {
            "active": self.active,
            "published": sorted(self.publish),
            "cache_entries": len(self._cache),
            "cache_bytes": self._cache_size,
            "head_refreshes": self.watch.refreshes if self.watch else 0,
            **self.counters,
        }

    async def wait_until(self, ready: Callable[[], bool], timeout: float) -> None:
        """Wait until ``ready()`` holds, checked whenever a request takes or frees a
        slot or starts or stops waiting for an entry (for tests and monitors);
        ``TimeoutError`` after ``timeout`` seconds."""
        async with asyncio.timeout(timeout):
            while not ready():
                self._changed.clear()
                await self._changed.wait()

    @contextlib.contextmanager
    def _slot(self) -> Iterator[None]:
        if self.active >= self.limits.max_waiting:
            self.counters["refused_busy"] += 1
            raise _Busy
        self.active += 1
        self._changed.set()
        try:
            yield
        finally:
            self.active -= 1
            self._changed.set()

    # -- reading ---------------------------------------------------------------------

    def _forget(self, stream: str) -> None:
        for key in [k for k in self._cache if k[0] == stream]:
            self._cache_size -= self._cache.pop(key).size

    def _cached_run(self, stream: str, start: int) -> list[_Item]:
        out: list[_Item] = []
        cache = self._cache
        i = start
        while len(out) < self.limits.batch:
            it = cache.get((stream, i))
            if it is None:
                break
            cache.move_to_end((stream, i))
            out.append(it)
            i += 1
        return out

    def _remember(self, stream: str, items: list[_Item]) -> None:
        lim = self.limits
        for it in items:
            if it.size > lim.cache_bytes // 16 or (stream, it.index) in self._cache:
                continue
            self._cache[(stream, it.index)] = it
            self._cache_size += it.size
        while self._cache and (len(self._cache) > lim.cache_entries
                               or self._cache_size > lim.cache_bytes):
            self._cache_size -= self._cache.popitem(last=False)[1].size

    async def read(self, stream: str, start: int) -> tuple[list[_Item], int]:
        """Consecutive entries from ``start`` (the first may be later when retention
        removed some), at most a batch; when there are none, also the stream's next
        index (else -1).  Served from the cache, or one store read shared by everyone
        asking for the same place at once."""
        run = self._cached_run(stream, start)
        if run:
            self.counters["cache_hits"] += 1
            return run, -1
        key = (stream, start)
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(stream, start))
            self._inflight[key] = task
            task.add_done_callback(lambda t: self._loaded(key, t))
        else:
            self.counters["reads_shared"] += 1
        return await asyncio.shield(task)

    def _loaded(self, key: tuple[str, int], task: asyncio.Task[Any]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have gone

    async def _load(self, stream: str, start: int) -> tuple[list[_Item], int]:
        lim = self.limits
        avg = self._avg_size.get(stream)
        limit = 4 if avg is None else int(max(1, min(lim.batch, lim.batch_bytes // max(avg, 1))))
        assert self.ctx.store is not None
        self.counters["store_reads"] += 1
        items, nxt = await self.ctx.run_store(_read_items, self.ctx.store, stream, start, limit)
        if items:
            size = sum(len(it.data) for it in items) / len(items)
            self._avg_size[stream] = size if avg is None else 0.8 * avg + 0.2 * size
            self._remember(stream, items)
        return items, nxt

    # -- requests --------------------------------------------------------------------

    def _stream(self, request: web.Request) -> str:
        name = request.match_info["stream"]
        try:
            check_stream_name(name)
        except ValueError as e:
            raise _BadRequest(str(e)) from None
        if name not in self.publish:
            self.counters["not_published"] += 1
            raise _Refused(404, f"stream {name!r} is not published here")
        return name

    def _timeout(self, request: web.Request) -> float:
        text = request.query.get("timeout")
        if text is None:
            return min(self.limits.default_timeout, self.limits.max_timeout)
        try:
            t = float(text)
        except ValueError:
            t = math.nan
        if not math.isfinite(t) or t < 0:
            raise _BadRequest(f"timeout {text!r} is not a number of seconds (0 to "
                              f"{self.limits.max_timeout:g})")
        return min(t, self.limits.max_timeout)

    @staticmethod
    def _binary(request: web.Request) -> bool:
        fmt = request.query.get("format")
        if fmt is not None:
            if fmt not in ("json", "binary"):
                raise _BadRequest(f"format {fmt!r}: use json or binary")
            return fmt == "binary"
        q: dict[str, float] = {}
        for part in request.headers.get("Accept", "").split(","):
            kind, *params = (p.strip() for p in part.split(";"))
            weight = 1.0
            for p in params:
                if p.startswith("q="):
                    with contextlib.suppress(ValueError):
                        weight = float(p[2:])
            q[kind.lower()] = max(q.get(kind.lower(), 0.0), weight)
        pres = q.get("application/preserves", 0.0)
        return pres > 0 and pres >= q.get("application/json", 0.0)

    async def handle_entry(self, request: web.Request) -> web.StreamResponse:
        """``GET /scry/STREAM/INDEX``: the entry, once it exists (long poll)."""
        name = self._stream(request)
        index = _parse_index(request.match_info["index"], "index")
        timeout = self._timeout(request)
        binary = self._binary(request)
        self.counters["entry_requests"] += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        with self._slot():
            while True:
                items, nxt = await self.read(name, index)
                if items:
                    it = items[0]
                    if it.index == index:
                        self.counters["entries_sent"] += 1
                        return self._entry_response(it, binary)
                    return self._gone(name, index, it.index, None)
                if nxt > index:
                    return self._gone(name, index, None, nxt)
                assert self.watch is not None
                remaining = deadline - loop.time()
                if remaining <= 0 or not await self.watch.wait_past(name, index, remaining):
                    if self._closing:
                        return json_error(503, "the server is shutting down; ask again",
                                          headers={"Retry-After": "1"})
                    self.counters["timeouts"] += 1
                    return web.Response(status=204, headers={"Cache-Control": "no-store"})

    def _entry_response(self, it: _Item, binary: bool) -> web.Response:
        if binary:
            return web.Response(body=it.data, content_type="application/preserves",
                                headers={"Scry-Index": str(it.index),
                                         "Scry-Time": repr(it.time)})
        return web.Response(body=it.json, content_type="application/json", charset="utf-8")

    def _gone(self, name: str, index: int, first: int | None, nxt: int | None) -> web.Response:
        self.counters["gone"] += 1
        if first is not None:
            return json_error(410, f"entry {index} of stream {name!r} was removed by "
                              f"retention; the first entry kept is {first}", first=first)
        return json_error(410, f"entry {index} of stream {name!r} was removed by retention; "
                          f"the stream keeps no entries now, the next one will be {nxt}",
                          first=None, next=nxt)

    async def handle_stream(self, request: web.Request) -> web.StreamResponse:
        """``GET /scry/STREAM``: its events (``from``, or an event-stream Accept), or
        its head."""
        name = self._stream(request)
        if "from" in request.query or "text/event-stream" in request.headers.get("Accept", ""):
            return await self._events(request, name)
        assert self.ctx.store is not None
        return json_response(await self.ctx.run_store(_head, self.ctx.store, name))

    async def handle_index(self, request: web.Request) -> web.StreamResponse:
        """``GET /scry/``: the published streams and their heads."""
        store = self.ctx.store
        heads = [] if store is None else [
            await self.ctx.run_store(_head, store, s) for s in sorted(self.publish)
        ]
        return json_response({"streams": heads})

    async def _events(self, request: web.Request, name: str) -> web.StreamResponse:
        last_id = request.headers.get("Last-Event-ID", "").strip()
        start = request.query.get("from", "next")
        if last_id:
            pos: int | None = _parse_index(last_id, "Last-Event-ID") + 1
        elif start in ("start", "next"):
            pos = None
        else:
            pos = _parse_index(start, "from")
        with self._slot():
            assert self.ctx.store is not None and self.watch is not None
            if pos is None:
                head = await self.ctx.run_store(_head, self.ctx.store, name)
                pos = head["next"] if start == "next" or head["first"] is None else head["first"]
            self.counters["event_streams"] += 1
            resp = web.StreamResponse(headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",
                "X-Content-Type-Options": "nosniff",
            })
            await resp.prepare(request)
            log.debug("scry: event stream of %s from %d for %s", name, pos, request.remote)
            try:
                await self._send(resp, f": stream {name} from {pos}\n\n".encode())
                await self._follow(resp, name, pos)
                await resp.write_eof()
            except StoreError as e:
                log.warning("scry gateway: event stream of %s: %s", name, e)
                with contextlib.suppress(ConnectionError, TimeoutError):
                    err = json.dumps({"error": f"the stream store failed: {e}"}).encode()
                    await self._send(resp, b"event: error\ndata: " + err + b"\n\n")
                    await resp.write_eof()
            except (ConnectionError, TimeoutError) as e:
                # The client went, or took nothing for send_timeout: drop the connection.
                log.debug("scry: event stream of %s ended: %s", name, e or type(e).__name__)
                if isinstance(e, TimeoutError):
                    self.counters["slow_clients_closed"] += 1
                if request.transport is not None:
                    request.transport.close()
            return resp

    async def _send(self, resp: web.StreamResponse, data: bytes) -> None:
        async with asyncio.timeout(self.limits.send_timeout):
            await resp.write(data)

    async def _follow(self, resp: web.StreamResponse, name: str, pos: int) -> None:
        assert self.watch is not None
        while not self._closing:
            items, nxt = await self.read(name, pos)
            if (items and items[0].index > pos) or (not items and nxt > pos):
                to = items[0].index if items else nxt
                gap = json.dumps({"stream": name, "from": pos, "to": to}).encode()
                await self._send(resp, b"event: gap\ndata: " + gap + b"\n\n")
                pos = to
                continue
            if items:
                await self._send(resp, b"".join(
                    b"id: %d\ndata: %s\n\n" % (it.index, it.json) for it in items))
                self.counters["entries_sent"] += len(items)
                pos = items[-1].index + 1
                continue
            if not await self.watch.wait_past(name, pos, self.limits.keepalive):
                if not self._closing:
                    await self._send(resp, b": keep-alive\n\n")


# ------------------------------------------------------------------------------------
# Wiring


SCRY = web.AppKey("dataspace.web.scry", ScryGateway)


def _guard(fn: Any) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request)
        except _Refused as e:
            return json_error(e.status, str(e))
        except _Busy:
            gw = request.app[SCRY]
            return json_error(503, f"too many waiting requests ({gw.limits.max_waiting} long "
                              "polls and event streams at once); try again later",
                              headers={"Retry-After": "5"})
        except StoreError as e:
            log.warning("scry gateway: %s", e)
            return json_error(503, f"the stream store failed: {e}")

    return handler


async def _bad_path(request: web.Request) -> web.StreamResponse:
    return json_error(400, f"no such path: {request.path}; use /scry/STREAM or "
                      "/scry/STREAM/INDEX (write a / inside a stream name as %2F)")


def setup(app: web.Application, ctx: WebContext) -> None:
    """Add the scry gateway's routes to ``app`` (a route module of the HTTP port).

    ``ctx.settings["scry_limits"]`` (a :class:`ScryLimits`) overrides the bounds.
    """
    gw = ScryGateway(ctx, ctx.settings.get("scry_limits"))
    app[SCRY] = gw
    # Counted in the server's memory budget (--max-memory), if it has one.
    sources = getattr(ctx.server, "memory_sources", None)

    async def on_startup(app: web.Application) -> None:
        await gw.start()
        if sources is not None:
            sources.append(gw.held_bytes)

    async def on_shutdown(app: web.Application) -> None:
        await gw.close()
        if sources is not None and gw.held_bytes in sources:
            sources.remove(gw.held_bytes)

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    r = app.router
    r.add_get("/scry", _guard(gw.handle_index), allow_head=False)
    r.add_get("/scry/", _guard(gw.handle_index), allow_head=False)
    r.add_get("/scry/{stream}", _guard(gw.handle_stream), allow_head=False)
    r.add_get("/scry/{stream}/{index}", _guard(gw.handle_entry), allow_head=False)
    r.add_get("/scry/{tail:.+}", _bad_path, allow_head=False)
