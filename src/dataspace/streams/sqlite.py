"""The SQLite stream store: one file (``streams.sqlite3`` in the data directory), WAL mode.

Layout (schema version 1; ``PRAGMA application_id`` = 0x44537472, "DStr")::

    streams  (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT UNIQUE, next_index,
              created_ns, max_count, max_age_ms)
    entries  (stream, idx, seq, time_ns, value BLOB, meta BLOB,
              PRIMARY KEY (stream, idx)) WITHOUT ROWID
    tailers  (stream, name, position, updated_ns, PRIMARY KEY (stream, name)) WITHOUT ROWID
    store_meta (key TEXT PRIMARY KEY, value)      -- format, created_ns, seq

* ``entries`` is clustered on (stream, index): appends go to the end of one b-tree range
  and a read of a range of indices is one index range scan.  Values and metadata are
  canonical Preserves binary.
* ``seq`` is a store-wide counter in commit order (writers are serialised by SQLite), so
  entries of different streams can be ordered by when they were committed; ``alts``
  processors use it to take "whichever input has one first" deterministically.
* ``next_index`` is kept per stream so indices stay monotonic when retention has removed
  every entry.
* One write transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``) may touch any number of
  streams and tailers: the exactly-once engine writes its outputs, its tailer positions
  and its backing-stream records together.

Durability: ``synchronous=FULL`` by default (every commit is fsynced before it returns);
``durability="normal"`` keeps commits safe from process crashes (kill -9) but not from
power loss, and is faster on slow disks.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Mapping, Sequence
from itertools import repeat
from pathlib import Path
from typing import Any

from ..values import Value
from .base import (
    MAX_INDEX,
    Columns,
    Entry,
    ForeignStore,
    LockHeld,
    Store,
    StoreCorrupt,
    StoreError,
    StoreLock,
    StoreNotFound,
    StreamInfo,
    StreamNotFound,
    TailerInfo,
    Transaction,
    check_lock_name,
    check_stream_name,
    check_tailer_name,
    encode_value,
    is_reserved,
    staged_count_error,
    staged_total,
)
from .wakeup import Notifier, get_notifier, release_notifier

__all__ = ["APPLICATION_ID", "SCHEMA_VERSION", "STAGE_SHARDS", "SQLiteStore", "open_store"]

log = logging.getLogger(__name__)

APPLICATION_ID = 0x44537472  # "DStr"
SCHEMA_VERSION = 1
_HEADER = b"SQLite format 3\x00"

_SCHEMA = f"""
CREATE TABLE streams (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    next_index INTEGER NOT NULL DEFAULT 0,
    created_ns INTEGER NOT NULL,
    max_count INTEGER,
    max_age_ms INTEGER
);
CREATE TABLE entries (
    stream INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    time_ns INTEGER NOT NULL,
    value BLOB NOT NULL,
    meta BLOB,
    PRIMARY KEY (stream, idx)
) WITHOUT ROWID;
CREATE TABLE tailers (
    stream INTEGER NOT NULL,
    name TEXT NOT NULL,
    position INTEGER NOT NULL,
    updated_ns INTEGER NOT NULL,
    PRIMARY KEY (stream, name)
) WITHOUT ROWID;
CREATE TABLE store_meta (key TEXT PRIMARY KEY, value);
INSERT INTO store_meta VALUES ('format', 'dataspace-streams');
INSERT INTO store_meta VALUES ('seq', 0);
PRAGMA application_id = {APPLICATION_ID};
PRAGMA user_version = {SCHEMA_VERSION};
"""

_TABLES = {"streams", "entries", "tailers", "store_meta"}

ROWS_PER_STATEMENT = 500
"""Bulk inserts of staged rows bind this many rows to one statement (multi-row
``VALUES``): 50,000 rows staged in 0.049 s where ``executemany`` of one row a statement
takes 0.076 s -- staging is in every Spark read task."""


def _insert_values(conn: sqlite3.Connection, head: str, width: int, flat: Sequence[Any]) -> None:
    """``head`` (``INSERT INTO t (a, b) VALUES``) for the rows in ``flat``, ``width``
    values a row, one after the other: :data:`ROWS_PER_STATEMENT` rows a statement."""
    n = len(flat) // width
    one = "(" + ",".join("?" * width) + ")"
    full = n - n % ROWS_PER_STATEMENT
    if full:
        stmt = f"{head} {','.join([one] * ROWS_PER_STATEMENT)}"
        step = ROWS_PER_STATEMENT * width
        for a in range(0, full * width, step):
            conn.execute(stmt, flat[a:a + step])
    if n > full:
        conn.execute(f"{head} {','.join([one] * (n - full))}", flat[full * width:])


PAGE_SIZE = 16384
"""The page size of new store files.  Pipelines append and read in batches: with 16 KiB
pages a 100,000-row append inside the store (a Spark batch's commit) takes about 0.06 s
where 4 KiB pages take 0.08 s, and reading the rows back 0.05 s for 0.065 s, while a
small commit (a recording server's) costs the same; 64 KiB pages doubled small commits.
Existing files keep the page size they were made with."""

STAGE_SHARDS = 4
"""Files that rows staged ahead of a commit go into (Store.stage): parallel tasks each
find one whose lock is free."""

# In each shard: a registry, and a table per (token, stream), ``t<id>``: ids are never
# reused (AUTOINCREMENT), as a dropped part's table may wait for collect_staged.
_STAGED_DDL = """CREATE TABLE IF NOT EXISTS staged (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    owner TEXT NOT NULL,
    token TEXT NOT NULL,
    stream TEXT NOT NULL,
    count INTEGER NOT NULL,
    UNIQUE (token, stream)
)"""


def open_store(
    path: str | os.PathLike[str], *, create: bool = True, durability: str = "full",
    busy_timeout: float = 30.0,
) -> SQLiteStore:
    """Open (creating if asked) the SQLite store at ``path``.

    ``path`` is a data directory (the store is its ``streams.sqlite3``; a directory that
    does not exist is created) or the store file itself: the rule of
    :func:`dataspace.datadir.store_file`, which every command follows too.
    """
    from ..datadir import store_file

    p = store_file(path, create=create)
    return SQLiteStore(p, create=create, durability=durability, busy_timeout=busy_timeout)


class SQLiteLock(StoreLock):
    """A held :meth:`SQLiteStore.lock` (an open, ``flock``ed file)."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _corrupt(path: Path, e: BaseException) -> StoreCorrupt:
    return StoreCorrupt(
        f"{path} is damaged or is not a stream store ({e}); move it away (a new store is "
        "created on next use) or restore it from a backup"
    )


class SQLiteStore(Store):
    """A stream store in one SQLite file (see the module docstring).

    Safe to share between threads (operations are serialised by a lock).  Several
    processes may open the same file: SQLite serialises their writers, and the
    notifier wakes readers in every process.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        durability: str = "full",
        busy_timeout: float = 30.0,
    ) -> None:
        if durability not in ("full", "normal"):
            raise ValueError("durability must be 'full' or 'normal'")
        self.path = Path(path)
        self.durability = durability
        self._lock = threading.RLock()
        self._closed = False
        self._in_tx = False
        self._busy_timeout = busy_timeout
        self._stage_conns: dict[int, sqlite3.Connection] = {}  # shard -> connection (stage)
        self._attached: set[int] = set()  # shards attached to the main connection
        self._deferred_checkpoints = False
        self._conn = self._open(create, busy_timeout)
        self._notifier: Notifier | None = get_notifier(self.path)

    # -- opening --------------------------------------------------------------------------

    def _open(self, create: bool, busy_timeout: float) -> sqlite3.Connection:
        path = self.path
        exists = path.exists()
        if exists:
            if path.is_dir():
                raise StoreError(f"{path} is a directory, not a stream store file")
            try:
                with open(path, "rb") as f:
                    head = f.read(100)
            except OSError as e:
                raise StoreError(f"cannot read {path}: {e.strerror}") from e
            if head and not head.startswith(_HEADER):
                raise ForeignStore(
                    f"{path} is not a stream store (not an SQLite database: it starts with "
                    f"{head[:16]!r}); move it away or choose another --data-dir"
                )
            if head and len(head) < 100:
                raise StoreCorrupt(
                    f"{path} is truncated ({len(head)} bytes); move it away or restore it "
                    "from a backup"
                )
        elif not create:
            raise StoreNotFound(
                f"no stream store at {path}; append to a stream first (dataspace stream "
                "append NAME VALUE) or check --data-dir"
            )
        else:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(f"cannot create {path.parent}: {e.strerror}") from e
        try:
            conn = sqlite3.connect(
                str(path), isolation_level=None, check_same_thread=False,
                timeout=busy_timeout,
            )
        except sqlite3.Error as e:
            raise StoreError(f"cannot open {path}: {e}") from e
        try:
            self._setup(conn)
        except StoreError:
            conn.close()
            raise
        except sqlite3.OperationalError as e:
            conn.close()
            if "locked" in str(e):
                raise StoreError(f"{path} stayed locked by another process for the whole busy "
                                 "timeout while opening it") from e
            raise _corrupt(path, e) from e
        except sqlite3.DatabaseError as e:
            conn.close()
            raise _corrupt(path, e) from e
        return conn

    def _setup(self, conn: sqlite3.Connection) -> None:
        """Check the file (laying out the schema of a new one) and configure the
        connection.  Processes opening a new store at once race: switching a file to WAL
        does not wait for the busy timeout, so a "locked" answer is retried until it ends."""
        deadline = time.monotonic() + self._busy_timeout
        delay = 0.005
        while True:
            try:
                self._setup_once(conn)
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() >= deadline:
                    raise
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            time.sleep(delay)  # another process is laying out or switching the file
            delay = min(delay * 2, 0.1)

    def _setup_once(self, conn: sqlite3.Connection) -> None:
        path = self.path
        conn.execute("BEGIN")  # one snapshot: a creator may commit between two reads
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        if app_id == 0 and not (tables - {"sqlite_sequence"}):
            # A new (or empty) file: lay out the schema, in pages of PAGE_SIZE (a no-op
            # if another process laid the file out meanwhile).
            conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("BEGIN IMMEDIATE")
            try:
                # Another process may have won the race to initialise.
                if conn.execute("PRAGMA application_id").fetchone()[0] == 0:
                    for stmt in _SCHEMA.strip().split(";"):
                        if stmt.strip():
                            conn.execute(stmt)
                    conn.execute(
                        "INSERT INTO store_meta VALUES ('created_ns', ?)", (time.time_ns(),)
                    )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            app_id = APPLICATION_ID
            version = SCHEMA_VERSION
            tables = _TABLES
        if app_id != APPLICATION_ID:
            what = f"application id {app_id:#x}" if app_id else "tables " + ", ".join(sorted(tables))
            raise ForeignStore(
                f"{path} is an SQLite database of another application ({what}), not a "
                "stream store; choose another --data-dir or move the file away"
            )
        if version > SCHEMA_VERSION:
            raise ForeignStore(
                f"{path} was written by a newer dataspace (store format {version}, this one "
                f"reads up to {SCHEMA_VERSION}); upgrade dataspace"
            )
        if not _TABLES <= tables:
            raise StoreCorrupt(
                f"{path} is a stream store with missing tables ({', '.join(sorted(_TABLES - tables))}); "
                "move it away or restore it from a backup"
            )
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"{path}: cannot switch to WAL mode (got {mode}); is the file system local?")
        conn.execute(f"PRAGMA synchronous = {'FULL' if self.durability == 'full' else 'NORMAL'}")
        conn.execute("PRAGMA temp_store = MEMORY")
        conn.execute("PRAGMA cache_size = -32768")

    @property
    def url(self) -> str:
        return str(self.path.absolute())

    @property
    def display(self) -> str:
        return str(self.path)

    # -- locks ----------------------------------------------------------------------------

    def _lock_file(self, name: str) -> Path:
        check_lock_name(name)
        return self.path.with_name(self.path.name + "-locks") / (name.replace("/", "%2F") + ".lock")

    def lock(self, name: str, note: str = "") -> SQLiteLock:
        """An exclusive ``flock`` on ``streams.sqlite3-locks/NAME.lock`` holding our pid,
        released by the kernel when the process dies."""
        path = self._lock_file(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                other = os.pread(fd, 128, 0).decode(errors="replace").strip()
            finally:
                os.close(fd)
            raise LockHeld(name, f"pid {other or '?'}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (f"{os.getpid()}, {note}" if note else str(os.getpid())).encode()[:128], 0)
        return SQLiteLock(fd)

    def lock_holder(self, name: str) -> str | None:
        try:
            fd = os.open(self._lock_file(name), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "pid " + (os.pread(fd, 128, 0).decode(errors="replace").strip() or "?")
        finally:
            os.close(fd)
        return None

    # -- plumbing -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the store {self.path} is closed")

    def _exec(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        try:
            return self._conn.execute(sql, params)
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
                raise StoreError(
                    f"{self.path} stayed locked by another process for the whole busy "
                    "timeout; is a long transaction running elsewhere?"
                ) from e
            if isinstance(e, (sqlite3.IntegrityError, sqlite3.OperationalError, sqlite3.ProgrammingError)):
                raise
            raise _corrupt(self.path, e) from e

    def _stream_id(self, name: str) -> int | None:
        # Looked up by name on every call (an indexed point query), never from a cache: a
        # stream deleted by another process (stream rm, pipeline reset) and created again
        # has a new id, and a read through the old one would find nothing.
        row = self._exec("SELECT id FROM streams WHERE name = ?", (name,)).fetchone()
        return None if row is None else int(row[0])

    def begin(self) -> SQLiteTransaction:
        """Start a write transaction (``BEGIN IMMEDIATE``: waits for other writers up to
        the busy timeout).  Commit or roll it back from the same thread."""
        self._lock.acquire()
        try:
            self._check_open()
            if self._in_tx:
                raise StoreError("transactions do not nest")
            self._exec("BEGIN IMMEDIATE")
            self._in_tx = True
        except BaseException:
            self._lock.release()
            raise
        return SQLiteTransaction(self)

    def _end(self, tx: SQLiteTransaction, commit: bool) -> None:
        if tx._done:
            raise StoreError("this transaction has already ended")
        tx._done = True
        try:
            if commit:
                try:
                    tx._finish()
                    self._exec("COMMIT")
                except BaseException:
                    self._rollback()
                    raise
            else:
                self._rollback()
        finally:
            self._in_tx = False
            changed = commit and self._conn.total_changes != tx._changes0
            self._lock.release()
        if changed:
            assert self._notifier is not None
            self._notifier.signal()

    def wake(self) -> None:
        self._check_open()
        assert self._notifier is not None
        self._notifier.bump()

    def _rollback(self) -> None:
        try:
            self._conn.execute("ROLLBACK")
        except sqlite3.Error:  # pragma: no cover - the transaction was already gone
            pass

    # -- streams --------------------------------------------------------------------------

    def create_stream(
        self, name: str, *, max_count: int | None = None, max_age: float | None = None
    ) -> StreamInfo:
        check_stream_name(name)
        with self.transaction() as tx:
            tx.create_stream(name, max_count, max_age)
        return self.stream_info(name)

    def has_stream(self, name: str) -> bool:
        with self._lock:
            self._check_open()
            return self._stream_id(name) is not None

    def _info(self, row: tuple[Any, ...], with_tailers: bool) -> StreamInfo:
        sid, name, nxt, created, max_count, max_age_ms = row
        first_row = self._exec(
            "SELECT idx FROM entries WHERE stream = ? ORDER BY idx LIMIT 1", (sid,)
        ).fetchone()
        last_row = self._exec(
            "SELECT time_ns FROM entries WHERE stream = ? ORDER BY idx DESC LIMIT 1", (sid,)
        ).fetchone()
        first = None if first_row is None else first_row[0]
        tailers: tuple[TailerInfo, ...] = ()
        if with_tailers:
            tailers = tuple(
                TailerInfo(name, t, p, u)
                for t, p, u in self._exec(
                    "SELECT name, position, updated_ns FROM tailers WHERE stream = ? ORDER BY name",
                    (sid,),
                )
            )
        return StreamInfo(
            name=name,
            first=first,
            next=nxt,
            count=0 if first is None else nxt - first,
            created_ns=created,
            max_count=max_count,
            max_age=None if max_age_ms is None else max_age_ms / 1000.0,
            last_time_ns=None if last_row is None else last_row[0],
            tailers=tailers,
        )

    _COLS = "id, name, next_index, created_ns, max_count, max_age_ms"

    def stream_info(self, name: str) -> StreamInfo:
        with self._lock:
            self._check_open()
            row = self._exec(f"SELECT {self._COLS} FROM streams WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise StreamNotFound(f"no stream named {name!r} in {self.path}")
            return self._info(row, True)

    def streams(self, include_internal: bool = False) -> list[StreamInfo]:
        with self._lock:
            self._check_open()
            rows = self._exec(f"SELECT {self._COLS} FROM streams ORDER BY name").fetchall()
            return [
                self._info(r, True) for r in rows if include_internal or not is_reserved(r[1])
            ]

    def delete_stream(self, name: str) -> None:
        with self.transaction() as tx:
            sid = tx._sid(name)
            self._exec("DELETE FROM entries WHERE stream = ?", (sid,))
            self._exec("DELETE FROM tailers WHERE stream = ?", (sid,))
            self._exec("DELETE FROM streams WHERE id = ?", (sid,))
            tx._next.pop(sid, None)

    def next_indices(self) -> dict[str, int]:
        with self._lock:
            self._check_open()
            return dict(self._exec("SELECT name, next_index FROM streams").fetchall())

    def next_index(self, name: str) -> int:
        with self._lock:
            self._check_open()
            sid = self._stream_id(name)
            if sid is None:
                return 0
            row = self._exec("SELECT next_index FROM streams WHERE id = ?", (sid,)).fetchone()
            return 0 if row is None else int(row[0])

    # -- reading --------------------------------------------------------------------------

    def read(self, name: str, start: int = 0, limit: int | None = None,
             end: int | None = None) -> list[Entry]:
        with self._lock:
            self._check_open()
            sid = self._stream_id(name)
            if sid is None:
                return []
            return _read(self, sid, name, start, MAX_INDEX if limit is None else limit, end)

    def get(self, name: str, index: int) -> Entry | None:
        with self._lock:
            self._check_open()
            sid = self._stream_id(name)
            if sid is None:
                return None
            return _get(self, sid, name, index)

    def last(self, name: str, before: int | None = None, limit: int = 1) -> list[Entry]:
        with self._lock:
            self._check_open()
            sid = self._stream_id(name)
            if sid is None:
                return []
            return _last(self, sid, name, before, limit)

    def read_rows(
        self, name: str, start: int, end: int, limit: int
    ) -> list[tuple[int, int, bytes, bytes | None]]:
        with self._lock:
            self._check_open()
            sid = self._stream_id(name)
            if sid is None:
                return []
            return self._exec(
                "SELECT idx, seq, value, meta FROM entries WHERE stream = ? AND idx >= ? "
                "AND idx < ? ORDER BY idx LIMIT ?",
                (sid, start, end, limit),
            ).fetchall()

    def read_columns(
        self, name: str, start: int, end: int, *, values: bool = True, meta: bool = False,
        limit: int = MAX_INDEX,
    ) -> Columns:
        """One range query, transposed to columns in C (``zip``)."""
        cols = "idx, seq, time_ns" + (", value" if values else "") + (", meta" if meta else "")
        with self._lock:
            self._check_open()
            sid = self._stream_id(name)
            rows = [] if sid is None or limit <= 0 else self._exec(
                f"SELECT {cols} FROM entries WHERE stream = ? AND idx >= ? AND idx < ? "
                "ORDER BY idx LIMIT ?",
                (sid, max(start, 0), end, limit),
            ).fetchall()
        if not rows:
            return Columns([], [], [], [], [])
        t = [list(c) for c in zip(*rows)]
        return Columns(t[0], t[1], t[2], t[3] if values else [],
                       t[-1] if meta else [])

    def first_index(self, name: str) -> int | None:
        with self._lock:
            self._check_open()
            sid = self._stream_id(name)
            if sid is None:
                return None
            row = self._exec(
                "SELECT idx FROM entries WHERE stream = ? ORDER BY idx LIMIT 1", (sid,)
            ).fetchone()
            return None if row is None else row[0]

    # -- tailers --------------------------------------------------------------------------

    def position(self, stream: str, tailer: str) -> int | None:
        with self._lock:
            self._check_open()
            sid = self._stream_id(stream)
            if sid is None:
                return None
            row = self._exec(
                "SELECT position FROM tailers WHERE stream = ? AND name = ?", (sid, tailer)
            ).fetchone()
            return None if row is None else int(row[0])

    def set_position(self, stream: str, tailer: str, position: int) -> None:
        with self.transaction() as tx:
            tx.set_position(stream, tailer, position)

    def tailers(self, stream: str) -> list[TailerInfo]:
        return list(self.stream_info(stream).tailers)

    def delete_tailer(self, stream: str, tailer: str) -> None:
        with self.transaction() as tx:
            sid = tx._sid(stream)
            self._exec("DELETE FROM tailers WHERE stream = ? AND name = ?", (sid, tailer))

    # -- waiting --------------------------------------------------------------------------

    def generation(self) -> int:
        self._check_open()
        assert self._notifier is not None
        return self._notifier.generation()

    def wait_change(self, generation: int, timeout: float | None) -> int:
        self._check_open()
        assert self._notifier is not None
        return self._notifier.wait(generation, timeout)

    async def wait_change_async(self, generation: int, timeout: float | None) -> int:
        self._check_open()
        assert self._notifier is not None
        return await self._notifier.wait_async(generation, timeout)

    @property
    def wakeup_mode(self) -> str:
        """How other processes' commits wake readers: ``inotify`` or ``poll``."""
        assert self._notifier is not None
        self._notifier.generation()
        return self._notifier.mode

    # -- staging ------------------------------------------------------------------------

    def stage_path(self, shard: int) -> Path:
        """The file of staging shard ``shard`` (beside the store)."""
        return self.path.with_name(f"{self.path.name}-stage{shard}")

    def attach_staged(self) -> None:
        """Attach the staging shards that exist to the main connection, for the next
        transactions to take or drop staged rows (SQLite attaches only outside one)."""
        with self._lock:
            self._check_open()
            if self._in_tx:
                raise StoreError("attach_staged() inside a transaction")
            if len(self._attached) < STAGE_SHARDS:
                self._attach_shards()

    def _attach_shards(self) -> None:
        for k in range(STAGE_SHARDS):
            if k not in self._attached and self.stage_path(k).exists():
                try:
                    self._conn.execute(f"ATTACH DATABASE ? AS stage{k}", (str(self.stage_path(k)),))
                    self._conn.execute(f"PRAGMA stage{k}.journal_mode = TRUNCATE")
                    self._conn.execute(f"PRAGMA stage{k}.synchronous = OFF")
                except sqlite3.Error as e:
                    raise StoreError(f"cannot open the staging file {self.stage_path(k)}: {e}") from e
                self._attached.add(k)

    def _stage_conn(self, k: int) -> sqlite3.Connection:
        conn = self._stage_conns.get(k)
        if conn is None:
            try:
                conn = sqlite3.connect(str(self.stage_path(k)), isolation_level=None,
                                       check_same_thread=False, timeout=self._busy_timeout)
                conn.execute("PRAGMA journal_mode = TRUNCATE")
                conn.execute("PRAGMA synchronous = OFF")
            except sqlite3.Error as e:
                raise StoreError(f"cannot open the staging file {self.stage_path(k)}: {e}") from e
            self._stage_conns[k] = conn
        return conn

    def stage(self, owner: str, token: str,
              rows: Mapping[str, tuple[Sequence[bytes], Sequence[bytes | None]]]) -> None:
        """Staged rows go into one of :data:`STAGE_SHARDS` files beside the store
        (``streams.sqlite3-stageN``: never synced, nothing there is durable), the first
        whose lock is free, so that parallel tasks do not queue for one lock; each
        stream's rows in a table of their own, registered in the shard's ``staged``
        table.  The main connection attaches the shards; a commit takes the rows with
        ``INSERT ... SELECT`` and drops their tables."""
        with self._lock:
            self._check_open()
            if self._in_tx:  # as PostgreSQL: staging is a transaction of its own
                raise StoreError("stage() inside a transaction")
            first = os.getpid() % STAGE_SHARDS
            order = [(first + k) % STAGE_SHARDS for k in range(STAGE_SHARDS)]
            conn = None
            for k in order:  # a free shard, without waiting...
                c = self._stage_conn(k)
                c.execute("PRAGMA busy_timeout = 0")
                try:
                    c.execute("BEGIN IMMEDIATE")
                    conn = c
                except sqlite3.OperationalError:
                    continue
                finally:
                    c.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
                break
            if conn is None:  # ...else wait for the first
                conn = self._stage_conn(first)
                try:
                    conn.execute("BEGIN IMMEDIATE")
                except sqlite3.OperationalError as e:
                    raise StoreError(f"{self.stage_path(first)} stayed locked: {e}") from e
            try:
                conn.execute(_STAGED_DDL)
                for stream, (datas, metas) in rows.items():
                    if len(metas) != len(datas):
                        raise ValueError("stage: datas and metas differ in length")
                    tid = conn.execute(
                        "INSERT INTO staged (owner, token, stream, count) VALUES (?, ?, ?, ?)",
                        (owner, token, stream, len(datas))).lastrowid
                    # k is the rowid, 1, 2, ... in a new table (not bound: 7% faster)
                    conn.execute(f"CREATE TABLE t{tid} (k INTEGER PRIMARY KEY, value BLOB NOT NULL, "
                                 "meta BLOB)")
                    _insert_values(conn, f"INSERT INTO t{tid} (value, meta) VALUES", 2,
                                   list(itertools.chain.from_iterable(zip(datas, metas))))
                conn.execute("COMMIT")
            except BaseException as e:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                if isinstance(e, sqlite3.IntegrityError):
                    raise StoreError(f"stage: token {token!r} was staged already") from None
                if isinstance(e, sqlite3.Error):
                    raise StoreError(f"stage: {e} ({self.stage_path(first).parent})") from e
                raise
            if len(self._attached) < STAGE_SHARDS:
                self._attach_shards()  # this process may take them itself

    def collect_staged(self) -> int:
        """Drop the tables of staged rows no registry row names any more, shard by
        shard, each with a connection of its own and only if its lock is free (a shard
        in use is collected next time); after :meth:`defer_checkpoints`, first fold the
        write-ahead log into the database (a passive checkpoint)."""
        freed = 0
        if self._deferred_checkpoints and not self._closed:
            with contextlib.suppress(sqlite3.Error):  # never blocks; a busy log waits for next time
                conn = sqlite3.connect(str(self.path), isolation_level=None, timeout=0)
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                finally:
                    conn.close()
        for k in range(STAGE_SHARDS):
            path = self.stage_path(k)
            if not path.exists():
                continue
            try:
                conn = sqlite3.connect(str(path), isolation_level=None, timeout=0)
            except sqlite3.Error:
                continue
            try:
                conn.execute("PRAGMA journal_mode = TRUNCATE")
                conn.execute("PRAGMA synchronous = OFF")
                conn.execute("BEGIN IMMEDIATE")
                try:
                    names = [r[0] for r in conn.execute(
                        "SELECT name FROM sqlite_master WHERE type = 'table' AND name GLOB 't[0-9]*' "
                        "AND CAST(substr(name, 2) AS INTEGER) NOT IN (SELECT id FROM staged)")]
                    for name in names:
                        conn.execute(f"DROP TABLE {name}")
                    conn.execute("COMMIT")
                    freed += len(names)
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.OperationalError:
                continue  # busy, or no registry yet
            finally:
                conn.close()
        return freed

    # -- maintenance ----------------------------------------------------------------------

    def apply_retention(self, now_ns: int | None = None) -> int:
        now = time.time_ns() if now_ns is None else now_ns
        with self.transaction() as tx:
            rows = self._exec(
                "SELECT id, next_index, max_count, max_age_ms FROM streams "
                "WHERE max_count IS NOT NULL OR max_age_ms IS NOT NULL"
            ).fetchall()
            deleted = 0
            for sid, nxt, max_count, max_age_ms in rows:
                deleted += _retain(self, sid, nxt, max_count, max_age_ms, now)
            tx._retained = deleted
        return deleted

    def check(self) -> list[str]:
        with self._lock:
            self._check_open()
            try:
                rows = self._conn.execute("PRAGMA integrity_check").fetchall()
            except sqlite3.DatabaseError as e:
                return [str(e)]
            problems = [r[0] for r in rows if r[0] != "ok"]
            if not problems:
                bad = self._conn.execute(
                    "SELECT s.name, s.next_index, max(e.idx) FROM streams s JOIN entries e "
                    "ON e.stream = s.id GROUP BY s.id HAVING max(e.idx) >= s.next_index"
                ).fetchall()
                problems += [f"stream {n!r}: entry {m} at or beyond next index {x}" for n, x, m in bad]
                orphans = self._conn.execute(
                    "SELECT count(*) FROM entries WHERE stream NOT IN (SELECT id FROM streams)"
                ).fetchone()[0]
                if orphans:
                    problems.append(f"{orphans} entries of no stream")
            return problems

    def checkpoint(self) -> None:
        """Fold the write-ahead log into the database file (also done automatically)."""
        with self._lock:
            self._check_open()
            self._exec("PRAGMA wal_checkpoint(TRUNCATE)")

    def defer_checkpoints(self) -> None:
        """This connection's commits stop folding the write-ahead log into the database
        (SQLite does it after a commit once the log passes 1,000 pages: about half of a
        100,000-row commit's time); :meth:`collect_staged`, which the Spark sink runs in
        the background after each commit, does it instead."""
        with self._lock:
            self._check_open()
            if not self._deferred_checkpoints:
                self._exec("PRAGMA wal_autocheckpoint = 0")
                self._deferred_checkpoints = True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for c in self._stage_conns.values():
                with contextlib.suppress(sqlite3.Error):
                    c.close()
            self._stage_conns.clear()
            try:
                self._conn.close()
            finally:
                if self._notifier is not None:
                    release_notifier(self._notifier)
                    self._notifier = None

    def __repr__(self) -> str:
        return f"<SQLiteStore {self.path}>"


# -- shared read helpers (store and transaction) -----------------------------------------


def _read(store: SQLiteStore, sid: int, name: str, start: int, limit: int, end: int | None) -> list[Entry]:
    if limit <= 0:
        return []
    hi = MAX_INDEX if end is None else end
    rows = store._exec(
        "SELECT idx, seq, time_ns, value, meta FROM entries WHERE stream = ? AND idx >= ? "
        "AND idx < ? ORDER BY idx LIMIT ?",
        (sid, max(start, 0), hi, limit),
    ).fetchall()
    return [Entry(name, i, v, m, t, s) for i, s, t, v, m in rows]


def _get(store: SQLiteStore, sid: int, name: str, index: int) -> Entry | None:
    row = store._exec(
        "SELECT idx, seq, time_ns, value, meta FROM entries WHERE stream = ? AND idx = ?",
        (sid, index),
    ).fetchone()
    if row is None:
        return None
    i, s, t, v, m = row
    return Entry(name, i, v, m, t, s)


def _last(store: SQLiteStore, sid: int, name: str, before: int | None, limit: int) -> list[Entry]:
    hi = MAX_INDEX if before is None else before
    rows = store._exec(
        "SELECT idx, seq, time_ns, value, meta FROM entries WHERE stream = ? AND idx < ? "
        "ORDER BY idx DESC LIMIT ?",
        (sid, hi, limit),
    ).fetchall()
    return [Entry(name, i, v, m, t, s) for i, s, t, v, m in rows]


def _retain(
    store: SQLiteStore, sid: int, nxt: int, max_count: int | None, max_age_ms: int | None, now_ns: int
) -> int:
    cut = 0
    if max_count is not None:
        cut = max(cut, nxt - max_count)
    if max_age_ms is not None:
        limit_ns = now_ns - max_age_ms * 1_000_000
        row = store._exec(
            "SELECT idx FROM entries WHERE stream = ? AND time_ns >= ? ORDER BY idx LIMIT 1",
            (sid, limit_ns),
        ).fetchone()
        cut = max(cut, nxt if row is None else row[0])
    if cut <= 0:
        return 0
    cur = store._exec("DELETE FROM entries WHERE stream = ? AND idx < ?", (sid, cut))
    return max(cur.rowcount, 0)


class SQLiteTransaction(Transaction):
    """A write transaction of :class:`SQLiteStore` (see :meth:`SQLiteStore.transaction`)."""

    __slots__ = ("_changes0", "_copy_base", "_done", "_ids", "_new_ids", "_next",
                 "_no_retention", "_retained", "_seq", "_start_next", "_store", "_time")

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store
        self._done = False
        self._changes0 = store._conn.total_changes
        self._next: dict[int, int] = {}  # stream id -> next index (as of this transaction)
        self._start_next: dict[int, int] = {}
        self._seq: int | None = None
        self._new_ids: dict[str, int] = {}
        # Ids looked up in this transaction: a writer holds the write lock, so no other
        # process deletes a stream meanwhile (ids are never cached across transactions).
        self._ids: dict[str, int] = {}
        self._retained = 0
        self._time: int | None = None
        self._no_retention: set[int] = set()
        self._copy_base: int | None = None

    # -- helpers ----------------------------------------------------------------------

    def _sid(self, name: str, create: bool = False) -> int:
        sid = self._new_ids.get(name)
        if sid is not None:
            return sid
        store = self._store
        sid = self._ids.get(name)
        if sid is None:
            row = store._exec("SELECT id FROM streams WHERE name = ?", (name,)).fetchone()
            if row is not None:
                sid = self._ids[name] = row[0]
            elif create:
                check_stream_name(name)
                sid = store._exec(
                    "INSERT INTO streams (name, next_index, created_ns) VALUES (?, 0, ?)",
                    (name, time.time_ns()),
                ).lastrowid
                assert sid is not None
                self._new_ids[name] = sid
                self._next[sid] = self._start_next[sid] = 0
            else:
                raise StreamNotFound(f"no stream named {name!r} in {store.path}")
        return sid

    def _next_of(self, sid: int) -> int:
        n = self._next.get(sid)
        if n is None:
            row = self._store._exec("SELECT next_index FROM streams WHERE id = ?", (sid,)).fetchone()
            if row is None:
                raise StreamNotFound(f"stream id {sid} was deleted")
            n = self._next[sid] = self._start_next[sid] = row[0]
        return n

    def _finish(self) -> None:
        store = self._store
        changed = [(n, sid) for sid, n in self._next.items() if n != self._start_next[sid]]
        if changed:
            store._conn.executemany("UPDATE streams SET next_index = ? WHERE id = ?", changed)
            if self._seq is not None:
                store._exec("UPDATE store_meta SET value = ? WHERE key = 'seq'", (self._seq,))
            # Retention of the streams written, in the same transaction.
            ids = [sid for _n, sid in changed if sid not in self._no_retention]
            if not ids:
                return
            rows = store._exec(
                f"SELECT id, next_index, max_count, max_age_ms FROM streams WHERE id IN "
                f"({','.join('?' * len(ids))}) AND (max_count IS NOT NULL OR max_age_ms IS NOT NULL)",
                ids,
            ).fetchall()
            now = self._time or time.time_ns()
            for sid, nxt, max_count, max_age_ms in rows:
                self._retained += _retain(store, sid, nxt, max_count, max_age_ms, now)

    def commit(self) -> None:
        self._store._end(self, True)

    def rollback(self) -> None:
        self._store._end(self, False)

    # -- the interface ----------------------------------------------------------------

    def create_stream(
        self, stream: str, max_count: int | None = None, max_age: float | None = None
    ) -> None:
        sid = self._sid(stream, create=True)
        if max_count is not None or max_age is not None:
            if max_count is not None and (type(max_count) is not int or max_count < 1):
                raise ValueError("max_count must be a positive integer")
            if max_age is not None and not (max_age > 0):
                raise ValueError("max_age must be a positive number of seconds")
            self._store._exec(
                "UPDATE streams SET max_count = ?, max_age_ms = ? WHERE id = ?",
                (max_count, None if max_age is None else round(max_age * 1000), sid),
            )

    def set_retention(self, stream: str, max_count: int | None, max_age: float | None) -> None:
        """Set (or with None, clear) both retention limits of ``stream``."""
        sid = self._sid(stream)
        self._store._exec(
            "UPDATE streams SET max_count = ?, max_age_ms = ? WHERE id = ?",
            (max_count, None if max_age is None else round(max_age * 1000), sid),
        )

    def next_index(self, stream: str) -> int:
        store = self._store
        sid = self._new_ids.get(stream) or self._ids.get(stream)
        if sid is None:
            row = store._exec("SELECT id FROM streams WHERE name = ?", (stream,)).fetchone()
            if row is None:
                return 0
            sid = self._ids[stream] = row[0]
        return self._next_of(sid)

    def append(self, stream: str, value: Value, meta: Value | None = None) -> int:
        data = encode_value(value)
        m = None if meta is None else encode_value(meta, "metadata")
        return self.append_encoded(stream, [data], [m])

    def append_encoded(
        self, stream: str, datas: list[bytes], metas: list[bytes | None] | None = None
    ) -> int:
        sid = self._sid(stream, create=True)
        first = self._next_of(sid)
        n = len(datas)
        if n == 0:
            return first
        if first + n > MAX_INDEX:
            raise StoreError(f"stream {stream!r} is full (64-bit indices exhausted)")
        seq = self._seq
        store = self._store
        if seq is None:
            seq = store._exec("SELECT value FROM store_meta WHERE key = 'seq'").fetchone()[0]
        t = self._time = time.time_ns()
        # Rows are zipped in C (no per-row Python tuple building in a loop).
        if metas is None:
            store._conn.executemany(
                "INSERT INTO entries (stream, idx, seq, time_ns, value) VALUES (?, ?, ?, ?, ?)",
                zip(repeat(sid), range(first, first + n), range(seq, seq + n), repeat(t), datas),
            )
        else:
            if len(metas) != n:
                raise ValueError("append_encoded: datas and metas differ in length")
            store._conn.executemany(
                "INSERT INTO entries (stream, idx, seq, time_ns, value, meta) VALUES (?, ?, ?, ?, ?, ?)",
                zip(repeat(sid), range(first, first + n), range(seq, seq + n), repeat(t), datas, metas),
            )
        self._seq = seq + n
        self._next[sid] = first + n
        return first

    def read(self, stream: str, start: int, limit: int, end: int | None = None) -> list[Entry]:
        try:
            sid = self._sid(stream)
        except StreamNotFound:
            return []
        return _read(self._store, sid, stream, start, limit, end)

    def read_rows(self, stream: str, start: int, end: int, limit: int) -> list[tuple[int, int, bytes, bytes | None]]:
        """The engine's fast path: ``(index, seq, value, meta)`` tuples."""
        try:
            sid = self._sid(stream)
        except StreamNotFound:
            return []
        return self._store._exec(
            "SELECT idx, seq, value, meta FROM entries WHERE stream = ? AND idx >= ? AND idx < ? "
            "ORDER BY idx LIMIT ?",
            (sid, start, end, limit),
        ).fetchall()

    def get(self, stream: str, index: int) -> Entry | None:
        try:
            sid = self._sid(stream)
        except StreamNotFound:
            return None
        return _get(self._store, sid, stream, index)

    def last(self, stream: str, before: int | None = None, limit: int = 1) -> list[Entry]:
        try:
            sid = self._sid(stream)
        except StreamNotFound:
            return []
        return _last(self._store, sid, stream, before, limit)

    def first_index(self, stream: str) -> int | None:
        """The lowest stored index of ``stream`` (None when empty or absent)."""
        try:
            sid = self._sid(stream)
        except StreamNotFound:
            return None
        row = self._store._exec(
            "SELECT idx FROM entries WHERE stream = ? ORDER BY idx LIMIT 1", (sid,)
        ).fetchone()
        return None if row is None else row[0]

    def position(self, stream: str, tailer: str) -> int | None:
        try:
            sid = self._sid(stream)
        except StreamNotFound:
            return None
        row = self._store._exec(
            "SELECT position FROM tailers WHERE stream = ? AND name = ?", (sid, tailer)
        ).fetchone()
        return None if row is None else int(row[0])

    def set_position(self, stream: str, tailer: str, position: int) -> None:
        check_tailer_name(tailer)
        if type(position) is not int or not 0 <= position <= MAX_INDEX:
            raise ValueError(f"a tailer position is an index (0 to 2**63-1), not {position!r}")
        sid = self._sid(stream, create=True)
        self._store._exec(
            "INSERT INTO tailers (stream, name, position, updated_ns) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (stream, name) DO UPDATE SET position = excluded.position, "
            "updated_ns = excluded.updated_ns",
            (sid, tailer, position, time.time_ns()),
        )

    def set_positions(self, items: list[tuple[str, str, int]]) -> None:
        """Several :meth:`set_position` calls in one statement."""
        now = time.time_ns()
        rows = [(self._sid(s, create=True), t, p, now) for s, t, p in items]
        self._store._conn.executemany(
            "INSERT INTO tailers (stream, name, position, updated_ns) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (stream, name) DO UPDATE SET position = excluded.position, "
            "updated_ns = excluded.updated_ns",
            rows,
        )

    def _find_staged(self, token: str, stream: str) -> tuple[int, int, int] | None:
        """(shard, table id, count) of ``token``'s rows of ``stream``, or None."""
        store = self._store
        for k in sorted(store._attached):
            row = store._exec(f"SELECT id, count FROM stage{k}.staged WHERE token = ? AND stream = ?",
                              (token, stream)).fetchone()
            if row is not None:
                return k, row[0], row[1]
        return None

    def append_staged(self, stream: str, staged: Sequence[tuple[str, int]], *,
                      meta_cut: int = 0, meta_suffix: bytes = b"") -> int:
        sid = self._sid(stream, create=True)
        first = self._next_of(sid)
        store = self._store
        total = staged_total(stream, first, staged)
        if total == 0:
            return first
        if not store._attached:
            raise StoreError(f"stream {stream!r}: no staged rows beside {store.path} (lost?)")
        seq = self._seq
        if seq is None:
            seq = store._exec("SELECT value FROM store_meta WHERE key = 'seq'").fetchone()[0]
        t = self._time = time.time_ns()
        meta = ("meta" if not meta_cut else
                "CASE WHEN meta IS NULL THEN NULL ELSE "
                "CAST(substr(meta, 1, length(meta) - ?) || ? AS BLOB) END")
        at = first
        for token, n in staged:
            found = self._find_staged(token, stream)
            if found is None or found[2] != n:
                raise staged_count_error(stream, token, None if found is None else found[2], n)
            k, tid, _n = found
            params: tuple[Any, ...] = (sid, at - 1, seq + (at - first) - 1, t)
            if meta_cut:
                params += (meta_cut, meta_suffix)
            cur = store._exec(
                f"INSERT INTO entries (stream, idx, seq, time_ns, value, meta) "
                f"SELECT ?, ? + k, ? + k, ?, value, {meta} FROM stage{k}.t{tid}", params)
            if cur.rowcount != n:
                raise staged_count_error(stream, token, cur.rowcount, n)
            at += n
        self._seq = seq + total
        self._next[sid] = at
        return first

    def drop_staged(self, owner: str) -> int:
        # The registry rows go now; the tables, whose dropping costs about as much as
        # writing them, when Store.collect_staged next runs (in the background).
        store = self._store
        dropped = 0
        for k in sorted(store._attached):
            n = store._exec(f"SELECT sum(count) FROM stage{k}.staged WHERE owner = ?",
                            (owner,)).fetchone()[0]
            if n is not None:
                store._exec(f"DELETE FROM stage{k}.staged WHERE owner = ?", (owner,))
                dropped += n
        return dropped

    def copy_in(self, stream: str, rows: list[tuple[int, int, bytes, bytes | None, int]]) -> None:
        if not rows:
            return
        sid = self._sid(stream, create=True)
        nxt = self._next_of(sid)
        if rows[0][0] < nxt or any(b[0] <= a[0] for a, b in itertools.pairwise(rows)):
            raise ValueError(f"copy_in {stream!r}: indices must increase from the next index {nxt}")
        if rows[-1][0] >= MAX_INDEX:
            raise StoreError(f"stream {stream!r} is full (64-bit indices exhausted)")
        store = self._store
        if self._copy_base is None:
            seq = self._seq
            if seq is None:
                seq = store._exec("SELECT value FROM store_meta WHERE key = 'seq'").fetchone()[0]
            self._copy_base = self._seq = seq
        base = self._copy_base
        store._conn.executemany(
            "INSERT INTO entries (stream, idx, seq, time_ns, value, meta) VALUES (?, ?, ?, ?, ?, ?)",
            [(sid, i, base + o, t, v, m) for i, t, v, m, o in rows],
        )
        self._seq = max(self._seq or 0, base + max(r[4] for r in rows) + 1)
        self._next[sid] = rows[-1][0] + 1
        self._no_retention.add(sid)

    def advance(self, stream: str, next_index: int) -> None:
        if type(next_index) is not int or not 0 <= next_index <= MAX_INDEX:
            raise ValueError(f"a next index is 0 to 2**63-1, not {next_index!r}")
        sid = self._sid(stream, create=True)
        if next_index > self._next_of(sid):
            self._next[sid] = next_index
