"""Routing messages on their encoded bytes (dataspace.protocol.route).

* The scanner: what it accepts as canonical is canonical (it re-encodes to the same
  bytes), every canonical encoding is accepted, and the offsets it finds are the items.
* The match cache against the brute-force reference (``pattern.match`` over every live
  observer), through real relays, with observers added and removed between messages, a
  tiny cache (evictions), remote observers (bytes spliced) and in-process ones (decoded
  captures), and each message also sent in a non-canonical encoding: both encodings reach
  the same observers with the same bytes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataspace.dataspace import OBSERVE, Dataspace, DataspaceEntity, Encoded
from dataspace.pattern import DISCARD, Arr, Bind, Dict, Lit, Rec, match, parse_pattern, to_preserves
from dataspace.protocol.relay import Relay, RelayLimits
from dataspace.protocol.route import MessageRouter, is_canonical, scan, scan_rel, skip
from dataspace.protocol.upstream import (
    REJECT,
    RESET,
    SUBSCRIBE,
    Producer,
    chain_to_value,
    pattern_chain,
    value_chain,
)
from dataspace.protocol.wire import Message, Turn, WireRef, parse_packet
from dataspace.values import (
    Annotated,
    Dictionary,
    Embedded,
    Record,
    Sequence,
    Set,
    Symbol,
    decode,
    encode,
    key,
)
from strategies import annotated_values, values

M = Symbol("M")
A, B = Symbol("A"), Symbol("B")

# ---------------------------------------------------------------------------------------
# The scanner


def _items_of(v: Any) -> list[Any]:
    t = type(v)
    if t is Record:
        return [v.label, *v.fields]
    if t is Sequence:
        return list(v)
    if t is Set:
        return sorted(v, key=encode)
    if t is Dictionary:
        out = []
        for k, x in sorted(v.items(), key=lambda kv: encode(kv[0])):
            out += [k, x]
        return out
    return []


@settings(max_examples=200)
@given(values, st.binary(max_size=5))
def test_relative_offsets_are_the_absolute_ones_less_the_start(v, before):
    """What Encoded keeps (scan_rel) is scan's offsets, each but the start made relative
    to the start, wherever the value sits in the buffer."""
    b = before + encode(v)
    p = len(before)
    items = scan(b, p, 0)
    rel = scan_rel(b, p, 0)
    assert items is not None and rel is not None
    assert rel[0] == items[0] == p
    assert [p + x for x in rel[1:]] == items[1:]


@settings(max_examples=500)
@given(values)
def test_canonical_encodings_are_accepted_and_their_items_found(v):
    b = encode(v)
    assert is_canonical(b)
    assert skip(b, 0, 0) == len(b)
    items = scan(b, 0, 0)
    assert items is not None
    assert items[0] == 0 and items[-1] == len(b)
    expected = _items_of(v)
    assert len(items) - 3 == len(expected)
    for i, x in enumerate(expected):
        assert key(decode(b[items[i + 1]:items[i + 2]])) == key(x)
    if expected:
        assert b[items[-2]] == 0x84


def _noncanonical(v: Any, out: bytearray) -> None:
    """An encoding of ``v`` that is valid but not canonical: integers one byte longer
    than needed, sets and dictionaries in reverse canonical order, lengths as two-byte
    varints where they fit in one."""
    t = type(v)
    if t is int:
        n = ((v if v >= 0 else ~v).bit_length() + 8) >> 3
        body = v.to_bytes(n + 1, "big", signed=True)
        out += bytes((0xB0, len(body))) + body
    elif t is str or t is Symbol:
        body = (v if t is str else v.name).encode()
        out.append(0xB1 if t is str else 0xB3)
        out += bytes((0x80 | (len(body) & 0x7F), len(body) >> 7)) + body
    elif t is Record:
        out.append(0xB4)
        for x in [v.label, *v.fields]:
            _noncanonical(x, out)
        out.append(0x84)
    elif t is Sequence:
        out.append(0xB5)
        for x in v:
            _noncanonical(x, out)
        out.append(0x84)
    elif t is Set:
        out.append(0xB6)
        for x in sorted(v, key=encode, reverse=True):
            _noncanonical(x, out)
        out.append(0x84)
    elif t is Dictionary:
        out.append(0xB7)
        for k, x in sorted(v.items(), key=lambda kv: encode(kv[0]), reverse=True):
            _noncanonical(k, out)
            _noncanonical(x, out)
        out.append(0x84)
    else:
        out += encode(v)


def noncanonical(v: Any) -> bytes:
    out = bytearray()
    _noncanonical(v, out)
    return bytes(out)


@settings(max_examples=300)
@given(values)
def test_other_encodings_of_a_value_are_not_taken_for_canonical(v):
    b = noncanonical(v)
    assert key(decode(b)) == key(v)
    assert is_canonical(b) == (b == encode(v))


@settings(max_examples=200)
@given(annotated_values)
def test_annotations_and_embedded_values_are_never_routed_on_bytes(v):
    b = encode(v, annotations=True)
    assert is_canonical(b) == (b == encode(v))
    assert not is_canonical(encode(Sequence([1, Embedded(2)])))


@st.composite
def mutated(draw):
    b = bytearray(encode(draw(values)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.integers(0, 2))
        i = draw(st.integers(0, len(b)))
        if op == 0 and i < len(b):
            b[i] = draw(st.integers(0, 255))
        elif op == 1:
            b.insert(i, draw(st.sampled_from([0x00, 0x84, 0x80, 0xB0, 0xB1, 0xB4, 0xFF, 0xC3])))
        elif i < len(b):
            del b[i]
    return bytes(b)


@settings(max_examples=1000)
@given(st.one_of(mutated(), st.binary(max_size=40)))
def test_what_the_scanner_accepts_decodes_and_reencodes_to_the_same_bytes(b):
    """Soundness against arbitrary input: whatever is accepted is one valid value in
    canonical form (so a key built from its bytes is exact); the rest is left to the
    decoder, which reports what is wrong."""
    end = skip(b, 0, 0)
    items = scan(b, 0, 0)
    assert (items is None) == (end < 0)
    if end < 0:
        return
    assert items is not None and items[-1] == end
    v = decode(b[:end])
    assert encode(v) == b[:end]


def test_hand_made_non_canonical_forms():
    for bad in [
        b"\xb0\x01\x00",  # zero is written with no bytes
        b"\xb0\x02\x00\x05",  # a leading zero byte
        b"\xb0\x02\xff\x85",  # a leading 0xff byte
        b"\xb1\x81\x00",  # a length varint with a trailing zero group
        b"\xb6\xb0\x01\x02\xb0\x01\x01\x84",  # a set out of order
        b"\xb6\xb0\x01\x01\xb0\x01\x01\x84",  # a set with a duplicate
        b"\xb7\xb1\x01b\x80\xb1\x01a\x80\x84",  # a dictionary out of order
        b"\xb7\xb1\x01a\x84",  # ... and one with a key but no value
        b"\xb4\x84",  # a record without a label
        b"\x85\xb1\x01a\x80",  # an annotation
        b"\x86\xb5\xb0\x00\xb0\x01\x01\x84",  # an embedded value
        b"\xb1\x02\xc3\x28",  # invalid UTF-8
        b"\xb3\x01\xff",  # invalid UTF-8 in a symbol
        b"\x87\x04\x00\x00\x00\x00",  # a double of 4 bytes
        b"\xb5\xb0\x01\x01",  # no end marker
    ]:
        assert not is_canonical(bad), bad
        assert scan(bad, 0, 0) is None
    assert is_canonical(b"\xb0\x00")
    assert is_canonical(b"\xb0\x02\x00\x80")  # 128 needs its leading zero
    deep = b"\xb5" * 201 + b"\x84" * 201
    assert not is_canonical(deep)  # deeper than the codec's limit: the decoder reports it


# ---------------------------------------------------------------------------------------
# The router against the brute-force reference, through real relays

ATOMS = [1, 1.0, True, 0, -1, 300, "x", "y", Symbol("s"), b"x"]
atoms = st.sampled_from(ATOMS)
labels = st.sampled_from([A, B])
dict_keys = st.sampled_from(["k", "l", 1, True])

small_values = st.recursive(
    atoms,
    lambda ch: st.one_of(
        st.builds(Record, labels, st.lists(ch, max_size=3)),
        st.lists(ch, max_size=3).map(Sequence),
        st.lists(atoms, max_size=3).map(lambda xs: Set({key(x): x for x in xs}.values())),
        st.dictionaries(dict_keys, ch, max_size=3).map(
            lambda d: Dictionary({key(k): (k, v) for k, v in d.items()}.values())
        ),
    ),
    max_leaves=6,
)

patterns = st.recursive(
    st.one_of(st.just(DISCARD), st.just(Bind()), atoms.map(Lit)),
    lambda ch: st.one_of(
        ch.map(Bind),
        st.builds(Rec, labels, st.dictionaries(st.integers(0, 2), ch, max_size=3)),
        st.dictionaries(st.integers(0, 2), ch, max_size=3).map(Arr),
        st.lists(st.tuples(dict_keys, ch), max_size=3).map(Dict),
    ),
    max_leaves=5,
)


def _packet(bodies: list[bytes]) -> bytes:
    """A Turn packet of messages to OID 0 whose bodies are these encodings."""
    out = bytearray(b"\xb5")
    for body in bodies:
        out += b"\xb5\xb0\x00\xb4\xb3\x01M" + body + b"\x84\x84"
    out += b"\x84"
    return bytes(out)


class Harness:
    """A dataspace with a router, a publisher's relay and observers: remote ones (each
    behind a relay of its own: what it is sent is read back from its packets) and
    in-process ones."""

    def __init__(self, max_entries: int = 8192) -> None:
        self.ds = Dataspace("t")
        self.router = MessageRouter(self.ds, max_entries=max_entries)
        self.entity = DataspaceEntity(self.ds)
        self.pub = Relay(name="pub")
        self.pub.export_at(0, self.entity)
        self.observers: dict[int, tuple[Any, ...]] = {}  # id -> (pattern, kind, handle)
        self.relays: dict[int, Relay] = {}
        self.got: dict[int, list[Any]] = {}
        self.next = 0

    def observe(self, pattern: Any, remote: bool) -> int:
        i = self.next
        self.next += 1
        self.got[i] = []
        if remote:
            r = Relay(name=f"sub{i}", limits=RelayLimits(strict=False))
            proxy = r.import_ref(7)
            h = self.ds.assert_(Record(OBSERVE, [to_preserves(pattern), Embedded(proxy)]))
            self.relays[i] = r
            self.observers[i] = (pattern, "remote", h)
        else:
            got = self.got[i]
            sub = self.ds.observe(pattern, on_message=lambda *caps: got.append(
                tuple(map(key, caps))))
            self.observers[i] = (pattern, "local", sub)
        return i

    def forget(self, i: int) -> None:
        _pattern, kind, h = self.observers.pop(i)
        if kind == "remote":
            self.ds.retract(h)
            self.collect()
            del self.relays[i]
        else:
            h.cancel()

    def collect(self) -> None:
        for i, r in self.relays.items():
            for pkt in r.take_packets():
                v = decode(pkt, embedded=WireRef.from_value)
                # What was spliced is exactly the canonical encoding of what it holds.
                assert encode(v, embedded=lambda w: w.to_value()) == pkt
                p = parse_packet(v)
                assert isinstance(p, Turn)
                for te in p.events:
                    assert te.oid == 7
                    if isinstance(te.event, Message):  # (assertions reach it too)
                        self.got[i].append(tuple(map(key, te.event.body)))

    def expected(self, msgs: list[Any], into: dict[int, list[Any]]) -> None:
        for v in msgs:
            for i, (pattern, _kind, _h) in self.observers.items():
                m = match(pattern, v)
                if m is not None:
                    into[i].append(tuple(map(key, m)))


@st.composite
def scenarios(draw):
    pats = draw(st.lists(patterns, min_size=1, max_size=5))
    vals = draw(st.lists(small_values, min_size=1, max_size=6))
    op = st.one_of(
        st.tuples(st.just("observe"), st.integers(0, len(pats) - 1), st.booleans()),
        st.tuples(st.just("forget"), st.integers(0, 20)),
        st.tuples(st.just("turn"), st.lists(st.integers(0, len(vals) - 1), min_size=1,
                                            max_size=5), st.booleans()),
        st.tuples(st.just("each"), st.lists(st.integers(0, len(vals) - 1), min_size=1,
                                            max_size=3), st.booleans()),
    )
    return pats, vals, draw(st.lists(op, min_size=1, max_size=25)), draw(st.sampled_from([2, 8192]))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_router_agrees_with_brute_force_reference(scenario):
    pats, vals, ops, cap = scenario
    h = Harness(max_entries=cap)
    want: dict[int, list[Any]] = {}
    on_bytes = 0
    for op in ops:
        if op[0] == "observe":
            i = h.observe(pats[op[1]], op[2])
            want[i] = []
        elif op[0] == "forget":
            if h.observers:
                live = sorted(h.observers)
                h.forget(live[op[1] % len(live)])
        else:
            msgs = [vals[j] for j in op[1]]
            # Canonical encodings are routed on their bytes; the others are decoded.
            bodies = [encode(v) if op[2] else noncanonical(v) for v in msgs]
            on_bytes += sum(map(is_canonical, bodies))
            if op[0] == "turn":
                h.pub.receive_data(_packet(bodies))
            else:
                h.pub.receive_data(b"".join(_packet([b]) for b in bodies))
            assert not h.pub.closed, h.pub.error
            h.expected(msgs, want)
            h.collect()
    h.collect()
    for i in want:
        assert h.got[i] == want[i], (i, h.observers.get(i))
    assert h.router.stats.routed == on_bytes  # every canonical one, and only those
    assert h.router.stats.fallbacks == 0  # every capture placed (every plan complete)


def test_routed_messages_use_the_cache_and_handler_changes_invalidate_it():
    h = Harness()
    a = h.observe(parse_pattern("<Says $who $text>"), True)
    b = h.observe(parse_pattern('<Says "bob" $text>'), True)
    msgs = [Record(Symbol("Says"), [who, f"t{i}"]) for i in range(20) for who in ("alice", "bob")]
    h.pub.receive_data(_packet([encode(m) for m in msgs]))
    h.collect()
    st_ = h.router.stats
    assert st_.routed == 40
    assert st_.misses == 2 and st_.hits == 38  # one key per speaker
    assert len(h.got[a]) == 40 and len(h.got[b]) == 20
    c = h.observe(parse_pattern('<Says "alice" $text>'), False)
    h.pub.receive_data(_packet([encode(m) for m in msgs[:2]]))
    h.collect()
    assert st_.misses == 4  # the class's entries were made stale by the new observer
    assert h.got[c] == [(key("t0"),)]


def test_the_cache_is_bounded():
    h = Harness(max_entries=16)
    h.observe(parse_pattern("<Says $who $text>"), True)
    h.observe(parse_pattern('<Says "user-3" $text>'), True)
    msgs = [Record(Symbol("Says"), [f"user-{i}", "hi"]) for i in range(200)]
    h.pub.receive_data(_packet([encode(m) for m in msgs]))
    h.collect()
    assert h.router.entries() <= 16
    assert h.router.stats.evictions > 0
    assert len(h.got[0]) == 200 and len(h.got[1]) == 1


def test_a_turn_too_large_is_refused_before_anything_is_delivered():
    h = Harness()
    h.ds.max_turn_events = 5
    s = h.observe(parse_pattern("<Says $who $text>"), True)
    msgs = [encode(Record(Symbol("Says"), ["a", str(i)])) for i in range(10)]
    h.pub.receive_data(_packet(msgs[:5]))
    h.collect()
    assert len(h.got[s]) == 5
    h.pub.receive_data(_packet(msgs))
    assert h.pub.closed and h.pub.error is not None and "turn too large" in h.pub.error[0]
    h.collect()
    assert len(h.got[s]) == 5  # nothing of the refused turn went out


def test_order_is_kept_when_an_in_process_observer_queues_work():
    """A remote observer's messages never overtake what the dataspace queued for it
    earlier: after an in-process observer queued a callback, later messages go through
    the queue too, in order."""
    h = Harness()
    seen: list[Any] = []
    h.ds.observe("<Says $who $text>", on_message=lambda who, text: seen.append(text))
    r = h.observe(parse_pattern("<Says _ $text>"), True)
    h.pub.receive_data(_packet([encode(Record(Symbol("Says"), ["a", str(i)])) for i in range(5)]))
    h.collect()
    assert h.got[r] == [(str(i),) for i in range(5)]
    assert seen == [str(i) for i in range(5)]


def test_with_a_router_the_tap_hears_only_the_messages_sent_as_values():
    """Runs routed on their bytes go to the router's forwarders (a link's), not to the
    tap; messages sent as values (in process, or received in another encoding) still
    reach the tap, in order."""
    h = Harness()
    heard: list[Any] = []
    h.ds.tap_messages(lambda ms: heard.extend(ms))
    msgs = [Record(Symbol("Says"), ["a", str(i)]) for i in range(3)]
    h.pub.receive_data(_packet([encode(m) for m in msgs]))
    assert heard == []
    assert h.router.stats.routed == 3
    h.pub.receive_data(_packet([noncanonical(msgs[0])]))
    h.ds.send(msgs[1])
    assert heard == [msgs[0], msgs[1]]
    h.ds.tap_messages(None)
    ds = Dataspace("no-router")  # without a router every message is a value: all tapped
    ds.tap_messages(lambda ms: heard.extend(ms))
    ds.send(_encoded(msgs))
    assert heard[2:] == msgs


def test_encoded_messages_sent_in_process():
    """Dataspace.send takes Encoded messages with or without a router."""
    for routed in (True, False):
        ds = Dataspace("x")
        if routed:
            MessageRouter(ds)
        got: list[Any] = []
        ds.observe("<Says $who $text>", on_message=lambda *c, got=got: got.append(c))
        body = encode(Record(Symbol("Says"), ["a", "b"]))
        items = scan(body, 0, 0)
        assert items is not None
        ds.send(Encoded(body, [items, items]))
        with ds.turn():
            ds.send(Encoded(body, [items]))
        assert got == [("a", "b")] * 3


@pytest.mark.parametrize("label", [Symbol("Says"), "text label", 7, Sequence([1, 2])])
def test_labels_of_any_kind(label):
    h = Harness()
    i = h.observe(Rec(label, [Bind(), Lit("x")]), True)
    msgs = [Record(label, [1, "x"]), Record(label, [2, "y"]), Record(Symbol("Other"), [3, "x"])]
    h.pub.receive_data(_packet([encode(m) for m in msgs]))
    h.collect()
    assert h.got[i] == [(key(1),)]


def test_annotated_message_reaches_the_same_observers_as_the_plain_one():
    h = Harness()
    i = h.observe(parse_pattern("<Says $who $text>"), True)
    plain = Record(Symbol("Says"), ["a", "b"])
    h.pub.receive_data(_packet([encode(plain), encode(Annotated(plain, ["note"]),
                                                       annotations=True)]))
    h.collect()
    assert h.got[i] == [(key("a"), key("b"))] * 2
    assert Counter(h.got[i]) == Counter({(key("a"), key("b")): 2})


def test_packets_of_messages_in_a_row_are_each_their_own_turn():
    """Consecutive one-turn packets are routed in one go, but each is still a turn: the
    limit applies to each (those before a refused one are delivered, none after), and a
    callback one of them queues runs before the next is routed."""
    h = Harness()
    h.ds.max_turn_events = 2
    s = h.observe(parse_pattern("<Says $who $text>"), True)
    says = [encode(Record(Symbol("Says"), ["a", str(i)])) for i in range(6)]
    big = _packet(says[:3])  # three deliveries: over the limit
    h.pub.receive_data(b"".join([_packet([says[0]]), _packet(says[1:3]), big, _packet([says[5]])]))
    assert h.pub.closed and h.pub.error is not None and "turn too large" in h.pub.error[0]
    h.collect()
    assert h.got[s] == [(key("a"), key(str(i))) for i in range(3)]
    assert h.pub.turns_in == 3  # the refused one was received

    h = Harness()
    late: list[int] = []
    # An in-process observer that, on the first message, adds a remote one.
    h.ds.observe("<Says _ \"0\">", on_message=lambda: late.append(
        h.observe(parse_pattern("<Says $who $text>"), True)))
    h.pub.receive_data(b"".join(_packet([b]) for b in says))
    h.collect()
    assert len(late) == 1
    assert h.got[late[0]] == [(key("a"), key(str(i))) for i in range(1, 6)]
    assert h.pub.turns_in == 6 and h.pub.packets_in == 6 and h.pub.messages_in == 6


def test_remote_observers_joining_and_leaving_update_the_cache_in_place():
    h = Harness()
    a = h.observe(parse_pattern("<Says $who $text>"), True)
    b = h.observe(parse_pattern('<Says "bob" $text>'), True)
    msgs = [encode(Record(Symbol("Says"), [who, "hi"])) for who in ("alice", "bob", "carol")]
    h.pub.receive_data(_packet(msgs))
    st_ = h.router.stats
    assert st_.misses == 3  # one key per speaker: the plan tests the first field
    c = h.observe(parse_pattern("<Says _ $text>"), True)  # tests what the plan tests
    e = h.observe(parse_pattern('<Says "carol" $text>'), True)
    h.pub.receive_data(_packet(msgs))
    h.collect()
    assert st_.misses == 3 and st_.hits == 3  # the entries were updated, not dropped
    assert h.got[c] == [(key("hi"),)] * 3
    assert h.got[e] == [(key("hi"),)]
    h.forget(a)
    h.forget(b)
    h.pub.receive_data(_packet(msgs))
    h.collect()
    assert st_.misses == 3
    assert len(h.got[a]) == 6 and len(h.got[b]) == 2 and len(h.got[c]) == 6
    assert len(h.got[e]) == 2
    # A pattern testing what the plan does not (the second field) replans the class.
    d = h.observe(parse_pattern('<Says _ "hi">'), True)
    h.pub.receive_data(_packet(msgs))
    h.collect()
    assert st_.misses == 6
    assert len(h.got[d]) == 3


def test_a_class_with_many_entries_is_invalidated_not_updated(monkeypatch):
    from dataspace.protocol import route

    monkeypatch.setattr(route, "PATCH_MAX", 4)
    h = Harness()
    h.observe(parse_pattern('<Says "user-0" $text>'), True)
    msgs = [encode(Record(Symbol("Says"), [f"user-{i}", "hi"])) for i in range(10)]
    h.pub.receive_data(_packet(msgs))
    before = h.router.stats.invalidations
    late = h.observe(parse_pattern("<Says _ $text>"), True)
    assert h.router.stats.invalidations == before + 1
    h.pub.receive_data(_packet(msgs))
    h.collect()
    assert h.got[late] == [(key("hi"),)] * 10


# ---------------------------------------------------------------------------------------
# Forwarders: a link's wants, decided by its producer, cached with the rest


def _encoded(msgs: list[Any]) -> Encoded:
    """``msgs`` as an Encoded run (their canonical encodings, one after another)."""
    buf = b"".join(encode(m) for m in msgs)
    items = []
    p = 0
    while p < len(buf):
        it = scan_rel(buf, p, 0)
        assert it is not None
        items.append(it)
        p = it[0] + it[-1]
    return Encoded(buf, items)


class Forwarder:
    """What a link gives the router (see broker.link._Forward), keeping what it sends."""

    def __init__(self, decide: Any) -> None:
        self.decide = decide
        self.delivered = 0
        self.sent: list[bytes] = []
        self.seen_count = 0

    def seen(self, n: int) -> None:
        self.seen_count += n

    def emit_run(self, head: bytes, parts: list[bytes]) -> None:
        assert head == b""
        self.sent += parts

    def emit_captures(self, head: bytes, parts: tuple[bytes, ...], size: int) -> None:
        assert len(parts) == 1 and size == len(parts[0])
        self.emit_run(head, list(parts))

    def deliver_body(self, body: bytes) -> None:
        self.delivered += 1
        assert body[:1] == b"\xb5" and body[-1:] == b"\x84"
        self.sent.append(body[1:-1])


def _request(kind: Symbol, seq: int, chain: Any) -> Record:
    return Record(kind, [seq, 0, chain_to_value(chain)])


chains = st.one_of(patterns.map(pattern_chain), small_values.map(value_chain))


@st.composite
def forwarding_scenarios(draw):
    cs = draw(st.lists(chains, min_size=1, max_size=5))
    pats = draw(st.lists(patterns, min_size=1, max_size=3))
    vals = draw(st.lists(small_values, min_size=1, max_size=6))
    op = st.one_of(
        st.tuples(st.sampled_from(["subscribe", "reject", "reset"]),
                  st.integers(0, len(cs) - 1)),
        st.tuples(st.just("observe"), st.integers(0, len(pats) - 1), st.booleans()),
        st.tuples(st.just("send"), st.lists(st.integers(0, len(vals) - 1), min_size=1,
                                            max_size=5), st.sampled_from(["", "skip", "value"])),
    )
    return cs, pats, vals, draw(st.lists(op, min_size=1, max_size=25)), draw(st.sampled_from([2, 8192]))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(forwarding_scenarios())
def test_forwarders_agree_with_their_producer_under_churn(scenario):
    """A forwarder hears exactly the messages its producer's reference rule
    (``forward_reference``: every matching entry, no trie walk) lets through at the
    moment each is sent -- with the producer's entries subscribed, rejected and reset
    between messages, observers of the dataspace coming and going (the plans change),
    a tiny cache (evictions), runs that came from the forwarder itself (skipped) and
    messages sent as values (those are the tap's, never the forwarder's)."""
    cs, pats, vals, ops, cap = scenario
    h = Harness(max_entries=cap)
    prod = Producer()
    fw = Forwarder(prod.forward)
    h.router.add_forwarder(fw, [c for c, _p in prod.entries()])
    other = Forwarder(lambda v: True)  # a second link: hears everything not its own
    h.router.add_forwarder(other, [()])
    want: list[bytes] = []
    want_other: list[bytes] = []
    seq = 0
    kinds = {"subscribe": SUBSCRIBE, "reject": REJECT, "reset": RESET}
    for op in ops:
        if op[0] in kinds:
            seq += 1
            changed = prod.on_request(_request(kinds[op[0]], seq, cs[op[1]]))
            prod.take_outgoing()
            if changed is not None:
                h.router.forwarder_changed(fw, changed, prod.has(changed))
        elif op[0] == "observe":
            h.observe(pats[op[1]], op[2])
        else:
            msgs = [vals[j] for j in op[1]]
            if op[2] == "value":
                for m in msgs:
                    h.ds.send(m)
                continue
            enc = _encoded(msgs)
            if op[2] == "skip":
                enc.skip = (fw,)
            h.ds.send(enc)
            for m in msgs:
                if op[2] != "skip" and prod.forward_reference(m):
                    want.append(encode(m))
                want_other.append(encode(m))
    h.collect()
    assert fw.sent == want
    assert other.sent == want_other
    assert h.router.stats.fallbacks == 0
    h.router.remove_forwarder(fw)
    h.ds.send(_encoded(vals))
    assert fw.sent == want  # removed: hears nothing more
    assert other.sent == want_other + [encode(v) for v in vals]


def test_a_forwarder_gets_runs_as_the_bytes_they_came_in_and_counts_what_it_skipped():
    """Through a relay: a run of messages reaches the forwarder as its received bytes
    in one call; ``seen`` counts every routed message not from it; the cache is hit
    from the second message of a class on; a producer's change invalidates only the
    class of its chain."""
    h = Harness()
    prod = Producer()
    calls: list[int] = []
    fw = Forwarder(prod.forward)
    run = fw.emit_run
    fw.emit_run = lambda head, parts: (calls.append(len(parts)), run(head, parts))  # type: ignore[method-assign]
    h.router.add_forwarder(fw, [c for c, _p in prod.entries()])
    says = [encode(Record(Symbol("Says"), ["a", str(i)])) for i in range(5)]
    h.pub.receive_data(_packet(says))
    assert fw.sent == says and calls == [5]  # the root artifact: everything, one call
    assert fw.seen_count == 5
    # The peer asks for <Says "b" _> only, and drops the root artifact.
    chain = pattern_chain(parse_pattern('<Says "b" $t>'))
    prod.on_request(_request(SUBSCRIBE, 1, chain))
    h.router.forwarder_changed(fw, chain, prod.has(chain))
    prod.on_request(_request(RESET, 2, ()))
    h.router.forwarder_changed(fw, (), prod.has(()))
    b = [encode(Record(Symbol("Says"), ["b", str(i)])) for i in range(3)]
    hits = h.router.stats.hits
    h.pub.receive_data(_packet([says[0], b[0], b[1], says[1], b[2]]))
    assert fw.sent == says + b
    assert h.router.stats.hits >= hits + 3
    assert fw.seen_count == 10
    enc = _encoded([decode(x) for x in b])
    enc.skip = (fw,)
    h.ds.send(enc)  # came from the forwarder's own link: not back
    assert fw.sent == says + b and fw.seen_count == 10


def test_messages_are_routed_on_their_bytes_while_a_link_keeps_received_encodings():
    """keep_received (a link forwarding values as the bytes they came in) does not
    turn byte routing off: runs are still routed on their bytes, to subscribers and to
    forwarders, and a run of turns is still read as one."""
    from dataspace.protocol.relay import keep_received

    h = Harness()
    s = h.observe(parse_pattern("<Says $who $text>"), True)
    fw = Forwarder(lambda v: True)
    h.router.add_forwarder(fw, [()])
    bodies = [encode(Record(Symbol("Says"), ["a", str(i)])) for i in range(4)]
    keep_received(True)
    try:
        h.pub.receive_data(_packet(bodies[:2]))
        h.pub.receive_data(_packet(bodies[2:3]) + _packet(bodies[3:]))  # a run of turns
    finally:
        keep_received(False)
    h.collect()
    assert h.router.stats.routed == 4
    assert h.got[s] == [tuple(map(key, ["a", str(i)])) for i in range(4)]
    assert fw.sent == bodies


def test_a_new_class_plans_what_the_patterns_of_no_class_capture():
    """A class whose first pattern tests nothing (``<A>``) still places the captures
    of the patterns of every class (``$x``): its plan is made at once, not only when
    the new pattern tests more than the empty plan."""
    h = Harness()
    whole = h.observe(parse_pattern("$x"), True)
    h.observe(parse_pattern("<A>"), True)
    h.pub.receive_data(_packet([encode(Record(A, []))]))
    h.collect()
    assert h.got[whole] == [(key(Record(A, [])),)]
    assert h.router.stats.fallbacks == 0 and h.router.stats.routed == 1


def test_a_relay_writes_bodies_as_they_are():
    out = Relay(name="link")
    peer = out.import_ref(3)
    bodies = [encode(Record(Symbol("Says"), ["a", str(i)])) for i in range(3)]
    peer.send_bodies(bodies)
    (pkt,) = out.take_packets()
    p = parse_packet(decode(pkt, embedded=WireRef.from_value))
    assert isinstance(p, Turn)
    assert [(te.oid, encode(te.event.body)) for te in p.events] == [(3, b) for b in bodies]
    assert out.events_out == 3
