"""The wire types and the gatekeeper, driven through two relays wired back to back."""

from __future__ import annotations

import pytest

from dataspace.dataspace import Dataspace, DataspaceEntity, Entity
from dataspace.protocol.gatekeeper import Bindings, Gatekeeper
from dataspace.protocol.relay import Relay, RelayLimits, RemoteEntity
from dataspace.protocol.sturdy import SturdyRef, attenuate, mint
from dataspace.protocol.wire import (
    Error,
    Extension,
    Nop,
    ProtocolError,
    Turn,
    WireRef,
    encode_packet,
    error_packet,
    parse_packet,
)
from dataspace.values import Embedded, Record, Symbol, decode, parse

KEY = bytes(range(32))


# -- wire --------------------------------------------------------------------------------


def test_wireref_values():
    assert WireRef.from_value(parse("[0 5]")) == WireRef(True, 5)
    r = WireRef.from_value(parse("[1 5 <reject <_>>]"))
    assert not r.mine and r.caveats == (parse("<reject <_>>"),)
    assert r.to_value() == parse("[1 5 <reject <_>>]")
    for bad in ("[0]", "[2 1]", "[0 -1]", '[0 "x"]', "[0 1 2]", "5"):
        with pytest.raises(ProtocolError):
            WireRef.from_value(parse(bad))


def test_parse_packet_kinds():
    assert parse_packet(False) == Nop()
    assert parse_packet(parse('<error "m" 1>')) == Error("m", 1)
    assert isinstance(parse_packet(parse("<hello 1>")), Extension)
    assert parse_packet(parse("[]")) == Turn([])
    with pytest.raises(ProtocolError):
        parse_packet(3)
    with pytest.raises(ProtocolError):
        parse_packet(parse("[[0 <A 1 #f>]]"))


def test_error_packet_with_unwritable_detail():
    p = decode(error_packet("boom", Record(Symbol("x"), [Embedded(object())])))
    assert p.label == Symbol("error") and isinstance(p.fields[1], str)


def test_encode_packet_round_trip():
    v = parse('[[0 <M "hi">]]')
    assert decode(encode_packet(v)) == v


# -- gatekeeper --------------------------------------------------------------------------


class Answers(Entity):
    def __init__(self) -> None:
        self.live: dict[int, object] = {}
        self.history: list[object] = []

    def on_assert(self, value: object, handle: int) -> None:
        self.live[handle] = value
        self.history.append(value)

    def on_retract(self, handle: int) -> None:
        self.live.pop(handle)


class Pair:
    """A server relay with a gatekeeper and a client relay, connected in memory."""

    def __init__(self) -> None:
        self.ds = Dataspace("root")
        self.bindings = Bindings()
        self.bindings.bind("root", KEY, DataspaceEntity(self.ds))
        self.server = Relay(turn=self.ds.turn, name="server")
        self.rejections: list[str] = []

        def rejected(msg: str, detail: object) -> None:
            self.rejections.append(msg)
            self.server.fail(msg, detail)

        self.gk = Gatekeeper(self.bindings, on_rejected=rejected)
        self.server.export_at(0, self.gk)
        self.client = Relay(limits=RelayLimits(strict=False), name="client")
        self.gk_ref = self.client.import_ref(0)

    def pump(self) -> None:
        """Exchange data until neither relay has anything to send."""
        for _ in range(10):
            a = self.client.data_to_send()
            b = self.server.data_to_send()
            if not a and not b:
                return
            self.server.receive_data(a)
            self.client.receive_data(b)
        raise AssertionError("relays did not quiesce in 10 rounds")

    def resolve(self, ref: SturdyRef | object, handle: int = 1) -> Answers:
        answers = Answers()
        step = ref.to_value() if isinstance(ref, SturdyRef) else ref
        self.gk_ref.on_assert(Record(Symbol("resolve"), [step, Embedded(answers)]), handle)
        self.pump()
        return answers


def accepted_ref(answers: Answers) -> RemoteEntity:
    (v,) = answers.live.values()
    assert v.label == Symbol("accepted"), v
    return v.fields[0].value


def test_resolve_accepted_then_use_and_retract():
    p = Pair()
    answers = p.resolve(mint("root", KEY))
    ds_ref = accepted_ref(answers)
    ds_ref.on_assert(parse('<Present "alice">'), 2)
    p.pump()
    assert parse('<Present "alice">') in p.ds
    # Retracting the resolve retracts the answer.
    p.gk_ref.on_retract(1)
    p.pump()
    assert answers.live == {}
    assert p.gk.accepted == 1 and p.rejections == []


@pytest.mark.parametrize(
    ("ref", "fragment"),
    [
        (mint("root", b"another key"), "invalid signature"),
        (mint("nothing", KEY), "no object"),
        (parse('<ref {oid: "root"}>'), "not a sturdyref"),
        (parse("<ref 1 2 3>"), "not a sturdyref"),
        (SturdyRef("root", bytes(16)), "invalid signature"),
    ],
)
def test_resolve_rejected_errors_and_closes(ref, fragment):
    p = Pair()
    p.ds.assert_("server-side state")
    answers = p.resolve(ref)
    (v,) = answers.history
    assert v.label == Symbol("rejected")
    # The client relay saw the error: the connection is over, the answer retracted.
    assert answers.live == {}
    assert p.rejections and fragment in p.rejections[0]
    assert p.server.closed and p.client.peer_error is not None
    assert fragment in p.client.peer_error[0]
    assert p.ds.assertions() == ["server-side state"]


def test_malformed_resolve_is_an_error():
    p = Pair()
    p.gk_ref.on_assert(Record(Symbol("resolve"), [mint("root", KEY).to_value()]), 1)
    p.pump()
    assert p.server.closed and "malformed resolve" in p.rejections[0]


def test_other_assertions_to_the_gatekeeper_are_ignored():
    p = Pair()
    p.gk_ref.on_assert(parse("<hello>"), 1)
    p.pump()
    assert not p.server.closed


def test_attenuated_sturdyref_is_enforced_by_the_server():
    p = Pair()
    only_present = parse("<rewrite <bind <rec Present [<_>]>> <ref 0>>")
    ref = attenuate(mint("root", KEY), only_present)
    ds_ref = accepted_ref(p.resolve(ref))
    ds_ref.on_assert(parse('<Present "alice">'), 2)
    ds_ref.on_assert(parse('<Secret "x">'), 3)
    ds_ref.on_message(parse('<Says "a" "b">'))
    seen: list[object] = []
    p.ds.observe("<Says $a $b>", on_message=lambda a, b: seen.append((a, b)))
    p.pump()
    assert parse('<Present "alice">') in p.ds
    assert parse('<Secret "x">') not in p.ds
    assert seen == []
    ds_ref.on_retract(2)
    ds_ref.on_retract(3)  # was dropped by the caveat: its retraction is dropped too
    p.pump()
    assert parse('<Present "alice">') not in p.ds and not p.server.closed


def test_rewrite_caveat_rewrites():
    p = Pair()
    wrap = parse("<rewrite <bind <_>> <rec Wrapped [<ref 0>]>>")
    ds_ref = accepted_ref(p.resolve(attenuate(mint("root", KEY), wrap)))
    ds_ref.on_assert("x", 2)
    p.pump()
    assert parse('<Wrapped "x">') in p.ds


def test_several_keys_for_one_oid():
    p = Pair()
    other = Dataspace("other")
    p.bindings.bind("root", b"second", DataspaceEntity(other))
    # Binding a second key adds to the first rather than replacing it: both are
    # accepted, and each leads to what it was bound to.
    second = accepted_ref(p.resolve(mint("root", b"second")))
    first = accepted_ref(p.resolve(mint("root", KEY), handle=2))
    first.on_assert(parse('<Present "first">'), 3)
    second.on_assert(parse('<Present "second">'), 4)
    p.pump()
    assert p.ds.assertions() == [parse('<Present "first">')]
    assert other.assertions() == [parse('<Present "second">')]
    assert p.gk.accepted == 2 and p.rejections == [] and not p.server.closed
