"""The relay machine, without sockets: bytes in, effects on local entities, bytes out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataspace.dataspace import Dataspace, DataspaceEntity, Entity
from dataspace.protocol.relay import Relay, RelayLimits, RemoteEntity
from dataspace.protocol.wire import (
    Assert,
    Error,
    Message,
    Retract,
    Sync,
    Turn,
    TurnEvent,
    WireRef,
    encode_packet,
    parse_packet,
)
from dataspace.values import Embedded, Record, Sequence, Symbol, decode, encode, parse
from strategies import values

OBSERVE = Symbol("Observe")
PRESENT_PAT = parse("<group <rec Present> {0: <bind <_>>}>")
SAYS_PAT = parse("<group <rec Says> {0: <bind <_>> 1: <bind <_>>}>")


def turn(*events: tuple[int, object]) -> bytes:
    return encode_packet(Turn([TurnEvent(oid, ev) for oid, ev in events]))  # type: ignore[arg-type]


def packets(relay: Relay) -> list[object]:
    return [parse_packet(decode(p, embedded=WireRef.from_value)) for p in relay.take_packets()]


def events_of(pkts: list[object]) -> list[tuple[int, object]]:
    out = []
    for p in pkts:
        assert isinstance(p, Turn)
        out += [(te.oid, te.event) for te in p.events]
    return out


def observe(pattern: object, oid: int) -> Record:
    return Record(OBSERVE, [pattern, Embedded(WireRef(True, oid))])


class Recorder(Entity):
    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []

    def on_assert(self, value: object, handle: int) -> None:
        self.log.append(("+", value))

    def on_retract(self, handle: int) -> None:
        self.log.append(("-", handle))

    def on_message(self, value: object) -> None:
        self.log.append(("!", value))


def server(limits: RelayLimits | None = None) -> tuple[Relay, Dataspace]:
    ds = Dataspace("test")
    relay = Relay(limits=limits, turn=ds.turn, name="test")
    relay.export_at(0, DataspaceEntity(ds))
    return relay, ds


# -- the happy path ----------------------------------------------------------------------


def test_assert_observe_message_retract():
    relay, ds = server()
    relay.receive_data(turn((0, Assert(parse('<Present "alice">'), 1))))
    assert parse('<Present "alice">') in ds
    relay.receive_data(turn((0, Assert(observe(PRESENT_PAT, 5), 2))))
    (oid, ev), = events_of(packets(relay))
    assert oid == 5 and isinstance(ev, Assert) and ev.assertion == Sequence(["alice"])
    relay.receive_data(turn((0, Assert(observe(SAYS_PAT, 6), 3))))
    relay.receive_data(turn((0, Message(parse('<Says "alice" "hi">')))))
    (oid, ev), = events_of(packets(relay))
    assert oid == 6 and ev == Message(Sequence(["alice", "hi"]))
    relay.receive_data(turn((0, Retract(1))))
    (oid, ev2), = events_of(packets(relay))
    assert oid == 5 and isinstance(ev2, Retract)
    assert parse('<Present "alice">') not in ds
    assert relay.stats()["assertions_in"] == 2


def test_events_of_one_packet_are_one_turn():
    relay, _ds = server()
    relay.receive_data(turn((0, Assert(observe(PRESENT_PAT, 5), 1))))
    assert packets(relay) == []
    # Asserted and retracted in one packet: observers never see it.
    relay.receive_data(turn((0, Assert(parse('<Present "x">'), 2)), (0, Retract(2))))
    assert packets(relay) == []
    # Sync in a multi-event packet is answered after the packet's effects.
    relay.receive_data(turn((0, Assert(parse('<Present "y">'), 3)), (0, Sync(WireRef(True, 9)))))
    evs = events_of(packets(relay))
    assert [oid for oid, _ in evs] == [5, 9]
    assert evs[1][1] == Message(True)


def test_sync_alone_is_answered():
    relay, _ds = server()
    relay.receive_data(turn((0, Sync(WireRef(True, 4)))))
    assert events_of(packets(relay)) == [(4, Message(True))]


@settings(max_examples=30)
@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30))
def test_stream_framing_any_chunking(cuts):
    data = b"".join(
        turn((0, Assert(parse(f'<Present "u{i}">'), i))) for i in range(20)
    ) + turn((0, Message(parse('<Says "a" "b">'))))
    relay, ds = server()
    pos = 0
    for c in cuts:
        relay.receive_data(data[pos : pos + c])
        pos += c
    relay.receive_data(data[pos:])
    assert not relay.closed
    assert len(ds.assertions()) == 20
    assert relay.packets_in == 21


@settings(max_examples=50)
@given(values)
def test_any_value_round_trips_through_a_relay(v):
    relay, _ds = server()
    relay.receive_data(turn((0, Assert(observe(parse("<bind <_>>"), 5), 1))))
    relay.take_packets()
    relay.receive_data(turn((0, Message(v))))
    (_oid, ev), = events_of(packets(relay))
    assert ev == Message(Sequence([v]))


def test_outbound_turn_is_cut_at_the_packet_limit():
    relay, _ds = server(RelayLimits(max_outbound_packet=2048))
    relay.receive_data(turn((0, Assert(observe(parse("<bind <_>>"), 5), 1))))
    relay.take_packets()
    body = "x" * 100
    relay.receive_data(b"".join(turn((0, Message(body))) for _ in range(100)))
    out = relay.take_packets()
    assert len(out) > 3
    assert all(len(p) < 2048 + 200 for p in out)
    assert sum(len(parse_packet(decode(p, embedded=WireRef.from_value)).events) for p in out) == 100


def test_nop_and_extension_packets_are_ignored():
    relay, _ds = server()
    relay.receive_data(encode(False) + encode(parse("<frob 1 2>")))
    assert not relay.closed and relay.take_packets() == []


# -- membranes ---------------------------------------------------------------------------


def test_imports_are_reference_counted():
    relay, _ds = server()
    relay.receive_data(turn((0, Assert(observe(PRESENT_PAT, 5), 1))))
    relay.receive_data(turn((0, Assert(observe(SAYS_PAT, 5), 2))))
    assert relay.stats()["imports"] == 1
    relay.receive_data(turn((0, Retract(1))))
    assert relay.stats()["imports"] == 1
    relay.receive_data(turn((0, Retract(2))))
    assert relay.stats()["imports"] == 0


def test_exports_are_reference_counted_and_yours_refs_resolve():
    ds = Dataspace()
    relay = Relay(turn=ds.turn)
    relay.export_at(0, DataspaceEntity(ds))
    local = Recorder()
    # The peer observes, and we assert a value holding a local entity: it is exported.
    relay.receive_data(turn((0, Assert(observe(parse("<group <rec Ref> {0: <bind <_>>}>"), 5), 1))))
    h = ds.assert_(Record(Symbol("Ref"), [Embedded(local)]))
    (_oid, ev), = events_of(packets(relay))
    wr = ev.assertion[0].value
    assert isinstance(wr, WireRef) and wr.mine and wr.oid != 0
    assert relay.stats()["exports"] == 2
    # The peer talks to it through [0 oid]-as-target.
    relay.receive_data(turn((wr.oid, Message("ping")), (wr.oid, Assert("held", 7))))
    assert local.log == [("!", "ping"), ("+", "held")]
    # It hands it back to us as [1 oid]: we see our own object.
    relay.receive_data(turn((0, Assert(Record(Symbol("Back"), [Embedded(WireRef(False, wr.oid))]), 8))))
    assert Record(Symbol("Back"), [Embedded(local)]) in ds
    # Retracting our assertion and the peer's uses unpins the export.
    ds.retract(h)
    relay.receive_data(turn((wr.oid, Retract(7)), (0, Retract(8))))
    assert local.log[-1][0] == "-"
    assert relay.stats()["exports"] == 1


def test_attenuated_yours_ref_enforces_caveats():
    ds = Dataspace()
    relay = Relay(turn=ds.turn)
    ent = DataspaceEntity(ds)
    relay.export_at(0, ent)
    local = Recorder()
    relay.receive_data(turn((0, Assert(observe(parse("<group <rec Ref> {0: <bind <_>>}>"), 5), 1))))
    ds.assert_(Record(Symbol("Ref"), [Embedded(local)]))
    (_oid, ev), = events_of(packets(relay))
    oid = ev.assertion[0].value.oid
    only_present = parse("<rewrite <bind <rec Present [<_>]>> <ref 0>>")
    relay.receive_data(turn((0, Assert(
        Record(Symbol("Att"), [Embedded(WireRef(False, oid, (only_present,)))]), 2))))
    (att,) = [a for a in ds.assertions() if isinstance(a, Record) and a.label == Symbol("Att")]
    target = att.fields[0].value
    target.on_message(parse('<Present "a">'))
    target.on_message(parse('<Says "a" "b">'))
    assert local.log == [("!", parse('<Present "a">'))]


def test_remote_entity_outbound_and_after_close():
    relay = Relay()
    proxy = relay.import_ref(3)
    proxy.on_assert("v", 10)
    proxy.on_message("m")
    proxy.on_retract(10)
    proxy.on_retract(99)  # unknown: nothing sent
    assert events_of(packets(relay)) == [(3, Assert("v", 10)), (3, Message("m")), (3, Retract(10))]
    relay.close()
    proxy.on_message("late")
    assert relay.take_packets() == [] and not proxy.alive


def test_sync_sent_and_answered_between_two_relays():
    a, b = Relay(), Relay()
    target = Recorder()
    b.export_at(0, target)
    got = Recorder()
    a.send_sync(a.import_ref(0), got)
    b.receive_data(a.data_to_send())
    a.receive_data(b.data_to_send())
    assert got.log == [("!", True)]


# -- bad input ---------------------------------------------------------------------------


def assert_failed(relay: Relay, ds: Dataspace | None, fragment: str) -> None:
    assert relay.closed and relay.wants_close
    assert relay.error is not None and fragment in relay.error[0], relay.error
    out = packets(relay)
    assert isinstance(out[-1], Error) and fragment in out[-1].message
    if ds is not None:
        assert [a for a in ds.assertions() if not _is_local_observe(a)] == []


def _is_local_observe(a: object) -> bool:
    return isinstance(a, Record) and a.label == OBSERVE and not isinstance(a.fields[1].value, RemoteEntity)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"\xb5\xb5\x84\x84", "malformed turn event"),
        (b"\xff", "malformed packet"),
        (encode(42), "malformed packet"),
        (encode(parse("[[0 <A 1>]]")), "malformed event"),
        (encode(parse("[[0 <Z 1>]]")), "malformed event"),
        (encode(parse('[["x" <M 1>]]')), "OID must be an integer"),
        (encode(parse("[[7 <M 1>]]")), "unknown OID 7"),
        (encode(parse("[[-1 <M 1>]]")), "unknown OID -1"),
        (encode(parse("[[0 <R 12>]]")), "unknown handle"),
        (encode(parse('[[0 <A 1 "h">]]')), "handle must be an integer"),
        (encode(parse("[[0 <S 1>]]")), "<S> needs an embedded"),
        (b"\xb5\xb5\xb0\x00\xb4\xb3\x01M\x86\xb1\x01x\x84\x84\x84", "malformed wire reference"),
        (b"\xb5\xb5\xb0\x00\xb4\xb3\x01M\x86\xb5\xb0\x01\x01\xb0\x01\x63\x84\x84\x84\x84",
         "unknown OID 99"),
    ],
)
def test_bad_packets_error_and_close(data, fragment):
    relay, ds = server()
    relay.receive_data(turn((0, Assert(parse('<Present "me">'), 1))))
    relay.receive_data(data)
    assert_failed(relay, ds, fragment)
    # Nothing more is processed afterwards.
    relay.receive_data(turn((0, Assert(parse('<Present "late">'), 2))))
    assert parse('<Present "late">') not in ds


def test_oversized_packet_is_refused_before_it_is_buffered():
    relay, ds = server(RelayLimits(max_packet_size=1000))
    big = turn((0, Message("x" * 5000)))
    relay.receive_data(big[:1500])  # the limit is known after 1000 bytes
    assert_failed(relay, ds, "max_value_size")
    relay2, ds2 = server(RelayLimits(max_packet_size=1000))
    relay2.receive_packet(big)
    assert_failed(relay2, ds2, "larger than the limit")


@pytest.mark.parametrize(("data", "detail"), [
    (b"\xb1" + b"\xff" * 11 + b"\x01", "malformed-packet"),  # a length varint of 12 bytes
    (b"\xb1\xff\x0f" + b"x" * 1200, "packet-too-large"),  # a 2047-byte string, limit 1000
    (b"\xb5" * 600, "malformed-packet"),  # nested past the depth limit
])
def test_error_detail_says_what_was_wrong(data, detail):
    relay, _ds = server(RelayLimits(max_packet_size=1000))
    relay.receive_data(data)
    assert relay.closed and relay.error is not None
    assert relay.error[1] == Symbol(detail), relay.error


def test_duplicate_handle_and_too_many_assertions():
    relay, ds = server()
    relay.receive_data(turn((0, Assert("a", 1))))
    relay.receive_data(turn((0, Assert("b", 1))))
    assert_failed(relay, ds, "already in use")
    relay, ds = server(RelayLimits(max_assertions=3))
    relay.receive_data(turn(*[(0, Assert(i, i)) for i in range(4)]))
    assert_failed(relay, ds, "too many assertions")


def test_too_many_references():
    relay, ds = server(RelayLimits(max_imports=2))
    relay.receive_data(turn(*[(0, Assert(observe(PRESENT_PAT, i), i)) for i in range(3)]))
    assert_failed(relay, ds, "too many references")


def test_error_midway_keeps_earlier_events_then_retracts():
    relay, ds = server()
    seen = []
    ds.observe("<Present $x>", on_assert=lambda x: seen.append(("+", x)),
               on_retract=lambda x: seen.append(("-", x)))
    relay.receive_data(turn((0, Assert(parse('<Present "a">'), 1)), (0, Retract(77))))
    assert_failed(relay, ds, "unknown handle")
    assert seen == [("+", "a"), ("-", "a")]


def test_peer_error_packet_closes_without_reply():
    relay, ds = server()
    relay.receive_data(turn((0, Assert("x", 1))))
    relay.receive_data(encode(parse('<error "bye" 1>')))
    assert relay.closed and relay.wants_close and relay.peer_error == ("bye", 1)
    assert relay.take_packets() == [] and ds.assertions() == []


def test_receive_packet_framing_errors():
    relay, ds = server()
    relay.receive_packet(turn((0, Assert("x", 1))) + b"\x80")
    assert_failed(relay, ds, "after the packet")
    relay, ds = server()
    relay.receive_packet(turn((0, Assert("x", 1)))[:-1])
    assert_failed(relay, ds, "ends in the middle")


def test_lenient_relay_ignores_unknown_oids_and_handles():
    relay = Relay(limits=RelayLimits(strict=False))
    relay.receive_data(encode(parse("[[7 <M 1>] [7 <A 1 3>] [0 <R 3>] [0 <R 99>]]")))
    assert not relay.closed and relay.stats()["assertions_in"] == 0


def test_close_retracts_everything_and_is_idempotent():
    relay, ds = server()
    relay.receive_data(turn(*[(0, Assert(parse(f'<Present "{i}">'), i)) for i in range(5)]))
    relay.receive_data(turn((0, Assert(observe(PRESENT_PAT, 5), 100))))
    assert len(ds.assertions()) == 6
    relay.close()
    relay.close()
    assert ds.assertions() == [] and relay.take_packets() == []
    relay.receive_data(turn((0, Assert("late", 1))))
    assert ds.assertions() == []


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_packet_size"):
        RelayLimits(max_packet_size=0)


def normalized(relay: Relay) -> list[object]:
    """Outbound events with handles renumbered in order of appearance (handles are
    process-unique, so they differ between runs)."""
    names: dict[int, int] = {}
    out = []
    for oid, ev in events_of(packets(relay)):
        if isinstance(ev, Assert | Retract):
            ev.handle = names.setdefault(ev.handle, len(names))
        out.append((oid, repr(ev)))
    return out


@settings(max_examples=40)
@given(st.lists(st.tuples(st.sampled_from("AMRx"), values), min_size=1, max_size=12),
       st.integers(min_value=1, max_value=7))
def test_fast_path_and_streaming_decoder_agree(ops, chunk):
    """Whole packets take the fast path; bytes trickling in take the streaming decoder.
    Both must give the same effects and the same output, errors included."""
    handles: list[int] = []
    data = [turn((0, Assert(observe(parse("<bind <_>>"), 5), 1000)))]
    for i, (kind, v) in enumerate(ops):
        if kind == "A":
            data.append(turn((0, Assert(v, i))))
            handles.append(i)
        elif kind == "M":
            data.append(turn((0, Message(v)), (0, Message(Sequence([v, v])))))
        elif kind == "R" and handles:
            data.append(turn((0, Retract(handles.pop()))))
        else:  # a non-canonical OID encoding and an extension: the decoder's business
            data.append(b"\xb5\xb5\xb0\x02\x00\x00\xb4\xb3\x01M\xb0\x01\x07\x84\x84\x84" + encode(parse("<ext>")))
    stream = b"".join(data)
    results = []
    for pieces in ([stream], [stream[i:i + chunk] for i in range(0, len(stream), chunk)]):
        relay, ds = server()
        for piece in pieces:
            relay.receive_data(piece)
        results.append((relay.closed, sorted(map(repr, ds.assertions())), normalized(relay)))
    assert results[0] == results[1]
    assert not results[0][0]


def test_websocket_packets_use_the_same_rules():
    relay, ds = server()
    relay.receive_packet(turn((0, Assert(parse('<Present "a">'), 1))))
    relay.receive_packet(b"\xb5\xb5\xb0\x02\x00\x00\xb4\xb3\x01A\xb1\x01b\xb0\x01\x02\x84\x84\x84")
    assert parse('<Present "a">') in ds and "b" in ds
    relay.receive_packet(turn((0, Assert("c", 3))) + b"\x80")
    assert_failed(relay, ds, "after the packet")


def test_a_failing_local_entity_closes_only_that_connection(caplog):
    class Broken(Entity):
        def on_assert(self, value: object, handle: int) -> None:
            raise ValueError("a bug on this side")

    ds = Dataspace()
    relay = Relay(turn=ds.turn)
    relay.export_at(0, DataspaceEntity(ds))
    relay.export_at(1, Broken())
    relay.receive_data(turn((0, Assert("kept until the close", 1)), (1, Assert("x", 2))))
    assert_failed(relay, ds, "internal error")
    assert "a bug on this side" in caplog.text


def test_events_to_a_withdrawn_oid_are_dropped_not_a_protocol_error():
    """The server exports an object inside an assertion, withdraws it when the assertion
    goes, and the peer's message to it crosses that retraction: the message is dropped
    and the connection stays (a producer answering the observers it sees hits this)."""
    relay, ds = server()

    class Sink(Entity):
        def __init__(self) -> None:
            self.got: list[object] = []

        def on_message(self, value: object) -> None:
            self.got.append(value)

    relay.receive_data(turn((0, Assert(observe(PRESENT_PAT, 5), 1))))
    sink = Sink()
    h = ds.assert_(Record(Symbol("Present"), [Embedded(sink)]))
    (_oid, ev), = [e for e in events_of(packets(relay)) if isinstance(e[1], Assert)]
    exported = ev.assertion[0].value.oid  # the sink, exported under a fresh OID
    ds.retract(h)
    packets(relay)
    relay.receive_data(turn((exported, Message("late"))))
    relay.receive_data(turn((0, Message(Record(Symbol("ref"), [Embedded(WireRef(False, exported))])))))
    assert not relay.closed and sink.got == []
    # An OID this side never issued is still a protocol error.
    relay.receive_data(turn((exported + 100, Message("forged"))))
    assert relay.closed and "unknown OID" in relay.error[0]


# -- Turn packets split across reads -------------------------------------------------------


def _event(kind: str, i: int, v: object) -> bytes:
    """One event's bytes: canonical (the fast path's), annotated or unknown (the
    decoder's), a sync, or an assertion with an embedded reference."""
    if kind == "M":
        return encode_packet(Sequence([0, Record(Symbol("M"), [v])]))
    if kind == "A":
        return encode_packet(Sequence([0, Record(Symbol("A"), [v, 100 + i])]))
    if kind == "E":  # an observer: an embedded reference (the rewriting path)
        obs = observe(parse("<bind <_>>"), 7)
        return encode_packet(Sequence([0, Record(Symbol("A"), [obs, 100 + i])]))
    if kind == "S":
        return encode_packet(Sequence([0, Record(Symbol("S"), [Embedded(WireRef(True, 9))])]))
    if kind == "N":  # annotated: not canonical, the decoder reads it
        return b"\x85" + encode("note") + encode_packet(Sequence([0, Record(Symbol("M"), [v])]))
    return encode_packet(Sequence([0, Record(Symbol("X"), [v])]))  # "X": a malformed event


def _split_results(packets_: list[bytes], cuts: list[int]) -> list[object]:
    stream = b"".join(packets_)
    results = []
    bounds = sorted({c % (len(stream) + 1) for c in cuts})
    for pieces in ([stream], [stream[a:b] for a, b in zip([0, *bounds], [*bounds, len(stream)])]):
        relay = Relay(turn=Dataspace("t").turn, name="test")
        rec = Recorder()
        relay.export_at(0, rec)
        out = []
        for piece in pieces:
            relay.receive_data(piece)
            out += relay.take_packets()
        handles: dict[object, int] = {}
        log = [(k, handles.setdefault(v, len(handles)) if k == "-" else repr(v))
               for k, v in rec.log]
        answers = [parse_packet(decode(p, embedded=WireRef.from_value)) for p in out]
        answers = events_of([a for a in answers if isinstance(a, Turn)])
        results.append((relay.closed, relay.error and relay.error[1], log, answers,
                        relay.packets_in))
    return results


@settings(max_examples=80)
@given(st.lists(st.lists(st.tuples(st.sampled_from("MMMAESNX"), values), min_size=1, max_size=6),
                min_size=1, max_size=5),
       st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_turn_split_anywhere_has_the_effects_of_the_whole(pkts, cuts):
    """A Turn packet the input ends inside is read on when the rest comes (fast path
    and decoder mixed, event by event): the effects, answers and errors are those of
    the whole input read at once."""
    data = [b"\xb5" + b"".join(_event(k, i, v) for i, (k, v) in enumerate(p)) + b"\x84"
            for p in pkts]
    whole, split = _split_results(data, cuts)
    assert whole == split


def test_turn_split_across_reads_is_not_decoded_again():
    """A canonical Turn packet larger than one read (a busy link's) is read by the fast
    path where each read stops, never handed whole to the streaming decoder (which
    would decode it again from its start: many times the cost)."""
    relay, _ds = server()
    relay.receive_data(turn((0, Assert(observe(SAYS_PAT, 5), 1))))
    relay.take_packets()
    big = turn(*[(0, Message(parse(f'<Says "u" "{i:05d} hello there">'))) for i in range(2000)])
    for i in range(0, len(big), 4096):
        relay.receive_data(big[i:i + 4096])
        if i + 4096 < len(big):
            assert packets(relay) == []  # one turn: nothing before the packet ends
            assert 0 < relay.buffered <= i + 4096
    assert relay.packets_decoded == 0 and relay.packets_in == 2 and relay.buffered == 0
    assert len(events_of(packets(relay))) == 2000


def test_turn_split_across_reads_keeps_the_packet_limit():
    relay, ds = server(RelayLimits(max_packet_size=1000))
    big = turn(*[(0, Message("x" * 50)) for _ in range(40)])  # about 2,300 bytes
    relay.receive_data(big[:600])
    assert not relay.closed
    relay.receive_data(big[600:1200])
    assert_failed(relay, ds, "max_value_size")


def test_a_packet_of_messages_all_to_one_entity_is_handed_over_at_once():
    """An entity with ``on_messages`` (a link's data entity) gets a packet's messages in
    one call, in order and in one turn; any other packet goes event by event."""

    class Batch(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.on_messages = lambda vs: self.log.append(("*", list(vs)))

    ds = Dataspace("t")
    relay = Relay(turn=ds.turn, name="test")
    rec = Batch()
    relay.export_at(0, rec)
    relay.receive_data(turn((0, Message(1)), (0, Message(parse("<a>"))), (0, Message(3))))
    assert rec.log == [("*", [1, parse("<a>"), 3])]
    assert relay.messages_in == 3
    relay.receive_data(turn((0, Message(4)), (0, Assert(5, 1))))  # not only messages
    relay.receive_data(turn((0, Message(6))))  # one message
    assert [e[0] for e in rec.log[1:]] == ["!", "+", "!"]


def test_messages_sent_on_as_received_are_written_as_the_bytes_they_came_in():
    """While kept (keep_received), a message a relay received goes out of another relay,
    during the turn that applies it, as its received bytes (here an integer written in
    two bytes stays so); a value that was not received is encoded; order and packet cuts
    are kept.  After the turn, or when not kept, the values are encoded again."""
    from dataspace.protocol.relay import keep_received

    out = Relay(limits=RelayLimits(max_outbound_packet=64), name="out")
    peer = out.import_ref(3)
    got: list[object] = []

    class Forward(Entity):
        def __init__(self) -> None:
            self.on_messages = self.forward

        def forward(self, vs: list[object]) -> None:
            got.extend(vs)
            peer.send_messages([*vs[:3], parse("<y 5>"), *vs[3:]])

    inbound = Relay(turn=Dataspace("t").turn, name="in")
    inbound.export_at(0, Forward())
    odd = b"\xb4\xb3\x01x\xb0\x02\x00\x05\x84"  # <x 5>, the 5 in two bytes
    packet = b"\xb5" + (b"\xb5\xb0\x01\x00\xb4\xb3\x01M" + odd + b"\x84\x84") * 6 + b"\x84"
    keep_received(True)
    try:
        inbound.receive_data(packet)
    finally:
        keep_received(False)
    sent = out.take_packets()
    assert len(sent) > 1  # cut at the packet limit
    data = b"".join(sent)
    assert data.count(odd) == 6 and data.count(encode(parse("<y 5>"))) == 1
    assert [ev.body for _oid, ev in events_of(packets_of(sent))] == [
        *got[:3], parse("<y 5>"), *got[3:]]
    peer.send_messages(got[:2])  # after the turn: encoded (canonically)
    assert b"".join(out.take_packets()).count(encode(parse("<x 5>"))) == 2


def packets_of(raw: list[bytes]) -> list[object]:
    return [parse_packet(decode(p, embedded=WireRef.from_value)) for p in raw]
