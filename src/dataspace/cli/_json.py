"""Preserves values as JSON, for ``--json`` output (one object per line, for jq).

The mapping is made for reading with jq; it is exact for the JSON-like values
(strings, integers, finite doubles, booleans, sequences, dictionaries keyed by strings)
and tags the rest with ``@`` keys.  The ``text`` field of each event (Preserves text)
is the exact value whenever the mapping is not (docs/broker.md, "JSON output").

=====================  =================================================================
Preserves              JSON
=====================  =================================================================
string                 string
integer                number (any size: jq 1.7 keeps big integers exact)
double                 number; NaN and the infinities as ``{"@double": "NaN"}`` etc.
boolean                ``true`` / ``false``
symbol                 ``{"@symbol": "name"}``
byte string            ``{"@bytes": "BASE64"}``
record                 ``{"@record": "Label", "@fields": [...]}`` (a symbol label by its
                       name, any other label mapped as a value)
sequence               array
set                    ``{"@set": [...]}`` (in Preserves order)
dictionary             object, when its keys are strings, or symbols (by name), that
                       differ and do not start with ``@``; else
                       ``{"@dict": [[key, value], ...]}``
embedded reference     ``{"@embedded": "TEXT"}``
annotations            dropped
=====================  =================================================================
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from typing import Any

from ..values import (
    Dictionary,
    Embedded,
    Record,
    Sequence,
    Set,
    Symbol,
    Value,
    sort_key,
    stringify,
    strip,
)

__all__ = ["to_json"]

MAX_DEPTH = 1000


def _embedded(v: Embedded, text: Callable[[Any], Value] | None) -> dict[str, str]:
    try:
        shown = stringify(v, embedded=text) if text is not None else stringify(v)
    except Exception:  # only for display: never fail while printing an event
        shown = f"#:<{type(v.value).__name__}>"
    return {"@embedded": shown}


def to_json(v: Value, embedded: Callable[[Any], Value] | None = None, _depth: int = 0) -> Any:
    """``v`` as a JSON-ready Python object (see the module docstring); ``embedded``
    renders an embedded reference's object as a value for its text."""
    if _depth > MAX_DEPTH:
        raise ValueError(f"the value is nested more than {MAX_DEPTH} levels deep")
    v = strip(v)
    t = type(v)
    d = _depth + 1
    if t is str or t is bool or t is int:
        return v
    if t is float:
        if math.isfinite(v):
            return v
        return {"@double": "NaN" if v != v else ("+Infinity" if v > 0 else "-Infinity")}
    if t is Symbol:
        return {"@symbol": v.name}
    if t is bytes:
        return {"@bytes": base64.b64encode(v).decode("ascii")}
    if t is Record:
        label = v.label
        return {"@record": label.name if type(label) is Symbol else to_json(label, embedded, d),
                "@fields": [to_json(f, embedded, d) for f in v.fields]}
    if t is Sequence:
        return [to_json(x, embedded, d) for x in v]
    if t is Set:
        return {"@set": [to_json(x, embedded, d) for x in sorted(v, key=sort_key)]}
    if t is Dictionary:
        names = [k if type(k) is str else k.name if type(k) is Symbol else None for k in v]
        if all(n is not None and not n.startswith("@") for n in names) and \
                len(set(names)) == len(names):
            return {n: to_json(x, embedded, d) for n, x in zip(names, v.values())}
        items = sorted(v.items(), key=lambda kv: sort_key(kv[0]))
        return {"@dict": [[to_json(k, embedded, d), to_json(x, embedded, d)] for k, x in items]}
    if t is Embedded:
        return _embedded(v, embedded)
    raise TypeError(f"not a Preserves value: {t.__name__}")  # pragma: no cover
