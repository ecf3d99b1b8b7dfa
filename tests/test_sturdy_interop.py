"""Sturdyrefs: interop with syndicate-py (its schema decoder for sturdy.prs; it has no
signing code).

Kept apart from test_sturdy.py so that a missing ``syndicate``/``preserves`` package skips
only these tests, not the core capability tests.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest
from hypothesis import assume, given

from dataspace.protocol.sturdy import SturdyError, attenuate, caveat_kind, mint
from dataspace.values import encode, parse
from strategies import caveats

syndicate_schema = pytest.importorskip("syndicate.schema")
preserves_py = pytest.importorskip("preserves")

P = parse
_THEIR_KIND = {"Rewrite": "rewrite", "Alts": "or", "Reject": "reject", "unknown": "unknown"}


def _theirs(v):
    return preserves_py.decode(encode(v))


def test_syndicate_py_reads_our_refs_and_signs_alike():
    sturdy = syndicate_schema.sturdy
    c1 = P("<reject <_>>")
    c2 = P("<or [<rewrite <bind <dict {b: <_> a: <bind String>}>> <ref 1>>]>")
    ref = attenuate(mint(P("<space chat>"), b"k"), c1, c2)
    theirs = sturdy.SturdyRef.decode(_theirs(ref.to_value()))
    assert [c.VARIANT.name for c in theirs.parameters.caveats.caveats] == ["Reject", "Alts"]
    assert theirs.parameters.sig == ref.sig
    # Their canonical encoding of the whole ref, and of each part, is byte for byte ours,
    # so the chained HMAC over their encodings is our signature.
    assert preserves_py.canonicalize(theirs.__preserve__()) == encode(ref.to_value())
    sig = b"k"
    for part in (_theirs(ref.oid), _theirs(c1), _theirs(c2)):
        sig = hmac.new(sig, preserves_py.canonicalize(part), hashlib.blake2s).digest()[:16]
    assert sig == ref.sig
    # Our absent caveats are their @absent; their minimal example is our test vector.
    bare = sturdy.SturdyRef.decode(_theirs(mint("syndicate", b"").to_value()))
    assert bare.parameters.caveats.VARIANT.name == "absent"
    assert bare.parameters.sig == base64.b64decode("acowDB2/oI+6aSEC3YIxGg==")


@pytest.mark.parametrize(
    "text",
    [
        "<rewrite <bind <_>> <ref 0>>",
        "<reject Boolean>",
        "<reject <Boolean>>",
        "<reject <lit Boolean>>",
        "<or [<rewrite <bind <_>> <ref 0>>]>",
        "<or [<reject <_>>]>",
        "<or []>",
        "<rewrite <bind <_>> <attenuate <ref 0> [<future>]>>",
        "<rewrite <rec Says [<bind String>]> <dict {k: <ref 0>}>>",
        "<rewrite <bind <_>>>",
        "<future 1>",
        "[1 2]",
    ],
)
def test_caveat_kinds_agree_with_syndicate_py(text):
    v = P(text)
    theirs = syndicate_schema.sturdy.Caveat.decode(_theirs(v)).VARIANT.name
    assert caveat_kind(v)[0] == _THEIR_KIND[theirs]


def test_boolean_binding_number_is_not_an_int():
    # The schema says <ref int>; #t is a Boolean.  syndicate-py's decoder accepts it
    # (Python's bool is an int subclass); we follow the schema, as syndicate-rs does.
    v = P("<rewrite <bind <_>> <ref #t>>")
    assert syndicate_schema.sturdy.Caveat.decode(_theirs(v)).VARIANT.name == "Rewrite"
    assert caveat_kind(v)[0] == "unknown"


@given(caveats)
def test_random_caveat_kinds_agree_with_syndicate_py(c):
    try:
        pv = _theirs(c)
    except preserves_py.DecodeError:
        # preserves-py cannot hold a set or dictionary with both 0 and 0.0 (or #f) in it,
        # since Python's equality conflates them; nothing to compare for such a caveat.
        assume(False)
    theirs = _THEIR_KIND[syndicate_schema.sturdy.Caveat.decode(pv).VARIANT.name]
    try:
        ours = caveat_kind(c)[0]
    except SturdyError:
        # Parses, but invalid (unbound <ref>, <bind> under <not>): only a rewrite or an or
        # of rewrites can be invalid, and the schema decoder (syntax only) accepts it.
        assert theirs in ("rewrite", "or")
        return
    assert ours == theirs
