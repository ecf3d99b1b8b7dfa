"""Inside the dataspaces over HTTP: subscriptions, current assertions, a live watch.

Routes (JSON or Server-Sent Events; a token is needed, see :mod:`dataspace.web.auth`):

``GET /api/subscriptions?dataspace=NAME``
    The patterns observed in the dataspace with their observer counts; the server's own
    observers (its recorders, the watches of ``/api/watch``) on rows of their own, marked
    ``own`` (``"recorder chat"``, ``"watch"``), after the clients'.
``GET /api/assertions?dataspace=NAME&pattern=P&limit=N``
    The assertions matching the concise pattern ``P`` now (at most ``N``, with a
    ``truncated`` flag).
``GET /api/watch?dataspace=NAME&pattern=P``
    Server-Sent Events: the current matches as ``+`` events, then ``event: synced``, then
    ``+`` / ``-`` / ``!`` as assertions appear and go and messages are sent.
``GET /api/groups?dataspace=NAME``
    The groups of observers that share work in the dataspace (``<ObserveGroup ...>``):
    each group's name, pattern and figures, and its members in the order they joined
    (their connection, the messages given to each, the jobs each holds).  A group's own
    ``<Observe PATTERN ...>`` is listed by ``/api/subscriptions`` as the server's own,
    ``own`` ``"group NAME"``.

``dataspace`` defaults to the token's dataspace (``root`` for the administrator).  Values
are Preserves text; an embedded reference is shown readably (``#:<peer "HOST:PORT" 3>``:
object 3 of that connection, for the administrator; ``#:<ref>`` / ``#:<opaque>``
otherwise).  A bad pattern is answered 400 with the parser's message and the position.

What a token sees follows its caveats: its caveats are applied to ``<Observe <$ P>
#:observer>`` (whole values), and when they refuse it to ``<Observe P #:observer>``, as
the server applies them to a subscription made through it.  Rejected: 403.  Accepted,
perhaps rewritten to ``<Observe P' ...>``: the token is shown what that subscription
would tell it -- the matches of ``P'``, as captures (and the whole value when ``P'`` binds
it at the top), passed through any caveats the rewrite put on the observer.  The
administrator sees whole values always.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from typing import Any

from aiohttp import web

from ..dataspace import OBSERVE, Entity, Subscription, TurnTooLarge, fresh_handle
from ..groups import Groups
from ..pattern import (
    Bind,
    Pattern,
    PatternError,
    from_preserves,
    from_value_syntax,
    instantiate,
    match,
    skeleton,
)
from ..pattern import to_preserves as pattern_value
from ..protocol.relay import RemoteEntity
from ..protocol.sturdy import AttenuatedEntity, AttenuatedRef, Attenuation, Opaque
from ..values import Embedded, ParseError, Record, Sequence, Symbol, Value, parse, stringify
from ..values import key as strict_key
from .auth import Access, ApiError
from .broker import group_rows
from .context import WebContext, guarded, json_response

__all__ = ["MAX_PATTERN", "View", "WATCHES", "Watches", "groups_view", "own_observer",
           "parse_user_pattern", "setup", "value_text"]

log = logging.getLogger(__name__)

MAX_PATTERN = 4096
"""The longest pattern text accepted (characters)."""
DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000
MAX_TEXT = 64 * 1024
"""Longest text of one value shown; longer ones are cut (and marked ``cut``)."""


# ------------------------------------------------------------------------------------
# Values as text


def _admin_ref(obj: Any) -> Value:
    t = type(obj)
    if t is RemoteEntity:
        return Record(Symbol("peer"), [obj.relay.name, obj.oid])
    if t is AttenuatedRef or t is AttenuatedEntity:
        return Record(Symbol("attenuated"), [_admin_ref(obj.target),
                                             len(obj.attenuation.caveats)])
    if t is Opaque:
        return Record(Symbol("opaque"), [])
    if t is Subscription:
        return Record(Symbol("subscription"), [obj.id])
    group = Groups.dispatcher_group(obj)
    if group is not None:
        return Record(Symbol("group"), [group])
    target = getattr(obj, "target", None)
    if target is not None and isinstance(obj, Entity):  # a wrapper: show what it wraps
        return _admin_ref(target)
    ds = getattr(obj, "dataspace", None)
    if ds is not None and hasattr(ds, "name"):
        return Record(Symbol("dataspace"), [str(ds.name)])
    return Record(Symbol("object"), [type(obj).__name__])


def _guest_ref(obj: Any) -> Value:
    return Record(Symbol("opaque" if type(obj) is Opaque else "ref"), [])


def value_text(v: Value, admin: bool) -> tuple[str, bool]:
    """``v`` as Preserves text with readable references, and whether it was cut (at
    :data:`MAX_TEXT` characters)."""
    try:
        text = stringify(v, embedded=_admin_ref if admin else _guest_ref)
    except Exception as e:  # pragma: no cover - stringify handles every value
        text = f"#!unprintable ({type(e).__name__})"
    if len(text) > MAX_TEXT:
        return text[:MAX_TEXT] + " …", True
    return text, False


# ------------------------------------------------------------------------------------
# Patterns and what a token sees of them


def parse_user_pattern(text: str | None, what: str = "pattern") -> Pattern:
    """A concise pattern typed by a person; :class:`ApiError` 400 with the parser's
    message and where (``position``, ``line``, ``column``) when it is not one."""
    if text is None or not text.strip():
        raise ApiError(400, f"give a {what}, e.g. {what}=<Present $who> (URL-encoded)")
    if len(text) > MAX_PATTERN:
        raise ApiError(400, f"the {what} is longer than {MAX_PATTERN} characters")
    try:
        v = parse(text)
    except ParseError as e:
        extra = {"position": e.position, "line": e.line, "column": e.column}
        where = f" (line {e.line}, column {e.column})" if e.line is not None else ""
        raise ApiError(400, f"bad {what}: {e.reason}{where}",
                       **{k: x for k, x in extra.items() if x is not None}) from None
    except ValueError as e:
        raise ApiError(400, f"bad {what}: {e}") from None
    try:
        return from_value_syntax(v)
    except PatternError as e:
        raise ApiError(400, f"bad {what}: {e}") from None


class _Probe(Entity):
    """Stands for an observer while caveats are tried on ``<Observe P #:probe>``."""


class View:
    """What ``access`` sees of ``pattern``: the pattern asked for through the token's
    caveats (:attr:`asked`), the pattern actually observed once they rewrote it
    (:attr:`observed`), whether whole values are shown, and the caveats on what the
    observer is told (:attr:`inner`).  Raises :class:`ApiError` 403 when the token's
    caveats would not let it observe ``pattern``.

    Whole values are shown whenever the caveats allow: the administrator always observes
    ``<$ P>``; another token asks for ``<$ P>`` first too, and for ``P`` itself (its
    captures only) when its caveats refuse that.  Asking for ``P`` alone would make a
    pattern without captures (``_``, the pages' default) tell only *whether* something
    matches: one empty match, however many assertions there are."""

    def __init__(self, access: Access, pattern: Pattern) -> None:
        self.access = access
        self.admin = access.admin
        self.pattern = pattern
        self.inner: Attenuation | None = None
        self.wrapped = False
        """True when ``<$ P>`` was observed for a ``P`` that is not ``<$ ...>`` itself:
        the first capture is then the whole value, not one of ``P``'s."""
        if access.admin:
            self.shown = pattern
            self.asked: Pattern = Bind(pattern)
            self.observed: Pattern = self.asked  # caps[0]: the whole value
            self.whole = True
            return
        att = access.attenuation
        self.shown = pattern
        self.asked = pattern
        if type(pattern) is not Bind:
            try:
                self._through(att, Bind(pattern))
                self.wrapped = type(self.shown) is Bind
            except ApiError:
                self.shown, self.inner = pattern, None
        if not self.wrapped:
            self._through(att, pattern)
        self.observed = self.shown
        self.whole = type(self.shown) is Bind
        if self.wrapped:
            self.shown = self.shown.pattern  # type: ignore[attr-defined]

    def _through(self, att: Attenuation | None, asked: Pattern) -> None:
        """Ask the caveats ``att`` for a subscription to ``asked``: set :attr:`asked`,
        :attr:`shown` (what it became) and :attr:`inner`, or raise 403."""
        self.asked = self.shown = asked
        self.inner = None
        if att is None:
            return
        pattern = self.pattern
        probe = _Probe()
        r = att.apply(Record._make(OBSERVE, (pattern_value(asked), Embedded(probe))))
        if r is None:
            raise ApiError(403, f"this token's caveats do not let it observe {pattern}")
        if (type(r) is not Record or r.label != OBSERVE or len(r.fields) != 2
                or type(r.fields[1]) is not Embedded):
            raise ApiError(403, f"this token's caveats turn a subscription to {pattern} "
                           "into something else; it cannot be shown here")
        try:
            self.shown = from_preserves(r.fields[0])
        except PatternError:
            raise ApiError(403, "this token's caveats rewrite the pattern into one that "
                           "is not valid") from None
        obs = r.fields[1].value
        while type(obs) is AttenuatedRef:
            self.inner = (obs.attenuation if self.inner is None
                          else obs.attenuation.then(self.inner))
            obs = obs.target
        if obs is not probe:
            raise ApiError(403, "this token's caveats replace the observer of a "
                           "subscription; it cannot be shown here")

    @property
    def presence_only(self) -> bool:
        """True when what is observed captures nothing: its observers are told only
        whether something matches (one empty match), not what."""
        return not self.whole and not skeleton(self.observed).captures

    def row(self, caps: tuple[Value, ...], filtered: bool = True) -> dict[str, Any] | None:
        """A match as shown: ``captures``, ``match`` (the pattern filled with them) and
        ``value`` when whole values are shown; None when the observer's caveats drop it.
        ``filtered=False`` when the caveats on the observer were applied already."""
        if self.admin:
            whole, caps = caps[0], caps[1:]
        else:
            if filtered and self.inner is not None:
                r = self.inner.apply(Sequence(caps))
                if r is None:
                    return None
                caps = tuple(r) if type(r) is Sequence else (r,)
            whole = caps[0] if self.whole and caps else None
            if self.wrapped:
                caps = caps[1:]
        texts = [value_text(c, self.admin) for c in caps]
        out: dict[str, Any] = {"captures": [t for t, _cut in texts]}
        try:
            out["match"] = value_text(instantiate(self.shown, caps), self.admin)[0]
        except StopIteration:  # the caveats changed the captures: no pattern to fill
            pass
        cut = any(c for _t, c in texts)
        if whole is not None:
            text, c = value_text(whole, self.admin)
            out["value"] = text
            cut = cut or c
        if cut:
            out["cut"] = True
        return out

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"pattern": str(self.pattern)}
        if self.shown != self.pattern:
            d["observed"] = str(self.shown)
        if self.presence_only:
            d["presence_only"] = True
        return d


# ------------------------------------------------------------------------------------
# Live watches


class _Watcher(Entity):
    """The observer of one ``/api/watch``: queues what it is told for the event stream."""

    def __init__(self, limit: int) -> None:
        self.events: deque[tuple[str, tuple[Value, ...]]] = deque()
        self.held: dict[int, tuple[Value, ...]] = {}
        self.limit = limit
        self.overflow = False
        self.closed = False
        self.wake = asyncio.Event()

    @property
    def alive(self) -> bool:
        return not self.closed

    def _push(self, kind: str, caps: tuple[Value, ...]) -> None:
        if self.closed:
            return
        if len(self.events) >= self.limit:
            self.overflow = True
            self.closed = True
        else:
            self.events.append((kind, caps))
        self.wake.set()

    def on_assert(self, value: Value, handle: int) -> None:
        caps = tuple(value) if type(value) is Sequence else (value,)
        self.held[handle] = caps
        self._push("+", caps)

    def on_retract(self, handle: int) -> None:
        caps = self.held.pop(handle, None)
        if caps is not None:
            self._push("-", caps)

    def on_message(self, value: Value) -> None:
        self._push("!", tuple(value) if type(value) is Sequence else (value,))

    def close(self) -> None:
        self.closed = True
        self.wake.set()


class Watches:
    """The live watches of an HTTP port (``app[WATCHES]``): their number is capped, and
    the port's shutdown ends them."""

    def __init__(self, max_watches: int = 100, queue: int = 10_000, keepalive: float = 15.0,
                 send_timeout: float = 30.0) -> None:
        self.max_watches = max_watches
        self.queue = queue
        self.keepalive = keepalive
        self.send_timeout = send_timeout
        self.active: set[_Watcher] = set()
        self.closing = False
        self.changed = asyncio.Event()

    def close(self) -> None:
        self.closing = True
        for w in list(self.active):
            w.close()


WATCHES = web.AppKey("dataspace.web.watches", Watches)


# ------------------------------------------------------------------------------------
# Handlers


def _dataspace(ctx: WebContext, request: web.Request, access: Access) -> tuple[str, Any]:
    server = ctx.server
    if server is None:
        raise ApiError(404, "no broker behind this HTTP port")
    name = request.query.get("dataspace") or access.dataspace or "root"
    access.check_dataspace(name)
    ds = server.dataspaces.get(name)
    if ds is None:
        raise ApiError(404, f"no dataspace {name!r} on this server (it has: "
                       f"{', '.join(sorted(server.dataspaces))})")
    return name, ds


def _limit(request: web.Request) -> int:
    text = request.query.get("limit")
    if text is None:
        return DEFAULT_LIMIT
    if not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT:
        raise ApiError(400, f"limit {text!r}: give a number from 1 to {MAX_LIMIT}")
    return int(text)


_OBSERVE_ANY = Record(Symbol("Observe"), [Symbol("_"), Symbol("_")])


def own_observer(observer: Any, recorders: dict[int, str]) -> str | None:
    """What of the server's own machinery observes through ``observer`` -- a recorder
    (``"recorder chat"``; ``recorders``: the stream of each recorder's subscription, by
    its id()), a watch of ``/api/watch`` (the inspector's pages: ``"watch"``), a group's
    dispatcher (``"group resize"``: it observes the pattern for the group's members) --
    or None (a client, or other code in the server's process)."""
    while type(observer) is AttenuatedRef or type(observer) is AttenuatedEntity:
        observer = observer.target
    if type(observer) is _Watcher:
        return "watch"
    group = Groups.dispatcher_group(observer)
    if group is not None:
        return f"group {group}"
    if type(observer) is Subscription:
        stream = recorders.get(id(observer))
        if stream is not None:
            return f"recorder {stream}"
    return None


def subscriptions(ctx: WebContext, name: str, ds: Any, access: Access) -> dict[str, Any]:
    """``GET /api/subscriptions``: the observed patterns, most observed first; the
    server's own observers (:func:`own_observer`) on rows of their own, marked ``own``,
    after the clients' (they are real subscriptions -- links upstream them, producers
    see them -- but nobody outside asked for them)."""
    if not access.admin:
        View(access, from_value_syntax(_OBSERVE_ANY))  # 403 unless it may observe <Observe _ _>
    groups: dict[tuple[str, str | None], dict[str, Any]] = {}
    recorders = {id(r.subscription): r.stream for r in ctx.recorders
                 if getattr(r, "subscription", None) is not None}
    for _value, pat, observer, delivered, held in ds.observers():
        text = str(pat)
        own = own_observer(observer, recorders)
        g = groups.get((text, own))
        if g is None:
            g = groups[(text, own)] = {"pattern": text, "observers": 0, "remote": 0,
                                       "local": 0, "delivered": 0, "matches": 0, "own": own}
        g["observers"] += 1
        g["local" if type(observer) is Subscription else "remote"] += 1
        g["delivered"] += delivered
        g["matches"] += held
    rows = sorted(groups.values(), key=lambda g: (g["own"] is not None, -g["observers"],
                                                  -g["delivered"], g["pattern"], g["own"] or ""))
    return {"dataspace": name, "scope": access.scope, "observers": ds.observer_count(),
            "patterns": rows}


_OBSERVE_GROUP_ANY = Record(Symbol("ObserveGroup"), [Symbol("_"), Symbol("_"), Symbol("_")])


def groups_view(ctx: WebContext, name: str, access: Access) -> dict[str, Any]:
    """``GET /api/groups``: the groups of dataspace ``name`` with their members.  A token
    that is not the administrator's must be allowed to observe ``<ObserveGroup _ _ _>``,
    and is given the members' connections by id only."""
    if not access.admin:
        View(access, from_value_syntax(_OBSERVE_GROUP_ANY))  # 403 unless it may
    rows = group_rows(ctx.server, [name], members=True, admin=access.admin)
    for r in rows:
        del r["dataspace"]
    return {"dataspace": name, "scope": access.scope, "count": len(rows), "groups": rows}


async def list_assertions(ds: Any, view: View, limit: int, slice_s: float = 0.005
                          ) -> tuple[list[dict[str, Any]], int]:
    """The rows of the matches of ``view`` now (the first ``limit`` found, sorted by
    their text) and how many there are.

    The dataspace's distinct values are matched against the pattern in slices of
    ``slice_s`` seconds, letting the broker's connections run in between (a scan of
    100,000 values takes a fraction of a second in all); nothing is asserted or
    installed, so links and producers see nothing of it.  A value retracted during the
    scan is left out."""
    values = ds.assertions()
    pattern = view.observed
    admin = view.admin
    loop = asyncio.get_running_loop()
    deadline = loop.time() + slice_s
    found: dict[Any, tuple[Value, ...]] = {}
    for i, v in enumerate(values):
        caps = match(pattern, v)
        if caps is not None:
            # Whole values are distinct already; captures are told once per distinct tuple.
            k = i if admin else strict_key(Sequence(caps))
            if k not in found:
                found[k] = caps
        if i % 256 == 255 and loop.time() >= deadline:
            await asyncio.sleep(0)
            deadline = loop.time() + slice_s
    rows: list[dict[str, Any]] = []
    count = 0
    inner = view.inner
    for caps in found.values():
        if view.admin and caps[0] not in ds:
            continue  # retracted meanwhile
        if inner is not None and inner.apply(Sequence(caps)) is None:
            continue  # the caveats on what the observer is told drop it
        count += 1
        if len(rows) < limit:
            row = view.row(caps)
            if row is not None:
                if view.admin:
                    row["copies"] = ds.count(caps[0])
                rows.append(row)
    rows.sort(key=lambda r: r.get("value") or r.get("match") or "")
    return rows, count


async def _watch(ctx: WebContext, watches: Watches, request: web.Request, access: Access
                 ) -> web.StreamResponse:
    name, _ds = _dataspace(ctx, request, access)
    pattern = parse_user_pattern(request.query.get("pattern"))
    view = View(access, pattern)
    if watches.closing:
        raise ApiError(503, "the server is shutting down", {"Retry-After": "1"})
    if len(watches.active) >= watches.max_watches:
        raise ApiError(503, f"too many watches ({watches.max_watches} at once); try again "
                       "later", {"Retry-After": "5"})
    server = ctx.server
    target: Entity = server.entity(name)
    observed: Pattern = view.observed
    if not access.admin and access.attenuation is not None:
        target = AttenuatedEntity(target, access.attenuation)
        observed = view.asked  # the caveats rewrite it as for any subscription
    w = _Watcher(watches.queue)
    handle = fresh_handle()
    try:
        target.on_assert(Record._make(OBSERVE, (pattern_value(observed), Embedded(w))), handle)
    except TurnTooLarge as e:
        raise ApiError(413, f"{pattern} matches too much to watch at once ({e}); narrow the "
                       "pattern") from None
    watches.active.add(w)
    watches.changed.set()
    try:
        if w.overflow:
            raise ApiError(413, f"{pattern} matches more than {watches.queue} assertions; "
                           "narrow the pattern, or list them with /api/assertions")
        return await _stream(watches, request, name, view, w)
    finally:
        w.close()
        watches.active.discard(w)
        watches.changed.set()
        with contextlib.suppress(Exception):
            target.on_retract(handle)


async def _stream(watches: Watches, request: web.Request, name: str, view: View, w: _Watcher
                  ) -> web.StreamResponse:
    resp = web.StreamResponse(headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-store",
        "X-Accel-Buffering": "no",
        "X-Content-Type-Options": "nosniff",
    })
    await resp.prepare(request)

    async def send(data: bytes) -> None:
        async with asyncio.timeout(watches.send_timeout):
            await resp.write(data)

    synced = False
    head = {"dataspace": name, **view.describe()}
    try:
        await send(b": watching " + json.dumps(head, ensure_ascii=False).encode() + b"\n\n")
        while True:
            out: list[bytes] = []
            while w.events and len(out) < 256:
                kind, caps = w.events.popleft()
                row = view.row(caps, filtered=False)
                if row is not None:
                    row = {"event": kind, **row}
                    out.append(b"data: " + json.dumps(row, ensure_ascii=False).encode() + b"\n\n")
            if not w.events and not synced:
                synced = True
                out.append(b"event: synced\ndata: " + json.dumps(
                    {**head, "matches": len(w.held)}).encode() + b"\n\n")
            if out:
                await send(b"".join(out))
                continue
            if w.closed:
                break
            w.wake.clear()
            try:
                async with asyncio.timeout(watches.keepalive):
                    await w.wake.wait()
            except TimeoutError:
                await send(b": keep-alive\n\n")
        if w.overflow:
            err = {"error": f"more than {watches.queue} events waited for this client; the "
                   "watch ends (reconnect to start from the current state)"}
            await send(b"event: error\ndata: " + json.dumps(err).encode() + b"\n\n")
        await resp.write_eof()
    except (ConnectionError, TimeoutError) as e:
        log.debug("watch of %s ended: %s", view.pattern, e or type(e).__name__)
        if request.transport is not None:
            request.transport.close()
    return resp


def setup(app: web.Application, ctx: WebContext) -> None:
    """Add ``/api/subscriptions``, ``/api/assertions``, ``/api/watch`` and ``/api/groups``.

    ``ctx.settings["watches"]`` (a :class:`Watches`) overrides the watches' bounds."""
    watches = ctx.settings.get("watches") or Watches()
    app[WATCHES] = watches

    async def on_shutdown(app: web.Application) -> None:
        watches.close()

    app.on_shutdown.append(on_shutdown)

    async def api_subscriptions(request: web.Request, access: Access) -> web.StreamResponse:
        name, ds = _dataspace(ctx, request, access)
        return json_response(subscriptions(ctx, name, ds, access))

    async def api_assertions(request: web.Request, access: Access) -> web.StreamResponse:
        name, ds = _dataspace(ctx, request, access)
        pattern = parse_user_pattern(request.query.get("pattern"))
        limit = _limit(request)
        view = View(access, pattern)
        rows, count = await list_assertions(ds, view, limit)
        return json_response({"dataspace": name, "scope": access.scope, **view.describe(),
                              "count": count, "limit": limit, "truncated": count > len(rows),
                              "assertions": rows})

    async def api_watch(request: web.Request, access: Access) -> web.StreamResponse:
        return await _watch(ctx, watches, request, access)

    async def api_groups(request: web.Request, access: Access) -> web.StreamResponse:
        name, _ds = _dataspace(ctx, request, access)
        return json_response(groups_view(ctx, name, access))

    r = app.router
    r.add_get("/api/subscriptions", guarded(ctx, api_subscriptions), allow_head=False)
    r.add_get("/api/assertions", guarded(ctx, api_assertions), allow_head=False)
    r.add_get("/api/watch", guarded(ctx, api_watch), allow_head=False)
    r.add_get("/api/groups", guarded(ctx, api_groups), allow_head=False)
