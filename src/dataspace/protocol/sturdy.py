"""Sturdy capabilities (sturdyrefs) and the caveats that attenuate them.

A sturdyref is a capability written as plain data::

    <ref {oid: "syndicate" sig: #x"69ca300c1dbfa08fba692102dd82311a"}>

``oid`` names the object on the server; ``sig`` proves that whoever holds the server's
secret key made the ref.  Anyone holding a ref can *attenuate* it -- append caveats that
restrict (and may rewrite) what flows through it -- without knowing the key, and nobody
can remove a caveat afterwards.  This module implements schema ``sturdy.prs`` of the
Syndicate protocol (shipped in ``syndicate-py``), so refs made here validate in other
Syndicate implementations and vice versa.

Signatures
----------
With ``f(k, d) = HMAC-BLAKE2s-256(k, d)`` truncated to its first 16 bytes and ``e(v)`` the
canonical binary encoding of ``v``::

    sig = f(... f(f(key, e(oid)), e(caveat1)) ..., e(caveatN))

so appending caveat ``c`` to a ref only needs its current signature:
``sig' = f(sig, e(c))``.  Check: with an empty key (HMAC pads any key shorter than its
block with zeros, so ``b""`` and 16 zero bytes are the same key) and oid ``"syndicate"``,
``sig`` is ``#x"69ca300c1dbfa08fba692102dd82311a"`` (``#[acowDB2/oI+6aSEC3YIxGg==]``), the
value syndicate-py's examples and the Nim implementation's ``mint()`` use.

Because the signature covers canonical encodings, a sturdyref is pure data: its oid and
caveats may not contain embedded references (the Rust implementation signs with a codec
that refuses them too).

Caveat semantics (and where the facts come from)
------------------------------------------------
The schema fixes the syntax; the behaviour below follows the reference implementation,
syndicate-rs (``syndicate/src/rewrite.rs``, ``Cap::rewrite`` in ``actor.rs`` and
``decode_wireref`` in ``relay.rs``), and was checked against the syntax classes of
syndicate-py's schema decoder (``syndicate.schema.sturdy.Caveat``):

* **Order.**  Caveats run right to left: the newest (rightmost) caveat sees the value
  first, and its output goes to the next older one.  If any caveat rejects, the value is
  dropped.  (Schema comment; ``Cap::rewrite`` iterates the chain in reverse.)
* **Which caveat kind.**  A caveat is a ``<rewrite P T>``, an ``<or [<rewrite ...> ...]>``
  or a ``<reject P>`` only if it parses *completely* as one (record arity included, every
  alternative of an ``or`` a rewrite, every nested pattern and template well formed).
  Anything else is an *unknown* caveat, which rejects everything: the schema's
  ``@unknown any`` branch, checked as ``Reject(<_>)`` in Rust.  Failing closed means a
  caveat this version does not understand can never widen access.
* **Invalid caveats are errors.**  A rewrite that parses but cannot work -- a template
  ``<ref n>`` with ``n`` negative or not less than the number of bindings of its pattern,
  or a ``<bind>`` under ``<not>`` in a rewrite's pattern -- raises :class:`SturdyError`
  (Rust: ``CaveatError::UnboundRef`` / ``BindingUnderNegation``, which make attenuation,
  and so a gatekeeper resolution or a relay's import of an attenuated ref, fail).  The
  checks apply to nested ``<attenuate>`` caveat lists too.  ``<reject P>`` is not checked
  (Rust does not count bindings of reject patterns; they are simply unused).
* **Patterns** (not the dataspace pattern language):
  ``<_>`` matches anything; the bare symbols ``Boolean``, ``Double``, ``SignedInteger``,
  ``String``, ``ByteString``, ``Symbol`` and ``Embedded`` are type tests (the schema says
  ``=Boolean``: a symbol, *not* ``<Boolean>``; a record like ``<String>`` is not a pattern,
  so a caveat using it is unknown); ``<lit v>`` matches values equal to ``v``
  (Preserves equality: ``1``, ``1.0`` and ``#t`` differ); ``<bind P>`` captures the value
  and then matches ``P``; ``<and [P ...]>`` needs every ``P``; ``<not P>`` needs ``P``
  to fail; ``<rec L [P ...]>`` matches a record with label ``L`` and *exactly* as many
  fields as patterns; ``<arr [P ...]>`` a sequence of *exactly* that length;
  ``<dict {k: P ...}>`` a dictionary that has every key ``k`` with a matching value
  (other keys are allowed).
* **Binding numbers** are given in pre-order: ``<bind P>`` takes its number before the
  bindings inside ``P``; fields, items and conjuncts count left to right; dictionary
  entries in the Preserves order of their keys (Rust keeps them in an ordered map).
  So in ``<bind <arr [<bind <_>>]>>`` binding 0 is the whole sequence and binding 1 its
  item.
* **Templates**: ``<ref n>`` is binding ``n``; ``<lit v>`` is ``v``; ``<rec L [T ...]>``,
  ``<arr [T ...]>`` and ``<dict {k: T ...}>`` build compounds; ``<attenuate T [C ...]>``
  instantiates ``T``, which must yield an embedded reference, and wraps it so the caveats
  ``C ...`` apply to everything sent through it.  Here the result is
  ``Embedded(AttenuatedRef(target, Attenuation(C)))``, attenuating an already attenuated
  ref appends to its chain (as ``Cap::attenuate`` does).  If ``T`` yields anything but an
  embedded value the rewrite fails and the value is rejected.
* **Rewrite** runs its pattern; on a match the template's result replaces the value, on
  a miss the value is rejected.  **Or** tries its rewrites in order and uses the *first*
  whose pattern matches; if that one's template fails, the value is rejected (later
  alternatives are not tried), and an empty ``<or []>`` rejects everything.  **Reject**
  drops values matching its pattern and passes others unchanged.

Limits (our addition, for untrusted caveats): templates can duplicate bindings, so a
chain of holder-made caveats could otherwise blow a small value up exponentially.  A
rewrite whose template could grow its input -- using a binding twice, or a binding and
another one inside it, or placing a binding deeper than it was found -- has each result
measured, and rejected if it has more than :data:`MAX_REWRITE_NODES` nodes or is nested
deeper than the codecs' depth limit.  Other rewrites only rearrange (parts of) the input
and constants of the caveat, so their results need no measuring.

:meth:`Attenuation.apply` takes values as decoded by default (without annotations); it
never raises.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from ..dataspace import OBSERVE, Entity
from ..groups import OBSERVE_GROUP
from ..values import (
    Dictionary,
    Embedded,
    PreservesError,
    Record,
    Sequence,
    Set,
    Symbol,
    Value,
    encode,
    key,
    parse,
    preserve,
    sort_key,
    stringify,
    strip,
)
from ..values.model import MAX_DEPTH

__all__ = [
    "MAX_REWRITE_NODES",
    "SIG_BYTES",
    "AttenuatedEntity",
    "AttenuatedRef",
    "Attenuation",
    "Opaque",
    "SturdyError",
    "SturdyRef",
    "attenuate",
    "caveat_kind",
    "mint",
    "signature",
    "validate",
]

log = logging.getLogger(__name__)

SIG_BYTES = 16
"""Length of a signature: HMAC-BLAKE2s-256 truncated to 128 bits."""

MAX_REWRITE_NODES = 100_000
"""Largest value (counted in nodes: atoms, compounds, embedded) a rewriting caveat may
produce; larger results are rejected."""

REF = Symbol("ref")
OID = Symbol("oid")
SIG = Symbol("sig")
CAVEATS = Symbol("caveats")

PATTERN_HELP = (
    "patterns are <_>, <bind P>, <and [P ...]>, <not P>, <lit VALUE>, <rec LABEL [P ...]>, "
    "<arr [P ...]>, <dict {KEY: P ...}> or one of the type tests Boolean, Double, "
    "SignedInteger, String, ByteString, Symbol, Embedded (bare symbols)"
)
TEMPLATE_HELP = (
    "templates are <ref N>, <lit VALUE>, <rec LABEL [T ...]>, <arr [T ...]>, "
    "<dict {KEY: T ...}> or <attenuate T [CAVEAT ...]>"
)
CAVEAT_HELP = (
    "caveats are <rewrite PATTERN TEMPLATE>, <or [<rewrite ...> ...]> or <reject PATTERN>"
)


class SturdyError(ValueError):
    """A malformed sturdyref, caveat or key; the message says what is wrong and how to fix it."""


def _show(v: Any, width: int = 60) -> str:
    """A short Preserves-text rendering of ``v`` for error messages."""
    try:
        s = stringify(v, embedded=_embedded_text)
    except Exception:  # only for messages: never fail while reporting an error
        s = repr(v)
    return s if len(s) <= width else s[: width - 3] + "..."


def _embedded_text(obj: Any) -> Value:
    if isinstance(obj, AttenuatedRef):
        return Record(Symbol("attenuated"), [Sequence(obj.attenuation.caveats)])
    try:
        return preserve(obj)
    except TypeError:
        return Symbol(type(obj).__name__)


def _kind(v: Any) -> str:
    t = type(v)
    return {
        bool: "a boolean", float: "a double", int: "an integer", str: "a string",
        bytes: "a byte string", Symbol: "a symbol", Record: "a record",
        Sequence: "a sequence", Set: "a set", Dictionary: "a dictionary",
        Embedded: "an embedded reference",
    }.get(t, f"a {t.__name__}")


def _as_value(v: Any, what: str) -> Value:
    try:
        return strip(preserve(v))
    except TypeError as e:
        raise SturdyError(f"{what} must be a Preserves value: {e}") from None
    except RecursionError:
        raise SturdyError(
            f"{what} is nested too deeply (the limit is {MAX_DEPTH} levels)"
        ) from None


# ---------------------------------------------------------------------------------------
# Signatures


def _refuse_embedded(obj: Any) -> Value:
    raise SturdyError(
        "a sturdyref is plain data: its oid and caveats cannot contain embedded references "
        f"(found #:{_show(_embedded_text(obj), 30)}), because the signature covers their "
        "canonical binary encoding"
    )


def _encode(v: Value, what: str) -> bytes:
    try:
        return encode(v, embedded=_refuse_embedded)
    except SturdyError:
        raise
    except (TypeError, ValueError) as e:
        raise SturdyError(f"cannot encode the {what} canonically: {e}") from None


def _f(k: bytes, data: bytes) -> bytes:
    return hmac.new(k, data, hashlib.blake2s).digest()[:SIG_BYTES]


def _check_key(k: Any) -> bytes:
    if isinstance(k, bytes | bytearray | memoryview):
        return bytes(k)
    raise SturdyError(f"a key is a byte string, not {type(k).__name__}")


def signature(key: bytes, oid: Value, caveats: Iterable[Value] = ()) -> bytes:
    """The signature of a ref for ``oid`` with ``caveats`` under ``key`` (16 bytes)."""
    sig = _f(_check_key(key), _encode(_as_value(oid, "the oid"), "oid"))
    for c in caveats:
        sig = _f(sig, _encode(_as_value(c, "a caveat"), "caveat"))
    return sig


# ---------------------------------------------------------------------------------------
# SturdyRef


@dataclass(frozen=True, eq=False)
class SturdyRef:
    """A capability: ``<ref {oid: OID sig: SIG caveats: [CAVEAT ...]}>``.

    Build one with :func:`mint` (needs the key), :func:`attenuate` (does not),
    :meth:`from_value` or :meth:`parse`.  ``caveats`` is empty for an unattenuated ref.
    Equality is Preserves equality of the three parts.
    """

    oid: Value
    sig: bytes
    caveats: tuple[Value, ...] = ()

    def __post_init__(self) -> None:
        oid = _as_value(self.oid, "the oid")
        sig = self.sig
        if not isinstance(sig, bytes | bytearray | memoryview):
            raise SturdyError(
                f"sig must be a byte string (#x\"hex\" or #[base64]), not {_kind(sig)}"
            )
        sig = bytes(sig)
        if len(sig) != SIG_BYTES:
            raise SturdyError(
                f"sig must be {SIG_BYTES} bytes (a truncated HMAC-BLAKE2s), not {len(sig)}; "
                "was the ref copied whole?"
            )
        cs = self.caveats
        if isinstance(cs, str | bytes | Record | Mapping | AbstractSet) or not isinstance(
            cs, Iterable
        ):
            raise SturdyError(f"caveats must be a sequence of caveat values, not {_kind(cs)}")
        caveats = tuple(_as_value(c, "a caveat") for c in cs)
        _encode(oid, "oid")
        for c in caveats:
            _encode(c, "caveat")
        object.__setattr__(self, "oid", oid)
        object.__setattr__(self, "sig", sig)
        object.__setattr__(self, "caveats", caveats)

    def __eq__(self, other: object) -> bool:
        if type(other) is not SturdyRef:
            return NotImplemented
        return (
            self.sig == other.sig
            and key(self.oid) == key(other.oid)
            and key(Sequence(self.caveats)) == key(Sequence(other.caveats))
        )

    def __hash__(self) -> int:
        return hash((self.sig, key(self.oid), Sequence(self.caveats)))

    def to_value(self) -> Record:
        """The ``<ref {...}>`` record (no ``caveats`` key when there are none)."""
        params: dict[Value, Value] = {OID: self.oid, SIG: self.sig}
        if self.caveats:
            params[CAVEATS] = Sequence(self.caveats)
        return Record(REF, [Dictionary(params)])

    def __preserve__(self) -> Record:
        return self.to_value()

    @classmethod
    def from_value(cls, v: Value) -> SturdyRef:
        """Read a ``<ref {oid: ... sig: ... caveats: [...]}>`` value.

        Keys other than ``oid``, ``sig`` and ``caveats`` are ignored (the schema's
        dictionaries are open).  ``caveats: []`` is the same as no caveats.
        """
        v = _as_value(v, "a sturdyref")
        if type(v) is not Record:
            raise SturdyError(
                f"a sturdyref is a record <ref {{oid: ... sig: ...}}>, not {_kind(v)} ({_show(v)})"
            )
        if v.label != REF:
            raise SturdyError(
                f"a sturdyref's label is `ref`, not {_show(v.label)}: expected "
                "<ref {oid: ... sig: ...}>"
            )
        if len(v.fields) != 1:
            hint = ""
            if len(v.fields) == 3:
                hint = (
                    "; <ref OID [CAVEATS] SIG> is the layout of older Syndicate versions, write "
                    "<ref {oid: OID sig: SIG caveats: [CAVEATS]}> instead"
                )
            raise SturdyError(
                f"<ref> takes one field, the parameters {{oid: ... sig: ...}}; "
                f"found {len(v.fields)}{hint}"
            )
        params = v.fields[0]
        if type(params) is not Dictionary:
            raise SturdyError(
                f"the field of <ref> must be a dictionary {{oid: ... sig: ...}}, not {_kind(params)}"
            )
        for name in ("oid", "sig"):
            if Symbol(name) not in params:
                if name in params:
                    raise SturdyError(
                        f"the keys of a sturdyref are symbols: write {name}: ..., not \"{name}\": ..."
                    )
                raise SturdyError(f"the sturdyref has no `{name}` (it needs {{oid: ... sig: ...}})")
        sig = params[SIG]
        if type(sig) is not bytes:
            raise SturdyError(
                f"sig must be a byte string (#x\"hex\" or #[base64]), not {_kind(sig)} ({_show(sig)})"
            )
        caveats: Any = params.get(CAVEATS, Sequence())
        if type(caveats) is not Sequence:
            raise SturdyError(
                f"caveats must be a sequence [CAVEAT ...], not {_kind(caveats)} ({_show(caveats)})"
            )
        return cls(params[OID], sig, tuple(caveats))

    @classmethod
    def parse(cls, text: str) -> SturdyRef:
        """Read a sturdyref from Preserves text."""
        if not isinstance(text, str):
            raise SturdyError(f"expected Preserves text, not {type(text).__name__}")
        if not text.strip():
            raise SturdyError("no sturdyref: the text is empty")
        try:
            v = parse(text, max_length=1 << 20)
        except PreservesError as e:
            raise SturdyError(f"a sturdyref must be Preserves text <ref {{...}}>: {e}") from None
        return cls.from_value(v)

    def __str__(self) -> str:
        return stringify(self.to_value())

    def attenuation(self) -> Attenuation:
        """The compiled :class:`Attenuation` of this ref's caveats."""
        return Attenuation(self.caveats)


def mint(oid: Value, key: bytes) -> SturdyRef:
    """A new unattenuated ref for ``oid``, signed with the secret ``key``."""
    oid = _as_value(oid, "the oid")
    return SturdyRef(oid, signature(key, oid))


def attenuate(ref: SturdyRef, *caveats: Value) -> SturdyRef:
    """``ref`` with ``caveats`` appended (newest last); no key needed.

    Raises :class:`SturdyError` for an invalid caveat (see the module docstring); a caveat
    of unknown kind is accepted -- it makes the ref reject everything.
    """
    if not isinstance(ref, SturdyRef):
        raise SturdyError(f"attenuate() takes a SturdyRef, not {type(ref).__name__}")
    if not caveats:
        return ref
    cs = tuple(_as_value(c, "a caveat") for c in caveats)
    Attenuation(cs)  # validate
    sig = ref.sig
    for c in cs:
        sig = _f(sig, _encode(c, "caveat"))
    return SturdyRef(ref.oid, sig, ref.caveats + cs)


def validate(ref: SturdyRef, key: bytes) -> bool:
    """True when ``ref``'s signature was made with ``key`` (constant-time comparison).

    Only the signature is checked; build ``Attenuation(ref.caveats)`` to check the caveats.
    """
    try:
        expected = signature(key, ref.oid, ref.caveats)
    except SturdyError as e:
        log.debug("sturdyref cannot be validated: %s", e)
        return False
    return hmac.compare_digest(expected, ref.sig)


# ---------------------------------------------------------------------------------------
# Compiling caveats

Binds = list
Matcher = Callable[[Value, Binds], bool]
Builder = Callable[[Binds], Any]  # a value, or None when instantiation fails


class _NotCaveat(Exception):
    """The value does not parse as a Rewrite/Alts/Reject: an unknown caveat."""


class _Ctx:
    """Problems found in a caveat that parses (reported only if the whole caveat parses)."""

    __slots__ = ("problems",)

    def __init__(self) -> None:
        self.problems: list[str] = []


class _Scope:
    """The bindings of one pattern, numbered in pre-order as the pattern is compiled.

    For each binding: its depth in the pattern and the numbers of the bindings around it
    (used to tell whether a template can duplicate part of the input).
    """

    __slots__ = ("binds", "negated")

    def __init__(self) -> None:
        self.binds: list[tuple[int, frozenset[int]]] = []
        self.negated = False  # a <bind> sits under a <not>


_TYPE_TESTS: dict[str, type] = {
    "Boolean": bool,
    "Double": float,
    "SignedInteger": int,
    "String": str,
    "ByteString": bytes,
    "Symbol": Symbol,
    "Embedded": Embedded,
}


def _match_any(v: Value, b: Binds) -> bool:
    return True


def _type_test(t: type) -> Matcher:
    def m(v: Value, b: Binds) -> bool:
        return type(v) is t

    return m


def _record_parts(v: Value, what: str, help_text: str) -> tuple[str, tuple[Any, ...]]:
    if type(v) is not Record or type(v.label) is not Symbol:
        raise _NotCaveat(f"{_show(v)} is not {what}: {help_text}")
    return v.label.name, v.fields


def _all_of(ms: tuple[Matcher, ...]) -> Matcher:
    def m_and(v: Value, b: Binds) -> bool:
        for m in ms:
            if not m(v, b):
                return False
        return True

    return m_and


def _compile_pattern(
    p: Value, scope: _Scope, depth: int = 0, outer: frozenset[int] = frozenset()
) -> Matcher:
    """A matcher for pattern ``p``; its bindings are recorded in ``scope``."""
    if type(p) is Symbol:
        t = _TYPE_TESTS.get(p.name)
        if t is None:
            raise _NotCaveat(
                f"the symbol {_show(p)} is not a pattern: bare symbols are the type tests "
                f"{', '.join(_TYPE_TESTS)}; to match the symbol itself write <lit {_show(p)}>"
            )
        return _type_test(t)
    if type(p) is Record and p.fields == () and type(p.label) is Symbol and p.label.name in _TYPE_TESTS:
        raise _NotCaveat(
            f"{_show(p)} is not a pattern: type tests are bare symbols, write {p.label.name} "
            f"instead of <{p.label.name}>"
        )
    label, fs = _record_parts(p, "a pattern", PATTERN_HELP)
    n = len(fs)
    if label == "_" and n == 0:
        return _match_any
    if label == "bind" and n == 1:
        number = len(scope.binds)
        scope.binds.append((depth, outer))
        inner = _compile_pattern(fs[0], scope, depth, outer | {number})
        if inner is _match_any:

            def m_bind_any(v: Value, b: Binds) -> bool:
                b.append(v)
                return True

            return m_bind_any

        def m_bind(v: Value, b: Binds) -> bool:
            b.append(v)
            return inner(v, b)

        return m_bind
    if label == "lit" and n == 1:
        klit = key(fs[0])

        def m_lit(v: Value, b: Binds) -> bool:
            return key(v) == klit

        return m_lit
    if label == "and" and n == 1 and type(fs[0]) is Sequence:
        return _all_of(tuple(_compile_pattern(x, scope, depth, outer) for x in fs[0]))
    if label == "not" and n == 1:
        before = len(scope.binds)
        inner = _compile_pattern(fs[0], scope, depth, outer)
        if len(scope.binds) > before:
            scope.negated = True

        def m_not(v: Value, b: Binds) -> bool:
            return not inner(v, [])

        return m_not
    if label == "rec" and n == 2 and type(fs[1]) is Sequence:
        klabel = key(fs[0])
        ms = tuple(_compile_pattern(x, scope, depth + 1, outer) for x in fs[1])
        arity = len(ms)

        def m_rec(v: Value, b: Binds) -> bool:
            if type(v) is not Record or len(v.fields) != arity or key(v.label) != klabel:
                return False
            for m, x in zip(ms, v.fields):
                if not m(x, b):
                    return False
            return True

        return m_rec
    if label == "arr" and n == 1 and type(fs[0]) is Sequence:
        ms = tuple(_compile_pattern(x, scope, depth + 1, outer) for x in fs[0])
        length = len(ms)

        def m_arr(v: Value, b: Binds) -> bool:
            if type(v) is not Sequence or len(v) != length:
                return False
            for m, x in zip(ms, v):
                if not m(x, b):
                    return False
            return True

        return m_arr
    if label == "dict" and n == 1 and type(fs[0]) is Dictionary:
        # Entries in the Preserves order of their keys: this fixes the binding numbers.
        entries = sorted(fs[0].items(), key=lambda kv: sort_key(kv[0]))
        ks = tuple((k, _compile_pattern(x, scope, depth + 1, outer)) for k, x in entries)
        missing = object()

        def m_dict(v: Value, b: Binds) -> bool:
            if type(v) is not Dictionary:
                return False
            for k, m in ks:
                x = v.get(k, missing)
                if x is missing or not m(x, b):
                    return False
            return True

        return m_dict
    raise _NotCaveat(f"<{label}> with {n} field(s) is not a pattern: {PATTERN_HELP}")


def _instantiate_all(bs: tuple[Builder, ...], b: Binds) -> list[Value] | None:
    out = []
    for bld in bs:
        x = bld(b)
        if x is None:
            return None
        out.append(x)
    return out


def _compile_template(t: Value, ctx: _Ctx, uses: list[tuple[int, int]], depth: int = 0) -> Builder:
    """A builder for template ``t``; each ``<ref n>`` is recorded in ``uses`` as (n, depth)."""
    label, fs = _record_parts(t, "a template", TEMPLATE_HELP)
    n = len(fs)
    if label == "ref" and n == 1 and type(fs[0]) is int:
        i = fs[0]
        if i < 0:
            ctx.problems.append(f"<ref {i}> refers to a negative binding number")
            return lambda b: None
        uses.append((i, depth))

        def t_ref(b: Binds) -> Value:
            return b[i]

        return t_ref
    if label == "lit" and n == 1:
        lit = fs[0]
        return lambda b: lit
    if label == "rec" and n == 2 and type(fs[1]) is Sequence:
        lab = fs[0]
        bs = tuple(_compile_template(x, ctx, uses, depth + 1) for x in fs[1])

        def t_rec(b: Binds) -> Value | None:
            out = _instantiate_all(bs, b)
            return None if out is None else Record(lab, out)

        return t_rec
    if label == "arr" and n == 1 and type(fs[0]) is Sequence:
        bs = tuple(_compile_template(x, ctx, uses, depth + 1) for x in fs[0])

        def t_arr(b: Binds) -> Value | None:
            out = _instantiate_all(bs, b)
            return None if out is None else Sequence(out)

        return t_arr
    if label == "dict" and n == 1 and type(fs[0]) is Dictionary:
        items = fs[0].items()
        ks = tuple(k for k, _x in items)
        bs = tuple(_compile_template(x, ctx, uses, depth + 1) for _k, x in items)

        def t_dict(b: Binds) -> Value | None:
            out = _instantiate_all(bs, b)
            return None if out is None else Dictionary(zip(ks, out))

        return t_dict
    if label == "attenuate" and n == 2 and type(fs[1]) is Sequence:
        inner = _compile_template(fs[0], ctx, uses, depth)
        try:
            att: Attenuation | None = Attenuation(fs[1])
        except SturdyError as e:
            ctx.problems.append(f"in <attenuate>: {e}")
            att = None

        def t_attenuate(b: Binds) -> Value | None:
            r = inner(b)
            if type(r) is not Embedded or att is None:
                return None
            if att.is_identity:
                return r
            target = r.value
            if type(target) is AttenuatedRef:
                return Embedded(AttenuatedRef(target.target, target.attenuation.then(att)))
            return Embedded(AttenuatedRef(target, att))

        return t_attenuate
    raise _NotCaveat(f"<{label}> with {n} field(s) is not a template: {TEMPLATE_HELP}")


class _Rewrite:
    """A compiled ``<rewrite PATTERN TEMPLATE>``.

    ``measure`` is set when the template could make the value bigger than the input plus
    the template itself -- by using a binding twice, or a binding and another inside it --
    or nest it deeper (a binding placed deeper than it was found): only then is each
    result measured against the limits.
    """

    __slots__ = ("build", "match", "measure")

    def __init__(self, v: Value, ctx: _Ctx) -> None:
        label, fs = _record_parts(v, "a rewrite", "a rewrite is <rewrite PATTERN TEMPLATE>")
        if label != "rewrite" or len(fs) != 2:
            raise _NotCaveat(f"{_show(v)} is not a rewrite: write <rewrite PATTERN TEMPLATE>")
        scope = _Scope()
        self.match = _compile_pattern(fs[0], scope)
        uses: list[tuple[int, int]] = []
        self.build = _compile_template(fs[1], ctx, uses)
        self.measure = True
        nbinds = len(scope.binds)
        if scope.negated:
            ctx.problems.append(
                "a <bind> inside <not> can never capture anything (the value did not match); "
                "remove the <bind> from under the <not>"
            )
            return
        need = max((i + 1 for i, _d in uses), default=0)
        if need > nbinds:
            ctx.problems.append(
                f"the template uses <ref {need - 1}> but the pattern has only {nbinds} "
                "binding(s), numbered from 0 in the order the <bind>s appear"
            )
            return
        used = {i for i, _d in uses}
        duplicates = len(used) < len(uses) or any(scope.binds[i][1] & used for i in used)
        deeper = any(d > scope.binds[i][0] for i, d in uses)
        self.measure = duplicates or deeper


Step = Callable[[Value], Any]


def _reject_all(v: Value) -> None:
    return None


def _bounded(v: Value) -> bool:
    """True when ``v`` has at most MAX_REWRITE_NODES nodes and nests at most MAX_DEPTH."""
    budget = MAX_REWRITE_NODES
    stack: list[tuple[Any, int]] = [(v, 0)]
    pop = stack.pop
    push = stack.append
    while stack:
        x, d = pop()
        budget -= 1
        if budget < 0 or d > MAX_DEPTH:
            return False
        t = type(x)
        if t is Record:
            push((x.label, d + 1))
            for y in x.fields:
                push((y, d + 1))
        elif t is Sequence or t is Set:
            for y in x:
                push((y, d + 1))
        elif t is Dictionary:
            for k, y in x.items():
                push((k, d + 1))
                push((y, d + 1))
        elif t is Embedded and type(x.value) is not AttenuatedRef:
            inner = x.value
            if type(inner) in (Record, Sequence, Set, Dictionary):
                push((inner, d + 1))
    return True


def _step_for(rewrites: list[_Rewrite]) -> Step:
    if len(rewrites) == 1:
        (rw,) = rewrites
        match, build, measure = rw.match, rw.build, rw.measure

        def step_rewrite(v: Value) -> Any:
            b: Binds = []
            if not match(v, b):
                return None
            r = build(b)
            if measure and r is not None and not _bounded(r):
                log.info("attenuation: rewrite result too large, rejected")
                return None
            return r

        return step_rewrite
    alts = tuple((rw.match, rw.build, rw.measure) for rw in rewrites)

    def step_alts(v: Value) -> Any:
        for match, build, measure in alts:
            b: Binds = []
            if match(v, b):
                r = build(b)
                if measure and r is not None and not _bounded(r):
                    log.info("attenuation: rewrite result too large, rejected")
                    return None
                return r
        return None

    return step_alts


def _compile_caveat(c: Value) -> tuple[str, Step, str | None]:
    """(kind, step, why it is unknown).  Raises SturdyError for an invalid caveat."""
    ctx = _Ctx()
    try:
        if type(c) is not Record or type(c.label) is not Symbol:
            raise _NotCaveat(f"{_show(c)} is {_kind(c)}, not a caveat: {CAVEAT_HELP}")
        label, fs = c.label.name, c.fields
        if label == "rewrite" and len(fs) == 2:
            kind, step = "rewrite", _step_for([_Rewrite(c, ctx)])
        elif label == "or" and len(fs) == 1 and type(fs[0]) is Sequence:
            rws = [_Rewrite(x, ctx) for x in fs[0]]
            kind, step = "or", (_step_for(rws) if rws else _reject_all)
        elif label == "reject" and len(fs) == 1:
            match = _compile_pattern(fs[0], _Scope())

            def step_reject(v: Value) -> Any:
                return None if match(v, []) else v

            kind, step = "reject", step_reject
        else:
            raise _NotCaveat(
                f"<{label}> with {len(fs)} field(s) is not a caveat: {CAVEAT_HELP}"
            )
    except _NotCaveat as e:
        return "unknown", _reject_all, str(e)
    except RecursionError:
        raise SturdyError("the caveat is nested too deeply to compile") from None
    if ctx.problems:
        raise SturdyError(f"invalid caveat {_show(c)}: {'; '.join(ctx.problems)}")
    return kind, step, None


def caveat_kind(caveat: Value) -> tuple[str, str | None]:
    """Classify a caveat: ``("rewrite" | "or" | "reject" | "unknown", reason)``.

    ``reason`` explains why an unknown caveat does not parse (``None`` otherwise).
    Raises :class:`SturdyError` for a caveat that parses but is invalid.
    """
    kind, _step, why = _compile_caveat(_as_value(caveat, "a caveat"))
    return kind, why


# ---------------------------------------------------------------------------------------
# Attenuation


class Attenuation:
    """A compiled chain of caveats: :meth:`apply` runs it on one value.

    ``Attenuation(caveats)`` takes caveat values oldest first (as in a sturdyref or a
    ``WireRef``).  Unknown caveat kinds are accepted and reject everything (their reasons
    are in :attr:`unknown`); invalid caveats raise :class:`SturdyError`.
    Attenuations compare and hash by their caveat values.
    """

    __slots__ = ("_hash", "_steps", "caveats", "unknown")

    caveats: tuple[Value, ...]
    unknown: tuple[tuple[int, str], ...]
    """``(position, reason)`` for each caveat of unknown kind."""

    def __init__(self, caveats: Iterable[Value] = ()) -> None:
        if isinstance(caveats, Attenuation):
            self._init_from(caveats.caveats, caveats._steps, caveats.unknown)
            return
        if isinstance(caveats, str | bytes | Record | Mapping | AbstractSet) or not isinstance(
            caveats, Iterable
        ):
            raise SturdyError(
                f"an attenuation is built from a sequence of caveats, not {_kind(caveats)}"
            )
        cs = tuple(_as_value(c, "a caveat") for c in caveats)
        steps = []
        unknown = []
        for i, c in enumerate(cs):
            _kind_name, step, why = _compile_caveat(c)
            if why is not None:
                log.debug("caveat %d is of unknown kind and rejects everything: %s", i, why)
                unknown.append((i, why))
            steps.append(step)
        self._init_from(cs, tuple(steps), tuple(unknown))

    def _init_from(
        self, cs: tuple[Value, ...], steps: tuple[Step, ...], unknown: tuple[tuple[int, str], ...]
    ) -> None:
        self.caveats = cs
        self._steps = steps
        self.unknown = unknown
        self._hash: int | None = None

    @property
    def is_identity(self) -> bool:
        """True when there are no caveats (every value passes unchanged)."""
        return not self._steps

    def apply(self, value: Value) -> Value | None:
        """Run the caveats, newest first: the rewritten value, or None if rejected."""
        steps = self._steps
        if not steps:
            return value
        try:
            for step in reversed(steps):
                value = step(value)
                if value is None:
                    return None
        except (RecursionError, TypeError, ValueError) as e:  # pragma: no cover - defensive
            log.warning("attenuation failed on a value (rejected): %r", e)
            return None
        return value

    def then(self, newer: Iterable[Value] | Attenuation) -> Attenuation:
        """This chain with ``newer`` caveats appended (they will run first)."""
        other = newer if isinstance(newer, Attenuation) else Attenuation(newer)
        if other.is_identity:
            return self
        if self.is_identity:
            return other
        r = Attenuation.__new__(Attenuation)
        shift = len(self.caveats)
        r._init_from(
            self.caveats + other.caveats,
            self._steps + other._steps,
            self.unknown + tuple((i + shift, why) for i, why in other.unknown),
        )
        return r

    def __len__(self) -> int:
        return len(self.caveats)

    def __eq__(self, other: object) -> bool:
        if type(other) is not Attenuation:
            return NotImplemented
        return self is other or Sequence(self.caveats) == Sequence(other.caveats)

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = self._hash = hash(Sequence(self.caveats)) ^ 0x51ED270B
        return h

    def __repr__(self) -> str:
        return f"Attenuation([{', '.join(_show(c) for c in self.caveats)}])"


@dataclass(frozen=True)
class AttenuatedRef:
    """An embedded reference with caveats attached, made by ``<attenuate T [C ...]>``.

    ``target`` is the object the reference stood for (the content of the
    :class:`~dataspace.values.Embedded`); whatever is asserted or sent *through* this
    reference must pass ``attenuation`` first (wrap the target in
    :class:`AttenuatedEntity`, or send its caveats along in a ``WireRef``).
    """

    target: Any
    attenuation: Attenuation

    @property
    def caveats(self) -> tuple[Value, ...]:
        return self.attenuation.caveats


class AttenuatedEntity(Entity):
    """An entity that passes what it receives through an :class:`Attenuation` to ``target``.

    Rejected assertions are dropped; their retractions are dropped too.  Only the handles
    actually forwarded are remembered, and each is forgotten when it is retracted, so the
    memory used is proportional to the assertions currently forwarded.

    What the holder learns through its subscriptions is attenuated too: the observer of
    an ``<Observe P #:observer>`` -- or of an ``<ObserveGroup G P #:observer>``, a
    member of a group (:mod:`dataspace.groups`) -- that passes the caveats is wrapped (see
    :class:`_Revealing`), so that every reference the dataspace shows it carries the same
    caveats (it cannot deliver through them what it could not assert or send here), and
    the observer references of other subscriptions are :class:`Opaque` (it can see and
    count them, never make their callbacks fire).
    """

    def __init__(self, target: Entity, attenuation: Attenuation | Iterable[Value]) -> None:
        self.target = target
        self.attenuation = (
            attenuation if isinstance(attenuation, Attenuation) else Attenuation(attenuation)
        )
        self._forwarded: set[int] = set()

    @property
    def alive(self) -> bool:
        """False once the entity behind it can no longer receive anything."""
        return getattr(self.target, "alive", True) is not False

    def is_observer(self, obj: Any) -> bool:
        """Whether ``obj`` observes in the dataspace behind this entity (if it knows)."""
        f = getattr(self.target, "is_observer", None)
        return bool(f(obj)) if f is not None else False

    def on_assert(self, value: Value, handle: int) -> None:
        r = self.attenuation.apply(value)
        if r is None:
            log.debug("attenuated entity: assertion dropped by its caveats")
            return
        if type(r) is Record and not self.attenuation.is_identity:
            lab = r.label
            if lab == OBSERVE:
                if len(r.fields) == 2:
                    r = self._reveal_through(r, 1)
            elif lab == OBSERVE_GROUP and len(r.fields) in (3, 4):
                # A member of a group is told what an observer is: through the caveats.
                r = self._reveal_through(r, 2)
        self._forwarded.add(handle)
        self.target.on_assert(r, handle)

    def _reveal_through(self, observe: Record, at: int) -> Record:
        """``<Observe P #:observer>`` (``at`` 1) or ``<ObserveGroup G P #:observer ...>``
        (``at`` 2) with its observer wrapped in :class:`_Revealing`."""
        if type(observe.fields[at]) is not Embedded:
            return observe
        obs = observe.fields[at].value
        if type(obs) is AttenuatedRef and isinstance(obs.target, Entity):
            # A caveat's <attenuate> template restricts what the holder is told.
            obs = AttenuatedEntity(obs.target, obs.attenuation)
        if not isinstance(obs, Entity):
            return observe
        fields = list(observe.fields)
        fields[at] = Embedded(_Revealing(obs, self))
        return Record._make(observe.label, tuple(fields))

    def on_retract(self, handle: int) -> None:
        try:
            self._forwarded.remove(handle)
        except KeyError:
            return
        self.target.on_retract(handle)

    def on_message(self, value: Value) -> None:
        r = self.attenuation.apply(value)
        if r is None:
            log.debug("attenuated entity: message dropped by its caveats")
            return
        self.target.on_message(r)

    @property
    def forwarded(self) -> int:
        """How many assertions are currently forwarded (and remembered)."""
        return len(self._forwarded)


class Opaque:
    """A reference its holder may see but not use: what a holder of an attenuated
    capability is shown in place of another subscription's observer.

    Two opaque references to the same object are equal (a ``during`` over
    ``<Observe $p $o>`` sees each observer come and go); nothing sent to one is delivered.
    """

    __slots__ = ("_ref",)

    def __init__(self, ref: Any) -> None:
        self._ref = ref

    def __eq__(self, other: object) -> bool:
        return type(other) is Opaque and other._ref is self._ref

    def __hash__(self) -> int:
        return id(self._ref) ^ 0x0BAC0E5

    def __repr__(self) -> str:
        return "<opaque reference>"


class _Revealing(Entity):
    """The observer of a subscription made through caveats: what the dataspace tells it
    is passed on with every embedded reference attenuated by those caveats, and with the
    observers of other subscriptions made :class:`Opaque`.  References that belong to
    the holder's own connection pass unchanged."""

    def __init__(self, target: Entity, gate: AttenuatedEntity) -> None:
        self.target = target
        self.gate = gate

    @property
    def alive(self) -> bool:
        return getattr(self.target, "alive", True) is not False

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is _Revealing
            and other.target is self.target  # type: ignore[attr-defined]
            and other.gate.attenuation == self.gate.attenuation  # type: ignore[attr-defined]
        )

    def __hash__(self) -> int:
        return id(self.target) ^ hash(self.gate.attenuation)

    def on_assert(self, value: Value, handle: int) -> None:
        self.target.on_assert(self._reveal(value), handle)

    def on_retract(self, handle: int) -> None:
        self.target.on_retract(handle)

    def on_message(self, value: Value) -> None:
        self.target.on_message(self._reveal(value))

    def _reveal(self, v: Value) -> Value:
        t = type(v)
        if t is Embedded:
            return Embedded(self._ref(v.value))
        if t is Record:
            fields = v.fields
            new = [self._reveal(x) for x in fields]
            if all(map(_same, new, fields)):
                return v
            return Record._make(v.label, tuple(new))
        if t is Sequence:
            new = [self._reveal(x) for x in v]
            return v if all(map(_same, new, v)) else tuple.__new__(Sequence, new)
        if t is Set or t is Dictionary:
            items = list(v.items()) if t is Dictionary else list(v)
            if not any(_has_embedded(x) for x in items):
                return v
            if t is Set:
                return Set([self._reveal(x) for x in items])
            return Dictionary([(self._reveal(k), self._reveal(x)) for k, x in items])
        return v

    def _ref(self, obj: Any) -> Any:
        holder = self.target
        while type(holder) is AttenuatedEntity:
            holder = holder.target
        own = getattr(holder, "relay", None)
        if own is not None and getattr(obj, "relay", None) is own:
            return obj  # the holder's own object, back to it
        if type(obj) is Opaque:
            return obj
        if self.gate.is_observer(obj):
            return Opaque(obj)
        if isinstance(obj, Entity):
            return AttenuatedRef(obj, self.gate.attenuation)
        if type(obj) is AttenuatedRef:
            return AttenuatedRef(obj.target, obj.attenuation.then(self.gate.attenuation))
        return obj  # not something that can be sent to


def _same(a: Any, b: Any) -> bool:
    return a is b


def _has_embedded(v: Any) -> bool:
    if type(v) is tuple:  # a dictionary item
        return any(map(_has_embedded, v))
    t = type(v)
    if t is Embedded:
        return True
    if t is Record:
        return any(map(_has_embedded, v.fields))
    if t is Sequence or t is Set:
        return any(map(_has_embedded, v))
    if t is Dictionary:
        return any(_has_embedded(k) or _has_embedded(x) for k, x in v.items())
    return False


def attenuation_pattern(pattern: Any) -> Value:
    """Translate a dataspace pattern (e.g. from the concise syntax) into the attenuation
    pattern language, matching exactly the shape written.

    Records and sequences keep the arity written (``<Says "alice" _>`` matches two-field
    ``Says`` records only: attenuation patterns are exact, unlike dataspace patterns);
    gaps become ``<_>``; binds become their subpatterns (a filter has no use for them).
    """
    from ..pattern import Arr, Bind, Dict, Discard, Lit, Rec

    t = type(pattern)
    if t is Discard:
        return Record(Symbol("_"), [])
    if t is Bind:
        return attenuation_pattern(pattern.pattern)
    if t is Lit:
        return Record(Symbol("lit"), [pattern.value])
    if t is Rec or t is Arr:
        items = dict(pattern.fields if t is Rec else pattern.items)
        n = max(items) + 1 if items else 0
        subs = Sequence(
            attenuation_pattern(items[i]) if i in items else Record(Symbol("_"), [])
            for i in range(n)
        )
        if t is Rec:
            return Record(Symbol("rec"), [pattern.label, subs])
        return Record(Symbol("arr"), [subs])
    if t is Dict:
        return Record(
            Symbol("dict"), [Dictionary((k, attenuation_pattern(x)) for k, x in pattern.entries)]
        )
    raise TypeError(f"not a pattern: {pattern!r}")

