"""The stream store: appends, reads, tailers, transactions, retention, commit order,
locks, bad files and bad databases.

Every test taking ``store`` or ``store_url`` runs twice: on the SQLite store and on a
PostgreSQL database of a real server the test session starts (tests/conftest.py).
Includes a hypothesis state machine comparing each store with a small in-memory
reference model (including closing and reopening the store between steps).
"""

from __future__ import annotations

import os
import random
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dataspace.datadir import STREAMS_DB
from dataspace.streams import (
    ForeignStore,
    LockHeld,
    StoreCorrupt,
    StoreError,
    StoreNotFound,
    StreamNotFound,
    open_store,
)
from dataspace.streams.base import MAX_VALUE_SIZE, check_stream_name, parse_duration
from dataspace.values import decode, encode, parse
from store_support import wait_lock_free
from strategies import values


def test_append_read_get_last(store):
    assert store.next_index("chat") == 0
    assert store.read("chat") == []
    for i in range(5):
        assert store.append("chat", parse(f'<Says "u{i}" {i}>')) == i
    entries = store.read("chat", 1, 2)
    assert [e.index for e in entries] == [1, 2]
    assert entries[0].value == parse('<Says "u1" 1>')
    assert entries[0].stream == "chat" and entries[0].meta is None
    assert store.get("chat", 4).value == parse('<Says "u4" 4>')
    assert store.get("chat", 5) is None
    assert [e.index for e in store.last("chat", limit=2)] == [4, 3]
    assert [e.index for e in store.last("chat", before=2, limit=5)] == [1, 0]
    assert [e.index for e in store.read("chat", 3, 10, end=4)] == [3]
    info = store.stream_info("chat")
    assert (info.first, info.next, info.count) == (0, 5, 5)
    assert info.last_time_ns is not None and info.last_time_ns >= info.created_ns


def test_values_are_stored_canonically_with_metadata(store):
    v = parse('{b: 2 a: 1 c: #{3 1 2}}')
    i = store.append("s", v, meta=parse("<meta 7>"))
    e = store.get("s", i)
    assert e.data == encode(v)
    assert e.meta == parse("<meta 7>")
    assert decode(e.data) == v


def test_append_many_and_iter(store):
    r = store.append_many("nums", range(2500))
    assert r == range(0, 2500)
    assert [e.value for e in store.iter_entries("nums", 10, 20)] == list(range(10, 20))
    assert sum(1 for _ in store.iter_entries("nums")) == 2500


def test_read_without_a_limit_reads_every_entry(store):
    """`store.read(name)` once stopped at 1,000 entries without saying so (a user's count
    said 1,000); without a limit it reads the whole range, with one it reads a page."""
    store.append_many("nums", range(2500))
    assert [e.index for e in store.read("nums")] == list(range(2500))
    assert [e.index for e in store.read("nums", 2000)] == list(range(2000, 2500))
    assert [e.index for e in store.read("nums", end=1500)][-1] == 1499
    assert len(store.read("nums", 0, 1000)) == 1000
    assert store.read("nums", 0, 0) == []


def test_a_stream_removed_by_another_handle_is_looked_up_again(store_url):
    """`stream rm` / `pipeline reset` delete streams that other processes may have open (a
    recorder, Spark's Python workers): their cached stream id must not make a write fail
    ("stream id N was deleted") nor put a tailer position on the deleted stream."""
    with open_store(store_url) as a, open_store(store_url) as b:
        a.append("s", 1)
        a.set_position("s", "t", 1)  # a has the stream's id cached
        b.delete_stream("s")
        with a.transaction() as tx:
            assert tx.next_index("s") == 0
        a.set_position("s", "t", 0)
        assert a.append("s", 2) == 0
        with a.transaction() as tx:
            tx.set_positions([("s", "u", 1)])
        assert [e.value for e in b.read("s")] == [2]
        assert (b.position("s", "t"), b.position("s", "u")) == (0, 1)
        b.delete_stream("s")
        with a.transaction() as tx:
            tx.set_positions([("s", "u", 0)])
        assert [t.name for t in b.tailers("s")] == ["u"]
        # Reads too: through a stale id they found nothing (a graph's read tasks in a
        # long-lived Spark worker then delivered an empty step and moved on).
        assert [e.value for e in a.read("s")] == []
        b.delete_stream("s")
        b.append_many("s", [7, 8])
        assert [e.value for e in a.read("s")] == [7, 8]
        assert a.read_rows("s", 0, 2, 10)[1][2] == encode(8)
        assert (a.next_index("s"), a.first_index("s"), a.get("s", 1).value) == (2, 0, 8)


def test_indices_are_monotonic_after_retention_removes_everything(store):
    store.create_stream("s", max_count=2)
    for i in range(5):
        store.append("s", i)
    assert [e.value for e in store.read("s")] == [3, 4]
    store.create_stream("s", max_age=1.0)
    assert store.apply_retention(now_ns=time.time_ns() + 10**10) == 2
    info = store.stream_info("s")
    assert info.first is None and info.count == 0 and info.next == 5
    assert store.append("s", 5) == 5


def test_retention_by_count_applies_on_append(store):
    store.create_stream("log", max_count=10)
    store.append_many("log", range(25))
    info = store.stream_info("log")
    assert (info.first, info.next, info.count, info.max_count) == (15, 25, 10, 10)


def test_retention_by_age(store):
    store.create_stream("events", max_age=60)
    store.append_many("events", range(3))
    now = time.time_ns()
    assert store.apply_retention(now_ns=now) == 0
    assert store.apply_retention(now_ns=now + 61 * 10**9) == 3
    assert store.stream_info("events").max_age == 60


def test_transaction_is_atomic_across_streams(store):
    with store.transaction() as tx:
        assert tx.append("a", 1) == 0
        assert tx.append("b", 2) == 0
        tx.set_position("a", "reader", 1)
        assert tx.next_index("a") == 1
        assert [e.value for e in tx.read("a", 0, 10)] == [1]
    with pytest.raises(RuntimeError), store.transaction() as tx:
        tx.append("a", 10)
        tx.append("c", 3)  # a new stream, rolled back too
        tx.set_position("a", "reader", 2)
        raise RuntimeError("boom")
    assert [e.value for e in store.read("a")] == [1]
    assert not store.has_stream("c")
    assert store.position("a", "reader") == 1
    assert store.append("a", 11) == 1  # the rolled-back index is reused


def test_transactions_do_not_nest(store):
    with store.transaction(), pytest.raises(StoreError, match="nest"), store.transaction():
        pass


def test_stream_names_are_checked(store):
    for bad in ["", "has space", "-x", "a" * 201, "tab\t", "é"]:
        with pytest.raises(ValueError, match="invalid stream name"):
            store.append(bad, 1)
    assert check_stream_name("orders.eu-1/v2:x@y+z") == "orders.eu-1/v2:x@y+z"


def test_oversized_values_are_refused(store):
    with pytest.raises(ValueError, match="limit"):
        store.append("big", b"\x00" * MAX_VALUE_SIZE)  # a byte string: plus its header


def test_stream_not_found(store):
    with pytest.raises(StreamNotFound, match="no stream named 'nope'"):
        store.stream_info("nope")


def test_list_and_delete_streams(store):
    store.append("b", 1)
    store.append("a", 1)
    store.append("__backing/g/p", 1)
    assert [s.name for s in store.streams()] == ["a", "b"]
    assert [s.name for s in store.streams(include_internal=True)] == ["__backing/g/p", "a", "b"]
    store.delete_stream("a")
    assert not store.has_stream("a")
    assert store.next_index("a") == 0


# -- tailers ---------------------------------------------------------------------------


def test_named_tailer_resumes(store_url):
    with open_store(store_url) as s:
        s.append_many("t", range(10))
        t = s.tailer("t", "worker")
        assert [e.value for e in t.read(4)] == [0, 1, 2, 3]
    with open_store(store_url) as s:
        t = s.tailer("t", "worker")
        assert t.position == 4
        assert t.lag == 6
        assert [e.value for e in t.read(100)] == list(range(4, 10))
        assert s.tailers("t")[0].position == 10


def test_tailer_start_positions(store):
    store.append_many("t", range(5))
    assert store.tailer("t", start="latest").read() == []
    assert [e.value for e in store.tailer("t", start=3).read()] == [3, 4]
    # A named tailer saves its resolved start at once: entries appended before its first
    # read are not skipped after a restart.
    store.tailer("t", "late", start="latest")
    store.append("t", 5)
    assert [e.value for e in store.tailer("t", "late").read()] == [5]
    with pytest.raises(ValueError):
        store.tailer("t", start="middle")


def test_tailer_without_auto_commit(store):
    store.append_many("t", range(3))
    t = store.tailer("t", "careful", auto_commit=False)
    assert len(t.read()) == 3
    assert store.position("t", "careful") == 0
    t.commit()
    assert store.position("t", "careful") == 3


def test_tailer_skips_entries_removed_by_retention(store, caplog):
    store.create_stream("t", max_count=3)
    t = store.tailer("t", "slow")
    store.append_many("t", range(10))
    assert [e.value for e in t.read()] == [7, 8, 9]
    assert "removed by retention" in caplog.text


def test_tailer_poll_times_out_empty(store):
    t = store.tailer("t")
    assert t.poll(timeout=0.05) == []
    assert t.next(timeout=0.01) is None


# -- bad files --------------------------------------------------------------------------


def test_processes_creating_one_store_at_once_all_open_it(tmp_path):
    """Parallel tasks (Spark's write tasks) may be the first to open a store: each must
    get it, not "database is locked" taken for damage, nor a half-made schema taken for
    another application's database."""
    def opener(d, start, errors) -> None:
        start.wait(10)
        try:
            open_store(d).close()
        except BaseException as e:
            errors.append(e)

    for k in range(15):
        d = tmp_path / str(k)
        d.mkdir()  # a data directory: the store file is made in it
        errors: list[BaseException] = []
        start = threading.Barrier(4)
        threads = [threading.Thread(target=opener, args=(d, start, errors)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == [] and not any(t.is_alive() for t in threads)
        with open_store(d, create=False) as store:
            assert store.check() == []


def test_new_files_have_large_pages_and_old_ones_keep_theirs(tmp_path):
    """Stores are laid out in PAGE_SIZE pages (batch appends and reads are faster); a
    file made with SQLite's default 4 KiB pages opens and works as it is."""
    import sqlite3

    from dataspace.streams.sqlite import PAGE_SIZE

    def page_size(path) -> int:
        c = sqlite3.connect(path)
        try:
            return c.execute("PRAGMA page_size").fetchone()[0]
        finally:
            c.close()

    with open_store(tmp_path / "new") as store:
        store.append("s", 1)
    assert PAGE_SIZE == 16384 and page_size(tmp_path / "new" / STREAMS_DB) == PAGE_SIZE
    old = tmp_path / "old"
    old.mkdir()
    c = sqlite3.connect(old / STREAMS_DB)
    c.execute("PRAGMA page_size = 4096")
    c.execute("VACUUM")
    c.close()
    with open_store(old) as store:
        store.append("s", 1)
        assert [e.value for e in store.read("s", 0, 10)] == [1]
    assert page_size(old / STREAMS_DB) == 4096


def test_foreign_file_is_refused(tmp_path):
    (tmp_path / STREAMS_DB).write_bytes(b"this is not a database at all" * 10)
    with pytest.raises(ForeignStore, match="not an SQLite database"):
        open_store(tmp_path)


def test_truncated_file_is_refused(tmp_path):
    (tmp_path / STREAMS_DB).write_bytes(b"SQLite format 3\x00\x10\x00")
    with pytest.raises(StoreCorrupt, match="truncated"):
        open_store(tmp_path)


def test_other_applications_database_is_refused(tmp_path):
    c = sqlite3.connect(tmp_path / STREAMS_DB)
    c.execute("create table customers (id integer primary key, name text)")
    c.commit()
    c.close()
    with pytest.raises(ForeignStore, match="another application"):
        open_store(tmp_path)


def test_newer_format_is_refused(tmp_path):
    open_store(tmp_path).close()
    c = sqlite3.connect(tmp_path / STREAMS_DB)
    c.execute("pragma user_version = 99")
    c.close()
    with pytest.raises(ForeignStore, match="newer dataspace"):
        open_store(tmp_path)


def test_damaged_pages_give_a_clear_error(tmp_path):
    with open_store(tmp_path) as s:
        s.append_many("s", ["x" * 128] * 2000)
        s.checkpoint()
    p = tmp_path / STREAMS_DB
    data = bytearray(p.read_bytes())
    page = 4096
    assert len(data) > 8 * page
    for off in range(2 * page, len(data), page):  # scribble over every page but the first
        data[off : off + 64] = b"\xff" * 64
    p.write_bytes(bytes(data))
    for wal in (tmp_path / (STREAMS_DB + "-wal"), tmp_path / (STREAMS_DB + "-shm")):
        wal.unlink(missing_ok=True)
    with pytest.raises(StoreCorrupt, match="damaged"):
        s = open_store(tmp_path)
        try:
            s.stream_info("s")
            s.read("s", 0, 5000)
            assert s.check() == []  # pragma: no cover - would mean the damage went unseen
        finally:
            s.close()


def test_check_reports_a_sound_store(store):
    store.append_many("s", range(100))
    assert store.check() == []


def test_missing_store_without_create(store_url):
    with pytest.raises(StoreNotFound, match="no stream store"):
        open_store(store_url, create=False)


def test_closed_store(store_url):
    s = open_store(store_url)
    s.close()
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.append("x", 1)


def test_parse_duration():
    assert parse_duration("90") == 90
    assert parse_duration("15m") == 900
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("250ms") == 0.25
    for bad in ["", "7 days", "-1s", "0"]:
        with pytest.raises(ValueError):
            parse_duration(bad)


# -- differential state machine against an in-memory reference --------------------------

STREAMS = ["a", "b", "c"]
TAILERS = ["t1", "t2"]


class StoreMachine(RuleBasedStateMachine):
    """Random appends (alone and in multi-stream transactions, some rolled back), reads,
    tailer positions, retention and reopenings: the store must agree with a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = self.new_location()
        self.store = open_store(self.dir)
        self.ref: dict[str, dict[int, bytes]] = {}
        self.next: dict[str, int] = {}
        self.pos: dict[tuple[str, str], int] = {}
        self.max_count: dict[str, int | None] = {}

    def new_location(self) -> str:
        import tempfile

        return tempfile.mkdtemp(prefix="streams-sm-")

    def teardown(self) -> None:
        self.store.close()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)

    def _ref_append(self, stream: str, data: bytes) -> int:
        i = self.next.get(stream, 0)
        self.ref.setdefault(stream, {})[i] = data
        self.next[stream] = i + 1
        return i

    def _ref_retain(self, stream: str) -> None:
        mc = self.max_count.get(stream)
        if mc is not None:
            cut = self.next.get(stream, 0) - mc
            for i in [i for i in self.ref.get(stream, {}) if i < cut]:
                del self.ref[stream][i]

    @initialize()
    def start(self) -> None:
        pass

    @rule(stream=st.sampled_from(STREAMS), v=values)
    def append(self, stream, v):
        i = self.store.append(stream, v)
        assert i == self._ref_append(stream, encode(v))
        self._ref_retain(stream)

    @rule(
        writes=st.lists(st.tuples(st.sampled_from(STREAMS), values), min_size=1, max_size=6),
        pos=st.lists(st.tuples(st.sampled_from(STREAMS), st.sampled_from(TAILERS),
                               st.integers(0, 20)), max_size=3),
        fail=st.booleans(),
    )
    def transaction(self, writes, pos, fail):
        class Abort(Exception):
            pass

        # A tailer's position is at most its stream's next index (with this transaction's
        # appends): more is refused, and the transaction rolled back.
        ends = {s: self.next.get(s, 0) + sum(1 for w, _v in writes if w == s) for s in STREAMS}
        beyond = any(p > ends[s] for s, _t, p in pos)
        try:
            with self.store.transaction() as tx:
                got = [tx.append(s, v) for s, v in writes]
                for s, t, p in pos:
                    tx.set_position(s, t, p)
                if fail:
                    raise Abort
        except Abort:
            return
        except ValueError as e:
            assert beyond and "is beyond the end of stream" in str(e), e
            return
        assert not beyond
        expect = [self._ref_append(s, encode(v)) for s, v in writes]
        assert got == expect
        for s, t, p in pos:
            self.pos[(s, t)] = p
        for s in STREAMS:
            self._ref_retain(s)

    @rule(stream=st.sampled_from(STREAMS), mc=st.one_of(st.none(), st.integers(1, 5)))
    def set_retention(self, stream, mc):
        with self.store.transaction() as tx:
            tx.create_stream(stream)
            tx.set_retention(stream, mc, None)
        self.next.setdefault(stream, 0)
        self.ref.setdefault(stream, {})
        self.max_count[stream] = mc
        self.store.apply_retention()
        self._ref_retain(stream)

    @rule()
    def reopen(self):
        self.store.close()
        self.store = open_store(self.dir)

    @precondition(lambda self: self.ref)
    @rule(stream=st.sampled_from(STREAMS), start=st.integers(0, 30), limit=st.integers(0, 10))
    def read_range(self, stream, start, limit):
        got = [(e.index, e.data) for e in self.store.read(stream, start, limit)]
        want = sorted((i, d) for i, d in self.ref.get(stream, {}).items() if i >= start)[:limit]
        assert got == want

    @invariant()
    def agrees(self):
        for s in STREAMS:
            assert self.store.next_index(s) == self.next.get(s, 0)
            got = {e.index: e.data for e in self.store.read(s, 0, 10_000)}
            assert got == self.ref.get(s, {})
        for (s, t), p in self.pos.items():
            assert self.store.position(s, t) == p


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


class PostgresStoreMachine(StoreMachine):
    """The same machine on a fresh PostgreSQL database per example."""

    pg = None  # the session's server, set by the fixture below
    count = 0

    def new_location(self) -> str:
        PostgresStoreMachine.count += 1
        self.db = f"sm_{os.getpid()}_{PostgresStoreMachine.count}"
        return self.pg.create_database(self.db)

    def teardown(self) -> None:
        self.store.close()
        self.pg.drop_database(self.db)


@pytest.fixture
def _machine_pg(request, pg_server):
    PostgresStoreMachine.pg = pg_server


TestPostgresStoreMachine = pytest.mark.usefixtures("_machine_pg")(PostgresStoreMachine.TestCase)
TestPostgresStoreMachine.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)


def test_a_stream_created_in_a_rolled_back_transaction_leaves_no_trace(store):
    """Reads through the store inside its own transaction see the new stream; after a
    rollback its id must not survive in any cache (the next stream reuses the id)."""
    store.append("a", "x")
    with pytest.raises(RuntimeError), store.transaction() as tx:
        tx.create_stream("new")
        assert store.has_stream("new")
        raise RuntimeError("roll back")
    assert not store.has_stream("new")
    store.append("other", "for other")
    store.append("new", "for new")
    assert [e.value for e in store.read("other", 0, 10)] == ["for other"]
    assert [e.value for e in store.read("new", 0, 10)] == ["for new"]


# -- commit order across concurrent writers ----------------------------------------------------


def test_commit_order_numbers_follow_commit_order_across_concurrent_writers(store_url):
    """alts processors take "whichever input has one first" by ``seq``: a reader that sees
    an entry numbered q must already see every entry numbered below q, in every stream.
    Four writers (each its own store, so its own connection) commit small multi-stream
    transactions while a reader reads the streams one after another and checks, against
    the final contents, that nothing numbered below what it saw in an earlier stream is
    missing from a later one.  (PostgreSQL sequences alone break this: two transactions
    commit in the opposite order of their numbers.)"""
    streams = ["a", "b", "c"]
    open_store(store_url).close()
    stop = threading.Event()
    errors: list[BaseException] = []
    observations: list[list[tuple[str, set[int]]]] = []

    def writer(k: int) -> None:
        rng = random.Random(k)
        try:
            with open_store(store_url) as s:
                for _ in range(60):
                    with s.transaction() as tx:
                        for name in rng.sample(streams, rng.randint(1, 2)):
                            tx.append_encoded(name, [b"\xb0\x01\x01"] * rng.randint(1, 3))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader() -> None:
        rng = random.Random(99)
        try:
            with open_store(store_url) as s:
                while not stop.is_set():
                    order = rng.sample(streams, 3)
                    observations.append(
                        [(n, set(s.read_columns(n, 0, 1 << 62, values=False).seqs)) for n in order])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    rd = threading.Thread(target=reader)
    rd.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    rd.join(60)
    assert not errors, errors
    with open_store(store_url) as s:
        final = {n: set(s.read_columns(n, 0, 1 << 62, values=False).seqs) for n in streams}
    everything = sorted(q for n in streams for q in final[n])
    assert everything == list(range(len(everything)))  # one number per entry, no gaps
    assert len(observations) > 10
    for obs in observations:
        top = -1
        for name, seen in obs:
            missing = {q for q in final[name] if q < top} - seen
            assert not missing, f"{name}: saw numbers up to {top} elsewhere but not {sorted(missing)[:5]}"
            top = max([top, *seen])


def test_a_reader_never_waits_for_a_writer(store, store_url):
    """Writers are serialised (commit order); a reader elsewhere is not held up by an open
    transaction, and sees only what is committed."""
    store.append("s", 1)
    tx = store.begin()
    try:
        tx.append("s", 2)
        with open_store(store_url) as other:
            assert [e.value for e in other.read("s")] == [1]
    finally:
        tx.commit()
    assert [e.value for e in store.read("s")] == [1, 2]


# -- moving entries at their own indices (stream copy) ----------------------------------------


def test_copy_in_keeps_indices_times_and_metadata(store):
    rows = [(5, 111, encode(parse("<a>")), None, 0), (6, 222, encode(1), encode(parse("{m: 1}")), 2)]
    store.create_stream("dst", max_count=1)
    store.create_stream("empty")
    store.append("other", "before")
    with store.transaction() as tx:
        tx.copy_in("dst", rows)
        tx.copy_in("other", [(1, 333, encode(2), None, 1)])  # between the two in commit order
        tx.advance("dst", 7)  # where it is already
        tx.advance("dst", 3)  # never lowers it
        tx.advance("empty", 9)  # an empty stream starts further on
    got = store.read("dst")
    assert [(e.index, e.time_ns, e.data, e.meta_data) for e in got] == [r[:4] for r in rows]
    assert store.next_index("dst") == 7 and store.first_index("dst") == 5
    assert store.next_index("empty") == 9 and store.first_index("empty") is None
    other = store.read("other")
    assert got[0].seq > other[0].seq  # after what was there
    assert got[0].seq < other[1].seq < got[1].seq  # the order given
    assert store.append("other", 3) == 2 and store.read("other")[2].seq > got[1].seq
    assert store.append("dst", 7) == 7  # ...and retention applies to new appends as before
    assert [e.index for e in store.read("dst")] == [7]
    assert store.append("empty", 1) == 9 and [e.index for e in store.read("empty")] == [9]
    with pytest.raises(ValueError, match="indices must increase"), store.transaction() as tx:
        tx.copy_in("dst", [(4, 0, b"\x84", None, 0)])
    # A stream's entries have no gaps (reads check it): neither after its entries...
    with pytest.raises(ValueError, match=r"index 10 would leave indices 8..9 missing"), \
            store.transaction() as tx:
        tx.copy_in("dst", [(10, 0, b"\x84", None, 0)])
    with pytest.raises(ValueError, match=r"indices 8..11 would be missing"), store.transaction() as tx:
        tx.advance("dst", 12)
    # ...nor between the rows copied.
    with pytest.raises(ValueError, match=r"index 3 after index 1 would leave index 2 missing"), \
            store.transaction() as tx:
        tx.copy_in("new", [(1, 0, b"\x84", None, 0), (3, 0, b"\x84", None, 1)])
    assert [e.index for e in store.read("dst")] == [7] and not store.has_stream("new")


def test_staged_rows_are_invisible_until_a_transaction_takes_them(store):
    store.append("out", "before")
    e = [encode(x) for x in range(5)]
    m = [encode(parse("{h: #x\"0102\"}")), None, encode(1), encode(2), encode(3)]
    store.stage("p1", "p1/a", {"out": (e[:2], m[:2]), "err": (e[4:], m[4:])})
    store.stage("p1", "p1/b", {"out": (e[2:4], m[2:4])})
    store.stage("p2", "p2/a", {"out": (e[:1], m[:1])})
    with pytest.raises(StoreError, match="staged already"):
        store.stage("p1", "p1/a", {"out": (e[:1], m[:1])})
    assert [x.index for x in store.read("out")] == [0] and not store.has_stream("err")
    seq0 = store.read("out")[0].seq
    with store.transaction() as tx:
        assert tx.append_staged("out", [("p1/b", 2), ("p1/a", 2)]) == 1  # in the order given
        tx.append("mid", 9)
        assert tx.append_staged("err", [("p1/a", 1)]) == 0
        assert tx.drop_staged("p1") == 5
    got = store.read("out")
    assert [(x.index, x.data, x.meta_data) for x in got[1:]] == [
        (1, e[2], m[2]), (2, e[3], m[3]), (3, e[0], m[0]), (4, e[1], m[1])]
    seqs = [x.seq for x in got] + [store.read("mid")[0].seq, store.read("err")[0].seq]
    assert seqs == sorted(seqs) and len(set(seqs)) == 7 and seqs[0] == seq0  # commit order
    assert store.read("err")[0].data == e[4]
    assert store.next_index("out") == 5
    # Dropped: taking them again fails and leaves nothing; another owner's rows are kept.
    with pytest.raises(StoreError, match="missing"), store.transaction() as tx:
        tx.append("out", "x")
        tx.append_staged("out", [("p1/a", 2)])
    assert store.next_index("out") == 5
    with pytest.raises(StoreError, match="1, not 2"), store.transaction() as tx:
        tx.append_staged("out", [("p2/a", 2)])
    with store.transaction() as tx:  # metadata ending in another hash: the suffix replaced
        tx.append_staged("out", [("p2/a", 1)], meta_cut=3, meta_suffix=b"\x00\xff\x84")
        assert tx.drop_staged("p2") == 1 and tx.drop_staged("nobody") == 0
    assert store.read("out")[5].meta_data == m[0][:-3] + b"\x00\xff\x84"
    assert store.check() == []
    store.collect_staged()  # frees the space of what was dropped (if the store defers it)
    assert store.collect_staged() == 0


@pytest.mark.parametrize("n", [1, 499, 500, 501, 1234])
def test_staged_parts_of_any_size_come_back_whole_and_in_order(store, n):
    """Bulk staging binds many rows to one statement (SQLite: ROWS_PER_STATEMENT): a
    part of any length, across and between those chunks, arrives entire and in order."""
    e = [encode(x) for x in range(n)]
    m = [None if x % 7 == 0 else encode(-x) for x in range(n)]
    store.stage("p", "p/t", {"out": (e, m)})
    with store.transaction() as tx:
        assert tx.append_staged("out", [("p/t", n)]) == 0
        tx.drop_staged("p")
    got = store.read("out", 0, n + 1)
    assert [(x.index, x.data, x.meta_data) for x in got] == list(zip(range(n), e, m))


def test_staging_inside_a_transaction_is_refused_alike_everywhere(store):
    """Staging is a transaction of its own: both stores refuse it inside one with the
    same line (SQLite used to fail on attaching its staging files, obscurely), and the
    open transaction is unharmed."""
    tx = store.begin()
    tx.append("a", 1)
    with pytest.raises(StoreError, match=r"^stage\(\) inside a transaction$"):
        store.stage("p", "p/1", {"out": ([encode(1)], [None])})
    tx.commit()
    store.stage("p", "p/1", {"out": ([encode(1)], [None])})
    store.attach_staged()
    with store.transaction() as tx:
        assert tx.append_staged("out", [("p/1", 1)]) == 0
        tx.drop_staged("p")
    assert [e.value for e in store.read("out")] + [e.value for e in store.read("a")] == [1, 1]


def test_a_transaction_without_staging_never_needs_the_staging_table(store):
    with store.transaction() as tx:
        assert tx.drop_staged("p") == 0
        assert tx.append_staged("out", []) == 0
    with pytest.raises(StoreError, match="no staged rows"), store.transaction() as tx:
        tx.append_staged("out", [("t", 1)])


def _shard_tables(path) -> list[str]:
    con = sqlite3.connect(str(path))
    try:
        return sorted(r[0] for r in con.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name GLOB 't[0-9]*'"))
    finally:
        con.close()


def test_sqlite_staging_shards_let_stagers_work_in_parallel_and_are_collected(tmp_path):
    from dataspace.streams.sqlite import STAGE_SHARDS

    store = open_store(tmp_path)
    try:
        rows = {"out": ([encode(1), encode(2)], [None, None])}
        # A stager holding a shard's lock does not make another wait: it takes the next.
        blocker = store._stage_conn(os.getpid() % STAGE_SHARDS)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            store.stage("p", "p/b", rows)  # no wait (the busy timeout is 30 s)
        finally:
            blocker.execute("ROLLBACK")
        busy = store.stage_path(os.getpid() % STAGE_SHARDS)
        used = store.stage_path((os.getpid() + 1) % STAGE_SHARDS)
        assert _shard_tables(used) == ["t1"] and (not busy.exists() or _shard_tables(busy) == [])
        store.stage("p", "p/c", rows)  # the free first shard again
        with store.transaction() as tx:
            assert tx.append_staged("out", [("p/b", 2), ("p/c", 2)]) == 0
            assert tx.drop_staged("p") == 4
        assert [e.value for e in store.read("out")] == [1, 2, 1, 2]
        # Dropped parts' tables wait for collect_staged; ids are not reused meanwhile.
        assert _shard_tables(busy) == ["t1"]
        store.stage("p", "p/d", rows)
        assert _shard_tables(busy) == ["t1", "t2"]
        assert store.collect_staged() == 2  # t1 in each shard; p/d's table stays
        assert _shard_tables(busy) == ["t2"] and _shard_tables(used) == []
        with store.transaction() as tx:
            assert tx.append_staged("out", [("p/d", 2)]) == 4
    finally:
        store.close()
    # The staging files are beside the store; the store itself is sound and ours.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith("-stage", 0, -1)) == sorted(
        {busy.name, used.name})
    assert open_store(tmp_path).check() == []


def test_sqlite_deferred_checkpoints_happen_in_collect_staged(tmp_path):
    store = open_store(tmp_path)
    try:
        db = tmp_path / STREAMS_DB
        big = [encode(bytes(400))] * 20_000  # about 2,500 pages: past the 1,000 of autocheckpoint
        store.append_many("warm", [1])
        size0 = db.stat().st_size
        store.defer_checkpoints()
        with store.transaction() as tx:
            tx.append_encoded("a", big)
        assert db.stat().st_size == size0  # the commit left the rows in the log
        store.collect_staged()
        assert db.stat().st_size > size0 + 8_000_000  # ...and collect_staged folded them in
        assert len(store.read("a", 19_990)) == 10
    finally:
        store.close()


# -- locks ------------------------------------------------------------------------------------


_LOCK_CHILD = """
import sys
from dataspace.streams import open_store
s = open_store(sys.argv[1])
lock = s.lock("graph:g")
print("locked", flush=True)
sys.stdin.readline()
"""


def test_a_lock_is_exclusive_and_released_when_its_holder_dies(store_url):
    with open_store(store_url) as store:
        store.create_stream("x")
        lock = store.lock("graph:g")
        assert store.lock_holder("graph:g") is not None and str(os.getpid()) in store.lock_holder("graph:g")
        with pytest.raises(LockHeld, match="is held by pid"):
            store.lock("graph:g")
        lock.release()
        lock.release()  # idempotent
        assert store.lock_holder("graph:g") is None
        other = store.lock("graph:other")  # independent names

        child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_LOCK_CHILD), store_url],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "locked"
            with pytest.raises(LockHeld) as e:
                store.lock("graph:g")
            assert f"pid {child.pid}" in e.value.holder
            assert f"pid {child.pid}" in store.lock_holder("graph:g")
            child.kill()  # SIGKILL: no clean-up of its own
            assert child.wait(30) == -9
        finally:
            if child.poll() is None:
                child.kill()
        wait_lock_free(store_url, "graph:g")
        assert store.lock_holder("graph:g") is None
        store.lock("graph:g").release()
        other.release()


# -- bad databases, bad URLs, a server that is not there (PostgreSQL) ---------------------------


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


def test_a_database_of_another_application_is_refused(pg_server, pg_url):
    db = pg_url.rsplit("/", 1)[1]
    pg_server.execute(db, "CREATE SCHEMA dataspace")
    pg_server.execute(db, "CREATE TABLE dataspace.customers (id int, name text)")
    with pytest.raises(ForeignStore, match="another application's tables") as e:
        open_store(pg_url)
    assert pg_server.password not in _one_line(e.value) and "***" in str(e.value)
    pg_server.execute(db, "CREATE TABLE dataspace.store_meta (key text, value text)")
    pg_server.execute(db, "INSERT INTO dataspace.store_meta VALUES ('format', 'their-app')")
    with pytest.raises(ForeignStore, match="format 'their-app'"):
        open_store(pg_url)


def test_other_tables_in_the_database_are_no_problem(pg_server, pg_url):
    db = pg_url.rsplit("/", 1)[1]
    pg_server.execute(db, "CREATE TABLE public.customers (id int, name text)")
    with open_store(pg_url) as s:
        s.append("x", 1)
    assert pg_server.execute(db, "SELECT count(*) FROM public.customers") == [(0,)]


def test_a_newer_or_damaged_postgresql_store_is_refused(pg_server, pg_url):
    db = pg_url.rsplit("/", 1)[1]
    with open_store(pg_url) as s:
        s.append_many("s", range(10))
    pg_server.execute(db, "UPDATE dataspace.store_meta SET value = '99' WHERE key = 'version'")
    with pytest.raises(ForeignStore, match=r"newer dataspace.*upgrade dataspace") as e:
        open_store(pg_url)
    _one_line(e.value)
    pg_server.execute(db, "UPDATE dataspace.store_meta SET value = '1' WHERE key = 'version'")
    pg_server.execute(db, "DROP TABLE dataspace.tailers")
    with pytest.raises(StoreCorrupt, match=r"missing tables \(tailers\).*backup") as e:
        open_store(pg_url)
    _one_line(e.value)


def test_damage_after_opening_is_a_store_error_and_check_finds_inconsistencies(pg_server, pg_url):
    db = pg_url.rsplit("/", 1)[1]
    with open_store(pg_url) as s:
        s.append_many("s", range(10))
        assert s.check() == []
        pg_server.execute(db, "UPDATE dataspace.streams SET next_index = 5")
        pg_server.execute(db, "UPDATE dataspace.commit_order SET seq = 3")
        problems = s.check()
        assert any("at or beyond next index 5" in p for p in problems), problems
        assert any("commit counter (3)" in p for p in problems), problems
        pg_server.execute(db, "DROP TABLE dataspace.entries")
        with pytest.raises(StoreCorrupt, match="damaged") as e:
            s.read("s")
        _one_line(e.value)


def test_a_wrong_password_is_one_line_without_the_password(pg_server, pg_url):
    bad = pg_url.replace(pg_server.password, "not-the-password")
    with pytest.raises(StoreError) as e:
        open_store(bad)
    msg = _one_line(e.value)
    assert "password authentication failed" in msg and "check the user and password" in msg
    assert "not-the-password" not in msg and pg_server.password not in msg


def test_a_server_that_is_down_is_one_line_saying_what_to_do(pg_server):
    import socket

    with socket.socket() as sock:  # a loopback port where nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"postgresql://someone:s3cret@127.0.0.1:{port}/db"
    with pytest.raises(StoreError) as e:
        open_store(url, connect_timeout=5)
    msg = _one_line(e.value)
    assert "cannot reach the PostgreSQL server" in msg and "is it running?" in msg
    assert "s3cret" not in msg and "someone:***@" in msg


def test_a_missing_database_says_to_create_it(pg_server):
    with pytest.raises(StoreError, match="does not exist; create it"):
        open_store(pg_server.url("no_such_database"))


def test_store_urls_that_are_neither_sqlite_nor_postgresql_are_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url in ("mysql://u:pw@host/db", "redis://localhost", "postgresql:db"):
        with pytest.raises(ValueError) as e:
            open_store(url)
        assert "pw" not in str(e.value)
    assert list(tmp_path.iterdir()) == []  # no file or directory of that name
    with open_store(f"sqlite:{tmp_path}/x.sqlite3") as s:
        assert s.path == tmp_path / "x.sqlite3"


def test_the_postgresql_listener_comes_back_after_its_connection_is_killed(pg_server, pg_url):
    """A lost LISTEN connection wakes every reader (to look again) and is re-established:
    appends after it still wake readers."""
    db = pg_url.rsplit("/", 1)[1]
    with open_store(pg_url) as store, open_store(pg_url) as writer:
        g = store.generation()
        killed = pg_server.execute(db, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                       "WHERE application_name = 'dataspace-listen' AND datname = current_database()")
        assert killed == [(True,)]
        g = store.wait_change(g, 30)  # woken by the loss
        assert store.wait_until(lambda: pg_server.execute(
            db, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'dataspace-listen'")[0][0] == 1,
            30)  # listening again (each reconnection bumps the generation: no polling here)
        g = store.generation()
        writer.append("s", 1)
        assert store.wait_change(g, 30) != g
        assert store.next_index("s") == 1
