"""Shared by the commands that use the embedded stream store (serve, stream, pipeline)."""

from __future__ import annotations

import os

from ..datadir import resolve_data_dir
from ..streams import SQLiteStore, open_store


def open_data_store(
    data_dir: str | os.PathLike[str] | None, *, create: bool, durability: str = "full"
) -> SQLiteStore:
    """The stream store of a data directory (``<data-dir>/streams.sqlite3``).

    Raises :class:`~dataspace.streams.StoreError` or ``OSError`` whose message is the
    one line to show the user (the file is damaged, foreign, a directory, missing ...):
    every command reports it as ``dataspace COMMAND: MESSAGE``.
    """
    d = resolve_data_dir(data_dir, create=create)
    return open_store(d, create=create, durability=durability)
