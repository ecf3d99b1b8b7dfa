"""Shared by the commands that use a stream store (serve, stream, pipeline)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..datadir import STORE_HELP, mask_url, resolve_data_dir, store_location
from ..streams import Store, StoreNotFound, open_store

__all__ = ["CREATE_HINT", "add_store_argument", "no_store_message", "open_data_store",
           "spark_data_dir"]


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    """``--store URL`` (beside ``--data-dir``)."""
    parser.add_argument("--store", metavar="URL", help=STORE_HELP)


CREATE_HINT = "create one with `dataspace stream create NAME`"
"""How to make a store, in the error of a command that does not create one."""


def open_data_store(
    data_dir: str | os.PathLike[str] | None, *, create: bool, durability: str = "full",
    store: str | None = None, create_hint: str = CREATE_HINT,
) -> Store:
    """The stream store a command uses: ``store`` (``--store URL``, or the configuration
    file's ``store``) when given, else the data directory's ``streams.sqlite3``.

    Only commands that write streams (``stream append``, ``create``, ``import``,
    ``serve --record``) pass ``create=True``; a command that reads or processes a store
    does not make one where a mistyped ``--data-dir`` points: it fails with
    :func:`no_store_message` (``create_hint`` says how to make one instead).

    Raises :class:`~dataspace.streams.StoreError`, ``OSError`` or ``ValueError`` whose
    message is the one line to show the user (the file is damaged, foreign, a directory,
    missing; the server is down, the password wrong; the URL is not a store's ...): every
    command reports it as ``dataspace COMMAND: MESSAGE``.  No message holds a password.
    """
    try:
        if store:
            return open_store(store, create=create, durability=durability)
        d = resolve_data_dir(data_dir, create=create)
        return open_store(d, create=create, durability=durability)
    except StoreNotFound:
        raise StoreNotFound(no_store_message(data_dir, store, create_hint)) from None


def no_store_message(data_dir: str | os.PathLike[str] | None, store: str | None,
                     create_hint: str = CREATE_HINT) -> str:
    """The one line for "there is no store there": where was looked, why nothing is
    there, which setting named it, and how to make one."""
    if store:
        loc = store_location(store, create=False)
        if loc.path is None:
            return (f"no stream store in {mask_url(store)} (the database holds no stream "
                    f"store); check --store, or {create_hint}")
        why = ("the file does not exist" if loc.path.parent.is_dir()
               else "the directory does not exist")
        return f"no stream store at {loc.path} ({why}); check --store, or {create_hint}"
    d = resolve_data_dir(data_dir, create=False).absolute()
    why = ("the data directory does not exist" if not d.exists()
           else "the data directory holds no store")
    setting = ("check --data-dir" if data_dir else "check $DATASPACE_DATA_DIR"
               if os.environ.get("DATASPACE_DATA_DIR") else "give --data-dir or --store")
    return f"no stream store at {d} ({why}); {setting}, or {create_hint}"


def spark_data_dir(store: Store, data_dir: str | os.PathLike[str] | None, *,
                   create: bool = True) -> Path:
    """Where the Spark engine keeps a graph's checkpoints and logs: beside an SQLite store,
    in the data directory (``--data-dir``) for a PostgreSQL one."""
    path = getattr(store, "path", None)
    if path is not None:
        return Path(path).resolve().parent
    return resolve_data_dir(data_dir, create=create)
