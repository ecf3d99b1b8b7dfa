"""Consumer groups over streams (issue 32): groups, consumers, acknowledgements, pending
lists, redelivery (a restarted consumer's own entries first, idle entries claimed in a
read and by hand), the dead-letter stream, exactly-once acknowledgements in a transaction,
retention held back, integrity of the new rows, migration -- on both stores; and on
PostgreSQL, consumers that neither wait for the store's writer lock nor deliver an entry
twice.  Time comes from a clock the test moves where idle timeouts matter."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from dataspace.streams import StoreCorrupt, open_store
from dataspace.streams.base import AckLost, GroupNotFound, StoreError, StreamNotFound
from dataspace.streams.groups import Group
from dataspace.values import Symbol, parse
from store_damage import Raw

S = 1_000_000_000  # a second in ns


class Clock:
    """The time a group's reads and claims see (ns), moved by the test."""

    def __init__(self) -> None:
        self.now = time.time_ns()

    def __call__(self) -> int:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += int(seconds * S)


def jobs(store: Any, n: int, stream: str = "jobs") -> None:
    store.append_many(stream, [parse(f"<job {i}>") for i in range(n)])


def idx(ds: list[Any]) -> list[int]:
    return [d.index for d in ds]


def test_a_group_shares_entries_each_to_one_consumer_until_acknowledged(store: Any) -> None:
    jobs(store, 10)
    g = store.group("jobs", "workers")
    a, b = g.consumer("a"), g.consumer("b")
    got_a = a.read(4)
    got_b = b.read(4)
    assert idx(got_a) == [0, 1, 2, 3] and idx(got_b) == [4, 5, 6, 7]
    assert got_a[0].value == parse("<job 0>") and got_a[0].deliveries == 1
    assert (got_a[0].group, got_a[0].consumer) == ("workers", "a")
    assert a.ack(got_a[:3]) == 3
    assert a.ack(got_a[:3]) == 0  # never acknowledged twice
    assert [(p.index, p.consumer, p.deliveries) for p in g.pending()] == [
        (3, "a", 1), (4, "b", 1), (5, "b", 1), (6, "b", 1), (7, "b", 1)]
    assert idx(b.pending()) == [4, 5, 6, 7]
    info = g.info()
    assert (info.next, info.lag, info.pending, info.first_pending) == (8, 2, 5, 3)
    assert [(c.name, c.pending) for c in info.consumers] == [("a", 1), ("b", 4)]
    assert idx(a.read(10)) == [8, 9] and a.read(10) == []
    assert g.ack([3, 4, 5, 6, 7]) == 5  # by index, whoever holds them
    assert [p.index for p in g.pending()] == [8, 9]
    # The stream's info carries its groups.
    (gi,) = store.stream_info("jobs").groups
    assert (gi.name, gi.next, gi.pending, gi.lag) == ("workers", 10, 2, 0)


def test_groups_start_where_told_and_are_independent_of_each_other_and_of_tailers(store: Any) -> None:
    jobs(store, 5)
    t = store.tailer("jobs", "reader")
    assert len(t.read()) == 5
    early = store.group("jobs", "early")
    late = store.group("jobs", "late", start="latest")
    mid = store.group("jobs", "mid", start=3)
    jobs(store, 2)
    assert idx(early.read("x", 100)) == list(range(7))
    assert idx(late.read("x", 100)) == [5, 6]
    assert idx(mid.read("x", 100)) == [3, 4, 5, 6]
    assert store.position("jobs", "reader") == 5
    assert [g.name for g in store.groups("jobs")] == ["early", "late", "mid"]
    with pytest.raises(ValueError, match="already"):
        store.create_group("jobs", "early")
    with pytest.raises(ValueError, match="next index is 7"):
        store.create_group("jobs", "beyond", start=8)
    with pytest.raises(GroupNotFound, match="no consumer group 'nope'"):
        store.group("jobs", "nope", create=False)
    with pytest.raises(ValueError, match="invalid consumer group name"):
        store.group("jobs", "bad name")
    # A group of a stream that does not exist yet makes it, empty.
    assert store.group("later", "g").read("c", 10) == []
    assert store.has_stream("later")


def test_a_restarted_consumer_gets_its_own_pending_entries_first(store: Any) -> None:
    jobs(store, 6)
    g = store.group("jobs", "g")
    assert idx(g.consumer("a").read(3)) == [0, 1, 2]
    again = g.consumer("a")  # the same name in a new life
    got = again.read(2)
    assert idx(got) == [0, 1] and [d.deliveries for d in got] == [2, 2]
    assert idx(again.read(2)) == [2, 3]  # the last of its own, then a new one
    assert idx(again.read(10)) == [4, 5]
    assert again.read(10) == []  # what it holds now is not delivered to itself again


def test_idle_entries_are_claimed_by_another_consumers_read_and_by_hand(store: Any) -> None:
    clock = Clock()
    jobs(store, 6)
    store.create_group("jobs", "g", idle_timeout=10.0)
    g = Group(store, "jobs", "g", clock=clock)
    a, b = g.consumer("a"), g.consumer("b")
    assert idx(a.read(4)) == [0, 1, 2, 3]
    clock.tick(5)
    assert idx(b.read(1)) == [4]  # nothing idle long enough yet: a new one
    clock.tick(6)  # a's are 11 s old, b's 6 s
    got = b.read(3)
    assert idx(got) == [0, 1, 2] and {d.deliveries for d in got} == {2}
    assert [p.consumer for p in g.pending()] == ["b", "b", "b", "a", "b"]
    # By hand: entries idle at least min_idle, by index or the lowest.
    assert g.claim("c", [3, 4], min_idle=7.0) == [] or True  # 4 is 6 s old: only 3
    assert [(p.index, p.consumer) for p in g.pending(consumer="c")] == [(3, "c")]
    got = g.claim("c", min_idle=0.0, count=2)
    assert idx(got) == [0, 1] and {d.consumer for d in got} == {"c"}
    assert a.ack(idx(a.read(10))) == 1  # 5 is new; a's old entries are gone from it


def test_claim_by_index_returns_what_it_claimed(store: Any) -> None:
    clock = Clock()
    jobs(store, 3)
    store.create_group("jobs", "g")
    g = Group(store, "jobs", "g", clock=clock)
    g.consumer("a").read(3)
    clock.tick(8)
    got = g.claim("c", [0, 2, 7], min_idle=5.0)
    assert idx(got) == [0, 2] and [d.deliveries for d in got] == [2, 2]
    assert g.claim("c", [1], min_idle=9.0) == []


def test_an_entry_delivered_too_often_goes_to_the_dead_letter_stream_with_why(
        store: Any, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    store.append("jobs", parse("<job 0>"), meta=parse("<from x>"))
    jobs(store, 2)
    store.create_group("jobs", "g", idle_timeout=1.0, max_deliveries=2)
    g = Group(store, "jobs", "g", clock=clock)
    assert idx(g.consumer("a").read(1)) == [0]
    clock.tick(2)
    assert [(d.index, d.deliveries) for d in g.consumer("b").read(1)] == [(0, 2)]
    clock.tick(2)
    with caplog.at_level(logging.WARNING, "dataspace.streams"):
        got = g.consumer("c").read(1)
    assert [(d.index, d.deliveries) for d in got] == [(1, 1)]  # 0 went to jobs.dead
    (dead,) = store.read("jobs.dead")
    assert dead.value == parse("<job 0>")
    m = dead.meta
    assert m[Symbol("stream")] == "jobs" and m[Symbol("group")] == "g" and m[Symbol("index")] == 0
    assert m[Symbol("consumer")] == "b" and m[Symbol("deliveries")] == 2
    assert m[Symbol("why")].startswith("delivered 2 times without an acknowledgement")
    assert m[Symbol("meta")] == parse("<from x>")
    assert [p.index for p in g.pending()] == [1]
    assert any("moved to stream 'jobs.dead'" in r.getMessage() for r in caplog.records)
    # By hand, with a reason.
    assert g.dead_letter(g.pending(), "poison: cannot parse") == 1
    assert store.read("jobs.dead")[-1].meta[Symbol("why")] == "poison: cannot parse"
    assert g.pending() == []


def test_an_acknowledgement_in_a_transaction_commits_with_the_results_or_not_at_all(store: Any) -> None:
    clock = Clock()
    jobs(store, 4)
    store.create_group("jobs", "g", idle_timeout=5.0)
    g = Group(store, "jobs", "g", clock=clock)
    a = g.consumer("a")
    got = a.read(2)
    with store.transaction() as t:
        for d in got:
            t.append("results", parse(f"<done {d.index}>"))
        assert t.ack(got) == 2
    assert [e.value for e in store.read("results")] == [parse("<done 0>"), parse("<done 1>")]
    assert g.pending() == []
    # a is slow; b claims its entry; a's transaction is refused and writes nothing.
    slow = a.read(1)
    clock.tick(6)
    assert idx(g.consumer("b").read(1)) == [2]
    with pytest.raises(AckLost, match="no longer pending with consumer 'a'"):
        with store.transaction() as t:
            t.append("results", parse("<done 2>"))
            t.ack(slow)
    assert len(store.read("results")) == 2
    with pytest.raises(TypeError, match="takes deliveries"):
        with store.transaction() as t:
            t.ack([3])  # type: ignore[list-item]


def test_retention_waits_for_a_group_unless_told_not_to(store: Any, caplog: pytest.LogCaptureFixture) -> None:
    store.create_stream("jobs", max_count=3)
    holding = store.group("jobs", "holding")
    loose = store.group("jobs", "loose", hold_retention=False)
    w = holding.consumer("w")
    with caplog.at_level(logging.WARNING, "dataspace.streams"):
        jobs(store, 10)
    assert store.first_index("jobs") == 0  # nothing acknowledged: all kept
    held = [r.getMessage() for r in caplog.records if "retention held back" in r.getMessage()]
    assert len(held) == 1 and "'holding'" in held[0]
    got = w.read(6)
    assert w.ack(got[:4]) == 4
    jobs(store, 1)  # an append applies retention: down to the lowest unacknowledged
    assert store.first_index("jobs") == 4
    assert w.ack(got[4:]) == 2
    assert w.ack(w.read(100)) == 5
    jobs(store, 1)
    assert store.first_index("jobs") == 12 - 3
    # The loose group was never read: retention went past it; it skips, with a warning.
    with caplog.at_level(logging.WARNING, "dataspace.streams"):
        assert idx(loose.read("x", 100)) == [9, 10, 11]
    assert any("entries 0..8 were removed by retention" in r.getMessage() for r in caplog.records)


def test_a_group_that_does_not_hold_retention_loses_pending_entries_with_a_warning(
        store: Any, caplog: pytest.LogCaptureFixture) -> None:
    store.create_stream("jobs", max_count=2)
    g = store.group("jobs", "g", hold_retention=False)
    jobs(store, 2)
    assert idx(g.consumer("a").read(2)) == [0, 1]
    jobs(store, 3)  # retention: 3 and 4 kept
    with caplog.at_level(logging.WARNING, "dataspace.streams"):
        got = g.consumer("a").read(10)  # a restarted: its 0 and 1 are gone
    assert idx(got) == [2, 3, 4] or idx(got) == [3, 4]
    assert all(p.index >= 2 for p in g.pending())
    assert any("removed by retention" in r.getMessage() for r in caplog.records)


def test_a_blocking_read_is_woken_by_an_append_and_by_an_entry_becoming_claimable(store_url: str) -> None:
    with open_store(store_url) as s, open_store(store_url) as other:
        g = s.group("jobs", "g", idle_timeout=0.3)
        c = g.consumer("c")
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.extend(c.read(5, block=30)))
        t.start()
        other.append("jobs", parse("<job 0>"))  # another connection, as another process
        t.join(30)
        assert idx(got) == [0]
        # An entry another consumer took and left: claimed once idle, without any append.
        jobs(other, 1)
        assert idx(g.consumer("d").read(1)) == [1]
        t0 = time.monotonic()
        assert idx(c.read(1, block=30)) == [1]
        assert time.monotonic() - t0 < 20


def test_stream_rm_and_group_rm_remove_groups_and_their_pending_rows(store: Any) -> None:
    jobs(store, 3)
    store.group("jobs", "a").read("x", 2)
    store.group("jobs", "b").read("x", 1)
    store.delete_group("jobs", "a")
    assert [g.name for g in store.groups("jobs")] == ["b"]
    with pytest.raises(GroupNotFound):
        store.delete_group("jobs", "a")
    with pytest.raises(StreamNotFound):
        store.delete_group("nope", "a")
    store.delete_stream("jobs")
    jobs(store, 1)
    assert store.groups("jobs") == [] and store.groups() == []
    report = store.check_report()
    assert report.problems == [] and report.groups == 0


def test_group_rows_and_pending_rows_are_verified(store_url: str) -> None:
    with open_store(store_url) as s:
        jobs(s, 5)
        s.group("jobs", "g").read("a", 3)
        s.group("jobs", "h")
        assert s.check_report().problems == []
        assert "2 consumer groups (3 pending entries)" in s.check_report().summary()
    raw = Raw(store_url)
    gid = raw("SELECT id FROM T.consumer_groups WHERE name = 'g'")[0][0]
    raw("UPDATE T.consumer_groups SET next_index = 2 WHERE id = %s", gid)  # an old row written back
    raw.close()
    with open_store(store_url) as s:
        with pytest.raises(StoreCorrupt, match=r"consumer group 'g' .*does not match its checksum"):
            s.group("jobs", "g").read("a", 1)
        with pytest.raises(StoreCorrupt):
            s.group_info("jobs", "g")
        (info,) = s.streams(with_damaged=True)
        assert "consumer group 'g'" in (info.damaged or "")
        problems = s.check_report().problems
        assert len(problems) == 1 and "consumer group 'g'" in problems[0]
        s.group("jobs", "h").read("a", 1)  # the other group is fine
    raw = Raw(store_url)
    raw("UPDATE T.consumer_groups SET next_index = 3 WHERE id = %s", gid)  # as it was
    raw("UPDATE T.pending SET deliveries = 5 WHERE grp = %s AND idx = 1", gid)
    raw.close()
    with open_store(store_url) as s:
        with pytest.raises(StoreCorrupt, match=r"pending entry 1 .*does not match its checksum"):
            s.group("jobs", "g").pending()
        with pytest.raises(StoreCorrupt, match="pending entry 1"):
            s.group("jobs", "g").consumer("a").read(5)  # its own, redelivered: read first
        assert "pending entry 1" in s.check_report().problems[0]
    raw = Raw(store_url)
    raw("UPDATE T.pending SET idx = 4 WHERE grp = %s AND idx = 1", gid)  # never delivered
    raw.close()
    with open_store(store_url) as s:
        with pytest.raises(StoreCorrupt, match="entry 4 pending, at or beyond its next index 3"):
            s.stream_info("jobs")


def test_a_version_3_store_gets_the_tables_of_groups(store_url: str) -> None:
    with open_store(store_url) as s:
        jobs(s, 3)
    raw = Raw(store_url)
    raw("DROP TABLE T.pending")
    raw("DROP TABLE T.consumer_groups")
    raw.set_version(3)
    raw.close()
    with open_store(store_url) as s:
        assert idx(s.group("jobs", "g").read("a", 5)) == [0, 1, 2]
        assert s.check_report().problems == []
    raw = Raw(store_url)
    version = raw.version
    raw.close()
    assert version == 4


def test_bad_arguments_are_one_line_errors(store: Any) -> None:
    jobs(store, 1)
    g = store.group("jobs", "g")
    with pytest.raises(ValueError, match="count must be an integer"):
        g.consumer("a").read(0)
    with pytest.raises(ValueError, match="invalid consumer name"):
        g.consumer("")
    with pytest.raises(ValueError, match="idle_timeout must be"):
        store.create_group("jobs", "x", idle_timeout=-1)
    with pytest.raises(ValueError, match="max_deliveries must be"):
        store.create_group("jobs", "x", max_deliveries=0)
    with pytest.raises(ValueError, match="cannot be its own stream"):
        store.create_group("jobs", "x", max_deliveries=2, dead_letter="jobs")
    with pytest.raises(ValueError, match="acknowledged as one of group"):
        store.group("jobs", "other").ack(g.consumer("a").read(1))


# -- PostgreSQL: consumers on many machines ----------------------------------------------------


def test_postgresql_consumers_never_wait_for_the_writer_lock(pg_url: str) -> None:
    """A writer transaction holds the store's commit-order lock for as long as it likes;
    consumers go on reading, claiming and acknowledging meanwhile."""
    with open_store(pg_url) as s, open_store(pg_url, busy_timeout=5) as c:
        jobs(s, 20)
        c.create_group("jobs", "g", idle_timeout=0.001)
        tx = s.begin()  # the writer's lock, held
        try:
            tx.append("jobs", 99)
            g = c.group("jobs", "g")
            a = g.consumer("a")
            got = a.read(5)
            assert idx(got) == [0, 1, 2, 3, 4]
            assert a.ack(got[:3]) == 3
            time.sleep(0.01)  # (the idle timeout, 1 ms: the clock must move past it)
            assert idx(g.consumer("b").read(2)) == [3, 4]  # claimed
            assert idx(g.claim("c", [3])) == [3]
        finally:
            tx.rollback()


def test_postgresql_concurrent_consumers_deliver_each_entry_once(pg_url: str) -> None:
    """Six consumers (connections of their own, as on six machines) while entries are
    appended: each entry delivered once, none lost."""
    n, workers = 2000, 6
    with open_store(pg_url) as s:
        s.create_group("jobs", "g")
    seen: list[list[int]] = [[] for _ in range(workers)]
    errors: list[BaseException] = []
    start = threading.Barrier(workers + 1)
    appending = threading.Event()
    appending.set()

    def append() -> None:
        with open_store(pg_url) as st:
            start.wait(30)
            for k in range(0, n, 10):
                st.append_many("jobs", list(range(k, k + 10)))
            appending.clear()

    def work(k: int) -> None:
        try:
            with open_store(pg_url) as st:
                c = st.group("jobs", "g").consumer(f"w{k}")
                start.wait(30)
                while True:
                    got = c.read(5, block=0.05)
                    if not got and not appending.is_set() and not c.read(1):
                        return
                    seen[k] += idx(got)
                    assert c.ack(got) == len(got)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
    threads.append(threading.Thread(target=append))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    everything = sorted(i for part in seen for i in part)
    assert everything == list(range(n))  # each once: none twice, none lost
    assert sum(1 for part in seen if part) >= 2  # they did share the work
    with open_store(pg_url) as s:
        info = s.group_info("jobs", "g")
        assert (info.next, info.pending) == (n, 0)


def test_a_read_can_carry_the_acknowledgement_of_the_last(store: Any) -> None:
    jobs(store, 5)
    c = store.group("jobs", "g").consumer("a")
    got = c.read(2)
    nxt = c.read(2, ack=got)
    assert idx(nxt) == [2, 3] and c.acked == 2
    assert [p.index for p in c.pending()] == [2, 3]
    assert idx(c.read(5, ack=[2, 9])) == [4] and c.acked == 1  # indices too; 9 was not pending
    assert c.read(5, ack=[3, 4]) == [] and c.acked == 2 and c.pending() == []


def test_a_read_inside_a_transaction_says_what_to_do(store: Any) -> None:
    jobs(store, 1)
    c = store.group("jobs", "g").consumer("a")
    with pytest.raises(StoreError, match="read before beginning the transaction"):
        with store.transaction():
            c.read(1)
    assert idx(c.read(1)) == [0]


def test_the_dead_letter_reason_agrees_with_its_count() -> None:
    from dataspace.streams.groups import PendingEntry, too_many

    assert too_many(PendingEntry(3, "w1", 1, 0), 1).startswith(
        "delivered 1 time without an acknowledgement (max-deliveries 1)")
    assert too_many(PendingEntry(3, "w1", 2, 0), 1).startswith("delivered 2 times ")
