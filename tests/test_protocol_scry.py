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
from dataspace.values import Record, encode

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
)
def test_every_reader_gets_every_entry_once_in_order(gaps, readers, loss, dup, spread, sizes,
                                                      model, broadcast, seed):
    times, t = [], 0.0
    for g in gaps:
        t += g
        times.append(t)
    r = simulate(times, readers, loss=loss, dup=dup, delay=(0.001, 0.001 + spread),
                 poll=MODELS[model], broadcast=broadcast, seed=seed,
                 size=lambda i: (i * 7919) % sizes + 1, settle=600.0)
    for d in r.delivered:
        assert d == list(range(len(times)))
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
