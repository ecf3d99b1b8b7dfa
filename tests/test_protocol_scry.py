"""Seed 004's machines in simulated time (dataspace.protocol.scrysim): exactly once, in
order, through loss, duplication and reordering; bounded publisher memory; hostile and
forged datagrams."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataspace.protocol.scry import (
    FRAG,
    GET,
    HEAD,
    FixedPoll,
    HazardPoll,
    PoissonPoll,
    Publisher,
    Reader,
    ScryError,
    decode_datagram,
    entry_hash,
)
from dataspace.protocol.scrysim import simulate, trace
from dataspace.values import Record, Symbol, encode

MODELS = {"hazard": HazardPoll, "poisson": PoissonPoll, "fixed": lambda: FixedPoll(0.5)}


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.floats(0.0, 20.0), min_size=1, max_size=40),
    readers=st.integers(1, 6),
    loss=st.sampled_from([0.0, 0.1, 0.3]),
    dup=st.sampled_from([0.0, 0.2]),
    spread=st.sampled_from([0.002, 0.05, 0.5]),
    sizes=st.sampled_from([10, 1024, 3000, 9000]),
    model=st.sampled_from(sorted(MODELS)),
    broadcast=st.booleans(),
    seed=st.integers(0, 1 << 30),
    from_next=st.booleans(),
)
def test_every_reader_gets_every_entry_once_in_order(gaps, readers, loss, dup, spread, sizes,
                                                      model, broadcast, seed, from_next):
    times, t = [], 0.0
    for g in gaps:
        t += g
        times.append(t)
    r = simulate(times, readers, loss=loss, dup=dup, delay=(0.001, 0.001 + spread),
                 poll=MODELS[model], broadcast=broadcast, seed=seed,
                 size=lambda i: (i * 7919) % sizes + 1, settle=600.0,
                 start=None if from_next else 0)
    for d, first, then in zip(r.delivered, r.firsts, r.appended_then, strict=True):
        # From next (the CLI's default): every entry from where the stream ended when the
        # reader learned it, on; from 0: every entry.
        assert first is not None and first <= then
        assert d == list(range(first, len(times)))
    # A premature request never reads the store: at most one read per entry (each is
    # cached once read; the cache holds them all here).
    assert r.store_reads <= len(times)


def test_the_publisher_stays_bounded_under_a_flood_of_future_requests():
    pub = Publisher(ahead=64, max_paths=100, max_requesters=50)
    pub.publish("chat", 10, 0)
    for i in range(50_000):
        addr = (f"10.0.0.{i % 250}", i)
        pub.datagram(encode(Record(GET, ["chat", 10 + (i % 5000), 0])), addr, float(i) * 1e-3)
        pub.take_outgoing()
    mem = pub.memory()
    assert mem["shield_paths"] <= 100
    assert mem["requesters"] <= 100 * 50
    # What the server's memory budget counts for it (no entry cached, no repeat due).
    assert pub.held_bytes() == (mem["shield_paths"] * Publisher.PATH_BYTES
                                + mem["requesters"] * Publisher.REQUESTER_BYTES) > 0
    assert pub.stats.too_far > 0 and pub.stats.loads == 0  # never touched the store
    # And requests for paths of streams not published get an answer, not memory.
    pub.datagram(encode(Record(GET, ["secret", 0, 0])), ("x", 1), 0.0)
    (out, _addr), = pub.take_outgoing()
    assert b"not published" in out


@pytest.mark.parametrize("data", [
    b"", b"\xff\xff", encode(Record(GET, ["chat", -1, 0])), encode(Record(GET, ["chat", 1])),
    encode("just a string"), encode(Record(GET, ["x" * 300, 0, 0])), b"\xb4" * 5000,
])
def test_malformed_datagrams_are_dropped_and_counted(data):
    pub = Publisher()
    pub.publish("chat", 5, 0)
    pub.datagram(data, ("a", 1), 0.0)
    assert pub.take_outgoing() == [] and pub.stats.malformed == 1
    with pytest.raises(ScryError):
        decode_datagram(data)


def test_a_reader_from_next_learns_the_end_then_gets_each_new_entry():
    """`dataspace scry follow URL` (from next): the publisher's <scry-head STREAM NEXT
    FIRST> answer is understood, not dropped as malformed (issue 20, item 2)."""
    pub = Publisher()
    pub.publish("chat", 4, 0)
    r = Reader("chat", None)
    r.begin(0.0)

    def exchange(now: float) -> None:
        for _ in range(10):
            for d in r.take_outgoing():
                pub.datagram(d, "r", now)
            for s, i in pub.take_loads():
                pub.entry(s, i, encode(f"entry {i}"), now)
            out = pub.take_outgoing()
            if not out:
                return
            for d, _a in out:
                r.datagram(d, now)

    exchange(0.0)
    assert r.stats.malformed == 0 and pub.stats.heads == 1
    assert r.next == 4 and pub.stats.waits == 1  # asked for 4 and is remembered for it
    assert [(n.kind, n.index) for n in r.take_notices()] == [("ready", 4)]
    pub.appended("chat", 6, 1.0)                  # two entries appear: 4 is broadcast
    for s, i in pub.take_loads():
        pub.entry(s, i, encode(f"entry {i}"), 1.0)
    for d, _a in pub.take_outgoing():
        r.datagram(d, 1.0)
    exchange(1.0)
    assert [i for i, _ in r.take_entries()] == [4, 5]


def test_answers_are_not_requests_and_requests_are_not_answers():
    pub = Publisher()
    pub.publish("chat", 4, 0)
    pub.datagram(encode(Record(HEAD, ["chat", 4, 0])), "a", 0.0)  # an answer, sent back
    assert pub.take_outgoing() == [] and pub.stats.malformed == 1
    r = Reader("chat", None)
    r.begin(0.0)
    r.take_outgoing()
    r.datagram(encode(Record(HEAD, ["chat"])), 0.1)
    r.datagram(encode(Record(GET, ["chat", 0, 0])), 0.1)
    assert r.next is None and r.stats.ignored == 2 and r.take_notices() == []
    for bad in (Record(HEAD, ["chat", -1, 0]), Record(HEAD, ["chat", 1, "x"]),
                Record(HEAD, ["chat", 1]), Record(Symbol("scry-gone"), ["chat", 1, "x"])):
        with pytest.raises(ScryError):
            decode_datagram(encode(bad))


def run_until(r: Reader, end: float, answer=None, now: float = 0.0) -> list[tuple[float, str]]:
    """Drive a reader by its own deadlines (simulated time) up to ``end``; each request
    goes to ``answer(data, now)``, which returns datagrams for the reader (or nothing).
    A deadline that does not move once passed fails the test (the loop is bounded)."""
    seen: list[tuple[float, str]] = []
    for _ in range(10_000):
        for d in r.take_outgoing():
            for back in (answer(d, now) if answer else None) or ():
                r.datagram(back, now)
        seen += [(now, n.kind) for n in r.take_notices()]
        d = r.next_deadline()
        if d is None or d > end:
            return seen
        now = max(now, d)
        r.tick(now)
    raise AssertionError("the reader's deadlines never passed the end")


def test_a_reader_says_when_nothing_answers_and_keeps_trying():
    r = Reader("chat", None, quiet=3.0)
    r.begin(0.0)
    seen = run_until(r, 60.0)
    assert seen == [(3.0, "silent")]   # once, after 3 s
    assert r.error is None and r.stats.requests > 30  # still asking, a minute later
    n = Reader("chat", 5, quiet=3.0)
    n.begin(0.0)
    assert run_until(n, 60.0) == [(3.0, "silent")] and n.stats.retries > 5


def test_a_deadline_reached_is_acted_on_whatever_the_rounding():
    # 0.7 + 2.9 - 0.7 < 2.9 in floating point: the notice is due at the deadline itself.
    r = Reader("chat", 5, quiet=2.9, give_up=4.1)
    r.begin(0.7)
    assert run_until(r, 60.0, now=0.7) == [(0.7 + 2.9, "silent"), (0.7 + 4.1, "gave-up")]


def test_a_reader_gives_up_when_told_and_then_sends_nothing():
    r = Reader("chat", 0, quiet=3.0, give_up=10.0)
    r.begin(0.0)
    seen = run_until(r, 60.0)
    assert seen == [(3.0, "silent"), (10.0, "gave-up")]
    assert r.error == "no answer for 10 s" and r.next_deadline() is None
    r.tick(20.0)
    assert r.take_outgoing() == []


def test_a_reader_says_when_the_publisher_answers_again():
    pub = Publisher()
    pub.publish("chat", 0, 0)
    up = [False]

    def answer(data, now):
        if not up[0]:
            return []
        pub.datagram(data, "r", now)
        return [d for d, _a in pub.take_outgoing()]

    r = Reader("chat", None, quiet=3.0)
    r.begin(0.0)
    assert run_until(r, 5.0, answer) == [(3.0, "silent")]
    up[0] = True
    seen = run_until(r, 30.0, answer)
    kinds = [k for _t, k in seen]
    assert kinds == ["back", "ready"], seen   # then quiet: waits are acknowledged
    assert r.next == 0 and r.error is None


def test_a_request_too_far_ahead_is_answered_though_not_remembered():
    pub = Publisher(ahead=64)
    pub.publish("chat", 10, 0)
    r = Reader("chat", 1000, quiet=3.0)
    r.begin(0.0)

    def answer(data, now):
        pub.datagram(data, "r", now)
        return [d for d, _a in pub.take_outgoing()]

    assert run_until(r, 60.0, answer) == [(0.0, "ready")]  # never "silent"
    assert pub.stats.too_far > 0 and pub.memory()["shield_paths"] == 0
    assert r.known_next == 10


def frag(stream, index, data, total=1, n=0, h=None, nxt=None, waiting=False):
    return encode(Record(FRAG, [stream, index, n, total, h or entry_hash(data),
                                index + 1 if nxt is None else nxt, data, waiting]))


def test_a_reader_accepts_no_forged_entry_for_the_wrong_path_or_content():
    r = Reader("chat", 3)
    r.begin(0.0)
    good = encode("hello")
    r.datagram(frag("other", 3, good), 0.1)          # another stream
    r.datagram(frag("chat", 4, encode("x")), 0.1)    # not the path asked (kept, not given)
    r.datagram(frag("chat", 3, encode("forged"), h=entry_hash(good)), 0.1)  # wrong content
    assert r.take_entries() == []
    assert r.stats.ignored == 1 and r.stats.bad_hash == 1
    r.datagram(frag("chat", 3, good), 0.2)
    assert [i for i, _ in r.take_entries()] == [3, 4]


def test_entries_of_many_fragments_are_reassembled():
    data = bytes(range(256)) * 20  # 5,120 bytes: 5 fragments
    pub = Publisher()
    pub.publish("big", 1, 0)
    r = Reader("big", 0)
    r.begin(0.0)
    for _ in range(10):
        for d in r.take_outgoing():
            pub.datagram(d, "r", 0.0)
        for s, i in pub.take_loads():
            pub.entry(s, i, data, 0.0)
        for d, _a in pub.take_outgoing():
            r.datagram(d, 0.0)
    assert r.take_entries() == [(0, data)]
    assert r.stats.fragments == 5


def test_trace_generators_are_seeded():
    assert trace("bursty", 3) == trace("bursty", 3)
    assert trace("bursty", 3) != trace("bursty", 4)
    assert len(trace("steady", 1, duration=100)) >= 80
