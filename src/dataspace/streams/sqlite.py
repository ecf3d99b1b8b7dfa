"""The SQLite stream store: one file (``streams.sqlite3`` in the data directory), WAL mode.

Layout (schema version 4; ``PRAGMA application_id`` = 0x44537472, "DStr")::

    streams  (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT UNIQUE, next_index,
              created_ns, max_count, max_age_ms, first_index, checksum)
    entries  (stream, idx, seq, time_ns, value BLOB, meta BLOB, checksum,
              PRIMARY KEY (stream, idx)) WITHOUT ROWID
    tailers  (stream, name, position, updated_ns, checksum,
              PRIMARY KEY (stream, name)) WITHOUT ROWID
    store_meta (key TEXT PRIMARY KEY, value)      -- format, created_ns, seq
    consumer_groups (id, stream, name, next_index, created_ns, idle_ms,
              max_deliveries, dead_letter, hold, checksum, UNIQUE (stream, name))
    pending  (grp, idx, consumer, deliveries, delivered_ns, checksum,
              PRIMARY KEY (grp, idx)) WITHOUT ROWID

* ``entries`` is clustered on (stream, index): appends go to the end of one b-tree range
  and a read of a range of indices is one index range scan.  Values and metadata are
  canonical Preserves binary.
* ``seq`` is a store-wide counter in commit order (writers are serialised by SQLite), so
  entries of different streams can be ordered by when they were committed; ``alts``
  processors use it to take "whichever input has one first" deterministically.
* ``next_index`` is kept per stream so indices stay monotonic when retention has removed
  every entry; ``first_index`` is the lowest index it holds (``next_index`` when empty):
  its entries are exactly ``first_index <= idx < next_index``, and ``checksum`` is each entry's
  checksum.  Every read checks both (:mod:`.integrity`).  The rows of ``streams`` and
  ``tailers`` carry checksums of their own, checked by every read of them, and a stream's
  row is cross-checked against its lowest and highest stored index in the same snapshot.
  A version 1 file (before checksums) is migrated when opened: ``first_index`` from its
  entries, ``checksum`` NULL for the entries it holds (read unverified, with a note in
  the log); a version 1 or 2 file's stream and tailer rows get the checksums of the
  values they hold then; a version 3 file gets the tables of consumer groups.
* Consumer groups (:mod:`.groups`): a read or claim is one write transaction
  (``BEGIN IMMEDIATE``: SQLite serialises them with every writer) committed with
  ``synchronous=NORMAL`` -- safe from kill -9, and after a power loss entries delivered
  but not acknowledged are delivered again, as after any crash -- and without waking
  readers; acknowledgements are fsynced (``synchronous=FULL``, the store's durability).
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
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from pathlib import Path
from typing import Any

from ..values import Value
from .base import (
    DEFAULT_IDLE_TIMEOUT,
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
    StreamRows,
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
from .groups import (
    AckLost,
    Delivery,
    GroupInfo,
    GroupRead,
    PendingEntry,
    ack_args,
    checked_info,
    delivery_runs,
    group_exists,
    group_settings,
    hold_cut,
    lost_message,
    move_dead,
    no_group,
    resolve_start,
    split_over,
    warn_lost,
)
from .integrity import (
    CheckReport,
    GroupRow,
    Salvaged,
    StreamDigest,
    StreamRow,
    StreamScan,
    check_advance,
    check_copy_in,
    checksums,
    damaged,
    digest_of,
    ends_problem,
    orphan_problems,
    pending_checksum,
    pending_checksums,
    salvage_rows,
    staged_checksums,
    tailer_checksum,
    verify_at,
    verify_checksums,
    verify_get,
    verify_group,
    verify_indices,
    verify_pending,
    verify_stream_row,
    verify_tailer,
)
from .wakeup import Notifier, get_notifier, release_notifier

__all__ = ["APPLICATION_ID", "SCHEMA_VERSION", "STAGE_SHARDS", "SQLiteStore", "open_store"]

log = logging.getLogger(__name__)

APPLICATION_ID = 0x44537472  # "DStr"
SCHEMA_VERSION = 4
_HEADER = b"SQLite format 3\x00"

_GROUP_TABLES = """
CREATE TABLE consumer_groups (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    stream INTEGER NOT NULL,
    name TEXT NOT NULL,
    next_index INTEGER NOT NULL,
    created_ns INTEGER NOT NULL,
    idle_ms INTEGER,
    max_deliveries INTEGER,
    dead_letter TEXT,
    hold INTEGER NOT NULL,
    checksum INTEGER,
    UNIQUE (stream, name)
);
CREATE TABLE pending (
    grp INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    consumer TEXT NOT NULL,
    deliveries INTEGER NOT NULL,
    delivered_ns INTEGER NOT NULL,
    checksum INTEGER,
    PRIMARY KEY (grp, idx)
) WITHOUT ROWID;
"""

_SCHEMA = f"""
CREATE TABLE streams (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    next_index INTEGER NOT NULL DEFAULT 0,
    created_ns INTEGER NOT NULL,
    max_count INTEGER,
    max_age_ms INTEGER,
    first_index INTEGER NOT NULL DEFAULT 0,
    checksum INTEGER
);
CREATE TABLE entries (
    stream INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    time_ns INTEGER NOT NULL,
    value BLOB NOT NULL,
    meta BLOB,
    checksum INTEGER,
    PRIMARY KEY (stream, idx)
) WITHOUT ROWID;
CREATE TABLE tailers (
    stream INTEGER NOT NULL,
    name TEXT NOT NULL,
    position INTEGER NOT NULL,
    updated_ns INTEGER NOT NULL,
    checksum INTEGER,
    PRIMARY KEY (stream, name)
) WITHOUT ROWID;
CREATE TABLE store_meta (key TEXT PRIMARY KEY, value);
{_GROUP_TABLES}
INSERT INTO store_meta VALUES ('format', 'dataspace-streams');
INSERT INTO store_meta VALUES ('seq', 0);
PRAGMA application_id = {APPLICATION_ID};
PRAGMA user_version = {SCHEMA_VERSION};
"""

_TABLES = {"streams", "entries", "tailers", "store_meta"}
_TABLES_4 = {"consumer_groups", "pending"}  # since version 4

_MIGRATE_1_TO_2 = """
ALTER TABLE streams ADD COLUMN first_index INTEGER NOT NULL DEFAULT 0;
UPDATE streams SET first_index = coalesce(
    (SELECT min(idx) FROM entries WHERE entries.stream = streams.id), next_index);
ALTER TABLE entries ADD COLUMN checksum INTEGER;
PRAGMA user_version = 2
"""

_MIGRATE_2_TO_3 = """
ALTER TABLE streams ADD COLUMN checksum INTEGER;
ALTER TABLE tailers ADD COLUMN checksum INTEGER
"""

_MIGRATE_3_TO_4 = _GROUP_TABLES + "PRAGMA user_version = 4"

# A stream's row as the stores read it (:class:`.integrity.StreamRow`'s order), with its
# lowest and highest stored index: two index-only probes, in the same statement.
_ROW = ("SELECT s.id, s.name, s.next_index, s.created_ns, s.max_count, s.max_age_ms, "
        "s.first_index, s.checksum, "
        "(SELECT idx FROM entries WHERE stream = s.id ORDER BY idx LIMIT 1), "
        "(SELECT idx FROM entries WHERE stream = s.id ORDER BY idx DESC LIMIT 1) "
        "FROM streams s")

# A consumer group's row (:class:`.integrity.GroupRow`'s order) and a pending entry's.
_GROUP = ("SELECT id, stream, name, next_index, created_ns, idle_ms, max_deliveries, "
          "dead_letter, hold, checksum FROM consumer_groups")
_PENDING = "SELECT idx, consumer, deliveries, delivered_ns, checksum FROM pending"
# A stream's row with its probes and the row of one of its groups (NULLs: no such group).
_ROW_GROUP = (_ROW.replace(" FROM streams s", ", g.id, g.stream, g.name, g.next_index, "
                           "g.created_ns, g.idle_ms, g.max_deliveries, g.dead_letter, g.hold, "
                           "g.checksum FROM streams s LEFT JOIN consumer_groups g ON "
                           "g.stream = s.id AND g.name = ?"))
_COUNTS = ("SELECT grp, consumer, count(*), min(delivered_ns), max(delivered_ns), min(idx), "
           "max(idx) FROM pending WHERE grp IN (SELECT id FROM consumer_groups WHERE "
           "stream = ?) GROUP BY grp, consumer ORDER BY grp, consumer")

# A read's checksums, less the index (see .integrity): NULL for entries without one;
# and what a write stores, from the checksum c and the index i.
_SUM = "(checksum - idx) & 4294967295"
_SEAL = "(({c}) + (({i}) & 4294967295)) & 4294967295"

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
        self._tx: SQLiteTransaction | None = None  # the open transaction (its view of next)
        self._busy_timeout = busy_timeout
        self._stage_conns: dict[int, sqlite3.Connection] = {}  # shard -> connection (stage)
        self._attached: set[int] = set()  # shards attached to the main connection
        self._deferred_checkpoints = False
        self._groups_fd: int | None = None  # the consumer groups' queue (see _quiet)
        self._relaxed = False  # the connection is at synchronous=NORMAL (see _begin)
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
            tables = _TABLES | _TABLES_4
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
        if version < SCHEMA_VERSION:
            self._migrate(conn)
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master "
                                                 "WHERE type='table'")}
        if not _TABLES_4 <= tables:
            raise StoreCorrupt(
                f"{path} is a stream store with missing tables ({', '.join(sorted(_TABLES_4 - tables))}); "
                "move it away or restore it from a backup"
            )
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"{path}: cannot switch to WAL mode (got {mode}); is the file system local?")
        conn.execute(f"PRAGMA synchronous = {'FULL' if self.durability == 'full' else 'NORMAL'}")
        conn.execute("PRAGMA temp_store = MEMORY")
        conn.execute("PRAGMA cache_size = -32768")
        # Rows staged ahead of their commit whose metadata the commit rewrites get their
        # checksum here (append_staged with meta_cut; the other rows carry theirs).
        conn.create_function("dataspace_adler32", 2, _adler_of, deterministic=True)

    def _migrate(self, conn: sqlite3.Connection) -> None:
        """Bring a version 1 file (before checksums) or 2 (before the rows of streams and
        tailers had theirs) to this version, once (another process may be doing it at the
        same moment: the write lock decides)."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 1:
                for stmt in _MIGRATE_1_TO_2.strip().split(";"):
                    conn.execute(stmt)
                log.info("%s: migrated to store format 2 (entries are checksummed from now "
                         "on; those already there are read unverified)", self.path)
                version = 2
            if version == 2:
                for stmt in _MIGRATE_2_TO_3.strip().split(";"):
                    conn.execute(stmt)
                _seal_rows(conn)
                conn.execute("PRAGMA user_version = 3")
                log.info("%s: migrated to store format 3 (the rows of streams and tailers "
                         "carry checksums from now on, of the values they hold now)", self.path)
                version = 3
            if version == 3:
                for stmt in _MIGRATE_3_TO_4.strip().split(";"):
                    if stmt.strip():
                        conn.execute(stmt)
                log.info("%s: migrated to store format 4 (consumer groups)", self.path)
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise

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
            err = self._error(e)
            if err is e:
                raise
            raise err from e

    def _all(self, sql: str, params: Any = ()) -> list[Any]:
        """The rows of a query (a damaged page may fail the fetch, not the execute)."""
        try:
            return self._conn.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as e:
            err = self._error(e)
            if err is e:
                raise
            raise err from e

    def _one(self, sql: str, params: Any = ()) -> Any:
        try:
            return self._conn.execute(sql, params).fetchone()
        except sqlite3.DatabaseError as e:
            err = self._error(e)
            if err is e:
                raise
            raise err from e

    def _error(self, e: sqlite3.DatabaseError) -> BaseException:
        if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
            return StoreError(
                f"{self.path} stayed locked by another process for the whole busy "
                "timeout; is a long transaction running elsewhere?"
            )
        if isinstance(e, (sqlite3.IntegrityError, sqlite3.OperationalError, sqlite3.ProgrammingError)):
            return e
        return _corrupt(self.path, e)

    def _stream_id(self, name: str) -> int | None:
        # Looked up by name on every call (an indexed point query), never from a cache: a
        # stream deleted by another process (stream rm, pipeline reset) and created again
        # has a new id, and a read through the old one would find nothing.
        row = self._one("SELECT id FROM streams WHERE name = ?", (name,))
        return None if row is None else int(row[0])

    def begin(self) -> SQLiteTransaction:
        """Start a write transaction (``BEGIN IMMEDIATE``: waits for other writers up to
        the busy timeout).  Commit or roll it back from the same thread."""
        return self._begin()

    def _begin(self, *, durable: bool = True, quiet: bool = False) -> SQLiteTransaction:
        """:meth:`begin`; ``durable=False``: committed without an fsync (safe from kill
        -9, not from power loss: a consumer group's deliveries), ``quiet``: readers are
        not woken by its commit (it changes no stream)."""
        self._lock.acquire()
        try:
            self._check_open()
            if self._in_tx:
                raise StoreError("transactions do not nest")
            # The connection stays as the last transaction left it: a consumer's reads
            # follow each other without switching back and forth.
            if self.durability == "full" and self._relaxed == durable:
                self._exec(f"PRAGMA synchronous = {'FULL' if durable else 'NORMAL'}")
                self._relaxed = not durable
            self._exec("BEGIN IMMEDIATE")
            self._in_tx = True
        except BaseException:
            self._lock.release()
            raise
        tx = self._tx = SQLiteTransaction(self)
        tx._quiet = quiet
        return tx

    @contextlib.contextmanager
    def _quiet(self, durable: bool = True) -> Iterator[SQLiteTransaction]:
        """:meth:`_begin` ``quiet`` as a ``with`` block (rolled back if it raises), for a
        consumer group's operations: they queue on an ``flock`` of
        ``streams.sqlite3-groups`` first -- the kernel wakes the next at once -- where
        SQLite's busy handler would have them poll the write lock with sleeps of up to
        100 ms (four consumers of one group went from 30,000 entries/s to 11,000)."""
        fd = self._groups_fd
        if fd is None:
            try:
                fd = os.open(self.path.with_name(self.path.name + "-groups"),
                             os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise StoreError(f"cannot open {self.path}-groups: {e.strerror}") from e
            self._groups_fd = fd
        if self._in_tx and self._tx is not None:
            raise StoreError("a consumer group's read, claim or acknowledgement inside a "
                             "transaction: read before beginning the transaction that writes "
                             "its results, and acknowledge in it with Transaction.ack")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            tx = self._begin(durable=durable, quiet=True)
            try:
                yield tx
            except BaseException:
                tx.rollback()
                raise
            tx.commit()
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

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
            self._tx = None
            changed = commit and self._conn.total_changes != tx._changes0 and (
                not tx._quiet or tx._appended)
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

    def _info(self, r: tuple[Any, ...]) -> StreamInfo:
        """A stream's info from its row and probes (``_ROW``), verified, with its tailers
        (each verified); call inside :meth:`_snapshot`."""
        row = self._check_row(StreamRow(*r[:8]), r[8], r[9])
        first, nxt = row.first, row.next
        last_row = None if first >= nxt else self._one(
            "SELECT time_ns FROM entries WHERE stream = ? AND idx = ?", (row.id, nxt - 1))
        where = str(self.path)
        tailers = tuple(
            TailerInfo(row.name, t, verify_tailer(where, row.name, row.id, t, p, u, c, nxt), u)
            for t, p, u, c in self._all(
                "SELECT name, position, updated_ns, checksum FROM tailers WHERE stream = ? "
                "ORDER BY name", (row.id,)))
        return StreamInfo(
            name=row.name,
            first=first if first < nxt else None,
            next=nxt,
            count=max(nxt - first, 0),
            created_ns=row.created_ns,
            max_count=row.max_count,
            max_age=None if row.max_age_ms is None else row.max_age_ms / 1000.0,
            last_time_ns=None if last_row is None else last_row[0],
            tailers=tailers,
            groups=self._groups_of(row),
        )

    # -- consumer groups (see .groups) ----------------------------------------------------

    def _groups_of(self, srow: StreamRow) -> tuple[GroupInfo, ...]:
        """The verified groups of the verified stream row ``srow``, with their pending
        counts (call inside :meth:`_snapshot` or a transaction)."""
        rows = self._all(_GROUP + " WHERE stream = ? ORDER BY name", (srow.id,))
        if not rows:
            return ()
        counts: dict[int, list[tuple[Any, ...]]] = {}
        for gid, *rest in self._all(_COUNTS, (srow.id,)):
            counts.setdefault(gid, []).append(tuple(rest))
        where = str(self.path)
        out = []
        for r in rows:
            g = verify_group(where, srow.name, GroupRow(*r, stream=srow.name), srow.next)
            out.append(checked_info(where, srow.name, srow.first, srow.next, g,
                                    counts.get(g.id, [])))
        return tuple(out)

    def _group_row(self, srow: StreamRow, name: str) -> GroupRow:
        """The verified row of group ``name`` of ``srow`` (:class:`GroupNotFound`)."""
        r = self._one(_GROUP + " WHERE stream = ? AND name = ?", (srow.id, name))
        if r is None:
            raise no_group(str(self.path), srow.name, name)
        return verify_group(str(self.path), srow.name, GroupRow(*r, stream=srow.name), srow.next)

    def create_group(self, stream: str, name: str, *, start: int | str = "earliest",
                     idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
                     max_deliveries: int | None = None, dead_letter: str | None = None,
                     hold_retention: bool = True, exist_ok: bool = False) -> GroupInfo:
        idle_ms, dead_letter = group_settings(stream, name, idle_timeout, max_deliveries,
                                              dead_letter)
        with self._quiet() as tx:
            srow = tx._load(stream, create=True)
            assert srow is not None
            if self._one("SELECT id FROM consumer_groups WHERE stream = ? AND name = ?",
                         (srow.id, name)) is not None:
                if not exist_ok:
                    raise group_exists(stream, name)
            else:
                nxt = resolve_start(start, srow.first, srow.next, stream)
                now = time.time_ns()
                gid = self._exec(
                    "INSERT INTO consumer_groups (stream, name, next_index, created_ns, idle_ms, "
                    "max_deliveries, dead_letter, hold) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (srow.id, name, nxt, now, idle_ms, max_deliveries, dead_letter,
                     1 if hold_retention else 0)).lastrowid
                assert gid is not None
                g = GroupRow(gid, srow.id, name, nxt, now, idle_ms, max_deliveries, dead_letter,
                             hold_retention)
                self._exec("UPDATE consumer_groups SET checksum = ? WHERE id = ?", (g.seal(), gid))
        return self.group_info(stream, name)

    def delete_group(self, stream: str, name: str) -> None:
        # By its id alone: a group whose row is damaged can be removed.
        with self._quiet():
            r = self._one("SELECT g.id FROM consumer_groups g JOIN streams s ON s.id = g.stream "
                          "WHERE s.name = ? AND g.name = ?", (stream, name))
            if r is None:
                if self._stream_id(stream) is None:
                    raise StreamNotFound(f"no stream named {stream!r} in {self.path}")
                raise no_group(str(self.path), stream, name)
            self._exec("DELETE FROM pending WHERE grp = ?", (r[0],))
            self._exec("DELETE FROM consumer_groups WHERE id = ?", (r[0],))

    def groups(self, stream: str | None = None) -> list[GroupInfo]:
        with self._lock:
            self._check_open()
            with self._snapshot():
                if stream is None:
                    rows = self._all(_ROW + " WHERE s.id IN (SELECT stream FROM consumer_groups) "
                                     "ORDER BY s.name")
                else:
                    rows = self._all(_ROW + " WHERE s.name = ?", (stream,))
                    if not rows:
                        raise StreamNotFound(f"no stream named {stream!r} in {self.path}")
                out: list[GroupInfo] = []
                for r in rows:
                    out += self._groups_of(self._check_row(StreamRow(*r[:8]), r[8], r[9]))
                return out

    def group_info(self, stream: str, name: str) -> GroupInfo:
        with self._lock:
            self._check_open()
            with self._snapshot():
                srow = self._verified_row(stream)
                g = self._group_row(srow, name)
                cons = self._all("SELECT consumer, count(*), min(delivered_ns), max(delivered_ns), "
                                 "min(idx), max(idx) FROM pending WHERE grp = ? GROUP BY consumer "
                                 "ORDER BY consumer", (g.id,))
        return checked_info(str(self.path), stream, srow.first, srow.next, g, cons)

    def group_pending(self, stream: str, group: str, *, consumer: str | None = None,
                      start: int = 0, limit: int = 100) -> list[PendingEntry]:
        with self._lock:
            self._check_open()
            with self._snapshot():
                srow = self._verified_row(stream)
                g = self._group_row(srow, group)
                if consumer is None:
                    rows = self._all(_PENDING + " WHERE grp = ? AND idx >= ? ORDER BY idx LIMIT ?",
                                     (g.id, max(start, 0), max(limit, 0)))
                else:
                    rows = self._all(_PENDING + " WHERE grp = ? AND consumer = ? AND idx >= ? "
                                     "ORDER BY idx LIMIT ?", (g.id, consumer, max(start, 0),
                                                              max(limit, 0)))
        verify_pending(str(self.path), stream, g, rows)
        return [PendingEntry(i, c, d, t) for i, c, d, t, _k in rows]

    def _stream_group(self, stream: str, group: str) -> tuple[StreamRow, GroupRow]:
        """The verified rows of ``stream`` and its group ``group``, in one statement
        (inside a transaction of group operations: one that changes no stream row)."""
        r = self._one(_ROW_GROUP + " WHERE s.name = ?", (group, stream))
        if r is None:
            raise StreamNotFound(f"no stream named {stream!r} in {self.path}")
        srow = self._check_row(StreamRow(*r[:8]), r[8], r[9])
        if r[10] is None:
            raise no_group(str(self.path), stream, group)
        g = GroupRow(*r[10:], stream=stream)
        return srow, verify_group(str(self.path), stream, g, srow.next)

    def _verified_row(self, stream: str) -> StreamRow:
        r = self._one(_ROW + " WHERE s.name = ?", (stream,))
        if r is None:
            raise StreamNotFound(f"no stream named {stream!r} in {self.path}")
        return self._check_row(StreamRow(*r[:8]), r[8], r[9])

    def group_read(self, stream: str, group: str, consumer: str, count: int, *,
                   now_ns: int, recover: tuple[int, int] | None = None,
                   claim_idle: bool = True, ack: Sequence[Delivery | int] = ()) -> GroupRead:
        with self._quiet(durable=bool(ack)):
            srow, g = self._stream_group(stream, group)
            out = GroupRead()
            if ack:
                out.acked = self._ack_rows(g, stream, group, ack)
            left = count
            if recover is not None:
                after, born = recover
                rows = self._all(_PENDING + " WHERE grp = ? AND consumer = ? AND idx > ? AND "
                                 "delivered_ns < ? ORDER BY idx LIMIT ?",
                                 (g.id, consumer, after, born, left))
                verify_pending(str(self.path), stream, g, rows)
                out.recovered = len(rows) < left
                out.cursor = rows[-1][0] if rows else after
                left -= self._redeliver(srow, g, rows, consumer, now_ns, out)
            if claim_idle and g.idle_ms is not None and left > 0:
                idle = g.idle_ms * 1_000_000
                rows = self._all(_PENDING + " WHERE grp = ? AND delivered_ns <= ? AND "
                                 "consumer != ? ORDER BY idx LIMIT ?",
                                 (g.id, now_ns - idle, consumer, left))
                verify_pending(str(self.path), stream, g, rows)
                full = len(rows) == left
                left -= self._redeliver(srow, g, rows, consumer, now_ns, out)
                if full:
                    out.expiry_ns = now_ns
                else:
                    low = self._one("SELECT min(delivered_ns) FROM pending WHERE grp = ? AND "
                                    "consumer != ?", (g.id, consumer))[0]
                    out.expiry_ns = (now_ns if low is None else min(int(low), now_ns)) + idle
            elif claim_idle and g.idle_ms is None:
                out.expiry_ns = MAX_INDEX  # never claimed by a read
            if left > 0:
                self._deliver_new(srow, g, consumer, left, now_ns, out)
        if out.fetch is not None:
            with self._lock:
                self._check_open()
                out.deliveries += self._fetch(stream, *out.fetch)
            out.fetch = None
        return out

    def group_claim(self, stream: str, group: str, consumer: str, *, now_ns: int,
                    min_idle_ns: int, count: int,
                    indices: Sequence[int] | None = None) -> GroupRead:
        with self._quiet(durable=False):
            srow, g = self._stream_group(stream, group)
            out = GroupRead()
            if indices is None:
                rows = self._all(_PENDING + " WHERE grp = ? AND delivered_ns <= ? ORDER BY idx "
                                 "LIMIT ?", (g.id, now_ns - min_idle_ns, count))
            else:
                rows = []
                for k in range(0, len(indices), 500):
                    part = list(indices[k:k + 500])
                    rows += self._all(_PENDING + f" WHERE grp = ? AND delivered_ns <= ? AND idx "
                                      f"IN ({','.join('?' * len(part))}) ORDER BY idx",
                                      (g.id, now_ns - min_idle_ns, *part))
            verify_pending(str(self.path), stream, g, rows)
            self._redeliver(srow, g, rows, consumer, now_ns, out)
        return out

    def _redeliver(self, srow: StreamRow, g: GroupRow, rows: Sequence[Sequence[Any]],
                   consumer: str, now: int, out: GroupRead) -> int:
        """Deliver the pending ``rows`` (verified) again, to ``consumer`` (those over the
        group's ``max_deliveries`` go to ``out.over``); how many were delivered."""
        again, over = split_over(rows, g.max_deliveries)
        out.over += over
        if not again:
            return 0
        gone = [r[0] for r in again if r[0] < srow.first]
        if gone:  # retention removed them (a group that does not hold it)
            self._conn.executemany("DELETE FROM pending WHERE grp = ? AND idx = ?",
                                   [(g.id, i) for i in gone])
            for i in gone:
                warn_lost(str(self.path), srow.name, g.name, i, i + 1)
            out.lost += len(gone)
            again = [r for r in again if r[0] >= srow.first]
            if not again:
                return 0
        want = [r[0] for r in again]
        got = []
        for k in range(0, len(want), 500):
            part = want[k:k + 500]
            got += self._all(f"SELECT idx, seq, time_ns, value, meta, {_SUM} FROM entries WHERE "
                             f"stream = ? AND idx IN ({','.join('?' * len(part))}) ORDER BY idx",
                             (srow.id, *part))
        where = str(self.path)
        idxs = [r[0] for r in got]
        verify_at(where, srow.name, srow.first, srow.next, want, idxs)
        verify_checksums(where, srow.name, idxs, [r[3] for r in got], [r[4] for r in got],
                         [r[5] for r in got])
        self._conn.executemany(
            "UPDATE pending SET consumer = ?, deliveries = ?, delivered_ns = ?, checksum = ? "
            "WHERE grp = ? AND idx = ?",
            [(consumer, r[2] + 1, now, pending_checksum(g.id, r[0], consumer, r[2] + 1, now),
              g.id, r[0]) for r in again])
        out.deliveries += [Delivery(srow.name, i, v, m, t, q, g.name, consumer, r[2] + 1, now)
                           for (i, q, t, v, m, _c), r in zip(got, again)]
        return len(again)

    def _deliver_new(self, srow: StreamRow, g: GroupRow, consumer: str, left: int, now: int,
                     out: GroupRead) -> None:
        """Deliver up to ``left`` entries from the group's position on to ``consumer``."""
        a = max(g.next, srow.first)
        if a > g.next:
            warn_lost(str(self.path), srow.name, g.name, g.next, a)
            out.lost += a - g.next
        b = min(a + left, srow.next)
        if b <= a and a == g.next:
            return
        g.next = max(a, b)
        self._exec("UPDATE consumer_groups SET next_index = ?, checksum = ? WHERE id = ?",
                   (g.next, g.seal(), g.id))
        if b <= a:
            return
        try:
            gid = g.id
            self._conn.executemany(
                "INSERT INTO pending (grp, idx, consumer, deliveries, delivered_ns, checksum) "
                "VALUES (?, ?, ?, 1, ?, ?)",
                [(gid, i, consumer, now, c)
                 for i, c in zip(range(a, b), pending_checksums(gid, a, b, consumer, now))])
        except sqlite3.IntegrityError:
            raise damaged(str(self.path), srow.name, f"its consumer group {g.name!r} has an "
                          f"entry pending at index {a} or after, never delivered") from None
        if g.hold:
            # Their pending rows hold retention back: read them after the commit, outside
            # the consumers' queue (it is held for less than half as long).
            out.fetch = (a, b, g.name, consumer, now)
        else:
            out.deliveries += self._fetch(srow.name, a, b, g.name, consumer, now)

    def _fetch(self, stream: str, a: int, b: int, group: str, consumer: str,
               now: int) -> list[Delivery]:
        """The entries ``a <= i < b`` just delivered to ``consumer``, read and verified."""
        rows = _range(self, stream, "idx, seq, time_ns", a, b, b - a)
        return [Delivery(stream, i, v, m, t, q, group, consumer, 1, now)
                for i, q, t, v, m, _c in rows or ()]

    def group_ack(self, stream: str, group: str, items: Sequence[Delivery | int]) -> int:
        with self._quiet():
            _srow, g = self._stream_group(stream, group)
            return self._ack_rows(g, stream, group, items)

    def _ack_rows(self, g: GroupRow, stream: str, group: str,
                  items: Sequence[Delivery | int]) -> int:
        """Delete the pending rows of ``items`` (inside a transaction); how many went."""
        before = self._conn.total_changes
        ints = sorted({x for x in items if type(x) is int})
        runs = delivery_runs(g.id, stream, group, [d for d in items if type(d) is not int])
        if ints:
            self._conn.executemany("DELETE FROM pending WHERE grp = ? AND idx = ?",
                                   [(g.id, i) for i in ints])
        if runs:
            # A run of deliveries with consecutive indices, one consumer and one count of
            # deliveries (what one read gives): one statement, the rows that match each.
            self._conn.executemany("DELETE FROM pending WHERE grp = ? AND idx BETWEEN ? AND ? "
                                   "AND consumer = ? AND deliveries = ?", runs)
        return self._conn.total_changes - before

    def stream_info(self, name: str) -> StreamInfo:
        with self._lock:
            self._check_open()
            with self._snapshot():
                r = self._one(_ROW + " WHERE s.name = ?", (name,))
                if r is None:
                    raise StreamNotFound(f"no stream named {name!r} in {self.path}")
                return self._info(r)

    def streams(self, include_internal: bool = False, *,
                with_damaged: bool = False) -> list[StreamInfo]:
        with self._lock:
            self._check_open()
            with self._snapshot():
                rows = self._all(_ROW + " ORDER BY s.name")
                out = []
                for r in rows:
                    name = r[1] if type(r[1]) is str else str(r[1])
                    if not include_internal and is_reserved(name):
                        continue
                    try:
                        out.append(self._info(r))
                    except StoreCorrupt as e:
                        if not with_damaged:
                            raise
                        out.append(StreamInfo.broken(name, e))
                return out

    def delete_stream(self, name: str) -> None:
        # By its id alone: a stream whose row is damaged can be removed.
        with self.transaction() as tx:
            sid = self._stream_id(name)
            if sid is None:
                raise StreamNotFound(f"no stream named {name!r} in {self.path}")
            self._exec("DELETE FROM entries WHERE stream = ?", (sid,))
            self._exec("DELETE FROM tailers WHERE stream = ?", (sid,))
            self._exec("DELETE FROM pending WHERE grp IN (SELECT id FROM consumer_groups "
                       "WHERE stream = ?)", (sid,))
            self._exec("DELETE FROM consumer_groups WHERE stream = ?", (sid,))
            self._exec("DELETE FROM streams WHERE id = ?", (sid,))
            tx._forget(sid)

    def next_indices(self) -> dict[str, int]:
        with self._lock:
            self._check_open()
            with self._snapshot():
                return {(row := self._check_row(StreamRow(*r[:8]), r[8], r[9])).name: row.next
                        for r in self._all(_ROW)}

    def next_index(self, name: str) -> int:
        with self._lock:
            self._check_open()
            with self._snapshot():
                v = self._verified(name)
            return 0 if v is None else v[2]

    # -- reading --------------------------------------------------------------------------

    def read(self, name: str, start: int = 0, limit: int | None = None,
             end: int | None = None) -> list[Entry]:
        with self._lock:
            self._check_open()
            return _read(self, name, start, MAX_INDEX if limit is None else limit, end)

    def get(self, name: str, index: int) -> Entry | None:
        with self._lock:
            self._check_open()
            return _get(self, name, index)

    def last(self, name: str, before: int | None = None, limit: int = 1) -> list[Entry]:
        with self._lock:
            self._check_open()
            return _last(self, name, before, limit)

    def read_rows(
        self, name: str, start: int, end: int, limit: int
    ) -> list[tuple[int, int, bytes, bytes | None]]:
        with self._lock:
            self._check_open()
            return _read_rows(self, name, start, end, limit)

    def read_columns(
        self, name: str, start: int, end: int, *, values: bool = True, meta: bool = False,
        limit: int = MAX_INDEX,
    ) -> Columns:
        """One range query, transposed to columns in C (``zip``) and verified."""
        cols = "idx, seq, time_ns" + (f", value, meta, {_SUM}" if values else "")
        with self._lock:
            self._check_open()
            if limit <= 0:
                return Columns([], [], [], [], [])
            with self._snapshot():
                v = self._verified(name)
                if v is None:
                    return Columns([], [], [], [], [])
                sid, *bounds = v
                rows = self._all(
                    f"SELECT {cols} FROM entries WHERE stream = ? AND idx >= ? AND idx < ? "
                    "ORDER BY idx LIMIT ?",
                    (sid, max(start, 0), end, limit),
                )
        where = str(self.path)
        if not rows:
            verify_indices(where, name, *bounds, start, end, limit, ())
            return Columns([], [], [], [], [])
        t = [list(c) for c in zip(*rows)]
        verify_indices(where, name, *bounds, start, end, limit, t[0])
        if values:
            verify_checksums(where, name, t[0], t[3], t[4], t[5])
        return Columns(t[0], t[1], t[2], t[3] if values else [],
                       t[4] if values and meta else [])

    def first_index(self, name: str) -> int | None:
        with self._lock:
            self._check_open()
            with self._snapshot():
                v = self._verified(name)
        return None if v is None or v[1] >= v[2] else v[1]

    def salvage(self, name: str, start: int = 0, end: int = MAX_INDEX, limit: int = 1000,
                descending: bool = False) -> list[Salvaged]:
        with self._lock:
            self._check_open()
            sid = self._stream_id(name)
            if sid is None:
                raise StreamNotFound(f"no stream named {name!r} in {self.path}")
            rows = self._all(
                f"SELECT idx, seq, time_ns, value, meta, {_SUM} FROM entries WHERE stream = ? "
                f"AND idx >= ? AND idx < ? ORDER BY idx {'DESC' if descending else ''} LIMIT ?",
                (sid, max(start, 0), end, max(limit, 0)))
        return salvage_rows(name, rows)

    def digest(self, name: str, start: int = 0, end: int = MAX_INDEX, *,
               values: bool = False) -> StreamDigest:
        """Without ``values``: one aggregate over the range's stored checksums (in C),
        its count and ends checked against the stream's verified row."""
        if not values:
            with self._lock:
                self._check_open()
                with self._snapshot():
                    v = self._verified(name)
                    if v is None:
                        return StreamDigest()
                    sid, *bounds = v
                    got = self._one(
                        f"SELECT count(*), min(idx), max(idx), count(checksum), sum({_SUM}) "
                        "FROM entries WHERE stream = ? AND idx >= ? AND idx < ?",
                        (sid, max(start, 0), end))
            out = digest_of(str(self.path), name, *bounds, start, end, got)
            if out is not None:
                return out
        return super().digest(name, start, end, values=True)

    # -- verified reads (see .integrity) -------------------------------------------------

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[None]:
        """Run the reads inside in one read transaction, so that a stream's row and its
        entries agree (a write transaction of this connection is one already)."""
        if self._conn.in_transaction:
            yield
            return
        self._exec("BEGIN")
        try:
            yield
        finally:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("COMMIT")

    def _check_row(self, row: StreamRow, lo: Any, hi: Any) -> StreamRow:
        """``row`` (read with its lowest and highest stored index ``lo``, ``hi``) verified:
        its checksum, and that it holds exactly the entries it says.  Inside a write
        transaction that has the stream's row, that row instead (with the transaction's
        writes; it was verified when the transaction read it)."""
        tx = self._tx
        mine = None if tx is None else tx._rows.get(row.id)
        if mine is None:
            verify_stream_row(str(self.path), row.name, row, lo, hi)
            return row
        what = ends_problem(mine.first, mine.next, lo, hi)
        if what is not None:
            raise damaged(str(self.path), row.name, what)
        return mine

    def _verified(self, name: str) -> tuple[int, int, int] | None:
        """(id, first index, next index) of stream ``name`` as this connection sees it
        now (inside a transaction: with its writes), verified (:meth:`_check_row`); None
        if there is no such stream.  Call inside :meth:`_snapshot`."""
        r = self._one(_ROW + " WHERE s.name = ?", (name,))
        if r is None:
            return None
        row = self._check_row(StreamRow(*r[:8]), r[8], r[9])
        return row.id, row.first, row.next

    def _position(self, stream: str, tailer: str) -> int | None:
        with self._snapshot():
            v = self._verified(stream)
            if v is None:
                return None
            row = self._one("SELECT position, updated_ns, checksum FROM tailers WHERE stream = ? "
                            "AND name = ?", (v[0], tailer))
        if row is None:
            return None
        return verify_tailer(str(self.path), stream, v[0], tailer, row[0], row[1], row[2], v[2])

    # -- tailers --------------------------------------------------------------------------

    def position(self, stream: str, tailer: str) -> int | None:
        with self._lock:
            self._check_open()
            return self._position(stream, tailer)

    def set_position(self, stream: str, tailer: str, position: int) -> None:
        with self.transaction() as tx:
            tx.set_position(stream, tailer, position)

    def tailers(self, stream: str) -> list[TailerInfo]:
        return list(self.stream_info(stream).tailers)

    def lost_tailers(self) -> int:
        with self._lock:
            self._check_open()
            return int(self._one("SELECT count(*) FROM tailers WHERE stream NOT IN "
                                 "(SELECT id FROM streams)")[0])

    def delete_tailer(self, stream: str, tailer: str) -> None:
        with self.transaction():
            sid = self._stream_id(stream)
            if sid is None:
                raise StreamNotFound(f"no stream named {stream!r} in {self.path}")
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
                    # k is the rowid, 1, 2, ... in a new table (not bound: 7% faster);
                    # the checksums of the value alone and with the metadata, less the
                    # index the commit gives each row.
                    conn.execute(f"CREATE TABLE t{tid} (k INTEGER PRIMARY KEY, value BLOB NOT NULL, "
                                 "meta BLOB, vsum INTEGER NOT NULL, checksum INTEGER NOT NULL)")
                    vsums, sums = staged_checksums(stream, datas, metas)
                    _insert_values(conn, f"INSERT INTO t{tid} (value, meta, vsum, checksum) VALUES", 4,
                                   list(itertools.chain.from_iterable(zip(datas, metas, vsums, sums))))
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
            names = self._all("SELECT name FROM streams "
                              "WHERE max_count IS NOT NULL OR max_age_ms IS NOT NULL")
            deleted = 0
            for (name,) in names:
                row = tx._load(name)  # verified
                if row is not None:
                    deleted += _retain(self, row, now)
            tx._retained = deleted
        return deleted

    def check(self) -> list[str]:
        return self.check_report().problems

    def check_report(self, chunk: int = 10_000) -> CheckReport:
        """SQLite's ``PRAGMA integrity_check``, then every entry of every stream read and
        verified (indices, checksums), ``chunk`` rows a query."""
        report = CheckReport()
        with self._lock:
            self._check_open()
            try:
                rows = self._conn.execute("PRAGMA integrity_check").fetchall()
            except sqlite3.DatabaseError as e:
                report.problems.append(str(e))
                return report
            report.problems += _integrity_lines(r[0] for r in rows)
            try:
                bad = self._conn.execute(
                    "SELECT s.name, s.next_index, max(e.idx) FROM streams s JOIN entries e "
                    "ON e.stream = s.id GROUP BY s.id HAVING max(e.idx) >= s.next_index"
                ).fetchall()
                report.problems += [f"stream {n!r}: entry {m} at or beyond next index {x}"
                                    for n, x, m in bad]
                report.problems += orphan_problems(lambda t, col, parent: self._conn.execute(
                    f"SELECT count(*) FROM {t} WHERE {col} NOT IN (SELECT id FROM {parent})"
                ).fetchone()[0])
                streams = self._conn.execute("SELECT id, name FROM streams ORDER BY name").fetchall()
            except sqlite3.DatabaseError as e:
                report.problems.append(str(e))
                return report
        for sid, name in streams:
            # Each stream in one snapshot (appends and retention by others go on): its
            # row (its checksum), every entry, its tailers.
            with self._lock:
                self._check_open()
                scan = None
                try:
                    with self._snapshot():
                        r = self._conn.execute(_ROW + " WHERE s.id = ?", (sid,)).fetchone()
                        if r is None:  # deleted meanwhile
                            continue
                        row = StreamRow(*r[:8])
                        report.add_row(row)
                        scan = StreamScan(name, row.first, row.next)
                        pos = -(1 << 63)
                        while True:
                            rows = self._conn.execute(
                                f"SELECT idx, value, meta, {_SUM} FROM entries WHERE stream = ? "
                                "AND idx > ? ORDER BY idx LIMIT ?", (sid, pos, chunk)).fetchall()
                            if not rows:
                                break
                            i, v, m, c = zip(*rows)
                            scan.feed(i, v, m, c)
                            if type(i[-1]) is not int:  # a damaged key: no way on from it
                                break
                            pos = i[-1]
                        for t, p, u, c in self._conn.execute(
                                "SELECT name, position, updated_ns, checksum FROM tailers "
                                "WHERE stream = ? ORDER BY name", (sid,)).fetchall():
                            report.add_tailer(name, sid, t, p, u, c, row.next)
                        for r in self._conn.execute(_GROUP + " WHERE stream = ? ORDER BY name",
                                                    (sid,)).fetchall():
                            g = GroupRow(*r, stream=name)
                            report.add_group(name, g, row.next, self._conn.execute(
                                _PENDING + " WHERE grp = ? ORDER BY idx", (g.id,)).fetchall())
                except (sqlite3.DatabaseError, StoreCorrupt) as e:
                    report.problems.append(f"stream {name!r}: {e}")
                if scan is not None:
                    report.add(scan)
        return report

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
            if self._groups_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._groups_fd)
                self._groups_fd = None
            try:
                self._conn.close()
            finally:
                if self._notifier is not None:
                    release_notifier(self._notifier)
                    self._notifier = None

    def __repr__(self) -> str:
        return f"<SQLiteStore {self.path}>"


# -- shared read helpers (store and transaction) -----------------------------------------


def _integrity_lines(texts: Iterator[str], most: int = 20) -> list[str]:
    """``PRAGMA integrity_check``'s answer as problems of a line each: its header lines
    dropped, pages never used counted in one line, at most ``most`` lines."""
    lines = [ln.strip() for t in texts if t != "ok" for ln in t.splitlines()
             if ln.strip() and not ln.startswith("*** in database")]
    unused = [ln for ln in lines if ln.startswith("Page ") and ln.endswith(" is never used")]
    never = set(unused)
    out = [ln for ln in lines if ln not in never]
    if unused:
        out.append(f"{len(unused)} pages are never used ({unused[0][5:-14]}, ...)"
                   if len(unused) > 1 else unused[0])
    if len(out) > most:
        out = [*out[:most - 1], f"... and {len(out) - most + 1} more problems"]
    return out


def _adler_of(data: bytes | None, start: int) -> int:
    """``dataspace_adler32(blob, start)`` in SQL: zlib's Adler-32 of ``blob`` from ``start``."""
    return start if data is None else zlib.adler32(data, start)


def _range(store: SQLiteStore, name: str, cols: str, start: int, end: int,
           limit: int, desc: bool = False) -> list[tuple[Any, ...]] | None:
    """Rows of ``cols`` (``idx`` first, ``value, meta, checksum`` last) of ``start <= idx <
    end`` (newest first with ``desc``), checked against the stream's row read and
    verified in the same snapshot (None: no such stream)."""
    with store._snapshot():
        v = store._verified(name)
        if v is None:
            return None
        sid, *bounds = v
        rows = store._all(
            f"SELECT {cols}, value, meta, {_SUM} FROM entries WHERE stream = ? AND idx >= ? "
            f"AND idx < ? ORDER BY idx {'DESC' if desc else ''} LIMIT ?",
            (sid, max(start, 0), end, limit),
        )
    where = str(store.path)
    if not rows:
        verify_indices(where, name, *bounds, start, end, limit, (), desc)
        return rows
    t = list(zip(*rows))
    verify_indices(where, name, *bounds, start, end, limit, t[0], desc)
    verify_checksums(where, name, t[0], t[-3], t[-2], t[-1])
    return rows


def _read(store: SQLiteStore, name: str, start: int, limit: int, end: int | None) -> list[Entry]:
    if limit <= 0:
        return []
    rows = _range(store, name, "idx, seq, time_ns", start, MAX_INDEX if end is None else end,
                  limit)
    return [Entry(name, i, v, m, t, s) for i, s, t, v, m, _c in rows or ()]


def _read_rows(store: SQLiteStore, name: str, start: int, end: int,
               limit: int) -> list[tuple[int, int, bytes, bytes | None]]:
    if limit <= 0:
        return []
    with store._snapshot():
        v = store._verified(name)
        if v is None:
            return []
        sid, *bounds = v
        rows = store._all(
            f"SELECT idx, seq, value, meta, {_SUM} FROM entries WHERE stream = ? AND idx >= ? "
            "AND idx < ? ORDER BY idx LIMIT ?",
            (sid, start, end, limit),
        )
    where = str(store.path)
    if not rows:
        verify_indices(where, name, *bounds, start, end, limit, ())
        return rows
    i, s, v, m, c = zip(*rows)
    verify_indices(where, name, *bounds, start, end, limit, i)
    verify_checksums(where, name, i, v, m, c)
    return list(zip(i, s, v, m))


def _get(store: SQLiteStore, name: str, index: int) -> Entry | None:
    with store._snapshot():
        v = store._verified(name)
        if v is None:
            return None
        sid, *bounds = v
        row = store._one(
            f"SELECT idx, seq, time_ns, value, meta, {_SUM} FROM entries WHERE stream = ? AND idx = ?",
            (sid, index),
        )
    where = str(store.path)
    verify_get(where, name, *bounds, index, row)
    if row is None:
        return None
    i, s, t, v, m, c = row
    verify_checksums(where, name, (i,), (v,), (m,), (c,))
    return Entry(name, i, v, m, t, s)


def _last(store: SQLiteStore, name: str, before: int | None, limit: int) -> list[Entry]:
    if limit <= 0:
        return []
    rows = _range(store, name, "idx, seq, time_ns", 0,
                  MAX_INDEX if before is None else before, limit, desc=True)
    return [Entry(name, i, v, m, t, s) for i, s, t, v, m, _c in rows or ()]


def _retain(store: SQLiteStore, row: StreamRow, now_ns: int) -> int:
    """Apply ``row``'s retention (deleting below a cut, raising its first index to it:
    the row is written when the transaction ends); how many entries went."""
    cut = 0
    if row.max_count is not None:
        cut = max(cut, row.next - row.max_count)
    if row.max_age_ms is not None:
        limit_ns = now_ns - row.max_age_ms * 1_000_000
        r = store._one(
            "SELECT idx FROM entries WHERE stream = ? AND time_ns >= ? ORDER BY idx LIMIT 1",
            (row.id, limit_ns),
        )
        cut = max(cut, row.next if r is None else r[0])
    cut = min(cut, row.next)
    if cut <= row.first:
        return 0
    cut = _held(store, row, cut)
    if cut <= row.first:
        return 0
    cur = store._exec("DELETE FROM entries WHERE stream = ? AND idx < ?", (row.id, cut))
    row.first = cut
    return max(cur.rowcount, 0)


def _held(store: SQLiteStore, row: StreamRow, cut: int) -> int:
    """``cut`` lowered to the lowest index a consumer group of ``row`` holding retention
    has not acknowledged (each such group's row verified), with a warning once."""
    where = str(store.path)

    def holds() -> Iterator[tuple[GroupRow, Any]]:
        for r in store._all(_GROUP + " WHERE stream = ? AND hold", (row.id,)):
            g = verify_group(where, row.name, GroupRow(*r, stream=row.name), row.next)
            yield g, store._one("SELECT min(idx) FROM pending WHERE grp = ?", (g.id,))[0]

    return hold_cut(where, row.name, cut, holds())


class SQLiteTransaction(StreamRows, Transaction):
    """A write transaction of :class:`SQLiteStore` (see :meth:`SQLiteStore.transaction`).

    The rows of the streams it touches are read (and verified) once, kept here with its
    changes -- next and first index, retention -- and written back, each with its new
    checksum, when it commits."""

    __slots__ = ("_appended", "_changes0", "_copy_base", "_done", "_names", "_no_retention",
                 "_orig", "_quiet", "_retained", "_rows", "_seq", "_store", "_time")

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store
        self._done = False
        self._quiet = False
        self._appended = False
        self._changes0 = store._conn.total_changes
        # Stream id -> its row as of this transaction; the values it was read with (None:
        # created here); name -> id.  A writer holds the write lock, so no other process
        # changes these rows meanwhile (nothing is cached across transactions).
        self._rows: dict[int, StreamRow] = {}
        self._orig: dict[int, tuple[Any, ...] | None] = {}
        self._names: dict[str, int] = {}
        self._seq: int | None = None
        self._retained = 0
        self._time: int | None = None
        self._no_retention: set[int] = set()
        self._copy_base: int | None = None

    # -- helpers ----------------------------------------------------------------------

    def _read_row(self, name: str) -> Sequence[Any] | None:
        return self._store._one(_ROW + " WHERE s.name = ?", (name,))

    def _insert_row(self, name: str, now_ns: int) -> int:
        sid = self._store._exec("INSERT INTO streams (name, next_index, created_ns) VALUES "
                                "(?, 0, ?)", (name, now_ns)).lastrowid
        assert sid is not None
        return sid

    def _finish(self) -> None:
        store = self._store
        grew = False
        writes = []
        for sid, row in self._rows.items():
            orig = self._orig[sid]
            if orig is None or row.next != orig[0]:
                grew = grew or orig is None or row.next != orig[0]
                # Retention of the streams written, in the same transaction.
                if sid not in self._no_retention and (row.max_count is not None
                                                      or row.max_age_ms is not None):
                    self._retained += _retain(store, row, self._time or time.time_ns())
            if orig is None or (row.next, row.first, row.max_count, row.max_age_ms) != orig:
                writes.append((row.next, row.first, row.max_count, row.max_age_ms, row.seal(),
                               sid))
        if writes:
            store._conn.executemany(
                "UPDATE streams SET next_index = ?, first_index = ?, max_count = ?, "
                "max_age_ms = ?, checksum = ? WHERE id = ?", writes)
        if grew and self._seq is not None:
            store._exec("UPDATE store_meta SET value = ? WHERE key = 'seq'", (self._seq,))

    def commit(self) -> None:
        self._store._end(self, True)

    def rollback(self) -> None:
        self._store._end(self, False)

    # -- consumer groups ----------------------------------------------------------------

    def ack(self, deliveries: Delivery | Iterable[Delivery]) -> int:
        store = self._store
        ds = ack_args(deliveries)
        rows: dict[tuple[str, str], GroupRow] = {}
        for d in ds:
            g = rows.get((d.stream, d.group))
            if g is None:
                g = rows[(d.stream, d.group)] = store._group_row(self._need(d.stream), d.group)
            cur = store._exec("DELETE FROM pending WHERE grp = ? AND idx = ? AND consumer = ? AND "
                              "deliveries = ?", (g.id, d.index, d.consumer, d.deliveries))
            if cur.rowcount != 1:
                raise AckLost(lost_message(d.stream, d.group, d))
        return len(ds)

    def dead_letter(self, stream: str, group: str, entries: Sequence[PendingEntry],
                    why: str | None = None) -> int:
        store = self._store
        g = store._group_row(self._need(stream), group)

        def take(p: PendingEntry) -> bool:
            return store._exec("DELETE FROM pending WHERE grp = ? AND idx = ? AND consumer = ? "
                               "AND deliveries = ?",
                               (g.id, p.index, p.consumer, p.deliveries)).rowcount == 1

        return move_dead(self, str(store.path), stream, g, entries, why, take,
                         lambda i: _get(store, stream, i))

    # -- the interface ----------------------------------------------------------------

    def append(self, stream: str, value: Value, meta: Value | None = None) -> int:
        data = encode_value(value)
        m = None if meta is None else encode_value(meta, "metadata")
        return self.append_encoded(stream, [data], [m])

    def append_encoded(
        self, stream: str, datas: list[bytes], metas: list[bytes | None] | None = None
    ) -> int:
        row = self._load(stream, create=True)
        assert row is not None
        sid = row.id
        first = row.next
        n = len(datas)
        if n == 0:
            return first
        if first + n > MAX_INDEX:
            raise StoreError(f"stream {stream!r} is full (64-bit indices exhausted)")
        seq = self._seq
        store = self._store
        if seq is None:
            seq = store._one("SELECT value FROM store_meta WHERE key = 'seq'")[0]
        t = self._time = time.time_ns()
        # Rows are zipped in C (no per-row Python tuple building in a loop); the checksums
        # are computed in C too, and their index part is added in SQL.
        with _inserting(store, stream, first):
            self._insert(sid, first, n, seq, t, stream, datas, metas)
        self._seq = seq + n
        row.next = first + n
        self._appended = True
        return first

    def _insert(self, sid: int, first: int, n: int, seq: int, t: int, stream: str,
                datas: list[bytes], metas: list[bytes | None] | None) -> None:
        store = self._store
        if metas is None:
            store._conn.executemany(
                "INSERT INTO entries (stream, idx, seq, time_ns, value, checksum) "
                f"VALUES (?1, ?2, ?3, ?4, ?5, {_SEAL.format(c='?6', i='?2')})",
                zip(repeat(sid), range(first, first + n), range(seq, seq + n), repeat(t), datas,
                    checksums(stream, datas)),
            )
        else:
            if len(metas) != n:
                raise ValueError("append_encoded: datas and metas differ in length")
            store._conn.executemany(
                "INSERT INTO entries (stream, idx, seq, time_ns, value, meta, checksum) "
                f"VALUES (?1, ?2, ?3, ?4, ?5, ?6, {_SEAL.format(c='?7', i='?2')})",
                zip(repeat(sid), range(first, first + n), range(seq, seq + n), repeat(t), datas,
                    metas, checksums(stream, datas, metas)),
            )

    def read(self, stream: str, start: int, limit: int, end: int | None = None) -> list[Entry]:
        return _read(self._store, stream, start, limit, end)

    def read_rows(self, stream: str, start: int, end: int, limit: int) -> list[tuple[int, int, bytes, bytes | None]]:
        """The engine's fast path: ``(index, seq, value, meta)`` tuples."""
        return _read_rows(self._store, stream, start, end, limit)

    def get(self, stream: str, index: int) -> Entry | None:
        return _get(self._store, stream, index)

    def last(self, stream: str, before: int | None = None, limit: int = 1) -> list[Entry]:
        return _last(self._store, stream, before, limit)

    def first_index(self, stream: str) -> int | None:
        """The lowest stored index of ``stream`` (None when empty or absent)."""
        return self._store.first_index(stream)

    def position(self, stream: str, tailer: str) -> int | None:
        return self._store._position(stream, tailer)

    def _tailer_row(self, stream: str, tailer: str, position: Any, now: int) -> tuple[Any, ...]:
        check_tailer_name(tailer)
        if type(position) is not int or not 0 <= position <= MAX_INDEX:
            raise ValueError(f"a tailer position is an index (0 to 2**63-1), not {position!r}")
        row = self._load(stream, create=True)
        assert row is not None
        if position > row.next:
            raise ValueError(_beyond(stream, tailer, position, row.next))
        return row.id, tailer, position, now, tailer_checksum(row.id, tailer, position, now)

    def set_position(self, stream: str, tailer: str, position: int) -> None:
        self._store._exec(_UPSERT_TAILER, self._tailer_row(stream, tailer, position, time.time_ns()))

    def set_positions(self, items: list[tuple[str, str, int]]) -> None:
        """Several :meth:`set_position` calls in one statement."""
        now = time.time_ns()
        rows = [self._tailer_row(s, t, p, now) for s, t, p in items]
        self._store._conn.executemany(_UPSERT_TAILER, rows)

    def _find_staged(self, token: str, stream: str) -> tuple[int, int, int] | None:
        """(shard, table id, count) of ``token``'s rows of ``stream``, or None."""
        store = self._store
        for k in sorted(store._attached):
            row = store._one(f"SELECT id, count FROM stage{k}.staged WHERE token = ? AND stream = ?",
                              (token, stream))
            if row is not None:
                return k, row[0], row[1]
        return None

    def append_staged(self, stream: str, staged: Sequence[tuple[str, int]], *,
                      meta_cut: int = 0, meta_suffix: bytes = b"") -> int:
        row = self._load(stream, create=True)
        assert row is not None
        sid = row.id
        first = row.next
        store = self._store
        total = staged_total(stream, first, staged)
        if total == 0:
            return first
        if not store._attached:
            raise StoreError(f"stream {stream!r}: no staged rows beside {store.path} (lost?)")
        seq = self._seq
        if seq is None:
            seq = store._one("SELECT value FROM store_meta WHERE key = 'seq'")[0]
        t = self._time = time.time_ns()
        # The staged rows carry their checksums less the index (added here); where the
        # metadata is rewritten, the checksum of the value goes on over the new metadata.
        seal = _SEAL.format(c="checksum" if not meta_cut else "dataspace_adler32(meta, vsum)", i="? + k")
        at = first
        for token, n in staged:
            found = self._find_staged(token, stream)
            if found is None or found[2] != n:
                raise staged_count_error(stream, token, None if found is None else found[2], n)
            k, tid, _n = found
            params: tuple[Any, ...] = (sid, at - 1, seq + (at - first) - 1, t, at - 1)
            src = f"stage{k}.t{tid}"
            if meta_cut:
                params += (meta_cut, meta_suffix)
                src = ("(SELECT k, value, vsum, CASE WHEN meta IS NULL THEN NULL ELSE "
                       "CAST(substr(meta, 1, length(meta) - ?) || ? AS BLOB) END AS meta "
                       f"FROM {src})")
            with _inserting(store, stream, at):
                cur = store._exec(
                    f"INSERT INTO entries (stream, idx, seq, time_ns, value, meta, checksum) "
                    f"SELECT ?, ? + k, ? + k, ?, value, meta, {seal} FROM {src}", params)
            if cur.rowcount != n:
                raise staged_count_error(stream, token, cur.rowcount, n)
            at += n
        self._seq = seq + total
        row.next = at
        return first

    def drop_staged(self, owner: str) -> int:
        # The registry rows go now; the tables, whose dropping costs about as much as
        # writing them, when Store.collect_staged next runs (in the background).
        store = self._store
        dropped = 0
        for k in sorted(store._attached):
            n = store._one(f"SELECT sum(count) FROM stage{k}.staged WHERE owner = ?",
                            (owner,))[0]
            if n is not None:
                store._exec(f"DELETE FROM stage{k}.staged WHERE owner = ?", (owner,))
                dropped += n
        return dropped

    def copy_in(self, stream: str, rows: list[tuple[int, int, bytes, bytes | None, int]]) -> None:
        if not rows:
            return
        row = self._load(stream, create=True)
        assert row is not None
        sid = row.id
        nxt = row.next
        check_copy_in(stream, nxt, row.first < nxt, [r[0] for r in rows])
        store = self._store
        if row.first >= nxt:  # empty: it starts there
            row.first = rows[0][0]
        if self._copy_base is None:
            seq = self._seq
            if seq is None:
                seq = store._one("SELECT value FROM store_meta WHERE key = 'seq'")[0]
            self._copy_base = self._seq = seq
        base = self._copy_base
        sums = checksums(stream, [r[2] for r in rows], [r[3] for r in rows])
        with _inserting(store, stream, rows[0][0]):
            store._conn.executemany(
                "INSERT INTO entries (stream, idx, seq, time_ns, value, meta, checksum) "
                f"VALUES (?1, ?2, ?3, ?4, ?5, ?6, {_SEAL.format(c='?7', i='?2')})",
                [(sid, i, base + o, t, v, m, c) for (i, t, v, m, o), c in zip(rows, sums)],
            )
        self._seq = max(self._seq or 0, base + max(r[4] for r in rows) + 1)
        row.next = rows[-1][0] + 1
        self._no_retention.add(sid)

    def advance(self, stream: str, next_index: int) -> None:
        if type(next_index) is not int or not 0 <= next_index <= MAX_INDEX:
            raise ValueError(f"a next index is 0 to 2**63-1, not {next_index!r}")
        row = self._load(stream, create=True)
        assert row is not None
        if next_index > row.next:
            check_advance(stream, row.next, row.first < row.next, next_index)
            row.first = row.next = next_index


_UPSERT_TAILER = (
    "INSERT INTO tailers (stream, name, position, updated_ns, checksum) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (stream, name) DO UPDATE SET position = excluded.position, "
    "updated_ns = excluded.updated_ns, checksum = excluded.checksum")

@contextlib.contextmanager
def _inserting(store: SQLiteStore, stream: str, at: int) -> Iterator[None]:
    """Entries inserted at ``at`` and after, where the stream's row says none is stored:
    one there already (a primary key taken) is damage, said as the other reads say it."""
    try:
        yield
    except sqlite3.IntegrityError as e:
        raise damaged(str(store.path), stream, f"an entry is stored already at index {at} or "
                      f"after, where it appends ({e})") from None


def _beyond(stream: str, tailer: str, position: int, nxt: int) -> str:
    return (f"tailer {tailer!r}: position {position} is beyond the end of stream {stream!r} "
            f"(its next index is {nxt}); a tailer's position is at most that")


def _seal_rows(conn: sqlite3.Connection) -> None:
    """Give every stream and tailer row the checksum of the values it holds (migration to
    version 3); a row whose values are not integers (damaged) keeps none: reads of it fail."""
    streams = []
    for r in conn.execute("SELECT id, name, next_index, created_ns, max_count, max_age_ms, "
                          "first_index FROM streams").fetchall():
        with contextlib.suppress(TypeError, ValueError, AttributeError, OverflowError,
                                 struct.error):
            streams.append((StreamRow(*r).seal(), r[0]))
    conn.executemany("UPDATE streams SET checksum = ? WHERE id = ?", streams)
    tailers = []
    for sid, name, position, updated in conn.execute(
            "SELECT stream, name, position, updated_ns FROM tailers").fetchall():
        with contextlib.suppress(TypeError, ValueError, AttributeError, OverflowError,
                                 struct.error):
            tailers.append((tailer_checksum(sid, name, position, updated), sid, name))
    conn.executemany("UPDATE tailers SET checksum = ? WHERE stream = ? AND name = ?", tailers)
