"""Helpers for the tests that run on both stores."""

from __future__ import annotations


def wait_lock_free(store_url: str, name: str, timeout: float = 30.0) -> None:
    """Block (bounded) until the store lock ``name`` of a holder that died is free.
    SQLite: the kernel released the flock when the holder died, nothing to wait for.
    PostgreSQL: the server ends the dead client's session on its own, moments later; wait
    for that with a blocking advisory lock under a lock_timeout (no polling)."""
    if not store_url.startswith("postgresql:"):
        return
    import psycopg

    from dataspace.streams.postgres import _lock_key

    with psycopg.connect(store_url, autocommit=True) as c:
        c.execute(f"SET lock_timeout = '{int(timeout * 1000)}ms'")
        c.execute("SELECT pg_advisory_lock(%s)", (_lock_key(name),))
        c.execute("SELECT pg_advisory_unlock(%s)", (_lock_key(name),))
