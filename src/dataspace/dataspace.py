"""The in-process dataspace: assertions with handles, messages, observers and turns.

>>> ds = Dataspace()
>>> seen = []
>>> sub = ds.observe('<Present $who>', on_assert=lambda who: seen.append(("+", who)),
...                  on_retract=lambda who: seen.append(("-", who)))
>>> h = ds.assert_(parse('<Present "alice">'))
>>> ds.retract(h)
>>> seen
[('+', 'alice'), ('-', 'alice')]

Semantics
---------
* Assertions are counted (bag semantics): two handles asserting the same value make it
  present once; it disappears when the last handle is retracted.
* A *turn* (``with ds.turn(): ...``) applies its actions atomically when it ends: first
  every addition, then every removal, then the messages in the order sent.  An assertion
  made and retracted in the same turn is never seen.  Outside an explicit turn every call
  is its own turn.
* Observer callbacks never run inside the index: they are queued and run in order once
  the turn that caused them has been applied.  Whatever a callback does (assert, retract,
  send, observe) forms a new turn, applied when the callback returns; if the callback
  raises, the exception is logged and that turn is discarded -- the dataspace carries on.
* Subscriptions are assertions too: ``observe`` asserts ``<Observe pattern #:observer>``
  (the pattern in the Syndicate wire form), so a producer can observe interest.  Any
  ``<Observe ...>`` assertion works, including ones whose observer is an :class:`Entity`
  (that is how remote peers subscribe): the entity is asserted the captures as a sequence,
  retracted when they go, and sent the captures of each matching message.
* :meth:`Dataspace.during` runs a setup function in a *facet* for each matching assertion;
  everything the setup asserts or observes (and the cleanup function it may return) is
  retracted/cancelled/called when that assertion is retracted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final, NewType, final

from mypy_extensions import mypyc_attr

from .index import Index
from .pattern import Pattern, PatternError, as_pattern, from_preserves, to_preserves
from .values import Embedded, Record, Sequence, Symbol, Value, key, preserve, sort_key, strip
from .values.binary import DEFAULT_MAX_DEPTH, make_reader
from .values.model import _PLAIN

__all__ = [
    "Dataspace",
    "Encoded",
    "TurnTooLarge",
    "DataspaceEntity",
    "Entity",
    "Facet",
    "Handle",
    "Subscription",
    "OBSERVE",
    "fresh_handle",
]

log = logging.getLogger(__name__)

OBSERVE = Symbol("Observe")


@final
class _Ids:
    """The process-wide source of handles and ids (one counter: a handle of one
    dataspace is never live in another).  Compiled, ``next_id`` is a native call on a
    native attribute, where ``next(itertools.count())`` was a module-dict lookup and a
    call through the interpreter."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def next_id(self) -> int:
        n = self.n + 1
        self.n = n
        return n


_ids: Final = _Ids()
_MISSING = object()


class TurnTooLarge(Exception):
    """A turn would have delivered more events than :attr:`Dataspace.max_turn_events`.

    The turn is undone before this is raised: nothing of it was applied or delivered.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"turn too large: it would deliver more than {limit} events to observers; "
            "split it into smaller turns, or observe narrower patterns"
        )
        self.limit = limit
        self.sent = 0
        """Turns sent before this one was refused (see :meth:`Dataspace.send_turns`)."""


_read_plain = make_reader(False, None, DEFAULT_MAX_DEPTH)


class Encoded:
    """Messages given by their canonical binary encodings: spans of one received buffer
    ``buf``.  ``msgs`` holds, per message, ``[start, item offsets..., end]``: where it
    starts, where each item of its outermost record, sequence, set or dictionary starts
    (a record's label is its first item) and where it ends, as
    :func:`dataspace.protocol.route.scan_rel` finds them: every offset but the start
    relative to the start.  A relay hands a run of messages
    to one entity as one of these, to a dataspace with a message router, which delivers
    them without decoding; values are decoded only when something needs them.
    ``skip``: the router's forwarders that must not hear these (the link they came in
    by: see :meth:`dataspace.protocol.route.MessageRouter.add_forwarder`)."""

    __slots__ = ("_values", "buf", "msgs", "skip")

    def __init__(self, buf: bytes, msgs: list[list[int]]) -> None:
        self.buf = buf
        self.msgs = msgs
        self._values: list[Value] | None = None
        self.skip: tuple[Any, ...] | None = None

    def values(self) -> list[Value]:
        """The messages, decoded (once)."""
        vs = self._values
        if vs is None:
            buf = self.buf
            vs = self._values = [_read_plain(buf, m[0], 0)[0] for m in self.msgs]
        return vs

    def encodings(self) -> list[bytes]:
        buf = self.buf
        return [buf[m[0]:m[0] + m[-1]] for m in self.msgs]

    def __len__(self) -> int:
        return len(self.msgs)

    def __repr__(self) -> str:
        return f"Encoded({self.encodings()!r})"


@mypyc_attr(allow_interpreted_subclasses=True)
class Entity:
    """Something assertions and messages can be delivered to (Syndicate's entity).

    Subclass and override what you need.  ``handle`` identifies an assertion until it is
    retracted.  Methods are called from the dataspace's dispatch loop, never re-entrantly.
    """

    def on_assert(self, value: Value, handle: int) -> None:
        """``value`` was asserted to this entity under ``handle``."""

    def on_retract(self, handle: int) -> None:
        """The assertion made under ``handle`` was retracted."""

    def on_message(self, value: Value) -> None:
        """``value`` was sent to this entity."""

    # Optional, looked up by name (``getattr``) where they matter, so a subclass defines
    # them as methods or sets them as attributes:
    #
    # ``send_body(body)`` delivers a message given by its canonical encoding ``body`` (a
    # relay's proxy for a peer's object: the bytes go out as they are); a dataspace's
    # message router delivers to such observers without decoding.
    #
    # ``on_messages(values)``: a relay hands it the messages of one incoming packet that
    # are all to this entity, at once and in order, instead of calling :meth:`on_message`
    # for each (a link's data entity: its peer's packets are long runs of messages).


Handle = NewType("Handle", int)
"""The receipt for an assertion: pass it to :meth:`Dataspace.retract`.

A handle is a plain integer, unique in the process.  (Plain on purpose: CPython does not
track integers in its garbage collector, so holding many assertions does not make every
collection slower, as a small object per assertion would.)
"""


class Facet:
    """Owns assertions, subscriptions and child facets that end together."""

    __slots__ = ("alive", "children", "cleanups", "handles", "parent", "subscriptions")

    def __init__(self, parent: Facet | None) -> None:
        self.handles: set[Handle] = set()
        self.subscriptions: set[Any] = set()  # Subscription or RemoteSubscription
        self.children: set[Facet] = set()
        self.cleanups: list[Callable[[], Any]] = []
        self.parent = parent
        self.alive = True
        if parent is not None:
            parent.children.add(self)

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


class Subscription:
    """An active observer: returned by :meth:`Dataspace.observe`; :meth:`cancel` ends it."""

    __slots__ = (
        "__weakref__",
        "_during",
        "ds",
        "facet",
        "handle",
        "id",
        "live",
        "on_assert",
        "on_message",
        "on_retract",
        "pattern",
    )

    def __init__(
        self,
        ds: Dataspace,
        pattern: Pattern,
        on_assert: Callable[..., Any] | None,
        on_retract: Callable[..., Any] | None,
        on_message: Callable[..., Any] | None,
        facet: Facet | None,
    ) -> None:
        self.id = _ids.next_id()
        self.ds = ds
        self.pattern = pattern
        self.on_assert = on_assert
        self.on_retract = on_retract
        self.on_message = on_message
        self.facet = facet
        self.handle: Handle | None = None
        self.live = True
        # For ``during``: captures -> facet running for them.
        self._during: dict[tuple[Any, ...], Facet] | None = None

    def cancel(self) -> None:
        """Stop observing (retracts the ``<Observe ...>`` assertion; ends ``during``
        facets)."""
        self.ds._cancel(self)

    def __hash__(self) -> int:
        return self.id

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        return f"<Subscription {self.id} {self.pattern}>"


class _EntityObserver:
    """Index target for an ``<Observe P #:entity>`` whose observer is an Entity."""

    __slots__ = ("delivered", "ds", "entity", "handles", "live")

    def __init__(self, ds: Dataspace, entity: Entity) -> None:
        self.ds = ds
        self.entity = entity
        self.handles: dict[Any, int] = {}
        self.live = True
        self.delivered = 0  # events delivered (for monitoring: the busiest patterns)

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def deliver(self, event: str, caps: tuple[Any, ...]) -> None:
        self.delivered += 1
        value = tuple.__new__(Sequence, caps)
        if event == "+":
            h = _ids.next_id()
            self.handles[value] = h
            self.entity.on_assert(value, h)
        elif event == "-":
            gone = self.handles.pop(value, None)
            if gone is not None:
                self.entity.on_retract(gone)
        else:
            self.entity.on_message(value)

    def deliver_body(self, body: bytes) -> None:
        """Deliver a message of captures given by their encoding (``[capture ...]``);
        the entity has ``send_body``."""
        if self.live:
            self.delivered += 1
            send = getattr(self.entity, "send_body", None)
            if send is not None:
                send(body)

    @property
    def dead(self) -> bool:
        """Uninstalled, or its entity can no longer receive (a closed connection's)."""
        return not self.live or getattr(self.entity, "alive", True) is False

    def retract_all(self) -> dict[Any, int]:
        """Queue a retraction of everything delivered; returns what was held."""
        held = self.handles
        self.handles = {}
        if held and getattr(self.entity, "alive", True) is not False:
            on_retract = self.entity.on_retract
            q = self.ds._queue
            for h in held.values():
                q.append(("x", (on_retract,), (h,)))
        return held


@mypyc_attr(allow_interpreted_subclasses=True)
class _DataspaceBase:
    """What the in-process :class:`Dataspace` and the remote client share: live handles
    and their values, turns (collected, applied as their net effect, undone if they
    fail), callbacks run as turns of their own, and facets for ``during``.

    A subclass says how a turn's net effect is applied (:meth:`_apply`) and what follows
    a turn (:meth:`_after_turn`); subscriptions have ``live``, ``facet``, ``handle`` and
    ``_during`` attributes.
    """

    name: str

    def _init_base(self) -> None:
        self._turn: list[tuple[str, Any, Any]] | None = None
        self._turn_depth = 0
        self._facet: Facet | None = None
        # Live handles and their values; handles made inside a facet and their facet.
        self._values: dict[Handle, Value] = {}
        self._owner: dict[Handle, Facet] = {}

    def _apply(
        self, added: dict[Handle, Value], removed: list[tuple[Handle, Value]], messages: list[Value]
    ) -> None:
        raise NotImplementedError

    def _after_turn(self) -> None:
        pass

    def assert_(self, value: Value) -> Handle:
        raise NotImplementedError

    def retract(self, handle: Any) -> bool:
        raise NotImplementedError

    def send(self, value: Value) -> None:
        raise NotImplementedError

    def observe(
        self,
        pattern: Pattern | str | Value,
        on_assert: Callable[..., Any] | None = None,
        on_retract: Callable[..., Any] | None = None,
        on_message: Callable[..., Any] | None = None,
        *,
        group: str | None = None,
        rebalance: bool = False,
    ) -> Any:
        raise NotImplementedError

    def value_of(self, handle: Handle) -> Value | None:
        """The value asserted under ``handle``, or None if it is not live."""
        return self._values.get(handle)

    def _new_handle(self, value: Value) -> Handle:
        """Record a live handle for ``value``, owned by the current facet if any."""
        h: Handle = _ids.next_id()  # type: ignore[assignment]
        self._values[h] = value
        facet = self._facet
        if facet is not None:
            facet.handles.add(h)
            self._owner[h] = facet
        return h

    def _drop_handle(self, handle: Any) -> Any:
        """Forget a live handle; its value, or _MISSING if it was not live."""
        values = self._values
        value = values.get(handle, _MISSING)
        if value is _MISSING:
            return value
        del values[handle]
        if self._owner:
            facet = self._owner.pop(handle, None)
            if facet is not None:
                facet.handles.discard(handle)
        return value

    @contextmanager
    def turn(self) -> Iterator[Any]:
        """Group actions into one atomic turn (additions, then removals, then messages).

        If the block raises, the turn is discarded and the exception propagates.
        """
        if self._turn is not None:
            self._turn_depth += 1
            try:
                yield self
            finally:
                self._turn_depth -= 1
            return
        self._turn = []
        try:
            yield self
        except BaseException:
            actions, self._turn = self._turn, None
            self._undo(actions)
            raise
        actions, self._turn = self._turn, None
        try:
            self._commit(actions)
        except TurnTooLarge:
            self._undo(actions)
            raise
        self._after_turn()

    def _commit(self, actions: list[tuple[str, Any, Any]]) -> None:
        # Net effect of the turn: an assertion both made and retracted here never shows.
        added: dict[Handle, Value] = {}
        removed: list[tuple[Handle, Value]] = []
        messages: list[Value] = []
        for kind, h, v in actions:
            if kind == "a":
                added[h] = v
            elif kind == "r":
                if added.pop(h, _MISSING) is _MISSING:
                    removed.append((h, v))
            else:
                messages.append(v)
        self._apply(added, removed, messages)

    def _undo(self, actions: list[tuple[str, Any, Any]]) -> None:
        for i in range(len(actions) - 1, -1, -1):
            kind, h, v = actions[i]
            if kind == "a":
                self._values.pop(h, None)
                facet = self._owner.pop(h, None)
                if facet is not None:
                    facet.handles.discard(h)
            elif kind == "r":
                self._values[h] = v

    def _run_callback(self, fn: Callable[..., Any], args: tuple[Any, ...], facet: Facet | None) -> None:
        """Run one callback as its own turn, in ``facet``, isolating failures."""
        prev_turn, prev_facet = self._turn, self._facet
        turn: list[tuple[str, Any, Any]] = []
        self._turn = turn
        self._facet = facet
        try:
            fn(*args)
        except Exception:
            log.exception("%s: callback %r failed; its actions are discarded", self.name, fn)
            self._turn = prev_turn
            self._undo(turn)
        else:
            self._turn = prev_turn
            if turn:
                self._commit(turn)
        finally:
            self._turn, self._facet = prev_turn, prev_facet

    # -- one-shot reads: query and request ------------------------------------------------

    async def _barrier(self, timeout: float | None) -> None:
        """Wait until everything done so far has been processed and its consequences
        delivered (the remote client's round trip; in process, nothing to wait for)."""

    def _check_ready(self, what: str) -> None:
        """Raise if ``what`` (query, request) cannot work now."""
        if self._turn is not None:
            raise RuntimeError(f"{what}() inside a turn: the turn's actions (the "
                               "subscription among them) apply only when it ends")

    async def query(self, pattern: Pattern | str | Value,
                    timeout: float | None = 30.0) -> list[tuple[Any, ...]]:
        """The matches of ``pattern`` now: one tuple of captures per distinct match, in
        Preserves order (``[]`` when nothing matches; ``[()]`` when something matches a
        pattern that captures nothing).

        A one-shot :meth:`observe`: it subscribes, waits until the dataspace has told it
        everything that matches (for a remote dataspace, a round trip: :meth:`sync`),
        then cancels.  Like ``redis-cli KEYS`` or ``nats kv ls``; ``dataspace query``
        on the command line.
        """
        self._check_ready("query")
        present: dict[Any, tuple[Any, ...]] = {}

        def add(*caps: Any) -> None:
            present[key(Sequence(caps))] = caps

        def drop(*caps: Any) -> None:
            present.pop(key(Sequence(caps)), None)

        sub = self.observe(pattern, on_assert=add, on_retract=drop)
        try:
            await self._barrier(timeout)
        finally:
            sub.cancel()
        return sorted(present.values(), key=lambda caps: sort_key(Sequence(caps)))

    async def request(self, message: Value, reply: Pattern | str | Value,
                      timeout: float | None = 10.0) -> tuple[Any, ...]:
        """Send ``message`` and return the captures of the first message matching the
        pattern ``reply`` (request/reply, like ``nats req``).

        The reply is observed before the request is sent, so a responder cannot answer
        too early.  Only messages count as replies (an assertion already present is not
        an answer to this request).  Raises ``TimeoutError`` when no reply comes within
        ``timeout`` seconds (None: wait for ever).
        """
        self._check_ready("request")
        pat = as_pattern(reply)
        fut: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()

        def got(*caps: Any) -> None:
            if not fut.done():
                fut.set_result(caps)

        sub = self.observe(pat, on_message=got)
        try:
            self.send(message)
            try:
                return await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                raise TimeoutError(f"no reply matching {pat} within {timeout:g} s") from None
        finally:
            sub.cancel()

    # -- subscriptions and facets (during) -----------------------------------------------

    def _forget(self, sub: Any) -> None:
        """A subscription ended (hook for subclasses that track them: a hidden one of the
        in-process Dataspace leaves the index here)."""

    def _new_subscription(self, pat: Pattern, on_assert: Any, on_retract: Any,
                          on_message: Any) -> Any:
        """A subscription object of this kind of dataspace (hook for subclasses)."""
        raise NotImplementedError

    def _observer_of(self, sub: Any) -> Any:
        """What ``<Observe PATTERN #:observer>`` embeds for ``sub`` (hook)."""
        return sub

    def _subscribe(self, pattern: Pattern | str | Value, on_assert: Any, on_retract: Any,
                   on_message: Any, setup: Callable[..., Any] | None = None) -> Any:
        """observe() and during(), once for both kinds of dataspace: a subscription in
        the current facet, asserted as ``<Observe PATTERN #:observer>``; with ``setup``,
        a facet per distinct match (see during())."""
        pat = as_pattern(pattern)
        sub = self._new_subscription(pat, on_assert, on_retract, on_message)
        if setup is not None:
            sub._during = {}
            sub.on_assert = lambda *caps: self._start_facet(sub, caps, setup)
            sub.on_retract = lambda *caps: self._stop_during(sub, caps)
        if self._facet is not None:
            self._facet.subscriptions.add(sub)
        observe = Record._make(OBSERVE, (to_preserves(pat), Embedded(self._observer_of(sub))))
        sub.handle = self.assert_(observe)
        return sub

    def _cancel(self, sub: Any) -> None:
        if not sub.live:
            return
        sub.live = False
        self._forget(sub)
        if sub.facet is not None:
            sub.facet.subscriptions.discard(sub)
        if sub.handle is not None:
            self.retract(sub.handle)
        if sub._during:
            facets = list(sub._during.values())
            sub._during.clear()
            for f in facets:
                self._stop_facet(f)

    def _start_facet(self, sub: Any, caps: tuple[Any, ...], setup: Callable[..., Any]) -> None:
        facet = Facet(sub.facet)
        # Keyed by the captures as a Sequence: (1,) and (True,) are different matches.
        sub._during[Sequence(caps)] = facet
        prev = self._facet
        self._facet = facet
        try:
            cleanup = setup(*caps)
        finally:
            self._facet = prev
        if callable(cleanup):
            facet.cleanups.append(cleanup)

    def _stop_during(self, sub: Any, caps: tuple[Any, ...]) -> None:
        facet = sub._during.pop(Sequence(caps), None)
        if facet is not None:
            self._stop_facet(facet)

    def _stop_facet(self, facet: Facet) -> None:
        if not facet.alive:
            return
        facet.alive = False
        for child in list(facet.children):
            self._stop_facet(child)
        for sub in list(facet.subscriptions):
            self._cancel(sub)
        for h in list(facet.handles):
            self.retract(h)
        facet.handles.clear()
        for fn in facet.cleanups:
            try:
                fn()
            except Exception:
                log.exception("%s: cleanup %r failed", self.name, fn)
        if facet.parent is not None:
            facet.parent.children.discard(facet)


class Dataspace(_DataspaceBase):
    """An in-process dataspace (see the module docstring for the semantics)."""

    def __init__(self, name: str = "dataspace") -> None:
        self.name = name
        # Events the index produces, (event, targets, captures), dispatched in order.
        self._queue: list[tuple[str, tuple[Any, ...], Any]] = []
        self.index = Index(sink=self._queue)
        self._init_base()
        self._dispatching = False
        # Lists used again rather than made anew for every event (each one made is work
        # for the cyclic collector): a dispatched batch, and a callback's turn that
        # stayed empty.  Both are empty while kept here.
        self._spare_batch: list[tuple[str, tuple[Any, ...], Any]] | None = None
        self._spare_turn: list[tuple[str, Any, Any]] | None = None
        # Observe assertion (strict key) -> (pattern, index callback)
        self._observers: dict[Any, tuple[Pattern, Any]] = {}
        # id() of each object observing through an installed <Observe> -> how many
        self._observing: dict[int, int] = {}
        self._hidden: set[Subscription] = set()  # see observe_hidden
        # Count watches (see watch_counts): strict keys watched -> watchers, and the hook.
        self._watch: dict[Any, int] = {}
        self._watch_fn: Callable[[Value], Any] | None = None
        self._tap: Callable[[Any], Any] | None = None  # see tap_messages
        self.router: Any = None
        """A message router (:class:`dataspace.protocol.route.MessageRouter`) that
        delivers :class:`Encoded` messages on their bytes; None: they are decoded."""
        self.max_turn_events: int | None = None
        """When set, a turn (or an action outside a turn) that would deliver more events
        than this to observers is undone and raises :class:`TurnTooLarge` (a server sets
        it, so that one peer's turn cannot queue unbounded work; callbacks' own turns
        are not metered)."""

    # -- the public API ------------------------------------------------------------------

    def assert_(self, value: Value) -> Handle:
        """Assert ``value``; returns the handle that retracts it."""
        if type(value) not in _PLAIN:
            value = strip(preserve(value))
        h = self._new_handle(value)
        turn = self._turn
        if turn is not None:
            turn.append(("a", h, value))
            return h
        if self.max_turn_events is not None:
            try:
                self._apply_metered({h: value}, (), ())
            except TurnTooLarge:
                self._drop_handle(h)
                raise
            if self._queue and not self._dispatching:
                self._dispatch()
            return h
        if self.index.adjust_assertion(value, 1) and type(value) is Record:
            self._maybe_install(value)
        if self._watch:
            self._watched(value)
        if self._queue and not self._dispatching:
            self._dispatch()
        return h

    def retract(self, handle: Any) -> bool:
        """Retract the assertion made under ``handle`` (a :data:`Handle`).

        Returns False (and does nothing) if it was already retracted or is not a handle
        of this dataspace.
        """
        value = self._drop_handle(handle)
        if value is _MISSING:
            if not isinstance(handle, int):
                raise TypeError(f"retract() takes a Handle, not {type(handle).__name__}")
            return False
        turn = self._turn
        if turn is not None:
            turn.append(("r", handle, value))
            return True
        if self.max_turn_events is not None:
            try:
                self._apply_metered({}, ((handle, value),), ())
            except TurnTooLarge:
                self._values[handle] = value
                raise
        else:
            self._remove(value)
        if self._queue and not self._dispatching:
            self._dispatch()
        return True

    def send(self, value: Value) -> None:
        """Send ``value`` as a message to every current matching observer (an
        :class:`Encoded` message too)."""
        if type(value) not in _PLAIN:
            if type(value) is not Encoded:
                value = strip(preserve(value))
            elif not value.msgs:
                return
        turn = self._turn
        if turn is not None:
            turn.append(("m", None, value))
            return
        if self.max_turn_events is not None:
            self._apply_metered({}, (), (value,))
        elif type(value) is not Encoded:
            self.index.send_message(value)
            if self._tap is not None:
                self._queue.append(("x", (self._tap,), ((value,),)))
        else:
            self._send_messages((value,))
        if self._queue and not self._dispatching:
            self._dispatch()

    def send_turns(self, enc: Encoded, cuts: list[int]) -> int:
        """Send the messages of ``enc`` as consecutive turns, the messages
        ``enc.msgs[cuts[i - 1]:cuts[i]]`` forming turn ``i``, as if each were sent (by
        :meth:`send`, in a turn of its own) after the one before had been applied and
        its callbacks run.  Returns how many turns were sent: it stops after one whose
        deliveries queued callbacks (they run first, and may change who observes what),
        and the caller sends the rest again.  Without a router, or inside a turn or a
        callback, it sends the first turn only.  A turn over :attr:`max_turn_events`
        raises :class:`TurnTooLarge` (the ones before it are sent)."""
        router = self.router
        if router is None or self._turn is not None or self._dispatching or self._queue:
            self.send(Encoded(enc.buf, enc.msgs[:cuts[0]]))
            return 1
        q = self._queue
        limit = self.max_turn_events
        entries, _cost = router.prepare(enc, 0, cuts[-1])
        sent = len(cuts)
        refused = False
        lo = 0
        for i, hi in enumerate(cuts):
            cost = 0
            queued = False
            for j in range(lo, hi):
                e = entries[j]
                cost += e.count
                if e.queued:
                    queued = True
            if limit is not None and cost > limit:
                sent = i
                refused = True
                break
            lo = hi
            if queued:
                # Its callbacks run before the next turn is routed (they may change
                # who observes what): the caller sends the rest again.
                sent = i + 1
                break
        if sent:
            m = cuts[sent - 1]
            router.emit(enc, entries[:m] if m < len(entries) else entries, q, True)
        if refused:
            log.info("%s: a turn was refused: more than %d deliveries", self.name, limit)
            err = TurnTooLarge(limit)  # type: ignore[arg-type]
            err.sent = sent
            if q:
                self._dispatch()
            raise err
        if q:
            self._dispatch()
        return sent

    def observe(
        self,
        pattern: Pattern | str | Value,
        on_assert: Callable[..., Any] | None = None,
        on_retract: Callable[..., Any] | None = None,
        on_message: Callable[..., Any] | None = None,
        *,
        group: str | None = None,
        rebalance: bool = False,
    ) -> Subscription:
        """Observe ``pattern`` (a Pattern, concise pattern text, or a wire-form value).

        ``on_assert(*captures)`` runs once per distinct capture tuple as matching
        assertions appear (including those already present), ``on_retract(*captures)``
        when the last one giving those captures goes, and ``on_message(*captures)`` for
        each matching message.

        ``group``: join that group of observers instead (:mod:`dataspace.groups`; the
        subscription asserts ``<ObserveGroup group PATTERN #:observer>``): each matching
        message goes to one member of the group, each matching assertion is a job
        assigned to one member (``on_assert``, ``on_retract`` when it is finished or
        moved away), moved to another member when this one leaves (``cancel()``).
        ``rebalance``: take a share of the jobs already assigned when joining.
        """
        if group is not None:
            from .groups import subscribe_group  # (the rules stay out of the core)

            sub: Subscription = subscribe_group(
                self, pattern, on_assert, on_retract, on_message, group, rebalance)
            return sub
        return self._subscribe(pattern, on_assert, on_retract, on_message)

    def _new_subscription(self, pat: Pattern, on_assert: Any, on_retract: Any,
                          on_message: Any) -> Subscription:
        return Subscription(self, pat, on_assert, on_retract, on_message, self._facet)

    def observe_hidden(
        self,
        pattern: Pattern | str | Value,
        on_assert: Callable[..., Any] | None = None,
        on_retract: Callable[..., Any] | None = None,
        on_message: Callable[..., Any] | None = None,
    ) -> Subscription:
        """:meth:`observe` without asserting ``<Observe ...>``: for the server's own
        machinery (links), which must not show up as interest in the dataspace or in what
        its clients see.  Takes effect at once, even inside a turn.  Without
        ``on_message`` it hears assertions only, and messages do not reach it at all
        (see :meth:`tap_messages` for those)."""
        pat = as_pattern(pattern)
        sub = Subscription(self, pat, on_assert, on_retract, on_message, None)
        self._hidden.add(sub)
        self.index.add_handler(pat, sub, messages=on_message is not None)
        if self._queue and not self._dispatching:
            self._dispatch()
        return sub

    def _forget(self, sub: Any) -> None:
        if sub in self._hidden:
            self._hidden.discard(sub)
            self.index.remove_handler(sub.pattern, sub)

    def during(
        self, pattern: Pattern | str | Value, setup: Callable[..., Any]
    ) -> Subscription:
        """For each distinct match of ``pattern`` run ``setup(*captures)`` in a new facet.

        What ``setup`` asserts and observes lives until the matching assertion is
        retracted; if ``setup`` returns a callable, it is called then too.
        """
        return self._subscribe(pattern, None, None, None, setup)

    def tap_messages(self, fn: Callable[[Any], Any] | None) -> None:
        """Have ``fn(messages)`` hear every message sent here from now on (None: stop),
        the messages of one turn at once (a sequence, in the order sent), whether or not
        anything observes them.  It is queued with the turn's deliveries (after those of
        its own messages), so it runs in order with them and is isolated like any
        callback.  For a server's links, which forward messages: one call per turn and
        no matching, where an observer of everything would cost a match and a callback
        per message.

        With a message :attr:`router`, the tap hears only the messages that are not
        routed on their bytes (those sent as values); :class:`Encoded` runs go to the
        router's forwarders instead.  Its calls are then queued where those messages
        were delivered, so that what a link forwards keeps the order of the turn."""
        self._tap = fn

    def _after_turn(self) -> None:
        if self._queue and not self._dispatching:
            self._dispatch()

    def flush(self) -> None:
        """Run queued callbacks now (normally automatic; useful after manual index use)."""
        if not self._dispatching:
            self._dispatch()

    # -- inspection ----------------------------------------------------------------------

    def __contains__(self, value: Value) -> bool:
        return value in self.index

    def count(self, value: Value) -> int:
        """How many handles currently assert ``value``."""
        return self.index.count(value)

    def assertions(self) -> list[Value]:
        """The distinct values currently asserted."""
        return self.index.assertions()

    def observer_count(self) -> int:
        """How many ``<Observe ...>`` assertions have installed an observer here."""
        return len(self._observers)

    def observers(self) -> list[tuple[Value, Pattern, Any, int, int]]:
        """Every installed ``<Observe P #:observer>`` (for monitoring): ``(the Observe
        assertion, its pattern, the observer object, events delivered to it, matches it
        holds now)``; the last two are 0 for in-process subscriptions."""
        out = []
        for value, (pat, cb) in self._observers.items():
            if type(cb) is _EntityObserver:
                out.append((value, pat, cb.entity, cb.delivered, len(cb.handles)))
            else:
                out.append((value, pat, cb, 0, 0))
        return out

    def compact(self) -> None:
        """Shrink tables that were once large (after a big release; see
        :meth:`Index.compact`).  Not while a turn or dispatch is under way."""
        if self._turn is not None or self._dispatching:
            return
        self.index.compact()
        self._values = dict(self._values)
        self._owner = dict(self._owner)
        self._observers = dict(self._observers)
        self._observing = dict(self._observing)

    # -- internals -----------------------------------------------------------------------

    def _add(self, value: Value) -> None:
        if self.index.adjust_assertion(value, 1) and type(value) is Record:
            self._maybe_install(value)
        if self._watch:
            self._watched(value)

    def _remove(self, value: Value) -> Any:
        """Remove one copy; when an observer goes with it, what :meth:`_uninstall_observer`
        returns (for a rollback)."""
        if self._watch:
            self._watched(value)
        if self.index.adjust_assertion(value, -1) and type(value) is Record:
            lab = value.label
            if type(lab) is Symbol and lab.name == "Observe":
                return self._uninstall_observer(value)
        return None

    # -- count watches ------------------------------------------------------------------

    def watch_counts(self, fn: Callable[[Value], Any] | None) -> None:
        """Call ``fn(value)`` (as a callback, after the turn) whenever the number of copies
        of a watched value changes (:meth:`watch_key`), not only when it appears or goes;
        None stops watching.  For code that must know how many holders a value has, such
        as a broker link telling its own copies from everyone else's."""
        self._watch_fn = fn
        if fn is None:
            self._watch.clear()

    def watch_key(self, k: Any, delta: int) -> None:
        """Start (``delta`` 1) or stop (-1) watching the value whose strict key is ``k``."""
        n = self._watch.get(k, 0) + delta
        if n > 0:
            self._watch[k] = n
        else:
            self._watch.pop(k, None)

    def _watched(self, value: Value) -> None:
        fn = self._watch_fn
        if fn is not None and key(value) in self._watch:
            self._queue.append(("x", (fn,), (value,)))

    def _maybe_install(self, value: Record) -> None:
        lab = value.label
        if type(lab) is not Symbol:
            return
        sym: Symbol = lab  # (typed: compiled, a native read instead of a getattr)
        if sym.name != "Observe":
            return
        if len(value.fields) != 2 or type(value.fields[1]) is not Embedded:
            return
        target = value.fields[1].value
        cb: Any
        if type(target) is Subscription and target.ds is self:
            # Our own subscription: its pattern object is at hand (and equal to the
            # wire form in the assertion), so skip reading it back.
            if not target.live:
                return
            pat = target.pattern
            cb = target
        else:
            try:
                pat = from_preserves(value.fields[0])
            except PatternError as e:
                log.warning("%s: ignoring <Observe> with a malformed pattern: %s", self.name, e)
                return
            if isinstance(target, Entity):
                cb = _EntityObserver(self, target)
            else:
                return
        self._observers[value] = (pat, cb)
        self.index.add_handler(pat, cb)
        k = id(target)
        self._observing[k] = self._observing.get(k, 0) + 1

    def _uninstall_observer(self, value: Record) -> Any:
        """Remove the observer an ``<Observe>`` assertion installed.  Returns
        ``(value, entry, held)`` for :meth:`_reinstall`, or None if there was none."""
        entry = self._observers.pop(value, None)
        if entry is None:
            return None
        pat, cb = entry
        self.index.remove_handler(pat, cb)
        self._unobserving(cb)
        held = None
        if type(cb) is _EntityObserver:
            cb.live = False
            held = cb.retract_all()
        return (value, entry, held)

    def _unobserving(self, cb: Any) -> None:
        k = id(cb.entity if type(cb) is _EntityObserver else cb)
        n = self._observing.get(k, 0) - 1
        if n > 0:
            self._observing[k] = n
        else:
            self._observing.pop(k, None)

    def is_observer(self, obj: Any) -> bool:
        """Whether ``obj`` is the observer of an ``<Observe ...>`` installed here."""
        return id(obj) in self._observing

    def _reinstall(self, info: Any) -> None:
        """Undo :meth:`_uninstall_observer` (the events it queued are discarded by the
        caller): the same observer, holding what it held."""
        value, entry, held = info
        pat, cb = entry
        self._observers[value] = entry
        self.index.add_handler(pat, cb)
        k = id(cb.entity if type(cb) is _EntityObserver else cb)
        self._observing[k] = self._observing.get(k, 0) + 1
        if type(cb) is _EntityObserver:
            cb.live = True
            cb.handles = held or {}

    def _observers_going(self, removed: Any) -> list[Value]:
        """The ``<Observe>`` assertions that ``removed`` (handle, value) pairs take away
        entirely: their observers are uninstalled before anything else is removed, so a
        peer dropping many observers of everything does not first hear every one of its
        own retractions (quadratic work for nothing)."""
        counts: dict[Any, list[Any]] = {}
        for _h, v in removed:
            if type(v) is Record and v.label == OBSERVE and v in self._observers:
                e = counts.get(v)
                if e is None:
                    counts[v] = [v, 1]
                else:
                    e[1] += 1
        return [v for v, n in counts.values() if self.index.count(v) <= n]

    def _apply(
        self, added: dict[Handle, Value], removed: list[tuple[Handle, Value]], messages: list[Value]
    ) -> None:
        if self.max_turn_events is not None and not self._dispatching:
            self._apply_metered(added, removed, messages)
            return
        for v in added.values():
            self._add(v)
        if len(removed) > 1:
            for v in self._observers_going(removed):
                self._uninstall_observer(v)
        for _h, v in removed:
            self._remove(v)
        if messages:
            self._send_messages(messages)

    def _send_messages(self, messages: Any) -> None:
        """Deliver a turn's messages (unmetered), in order, and tell the tap (see
        :meth:`tap_messages`)."""
        send = self.index.send_message
        router = self.router
        q = self._queue
        tap = self._tap
        tapped: list[Value] = []  # values sent since the last run routed on bytes
        for m in messages:
            if type(m) is Encoded:
                if router is not None:
                    if tapped:
                        q.append(("x", (tap,), (tapped,)))
                        tapped = []
                    router.emit(m, router.prepare(m)[0], q, True)
                    continue
                vs = m.values()
                for v in vs:
                    send(v)
                if tap is not None:
                    tapped += vs
                continue
            send(m)
            if tap is not None:
                tapped.append(m)
        if tapped:
            q.append(("x", (tap,), (tapped,)))

    def _apply_metered(self, added: Any, removed: Any, messages: Any) -> None:
        """:meth:`_apply` counting the deliveries that additions and messages queue; past
        ``max_turn_events`` every change is undone, the queued events are dropped, and
        TurnTooLarge is raised."""
        limit = self.max_turn_events
        assert limit is not None
        q = self._queue
        start = len(q)
        used = 0
        done: list[tuple[str, Any, Any]] = []
        try:
            for v in added.values():
                n = len(q)
                self._add(v)
                done.append(("a", v, None))
                if len(q) != n:
                    used += _queued_cost(q, n)
                    if used > limit:
                        raise TurnTooLarge(limit)
            # Retractions are never refused (a peer must always be able to take back
            # what it asserted, and closing retracts everything): they are not counted.
            if len(removed) > 1:
                for v in self._observers_going(removed):
                    done.append(("u", v, self._uninstall_observer(v)))
            for _h, v in removed:
                done.append(("r", v, self._remove(v)))
            router = self.router
            tap = self._tap
            tapped: list[Value] = []  # values sent since the last run routed on bytes
            routed: list[Any] = []  # (messages, deliveries): delivered once the turn fits
            for m in messages:
                if type(m) is Encoded:
                    if router is not None:
                        if tapped:  # (the tap hears them before the run that follows)
                            q.append(("x", (tap,), (tapped,)))
                            tapped = []
                        entries, cost = router.prepare(m)
                        if cost:
                            used += cost
                            if used > limit:
                                raise TurnTooLarge(limit)
                        routed.append((m, entries))
                        continue
                    values: Any = m.values()
                else:
                    values = (m,)
                if routed:  # those before it go first (queued: the turn may not fit)
                    for rm, entries in routed:
                        router.emit(rm, entries, q, False)
                    routed = []
                for v in values:
                    n = len(q)
                    self.index.send_message(v)
                    if len(q) != n:
                        used += _queued_cost(q, n)
                        if used > limit:
                            raise TurnTooLarge(limit)
                if tap is not None:
                    tapped += values
            for rm, entries in routed:
                router.emit(rm, entries, q, True)
            if tapped:
                q.append(("x", (tap,), (tapped,)))
        except TurnTooLarge:
            for i in range(len(done) - 1, -1, -1):
                kind, v, info = done[i]
                if kind == "a":
                    self._remove(v)
                elif kind == "r":
                    self.index.adjust_assertion(v, 1)
                    if info is not None:
                        self._reinstall(info)
                elif info is not None:
                    self._reinstall(info)
            while len(q) > start:
                q.pop()
            log.info("%s: a turn was refused: more than %d deliveries", self.name, limit)
            raise

    def _dispatch(self) -> None:
        self._dispatching = True
        try:
            while self._queue:
                # The events queued so far, in order; what they cause goes to a fresh
                # list (the index's sink too), dispatched after them.
                batch = self._queue
                fresh = self._spare_batch
                self._spare_batch = None
                if fresh is None:
                    fresh = []
                self._queue = fresh
                self.index.sink = fresh
                i = 0
                try:
                    for event, targets, caps in batch:
                        i += 1
                        self._dispatch_one(event, targets, caps)
                except BaseException:
                    # Keep the undelivered events, ahead of those they caused.
                    self._queue[:0] = batch[i:]
                    raise
                batch.clear()
                self._spare_batch = batch
        finally:
            self._dispatching = False

    def _dispatch_one(self, event: str, targets: tuple[Any, ...], caps: Any) -> None:
        if event == "b":  # a message's encoding to observers that take bytes
            for target in targets:
                target.deliver_body(caps)
            return
        for target in targets:
            if type(target) is Subscription:
                sub: Subscription = target
                if not sub.live:
                    continue
                if event == "!":
                    fn = sub.on_message
                elif event == "+":
                    fn = sub.on_assert
                else:
                    fn = sub.on_retract
                if fn is None:
                    continue
                # _run_callback(fn, caps, sub.facet), inlined: the hottest call
                prev_turn = self._turn
                prev_facet = self._facet
                turn = self._spare_turn
                self._spare_turn = None
                if turn is None:
                    turn = []
                self._turn = turn
                self._facet = sub.facet
                try:
                    fn(*caps)
                except Exception:
                    log.exception("%s: callback %r failed; its actions are discarded",
                                  self.name, fn)
                    self._turn = prev_turn
                    self._undo(turn)
                else:
                    self._turn = prev_turn
                    if turn:
                        self._commit(turn)
                    else:
                        self._spare_turn = turn  # (nothing done: the next one's)
                finally:
                    self._turn = prev_turn
                    self._facet = prev_facet
            elif event == "x":
                self._run_callback(target, caps, None)
            elif not target.dead:
                self._run_callback(target.deliver, (event, caps), None)


def _decoded(messages: Any) -> Any:
    """``messages`` with every :class:`Encoded` run decoded (for the tap)."""
    for m in messages:
        if type(m) is Encoded:
            out: list[Value] = []
            for x in messages:
                if type(x) is Encoded:
                    out += x.values()
                else:
                    out.append(x)
            return out
    return messages


def _queued_cost(q: list[Any], n: int) -> int:
    """Deliveries in the entries queued after the first ``n``."""
    total = 0
    for i in range(n, len(q)):
        total += len(q[i][1])
    return total


def fresh_handle() -> Handle:
    """A new process-unique handle, for code that asserts to an :class:`Entity` directly
    (a relay applying a peer's assertions, a gatekeeper answering)."""
    return _ids.next_id()  # type: ignore[return-value]


class DataspaceEntity(Entity):
    """An :class:`Entity` facade over a :class:`Dataspace`: what a remote peer addresses.

    Assertions made to the facade under the caller's handles become assertions in the
    dataspace (under handles of its own), retractions retract them and messages are sent.
    An ``<Observe pattern #:entity>`` asserted this way subscribes ``entity``.
    """

    def __init__(self, dataspace: Dataspace) -> None:
        self.dataspace = dataspace
        self._handles: dict[int, Handle] = {}
        # Handles being asserted -> retracted meanwhile?  (Asserting dispatches events,
        # and what they cause may retract the very assertion being made: a peer whose
        # connection fails while it is told of its own assertion.)
        self._pending: dict[int, bool] = {}

    def on_assert(self, value: Value, handle: int) -> None:
        pending = self._pending
        pending[handle] = False
        try:
            h = self.dataspace.assert_(value)
        finally:
            early = pending.pop(handle)
        if early:
            self.dataspace.retract(h)
        else:
            self._handles[handle] = h

    def on_retract(self, handle: int) -> None:
        h = self._handles.pop(handle, None)
        if h is not None:
            self.dataspace.retract(h)
        elif handle in self._pending:
            self._pending[handle] = True

    def on_message(self, value: Value) -> None:
        self.dataspace.send(value)

    def on_messages(self, values: list[Value]) -> None:
        """The messages of one packet (see :class:`Entity`)."""
        send = self.dataspace.send
        for v in values:
            send(v)

    def on_message_turns(self, enc: Encoded, cuts: list[int]) -> int:
        """Consecutive packets of messages (see :meth:`Dataspace.send_turns`)."""
        return self.dataspace.send_turns(enc, cuts)

    @property
    def accepts_encoded(self) -> bool:
        """Whether :class:`Encoded` messages may be handed in (the dataspace routes them
        on their bytes)."""
        return self.dataspace.router is not None

    def is_observer(self, obj: Any) -> bool:
        """Whether ``obj`` observes in this dataspace (see :meth:`Dataspace.is_observer`)."""
        return self.dataspace.is_observer(obj)

    def compact(self) -> None:
        """Shrink this facade's tables and its dataspace's (see :meth:`Dataspace.compact`)."""
        self._handles = dict(self._handles)
        self.dataspace.compact()

    def __repr__(self) -> str:
        return f"<DataspaceEntity {self.dataspace.name}>"
