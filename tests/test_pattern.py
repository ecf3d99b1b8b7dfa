"""Patterns: the semantics of seed 003, the skeleton analysis of seed 000, the Preserves
forms and the concise text syntax."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataspace.pattern import (
    DISCARD,
    Arr,
    Bind,
    Dict,
    Lit,
    PatternError,
    Rec,
    from_preserves,
    lit,
    match,
    parse_pattern,
    skeleton,
    to_preserves,
)
from dataspace.values import Embedded, Record, Sequence, Symbol, parse
from strategies import values

# ---------------------------------------------------------------------------------------
# Seed 003: the worked example, in the specification's own (older) form.

SEED_003 = from_preserves(parse("<arr {0:<lit 1> 1:<bind <arr {0:<bind <_>> 1:<_>}>> 2:<_>}>"))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[1 2 3]", None),  # 2 is not an array
        ("[1 [2 3] 4]", "[[2 3] 2]"),
        ("[1 [2] 5]", None),  # [2] lacks an element at index 1
        ("[1 [2 3 4] 5]", "[[2 3 4] 2]"),  # at least two elements is enough
        ("[1 [<x> <y>] []]", "[[<x> <y>] <x>]"),
    ],
)
def test_seed_003_examples(text, expected):
    got = match(SEED_003, parse(text))
    assert got == (None if expected is None else tuple(parse(expected)))


def test_seed_003_in_wire_form_and_concise_syntax_are_the_same_pattern():
    wire = from_preserves(
        parse("<group <arr> {0: <lit 1> 1: <bind <group <arr> {0: <bind <_>> 1: <_>}>> 2: <_>}>")
    )
    concise = parse_pattern("[1 <$ [$ _]> _]")
    assert wire == SEED_003 == concise
    assert hash(wire) == hash(SEED_003) == hash(concise)
    assert to_preserves(SEED_003) == parse(
        "<group <arr> {0: <lit 1> 1: <bind <group <arr> {0: <bind <_>> 1: <_>}>> 2: <_>}>"
    )


def test_rec_and_dict_forms_both_read():
    old = from_preserves(parse('<rec Says {0: <lit "alice"> 1: <bind <_>>}>'))
    new = from_preserves(parse('<group <rec Says> {0: <lit "alice"> 1: <bind <_>>}>'))
    assert old == new == parse_pattern('<Says "alice" $text>')
    d_old = from_preserves(parse('<dict {"name": <bind <_>>}>'))
    d_new = from_preserves(parse('<group <dict> {"name": <bind <_>>}>'))
    assert d_old == d_new == parse_pattern('{"name": $n}')


# ---------------------------------------------------------------------------------------
# Matching semantics


def test_records_ignore_extra_fields_and_fail_on_missing_ones():
    p = parse_pattern("<Says $who $what>")
    assert match(p, parse('<Says "a" "b" "extra">')) == ("a", "b")
    assert match(p, parse('<Says "a">')) is None
    assert match(p, parse('<Other "a" "b">')) is None
    assert match(p, parse('["a" "b"]')) is None


def test_dictionary_bindings_follow_preserves_key_order():
    # b, a written in that order; a < b in Preserves order, so a's binding comes first.
    p = parse_pattern("{b: $x, a: $y}")
    assert match(p, parse("{a: 1, b: 2, c: 3}")) == (1, 2)
    assert match(p, parse("{a: 1}")) is None
    # Keys of different kinds: 1 (integer) < "s" (string) < s (symbol).
    p2 = parse_pattern('{s: $a "s": $b 1: $c}')
    assert match(p2, parse('{1: "int", "s": "str", s: "sym"}')) == ("int", "str", "sym")


def test_literals_are_strict():
    assert match(parse_pattern("1"), 1) == ()
    assert match(parse_pattern("1"), 1.0) is None
    assert match(parse_pattern("1"), True) is None
    assert match(parse_pattern("#t"), 1) is None
    assert match(parse_pattern("1.0"), 1.0) == ()
    assert match(parse_pattern("[$ 1]"), Sequence(["x", True])) is None


def test_bind_captures_whole_value_then_inner_bindings():
    p = parse_pattern("<$outer <point $x $y>>")
    assert match(p, parse("<point 1 2>")) == (parse("<point 1 2>"), 1, 2)
    assert p.binding_names() == ["outer", "x", "y"]


def test_sets_and_embedded_match_exactly():
    p = parse_pattern("[#{1 2} $]")
    assert match(p, parse("[#{2 1} 5]")) == (5,)
    assert match(p, parse("[#{1 2 3} 5]")) is None
    e = Embedded("ref")
    assert match(Arr([Lit(e), Bind()]), Sequence([Embedded("ref"), 1])) == (1,)


# ---------------------------------------------------------------------------------------
# The concise syntax


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("_", DISCARD),
        ("$", Bind()),
        ("$name", Bind()),
        ('<Says "alice" $text>', Rec(Symbol("Says"), [Lit("alice"), Bind()])),
        ("[1 $ _]", Arr([Lit(1), Bind(), DISCARD])),
        ('{"name": $n}', Dict({"name": Bind()})),
        ("<$ [1 $]>", Bind(Arr([Lit(1), Bind()]))),
        ("__", Lit(Symbol("_"))),
        ("___", Lit(Symbol("__"))),
        ("$$x", Lit(Symbol("$x"))),
        ("$$", Lit(Symbol("$"))),
        ("<$$x 1>", Rec(Symbol("$x"), [Lit(1)])),
        ("<__ 1>", Rec(Symbol("_"), [Lit(1)])),
        ("{$$k: $v}", Dict({Symbol("$k"): Bind()})),
        ("<a _ _ $>", Rec(Symbol("a"), [DISCARD, DISCARD, Bind()])),
    ],
)
def test_concise_syntax(text, pattern):
    p = parse_pattern(text)
    assert p == pattern
    assert parse_pattern(str(p)) == p  # str() writes the concise syntax back


@pytest.mark.parametrize(
    "text, message",
    [
        ("<$x 1 2>", "exactly one subpattern"),
        ("<$x>", "exactly one subpattern"),
        ("<_ 1>", "record label"),
        ("{$k: 1}", "literal"),
        ("{_: 1}", "literal"),
        ("#{$x}", "sets match exactly"),
        ("<Says", "bad pattern text"),
    ],
)
def test_concise_syntax_errors_teach(text, message):
    with pytest.raises(PatternError, match=message):
        parse_pattern(text)


def test_names_are_documentation_only():
    assert parse_pattern("<a $x>") == parse_pattern("<a $y>") == parse_pattern("<a $>")
    assert parse_pattern("<a $x>").binding_names() == ["x"]


# ---------------------------------------------------------------------------------------
# Preserves forms: errors and round trips


@pytest.mark.parametrize(
    "text",
    [
        "1",
        "<bind>",
        "<lit 1 2>",
        "<group <rec a> [1]>",
        "<group <rec a> {-1: <_>}>",
        "<group <rec a> {x: <_>}>",
        "<group <set> {}>",
        "<rec a {0: 5}>",
        "<foo>",
    ],
)
def test_from_preserves_rejects_malformed_patterns(text):
    with pytest.raises(PatternError):
        from_preserves(parse(text))


def test_from_preserves_limits_depth():
    text = "<bind " * 1000 + "<_>" + ">" * 1000
    with pytest.raises(PatternError, match="deeper"):
        from_preserves(parse(text, max_depth=5000))


def test_compound_literal_becomes_compound_pattern():
    assert from_preserves(parse("<lit [1 2]>")) == parse_pattern("[1 2]")
    assert lit(parse('<a "b" [1]>')) == parse_pattern('<a "b" [1]>')


patterns = st.recursive(
    st.one_of(st.just(DISCARD), st.just(Bind()), st.integers().map(Lit), st.text().map(Lit)),
    lambda ch: st.one_of(
        ch.map(Bind),
        st.builds(Rec, st.sampled_from([Symbol("a"), "str", 3]), st.dictionaries(st.integers(0, 5), ch)),
        st.dictionaries(st.integers(0, 5), ch).map(Arr),
        st.lists(st.tuples(st.one_of(st.text(max_size=3), st.integers()), ch), max_size=3).map(Dict),
    ),
    max_leaves=10,
)


@given(patterns)
def test_wire_form_round_trip(p):
    assert from_preserves(to_preserves(p)) == p
    assert from_preserves(parse(str(to_preserves(p)))) == p


@given(patterns)
def test_concise_form_round_trip(p):
    # The concise syntax writes gaps in records and sequences as _, which is the same
    # pattern up to normal form.
    q = parse_pattern(str(p))
    assert q.normalized() == p.normalized()
    assert skeleton(q).index_checks == skeleton(p.normalized()).index_checks


@given(patterns, values)
def test_normal_form_matches_the_same_values(p, v):
    assert match(p.normalized(), v) == match(p, v)


def test_normal_form_drops_only_implied_discards():
    assert parse_pattern("<a _ _>").normalized() == Rec(Symbol("a"), {1: DISCARD})
    assert parse_pattern("<a _ _>") != Rec(Symbol("a"), {1: DISCARD})  # structural
    assert parse_pattern("[_ $ _]").normalized() == Arr({1: Bind(), 2: DISCARD})
    assert parse_pattern("{a: _ b: _}").normalized() == parse_pattern("{a: _ b: _}")
    k = skeleton(parse_pattern("<x <y 3 4> $v <z _ <w> _> _>"))
    assert k.index_checks == [(2, 2), (3,)]  # (2, 0) is implied by <w> at (2, 1)


@given(values)
def test_lit_of_any_value_matches_it(v):
    assert match(lit(v), v) == ()


# ---------------------------------------------------------------------------------------
# Seed 000: skeleton of x(y(3, 4), $v, z(_, w(), _), _)


def test_seed_000_skeleton_and_shape_visit():
    x, y, z, w = map(Symbol, "xyzw")
    p = parse_pattern("<x <y 3 4> $v <z _ <w> _> _>")
    assert p == Rec(x, [Rec(y, [Lit(3), Lit(4)]), Bind(), Rec(z, [DISCARD, Rec(w, []), DISCARD]), DISCARD])
    k = skeleton(p)
    # shape p = ([] ⟼ x) ([0] ⟼ y) ([2] ⟼ z) ([2, 1] ⟼ w)
    assert k.shape == [((), x), ((0,), y), ((2,), z), ((2, 1), w)]
    # constantmap p = ([0, 0] ⟼ inl 3) ([0, 1] ⟼ inl 4) ([2, 0] ⟼ inr ()) ([2, 2] ⟼ inr ()) ([3] ⟼ inr ())
    assert k.constants == [((0, 0), 3), ((0, 1), 4)]
    assert k.checks == [(2, 0), (2, 2), (3,)]
    # capturemap p = [[1]]
    assert k.captures == [(1,)]
    # shapeVisit (shape p) = [((0, []), x), ((0, [0]), y), ((1, [2]), z), ((0, [1]), w)]
    assert k.visit == [((0, ()), x), ((0, (0,)), y), ((1, (2,)), z), ((0, (1,)), w)]


def test_capture_map_follows_binding_order():
    p = parse_pattern("{b: $x a: <$y [$z]>}")
    k = skeleton(p)
    assert k.captures == [(Symbol("a"),), (Symbol("a"), 0), (Symbol("b"),)]
    assert match(p, parse("{a: [7] b: 8}")) == (Sequence([7]), 7, 8)


def test_records_with_non_symbol_labels():
    p = parse_pattern('<"label" $>')
    assert match(p, Record("label", [1])) == (1,)
    assert match(p, Record(Symbol("label"), [1])) is None
