"""Consumer groups: workers sharing a stream's entries, with acknowledgement, pending
lists, redelivery and a dead-letter stream (as Redis Streams' XREADGROUP / XACK /
XPENDING / XAUTOCLAIM, Kafka's consumer groups and NATS JetStream's pull consumers).

>>> # g = store.group("jobs", "workers")               # created at the first stored entry
>>> # c = g.consumer("w1")                             # a name within the group
>>> # for d in c.read(10, block=5.0):                  # up to 10, waiting up to 5 s
>>> #     handle(d.value)
>>> #     c.ack(d)                                     # done: never delivered again
>>> # with store.transaction() as t:                   # exactly once: results and ack
>>> #     t.append("results", result); t.ack(d)        # commit together, or neither

The model
---------
A group has a position, ``next``: the lowest index not yet delivered to the group.  A
consumer's :meth:`Consumer.read` takes entries from there (moving ``next`` on) and each
becomes *pending* with that consumer -- a row with the consumer's name, how many times
the entry was delivered and when last -- until it is acknowledged (:meth:`Consumer.ack`,
or :meth:`~.base.Transaction.ack` inside a transaction), which removes the row.  So an
entry below ``next`` without a pending row is acknowledged (or went to the dead-letter
stream); each entry is pending with one consumer at a time.

A read, in order: (1) a consumer's first reads return the entries pending with it from
before it started -- a restarted worker finishes its own work first; (2) entries of
other consumers idle longer than the group's ``idle_timeout`` (delivered that long ago
and not acknowledged: their consumer died or hangs) are claimed, delivered again to this
consumer; (3) new entries.  With ``block`` it waits for appends (woken as tailers are,
:mod:`.wakeup`), and for the moment the oldest pending entry of another consumer becomes
idle enough to claim.  :meth:`Group.claim` claims by hand.  An entry that would be
delivered more than ``max_deliveries`` times is moved to the dead-letter stream instead:
its value, with metadata saying which stream, group, index, consumer and how many
deliveries, and why.

Exactly once: a consumer whose results go into the same store acknowledges in the
transaction that writes them; that acknowledgement is refused (:class:`AckLost`, and the
whole transaction rolls back) when the entry is no longer pending with that consumer
under that delivery -- another consumer claimed it -- so after any crash each entry's
results are there once.  Plain :meth:`Consumer.ack` is at-least-once.

Retention never removes an entry a group holding retention (the default) has not
acknowledged: a stream's retention stops at the lowest such index of its groups (a
warning says so once per stream and group).  A group created with
``hold_retention=False`` does not hold it back: entries retention removes before the
group acknowledged them are skipped (a warning says which).

The stores implement the primitives (:meth:`~.base.Store.group_read`, ``group_claim``,
``group_ack``, ``group_pending``, ...); this module holds the types and the handles.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..values import Dictionary, Symbol, Value
from .entry import Entry, check_name, check_stream_name
from .errors import MAX_INDEX, StoreError
from .integrity import damaged, pending_top_problem, plural

if TYPE_CHECKING:
    from .base import Store

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "AckLost",
    "Consumer",
    "ConsumerInfo",
    "Delivery",
    "Group",
    "GroupInfo",
    "GroupNotFound",
    "GroupRead",
    "PendingEntry",
    "check_consumer_name",
    "check_group_name",
    "dead_letter_meta",
    "dead_meta_data",
    "delivery_runs",
    "same_group",
    "default_dead_letter",
    "resolve_start",
]

log = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT = 30.0
"""Seconds an entry may stay pending with a consumer, unacknowledged, before another
consumer's read claims it (NATS JetStream's default ack wait)."""

MAX_READ = 10_000
"""The most entries one read, claim or acknowledgement takes."""


class GroupNotFound(StoreError, KeyError):
    """No consumer group of that name on that stream."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "consumer group not found"


class AckLost(StoreError):
    """An acknowledgement inside a transaction of an entry that is no longer pending with
    the consumer it was delivered to, under that delivery: another consumer claimed it
    (it was idle too long) or it was acknowledged already.  The transaction must roll
    back (``with store.transaction()`` does): its results would be there twice."""


def check_group_name(name: str) -> str:
    """``name`` if it can name a consumer group (the rule of stream names), else
    ``ValueError``."""
    return check_name(name, "consumer group")


def check_consumer_name(name: str) -> str:
    """``name`` if it can name a consumer (the rule of stream names), else ``ValueError``."""
    return check_name(name, "consumer")


def default_dead_letter(stream: str) -> str:
    """Where entries delivered too often go when the group does not say: ``STREAM.dead``."""
    return f"{stream}.dead"


def resolve_start(start: int | str, first: int, nxt: int, stream: str) -> int:
    """A group's starting ``next`` from ``start`` (``"earliest"``: the first stored
    entry; ``"latest"``: only entries appended from now; an index, at most ``nxt``) on a
    stream holding ``first <= i < nxt``."""
    if start == "earliest":
        return first
    if start == "latest":
        return nxt
    if isinstance(start, bool) or not isinstance(start, int):
        raise ValueError(f"a group's start is 'earliest', 'latest' or an index, not {start!r}")
    if start < 0 or start > nxt:
        raise ValueError(f"a group of {stream!r} cannot start at index {start}: the stream's "
                         f"next index is {nxt} (start at most there: 'latest')")
    return max(start, first)


def check_options(idle_timeout: float | None, max_deliveries: int | None) -> None:
    if idle_timeout is not None and not (0 < idle_timeout <= 365 * 86400):
        raise ValueError("idle_timeout must be a positive number of seconds (at most a year), "
                         "or None: never claimed by another consumer's read")
    if max_deliveries is not None and (type(max_deliveries) is not int
                                       or not 1 <= max_deliveries <= 1_000_000):
        raise ValueError("max_deliveries must be an integer from 1 to 1,000,000, or None")


def group_settings(stream: str, name: str, idle_timeout: float | None,
                   max_deliveries: int | None, dead_letter: str | None
                   ) -> tuple[int | None, str | None]:
    """The settings of a new group ``name`` of ``stream`` as a store keeps them: its idle
    timeout in milliseconds and its dead-letter stream (``STREAM.dead`` when it has
    ``max_deliveries`` and names none); ``ValueError`` saying which one is wrong."""
    check_stream_name(stream)
    check_group_name(name)
    check_options(idle_timeout, max_deliveries)
    if dead_letter is None and max_deliveries is not None:
        dead_letter = default_dead_letter(stream)
    if dead_letter is not None:
        check_name(dead_letter, "dead-letter stream")
        if dead_letter == stream:
            raise ValueError("a group's dead-letter stream cannot be its own stream")
    idle_ms = None if idle_timeout is None else max(1, round(idle_timeout * 1000))
    return idle_ms, dead_letter


def group_exists(stream: str, name: str) -> ValueError:
    """The error of creating a group that exists (without ``exist_ok``)."""
    return ValueError(f"stream {stream!r} has a consumer group {name!r} already "
                      f"(dataspace stream group ls {stream} lists them)")


def no_group(where: str, stream: str, group: str) -> GroupNotFound:
    """The error of a group ``group`` that ``stream`` in the store ``where`` does not have."""
    return GroupNotFound(f"no consumer group {group!r} on stream {stream!r} in {where} "
                         f"(dataspace stream group ls {stream} lists them)")


@dataclass(frozen=True)
class ConsumerInfo:
    """A consumer of a group with entries pending: how many, and when the oldest and the
    newest of them was delivered (ns since the epoch)."""

    name: str
    pending: int
    oldest_ns: int
    newest_ns: int


@dataclass(frozen=True)
class GroupInfo:
    """What a store knows about a consumer group.

    ``next`` is the lowest index not yet delivered to the group; ``lag`` how many
    entries of the stream it has not been delivered yet (the stream's next index less
    ``next``, less any retention removed); ``pending`` how many are delivered and not
    acknowledged, ``first_pending`` the lowest of those (None: none), ``oldest_ns`` when
    the longest-waiting of them was delivered.  ``idle_timeout`` (seconds; None: never)
    is how long a pending entry waits before another consumer's read claims it,
    ``max_deliveries`` (None: no limit) how many deliveries an entry gets before it goes
    to ``dead_letter``; ``hold_retention``: the stream's retention waits for the group.
    """

    stream: str
    name: str
    next: int
    created_ns: int
    idle_timeout: float | None
    max_deliveries: int | None
    dead_letter: str | None
    hold_retention: bool
    lag: int = 0
    pending: int = 0
    first_pending: int | None = None
    oldest_ns: int | None = None
    consumers: tuple[ConsumerInfo, ...] = field(default=())

    @property
    def floor(self) -> int:
        """The lowest index the group has not acknowledged: where it holds retention."""
        return self.next if self.first_pending is None else min(self.first_pending, self.next)

    def as_json(self, now: float | None = None) -> dict[str, Any]:
        """The group as ``stream group ls --json`` and ``GET /api/streams`` give it (but
        its stream): its position (``next``), ``lag`` (entries not delivered yet),
        ``pending`` (delivered, not acknowledged), ``oldest_idle`` (seconds the oldest
        pending entry has waited at ``now``, by default the time now), its settings, and
        its consumers with entries pending."""
        t = time.time() if now is None else now
        return {
            "name": self.name, "next": self.next, "lag": self.lag, "pending": self.pending,
            "first_pending": self.first_pending,
            "oldest_idle": None if self.oldest_ns is None else max(0.0, t - self.oldest_ns / 1e9),
            "idle_timeout": self.idle_timeout, "max_deliveries": self.max_deliveries,
            "dead_letter": self.dead_letter, "hold_retention": self.hold_retention,
            "created": self.created_ns / 1e9,
            "consumers": [{"name": c.name, "pending": c.pending,
                           "oldest_idle": max(0.0, t - c.oldest_ns / 1e9),
                           "newest_idle": max(0.0, t - c.newest_ns / 1e9)}
                          for c in self.consumers],
        }


@dataclass(frozen=True)
class PendingEntry:
    """An entry delivered to a group and not acknowledged: its index, the consumer it is
    pending with, how many times it was delivered and when last (ns since the epoch)."""

    index: int
    consumer: str
    deliveries: int
    delivered_ns: int

    def idle(self, now_ns: int | None = None) -> float:
        """Seconds since it was last delivered."""
        return max(0, (time.time_ns() if now_ns is None else now_ns) - self.delivered_ns) / 1e9


class Delivery(Entry):
    """An entry as a consumer group delivered it: the entry (``index``, ``value``, ...)
    with its ``group``, the ``consumer`` it is pending with, ``deliveries``, how many
    times it has been delivered (1 the first time), and when (``delivered_ns``: its idle
    time counts from there).  Acknowledge it with
    :meth:`Consumer.ack` or, with results, :meth:`~.base.Transaction.ack`."""

    __slots__ = ("consumer", "delivered_ns", "deliveries", "group")

    def __init__(self, stream: str, index: int, data: bytes, meta_data: bytes | None,
                 time_ns: int, seq: int, group: str, consumer: str, deliveries: int,
                 delivered_ns: int = 0) -> None:
        super().__init__(stream, index, data, meta_data, time_ns, seq)
        self.group = group
        self.consumer = consumer
        self.deliveries = deliveries
        self.delivered_ns = delivered_ns

    def __repr__(self) -> str:
        return (f"Delivery({self.stream!r}, {self.index}, group={self.group!r}, "
                f"consumer={self.consumer!r}, deliveries={self.deliveries})")


@dataclass
class GroupRead:
    """What one :meth:`~.base.Store.group_read` (or ``group_claim``) did: the entries
    delivered; the pending entries found delivered ``max_deliveries`` times already
    (``over``: not delivered; the caller moves them to the dead-letter stream); whether a
    consumer's own earlier entries are all delivered again (``recovered``) and the highest
    index looked at (``cursor``); a time before which no pending entry of another
    consumer becomes idle enough to claim (``expiry_ns``; None: not looked at); how many
    entries retention removed before they could be delivered (``lost``); how many of the
    entries the read was given to acknowledge were pending (``acked``)."""

    deliveries: list[Delivery] = field(default_factory=list)
    over: list[PendingEntry] = field(default_factory=list)
    acked: int = 0
    fetch: Any = None  # (a store's own: entries to read once its transaction is over)
    recovered: bool = True
    cursor: int = -1
    expiry_ns: int | None = None
    lost: int = 0


def group_info_of(stream: str, first: int, nxt: int, g: Any,
                  consumers: Sequence[Sequence[Any]]) -> GroupInfo:
    """A group's info from its verified row ``g`` (a :class:`~.integrity.GroupRow`) on a
    stream holding ``first <= i < nxt``, and its pending counts per consumer: rows of
    ``(consumer, count, oldest delivered_ns, newest delivered_ns, lowest index)``."""
    cons = tuple(ConsumerInfo(c, int(n), int(lo), int(hi)) for c, n, lo, hi, _i in consumers)
    return GroupInfo(
        stream=stream, name=g.name, next=g.next, created_ns=g.created_ns,
        idle_timeout=None if g.idle_ms is None else g.idle_ms / 1000.0,
        max_deliveries=g.max_deliveries, dead_letter=g.dead_letter, hold_retention=g.hold,
        lag=max(0, nxt - max(g.next, first)), pending=sum(c.pending for c in cons),
        first_pending=min((int(r[4]) for r in consumers), default=None),
        oldest_ns=min((c.oldest_ns for c in cons), default=None), consumers=cons)


def checked_info(where: str, stream: str, first: int, nxt: int, g: Any,
                 consumers: Sequence[Sequence[Any]]) -> GroupInfo:
    """:func:`group_info_of` from pending counts per consumer that also give each one's
    highest pending index (a sixth column), cross-checked against the group's ``next``
    (:class:`~.errors.StoreCorrupt` if one is at or beyond it)."""
    what = pending_top_problem(g, max((c[5] for c in consumers), default=None))
    if what is not None:
        raise damaged(where, stream, what)
    return group_info_of(stream, first, nxt, g, [c[:5] for c in consumers])


def hold_cut(where: str, stream: str, cut: int, holds: Iterable[tuple[Any, Any]]) -> int:
    """``cut`` lowered to the lowest index a consumer group holding retention has not
    acknowledged, with a warning once: ``holds`` gives each such group's verified row
    and its lowest pending index (None: nothing pending)."""
    low = cut
    holder = None
    for g, top in holds:
        floor = g.next if top is None else min(int(top), g.next)
        if floor < low:
            low, holder = floor, g.name
    if holder is not None:
        warn_once("retention", f"{where}|{stream}|{holder}",
                  "stream %r in %s: retention held back at index %d by consumer group %r, "
                  "which has not acknowledged the entries from there (remove the group, or "
                  "create it with hold_retention=False, to let retention go on)",
                  stream, where, low, holder)
    return low


def move_dead(tx: Any, where: str, stream: str, g: Any, entries: Iterable[PendingEntry],
              why: str | None, take: Callable[[PendingEntry], bool],
              get: Callable[[int], Entry | None]) -> int:
    """Move ``entries`` pending with the group of verified row ``g`` to its dead-letter
    stream in the transaction ``tx``, each one that ``take`` removes from the pending
    list (False: acknowledged or claimed meanwhile), its entry read with ``get``; how
    many moved."""
    target = g.dead_letter or default_dead_letter(stream)
    moved = 0
    for p in entries:
        if not take(p):
            continue
        e = get(p.index)
        if e is None:
            warn_lost(where, stream, g.name, p.index, p.index + 1)
            continue
        reason = why or too_many(p, g.max_deliveries or p.deliveries)
        tx.append_encoded(target, [e.data], [dead_meta_data(stream, g.name, p, reason,
                                                            e.meta_data)])
        log.warning("consumer group %r of stream %r: entry %d %s; moved to stream %r",
                    g.name, stream, p.index, reason, target)
        moved += 1
    return moved


def split_over(rows: Sequence[Sequence[Any]], max_deliveries: int | None
               ) -> tuple[list[Sequence[Any]], list[PendingEntry]]:
    """Pending rows ``(idx, consumer, deliveries, delivered_ns, ...)`` to deliver again,
    and those delivered ``max_deliveries`` times already (for the dead-letter stream)."""
    if max_deliveries is None:
        return list(rows), []
    again, over = [], []
    for r in rows:
        if r[2] >= max_deliveries:
            over.append(PendingEntry(r[0], r[1], r[2], r[3]))
        else:
            again.append(r)
    return again, over


def dead_letter_meta(stream: str, group: str, p: PendingEntry, why: str,
                     meta: Value | None) -> Value:
    """The metadata of an entry moved to a dead-letter stream: where it came from and
    why (with the entry's own metadata, if any, as ``meta``)."""
    d: dict[Value, Value] = {
        Symbol("stream"): stream, Symbol("group"): group, Symbol("index"): p.index,
        Symbol("consumer"): p.consumer, Symbol("deliveries"): p.deliveries,
        Symbol("why"): why,
    }
    if meta is not None:
        d[Symbol("meta")] = meta
    return Dictionary(d)


def too_many(p: PendingEntry, max_deliveries: int) -> str:
    return (f"delivered {plural(p.deliveries, 'time')} without an acknowledgement (max-deliveries "
            f"{max_deliveries}), the last time to {p.consumer!r}")


def _count(count: int) -> int:
    if type(count) is not int or not 1 <= count <= MAX_READ:
        raise ValueError(f"count must be an integer from 1 to {MAX_READ:,}, not {count!r}")
    return count


def indices_of(items: Delivery | int | Iterable[Delivery | int]) -> list[Delivery | int]:
    """``items`` as a list (one Delivery or index, or several)."""
    if isinstance(items, (Delivery, int)):
        return [items]
    out = list(items)
    for x in out:
        if not isinstance(x, Delivery) and (type(x) is not int or not 0 <= x <= MAX_INDEX):
            raise ValueError(f"acknowledge deliveries or indices, not {x!r}")
    if len(out) > MAX_READ:
        raise ValueError(f"acknowledge at most {MAX_READ:,} entries at once")
    return out


_warned: set[tuple[str, str, str]] = set()
_warned_lock = threading.Lock()


def warn_once(kind: str, key: str, msg: str, *args: Any) -> None:
    """Log ``msg`` as a warning once per process for ``(kind, key)``."""
    with _warned_lock:
        if (kind, key, msg) in _warned:
            return
        _warned.add((kind, key, msg))
    log.warning(msg, *args)


def warn_lost(where: str, stream: str, group: str, first: int, end: int) -> None:
    """Retention removed ``first <= i < end`` before ``group`` was delivered them."""
    span = f"entry {first}" if end == first + 1 else f"entries {first}..{end - 1}"
    log.warning("consumer group %r of stream %r in %s: %s were removed by retention before "
                "the group acknowledged them (it does not hold retention back); skipped",
                group, stream, where, span)


class Group:
    """A handle on the consumer group ``name`` of ``stream`` (:meth:`.base.Store.group`):
    its consumers, pending list, claims and acknowledgements.  ``clock`` (ns since the
    epoch) is what its reads and claims call now: tests pass their own."""

    def __init__(self, store: Store, stream: str, name: str, *,
                 clock: Callable[[], int] = time.time_ns) -> None:
        check_group_name(name)
        self.store = store
        self.stream = stream
        self.name = name
        self.clock = clock

    def info(self) -> GroupInfo:
        """The group's row and pending counts (:class:`GroupNotFound` if it is gone)."""
        return self.store.group_info(self.stream, self.name)

    def consumer(self, name: str) -> Consumer:
        """The consumer ``name`` of this group (a new handle starts by delivering again
        the entries pending with that name from before: a restarted worker)."""
        return Consumer(self, name)

    def read(self, consumer: str, count: int = 1, block: float | None = None) -> list[Delivery]:
        """One read as a new :meth:`consumer` handle would do it (see :class:`Consumer`)."""
        return self.consumer(consumer).read(count, block)

    def ack(self, items: Delivery | int | Iterable[Delivery | int]) -> int:
        """Acknowledge entries (:meth:`Consumer.ack`); returns how many were pending."""
        return self.store.group_ack(self.stream, self.name, indices_of(items))

    def pending(self, consumer: str | None = None, start: int = 0,
                limit: int = 100) -> list[PendingEntry]:
        """Pending entries from index ``start`` (of one consumer, or every one), in
        index order, at most ``limit``."""
        return self.store.group_pending(self.stream, self.name, consumer=consumer,
                                        start=start, limit=limit)

    def claim(self, consumer: str, indices: Iterable[int] | None = None, *,
              min_idle: float = 0.0, count: int = 100) -> list[Delivery]:
        """Deliver to ``consumer`` pending entries idle at least ``min_idle`` seconds --
        those of ``indices``, or the lowest ``count`` of any consumer (Redis' XCLAIM and
        XAUTOCLAIM): each is then pending with ``consumer``, delivered once more (or moved
        to the dead-letter stream if that would exceed ``max_deliveries``)."""
        check_consumer_name(consumer)
        if min_idle < 0:
            raise ValueError("min_idle cannot be negative")
        want = None if indices is None else sorted({int(i) for i in indices})
        if want is not None and len(want) > MAX_READ:
            raise ValueError(f"claim at most {MAX_READ:,} entries at once")
        out: list[Delivery] = []
        while True:
            got = self.store.group_claim(self.stream, self.name, consumer, now_ns=self.clock(),
                                         min_idle_ns=int(min_idle * 1e9),
                                         count=_count(count) if want is None else len(want) or 1,
                                         indices=want)
            out += got.deliveries
            if not got.over:
                return out
            self.dead_letter(got.over)
            if want is not None:
                return out

    def dead_letter(self, entries: Sequence[PendingEntry], why: str | None = None) -> int:
        """Move pending ``entries`` (as :meth:`pending` lists them) to the group's
        dead-letter stream, if they are still pending as listed; ``why`` (default: the
        number of deliveries) goes into each one's metadata.  Returns how many moved."""
        if not entries:
            return 0
        with self.store.transaction() as tx:
            return tx.dead_letter(self.stream, self.name, list(entries), why)

    def delete(self) -> None:
        """Remove the group with its pending list."""
        self.store.delete_group(self.stream, self.name)

    def __repr__(self) -> str:
        return f"<Group {self.name} of {self.stream}>"


class Consumer:
    """A consumer of a group: reads entries not yet delivered to the group (or pending
    with it from before, or claimable), and acknowledges them.  Use one handle per worker
    and thread; its name is what the pending list records."""

    def __init__(self, group: Group, name: str) -> None:
        check_consumer_name(name)
        self.group = group
        self.name = name
        self.born_ns = group.clock()
        self._recovering = True  # own entries from before this handle come first
        self._cursor = -1
        self.acked = 0
        """How many entries the last :meth:`read` with ``ack`` acknowledged."""
        self._expiry: int | None = None  # no other consumer's entry is claimable before

    @property
    def stream(self) -> str:
        return self.group.stream

    def _once(self, count: int, ack: Sequence[Delivery | int] = ()) -> GroupRead:
        g = self.group
        now = g.clock()
        claim = self._expiry is None or now >= self._expiry
        got = g.store.group_read(
            g.stream, g.name, self.name, count, now_ns=now,
            recover=(self._cursor, self.born_ns) if self._recovering else None,
            claim_idle=claim, **({"ack": ack} if ack else {}))
        self.acked = got.acked
        if self._recovering:
            self._cursor = max(self._cursor, got.cursor)
            self._recovering = not got.recovered
        if claim:
            self._expiry = got.expiry_ns
        return got

    def read(self, count: int = 1, block: float | None = None, *,
             ack: Delivery | int | Iterable[Delivery | int] = ()) -> list[Delivery]:
        """Up to ``count`` entries: this consumer's own from before its handle was made,
        then other consumers' idle past the group's ``idle_timeout`` (claimed), then new
        ones.  Without ``block`` (or 0), what is there now (possibly nothing); else wait up
        to ``block`` seconds for some -- woken by appends, and by the time the oldest
        pending entry of another consumer becomes claimable.

        ``ack``: entries to acknowledge (as :meth:`ack` takes them) in the same
        transaction as the read -- a worker's "done with these, give me the next" in one
        durable commit instead of two; :attr:`acked` then says how many were pending."""
        _count(count)
        acks = indices_of(ack) if ack != () else []
        deadline = None if not block else time.monotonic() + block
        store = self.group.store
        while True:
            gen = store.generation()
            got = self._once(count, acks)
            acks = []
            if got.over:
                self.group.dead_letter(got.over)
            out, wait = self._then(got, deadline)
            if out is not None:
                return out
            if wait is not None:
                store.wait_change(gen, wait)

    async def read_async(self, count: int = 1, block: float | None = None) -> list[Delivery]:
        """:meth:`read` for asyncio (the store calls run in a thread)."""
        _count(count)
        deadline = None if not block else time.monotonic() + block
        store = self.group.store
        loop = asyncio.get_running_loop()
        while True:
            gen = store.generation()
            got = await loop.run_in_executor(None, self._once, count)
            if got.over:
                await loop.run_in_executor(None, self.group.dead_letter, got.over)
            out, wait = self._then(got, deadline)
            if out is not None:
                return out
            if wait is not None:
                await store.wait_change_async(gen, wait)

    def _then(self, got: GroupRead, deadline: float | None
              ) -> tuple[list[Delivery] | None, float | None]:
        """What a read does after one try that gave ``got`` (its entries over
        ``max_deliveries`` moved to the dead-letter stream): return a list (what was
        delivered, or nothing when ``deadline`` is None or has passed), or wait up to
        a time for a change, or (both None) try again at once -- it found only entries
        it moved."""
        if got.deliveries:
            return got.deliveries, None
        if got.over:
            return None, None
        if deadline is None:
            return [], None
        wait = self._wait(deadline)
        return ([], None) if wait is None else (None, wait)

    def _wait(self, deadline: float) -> float | None:
        """How long to wait for a change: until ``deadline`` or until another consumer's
        pending entry becomes claimable; None when the deadline has passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if self._expiry is not None:
            left = min(left, max(0.0, (self._expiry - self.group.clock()) / 1e9) + 0.001)
        return left

    def follow(self, count: int = 100, idle_timeout: float | None = None) -> Iterator[Delivery]:
        """Every entry delivered to this consumer, waiting for more; ends after
        ``idle_timeout`` seconds without any (None: never).  Acknowledge each."""
        while True:
            got = self.read(count, block=idle_timeout if idle_timeout is not None else 3600.0)
            if not got and idle_timeout is not None:
                return
            yield from got

    def ack(self, items: Delivery | int | Iterable[Delivery | int]) -> int:
        """Acknowledge entries: deliveries (acknowledged only while still pending with the
        consumer and delivery they name) or indices (whoever holds them); returns how many
        were pending and are not any more.  Durable when it returns (at-least-once: a
        crash before it means the entries are delivered again)."""
        return self.group.ack(items)

    def pending(self, start: int = 0, limit: int = 100) -> list[PendingEntry]:
        """This consumer's pending entries."""
        return self.group.pending(self.name, start, limit)

    def claim(self, indices: Iterable[int] | None = None, *, min_idle: float = 0.0,
              count: int = 100) -> list[Delivery]:
        """:meth:`Group.claim` for this consumer."""
        return self.group.claim(self.name, indices, min_idle=min_idle, count=count)

    def __repr__(self) -> str:
        return f"<Consumer {self.name} of group {self.group.name} of {self.group.stream}>"


def ack_args(items: Delivery | Iterable[Delivery]) -> list[Delivery]:
    """The deliveries a :meth:`~.base.Transaction.ack` was given."""
    out = [items] if isinstance(items, Delivery) else list(items)
    for x in out:
        if not isinstance(x, Delivery):
            raise TypeError("Transaction.ack takes deliveries (what Consumer.read returned): "
                            f"not {x!r}; acknowledge indices with Consumer.ack")
    if len(out) > MAX_READ:
        raise ValueError(f"acknowledge at most {MAX_READ:,} entries at once")
    return out


def same_group(d: Delivery, stream: str, group: str) -> None:
    """``ValueError`` unless ``d`` was delivered by ``group`` of ``stream``."""
    if d.stream != stream or d.group != group:
        raise ValueError(f"a delivery of group {d.group!r} of {d.stream!r} acknowledged as "
                         f"one of group {group!r} of {stream!r}")


def delivery_runs(gid: int, stream: str, group: str, deliveries: Sequence[Delivery]
                  ) -> list[tuple[int, int, int, str, int]]:
    """Deliveries to acknowledge as runs ``(gid, first, last, consumer, deliveries)`` of
    consecutive indices with one consumer and one count of deliveries (what one read
    gives): a run's rows are deleted by one statement, ``idx BETWEEN first AND last AND
    consumer = ... AND deliveries = ...`` -- the rows each delivery alone would delete."""
    runs: list[tuple[int, int, int, str, int]] = []
    if not deliveries:
        return runs
    if {(d.stream, d.group) for d in deliveries} != {(stream, group)}:
        for d in deliveries:
            same_group(d, stream, group)
    ds = sorted(deliveries, key=_index)
    first = last = ds[0].index
    who, n = ds[0].consumer, ds[0].deliveries
    for d in ds[1:]:
        i = d.index
        if i == last + 1 and d.deliveries == n and d.consumer == who:
            last = i
            continue
        runs.append((gid, first, last, who, n))
        first = last = i
        who, n = d.consumer, d.deliveries
    runs.append((gid, first, last, who, n))
    return runs


def _index(d: Delivery) -> int:
    return d.index


def dead_meta_data(stream: str, group: str, p: PendingEntry, why: str,
                   meta_data: bytes | None) -> bytes:
    """The encoded metadata of an entry (its own metadata ``meta_data``) moved to a
    dead-letter stream (:func:`dead_letter_meta`)."""
    from ..values import decode, encode

    meta: Value | None = None
    if meta_data is not None:
        try:
            meta = decode(meta_data)
        except ValueError:
            meta = meta_data
    return encode(dead_letter_meta(stream, group, p, why, meta))


def lost_message(stream: str, group: str, d: Delivery) -> str:
    return (f"entry {d.index} of {stream!r} is no longer pending with consumer "
            f"{d.consumer!r} of group {group!r} under delivery {d.deliveries}: another "
            "consumer claimed it (idle past the group's idle timeout) or it was acknowledged "
            "already; this transaction rolls back, nothing of it is written")

