"""The Syndicate wire protocol: packets, events and wire references (protocol.prs).

A connection carries *packets*, each one binary Preserves value::

    Packet    = Turn / Error / Extension / Nop
    Turn      = [[oid Event] ...]
    Event     = <A assertion handle> / <R handle> / <M body> / <S #:peer>
    Error     = <error message detail>
    Extension = any other record (ignored)
    Nop       = #f

Over a byte stream (TCP, Unix sockets) packets are simply concatenated; over WebSocket each
packet is one binary message.

Embedded values (``#:x``) inside packets are *wire references* (sturdy.prs ``WireRef``),
written from the sender's point of view:

* ``[0 oid]`` -- "mine": an object the sender exports under ``oid``;
* ``[1 oid caveat ...]`` -- "yours": an object the receiver exported under ``oid``, with
  optional caveats (attenuation) the receiver must apply to whatever is sent through it.

This module holds the data types and the validating reader used by tests and tools;
:mod:`dataspace.protocol.relay` reads packets with an inline fast path of the same rules
(decoding each packet exactly once).

>>> from dataspace.values import decode
>>> v = decode(encode_packet(Turn([TurnEvent(0, Message("hi"))])), embedded=WireRef.from_value)
>>> parse_packet(v)
Turn(events=[TurnEvent(oid=0, event=Message(body='hi'))])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from ..values import Embedded, Record, Sequence, Symbol, Value, encode, stringify

__all__ = [
    "ASSERT",
    "ERROR",
    "MESSAGE",
    "RETRACT",
    "SYNC",
    "Assert",
    "Error",
    "Event",
    "Extension",
    "Message",
    "Nop",
    "Packet",
    "ProtocolError",
    "Retract",
    "Sync",
    "Turn",
    "TurnEvent",
    "WireRef",
    "encode_packet",
    "error_packet",
    "parse_packet",
    "short",
]

ASSERT = Symbol("A")
RETRACT = Symbol("R")
MESSAGE = Symbol("M")
SYNC = Symbol("S")
ERROR = Symbol("error")


class ProtocolError(ValueError):
    """The peer broke the protocol; ``detail`` is a Preserves value for the error packet."""

    def __init__(self, message: str, detail: Value = False) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


def short(v: Any, width: int = 80) -> str:
    """Preserves text of ``v`` cut to ``width`` characters (for error messages and logs)."""
    try:
        s = stringify(v, embedded=_embedded_text)
    except Exception:  # pragma: no cover - defensive: never fail while reporting
        s = repr(v)
    return s if len(s) <= width else s[: width - 3] + "..."


def _embedded_text(obj: Any) -> Value:
    if isinstance(obj, WireRef):
        return obj.to_value()
    return Symbol(f"<{type(obj).__name__}>")


class WireRef:
    """A reference as written on the wire (``[0 oid]`` or ``[1 oid caveat ...]``).

    ``mine`` is from the *sender's* point of view: True for an object the sender exports.
    Wire references compare by value.
    """

    __slots__ = ("caveats", "mine", "oid")

    def __init__(self, mine: bool, oid: int, caveats: tuple[Value, ...] = ()) -> None:
        self.mine = mine
        self.oid = oid
        self.caveats = caveats

    @classmethod
    def from_value(cls, v: Value) -> WireRef:
        """Read ``[0 oid]`` / ``[1 oid caveat ...]``; raises :class:`ProtocolError`."""
        if type(v) is Sequence and len(v) >= 2:
            tag, oid = v[0], v[1]
            if type(oid) is int and oid >= 0 and type(tag) is int:
                if tag == 0 and len(v) == 2:
                    return cls(True, oid)
                if tag == 1:
                    return cls(False, oid, tuple(v[2:]))
        raise ProtocolError(
            f"malformed wire reference {short(v)}: expected [0 oid] or [1 oid caveat ...]",
            v,
        )

    def to_value(self) -> Sequence:
        if self.mine:
            return Sequence((0, self.oid))
        return Sequence((1, self.oid, *self.caveats))

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is WireRef
            and self.mine == other.mine  # type: ignore[attr-defined]
            and self.oid == other.oid  # type: ignore[attr-defined]
            and Sequence(self.caveats) == Sequence(other.caveats)  # type: ignore[attr-defined]
        )

    def __hash__(self) -> int:
        return hash((self.mine, self.oid, Sequence(self.caveats)))

    def __repr__(self) -> str:
        return f"WireRef({short(self.to_value())})"


# ---------------------------------------------------------------------------------------
# Packets and events (the readable representation)


@dataclass
class Assert:
    assertion: Value
    handle: int


@dataclass
class Retract:
    handle: int


@dataclass
class Message:
    body: Value


@dataclass
class Sync:
    peer: Any  # a WireRef as read off the wire


Event: TypeAlias = Assert | Retract | Message | Sync


@dataclass
class TurnEvent:
    oid: int
    event: Event


@dataclass
class Turn:
    events: list[TurnEvent] = field(default_factory=list)


@dataclass
class Error:
    message: str
    detail: Value


@dataclass
class Extension:
    label: Value
    fields: tuple[Value, ...]


@dataclass
class Nop:
    pass


Packet: TypeAlias = Turn | Error | Extension | Nop


def _handle(v: Value, where: Value) -> int:
    if type(v) is not int:
        raise ProtocolError(f"a handle must be an integer, not {short(v)}", where)
    return v


def parse_event(e: Value) -> Event:
    """Read one ``Event`` record; raises :class:`ProtocolError`."""
    if type(e) is Record:
        label, f = e.label, e.fields
        n = len(f)
        if label == ASSERT and n == 2:
            return Assert(f[0], _handle(f[1], e))
        if label == RETRACT and n == 1:
            return Retract(_handle(f[0], e))
        if label == MESSAGE and n == 1:
            return Message(f[0])
        if label == SYNC and n == 1:
            if type(f[0]) is not Embedded:
                raise ProtocolError(f"<S> needs an embedded peer reference, not {short(f[0])}", e)
            return Sync(f[0].value)
    raise ProtocolError(
        f"malformed event {short(e)}: expected <A assertion handle>, <R handle>, <M body> "
        "or <S #:peer>",
        e,
    )


def parse_packet(v: Value) -> Packet:
    """Read a decoded packet value into :class:`Turn`, :class:`Error`, ... objects."""
    if type(v) is Sequence:
        events = []
        for te in v:
            if type(te) is not Sequence or len(te) != 2:
                raise ProtocolError(f"malformed turn event {short(te)}: expected [oid event]", te)
            oid = te[0]
            if type(oid) is not int or oid < 0:
                raise ProtocolError(f"an OID must be a non-negative integer, not {short(oid)}", te)
            events.append(TurnEvent(oid, parse_event(te[1])))
        return Turn(events)
    if type(v) is Record:
        if v.label == ERROR and len(v.fields) == 2 and type(v.fields[0]) is str:
            return Error(v.fields[0], v.fields[1])
        return Extension(v.label, v.fields)
    if v is False:
        return Nop()
    raise ProtocolError(
        f"malformed packet {short(v)}: expected a turn [[oid event] ...], <error ...>, "
        "an extension record or #f",
        v,
    )


def _event_value(e: Event) -> Record:
    if isinstance(e, Assert):
        return Record._make(ASSERT, (e.assertion, e.handle))
    if isinstance(e, Retract):
        return Record._make(RETRACT, (e.handle,))
    if isinstance(e, Message):
        return Record._make(MESSAGE, (e.body,))
    if isinstance(e, Sync):
        return Record._make(SYNC, (Embedded(e.peer),))
    raise TypeError(f"not an event: {e!r}")


def packet_value(p: Packet) -> Value:
    """The Preserves value of a packet object (embedded objects left as they are)."""
    if isinstance(p, Turn):
        return Sequence(Sequence((te.oid, _event_value(te.event))) for te in p.events)
    if isinstance(p, Error):
        return Record._make(ERROR, (p.message, p.detail))
    if isinstance(p, Extension):
        return Record._make(p.label, tuple(p.fields))
    if isinstance(p, Nop):
        return False
    raise TypeError(f"not a packet: {p!r}")


def _wireref_out(obj: Any) -> Value:
    if isinstance(obj, WireRef):
        return obj.to_value()
    raise TypeError(f"embedded {type(obj).__name__} in a packet: only WireRefs can be written")


def encode_packet(p: Packet | Value, embedded: Callable[[Any], Value] | None = None) -> bytes:
    """Binary encoding of a packet (object or value); embedded WireRefs are written as such."""
    v = p if not isinstance(p, Turn | Error | Extension | Nop) else packet_value(p)
    return encode(v, embedded=embedded or _wireref_out)


def error_packet(message: str, detail: Value = False) -> bytes:
    """The encoding of ``<error message detail>``.

    A detail that cannot be written as plain data (it holds embedded references) is
    replaced by its text.
    """
    try:
        return encode(Record._make(ERROR, (message, detail)))
    except (TypeError, ValueError):
        return encode(Record._make(ERROR, (message, short(detail, 200))))
