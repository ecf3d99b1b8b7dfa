"""Shared by the commands that use the embedded stream store (serve, stream, pipeline)."""

from __future__ import annotations

import os

from ..datadir import STREAMS_DB, resolve_data_dir
from ..streams import SQLiteStore


def open_data_store(
    data_dir: str | os.PathLike[str] | None, *, create: bool, durability: str = "full"
) -> SQLiteStore:
    """The stream store of a data directory (``<data-dir>/streams.sqlite3``).

    Raises :class:`~dataspace.streams.StoreError` or ``OSError`` whose message is the
    one line to show the user (the file is damaged, foreign, a directory, missing ...):
    every command reports it as ``dataspace COMMAND: MESSAGE``.
    """
    d = resolve_data_dir(data_dir, create=create)
    # The file path, not the directory: open_store(DIR) would look inside a directory
    # that sits where the file should be, and report the wrong path.
    return SQLiteStore(d / STREAMS_DB, create=create, durability=durability)
