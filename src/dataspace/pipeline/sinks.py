"""Side-effecting sinks made exactly-once with the delivery hash: the pattern, and one
real example writing to an SQLite table.

The engine delivers a sink's input *at least once*: after a crash between the side effect
and the engine's commit, the step runs again -- with the same messages and the same
delivery hash (the step's snapshot, with its extent, is durable before the function
runs).  So a sink is exactly-once when it records the delivery hash *in the same
transaction* as its effect and skips a step whose hash it has already recorded::

    BEGIN
      SELECT 1 FROM deliveries WHERE hash = :hash      -- seen?  then do nothing
      INSERT INTO results ...                           -- the effect
      INSERT INTO deliveries (hash, ...)                -- and the proof, atomically
    COMMIT

:class:`SQLiteSink` does exactly this for a batch sink (``graph.sink(..., batch=True)``,
one call per step).  For a per-message sink (``fn(value, delivery)``) use
``delivery.key`` (``hash:seq``, unique per message set) as a UNIQUE column and
``INSERT ... ON CONFLICT DO NOTHING``.  The same works for any store with transactions
(PostgreSQL, Redis MULTI with a SET NX of the hash, ...); without transactions, a
single-writer design keyed by the hash is needed.
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..values import Value, encode, stringify
from .graph import Delivery

__all__ = ["SQLiteSink"]

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def _ident(name: str, what: str) -> str:
    if not _IDENT.fullmatch(name):
        raise ValueError(f"{what} {name!r}: use letters, digits and _ (an SQL identifier)")
    return name


def _default_row(v: Value) -> tuple[Any, ...]:
    return (stringify(v), encode(v))


class SQLiteSink:
    """A batch sink writing one row per message to ``table`` in the SQLite file ``path``,
    exactly once per delivery (see the module docstring).

    ``columns`` are the table's columns as ``"name TYPE"`` (created if the table is
    missing) and ``to_row(value)`` makes a row of them; by default a message becomes
    ``(text, value)``: its Preserves text and canonical binary.  The delivery hashes go
    to ``deliveries_table`` (processor id, hash, row count, time).

    >>> # graph.sink("archive", "results", SQLiteSink("out.db", "results"), batch=True)
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        table: str,
        columns: Sequence[str] = ("text TEXT", "value BLOB"),
        to_row: Callable[[Value], Sequence[Any]] = _default_row,
        *,
        deliveries_table: str = "dataspace_deliveries",
    ) -> None:
        self.path = os.fspath(path)
        self.table = _ident(table, "table")
        self.deliveries = _ident(deliveries_table, "deliveries table")
        self.columns = [c.strip() for c in columns]
        names = []
        for c in self.columns:
            name = c.split()[0] if c.split() else ""
            names.append(_ident(name, "column"))
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\s+[A-Za-z][A-Za-z0-9_ ()]*)?", c):
                raise ValueError(f"column {c!r}: expected 'name TYPE'")
        self.names = names
        self.to_row = to_row
        self.skipped = 0
        self.written = 0
        self._local = threading.local()

    def _conn(self) -> sqlite3.Connection:
        c = getattr(self._local, "conn", None)
        if c is None:
            c = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
            c.execute("PRAGMA journal_mode = WAL")
            c.execute("PRAGMA synchronous = FULL")
            c.execute(f"CREATE TABLE IF NOT EXISTS {self.table} ({', '.join(self.columns)})")
            c.execute(
                f"CREATE TABLE IF NOT EXISTS {self.deliveries} (hash BLOB PRIMARY KEY, "
                "proc TEXT NOT NULL, rows INTEGER NOT NULL, time_ns INTEGER NOT NULL)"
            )
            self._local.conn = c
        return c

    def __call__(self, values: list[Value], delivery: Delivery) -> None:
        """The batch-sink function: ``graph.sink(name, inputs, sink, batch=True)``."""
        rows = [tuple(self.to_row(v)) for v in values]
        c = self._conn()
        c.execute("BEGIN IMMEDIATE")
        try:
            seen = c.execute(
                f"SELECT 1 FROM {self.deliveries} WHERE hash = ?", (delivery.hash,)
            ).fetchone()
            if seen is None:
                marks = ", ".join("?" * len(self.names))
                c.executemany(
                    f"INSERT INTO {self.table} ({', '.join(self.names)}) VALUES ({marks})", rows
                )
                c.execute(
                    f"INSERT INTO {self.deliveries} VALUES (?, ?, ?, ?)",
                    (delivery.hash, delivery.proc, len(rows), time.time_ns()),
                )
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        if seen is None:
            self.written += len(rows)
        else:
            self.skipped += len(rows)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (the Spark engine ships sinks to its worker processes): without the
        per-thread connections, and with the path made absolute, since workers may run in
        another directory."""
        state = dict(self.__dict__)
        state["path"] = os.path.abspath(self.path)
        del state["_local"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def close(self) -> None:
        """Close this thread's connection."""
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
            self._local.conn = None
