"""The Preserves text syntax: :func:`parse` text into values and :func:`stringify` them back.

>>> from dataspace.values import Record, Symbol
>>> parse('<Says "alice" "hello world" 12345>')
Record(Symbol('Says'), ('alice', 'hello world', 12345))
>>> stringify(Record(Symbol("Says"), ["alice", 1.5, b"hi"]))
'<Says "alice" 1.5 #"hi">'

Syntax summary (see samples.pr in the conformance suite for the test cases):

* ``#t`` ``#f``; integers ``-12``; doubles ``1.5`` ``1e3`` and ``#xd"7ff0000000000000"``
  (exact bits, for infinities and NaNs); strings ``"a\\nb"``; byte strings ``#"abc"``,
  ``#x"61 62"``, ``#[YWJj]``; symbols ``bare-word`` or ``|quoted word|``.
* ``<label field ...>`` records (no commas), ``[a, b]`` sequences, ``#{a b}`` sets and
  ``{key: value, ...}`` dictionaries (commas are optional whitespace between items),
  ``#:value`` embedded values (written ``#:<object "repr">`` by default when the embedded
  Python object is not itself a value).
* ``@annotation value``; ``# comment`` to end of line is an annotation (a string) on the
  value after it; ``#!line`` is the annotation ``<interpreter "line">``.  A comment with
  no value after it before a closing bracket, a comma or the end of the text is dropped.

Errors are :class:`~dataspace.values.errors.ParseError` (or a subclass) carrying the
character position; nothing else escapes :func:`parse` for bad input.
"""

from __future__ import annotations

import base64
import binascii
import decimal
import functools
import re
import unicodedata
from collections.abc import Callable
from typing import Any

from .errors import ParseEOF, ParseError, ParseLimitExceeded, ParseShort
from .model import (
    MAX_DEPTH,
    Annotated,
    Dictionary,
    Embedded,
    Record,
    Sequence,
    Set,
    Symbol,
    Value,
    _set_text_form,
    double_bits,
    double_from_bits,
    is_value,
    key,
    preserve,
    sort_key,
)

__all__ = ["MAX_INTEGER_DIGITS", "MAX_OBJECT_TEXT", "parse", "parse_many", "parse_prefix", "stringify"]

MAX_INTEGER_DIGITS = 100_000
"""Longest integer literal :func:`parse` accepts (in digits); longer is ParseLimitExceeded.

Converting decimal digits to a Python int costs more than linear time, so this bounds the
work a hostile text can cause.  :func:`stringify` writes integers of any size.
"""

# ---------------------------------------------------------------------------------------
# Character classes and token patterns

_DELIMITERS = frozenset(' \t\r\n<>[]{}#:"|@;,')

# Non-ASCII characters allowed in bare symbols when reading: everything except C1
# controls, Unicode spaces and line separators, the invisible bidirectional-text controls,
# the byte-order mark and surrogates.  (Writing is stricter: see _symbol_text.)
_NONASCII_SYMBOL_CHARS = (
    "\u00a1-\u061b\u061d-\u167f\u1681-\u1fff\u200b-\u200d\u2010-\u2027"
    "\u2030-\u205e\u2060-\u2065\u206a-\u2fff\u3001-\ud7ff\ue000-\ufefe\uff00-\U0010ffff"
)
_BARE = re.compile("[A-Za-z0-9~!$%^&*?_=+\\-/." + _NONASCII_SYMBOL_CHARS + "]+")
# A whole bare token that ends at a delimiter: group 1 an integer, 2 a double, 3 a symbol.
_TOKEN = re.compile(
    r"(?:([-+]?[0-9]+)|([-+]?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)|"
    "([A-Za-z0-9~!$%^&*?_=+\\-/." + _NONASCII_SYMBOL_CHARS + "]+))"
    r'(?=[ \t\r\n<>\[\]{}#:"|@;,]|\Z)'
)
_BARE_START = frozenset(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789~!$%^&*?_=+-/."
)
_NUMBER = re.compile(r"[-+]?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_SKIP_WS = re.compile(r"[ \t\r\n]*")
_SKIP_WS_COMMAS = re.compile(r"[ \t\r\n,]*")
_TO_EOL = re.compile(r"[^\r\n]*")
_SURROGATE = re.compile("[\ud800-\udfff]")

_STRING = re.compile('"([^"\\\\\ud800-\udfff]*)"')
_STRING_CHUNK = re.compile('[^"\\\\\ud800-\udfff]*')
_QSYMBOL = re.compile("\\|([^|\\\\\ud800-\udfff]*)\\|")
_QSYMBOL_CHUNK = re.compile("[^|\\\\\ud800-\udfff]*")
_BYTES = re.compile(r'#"([ !#-\[\]-~]*)"')
_BYTES_CHUNK = re.compile(r"[ !#-\[\]-~]*")
_BASE64_BODY = re.compile(r"[A-Za-z0-9+/\-_= \t\r\n]*")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_HEXDIGITS = frozenset("0123456789abcdefABCDEF")

_STRING_ESCAPES = {
    "\\": "\\",
    "/": "/",
    '"': '"',
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
}
_SYMBOL_ESCAPES = {**_STRING_ESCAPES, "|": "|"}
del _SYMBOL_ESCAPES['"']
_BYTES_ESCAPES = _STRING_ESCAPES

_INTERPRETER = Symbol("interpreter")

# Characters that cannot start a value, with the error message for each.
_NOT_A_VALUE = {
    ">": "unexpected '>'",
    "]": "unexpected ']'",
    "}": "unexpected '}'",
    ",": "unexpected ','",
    ":": "unexpected ':'",
    ";": "';' is reserved syntax",
}

# Frame kinds of the parser's explicit stack.  The first four are "collections": the
# closing bracket may come next, and a dangling comment is dropped.
_SEQ, _SET, _DKEY, _REC, _DVAL, _ANN_A, _ANN_V, _EMB, _TOP = range(9)
_CLOSER_BY_KIND = "]}}>"
_OPEN_NAMES = {_SEQ: "'['", _SET: "'#{'", _DKEY: "'{'", _REC: "'<'"}


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - text.rfind("\n", 0, pos)


def _err(cls: type[ParseError], message: str, text: str, pos: int) -> ParseError:
    pos = max(0, min(pos, len(text)))
    line, col = _line_col(text, pos)
    return cls(f"{message} (line {line}, column {col})", pos, line=line, column=col, reason=message)


def _short(text: str, what: str) -> ParseError:
    return _err(ParseShort, f"text ended inside {what}", text, len(text))


def _describe(c: str) -> str:
    return repr(c) if c.isprintable() and c != " " else f"U+{ord(c):04X} {c!r}"


# ---------------------------------------------------------------------------------------
# Integers of any size (Python 3.11 refuses int <-> str beyond 4300 digits)

_POW10: dict[int, int] = {}


def _pow10(k: int) -> int:
    p = _POW10.get(k)
    if p is None:
        if len(_POW10) > 256:
            _POW10.clear()
        p = _POW10[k] = 10**k
    return p


def _digits_to_int(s: str) -> int:
    """Non-negative decimal digits to int, divide and conquer (no digit-count limit)."""
    n = len(s)
    if n <= 4000:
        return int(s)
    lo = n // 2
    return _digits_to_int(s[: n - lo]) * _pow10(lo) + _digits_to_int(s[n - lo :])


_DEC_CONTEXT = decimal.Context(
    prec=decimal.MAX_PREC, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[]
)
_POW2_DEC: dict[int, decimal.Decimal] = {}


def _int_to_decimal(v: int) -> decimal.Decimal:
    n = v.bit_length()
    if n <= 8192:
        return decimal.Decimal(v)
    k = n // 2
    p = _POW2_DEC.get(k)
    if p is None:
        if len(_POW2_DEC) > 256:
            _POW2_DEC.clear()
        p = _POW2_DEC[k] = _DEC_CONTEXT.power(decimal.Decimal(2), k)
    hi = _int_to_decimal(v >> k)
    lo = _int_to_decimal(v & ((1 << k) - 1))
    return _DEC_CONTEXT.add(_DEC_CONTEXT.multiply(hi, p), lo)


_STR_INT_LIMIT = 1 << 14000  # below this, at most 4215 digits: str() is allowed


def _int_text(v: int) -> str:
    if -_STR_INT_LIMIT < v < _STR_INT_LIMIT:
        return str(v)
    if v < 0:
        return "-" + str(_int_to_decimal(-v))
    return str(_int_to_decimal(v))


# ---------------------------------------------------------------------------------------
# Token readers (each takes the position of the token's first character)


def _hex4(text: str, j: int, n: int) -> int:
    if _HEX4.match(text, j):
        return int(text[j : j + 4], 16)
    for q in range(j, j + 4):
        if q >= n:
            raise _short(text, "a \\u escape")
        if text[q] not in _HEXDIGITS:
            raise _err(ParseError, "\\u must be followed by four hex digits", text, q)
    raise AssertionError("unreachable")  # pragma: no cover


def _read_quoted(text: str, i: int, n: int, quote: str) -> tuple[str, int]:
    """Read a string (quote '"') or quoted symbol (quote '|') with escapes."""
    chunk = _STRING_CHUNK if quote == '"' else _QSYMBOL_CHUNK
    escapes = _STRING_ESCAPES if quote == '"' else _SYMBOL_ESCAPES
    what = "a string" if quote == '"' else "a quoted symbol"
    parts = []
    j = i + 1
    while True:
        m = chunk.match(text, j)
        parts.append(m.group())
        j = m.end()
        if j >= n:
            raise _short(text, what)
        c = text[j]
        if c == quote:
            return "".join(parts), j + 1
        if c != "\\":
            raise _err(ParseError, f"unpaired surrogate {_describe(c)} in {what}", text, j)
        if j + 1 >= n:
            raise _short(text, what)
        e = text[j + 1]
        r = escapes.get(e)
        if r is not None:
            parts.append(r)
            j += 2
            continue
        if e != "u":
            raise _err(ParseError, f"invalid escape \\{e} in {what}", text, j)
        cp = _hex4(text, j + 2, n)
        j += 6
        if 0xD800 <= cp <= 0xDBFF:
            if (j < n and text[j] != "\\") or (j + 1 < n and text[j + 1] != "u"):
                raise _err(ParseError, "high surrogate escape not followed by \\u", text, j)
            if j + 1 >= n:
                raise _short(text, what)
            lo = _hex4(text, j + 2, n)
            if not 0xDC00 <= lo <= 0xDFFF:
                raise _err(ParseError, "high surrogate escape not followed by a low one", text, j)
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)
            j += 6
        elif 0xDC00 <= cp <= 0xDFFF:
            raise _err(ParseError, "low surrogate escape without a high one", text, j - 6)
        parts.append(chr(cp))


def _read_bytes_literal(text: str, i: int, n: int) -> tuple[bytes, int]:
    parts = []
    j = i + 2
    while True:
        m = _BYTES_CHUNK.match(text, j)
        parts.append(m.group())
        j = m.end()
        if j >= n:
            raise _short(text, "a byte string")
        c = text[j]
        if c == '"':
            return "".join(parts).encode("latin-1"), j + 1
        if c != "\\":
            raise _err(
                ParseError,
                f'character {_describe(c)} not allowed in #"..." (use a \\x escape)',
                text,
                j,
            )
        if j + 1 >= n:
            raise _short(text, "a byte string")
        e = text[j + 1]
        r = _BYTES_ESCAPES.get(e)
        if r is not None:
            parts.append(r)
            j += 2
            continue
        if e != "x":
            raise _err(ParseError, f"invalid escape \\{e} in a byte string", text, j)
        for q in (j + 2, j + 3):
            if q >= n:
                raise _short(text, "a byte string")
            if text[q] not in _HEXDIGITS:
                raise _err(ParseError, "\\x must be followed by two hex digits", text, q)
        parts.append(chr(int(text[j + 2 : j + 4], 16)))
        j += 4


def _read_hex(text: str, j: int, n: int, what: str) -> tuple[bytes, int]:
    """Hex digit pairs, whitespace allowed between pairs, up to a closing '"'."""
    pairs = []
    while True:
        j = _SKIP_WS.match(text, j).end()
        if j >= n:
            raise _short(text, what)
        c = text[j]
        if c == '"':
            return bytes.fromhex("".join(pairs)), j + 1
        if c not in _HEXDIGITS:
            raise _err(ParseError, f"expected a hex digit in {what}, not {_describe(c)}", text, j)
        if j + 1 >= n:
            raise _short(text, what)
        d = text[j + 1]
        if d not in _HEXDIGITS:
            raise _err(
                ParseError,
                f"hex digits must come in pairs in {what}, not {_describe(d)}",
                text,
                j + 1,
            )
        pairs.append(text[j : j + 2])
        j += 2


def _read_base64(text: str, i: int, n: int) -> tuple[bytes, int]:
    j = _BASE64_BODY.match(text, i + 2).end()
    if j >= n:
        raise _short(text, "#[...] base64")
    if text[j] != "]":
        raise _err(ParseError, f"character {_describe(text[j])} not allowed in base64", text, j)
    body = "".join(text[i + 2 : j].split()).translate(_B64_URLSAFE)
    stripped = body.rstrip("=")
    if "=" in stripped or len(stripped) % 4 == 1:
        raise _err(ParseError, "malformed base64", text, i)
    try:
        return base64.b64decode(stripped + "=" * (-len(stripped) % 4), validate=True), j + 1
    except (binascii.Error, ValueError):  # pragma: no cover - excluded above
        raise _err(ParseError, "malformed base64", text, i) from None


_B64_URLSAFE = str.maketrans("-_", "+/")


def _read_comment(text: str, i: int) -> tuple[str, int]:
    """``i`` is at '#', followed by space, tab, CR, LF or '!'; returns (text, end)."""
    c = text[i + 1]
    if c == "\r" or c == "\n":
        return "", i + 1
    j = _TO_EOL.match(text, i + 2).end()
    return text[i + 2 : j], j


def _big_int(text: str, i: int, s: str) -> int:
    digits = s.lstrip("+-")
    if len(digits) > MAX_INTEGER_DIGITS:
        raise _err(
            ParseLimitExceeded,
            f"integer literal longer than MAX_INTEGER_DIGITS={MAX_INTEGER_DIGITS} digits",
            text,
            i,
        )
    v = _digits_to_int(digits)
    return -v if s[0] == "-" else v


def _read_hex_form(text: str, i: int, n: int) -> tuple[Any, int]:
    """``#x"..."`` (bytes) or ``#xd"..."`` (a double's bits); ``i`` is at '#'."""
    if i + 2 >= n:
        raise _short(text, "a '#x' form")
    e = text[i + 2]
    if e == '"':
        return _read_hex(text, i + 3, n, '#x"..."')
    if e != "d":
        raise _err(ParseError, "expected '\"' or 'd' after #x", text, i + 2)
    if i + 3 >= n:
        raise _short(text, "a '#xd' form")
    if text[i + 3] != '"':
        raise _err(ParseError, "expected '\"' after #xd", text, i + 3)
    b, j = _read_hex(text, i + 4, n, '#xd"..."')
    if len(b) != 8:
        raise _err(ParseError, '#xd"..." must hold exactly 8 bytes (16 hex digits)', text, i)
    return double_from_bits(int.from_bytes(b, "big")), j


def _comment_annotation(text: str, end: int, d: str, s: str) -> Value:
    if _SURROGATE.search(s) is not None:
        raise _err(ParseError, "unpaired surrogate in a comment", text, end - len(s))
    return Record._make(_INTERPRETER, (s,)) if d == "!" else s


def _bare(text: str, i: int, n: int) -> tuple[Any, int]:
    m = _BARE.match(text, i)
    if m is None:
        c = text[i]
        raise _err(ParseError, f"unexpected character {_describe(c)}", text, i)
    j = m.end()
    if j < n and text[j] not in _DELIMITERS:
        raise _err(ParseError, f"unexpected character {_describe(text[j])}", text, j)
    s = m.group()
    if s[0] in "+-0123456789":
        nm = _NUMBER.fullmatch(s)
        if nm is not None:
            if nm.group(1) is None and nm.group(2) is None:
                return (int(s) if j - i <= 4000 else _big_int(text, i, s)), j
            return float(s), j
    return Symbol(s), j


# ---------------------------------------------------------------------------------------
# The parser: an explicit stack, so nesting depth never touches Python's recursion limit


def _collection_comments(
    text: str, i: int, n: int, annotations: bool
) -> tuple[list[Value] | None, int]:
    """At '#' + (space, tab, CR, LF or '!') inside a collection: read the comments there.

    Returns the annotations they make for the next item -- None if annotations are off or
    the comments dangle (a closing bracket, a comma or the end of the text comes next) --
    and the position of the next character that is not whitespace.
    """
    pending: list[Value] | None = None
    while True:
        d = text[i + 1]
        s, i = _read_comment(text, i)
        if annotations:
            a = _comment_annotation(text, i, d, s)
            if pending is None:
                pending = [a]
            else:
                pending.append(a)
        i = _SKIP_WS.match(text, i).end()
        if i + 1 < n and text[i] == "#" and text[i + 1] in " \t\r\n!":
            continue
        if i >= n or text[i] in ",]}>":
            pending = None  # a dangling comment annotates nothing
        return pending, i


def _too_deep(text: str, i: int, max_depth: int) -> ParseError:
    return _err(ParseLimitExceeded, f"nesting deeper than max_depth={max_depth}", text, i)


def _parse_one(
    text: str,
    i: int,
    annotations: bool,
    embedded: Callable[[Value], Any] | None,
    max_depth: int,
) -> tuple[Value, int]:
    """Parse one value starting at ``i`` (leading whitespace allowed); return (v, end).

    The parser keeps an explicit stack of open frames (collections, annotations, embedded
    values), so nesting depth never touches Python's recursion limit.
    """
    n = len(text)
    stack: list[list[Any]] = []
    push = stack.append
    skip_ws = _SKIP_WS.match
    skip_wsc = _SKIP_WS_COMMAS.match
    token = _TOKEN.match
    string_match = _STRING.match
    closers = _CLOSER_BY_KIND
    bare_start = _BARE_START
    f: list[Any] = []  # the top frame (unused while k is _TOP)
    k = _TOP
    vstart = i

    while True:
        # ---- Phase A: find the start of the next value, or close a collection.
        if k <= _REC:
            if i < n and text[i] in " \t\r\n,":
                i = (skip_ws if k == _REC else skip_wsc)(text, i).end()
            if i >= n:
                raise _short(text, f"{_OPEN_NAMES[k]} opened at position {f[2]}")
            c = text[i]
            pending = None
            if c == "#" and i + 1 < n and text[i + 1] in " \t\r\n!":
                pending, i = _collection_comments(text, i, n, annotations)
                if pending is None:
                    continue
                c = text[i]
            if c == closers[k]:
                items = f[1]
                vstart = f[2]
                i += 1
                if k == _SEQ:
                    v = tuple.__new__(Sequence, items)
                elif k == _REC:
                    if not items:
                        raise _err(ParseError, "a record needs a label", text, vstart)
                    v = Record._make(items[0], tuple(items[1:]))
                elif k == _SET:
                    v = Set._from_dict(items)
                else:
                    v = Dictionary._from_dict(items)
                stack.pop()
                if stack:
                    f = stack[-1]
                    k = f[0]
                else:
                    k = _TOP
            else:
                if c == "," and k == _REC:
                    raise _err(ParseError, "commas are not allowed in records", text, i)
                if pending is not None:
                    if len(stack) >= max_depth:
                        raise _too_deep(text, i, max_depth)
                    f = [_ANN_V, pending, i]
                    push(f)
                    k = _ANN_V
                v = None
        else:
            if i < n and text[i] in " \t\r\n":
                i = skip_ws(text, i).end()
            if i >= n:
                raise _short(text, "a value")
            c = text[i]
            v = None

        # ---- Dispatch on the first character of a value.
        if v is None:
            vstart = i
            if c == '"':
                m = string_match(text, i)
                if m is not None:
                    v = m.group(1)
                    i = m.end()
                else:
                    v, i = _read_quoted(text, i, n, '"')
            elif c in bare_start:
                m = token(text, i)
                if m is None:  # not followed by a delimiter, or a big integer
                    v, i = _bare(text, i, n)
                else:
                    g = m.lastindex
                    if g == 3:
                        v = Symbol(m.group(3))
                    elif g == 1:
                        s = m.group(1)
                        v = int(s) if len(s) <= 4000 else _big_int(text, i, s)
                    else:
                        v = float(m.group(2))
                    i = m.end()
            elif c == "<" or c == "[" or c == "{":
                if len(stack) >= max_depth:
                    raise _too_deep(text, i, max_depth)
                if c == "<":
                    f = [_REC, [], i]
                    k = _REC
                elif c == "[":
                    f = [_SEQ, [], i]
                    k = _SEQ
                else:
                    f = [_DKEY, {}, i, None, None]
                    k = _DKEY
                push(f)
                i += 1
                continue
            elif c == "#":
                if i + 1 >= n:
                    raise _short(text, "a '#' form")
                d = text[i + 1]
                if d == "t" or d == "f":
                    if i + 2 < n and text[i + 2] not in _DELIMITERS:
                        raise _err(
                            ParseError,
                            f"#{d} must be followed by a delimiter, not {_describe(text[i + 2])}",
                            text,
                            i + 2,
                        )
                    v = d == "t"
                    i += 2
                elif d == "{" or d == ":":
                    if len(stack) >= max_depth:
                        raise _too_deep(text, i, max_depth)
                    if d == "{":
                        f = [_SET, {}, i]
                        k = _SET
                    else:
                        f = [_EMB, None, i]
                        k = _EMB
                    push(f)
                    i += 2
                    continue
                elif d in " \t\r\n!":
                    s, i = _read_comment(text, i)
                    if annotations:
                        a = _comment_annotation(text, i, d, s)
                        if k == _ANN_V:
                            f[1].append(a)
                        else:
                            if len(stack) >= max_depth:
                                raise _too_deep(text, i, max_depth)
                            f = [_ANN_V, [a], vstart]
                            push(f)
                            k = _ANN_V
                    continue
                elif d == '"':
                    m = _BYTES.match(text, i)
                    if m is not None:
                        v = m.group(1).encode("ascii")
                        i = m.end()
                    else:
                        v, i = _read_bytes_literal(text, i, n)
                elif d == "x":
                    v, i = _read_hex_form(text, i, n)
                elif d == "[":
                    v, i = _read_base64(text, i, n)
                else:
                    raise _err(ParseError, f"invalid syntax {('#' + d)!r}", text, i)
            elif c == "@":
                if k == _ANN_V:
                    f[0] = k = _ANN_A
                else:
                    if len(stack) >= max_depth:
                        raise _too_deep(text, i, max_depth)
                    f = [_ANN_A, [], i]
                    push(f)
                    k = _ANN_A
                i += 1
                continue
            elif c == "|":
                m = _QSYMBOL.match(text, i)
                if m is not None:
                    v = Symbol(m.group(1))
                    i = m.end()
                else:
                    s, i = _read_quoted(text, i, n, "|")
                    v = Symbol(s)
            elif c in _NOT_A_VALUE:
                raise _err(ParseError, _NOT_A_VALUE[c], text, i)
            else:  # a non-ASCII symbol, or an error
                v, i = _bare(text, i, n)

        # ---- Phase B: hand the finished value to the enclosing frame.
        while True:
            if k == _SEQ or k == _REC:
                f[1].append(v)
                break
            if k == _TOP:
                return v, i
            if k == _DVAL:
                f[1][f[4]] = (f[3], v)
                f[0] = k = _DKEY
                break
            if k == _DKEY:
                kk = key(v)
                if kk in f[1]:
                    raise _err(ParseError, "duplicate dictionary key", text, vstart)
                i = skip_ws(text, i).end()
                if i >= n:
                    raise _short(text, f"'{{' opened at position {f[2]}")
                if text[i] != ":":
                    raise _err(
                        ParseError,
                        f"expected ':' after a dictionary key, not {_describe(text[i])}",
                        text,
                        i,
                    )
                i += 1
                f[3] = v
                f[4] = kk
                f[0] = k = _DVAL
                break
            if k == _SET:
                kk = key(v)
                if kk in f[1]:
                    raise _err(ParseError, "duplicate set element", text, vstart)
                f[1][kk] = v
                break
            if k == _ANN_A:
                f[1].append(v)
                f[0] = k = _ANN_V
                break
            # _ANN_V or _EMB: the frame is complete.
            stack.pop()
            vstart = f[2]
            if k == _ANN_V:
                if annotations:
                    v = Annotated(v, f[1])
            elif embedded is None:
                v = Embedded(v)
            else:
                try:
                    v = Embedded(embedded(v))
                except ParseError:
                    raise
                except Exception as e:
                    raise _err(ParseError, f"embedded value rejected: {e!r}", text, vstart) from e
            if stack:
                f = stack[-1]
                k = f[0]
            else:
                k = _TOP


def _parse_guarded(
    text: str,
    i: int,
    annotations: bool,
    embedded: Callable[[Value], Any] | None,
    max_depth: int,
) -> tuple[Value, int]:
    try:
        return _parse_one(text, i, annotations, embedded, max_depth)
    except RecursionError:
        # The parser itself does not recurse, but hashing deeply nested set elements or
        # dictionary keys does.
        raise _err(
            ParseLimitExceeded, "value nested too deeply for this Python (recursion limit)", text, i
        ) from None


def _skip_trailing(text: str, i: int) -> int:
    """Skip whitespace and comments; return the position of the next other character."""
    n = len(text)
    while True:
        i = _SKIP_WS.match(text, i).end()
        if i + 1 < n and text[i] == "#" and text[i + 1] in " \t\r\n!":
            i = _read_comment(text, i)[1]
            continue
        return i


def _check_args(text: Any, max_length: int) -> None:
    if not isinstance(text, str):
        raise TypeError(
            f"parse() needs a str, not {type(text).__name__}"
            + (
                " (use decode() for binary Preserves)"
                if isinstance(text, bytes | bytearray)
                else ""
            )
        )
    if len(text) > max_length:
        raise ParseLimitExceeded(f"text longer than max_length={max_length}", max_length)


def parse_prefix(
    text: str,
    offset: int = 0,
    *,
    annotations: bool = False,
    embedded: Callable[[Value], Any] | None = None,
    max_depth: int = MAX_DEPTH,
    max_length: int = 64 * 1024 * 1024,
) -> tuple[Value, int]:
    """Parse one value starting at ``offset``; return it and the offset just after it.

    Leading whitespace and comments are skipped; nothing after the value is looked at,
    except that a bare symbol, number, ``#t`` or ``#f`` must end at a delimiter.
    Raises :class:`ParseEOF` if ``text[offset:]`` is empty, :class:`ParseShort` if it
    ends inside a value, and :class:`ParseError` for anything malformed.
    """
    _check_args(text, max_length)
    text = str(text)
    if offset < 0:
        raise ValueError(f"parse_prefix offset must not be negative, not {offset}")
    if offset >= len(text):
        raise _err(ParseEOF, "no value in text", text, len(text))
    return _parse_guarded(text, offset, annotations, embedded, max_depth)


def parse(
    text: str,
    *,
    annotations: bool = False,
    embedded: Callable[[Value], Any] | None = None,
    max_depth: int = MAX_DEPTH,
    max_length: int = 64 * 1024 * 1024,
) -> Value:
    """Parse exactly one Preserves value from ``text``.

    ``annotations=True`` keeps annotations and comments (as :class:`Annotated` values);
    otherwise they are dropped.  ``embedded`` converts the value inside ``#:v`` to the
    object wrapped in :class:`Embedded` (default: the value itself).  Nesting deeper than
    ``max_depth`` (default :data:`~dataspace.values.model.MAX_DEPTH`, shared with the
    binary codec) or text longer than ``max_length`` characters is
    :class:`ParseLimitExceeded`.  Whitespace and comments may follow the value; anything
    else is a :class:`ParseError`.
    """
    _check_args(text, max_length)
    text = str(text)
    if not text:
        raise _err(ParseEOF, "no value in text", text, 0)
    v, i = _parse_guarded(text, 0, annotations, embedded, max_depth)
    j = _skip_trailing(text, i)
    if j < len(text):
        raise _err(ParseError, f"unexpected text after the value: {text[j : j + 20]!r}", text, j)
    return v


def parse_many(
    text: str,
    *,
    annotations: bool = False,
    embedded: Callable[[Value], Any] | None = None,
    max_depth: int = MAX_DEPTH,
    max_length: int = 64 * 1024 * 1024,
) -> list[Value]:
    """Parse zero or more values separated by whitespace (and comments)."""
    _check_args(text, max_length)
    text = str(text)
    out = []
    i = 0
    n = len(text)
    while True:
        j = _skip_trailing(text, i)
        if j >= n:
            return out
        # Start at i, not j, so that comments before a value annotate it.
        v, i = _parse_guarded(text, i if annotations else j, annotations, embedded, max_depth)
        out.append(v)


# ---------------------------------------------------------------------------------------
# Writing


# Written as escapes: the quote, backslash, control characters, line separators and the
# invisible bidirectional-text controls (so that text cannot look different from what it
# holds); lone surrogates are refused.
_INVISIBLE = "\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ufeff"
_STRING_NEEDS_ESCAPE = re.compile('["\\\\' + _INVISIBLE + "\ud800-\udfff]")
_SYMBOL_NEEDS_ESCAPE = re.compile("[|\\\\" + _INVISIBLE + "\ud800-\udfff]")
_SHORT_ESCAPES = {
    "\\": "\\\\",
    '"': '\\"',
    "|": "\\|",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}
_ASCII_BARE = re.compile(r"[A-Za-z0-9~!$%^&*?_=+\-/.]+")
_BARE_OUTPUT_CATEGORIES = frozenset(
    "Lu Ll Lt Lm Lo Mn Mc Me Nd Nl No Pc Pd Po Sc Sm Sk So Co".split()
)


def _escape_char(m: re.Match[str]) -> str:
    c = m.group()
    r = _SHORT_ESCAPES.get(c)
    if r is not None:
        return r
    if "\ud800" <= c <= "\udfff":
        raise ValueError(
            f"string contains the lone surrogate U+{ord(c):04X}, which is not a Unicode "
            "scalar value and so cannot be part of a Preserves string or symbol"
        )
    return f"\\u{ord(c):04x}"


def _string_text(s: str) -> str:
    if _STRING_NEEDS_ESCAPE.search(s) is None:
        return '"' + s + '"'
    return '"' + _STRING_NEEDS_ESCAPE.sub(_escape_char, s) + '"'


@functools.lru_cache(maxsize=4096)
def _symbol_text(name: str) -> str:
    if _ASCII_BARE.fullmatch(name) is not None or (
        _BARE.fullmatch(name) is not None
        and all(c < "\x80" or unicodedata.category(c) in _BARE_OUTPUT_CATEGORIES for c in name)
    ):
        if name[0] not in "+-0123456789" or _NUMBER.fullmatch(name) is None:
            return name
    if _SYMBOL_NEEDS_ESCAPE.search(name) is None:
        return "|" + name + "|"
    return "|" + _SYMBOL_NEEDS_ESCAPE.sub(_escape_char, name) + "|"


_PRINTABLE_BYTES = re.compile(rb"[ -~\t\n\r]*")
_BYTES_NEEDS_ESCAPE = re.compile(r'["\\\t\n\r]')


def _bytes_text(b: bytes) -> str:
    if _PRINTABLE_BYTES.fullmatch(b) is not None:
        s = b.decode("ascii")
        if _BYTES_NEEDS_ESCAPE.search(s) is not None:
            s = _BYTES_NEEDS_ESCAPE.sub(lambda m: _SHORT_ESCAPES[m.group()], s)
        return '#"' + s + '"'
    return '#x"' + b.hex() + '"'


def _double_text(x: float) -> str:
    if x != x or x in (_INF, _NINF):
        return f'#xd"{double_bits(x):016x}"'
    r = repr(x)
    if "." not in r and "e" not in r:  # pragma: no cover - repr always has one
        r += ".0"
    return r


_INF = float("inf")
_NINF = float("-inf")


def _sorted_items(items: list[Value]) -> list[Value]:
    """Sort values into the Preserves order (fast paths for homogeneous atoms)."""
    if not items:
        return items
    t = type(items[0])
    if t in (str, int, bytes) and all(type(x) is t for x in items):
        return sorted(items)
    if t is Symbol and all(type(x) is Symbol for x in items):
        return sorted(items, key=_symbol_name)
    return sorted(items, key=sort_key)


def _symbol_name(s: Symbol) -> str:
    return s.name


def _embedded_value(obj: Any, embedded: Callable[[Any], Value] | None) -> Value:
    if embedded is not None:
        v = embedded(obj)
        if is_value(v):
            return v
        try:
            return preserve(v)
        except TypeError:
            raise TypeError(
                f"the embedded= function returned {type(v).__name__}, not a Preserves value"
            ) from None
    if is_value(obj):
        return obj
    try:
        return preserve(obj)
    except TypeError:
        return _object_text(obj)


_OBJECT = Symbol("object")
MAX_OBJECT_TEXT = 200
"""Longest ``repr`` (in characters) kept in the default text of an embedded object."""


def _object_text(obj: Any) -> Value:
    """The default text of an embedded object that is not a Preserves value (a reference,
    an entity ...): ``<object "its repr">``, for people and logs."""
    try:
        r = repr(obj)
    except Exception:  # a failing __repr__ must not make the value unprintable
        t = type(obj)
        r = f"<{t.__module__}.{t.__qualname__} object at {id(obj):#x}>"
    if len(r) > MAX_OBJECT_TEXT:
        r = r[: MAX_OBJECT_TEXT - 3] + "..."
    return Record._make(_OBJECT, (r,))


class _Table(dict):
    """Type -> writer function; unknown types go through :func:`preserve` first."""

    __slots__ = ("fallback",)

    def __missing__(self, t: type) -> Callable[[Any], str]:
        return self.fallback


@functools.lru_cache(maxsize=64)
def _compact_writer(annotations: bool, embedded: Callable[[Any], Value] | None) -> _Table:
    """The dispatch table of the one-line writer for these options."""
    table = _Table()

    def w_other(v: Any) -> str:
        c = _coerce(v)
        return table[type(c)](c)

    def w_symbol(v: Symbol) -> str:
        return _symbol_text(v.name)

    def w_bool(v: bool) -> str:
        return "#t" if v else "#f"

    def w_record(v: Record) -> str:
        fields = v.fields
        label = v.label
        if fields:
            return (
                "<"
                + table[type(label)](label)
                + " "
                + " ".join([table[type(x)](x) for x in fields])
                + ">"
            )
        return "<" + table[type(label)](label) + ">"

    def w_sequence(v: Sequence) -> str:
        return "[" + " ".join([table[type(x)](x) for x in v]) + "]"

    def w_set(v: Set) -> str:
        return "#{" + " ".join([table[type(x)](x) for x in _sorted_items(list(v))]) + "}"

    def w_dictionary(v: Dictionary) -> str:
        pairs = v._items.values()
        if len(pairs) > 1:
            lookup = v._items
            pairs = [lookup[key(k)] for k in _sorted_items([k for k, _x in pairs])]
        return (
            "{" + " ".join([table[type(k)](k) + ": " + table[type(x)](x) for k, x in pairs]) + "}"
        )

    def w_annotated(v: Annotated) -> str:
        item = v.item
        if not annotations:
            return table[type(item)](item)
        return "".join(["@" + table[type(a)](a) + " " for a in v.annotations]) + table[type(item)](
            item
        )

    def w_embedded(v: Embedded) -> str:
        x = _embedded_value(v.value, embedded)
        return "#:" + table[type(x)](x)

    table.fallback = w_other
    table.update(
        {
            str: _string_text,
            Symbol: w_symbol,
            int: _int_text,
            bool: w_bool,
            float: _double_text,
            bytes: _bytes_text,
            Record: w_record,
            Sequence: w_sequence,
            Set: w_set,
            Dictionary: w_dictionary,
            Annotated: w_annotated,
            Embedded: w_embedded,
        }
    )
    return table


class _Pretty:
    """The indenting writer: containers that fit in ``width`` columns stay on one line."""

    __slots__ = ("annotations", "embedded", "indent", "table", "width")

    def __init__(
        self, annotations: bool, embedded: Callable[[Any], Value] | None, indent: int
    ) -> None:
        self.annotations = annotations
        self.embedded = embedded
        self.indent = indent
        self.width = 80
        self.table = _table_for(annotations, embedded)

    def write(self, v: Value, level: int) -> str:
        t = type(v)
        if t not in _CONTAINERS:
            if t is Annotated:
                if not self.annotations:
                    return self.write(v.item, level)
                return "".join(
                    ["@" + self.write(a, level) + " " for a in v.annotations]
                ) + self.write(v.item, level)
            if t is Embedded:
                return "#:" + self.write(_embedded_value(v.value, self.embedded), level)
            if t in _ATOMS:
                return self.table[t](v)
            return self.write(_coerce(v), level)
        s = self.table[t](v)
        if len(s) + level <= self.width:
            return s
        inner = level + self.indent
        nl = "\n" + " " * inner
        end = "\n" + " " * level
        p = self.write
        if t is Record:
            if not v.fields:
                return "<" + p(v.label, level) + ">"
            fields = nl.join([p(x, inner) for x in v.fields])
            return "<" + p(v.label, level) + nl + fields + end + ">"
        if t is Sequence:
            return "[" + nl + nl.join([p(x, inner) for x in v]) + end + "]"
        if t is Set:
            return "#{" + nl + nl.join([p(x, inner) for x in _sorted_items(list(v))]) + end + "}"
        lookup = v._items
        entries = []
        for k in _sorted_items([k for k, _x in lookup.values()]):
            x = lookup[key(k)][1]
            entries.append(p(k, inner) + ": " + p(x, inner))
        return "{" + nl + nl.join(entries) + end + "}"


_CONTAINERS = frozenset({Record, Sequence, Set, Dictionary})
_ATOMS = frozenset({bool, float, int, str, bytes, Symbol})


def _coerce(v: Any) -> Value:
    try:
        return preserve(v)
    except TypeError:
        raise TypeError(f"cannot write {type(v).__name__} as Preserves text: {v!r:.60}") from None


def stringify(
    v: Value,
    *,
    indent: int | None = None,
    annotations: bool = True,
    embedded: Callable[[Any], Value] | None = None,
) -> str:
    """Write ``v`` as Preserves text that :func:`parse` reads back as an equal value.

    Sets and dictionaries are written in the Preserves order, so equal values give equal
    text.  ``indent`` (spaces per level) pretty-prints across lines; containers that fit
    in 80 columns stay on one line.  ``annotations=False`` omits annotations.  An
    :class:`Embedded` is written ``#:`` followed by ``embedded(obj)``, which must be a
    Preserves value (TypeError otherwise).  Without ``embedded``, it is the wrapped object
    itself when that is a Preserves value, else ``<object "repr of the object">`` (at most
    :data:`MAX_OBJECT_TEXT` characters of it): every value has a text form for people and
    logs, though such an object does not come back from :func:`parse` (the record does).
    Natural Python data (lists, dicts, ...) is accepted as by :func:`preserve`.
    """
    try:
        if indent:
            return _Pretty(annotations, embedded, indent).write(v, 0)
        if embedded is None:
            table = _DEFAULT_TABLE if annotations else _NO_ANNOTATIONS_TABLE
        else:
            table = _table_for(annotations, embedded)
        return table[type(v)](v)
    except RecursionError:
        # Too deep for the recursive writers: write it on one line without recursion.
        return _write_deep(v, annotations, embedded)


def _table_for(annotations: bool, embedded: Callable[[Any], Value] | None) -> _Table:
    try:
        return _compact_writer(annotations, embedded)
    except TypeError:  # an unhashable embedded= callable
        return _compact_writer.__wrapped__(annotations, embedded)


def _write_deep(v: Value, annotations: bool, embedded: Callable[[Any], Value] | None) -> str:
    """The one-line writer with an explicit stack instead of recursion."""
    table = _table_for(annotations, embedded)
    out: list[str] = []
    emit = out.append
    todo: list[tuple[bool, Any]] = [(False, v)]
    push = todo.append
    while todo:
        literal, x = todo.pop()
        if literal:
            emit(x)
            continue
        t = type(x)
        if t is Record:
            items: list[Any] = [x.label, *x.fields]
            opener, closer = "<", ">"
        elif t is Sequence:
            items, opener, closer = list(x), "[", "]"
        elif t is Set:
            items, opener, closer = _sorted_items(list(x)), "#{", "}"
        elif t is Dictionary:
            push((True, "}"))
            lookup = x._items
            order = _sorted_items([k for k, _x in lookup.values()])
            for n, k in enumerate(reversed(order)):
                if n:
                    push((True, " "))
                push((False, lookup[key(k)][1]))
                push((True, ": "))
                push((False, k))
            push((True, "{"))
            continue
        elif t is Annotated:
            push((False, x.item))
            if annotations:
                for a in reversed(x.annotations):
                    push((True, " "))
                    push((False, a))
                    push((True, "@"))
            continue
        elif t is Embedded:
            push((False, _embedded_value(x.value, embedded)))
            push((True, "#:"))
            continue
        elif t in _ATOMS:
            emit(table[t](x))
            continue
        else:
            push((False, _coerce(x)))
            continue
        push((True, closer))
        for n, item in enumerate(reversed(items)):
            if n:
                push((True, " "))
            push((False, item))
        push((True, opener))
    return "".join(out)


_DEFAULT_TABLE = _compact_writer(True, None)
_NO_ANNOTATIONS_TABLE = _compact_writer(False, None)

_set_text_form(stringify)
