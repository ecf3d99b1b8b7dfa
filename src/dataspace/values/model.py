"""The Preserves data model, with Preserves equality and total order.

Representation
--------------
Atoms are plain Python objects: ``bool``, ``float`` (Preserves Double), ``int``
(SignedInteger, arbitrary precision), ``str`` (String) and ``bytes`` (ByteString).
Everything else is a class from this module: :class:`Symbol`, :class:`Record`,
:class:`Sequence` (a ``tuple`` subclass), :class:`Set`, :class:`Dictionary`,
:class:`Embedded` and :class:`Annotated`.

Python's own equality conflates ``1``, ``1.0`` and ``True`` (and hashes them alike), and
treats two NaNs as unequal.  Preserves does neither: those are three distinct values, and
a NaN equals itself bit for bit.  So every container here compares and hashes through a
*strict key* (:func:`key`): an object whose Python equality is Preserves equality.  For
the overwhelmingly common case -- containers of strings, integers, symbols and other
containers -- the key is the plain tuple of the items and is checked at C speed; only
booleans and doubles are wrapped.

Use :func:`preserve` to turn natural Python data (lists, tuples, dicts, sets, bytearray,
subclasses of the atom types, objects with ``__preserve__``) into values.  Every constructor
here normalises its arguments through it, so a value built from these classes is always
well formed.

Values are immutable: do not assign to their attributes (hashes are cached).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, TypeAlias

__all__ = [
    "Annotated",
    "Dictionary",
    "Embedded",
    "Record",
    "Sequence",
    "Set",
    "Symbol",
    "Value",
    "compare",
    "double_bits",
    "double_from_bits",
    "is_value",
    "key",
    "preserve",
    "strip",
    "annotations_equal",
    "sort_key",
]

Value: TypeAlias = Any
"""Any Preserves value (see the module docstring for the representation)."""

MAX_DEPTH = 200
"""Default nesting limit of the codecs.  Comparing, hashing, encoding and printing values
recurse once or twice per level, so the limit keeps every operation on decoded input well
inside Python's recursion limit."""

_pack_d = struct.Struct(">d").pack
_unpack_q = struct.Struct(">q").unpack
_unpack_Q = struct.Struct(">Q").unpack
_pack_Q = struct.Struct(">Q").pack
_unpack_d = struct.Struct(">d").unpack


def double_bits(x: float) -> int:
    """The 64 IEEE-754 bits of ``x`` as an unsigned integer."""
    return _unpack_Q(_pack_d(x))[0]


def double_from_bits(bits: int) -> float:
    """The double whose IEEE-754 bits are ``bits`` (NaN payloads are kept)."""
    return _unpack_d(_pack_Q(bits))[0]


class _AtomKey:
    """Strict key for a boolean or a double (whose Python equality is too loose)."""

    __slots__ = ("_hash", "payload", "tag")

    def __init__(self, tag: int, payload: int) -> None:
        self.tag = tag
        self.payload = payload
        self._hash = hash((tag, payload, "_AtomKey"))

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is _AtomKey
            and self.tag == other.tag  # type: ignore[attr-defined]
            and self.payload == other.payload  # type: ignore[attr-defined]
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"_AtomKey({self.tag}, {self.payload:#x})"


class _BigIntKey:
    """Strict key for an integer of 2**61 or more in magnitude.

    Python hashes integers modulo 2**61 - 1 with no salt, so a peer could send a set or
    dictionary of big integers that all collide and make building it quadratic.  These
    keys hash the integer's bytes instead, which Python salts per process.
    """

    __slots__ = ("_hash", "n")

    def __init__(self, n: int) -> None:
        self.n = n
        self._hash = hash(n.to_bytes((n.bit_length() + 8) // 8, "big", signed=True))

    def __eq__(self, other: object) -> bool:
        return type(other) is _BigIntKey and self.n == other.n  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return self._hash


_BIG_INT = (1 << 61) - 1

_FALSE_KEY = _AtomKey(0, 0)
_TRUE_KEY = _AtomKey(0, 1)


# The text form of str(value).  This module does not import the text codec (which is
# built on it): ``values.text`` installs its writer here when it is imported, which the
# package's ``__init__`` does before anyone can hold a value.
_text_form: Callable[[Any], str] = repr


def _set_text_form(writer: Callable[[Any], str]) -> None:
    """Make ``str(value)`` use ``writer`` (called once, by :mod:`.text`)."""
    global _text_form
    _text_form = writer


class _ValueMethods:
    """Methods every value class shares: the Preserves total order and text form."""

    __slots__ = ()

    def __lt__(self, other: object) -> bool:
        return compare(self, other) < 0

    def __le__(self, other: object) -> bool:
        return compare(self, other) <= 0

    def __gt__(self, other: object) -> bool:
        return compare(self, other) > 0

    def __ge__(self, other: object) -> bool:
        return compare(self, other) >= 0

    def __str__(self) -> str:
        return _text_form(self)


class Symbol(_ValueMethods):
    """A Preserves symbol, written ``name`` or ``|quoted name|`` in text."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        if type(name) is not str:
            if isinstance(name, str):
                name = str(name)
            else:
                raise TypeError(f"Symbol name must be a str, not {type(name).__name__}")
        self.name = name

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is Symbol and self.name == other.name)  # type: ignore[attr-defined]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self.name) ^ 0x5F3759DF

    def __repr__(self) -> str:
        return f"Symbol({self.name!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Symbol, (self.name,))


class Record(_ValueMethods):
    """A Preserves record ``<label field ...>``.

    >>> Record(Symbol("Says"), ["alice", "hi"])
    Record(Symbol('Says'), ('alice', 'hi'))

    ``label`` is any value (usually a :class:`Symbol`); ``fields`` is a tuple of values.
    Records support ``len()``, indexing and iteration over their fields.
    """

    __slots__ = ("_hash", "fields", "label")

    def __init__(self, label: Value, fields: Iterable[Value] = ()) -> None:
        self.label = label if type(label) in _PLAIN_OR_ATOM else preserve(label)
        fields = tuple(fields)
        if not _PLAIN_OR_ATOM.issuperset(map(type, fields)):
            fields = tuple(map(preserve, fields))
        self.fields = fields
        self._hash: int | None = None

    @classmethod
    def _make(cls, label: Value, fields: tuple[Any, ...]) -> Record:
        """Build without normalising (the arguments must already be values)."""
        r = _new(cls)
        r.label = label
        r.fields = fields
        r._hash = None
        return r

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not Record:
            return type(other) is Annotated and other == self
        sf = self.fields
        of = other.fields  # type: ignore[attr-defined]
        if len(sf) != len(of):
            return False
        sl = self.label
        ol = other.label  # type: ignore[attr-defined]
        if sl is not ol and key(sl) != key(ol):
            return False
        if _PLAIN.issuperset(map(type, sf)) and _PLAIN.issuperset(map(type, of)):
            return sf == of
        return tuple(map(key, sf)) == tuple(map(key, of))

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            # Fields and label hashed by the rule of _hk (annotations unwrapped, NaNs by
            # their bits), which agrees with strict equality; usually no tuple is built.
            f = self.fields
            if not _HK_TYPES.isdisjoint(map(type, f)):
                f = tuple(map(_hk, f))
            lab = self.label
            if type(lab) in _HK_TYPES:
                lab = _hk(lab)
            h = self._hash = hash(f) ^ hash(lab) ^ 0x2545F491
        return h

    def __len__(self) -> int:
        return len(self.fields)

    def __getitem__(self, i: int) -> Value:
        return self.fields[i]

    def __iter__(self) -> Iterator[Value]:
        return iter(self.fields)

    def __repr__(self) -> str:
        return f"Record({self.label!r}, {self.fields!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Record, (self.label, self.fields))


class Sequence(_ValueMethods, tuple):
    """A Preserves sequence ``[item ...]``: an immutable tuple with strict equality."""

    __slots__ = ()

    def __new__(cls, items: Iterable[Value] = ()) -> Sequence:
        items = tuple(items)
        if not _PLAIN_OR_ATOM.issuperset(map(type, items)):
            items = tuple(map(preserve, items))
        return tuple.__new__(cls, items)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        t = type(other)
        if t is not Sequence:
            if t is tuple or t is list:
                try:
                    other = Sequence(other)  # type: ignore[arg-type]
                except TypeError:
                    return False
            elif t is Annotated:
                return other == self
            else:
                return False
        if tuple.__len__(self) != tuple.__len__(other):  # type: ignore[arg-type]
            return False
        if _PLAIN.issuperset(map(type, self)) and _PLAIN.issuperset(map(type, other)):  # type: ignore[call-overload]
            return tuple.__eq__(self, other)  # type: ignore[operator]
        return tuple(map(key, self)) == tuple(map(key, other))  # type: ignore[call-overload]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        # Equal to the hash of the plain tuple (a Sequence compares equal to one) and
        # consistent with strict equality (see _hk).
        if _HK_TYPES.isdisjoint(map(type, self)):
            return tuple.__hash__(self)
        return hash(tuple(map(_hk, self)))

    def __add__(self, other: Iterable[Value]) -> Sequence:  # type: ignore[override]
        return Sequence(tuple(self) + tuple(other))

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        r = tuple.__getitem__(self, i)
        if type(i) is slice:
            return tuple.__new__(Sequence, r)
        return r

    def __repr__(self) -> str:
        return f"Sequence({tuple.__repr__(self)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Sequence, (tuple(self),))


class Set(_ValueMethods, AbstractSet):  # type: ignore[misc]
    """A Preserves set ``#{item ...}``: immutable, hashable, with strict membership.

    ``1``, ``1.0`` and ``True`` are three distinct members here.
    """

    __slots__ = ("_hash", "_items")

    def __init__(self, items: Iterable[Value] = ()) -> None:
        d: dict[Any, Any] = {}
        for x in items:
            x = preserve(x)
            d[key(x)] = x
        self._items = d
        self._hash: int | None = None

    @classmethod
    def _from_dict(cls, d: dict[Any, Any]) -> Set:
        s = _new(cls)
        s._items = d
        s._hash = None
        return s

    def __contains__(self, x: object) -> bool:
        try:
            return key(preserve(x)) in self._items
        except TypeError:
            return False

    def __iter__(self) -> Iterator[Value]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        t = type(other)
        if t is not Set:
            if t is set or t is frozenset:
                try:
                    other = Set(other)  # type: ignore[arg-type]
                except TypeError:
                    return False
            elif t is Annotated:
                return other == self
            else:
                return False
        return self._items.keys() == other._items.keys()  # type: ignore[attr-defined]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        # As for Sequence: equal to the hash of a frozenset of the same members.
        h = self._hash
        if h is None:
            values = self._items.values()
            if _HK_TYPES.isdisjoint(map(type, values)):
                h = hash(frozenset(values))
            else:
                h = hash(frozenset(map(_hk, values)))
            self._hash = h
        return h

    def _from_iterable(self, it: Iterable[Value]) -> Set:  # type: ignore[override]
        return Set(it)

    def __repr__(self) -> str:
        return f"Set({list(self._items.values())!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Set, (list(self._items.values()),))


class Dictionary(_ValueMethods, Mapping):  # type: ignore[misc]
    """A Preserves dictionary ``{key: value ...}``: immutable, hashable, strict keys."""

    __slots__ = ("_hash", "_items")

    def __init__(self, items: Mapping[Value, Value] | Iterable[tuple[Value, Value]] = ()) -> None:
        pairs = items.items() if isinstance(items, Mapping) else items
        d: dict[Any, tuple[Any, Any]] = {}
        for k, v in pairs:
            k = preserve(k)
            d[key(k)] = (k, preserve(v))
        self._items = d
        self._hash: int | None = None

    @classmethod
    def _from_dict(cls, d: dict[Any, tuple[Any, Any]]) -> Dictionary:
        r = _new(cls)
        r._items = d
        r._hash = None
        return r

    def __getitem__(self, k: Value) -> Value:
        try:
            kk = key(preserve(k))
        except TypeError:
            raise KeyError(k) from None
        return self._items[kk][1]

    def __contains__(self, k: object) -> bool:
        try:
            return key(preserve(k)) in self._items
        except TypeError:
            return False

    def __iter__(self) -> Iterator[Value]:
        for k, _v in self._items.values():
            yield k

    def __len__(self) -> int:
        return len(self._items)

    def items(self):  # type: ignore[no-untyped-def, override]
        return list(self._items.values())

    def values(self):  # type: ignore[no-untyped-def, override]
        return [v for _k, v in self._items.values()]

    def keys(self):  # type: ignore[no-untyped-def, override]
        return [k for k, _v in self._items.values()]

    def _strict(self) -> frozenset[Any]:
        return frozenset((kk, key(v)) for kk, (_k, v) in self._items.items())

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        t = type(other)
        if t is not Dictionary:
            if t is dict:
                try:
                    other = Dictionary(other)  # type: ignore[arg-type]
                except TypeError:
                    return False
            elif t is Annotated:
                return other == self
            else:
                return False
        if len(self._items) != len(other._items):  # type: ignore[attr-defined]
            return False
        oi = other._items  # type: ignore[attr-defined]
        for kk, (_k, v) in self._items.items():
            p = oi.get(kk)
            if p is None or key(p[1]) != key(v):
                return False
        return True

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = self._hash = hash(self._strict()) ^ 0x3C6EF372
        return h

    def __repr__(self) -> str:
        return f"Dictionary({dict(self._items.values())!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Dictionary, (list(self._items.values()),))


class Embedded(_ValueMethods):
    """An embedded value ``#:...``: a reference to something outside the data model.

    Two embedded values are equal when the objects they wrap are equal (for references,
    usually identity).  The wrapped object must be hashable.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if type(other) is not Embedded:
            return type(other) is Annotated and other == self
        v = self.value
        o = other.value  # type: ignore[attr-defined]
        return v is o or v == o

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self.value) ^ 0x7A3D1B2C

    def __repr__(self) -> str:
        return f"Embedded({self.value!r})"


class Annotated(_ValueMethods):
    """A value with annotations attached, as read with ``annotations=True``.

    Annotations are not part of a value's identity: ``Annotated(1, ["x"]) == 1``.
    Use :func:`strip` to remove them and :func:`annotations_equal` to compare them too.
    """

    __slots__ = ("annotations", "item")

    def __init__(self, item: Value, annotations: Iterable[Value] = ()) -> None:
        anns = tuple(preserve(a) for a in annotations)
        if type(item) is Annotated:
            # @a @b x is one value with annotations [a, b]: keep one flat wrapper.
            anns += item.annotations
            item = item.item
        self.item = preserve(item)
        self.annotations = anns

    def __eq__(self, other: object) -> bool:
        try:
            return key(self) == key(preserve(other))
        except TypeError:
            return False

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        # Hashes as the bare value does (it compares equal to it): not through _hk, whose
        # salted key of a big integer is for the items of containers.
        x = self.item
        while type(x) is Annotated:
            x = x.item
        if type(x) is float and x != x:
            return hash(key(x))
        return hash(x)

    def __repr__(self) -> str:
        return f"Annotated({self.item!r}, {list(self.annotations)!r})"


_new = object.__new__

# Types whose Python equality is already Preserves-strict.  ``int`` is here because the
# only values Python would confuse it with (``bool`` and ``float``) are never left bare
# inside a strict key.  Its hash is not flood-safe for big ints: containers hash their
# items through ``_hk`` (which salts them) and ``key()`` wraps a bare one.
_PLAIN = frozenset({str, int, bytes, Symbol, Record, Sequence, Set, Dictionary, Embedded})
# Types whose strict key is always the value itself (``key()`` wraps big integers).
_PLAIN_NOINT = _PLAIN - {int}
# Types that are already normalised values (no conversion needed by ``preserve``).
_PLAIN_OR_ATOM = _PLAIN | {bool, float}


_HK_TYPES = frozenset({float, Annotated, int})


def _hk(x: Value) -> Any:
    """What stands for an item when hashing a Sequence, Set or Annotated.

    The item itself with annotations unwrapped, except a NaN (Python hashes NaNs by
    identity) which is replaced by its bit-pattern key.  Strictly equal items give equal
    hashes this way, and plain items hash exactly as Python hashes them, so a Sequence
    hashes like the tuple it compares equal to.
    """
    while type(x) is Annotated:
        x = x.item
    t = type(x)
    if t is int:
        return x if -_BIG_INT < x < _BIG_INT else _BigIntKey(x)
    if t is float and x != x:
        return key(x)
    return x


def key(v: Value) -> Any:
    """A hashable object whose Python equality is Preserves equality on values.

    ``key(1)``, ``key(1.0)`` and ``key(True)`` are all different; ``key(nan) == key(nan)``
    for NaNs with the same bits; annotations are ignored.  Use it to key Python dicts and
    sets by values.
    """
    t = type(v)
    if t in _PLAIN:
        if t is int and not -_BIG_INT < v < _BIG_INT:
            return _BigIntKey(v)
        return v
    if t is bool:
        return _TRUE_KEY if v else _FALSE_KEY
    if t is float:
        return _AtomKey(1, _unpack_Q(_pack_d(v))[0])
    if t is Annotated:
        return key(v.item)
    return key(preserve(v))


def is_value(v: object) -> bool:
    """True when ``v`` is already a normalised Preserves value at its top level."""
    return type(v) in _PLAIN_OR_ATOM or type(v) is Annotated


def preserve(v: Any) -> Value:
    """Convert natural Python data to a Preserves value.

    Accepts the value classes of this module, ``bool``, ``int``, ``float``, ``str``,
    ``bytes``/``bytearray``/``memoryview``, ``tuple``/``list`` (sequences), ``dict``
    (dictionaries), ``set``/``frozenset`` (sets) and any object with a
    ``__preserve__()`` method.  Raises ``TypeError`` for anything else.
    """
    t = type(v)
    if t in _PLAIN_OR_ATOM or t is Annotated:
        return v
    if t is tuple or t is list:
        return Sequence(v)
    if t is dict:
        return Dictionary(v)
    if t is set or t is frozenset:
        return Set(v)
    if t is bytearray or t is memoryview:
        return bytes(v)
    conv = getattr(v, "__preserve__", None)
    if conv is not None:
        return preserve(conv())
    # Subclasses of the atom and container types (IntEnum, str enums, namedtuples, ...).
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, str):
        return str(v)
    if isinstance(v, bytes):
        return bytes(v)
    if isinstance(v, tuple | list):
        return Sequence(v)
    if isinstance(v, Mapping):
        return Dictionary(v)
    if isinstance(v, AbstractSet):
        return Set(v)
    raise TypeError(
        f"{type(v).__name__} is not a Preserves value; use str, int, float, bool, bytes, "
        "tuple/list, dict, set/frozenset, Symbol, Record or Embedded (or define __preserve__)"
    )


def strip(v: Value) -> Value:
    """Remove every annotation, at every depth."""
    t = type(v)
    if t is Annotated:
        return strip(v.item)
    if t is Record:
        return Record._make(strip(v.label), tuple(map(strip, v.fields)))
    if t is Sequence:
        return tuple.__new__(Sequence, map(strip, v))
    if t is Set:
        return Set(map(strip, v))
    if t is Dictionary:
        return Dictionary((strip(k), strip(x)) for k, x in v._items.values())
    if t is Embedded:
        return v
    return v


def annotations_equal(a: Value, b: Value) -> bool:
    """Structural equality that also compares annotations (used by conformance tests)."""
    ta, tb = type(a), type(b)
    if ta is Annotated or tb is Annotated:
        if ta is not Annotated or tb is not Annotated:
            return False
        return (
            len(a.annotations) == len(b.annotations)
            and all(annotations_equal(x, y) for x, y in zip(a.annotations, b.annotations))
            and annotations_equal(a.item, b.item)
        )
    if ta is not tb:
        return False
    if ta is Record:
        return (
            len(a.fields) == len(b.fields)
            and annotations_equal(a.label, b.label)
            and all(annotations_equal(x, y) for x, y in zip(a.fields, b.fields))
        )
    if ta is Sequence:
        return len(a) == len(b) and all(annotations_equal(x, y) for x, y in zip(a, b))
    if ta is Set:
        if strip(a) != strip(b):
            return False
        bi = {key(x): x for x in b}
        return all(annotations_equal(x, bi[key(x)]) for x in a)
    if ta is Dictionary:
        if len(a) != len(b):
            return False
        bi = b._items
        for kk, (k, v) in a._items.items():
            p = bi.get(kk)
            if p is None or not annotations_equal(k, p[0]) or not annotations_equal(v, p[1]):
                return False
        return True
    return key(a) == key(b)


# ---------------------------------------------------------------------------------------
# Total order

_RANK = {
    bool: 0,
    float: 1,
    int: 2,
    str: 3,
    bytes: 4,
    Symbol: 5,
    Record: 6,
    Sequence: 7,
    Set: 8,
    Dictionary: 9,
    Embedded: 10,
}


def _double_order(x: float) -> int:
    # IEEE-754 totalOrder: map the bits to a signed integer that sorts the same way.
    b = _unpack_q(_pack_d(x))[0]
    return b ^ 0x7FFFFFFFFFFFFFFF if b < 0 else b


def _cmp_seq(a: Iterable[Value], b: Iterable[Value]) -> int:
    ia, ib = iter(a), iter(b)
    for x in ia:
        for y in ib:
            c = compare(x, y)
            if c:
                return c
            break
        else:
            return 1
    for _y in ib:
        return -1
    return 0


def compare(a: Value, b: Value) -> int:
    """Compare two values in the Preserves total order: -1, 0 or 1.

    Kinds are ordered Boolean < Double < SignedInteger < String < ByteString < Symbol <
    Record < Sequence < Set < Dictionary < Embedded; doubles by IEEE-754 totalOrder;
    records by label then fields; sequences lexicographically; sets and dictionaries as
    their sorted elements or sorted (key, value) pairs.  Annotations are ignored.
    """
    while type(a) is Annotated:
        a = a.item
    while type(b) is Annotated:
        b = b.item
    a = preserve(a)
    b = preserve(b)
    ta, tb = type(a), type(b)
    if ta is not tb:
        ra, rb = _RANK[ta], _RANK[tb]
        return -1 if ra < rb else 1
    if ta is float:
        x, y = _double_order(a), _double_order(b)
    elif ta is Symbol:
        x, y = a.name, b.name
    elif ta is Record:
        c = compare(a.label, b.label)
        return c if c else _cmp_seq(a.fields, b.fields)
    elif ta is Sequence:
        return _cmp_seq(a, b)
    elif ta is Set:
        return _cmp_seq(sorted(a, key=sort_key), sorted(b, key=sort_key))
    elif ta is Dictionary:
        ia = sorted(a._items.values(), key=lambda kv: sort_key(kv[0]))
        ib = sorted(b._items.values(), key=lambda kv: sort_key(kv[0]))
        for (ka, va), (kb, vb) in zip(ia, ib):
            c = compare(ka, kb) or compare(va, vb)
            if c:
                return c
        return (len(ia) > len(ib)) - (len(ia) < len(ib))
    elif ta is Embedded:
        if a == b:
            return 0
        try:
            return -1 if a.value < b.value else 1
        except TypeError:
            return -1 if id(a.value) < id(b.value) else 1
    else:
        x, y = a, b
    return (x > y) - (x < y)


class _SortKey:
    __slots__ = ("v",)

    def __init__(self, v: Value) -> None:
        self.v = v

    def __lt__(self, other: _SortKey) -> bool:
        return compare(self.v, other.v) < 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SortKey) and compare(self.v, other.v) == 0

    __hash__ = None  # type: ignore[assignment]


def sort_key(v: Value) -> _SortKey:
    """A key for ``sorted()`` that orders values by the Preserves total order."""
    return _SortKey(v)
