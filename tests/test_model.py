"""The data model: Preserves equality, hashing and total order."""

from __future__ import annotations

import math
import pickle

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from dataspace.values import (
    Annotated,
    Dictionary,
    Embedded,
    Record,
    Sequence,
    Set,
    Symbol,
    annotations_equal,
    compare,
    double_from_bits,
    key,
    preserve,
    sort_key,
    strip,
)
from strategies import annotated_values, confusable_atoms, values


def test_one_one_point_oh_and_true_are_three_values():
    s = Set([1, 1.0, True])
    assert len(s) == 3 and 1 in s and 1.0 in s and True in s and 2 not in s
    # (A Python dict literal would collapse these keys before we see them: use pairs.)
    d = Dictionary([(1, "int"), (1.0, "double"), (True, "bool")])
    assert len(d) == 3
    assert (d[1], d[1.0], d[True]) == ("int", "double", "bool")
    assert Record(Symbol("a"), [1]) != Record(Symbol("a"), [True])
    assert Record(Symbol("a"), [1]) != Record(Symbol("a"), [1.0])
    assert Sequence([1]) != Sequence([True])
    assert len({Sequence([0]), Sequence([False]), Sequence([0.0]), Sequence([-0.0])}) == 4


def test_nan_equals_itself_by_bits_and_zeros_differ():
    nan1 = double_from_bits(0x7FF8000000000001)
    nan2 = double_from_bits(0x7FF8000000000002)
    assert Sequence([math.nan]) == Sequence([float("nan")])
    assert Sequence([nan1]) != Sequence([nan2])
    assert len(Set([math.nan, float("nan"), nan1, nan2])) == 3
    assert Sequence([0.0]) != Sequence([-0.0])
    assert compare(-0.0, 0.0) == -1


def test_natural_python_input_is_normalised():
    v = preserve({"a": [1, (2, 3)], "b": {4, 5}, "c": bytearray(b"xy")})
    assert type(v) is Dictionary
    assert type(v["a"]) is Sequence and type(v["a"][1]) is Sequence
    assert type(v["b"]) is Set and v["c"] == b"xy"
    with pytest.raises(TypeError, match="not a Preserves value"):
        preserve(object())
    with pytest.raises(TypeError):
        Record(Symbol("a"), [None])


def test_dunder_preserve_hook():
    class Point:
        def __init__(self, x, y):
            self.x, self.y = x, y

        def __preserve__(self):
            return Record(Symbol("point"), [self.x, self.y])

    assert preserve([Point(1, 2)]) == Sequence([Record(Symbol("point"), [1, 2])])


def test_equal_to_native_containers_means_equal_hashes():
    assert hash(Sequence((1, "a"))) == hash((1, "a"))
    assert {(1, 2): "x"}.get(Sequence((1, 2))) == "x"
    assert hash(Set([1, "a"])) == hash(frozenset([1, "a"]))
    assert hash(Sequence((True,))) == hash((True,))  # equal, so equal hashes
    assert hash(Annotated(True, ["n"])) == hash(True)


def test_sequences_compare_with_tuples_and_lists_strictly():
    assert Sequence([1, "a"]) == (1, "a") == Sequence([1, "a"])
    assert Sequence([1, "a"]) == [1, "a"]
    assert Sequence([True]) != (1,)
    assert (1,) != Sequence([True])  # the strict side wins even when on the right
    assert isinstance(Sequence([1])[0:1], Sequence)


def test_total_order_across_kinds():
    ordered = [
        False, True, -math.inf, -1.5, 0.0, 2.5, math.inf, -5, 0, 10**30, "", "a", "b",
        b"", b"\x00", Symbol("a"), Symbol("b"), Record(Symbol("a"), []),
        Record(Symbol("a"), [1]), Record(Symbol("b"), []), Sequence([]), Sequence([1]),
        Sequence([1, 2]), Sequence([2]), Set([]), Set([1]), Set([1, 2]), Set([2]),
        Dictionary({}), Dictionary({1: 1}), Dictionary({1: 2}), Dictionary({2: 0}),
        Embedded(1),
    ]
    for i, a in enumerate(ordered):
        for j, b in enumerate(ordered):
            assert compare(a, b) == (i > j) - (i < j), (a, b)
    assert sorted(reversed(ordered), key=sort_key) == ordered


def test_annotations_are_not_part_of_identity():
    a = Annotated(1, ["note"])
    assert a == 1 and hash(a) == hash(key(1)) and key(a) == key(1)
    assert Record(Symbol("r"), [a]) == Record(Symbol("r"), [1])
    assert hash(Record(Symbol("r"), [a])) == hash(Record(Symbol("r"), [1]))
    assert not annotations_equal(Record(Symbol("r"), [a]), Record(Symbol("r"), [1]))
    assert strip(Sequence([a, Annotated(Sequence([a]), [2])])) == Sequence([1, Sequence([1])])


def test_pickle_round_trip():
    v = preserve([Record(Symbol("a"), [1, 1.0, True]), Set([1, 2]), {"k": b"v"}])
    assert pickle.loads(pickle.dumps(v)) == v


@given(values)
def test_equality_and_hash_are_consistent(v):
    w = pickle.loads(pickle.dumps(v))  # an equal value made of different objects
    assert key(v) == key(w) and hash(key(v)) == hash(key(w))
    if not isinstance(v, float):  # a bare NaN is Python's float, with Python's ==
        assert v == w and hash(v) == hash(w)
    assert compare(v, w) == 0


@given(values, values)
def test_order_is_total_and_agrees_with_equality(a, b):
    c = compare(a, b)
    assert c == -compare(b, a)
    assert (c == 0) == (key(a) == key(b))


@given(values, values, values)
def test_order_is_transitive(a, b, c):
    x, y, z = sorted([a, b, c], key=sort_key)
    assert compare(x, y) <= 0 and compare(y, z) <= 0 and compare(x, z) <= 0


@given(st.lists(confusable_atoms, max_size=8))
def test_confusable_atoms_as_set_members(xs):
    s = Set(xs)
    assert len(s) == len({key(x) for x in xs})
    for x in xs:
        assert x in s


@given(annotated_values)
def test_strip_removes_annotations_and_keeps_equality(v):
    s = strip(v)
    assert key(s) == key(v)
    assert annotations_equal(strip(s), s)


def _is_bare_nan(x):
    return isinstance(x, float) and x != x


@given(annotated_values)
@example(Annotated(2**61 - 1, [Sequence(())]))  # a big integer: hashed salted, unlike bare
def test_annotations_never_change_a_hash(v):
    s = strip(v)
    assert v == s or _is_bare_nan(s)
    if not _is_bare_nan(s):  # a bare NaN is hashed by Python, by identity
        assert hash(v) == hash(s)
    assert hash(preserve([v, True, 0.0])) == hash(preserve([s, True, 0.0]))
    assert hash(Set([v])) == hash(Set([s]))


def test_big_integers_hash_alike_with_and_without_annotations():
    big = (1 << 61) - 1
    a = Record(Symbol("a"), [big])
    b = Record(Symbol("a"), [Annotated(big, ["note"])])
    assert a == b and hash(a) == hash(b)
    assert Set([a]) == Set([b]) and hash(Set([a])) == hash(Set([b]))
    assert hash(Sequence([big, Annotated(big, [1])])) == hash(Sequence([big, big]))


def test_big_integers_inside_compounds_do_not_share_hashes():
    """Python's int hash is modulo 2**61-1: a peer can send many big ints with one hash.
    Inside records, sequences and sets they must be salted as they are at the top level of
    key(), or a dictionary of such values degrades to a list (a hash flood)."""
    m = (1 << 61) - 1
    ints = [m * i + 5 for i in range(1, 200)]
    assert len({hash(i) for i in ints}) == 1  # the attack: raw hashes all collide
    for wrap in (lambda i: Record(Symbol("x"), [i]), lambda i: Sequence([i]),
                 lambda i: Set([i]), lambda i: Dictionary({i: 1})):
        hashes = {hash(wrap(i)) for i in ints}
        assert len(hashes) > len(ints) // 2, wrap(ints[0])
    small = Record(Symbol("x"), [5])  # small ints keep their plain hashing
    assert hash(small) == hash(Record(Symbol("x"), [5]))


def test_model_does_not_import_the_text_codec():
    """values.text is built on values.model; model must not import text back (not even
    inside a function): str() of a value reaches the text writer that text installs."""
    import ast
    import pathlib

    import dataspace.values.model as model

    # (The source beside the module: the compiled build's __file__ is its extension.)
    source = pathlib.Path(model.__file__).with_name("model.py")
    tree = ast.parse(source.read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not {m for m in imported if m.endswith("text")}, imported
    assert str(Record(Symbol("Says"), ["alice", 1.5])) == '<Says "alice" 1.5>'
    assert str(Sequence([Symbol("a"), b"x"])) == '[a #"x"]'
