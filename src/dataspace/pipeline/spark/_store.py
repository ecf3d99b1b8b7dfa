"""Stores opened by Spark's Python workers, cached per process (workers are reused)."""

from __future__ import annotations

import os
import threading

from ...streams.sqlite import SQLiteStore

__all__ = ["db_path", "store_for"]

_lock = threading.Lock()
_stores: dict[str, tuple[int, SQLiteStore]] = {}


def db_path(path: str | os.PathLike[str]) -> str:
    """The store file for ``path`` (a data directory, the file itself, a ``file:`` URL:
    the rule of :func:`dataspace.datadir.store_file`); absolute, so that workers in
    another directory find it.  Nothing is created here."""
    from ...datadir import store_file

    return str(store_file(path, create=False).resolve())


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
