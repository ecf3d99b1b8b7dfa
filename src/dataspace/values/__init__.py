"""Preserves values: the data model, the canonical binary codec and the text codec.

>>> from dataspace.values import parse, stringify, encode, decode, Record, Symbol
>>> v = parse('<Says "alice" "hi">')
>>> v == Record(Symbol("Says"), ["alice", "hi"])
True
>>> decode(encode(v)) == v
True
>>> stringify(v)
'<Says "alice" "hi">'
"""

from .binary import Decoder, decode, decode_prefix, encode
from .errors import (
    DecodeEOF,
    DecodeError,
    DecodeLimitExceeded,
    DecodeShort,
    DecodeTooLarge,
    LimitExceeded,
    ParseEOF,
    ParseError,
    ParseLimitExceeded,
    ParseShort,
    PreservesError,
)
from .model import (
    Annotated,
    Dictionary,
    Embedded,
    Record,
    Sequence,
    Set,
    Symbol,
    Value,
    annotations_equal,
    compare,
    double_bits,
    double_from_bits,
    is_value,
    key,
    preserve,
    sort_key,
    strip,
)
from .text import parse, stringify

__all__ = [
    "Annotated",
    "DecodeEOF",
    "DecodeError",
    "DecodeLimitExceeded",
    "DecodeTooLarge",
    "DecodeShort",
    "Decoder",
    "Dictionary",
    "Embedded",
    "LimitExceeded",
    "ParseEOF",
    "ParseError",
    "ParseLimitExceeded",
    "ParseShort",
    "PreservesError",
    "Record",
    "Sequence",
    "Set",
    "Symbol",
    "Value",
    "annotations_equal",
    "compare",
    "decode",
    "decode_prefix",
    "double_bits",
    "double_from_bits",
    "encode",
    "is_value",
    "key",
    "parse",
    "preserve",
    "sort_key",
    "stringify",
    "strip",
]
