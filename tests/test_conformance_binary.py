"""The official Preserves conformance suite (samples.bin), binary expectations.

Expectations (from the header of samples.pr), checked per test case:

1. ``decodeBinary(encodeBinary(annotatedValue)) = stripped``
2. ``strip(decodeBinary(binary)) = stripped``
3. ``decodeBinary(binary) = annotatedValue``
4. ``decodeBinary(annotatedBinary(annotatedValue)) = annotatedValue``
7. ``annotatedBinary(annotatedValue) = binary``
8. ``looseEncodeBinary(annotatedValue) = binary``
30. ``decodeBinary(bytes)`` fails with a syntax error (never with EOF)
31. ``decodeBinary(bytes)`` fails signalling premature EOF after a partial parse
32. ``decodeBinary(bytes)`` fails signalling immediate EOF

Text expectations (5, 6, 20-22) live with the text codec's tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dataspace.values import (
    Annotated,
    DecodeEOF,
    DecodeError,
    Decoder,
    DecodeShort,
    Record,
    Symbol,
    annotations_equal,
    decode,
    encode,
    strip,
)

SAMPLES = Path(__file__).parent / "data" / "preserves" / "samples.bin"

EXPECTATIONS = {
    "Test": (1, 2, 3, 4, 7, 8),
    "NondeterministicTest": (1, 2, 3, 4, 7),
    "DecodeError": (30,),
    "DecodeShort": (31,),
    "DecodeEOF": (32,),
}


def _load_cases() -> list[tuple[str, str, tuple[object, ...]]]:
    doc = decode(SAMPLES.read_bytes(), annotations=True)
    while type(doc) is Annotated:  # the document's @<EmacsMode ...> @<Documentation ...>
        doc = doc.item
    assert type(doc) is Record and doc.label == Symbol("TestCases"), doc
    cases = []
    for name, case in doc.fields[0].items():
        case = case.item if type(case) is Annotated else case  # a comment on the case
        assert type(case) is Record
        kind = strip(case.label).name
        cases.append((strip(name).name, kind, case.fields))
    return cases


CASES = _load_cases()
PARAMS = [
    pytest.param(kind, fields, exp, id=f"{name}-{exp}")
    for name, kind, fields in CASES
    for exp in EXPECTATIONS.get(kind, ())
]


def test_suite_is_loaded() -> None:
    kinds = {kind for _n, kind, _f in CASES}
    assert {"Test", "NondeterministicTest", "DecodeError", "DecodeShort", "DecodeEOF"} <= kinds
    assert len(PARAMS) > 700


@pytest.mark.parametrize(("kind", "fields", "exp"), PARAMS)
def test_expectation(kind: str, fields: tuple[object, ...], exp: int) -> None:
    if exp >= 30:
        data = strip(fields[0])
        assert type(data) is bytes
        with pytest.raises(DecodeError) as info:
            decode(data, annotations=True)
        e = info.value
        if exp == 30:
            assert not isinstance(e, DecodeShort), e
        elif exp == 31:
            assert isinstance(e, DecodeShort) and not isinstance(e, DecodeEOF), e
        else:
            assert isinstance(e, DecodeEOF), e
        assert e.position is not None
        return

    binary = strip(fields[0])
    assert type(binary) is bytes
    annotated = fields[1]
    stripped = strip(annotated)
    if exp == 1:
        got = decode(encode(annotated), annotations=True)
        assert annotations_equal(got, stripped), (got, stripped)
    elif exp == 2:
        got = strip(decode(binary, annotations=True))
        assert annotations_equal(got, stripped), (got, stripped)
    elif exp == 3:
        got = decode(binary, annotations=True)
        assert annotations_equal(got, annotated), (got, annotated)
        # The stream decoder agrees, even fed one byte at a time.
        d = Decoder(annotations=True)
        out = []
        for i in range(len(binary)):
            d.feed(binary[i : i + 1])
            out.extend(d)
        assert len(out) == 1 and annotations_equal(out[0], annotated)
        assert d.buffered == 0
    elif exp == 4:
        got = decode(encode(annotated, annotations=True), annotations=True)
        assert annotations_equal(got, annotated), (got, annotated)
    elif exp == 7:
        assert encode(annotated, annotations=True).hex() == binary.hex()
    elif exp == 8:
        assert encode(annotated, canonical=False, annotations=True).hex() == binary.hex()
    else:  # pragma: no cover
        pytest.fail(f"unknown expectation {exp}")
