"""The two codecs agree on the whole conformance document, annotations included."""

from __future__ import annotations

from pathlib import Path

from dataspace.values import annotations_equal, decode, encode, parse

SUITE = Path(__file__).parent / "data" / "preserves"


def test_text_and_binary_documents_are_the_same_annotated_value():
    from_text = parse((SUITE / "samples.pr").read_text("utf-8"), annotations=True)
    from_binary = decode((SUITE / "samples.bin").read_bytes(), annotations=True)
    assert annotations_equal(from_text, from_binary)
    assert encode(from_text) == encode(from_binary)
