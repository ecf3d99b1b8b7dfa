"""Getting out what is still good of a damaged stream (``stream tail``, ``stream read``,
``stream export --skip-damaged``).

Reads are verified (:mod:`.integrity`): a read that meets damage raises
:class:`~.errors.StoreCorrupt` and returns nothing.  That is right for everything that
goes on working with what it read (engines, copies, a plain export), but a user
recovering a damaged store wants the rest: :func:`entries` reads a range as every read
does and, where a read is refused, goes on through :meth:`~.base.Store.salvage` -- the
entries as stored, each checked on its own -- handing out the intact ones and telling
``on_damage`` one line for the refused read, each damaged entry and each run of missing
indices.  A damaged entry is never handed out: an entry is intact when its checksum
(which covers its stream, index, value and metadata) matches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .base import Store
from .entry import Entry
from .errors import MAX_INDEX, StoreCorrupt
from .integrity import Salvaged

__all__ = ["as_stored", "entries", "last_entries"]

Tell = Callable[[str], None]


def entries(store: Store, name: str, start: int, end: int = MAX_INDEX, *, chunk: int = 1000,
            on_damage: Tell) -> Iterator[Entry]:
    """The entries of ``name`` with ``start <= index < end``: verified reads, then -- from
    the first read refused -- the intact entries as stored (see the module docstring)."""
    pos = start
    while pos < end:
        try:
            batch = store.read(name, pos, chunk, end)
        except StoreCorrupt as e:
            on_damage(str(e))
            yield from as_stored(store, name, pos, end, chunk=chunk, on_damage=on_damage)
            return
        if not batch:
            return
        yield from batch
        pos = batch[-1].index + 1


def last_entries(store: Store, name: str, n: int, *, on_damage: Tell) -> list[Entry]:
    """The intact entries among the last ``n`` stored (for a stream whose bookkeeping is
    damaged, so that its end is not known but from what is stored), oldest first."""
    try:
        rows = store.salvage(name, 0, MAX_INDEX, n, descending=True)
    except StoreCorrupt as e:
        on_damage(str(e))
        return []
    rows.reverse()
    return list(_judge(name, rows, None, on_damage))


def as_stored(store: Store, name: str, pos: int, end: int = MAX_INDEX, *, chunk: int = 1000,
              on_damage: Tell) -> Iterator[Entry]:
    """The intact entries of ``pos <= index < end`` as stored, without a verified read
    first (the caller's was refused and said so); damage told to ``on_damage``."""
    expect: int | None = None
    while pos < end:
        try:
            rows = store.salvage(name, pos, end, chunk)
        except StoreCorrupt as e:  # the database itself refuses to read on
            on_damage(str(e))
            return
        if not rows:
            return
        yield from _judge(name, rows, expect, on_damage)
        last = rows[-1].index
        if type(last) is not int:
            on_damage(f"stream {name!r}: an entry's index is damaged; nothing after index "
                      f"{pos - 1} can be read")
            return
        expect = pos = last + 1


def _judge(name: str, rows: list[Salvaged], expect: int | None, on_damage: Tell) -> Iterator[Entry]:
    for r in rows:
        if type(r.index) is not int:
            on_damage(f"stream {name!r}: an entry after index {expect} is damaged: {r.problem}; "
                      "left out")
            continue
        if expect is not None and r.index > expect:
            gap = (f"entry {expect} is" if r.index == expect + 1
                   else f"entries {expect}..{r.index - 1} are")
            on_damage(f"stream {name!r}: {gap} missing")
        if r.problem is not None:
            on_damage(f"stream {name!r}: entry {r.index} is damaged: {r.problem}; left out")
        else:
            yield Entry(name, r.index, r.data, r.meta, r.time_ns, r.seq)
        expect = r.index + 1
