"""Sturdyrefs: signatures, the ref format, caveat semantics and attenuated entities."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataspace.dataspace import Entity
from dataspace.protocol.sturdy import (
    MAX_REWRITE_NODES,
    AttenuatedEntity,
    AttenuatedRef,
    Attenuation,
    SturdyError,
    SturdyRef,
    attenuate,
    caveat_kind,
    mint,
    signature,
    validate,
)
from dataspace.values import Dictionary, Embedded, Record, Sequence, Symbol, encode, key, parse
from strategies import caveat_inputs, caveats, values

P = parse
KEY = bytes(range(32))


def att(*texts: str) -> Attenuation:
    return Attenuation([P(t) for t in texts])


# ---------------------------------------------------------------------------------------
# Signatures


def test_vector_empty_key_syndicate_oid():
    ref = mint("syndicate", b"")
    assert ref.sig == base64.b64decode("acowDB2/oI+6aSEC3YIxGg==")
    assert ref.sig == hmac.new(b"", encode("syndicate"), hashlib.blake2s).digest()[:16]
    assert str(ref) == '<ref {oid: "syndicate" sig: #x"69ca300c1dbfa08fba692102dd82311a"}>'
    # HMAC pads short keys with zeros: 16 zero bytes (Nim's mint()) is the same key.
    assert mint("syndicate", bytes(16)) == ref
    assert validate(ref, b"")
    assert SturdyRef.parse('<ref {oid: "syndicate" sig: #[acowDB2/oI+6aSEC3YIxGg==]}>') == ref


def test_attenuation_chains_the_signature():
    ref = mint("syndicate", KEY)
    c1, c2 = P("<reject <rec Secret [<_>]>>"), P("<rewrite <bind String> <ref 0>>")
    a = attenuate(ref, c1, c2)
    expected = hmac.new(ref.sig, encode(c1), hashlib.blake2s).digest()[:16]
    expected = hmac.new(expected, encode(c2), hashlib.blake2s).digest()[:16]
    assert a.sig == expected == signature(KEY, "syndicate", [c1, c2])
    assert a.caveats == (c1, c2) and a.oid == "syndicate"
    # Attenuating in two steps is the same as in one.
    assert attenuate(attenuate(ref, c1), c2) == a
    assert attenuate(ref) is ref


def test_validate_round_trips_and_tampering():
    ref = mint(Record(Symbol("space"), ["chat"]), KEY)
    c1, c2 = P("<reject <rec Secret [<_>]>>"), P("<rewrite <bind String> <ref 0>>")
    a = attenuate(ref, c1, c2)
    assert validate(ref, KEY) and validate(a, KEY)
    assert not validate(a, KEY[:-1] + b"\xff")
    assert not validate(a, b"")
    # Any change to the oid, the caveats or the signature breaks it.
    assert not validate(SturdyRef("chat", a.sig, a.caveats), KEY)
    assert not validate(SturdyRef(a.oid, a.sig, (c1, P("<rewrite <bind Symbol> <ref 0>>"))), KEY)
    assert not validate(SturdyRef(a.oid, a.sig, (c2, c1)), KEY)  # reordered
    assert not validate(SturdyRef(a.oid, a.sig, (c1,)), KEY)  # newest caveat removed
    assert not validate(SturdyRef(a.oid, a.sig, (c2,)), KEY)  # oldest caveat removed
    assert not validate(SturdyRef(a.oid, a.sig, ()), KEY)  # all caveats removed
    assert not validate(SturdyRef(a.oid, bytes(16), a.caveats), KEY)
    flipped = bytes([a.sig[0] ^ 1]) + a.sig[1:]
    assert not validate(SturdyRef(a.oid, flipped, a.caveats), KEY)


def test_attenuate_refuses_invalid_caveats_but_allows_unknown_ones():
    ref = mint("x", KEY)
    with pytest.raises(SturdyError, match="only 0 binding"):
        attenuate(ref, P("<rewrite <_> <ref 0>>"))
    a = attenuate(ref, P("<future-caveat 1 2>"))
    assert validate(a, KEY)
    assert a.attenuation().apply("anything") is None


# ---------------------------------------------------------------------------------------
# The ref format


def test_to_value_and_back():
    ref = mint("syndicate", KEY)
    v = ref.to_value()
    assert v.label == Symbol("ref") and Symbol("caveats") not in v.fields[0]
    assert SturdyRef.from_value(v) == ref
    a = attenuate(ref, P("<reject <_>>"))
    va = a.to_value()
    assert va.fields[0][Symbol("caveats")] == Sequence([P("<reject <_>>")])
    assert SturdyRef.from_value(va) == a
    assert SturdyRef.parse(str(a)) == a
    assert hash(SturdyRef.parse(str(a))) == hash(a)
    # An empty caveats list is the same as none; unknown keys are ignored (open dict).
    same = P('<ref {oid: "syndicate" sig: #x"HEX" caveats: [] note: "hi"}>'.replace("HEX", ref.sig.hex()))
    assert SturdyRef.from_value(same) == ref
    # Equality is Preserves equality: oid 1 and oid 1.0 are different refs.
    assert SturdyRef(1, ref.sig) != SturdyRef(1.0, ref.sig)


SIG_TEXT = "#x\"69ca300c1dbfa08fba692102dd82311a\""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('"syndicate"', "is a record <ref"),
        ("<sturdy {oid: 1 sig: SIG}>", "label is `ref`"),
        ("<ref>", "one field"),
        ('<ref "syndicate" [] SIG>', "older Syndicate"),
        ("<ref [1 2]>", "must be a dictionary"),
        ("<ref {sig: SIG}>", "no `oid`"),
        ("<ref {oid: 1}>", "no `sig`"),
        ('<ref {"oid": 1 "sig": SIG}>', "keys of a sturdyref are symbols"),
        ('<ref {oid: 1 sig: "69ca300c"}>', "sig must be a byte string"),
        ("<ref {oid: 1 sig: #x\"69ca\"}>", "16 bytes"),
        ("<ref {oid: 1 sig: SIG caveats: <reject <_>>}>", "caveats must be a sequence"),
        ("<ref {oid: #:1 sig: SIG}>", "embedded"),
        ("<ref {oid: 1 sig: SIG caveats: [<reject <lit #:x>>]}>", "embedded"),
    ],
)
def test_malformed_refs(text, message):
    with pytest.raises(SturdyError, match=message):
        SturdyRef.parse(text.replace("SIG", SIG_TEXT))


def test_malformed_inputs_to_constructors():
    with pytest.raises(SturdyError, match="empty"):
        SturdyRef.parse("   ")
    with pytest.raises(SturdyError, match="Preserves text"):
        SturdyRef.parse("<ref {oid: 1")
    with pytest.raises(SturdyError, match="Preserves text"):
        SturdyRef.parse(b"<ref>")  # type: ignore[arg-type]
    with pytest.raises(SturdyError, match="Preserves value"):
        SturdyRef.from_value(object())
    with pytest.raises(SturdyError, match="Preserves value"):
        SturdyRef(object(), bytes(16))
    with pytest.raises(SturdyError, match="byte string"):
        SturdyRef(1, "x" * 16)  # type: ignore[arg-type]
    with pytest.raises(SturdyError, match="sequence of caveat"):
        SturdyRef(1, bytes(16), "<reject <_>>")  # type: ignore[arg-type]
    with pytest.raises(SturdyError, match="key is a byte string"):
        mint(1, "secret")  # type: ignore[arg-type]
    with pytest.raises(SturdyError, match="takes a SturdyRef"):
        attenuate("<ref {}>", P("<reject <_>>"))  # type: ignore[arg-type]
    assert not validate(mint(1, KEY), "not bytes")  # type: ignore[arg-type]
    for bad in ("<reject <_>>", P("<reject <_>>"), Dictionary({1: 2}), 5):
        with pytest.raises(SturdyError, match="sequence of caveats"):
            Attenuation(bad)  # type: ignore[arg-type]
    with pytest.raises(SturdyError, match="Preserves value"):
        Attenuation([object()])


# ---------------------------------------------------------------------------------------
# Caveat semantics, worked examples


def test_rewrite_with_binds_and_templates():
    a = att('<rewrite <rec Says [<bind String> <bind String>]> <rec Said [<ref 1> <lit "by"> <ref 0>]>>')
    assert a.apply(P('<Says "alice" "hi">')) == P('<Said "hi" "by" "alice">')
    assert a.apply(P('<Says "alice" 3>')) is None
    # Bindings are numbered in pre-order: an outer <bind> before those inside it.
    b = att("<rewrite <bind <arr [<bind <_>> <bind <_>>]>> <arr [<ref 2> <ref 1> <ref 0>]>>")
    assert b.apply(P("[1 2]")) == P("[2 1 [1 2]]")
    # Dictionary entries count in the Preserves order of their keys, not as written.
    d = att("<rewrite <dict {b: <bind <_>> a: <bind <_>>}> <arr [<ref 0> <ref 1>]>>")
    assert d.apply(P("{a: 1 b: 2 c: 3}")) == P("[1 2]")  # extra key c allowed
    assert d.apply(P("{a: 1}")) is None  # missing key b
    # Templates build dictionaries too.
    t = att("<rewrite <bind <_>> <dict {v: <ref 0> k: <lit 1>}>>")
    assert t.apply("x") == P('{k: 1 v: "x"}')


def test_compound_patterns_match_exact_arity():
    rec = att("<rewrite <bind <rec Says [<_> <_>]>> <ref 0>>")
    assert rec.apply(P("<Says 1 2>")) == P("<Says 1 2>")
    assert rec.apply(P("<Says 1>")) is None
    assert rec.apply(P("<Says 1 2 3>")) is None  # unlike dataspace patterns
    assert rec.apply(P("<Said 1 2>")) is None
    assert rec.apply(P("[1 2]")) is None
    arr = att("<rewrite <bind <arr [<_>]>> <ref 0>>")
    assert arr.apply(P("[1]")) == P("[1]")
    assert arr.apply(P("[1 2]")) is None and arr.apply(P("[]")) is None
    assert arr.apply(P("<x 1>")) is None
    # Record labels are any value, compared by Preserves equality.
    lab = att('<rewrite <bind <rec "str-label" []>> <ref 0>>')
    assert lab.apply(Record("str-label", [])) is not None
    assert lab.apply(P("<str-label>")) is None


@pytest.mark.parametrize(
    ("test", "yes", "no"),
    [
        ("Boolean", "#t", ["1", "0.0", '"t"']),
        ("Double", "1.0", ["1", "#t"]),
        ("SignedInteger", "1", ["1.0", "#t", "#f"]),
        ("String", '"s"', ["s", '#"s"']),
        ("ByteString", '#"s"', ['"s"']),
        ("Symbol", "s", ['"s"', "<s>"]),
        ("Embedded", "#:1", ["1"]),
    ],
)
def test_type_tests(test, yes, no):
    a = att(f"<rewrite <bind {test}> <ref 0>>")
    assert a.apply(P(yes)) == P(yes)
    for v in no:
        assert a.apply(P(v)) is None, v


def test_lit_is_strict_preserves_equality():
    a = att("<rewrite <bind <lit 1>> <ref 0>>")
    assert a.apply(1) == 1
    assert a.apply(1.0) is None and a.apply(True) is None
    b = att("<rewrite <bind <lit <Says [1]>>> <ref 0>>")
    assert b.apply(P("<Says [1]>")) is not None
    assert b.apply(P("<Says [1.0]>")) is None


def test_and_not():
    a = att("<rewrite <and [<bind <_>> <not String> <not <lit 0>>]> <ref 0>>")
    assert a.apply(5) == 5
    assert a.apply("x") is None and a.apply(0) is None
    empty_and = att("<rewrite <and []> <lit ok>>")
    assert empty_and.apply(P("anything")) == Symbol("ok")
    # A <bind> under <not> in a *reject* pattern is harmless (and allowed, as in Rust).
    r = att("<reject <not <bind String>>>")
    assert r.apply("s") == "s" and r.apply(1) is None


def test_reject():
    r = att("<reject <rec Secret [<_>]>>")
    assert r.apply(P("<Secret 1>")) is None
    assert r.apply(P("<Public 1>")) == P("<Public 1>")
    assert r.apply(P("<Secret 1 2>")) == P("<Secret 1 2>")  # exact arity again
    assert att("<reject <_>>").apply(1) is None


def test_or_takes_the_first_matching_alternative():
    a = att("<or [<rewrite <bind Symbol> <lit first>> <rewrite <bind <_>> <lit second>>]>")
    assert a.apply(Symbol("x")) == Symbol("first")
    assert a.apply(1) == Symbol("second")
    # The first match decides: if its template fails, later alternatives are not tried.
    b = att("<or [<rewrite <bind <_>> <attenuate <ref 0> [<reject <_>>]>> <rewrite <_> <lit x>>]>")
    assert b.apply(1) is None
    assert type(b.apply(Embedded(1))) is Embedded
    assert att("<or []>").apply(1) is None


@pytest.mark.parametrize(
    "caveat",
    [
        "<future 1 2>",  # an unknown kind
        "42",
        "<rewrite <bind <_>>>",  # wrong arity
        "<rewrite <bind <_>> <ref 0> extra>",
        "<reject <String>>",  # type tests are bare symbols
        "<reject Str>",
        "<reject <rec Says <_>>>",  # fields must be a sequence
        "<rewrite <bind <_>> <ref #t>>",  # binding numbers are integers
        "<rewrite <bind <_>> <ref 0.0>>",
        "<rewrite <bind <_>> unbracketed>",
        "<or [<reject <_>>]>",  # alternatives must be rewrites
        "<or <rewrite <bind <_>> <ref 0>>>",
        "<rewrite <bind <_>> <attenuate <ref 0> <reject <_>>>>",  # caveats must be a sequence
        # Structure is checked before validity: this one is unknown, not an error.
        "<rewrite <not <bind <_>>> <bogus>>",
    ],
)
def test_unknown_caveats_reject_everything(caveat):
    a = att("<rewrite <bind <_>> <ref 0>>", caveat)
    assert [i for i, _why in a.unknown] == [1]
    assert caveat_kind(P(caveat))[0] == "unknown"
    for v in (1, "x", P("<Says 1 2>"), Embedded(1), P("[]")):
        assert a.apply(v) is None


def test_unknown_reasons_teach():
    (_i, why), = att("<reject <String>>").unknown
    assert "write String instead of <String>" in why
    (_i, why), = att("<reject Strin>").unknown
    assert "<lit Strin>" in why


@pytest.mark.parametrize(
    ("caveat", "message"),
    [
        ("<rewrite <_> <ref 0>>", "only 0 binding"),
        ("<rewrite <bind <_>> <arr [<ref 0> <ref 1>]>>", "uses <ref 1>"),
        ("<rewrite <bind <_>> <ref -1>>", "negative"),
        ("<rewrite <and [<bind <_>> <not <bind String>>]> <ref 0>>", "inside <not>"),
        ("<or [<rewrite <bind <_>> <ref 0>> <rewrite <_> <ref 0>>]>", "only 0 binding"),
        ("<rewrite <bind <_>> <attenuate <ref 0> [<rewrite <_> <ref 3>>]>>", "in <attenuate>"),
    ],
)
def test_invalid_caveats_raise(caveat, message):
    with pytest.raises(SturdyError, match=message):
        att(caveat)
    with pytest.raises(SturdyError, match=message):
        caveat_kind(P(caveat))


def test_caveats_run_right_to_left():
    older = "<rewrite <rec b [<bind <_>>]> <rec c [<ref 0>]>>"  # b -> c
    newer = "<rewrite <rec a [<bind <_>>]> <rec b [<ref 0>]>>"  # a -> b
    a = att(older, newer)
    assert a.apply(P("<a 1>")) == P("<c 1>")  # newer first: a -> b, then b -> c
    assert a.apply(P("<b 1>")) is None  # the newer caveat sees it first, and rejects it
    # Run left to right (= the same caveats in the other order), <a 1> would be rejected.
    assert att(newer, older).apply(P("<a 1>")) is None
    # then() appends newer caveats.
    assert att(older).then([P(newer)]) == a
    assert att(older).then(att(newer)).apply(P("<a 1>")) == P("<c 1>")


def test_attenuate_template_yields_attenuated_ref():
    a = att("<rewrite <rec Observe [<bind <_>> <bind Embedded>]> "
            "<rec Observe [<ref 0> <attenuate <ref 1> [<reject <rec Secret [<_>]>>]>]>>")
    observer = object()
    out = a.apply(Record(Symbol("Observe"), ["pattern", Embedded(observer)]))
    assert out.label == Symbol("Observe") and out.fields[0] == "pattern"
    emb = out.fields[1]
    assert type(emb) is Embedded and type(emb.value) is AttenuatedRef
    ref = emb.value
    assert ref.target is observer
    assert ref.caveats == (P("<reject <rec Secret [<_>]>>"),)
    assert ref.attenuation.apply(P("<Secret 1>")) is None
    assert ref.attenuation.apply(P("<Public 1>")) == P("<Public 1>")
    # Same target and caveats: equal and hash alike (the broker can deduplicate them).
    again = a.apply(Record(Symbol("Observe"), ["pattern", Embedded(observer)]))
    assert again == out and hash(again) == hash(out)
    # Attenuating an attenuated ref appends to its chain.
    more = att("<rewrite <bind <_>> <attenuate <ref 0> [<reject <rec Other [<_>]>>]>>")
    twice = more.apply(emb).value
    assert twice.target is observer
    assert twice.caveats == (P("<reject <rec Secret [<_>]>>"), P("<reject <rec Other [<_>]>>"))
    # Not an embedded value: the rewrite fails.
    assert a.apply(P('<Observe "pattern" "not a ref">')) is None
    assert att("<rewrite <_> <attenuate <lit 5> []>>").apply(1) is None
    # An empty caveat list leaves the reference as it is.
    assert att("<rewrite <bind <_>> <attenuate <ref 0> []>>").apply(Embedded(7)) == Embedded(7)


def test_growth_is_bounded():
    double = "<rewrite <bind <_>> <arr [<ref 0> <ref 0>]>>"
    a = att(*[double] * 40)  # 2**40 nodes if nothing stopped it
    assert a.apply(1) is None
    assert att(*[double] * 10).apply(1) is not None  # 2**10 nodes is fine
    assert MAX_REWRITE_NODES < 2**40
    deeper = "<rewrite <bind <_>> <arr [<ref 0>]>>"
    assert att(*[deeper] * 250).apply(1) is None  # nested deeper than the codecs allow
    assert att(*[deeper] * 100).apply(1) is not None


def test_attenuation_value_semantics():
    a, b = att("<reject <_>>"), att("<reject <_>>")
    assert a == b and hash(a) == hash(b) and len(a) == 1
    assert a != att("<reject String>")
    assert Attenuation().is_identity and not a.is_identity
    assert Attenuation(a) == a
    assert "reject" in repr(a)
    assert mint(1, KEY).attenuation().is_identity


# ---------------------------------------------------------------------------------------
# AttenuatedEntity


class Recorder(Entity):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_assert(self, value, handle):
        self.events.append(("assert", value, handle))

    def on_retract(self, handle):
        self.events.append(("retract", handle))

    def on_message(self, value):
        self.events.append(("message", value))


def test_attenuated_entity_forwards_and_drops():
    target = Recorder()
    e = AttenuatedEntity(target, [P('<rewrite <rec Says [<bind String>]> <rec Said [<ref 0>]>>')])
    e.on_assert(P('<Says "hi">'), 1)
    e.on_assert(P("<Says 2>"), 2)  # rejected
    e.on_assert(P('<Says "yo">'), 3)
    assert e.forwarded == 2
    e.on_retract(2)  # never forwarded: dropped
    e.on_retract(1)
    e.on_retract(1)  # already retracted: dropped
    e.on_retract(99)  # unknown: dropped
    e.on_message(P('<Says "m">'))
    e.on_message(P("<Other>"))  # rejected
    e.on_retract(3)
    assert target.events == [
        ("assert", P('<Said "hi">'), 1),
        ("assert", P('<Said "yo">'), 3),
        ("retract", 1),
        ("message", P('<Said "m">')),
        ("retract", 3),
    ]
    assert e.forwarded == 0  # memory is given back on retraction


def test_attenuated_entity_memory_is_bounded():
    target = Recorder()
    e = AttenuatedEntity(target, att("<reject <rec Secret [<_>]>>"))
    for h in range(1000):
        e.on_assert(P("<Secret 1>") if h % 2 else P("<Public 1>"), h)
    assert e.forwarded == 500
    for h in range(1000):
        e.on_retract(h)
    assert e.forwarded == 0
    assert sum(1 for ev in target.events if ev[0] == "retract") == 500


def test_identity_attenuated_entity_forwards_everything():
    target = Recorder()
    e = AttenuatedEntity(target, Attenuation())
    e.on_assert(1, 1)
    e.on_message(2)
    e.on_retract(1)
    assert target.events == [("assert", 1, 1), ("message", 2), ("retract", 1)]


# ---------------------------------------------------------------------------------------
# Properties


@given(values)
def test_identity_attenuation_returns_every_value(v):
    assert Attenuation().apply(v) is v


@given(values)
def test_bind_everything_ref_0_is_identity(v):
    assert key(att("<rewrite <bind <_>> <ref 0>>").apply(v)) == key(v)  # key: NaN == NaN


@given(values)
def test_reject_discard_rejects_everything(v):
    assert att("<reject <_>>").apply(v) is None
    assert att("<unknown-caveat>").apply(v) is None


@given(st.lists(caveats, max_size=4), st.lists(caveat_inputs, max_size=5))
def test_random_caveat_chains_never_misbehave(cs, vs):
    try:
        a = Attenuation(cs)
    except SturdyError:
        return
    for v in vs:
        r = a.apply(v)
        if r is not None:
            encode(r, embedded=lambda x: 0)  # a well-formed value


@given(values, st.lists(st.sampled_from([
    "<reject <rec Secret [<_>]>>",
    "<rewrite <bind <_>> <ref 0>>",
    "<or [<rewrite <bind String> <ref 0>> <rewrite <bind <_>> <lit 0>>]>",
    "<future>",
]).map(P), max_size=4), st.binary(max_size=40), st.binary(min_size=1, max_size=40))
def test_mint_attenuate_validate_properties(oid, cs, key, other):
    ref = attenuate(mint(oid, key), *cs)
    assert validate(ref, key)
    assert validate(ref, key + b"\x00")  # HMAC zero-pads short keys
    if other.rstrip(b"\x00") != key.rstrip(b"\x00"):
        assert not validate(ref, other)
    assert SturdyRef.parse(str(ref)) == ref
    assert SturdyRef.from_value(ref.to_value()) == ref


@pytest.mark.parametrize(
    ("rewrite", "measured"),
    [
        ("<rewrite <bind <_>> <ref 0>>", False),
        ("<rewrite <rec Says [<bind String> <bind String>]> <rec Said [<ref 1> <ref 0>]>>", False),
        ("<rewrite <bind <_>> <lit 1>>", False),
        ("<rewrite <arr [<bind <_>>]> <arr [<ref 0> <ref 0>]>>", True),  # duplicated
        ("<rewrite <arr [<bind <arr [<bind <_>>]>>]> <arr [<ref 0> <ref 1>]>>", True),  # nested
        ("<rewrite <bind <_>> <arr [<ref 0>]>>", True),  # placed deeper than found
        ("<rewrite <arr [<arr [<bind <_>>]>]> <arr [<ref 0>]>>", False),  # shallower is fine
    ],
)
def test_only_growing_rewrites_are_measured(rewrite, measured):
    from dataspace.protocol.sturdy import _Ctx, _Rewrite

    assert _Rewrite(P(rewrite), _Ctx()).measure is measured
