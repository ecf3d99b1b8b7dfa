"""The official Preserves conformance suite (samples.pr), text-syntax expectations.

The document is read with our own parser (annotations kept), so a failure here can also
mean the document itself was misread; ``test_document_shape`` guards against that.
Expectations covered: 5 and 6 (text round trip of Test and NondeterministicTest cases),
20 (ParseError), 21 (ParseShort) and 22 (ParseEOF).  The binary expectations belong to
the binary codec's tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dataspace.values import (
    Annotated,
    Dictionary,
    ParseEOF,
    ParseError,
    ParseShort,
    Record,
    Symbol,
    annotations_equal,
    key,
    strip,
)
from dataspace.values.text import parse, stringify

SAMPLES = Path(__file__).parent / "data" / "preserves" / "samples.pr"

_TEXT_EXPECTATIONS = {
    "Test": (5, 6),
    "NondeterministicTest": (5, 6),
    "ParseError": (20,),
    "ParseShort": (21,),
    "ParseEOF": (22,),
}


def _unannotate(v):
    """Remove annotations at the top level only."""
    while type(v) is Annotated:
        v = v.item
    return v


def _load_cases():
    doc = _unannotate(parse(SAMPLES.read_text(encoding="utf-8"), annotations=True))
    assert type(doc) is Record and doc.label == Symbol("TestCases"), doc
    cases = _unannotate(doc.fields[0])
    assert type(cases) is Dictionary
    out = []
    for name, case in cases.items():
        name = _unannotate(name)
        case = _unannotate(case)
        out.append((name.name, case))
    return out


CASES = _load_cases()


def _params():
    params = []
    for name, case in CASES:
        kind = case.label.name
        for expectation in _TEXT_EXPECTATIONS.get(kind, ()):
            params.append(pytest.param(name, case, expectation, id=f"{name}-{expectation}"))
    return params


@pytest.mark.parametrize(("name", "case", "expectation"), _params())
def test_sample(name, case, expectation):
    if expectation == 5:
        stripped = strip(case.fields[1])
        text = stringify(stripped)
        back = parse(text, annotations=True)
        assert annotations_equal(back, stripped), (text, back, stripped)
        assert key(back) == key(stripped)
    elif expectation == 6:
        annotated = case.fields[1]
        text = stringify(annotated)
        back = parse(text, annotations=True)
        assert annotations_equal(back, annotated), (text, back, annotated)
        # Pretty-printed text must read back the same too.
        back = parse(stringify(annotated, indent=2), annotations=True)
        assert annotations_equal(back, annotated)
    else:
        text = _unannotate(case.fields[0])
        with pytest.raises(ParseError) as info:
            parse(text, annotations=True)
        err = info.value
        assert isinstance(err.position, int) and 0 <= err.position <= len(text)
        if expectation == 20:
            assert not isinstance(err, ParseShort), err
        elif expectation == 21:
            assert isinstance(err, ParseShort) and not isinstance(err, ParseEOF), err
        else:
            assert isinstance(err, ParseEOF), err
        # The same outcome without annotations.
        with pytest.raises(type(err)):
            parse(text)


def test_document_shape():
    assert CASES is not None, "samples.pr not found"
    kinds: dict[str, int] = {}
    for name, case in CASES:
        assert type(case) is Record and type(case.label) is Symbol, name
        kind = case.label.name
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind in ("Test", "NondeterministicTest"):
            assert len(case.fields) == 2, name
            assert type(_unannotate(case.fields[0])) is bytes, name
        elif kind.startswith("Parse"):
            assert len(case.fields) == 1, name
            assert type(_unannotate(case.fields[0])) is str, name
        elif kind.startswith("Decode"):
            assert type(_unannotate(case.fields[0])) is bytes, name
        else:  # pragma: no cover
            raise AssertionError(f"unknown test case kind {kind} in {name}")
    assert kinds["Test"] > 100
    assert kinds["NondeterministicTest"] >= 5
    assert kinds["ParseError"] >= 30
    assert kinds["ParseShort"] >= 5
    assert kinds["ParseEOF"] >= 1


def test_selected_cases_read_right():
    cases = dict(CASES)
    # annotation1: @"abc" 9
    a1 = cases["annotation1"].fields[1]
    assert type(a1) is Annotated and a1.annotations == ("abc",) and a1.item == 9
    # annotation12: the interpreter line
    a12 = cases["annotation12"].fields[1]
    assert a12.annotations == (Record(Symbol("interpreter"), ["/some/path"]),)
    # bytes13 escapes
    assert cases["bytes13"].fields[1] == b'abc\x6c\x34\xf0\\/"\b\f\n\r\txyz'
    # The binary field with an annotation on it.
    assert _unannotate(cases["bytes2a"].fields[0]) == bytes.fromhex("B20568656c6c6f")
    # string5: a surrogate pair escape.
    assert cases["string5"].fields[1] == "\U0001d11e"
    # A symbol test name containing '+'.
    assert "double+0" in cases and "int-98765432109876543210987654321098765432109" in cases
