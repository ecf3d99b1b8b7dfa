"""dataspace: a Python dataspace broker and toolkit.

Programs assert structured Preserves values into a dataspace, observe them with patterns,
send messages, record them into durable streams and run exactly-once pipelines over them.

>>> from dataspace import Dataspace, parse
>>> ds = Dataspace()
>>> sub = ds.observe('<Says $who $what>', on_message=lambda who, what: print(who, what))
>>> ds.send(parse('<Says "alice" "hi">'))
alice hi
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_WHERE = {
    "OBSERVE": "dataspace",
    "Dataspace": "dataspace",
    "Entity": "dataspace",
    "Facet": "dataspace",
    "Handle": "dataspace",
    "Subscription": "dataspace",
    "Index": "index",
    "Pattern": "pattern",
    "PatternError": "pattern",
    "match": "pattern",
    "parse_pattern": "pattern",
}


def __getattr__(name: str) -> Any:
    # Submodules load on first use: a process that needs one part (a Spark worker reading
    # a stream) does not pay for importing every other part.
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
