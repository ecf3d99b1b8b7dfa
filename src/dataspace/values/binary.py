"""The canonical binary Preserves codec.

>>> from dataspace.values import Record, Symbol
>>> b = encode(Record(Symbol("Says"), ["alice", 1]))
>>> b.hex()
'b4b30453617973b105616c696365b0010184'
>>> decode(b)
Record(Symbol('Says'), ('alice', 1))

Wire format (one tag byte, then a body)::

    80 #f          81 #t          84 end marker        85 annotation, then annotated value
    86 embedded    87 double (varint length 8, then 8 big-endian IEEE-754 bytes)
    B0 integer     B1 string      B2 byte string       B3 symbol
                   (varint length, then big-endian two's complement / UTF-8 / raw bytes)
    B4 record      B5 sequence    B6 set               B7 dictionary
                   (values, then 84; a record's first value is its label)

Varints are unsigned LEB128.  :func:`encode` writes canonical form by default: minimal
integers, no annotations, set elements and dictionary entries sorted by the canonical
encoding of the element or key.

:func:`decode` and :func:`decode_prefix` read a complete buffer; :class:`Decoder` reads a
stream of concatenated values arriving in arbitrary chunks (sans-IO).  Malformed input
only ever raises :class:`~dataspace.values.errors.DecodeError` (or a subclass), naming the
byte position.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Any, Final

from .errors import DecodeEOF, DecodeError, DecodeLimitExceeded, DecodeShort, DecodeTooLarge
from .model import (
    _PLAIN_NOINT,
    MAX_DEPTH,
    RECURSION_LIMIT,
    Annotated,
    Dictionary,
    Embedded,
    Record,
    Sequence,
    Set,
    Symbol,
    Value,
    is_value,
    key,
    preserve,
)

__all__ = ["Decoder", "decode", "decode_prefix", "encode", "make_reader", "make_writer"]

DEFAULT_MAX_DEPTH: Final = MAX_DEPTH
"""Default nesting limit (containers, embedded values and annotations) for both ways."""

DEFAULT_MAX_VALUE_SIZE: Final = 16 * 1024 * 1024
"""Default limit on the encoded size of one value read by a :class:`Decoder`."""

_pack_d: Final = struct.Struct(">d").pack
_unpack_d_from: Final = struct.Struct(">d").unpack_from

# Header bytes (tag + single-byte varint length) for lengths below 128.
_HDR_INT: Final = [bytes((0xB0, n)) for n in range(128)]
_HDR_STR: Final = [bytes((0xB1, n)) for n in range(128)]
_HDR_BYTES: Final = [bytes((0xB2, n)) for n in range(128)]
_HDR_SYM: Final = [bytes((0xB3, n)) for n in range(128)]

# Complete encodings of the small integers.
_SMALL_INT_MIN: Final = -256
_SMALL_INT_MAX: Final = 1024
_SMALL_INTS: Final = [
    bytes((0xB0, 0))
    if i == 0
    else _HDR_INT[((i if i >= 0 else ~i).bit_length() + 8) >> 3]
    + i.to_bytes(((i if i >= 0 else ~i).bit_length() + 8) >> 3, "big", signed=True)
    for i in range(_SMALL_INT_MIN, _SMALL_INT_MAX)
]

# Decoded symbols, keyed by their UTF-8 bytes (symbols are immutable, so sharing is safe).
# Bounded: untrusted peers can fill it, which only costs the cache its usefulness.
_SYMBOL_CACHE: Final[dict[bytes, Symbol]] = {}
_SYMBOL_CACHE_MAX: Final = 4096
_SYMBOL_CACHE_MAX_LEN: Final = 64


def _varint(n: int) -> bytes:
    """The unsigned LEB128 encoding of ``n``."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _header(tag: int, n: int) -> bytes:
    """Tag byte plus varint length ``n`` (any size)."""
    if n < 0x80:
        return bytes((tag, n))
    return bytes((tag,)) + _varint(n)


def _int_bytes(v: int) -> bytes:
    """The complete encoding of the integer ``v`` (minimal two's complement)."""
    if _SMALL_INT_MIN <= v < _SMALL_INT_MAX:
        return _SMALL_INTS[v - _SMALL_INT_MIN]
    n = ((v if v >= 0 else ~v).bit_length() + 8) >> 3
    if n < 0x80:
        return _HDR_INT[n] + v.to_bytes(n, "big", signed=True)
    return _header(0xB0, n) + v.to_bytes(n, "big", signed=True)


def _too_deep(max_depth: int) -> ValueError:
    return ValueError(f"value nested more than {max_depth} levels deep; cannot encode it")


def _no_embedded_hook(obj: Any) -> TypeError:
    return TypeError(
        f"cannot encode Embedded({type(obj).__name__} object): its value is not a Preserves "
        "value; pass encode(..., embedded=fn) to convert embedded objects to values"
    )


def _depth_limit(max_depth: int) -> int:
    """``max_depth`` as the codecs apply it: at most :data:`RECURSION_LIMIT`, so that a
    deep value is refused before it exhausts the stack (the C stack, compiled)."""
    return max_depth if max_depth < RECURSION_LIMIT else RECURSION_LIMIT


# ---------------------------------------------------------------------------------------
# Encoding

_WriteFn = Callable[[Any, list[bytes], int], None]


def _first(e: tuple[bytes, Any]) -> bytes:
    return e[0]


def _first3(e: tuple[bytes, list[bytes], Any]) -> bytes:
    return e[0]


class _Writer:
    """The encoder for one set of options: :meth:`write` appends the encoding of a value
    to a list of ``bytes`` chunks (joined once at the end).

    The most common leaf types are handled inline in the container loops to save a call
    per item.  With canonical ordering *and* annotations, elements are sorted by their
    canonical annotation-free encodings (``sorter``), but written with their annotations.
    """

    __slots__ = ("annotations", "canonical", "embedded", "max_depth", "sorter")

    def __init__(
        self,
        canonical: bool,
        annotations: bool,
        embedded: Callable[[Any], Any] | None,
        max_depth: int,
    ) -> None:
        self.canonical = canonical
        self.annotations = annotations
        self.embedded = embedded
        self.max_depth = _depth_limit(max_depth)
        self.sorter: _Writer | None = (
            _Writer(True, False, embedded, max_depth) if canonical and annotations else None
        )

    def write(self, v: Any, out: list[bytes], depth: int) -> None:
        t = type(v)
        if t is Record or t is Sequence:
            if depth >= self.max_depth:
                raise _too_deep(self.max_depth)
            depth += 1
            items: tuple[Any, ...]
            if t is Record:
                out.append(b"\xb4")
                x = v.label
                if type(x) is Symbol:
                    lab: Symbol = x
                    b = lab.name.encode()
                    n = len(b)
                    out.append(_HDR_SYM[n] if n < 0x80 else _header(0xB3, n))
                    out.append(b)
                else:
                    self.write(x, out, depth)
                items = v.fields
            else:
                out.append(b"\xb5")
                items = v
            for x in items:
                tx = type(x)
                if tx is str:
                    xs: str = x  # (typed: compiled, a direct call)
                    b = xs.encode()
                    n = len(b)
                    out.append(_HDR_STR[n] if n < 0x80 else _header(0xB1, n))
                    out.append(b)
                elif tx is int:
                    xi: int = x
                    out.append(
                        _SMALL_INTS[xi - _SMALL_INT_MIN]
                        if _SMALL_INT_MIN <= xi < _SMALL_INT_MAX
                        else _int_bytes(xi)
                    )
                elif tx is Symbol:
                    xy: Symbol = x
                    b = xy.name.encode()
                    n = len(b)
                    out.append(_HDR_SYM[n] if n < 0x80 else _header(0xB3, n))
                    out.append(b)
                else:
                    self.write(x, out, depth)
            out.append(b"\x84")
        elif t is str:
            vs: str = v
            b = vs.encode()
            n = len(b)
            out.append(_HDR_STR[n] if n < 0x80 else _header(0xB1, n))
            out.append(b)
        elif t is int:
            vi: int = v
            out.append(
                _SMALL_INTS[vi - _SMALL_INT_MIN]
                if _SMALL_INT_MIN <= vi < _SMALL_INT_MAX
                else _int_bytes(vi)
            )
        elif t is Symbol:
            vy: Symbol = v
            b = vy.name.encode()
            n = len(b)
            out.append(_HDR_SYM[n] if n < 0x80 else _header(0xB3, n))
            out.append(b)
        elif t is Dictionary:
            self._write_dict(v, out, depth)
        elif t is bool:
            out.append(b"\x81" if v else b"\x80")
        elif t is float:
            out.append(b"\x87\x08")
            out.append(_pack_d(v))
        elif t is bytes:
            n = len(v)
            out.append(_HDR_BYTES[n] if n < 0x80 else _header(0xB2, n))
            out.append(v)
        elif t is Set:
            self._write_set(v, out, depth)
        elif t is Embedded:
            if depth >= self.max_depth:
                raise _too_deep(self.max_depth)
            obj = v.value
            hook = self.embedded
            if hook is not None:
                obj = hook(obj)
            elif not is_value(obj):
                raise _no_embedded_hook(obj)
            out.append(b"\x86")
            self.write(obj, out, depth + 1)
        elif t is Annotated:
            if depth >= self.max_depth:
                raise _too_deep(self.max_depth)
            depth += 1
            if self.annotations:
                for a in v.annotations:
                    out.append(b"\x85")
                    self.write(a, out, depth)
            self.write(v.item, out, depth)
        else:
            # Natural Python data (lists, dicts, subclasses, __preserve__ ...).
            p = preserve(v)
            if type(p) is t:  # pragma: no cover - preserve() always returns a value type
                raise TypeError(f"cannot encode {t.__name__}")
            self.write(p, out, depth)

    def _write_dict(self, v: Dictionary, out: list[bytes], depth: int) -> None:
        if depth >= self.max_depth:
            raise _too_deep(self.max_depth)
        depth += 1
        out.append(b"\xb7")
        sorter = self.sorter
        if not self.canonical:
            for k, x in v._items.values():
                self.write(k, out, depth)
                self.write(x, out, depth)
        elif sorter is None:
            entries: list[tuple[bytes, Any]] = []
            for k, x in v._items.values():
                tk = type(k)
                if tk is str:
                    ks: str = k
                    b = ks.encode()
                    n = len(b)
                    kb = (_HDR_STR[n] if n < 0x80 else _header(0xB1, n)) + b
                elif tk is Symbol:
                    ky: Symbol = k
                    b = ky.name.encode()
                    n = len(b)
                    kb = (_HDR_SYM[n] if n < 0x80 else _header(0xB3, n)) + b
                else:
                    sub: list[bytes] = []
                    self.write(k, sub, depth)
                    kb = b"".join(sub)
                entries.append((kb, x))
            entries.sort(key=_first)
            for kb, x in entries:
                out.append(kb)
                tx = type(x)
                if tx is str:
                    xs: str = x  # (typed: compiled, a direct call)
                    b = xs.encode()
                    n = len(b)
                    out.append(_HDR_STR[n] if n < 0x80 else _header(0xB1, n))
                    out.append(b)
                elif tx is int:
                    xi: int = x
                    out.append(
                        _SMALL_INTS[xi - _SMALL_INT_MIN]
                        if _SMALL_INT_MIN <= xi < _SMALL_INT_MAX
                        else _int_bytes(xi)
                    )
                elif tx is Symbol:
                    xy: Symbol = x
                    b = xy.name.encode()
                    n = len(b)
                    out.append(_HDR_SYM[n] if n < 0x80 else _header(0xB3, n))
                    out.append(b)
                else:
                    self.write(x, out, depth)
        else:
            annotated: list[tuple[bytes, list[bytes], Any]] = []
            for k, x in v._items.values():
                sk: list[bytes] = []
                sorter.write(k, sk, depth)
                sub = []
                self.write(k, sub, depth)
                annotated.append((b"".join(sk), sub, x))
            annotated.sort(key=_first3)
            for _sk, sub, x in annotated:
                out += sub
                self.write(x, out, depth)
        out.append(b"\x84")

    def _write_set(self, v: Set, out: list[bytes], depth: int) -> None:
        if depth >= self.max_depth:
            raise _too_deep(self.max_depth)
        depth += 1
        out.append(b"\xb6")
        sorter = self.sorter
        if not self.canonical:
            for x in v._items.values():
                self.write(x, out, depth)
        elif sorter is None:
            encs: list[bytes] = []
            for x in v._items.values():
                sub: list[bytes] = []
                self.write(x, sub, depth)
                encs.append(b"".join(sub))
            encs.sort()
            out += encs
        else:
            pairs: list[tuple[bytes, list[bytes]]] = []
            for x in v._items.values():
                sk: list[bytes] = []
                sorter.write(x, sk, depth)
                sub = []
                self.write(x, sub, depth)
                pairs.append((b"".join(sk), sub))
            pairs.sort(key=_first)
            for _sk, sub in pairs:
                out += sub
        out.append(b"\x84")


def make_writer(
    canonical: bool,
    annotations: bool,
    embedded: Callable[[Any], Value] | None,
    max_depth: int,
) -> _WriteFn:
    """Build ``write(v, out, depth)`` appending the encoding of ``v`` to the list ``out``.

    Low-level API for protocol code that encodes many values with the same options (the
    relay): ``out`` is a list of ``bytes`` to ``b"".join``, ``depth`` starts at 0.
    """
    return _Writer(canonical, annotations, embedded, max_depth).write


_WRITERS: Final[dict[tuple[bool, bool, int], _Writer]] = {}
_DEFAULT_WRITER: Final = _Writer(True, False, None, DEFAULT_MAX_DEPTH)
_WRITERS[(True, False, DEFAULT_MAX_DEPTH)] = _DEFAULT_WRITER


def encode(
    v: Any,
    *,
    canonical: bool = True,
    annotations: bool = False,
    embedded: Callable[[Any], Value] | None = None,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> bytes:
    """Encode ``v`` as binary Preserves.

    ``v`` may be a value or natural Python data (converted with
    :func:`~dataspace.values.model.preserve`: lists, dicts, sets, ...).

    * ``canonical`` (default) sorts set elements and dictionary entries by the canonical
      encoding of the element or key; with ``canonical=False`` they are written in their
      insertion order.
    * ``annotations`` writes the annotations of :class:`Annotated` values (canonical form
      omits them).  ``canonical=True, annotations=True`` keeps canonical ordering.
    * ``embedded`` converts the object inside each :class:`Embedded` into the value to
      write.  Without it, the object must already be a value, else ``TypeError``.
    * ``max_depth`` bounds the nesting (containers, embedded values, annotations);
      deeper input raises ``ValueError``.  It is at most
      :data:`~dataspace.values.model.RECURSION_LIMIT`.

    Raises ``TypeError`` for data that is not a value and ``ValueError`` for too-deep data
    or strings that are not valid Unicode (lone surrogates).
    """
    w: _Writer | None
    if embedded is None and canonical and not annotations and max_depth == DEFAULT_MAX_DEPTH:
        w = _DEFAULT_WRITER
    elif embedded is None:
        k = (canonical, annotations, max_depth)
        w = _WRITERS.get(k)
        if w is None:
            if len(_WRITERS) > 64:
                _WRITERS.clear()
            w = _WRITERS[k] = _Writer(canonical, annotations, None, max_depth)
    else:
        w = _Writer(canonical, annotations, embedded, max_depth)
    out: list[bytes] = []
    try:
        w.write(v, out, 0)
    except RecursionError:
        raise _too_deep(w.max_depth) from None
    return b"".join(out)


# ---------------------------------------------------------------------------------------
# Decoding


def _read_varint(buf: bytes, p: int) -> tuple[int, int]:
    """Read the varint at ``p``: (value, position after it).  IndexError when short."""
    b = buf[p]
    if b < 0x80:
        return b, p + 1
    start = p
    result = b & 0x7F
    shift = 7
    for _ in range(9):
        p += 1
        b = buf[p]
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, p + 1
        shift += 7
    raise DecodeError("length varint longer than 10 bytes", start)


def _short(p: int) -> DecodeShort:
    return DecodeShort("input ends in the middle of a value", p)


def _bad_utf8(e: UnicodeDecodeError, start: int, what: str) -> DecodeError:
    return DecodeError(f"invalid UTF-8 in {what}: {e.reason}", start + e.start)


def _make_symbol(buf: bytes, s: int, q: int) -> Symbol:
    raw = buf[s:q]
    try:
        name = raw.decode()
    except UnicodeDecodeError as e:
        raise _bad_utf8(e, s, "symbol") from None
    sym = Symbol(name)
    if q - s <= _SYMBOL_CACHE_MAX_LEN and len(_SYMBOL_CACHE) < _SYMBOL_CACHE_MAX:
        _SYMBOL_CACHE[raw] = sym
    return sym


def _symbol(buf: bytes, s: int, q: int) -> Symbol:
    sym = _SYMBOL_CACHE.get(buf[s:q])
    return sym if sym is not None else _make_symbol(buf, s, q)


def _too_deep_input(max_depth: int, p: int) -> DecodeLimitExceeded:
    return DecodeLimitExceeded(f"values nested more than {max_depth} deep", p)


_ReadFn = Callable[[bytes, int, int], tuple[Any, int]]


class _Reader:
    """The decoder for one set of options: :meth:`read` reads the value at ``buf[p]``.

    ``buf`` must be ``bytes``.  Reading past the end of ``buf`` raises ``IndexError`` or
    :class:`DecodeShort`; callers turn the former into the latter.  The most common leaf
    types are decoded inline in the container loop, so there is one call per container
    (which also bounds the stack use by ``max_depth``).
    """

    __slots__ = ("annotations", "embedded", "max_depth")

    def __init__(
        self, annotations: bool, embedded: Callable[[Any], Any] | None, max_depth: int
    ) -> None:
        self.annotations = annotations
        self.embedded = embedded
        self.max_depth = _depth_limit(max_depth)

    def read(self, buf: bytes, p: int, depth: int) -> tuple[Any, int]:
        tag = buf[p]
        if 0xB4 <= tag <= 0xB7:
            return self._read_compound(buf, p, depth, tag)
        if tag == 0xB1 or tag == 0xB3 or tag == 0xB2 or tag == 0xB0:
            n = buf[p + 1]
            if n < 0x80:
                s = p + 2
            else:
                n, s = _read_varint(buf, p + 1)
            q = s + n
            if q > len(buf):
                raise _short(len(buf))
            if tag == 0xB1:
                try:
                    return buf[s:q].decode(), q
                except UnicodeDecodeError as e:
                    raise _bad_utf8(e, s, "string") from None
            if tag == 0xB3:
                return _symbol(buf, s, q), q
            if tag == 0xB2:
                return buf[s:q], q
            return int.from_bytes(buf[s:q], "big", signed=True), q
        if tag == 0x80:
            return False, p + 1
        if tag == 0x81:
            return True, p + 1
        if tag == 0x87:
            n, s = _read_varint(buf, p + 1)
            if n != 8:
                raise DecodeError(f"double must have 8 bytes, not {n}", p + 1)
            if s + 8 > len(buf):
                raise _short(len(buf))
            x: float = _unpack_d_from(buf, s)[0]
            return x, s + 8
        if tag == 0x85:
            if depth >= self.max_depth:
                raise _too_deep_input(self.max_depth, p)
            d1 = depth + 1
            anns: list[Any] = []
            while tag == 0x85:
                a, p = self.read(buf, p + 1, d1)
                anns.append(a)
                tag = buf[p]
            v, p = self.read(buf, p, d1)
            if not self.annotations:
                return v, p
            return Annotated(v, anns), p
        if tag == 0x86:
            if depth >= self.max_depth:
                raise _too_deep_input(self.max_depth, p)
            start = p
            v, p = self.read(buf, p + 1, depth + 1)
            hook = self.embedded
            if hook is not None:
                try:
                    v = hook(v)
                except DecodeError:
                    raise
                except Exception as e:
                    raise DecodeError(f"embedded hook rejected the value: {e!r}", start) from e
            return Embedded(v), p
        if tag == 0x84:
            raise DecodeError("unexpected end marker (0x84) where a value was expected", p)
        raise DecodeError(f"invalid tag 0x{tag:02x}", p)

    def _read_compound(self, buf: bytes, p: int, depth: int, tag: int) -> tuple[Any, int]:
        if depth >= self.max_depth:
            raise _too_deep_input(self.max_depth, p)
        start = p
        end = len(buf)
        d1 = depth + 1
        items: list[Any] = []
        p += 1
        while True:
            t = buf[p]
            if t == 0xB1:
                n = buf[p + 1]
                if n < 0x80:
                    s = p + 2
                    q = s + n
                    if q > end:
                        raise _short(end)
                    try:
                        items.append(buf[s:q].decode())
                    except UnicodeDecodeError as e:
                        raise _bad_utf8(e, s, "string") from None
                    p = q
                    continue
            elif t == 0xB0:
                n = buf[p + 1]
                if n == 1:
                    x = buf[p + 2]
                    items.append(x - 256 if x & 0x80 else x)
                    p += 3
                    continue
                if n == 2:
                    x = buf[p + 2] << 8 | buf[p + 3]
                    items.append(x - 0x10000 if x & 0x8000 else x)
                    p += 4
                    continue
                if n < 0x80:
                    s = p + 2
                    q = s + n
                    if q > end:
                        raise _short(end)
                    items.append(int.from_bytes(buf[s:q], "big", signed=True))
                    p = q
                    continue
            elif t == 0xB3:
                n = buf[p + 1]
                if n < 0x80:
                    s = p + 2
                    q = s + n
                    if q > end:
                        raise _short(end)
                    items.append(_symbol(buf, s, q))
                    p = q
                    continue
            elif t == 0x84:
                p += 1
                break
            elif t == 0x80:
                items.append(False)
                p += 1
                continue
            elif t == 0x81:
                items.append(True)
                p += 1
                continue
            v, p = self.read(buf, p, d1)
            items.append(v)
        if tag == 0xB4:
            if not items:
                raise DecodeError("record has no label", start)
            label = items[0]
            del items[0]
            return Record._make(label, tuple(items)), p
        if tag == 0xB5:
            return tuple.__new__(Sequence, items), p
        if tag == 0xB6:
            sd: dict[Any, Any]
            if _PLAIN_NOINT.issuperset(map(type, items)):
                sd = dict(zip(items, items))
            else:
                sd = {key(x): x for x in items}
            if len(sd) != len(items):
                raise DecodeError("set has a duplicate element", start)
            return Set._from_dict(sd), p
        # 0xB7
        if len(items) & 1:
            raise DecodeError("dictionary key has no value", p - 1)
        dd: dict[Any, tuple[Any, Any]] = {}
        for i in range(0, len(items), 2):
            k = items[i]
            dd[k if type(k) in _PLAIN_NOINT else key(k)] = (k, items[i + 1])
        if len(dd) << 1 != len(items):
            raise DecodeError("dictionary has a duplicate key", start)
        return Dictionary._from_dict(dd), p


def make_reader(
    annotations: bool,
    embedded: Callable[[Value], Any] | None,
    max_depth: int,
) -> _ReadFn:
    """Build ``read(buf, p, depth) -> (value, end)`` reading the value at ``buf[p]``.

    Low-level API for protocol code that decodes many values with the same options (the
    relay); ``depth`` starts at 0.  ``buf`` must be ``bytes``.  Reading past the end of
    ``buf`` raises ``IndexError`` or :class:`DecodeShort`; callers turn the former into
    the latter.
    """
    return _Reader(annotations, embedded, max_depth).read


_READERS: Final[dict[tuple[bool, int], _Reader]] = {}
_PLAIN_READER: Final = _Reader(False, None, DEFAULT_MAX_DEPTH)
_READERS[(False, DEFAULT_MAX_DEPTH)] = _PLAIN_READER


def _reader_for(
    annotations: bool, embedded: Callable[[Value], Any] | None, max_depth: int
) -> _Reader:
    if embedded is not None:
        return _Reader(annotations, embedded, max_depth)
    k = (bool(annotations), max_depth)
    r = _READERS.get(k)
    if r is None:
        if len(_READERS) > 64:
            _READERS.clear()
        r = _READERS[k] = _Reader(bool(annotations), None, max_depth)
    return r


def _run(read: _Reader, buf: bytes, offset: int) -> tuple[Any, int]:
    """Read one value at ``offset``, turning every failure into a DecodeError."""
    try:
        return read.read(buf, offset, 0)
    except IndexError:
        if offset >= len(buf):
            raise DecodeEOF("no value: input is empty", offset) from None
        raise _short(len(buf)) from None
    except RecursionError:
        raise DecodeLimitExceeded(
            f"values nested too deeply for the Python stack (max_depth={read.max_depth})",
            offset,
        ) from None


def _as_bytes(data: object) -> bytes:
    if type(data) is bytes:
        return data
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    raise TypeError(f"expected bytes, bytearray or memoryview, not {type(data).__name__}")


def decode(
    data: bytes | bytearray | memoryview,
    *,
    annotations: bool = False,
    embedded: Callable[[Value], Any] | None = None,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Value:
    """Decode exactly one value filling ``data``.

    * ``annotations``: with ``False`` (default) annotations are validated and dropped;
      with ``True`` annotated values come back as :class:`Annotated`.
    * ``embedded`` maps the value inside each embedded marker to the object to wrap in
      :class:`Embedded` (default: the value itself).  An exception from it becomes a
      :class:`DecodeError`.
    * ``max_depth`` bounds nesting; deeper input raises :class:`DecodeLimitExceeded`.  It
      is at most :data:`~dataspace.values.model.RECURSION_LIMIT`.

    Raises :class:`DecodeEOF` for empty input, :class:`DecodeShort` when the input ends
    inside the value, and :class:`DecodeError` for anything malformed, including bytes
    after the value.
    """
    buf: bytes
    if (
        type(data) is bytes
        and not annotations
        and embedded is None
        and max_depth == DEFAULT_MAX_DEPTH
    ):
        buf = data
        r = _PLAIN_READER
    else:
        buf = _as_bytes(data)
        r = _reader_for(annotations, embedded, max_depth)
    try:
        v, end = r.read(buf, 0, 0)
    except IndexError:
        if not buf:
            raise DecodeEOF("no value: input is empty", 0) from None
        raise _short(len(buf)) from None
    except RecursionError:
        raise DecodeLimitExceeded(
            f"values nested too deeply for the Python stack (max_depth={r.max_depth})", 0
        ) from None
    if end != len(buf):
        raise DecodeError(f"{len(buf) - end} trailing byte(s) after the value", end)
    return v


def decode_prefix(
    data: bytes | bytearray | memoryview,
    offset: int = 0,
    *,
    annotations: bool = False,
    embedded: Callable[[Value], Any] | None = None,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> tuple[Value, int]:
    """Decode one value starting at ``offset``; return ``(value, end offset)``.

    Options and errors as for :func:`decode`, except that bytes after the value are
    allowed.  :class:`DecodeEOF` means there were no bytes at ``offset``.
    """
    if offset < 0:
        raise ValueError("offset must not be negative")
    buf = _as_bytes(data)
    return _run(_reader_for(annotations, embedded, max_depth), buf, offset)


# ---------------------------------------------------------------------------------------
# Streaming

# Scanner frame kinds (see Decoder._scan_value).
_F_CONTAINER = 0  # waiting for values, then 0x84
_F_ONE = 1  # waiting for one value (top level, or after 0x86)
_F_ANN = 2  # after 0x85: waiting for the annotation value
_F_ANNOTATED = 3  # after 0x85 and its annotation: waiting for the annotated value


def _rebased(e: DecodeError, delta: int) -> DecodeError:
    """The same error with its position moved by ``delta`` (stream offsets)."""
    if not delta or e.position is None:
        return e
    ne = type(e)(e.message, e.position + delta)
    ne.__cause__ = e.__cause__
    return ne


class Decoder:
    """Incremental, sans-IO decoder for a stream of concatenated binary values.

    >>> d = Decoder()
    >>> d.feed(b"\\xb1\\x05hel")
    >>> d.try_next() is None
    True
    >>> d.feed(b"lo\\xb0\\x01\\x07")
    >>> list(d)
    ['hello', 7]

    Feed bytes as they arrive with :meth:`feed`; :meth:`try_next` returns the next
    complete value or ``None`` when more bytes are needed; iterating yields every value
    complete so far.  ``annotations``, ``embedded`` and ``max_depth`` are as for
    :func:`decode`.  A value whose encoding is longer than ``max_value_size`` bytes raises
    :class:`DecodeLimitExceeded` as soon as that is known (before it is all buffered).

    Errors name positions counted from the first byte ever fed.  After an error the stream
    is unusable: every later :meth:`try_next` raises the same error.  Structural errors
    (bad tags, misplaced end markers) and limits are reported as soon as the bytes show
    them; content errors inside a value still arriving (invalid UTF-8, duplicate set
    elements, ...) are reported at the latest when the value is complete.

    Cost is linear in the input however it is chunked: a value that does not fit in what
    is buffered is tracked by a resumable structural scan, and decoded once it is complete.
    """

    def __init__(
        self,
        *,
        annotations: bool = False,
        embedded: Callable[[Value], Any] | None = None,
        max_depth: int = DEFAULT_MAX_DEPTH,
        max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
    ) -> None:
        if max_value_size < 1:
            raise ValueError("max_value_size must be positive")
        self._read = _reader_for(annotations, embedded, max_depth)
        self._max_depth = self._read.max_depth
        self._max_size = max_value_size
        self._buf = bytearray()
        self._pos = 0  # first unconsumed byte in _buf
        self._base = 0  # stream offset of _buf[0]
        self._snap: bytes | None = None  # bytes(_buf[_pos:]) taken after the last feed
        self._snap_base = 0  # index in _buf of _snap[0]
        # Resumable scan of an incomplete value: next token index, frame stack.
        self._scan_p = -1
        self._stack: list[int] = []
        self._error: DecodeError | None = None
        self._decodes = 0  # values decoded from the buffer, and attempts that came up short

    @property
    def buffered(self) -> int:
        """Number of bytes received but not yet returned as values."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes to the buffer."""
        if not data:
            return
        buf = self._buf
        pos = self._pos
        if pos:
            del buf[:pos]
            self._base += pos
            if self._scan_p >= 0:
                self._scan_p -= pos
            self._pos = 0
        buf += data
        self._snap = None

    def try_next(self) -> Value | None:
        """The next complete value, or ``None`` if more bytes are needed."""
        if self._error is not None:
            raise self._error
        try:
            return self._next()
        except DecodeError as e:
            self._error = e
            raise

    def __iter__(self) -> Iterator[Value]:
        return self

    def __next__(self) -> Value:
        v = self.try_next()
        if v is None:
            raise StopIteration
        return v

    def _next(self) -> Value | None:
        buf = self._buf
        pos = self._pos
        n = len(buf)
        if pos >= n:
            return None
        if self._scan_p < 0:
            if n - pos <= self._max_size:
                # Fast path: try to decode straight from a snapshot of the buffer.
                snap = self._snap
                if snap is None:
                    snap = self._snap = bytes(buf[pos:])
                    self._snap_base = pos
                rel = pos - self._snap_base
                self._decodes += 1
                try:
                    v, end = _run(self._read, snap, rel)
                except DecodeShort:
                    pass  # incomplete: fall back to the resumable scan
                except DecodeError as e:
                    raise _rebased(e, self._base + self._snap_base) from None
                else:
                    self._pos = self._snap_base + end
                    return v
            self._scan_p = pos
            self._stack = [_F_ONE]
        end = self._scan_value()
        if end < 0:
            return None
        data = bytes(buf[pos:end])
        self._scan_p = -1
        self._stack = []
        self._decodes += 1
        try:
            v, vend = _run(self._read, data, 0)
        except DecodeShort as e:  # pragma: no cover - the scan found a complete value
            raise DecodeError(e.message, (e.position or 0) + pos + self._base) from None
        except DecodeError as e:
            raise _rebased(e, pos + self._base) from None
        if vend != len(data):  # pragma: no cover - scan and decoder agree on boundaries
            raise DecodeError("internal error: value boundary mismatch", pos + self._base)
        self._pos = end
        self._snap = None
        return v

    def _scan_value(self) -> int:
        """Advance the structural scan of the value at ``_pos`` over the buffered bytes.

        Returns the index just past the value once it is complete, else -1 (state is kept
        for the next call).  Checks nesting and size limits as soon as they are known.
        """
        buf = self._buf
        n = len(buf)
        p = self._scan_p
        stack = self._stack
        start = self._pos
        limit = start + self._max_size
        max_depth = self._max_depth
        base = self._base
        if not stack:  # structure complete, waiting for the end of the last atom
            return p if p <= n else -1
        while True:
            if p >= n:
                self._scan_p = p
                return -1
            tag = buf[p]
            if tag == 0x80 or tag == 0x81:
                p += 1
            elif 0xB4 <= tag <= 0xB7 or tag == 0x86:
                if len(stack) > max_depth:
                    raise DecodeLimitExceeded(f"values nested more than {max_depth} deep", p + base)
                stack.append(_F_CONTAINER if tag != 0x86 else _F_ONE)
                p += 1
                if p > limit:
                    raise self._too_big()
                continue
            elif tag == 0x85:
                if stack[-1] == _F_ANNOTATED:
                    stack[-1] = _F_ANN  # another annotation of the same value
                else:
                    if len(stack) > max_depth:
                        raise DecodeLimitExceeded(
                            f"values nested more than {max_depth} deep", p + base
                        )
                    stack.append(_F_ANN)
                p += 1
                if p > limit:
                    raise self._too_big()
                continue
            elif tag == 0x84:
                if stack[-1] != _F_CONTAINER:
                    raise DecodeError(
                        "unexpected end marker (0x84) where a value was expected", p + base
                    )
                stack.pop()
                p += 1
            elif tag == 0x87 or 0xB0 <= tag <= 0xB3:
                # Length-prefixed atom: read the whole varint, then skip the body.
                q = p + 1
                length = 0
                shift = 0
                while True:
                    if q >= n:
                        self._scan_p = p  # resume at the tag once more bytes arrive
                        return -1
                    b = buf[q]
                    q += 1
                    length |= (b & 0x7F) << shift
                    if b < 0x80:
                        break
                    shift += 7
                    if shift >= 70:
                        raise DecodeError("length varint longer than 10 bytes", p + 1 + base)
                if tag == 0x87 and length != 8:
                    raise DecodeError(f"double must have 8 bytes, not {length}", p + 1 + base)
                p = q + length
            else:
                raise DecodeError(f"invalid tag 0x{tag:02x}", p + base)
            if p > limit:
                raise self._too_big()
            # A value ended: complete the frames waiting for exactly one value.
            while True:
                f = stack[-1]
                if f == _F_CONTAINER:
                    break
                if f == _F_ANN:
                    stack[-1] = _F_ANNOTATED
                    break
                stack.pop()  # _F_ONE or _F_ANNOTATED: that value is complete too
                if not stack:
                    if p > n:  # complete once the last atom's body has arrived
                        self._scan_p = p
                        return -1
                    return p

    def _too_big(self) -> DecodeTooLarge:
        return DecodeTooLarge(
            f"value longer than max_value_size ({self._max_size} bytes)",
            self._pos + self._base,
        )
