"""Verified reads: every read of a store checks that it got what it asked for.

A damaged store file (a misdirected b-tree page, pages overwritten, a flipped bit) can
still be well formed: SQLite then answers a range query with rows missing, twice or out
of place, or with a changed value, and nothing else notices.  So the stores check every
read against two things they keep, and a mismatch raises :class:`StoreCorrupt` with one
line (``stream 'ab' in PATH is damaged: entry 26188 missing from a read of indices
0..49999 (...)``) instead of returning data.

**Which indices a stream holds.**  Each stream's row keeps its ``first_index`` beside its
``next_index``, and the stores keep this invariant: *a stream's stored entries are
exactly the indices ``first <= i < next``*, none missing, none twice.

* An append adds ``next`` (and on: ``next`` grows by the count).
* Retention removes a prefix -- everything below a cut -- and raises ``first`` to the
  cut; nothing else removes entries (but deleting the stream).
* :meth:`~.base.Transaction.copy_in` (``stream copy``, ``stream import
  --keep-indices``) starts an empty stream at its first row (``first`` = that index:
  indices below it were never stored here, as after retention) and otherwise continues
  at ``next``; rows must follow each other.  :meth:`~.base.Transaction.advance` moves an
  empty stream's ``first`` and ``next`` together.  Both refuse what would leave a hole.

So a read of ``start <= i < end`` (at most ``limit``) must return exactly the indices
``max(start, first)``, +1, ... up to ``min(end, next)`` or ``limit`` of them, in order;
reading newest first (``last``) the same from ``min(before, next) - 1`` down.  A read
asks the stream's row and the entries in one snapshot, so retention or appends by others
never look like damage.

**A checksum per entry.**  Each entry's row holds ``checksum``: the Adler-32 (zlib's, in
C) of the stream's name, the value and the metadata (none when absent), plus the index,
modulo 2**32::

    checksum = (adler32(meta, adler32(value, adler32(name))) + index) mod 2**32

so a flipped bit in a value or its metadata, a row that answers for another index and a
row of another stream are caught.  Adler-32 catches every change of one byte and of any
two bytes of an entry shorter than 65,521 bytes, so every flipped bit; of other changes
it misses a few in 2**32 for entries of a few hundred bytes or more, more for shorter
ones (its sums use fewer bits there).  Why not CRC-32 or CRC32C: measured here, for entries
of about 60 bytes -- the cost of a checksum in Python is the call, then the bytes --
zlib's CRC-32 takes 190 ns an entry, a CRC32C package with the CPU's instruction 117 ns
(and another dependency), Adler-32 63 ns; a read checks every entry it returns, so this
is much of what verified reads cost the exactly-once pipeline (6-12% with Adler-32,
measured; twice that with CRC-32).  The indices are checked apart (below), which is
what catches misdirected and overwritten pages; the checksum catches changed bytes.

Appends compute the checksum in the writing process; the index part is added in SQL,
which lets rows staged ahead of their index (Spark's write tasks,
:meth:`~.base.Store.stage`) carry the rest.  A read computes it again for every
entry it returns with values.  Reads of indices alone (``read_columns(values=False)``)
check the indices only.  The time and the commit number (``seq``) are not covered.

Entries written before checksums existed (a store made by an older dataspace, migrated
on open) have none (``checksum`` NULL): they are read unverified, with a note in the log
once per stream, and ``dataspace stream info --check`` counts them.

**The bookkeeping rows.**  What a stream holds is said by its row in ``streams``
(``first_index``, ``next_index``) and where a named reader is by its row in ``tailers``
(``position``): a flipped bit there would make every read above agree with a stream cut
short or shifted (``next_index`` 20000 -> 19968 and a read of ``0 <= i < next`` returns
19,968 entries, each sound).  So these rows are verified as the entries are:

* Each carries a ``checksum``: the CRC-32 (zlib's) of its columns, 64-bit big-endian,
  then the name (UTF-8)::

      stream row: crc32(q(id) q(first_index) q(next_index) q(created_ns)
                        q(max_count or 0) q(max_age_ms or 0) b(nulls) name)
      tailer row: crc32(q(stream id) q(position) q(updated_ns) name)

  where ``q`` is an 8-byte signed big-endian integer and ``nulls`` a byte whose bit 0 says
  ``max_count`` is NULL and bit 1 ``max_age_ms``.  CRC-32 catches every flipped bit in
  the row (and every burst of changed bits up to 32 long, in the 64-bit fields too -- an
  additive checksum modulo 2**32 would miss a flip above bit 31), and a change of the
  checksum itself.  Every writer of these columns computes it in Python (the stores write
  ``next_index``, ``first_index`` and ``position`` only from values this process holds,
  in the transaction that read and verified the row), so both stores share one formula.
* Every read of a stream checks its row's checksum, and cross-checks the row against the
  entries in the same snapshot by two index-only probes (the lowest and the highest
  stored index of the stream, one b-tree descent each): the entry at ``first_index``
  exists and none below it, the entry at ``next_index - 1`` exists and none after it --
  or no entry at all when ``first_index == next_index`` (retention keeps this: it deletes
  below a cut and raises ``first_index`` to it in one transaction).  So an old copy of a
  stream's row written back (a lost write: its checksum is right for its old values) is
  caught too.
* A tailer's position is at most its stream's next index (:meth:`~.base.Transaction.
  set_position` refuses more); a read of a position checks its row's checksum and that.

**Consumer groups' rows** (:mod:`.groups`) are verified the same way.  A group's row in
``consumer_groups`` says where the group is (``next_index``: the lowest index not yet
delivered to it) and how it redelivers; each delivered, unacknowledged entry has a row in
``pending`` (its consumer, how many times it was delivered, when last)::

      group row:   crc32(q(id) q(stream id) q(next_index) q(created_ns) q(idle_ms or 0)
                         q(max_deliveries or 0) b(flags) name b(0) dead_letter)
      pending row: crc32(q(group id) q(idx) q(deliveries) q(delivered_ns) consumer)

where bit 0 of ``flags`` says the group holds retention back, bit 1 that ``idle_ms`` is
NULL and bit 2 ``max_deliveries``.  Every read of a group row checks its checksum and
that its ``next_index`` is at most its stream's (as a tailer's position); every read of
a pending row checks its checksum and that its index is below its group's
``next_index`` (an entry is pending only once delivered).  Listings count pending rows
without reading each one (the highest index of each group is checked against its row);
``--check`` reads them all.

Stores made before these checksums (schema version 2 and older) are migrated on open:
their rows get checksums of the values they hold then (see the stores' modules).

What it costs: see docs/streams.md (the exactly-once benchmark before and after).
"""

from __future__ import annotations

import logging
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import pairwise, repeat
from typing import Any, NamedTuple

from .errors import MAX_INDEX, StoreCorrupt, StoreError

__all__ = [
    "CHECKSUM_MASK",
    "CheckReport",
    "GroupRow",
    "Salvaged",
    "StreamDigest",
    "StreamRow",
    "StreamScan",
    "check_advance",
    "check_copy_in",
    "checksums",
    "damaged",
    "digest_of",
    "expected_range",
    "staged_checksums",
    "plural",
    "salvage_rows",
    "stream_checksum",
    "stream_seed",
    "ends_problem",
    "group_checksum",
    "group_problem",
    "pending_checksum",
    "pending_checksums",
    "pending_problem",
    "pending_top_problem",
    "verify_group",
    "verify_pending",
    "stream_row_problem",
    "tailer_checksum",
    "tailer_problem",
    "verify_at",
    "verify_checksums",
    "verify_tailer",
    "verify_get",
    "verify_indices",
    "verify_stream_row",
]

log = logging.getLogger(__name__)

CHECKSUM_MASK = 0xFFFFFFFF
"""Checksums are 32-bit: the stores add the index modulo 2**32 (``& CHECKSUM_MASK``)."""

_adler = zlib.adler32


@lru_cache(maxsize=4096)
def stream_seed(stream: str) -> int:
    """The Adler-32 of a stream's name (UTF-8): where its entries' checksums start."""
    return _adler(stream.encode())


def checksums(stream: str, values: Sequence[bytes],
              metas: Sequence[bytes | None] | None = None) -> list[int]:
    """Each entry's checksum without its index (see the module docstring): Adler-32 of the
    stream's name, the value and the metadata.  Computed in C, one call a part."""
    return list(_sums(stream, values, metas))


def _sums(stream: str, values: Sequence[bytes], metas: Sequence[bytes | None] | None) -> Any:
    c = map(_adler, values, repeat(stream_seed(stream)))
    if metas is None:
        return c
    nones = metas.count(None)
    if nones == len(metas):
        return c
    if nones:
        metas = [b"" if m is None else m for m in metas]
    return map(_adler, metas, c)


def _checksums_each(stream: str, values: Sequence[Any], metas: Sequence[Any] | None) -> list[int | None]:
    """:func:`checksums` one entry at a time: None where the value or metadata is not
    bytes (a damaged row's column can come back as text or a number)."""
    seed = stream_seed(stream)
    out: list[int | None] = []
    for k, v in enumerate(values):
        m = None if metas is None else metas[k]
        try:
            c = _adler(v, seed)
            out.append(c if m is None else _adler(m, c))
        except TypeError:
            out.append(None)
    return out


def staged_checksums(stream: str, values: Sequence[bytes],
                     metas: Sequence[bytes | None]) -> tuple[list[int], list[int]]:
    """For rows staged ahead of their index (:meth:`~.base.Store.stage`): each one's
    checksum of the value alone and with the metadata (both less the index); the first
    lets a commit that rewrites the metadata go on over the new one."""
    vsums = list(map(_adler, values, repeat(stream_seed(stream))))
    nones = metas.count(None)
    if nones == len(metas):
        return vsums, vsums
    if nones:
        metas = [b"" if m is None else m for m in metas]
    return vsums, list(map(_adler, metas, vsums))


def check_copy_in(stream: str, nxt: int, holds: bool, idxs: Sequence[int]) -> None:
    """ValueError unless rows at ``idxs`` may be copied into ``stream`` (next index
    ``nxt``; ``holds``: it holds entries) keeping its entries without gaps: increasing by
    one, from ``nxt`` -- or, into an empty stream, from any index at or after it."""
    if idxs[0] < nxt or any(b <= a for a, b in pairwise(idxs)):
        raise ValueError(f"copy_in {stream!r}: indices must increase from the next index {nxt}")
    for a, b in pairwise(idxs):
        if b != a + 1:
            raise ValueError(f"copy_in {stream!r}: index {b} after index {a} would leave "
                             f"{_span(a + 1, b)} missing: a stream's entries have no gaps")
    if holds and idxs[0] != nxt:
        raise ValueError(f"copy_in {stream!r}: index {idxs[0]} would leave {_span(nxt, idxs[0])} "
                         f"missing after the stream's entries (a stream's entries have no "
                         f"gaps): continue at {nxt}, or copy into an empty stream")
    if idxs[-1] >= MAX_INDEX:
        raise StoreError(f"stream {stream!r} is full (64-bit indices exhausted)")


def check_advance(stream: str, nxt: int, holds: bool, to: int) -> None:
    """ValueError if raising the next index of ``stream`` from ``nxt`` to ``to`` would
    leave a gap after its entries (``holds``: it has some)."""
    if holds:
        raise ValueError(f"advance {stream!r} to {to}: {_span(nxt, to)} would be missing "
                         "after the stream's entries (a stream's entries have no gaps); "
                         "only an empty stream's next index can be raised")


def damaged(where: str, stream: str, what: str) -> StoreCorrupt:
    """The one-line error of a damaged stream: what is wrong and what to do."""
    err = StoreCorrupt(
        f"stream {stream!r} in {where} is damaged: {what} (run `dataspace stream info "
        f"{stream} --check`; restore the store from a backup)"
    )
    err.stream = stream
    err.reason = what
    return err


def _span(a: int, b: int) -> str:
    return f"index {a}" if b == a + 1 else f"indices {a}..{b - 1}"


def plural(n: int, one: str, many: str | None = None) -> str:
    """``1 entry``, ``2 entries``, ``1,000 streams``."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"


ORPHANS = (
    # (table, its column naming a parent row, the parent's table, a row, rows, a parent)
    ("entries", "stream", "streams", "entry", "entries", "stream"),
    ("tailers", "stream", "streams", "tailer", None, "stream"),
    ("consumer_groups", "stream", "streams", "consumer group", None, "stream"),
    ("pending", "grp", "consumer_groups", "pending entry", "pending entries", "consumer group"),
)
"""The rows a store's check looks for whose parent row is gone (both stores' tables)."""


def orphan_problems(count: Callable[[str, str, str], int]) -> list[str]:
    """What a check says of rows whose parent is gone (:data:`ORPHANS`), given
    ``count(table, column, parent_table)``: how many rows of ``table`` name a missing
    row of ``parent_table`` in ``column``."""
    out = []
    for table, column, parent, one, many, of in ORPHANS:
        n = count(table, column, parent)
        if n:
            out.append(f"{plural(n, one, many)} of no {of}")
    return out


# -- the bookkeeping rows (see the module docstring) -------------------------------------------

_STREAM_ROW = struct.Struct(">qqqqqqB")
_TAILER_ROW = struct.Struct(">qqq")
_UNREADABLE = (TypeError, ValueError, AttributeError, OverflowError, struct.error)


def stream_checksum(sid: int, name: str, first: int, nxt: int, created_ns: int,
                    max_count: int | None, max_age_ms: int | None) -> int:
    """The checksum of a stream's row (the module docstring has the formula)."""
    nulls = (max_count is None) | ((max_age_ms is None) << 1)
    head = _STREAM_ROW.pack(sid, first, nxt, created_ns, max_count or 0, max_age_ms or 0, nulls)
    return zlib.crc32(name.encode("utf-8", "surrogatepass"), zlib.crc32(head))


def tailer_checksum(sid: int, name: str, position: int, updated_ns: int) -> int:
    """The checksum of a tailer's row (the module docstring has the formula)."""
    return zlib.crc32(name.encode("utf-8", "surrogatepass"),
                      zlib.crc32(_TAILER_ROW.pack(sid, position, updated_ns)))


_GROUP_ROW = struct.Struct(">qqqqqqB")
_PENDING_ROW = struct.Struct(">qqqq")


def group_checksum(gid: int, sid: int, name: str, nxt: int, created_ns: int,
                   idle_ms: int | None, max_deliveries: int | None, dead_letter: str | None,
                   hold: Any) -> int:
    """The checksum of a consumer group's row (the module docstring has the formula)."""
    flags = (1 if hold else 0) | ((idle_ms is None) << 1) | ((max_deliveries is None) << 2)
    head = _GROUP_ROW.pack(gid, sid, nxt, created_ns, idle_ms or 0, max_deliveries or 0, flags)
    tail = name.encode("utf-8", "surrogatepass") + b"\0" + (dead_letter or "").encode(
        "utf-8", "surrogatepass")
    return zlib.crc32(tail, zlib.crc32(head))


def pending_checksum(gid: int, idx: int, consumer: str, deliveries: int,
                     delivered_ns: int) -> int:
    """The checksum of a pending entry's row (the module docstring has the formula)."""
    return zlib.crc32(consumer.encode("utf-8", "surrogatepass"),
                      zlib.crc32(_PENDING_ROW.pack(gid, idx, deliveries, delivered_ns)))


def pending_checksums(gid: int, a: int, b: int, consumer: str, delivered_ns: int,
                      deliveries: int = 1) -> list[int]:
    """:func:`pending_checksum` of the rows of indices ``a <= i < b``, all delivered
    ``deliveries`` times to ``consumer`` at ``delivered_ns``: one read's new rows."""
    pack = _PENDING_ROW.pack
    crc = zlib.crc32
    name = consumer.encode("utf-8", "surrogatepass")
    return [crc(name, crc(pack(gid, i, deliveries, delivered_ns))) for i in range(a, b)]


class GroupRow:
    """A consumer group's row as a store reads and writes it (``next``: its
    ``next_index``); :meth:`seal` sets ``checksum`` for its values."""

    __slots__ = ("checksum", "created_ns", "dead_letter", "hold", "id", "idle_ms",
                 "max_deliveries", "name", "next", "stream", "stream_id")

    def __init__(self, gid: int, sid: int, name: str, nxt: int, created_ns: int,
                 idle_ms: int | None, max_deliveries: int | None, dead_letter: str | None,
                 hold: Any, checksum: int | None = None, stream: str = "") -> None:
        self.id = gid
        self.stream_id = sid
        self.name = name
        self.next = nxt
        self.created_ns = created_ns
        self.idle_ms = idle_ms
        self.max_deliveries = max_deliveries
        self.dead_letter = dead_letter
        self.hold = bool(hold)
        self.checksum = checksum
        self.stream = stream

    def seal(self) -> int:
        """Compute (and keep) the checksum of the row's values."""
        self.checksum = group_checksum(self.id, self.stream_id, self.name, self.next,
                                       self.created_ns, self.idle_ms, self.max_deliveries,
                                       self.dead_letter, self.hold)
        return self.checksum

    def __repr__(self) -> str:
        return f"GroupRow({self.id}, {self.stream!r}, {self.name!r}, next={self.next})"


def group_problem(row: GroupRow, nxt: int | None) -> str | None:
    """What is wrong with a group's row (its stream's next index ``nxt``; None:
    unknown), or None."""
    try:
        want = group_checksum(row.id, row.stream_id, row.name, row.next, row.created_ns,
                              row.idle_ms, row.max_deliveries, row.dead_letter, row.hold)
    except _UNREADABLE:
        return f"the row of its consumer group {row.name!r} holds a value of the wrong type"
    if want != row.checksum:
        return (f"the row of its consumer group {row.name!r} (at index {row.next}) does not "
                "match its checksum (changed behind the store's back)")
    if row.next < 0 or (nxt is not None and row.next > nxt):
        return (f"its consumer group {row.name!r} is at index {row.next}, beyond its next "
                f"index {nxt}")
    return None


def verify_group(where: str, stream: str, row: GroupRow, nxt: int | None) -> GroupRow:
    """Raise :func:`damaged` unless a group's row matches its checksum and is not beyond
    its stream's next index ``nxt``; returns the row."""
    what = group_problem(row, nxt)
    if what is not None:
        raise damaged(where, stream, what)
    return row


def pending_problem(group: GroupRow, idx: Any, consumer: Any, deliveries: Any,
                    delivered_ns: Any, stored: Any) -> str | None:
    """What is wrong with a pending row of ``group`` (verified), or None."""
    try:
        want = pending_checksum(group.id, idx, consumer, deliveries, delivered_ns)
    except _UNREADABLE:
        return (f"a pending entry's row of its consumer group {group.name!r} holds a value "
                "of the wrong type")
    if want != stored:
        return (f"the pending entry {idx} of its consumer group {group.name!r} (consumer "
                f"{consumer!r}) does not match its checksum (changed behind the store's back)")
    if not 0 <= idx < group.next or deliveries < 1:
        return (f"the pending entry {idx} of its consumer group {group.name!r} is at or "
                f"beyond the group's next index {group.next} (never delivered)"
                if deliveries >= 1 else
                f"the pending entry {idx} of its consumer group {group.name!r} says it was "
                f"delivered {deliveries} times")
    return None


def verify_pending(where: str, stream: str, group: GroupRow,
                   rows: Sequence[Sequence[Any]]) -> None:
    """Raise :func:`damaged` unless every ``(idx, consumer, deliveries, delivered_ns,
    checksum)`` of ``group`` is sound."""
    for idx, consumer, deliveries, delivered_ns, stored in rows:
        what = pending_problem(group, idx, consumer, deliveries, delivered_ns, stored)
        if what is not None:
            raise damaged(where, stream, what)


def pending_top_problem(group: GroupRow, top: Any) -> str | None:
    """What is wrong with a group whose highest pending index is ``top`` (None: none
    pending), or None: the cheap cross-check of listings."""
    if top is None:
        return None
    if type(top) is not int or not top < group.next:
        return (f"its consumer group {group.name!r} has entry {top} pending, at or beyond its "
                f"next index {group.next} (never delivered)")
    return None


class StreamRow:
    """A stream's row as a store reads and writes it: ``next`` and ``first`` are its
    ``next_index`` and ``first_index``; :meth:`seal` sets ``checksum`` for its values."""

    __slots__ = ("checksum", "created_ns", "first", "id", "max_age_ms", "max_count", "name",
                 "next")

    def __init__(self, sid: int, name: str, nxt: int, created_ns: int, max_count: int | None,
                 max_age_ms: int | None, first: int, checksum: int | None = None) -> None:
        self.id = sid
        self.name = name
        self.next = nxt
        self.created_ns = created_ns
        self.max_count = max_count
        self.max_age_ms = max_age_ms
        self.first = first
        self.checksum = checksum

    def seal(self) -> int:
        """Compute (and keep) the checksum of the row's values."""
        self.checksum = stream_checksum(self.id, self.name, self.first, self.next,
                                        self.created_ns, self.max_count, self.max_age_ms)
        return self.checksum

    def copy(self) -> StreamRow:
        return StreamRow(self.id, self.name, self.next, self.created_ns, self.max_count,
                         self.max_age_ms, self.first, self.checksum)

    def __repr__(self) -> str:
        return (f"StreamRow({self.id}, {self.name!r}, first={self.first}, next={self.next}, "
                f"checksum={self.checksum})")


def stream_row_problem(row: StreamRow) -> str | None:
    """What is wrong with a stream's row on its own (its checksum, its indices), or None."""
    try:
        want = stream_checksum(row.id, row.name, row.first, row.next, row.created_ns,
                               row.max_count, row.max_age_ms)
    except _UNREADABLE:
        return "its row in the table of streams holds a value of the wrong type"
    if want != row.checksum:
        return (f"its bookkeeping row (first index {row.first}, next index {row.next}) does "
                "not match its checksum (changed behind the store's back)")
    if not 0 <= row.first <= row.next <= MAX_INDEX:
        return (f"its bookkeeping row says first index {row.first} and next index {row.next} "
                "(the first is never above the next)")
    return None


def ends_problem(first: int, nxt: int, lo: Any, hi: Any) -> str | None:
    """What is wrong with a stream whose row says ``first``, ``nxt`` and whose lowest and
    highest stored indices are ``lo`` and ``hi`` (None: it stores none), or None."""
    if first < nxt:
        if lo == first and hi == nxt - 1:
            return None
    elif lo is None and hi is None:
        return None
    for i in (lo, hi):
        if i is not None and type(i) is not int:
            return f"an entry's index is not an integer ({str(i)[:40]!r})"
    if lo is None or hi is None:
        return f"none of its entries ({_span(first, nxt)}) is stored"
    if hi >= nxt:
        return f"entry {hi} is stored at or beyond its next index {nxt}"
    if lo < first:
        return f"entry {lo} is stored below its first index {first}"
    if lo > first:
        return f"entry {first} (its first index) is missing"
    return f"entry {nxt - 1} (the last, before its next index {nxt}) is missing"


def tailer_problem(sid: int, name: str, position: Any, updated_ns: Any, stored: Any,
                   nxt: int | None) -> str | None:
    """What is wrong with a tailer's row (its stream's next index ``nxt``; None: unknown),
    or None."""
    try:
        want = tailer_checksum(sid, name, position, updated_ns)
    except _UNREADABLE:
        return f"the row of its tailer {name!r} holds a value of the wrong type"
    if want != stored:
        return (f"the row of its tailer {name!r} (position {position}) does not match its "
                "checksum (changed behind the store's back)")
    if position < 0 or (nxt is not None and position > nxt):
        return f"its tailer {name!r} is at position {position}, beyond its next index {nxt}"
    return None


def verify_stream_row(where: str, stream: str, row: StreamRow, lo: Any = None, hi: Any = None,
                      view: tuple[int, int] | None = None) -> tuple[int, int]:
    """Raise :func:`damaged` unless ``row`` matches its checksum and -- ``lo`` and ``hi``
    being the lowest and highest indices stored, read in the same snapshot -- holds
    exactly the entries it says (``view``: the (first, next) a transaction sees instead,
    with its own appends).  Returns (first, next) as the reader sees them."""
    what = stream_row_problem(row)
    if what is None:
        first, nxt = (row.first, row.next) if view is None else view
        what = ends_problem(first, nxt, lo, hi)
        if what is None:
            return first, nxt
    raise damaged(where, stream, what)


def verify_tailer(where: str, stream: str, sid: int, name: str, position: Any, updated_ns: Any,
                  stored: Any, nxt: int | None) -> int:
    """Raise :func:`damaged` unless a tailer's row matches its checksum and its position
    is not beyond its stream's next index ``nxt``; returns the position."""
    what = tailer_problem(sid, name, position, updated_ns, stored, nxt)
    if what is not None:
        raise damaged(where, stream, what)
    return int(position)


# -- what a copy, an export or an import wrote, against what it read ---------------------------


@dataclass
class StreamDigest:
    """A summary of entries of one stream: how many, the first and last index, and the
    sum of their checksums (with the index, modulo 2**64).  ``stream copy``, ``stream
    export`` and ``stream import`` keep one of what they read and compare it with one of
    what they wrote before they say they are done."""

    count: int = 0
    first: int | None = None
    last: int | None = None
    total: int = 0

    def add(self, stream: str, idxs: Sequence[int], values: Sequence[bytes],
            metas: Sequence[bytes | None] | None = None) -> None:
        """Entries at ``idxs`` (in index order) with these values and metadata."""
        if not idxs:
            return
        sums = checksums(stream, values, metas)
        self.total = (self.total + sum(sums) + sum(idxs)) & 0xFFFFFFFFFFFFFFFF
        if self.first is None:
            self.first = idxs[0]
        self.last = idxs[-1]
        self.count += len(idxs)

    def __str__(self) -> str:
        if not self.count:
            return "no entries"
        return f"{plural(self.count, 'entry', 'entries')} ({_span(self.first or 0, (self.last or 0) + 1)})"

    def add_sums(self, first: int, count: int, total: int) -> None:
        """``count`` entries from index ``first`` on whose checksums (less the index) sum
        to ``total``."""
        if not count:
            return
        last = first + count - 1
        self.total = (self.total + total + (first + last) * count // 2) & 0xFFFFFFFFFFFFFFFF
        if self.first is None:
            self.first = first
        self.last = last
        self.count += count

    def differs(self, other: StreamDigest) -> str | None:
        """How ``other`` (what was written) differs from this (what was read), or None."""
        if (self.count, self.first, self.last) != (other.count, other.first, other.last):
            return f"{other} where {self} were read"
        if self.total != other.total:
            return f"entries whose checksums differ from those read ({other})"
        return None


def expected_range(first: int, nxt: int, start: int, end: int, limit: int,
                   descending: bool = False) -> range:
    """The indices a read must return (see the module docstring): of ``start <= i <
    end``, at most ``limit``, from the lowest -- or with ``descending`` (``end`` is then
    ``before``; ``start`` is ignored) from the highest down."""
    if descending:
        b = min(end, nxt)
        a = max(first, b - max(limit, 0))
        return range(b - 1, a - 1, -1) if b > a else range(0)
    a = max(start, first, 0)
    b = min(end, nxt)
    if b <= a or limit <= 0:
        return range(0)
    return range(a, min(b, a + limit))


def verify_indices(where: str, stream: str, first: int, nxt: int, start: int, end: int,
                   limit: int, idxs: Sequence[int], descending: bool = False) -> None:
    """Raise :func:`damaged` unless ``idxs`` (what a read returned) are exactly the
    indices the read must return."""
    want = expected_range(first, nxt, start, end, limit, descending)
    n = len(want)
    if len(idxs) == n and (n == 0 or (idxs[0] == want[0] and idxs[-1] == want[-1] and idxs == (
            tuple(want) if type(idxs) is tuple else list(want)))):
        return
    step = want.step
    hi = min(end, nxt)
    if descending:
        asked = f"the {limit} entries below index {hi}"
    else:
        asked = f"indices {max(start, 0)}..{hi - 1}" if hi > start else f"index {start} on"
    lo, hi = (want[-1], want[0] + 1) if descending and n else (want.start, want.stop)
    seen: set[int] = set()
    for k, i in enumerate(idxs):
        e = want[k] if k < n else None
        if type(i) is not int:
            raise damaged(where, stream, f"an entry's index is not an integer ({str(i)[:40]!r}), "
                          f"in a read of {asked}")
        if i == e:
            seen.add(i)
            continue
        if i in seen:
            what = f"entry {i} came twice in a read of {asked}"
        elif not first <= i < nxt:
            what = (f"entry {i} is outside the stream's indices "
                    f"({_span(first, nxt) if nxt > first else 'none'}), in a read of {asked}")
        elif e is None:
            what = f"entry {i} came after the last one a read of {asked} should return"
        elif (i - e) * step > 0:
            what = f"entry {e} missing from a read of {asked}"
        else:
            what = f"entry {i} out of order in a read of {asked}"
        raise damaged(where, stream, what)
    missing = want[len(idxs)]
    what = f"entry {missing} missing from a read of {asked}"
    if len(idxs) < n - 1:
        what += f" ({n - len(idxs)} of {_span(lo, hi)} not returned)"
    raise damaged(where, stream, what)


_noted: set[tuple[str, str]] = set()
_noted_lock = threading.Lock()


def _note_unsealed(where: str, stream: str) -> None:
    key = (where, stream)
    with _noted_lock:
        if key in _noted:
            return
        _noted.add(key)
    log.warning("stream %r in %s holds entries written before dataspace checksummed entries: "
                "they are read unverified (`dataspace stream info %s --check` counts them)",
                stream, where, stream)


def verify_checksums(where: str, stream: str, idxs: Sequence[int], values: Sequence[bytes],
                metas: Sequence[bytes | None] | None, stored: Sequence[int | None]) -> None:
    """Raise :func:`damaged` unless every entry's checksum (``stored``: the store's
    ``checksum`` less the index, modulo 2**32; None for an entry written before checksums)
    matches its stream, value and metadata."""
    got: Sequence[int | None]
    try:  # built as what came, a tuple (columns of zip) or a list, to compare in C
        got = tuple(_sums(stream, values, metas)) if type(stored) is tuple else checksums(
            stream, values, metas)
    except TypeError:
        got = _checksums_each(stream, values, metas)
    if got == stored:
        return
    legacy = False
    for i, c, s in zip(idxs, got, stored):
        if c is None:
            raise damaged(where, stream, f"entry {i} holds a value or metadata that is not "
                          "bytes")
        if c != s:
            if s is None:
                legacy = True
                continue
            raise damaged(where, stream, f"entry {i} does not match its checksum (its value, "
                          "metadata or index changed)")
    if legacy:
        _note_unsealed(where, stream)


def verify_get(where: str, stream: str, first: int, nxt: int, index: int,
               row: tuple[Any, ...] | None) -> None:
    """Raise :func:`damaged` if ``row`` (index first, or None: not found) is not what a
    look-up of ``index`` must find."""
    if row is None:
        if first <= index < nxt:
            raise damaged(where, stream, f"entry {index} missing (the stream holds "
                          f"{_span(first, nxt)})")
    elif row[0] != index or not first <= index < nxt:
        raise damaged(where, stream, f"entry {row[0]} answered a look-up of entry {index} "
                      f"(the stream holds {_span(first, nxt) if nxt > first else 'none'})")


def verify_at(where: str, stream: str, first: int, nxt: int, wanted: Sequence[int],
              got: Sequence[Any]) -> None:
    """Raise :func:`damaged` unless ``got`` (the indices a read of the entries at
    ``wanted``, in index order, returned) are exactly ``wanted`` (each within the stream's
    ``first <= i < nxt``)."""
    if list(got) == list(wanted):
        return
    missing = sorted(set(wanted) - {i for i in got if type(i) is int})
    if missing:
        raise damaged(where, stream, f"entry {missing[0]} missing (the stream holds "
                      f"{_span(first, nxt) if nxt > first else 'none'})")
    raise damaged(where, stream, f"a read of entries {wanted[0]}.. returned entries out of "
                  "place or twice")


def digest_of(where: str, stream: str, first: int, nxt: int, start: int, end: int,
              got: Sequence[Any]) -> StreamDigest | None:
    """The digest of ``start <= index < end`` from one aggregate over the stored rows --
    ``got`` = (count, lowest index, highest index, how many have a checksum, the sum of
    their checksums less the index) -- raising :func:`damaged` unless they are the indices
    a read must return; None if some entries carry no checksum (written before
    checksums: the caller reads their values instead)."""
    want = expected_range(first, nxt, start, end, MAX_INDEX)
    n, lo, hi, sealed, total = got
    if n != len(want) or (n and (lo != want[0] or hi != want[-1])):
        asked = _span(max(start, 0), min(end, nxt)) if min(end, nxt) > max(start, 0) else "none"
        raise damaged(where, stream, f"a read of {asked} found {plural(n, 'entry', 'entries')}"
                      + (f" ({_span(lo, hi + 1)})" if n else "")
                      + f" where the stream holds {_span(want[0], want[-1] + 1) if want else 'none'}")
    if sealed != n:
        return None
    out = StreamDigest()
    if n:
        out.add_sums(want[0], n, int(total))
    return out


# -- salvage: what is still good in a damaged stream ------------------------------------------


class Salvaged(NamedTuple):
    """An entry as stored (:meth:`~.base.Store.salvage`), with what is wrong with it:
    ``problem`` is None for an entry whose checksum matches its stream, index, value and
    metadata (or that was written before checksums), else why it is damaged."""

    index: Any
    seq: Any
    time_ns: Any
    data: Any
    meta: Any
    problem: str | None


def salvage_rows(stream: str, rows: Sequence[Sequence[Any]]) -> list[Salvaged]:
    """``rows`` -- ``(idx, seq, time_ns, value, meta, stored checksum less the index)`` as
    stored, in index order -- each with its verdict."""
    if not rows:
        return []
    idxs, seqs, times, values, metas, stored = zip(*rows)
    got = _checksums_each(stream, values, metas)
    out = []
    for k, (i, c, st) in enumerate(zip(idxs, got, stored)):
        if type(i) is not int:
            what: str | None = f"its index is not an integer ({str(i)[:40]!r})"
        elif c is None:
            what = "it holds a value or metadata that is not bytes"
        elif st is not None and c != st:
            what = "it does not match its checksum (its value, metadata or index changed)"
        else:
            what = None
        out.append(Salvaged(i, seqs[k], times[k], values[k], metas[k], what))
    return out


# -- the whole-store check (``dataspace stream info --check``) ---------------------------------


@dataclass
class StreamScan:
    """What :meth:`Store.check` found in one stream's entries."""

    stream: str
    first: int
    next: int
    entries: int = 0
    unsealed: int = 0
    bad: int = 0
    first_bad: int | None = None
    missing: int = 0
    first_missing: int | None = None
    extra: int = 0
    first_extra: int | None = None
    _at: int = 0

    def __post_init__(self) -> None:
        self._at = self.first

    def feed(self, idxs: Sequence[int], values: Sequence[bytes], metas: Sequence[bytes | None],
             stored: Sequence[int | None]) -> None:
        """The next rows in index order (``stored`` as :func:`verify_checksums` takes it)."""
        got = _checksums_each(self.stream, values, metas)
        for i, c, s in zip(idxs, got, stored):
            self.entries += 1
            if type(i) is not int:
                self.extra += 1
                continue
            if s is None:
                self.unsealed += 1
            elif s != c:
                self.bad += 1
                if self.first_bad is None:
                    self.first_bad = i
            if i < self._at or i >= self.next:
                self.extra += 1
                if self.first_extra is None:
                    self.first_extra = i
                continue
            if i > self._at:
                self.missing += i - self._at
                if self.first_missing is None:
                    self.first_missing = self._at
            self._at = i + 1

    def done(self) -> list[str]:
        """The problems found (after the last :meth:`feed`)."""
        if self._at < self.next:
            self.missing += self.next - self._at
            if self.first_missing is None:
                self.first_missing = self._at
        out = []
        s = repr(self.stream)
        if self.missing:
            total = self.next - self.first
            out.append(f"stream {s}: {self.missing:,} of its {plural(total, 'entry', 'entries')} "
                       f"{'is' if self.missing == 1 else 'are'} missing (the first: "
                       f"{self.first_missing})")
        if self.extra:
            where = (f"outside its {_span(self.first, self.next)}" if self.next > self.first
                     else "though it holds none")
            out.append(f"stream {s}: {plural(self.extra, 'entry', 'entries')} out of place: "
                       f"twice, or {where} (the first: {self.first_extra})")
        if self.bad:
            out.append(f"stream {s}: {plural(self.bad, 'entry', 'entries')} "
                       f"{'does' if self.bad == 1 else 'do'} not match "
                       f"{'its checksum' if self.bad == 1 else 'their checksums'} "
                       f"(the first: {self.first_bad})")
        return out


@dataclass
class CheckReport:
    """What :meth:`Store.check_report` found: the problems (none: sound) and how many
    entries it read and verified, of which ``unsealed`` carry no checksum (written before
    dataspace checksummed entries)."""

    problems: list[str] = field(default_factory=list)
    streams: int = 0
    entries: int = 0
    unsealed: int = 0
    tailers: int = 0
    groups: int = 0
    pending: int = 0

    def add(self, scan: StreamScan) -> None:
        self.streams += 1
        self.entries += scan.entries
        self.unsealed += scan.unsealed
        self.problems += scan.done()

    def add_row(self, row: StreamRow) -> None:
        """A stream's row: its checksum and indices (the entries are :meth:`add` ed)."""
        what = stream_row_problem(row)
        if what is not None:
            self.problems.append(f"stream {row.name!r}: {what}")

    def add_tailer(self, stream: str, sid: int, name: str, position: Any, updated_ns: Any,
                   stored: Any, nxt: int | None) -> None:
        """A tailer's row of ``stream`` (its next index ``nxt``)."""
        self.tailers += 1
        what = tailer_problem(sid, name, position, updated_ns, stored, nxt)
        if what is not None:
            self.problems.append(f"stream {stream!r}: {what}")

    def add_group(self, stream: str, row: GroupRow, nxt: int | None,
                  pending: Sequence[Sequence[Any]]) -> None:
        """A consumer group's row of ``stream`` (its next index ``nxt``) and its pending
        rows ``(idx, consumer, deliveries, delivered_ns, checksum)``."""
        self.groups += 1
        self.pending += len(pending)
        what = group_problem(row, nxt)
        if what is not None:
            self.problems.append(f"stream {stream!r}: {what}")
            return
        bad = [p for p in pending if pending_problem(row, *p) is not None]
        if bad:
            first = pending_problem(row, *bad[0])
            more = f" (and {plural(len(bad) - 1, 'more pending entry', 'more pending entries')})"
            self.problems.append(f"stream {stream!r}: {first}" + (more if len(bad) > 1 else ""))

    def summary(self) -> str:
        """``20,010 entries in 2 streams and 1 tailer read and verified``."""
        what = (f"{plural(self.entries, 'entry', 'entries')} in "
                f"{plural(self.streams, 'stream')}")
        if self.tailers or self.groups:
            parts = [plural(self.tailers, 'tailer')] if self.tailers else []
            if self.groups:
                parts.append(f"{plural(self.groups, 'consumer group')} "
                             f"({plural(self.pending, 'pending entry', 'pending entries')})")
            what += ", " + ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 \
                else " and " + parts[0]
        what += " read and verified"
        if self.unsealed:
            what += f" ({self.unsealed:,} written before checksums: indices only)"
        return what
