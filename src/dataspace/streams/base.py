"""The storage interface of durable streams.

A *store* holds named, append-only *streams* of Preserves values.  Every entry has a
monotonic 64-bit *index* within its stream (0, 1, 2, ...; never reused, even after
retention removed old entries), the time it was appended, its value (kept as the canonical
binary encoding) and optional metadata (a Preserves value too).  Named *tailers* remember a
read position per stream.  A :class:`Transaction` writes entries to several streams,
tailer positions and anything else atomically: that is what makes exactly-once processing
cheap (see :mod:`dataspace.pipeline`).

**Reads are verified** (:mod:`.integrity`): a stream's entries are exactly the indices
from its first index to its next one, each with a checksum; every read checks that it got
the indices it asked for and that each entry matches its checksum -- and that the
stream's row (and a tailer's) matches its own checksum and the entries stored at its
ends -- and raises :class:`StoreCorrupt` (one line) rather than return what a damaged
store gave it.

:class:`~dataspace.streams.sqlite.SQLiteStore` (one file, no server) and
:class:`~dataspace.streams.postgres.PostgresStore` (a PostgreSQL database that many
machines reach) implement it; :func:`dataspace.streams.open_store` picks one by URL.
Another backend implements :class:`Store`, :class:`Transaction` and :class:`StoreLock`.
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..values import Value, encode
from .entry import Entry, check_name, check_stream_name, check_tailer_name
from .errors import (
    MAX_INDEX,
    MAX_VALUE_SIZE,
    ForeignStore,
    LockHeld,
    StoreCorrupt,
    StoreError,
    StoreNotFound,
    StreamNotFound,
)
from .groups import (
    DEFAULT_IDLE_TIMEOUT,
    AckLost,
    Delivery,
    Group,
    GroupInfo,
    GroupNotFound,
    GroupRead,
    PendingEntry,
    no_group,
)
from .integrity import CheckReport, Salvaged, StreamDigest, StreamRow, verify_stream_row
from .tailer import Tailer

__all__ = [
    "MAX_INDEX",
    "MAX_VALUE_SIZE",
    "AckLost",
    "Columns",
    "Delivery",
    "Group",
    "GroupInfo",
    "GroupNotFound",
    "PendingEntry",
    "Entry",
    "ForeignStore",
    "LockHeld",
    "Store",
    "StoreCorrupt",
    "StoreError",
    "StoreLock",
    "StoreNotFound",
    "StreamInfo",
    "StreamNotFound",
    "TailerInfo",
    "Transaction",
    "RESERVED_PREFIX",
    "check_lock_name",
    "check_stream_name",
    "check_user_name",
    "is_reserved",
    "check_tailer_name",
    "encode_value",
    "parse_duration",
]


class StoreLock(ABC):
    """A held :meth:`Store.lock`: :meth:`release` it (or leave the ``with`` block); the
    store releases it anyway when the holding process dies."""

    @abstractmethod
    def release(self) -> None:
        """Give the lock up (idempotent)."""

    def __enter__(self) -> StoreLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


RESERVED_PREFIX = "__"
"""Names starting with this belong to the store and its engines (processor backing
streams: ``__backing/GRAPH/PROCESSOR``); see :func:`check_user_name`."""


def is_reserved(name: str) -> bool:
    """Whether ``name`` is in the store's own namespace (starts with ``__``)."""
    return name.startswith(RESERVED_PREFIX)


def check_user_name(name: str, what: str = "stream") -> str:
    """``name`` if a user may give it to a ``what`` (stream, tailer, graph, processor),
    else ``ValueError`` saying why: :func:`check_stream_name`'s rules, and not in the
    store's own namespace (``__...``).

    The one rule for reserved names: the store's API takes them (the engines write their
    backing streams through it), everything a user names refuses them -- ``stream
    append`` and ``stream create``, graphs (streams, processors, the graph's name),
    recorders, the Spark writer.  Reserved streams can still be read (``stream ls --all``,
    ``stream tail``).
    """
    if isinstance(name, str) and is_reserved(name):
        raise ValueError(
            f"{what} name {name!r}: names starting with {RESERVED_PREFIX} are reserved for the "
            "store's own streams (processor backing streams); choose another name"
        )
    return check_name(name, what)


def check_lock_name(name: str) -> str:
    """``name`` if it can name a :meth:`Store.lock` (1-220 characters, no control
    characters: ``graph:`` and any graph name), else ``ValueError``."""
    if not isinstance(name, str) or not 0 < len(name) <= 220 or any(ord(c) < 32 for c in name):
        raise ValueError(f"invalid lock name {name!r}: 1-220 characters, no control characters")
    return name


def staged_total(stream: str, first: int, staged: Sequence[tuple[str, int]]) -> int:
    """How many rows ``append_staged`` of ``staged`` adds to ``stream`` (whose next index
    is ``first``); StoreError if they would not fit."""
    total = sum(n for _t, n in staged)
    if first + total > MAX_INDEX:
        raise StoreError(f"stream {stream!r} is full (64-bit indices exhausted)")
    return total


def staged_count_error(stream: str, token: str, have: int | None, want: int) -> StoreError:
    """The error of ``append_staged`` when ``token`` has ``have`` rows of ``stream``
    staged (None: none registered), not ``want``."""
    what = "missing" if have is None else f"{have}, not {want}"
    return StoreError(f"stream {stream!r}: the staged rows of {token!r} are {what} (lost in a "
                      "crash?); nothing was appended")


def encode_value(value: Value, what: str = "value") -> bytes:
    """The canonical encoding of ``value``, checked against :data:`MAX_VALUE_SIZE`.

    ``bytes`` are a Preserves value (a byte string) like any other: to append data that
    is already encoded, use :meth:`Transaction.append_encoded`.
    """
    data = encode(value)
    if len(data) > MAX_VALUE_SIZE:
        raise ValueError(
            f"{what} is {len(data)} bytes encoded; the limit is {MAX_VALUE_SIZE} bytes per entry"
        )
    return data


class Columns(NamedTuple):
    """Entries as parallel lists (:meth:`Store.read_columns`): indices, commit-order
    numbers (``seq``), append times (ns since the epoch), encoded values and metadata."""

    indices: list[int]
    seqs: list[int]
    times: list[int]
    values: list[bytes]
    metas: list[bytes | None]


@dataclass(frozen=True)
class TailerInfo:
    """A named tailer: its stream, name and persisted position (the next index it reads)."""

    stream: str
    name: str
    position: int
    updated_ns: int

    def as_json(self, nxt: int) -> dict[str, Any]:
        """The tailer as ``stream ls --json`` and ``GET /api/streams`` give it, on a stream
        whose next index is ``nxt`` (``lag``: entries it has not read)."""
        return {"name": self.name, "position": self.position,
                "lag": max(0, nxt - self.position), "updated": self.updated_ns / 1e9}


@dataclass(frozen=True)
class StreamInfo:
    """What a store knows about one stream.

    ``first`` is the lowest index still stored (None when empty), ``next`` the index the
    next append gets; ``count`` is the number of stored entries.  ``max_count`` and
    ``max_age`` (seconds) are the retention settings (None: keep).
    """

    name: str
    first: int | None
    next: int
    count: int
    created_ns: int
    max_count: int | None = None
    max_age: float | None = None
    last_time_ns: int | None = None
    tailers: tuple[TailerInfo, ...] = field(default=())
    groups: tuple[GroupInfo, ...] = field(default=())
    """Its consumer groups, by name (:mod:`.groups`)."""
    damaged: str | None = None
    """Only in :meth:`Store.streams` with ``with_damaged``: what is wrong with this
    stream's bookkeeping (its row, a tailer's), in a few words -- its other fields then
    say nothing (``next`` 0, ``first`` None, no tailers, no groups)."""

    @property
    def internal(self) -> bool:
        """Streams named ``__...`` are the store's own (processor backing streams)."""
        return self.name.startswith("__")

    @classmethod
    def broken(cls, name: str, err: StoreCorrupt) -> StreamInfo:
        """The info of stream ``name`` whose bookkeeping could not be verified (``err``)."""
        return cls(name=name, first=None, next=0, count=0, created_ns=0,
                   damaged=err.reason or str(err))


class Transaction(ABC):
    """A write transaction: everything done through it commits or rolls back together.

    Obtained from :meth:`Store.transaction`; reads inside it see its own writes.
    """

    @abstractmethod
    def append(
        self, stream: str, value: Value, meta: Value | None = None
    ) -> int:
        """Append one value (with optional metadata); returns its index."""

    @abstractmethod
    def append_encoded(
        self,
        stream: str,
        datas: list[bytes],
        metas: list[bytes | None] | None = None,
    ) -> int:
        """Append already-encoded values (and metadata) in order; returns the first
        index (the others follow).  The fast path: no checks on the bytes."""

    @abstractmethod
    def next_index(self, stream: str) -> int:
        """The index the next append to ``stream`` gets (this transaction's view)."""

    @abstractmethod
    def read(self, stream: str, start: int, limit: int, end: int | None = None) -> list[Entry]:
        """Up to ``limit`` entries with ``start <= index < end``, in index order."""

    @abstractmethod
    def get(self, stream: str, index: int) -> Entry | None:
        """The entry at ``index`` (None if absent or removed by retention)."""

    @abstractmethod
    def last(self, stream: str, before: int | None = None, limit: int = 1) -> list[Entry]:
        """Up to ``limit`` entries just below ``before`` (default: the end), newest first."""

    @abstractmethod
    def read_rows(
        self, stream: str, start: int, end: int, limit: int
    ) -> list[tuple[int, int, bytes, bytes | None]]:
        """The fast read path: ``(index, seq, value, meta)`` tuples with
        ``start <= index < end``, at most ``limit``, in index order.  ``seq`` orders
        entries of all streams by commit."""

    @abstractmethod
    def first_index(self, stream: str) -> int | None:
        """The lowest stored index of ``stream`` (None when empty or absent)."""

    @abstractmethod
    def position(self, stream: str, tailer: str) -> int | None:
        """A named tailer's persisted position, or None if it has none yet."""

    @abstractmethod
    def set_position(self, stream: str, tailer: str, position: int) -> None:
        """Persist a named tailer's position (the next index it will read): at most the
        stream's next index as this transaction sees it (``ValueError`` beyond: a read of
        a position past the end is damage, see :mod:`.integrity`)."""

    def set_positions(self, items: list[tuple[str, str, int]]) -> None:
        """Several ``(stream, tailer, position)`` at once."""
        for s, t, p in items:
            self.set_position(s, t, p)

    @abstractmethod
    def create_stream(
        self, stream: str, max_count: int | None = None, max_age: float | None = None
    ) -> None:
        """Create ``stream`` if absent (and set retention if given)."""

    @abstractmethod
    def ack(self, deliveries: Delivery | Iterable[Delivery]) -> int:
        """Acknowledge consumer groups' deliveries in this transaction: with the results
        written in it, exactly once.  Each must still be pending with the consumer and
        under the delivery it names, else :class:`AckLost` (another consumer claimed it
        meanwhile: this transaction must roll back, which ``with store.transaction()``
        does).  Returns how many were acknowledged (all of them)."""

    @abstractmethod
    def dead_letter(self, stream: str, group: str, entries: Sequence[PendingEntry],
                    why: str | None = None) -> int:
        """Move pending ``entries`` of ``group`` that are still pending as given (same
        consumer, same deliveries) to the group's dead-letter stream: each entry's value,
        with metadata saying where it came from and ``why`` (default: how many times it
        was delivered).  Returns how many moved."""

    @abstractmethod
    def set_retention(self, stream: str, max_count: int | None, max_age: float | None) -> None:
        """Set (None: clear) both retention limits of an existing stream."""

    @abstractmethod
    def copy_in(self, stream: str, rows: list[tuple[int, int, bytes, bytes | None, int]]) -> None:
        """Store entries at their own indices and append times -- ``(index, time_ns,
        value, meta, order)`` in index order, the first at or after the stream's next
        index (the stream is created if absent) -- as ``dataspace stream copy`` moves
        streams.  ``order`` is the row's place among every row copied in by this
        transaction, whatever the stream (0, 1, 2, ...): the commit-order numbers
        (``seq``) follow it, so a copy keeps the source's order across streams.  The
        stream's next index becomes its last index + 1.  Retention is not applied to
        these rows.  A stream's entries have no gaps: the indices must follow each other
        and, unless the stream is empty (then it starts at the first of them), start at
        its next index (``ValueError`` otherwise)."""

    @abstractmethod
    def advance(self, stream: str, next_index: int) -> None:
        """Raise ``stream``'s next index to ``next_index`` (never lowers it): indices
        below it are never used, as after retention removed entries.  Only an empty
        stream's (``ValueError`` otherwise: its entries would be followed by a gap)."""

    @abstractmethod
    def append_staged(self, stream: str, staged: Sequence[tuple[str, int]], *,
                      meta_cut: int = 0, meta_suffix: bytes = b"") -> int:
        """Append rows written earlier by :meth:`Store.stage` -- the rows of ``stream``
        staged under each ``(token, count)`` of ``staged``, in that order and in their
        order within a token -- as this transaction's appends (indices, ``seq``, append
        time, retention as :meth:`append_encoded`); returns the first index.  With
        ``meta_cut``, each staged metadata's last ``meta_cut`` bytes are replaced by
        ``meta_suffix``.  The rows are copied inside the store (they do not pass through
        this process).  :class:`StoreError` if a token has not exactly ``count`` rows of
        ``stream`` staged (staged rows are not durable until this commit takes them)."""

    @abstractmethod
    def drop_staged(self, owner: str) -> int:
        """Delete every row staged by ``owner`` (taken or not); returns how many.  A store
        may free their space later, in :meth:`Store.collect_staged`."""

    @abstractmethod
    def commit(self) -> None:
        """Make everything durable and visible (then wake readers everywhere)."""

    @abstractmethod
    def rollback(self) -> None:
        """Discard everything done in this transaction."""


class StreamRows:
    """The stream rows a store's write transaction touches, each read (and verified) once
    and kept with the transaction's changes -- next and first index, retention -- until
    it writes them back: ``_rows`` (id -> row), ``_orig`` (id -> the values it was read
    with; None: created here), ``_names`` (name -> id).  A store's transaction class
    (listing this first among its bases) gives the store's SQL: :meth:`_read_row` and
    :meth:`_insert_row`."""

    __slots__ = ()

    _rows: dict[int, StreamRow]
    _orig: dict[int, tuple[Any, ...] | None]
    _names: dict[str, int]
    _store: Store

    def _read_row(self, name: str) -> Sequence[Any] | None:
        """The stored row of stream ``name``: its eight columns and the two its checksum
        is checked with (None: there is none)."""
        raise NotImplementedError

    def _insert_row(self, name: str, now_ns: int) -> int:
        """Insert the row of a new, empty stream ``name``; its id."""
        raise NotImplementedError

    def _load(self, name: str, create: bool = False) -> StreamRow | None:
        """The row of stream ``name`` (read and verified once), created if asked; None if
        there is none."""
        sid = self._names.get(name)
        if sid is not None:
            return self._rows[sid]
        r = self._read_row(name)
        if r is not None:
            row = StreamRow(*r[:8])
            verify_stream_row(self._store.display, name, row, r[8], r[9])
            self._orig[row.id] = (row.next, row.first, row.max_count, row.max_age_ms)
        elif create:
            check_stream_name(name)
            now = time.time_ns()
            row = StreamRow(self._insert_row(name, now), name, 0, now, None, None, 0)
            self._orig[row.id] = None
        else:
            return None
        self._names[name] = row.id
        self._rows[row.id] = row
        return row

    def _need(self, name: str) -> StreamRow:
        row = self._load(name)
        if row is None:
            raise StreamNotFound(f"no stream named {name!r} in {self._store.display}")
        return row

    def _writable(self, name: str) -> StreamRow:
        row = self._load(name, create=True)
        assert row is not None
        return row

    def _forget(self, sid: int) -> None:
        """Stream ``sid`` was deleted in this transaction."""
        row = self._rows.pop(sid, None)
        self._orig.pop(sid, None)
        if row is not None:
            self._names.pop(row.name, None)

    def create_stream(
        self, stream: str, max_count: int | None = None, max_age: float | None = None
    ) -> None:
        row = self._writable(stream)
        if max_count is not None or max_age is not None:
            if max_count is not None and (type(max_count) is not int or max_count < 1):
                raise ValueError("max_count must be a positive integer")
            if max_age is not None and not (max_age > 0):
                raise ValueError("max_age must be a positive number of seconds")
            row.max_count = max_count
            row.max_age_ms = None if max_age is None else round(max_age * 1000)

    def set_retention(self, stream: str, max_count: int | None, max_age: float | None) -> None:
        """Set (or with None, clear) both retention limits of ``stream``."""
        row = self._need(stream)
        row.max_count = max_count
        row.max_age_ms = None if max_age is None else round(max_age * 1000)

    def next_index(self, stream: str) -> int:
        row = self._load(stream)
        return 0 if row is None else row.next


class Store(ABC):
    """A store of durable streams (see the module docstring)."""

    @property
    @abstractmethod
    def url(self) -> str:
        """How another process (or machine) opens this store: the SQLite file's absolute
        path, or the PostgreSQL URL -- with its password: never print it, show
        :attr:`display`."""

    @property
    @abstractmethod
    def display(self) -> str:
        """The store's location as it may be printed and logged (password masked)."""

    # -- locks ----------------------------------------------------------------------------

    @abstractmethod
    def lock(self, name: str, note: str = "") -> StoreLock:
        """Take the store-wide exclusive lock ``name`` for this process, without waiting:
        :class:`LockHeld` if another holds it.  Released by :meth:`StoreLock.release`,
        and by the store when the holder dies (kill -9 included) -- the pipeline engines
        take ``graph:NAME`` so that one graph runs once at a time per store.  ``note``
        (a few words: ``engine spark``) is said with the holder (:meth:`lock_holder`)."""

    @abstractmethod
    def lock_holder(self, name: str) -> str | None:
        """Who holds the lock ``name`` (``"pid N"``, ``"pid N on HOST"``, with the
        holder's note: ``"pid N, engine spark"``), or None."""

    # -- streams --------------------------------------------------------------------------

    @abstractmethod
    def create_stream(
        self,
        name: str,
        *,
        max_count: int | None = None,
        max_age: float | None = None,
    ) -> StreamInfo:
        """Create ``name`` if absent; set its retention when given (count, seconds)."""

    @abstractmethod
    def stream_info(self, name: str) -> StreamInfo:
        """Details of one stream (raises :class:`StreamNotFound`)."""

    @abstractmethod
    def streams(self, include_internal: bool = False, *,
                with_damaged: bool = False) -> list[StreamInfo]:
        """Every stream, by name.  One whose bookkeeping (its row, a tailer's) fails
        verification raises :class:`StoreCorrupt` -- or, ``with_damaged``, is listed with
        the others, marked (:attr:`StreamInfo.damaged`): what someone recovering a store
        needs to see."""

    @abstractmethod
    def has_stream(self, name: str) -> bool:
        """Whether ``name`` exists."""

    @abstractmethod
    def delete_stream(self, name: str) -> None:
        """Delete a stream with its entries, tailers and consumer groups."""

    @abstractmethod
    def next_index(self, name: str) -> int:
        """The index the next append to ``name`` will get (0 for a missing stream)."""

    @abstractmethod
    def next_indices(self) -> dict[str, int]:
        """:meth:`next_index` of every stream, in one read."""

    # -- writing --------------------------------------------------------------------------

    @abstractmethod
    def begin(self) -> Transaction:
        """Start a write transaction; end it with ``commit()`` or ``rollback()`` in the
        same thread.  (:meth:`transaction` is the usual way.)"""

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """``with store.transaction() as tx: ...``: one atomic, durable write; rolled
        back if the block raises."""
        tx = self.begin()
        try:
            yield tx
        except BaseException:
            tx.rollback()
            raise
        tx.commit()

    def append(self, name: str, value: Value, meta: Value | None = None) -> int:
        """Append one value in its own transaction; returns its index."""
        with self.transaction() as tx:
            return tx.append(name, value, meta)

    def append_many(self, name: str, values: Iterable[Value]) -> range:
        """Append values in one transaction; returns their indices."""
        datas = [encode_value(v) for v in values]
        with self.transaction() as tx:
            tx.create_stream(name)
            first = tx.append_encoded(name, datas)
        return range(first, first + len(datas))

    # -- reading --------------------------------------------------------------------------

    @abstractmethod
    def read(self, name: str, start: int = 0, limit: int | None = None,
             end: int | None = None) -> list[Entry]:
        """The stored entries of ``name`` from index ``start`` (below ``end``), in index
        order: all of them, or at most ``limit`` (a page: go on from the last index + 1).
        Without ``limit`` the whole range is read into one list (like Redis' XRANGE
        without COUNT); for a stream too large for memory use :meth:`iter_entries`, which
        reads it in chunks.  (Up to version 0.1 the default was ``limit=1000``.)"""

    @abstractmethod
    def get(self, name: str, index: int) -> Entry | None:
        """One entry, or None."""

    @abstractmethod
    def last(self, name: str, before: int | None = None, limit: int = 1) -> list[Entry]:
        """Up to ``limit`` entries just below ``before`` (default: the end), newest first."""

    @abstractmethod
    def first_index(self, name: str) -> int | None:
        """The lowest stored index of ``name`` (None when empty or absent)."""

    @abstractmethod
    def read_rows(
        self, name: str, start: int, end: int, limit: int
    ) -> list[tuple[int, int, bytes, bytes | None]]:
        """:meth:`Transaction.read_rows` outside a transaction (committed data)."""

    def read_columns(
        self, name: str, start: int, end: int, *, values: bool = True, meta: bool = False,
        limit: int = MAX_INDEX,
    ) -> Columns:
        """Entries with ``start <= index < end`` (at most ``limit``) as columns: the bulk
        read path of the Spark connector (partitions are index ranges).  ``values`` and
        ``meta`` say whether to fetch those (unfetched columns are empty lists).  This
        default goes through :meth:`read`; a backend may override it with one query."""
        out = Columns([], [], [], [], [])
        pos = start
        while pos < end and len(out.indices) < limit:
            batch = self.read(name, pos, min(10_000, limit - len(out.indices)), end)
            if not batch:
                break
            for e in batch:
                out.indices.append(e.index)
                out.seqs.append(e.seq)
                out.times.append(e.time_ns)
                if values:
                    out.values.append(e.data)
                if meta:
                    out.metas.append(e.meta_data)
            pos = batch[-1].index + 1
        return out

    @abstractmethod
    def salvage(self, name: str, start: int = 0, end: int = MAX_INDEX, limit: int = 1000,
                descending: bool = False) -> list[Salvaged]:
        """For recovering a damaged stream: up to ``limit`` entries of ``name`` with ``start
        <= index < end`` *as stored* (lowest first, or highest first with ``descending``),
        each with what is wrong with it (:class:`~.integrity.Salvaged`) -- not checked
        against the stream's bookkeeping, nor for gaps: the caller says what is missing.
        :class:`StreamNotFound` if there is no such stream; :class:`StoreCorrupt` where
        the database refuses to read on.  Never the way to read a sound stream."""

    def digest(self, name: str, start: int = 0, end: int = MAX_INDEX, *,
               values: bool = False) -> StreamDigest:
        """A summary of the stored entries of ``name`` with ``start <= index < end`` (how
        many, the first and last index, the sum of their checksums), read as a read of
        that range is -- verified: what a copy, an export or an import compares with what
        it read.  With ``values`` every value is read and its checksum computed again;
        without, a backend may sum the checksums it stores (this default reads values)."""
        out = StreamDigest()
        pos = start
        while pos < end:
            c = self.read_columns(name, pos, end, values=True, meta=True, limit=10_000)
            if not c.indices:
                break
            out.add(name, c.indices, c.values, c.metas)
            pos = c.indices[-1] + 1
        return out

    # -- tailers --------------------------------------------------------------------------

    @abstractmethod
    def position(self, stream: str, tailer: str) -> int | None:
        """A named tailer's persisted position (None if it never saved one)."""

    @abstractmethod
    def set_position(self, stream: str, tailer: str, position: int) -> None:
        """Persist a named tailer's position (at most the stream's next index)."""

    @abstractmethod
    def tailers(self, stream: str) -> list[TailerInfo]:
        """The named tailers of ``stream``."""

    @abstractmethod
    def delete_tailer(self, stream: str, tailer: str) -> None:
        """Forget a named tailer."""

    @abstractmethod
    def lost_tailers(self) -> int:
        """How many tailer rows name no stream (damage: a changed stream id makes a
        tailer unfindable by any read by name; ``check`` says "N tailers of no stream").
        Cheap (the tailers' table only): ``stream copy`` refuses a store that has any."""

    def tailer(
        self,
        stream: str,
        name: str | None = None,
        *,
        start: int | str = "earliest",
        auto_commit: bool = True,
    ) -> Tailer:
        """A reader of ``stream``; a *named* tailer resumes from its persisted position.

        ``start`` applies when there is no persisted position: ``"earliest"`` (the first
        stored entry), ``"latest"`` (only new entries) or an index.
        """
        return Tailer(self, stream, name, start=start, auto_commit=auto_commit)

    # -- consumer groups (see .groups) ----------------------------------------------------

    def group(self, stream: str, name: str, *, create: bool = True,
              start: int | str = "earliest", idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
              max_deliveries: int | None = None, dead_letter: str | None = None,
              hold_retention: bool = True) -> Group:
        """The consumer group ``name`` of ``stream`` (:class:`~.groups.Group`), created if
        absent (``create``; the stream too) with the settings given -- an existing group
        keeps its own.  See :meth:`create_group` for them."""
        try:
            self.group_info(stream, name)  # a read: no writer's lock when it exists
        except (GroupNotFound, StreamNotFound):
            if not create:
                raise
            self.create_group(stream, name, start=start, idle_timeout=idle_timeout,
                              max_deliveries=max_deliveries, dead_letter=dead_letter,
                              hold_retention=hold_retention, exist_ok=True)
        return Group(self, stream, name)

    @abstractmethod
    def create_group(self, stream: str, name: str, *, start: int | str = "earliest",
                     idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
                     max_deliveries: int | None = None, dead_letter: str | None = None,
                     hold_retention: bool = True, exist_ok: bool = False) -> GroupInfo:
        """Create the consumer group ``name`` on ``stream`` (created if absent), first
        delivering the entry at ``start``: ``"earliest"`` (the first stored),
        ``"latest"`` (entries appended from now on) or an index (at most the stream's next
        index).  ``idle_timeout``: seconds a delivered entry may stay unacknowledged
        before another consumer's read claims it (None: only by hand);
        ``max_deliveries``: deliveries after which an entry goes to ``dead_letter``
        instead (default ``STREAM.dead``); ``hold_retention``: the stream's retention
        never removes an entry the group has not acknowledged (False: it does, and the
        group skips it with a warning).  ``ValueError`` if the group exists, unless
        ``exist_ok`` (then its settings are kept)."""

    @abstractmethod
    def delete_group(self, stream: str, name: str) -> None:
        """Remove a consumer group and its pending list (:class:`GroupNotFound`)."""

    @abstractmethod
    def groups(self, stream: str | None = None) -> list[GroupInfo]:
        """The consumer groups of ``stream`` (or of every stream), by stream and name,
        each verified, with its pending counts."""

    def group_info(self, stream: str, name: str) -> GroupInfo:
        """One consumer group (:class:`GroupNotFound`, :class:`StreamNotFound`)."""
        for g in self.groups(stream):
            if g.name == name:
                return g
        raise no_group(self.display, stream, name)

    @abstractmethod
    def group_read(self, stream: str, group: str, consumer: str, count: int, *,
                   now_ns: int, recover: tuple[int, int] | None = None,
                   claim_idle: bool = True, ack: Sequence[Delivery | int] = ()) -> GroupRead:
        """The primitive of :meth:`~.groups.Consumer.read`, one transaction: up to
        ``count`` entries for ``consumer`` -- with ``recover`` (cursor, born): its own
        pending entries above index ``cursor`` delivered before ``born``; with
        ``claim_idle``: other consumers' entries idle past the group's idle timeout at
        ``now_ns``; then entries not yet delivered.  Pending entries already delivered
        ``max_deliveries`` times come back in ``over``, undelivered.  ``ack``: entries to
        acknowledge first, in the same (then durable) transaction."""

    @abstractmethod
    def group_claim(self, stream: str, group: str, consumer: str, *, now_ns: int,
                    min_idle_ns: int, count: int,
                    indices: Sequence[int] | None = None) -> GroupRead:
        """The primitive of :meth:`~.groups.Group.claim`: pending entries (of any
        consumer; of ``indices`` only, if given) delivered at least ``min_idle_ns`` before
        ``now_ns``, the lowest ``count``, delivered to ``consumer``."""

    @abstractmethod
    def group_ack(self, stream: str, group: str, items: Sequence[Delivery | int]) -> int:
        """Acknowledge (durably) entries pending with ``group``: deliveries while still
        pending under them, indices whoever holds them; how many were."""

    @abstractmethod
    def group_pending(self, stream: str, group: str, *, consumer: str | None = None,
                      start: int = 0, limit: int = 100) -> list[PendingEntry]:
        """Pending entries of ``group`` from index ``start`` (of ``consumer``, or all), in
        index order, at most ``limit``, each row verified."""

    # -- waiting --------------------------------------------------------------------------

    @abstractmethod
    def generation(self) -> int:
        """A counter that changes whenever the store may have changed (any process)."""

    @abstractmethod
    def wait_change(self, generation: int, timeout: float | None) -> int:
        """Block until :meth:`generation` differs from ``generation`` or ``timeout``
        seconds pass; returns the current generation.  No polling: see
        :mod:`dataspace.streams.wakeup`."""

    @abstractmethod
    async def wait_change_async(self, generation: int, timeout: float | None) -> int:
        """:meth:`wait_change` for asyncio."""

    @abstractmethod
    def wake(self) -> None:
        """Wake this process's waiters now (e.g. to make a loop look at a stop flag)."""

    def wait_for(self, name: str, index: int, timeout: float | None = None) -> bool:
        """Block until ``name`` has an entry at ``index`` or later appended (that is, its
        next index exceeds ``index``); False on timeout."""
        return self.wait_until(lambda: self.next_index(name) > index, timeout)

    async def wait_for_async(self, name: str, index: int, timeout: float | None = None) -> bool:
        """:meth:`wait_for` for asyncio."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            gen = self.generation()
            if self.next_index(name) > index:
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            await self.wait_change_async(gen, remaining)

    def wait_until(
        self, ready: Callable[[], bool], timeout: float | None = None
    ) -> bool:
        """Block until ``ready()`` is true (checked after every store change); False on
        timeout.  ``ready`` must only read the store."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            gen = self.generation()
            if ready():
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self.wait_change(gen, remaining)

    # -- maintenance ----------------------------------------------------------------------

    # -- staging (rows written ahead, made visible by a later transaction) ----------------

    @abstractmethod
    def stage(self, owner: str, token: str,
              rows: Mapping[str, tuple[Sequence[bytes], Sequence[bytes | None]]]) -> None:
        """Write ``rows`` -- per stream, encoded values and their metadata -- aside under
        ``token`` (unique per writer and attempt; ``owner``: who will take or drop them),
        in a transaction of its own, invisible to every reader: no index, no ``seq``,
        no wake-up.  A later transaction appends them with
        :meth:`Transaction.append_staged` (the Spark sink's write tasks stage a batch's
        outputs; the batch's commit takes them); :meth:`Transaction.drop_staged` removes
        what an owner left behind.  Staged rows are not made durable."""

    def collect_staged(self) -> int:
        """Free the space of staged rows that transactions dropped, if the store defers
        that, and do other housekeeping deferred to it (outside every transaction, so it
        may run in the background while others write); returns how many parts were
        freed."""
        return 0

    def attach_staged(self) -> None:
        """Make rows staged by other processes reachable by this store's next
        transactions (SQLite: attach the staging files; call it outside a transaction,
        before :meth:`begin`).  Nothing for stores that need nothing."""
        return None

    def defer_checkpoints(self) -> None:
        """Leave housekeeping that this store's commits would do (SQLite: folding the
        write-ahead log into the database) to :meth:`collect_staged`, which the caller
        then runs after its commits, in the background.  Nothing for stores without."""
        return None

    @abstractmethod
    def apply_retention(self, now_ns: int | None = None) -> int:
        """Delete entries beyond each stream's retention; returns how many went."""

    @abstractmethod
    def check(self) -> list[str]:
        """An integrity check: the problems found (empty when the store is sound)."""

    @abstractmethod
    def check_report(self) -> CheckReport:
        """:meth:`check`, with how many entries were read and verified (every one: its
        checksum and that the stream holds each index once, none missing)."""

    @abstractmethod
    def close(self) -> None:
        """Release the store (idempotent)."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def iter_entries(self, name: str, start: int = 0, end: int | None = None, chunk: int = 1000) -> Iterator[Entry]:
        """Every stored entry of ``name`` from ``start`` (below ``end``), read in chunks."""
        pos = start
        while True:
            batch = self.read(name, pos, chunk, end)
            if not batch:
                return
            yield from batch
            pos = batch[-1].index + 1


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """Seconds from ``"90"``, ``"90s"``, ``"15m"``, ``"12h"``, ``"7d"``, ``"2w"`` or ``"250ms"``."""
    t = text.strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?", t)
    if not m:
        raise ValueError(
            f"invalid duration {text!r}: use a number with an optional unit (ms, s, m, h, d, w), "
            "e.g. 90s, 15m, 7d"
        )
    seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if seconds <= 0:
        raise ValueError(f"a duration must be positive, not {text!r}")
    return seconds
