"""Shared by the commands that use a stream store (serve, stream, pipeline)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..datadir import STORE_HELP, resolve_data_dir
from ..streams import Store, open_store

__all__ = ["add_store_argument", "open_data_store", "spark_data_dir"]


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    """``--store URL`` (beside ``--data-dir``)."""
    parser.add_argument("--store", metavar="URL", help=STORE_HELP)


def open_data_store(
    data_dir: str | os.PathLike[str] | None, *, create: bool, durability: str = "full",
    store: str | None = None,
) -> Store:
    """The stream store a command uses: ``store`` (``--store URL``, or the configuration
    file's ``store``) when given, else the data directory's ``streams.sqlite3``.

    Raises :class:`~dataspace.streams.StoreError`, ``OSError`` or ``ValueError`` whose
    message is the one line to show the user (the file is damaged, foreign, a directory,
    missing; the server is down, the password wrong; the URL is not a store's ...): every
    command reports it as ``dataspace COMMAND: MESSAGE``.  No message holds a password.
    """
    if store:
        return open_store(store, create=create, durability=durability)
    d = resolve_data_dir(data_dir, create=create)
    return open_store(d, create=create, durability=durability)


def spark_data_dir(store: Store, data_dir: str | os.PathLike[str] | None, *,
                   create: bool = True) -> Path:
    """Where the Spark engine keeps a graph's checkpoints and logs: beside an SQLite store,
    in the data directory (``--data-dir``) for a PostgreSQL one."""
    path = getattr(store, "path", None)
    if path is not None:
        return Path(path).resolve().parent
    return resolve_data_dir(data_dir, create=create)
