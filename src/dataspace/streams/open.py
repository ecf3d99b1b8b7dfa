"""Opening a store by location: the one place that picks the backend.

>>> # open_store("/var/lib/app")                        # SQLite: DIR/streams.sqlite3
>>> # open_store("sqlite:/var/lib/app/streams.sqlite3")  # the same file
>>> # open_store("postgresql://app:PW@db.example/app")  # PostgreSQL
"""

from __future__ import annotations

import os
from typing import Any

from .._extras import require
from ..datadir import StoreLocation, store_location
from .base import Store

__all__ = ["open_location", "open_store"]


def open_store(
    location: str | os.PathLike[str], *, create: bool = True, durability: str = "full",
    **options: Any,
) -> Store:
    """Open (creating it if asked) the store at ``location``, the rule of
    :func:`dataspace.datadir.store_location`: a data directory (its ``streams.sqlite3``;
    a directory that does not exist is created), a ``.sqlite3`` file, ``sqlite:PATH``, or
    a ``postgresql://USER:PASSWORD@HOST:PORT/DATABASE`` URL.  Any other URL is a
    ``ValueError``.  ``durability`` is ``"full"`` (every commit survives power loss) or
    ``"normal"`` (commits survive process crashes); ``options`` go to the backend
    (``busy_timeout``; PostgreSQL also ``connect_timeout``, ``pool_size``)."""
    return open_location(store_location(location, create=create), create=create,
                         durability=durability, **options)


def open_location(loc: StoreLocation, *, create: bool = True, durability: str = "full",
                  **options: Any) -> Store:
    """:func:`open_store` of a location already resolved."""
    if loc.kind == "postgresql":
        require("postgres", "a PostgreSQL store")  # psycopg: the postgres extra
        from .postgres import PostgresStore

        return PostgresStore(loc.url, create=create, durability=durability, **options)
    from .sqlite import SQLiteStore

    assert loc.path is not None
    return SQLiteStore(loc.path, create=create, durability=durability, **options)
