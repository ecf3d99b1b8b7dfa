"""Moving streams between stores (``dataspace stream copy SRC DST``): values, metadata,
indices, append times, retention settings and named tailers, from any store to any store
(SQLite to PostgreSQL and back).

Entries are copied in the source's commit order across all the streams copied (a k-way
merge by ``seq``), so ``alts`` processors see the same "which came first" after the move;
each destination transaction takes a batch of them.  Indices stay what they were (a
stream whose first entries retention removed keeps its gap), and every stream's next
index and tailers are set in the last transaction.

What is copied is what the source held when the copy started: stop the writers first
(servers recording into it, pipeline runs).  :class:`CopyResult` says how many entries
were appended to the source meanwhile (not copied).  A destination stream that already
holds entries or tailers is refused unless ``replace`` (it is then deleted first).

Reads of the source are verified as every read is (a damaged source stops the copy);
then what was written is verified against what was read before the copy says it is done:
each destination stream is read back (every entry verified) and must hold the same count,
first and last index and entry checksums as was read from the source -- which must be
what the source's bookkeeping said when the copy started -- with the same next index,
retention and tailer positions (:class:`CopyMismatch` otherwise).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .base import MAX_INDEX, Store, StoreCorrupt, StoreError, StreamInfo, StreamNotFound
from .integrity import StreamDigest, plural

__all__ = ["CopyMismatch", "CopyRefused", "CopyResult", "copy_streams", "plan_copy"]


class CopyRefused(StoreError):
    """The destination holds data the copy would overwrite (the message lists it)."""


class CopyMismatch(StoreError):
    """What the copy read is not what the source's bookkeeping said, or what it wrote is
    not what it read (the message says which stream and how)."""


@dataclass
class CopyResult:
    """What :func:`copy_streams` did."""

    streams: list[str] = field(default_factory=list)
    entries: int = 0
    tailers: int = 0
    replaced: list[str] = field(default_factory=list)
    appended_meanwhile: int = 0


def plan_copy(src: Store, names: list[str] | None = None) -> list[StreamInfo]:
    """The streams to copy: ``names`` (all of them must exist), else every stream of the
    source, the store's own (``__...``, processor backing streams) included -- moving a
    store moves its pipelines' state too."""
    infos = {s.name: s for s in src.streams(include_internal=True)}
    if names is None:
        return list(infos.values())
    missing = [n for n in names if n not in infos]
    if missing:
        raise StreamNotFound(
            f"no stream named {', '.join(repr(n) for n in missing)} in {src.display} "
            "(dataspace stream ls --all lists them)"
        )
    return [infos[n] for n in dict.fromkeys(names)]


def _rows(src: Store, s: StreamInfo, chunk: int,
          read: StreamDigest) -> Iterator[tuple[int, str, int, int, bytes, bytes | None]]:
    """``(seq, stream, index, time_ns, value, meta)`` of one stream, up to its next index
    when the copy started, read in chunks (and added to ``read``)."""
    pos = 0 if s.first is None else s.first
    while pos < s.next:
        c = src.read_columns(s.name, pos, s.next, values=True, meta=True, limit=chunk)
        if not c.indices:
            return
        read.add(s.name, c.indices, c.values, c.metas)
        yield from zip(c.seqs, [s.name] * len(c.indices), c.indices, c.times, c.values, c.metas)
        pos = c.indices[-1] + 1


def copy_streams(
    src: Store,
    dst: Store,
    names: list[str] | None = None,
    *,
    replace: bool = False,
    batch_rows: int = 5000,
    batch_bytes: int = 32 << 20,
    progress: Callable[[int, int], None] | None = None,
) -> CopyResult:
    """Copy streams from ``src`` to ``dst`` (see the module docstring).  ``progress(done,
    total)`` is called after each destination transaction (entries)."""
    lost = src.lost_tailers()
    if lost:  # (their streams would be copied without them, and nothing said)
        raise StoreCorrupt(
            f"{src.display} is damaged: {plural(lost, 'tailer')} of no stream (a tailer's row "
            "names a stream that is not there: changed behind the store's back); nothing was "
            "copied (`dataspace stream info STREAM --check` lists the damage; restore the "
            "store from a backup)")
    plan = plan_copy(src, names)
    result = CopyResult(streams=[s.name for s in plan])
    total = sum(s.count for s in plan)
    busy = []
    for s in plan:
        if dst.has_stream(s.name):
            d = dst.stream_info(s.name)
            if d.next > 0 or d.tailers:
                what = plural(d.count, "entry", "entries") if d.count else \
                    f"next index {d.next}"
                if d.tailers:
                    what += f", {plural(len(d.tailers), 'tailer')}"
                busy.append(f"{s.name} ({what})")
                result.replaced.append(s.name)
    if busy and not replace:
        raise CopyRefused(
            f"{dst.display} already has data in {', '.join(busy)}; give --replace to replace "
            "those streams, or --streams to copy others"
        )
    for name in result.replaced:
        dst.delete_stream(name)

    done = 0
    if progress is not None:
        progress(0, total)
    read = {s.name: StreamDigest() for s in plan}
    merged = heapq.merge(*(_rows(src, s, min(batch_rows, 1000), read[s.name]) for s in plan))
    pending: dict[str, list[tuple[int, int, bytes, bytes | None, int]]] = {}
    size = count = 0

    def flush() -> None:
        nonlocal size, count, done
        if not count:
            return
        with dst.transaction() as tx:
            for name, rows in pending.items():
                tx.copy_in(name, rows)
        done += count
        pending.clear()
        size = count = 0
        if progress is not None:
            progress(done, total)

    for _seq, name, idx, t, value, meta in merged:
        pending.setdefault(name, []).append((idx, t, value, meta, count))
        count += 1
        size += len(value) + (len(meta) if meta else 0) + 64
        if count >= batch_rows or size >= batch_bytes:
            flush()
    flush()
    result.entries = done

    # The streams themselves: next indices, retention, tailers (one transaction).
    with dst.transaction() as tx:
        for s in plan:
            tx.create_stream(s.name)
            tx.advance(s.name, min(s.next, MAX_INDEX))
            tx.set_retention(s.name, s.max_count, s.max_age)
            if s.tailers:
                tx.set_positions([(s.name, t.name, t.position) for t in s.tailers])
                result.tailers += len(s.tailers)
    now = src.next_indices()
    result.appended_meanwhile = sum(max(0, now.get(s.name, 0) - s.next) for s in plan)
    for s in plan:
        _verify(src, dst, s, read[s.name])
    return result


def _verify(src: Store, dst: Store, s: StreamInfo, read: StreamDigest) -> None:
    """What was read of ``s`` is what its bookkeeping said, and the destination holds
    what was read (every entry read back and verified), with the same next index,
    retention and tailers: else :class:`CopyMismatch`."""
    said = StreamDigest(s.count, s.first, None if s.first is None else s.next - 1)
    if (read.count, read.first, read.last) != (said.count, said.first, said.last):
        raise CopyMismatch(
            f"stream {s.name!r} of {src.display} held {said} when the copy started, but "
            f"{read} were read (written to or retention applied during the copy?); stop its "
            "writers and copy again with --replace")
    got = dst.digest(s.name, values=True)
    what = read.differs(got)
    d = dst.stream_info(s.name)
    if what is None and d.next != s.next:
        what = f"next index {d.next}, not {s.next}"
    if what is None and (d.max_count, d.max_age) != (s.max_count, s.max_age):
        what = "other retention settings"
    if what is None and [(t.name, t.position) for t in d.tailers] != [
            (t.name, t.position) for t in s.tailers]:
        what = "other tailers or tailer positions"
    if what is not None:
        raise CopyMismatch(
            f"{dst.display} does not hold what was read from {src.display}: stream "
            f"{s.name!r} there has {what}; copy again with --replace")
