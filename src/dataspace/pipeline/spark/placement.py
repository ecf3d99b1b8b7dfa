"""Where a Spark session's work can run: in this machine's JVM (``local`` masters) or on
executors elsewhere, and so where the connector reads a store (stdlib only: the source,
the session and the engine all ask, without importing each other).
"""

from __future__ import annotations

from ._store import is_postgres

__all__ = ["is_local", "read_on"]


def is_local(master: str) -> bool:
    """Whether ``master`` runs everything in this machine's JVM (``local``, ``local[N]``)."""
    return master == "local" or master.startswith("local[") or master.startswith("local-cluster")


def read_on(master: str, store_url: str) -> str:
    """Where the connector reads a store for a session on ``master``: ``executor`` in
    local mode or with a PostgreSQL store (every machine reaches the server), else
    ``driver`` (an SQLite store is a file only the driver's machine has)."""
    return "executor" if is_local(master) or is_postgres(store_url) else "driver"
