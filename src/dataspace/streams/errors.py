"""The stores' errors and limits: what :mod:`.base` (the interface) and
:mod:`.integrity` (verified reads) share, below both of them so that neither imports
the other's module for them.  :mod:`.base` re-exports every name."""

from __future__ import annotations

__all__ = [
    "MAX_INDEX",
    "MAX_VALUE_SIZE",
    "ForeignStore",
    "LockHeld",
    "StoreCorrupt",
    "StoreError",
    "StoreNotFound",
    "StreamNotFound",
]

MAX_INDEX = (1 << 63) - 1
"""Indices are signed 64-bit integers (SQLite's INTEGER), so at most this."""

MAX_VALUE_SIZE = 16 * 1024 * 1024
"""Largest encoded value (or metadata) one entry may hold, in bytes."""


class StoreError(Exception):
    """Base class of stream store errors (the message says what to do next)."""


class StoreCorrupt(StoreError):
    """The store file is damaged or is not a store at all -- also raised by a read that
    did not get what it asked for (see :mod:`.integrity`): nothing of it is returned.

    Raised for one damaged stream (:func:`.integrity.damaged`), it names it in
    ``stream`` and says what is wrong, in a few words, in ``reason``; both are None when
    the damage is the store's as a whole."""

    stream: str | None = None
    reason: str | None = None


class ForeignStore(StoreError):
    """The file or database is not a dataspace stream store (another application's, or
    written by a newer version)."""


class StoreNotFound(StoreError):
    """There is no store where one was to be opened without creating it."""


class LockHeld(StoreError):
    """A :meth:`Store.lock` is held by another process (``holder`` says which)."""

    def __init__(self, name: str, holder: str) -> None:
        super().__init__(f"the lock {name!r} is held by {holder}")
        self.name = name
        self.holder = holder


class StreamNotFound(StoreError, KeyError):
    """No stream of that name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "stream not found"


# Their public home is :mod:`.base` (documented there, re-exported from it): tracebacks and
# pickles (a Spark task's error crossing to the driver) name them by it, as before they
# moved here -- the Spark engine recognises a worker's ``dataspace.streams.base.StoreCorrupt``.
for _cls in (ForeignStore, LockHeld, StoreCorrupt, StoreError, StoreNotFound, StreamNotFound):
    _cls.__module__ = "dataspace.streams.base"
del _cls
