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
    callbacks wait for room (back-pressure, bounded by ``block_timeout``; after that the
    message is dropped with an error in the log and counted in ``dropped``).

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
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._threads import start_daemon
from ..pattern import Bind, Pattern, as_pattern, parse_pattern
from ..values import Record, Sequence, Symbol, Value, encode
from .base import MAX_VALUE_SIZE, Store, check_user_name, parse_duration
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
        self._queue: deque[bytes] = deque()
        self._enqueued = 0
        self._cond = threading.Condition()
        self._closing = False
        self.on_progress: Any = None
        """Called (from the writer thread) after each batch is committed or fails, e.g.
        a server's ``SyncGate.progress``."""
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
        v = self._value(caps)
        self._enqueue(Record._make(_MESSAGE, (v,)) if self.wrap else v)

    def _on_assert(self, *caps: Value) -> None:
        self._enqueue(Record._make(_ASSERT, (self._value(caps),)))

    def _on_retract(self, *caps: Value) -> None:
        self._enqueue(Record._make(_RETRACT, (self._value(caps),)))

    def _enqueue(self, value: Value) -> None:
        try:
            data = encode(value)
        except (TypeError, ValueError) as e:
            self.dropped += 1
            log.error("recorder %s: cannot encode a matching value (%s); dropped", self.stream, e)
            return
        if len(data) > MAX_VALUE_SIZE:
            self.dropped += 1
            log.error("recorder %s: a %d-byte value exceeds the entry limit; dropped",
                      self.stream, len(data))
            return
        with self._cond:
            if len(self._queue) >= self.max_queue and self.error is None and not self._closing:
                self._cond.wait_for(
                    lambda: len(self._queue) < self.max_queue or self.error is not None
                    or self._closing,
                    self.block_timeout,
                )
            if self.error is not None or len(self._queue) >= self.max_queue:
                self.dropped += 1
                log.error("recorder %s: %s; message dropped", self.stream,
                          f"store failed ({self.error})" if self.error else "queue full")
                return
            self._queue.append(data)
            self._enqueued += 1
            self._cond.notify_all()

    # -- the writer thread ---------------------------------------------------------------

    def _writer(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                n = min(len(self._queue), self.max_batch)
                batch = [self._queue.popleft() for _ in range(n)]
                self._cond.notify_all()
            t0 = time.perf_counter()
            try:
                with self.store.transaction() as tx:
                    tx.append_encoded(self.stream, batch)
            except Exception as e:
                log.exception("recorder %s: writing to the store failed; recording stops", self.stream)
                with self._cond:
                    self.error = e
                    self.dropped += len(batch) + len(self._queue)
                    self._queue.clear()
                    self._cond.notify_all()
                self._progress()
                return
            took = time.perf_counter() - t0
            with self._cond:
                self.recorded += len(batch)
                self.commits += 1
                self.commit_seconds += took
                self.commit_buckets[bisect.bisect_left(COMMIT_BUCKETS, took)] += 1
                self._cond.notify_all()
            self._progress()

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
        """Whether everything up to ``mark`` is committed (or dropped, or failed)."""
        return self.recorded + self.dropped >= mark or self.error is not None

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
                lambda: self.recorded + self.dropped >= target or self.error is not None, timeout
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
            if spec.max_count is not None or spec.max_age is not None:
                store.create_stream(spec.stream, max_count=spec.max_count, max_age=spec.max_age)
            recorders.append(
                Recorder(dataspace, spec.pattern, store, spec.stream, events=spec.events,
                         capture=spec.capture)
            )
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
