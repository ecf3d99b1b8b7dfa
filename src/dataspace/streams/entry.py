"""The store's entries and the names of its streams and tailers: what every store
module and the tailers share, below :mod:`.base` (which re-exports it) and
:mod:`.tailer`."""

from __future__ import annotations

import re
from typing import Any

from ..values import Value, decode

__all__ = ["Entry", "check_name", "check_stream_name", "check_tailer_name"]

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+/-]{0,199}")


def check_name(name: str, what: str = "stream") -> str:
    """``name`` if it is a valid name of a ``what`` (stream, tailer, graph, processor:
    one rule for all), else ``ValueError`` saying why.

    Names are 1-200 characters: letters, digits and ``_ . : @ + / -``, not starting with
    punctuation other than ``_``.  Names starting with ``__`` are the store's own
    (hidden by ``stream ls``; users may not create them: :func:`.base.check_user_name`).
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid {what} name {name!r}: use 1-200 letters, digits or _ . : @ + / - "
            "(starting with a letter, digit or _)"
        )
    return name


def check_stream_name(name: str) -> str:
    """``name`` if it is a valid stream name (:func:`check_name`), else ``ValueError``."""
    return check_name(name, "stream")


def check_tailer_name(name: str) -> str:
    """``name`` if it is a valid tailer name (:func:`check_name`), else ``ValueError``."""
    return check_name(name, "tailer")


class Entry:
    """One entry of a stream: index, append time, value and metadata.

    ``data`` and ``meta_data`` are the canonical encodings as stored; ``value`` and
    ``meta`` decode them on first use.
    """

    __slots__ = ("_meta", "_value", "data", "index", "meta_data", "seq", "stream", "time_ns")

    def __init__(
        self,
        stream: str,
        index: int,
        data: bytes,
        meta_data: bytes | None = None,
        time_ns: int = 0,
        seq: int = 0,
    ) -> None:
        self.stream = stream
        self.index = index
        self.data = data
        self.meta_data = meta_data
        self.time_ns = time_ns
        self.seq = seq
        self._value: Any = _UNSET
        self._meta: Any = _UNSET

    @property
    def value(self) -> Value:
        """The entry's value (decoded once)."""
        v = self._value
        if v is _UNSET:
            v = self._value = decode(self.data)
        return v

    @property
    def meta(self) -> Value | None:
        """The entry's metadata value, or None."""
        m = self._meta
        if m is _UNSET:
            m = self._meta = None if self.meta_data is None else decode(self.meta_data)
        return m

    @property
    def time(self) -> float:
        """Append time in seconds since the epoch."""
        return self.time_ns / 1e9

    def __repr__(self) -> str:
        return f"Entry({self.stream!r}, {self.index}, {self.data!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Entry)
            and (self.stream, self.index, self.data, self.meta_data)
            == (other.stream, other.index, other.data, other.meta_data)
        )

    __hash__ = None  # type: ignore[assignment]


_UNSET: Any = object()
