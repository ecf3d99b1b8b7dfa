"""dataspace: a Python dataspace broker and toolkit.

Programs assert structured Preserves values into a dataspace, observe them with patterns,
send messages, record them into durable streams and run exactly-once pipelines over them.

>>> from dataspace import Dataspace, parse
>>> ds = Dataspace()
>>> sub = ds.observe('<Says $who $what>', on_message=lambda who, what: print(who, what))
>>> ds.send(parse('<Says "alice" "hi">'))
alice hi
"""

from .dataspace import OBSERVE, Dataspace, Entity, Facet, Handle, Subscription
from .index import Index
from .pattern import Pattern, PatternError, match, parse_pattern
from .values import (
    Annotated,
    Dictionary,
    Embedded,
    Record,
    Sequence,
    Set,
    Symbol,
    decode,
    encode,
    parse,
    stringify,
)

__version__ = "0.1.0"

__all__ = [
    "OBSERVE",
    "Annotated",
    "Dataspace",
    "Dictionary",
    "Embedded",
    "Entity",
    "Facet",
    "Handle",
    "Index",
    "Pattern",
    "PatternError",
    "Record",
    "Sequence",
    "Set",
    "Subscription",
    "Symbol",
    "decode",
    "encode",
    "match",
    "parse",
    "parse_pattern",
    "stringify",
]
