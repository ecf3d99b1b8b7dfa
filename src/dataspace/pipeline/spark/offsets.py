"""The connector's offsets: ``{"dataspace": {stream: {"start": i, "end": j}}}`` -- where a
micro-batch starts and ends in every stream it reads (stdlib only: used without Spark by
``pipeline status``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["KEY", "make_offset", "offset_ranges"]

KEY = "dataspace"


def make_offset(starts: Mapping[str, int], ends: Mapping[str, int]) -> dict[str, Any]:
    """The offset of a batch reading ``[starts[s], ends[s])`` of every stream ``s``."""
    return {KEY: {s: {"start": int(starts[s]), "end": int(ends[s])} for s in ends}}


def offset_ranges(off: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """``{stream: (start, end)}`` of one of our offsets (``ValueError`` if not ours)."""
    d = off.get(KEY) if isinstance(off, Mapping) else None
    if not isinstance(d, Mapping):
        raise ValueError(f"not a dataspace offset: {off!r}")
    try:
        return {s: (int(r["start"]), int(r["end"])) for s, r in d.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a dataspace offset: {off!r}") from e
