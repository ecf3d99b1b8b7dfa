"""Stores opened by Spark's Python workers, cached per process (workers are reused)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ...streams.sqlite import SQLiteStore

__all__ = ["db_path", "store_for"]

_lock = threading.Lock()
_stores: dict[str, tuple[int, SQLiteStore]] = {}


def db_path(path: str | os.PathLike[str]) -> str:
    """The store file for ``path``: a data directory (``streams.sqlite3`` in it) or the
    file itself; absolute, so that workers in another directory find it."""
    from ...datadir import STREAMS_DB

    p = Path(str(path).removeprefix("file:")).expanduser()
    if p.is_dir() or (not p.exists() and p.suffix != ".sqlite3"):
        p = p / STREAMS_DB
    return str(p.resolve())


def store_for(path: str | os.PathLike[str], *, create: bool = False) -> SQLiteStore:
    """This process's store at ``path`` (opened once; reopened after a fork)."""
    key = db_path(path)
    pid = os.getpid()
    with _lock:
        got = _stores.get(key)
        if got is not None and got[0] == pid and not got[1]._closed:
            return got[1]
        store = SQLiteStore(key, create=create)
        _stores[key] = (pid, store)
        return store
