"""Stores opened by Spark's processes (driver and Python workers), cached per process
(workers are reused), and the connector's store options.

The source and the sink name their store with ``.option("store", URL)`` -- a data
directory, a ``.sqlite3`` file, ``sqlite:PATH`` or ``postgresql://...``, the rule of
:func:`dataspace.datadir.store_location` -- or, as before, ``.option("path", DIR)`` for an
SQLite store.  A PostgreSQL password may come separately as ``storePassword`` (an option
name Spark redacts in plans and logs); the engine passes it that way.
"""

from __future__ import annotations

import os
import threading
import urllib.parse
from collections.abc import Mapping
from typing import Any

from ...streams.base import Store

__all__ = ["db_path", "location_option", "split_password", "store_for", "store_options", "store_url"]

_lock = threading.Lock()
_stores: dict[str, tuple[int, Store]] = {}


def store_url(location: str | os.PathLike[str]) -> str:
    """The URL every process opens for ``location``: an SQLite store's file (absolute, so
    that workers in another directory find it) or the PostgreSQL URL.  Nothing is
    created here."""
    from ...datadir import store_location

    loc = store_location(location, create=False)
    if loc.path is not None:
        return str(loc.path.resolve())
    return loc.url


db_path = store_url
"""The former name of :func:`store_url` (SQLite stores only had a path)."""


def split_password(url: str) -> tuple[str, str | None]:
    """A PostgreSQL URL without its password (from ``user:PASSWORD@`` or a ``password=``
    parameter), and the password; other locations unchanged."""
    if not url.lower().startswith(("postgresql://", "postgres://")):
        return url, None
    u = urllib.parse.urlsplit(url)
    password = None
    netloc = u.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            user, pw = userinfo.split(":", 1)
            password = urllib.parse.unquote(pw)
            netloc = f"{user}@{host}"
    query = urllib.parse.parse_qsl(u.query, keep_blank_values=True)
    rest = []
    for k, v in query:
        if k == "password":
            password = v
        else:
            rest.append((k, v))
    return urllib.parse.urlunsplit((u.scheme, netloc, u.path, urllib.parse.urlencode(rest),
                                    u.fragment)), password


def _join_password(url: str, password: str) -> str:
    u = urllib.parse.urlsplit(url)
    query = [*urllib.parse.parse_qsl(u.query, keep_blank_values=True), ("password", password)]
    return urllib.parse.urlunsplit((u.scheme, u.netloc, u.path, urllib.parse.urlencode(query),
                                    u.fragment))


def store_options(url: str) -> dict[str, str]:
    """The connector options naming the store at ``url``: ``store``, plus
    ``storePassword`` when the URL has a password (kept out of ``store``)."""
    bare, password = split_password(url)
    return {"store": bare} if password is None else {"store": bare, "storePassword": password}


def location_option(opts: Mapping[str, str], what: str) -> str | None:
    """The store URL an option map names (``store``, else ``path``; ``storePassword``
    joined in), or None if it names none.  ``ValueError`` for a bad or doubly given one."""
    store = opts.get("store")
    path = opts.get("path")
    if store and path and store_url(store) != store_url(path):
        raise ValueError(f"{what}: give the store once, as .option('store', URL) (path is its "
                         "older name for SQLite stores)")
    given = store or path
    if not given:
        return None
    url = store_url(given)
    password = opts.get("storePassword")
    if password and url.lower().startswith(("postgresql://", "postgres://")):
        url = _join_password(url, password)
    return url


def store_for(location: str | os.PathLike[str], *, create: bool = False) -> Store:
    """This process's store at ``location`` (opened once; reopened after a fork)."""
    from ...streams.open import open_store

    key = store_url(location)
    pid = os.getpid()
    with _lock:
        got = _stores.get(key)
        if got is not None and got[0] == pid and not getattr(got[1], "_closed", False):
            return got[1]
        store = open_store(key, create=create)
        _stores[key] = (pid, store)
        return store


def is_postgres(url: Any) -> bool:
    """Whether a store URL names a PostgreSQL store."""
    return str(url).lower().startswith(("postgresql://", "postgres://"))
