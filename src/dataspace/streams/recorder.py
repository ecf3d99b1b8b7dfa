"""Streams meet the dataspace: the recorder (dataspace -> stream) and the emitter (back).

Both use only the public ``Dataspace`` API (``observe``, ``send``), so they work the same
with an in-process :class:`~dataspace.dataspace.Dataspace` and with a remote client
(``dataspace.client.connect(...)``).

Recorder
    Observes a pattern and appends every matching *message* to a stream (the whole
    message, or with ``capture=True`` the sequence of its captures).  With
    ``events=("message", "assert", "retract")`` it also records assertions appearing and
    disappearing; every entry is then wrapped: ``<message V>``, ``<assert V>``,
    ``<retract V>``.  Dataspace callbacks only enqueue; a writer thread appends what has
    queued up in one transaction per batch (so a burst costs one commit, not one per
    message) and wakes readers.  :meth:`Recorder.flush` waits until everything observed so
    far is committed.  The queue is bounded (``max_queue``): when the store falls behind,
    callbacks wait for room (back-pressure, bounded by ``block_timeout``).  A message that
    found no room in that time is dropped, and the recorder stops as it does when the
    store fails (:attr:`Recorder.failed`): what was queued before is still committed,
    every later value is dropped (all counted in ``dropped``), and a server's syncs fail
    rather than tell a client that what it sent is durable (:meth:`Recorder.reached`).

Emitter
    Sends a stream's entries into a dataspace as messages, in order.  With a named tailer
    it resumes after a restart; the position is saved after each batch is sent, so a
    crash re-sends at most the last batch (at-least-once into the dataspace).  Call
    :meth:`Emitter.run` in the thread that owns the dataspace (the in-process
    ``Dataspace`` is not thread-safe), or :meth:`Emitter.run_async` in its event loop.

Recorder specs (for ``dataspace serve``)
    ``STREAM[,OPTION=VALUE...]:PATTERN``, for example::

        chat:<Says $who $text>
        presence,events=all,max-age=7d:<Present _>
        says-alice,capture=yes,max-count=100000:<Says "alice" $text>

    Options: ``events`` (``message``, ``assert``, ``retract`` joined by ``+``, or ``all``;
    default ``message``), ``capture`` (``yes``/``no``), ``max-count`` (entries),
    ``max-age`` (a duration: ``90s``, ``15m``, ``12h``, ``7d``), ``dataspace`` (the name of
    the dataspace to record from, for servers with several; default: the server's
    default).  The same fields are accepted as a mapping (a config file section, Python
    or Preserves with symbol keys): ``{stream: "chat" pattern: "<Says $who $text>"
    events: [message assert] max-age: "7d"}``; :func:`recorder_specs` reads a list of
    either form.  :func:`start_recorders` starts one recorder per spec.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._threads import start_daemon
from ..pattern import Bind, Pattern, as_pattern, parse_pattern
from ..values import Record, Sequence, Symbol, Value, encode
from .base import (
    MAX_VALUE_SIZE,
    Store,
    StoreCorrupt,
    StoreError,
    Transaction,
    check_user_name,
    parse_duration,
)
from .tailer import Tailer

__all__ = [
    "COMMIT_BUCKETS",
    "EVENT_KINDS",
    "Emitter",
    "Recorder",
    "RecorderSpec",
    "parse_recorder_spec",
    "recorder_specs",
    "start_recorders",
    "stop_recorders",
]

log = logging.getLogger(__name__)

EVENT_KINDS = ("message", "assert", "retract")

COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                  5.0, 10.0)
"""Upper bounds (seconds) of the buckets of :attr:`Recorder.commit_buckets`."""
_MESSAGE = Symbol("message")
_ASSERT = Symbol("assert")
_RETRACT = Symbol("retract")
_PRESENCE = Symbol("presence")
_ASSERT_HEAD = b"\xb4" + encode(_ASSERT)
_RETRACT_HEAD = b"\xb4" + encode(_RETRACT)
_END = b"\x84"

PRESENCE_PREFIX = "__presence/"
"""In a cluster, the leader of a stream with assertion events keeps its fence and the
presence it recorded in the store's own stream ``__presence/STREAM`` (see
:meth:`Recorder.lead`)."""
PRESENCE_KEEP = 16
"""Entries kept in a ``__presence/...`` stream (retention)."""
CHECKPOINT_MIN = 256
"""A leader writes its recorded presence again after this many assertion events, or as
many as there are values present if more (so a new leader reads a bounded tail)."""
CHECKPOINT_MAX_BYTES = 8 << 20
"""A presence larger than this (encoded) is not checkpointed: a new leader replays the
stream from the last checkpoint that fitted (or from its start)."""


def presence_stream(stream: str) -> str:
    """The store's own stream where the leaders of ``stream`` fence and checkpoint."""
    return PRESENCE_PREFIX + stream


class _Led:
    """A value recorded only while the recorder leads its stream in a cluster (an
    assertion event, or a message of a member that does not record the stream here)."""

    __slots__ = ("data", "delta", "term", "value")

    def __init__(self, data: bytes, term: _Term, delta: int = 0, value: bytes = b"") -> None:
        self.data = data
        self.term = term
        self.delta = delta    # +1 an assert, -1 a retract, 0 a message
        self.value = value    # the asserted value's encoding (for the presence kept)


class _Term:
    """One leadership of a stream (see :meth:`Recorder.lead`)."""

    __slots__ = ("checkpointed", "fence", "lost", "member", "pending", "recorded", "since",
                 "snapshot", "token")

    def __init__(self, member: str, snapshot: Counter[bytes]) -> None:
        self.member = member
        self.token = secrets.token_hex(8)
        self.snapshot = snapshot
        """What was present when the term began (the takeover reconciles the stream
        with it)."""
        self.pending = True
        """The takeover is not written yet."""
        self.fence = -1
        """The index of this term's last entry in ``__presence/STREAM``: a term whose
        entry is no longer the last has lost the stream to another leader."""
        self.recorded: Counter[bytes] = Counter()
        """What the stream says is present (as of the last commit)."""
        self.since = 0
        """Assertion events since the last checkpoint."""
        self.checkpointed = 0
        self.lost = False




class Recorder:
    """Appends what ``pattern`` matches in ``dataspace`` to ``stream`` (see module doc)."""

    def __init__(
        self,
        dataspace: Any,
        pattern: Pattern | str | Value,
        store: Store,
        stream: str,
        *,
        events: Iterable[str] = ("message",),
        capture: bool = False,
        max_queue: int = 100_000,
        max_batch: int = 10_000,
        block_timeout: float = 10.0,
    ) -> None:
        check_user_name(stream)
        evs = tuple(events)
        bad = [e for e in evs if e not in EVENT_KINDS]
        if bad or not evs:
            raise ValueError(f"events must be some of {', '.join(EVENT_KINDS)}, not {evs!r}")
        self.dataspace = dataspace
        self.pattern = as_pattern(pattern)
        self.store = store
        self.stream = stream
        self.events = evs
        self.capture = capture
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.block_timeout = block_timeout
        self.wrap = evs != ("message",)
        self.recorded = 0
        self.dropped = 0
        self.commits = 0
        """Transactions committed (one per batch)."""
        self.commit_seconds = 0.0
        """Time spent committing them, in total."""
        self.commit_buckets = [0] * (len(COMMIT_BUCKETS) + 1)
        """How many commits took at most each bound of :data:`COMMIT_BUCKETS` (and the
        last, longer): not cumulative."""
        self.error: BaseException | None = None
        self._queue: deque[bytes | _Led] = deque()
        self._enqueued = 0
        self._done = 0  # values taken from the queue: committed, dropped or discarded
        self._cond = threading.Condition()
        self._closing = False
        self.on_progress: Any = None
        """Called (from the writer thread) after each batch is committed or fails, e.g.
        a server's ``SyncGate.progress``."""
        # -- in a cluster (see dataspace.streams.cluster): set before the first event --
        self.origin: Callable[[], Any] | None = None
        """Where what is being delivered now came from: None when it entered the
        cluster here (a client of this server, a link, this process), else the route
        it came over (that member records it, see :attr:`peer_records`)."""
        self.peer_records: Callable[[Any], bool | None] | None = None
        """For a route (as :attr:`origin` gives it): True when the member at its other
        end records this stream into this store itself, False when it does not (the
        stream's leader records its messages), None while that is not known (nobody
        here records them)."""
        self.leader_only = False
        """In a cluster: assertion events (and the messages of members that do not
        record this stream here) are recorded only while this recorder leads the
        stream in its store (:meth:`lead`): once for the cluster."""
        self.on_lost: Callable[[str], None] | None = None
        """Called (from the writer thread) when another member took the lead of the
        stream from this one (its fence moved), with why."""
        self._present: Counter[bytes] = Counter()
        self._term: _Term | None = None
        self.skipped = 0
        """Messages not recorded here: their origin member records them."""
        self.discarded = 0
        """Values not recorded because another member leads the stream now."""
        self.takeovers = 0
        """Times this recorder took the lead of its stream (in a cluster)."""
        if not store.has_stream(stream):
            store.create_stream(stream)
        self._thread = start_daemon(self._writer, f"recorder:{stream}")
        root = Bind(self.pattern)
        self.subscription = dataspace.observe(
            root,
            on_assert=self._on_assert if "assert" in evs else None,
            on_retract=self._on_retract if "retract" in evs else None,
            on_message=self._on_message if "message" in evs else None,
        )

    # -- dataspace callbacks (any thread) ----------------------------------------------

    def _value(self, caps: tuple[Value, ...]) -> Value:
        return tuple.__new__(Sequence, caps[1:]) if self.capture else caps[0]

    def _on_message(self, *caps: Value) -> None:
        origin = self.origin
        if origin is not None:
            route = origin()
            if route is not None:  # it entered the cluster at another member
                pr = self.peer_records
                if pr is None or pr(route) is not False or self._term is None:
                    self.skipped += 1
                    return
                # That member does not record this stream here: its leader does.
                v = self._value(caps)
                self._enqueue_led(Record._make(_MESSAGE, (v,)) if self.wrap else v)
                return
        v = self._value(caps)
        self._enqueue(Record._make(_MESSAGE, (v,)) if self.wrap else v)

    def _on_assert(self, *caps: Value) -> None:
        if self.leader_only:
            self._presence(self._value(caps), 1)
        else:
            self._enqueue(Record._make(_ASSERT, (self._value(caps),)))

    def _on_retract(self, *caps: Value) -> None:
        if self.leader_only:
            self._presence(self._value(caps), -1)
        else:
            self._enqueue(Record._make(_RETRACT, (self._value(caps),)))

    def _presence(self, v: Value, delta: int) -> None:
        """An assertion event in a cluster: kept, and recorded while leading."""
        data = self._encoded(v)
        if data is None:
            return
        with self._cond:
            present = self._present
            if delta > 0:
                present[data] += 1
            else:
                n = present[data] - 1
                if n > 0:
                    present[data] = n
                else:
                    del present[data]
            term = self._term
            kind = "assert" if delta > 0 else "retract"
            if term is None or kind not in self.events:
                return
            wrapped = (_ASSERT_HEAD if delta > 0 else _RETRACT_HEAD) + data + _END
            if not self._fits(len(wrapped)):
                return
            self._put(_Led(wrapped, term, delta, data))

    def _enqueue_led(self, value: Value) -> None:
        data = self._encoded(value)
        if data is None or not self._fits(len(data)):
            return  # (as _enqueue: one over the entry limit is dropped, not the recorder)
        with self._cond:
            term = self._term
            if term is None:
                self.skipped += 1
                return
            self._put(_Led(data, term))

    def _put(self, item: bytes | _Led) -> None:
        """Queue ``item`` (holding ``_cond``), waiting for room (see :meth:`_enqueue`)."""
        if len(self._queue) >= self.max_queue and self.error is None and not self._closing:
            self._cond.wait_for(
                lambda: len(self._queue) < self.max_queue or self.error is not None
                or self._closing,
                self.block_timeout,
            )
        if self.error is not None:
            self.dropped += 1  # the stop was said once: each value is counted, not logged
            return
        if len(self._queue) >= self.max_queue:
            # What a client was told is durable is durable: a value that found no room
            # stops the recorder as a store failure does, so that no sync covering it is
            # answered (see reached); what was queued before it is still committed.
            self.dropped += 1
            self.error = StoreError(
                f"it fell behind: the recorder's queue of {self.max_queue:,} values stayed "
                f"full for {self.block_timeout:g} s and a message was dropped")
            log.error("recorder %s: the store fell behind (the queue of %d values stayed full "
                      "for %g s): a message was dropped and recording stops; what is queued "
                      "is still committed, later values are dropped and counted, and syncs "
                      "fail", self.stream, self.max_queue, self.block_timeout)
            self._cond.notify_all()
            self._progress()  # the syncs waiting for it fail now
            return
        self._queue.append(item)
        self._enqueued += 1
        self._cond.notify_all()

    def _enqueue(self, value: Value) -> None:
        data = self._encoded(value)
        if data is None or not self._fits(len(data)):
            return
        with self._cond:
            self._put(data)

    def _encoded(self, value: Value) -> bytes | None:
        """``value`` encoded, or None: it cannot be (dropped: counted, and logged)."""
        try:
            return encode(value)
        except (TypeError, ValueError) as e:
            self.dropped += 1
            log.error("recorder %s: cannot encode a matching value (%s); dropped", self.stream, e)
            return None

    def _fits(self, size: int) -> bool:
        """Whether an entry of ``size`` bytes fits in the stream; if not, it is dropped
        (counted, and logged)."""
        if size <= MAX_VALUE_SIZE:
            return True
        self.dropped += 1
        log.error("recorder %s: a %d-byte value exceeds the entry limit; dropped",
                  self.stream, size)
        return False

    # -- the writer thread ---------------------------------------------------------------

    def _writer(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing
                                    or self.error is not None
                                    or (self._term is not None and self._term.pending))
                term = self._term
                if not self._queue and (self.error is not None
                                        or not (term is not None and term.pending)):
                    return  # (stopped: what was queued before the stop is committed)
                n = min(len(self._queue), self.max_batch)
                batch = [self._queue.popleft() for _ in range(n)]
                self._cond.notify_all()
            t0 = time.perf_counter()
            led = False
            for item in batch:
                if type(item) is not bytes:
                    led = True
                    break
            try:
                with self.store.transaction() as tx:
                    if term is None and not led:
                        tx.append_encoded(self.stream, batch)  # type: ignore[arg-type]
                        written = len(batch)
                        discarded = 0
                    else:
                        written, discarded = self._write_led(tx, batch, term)
            except Exception as e:
                self._stop(e, len(batch))
                return
            took = time.perf_counter() - t0
            lost = None
            with self._cond:
                self.recorded += written
                self.discarded += discarded
                self._done += len(batch)
                self.commits += 1
                self.commit_seconds += took
                self.commit_buckets[bisect.bisect_left(COMMIT_BUCKETS, took)] += 1
                if term is not None and term.lost and self._term is term:
                    self._term = None
                    lost = term
                self._cond.notify_all()
            if lost is not None:
                self._lost(lost)
            self._progress()

    # -- leading the stream in a cluster ---------------------------------------------------

    def _write_led(self, tx: Transaction, batch: list[bytes | _Led],
                   term: _Term | None) -> tuple[int, int]:
        """Write ``batch`` whose leader-only values count only while ``term`` leads the
        stream: the takeover first when it is pending, the fence checked otherwise.
        Returns how many entries were written and how many values were discarded."""
        fence = presence_stream(self.stream)
        lead = term is not None and not term.lost
        prefix: list[bytes] = []
        recorded: Counter[bytes] | None = None
        if lead:
            assert term is not None
            if term.pending:
                prefix, recorded = self._take_over(tx, term, fence)
            elif tx.read(fence, term.fence + 1, 1):
                who = tx.last(fence)
                lead = False
                term.lost = True
                log.info("recorder %s: another member leads the stream now (%s)", self.stream,
                         _describe_fence(who[0].value) if who else "its entry is gone")
            else:
                recorded = term.recorded  # (in place: a failed commit stops the recorder)
        datas = prefix
        discarded = 0
        events = 0
        for item in batch:
            if type(item) is bytes:
                datas.append(item)
            elif lead and item.term is term:  # type: ignore[union-attr]
                datas.append(item.data)  # type: ignore[union-attr]
                if item.delta and recorded is not None:  # type: ignore[union-attr]
                    events += 1
                    _adjust(recorded, item.value, item.delta)  # type: ignore[union-attr]
            else:
                discarded += 1
        if datas:
            tx.append_encoded(self.stream, datas)
        if lead and recorded is not None:
            assert term is not None
            since = term.since + events
            if term.pending or since >= max(CHECKPOINT_MIN, term.checkpointed):
                term.fence = self._checkpoint(tx, term, fence, recorded)
                since = 0
            # (Committed by the caller; a failed commit stops the recorder.)
            term.recorded = recorded
            term.since = since
            if term.pending:
                term.pending = False
                term.snapshot = Counter()
                self.takeovers += 1
                log.info("recorder %s: this member leads the stream now (presence "
                         "reconciled: %d entries)", self.stream, len(prefix))
        return len(datas), discarded

    def _take_over(self, tx: Transaction, term: _Term,
                   fence: str) -> tuple[list[bytes], Counter[bytes]]:
        """The entries that bring the stream's presence to what is present now (the
        term's snapshot), and that presence."""
        tx.create_stream(fence, max_count=PRESENCE_KEEP)
        if "assert" not in self.events and "retract" not in self.events:
            return [], Counter()  # (it leads for the messages of others only)
        recorded = self._recorded_presence(tx, fence)
        want = term.snapshot
        out = []
        for v, n in recorded.items():
            k = n - want.get(v, 0)
            if k > 0:
                out += [_RETRACT_HEAD + v + _END] * k
        for v, n in want.items():
            k = n - recorded.get(v, 0)
            if k > 0:
                out += [_ASSERT_HEAD + v + _END] * k
        return out, Counter(want)

    def _recorded_presence(self, tx: Transaction, fence: str) -> Counter[bytes]:
        """What the stream says is present: the newest checkpoint in ``fence`` and the
        assertion events after it (or every event of the stream without one)."""
        present: Counter[bytes] = Counter()
        start = tx.first_index(self.stream) or 0
        for e in tx.last(fence, limit=PRESENCE_KEEP):
            cp = _checkpoint_of(e.value)
            if cp is not None:
                start, values = cp
                for v in values:
                    present[encode(v)] += 1
                break
        end = tx.next_index(self.stream)
        while start < end:
            entries = tx.read(self.stream, start, 1000)
            if not entries:
                break
            for e in entries:
                v = e.value
                if type(v) is Record and len(v.fields) == 1 and (v.label == _ASSERT
                                                                  or v.label == _RETRACT):
                    _adjust(present, encode(v.fields[0]), 1 if v.label == _ASSERT else -1)
            start = entries[-1].index + 1
        return present

    def _checkpoint(self, tx: Transaction, term: _Term, fence: str,
                    recorded: Counter[bytes]) -> int:
        """Append ``<presence MEMBER TOKEN NEXT [V ...]>`` to ``fence`` (``#f`` for the
        values when they are too many); returns its index (the term's fence)."""
        nxt = tx.next_index(self.stream)
        size = sum(len(v) * n for v, n in recorded.items())
        if size <= CHECKPOINT_MAX_BYTES:
            body = b"\xb5" + b"".join(v * n for v, n in recorded.items()) + _END
        else:
            body = encode(False)
        head = b"\xb4" + encode(_PRESENCE) + encode(term.member) + encode(term.token) + \
            encode(nxt)
        term.checkpointed = sum(recorded.values())
        return tx.append_encoded(fence, [head + body + _END])

    def lead(self, member: str) -> bool:
        """Lead the stream from now on (in a cluster; the caller holds the store's lock
        for it): the next commit reconciles the stream with what is present now (a
        ``<retract V>`` for each value the stream says is present and is not, an
        ``<assert V>`` for each that is and it does not say), writes this member's
        fence in ``__presence/STREAM``, and from then on assertion events are recorded
        here.  Every commit that carries such events checks the fence in the same
        transaction: when another member has taken the lead meanwhile, they are
        discarded and :attr:`on_lost` is called.  False if already leading."""
        with self._cond:
            if self._term is not None:
                return False
            self._term = _Term(member, Counter(self._present))
            self._cond.notify_all()
            return True

    def resign(self) -> None:
        """Stop leading (what is queued for the term is discarded)."""
        with self._cond:
            self._term = None
            self._cond.notify_all()

    @property
    def leading(self) -> bool:
        """Whether this recorder leads its stream (its takeover may still be pending)."""
        term = self._term
        return term is not None and not term.lost

    def _stop(self, e: Exception, taken: int = 0) -> None:
        """Recording of this stream stops on the store's error ``e`` (``taken``: values
        of the failed batch), said once: a damaged stream in one line (the other
        recorders go on); every value queued or observed from now on is counted in
        :attr:`dropped`."""
        if isinstance(e, StoreCorrupt):
            log.error("recorder %s: %s; recording of this stream stops, the other recorders "
                      "go on", self.stream, e)
        else:
            log.error("recorder %s: writing to the store failed; recording stops",
                      self.stream, exc_info=e)
        with self._cond:
            self.error = e
            self.dropped += taken + len(self._queue)
            self._done += taken + len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._progress()

    def _lost(self, term: _Term) -> None:
        cb = self.on_lost
        if cb is not None:
            try:
                cb("another member took the lead")
            except Exception:  # pragma: no cover - a bad hook must not stop recording
                log.exception("recorder %s: on_lost callback failed", self.stream)

    def _progress(self) -> None:
        cb = self.on_progress
        if cb is not None:
            try:
                cb()
            except Exception:  # pragma: no cover - a bad hook must not stop recording
                log.exception("recorder %s: progress callback failed", self.stream)
    # -- durability marks (a server's SyncGate) -------------------------------------------

    def mark(self) -> int:
        """A mark for everything this recorder has been given so far."""
        return self._enqueued

    def reached(self, mark: int) -> bool:
        """Whether everything up to ``mark`` is committed.  Never once the recorder has
        stopped (:attr:`failed`: what it was given may have been dropped): it then asks
        the server's gate to look again (``on_progress``), which fails the sync -- one
        asked after the stop too, when nothing else waits."""
        if self.error is not None:
            self._progress()
            return False
        return self._done >= mark

    @property
    def failed(self) -> BaseException | None:
        """The store error that stopped this recorder, if any."""
        return self.error

    @property
    def queued(self) -> int:
        """Values waiting to be committed."""
        return len(self._queue)

    # -- control -------------------------------------------------------------------------

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until everything enqueued so far is committed; False on timeout/failure."""
        with self._cond:
            target = self._enqueued
            ok = self._cond.wait_for(
                lambda: (self._done >= target and not (self._term is not None
                                                       and self._term.pending))
                or self.error is not None, timeout
            )
            return bool(ok) and self.error is None

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop observing, commit what is queued and stop the writer."""
        with contextlib.suppress(Exception):
            self.subscription.cancel()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Recorder {self.pattern} -> {self.stream} ({self.recorded} recorded)>"


class Emitter:
    """Sends the entries of ``stream`` into ``dataspace`` as messages (see module doc)."""

    def __init__(
        self,
        store: Store,
        stream: str,
        dataspace: Any,
        *,
        tailer: str | None = None,
        start: int | str = "earliest",
        batch: int = 1000,
    ) -> None:
        self.dataspace = dataspace
        self.batch = batch
        self.sent = 0
        self.tailer = Tailer(store, stream, tailer, start=start, auto_commit=False)

    def pump(self, limit: int | None = None) -> int:
        """Send what is available now (at most ``limit``); returns how many were sent."""
        entries = self.tailer.read(self.batch if limit is None else min(limit, self.batch))
        return self._send(entries)

    def _send(self, entries: list[Any]) -> int:
        send = self.dataspace.send
        for e in entries:
            send(e.value)
        self.tailer.commit()
        self.sent += len(entries)
        return len(entries)

    def run(self, stop: threading.Event | None = None, idle_timeout: float | None = None) -> int:
        """Send entries as they arrive until ``stop`` is set (checked between batches and
        at least every second) or nothing arrives for ``idle_timeout`` seconds."""
        total = 0
        idle_since = time.monotonic()
        while stop is None or not stop.is_set():
            wait = 1.0 if stop is not None else None
            if idle_timeout is not None:
                left = idle_timeout - (time.monotonic() - idle_since)
                if left <= 0:
                    break
                wait = left if wait is None else min(wait, left)
            entries = self.tailer.poll(wait, self.batch)
            if entries:
                total += self._send(entries)
                idle_since = time.monotonic()
        return total

    async def run_async(self, stop: asyncio.Event | None = None) -> int:
        """:meth:`run` for asyncio (until ``stop`` is set or the task is cancelled)."""
        total = 0
        while stop is None or not stop.is_set():
            entries = await self.tailer.poll_async(1.0 if stop is not None else None, self.batch)
            if entries:
                total += self._send(entries)
        return total


@dataclass(frozen=True)
class RecorderSpec:
    """What to record: see the module docstring for the text and mapping forms."""

    stream: str
    pattern: str
    events: tuple[str, ...] = ("message",)
    capture: bool = False
    max_count: int | None = None
    max_age: float | None = None
    dataspace: str | None = None

    def __post_init__(self) -> None:
        check_user_name(self.stream)
        try:
            parse_pattern(self.pattern)
        except ValueError as e:
            raise ValueError(f"recorder for {self.stream!r}: bad pattern {self.pattern!r}: {e}") from e
        bad = [e for e in self.events if e not in EVENT_KINDS]
        if bad or not self.events:
            raise ValueError(
                f"recorder for {self.stream!r}: events must be some of {'+'.join(EVENT_KINDS)} or all"
            )
        if self.max_count is not None and self.max_count < 1:
            raise ValueError(f"recorder for {self.stream!r}: max-count must be >= 1")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> RecorderSpec:
        """From a config mapping (keys as in the text form; ``-`` or ``_`` both work)."""
        d = {_text(k).replace("-", "_"): _plain(v) for k, v in m.items()}
        unknown = set(d) - {"stream", "pattern", "events", "capture", "max_count", "max_age", "dataspace"}
        if unknown:
            raise ValueError(f"recorder spec: unknown keys {', '.join(sorted(unknown))}")
        if "stream" not in d or "pattern" not in d:
            raise ValueError("recorder spec: 'stream' and 'pattern' are required")
        events = d.get("events", ("message",))
        if isinstance(events, str):
            events = _events(events)
        age = d.get("max_age")
        if isinstance(age, str):
            age = parse_duration(age)
        return cls(
            stream=str(d["stream"]),
            pattern=str(d["pattern"]),
            events=tuple(events),
            capture=_yes(d.get("capture", False)),
            max_count=None if d.get("max_count") is None else int(d["max_count"]),
            max_age=None if age is None else float(age),
            dataspace=d.get("dataspace"),
        )


def _adjust(present: Counter[bytes], v: bytes, delta: int) -> None:
    n = present.get(v, 0) + delta
    if n > 0:
        present[v] = n
    else:
        present.pop(v, None)


def _checkpoint_of(v: Value) -> tuple[int, tuple[Value, ...]] | None:
    """``(NEXT, VALUES)`` of a ``<presence MEMBER TOKEN NEXT [V ...]>`` entry, or None."""
    if (type(v) is Record and v.label == _PRESENCE and len(v.fields) == 4
            and type(v.fields[2]) is int and isinstance(v.fields[3], tuple)):
        return v.fields[2], tuple(v.fields[3])
    return None


def _describe_fence(v: Value) -> str:
    if type(v) is Record and v.label == _PRESENCE and len(v.fields) >= 1:
        return f"member {v.fields[0]}"
    return "another member"


def _text(v: Any) -> str:
    return v.name if isinstance(v, Symbol) else str(v)


def _plain(v: Any) -> Any:
    """Preserves config values to Python: symbols become text, sequences tuples."""
    if isinstance(v, Symbol):
        return v.name
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v


def recorder_specs(config: Any) -> list[RecorderSpec]:
    """Specs from a config value: one spec (text or mapping) or a sequence of them, as
    parsed from Preserves text (symbol keys and values are accepted), e.g. the ``record``
    entry of a server configuration file::

        record: [
          "chat:<Says $who $text>"
          {stream: "presence" pattern: "<Present _>" events: [message assert retract]
           max-age: "7d" dataspace: "lobby"}
        ]
    """
    if isinstance(config, (str, Mapping)):
        config = [config]
    out = []
    for item in config:
        if isinstance(item, RecorderSpec):
            out.append(item)
        elif isinstance(item, str):
            out.append(parse_recorder_spec(item))
        elif isinstance(item, Mapping):
            out.append(RecorderSpec.from_mapping(item))
        else:
            raise ValueError(f"a recorder spec is text or a dictionary, not {item!r}")
    return out


def _events(text: str) -> tuple[str, ...]:
    if text.strip() == "all":
        return EVENT_KINDS
    return tuple(e.strip() for e in text.split("+") if e.strip())


def _yes(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("yes", "true", "1", "on"):
        return True
    if s in ("no", "false", "0", "off", ""):
        return False
    raise ValueError(f"expected yes or no, not {v!r}")


def parse_recorder_spec(text: str) -> RecorderSpec:
    """``STREAM[,OPTION=VALUE...]:PATTERN`` (see the module docstring)."""
    head, sep, pattern = text.partition(":")
    if not sep or not pattern.strip():
        raise ValueError(
            f"invalid recorder spec {text!r}: expected STREAM[,OPTION=VALUE...]:PATTERN, "
            "e.g. chat:<Says $who $text>"
        )
    stream, *opts = [p.strip() for p in head.split(",")]
    fields: dict[str, Any] = {"stream": stream, "pattern": pattern.strip()}
    for opt in opts:
        k, eq, v = opt.partition("=")
        k = k.strip().replace("-", "_")
        if not eq or k not in ("events", "capture", "max_count", "max_age", "dataspace"):
            raise ValueError(
                f"invalid recorder option {opt!r} in {text!r}: use events=, capture=, "
                "max-count=, max-age= or dataspace="
            )
        fields[k] = v.strip()
    if "max_count" in fields:
        try:
            fields["max_count"] = int(fields["max_count"])
        except ValueError:
            raise ValueError(f"invalid max-count in {text!r}: expected an integer") from None
    return RecorderSpec.from_mapping(fields)


def start_recorders(
    dataspace: Any, specs: Iterable[RecorderSpec | str | Mapping[str, Any]], store: Store
) -> list[Recorder]:
    """Start one :class:`Recorder` per spec on ``dataspace`` (the caller picks the specs of
    that dataspace by ``spec.dataspace``); sets each stream's retention from its spec.
    Stop them with :func:`stop_recorders`."""
    parsed = recorder_specs(list(specs))
    recorders: list[Recorder] = []
    try:
        for spec in parsed:
            damage = None
            if spec.max_count is not None or spec.max_age is not None:
                try:
                    store.create_stream(spec.stream, max_count=spec.max_count,
                                        max_age=spec.max_age)
                except StoreCorrupt as e:  # this stream's: the others are recorded
                    damage = e
            recorders.append(
                Recorder(dataspace, spec.pattern, store, spec.stream, events=spec.events,
                         capture=spec.capture)
            )
            if damage is not None:
                recorders[-1]._stop(damage)
                continue
            log.info("recording %s into stream %s (%s)", spec.pattern, spec.stream,
                     "+".join(spec.events))
    except BaseException:
        stop_recorders(recorders)
        raise
    return recorders


def stop_recorders(recorders: Iterable[Recorder], timeout: float | None = 30.0) -> None:
    """Stop recorders, committing what they have queued."""
    for r in recorders:
        r.close(timeout)
