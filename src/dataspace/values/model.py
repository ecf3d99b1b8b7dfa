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

This module is compiled (mypyc) where a compiler is present (see ``dataspace._build``):
the value classes are then native classes, which cannot be subclassed and take no
attributes beyond their own.  Operations that recurse over a value count their depth
(:data:`RECURSION_LIMIT`), so a deep value raises ``RecursionError`` in both builds
rather than exhausting the C stack of the compiled one.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, Final, TypeAlias

from mypy_extensions import mypyc_attr

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

MAX_DEPTH: Final = 200
"""Default nesting limit of the codecs.  Comparing, hashing, encoding and printing values
recurse once or twice per level, so the limit keeps every operation on decoded input well
inside Python's recursion limit."""

RECURSION_LIMIT: Final = 1000
"""Nesting beyond which the recursive operations of the data model (hashing, comparing,
converting, stripping) raise ``RecursionError``, and the most the codecs' ``max_depth``
can allow.  The interpreter has its own limit (``sys.getrecursionlimit()``); compiled code
does not, so this one keeps a deep value from exhausting the C stack."""


def _is_compiled() -> bool:
    """True when this module runs compiled: its functions then carry no Python code."""
    return not hasattr(_is_compiled, "__code__")


COMPILED: Final = _is_compiled()
"""Whether this module is the compiled (mypyc) build of its source."""


class _Depth:
    """The nesting depth of the native recursion under way (compiled build only)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


_DEPTH: Final = _Depth()


def _too_deep_recursion() -> RecursionError:
    return RecursionError(
        f"value nested more than {RECURSION_LIMIT} levels deep for this operation"
    )


def _enter() -> None:
    """Count one level of native recursion (pair with :func:`_leave` in ``finally``)."""
    d = _DEPTH
    n = d.n + 1
    if n > RECURSION_LIMIT:
        raise _too_deep_recursion()
    d.n = n


def _leave() -> None:
    _DEPTH.n -= 1


_pack_d: Final = struct.Struct(">d").pack
_unpack_q: Final = struct.Struct(">q").unpack
_unpack_Q: Final = struct.Struct(">Q").unpack
_pack_Q: Final = struct.Struct(">Q").pack
_unpack_d: Final = struct.Struct(">d").unpack


def double_bits(x: float) -> int:
    """The 64 IEEE-754 bits of ``x`` as an unsigned integer."""
    b: int = _unpack_Q(_pack_d(x))[0]
    return b


def double_from_bits(bits: int) -> float:
    """The double whose IEEE-754 bits are ``bits`` (NaN payloads are kept)."""
    x: float = _unpack_d(_pack_Q(bits))[0]
    return x


class _AtomKey:
    """Strict key for a boolean or a double (whose Python equality is too loose)."""

    __slots__ = ("_hash", "payload", "tag")

    def __init__(self, tag: int, payload: int) -> None:
        self.tag = tag
        self.payload = payload
        self._hash = hash((tag, payload, "_AtomKey"))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _AtomKey):
            return self.tag == other.tag and self.payload == other.payload
        return False

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

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
        if isinstance(other, _BigIntKey):
            return self.n == other.n
        return False

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return self._hash


_BIG_INT: Final = (1 << 61) - 1

_FALSE_KEY: Final = _AtomKey(0, 0)
_TRUE_KEY: Final = _AtomKey(0, 1)


# The text form of str(value).  This module does not import the text codec (which is
# built on it): ``values.text`` installs its writer here when it is imported, which the
# package's ``__init__`` does before anyone can hold a value.
_text_form: Callable[[Any], str] = repr


def _set_text_form(writer: Callable[[Any], str]) -> None:
    """Make ``str(value)`` use ``writer`` (called once, by :mod:`.text`)."""
    global _text_form
    _text_form = writer


# Building a value without normalising its parts (the codecs' and other modules' fast
# path).  Interpreted, object.__new__ skips __init__; a compiled (native) class has no
# such back door, but its __init__ is cheap when the parts are already values.
_new: Final = object.__new__


class _ValueMethods:
    """Methods every value class shares: the Preserves total order and text form.

    (:class:`Sequence`, a ``tuple``, has its own copies: a native class cannot be a base
    of a ``tuple`` subclass.)
    """

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

    __slots__ = ("_hash", "name")

    def __init__(self, name: object) -> None:
        if type(name) is str:
            self.name: str = name
        elif isinstance(name, str):
            self.name = str(name)
        else:
            raise TypeError(f"Symbol name must be a str, not {type(name).__name__}")
        # Kept: compiled, a hash beyond 62 bits is a boxed int, built anew on every call.
        self._hash: int = hash(self.name) ^ 0x5F3759DF

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is Symbol:
            return self.name == other.name
        return False

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return self._hash

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

    def __init__(self, label: Any, fields: Iterable[Any] = ()) -> None:
        self.label: Any = label if type(label) in _PLAIN_OR_ATOM else preserve(label)
        t = tuple(fields)
        if COMPILED:
            for x in t:
                if type(x) not in _PLAIN_OR_ATOM:
                    t = tuple([preserve(y) for y in t])
                    break
        elif not _PLAIN_OR_ATOM.issuperset(map(type, t)):
            t = tuple(map(preserve, t))
        self.fields: tuple[Any, ...] = t
        self._hash: int = -1

    @classmethod
    def _make(cls, label: Any, fields: tuple[Any, ...]) -> Record:
        """Build without normalising (the arguments must already be values)."""
        if COMPILED:
            return Record(label, fields)
        r: Record = _new(cls)
        r.label = label
        r.fields = fields
        r._hash = -1
        return r

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is Record:
            return _record_eq(self, other)
        return type(other) is Annotated and other == self

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        h = self._hash
        if h == -1:
            # Fields and label hashed by the rule of _hk (annotations unwrapped, NaNs by
            # their bits), which agrees with strict equality; usually no tuple is built.
            if COMPILED:
                _enter()
                try:
                    h = _record_hash(self)
                finally:
                    _leave()
            else:
                h = _record_hash(self)
            self._hash = h
        return h

    def __len__(self) -> int:
        return len(self.fields)

    def __getitem__(self, i: Any) -> Any:
        return self.fields[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.fields)

    def __repr__(self) -> str:
        return f"Record({self.label!r}, {self.fields!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Record, (self.label, self.fields))


def _record_eq(a: Record, b: Record) -> bool:
    sf = a.fields
    of = b.fields
    if len(sf) != len(of):
        return False
    sl = a.label
    ol = b.label
    if sl is not ol and key(sl) != key(ol):
        return False
    if COMPILED:
        for x in sf:
            if type(x) not in _PLAIN:
                return tuple([key(x) for x in sf]) == tuple([key(y) for y in of])
        for y in of:
            if type(y) not in _PLAIN:
                return tuple([key(x) for x in sf]) == tuple([key(y) for y in of])
        return sf == of
    if _PLAIN.issuperset(map(type, sf)) and _PLAIN.issuperset(map(type, of)):
        return sf == of
    return tuple(map(key, sf)) == tuple(map(key, of))


def _record_hash(r: Record) -> int:
    f = r.fields
    if COMPILED:
        for x in f:
            t = type(x)
            if t is int or t is float or t is Annotated:
                f = tuple([_hk(y) for y in f])
                break
    elif not _HK_TYPES.isdisjoint(map(type, f)):
        f = tuple(map(_hk, f))
    lab = r.label
    if type(lab) in _HK_TYPES:
        lab = _hk(lab)
    # One tuple hashed (with a tag, so that a record does not hash like the sequence
    # [label [fields...]]): compiled, arithmetic on full-width hashes would box them.
    h: int = hash(("<record>", lab, f))
    return -2 if h == -1 else h


@mypyc_attr(native_class=False)
class Sequence(tuple):  # type: ignore[type-arg]
    """A Preserves sequence ``[item ...]``: an immutable tuple with strict equality."""

    __slots__ = ()

    def __new__(cls, items: Iterable[Any] = ()) -> Sequence:
        t = tuple(items)
        if not _PLAIN_OR_ATOM.issuperset(map(type, t)):
            t = tuple(map(preserve, t))
        return tuple.__new__(cls, t)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        t = type(other)
        o: Any = other
        if t is not Sequence:
            if t is tuple or t is list:
                try:
                    o = Sequence(o)
                except TypeError:
                    return False
            elif t is Annotated:
                return o == self
            else:
                return False
        if tuple.__len__(self) != tuple.__len__(o):
            return False
        if _PLAIN.issuperset(map(type, self)) and _PLAIN.issuperset(map(type, o)):
            r: bool = tuple.__eq__(self, o)
            return r
        return tuple(map(key, self)) == tuple(map(key, o))

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        # Equal to the hash of the plain tuple (a Sequence compares equal to one) and
        # consistent with strict equality (see _hk).  (Hashing a deep one recurses
        # through the interpreter's calls, which count against its recursion limit.)
        if _HK_TYPES.isdisjoint(map(type, self)):
            return tuple.__hash__(self)
        return hash(tuple(map(_hk, self)))

    def __add__(self, other: Iterable[Any]) -> Sequence:  # type: ignore[override]
        return Sequence(tuple(self) + tuple(other))

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        r = tuple.__getitem__(self, i)
        if type(i) is slice:
            return tuple.__new__(Sequence, r)
        return r

    def __lt__(self, other: object) -> bool:  # type: ignore[override]
        return compare(self, other) < 0

    def __le__(self, other: object) -> bool:  # type: ignore[override]
        return compare(self, other) <= 0

    def __gt__(self, other: object) -> bool:  # type: ignore[override]
        return compare(self, other) > 0

    def __ge__(self, other: object) -> bool:  # type: ignore[override]
        return compare(self, other) >= 0

    def __str__(self) -> str:
        return _text_form(self)

    def __repr__(self) -> str:
        return f"Sequence({tuple.__repr__(self)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Sequence, (tuple(self),))


class Set(_ValueMethods):
    """A Preserves set ``#{item ...}``: immutable, hashable, with strict membership.

    ``1``, ``1.0`` and ``True`` are three distinct members here.  A
    ``collections.abc.Set`` (registered, with its operators ``& | - ^`` and
    ``isdisjoint``); ``<`` and friends are the Preserves order, not inclusion.
    """

    __slots__ = ("_hash", "_items")

    def __init__(self, items: Iterable[Any] = ()) -> None:
        d: dict[Any, Any] = {}
        for x in items:
            x = preserve(x)
            d[key(x)] = x
        self._items: dict[Any, Any] = d
        self._hash: int = -1

    @classmethod
    def _from_dict(cls, d: dict[Any, Any]) -> Set:
        """Build from ``{key(x): x}`` without checking it."""
        if COMPILED:
            s = Set()
        else:
            s = _new(cls)
            s._hash = -1
        s._items = d
        return s

    def __contains__(self, x: object) -> bool:
        try:
            return key(preserve(x)) in self._items
        except TypeError:
            return False

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        t = type(other)
        o: Any = other
        if t is not Set:
            if t is set or t is frozenset:
                try:
                    o = Set(o)
                except TypeError:
                    return False
            elif t is Annotated:
                return o == self
            else:
                return False
        r: bool = self._items.keys() == o._items.keys()
        return r

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        # As for Sequence: equal to the hash of a frozenset of the same members.
        h = self._hash
        if h == -1:
            if COMPILED:
                _enter()
                try:
                    h = _set_hash(self)
                finally:
                    _leave()
            else:
                h = _set_hash(self)
            self._hash = h
        return h

    # The operators of collections.abc.Set (a native class cannot inherit its mixins).
    def _others(self, other: Any) -> Set | None:
        if type(other) is Set:
            o: Set = other
            return o
        if isinstance(other, AbstractSet):
            try:
                return Set(other)
            except TypeError:
                return None
        return None

    def __and__(self, other: Any) -> Any:
        o = self._others(other)
        if o is None:
            return NotImplemented
        return Set._from_dict({k: x for k, x in self._items.items() if k in o._items})

    def __rand__(self, other: Any) -> Any:
        return self.__and__(other)

    def __or__(self, other: Any) -> Any:
        o = self._others(other)
        if o is None:
            return NotImplemented
        d = dict(self._items)
        for k, x in o._items.items():
            d.setdefault(k, x)
        return Set._from_dict(d)

    def __ror__(self, other: Any) -> Any:
        o = self._others(other)
        if o is None:
            return NotImplemented
        return o.__or__(self)

    def __sub__(self, other: Any) -> Any:
        o = self._others(other)
        if o is None:
            return NotImplemented
        return Set._from_dict({k: x for k, x in self._items.items() if k not in o._items})

    def __rsub__(self, other: Any) -> Any:
        o = self._others(other)
        if o is None:
            return NotImplemented
        return o.__sub__(self)

    def __xor__(self, other: Any) -> Any:
        o = self._others(other)
        if o is None:
            return NotImplemented
        d = {k: x for k, x in self._items.items() if k not in o._items}
        for k, x in o._items.items():
            if k not in self._items:
                d[k] = x
        return Set._from_dict(d)

    def __rxor__(self, other: Any) -> Any:
        o = self._others(other)
        if o is None:
            return NotImplemented
        return o.__xor__(self)

    def isdisjoint(self, other: Iterable[Any]) -> bool:
        """True when no member of ``other`` is in this set."""
        return not any(x in self for x in other)

    def __repr__(self) -> str:
        return f"Set({list(self._items.values())!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Set, (list(self._items.values()),))


def _set_hash(s: Set) -> int:
    values = s._items.values()
    if _HK_TYPES.isdisjoint(map(type, values)):
        return hash(frozenset(values))
    return hash(frozenset(map(_hk, values)))


class Dictionary(_ValueMethods):
    """A Preserves dictionary ``{key: value ...}``: immutable, hashable, strict keys.

    A ``collections.abc.Mapping`` (registered): ``d[k]``, ``get``, ``in``, ``keys()``,
    ``values()`` and ``items()`` (lists, in insertion order).
    """

    __slots__ = ("_hash", "_items")

    def __init__(self, items: Any = ()) -> None:
        pairs = items.items() if isinstance(items, Mapping) else items
        d: dict[Any, tuple[Any, Any]] = {}
        for k, v in pairs:
            k = preserve(k)
            d[key(k)] = (k, preserve(v))
        self._items: dict[Any, tuple[Any, Any]] = d
        self._hash: int = -1

    @classmethod
    def _from_dict(cls, d: dict[Any, tuple[Any, Any]]) -> Dictionary:
        """Build from ``{key(k): (k, v)}`` without checking it."""
        if COMPILED:
            r = Dictionary()
        else:
            r = _new(cls)
            r._hash = -1
        r._items = d
        return r

    def __getitem__(self, k: Any) -> Any:
        try:
            kk = key(preserve(k))
        except TypeError:
            raise KeyError(k) from None
        return self._items[kk][1]

    def get(self, k: Any, default: Any = None) -> Any:
        """The value at ``k``, or ``default``."""
        try:
            e = self._items.get(key(preserve(k)))
        except TypeError:
            return default
        return default if e is None else e[1]

    def __contains__(self, k: object) -> bool:
        try:
            return key(preserve(k)) in self._items
        except TypeError:
            return False

    def __iter__(self) -> Iterator[Any]:
        return iter([k for k, _v in self._items.values()])

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> list[tuple[Any, Any]]:
        return list(self._items.values())

    def values(self) -> list[Any]:
        return [v for _k, v in self._items.values()]

    def keys(self) -> list[Any]:
        return [k for k, _v in self._items.values()]

    def _strict(self) -> frozenset[Any]:
        return frozenset([(kk, key(v)) for kk, (_k, v) in self._items.items()])

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        t = type(other)
        o: Any = other
        if t is not Dictionary:
            if t is dict:
                try:
                    o = Dictionary(o)
                except TypeError:
                    return False
            elif t is Annotated:
                return o == self
            else:
                return False
        if len(self._items) != len(o._items):
            return False
        oi: dict[Any, tuple[Any, Any]] = o._items
        for kk, (_k, v) in self._items.items():
            p = oi.get(kk)
            if p is None or key(p[1]) != key(v):
                return False
        return True

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        h = self._hash
        if h == -1:
            if COMPILED:
                _enter()
                try:
                    h = hash(self._strict()) ^ 0x3C6EF372
                finally:
                    _leave()
            else:
                h = hash(self._strict()) ^ 0x3C6EF372
            if h == -1:
                h = -2
            self._hash = h
        return h

    def __repr__(self) -> str:
        return f"Dictionary({dict(self._items.values())!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Dictionary, (list(self._items.values()),))


AbstractSet.register(Set)
Mapping.register(Dictionary)


class Embedded(_ValueMethods):
    """An embedded value ``#:...``: a reference to something outside the data model.

    Two embedded values are equal when the objects they wrap are equal (for references,
    usually identity).  The wrapped object must be hashable.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value: Any = value

    def __eq__(self, other: object) -> bool:
        if type(other) is not Embedded:
            return type(other) is Annotated and other == self
        o: Any = other
        v = self.value
        ov = o.value
        return v is ov or bool(v == ov)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        if COMPILED:
            _enter()
            try:
                return hash(self.value) ^ 0x7A3D1B2C
            finally:
                _leave()
        return hash(self.value) ^ 0x7A3D1B2C

    def __repr__(self) -> str:
        return f"Embedded({self.value!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Embedded, (self.value,))


class Annotated(_ValueMethods):
    """A value with annotations attached, as read with ``annotations=True``.

    Annotations are not part of a value's identity: ``Annotated(1, ["x"]) == 1``.
    Use :func:`strip` to remove them and :func:`annotations_equal` to compare them too.
    """

    __slots__ = ("annotations", "item")

    def __init__(self, item: Any, annotations: Iterable[Any] = ()) -> None:
        anns = tuple([preserve(a) for a in annotations])
        if type(item) is Annotated:
            # @a @b x is one value with annotations [a, b]: keep one flat wrapper.
            inner: Annotated = item
            anns += inner.annotations
            item = inner.item
        self.item: Any = preserve(item)
        self.annotations: tuple[Any, ...] = anns

    def __eq__(self, other: object) -> bool:
        try:
            return bool(key(self) == key(preserve(other)))
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

    def __reduce__(self) -> tuple[Any, ...]:
        return (Annotated, (self.item, list(self.annotations)))


# Types whose Python equality is already Preserves-strict.  ``int`` is here because the
# only values Python would confuse it with (``bool`` and ``float``) are never left bare
# inside a strict key.  Its hash is not flood-safe for big ints: containers hash their
# items through ``_hk`` (which salts them) and ``key()`` wraps a bare one.
_PLAIN: Final = frozenset({str, int, bytes, Symbol, Record, Sequence, Set, Dictionary, Embedded})
# Types whose strict key is always the value itself (``key()`` wraps big integers).
_PLAIN_NOINT: Final = _PLAIN - {int}
# Types that are already normalised values (no conversion needed by ``preserve``).
_PLAIN_OR_ATOM: Final = _PLAIN | {bool, float}


_HK_TYPES: Final = frozenset({float, Annotated, int})


def _hk(x: Any) -> Any:
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


def key(v: Any) -> Any:
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
        return _AtomKey(1, double_bits(v))
    if t is Annotated:
        return key(v.item)
    return key(preserve(v))


def is_value(v: object) -> bool:
    """True when ``v`` is already a normalised Preserves value at its top level."""
    return type(v) in _PLAIN_OR_ATOM or type(v) is Annotated


def preserve(v: Any) -> Any:
    """Convert natural Python data to a Preserves value.

    Accepts the value classes of this module, ``bool``, ``int``, ``float``, ``str``,
    ``bytes``/``bytearray``/``memoryview``, ``tuple``/``list`` (sequences), ``dict``
    (dictionaries), ``set``/``frozenset`` (sets) and any object with a
    ``__preserve__()`` method.  Raises ``TypeError`` for anything else.
    """
    t = type(v)
    if t in _PLAIN_OR_ATOM or t is Annotated:
        return v
    if COMPILED:
        _enter()
        try:
            return _convert(v, t)
        finally:
            _leave()
    return _convert(v, t)


def _convert(v: Any, t: type) -> Any:
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


def strip(v: Any) -> Any:
    """Remove every annotation, at every depth."""
    return _strip(v, 0)


def _strip(v: Any, depth: int) -> Any:
    if depth > RECURSION_LIMIT:
        raise _too_deep_recursion()
    d = depth + 1
    t = type(v)
    if t is Annotated:
        return _strip(v.item, d)
    if t is Record:
        return Record._make(_strip(v.label, d), tuple([_strip(x, d) for x in v.fields]))
    if t is Sequence:
        return tuple.__new__(Sequence, [_strip(x, d) for x in v])
    if t is Set:
        return Set([_strip(x, d) for x in v])
    if t is Dictionary:
        return Dictionary([(_strip(k, d), _strip(x, d)) for k, x in v._items.values()])
    return v


def annotations_equal(a: Any, b: Any) -> bool:
    """Structural equality that also compares annotations (used by conformance tests)."""
    return _annotations_equal(a, b, 0)


def _annotations_equal(a: Any, b: Any, depth: int) -> bool:
    if depth > RECURSION_LIMIT:
        raise _too_deep_recursion()
    d = depth + 1
    ta, tb = type(a), type(b)
    if ta is Annotated or tb is Annotated:
        if ta is not Annotated or tb is not Annotated:
            return False
        return (
            len(a.annotations) == len(b.annotations)
            and all(
                _annotations_equal(x, y, d) for x, y in zip(a.annotations, b.annotations)
            )
            and _annotations_equal(a.item, b.item, d)
        )
    if ta is not tb:
        return False
    if ta is Record:
        return (
            len(a.fields) == len(b.fields)
            and _annotations_equal(a.label, b.label, d)
            and all(_annotations_equal(x, y, d) for x, y in zip(a.fields, b.fields))
        )
    if ta is Sequence:
        return len(a) == len(b) and all(_annotations_equal(x, y, d) for x, y in zip(a, b))
    if ta is Set:
        if strip(a) != strip(b):
            return False
        bi = {key(x): x for x in b}
        return all(_annotations_equal(x, bi[key(x)], d) for x in a)
    if ta is Dictionary:
        if len(a) != len(b):
            return False
        bi2: dict[Any, tuple[Any, Any]] = b._items
        for kk, (k, v) in a._items.items():
            p = bi2.get(kk)
            if (
                p is None
                or not _annotations_equal(k, p[0], d)
                or not _annotations_equal(v, p[1], d)
            ):
                return False
        return True
    return bool(key(a) == key(b))


# ---------------------------------------------------------------------------------------
# Total order

_RANK: Final = {
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
    b: int = _unpack_q(_pack_d(x))[0]
    return b ^ 0x7FFFFFFFFFFFFFFF if b < 0 else b


def _cmp_seq(a: Iterable[Any], b: Iterable[Any], depth: int) -> int:
    ia, ib = iter(a), iter(b)
    for x in ia:
        for y in ib:
            c = _compare(x, y, depth)
            if c:
                return c
            break
        else:
            return 1
    for _y in ib:
        return -1
    return 0


def compare(a: Any, b: Any) -> int:
    """Compare two values in the Preserves total order: -1, 0 or 1.

    Kinds are ordered Boolean < Double < SignedInteger < String < ByteString < Symbol <
    Record < Sequence < Set < Dictionary < Embedded; doubles by IEEE-754 totalOrder;
    records by label then fields; sequences lexicographically; sets and dictionaries as
    their sorted elements or sorted (key, value) pairs.  Annotations are ignored.
    """
    return _compare(a, b, 0)


def _first_key(kv: tuple[Any, Any]) -> _SortKey:
    return _SortKey(kv[0])


def _compare(a: Any, b: Any, depth: int) -> int:
    if depth > RECURSION_LIMIT:
        raise _too_deep_recursion()
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
    d = depth + 1
    x: Any
    y: Any
    if ta is float:
        x, y = _double_order(a), _double_order(b)
    elif ta is Symbol:
        x, y = a.name, b.name
    elif ta is Record:
        c = _compare(a.label, b.label, d)
        return c if c else _cmp_seq(a.fields, b.fields, d)
    elif ta is Sequence:
        return _cmp_seq(a, b, d)
    elif ta is Set:
        return _cmp_seq(sorted(a, key=sort_key), sorted(b, key=sort_key), d)
    elif ta is Dictionary:
        ia = sorted(a._items.values(), key=_first_key)
        ib = sorted(b._items.values(), key=_first_key)
        for (ka, va), (kb, vb) in zip(ia, ib):
            c = _compare(ka, kb, d) or _compare(va, vb, d)
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
    return int(x > y) - int(x < y)


class _SortKey:
    __slots__ = ("v",)

    def __init__(self, v: Any) -> None:
        self.v = v

    def __lt__(self, other: _SortKey) -> bool:
        return compare(self.v, other.v) < 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SortKey) and compare(self.v, other.v) == 0

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = None  # type: ignore[assignment]


def sort_key(v: Any) -> _SortKey:
    """A key for ``sorted()`` that orders values by the Preserves total order."""
    return _SortKey(v)
