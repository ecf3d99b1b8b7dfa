"""dataspace: a Python dataspace broker and toolkit.

Programs assert structured Preserves values into a dataspace, observe them with patterns,
send messages, record them into durable streams and run exactly-once pipelines over them.

>>> from dataspace import Dataspace, parse
>>> ds = Dataspace()
>>> sub = ds.observe('<Says $who $what>', on_message=lambda who, what: print(who, what))
>>> ds.send(parse('<Says "alice" "hi">'))
alice hi
"""

# First: Ctrl-C while the `dataspace` command is still importing is one line, not a
# traceback (only in the command's own process; see _interrupt).
from . import _interrupt  # noqa: F401

# isort: split
from typing import TYPE_CHECKING

# Then: choose the compiled or the pure-Python core before any of it is imported.
from . import _build  # noqa: F401
from ._lazy import lazy_exports

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
    # The values too load on first use: the ``dataspace`` command imports this package
    # before it can take Ctrl-C (cli/__init__.py), so the less it runs the better.
    **{name: "values" for name in ("Annotated", "Dictionary", "Embedded", "Record", "Sequence",
                                   "Set", "Symbol", "decode", "encode", "parse", "stringify")},
}


__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
