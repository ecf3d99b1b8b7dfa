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

What it costs: see docs/streams.md (the exactly-once benchmark before and after).
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import pairwise, repeat
from typing import Any

from .errors import MAX_INDEX, StoreCorrupt, StoreError

__all__ = [
    "CHECKSUM_MASK",
    "CheckReport",
    "StreamScan",
    "check_advance",
    "check_copy_in",
    "checksums",
    "damaged",
    "expected_range",
    "staged_checksums",
    "stream_seed",
    "verify_checksums",
    "verify_get",
    "verify_indices",
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
    return StoreCorrupt(
        f"stream {stream!r} in {where} is damaged: {what} (run `dataspace stream info "
        f"{stream} --check`; restore the store from a backup)"
    )


def _span(a: int, b: int) -> str:
    return f"index {a}" if b == a + 1 else f"indices {a}..{b - 1}"


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
            out.append(f"stream {s}: {self.missing} of its {self.next - self.first} entries "
                       f"missing (the first: {self.first_missing})")
        if self.extra:
            out.append(f"stream {s}: {self.extra} entries out of place: twice, or outside its "
                       f"indices {_span(self.first, self.next) if self.next > self.first else '(none)'} "
                       f"(the first: {self.first_extra})")
        if self.bad:
            out.append(f"stream {s}: {self.bad} entries do not match their checksums "
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

    def add(self, scan: StreamScan) -> None:
        self.streams += 1
        self.entries += scan.entries
        self.unsealed += scan.unsealed
        self.problems += scan.done()
