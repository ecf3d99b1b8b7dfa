"""Tailers: readers of a stream that remember where they are.

>>> # t = store.tailer("chat", "bot")          # resumes where "bot" stopped
>>> # for entry in t.follow(): ...             # blocks (wake-ups, no polling)
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Protocol

from .entry import Entry, check_stream_name, check_tailer_name

__all__ = ["Tailer", "TailerStore"]


class TailerStore(Protocol):
    """What a tailer needs of its store (:class:`.base.Store` has it all)."""

    def first_index(self, name: str) -> int | None: ...
    def next_index(self, name: str) -> int: ...
    def read(self, name: str, start: int = 0, limit: int = 1000, end: int | None = None) -> list[Entry]: ...
    def position(self, stream: str, tailer: str) -> int | None: ...
    def set_position(self, stream: str, tailer: str, position: int) -> None: ...
    def wait_for(self, name: str, index: int, timeout: float | None = None) -> bool: ...
    async def wait_for_async(self, name: str, index: int, timeout: float | None = None) -> bool: ...

log = logging.getLogger(__name__)


class Tailer:
    """Reads ``stream`` from a position, advancing it; named tailers persist it.

    ``start`` is used when a named tailer has no persisted position yet (or for an
    anonymous tailer): ``"earliest"`` (the first stored entry), ``"latest"`` (the next
    entry to be appended) or an index.  A named tailer saves the resolved start at once,
    so entries appended before its first read are not skipped after a restart.

    With ``auto_commit`` (the default) a named tailer persists its position after every
    read (a reader that crashes after a read does not see those entries again); without
    it, call :meth:`commit` after handling them (the reader then sees them again after a
    crash: at-least-once).  If retention removed entries the tailer had not read yet,
    reading skips to the first stored entry and logs a warning.
    """

    def __init__(
        self,
        store: TailerStore,
        stream: str,
        name: str | None = None,
        *,
        start: int | str = "earliest",
        auto_commit: bool = True,
    ) -> None:
        check_stream_name(stream)
        if name is not None:
            check_tailer_name(name)
        self.store = store
        self.stream = stream
        self.name = name
        self.auto_commit = auto_commit
        pos = store.position(stream, name) if name is not None else None
        if pos is None:
            pos = self._resolve(start)
            if name is not None:
                store.set_position(stream, name, pos)
        self.position = pos
        self._saved = pos

    def _resolve(self, start: int | str) -> int:
        if isinstance(start, int) and not isinstance(start, bool):
            if start < 0:
                raise ValueError("a start index cannot be negative")
            return start
        if start == "latest":
            return self.store.next_index(self.stream)
        if start == "earliest":
            first = self.store.first_index(self.stream)
            return first if first is not None else self.store.next_index(self.stream)
        raise ValueError(f"start must be 'earliest', 'latest' or an index, not {start!r}")

    @property
    def lag(self) -> int:
        """How many entries are appended but not read yet."""
        return max(0, self.store.next_index(self.stream) - self.position)

    def seek(self, index: int) -> None:
        """Continue reading at ``index`` (persisted by the next commit)."""
        if index < 0:
            raise ValueError("index cannot be negative")
        self.position = index

    def read(self, limit: int = 1000) -> list[Entry]:
        """Up to ``limit`` entries available now (possibly none); never blocks."""
        entries = self.store.read(self.stream, self.position, limit)
        if entries:
            if entries[0].index > self.position:
                log.warning(
                    "tailer %s of %s: entries %d..%d were removed by retention before being "
                    "read", self.name or "(anonymous)", self.stream, self.position,
                    entries[0].index - 1,
                )
            self.position = entries[-1].index + 1
            if self.auto_commit:
                self.commit()
        return entries

    def commit(self) -> None:
        """Persist the position (named tailers only; a no-op when unchanged)."""
        if self.name is not None and self.position != self._saved:
            self.store.set_position(self.stream, self.name, self.position)
            self._saved = self.position

    def poll(self, timeout: float | None = None, limit: int = 1000) -> list[Entry]:
        """Entries available now or, if none, as soon as some are appended (by any
        process); an empty list after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            entries = self.read(limit)
            if entries:
                return entries
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return []
            if not self.store.wait_for(self.stream, self.position, remaining):
                return []

    async def poll_async(self, timeout: float | None = None, limit: int = 1000) -> list[Entry]:
        """:meth:`poll` for asyncio."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            entries = self.read(limit)
            if entries:
                return entries
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return []
            if not await self.store.wait_for_async(self.stream, self.position, remaining):
                return []

    def next(self, timeout: float | None = None) -> Entry | None:
        """The next entry, waiting up to ``timeout`` seconds (None: no limit)."""
        entries = self.poll(timeout, 1)
        return entries[0] if entries else None

    def follow(self, idle_timeout: float | None = None) -> Iterator[Entry]:
        """Every entry from the position on, waiting for new ones; ends after
        ``idle_timeout`` seconds without any (None: never)."""
        while True:
            entries = self.poll(idle_timeout)
            if not entries:
                return
            yield from entries

    async def follow_async(self, idle_timeout: float | None = None) -> AsyncIterator[Entry]:
        """:meth:`follow` for asyncio."""
        while True:
            entries = await self.poll_async(idle_timeout)
            if not entries:
                return
            for e in entries:
                yield e

    def __repr__(self) -> str:
        return f"<Tailer {self.name or '(anonymous)'} of {self.stream} at {self.position}>"
