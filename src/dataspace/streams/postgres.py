"""The PostgreSQL stream store: streams in a database that many machines reach.

``open_store("postgresql://USER:PASSWORD@HOST:PORT/DATABASE")`` opens (creating if asked)
the store in that database.  It keeps the SQLite store's semantics -- the same tables,
monotonic indices, named tailers, retention, multi-stream transactions, commit order --
with these PostgreSQL mechanisms (schema version 4, all in the schema ``dataspace``, so a
database shared with other applications is fine)::

    dataspace.store_meta   (key text PRIMARY KEY, value text)    -- format, version, id
    dataspace.streams      (id bigint identity, name UNIQUE, next_index, created_ns,
                            max_count, max_age_ms, first_index, checksum)
    dataspace.entries      (stream, idx, seq, time_ns, value bytea, meta bytea, checksum,
                            PRIMARY KEY (stream, idx))
    dataspace.tailers      (stream, name, position, updated_ns, checksum,
                            PRIMARY KEY (stream, name))
    dataspace.commit_order (id = 1, seq)                          -- the store-wide counter
    dataspace.locks        (name PRIMARY KEY, holder, since_ns)   -- who holds a lock
    dataspace.consumer_groups (id identity, stream, name, next_index, created_ns, idle_ms,
                            max_deliveries, dead_letter, hold, checksum, UNIQUE (stream, name))
    dataspace.pending      (grp, idx, consumer, deliveries, delivered_ns, checksum,
                            PRIMARY KEY (grp, idx))

* **Commit order.**  ``seq`` must follow commit order across streams (``alts`` processors
  take "whichever input has one first" by it, and a reader that sees ``seq`` q must
  already see everything below q).  A PostgreSQL sequence does not give that: two
  concurrent transactions can commit in the opposite order of their numbers.  So every
  write transaction begins by locking the one row of ``commit_order`` (``SELECT ... FOR
  UPDATE``, held until COMMIT or ROLLBACK): writers are serialised -- as SQLite's
  ``BEGIN IMMEDIATE`` does -- and numbers are handed out under that lock, so a
  transaction's numbers are all above those of every transaction committed before it,
  and the next writer starts only once it is visible.  Readers never wait.
* **Wake-ups** are LISTEN/NOTIFY, which crosses machines: a committing writer sends
  ``NOTIFY dataspace_streams`` inside its transaction (delivered at commit, once the
  commit is visible), and each process keeps one connection LISTENing per store, with a
  thread blocked in ``select(2)`` on it (no polling).  The LISTEN is in place before the
  first generation is handed out, so no wake-up is lost; a lost connection wakes every
  reader (to look again) and is re-established.
* **Locks** (one run per graph) are session advisory locks on a connection of their own:
  PostgreSQL releases them when the session ends, which it does when the holder dies.
* **Connections** come from a pool (psycopg_pool); a transaction keeps one from
  ``begin()`` to its end.  In the thread that holds a transaction, the store's own reads
  go through that transaction (they see its writes), as with SQLite.
* **Verified reads** (:mod:`.integrity`): as in SQLite, a stream's entries are exactly
  ``first_index <= idx < next_index`` and each has a checksum (``checksum``), computed in this
  process; a read joins the stream's row -- with its lowest and highest stored index --
  to its entries in one statement (one snapshot) and checks both, and the rows of
  ``streams`` and ``tailers`` carry checksums of their own.  A version 1 schema is
  migrated when opened (``checksum`` NULL for the entries already there: read
  unverified, with a note in the log); a version 1 or 2 schema's stream and tailer rows
  get the checksums of the values they hold then.
* **Consumer groups** (:mod:`.groups`) never take the commit-order lock to read or
  acknowledge: many workers on many machines would queue on it.  A read is a transaction
  of its own (``synchronous_commit`` off: a server crash may lose the last deliveries,
  which are then delivered again, as after any crash; a later fsynced commit makes them
  durable too).  Pending entries it redelivers are taken ``FOR UPDATE SKIP LOCKED`` --
  a consumer never waits for another's rows and never takes one another holds -- and
  new entries by locking the group's row, ``FOR UPDATE``, from reading it to the
  commit: consumers of one group take turns on its position for about two round trips
  each (never behind writers, nor consumers of other groups).  An acknowledgement is one
  statement deleting the pending rows (fsynced); inside a transaction it is part of
  that writer's transaction, which is what makes it exactly once.
* **Durability**: ``durability="full"`` commits with ``synchronous_commit`` on (the
  server's default: flushed before COMMIT returns); ``"normal"`` turns it off for the
  store's sessions (safe from client crashes, not from a server crash).

Passwords in URLs are never printed or logged: messages show :func:`~dataspace.datadir.
mask_url` of the URL.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import select
import socket
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..datadir import mask_url
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
    StreamRows,
    TailerInfo,
    Transaction,
    check_lock_name,
    check_stream_name,
    check_tailer_name,
    encode_value,
    staged_count_error,
    staged_total,
)
from .groups import (
    DEFAULT_IDLE_TIMEOUT,
    AckLost,
    Delivery,
    GroupInfo,
    GroupRead,
    PendingEntry,
    ack_args,
    checked_info,
    group_exists,
    group_settings,
    hold_cut,
    lost_message,
    move_dead,
    no_group,
    resolve_start,
    same_group,
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
    group_problem,
    orphan_problems,
    pending_checksum,
    pending_checksums,
    plural,
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
from .wakeup import Generation

__all__ = ["CHANNEL", "FORMAT", "SCHEMA", "SCHEMA_VERSION", "PostgresStore", "store_key"]

log = logging.getLogger(__name__)

SCHEMA = "dataspace"
FORMAT = "dataspace-streams"
SCHEMA_VERSION = 4
CHANNEL = "dataspace_streams"
_TABLES = {"store_meta", "streams", "entries", "tailers", "commit_order", "locks"}
_TABLES_4 = {"consumer_groups", "pending"}  # since version 4
_INIT_LOCK = 0x44537472  # "DStr": serialises two processes creating the schema at once

_GROUP_DDL = f"""
CREATE TABLE {SCHEMA}.consumer_groups (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    stream bigint NOT NULL,
    name text NOT NULL,
    next_index bigint NOT NULL,
    created_ns bigint NOT NULL,
    idle_ms bigint,
    max_deliveries bigint,
    dead_letter text,
    hold boolean NOT NULL,
    checksum bigint,
    UNIQUE (stream, name)
);
CREATE TABLE {SCHEMA}.pending (
    grp bigint NOT NULL,
    idx bigint NOT NULL,
    consumer text NOT NULL,
    deliveries bigint NOT NULL,
    delivered_ns bigint NOT NULL,
    checksum bigint,
    PRIMARY KEY (grp, idx)
);
"""

_DDL = f"""
CREATE SCHEMA IF NOT EXISTS {SCHEMA};
CREATE TABLE {SCHEMA}.store_meta (key text PRIMARY KEY, value text NOT NULL);
CREATE TABLE {SCHEMA}.streams (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL UNIQUE,
    next_index bigint NOT NULL DEFAULT 0,
    created_ns bigint NOT NULL,
    max_count bigint,
    max_age_ms bigint,
    first_index bigint NOT NULL DEFAULT 0,
    checksum bigint
);
CREATE TABLE {SCHEMA}.entries (
    stream bigint NOT NULL,
    idx bigint NOT NULL,
    seq bigint NOT NULL,
    time_ns bigint NOT NULL,
    value bytea NOT NULL,
    meta bytea,
    checksum bigint,
    PRIMARY KEY (stream, idx)
);
CREATE TABLE {SCHEMA}.tailers (
    stream bigint NOT NULL,
    name text NOT NULL,
    position bigint NOT NULL,
    updated_ns bigint NOT NULL,
    checksum bigint,
    PRIMARY KEY (stream, name)
);
CREATE TABLE {SCHEMA}.commit_order (id int PRIMARY KEY CHECK (id = 1), seq bigint NOT NULL);
CREATE TABLE {SCHEMA}.locks (name text PRIMARY KEY, holder text NOT NULL, since_ns bigint NOT NULL);
INSERT INTO {SCHEMA}.commit_order VALUES (1, 0);
""" + _GROUP_DDL

_E = f"{SCHEMA}.entries"
_S = f"{SCHEMA}.streams"
_T = f"{SCHEMA}.tailers"
_G = f"{SCHEMA}.consumer_groups"
_P = f"{SCHEMA}.pending"

# A consumer group's row (:class:`.integrity.GroupRow`'s order), a pending entry's, and
# the pending counts of groups per consumer.
_GROUP_COLS = ("g.id, g.stream, g.name, g.next_index, g.created_ns, g.idle_ms, "
               "g.max_deliveries, g.dead_letter, g.hold, g.checksum")
_GROUP = f"SELECT {_GROUP_COLS} FROM {_G} g"
_PENDING = f"SELECT idx, consumer, deliveries, delivered_ns, checksum FROM {_P}"
_COUNTS = (f"SELECT grp, consumer, count(*), min(delivered_ns), max(delivered_ns), min(idx), "
           f"max(idx) FROM {_P} WHERE grp = ANY(%s) GROUP BY grp, consumer ORDER BY grp, "
           "consumer COLLATE \"C\"")

_MIGRATE_1_TO_2 = f"""
ALTER TABLE {_S} ADD COLUMN first_index bigint NOT NULL DEFAULT 0;
UPDATE {_S} s SET first_index = coalesce(
    (SELECT min(idx) FROM {_E} e WHERE e.stream = s.id), s.next_index);
ALTER TABLE {_E} ADD COLUMN checksum bigint;
UPDATE {SCHEMA}.store_meta SET value = '2' WHERE key = 'version'
"""

_MIGRATE_2_TO_3 = f"""
ALTER TABLE {_S} ADD COLUMN checksum bigint;
ALTER TABLE {_T} ADD COLUMN checksum bigint
"""

# A stream's row (:class:`.integrity.StreamRow`'s order) with its lowest and highest stored
# index: two index-only probes in the same statement.
_ROW = (f"SELECT s.id, s.name, s.next_index, s.created_ns, s.max_count, s.max_age_ms, "
        f"s.first_index, s.checksum, "
        f"(SELECT idx FROM {_E} WHERE stream = s.id ORDER BY idx LIMIT 1) AS lo, "
        f"(SELECT idx FROM {_E} WHERE stream = s.id ORDER BY idx DESC LIMIT 1) AS hi "
        f"FROM {_S} s")

# The same without the table's alias.
_SUM_BARE = "(checksum - idx) & 4294967295"
# A read's checksums, less the index (see .integrity): NULL for entries without one;
# and what a write stores, from the checksum c and the index i.
_SUM = "(e.checksum - e.idx) & 4294967295"
_SEAL = "(({c}) + (({i}) & 4294967295)) & 4294967295"


def store_key(url: str) -> str:
    """A short stable name for the database a URL points at (host, port, database; not
    the user or password): where the Spark engine keeps a PostgreSQL store's checkpoints."""
    import psycopg.conninfo

    try:
        d = psycopg.conninfo.conninfo_to_dict(url)
    except Exception:
        d = {"url": mask_url(url)}
    ident = "|".join(str(d.get(k, "")) for k in ("host", "hostaddr", "port", "dbname", "url"))
    return hashlib.blake2b(ident.encode(), digest_size=5).hexdigest()


# -- errors --------------------------------------------------------------------------------


def _connect_error(display: str, e: BaseException, secret: str | None) -> StoreError:
    """One line saying what went wrong connecting and what to do."""
    text = str(e).strip()
    if secret:
        text = text.replace(secret, "***")
    low = text.lower()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    detail = lines[0] if lines else type(e).__name__
    if "failed: " in detail:
        detail = detail.rsplit("failed: ", 1)[1].strip()
    for ln in lines:
        if "fatal:" in ln.lower():
            detail = ln.split("FATAL:", 1)[-1].strip()
            break
    if "password authentication failed" in low or "no password supplied" in low:
        return StoreError(
            f"{display}: {detail}; check the user and password in the store URL (or "
            "PGPASSWORD, ~/.pgpass)"
        )
    if "does not exist" in low and "database" in low:
        return StoreError(f"{display}: {detail}; create it (createdb NAME) or fix the store URL")
    if any(k in low for k in ("connection refused", "could not connect", "timeout expired",
                              "no route to host", "could not translate host name",
                              "name or service not known", "network is unreachable",
                              "server closed the connection", "connection timed out")):
        return StoreError(
            f"cannot reach the PostgreSQL server of {display} ({detail}); is it running? "
            "Start it, or check the host and port in the store URL"
        )
    for probe in ("invalid response to ssl negotiation: ", "but received "):
        if probe in low:  # something answered, but not in PostgreSQL's protocol
            got = text[low.index(probe) + len(probe):][:1]
            what = ("speaks HTTP, not PostgreSQL" if got == "H" else
                    f"does not speak PostgreSQL (it answered {got!r})" if got.isprintable()
                    and got != "\ufffd" else "does not speak PostgreSQL (it answered in binary: "
                    "a dataspace server's port?)")
            return StoreError(
                f"cannot use the PostgreSQL store {display}: that port {what}; check the host "
                "and port in the store URL (PostgreSQL listens on 5432 by default)")
    if "invalid" in low or ("missing" in low and "=" in low):
        return StoreError(f"{display}: not a usable PostgreSQL URL ({detail}); the form is "
                          "postgresql://USER:PASSWORD@HOST:PORT/DATABASE")
    return StoreError(f"cannot use the PostgreSQL store {display}: {detail}")


def _password(url: str) -> str | None:
    import psycopg.conninfo

    try:
        return psycopg.conninfo.conninfo_to_dict(url).get("password") or None  # type: ignore[return-value]
    except Exception:
        return None


# -- wake-ups ------------------------------------------------------------------------------


class PgNotifier(Generation):
    """The generation counter of one PostgreSQL store in this process: one connection
    LISTENs and a thread blocks in ``select(2)`` on it (see the module docstring)."""

    def __init__(self, url: str, display: str, connect_timeout: int) -> None:
        super().__init__()
        self.url = url
        self.display = display
        self.connect_timeout = connect_timeout
        self._pipe: tuple[int, int] | None = None
        self._conn: Any = None
        self._thread: threading.Thread | None = None
        self.mode = "listen"

    def _listen(self) -> Any:
        import psycopg

        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=self.connect_timeout,
                               application_name="dataspace-listen")
        conn.execute(f"LISTEN {CHANNEL}")
        return conn

    def _start(self) -> None:
        from .._threads import start_daemon

        with self._cond:
            if self._started:
                return
            try:
                self._conn = self._listen()
            except Exception as e:
                raise _connect_error(self.display, e, _password(self.url)) from None
            self._pipe = os.pipe()
            self._started = True
            self._thread = start_daemon(self._watch, "streams-listen")

    def _watch(self) -> None:
        assert self._pipe is not None
        rpipe = self._pipe[0]
        backoff = 0.1
        while not self._closed:
            conn = self._conn
            if conn is None:
                # Reconnect (bounded backoff); wake readers once listening again, since
                # commits may have happened while nobody listened.
                ready, _, _ = select.select([rpipe], [], [], backoff)
                if ready:
                    return
                try:
                    self._conn = self._listen()
                except Exception as e:
                    backoff = min(backoff * 2, 5.0)
                    log.debug("cannot LISTEN on %s yet: %s", self.display, e)
                    continue
                log.warning("wake-ups from %s work again", self.display)
                backoff = 0.1
                self.bump()
                continue
            try:
                ready, _, _ = select.select([conn.fileno(), rpipe], [], [])
            except (OSError, ValueError):
                ready = []
            if rpipe in ready:
                return
            hit = False
            try:
                pg = conn.pgconn
                pg.consume_input()
                while pg.notifies() is not None:
                    hit = True
                if not hit and pg.status != 0:  # CONNECTION_OK is 0
                    raise OSError("connection lost")
            except Exception as e:
                log.warning("lost the wake-up connection to %s (%s); reconnecting", self.display,
                            str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
                with contextlib.suppress(Exception):
                    conn.close()
                self._conn = None
                hit = True
            if hit:
                self.bump()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                os.write(self._pipe[1], b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
        if self._pipe is not None:
            for p in self._pipe:
                with contextlib.suppress(OSError):
                    os.close(p)
            self._pipe = None
        self.bump()


_notifiers: dict[tuple[int, str], PgNotifier] = {}
_notifiers_lock = threading.Lock()


def _get_notifier(url: str, display: str, connect_timeout: int) -> PgNotifier:
    key = (os.getpid(), url)
    with _notifiers_lock:
        n = _notifiers.get(key)
        if n is None or n._closed:
            n = _notifiers[key] = PgNotifier(url, display, connect_timeout)
        n.refs += 1
        return n


def _release_notifier(n: PgNotifier) -> None:
    with _notifiers_lock:
        n.refs -= 1
        if n.refs > 0:
            return
        key = (os.getpid(), n.url)
        if _notifiers.get(key) is n:
            del _notifiers[key]
    n.close()


# -- the store ------------------------------------------------------------------------------


class PostgresLock(StoreLock):
    """A held :meth:`PostgresStore.lock`: a session advisory lock on its own connection."""

    def __init__(self, conn: Any, key: int, name: str) -> None:
        self.conn = conn
        self.key = key
        self.name = name

    def release(self) -> None:
        conn, self.conn = self.conn, None
        if conn is None:
            return
        with contextlib.suppress(Exception):
            conn.execute(f"DELETE FROM {SCHEMA}.locks WHERE name = %s", (self.name,))
            conn.execute("SELECT pg_advisory_unlock(%s)", (self.key,))
        with contextlib.suppress(Exception):
            conn.close()


def _lock_key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"dataspace-lock:{name}".encode(), digest_size=8).digest(),
                          "big", signed=True)


class PostgresStore(Store):
    """A stream store in a PostgreSQL database (see the module docstring).

    ``url`` is a libpq URL; ``pool_size`` the most connections the store opens for reads
    and transactions (besides one for wake-ups and one per held lock); ``busy_timeout``
    how long a writer waits for another's transaction (seconds) and ``connect_timeout``
    how long a connection attempt may take.
    """

    def __init__(
        self,
        url: str,
        *,
        create: bool = True,
        durability: str = "full",
        busy_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        pool_size: int = 8,
    ) -> None:
        if durability not in ("full", "normal"):
            raise ValueError("durability must be 'full' or 'normal'")
        self._url = url
        self._display = mask_url(url)
        self._secret = _password(url)
        self.durability = durability
        self.busy_timeout = busy_timeout
        self.connect_timeout = max(1, round(connect_timeout))
        self._closed = False
        self._local = threading.local()
        self._pool: Any = None
        self._notifier: PgNotifier | None = None
        self.store_id = ""
        self._setup(create)
        self._pool = self._make_pool(pool_size)
        self._notifier = _get_notifier(url, self._display, self.connect_timeout)

    # -- opening --------------------------------------------------------------------------

    def _kwargs(self) -> dict[str, Any]:
        return {"connect_timeout": self.connect_timeout, "application_name": "dataspace"}

    def _configure(self, conn: Any) -> None:
        conn.autocommit = True
        conn.execute(f"SET lock_timeout = {int(self.busy_timeout * 1000)}")
        if self.durability == "normal":
            conn.execute("SET synchronous_commit = off")

    def _connect(self) -> Any:
        import psycopg

        try:
            conn = psycopg.connect(self._url, autocommit=True, **self._kwargs())
        except psycopg.Error as e:
            raise _connect_error(self._display, e, self._secret) from None
        return conn

    def _make_pool(self, size: int) -> Any:
        from psycopg_pool import ConnectionPool, PoolTimeout

        from ._pglog import answered, pool_name, register_pool

        name = pool_name()
        register_pool(name, self._url)  # its retries said once, our way (_pglog)

        def configure(conn: Any) -> None:
            self._configure(conn)
            answered(name)

        pool = ConnectionPool(
            self._url, kwargs=self._kwargs(), min_size=1, max_size=max(1, size),
            configure=configure, open=False, timeout=self.busy_timeout + self.connect_timeout,
            name=name, num_workers=1, reconnect_timeout=30.0,
        )
        try:
            pool.open(wait=True, timeout=self.connect_timeout + 5)
        except PoolTimeout:
            pool.close()
            # The pool says only that it timed out: one direct attempt says why.
            self._connect().close()
            raise StoreError(f"cannot connect to {self._display} within "
                             f"{self.connect_timeout + 5} s") from None
        return pool

    def _setup(self, create: bool) -> None:
        import psycopg

        with self._connect() as conn:
            try:
                state = self._inspect(conn)
                if state == "missing" or state == "empty":
                    if not create:
                        raise StoreNotFound(
                            f"no stream store in {self._display} (the database has no "
                            f"{SCHEMA!r} schema); append to a stream first (dataspace stream "
                            "append NAME VALUE --store URL) or check the store URL"
                        )
                    with conn.transaction():
                        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_INIT_LOCK,))
                        if self._inspect(conn) in ("missing", "empty"):
                            for stmt in _DDL.strip().split(";"):
                                if stmt.strip():
                                    conn.execute(stmt)
                            import uuid

                            conn.execute(
                                f"INSERT INTO {SCHEMA}.store_meta VALUES ('format', %s), "
                                "('version', %s), ('created_ns', %s), ('id', %s)",
                                (FORMAT, str(SCHEMA_VERSION), str(time.time_ns()), uuid.uuid4().hex),
                            )
                    self._inspect(conn)
            except psycopg.errors.InsufficientPrivilege as e:
                raise StoreError(f"{self._display}: {str(e).strip().splitlines()[0]}; the store "
                                 f"needs a user that may create the schema {SCHEMA!r} and its "
                                 "tables (or create them once as a user who may)") from None
            except psycopg.OperationalError as e:
                raise _connect_error(self._display, e, self._secret) from None
            except psycopg.DatabaseError as e:
                raise StoreCorrupt(
                    f"{self._display}: the stream store's schema is damaged "
                    f"({str(e).strip().splitlines()[0]}); restore the database from a backup "
                    f"or drop the schema {SCHEMA!r} (DROP SCHEMA {SCHEMA} CASCADE) to start afresh"
                ) from None

    def _inspect(self, conn: Any) -> str:
        """``missing`` (no schema), ``empty`` (a schema without tables), or ``ok`` after
        checking that the schema is ours, of a version we read and whole."""
        d = self._display
        if conn.execute("SELECT to_regnamespace(%s)", (SCHEMA,)).fetchone()[0] is None:
            return "missing"
        tables = {r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (SCHEMA,))}
        if not tables:
            return "empty"
        if "store_meta" not in tables:
            raise ForeignStore(
                f"{d}: the schema {SCHEMA!r} holds another application's tables "
                f"({', '.join(sorted(tables)[:5])}), not a stream store; use another database "
                "in the store URL"
            )
        try:
            meta = dict(conn.execute(f"SELECT key, value FROM {SCHEMA}.store_meta").fetchall())
        except Exception as e:
            raise ForeignStore(
                f"{d}: the schema {SCHEMA!r} holds another application's store_meta table "
                f"({str(e).strip().splitlines()[0]}); use another database in the store URL"
            ) from None
        if meta.get("format") != FORMAT:
            raise ForeignStore(
                f"{d}: the schema {SCHEMA!r} holds another application's tables (format "
                f"{meta.get('format')!r}), not a stream store; use another database in the store URL"
            )
        try:
            version = int(meta.get("version", ""))
        except ValueError:
            raise StoreCorrupt(f"{d}: the stream store's version is unreadable "
                               f"({meta.get('version')!r}); restore it from a backup") from None
        if version > SCHEMA_VERSION:
            raise ForeignStore(
                f"{d} was written by a newer dataspace (store format {version}, this one reads "
                f"up to {SCHEMA_VERSION}); upgrade dataspace"
            )
        missing = _TABLES - tables
        if missing:
            raise StoreCorrupt(
                f"{d}: the stream store is missing tables ({', '.join(sorted(missing))}); restore "
                f"it from a backup, or drop the schema {SCHEMA!r} to start afresh"
            )
        if conn.execute(f"SELECT count(*) FROM {SCHEMA}.commit_order WHERE id = 1").fetchone()[0] != 1:
            raise StoreCorrupt(f"{d}: the stream store's commit counter is missing; restore it "
                               "from a backup")
        if version < SCHEMA_VERSION:
            self._migrate(conn)
            tables = {r[0] for r in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (SCHEMA,))}
        missing = _TABLES_4 - tables
        if missing:
            raise StoreCorrupt(
                f"{d}: the stream store is missing tables ({', '.join(sorted(missing))}); restore "
                f"it from a backup, or drop the schema {SCHEMA!r} to start afresh"
            )
        self.store_id = meta.get("id", "")
        return "ok"

    def _migrate(self, conn: Any) -> None:
        """Bring a version 1 schema (before checksums) or 2 (before the rows of streams
        and tailers had theirs) to this version, once (under the lock that keeps two
        processes setting up the schema apart)."""
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_INIT_LOCK,))
            v = conn.execute(f"SELECT value FROM {SCHEMA}.store_meta WHERE key = 'version'").fetchone()
            version = None if v is None else v[0]
            if version == "1":
                for stmt in _MIGRATE_1_TO_2.strip().split(";"):
                    conn.execute(stmt)
                log.info("%s: migrated to store format 2 (entries are checksummed from now on; "
                         "those already there are read unverified)", self._display)
                version = "2"
            if version == "2":
                for stmt in _MIGRATE_2_TO_3.strip().split(";"):
                    conn.execute(stmt)
                _seal_rows(conn)
                conn.execute(f"UPDATE {SCHEMA}.store_meta SET value = '3' WHERE key = 'version'")
                log.info("%s: migrated to store format 3 (the rows of streams and tailers carry "
                         "checksums from now on, of the values they hold now)", self._display)
                version = "3"
            if version == "3":
                for stmt in _GROUP_DDL.strip().split(";"):
                    if stmt.strip():
                        conn.execute(stmt)
                conn.execute(f"UPDATE {SCHEMA}.store_meta SET value = '4' WHERE key = 'version'")
                log.info("%s: migrated to store format 4 (consumer groups)", self._display)

    # -- identity -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._url

    @property
    def display(self) -> str:
        return self._display

    def __repr__(self) -> str:
        return f"<PostgresStore {self._display}>"

    # -- plumbing -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the store {self._display} is closed")

    def _fail(self, e: BaseException) -> StoreError:
        import psycopg

        if isinstance(e, psycopg.errors.LockNotAvailable):
            return StoreError(
                f"{self._display} stayed locked by another writer for the whole busy timeout "
                f"({self.busy_timeout:g} s); is a long transaction running elsewhere?"
            )
        if isinstance(e, (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn)):
            return StoreCorrupt(f"{self._display}: the stream store's schema is damaged "
                                f"({str(e).strip().splitlines()[0]}); restore it from a backup")
        if isinstance(e, psycopg.OperationalError):
            return _connect_error(self._display, e, self._secret)
        return StoreError(f"{self._display}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")

    @contextlib.contextmanager
    def _conn(self) -> Iterator[Any]:
        """A connection for a read: this thread's transaction's, else one from the pool."""
        import psycopg
        from psycopg_pool import PoolTimeout

        self._check_open()
        tx = getattr(self._local, "tx", None)
        held = tx._conn if tx is not None else getattr(self._local, "snap", None)
        if held is not None:  # this thread's transaction (or read snapshot)
            try:
                yield held
            except psycopg.Error as e:
                raise self._fail(e) from None
            return
        try:
            with self._pool.connection() as conn:
                yield conn
        except PoolTimeout:
            raise StoreError(f"no connection to {self._display} came free or could be made; "
                             "is the server up?") from None
        except psycopg.Error as e:
            raise self._fail(e) from None

    def _rows(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        with self._conn() as c:
            cur = c.cursor(binary=True)
            cur.execute(sql, params)
            return cur.fetchall()

    def _one(self, sql: str, params: Any = ()) -> tuple[Any, ...] | None:
        with self._conn() as c:
            cur = c.cursor(binary=True)
            cur.execute(sql, params)
            return cur.fetchone()

    def _sid(self, name: str) -> int | None:
        # Looked up by name on every call, never from a cache: a stream deleted by another
        # process (stream rm, pipeline reset) and created again has a new id, and a read
        # through the old one would find nothing.
        row = self._one(f"SELECT id FROM {_S} WHERE name = %s", (name,))
        return None if row is None else int(row[0])

    # -- transactions ---------------------------------------------------------------------

    def begin(self) -> PostgresTransaction:
        """Start a write transaction: waits (up to the busy timeout) for the writer before
        it, as SQLite's ``BEGIN IMMEDIATE``.  Commit or roll it back in the same thread."""
        import psycopg
        from psycopg_pool import PoolTimeout

        self._check_open()
        if getattr(self._local, "tx", None) is not None:
            raise StoreError("transactions do not nest")
        try:
            conn = self._pool.getconn()
        except PoolTimeout:
            raise StoreError(f"no connection to {self._display} came free or could be made; "
                             "is the server up?") from None
        try:
            conn.execute("BEGIN")
            seq = conn.execute(
                f"SELECT seq FROM {SCHEMA}.commit_order WHERE id = 1 FOR UPDATE").fetchone()
            if seq is None:
                raise StoreCorrupt(f"{self._display}: the stream store's commit counter is "
                                   "missing; restore it from a backup")
        except BaseException as e:
            with contextlib.suppress(Exception):
                conn.execute("ROLLBACK")
            self._pool.putconn(conn)
            if isinstance(e, psycopg.Error):
                raise self._fail(e) from None
            raise
        tx = PostgresTransaction(self, conn, int(seq[0]))
        self._local.tx = tx
        return tx

    def _end(self, tx: PostgresTransaction, commit: bool) -> None:
        import psycopg

        if tx._done:
            raise StoreError("this transaction has already ended")
        tx._done = True
        conn = tx._conn
        changed = False
        try:
            if commit:
                try:
                    changed = tx._finish()
                    conn.execute("COMMIT")
                except BaseException as e:
                    with contextlib.suppress(Exception):
                        conn.execute("ROLLBACK")
                    if isinstance(e, psycopg.Error):
                        raise self._fail(e) from None
                    raise
            else:
                with contextlib.suppress(Exception):
                    conn.execute("ROLLBACK")
        finally:
            self._local.tx = None
            with contextlib.suppress(Exception):
                self._pool.putconn(conn)
        if changed and self._notifier is not None:
            self._notifier.bump()

    def wake(self) -> None:
        self._check_open()
        assert self._notifier is not None
        self._notifier.bump()

    # -- streams --------------------------------------------------------------------------

    def create_stream(
        self, name: str, *, max_count: int | None = None, max_age: float | None = None
    ) -> StreamInfo:
        check_stream_name(name)
        with self.transaction() as tx:
            tx.create_stream(name, max_count, max_age)
        return self.stream_info(name)

    def has_stream(self, name: str) -> bool:
        self._check_open()
        return self._sid(name) is not None

    def _check_row(self, r: Sequence[Any]) -> StreamRow:
        """A stream's row read by ``_ROW`` (its columns first, then the two probes),
        verified: its checksum, and that it holds exactly the entries it says.  Inside this
        thread's write transaction, the transaction's row if it has one (with its writes;
        verified when the transaction read it)."""
        row = StreamRow(*r[:8])
        tx = getattr(self._local, "tx", None)
        mine = None if tx is None else tx._rows.get(row.id)
        if mine is None:
            verify_stream_row(self._display, row.name, row, r[8], r[9])
            return row
        what = ends_problem(mine.first, mine.next, r[8], r[9])
        if what is not None:
            raise damaged(self._display, row.name, what)
        return mine

    def _infos(self, rows: list[tuple[Any, ...]],
               with_damaged: bool = False) -> list[StreamInfo]:
        """Infos of streams from ``_ROW`` rows with the last entry's time, verified, with
        their tailers (each verified): call with the rows' connection, in one snapshot.
        ``with_damaged``: a stream that fails verification is listed, marked."""
        checked: list[tuple[StreamRow, Any]] = []
        broken: dict[str, StreamInfo] = {}
        for r in rows:
            try:
                checked.append((self._check_row(r), r[10]))
            except StoreCorrupt as e:
                if not with_damaged:
                    raise
                broken[str(r[1])] = StreamInfo.broken(str(r[1]), e)
        ids = [row.id for row, _t in checked]
        tailers: dict[int, list[TailerInfo]] = {}
        nexts = {row.id: (row.name, row.next) for row, _t in checked}
        if ids:
            for sid, t, p, u, c in self._rows(
                f"SELECT stream, name, position, updated_ns, checksum FROM {_T} WHERE stream = "
                "ANY(%s) ORDER BY stream, name", (ids,)):
                name, nxt = nexts[sid]
                try:
                    p = verify_tailer(self._display, name, sid, t, p, u, c, nxt)
                except StoreCorrupt as e:
                    if not with_damaged:
                        raise
                    broken[name] = StreamInfo.broken(name, e)
                    continue
                tailers.setdefault(sid, []).append(TailerInfo(name, t, p, u))
        groups: dict[int, tuple[GroupInfo, ...]] = {}
        if ids:
            rows_by: dict[int, StreamRow] = {row.id: row for row, _t in checked
                                             if row.name not in broken}
            for sid, got in self._groups_of(list(rows_by.values()), with_damaged).items():
                if isinstance(got, StoreCorrupt):
                    broken[rows_by[sid].name] = StreamInfo.broken(rows_by[sid].name, got)
                else:
                    groups[sid] = got
        out = []
        for row, last_t in checked:
            if row.name in broken:
                continue
            first = row.first if row.first < row.next else None
            out.append(StreamInfo(
                name=row.name, first=first, next=row.next,
                count=0 if first is None else row.next - row.first,
                created_ns=row.created_ns, max_count=row.max_count,
                max_age=None if row.max_age_ms is None else row.max_age_ms / 1000.0,
                last_time_ns=last_t, tailers=tuple(tailers.get(row.id, ())),
                groups=groups.get(row.id, ()),
            ))
        if broken:
            out = sorted([*out, *broken.values()], key=lambda i: i.name.encode())
        return out

    _INFO = (f"SELECT * FROM (SELECT r.*, (SELECT time_ns FROM {_E} e WHERE e.stream = r.id "
             f"AND e.idx = r.hi) FROM ({_ROW}) r) q")

    def _snapshot_rows(self, sql: str, params: Any = (),
                       with_damaged: bool = False) -> list[StreamInfo]:
        """:meth:`_infos` of the rows of ``sql``, with the tailers read in the same snapshot
        (a read-only REPEATABLE READ transaction, unless inside this thread's own)."""
        if getattr(self._local, "tx", None) is not None:
            return self._infos(self._rows(sql, params), with_damaged)
        with self._conn() as c:
            with c.transaction():
                c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                self._local.snap = c
                try:
                    return self._infos(self._rows(sql, params), with_damaged)
                finally:
                    self._local.snap = None

    def stream_info(self, name: str) -> StreamInfo:
        got = self._snapshot_rows(self._INFO + " WHERE q.name = %s", (name,))
        if not got:
            raise StreamNotFound(f"no stream named {name!r} in {self._display}")
        return got[0]

    def streams(self, include_internal: bool = False, *,
                with_damaged: bool = False) -> list[StreamInfo]:
        # Filtered before the rows are verified: a listing without --all does not read the
        # store's own streams.
        where = "" if include_internal else " WHERE q.name NOT LIKE '\\_\\_%%'"
        return self._snapshot_rows(self._INFO + where + " ORDER BY q.name COLLATE \"C\"",
                                   with_damaged=with_damaged)

    def delete_stream(self, name: str) -> None:
        # By its id alone: a stream whose row is damaged can be removed.
        with self.transaction() as tx:
            c = tx._conn
            row = c.execute(f"SELECT id FROM {_S} WHERE name = %s", (name,)).fetchone()
            if row is None:
                raise StreamNotFound(f"no stream named {name!r} in {self._display}")
            sid = row[0]
            c.execute(f"DELETE FROM {_E} WHERE stream = %s", (sid,))
            c.execute(f"DELETE FROM {_T} WHERE stream = %s", (sid,))
            c.execute(f"DELETE FROM {_P} WHERE grp IN (SELECT id FROM {_G} WHERE stream = %s)",
                      (sid,))
            c.execute(f"DELETE FROM {_G} WHERE stream = %s", (sid,))
            c.execute(f"DELETE FROM {_S} WHERE id = %s", (sid,))
            tx._forget(sid)
            tx._dirty = True

    def next_indices(self) -> dict[str, int]:
        self._check_open()
        return {(row := self._check_row(r)).name: row.next for r in self._rows(_ROW)}

    def next_index(self, name: str) -> int:
        self._check_open()
        r = self._one(_ROW + " WHERE s.name = %s", (name,))
        return 0 if r is None else self._check_row(r).next

    # -- reading --------------------------------------------------------------------------

    # Verified reads (.integrity): the stream's row -- with its lowest and highest stored
    # index -- joined to its entries, one statement (one snapshot), so that retention or
    # appends by others never look like damage.  The row is computed once (MATERIALIZED).

    def _range(self, name: str, cols: str, start: int, end: int, limit: int,
               values: bool = True, desc: bool = False) -> list[Any] | None:
        """The columns ``cols`` (``idx`` first; with ``values``, then ``value, meta`` and
        the checksum less the index) of ``start <= idx < end`` (newest first with
        ``desc``), as lists, checked; None: no such stream.  The stream is found by its
        name in the same statement: one round trip, and never a cached id (a stream
        another process deleted and made again has a new one)."""
        self._check_open()
        # The stream's row rides on the first row only (as one array; the others carry
        # NULL): a 1,000-row read took a third longer with its columns on every row.
        rows = self._rows(
            f"WITH s AS MATERIALIZED ({_ROW} WHERE s.name = %s) "
            f"SELECT {cols}{', e.value, e.meta, ' + _SUM if values else ''}, CASE WHEN "
            "e.rn IS NULL OR e.rn = 1 THEN ARRAY[s.id, s.next_index, s.created_ns, s.max_count, "
            "s.max_age_ms, s.first_index, s.checksum, s.lo, s.hi] END FROM s LEFT JOIN LATERAL "
            f"(SELECT x.*, row_number() OVER () AS rn FROM (SELECT * FROM {_E} WHERE stream = "
            f"s.id AND idx >= %s AND idx < %s ORDER BY idx {'DESC' if desc else ''} LIMIT %s) x) "
            "e ON true",
            (name, max(start, 0), end, limit))
        if not rows:
            return None
        a = rows[0][-1] if rows[0][-1] is not None else next(r[-1] for r in rows if r[-1])
        row = self._check_row((a[0], name, *a[1:]))
        t = [list(c) for c in zip(*rows)][:-1]
        if t[0][0] is None:  # no entries: the one row of the stream alone
            t = [[] for _c in t]
        verify_indices(self._display, name, row.first, row.next, start, end, limit, t[0], desc)
        if values:
            verify_checksums(self._display, name, t[0], t[-3], t[-2], t[-1])
        return t

    def read(self, name: str, start: int = 0, limit: int | None = None,
             end: int | None = None) -> list[Entry]:
        limit = MAX_INDEX if limit is None else limit
        if limit <= 0:
            return []
        t = self._range(name, "e.idx, e.seq, e.time_ns", start,
                        MAX_INDEX if end is None else end, limit)
        return [] if t is None else [Entry(name, *r) for r in zip(t[0], t[3], t[4], t[2], t[1])]

    def get(self, name: str, index: int) -> Entry | None:
        self._check_open()
        r = self._one(f"WITH s AS MATERIALIZED ({_ROW} WHERE s.name = %s) "
                      f"SELECT e.idx, e.seq, e.time_ns, e.value, e.meta, {_SUM}, s.* FROM s "
                      f"LEFT JOIN {_E} e ON e.stream = s.id AND e.idx = %s", (name, index))
        if r is None:
            return None
        row = self._check_row(r[-10:])
        i, q, t, v, m, c = r[:6]
        found = None if i is None else r
        verify_get(self._display, name, row.first, row.next, index, found)
        if found is None:
            return None
        verify_checksums(self._display, name, (i,), (v,), (m,), (c,))
        return Entry(name, i, v, m, t, q)

    def last(self, name: str, before: int | None = None, limit: int = 1) -> list[Entry]:
        if limit <= 0:
            return []
        t = self._range(name, "e.idx, e.seq, e.time_ns", 0,
                        MAX_INDEX if before is None else before, limit, desc=True)
        return [] if t is None else [Entry(name, *r) for r in zip(t[0], t[3], t[4], t[2], t[1])]

    def read_rows(
        self, name: str, start: int, end: int, limit: int
    ) -> list[tuple[int, int, bytes, bytes | None]]:
        if limit <= 0:
            return []
        t = self._range(name, "e.idx, e.seq", start, end, limit)
        return [] if t is None else list(zip(t[0], t[1], t[2], t[3]))

    def read_columns(
        self, name: str, start: int, end: int, *, values: bool = True, meta: bool = False,
        limit: int = MAX_INDEX,
    ) -> Columns:
        """One range query, transposed to columns in C (``zip``) and verified."""
        t = None if limit <= 0 else self._range(
            name, "e.idx, e.seq, e.time_ns", start, end, limit, values=values)
        if t is None or not t[0]:
            return Columns([], [], [], [], [])
        return Columns(t[0], t[1], t[2], t[3] if values else [], t[4] if values and meta else [])

    def first_index(self, name: str) -> int | None:
        self._check_open()
        r = self._one(_ROW + " WHERE s.name = %s", (name,))
        if r is None:
            return None
        row = self._check_row(r)
        return row.first if row.first < row.next else None

    def salvage(self, name: str, start: int = 0, end: int = MAX_INDEX, limit: int = 1000,
                descending: bool = False) -> list[Salvaged]:
        self._check_open()
        rows = self._rows(
            f"SELECT s.id, e.idx, e.seq, e.time_ns, e.value, e.meta, {_SUM} FROM {_S} s LEFT JOIN "
            f"LATERAL (SELECT * FROM {_E} WHERE stream = s.id AND idx >= %s AND idx < %s ORDER "
            f"BY idx {'DESC' if descending else ''} LIMIT %s) e ON true WHERE s.name = %s",
            (max(start, 0), end, max(limit, 0), name))
        if not rows:
            raise StreamNotFound(f"no stream named {name!r} in {self._display}")
        return salvage_rows(name, [r[1:] for r in rows if r[1] is not None])

    def digest(self, name: str, start: int = 0, end: int = MAX_INDEX, *,
               values: bool = False) -> StreamDigest:
        """Without ``values``: one aggregate over the range's stored checksums, its count
        and ends checked against the stream's verified row (one statement)."""
        if not values:
            self._check_open()
            r = self._one(
                f"WITH s AS MATERIALIZED ({_ROW} WHERE s.name = %s) SELECT s.*, a.* FROM s "
                f"CROSS JOIN LATERAL (SELECT count(*), min(idx), max(idx), count(checksum), "
                f"sum({_SUM_BARE}) FROM {_E} WHERE stream = s.id AND idx >= %s AND idx < %s) a",
                (name, max(start, 0), end))
            if r is None:
                return StreamDigest()
            row = self._check_row(r)
            got = tuple(None if x is None else int(x) for x in r[10:15])
            out = digest_of(self._display, name, row.first, row.next, start, end, got)
            if out is not None:
                return out
        return super().digest(name, start, end, values=True)

    # -- consumer groups (see .groups) ----------------------------------------------------

    def _groups_of(self, srows: list[StreamRow], with_damaged: bool = False
                   ) -> dict[int, tuple[GroupInfo, ...] | StoreCorrupt]:
        """The verified groups of verified stream rows, by stream id, with their pending
        counts (``with_damaged``: a stream whose groups fail verification gets its error
        instead); on this thread's connection (snapshot or transaction)."""
        by = {r.id: r for r in srows}
        rows = self._rows(_GROUP + " WHERE g.stream = ANY(%s) ORDER BY g.stream, g.name COLLATE "
                          "\"C\"", (list(by),)) if by else []
        if not rows:
            return {}
        counts: dict[int, list[tuple[Any, ...]]] = {}
        for gid, *rest in self._rows(_COUNTS, ([r[0] for r in rows],)):
            counts.setdefault(gid, []).append(tuple(rest))
        out: dict[int, Any] = {}
        for r in rows:
            srow = by[r[1]]
            if isinstance(out.get(srow.id), StoreCorrupt):
                continue
            try:
                g = verify_group(self._display, srow.name, GroupRow(*r, stream=srow.name),
                                 srow.next)
                info = checked_info(self._display, srow.name, srow.first, srow.next, g,
                                    counts.get(g.id, []))
            except StoreCorrupt as e:
                if not with_damaged:
                    raise
                out[srow.id] = e
                continue
            out[srow.id] = (*out.get(srow.id, ()), info)
        return out

    def _stream_group(self, conn: Any, stream: str, group: str, lock: bool = False,
                      again: bool = True) -> tuple[StreamRow, GroupRow]:
        """The verified rows of ``stream`` and its group ``group`` on ``conn`` (one
        statement); ``lock``: the group's row ``FOR UPDATE``."""
        cur = conn.cursor(binary=True)
        r = cur.execute(f"SELECT r.*, {_GROUP_COLS} FROM ({_ROW} WHERE s.name = %s) r JOIN {_G} g "
                        f"ON g.stream = r.id AND g.name = %s"
                        + (" FOR UPDATE OF g" if lock else ""), (stream, group)).fetchone()
        if r is None:
            if cur.execute(f"SELECT 1 FROM {_S} WHERE name = %s", (stream,)).fetchone() is None:
                raise StreamNotFound(f"no stream named {stream!r} in {self._display}")
            raise no_group(self._display, stream, group)
        srow = self._check_row(r[:10])
        g = GroupRow(*r[10:], stream=stream)
        if lock and again and group_problem(g, srow.next) is not None:
            # A lock waited for: PostgreSQL gives the group's row as the consumer before
            # committed it, the stream's as of the statement's start -- before the appends
            # that consumer took.  Read both again (the row is ours now: no wait).
            return self._stream_group(conn, stream, group, lock, again=False)
        return srow, verify_group(self._display, stream, g, srow.next)

    def create_group(self, stream: str, name: str, *, start: int | str = "earliest",
                     idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
                     max_deliveries: int | None = None, dead_letter: str | None = None,
                     hold_retention: bool = True, exist_ok: bool = False) -> GroupInfo:
        idle_ms, dead_letter = group_settings(stream, name, idle_timeout, max_deliveries,
                                              dead_letter)
        with self.transaction() as tx:
            srow = tx._writable(stream)
            if tx._q(f"SELECT id FROM {_G} WHERE stream = %s AND name = %s",
                     (srow.id, name)).fetchone() is not None:
                if not exist_ok:
                    raise group_exists(stream, name)
            else:
                nxt = resolve_start(start, srow.first, srow.next, stream)
                now = time.time_ns()
                gid = int(tx._q(
                    f"INSERT INTO {_G} (stream, name, next_index, created_ns, idle_ms, "
                    "max_deliveries, dead_letter, hold) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
                    "RETURNING id", (srow.id, name, nxt, now, idle_ms, max_deliveries,
                                     dead_letter, bool(hold_retention))).fetchone()[0])
                g = GroupRow(gid, srow.id, name, nxt, now, idle_ms, max_deliveries, dead_letter,
                             hold_retention)
                tx._q(f"UPDATE {_G} SET checksum = %s WHERE id = %s", (g.seal(), gid))
        return self.group_info(stream, name)

    def delete_group(self, stream: str, name: str) -> None:
        # By its id alone: a group whose row is damaged can be removed.
        with self.transaction() as tx:
            r = tx._q(f"SELECT g.id FROM {_G} g JOIN {_S} s ON s.id = g.stream WHERE s.name = %s "
                      "AND g.name = %s", (stream, name)).fetchone()
            if r is None:
                if tx._q(f"SELECT 1 FROM {_S} WHERE name = %s", (stream,)).fetchone() is None:
                    raise StreamNotFound(f"no stream named {stream!r} in {self._display}")
                raise no_group(self._display, stream, name)
            tx._q(f"DELETE FROM {_P} WHERE grp = %s", (r[0],))
            tx._q(f"DELETE FROM {_G} WHERE id = %s", (r[0],))

    def groups(self, stream: str | None = None) -> list[GroupInfo]:
        self._check_open()
        with self._snapshot():
            if stream is None:
                rows = self._rows(_ROW + f" WHERE s.id IN (SELECT stream FROM {_G}) ORDER BY "
                                  "s.name COLLATE \"C\"")
            else:
                rows = self._rows(_ROW + " WHERE s.name = %s", (stream,))
                if not rows:
                    raise StreamNotFound(f"no stream named {stream!r} in {self._display}")
            srows = [self._check_row(r) for r in rows]
            got = self._groups_of(srows)
        return [g for r in srows for g in got.get(r.id, ())]  # type: ignore[union-attr]

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[None]:
        """Reads of this thread in one read-only REPEATABLE READ snapshot (unless inside
        this thread's transaction or snapshot already)."""
        if getattr(self._local, "tx", None) is not None or getattr(self._local, "snap", None):
            yield
            return
        with self._conn() as c, c.transaction():
            c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            self._local.snap = c
            try:
                yield
            finally:
                self._local.snap = None

    def group_info(self, stream: str, name: str) -> GroupInfo:
        self._check_open()
        with self._snapshot(), self._conn() as c:
            srow, g = self._stream_group(c, stream, name)
            cons = c.execute(f"SELECT consumer, count(*), min(delivered_ns), max(delivered_ns), "
                             f"min(idx), max(idx) FROM {_P} WHERE grp = %s GROUP BY consumer "
                             "ORDER BY consumer COLLATE \"C\"", (g.id,)).fetchall()
        return checked_info(self._display, stream, srow.first, srow.next, g, cons)

    def group_pending(self, stream: str, group: str, *, consumer: str | None = None,
                      start: int = 0, limit: int = 100) -> list[PendingEntry]:
        self._check_open()
        with self._snapshot(), self._conn() as c:
            _srow, g = self._stream_group(c, stream, group)
            if consumer is None:
                rows = c.execute(_PENDING + " WHERE grp = %s AND idx >= %s ORDER BY idx LIMIT %s",
                                 (g.id, max(start, 0), max(limit, 0))).fetchall()
            else:
                rows = c.execute(_PENDING + " WHERE grp = %s AND consumer = %s AND idx >= %s "
                                 "ORDER BY idx LIMIT %s",
                                 (g.id, consumer, max(start, 0), max(limit, 0))).fetchall()
        verify_pending(self._display, stream, g, rows)
        return [PendingEntry(i, cn, d, t) for i, cn, d, t, _k in rows]

    @contextlib.contextmanager
    def _claiming(self, durable: bool = False) -> Iterator[Any]:
        """A connection in a transaction of its own for a consumer group's read or claim:
        ``synchronous_commit`` off, never the commit-order lock (see the module
        docstring); committed at the end of the block, rolled back if it raises."""
        import psycopg

        self._check_open()
        if getattr(self._local, "tx", None) is not None:
            raise StoreError("a consumer group's read, claim or acknowledgement inside a "
                             "transaction: read before beginning the transaction that writes "
                             "its results, and acknowledge in it with Transaction.ack")
        with self._conn() as conn:
            try:
                conn.execute("BEGIN" if durable else "BEGIN; SET LOCAL synchronous_commit TO OFF")
                yield conn
                conn.execute("COMMIT")
            except BaseException as e:
                with contextlib.suppress(Exception):
                    conn.execute("ROLLBACK")
                if isinstance(e, psycopg.Error):
                    if isinstance(e, psycopg.errors.UniqueViolation):
                        raise StoreCorrupt(f"{self._display}: a pending entry of a consumer "
                                           "group is stored already where one is delivered "
                                           f"({str(e).strip().splitlines()[0]})") from None
                    raise self._fail(e) from None
                raise

    def group_read(self, stream: str, group: str, consumer: str, count: int, *,
                   now_ns: int, recover: tuple[int, int] | None = None,
                   claim_idle: bool = True, ack: Sequence[Delivery | int] = ()) -> GroupRead:
        out = GroupRead()
        with self._claiming(durable=bool(ack)) as conn:
            cur = conn.cursor(binary=True)
            early = recover is not None or claim_idle
            srow, g = self._stream_group(conn, stream, group, lock=not early)
            if ack:
                out.acked = _ack_rows(cur, g.id, stream, group, ack)
            left = count
            if recover is not None:
                after, born = recover
                rows = cur.execute(_PENDING + " WHERE grp = %s AND consumer = %s AND idx > %s "
                                   "AND delivered_ns < %s ORDER BY idx LIMIT %s FOR UPDATE SKIP "
                                   "LOCKED", (g.id, consumer, after, born, left)).fetchall()
                verify_pending(self._display, stream, g, rows)
                out.recovered = len(rows) < left
                out.cursor = rows[-1][0] if rows else after
                left -= self._redeliver(cur, srow, g, rows, consumer, now_ns, out)
            if claim_idle and g.idle_ms is not None and left > 0:
                idle = g.idle_ms * 1_000_000
                rows = cur.execute(_PENDING + " WHERE grp = %s AND delivered_ns <= %s AND "
                                   "consumer <> %s ORDER BY idx LIMIT %s FOR UPDATE SKIP LOCKED",
                                   (g.id, now_ns - idle, consumer, left)).fetchall()
                verify_pending(self._display, stream, g, rows)
                full = len(rows) == left
                left -= self._redeliver(cur, srow, g, rows, consumer, now_ns, out)
                if full:
                    out.expiry_ns = now_ns
                else:
                    low = cur.execute(f"SELECT min(delivered_ns) FROM {_P} WHERE grp = %s AND "
                                      "consumer <> %s", (g.id, consumer)).fetchone()[0]
                    out.expiry_ns = (now_ns if low is None else min(int(low), now_ns)) + idle
            elif claim_idle and g.idle_ms is None:
                out.expiry_ns = MAX_INDEX  # never claimed by a read
            if left > 0:
                if early:  # now the position: its row locked, read again
                    srow, g = self._stream_group(conn, stream, group, lock=True)
                self._deliver_new(cur, srow, g, consumer, left, now_ns, out)
        if out.fetch is not None:
            a, b, gname, cname, now = out.fetch
            out.fetch = None
            t = self._range(stream, "e.idx, e.seq, e.time_ns", a, b, b - a)
            if t is not None:
                out.deliveries += [Delivery(stream, i, v, m, tm, q, gname, cname, 1, now)
                                   for i, q, tm, v, m in zip(t[0], t[1], t[2], t[3], t[4])]
        return out

    def group_claim(self, stream: str, group: str, consumer: str, *, now_ns: int,
                    min_idle_ns: int, count: int,
                    indices: Sequence[int] | None = None) -> GroupRead:
        out = GroupRead()
        with self._claiming() as conn:
            cur = conn.cursor(binary=True)
            srow, g = self._stream_group(conn, stream, group)
            if indices is None:
                rows = cur.execute(_PENDING + " WHERE grp = %s AND delivered_ns <= %s ORDER BY "
                                   "idx LIMIT %s FOR UPDATE SKIP LOCKED",
                                   (g.id, now_ns - min_idle_ns, count)).fetchall()
            else:
                rows = cur.execute(_PENDING + " WHERE grp = %s AND delivered_ns <= %s AND idx = "
                                   "ANY(%s) ORDER BY idx FOR UPDATE SKIP LOCKED",
                                   (g.id, now_ns - min_idle_ns, list(indices))).fetchall()
            verify_pending(self._display, stream, g, rows)
            self._redeliver(cur, srow, g, rows, consumer, now_ns, out)
        return out

    def _redeliver(self, cur: Any, srow: StreamRow, g: GroupRow, rows: Sequence[Sequence[Any]],
                   consumer: str, now: int, out: GroupRead) -> int:
        """Deliver the pending ``rows`` (verified, locked) again, to ``consumer`` (those
        over the group's ``max_deliveries`` go to ``out.over``); how many were."""
        again, over = split_over(rows, g.max_deliveries)
        out.over += over
        if not again:
            return 0
        want = [r[0] for r in again]
        got = cur.execute(f"WITH s AS MATERIALIZED ({_ROW} WHERE s.id = %s) SELECT e.idx, e.seq, "
                          f"e.time_ns, e.value, e.meta, {_SUM}, s.first_index FROM s LEFT JOIN "
                          f"{_E} e ON e.stream = s.id AND e.idx = ANY(%s) ORDER BY e.idx",
                          (srow.id, want)).fetchall()
        first = got[0][6] if got else srow.first
        got = [r for r in got if r[0] is not None]
        gone = [i for i in want if i < max(first, srow.first)]
        if gone:  # retention removed them (a group that does not hold it)
            cur.execute(f"DELETE FROM {_P} WHERE grp = %s AND idx = ANY(%s)", (g.id, gone))
            for i in gone:
                warn_lost(self._display, srow.name, g.name, i, i + 1)
            out.lost += len(gone)
            again = [r for r in again if r[0] not in set(gone)]
            got = [r for r in got if r[0] not in set(gone)]
            want = [r[0] for r in again]
            if not again:
                return 0
        idxs = [r[0] for r in got]
        verify_at(self._display, srow.name, srow.first, srow.next, want, idxs)
        verify_checksums(self._display, srow.name, idxs, [r[3] for r in got],
                         [r[4] for r in got], [r[5] for r in got])
        cur.execute(f"UPDATE {_P} p SET consumer = %s, deliveries = u.d, delivered_ns = %s, "
                    "checksum = u.c FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[]) AS "
                    "u(i, d, c) WHERE p.grp = %s AND p.idx = u.i",
                    (consumer, now, want, [r[2] + 1 for r in again],
                     [pending_checksum(g.id, r[0], consumer, r[2] + 1, now) for r in again], g.id))
        out.deliveries += [Delivery(srow.name, i, v, m, t, q, g.name, consumer, r[2] + 1, now)
                           for (i, q, t, v, m, _c, _f), r in zip(got, again)]
        return len(again)

    def _deliver_new(self, cur: Any, srow: StreamRow, g: GroupRow, consumer: str, left: int,
                     now: int, out: GroupRead) -> None:
        """Deliver up to ``left`` entries from the group's position (its row locked) on to
        ``consumer``: the position, the pending rows and the entries in one statement."""
        a = max(g.next, srow.first)
        if a > g.next:
            warn_lost(self._display, srow.name, g.name, g.next, a)
            out.lost += a - g.next
        b = min(a + left, srow.next)
        if b <= a and a == g.next:
            return
        g.next = max(a, b)
        g.seal()
        idxs = list(range(a, b))
        if g.hold and b > a:
            # Their pending rows hold retention back: read them after the commit, with the
            # group's row no longer locked (the next consumer's read goes on meanwhile).
            cur.execute(
                f"WITH u AS (UPDATE {_G} SET next_index = %s, checksum = %s WHERE id = %s) "
                f"INSERT INTO {_P} (grp, idx, consumer, deliveries, delivered_ns, checksum) "
                "SELECT %s, i, %s, 1, %s, c FROM unnest(%b::bigint[], %b::bigint[]) AS x(i, c)",
                (g.next, g.checksum, g.id, g.id, consumer, now, idxs,
                 pending_checksums(g.id, a, b, consumer, now)))
            out.fetch = (a, b, g.name, consumer, now)
            return
        rows = cur.execute(
            f"WITH u AS (UPDATE {_G} SET next_index = %s, checksum = %s WHERE id = %s), "
            f"p AS (INSERT INTO {_P} (grp, idx, consumer, deliveries, delivered_ns, checksum) "
            "SELECT %s, i, %s, 1, %s, c FROM unnest(%b::bigint[], %b::bigint[]) AS x(i, c)) "
            f"SELECT e.idx, e.seq, e.time_ns, e.value, e.meta, {_SUM} FROM {_E} e WHERE "
            "e.stream = %s AND e.idx >= %s AND e.idx < %s ORDER BY e.idx",
            (g.next, g.checksum, g.id, g.id, consumer, now, idxs,
             pending_checksums(g.id, a, b, consumer, now), srow.id, a, b)
        ).fetchall()
        if b <= a:
            return
        t = [list(c) for c in zip(*rows)] or [[], [], [], [], [], []]
        if t[0] != idxs and not g.hold:
            # Retention (which this group does not hold) may have removed some since the
            # stream's row was read: what it holds now decides.
            first = cur.execute(f"SELECT first_index FROM {_S} WHERE id = %s",
                                (srow.id,)).fetchone()[0]
            gone = [i for i in idxs if i < first]
            if gone:
                cur.execute(f"DELETE FROM {_P} WHERE grp = %s AND idx = ANY(%s)", (g.id, gone))
                warn_lost(self._display, srow.name, g.name, gone[0], gone[-1] + 1)
                out.lost += len(gone)
                a = gone[-1] + 1
                idxs = idxs[len(gone):]
        verify_indices(self._display, srow.name, srow.first, srow.next, a, b, b - a, t[0])
        verify_checksums(self._display, srow.name, t[0], t[3], t[4], t[5])
        out.deliveries += [Delivery(srow.name, i, v, m, tm, q, g.name, consumer, 1, now)
                           for i, q, tm, v, m in zip(t[0], t[1], t[2], t[3], t[4])]

    def group_ack(self, stream: str, group: str, items: Sequence[Delivery | int]) -> int:
        self._check_open()
        gid = (f"(SELECT g.id FROM {_G} g JOIN {_S} s ON s.id = g.stream WHERE s.name = %s AND "
               "g.name = %s)")
        with self._conn() as c, c.transaction():
            n = _ack_rows(c.cursor(), gid, stream, group, items, (stream, group))
            if n == 0 and c.execute(gid[1:-1], (stream, group)).fetchone() is None:
                raise no_group(self._display, stream, group)
        return n

    # -- tailers --------------------------------------------------------------------------

    def position(self, stream: str, tailer: str) -> int | None:
        self._check_open()
        r = self._one(f"WITH s AS MATERIALIZED ({_ROW} WHERE s.name = %s) SELECT s.*, "
                      f"t.position, t.updated_ns, t.checksum, t.name FROM s LEFT JOIN {_T} t "
                      "ON t.stream = s.id AND t.name = %s", (stream, tailer))
        if r is None:
            return None
        row = self._check_row(r)
        if r[13] is None:
            return None
        return verify_tailer(self._display, stream, row.id, tailer, r[10], r[11], r[12], row.next)

    def set_position(self, stream: str, tailer: str, position: int) -> None:
        with self.transaction() as tx:
            tx.set_position(stream, tailer, position)

    def tailers(self, stream: str) -> list[TailerInfo]:
        return list(self.stream_info(stream).tailers)

    def lost_tailers(self) -> int:
        self._check_open()
        row = self._one(f"SELECT count(*) FROM {_T} WHERE stream NOT IN (SELECT id FROM {_S})")
        return 0 if row is None else int(row[0])

    def delete_tailer(self, stream: str, tailer: str) -> None:
        with self.transaction() as tx:
            row = tx._conn.execute(f"SELECT id FROM {_S} WHERE name = %s", (stream,)).fetchone()
            if row is None:
                raise StreamNotFound(f"no stream named {stream!r} in {self._display}")
            tx._conn.execute(f"DELETE FROM {_T} WHERE stream = %s AND name = %s", (row[0], tailer))
            tx._dirty = True

    # -- locks ----------------------------------------------------------------------------

    def lock(self, name: str, note: str = "") -> PostgresLock:
        """A session advisory lock on a connection of its own (released by the server when
        that session ends: the holder released it, exited or died)."""
        self._check_open()
        check_lock_name(name)
        key = _lock_key(name)
        conn = self._connect()
        try:
            # The server notices a holder whose machine vanished (no FIN ever comes) by TCP
            # keepalives: about 25 s with these, instead of the system's two hours.
            for setting in ("tcp_keepalives_idle = 10", "tcp_keepalives_interval = 5",
                            "tcp_keepalives_count = 3"):
                conn.execute(f"SET {setting}")
            got = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]
            if not got:
                holder = self.lock_holder(name) or "another process"
                raise LockHeld(name, holder)
            conn.execute(
                f"INSERT INTO {SCHEMA}.locks VALUES (%s, %s, %s) ON CONFLICT (name) DO UPDATE "
                "SET holder = excluded.holder, since_ns = excluded.since_ns",
                (name, f"pid {os.getpid()} on {socket.gethostname()}" + (f", {note}" if note else ""),
                 time.time_ns()))
        except BaseException as e:
            with contextlib.suppress(Exception):
                conn.close()
            import psycopg

            if isinstance(e, psycopg.Error):
                raise self._fail(e) from None
            raise
        return PostgresLock(conn, key, name)

    def lock_holder(self, name: str) -> str | None:
        key = _lock_key(name) & 0xFFFFFFFFFFFFFFFF
        row = self._one(
            "SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND l.classid::text::bigint = %s AND l.objid::text::bigint = %s AND l.objsubid = 1",
            (key >> 32, key & 0xFFFFFFFF))
        if row is None:
            return None
        h = self._one(f"SELECT holder FROM {SCHEMA}.locks WHERE name = %s", (name,))
        return str(h[0]) if h else f"server process {row[0]}"

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
        """How other processes' commits wake readers: ``listen`` (LISTEN/NOTIFY)."""
        return "listen"

    # -- staging ------------------------------------------------------------------------

    def stage(self, owner: str, token: str,
              rows: Mapping[str, tuple[Sequence[bytes], Sequence[bytes | None]]]) -> None:
        """Each stream's rows go into an UNLOGGED table of their own (``staged_ID``,
        registered in ``staged``), in a transaction that does not wait for the flush
        (``synchronous_commit = off``) nor take the commit-order lock; the commit takes
        them with ``INSERT ... SELECT`` and drops the table.  Rows lost by a server crash
        are missed by the commit's count check, which then fails the batch."""
        import psycopg

        with self._conn() as conn:
            if getattr(self._local, "tx", None) is not None:
                raise StoreError("stage() inside a transaction")
            try:
                with conn.transaction():
                    conn.execute("SET LOCAL synchronous_commit = off")
                    _ensure_staged(conn)
                    cur = conn.cursor(binary=True)
                    for stream, (datas, metas) in rows.items():
                        if len(metas) != len(datas):
                            raise ValueError("stage: datas and metas differ in length")
                        tid = cur.execute(
                            f"INSERT INTO {_STAGED} (owner, token, stream, count) "
                            "VALUES (%s, %s, %s, %s) RETURNING id",
                            (owner, token, stream, len(datas))).fetchone()[0]
                        # With the checksums of the value alone and with the metadata,
                        # less the index the commit gives each row.
                        cur.execute(f"CREATE UNLOGGED TABLE {SCHEMA}.staged_{int(tid)} "
                                    "(k int NOT NULL, value bytea NOT NULL, meta bytea, "
                                    "vsum bigint NOT NULL, checksum bigint NOT NULL)")
                        vsums, sums = staged_checksums(stream, datas, metas)
                        cur.execute(f"INSERT INTO {SCHEMA}.staged_{int(tid)} (k, value, meta, vsum, checksum) "
                                    "SELECT o - 1, v, m, vc, c FROM unnest(%b::bytea[], %b::bytea[], "
                                    "%b::bigint[], %b::bigint[]) WITH ORDINALITY AS u(v, m, vc, c, o)",
                                    (list(datas), list(metas), vsums, sums))
            except psycopg.errors.UniqueViolation:
                raise StoreError(f"stage: token {token!r} was staged already") from None

    # -- maintenance ----------------------------------------------------------------------

    def apply_retention(self, now_ns: int | None = None) -> int:
        now = time.time_ns() if now_ns is None else now_ns
        with self.transaction() as tx:
            names = tx._conn.execute(
                f"SELECT name FROM {_S} "
                "WHERE max_count IS NOT NULL OR max_age_ms IS NOT NULL").fetchall()
            deleted = 0
            for (name,) in names:
                row = tx._load(name)  # verified
                if row is not None:
                    deleted += _retain(tx._conn, row, now, self._display)
            tx._dirty = tx._dirty or deleted > 0
        return deleted

    def check(self) -> list[str]:
        return self.check_report().problems

    def check_report(self, chunk: int = 10_000) -> CheckReport:
        """Consistency checks of the tables, then every entry of every stream read and
        verified (indices, checksums), ``chunk`` rows a query."""
        report = CheckReport(self._check_tables())
        import psycopg

        try:
            # One snapshot for the whole walk (appends and retention by others go on).
            with self._conn() as c, c.transaction():
                c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                cur = c.cursor(binary=True)
                streams = cur.execute(f"SELECT id, name, next_index, created_ns, max_count, "
                                      f"max_age_ms, first_index, checksum FROM {_S} "
                                      "ORDER BY name COLLATE \"C\"").fetchall()
                tailers: dict[int, list[tuple[Any, ...]]] = {}
                for t in cur.execute(f"SELECT stream, name, position, updated_ns, checksum "
                                     f"FROM {_T} ORDER BY stream, name").fetchall():
                    tailers.setdefault(t[0], []).append(t[1:])
                groups: dict[int, list[tuple[Any, ...]]] = {}
                for r in cur.execute(_GROUP + " ORDER BY g.stream, g.name COLLATE \"C\"").fetchall():
                    groups.setdefault(r[1], []).append(r)
                for r in streams:
                    row = StreamRow(*r)
                    sid, name = row.id, row.name
                    report.add_row(row)
                    for t, p, u, k in tailers.get(sid, ()):
                        report.add_tailer(name, sid, t, p, u, k, row.next)
                    for r in groups.get(sid, ()):
                        g = GroupRow(*r, stream=name)
                        report.add_group(name, g, row.next, cur.execute(
                            _PENDING + " WHERE grp = %s ORDER BY idx", (g.id,)).fetchall())
                    scan = StreamScan(name, row.first, row.next)
                    pos = -(1 << 63)
                    while True:
                        rows = cur.execute(f"SELECT e.idx, e.value, e.meta, {_SUM} FROM {_E} e "
                                           "WHERE e.stream = %s AND e.idx > %s ORDER BY e.idx "
                                           "LIMIT %s", (sid, pos, chunk)).fetchall()
                        if not rows:
                            break
                        i, v, m, k = zip(*rows)
                        scan.feed(i, v, m, k)
                        if type(i[-1]) is not int:  # a damaged key: no way on from it
                            break
                        pos = i[-1]
                    report.add(scan)
        except (StoreError, psycopg.Error) as e:
            report.problems.append(self._fail(e).args[0] if isinstance(e, psycopg.Error) else str(e))
        return report

    def _check_tables(self) -> list[str]:
        problems: list[str] = []
        try:
            with self._conn() as c:
                for n, x, m in c.execute(
                        f"SELECT s.name, s.next_index, max(e.idx) FROM {_S} s JOIN {_E} e "
                        "ON e.stream = s.id GROUP BY s.id HAVING max(e.idx) >= s.next_index"):
                    problems.append(f"stream {n!r}: entry {m} at or beyond next index {x}")
                problems += orphan_problems(lambda t, col, parent: c.execute(
                    f"SELECT count(*) FROM {SCHEMA}.{t} WHERE {col} NOT IN "
                    f"(SELECT id FROM {SCHEMA}.{parent})").fetchone()[0])
                counter = c.execute(f"SELECT seq FROM {SCHEMA}.commit_order WHERE id = 1").fetchone()
                top = c.execute(f"SELECT max(seq) FROM {_E}").fetchone()[0]
                if counter is None:
                    problems.append("the commit counter is missing")
                elif top is not None and top >= counter[0]:
                    problems.append(f"the commit counter ({counter[0]}) is not above the "
                                    f"newest entry's commit number ({top})")
                dup = c.execute(f"SELECT count(*) FROM (SELECT seq FROM {_E} GROUP BY seq "
                                "HAVING count(*) > 1) d").fetchone()[0]
                if dup:
                    problems.append(f"{plural(dup, 'commit number')} used twice")
        except StoreError as e:
            problems.append(str(e))
        return problems

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(Exception):
                pool.close(timeout=5)
            from ._pglog import unregister_pool

            unregister_pool(pool.name)
        n, self._notifier = self._notifier, None
        if n is not None:
            _release_notifier(n)


# -- transactions ------------------------------------------------------------------------------


# The arrays go in binary (%b): psycopg's text form escapes every bytea element with a
# regular expression (about 7 us a value: 1.3 s of a 100,000-row commit).
# The checksums (less the index, which SQL adds) go in beside the values.
_INSERT = (f"INSERT INTO {_E} (stream, idx, seq, time_ns, value, checksum) "
           "SELECT %(s)s, %(i)s + o - 1, %(q)s + o - 1, %(t)s, v, "
           f"{_SEAL.format(c='c', i='%(i)s + o - 1')} "
           "FROM unnest(%(v)b::bytea[], %(c)b::bigint[]) WITH ORDINALITY AS u(v, c, o)")
_INSERT_META = (f"INSERT INTO {_E} (stream, idx, seq, time_ns, value, meta, checksum) "
                "SELECT %(s)s, %(i)s + o - 1, %(q)s + o - 1, %(t)s, v, m, "
                f"{_SEAL.format(c='c', i='%(i)s + o - 1')} "
                "FROM unnest(%(v)b::bytea[], %(m)b::bytea[], %(c)b::bigint[]) WITH ORDINALITY AS u(v, m, c, o)")
_UPSERT_TAILER = (f"INSERT INTO {_T} (stream, name, position, updated_ns, checksum) VALUES "
                  "(%s, %s, %s, %s, %s) ON CONFLICT (stream, name) DO UPDATE SET position = "
                  "excluded.position, updated_ns = excluded.updated_ns, checksum = excluded.checksum")


_STAGED = f"{SCHEMA}.staged"


def _ensure_staged(conn: Any) -> None:
    """The registry of staged rows (Store.stage), created on first use (stores made
    before staging existed lack it; the schema lock keeps two creators apart)."""
    if conn.execute("SELECT to_regclass(%s)", (_STAGED,)).fetchone()[0] is None:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_INIT_LOCK,))
        conn.execute(f"CREATE TABLE IF NOT EXISTS {_STAGED} (id bigint GENERATED ALWAYS AS "
                     "IDENTITY PRIMARY KEY, owner text NOT NULL, token text NOT NULL, "
                     "stream text NOT NULL, count bigint NOT NULL, UNIQUE (token, stream))")


def _retain(conn: Any, row: StreamRow, now_ns: int, where: str) -> int:
    """Apply ``row``'s retention (deleting below a cut, raising its first index to it:
    the row is written when the transaction ends); how many entries went."""
    cut = 0
    if row.max_count is not None:
        cut = max(cut, row.next - row.max_count)
    if row.max_age_ms is not None:
        r = conn.execute(f"SELECT idx FROM {_E} WHERE stream = %s AND time_ns >= %s "
                         "ORDER BY idx LIMIT 1", (row.id, now_ns - row.max_age_ms * 1_000_000)
                         ).fetchone()
        cut = max(cut, row.next if r is None else r[0])
    cut = min(cut, row.next)
    if cut <= row.first:
        return 0
    cut = _held(conn, row, cut, where)
    if cut <= row.first:
        return 0
    n = max(conn.execute(f"DELETE FROM {_E} WHERE stream = %s AND idx < %s", (row.id, cut)).rowcount, 0)
    row.first = cut
    return n


def _ack_rows(cur: Any, gid: Any, stream: str, group: str, items: Sequence[Delivery | int],
              gid_params: tuple[Any, ...] = ()) -> int:
    """Delete the pending rows of ``items`` of the group ``gid`` (its id, or a subquery
    with ``gid_params``); how many went.  Rows are taken in index order (``= ANY`` of an
    index scan): two acknowledgements never wait for each other in a cycle."""
    ints = [x for x in items if not isinstance(x, Delivery)]
    dels = [x for x in items if isinstance(x, Delivery)]
    for d in dels:
        same_group(d, stream, group)
    sub = gid if isinstance(gid, str) else "%s"
    params = gid_params if isinstance(gid, str) else (gid,)
    n = 0
    if ints:
        n += len(cur.execute(f"DELETE FROM {_P} WHERE grp = {sub} AND idx = ANY(%s) RETURNING idx",
                             (*params, ints)).fetchall())
    if dels:
        n += len(cur.execute(
            f"DELETE FROM {_P} p USING unnest(%s::bigint[], %s::text[], %s::bigint[]) AS "
            f"u(i, c, d) WHERE p.grp = {sub} AND p.idx = u.i AND p.consumer = u.c AND "
            "p.deliveries = u.d RETURNING p.idx",
            ([d.index for d in dels], [d.consumer for d in dels], [d.deliveries for d in dels],
             *params)).fetchall())
    return n


def _held(conn: Any, row: StreamRow, cut: int, where: str) -> int:
    """``cut`` lowered to the lowest index a consumer group of ``row`` holding retention
    has not acknowledged (each such group's row verified), with a warning once."""
    rows = conn.execute(f"SELECT {_GROUP_COLS}, (SELECT min(idx) FROM {_P} p WHERE p.grp = "
                        f"g.id) FROM {_G} g WHERE g.stream = %s AND g.hold", (row.id,)).fetchall()
    return hold_cut(where, row.name, cut, (
        (verify_group(where, row.name, GroupRow(*r[:10], stream=row.name), row.next), r[10])
        for r in rows))


def _seal_rows(conn: Any) -> None:
    """Give every stream and tailer row the checksum of the values it holds (migration to
    version 3)."""
    rows = conn.execute(f"SELECT id, name, next_index, created_ns, max_count, max_age_ms, "
                        f"first_index FROM {_S}").fetchall()
    conn.cursor().executemany(f"UPDATE {_S} SET checksum = %s WHERE id = %s",
                              [(StreamRow(*r).seal(), r[0]) for r in rows])
    tailers = conn.execute(f"SELECT stream, name, position, updated_ns FROM {_T}").fetchall()
    conn.cursor().executemany(f"UPDATE {_T} SET checksum = %s WHERE stream = %s AND name = %s",
                              [(tailer_checksum(*t), t[0], t[1]) for t in tailers])


def _beyond(stream: str, tailer: str, position: int, nxt: int) -> str:
    return (f"tailer {tailer!r}: position {position} is beyond the end of stream {stream!r} "
            f"(its next index is {nxt}); a tailer's position is at most that")


class PostgresTransaction(StreamRows, Transaction):
    """A write transaction of :class:`PostgresStore` (see :meth:`PostgresStore.begin`).

    The rows of the streams it touches are read (and verified) once, kept here with its
    changes -- next and first index, retention -- and written back, each with its new
    checksum, when it commits."""

    __slots__ = ("_conn", "_copy_base", "_dirty", "_done", "_names", "_no_retention", "_orig",
                 "_rows", "_seq", "_seq0", "_store", "_time")

    def __init__(self, store: PostgresStore, conn: Any, seq: int) -> None:
        self._store = store
        self._conn = conn
        self._done = False
        self._dirty = False
        self._seq = self._seq0 = seq
        # Stream id -> its row as of this transaction; the values it was read with (None:
        # created here); name -> id.  A writer holds the commit-order lock, so no other
        # process changes these rows meanwhile (nothing is cached across transactions).
        self._rows: dict[int, StreamRow] = {}
        self._orig: dict[int, tuple[Any, ...] | None] = {}
        self._names: dict[str, int] = {}
        self._no_retention: set[int] = set()
        self._copy_base: int | None = None
        self._time: int | None = None

    # -- helpers ----------------------------------------------------------------------

    def _q(self, sql: str, params: Any = (), inserting: tuple[str, int] | None = None) -> Any:
        """Run ``sql``; with ``inserting`` (stream, index), entries are inserted there and
        after, where the stream's row says none is stored: one there already is damage."""
        import psycopg

        try:
            cur = self._conn.cursor(binary=True)
            cur.execute(sql, params)
            return cur
        except psycopg.Error as e:
            if inserting is not None and isinstance(e, psycopg.errors.UniqueViolation):
                raise damaged(self._store.display, inserting[0], "an entry is stored already at "
                              f"index {inserting[1]} or after, where it appends "
                              f"({str(e).strip().splitlines()[0]})") from None
            if isinstance(e, (psycopg.errors.UniqueViolation, psycopg.errors.CheckViolation)):
                raise StoreError(f"{self._store.display}: {str(e).strip().splitlines()[0]}") from None
            raise self._store._fail(e) from None

    def _read_row(self, name: str) -> Sequence[Any] | None:
        return self._q(_ROW + " WHERE s.name = %s", (name,)).fetchone()

    def _insert_row(self, name: str, now_ns: int) -> int:
        self._dirty = True
        return int(self._q(f"INSERT INTO {_S} (name, next_index, created_ns) VALUES (%s, 0, %s) "
                           "RETURNING id", (name, now_ns)).fetchone()[0])

    def _finish(self) -> bool:
        """Before COMMIT: the streams' rows (next and first index, retention, checksum),
        the commit counter, the NOTIFY.  Whether anything changed."""
        c = self._conn
        writes = []
        for sid, row in self._rows.items():
            orig = self._orig[sid]
            if orig is None or row.next != orig[0]:
                # Retention of the streams written, in the same transaction.
                if sid not in self._no_retention and (row.max_count is not None
                                                      or row.max_age_ms is not None):
                    _retain(c, row, self._time or time.time_ns(), self._store.display)
            if orig is None or (row.next, row.first, row.max_count, row.max_age_ms) != orig:
                writes.append((row.next, row.first, row.max_count, row.max_age_ms, row.seal(),
                               sid))
        if writes:
            c.cursor().executemany(f"UPDATE {_S} SET next_index = %s, first_index = %s, "
                                   "max_count = %s, max_age_ms = %s, checksum = %s WHERE id = %s",
                                   writes)
            self._dirty = True
        if self._seq != self._seq0:
            self._q(f"UPDATE {SCHEMA}.commit_order SET seq = %s WHERE id = 1", (self._seq,))
        if self._dirty:
            c.execute(f"NOTIFY {CHANNEL}")
        return self._dirty

    def commit(self) -> None:
        self._store._end(self, True)

    def rollback(self) -> None:
        self._store._end(self, False)

    # -- consumer groups ----------------------------------------------------------------

    def _group(self, stream: str, group: str) -> GroupRow:
        """The verified row of ``group`` of ``stream`` (as this transaction sees it)."""
        srow = self._need(stream)
        r = self._q(_GROUP + " WHERE g.stream = %s AND g.name = %s", (srow.id, group)).fetchone()
        if r is None:
            raise no_group(self._store.display, stream, group)
        return verify_group(self._store.display, stream, GroupRow(*r, stream=stream), srow.next)

    def ack(self, deliveries: Delivery | Iterable[Delivery]) -> int:
        ds = ack_args(deliveries)
        by: dict[tuple[str, str], list[Delivery]] = {}
        for d in ds:
            by.setdefault((d.stream, d.group), []).append(d)
        for (stream, group), items in by.items():
            g = self._group(stream, group)
            items.sort(key=lambda d: d.index)  # rows locked in index order: no deadlock
            done = {r[0] for r in self._q(
                f"DELETE FROM {_P} p USING unnest(%s::bigint[], %s::text[], %s::bigint[]) AS "
                "u(i, c, d) WHERE p.grp = %s AND p.idx = u.i AND p.consumer = u.c AND "
                "p.deliveries = u.d RETURNING p.idx",
                ([d.index for d in items], [d.consumer for d in items],
                 [d.deliveries for d in items], g.id)).fetchall()}
            for d in items:
                if d.index not in done:
                    raise AckLost(lost_message(stream, group, d))
        self._dirty = True
        return len(ds)

    def dead_letter(self, stream: str, group: str, entries: Sequence[PendingEntry],
                    why: str | None = None) -> int:
        g = self._group(stream, group)

        def take(p: PendingEntry) -> bool:
            if self._q(f"DELETE FROM {_P} WHERE grp = %s AND idx = %s AND consumer = %s AND "
                       "deliveries = %s RETURNING idx",
                       (g.id, p.index, p.consumer, p.deliveries)).fetchone() is None:
                return False
            self._dirty = True
            return True

        return move_dead(self, self._store.display, stream, g,
                         sorted(entries, key=lambda p: p.index), why, take,
                         lambda i: self._store.get(stream, i))

    # -- the interface ----------------------------------------------------------------

    def append(self, stream: str, value: Value, meta: Value | None = None) -> int:
        data = encode_value(value)
        m = None if meta is None else encode_value(meta, "metadata")
        return self.append_encoded(stream, [data], None if m is None else [m])

    def append_encoded(
        self, stream: str, datas: list[bytes], metas: list[bytes | None] | None = None
    ) -> int:
        row = self._writable(stream)
        sid, first = row.id, row.next
        n = len(datas)
        if n == 0:
            return first
        if first + n > MAX_INDEX:
            raise StoreError(f"stream {stream!r} is full (64-bit indices exhausted)")
        t = self._time = time.time_ns()
        if metas is None:
            self._q(_INSERT, {"s": sid, "i": first, "q": self._seq, "t": t, "v": list(datas),
                              "c": checksums(stream, datas)}, (stream, first))
        else:
            if len(metas) != n:
                raise ValueError("append_encoded: datas and metas differ in length")
            self._q(_INSERT_META, {"s": sid, "i": first, "q": self._seq, "t": t, "v": list(datas),
                                   "m": list(metas), "c": checksums(stream, datas, metas)},
                    (stream, first))
        self._seq += n
        row.next = first + n
        return first

    def append_staged(self, stream: str, staged: Sequence[tuple[str, int]], *,
                      meta_cut: int = 0, meta_suffix: bytes = b"") -> int:
        row = self._writable(stream)
        sid, first = row.id, row.next
        total = staged_total(stream, first, staged)
        if total == 0:
            return first
        if self._q("SELECT to_regclass(%s)", (_STAGED,)).fetchone()[0] is None:
            raise StoreError(f"stream {stream!r}: no staged rows in {self._store.display} (lost?)")
        t = self._time = time.time_ns()
        at = first
        for token, n in staged:
            r = self._q(f"SELECT id, count FROM {_STAGED} WHERE token = %s AND stream = %s",
                        (token, stream)).fetchone()
            if r is None or r[1] != n:
                raise staged_count_error(stream, token, None if r is None else r[1], n)
            table = f"{SCHEMA}.staged_{int(r[0])}"
            params: tuple[Any, ...] = (sid, at, self._seq + (at - first), t, at)
            if not meta_cut:  # the staged rows carry their checksums less the index
                sql = (f"INSERT INTO {_E} (stream, idx, seq, time_ns, value, meta, checksum) "
                       f"SELECT %s, %s + k, %s + k, %s, value, meta, {_SEAL.format(c='checksum', i='%s + k')} "
                       f"FROM {table}")
            else:
                # The metadata is rewritten: its checksum goes on from the value's over the
                # new metadata, computed here (the metadata is small; values stay put).
                old = self._q(f"SELECT k, vsum, meta FROM {table} ORDER BY k").fetchall()
                sums = [v if m is None else zlib.adler32(m[:len(m) - meta_cut] + meta_suffix, v)
                        for _k, v, m in old]
                if [k for k, _v, _m in old] != list(range(len(old))):
                    raise staged_count_error(stream, token, len(old), n)
                sql = (f"INSERT INTO {_E} (stream, idx, seq, time_ns, value, meta, checksum) "
                       f"SELECT %s, %s + k, %s + k, %s, value, CASE WHEN meta IS NULL THEN NULL "
                       "ELSE substring(meta FROM 1 FOR length(meta) - %s) || %s END, "
                       f"{_SEAL.format(c='c.c', i='%s + k')} FROM {table} "
                       "JOIN unnest(%b::bigint[]) WITH ORDINALITY AS c(c, o) ON c.o = k + 1")
                params = (*params[:4], meta_cut, meta_suffix, at, sums)
            cur = self._q(sql, params, (stream, at))
            if cur.rowcount != n:
                raise staged_count_error(stream, token, cur.rowcount, n)
            at += n
        self._seq += total
        row.next = at
        return first

    def drop_staged(self, owner: str) -> int:
        if self._q("SELECT to_regclass(%s)", (_STAGED,)).fetchone()[0] is None:
            return 0
        rows = self._q(f"DELETE FROM {_STAGED} WHERE owner = %s RETURNING id, count",
                       (owner,)).fetchall()
        for tid, _n in rows:
            self._q(f"DROP TABLE IF EXISTS {SCHEMA}.staged_{int(tid)}")
        return sum(int(n) for _t, n in rows)

    def copy_in(self, stream: str, rows: list[tuple[int, int, bytes, bytes | None, int]]) -> None:
        if not rows:
            return
        row = self._writable(stream)
        sid, nxt = row.id, row.next
        idx, times, values, metas, order = (list(c) for c in zip(*rows))
        check_copy_in(stream, nxt, row.first < nxt, idx)
        if row.first >= nxt:  # empty: it starts there
            row.first = idx[0]
        if self._copy_base is None:
            self._copy_base = self._seq
        self._q(f"INSERT INTO {_E} (stream, idx, seq, time_ns, value, meta, checksum) "
                f"SELECT %s, i, %s + o, t, v, m, {_SEAL.format(c='c', i='i')} FROM unnest("
                "%b::bigint[], %b::bigint[], %b::bytea[], %b::bytea[], %b::bigint[], %b::bigint[]) "
                "AS u(i, t, v, m, o, c)",
                (sid, self._copy_base, idx, times, values, metas, order,
                 checksums(stream, values, metas)), (stream, idx[0]))
        self._seq = max(self._seq, self._copy_base + max(order) + 1)
        row.next = rows[-1][0] + 1
        self._no_retention.add(sid)

    def advance(self, stream: str, next_index: int) -> None:
        if type(next_index) is not int or not 0 <= next_index <= MAX_INDEX:
            raise ValueError(f"a next index is 0 to 2**63-1, not {next_index!r}")
        row = self._writable(stream)
        if next_index > row.next:
            check_advance(stream, row.next, row.first < row.next, next_index)
            row.first = row.next = next_index

    def read(self, stream: str, start: int, limit: int, end: int | None = None) -> list[Entry]:
        return self._store.read(stream, start, limit, end)

    def read_rows(self, stream: str, start: int, end: int, limit: int) -> list[tuple[int, int, bytes, bytes | None]]:
        return self._store.read_rows(stream, start, end, limit)

    def get(self, stream: str, index: int) -> Entry | None:
        return self._store.get(stream, index)

    def last(self, stream: str, before: int | None = None, limit: int = 1) -> list[Entry]:
        return self._store.last(stream, before, limit)

    def first_index(self, stream: str) -> int | None:
        return self._store.first_index(stream)

    def position(self, stream: str, tailer: str) -> int | None:
        return self._store.position(stream, tailer)

    def _tailer_row(self, stream: str, tailer: str, position: Any, now: int) -> tuple[Any, ...]:
        check_tailer_name(tailer)
        if type(position) is not int or not 0 <= position <= MAX_INDEX:
            raise ValueError(f"a tailer position is an index (0 to 2**63-1), not {position!r}")
        row = self._writable(stream)
        if position > row.next:
            raise ValueError(_beyond(stream, tailer, position, row.next))
        return row.id, tailer, position, now, tailer_checksum(row.id, tailer, position, now)

    def set_position(self, stream: str, tailer: str, position: int) -> None:
        self._q(_UPSERT_TAILER, self._tailer_row(stream, tailer, position, time.time_ns()))
        self._dirty = True

    def set_positions(self, items: list[tuple[str, str, int]]) -> None:
        """Several :meth:`set_position` calls in one round trip (after one to read the rows
        of streams this transaction has not read yet)."""
        if not items:
            return
        now = time.time_ns()
        unread = [s for s in dict.fromkeys(s for s, _t, _p in items) if s not in self._names]
        if len(unread) > 1:
            for r in self._q(_ROW + " WHERE s.name = ANY(%s)", (unread,)).fetchall():
                row = StreamRow(*r[:8])
                verify_stream_row(self._store.display, row.name, row, r[8], r[9])
                self._orig[row.id] = (row.next, row.first, row.max_count, row.max_age_ms)
                self._names[row.name] = row.id
                self._rows[row.id] = row
        rows = [self._tailer_row(s, t, p, now) for s, t, p in items]
        import psycopg

        try:
            self._conn.cursor().executemany(_UPSERT_TAILER, rows)
        except psycopg.Error as e:
            raise self._store._fail(e) from None
        self._dirty = True
