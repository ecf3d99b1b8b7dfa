"""Hypothesis strategies for Preserves values, shared by the test modules."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from dataspace.values import (
    Annotated,
    Dictionary,
    Embedded,
    Record,
    Sequence,
    Set,
    Symbol,
    double_from_bits,
    key,
)

symbols = st.text(max_size=8).map(Symbol)
small_symbols = st.sampled_from(["a", "b", "c", "Says", "Present", "x", "_", "$"]).map(Symbol)

doubles = st.one_of(
    st.floats(allow_nan=False),
    st.sampled_from([0.0, -0.0, 1.0, math.inf, -math.inf]),
    # NaNs with payloads, both signs, quiet and signalling.
    st.integers(min_value=1, max_value=(1 << 52) - 1).flatmap(
        lambda m: st.sampled_from([0x7FF0000000000000 | m, 0xFFF0000000000000 | m])
    ).map(double_from_bits),
)

atoms = st.one_of(
    st.booleans(),
    doubles,
    st.integers(),
    st.integers(min_value=-(1 << 200), max_value=1 << 200),
    st.text(),
    st.binary(),
    symbols,
)

# Atoms chosen to collide under Python equality: 1, 1.0, True, 0, 0.0, -0.0, False, NaN.
confusable_atoms = st.sampled_from([0, 1, 0.0, -0.0, 1.0, True, False, math.nan, "1", b"1"])


def _unique_by_key(xs):
    seen = {}
    for x in xs:
        seen.setdefault(key(x), x)
    return list(seen.values())


def _compound(children):
    return st.one_of(
        st.builds(Record, st.one_of(small_symbols, children), st.lists(children, max_size=4)),
        st.lists(children, max_size=5).map(Sequence),
        st.lists(children, max_size=4).map(lambda xs: Set(_unique_by_key(xs))),
        st.lists(st.tuples(children, children), max_size=4).map(
            lambda kvs: Dictionary({key(k): (k, v) for k, v in kvs}.values())
        ),
    )


values = st.recursive(st.one_of(atoms, confusable_atoms), _compound, max_leaves=20)
"""Any plain (unannotated, embedded-free) Preserves value."""


def with_embedded(children=values):
    """Values that may contain embedded references (wrapping small ints)."""
    return st.recursive(
        st.one_of(atoms, st.integers(0, 5).map(Embedded)), _compound, max_leaves=15
    )


def _annotate(children):
    return st.builds(Annotated, children, st.lists(values, min_size=1, max_size=2))


annotated_values = st.recursive(
    st.one_of(atoms, confusable_atoms).flatmap(
        lambda a: st.one_of(st.just(a), _annotate(st.just(a)))
    ),
    lambda ch: st.one_of(_compound(ch), _annotate(ch)),
    max_leaves=15,
)
"""Values with annotations at arbitrary depths."""


# ---------------------------------------------------------------------------------------
# Sturdyref caveats (dataspace.protocol.sturdy): mostly well-formed patterns, templates
# and caveats, with junk mixed in at every level.

_sym = st.sampled_from(["Says", "Present", "a", "b"]).map(Symbol)
_junk = st.one_of(st.integers(-2, 3), _sym, st.text(max_size=3), values)


def _rarely(good, bad, weight=8):
    """``good`` most of the time, ``bad`` about once in ``weight + 1`` draws."""
    return st.integers(0, weight).flatmap(lambda i: bad if i == 0 else good)


def _rec(label, *fields):
    return Record(Symbol(label), fields)


_caveat_patterns = st.recursive(
    _rarely(
        st.one_of(
            st.just(_rec("_")),
            st.sampled_from(
                ["Boolean", "Double", "SignedInteger", "String", "ByteString", "Symbol", "Embedded"]
            ).map(Symbol),
            st.one_of(st.integers(0, 2), st.text(max_size=2), _sym).map(lambda v: _rec("lit", v)),
        ),
        _junk,
    ),
    lambda ps: st.one_of(
        ps.map(lambda p: _rec("bind", p)),
        ps.map(lambda p: _rec("not", p)),
        st.lists(ps, max_size=3).map(lambda xs: _rec("and", Sequence(xs))),
        st.tuples(_sym, st.lists(ps, max_size=3)).map(lambda t: _rec("rec", t[0], Sequence(t[1]))),
        st.lists(ps, max_size=3).map(lambda xs: _rec("arr", Sequence(xs))),
        st.dictionaries(_sym, ps, max_size=3).map(lambda d: _rec("dict", Dictionary(d))),
    ),
    max_leaves=8,
)

_caveat_templates = st.recursive(
    _rarely(
        st.one_of(
            st.integers(-1, 3).map(lambda n: _rec("ref", n)),
            values.map(lambda v: _rec("lit", v)),
        ),
        _junk,
    ),
    lambda ts: st.one_of(
        st.tuples(_sym, st.lists(ts, max_size=3)).map(lambda t: _rec("rec", t[0], Sequence(t[1]))),
        st.lists(ts, max_size=3).map(lambda xs: _rec("arr", Sequence(xs))),
        st.dictionaries(_sym, ts, max_size=3).map(lambda d: _rec("dict", Dictionary(d))),
        st.tuples(ts, st.lists(st.just(_rec("reject", _rec("_"))), max_size=2)).map(
            lambda t: _rec("attenuate", t[0], Sequence(t[1]))
        ),
    ),
    max_leaves=6,
)

_rewrites = st.tuples(_caveat_patterns, _caveat_templates).map(lambda pt: _rec("rewrite", *pt))
caveats = _rarely(
    st.one_of(
        _rewrites,
        st.lists(_rewrites, max_size=3).map(lambda rs: _rec("or", Sequence(rs))),
        _caveat_patterns.map(lambda p: _rec("reject", p)),
    ),
    _junk,
    weight=5,
)
"""Caveats: rewrites, alternatives of rewrites and rejects, sometimes malformed."""

caveat_inputs = st.one_of(
    values,
    st.tuples(_sym, st.lists(st.one_of(st.integers(0, 2), st.text(max_size=2)), max_size=3)).map(
        lambda t: Record(t[0], t[1])
    ),
    st.integers(0, 3).map(Embedded),
)
"""Values to run caveats on: anything, records with simple fields, embedded refs."""
