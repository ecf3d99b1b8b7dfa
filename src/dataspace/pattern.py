"""Patterns over Preserves values (the dataspace pattern language) and skeleton analysis.

A pattern is one of

* :data:`DISCARD` (``_``) -- matches anything;
* :class:`Bind` (``$`` / ``$name``) -- captures the value at its position, then matches
  its subpattern there;
* :class:`Lit` -- matches exactly one atom (or, for literal sets, one set);
* :class:`Rec`, :class:`Arr`, :class:`Dict` -- compound patterns that check the kind of
  the input (and a record's label) and then match the listed positions only: extra fields,
  elements or keys in the input are ignored, missing ones make the match fail.

Bindings are numbered in visit order: record fields and sequence elements by increasing
index, dictionary entries by the Preserves order of their keys, a bind before the
bindings inside it.

Three ways to build a pattern:

>>> p = parse_pattern('<Says "alice" $text>')
>>> match(p, parse('<Says "alice" "hi">'))
('hi',)
>>> from_preserves(to_preserves(p)) == p
True

and the constructors of this module.  The concise text syntax (:func:`parse_pattern`)
is Preserves text with these symbols read specially:

=================  =====================================================================
``_``              discard
``$`` ``$name``    bind (the name is documentation; bindings are numbered)
``<$name P>``      bind with subpattern ``P`` (also ``<$ P>``)
``__`` ``___``     the literal symbols ``_``, ``__`` (one underscore fewer)
``$$x``            the literal symbol ``$x`` (``$$`` escapes a leading ``$``)
=================  =====================================================================

Everything else is literal: atoms match themselves; records, sequences and dictionaries
become compound patterns over their fields; sets and embedded values match exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

from .values import (
    Dictionary,
    Record,
    Sequence,
    Set,
    Symbol,
    Value,
    key,
    parse,
    preserve,
    sort_key,
)
from .values.model import _enter, _leave

__all__ = [
    "DISCARD",
    "Arr",
    "Bind",
    "Dict",
    "Discard",
    "Lit",
    "Pattern",
    "PatternError",
    "Rec",
    "Skeleton",
    "bind",
    "from_preserves",
    "match",
    "parse_pattern",
    "skeleton",
    "to_preserves",
]


def _is_compiled() -> bool:
    """True when this module runs compiled: its functions then carry no Python code."""
    return not hasattr(_is_compiled, "__code__")


COMPILED: Final = _is_compiled()
"""Whether this module is the compiled (mypyc) build of its source."""


class PatternError(ValueError):
    """A value or text that is not a valid pattern."""


class Pattern:
    """Base class of patterns.  Patterns are immutable, hashable and compare structurally.

    Compiled (mypyc), the pattern classes are native classes: they cannot be subclassed
    outside this module.
    """

    __slots__ = ("_depth", "_hash", "_skel")
    _depth: int  # nesting: 0 for discards and literals (checked against _MAX_PATTERN_DEPTH)
    _hash: int
    _skel: Skeleton

    def _k(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if isinstance(other, Pattern) and type(other) is type(self):
            return self._k() == other._k()
        return False

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            pass
        if COMPILED:
            _enter()
            try:
                h = hash((type(self).__name__, self._k()))
            finally:
                _leave()
        else:
            h = hash((type(self).__name__, self._k()))
        self._hash = h
        return h

    def __repr__(self) -> str:
        return f"parse_pattern({str(self)!r})"

    def __str__(self) -> str:
        return _unparse(self)

    def normalized(self) -> Pattern:
        """The normal form: discards below the highest index of a record or sequence
        pattern are dropped (an element at index n implies elements at every lower
        index), so ``<a _ _>`` and "field 1 exists" normalise to the same pattern."""
        return _normalize(self)

    def binding_names(self) -> list[str | None]:
        """The names given to each binding (``None`` for ``$``), in binding order."""
        out: list[str | None] = []
        _names(self, out)
        return out


class Discard(Pattern):
    """``_``: matches any value."""

    __slots__ = ()

    def __init__(self) -> None:
        self._depth = 0

    def _k(self) -> tuple[Any, ...]:
        return ()

    # (Each class says how to rebuild it: compiled, a native class has no default way to be
    # pickled or copied.)
    def __reduce__(self) -> tuple[Any, ...]:
        return (Discard, ())


DISCARD = Discard()


class Bind(Pattern):
    """``$name``: capture the value here, then match ``pattern`` against it."""

    __slots__ = ("name", "pattern")

    def __init__(self, pattern: object = DISCARD, name: str | None = None) -> None:
        if not isinstance(pattern, Pattern):
            raise TypeError("Bind needs a Pattern")
        self.pattern: Pattern = pattern
        self.name = name  # documentation only: not part of equality
        self._depth = _nested(pattern._depth)

    def _k(self) -> tuple[Any, ...]:
        return (self.pattern,)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Bind, (self.pattern, self.name))


class Lit(Pattern):
    """Matches exactly ``value`` (an atom, an embedded value or a set)."""

    __slots__ = ("_key", "value")

    def __init__(self, value: Value) -> None:
        value = preserve(value)
        if type(value) in (Record, Sequence, Dictionary):
            raise PatternError(
                "Lit holds atoms; build compound literals with lit() or Rec/Arr/Dict"
            )
        self.value = value
        self._key = key(value)
        self._depth = 0

    def _k(self) -> tuple[Any, ...]:
        return (self._key,)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Lit, (self.value,))


class Rec(Pattern):
    """``<label P0 P1 ...>``: a record with this label and at least the given fields."""

    __slots__ = ("_label_key", "fields", "label")

    def __init__(self, label: Value, fields: Iterable[Pattern] | Mapping[int, Pattern] = ()) -> None:
        self.label = preserve(label)
        self._label_key = key(self.label)
        self.fields = _indexed(fields, "record field")
        self._depth = _nested(max([p._depth for _i, p in self.fields], default=0))

    def _k(self) -> tuple[Any, ...]:
        return (self._label_key, self.fields)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Rec, (self.label, dict(self.fields)))


class Arr(Pattern):
    """``[P0 P1 ...]``: a sequence with at least the given elements."""

    __slots__ = ("items",)

    def __init__(self, items: Iterable[Pattern] | Mapping[int, Pattern] = ()) -> None:
        self.items = _indexed(items, "sequence element")
        self._depth = _nested(max([p._depth for _i, p in self.items], default=0))

    def _k(self) -> tuple[Any, ...]:
        return (self.items,)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Arr, (dict(self.items),))


class Dict(Pattern):
    """``{k: P ...}``: a dictionary with at least the given keys.

    ``entries`` is kept sorted by the Preserves order of the keys (the visit order).
    """

    __slots__ = ("entries",)

    def __init__(self, entries: Mapping[Value, Pattern] | Iterable[tuple[Value, Pattern]] = ()) -> None:
        pairs = entries.items() if isinstance(entries, Mapping) else entries
        seen: dict[Any, tuple[Value, Pattern]] = {}
        for k, p in pairs:
            k = preserve(k)
            if not isinstance(p, Pattern):
                raise TypeError("Dict entries must map keys to Patterns")
            seen[key(k)] = (k, p)
        self.entries: tuple[tuple[Value, Pattern], ...] = tuple(
            sorted(seen.values(), key=lambda kp: sort_key(kp[0]))
        )
        self._depth = _nested(max([p._depth for _k, p in self.entries], default=0))

    def _k(self) -> tuple[Any, ...]:
        return tuple((key(k), p) for k, p in self.entries)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Dict, (list(self.entries),))


def _nested(inner: int) -> int:
    """The depth of a pattern around one of depth ``inner``: nesting is bounded here, so
    every recursion over a pattern is (the compiled build has no stack guard of its own)."""
    if inner >= _MAX_PATTERN_DEPTH:
        raise PatternError(f"pattern nested deeper than {_MAX_PATTERN_DEPTH}")
    return inner + 1


def _indexed(
    items: Iterable[Pattern] | Mapping[int, Pattern], what: str
) -> tuple[tuple[int, Pattern], ...]:
    pairs = items.items() if isinstance(items, Mapping) else enumerate(items)
    out: dict[int, Pattern] = {}
    for i, p in pairs:
        if type(i) is not int or i < 0:
            raise PatternError(f"{what} index must be a non-negative integer, not {i!r}")
        if not isinstance(p, Pattern):
            raise TypeError(f"{what} {i} is not a Pattern: {p!r}")
        out[i] = p
    return tuple(sorted(out.items()))


def bind(pattern: Pattern = DISCARD, name: str | None = None) -> Bind:
    """Shorthand for :class:`Bind`."""
    return Bind(pattern, name)


def lit(value: Value) -> Pattern:
    """A pattern matching exactly ``value``; compound values become compound patterns."""
    value = preserve(value)
    t = type(value)
    if t is Record:
        return Rec(value.label, [lit(f) for f in value.fields])
    if t is Sequence:
        return Arr([lit(x) for x in value])
    if t is Dictionary:
        return Dict([(k, lit(v)) for k, v in value.items()])
    return Lit(value)


__all__.append("lit")


# ---------------------------------------------------------------------------------------
# Matching (the reference semantics of seed 003)


def match(pattern: Pattern, value: Value) -> tuple[Value, ...] | None:
    """Match ``value`` against ``pattern``: the tuple of bindings, or ``None``."""
    out: list[Value] = []
    return tuple(out) if _match(pattern, preserve(value), out) else None


def _match(p: Pattern, v: Value, out: list[Value]) -> bool:
    if isinstance(p, Discard):
        return True
    if isinstance(p, Bind):
        out.append(v)
        return _match(p.pattern, v, out)
    if isinstance(p, Lit):
        return bool(key(v) == p._key)
    if isinstance(p, Rec):
        if type(v) is not Record or key(v.label) != p._label_key:
            return False
        fields = v.fields
        for i, sub in p.fields:
            if i >= len(fields) or not _match(sub, fields[i], out):
                return False
        return True
    if isinstance(p, Arr):
        if type(v) is not Sequence:
            return False
        for i, sub in p.items:
            if i >= len(v) or not _match(sub, v[i], out):
                return False
        return True
    if isinstance(p, Dict):
        if type(v) is not Dictionary:
            return False
        items = v._items
        for k, sub in p.entries:
            e = items.get(key(k))
            if e is None or not _match(sub, e[1], out):
                return False
        return True
    raise TypeError(f"not a pattern: {p!r}")


# ---------------------------------------------------------------------------------------
# Conversion to and from the Preserves (wire) form

_S_ = Symbol("_")
_BIND = Symbol("bind")
_LIT = Symbol("lit")
_GROUP = Symbol("group")
_REC = Symbol("rec")
_ARR = Symbol("arr")
_DICT = Symbol("dict")

_MAX_PATTERN_DEPTH: Final = 256


def to_preserves(pattern: Pattern) -> Value:
    """The Syndicate wire form (dataspacePatterns.prs) of ``pattern``."""
    if isinstance(pattern, Discard):
        return Record._make(_S_, ())
    if isinstance(pattern, Bind):
        return Record._make(_BIND, (to_preserves(pattern.pattern),))
    if isinstance(pattern, Lit):
        return Record._make(_LIT, (pattern.value,))
    if isinstance(pattern, Rec):
        gt = Record._make(_REC, (pattern.label,))
        entries = Dictionary([(i, to_preserves(p)) for i, p in pattern.fields])
    elif isinstance(pattern, Arr):
        gt = Record._make(_ARR, ())
        entries = Dictionary([(i, to_preserves(p)) for i, p in pattern.items])
    elif isinstance(pattern, Dict):
        gt = Record._make(_DICT, ())
        entries = Dictionary([(k, to_preserves(p)) for k, p in pattern.entries])
    else:
        raise TypeError(f"not a pattern: {pattern!r}")
    return Record._make(_GROUP, (gt, entries))


def from_preserves(value: Value) -> Pattern:
    """Read a pattern from its Preserves form.

    Accepts the current Syndicate wire form (``<group <rec label> {0: P ...}>``,
    ``<group <arr> {...}>``, ``<group <dict> {...}>``) and the older form of the
    specification (``<rec label {0: P ...}>``, ``<arr {...}>``, ``<dict {...}>``), plus
    ``<_>``, ``<bind P>`` and ``<lit atom>``.  A compound value inside ``<lit ...>`` is read
    as the compound pattern matching exactly it.  Raises :class:`PatternError`.
    """
    return _from_pv(preserve(value), 0)


def _from_pv(v: Value, depth: int) -> Pattern:
    if depth > _MAX_PATTERN_DEPTH:
        raise PatternError(f"pattern nested deeper than {_MAX_PATTERN_DEPTH}")
    if type(v) is not Record:
        raise PatternError(f"expected a pattern record, got {_short(v)}")
    label, f = v.label, v.fields
    n = len(f)
    if label == _S_ and n == 0:
        return DISCARD
    if label == _BIND and n == 1:
        return Bind(_from_pv(f[0], depth + 1))
    if label == _LIT and n == 1:
        try:
            return lit(f[0])
        except TypeError as e:
            raise PatternError(str(e)) from None
    if label == _GROUP and n == 2:
        gt, entries = f
        if type(gt) is not Record or type(entries) is not Dictionary:
            raise PatternError(f"malformed group pattern {_short(v)}")
        if gt.label == _REC and len(gt.fields) == 1:
            return Rec(gt.fields[0], _int_entries(entries, depth))
        if gt.label == _ARR and len(gt.fields) == 0:
            return Arr(_int_entries(entries, depth))
        if gt.label == _DICT and len(gt.fields) == 0:
            return Dict([(k, _from_pv(p, depth + 1)) for k, p in entries.items()])
        raise PatternError(f"unknown group type {_short(gt)}")
    if label == _REC and n == 2 and type(f[1]) is Dictionary:
        return Rec(f[0], _int_entries(f[1], depth))
    if label == _ARR and n == 1 and type(f[0]) is Dictionary:
        return Arr(_int_entries(f[0], depth))
    if label == _DICT and n == 1 and type(f[0]) is Dictionary:
        return Dict([(k, _from_pv(p, depth + 1)) for k, p in f[0].items()])
    raise PatternError(f"not a pattern: {_short(v)}")


def _int_entries(d: Dictionary, depth: int) -> dict[int, Pattern]:
    out = {}
    for k, p in d.items():
        if type(k) is not int or k < 0:
            raise PatternError(f"field index must be a non-negative integer, not {_short(k)}")
        out[k] = _from_pv(p, depth + 1)
    return out


def _short(v: Value) -> str:
    try:
        from .values import stringify

        s = stringify(v)
    except Exception:
        s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


# ---------------------------------------------------------------------------------------
# The concise text syntax


def parse_pattern(text: str) -> Pattern:
    """Parse the concise pattern syntax (see the module docstring).

    >>> parse_pattern('[1 $ _]') == Arr([Lit(1), Bind(), DISCARD])
    True
    """
    try:
        v = parse(text)
    except ValueError as e:
        raise PatternError(f"bad pattern text: {e}") from None
    return from_value_syntax(v)


_DISCARD_TEXT = Symbol("_")


def instantiate(pattern: Pattern, captures: Iterable[Value]) -> Value:
    """``pattern`` with each bind replaced by its capture (in binding order) and each
    discard by the symbol ``_``: what an observer knows of a match.

    >>> from .values import stringify
    >>> stringify(instantiate(parse_pattern('<Says $who _>'), ["alice"]))
    '<Says "alice" _>'
    """
    return _fill(pattern, iter(captures))


def _fill(p: Pattern, captures: Iterator[Value]) -> Value:
    if isinstance(p, Bind):
        v = next(captures)
        for _ in p.pattern.binding_names():
            next(captures)  # binds inside a bind: its capture holds them already
        return v
    if isinstance(p, Lit):
        return p.value
    if isinstance(p, Rec):
        return Record(p.label, _fill_items(dict(p.fields), captures))
    if isinstance(p, Arr):
        return Sequence(_fill_items(dict(p.items), captures))
    if isinstance(p, Dict):
        return Dictionary([(k, _fill(x, captures)) for k, x in p.entries])
    return _DISCARD_TEXT


def _fill_items(items: dict[int, Pattern], captures: Iterator[Value]) -> list[Value]:
    n = max(items) + 1 if items else 0
    return [_fill(items[i], captures) if i in items else _DISCARD_TEXT for i in range(n)]


__all__.append("instantiate")


def as_pattern(p: Pattern | str | Value) -> Pattern:
    """A pattern from what APIs accept: a Pattern, concise pattern text, or the wire form."""
    if isinstance(p, Pattern):
        return p
    if isinstance(p, str):
        return parse_pattern(p)
    return from_preserves(p)


__all__.append("as_pattern")


def from_value_syntax(v: Value) -> Pattern:
    """Convert a parsed value written in the concise syntax into a pattern."""
    return _from_syntax(preserve(v), 0)


__all__.append("from_value_syntax")


def _from_syntax(v: Value, depth: int) -> Pattern:
    if depth > _MAX_PATTERN_DEPTH:
        raise PatternError(f"pattern nested deeper than {_MAX_PATTERN_DEPTH}")
    t = type(v)
    if t is Symbol:
        name = v.name
        if name == "_":
            return DISCARD
        if name.startswith("$"):
            if name.startswith("$$"):
                return Lit(Symbol(name[1:]))
            return Bind(DISCARD, name[1:] or None)
        if len(name) > 1 and name.strip("_") == "":
            return Lit(Symbol(name[1:]))
        return Lit(v)
    if t is Record:
        label = v.label
        if type(label) is Symbol and label.name.startswith("$") and not label.name.startswith("$$"):
            if len(v.fields) != 1:
                raise PatternError(
                    f"<{label.name} P> binds with exactly one subpattern P; to write a record "
                    f"labelled {label.name} write <${label.name} ...>"
                )
            return Bind(_from_syntax(v.fields[0], depth + 1), label.name[1:] or None)
        if type(label) is Symbol and label.name == "_":
            raise PatternError("a record label cannot be _ (labels are literal); write <__ ...>")
        return Rec(_unescape_literal(label), [_from_syntax(x, depth + 1) for x in v.fields])
    if t is Sequence:
        return Arr([_from_syntax(x, depth + 1) for x in v])
    if t is Dictionary:
        return Dict([(_unescape_literal(k), _from_syntax(x, depth + 1)) for k, x in v.items()])
    if t is Set:
        for x in v:
            _check_literal(x)
    return Lit(v)


def _unescape_literal(v: Value) -> Value:
    """Labels and dictionary keys are literal values: apply the escapes, reject patterns."""
    if type(v) is Symbol:
        name = v.name
        if name.startswith("$$"):
            return Symbol(name[1:])
        if name.startswith("$"):
            raise PatternError(f"{name} cannot be a binding here (labels and keys are literal)")
        if len(name) > 1 and name.strip("_") == "":
            return Symbol(name[1:])
        if name == "_":
            raise PatternError("_ cannot be a discard here (labels and keys are literal); write __")
    _check_literal(v)
    return v


def _check_literal(v: Value) -> None:
    t = type(v)
    if t is Symbol and (v.name == "_" or (v.name.startswith("$") and not v.name.startswith("$$"))):
        raise PatternError(
            f"{v.name} inside a set, label or key is ambiguous; sets match exactly, so write "
            "literal symbols escaped ($$x, __)"
        )
    if t is Record:
        _check_literal(v.label)
        for x in v.fields:
            _check_literal(x)
    elif t is Sequence or t is Set:
        for x in v:
            _check_literal(x)
    elif t is Dictionary:
        for k, x in v.items():
            _check_literal(k)
            _check_literal(x)


def _escape_symbol(s: Symbol) -> Symbol:
    name = s.name
    if name.startswith("$") or (name and name.strip("_") == ""):
        return Symbol(("$" if name.startswith("$") else "_") + name)
    return s


def _unparse(p: Pattern) -> str:
    from .values import stringify

    return stringify(_to_syntax(p))


def _to_syntax(p: Pattern) -> Value:
    if isinstance(p, Discard):
        return _S_
    if isinstance(p, Bind):
        name = "$" + (p.name or "")
        if type(p.pattern) is Discard:
            return Symbol(name)
        return Record._make(Symbol(name), (_to_syntax(p.pattern),))
    if isinstance(p, Lit):
        v = p.value
        return _escape_symbol(v) if type(v) is Symbol else v
    if isinstance(p, Rec):
        fields = dict(p.fields)
        n = max(fields) + 1 if fields else 0
        label = p.label
        label = _escape_symbol(label) if type(label) is Symbol else label
        return Record(label, [_to_syntax(fields[i]) if i in fields else _S_ for i in range(n)])
    if isinstance(p, Arr):
        items = dict(p.items)
        n = max(items) + 1 if items else 0
        return Sequence([_to_syntax(items[i]) if i in items else _S_ for i in range(n)])
    if isinstance(p, Dict):
        return Dictionary(
            [(_escape_symbol(k) if type(k) is Symbol else k, _to_syntax(x)) for k, x in p.entries]
        )
    raise TypeError(f"not a pattern: {p!r}")


def _drop_gaps(items: tuple[tuple[int, Pattern], ...]) -> dict[int, Pattern]:
    if not items:
        return {}
    top = max(i for i, _p in items)
    return {i: _normalize(p) for i, p in items if i == top or type(p) is not Discard}


def _normalize(p: Pattern) -> Pattern:
    if isinstance(p, Bind):
        return Bind(_normalize(p.pattern), p.name)
    if isinstance(p, Rec):
        return Rec(p.label, _drop_gaps(p.fields))
    if isinstance(p, Arr):
        return Arr(_drop_gaps(p.items))
    if isinstance(p, Dict):
        return Dict([(k, _normalize(x)) for k, x in p.entries])
    return p


def _names(p: Pattern, out: list[str | None]) -> None:
    if isinstance(p, Bind):
        out.append(p.name)
        _names(p.pattern, out)
    elif isinstance(p, Rec):
        for _i, x in p.fields:
            _names(x, out)
    elif isinstance(p, Arr):
        for _i, x in p.items:
            _names(x, out)
    elif isinstance(p, Dict):
        for _k, x in p.entries:
            _names(x, out)


# ---------------------------------------------------------------------------------------
# Skeletons (seed 000): shape, constant map, capture map

# Node classes.  A record's class is the strict key of its label; these two sentinels can
# never equal a label key.


class _ClassTag:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name

    def __reduce__(self) -> str:
        # The module's own instance (the index tells classes apart by identity).
        return "SEQUENCE_CLASS" if self.name == "sequence" else "DICTIONARY_CLASS"


SEQUENCE_CLASS = _ClassTag("sequence")
DICTIONARY_CLASS = _ClassTag("dictionary")

__all__ += ["SEQUENCE_CLASS", "DICTIONARY_CLASS", "classof"]


def classof(v: Value) -> Any:
    """The class of a value for the index: its label's key, or sequence / dictionary."""
    t = type(v)
    if t is Record:
        lab = v.label
        return lab if type(lab) is Symbol else key(lab)
    if t is Sequence:
        return SEQUENCE_CLASS
    if t is Dictionary:
        return DICTIONARY_CLASS
    return None


Path = tuple[Any, ...]  # steps: field / element indices, or dictionary keys


class Skeleton:
    """Static analysis of a pattern (seed 000).

    * ``shape``: ``[(path, class), ...]`` for every compound position, in lexicographic path
      order (so it is already the shape visit's order);
    * ``constants``: ``[(path, value), ...]`` (value checks), lexicographic order;
    * ``checks``: ``[path, ...]`` (existence checks of discards), lexicographic order;
    * ``captures``: ``[path, ...]`` in binding order;
    * ``kinds``: ``{path_key(path): 'rec' | 'arr' | 'dict'}`` for every compound position
      (keyed by :func:`path_key`: a dictionary key ``#t`` and an index ``1`` are different
      steps, though Python's ``(True,) == (1,)``), so that a
      path can be projected without inspecting the value.
    """

    __slots__ = ("captures", "checks", "constants", "index_checks", "kinds", "shape", "visit")

    def __init__(self, pattern: Pattern) -> None:
        shape: list[tuple[Path, Any]] = []
        consts: list[tuple[Path, Value]] = []
        checks: list[Path] = []
        caps: list[Path] = []
        kinds: dict[Path, str] = {}
        _walk(pattern, (), shape, consts, checks, caps, kinds)
        if "dict" not in kinds.values():
            # Only record fields and sequence elements: paths of ints sort natively.
            self.shape = sorted(shape, key=_first)
            self.constants = sorted(consts, key=_first)
            self.checks = sorted(checks)
        else:
            skey = _path_sort_key
            self.shape = sorted(shape, key=lambda e: skey(e[0]))
            self.constants = sorted(consts, key=lambda e: skey(e[0]))
            self.checks = sorted(checks, key=skey)
        self.captures = caps
        self.kinds = kinds
        self.visit = shape_visit(self.shape)
        # The checks the index needs: an existence check of element i of a record or
        # sequence is implied by any constraint on a later element of the same parent.
        # One pass (linear in the paths' total length): the largest step taken below each
        # record or sequence node by any path of the pattern.
        others = [p for p, _c in shape] + [p for p, _v in consts] + caps + self.checks
        maxstep: dict[Any, int] = {}
        for o in others:
            for depth in range(len(o)):
                parent = path_key(o[:depth])
                if kinds.get(parent) in ("rec", "arr") and o[depth] > maxstep.get(parent, -1):
                    maxstep[parent] = o[depth]
        self.index_checks = [
            h for h in self.checks
            if not (
                h
                and kinds.get(parent := path_key(h[:-1])) in ("rec", "arr")
                and maxstep.get(parent, -1) > h[-1]
            )
        ]

    def __repr__(self) -> str:
        return (
            f"Skeleton(shape={self.shape!r}, constants={self.constants!r}, "
            f"checks={self.checks!r}, captures={self.captures!r})"
        )


def _first(e: tuple[Any, Any]) -> Any:
    return e[0]


def path_key(path: Path) -> tuple[Any, ...]:
    """A path with each step as a strict key: use it wherever paths are compared or
    keyed (dictionary-key steps may be ``#t``, ``1`` or ``1.0``, all equal in Python)."""
    return tuple(s if type(s) is int else key(s) for s in path)


def _path_sort_key(path: Path) -> tuple[Any, ...]:
    return tuple(sort_key(s) for s in path)


def _walk(
    p: Pattern,
    h: Path,
    shape: list[tuple[Path, Any]],
    consts: list[tuple[Path, Value]],
    checks: list[Path],
    caps: list[Path],
    kinds: dict[Path, str],
) -> None:
    if isinstance(p, Discard):
        checks.append(h)
    elif isinstance(p, Bind):
        caps.append(h)
        sub = p.pattern
        if type(sub) is not Discard:
            _walk(sub, h, shape, consts, checks, caps, kinds)
    elif isinstance(p, Lit):
        consts.append((h, p.value))
    elif isinstance(p, Rec):
        shape.append((h, classof(Record._make(p.label, ()))))
        kinds[path_key(h)] = "rec"
        for i, sub in p.fields:
            _walk(sub, (*h, i), shape, consts, checks, caps, kinds)
    elif isinstance(p, Arr):
        shape.append((h, SEQUENCE_CLASS))
        kinds[path_key(h)] = "arr"
        for i, sub in p.items:
            _walk(sub, (*h, i), shape, consts, checks, caps, kinds)
    elif isinstance(p, Dict):
        shape.append((h, DICTIONARY_CLASS))
        kinds[path_key(h)] = "dict"
        for k, sub in p.entries:
            _walk(sub, (*h, k), shape, consts, checks, caps, kinds)
    else:
        raise TypeError(f"not a pattern: {p!r}")


def skeleton(pattern: Pattern) -> Skeleton:
    """The (cached) skeleton of ``pattern``."""
    try:
        return pattern._skel
    except AttributeError:
        s = pattern._skel = Skeleton(pattern)
        return s


def _same_step(a: Any, b: Any) -> bool:
    return type(a) is type(b) and key(a) == key(b)


def path_move(frm: Path, to: Path) -> tuple[int, Path]:
    """The move ``to ⊖ frm``: (steps rootward, path leafward) -- seed 000's ⊖."""
    n = 0
    limit = min(len(frm), len(to))
    while n < limit and _same_step(frm[n], to[n]):
        n += 1
    return (len(frm) - n, tuple(to[n:]))


def apply_move(frm: Path, move: tuple[int, Path]) -> Path:
    """``frm ⊕ move`` of seed 000."""
    up, down = move
    return tuple(frm[: len(frm) - up]) + tuple(down)


def shape_visit(shape: list[tuple[Path, Any]]) -> list[tuple[tuple[int, Path], Any]]:
    """Seed 000's shapeVisit: the sorted shape as a list of ((up, down), class) moves."""
    out = []
    cur: Path = ()
    for path, cls in shape:
        out.append((path_move(cur, path), cls))
        cur = path
    return out


__all__ += ["path_move", "apply_move", "shape_visit", "Path", "path_key"]
