"""The relay: a sans-IO machine for one connection speaking the Syndicate protocol.

Like h11 or wsproto, a :class:`Relay` never touches a socket, a clock or a task.  Its host
(an asyncio adapter in :mod:`dataspace.net`, or a test) moves bytes in and out::

    relay = Relay(limits=RelayLimits(), on_dirty=schedule_flush)
    relay.export_at(0, gatekeeper)           # what the peer sees at OID 0
    relay.receive_data(chunk)                # bytes off a stream (packets concatenated)
    relay.receive_packet(message)            # or one packet (a WebSocket message)
    for packet in relay.take_packets():      # bytes to send, one packet each
        transport.write(packet)
    if relay.wants_close: ...                # after a protocol error: send, then close
    relay.close()                            # the connection is gone: retract everything

Between the wire and local objects the relay is a *membrane*:

* inbound events are applied to the local :class:`~dataspace.dataspace.Entity` the peer
  addressed by OID (``on_assert``/``on_retract``/``on_message``), under handles of the
  relay's own (the peer's handles live in a per-connection table);
* ``[0 oid]`` references from the peer become :class:`RemoteEntity` proxies: whatever is
  asserted, retracted or sent to a proxy is queued as outbound events;
* local objects inside outbound values are exported under fresh OIDs.

Both directions are reference counted: an imported proxy stays in the table while
assertions mention it, an exported OID while assertions in either direction mention it
(or while events target it), as in the Syndicate implementations.

Outbound events are grouped into one Turn packet until :meth:`Relay.take_packets` is
called (a packet is cut early at ``RelayLimits.max_outbound_packet`` bytes).

Protocol errors -- malformed or oversized packets, unknown OIDs, duplicate or unknown
handles, too many assertions or references -- queue an ``<error message detail>`` packet,
set :attr:`Relay.wants_close`, and retract everything the peer asserted.  A relay never
raises on bad input.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from operator import is_
from typing import Any

from mypy_extensions import mypyc_attr

from ..dataspace import OBSERVE, Encoded, Entity, TurnTooLarge, fresh_handle
from ..values import (
    DecodeError,
    Decoder,
    DecodeShort,
    DecodeTooLarge,
    Dictionary,
    Embedded,
    Record,
    Sequence,
    Set,
    Symbol,
    Value,
)
from ..values.binary import DEFAULT_MAX_DEPTH, make_reader, make_writer
from .budget import (
    DELIVERY_OVERHEAD,
    MEMORY_FULL,
    REFUSED,
    MemoryBudget,
    charge,
    format_bytes,
    refused_packet,
)
from .route import scan_rel
from .sturdy import AttenuatedEntity, AttenuatedRef, Attenuation, SturdyError
from .wire import ERROR, ProtocolError, WireRef, error_packet, short

__all__ = ["Quota", "Relay", "RelayLimits", "RemoteEntity", "keep_received"]

log = logging.getLogger(__name__)

_MISSING = object()
_ASSERT = Symbol("A")
_RETRACT = Symbol("R")
_MESSAGE = Symbol("M")
_SYNC = Symbol("S")

# Fixed parts of outbound events (see _emit_*).
_B_SEQ = b"\xb5"
_B_END = b"\x84"
_B_END2 = b"\x84\x84"
_HDR_A = b"\xb4\xb3\x01A"
_HDR_R = b"\xb4\xb3\x01R"
_HDR_M = b"\xb4\xb3\x01M"
_HDR_M_SEQ = b"\xb4\xb3\x01M\xb5"
_B_END3 = b"\x84\x84\x84"
_HDR_S = b"\xb4\xb3\x01S"
_B_TRUE = b"\x81"

# The last message body encoded, as (value, body): one object, so that relays in
# different threads never pair one value with another's body (see Relay._send_message).
_cached: tuple[Any, bytes] | None = None
_PARTIAL = -2
"""What the fast path returns when the input ends inside a Turn packet."""
# The encodings of the messages of the Turn packets being applied, by the id of the value
# read (kept with it, so an id is never reused meanwhile): a message forwarded unchanged
# (a linked server's) goes out as the bytes it came in, not encoded again.  Only while
# some user wants it (keep_received), and emptied after each packet is applied.
_received: dict[int, tuple[Any, bytes]] = {}
_keeping = 0


def _scan_messages(buf: bytes, p: int, env: bytes, msgs: list[list[int]]) -> tuple[int, bool]:
    """Read the messages of events in a row, each ``env body ]]`` (``env``: an event up
    to its body, ``[oid <M ``), from ``buf[p]``, the first body: append the offsets of
    each body (:func:`~dataspace.protocol.route.scan_rel`) to ``msgs``.  Returns where
    the events read end, and False when reading stopped at an event whose body is not
    routed on its bytes (not canonical, or not complete: it starts there), True when at
    anything else."""
    n = len(buf)
    lenv = len(env)
    e = p - lenv
    while True:
        items = scan_rel(buf, p, 3)
        if items is None:
            return e, False
        end = p + items[-1]
        if end + 1 >= n or buf[end] != 0x84 or buf[end + 1] != 0x84:
            return e, False
        msgs.append(items)
        e = end + 2
        if not buf.startswith(env, e):
            return e, True
        p = e + lenv


def keep_received(on: bool) -> None:
    """Count one more (``on``) or one fewer user wanting the relays of this process to keep
    the encoding of each message they receive while its turn is applied, so that
    :class:`RemoteEntity` sends that same message, unchanged, as those bytes.  A server's
    links turn it on while they forward messages."""
    global _keeping
    _keeping = max(0, _keeping + (1 if on else -1))
    if not _keeping:
        _received.clear()


@mypyc_attr(native_class=False)  # (its defaults are read off the class: broker/config.py)
@dataclass(frozen=True)
class RelayLimits:
    """Per-connection limits of the protocol machine (all enforced on peer input).

    * ``max_packet_size`` -- largest packet accepted, in bytes (default 1 MiB);
    * ``max_assertions`` -- assertions the peer may hold at once (default 100,000);
    * ``max_imports`` -- distinct references of the peer's objects held at once
      (default 10,000);
    * ``max_observers`` -- ``<Observe ...>`` assertions the peer may hold at once (default
      10,000);
    * ``max_outbound_assertions`` -- assertions this side may hold at the peer at once
      (what its observers currently match; default 500,000): past it the connection is
      closed with a ``too-many-matches`` error rather than grow without bound;
    * ``max_outbound_packet`` -- outbound Turn packets are cut at about this size (default
      256 KiB), so they stay below the peer's own packet limit;
    * ``strict`` -- treat events addressed to OIDs never issued and retractions of unknown
      handles as protocol errors (the server); when False they are ignored (a client,
      where such events can race with its own retractions).  Events to an OID this side
      issued and has withdrawn since are always dropped quietly: they can cross the
      retraction that withdrew it.
    """

    max_packet_size: int = 1 << 20
    max_assertions: int = 100_000
    max_imports: int = 10_000
    max_observers: int = 10_000
    max_outbound_assertions: int = 500_000
    max_outbound_packet: int = 256 * 1024
    strict: bool = True

    def __post_init__(self) -> None:
        for name in ("max_packet_size", "max_assertions", "max_imports", "max_observers",
                     "max_outbound_assertions", "max_outbound_packet"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be a positive integer, not {v!r}")


class Quota:
    """A limit shared by many relays: the assertions all peers of a server hold at once.

    A peer whose assertion would go beyond ``max_assertions`` is refused with a
    ``server-full`` protocol error (its connection closes, its assertions go), so the
    server refuses work before its memory runs out.

    ``memory``, when given, is the server's :class:`~dataspace.protocol.budget.MemoryBudget`:
    the relays charge it for what their peers make the server hold, and past it a new
    assertion is refused on its own (a ``<refused ...>`` packet; the connection lives on).
    """

    __slots__ = ("assertions", "max_assertions", "memory")

    def __init__(self, max_assertions: int, memory: MemoryBudget | None = None) -> None:
        self.max_assertions = max_assertions
        self.assertions = 0
        self.memory = memory

    def __repr__(self) -> str:
        return f"<Quota {self.assertions}/{self.max_assertions} assertions>"


class RemoteEntity(Entity):
    """A local stand-in for an object the peer exported (``[0 oid]`` on the wire).

    Assertions, retractions and messages delivered to it are queued on its relay as
    outbound events; once the connection has closed they are dropped.
    """

    __slots__ = ("count", "msg_head", "oid", "oid_bytes", "permanent", "relay")

    def __init__(self, relay: Relay, oid: int) -> None:
        self.relay = relay
        self.oid = oid
        self.oid_bytes = relay._encode_int(oid)
        # What a message of captures to it starts with: ``[oid <M [`` (see emit_captures).
        self.msg_head = _B_SEQ + self.oid_bytes + _HDR_M_SEQ
        self.count = 0
        self.permanent = False

    def on_assert(self, value: Value, handle: int) -> None:
        self.relay._send_assert(self, value, handle)

    def on_retract(self, handle: int) -> None:
        self.relay._send_retract(self, handle)

    def on_message(self, value: Value) -> None:
        self.relay._send_message(self, value)

    def send_body(self, body: bytes) -> None:
        """Send the message whose canonical encoding is ``body``, as it is."""
        relay = self.relay
        if not relay.closed:
            relay._emit(self.oid_bytes, _HDR_M, body)

    def send_bodies(self, bodies: list[bytes]) -> None:
        """:meth:`send_body` for each of ``bodies``, in order."""
        relay = self.relay
        if not relay.closed:
            relay.emit_bodies(self.oid_bytes, bodies)

    def send_messages(self, values: list[Value]) -> None:
        """:meth:`on_message` for each of ``values``, in order (a link forwarding a
        turn's messages: one call, and each received one written as it came in)."""
        self.relay._send_messages(self, values)

    @property
    def alive(self) -> bool:
        """False once the connection is closed (events to it are dropped)."""
        return not self.relay.closed

    def __repr__(self) -> str:
        return f"<RemoteEntity {self.relay.name}#{self.oid}>"


class _Export:
    """An OID this side exported: the object, the entity that receives events for it."""

    __slots__ = ("count", "obj", "oid", "permanent", "target")

    def __init__(self, oid: int, obj: Any, target: Entity | None) -> None:
        self.oid = oid
        self.obj = obj
        self.target = target
        self.count = 0
        self.permanent = False


class Relay:
    """The protocol machine of one connection (see the module docstring).

    * ``limits`` -- a :class:`RelayLimits`;
    * ``name`` -- used in log messages;
    * ``turn`` -- a context-manager factory wrapped around the events of each multi-event
      inbound packet so that they apply atomically (e.g. ``Dataspace.turn``);
    * ``on_dirty(relay)`` -- called when output becomes pending (once, until
      :meth:`take_packets` is next called), so a host can schedule a flush;
    * ``quota`` -- a :class:`Quota` shared with other relays (a server-wide limit);
    * ``should_yield()`` -- asked after each inbound packet; when it answers True the
      relay stops reading, keeps the rest of the input, sets :attr:`input_paused`, and
      goes on when the host calls :meth:`resume_input` (so a host can share its time
      fairly between peers).
    """

    def __init__(
        self,
        *,
        limits: RelayLimits | None = None,
        name: str = "peer",
        turn: Callable[[], AbstractContextManager[Any]] | None = None,
        on_dirty: Callable[[Relay], None] | None = None,
        quota: Quota | None = None,
        should_yield: Callable[[], bool] | None = None,
    ) -> None:
        self.limits = limits = limits or RelayLimits()
        self.quota = quota
        self.should_yield = should_yield
        self.input_paused = False
        """True when :attr:`should_yield` stopped the reading of buffered input."""
        self._pending_input = b""
        # A Turn packet begun in an earlier chunk, read on the fast path: its events so
        # far, whether they held embedded references, and its bytes before the event
        # being read (which, when it is incomplete too, the decoder holds).
        self._part: tuple[list[tuple[int, int, Any, Any]], bool, int] | None = None
        self._cut = 0  # where _fast_events stopped (the start of the event it could not read)
        # The export last asked whether it takes Encoded messages, and the answer.
        self._raw_ex: tuple[Any, bool] | None = None
        # Peer handles of the live <Observe ...> assertions it made.
        self._observing: set[int] = set()
        self.name = name
        self._turn = turn
        self.on_dirty = on_dirty
        self._strict = limits.strict
        self._decoder = self._new_decoder()
        self._saw_embedded = False
        # Inbound assertions: peer handle -> (target entity or None, local handle, pins, export)
        # (the last: bytes charged to the memory budget)
        self._in: dict[int, tuple[Entity | None, int, list[Any] | None, _Export | None, int]] = {}
        # Outbound assertions: local handle -> pins
        self._out: dict[int, list[Any]] = {}
        self._imports: dict[int, RemoteEntity] = {}
        self._exports: dict[int, _Export] = {}
        self._export_by_obj: dict[Any, _Export] = {}
        self._transient: deque[_Export] = deque()
        self._next_oid = 0
        self._write = make_writer(True, False, self._embed_out, DEFAULT_MAX_DEPTH)
        self._read = make_reader(False, self._wireref_in, DEFAULT_MAX_DEPTH)
        self._pins: list[Any] | None = None
        self._embedded_out = False
        self._max_out = limits.max_outbound_packet
        # Output: fragments of the Turn packet being built, finished packets.
        self._frags: list[bytes] = []
        self._frag_size = 0
        self._outbox: list[bytes] = []
        self._dirty = False
        self._syncs: list[bytes] | None = None
        self.closed = False
        """True once the relay stopped (protocol error, peer error or :meth:`close`)."""
        self.wants_close = False
        """True when the host should close the connection once the output is sent."""
        self.error: tuple[str, Value] | None = None
        """``(message, detail)`` of the protocol error that stopped this relay, if any."""
        self.peer_error: tuple[str, Value] | None = None
        """``(message, detail)`` of an ``<error>`` packet the peer sent, if any."""
        self.packets_in = 0
        self.packets_out = 0
        self.events_out = 0
        """Events queued for the peer so far (the work its observers and objects cost)."""
        self.turns_in = 0
        """Turns (packets of events) received from the peer and applied."""
        self.messages_in = 0
        """Messages the peer sent (``<M ...>`` events received)."""
        self.packets_decoded = 0
        """Packets read by the generic decoder rather than the fast path (any packet that
        is not a Turn in canonical form: an error, an extension, annotated values ...)."""
        # Events sent that are not messages to the peer's observers (``messages_out`` is
        # the rest of ``events_out``: the message path, the hottest, counts nothing more).
        self._other_out = 0
        self.sync_gate: Callable[[Callable[[], None]], bool] | None = None
        """When set, the answer to each of the peer's syncs is passed to it first:
        ``sync_gate(answer)`` returns True to hold the answer (and calls ``answer()``
        later, e.g. once what the peer sent before is durable), False to answer now."""
        self.retract_chunk: int | None = None
        """When set, a closing relay retracts the peer's assertions this many per turn:
        the first chunk at once, the rest each time the host calls :meth:`retract_more`
        (so that a peer holding very many assertions does not stall the others)."""
        self._retracting: list[tuple[Entity, int]] = []
        # The last assertion body encoded: (captures, body, exports it pinned).
        self._acache: tuple[Any, bytes, list[_Export]] | None = None
        # The server's memory budget (see protocol.budget): what this relay charged it,
        # and the peer's handles of refused assertions not yet retracted.
        self._budget = budget = quota.memory if quota is not None else None
        if budget is not None:
            budget.relays += 1
        self._held = 0
        self._pending_out = 0  # bytes of output held for the peer, charged to the budget
        self.refused = 0
        """Assertions of the peer refused for the server's memory budget."""
        self.on_refused: Callable[[int, str, Value], None] | None = None
        """Called with ``(handle, message, detail)`` when the peer says it refused one of
        this side's assertions (a ``<refused ...>`` packet; a client's hook)."""

    # -- setup ---------------------------------------------------------------------------

    def export_at(self, oid: int, entity: Entity) -> None:
        """Export ``entity`` permanently under ``oid`` (e.g. a gatekeeper at OID 0)."""
        if oid in self._exports:
            raise ValueError(f"OID {oid} is already exported")
        ex = _Export(oid, entity, entity)
        ex.permanent = True
        self._exports[oid] = ex
        self._export_by_obj[entity] = ex
        self._next_oid = max(self._next_oid, oid + 1)

    def import_ref(self, oid: int) -> RemoteEntity:
        """A permanent proxy for the peer's object ``oid`` (e.g. its gatekeeper at 0)."""
        imp = self._imports.get(oid)
        if imp is None:
            imp = self._imports[oid] = RemoteEntity(self, oid)
        imp.permanent = True
        return imp

    # -- input ---------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes from a stream transport: any number of concatenated packets (or parts)."""
        if self.closed:
            return
        buf = data if type(data) is bytes else bytes(data)
        if self.input_paused:
            # Not expected (the host stops reading meanwhile): keep it, in order.
            if self._pending_input or not self._decoder.buffered or self._part is not None:
                self._pending_input += buf
            else:
                self._decoder.feed(buf)
            return
        p = 0
        n = len(buf)
        dec = self._decoder
        if self._part is not None:
            # A Turn packet begun in an earlier chunk: go on reading it where it stopped
            # (a packet larger than one read -- a busy link's -- would otherwise be
            # decoded again from its start by the streaming decoder).
            p = self._go_on(buf)
            if p < 0 or p >= n:
                return
            if self._yield_now():
                self._pending_input = buf[p:]
                return
        elif dec.buffered:
            # A packet begun in an earlier chunk: the streaming decoder (whose scan is
            # resumable, so bytes trickling in cost linear time) completes it; what
            # follows it in this chunk goes back to the fast path.
            dec.feed(buf)
            self._saw_embedded = False
            try:
                v = dec.try_next()
            except DecodeError as e:
                self._decode_failed(e)
                return
            if v is None:
                return
            rest = dec.buffered
            if rest > n:  # pragma: no cover - the packet ended inside this chunk
                self._decode_loop()
                return
            self._decoder = self._new_decoder()
            self._packet(v)
            if not rest:
                return
            p = n - rest
            if self._yield_now():
                self._pending_input = buf[p:]
                return
        # Fast path: complete, canonical Turn packets are framed and read here (one that
        # the chunk ends inside is kept, and read on when the rest comes).  The first
        # packet that is not (another kind, malformed) and all that follows it in this
        # chunk go to the streaming decoder.
        while p < n:
            if self.closed:
                return
            q = self._fast_turn(buf, p)
            if q < 0:
                if q == _PARTIAL:
                    return  # the packet goes on in the next chunk
                self._decoder.feed(buf[p:] if p else buf)
                self._decode_loop()
                return
            p = q
            if p < n and self._yield_now():
                self._pending_input = buf[p:]
                return

    def _yield_now(self) -> bool:
        sy = self.should_yield
        if sy is not None and not self.closed and sy():
            self.input_paused = True
            return True
        return False

    def resume_input(self) -> None:
        """Go on reading the input kept when :attr:`should_yield` paused it (it may
        pause again)."""
        if not self.input_paused:
            return
        self.input_paused = False
        if self.closed:
            self._pending_input = b""
            return
        data = self._pending_input
        self._pending_input = b""
        if data:
            self.receive_data(data)
        else:
            self._decode_loop()

    def _new_decoder(self) -> Decoder:
        return Decoder(embedded=self._wireref_in, max_value_size=self.limits.max_packet_size)

    def _decode_loop(self) -> None:
        dec = self._decoder
        while not self.closed:
            self._saw_embedded = False
            try:
                v = dec.try_next()
            except DecodeError as e:
                self._decode_failed(e)
                return
            if v is None:
                return
            self._packet(v)
            if dec.buffered and self._yield_now():
                return

    def receive_packet(self, data: bytes | bytearray | memoryview) -> None:
        """Exactly one packet (a WebSocket message)."""
        if self.closed:
            return
        if len(data) > self.limits.max_packet_size:
            self.fail(
                f"packet of {len(data)} bytes is larger than the limit of "
                f"{self.limits.max_packet_size} bytes",
                Symbol("packet-too-large"),
            )
            return
        buf = data if type(data) is bytes else bytes(data)
        if self._fast_turn(buf, 0, whole=True) >= 0:
            return
        if self.closed:
            return
        dec = self._decoder
        dec.feed(buf)
        self._saw_embedded = False
        try:
            v = dec.try_next()
            if v is None:
                raise DecodeError("the message ends in the middle of a packet", len(buf))
            if dec.buffered:
                raise DecodeError(
                    f"{dec.buffered} byte(s) after the packet (one packet per message)",
                    len(buf) - dec.buffered,
                )
        except DecodeError as e:
            self._decode_failed(e)
            return
        self._packet(v)

    def _fast_turn(self, buf: bytes, p: int, whole: bool = False) -> int:
        """Read and apply the Turn packet at ``buf[p]`` if it is canonical.

        Returns the offset after it; or -1 (nothing applied) when it is not canonical
        (another kind of packet, malformed): then the generic decoder reads it (and
        reports any error); or ``_PARTIAL`` when ``buf`` ends inside it: then the events
        read so far are kept and :meth:`_go_on` reads the rest when it comes.  Event
        envelopes ``[oid <A|R|M|S ...>]`` are checked byte by byte; assertions, bodies and
        handles go through the same reader (and limits) as the decoder uses.  With
        ``whole``, the packet must also end exactly at the end of ``buf``.
        """
        if buf[p] != 0xB5:
            return -1
        self._saw_embedded = False
        events: list[tuple[int, int, Any, Any]] = []
        q = self._fast_events(buf, p + 1, events)
        if q < 0:
            if q == _PARTIAL and not whole:
                # Keep what is read; the decoder takes the incomplete event (its scan
                # resumes as bytes come, and refuses one too large as soon as it can).
                cut = self._cut
                self._part = (events, self._saw_embedded, cut - p)
                q = self._go_on(buf, cut, True)
                return _PARTIAL if q < 0 else q
            return -1
        if q - p > self.limits.max_packet_size or (whole and q != len(buf)):
            return -1
        self.packets_in += 1
        if events:
            if len(events) == 1 and not whole and type(events[0][2]) is Encoded \
                    and q < len(buf) and buf[q] == 0xB5:
                r = self._run_of_turns(buf, q, events[0])
                if r >= 0:
                    return r
            self._turn_in(events, self._saw_embedded)
            if _received:
                _received.clear()
        return q

    def _run_of_turns(self, buf: bytes, q: int, ev: tuple[int, int, Any, Any]) -> int:
        """The packet just read is a run of messages to one entity, routed on their
        bytes (``ev``), and another packet follows at ``buf[q]``: read the packets after
        it that are the same (up to 256), and have the entity apply them, turn by turn,
        in one call (see :meth:`Dataspace.send_turns`).  Returns the offset after the
        last packet applied, or -1 (nothing applied) when no such packet follows."""
        oid = ev[0]
        enc = ev[2]
        ex = self._exports.get(oid)
        fn = getattr(ex.target, "on_message_turns", None) if ex is not None else None
        if fn is None:
            return -1
        msgs = enc.msgs
        cuts = [len(msgs)]
        ends = [q]
        n = len(buf)
        limit = self.limits.max_packet_size
        # The packets read here are Turns of messages to ``oid`` written canonically:
        # [[oid <M body>] ...], each body canonical (any other packet ends the run).
        env = _B_SEQ + self._encode_int(oid) + _HDR_M  # an event up to its body
        penv = _B_SEQ + env
        lenv = len(env)
        while q < n and len(cuts) < 256 and buf.startswith(penv, q):
            had = len(msgs)
            p, whole = _scan_messages(buf, q + lenv + 1, env, msgs)
            if not whole or p >= n or buf[p] != 0x84 or p + 1 - q > limit:
                del msgs[had:]  # not one of those: read as usual
                break
            q = p + 1
            cuts.append(len(msgs))
            ends.append(q)
        if len(cuts) == 1:
            return -1
        done = 1
        try:
            done = fn(enc, cuts)
        # (Each clause names its exception apart: compiled, a name has one type.)
        except TurnTooLarge as big:
            done = big.sent + 1  # the refused turn was received too
            self.fail(str(big), Symbol("turn-too-large"))
        except Exception as bug:
            self._internal_error(bug)
        self.packets_in += done - 1
        self.turns_in += done
        self.messages_in += cuts[done - 1]
        return ends[done - 1]

    def _fast_events(self, buf: bytes, p: int, events: list[tuple[int, int, Any, Any]]) -> int:
        """Read the events of a Turn packet from ``buf[p]`` (an event boundary) into
        ``events``; returns the offset after the packet's end, or -1 at an event the fast
        path does not read, or ``_PARTIAL`` when ``buf`` ends first.  Either way
        :attr:`_cut` is then where that event starts."""
        read = self._read
        keep = _keeping
        exports = self._exports
        raw_oid = -1  # the last OID asked whether it takes Encoded messages, and the answer
        raw = False
        no_raw = -1  # an event to read as usual (its body is not canonical, or incomplete)
        e = p
        try:
            while True:
                e = p
                t = buf[p]
                if t == 0x84:
                    return p + 1
                if t != 0xB5 or buf[p + 1] != 0xB0:
                    break
                ln = buf[p + 2]
                if ln > 8:
                    break
                q = p + 3 + ln
                oid = int.from_bytes(buf[p + 3 : q], "big", signed=True)
                if buf[q] != 0xB4 or buf[q + 1] != 0xB3 or buf[q + 2] != 1:
                    break
                k = buf[q + 3]
                p = q + 4
                if k == 0x4D:  # M: its body
                    if oid != raw_oid:
                        raw_oid = oid
                        ex = exports.get(oid)
                        c = self._raw_ex
                        if c is not None and c[0] is ex:
                            raw = c[1]
                        else:
                            raw = ex is not None and \
                                getattr(ex.target, "accepts_encoded", False) is True
                            self._raw_ex = (ex, raw)
                    if raw and e != no_raw:
                        # A run of messages to this OID, routed on their bytes, not
                        # decoded: each body canonical, without embedded values (the
                        # first that is not is read as usual).
                        msgs: list[list[int]] = []
                        # (this event's envelope, buf[e:p], is the run's other events')
                        e, whole = _scan_messages(buf, p, buf[e:p], msgs)
                        if msgs:
                            # (A link forwards these as they are: the dataspace's router
                            # hands their bytes to its forwarders.)
                            events.append((oid, k, Encoded(buf, msgs), None))
                        if not whole:
                            no_raw = e
                        p = e
                        continue
                    a, p = read(buf, p, 3)
                    if keep:
                        _received[id(a)] = (a, buf[q + 4 : p])
                    b = None
                elif k == 0x52 or k == 0x53:  # R, S: one field
                    a, p = read(buf, p, 3)
                    b = None
                elif k == 0x41:  # A: assertion, handle
                    a, p = read(buf, p, 3)
                    b, p = read(buf, p, 3)
                else:
                    break
                if buf[p] != 0x84 or buf[p + 1] != 0x84:
                    break
                p += 2
                events.append((oid, k, a, b))
        except (IndexError, DecodeShort):
            self._cut = e
            return _PARTIAL  # a read past the end: the bytes stop first
        except (DecodeError, RecursionError):
            pass  # malformed, or too deep: the decoder decides
        self._cut = e
        return -1

    def _too_large(self) -> None:
        self._part = None
        self._decode_failed(DecodeTooLarge(
            f"value longer than max_value_size ({self.limits.max_packet_size} bytes)", 0))

    def _go_on(self, buf: bytes, p: int = 0, generic: bool = False) -> int:
        """Read more of the Turn packet begun earlier (:attr:`_part`) from ``buf[p:]``:
        the events the fast path reads are read so, any other (incomplete, or not
        canonical: ``generic``) by the decoder, one event at a time.  Applies the packet
        when it ends and returns the offset after it in ``buf``; -1 when ``buf`` ends
        first (the state is kept) or the relay failed."""
        assert self._part is not None
        events, emb, size = self._part
        self._part = None
        limit = self.limits.max_packet_size
        n = len(buf)
        while True:
            dec = self._decoder
            if dec.buffered or generic:
                if not dec.buffered:  # a new event: the rest of the packet's budget
                    dec = self._decoder = Decoder(embedded=self._wireref_in,
                                                  max_value_size=max(1, limit - size))
                before = dec.buffered
                dec.feed(buf[p:] if p else buf)
                self._saw_embedded = emb
                try:
                    ev = dec.try_next()
                except DecodeTooLarge:
                    self._too_large()
                    return -1
                except DecodeError as e:
                    self._decode_failed(e)
                    return -1
                if ev is None:
                    self._part = (events, emb, size)
                    if size + dec.buffered > limit:
                        self._too_large()
                    return -1
                emb = self._saw_embedded
                rest = dec.buffered
                self._decoder = self._new_decoder()
                size += before + n - p - rest
                p = n - rest
                generic = False
                try:
                    events.append(_envelope(ev))
                except ProtocolError as bad:
                    # Events before the bad one are applied first, as when decoded.
                    self.packets_in += 1
                    if events:
                        self._turn_in(events, emb)
                    self.fail(bad.message, bad.detail)
                    return -1
                continue
            if p >= n:
                self._part = (events, emb, size)
                return -1
            self._saw_embedded = emb
            q = self._fast_events(buf, p, events)
            emb = self._saw_embedded
            if q < 0:  # the event at _cut is the decoder's: not canonical, or incomplete
                size += self._cut - p
                p = self._cut
                generic = True
                continue
            size += q - p
            if size > limit:
                self._too_large()
                return -1
            self.packets_in += 1
            if events:
                self._turn_in(events, emb)
                if _received:
                    _received.clear()
            return q

    def _decode_failed(self, e: DecodeError) -> None:
        cause = e.__cause__
        if isinstance(cause, ProtocolError):  # raised by the embedded hook
            self.fail(cause.message, cause.detail)
        else:
            self.fail(f"malformed packet: {e}", _decode_detail(e))

    @property
    def buffered(self) -> int:
        """Bytes received but not yet applied (a packet not yet complete, and input kept
        while reading is paused)."""
        part = self._part
        return (self._decoder.buffered + (part[2] if part is not None else 0)
                + len(self._pending_input))

    def _packet(self, v: Value) -> None:
        self.packets_in += 1
        self.packets_decoded += 1
        t = type(v)
        if t is Sequence:
            if v:
                try:
                    events = [_envelope(ev) for ev in v]
                except ProtocolError as e:
                    # Events before the bad one are applied first, as they would be
                    # had they come in a packet of their own.
                    good = []
                    for ev in v:
                        try:
                            good.append(_envelope(ev))
                        except ProtocolError:
                            break
                    if good:
                        self._turn_in(good, self._saw_embedded)
                    self.fail(e.message, e.detail)
                    return
                self._turn_in(events, self._saw_embedded)
        elif t is Record:
            if v.label == ERROR and len(v.fields) == 2:
                msg, detail = v.fields
                self.peer_error = (msg if type(msg) is str else short(msg), detail)
                log.info("%s: the peer reported an error: %s %s", self.name,
                            self.peer_error[0], short(detail))
                self.wants_close = True
                self._shutdown()
            elif v.label == REFUSED and len(v.fields) == 3 and type(v.fields[0]) is int:
                handle, msg, detail = v.fields
                msg = msg if type(msg) is str else short(msg)
                if self.on_refused is not None:
                    self.on_refused(handle, msg, detail)
                else:
                    log.info("%s: the peer refused assertion %d: %s", self.name, handle, msg)
            elif log.isEnabledFor(logging.DEBUG):  # short() of a peer's value is not free
                log.debug("%s: ignoring extension packet %s", self.name, short(v))
        elif v is False:
            pass  # Nop
        else:
            self.fail(
                f"malformed packet {short(v)}: expected a turn [[oid event] ...], "
                "<error ...>, an extension record or #f",
                Symbol("malformed-packet"),
            )

    def _turn_in(self, events: list[tuple[int, int, Any, Any]], emb: bool) -> None:
        self.turns_in += 1
        if len(events) == 1 or self._turn is None:
            try:
                for ev in events:
                    self._apply(ev, emb)
                    if self.closed:
                        return
            # (Each clause names its exception apart: compiled, a name has one type.)
            except ProtocolError as perr:
                self.fail(perr.message, perr.detail)
            except TurnTooLarge as big:
                self.fail(str(big), Symbol("turn-too-large"))
            except Exception as bug:
                self._internal_error(bug)
            return
        err: ProtocolError | None = None
        syncs = self._syncs = []
        many = None if emb else self._all_messages(events)
        try:
            with self._turn():
                if many is not None:
                    for ev in events:
                        a = ev[2]
                        self.messages_in += 1 if type(a) is not Encoded else len(a.msgs)
                    many([ev[2] for ev in events])
                    events = []
                for ev in events:
                    try:
                        self._apply(ev, emb)
                    except ProtocolError as perr2:
                        err = perr2
                        break
                    except TurnTooLarge as big2:
                        err = ProtocolError(str(big2), Symbol("turn-too-large"))
                        break
                    except Exception as bug2:
                        err = self._internal_error(bug2, fail=False)
                        break
                    if self.closed:
                        break
        except TurnTooLarge as big3:  # the turn was undone when it was applied
            err = ProtocolError(str(big3), Symbol("turn-too-large"))
        except Exception as bug3:  # committing the turn failed: a bug on this side
            err = self._internal_error(bug3, fail=False)
        finally:
            self._syncs = None
        if err is not None:
            self.fail(err.message, err.detail)
            return
        for oid_bytes in syncs:
            self._answer_sync(oid_bytes)

    def _all_messages(self, events: list[tuple[int, int, Any, Any]]) -> Any:
        """The ``on_messages`` of the entity every event of ``events`` is a message to,
        if it has one (a link's: the messages of a packet in one call), else None."""
        oid = events[0][0]
        ex = self._exports.get(oid)
        fn = getattr(ex.target, "on_messages", None) if ex is not None else None
        if fn is None:
            return None
        for ev in events:
            if ev[1] != 0x4D or ev[0] != oid:
                return None
        return fn

    def _internal_error(self, e: Exception, fail: bool = True) -> ProtocolError:
        """A local entity raised while applying the peer's event: a bug on this side,
        but only this connection is closed (the server carries on)."""
        log.error("%s: applying an event failed", self.name, exc_info=e)
        err = ProtocolError(
            f"internal error while applying an event ({type(e).__name__}); the connection "
            "is closed",
            Symbol("internal-error"),
        )
        if fail:
            self.fail(err.message, err.detail)
        return err

    def _apply(self, ev: tuple[int, int, Any, Any], emb: bool) -> None:
        """Apply one event ``(oid, kind, a, b)`` (kind: the byte of A, R, M or S)."""
        oid, k, a, b = ev
        ex = self._exports.get(oid)
        if ex is None:
            # An OID this side issued and has since withdrawn (the peer's event crossed
            # the retraction that dropped it) is not the peer's fault: the event is
            # dropped.  One never issued is.
            if self._strict and not 0 <= oid < self._next_oid:
                raise ProtocolError(f"unknown OID {oid}: no such object on this connection", oid)
            target = None
        else:
            target = ex.target
        if k == 0x4D:  # M
            self.messages_in += 1 if type(a) is not Encoded else len(a.msgs)
            if emb:
                pins: list[Any] = []
                a = self._rewrite_in(a, pins)
                if target is not None:
                    target.on_message(a)
                self._drop_pins(pins)
            elif target is not None:
                target.on_message(a)
        elif k == 0x41:  # A
            h = b
            if type(h) is not int:
                raise ProtocolError(f"a handle must be an integer, not {short(h)}", Symbol("malformed-event"))
            inbound = self._in
            if h in inbound:
                raise ProtocolError(f"handle {h} is already in use by a live assertion", h)
            if len(inbound) >= self.limits.max_assertions:
                raise ProtocolError(
                    f"too many assertions: the limit is {self.limits.max_assertions} per "
                    "connection",
                    Symbol("too-many-assertions"),
                )
            quota = self.quota
            if quota is not None and quota.assertions >= quota.max_assertions:
                raise ProtocolError(
                    f"the server is full: it holds its limit of {quota.max_assertions} "
                    "assertions; try again later",
                    Symbol("server-full"),
                )
            size = 0
            budget = self._budget
            if budget is not None:
                size = charge(a)
                held = budget.held + size
                if held + budget.extra + budget.output > budget.soft:  # else: admitted
                    why = budget.admit(size, self._held, ex is not None and ex.permanent)
                    if why is not None:
                        self._refuse(h, why)
                        return
                elif held > budget.high:
                    budget.high = held
            if type(a) is Record and a.label == OBSERVE:
                if len(self._observing) >= self.limits.max_observers:
                    raise ProtocolError(
                        f"too many observers: the limit is {self.limits.max_observers} per "
                        "connection",
                        Symbol("too-many-observers"),
                    )
                self._observing.add(h)
            pinned: list[Any] | None = None
            if emb:
                pinned = []
                a = self._rewrite_in(a, pinned)
            if ex is not None:
                ex.count += 1
            lh = fresh_handle()
            inbound[h] = (target, lh, pinned, ex, size)
            if size:
                self._held += size
                budget.held += size  # type: ignore[union-attr]
            if quota is not None:
                quota.assertions += 1
            if target is not None:
                target.on_assert(a, lh)
        elif k == 0x52:  # R
            rec = self._in.pop(a, None) if type(a) is int else None
            if rec is None:
                # Once assertions were refused, their handles' retractions are expected
                # (refused handles are not kept: they would cost what was refused).
                if self._strict and not self.refused:
                    raise ProtocolError(f"retraction of unknown handle {short(a)}", a)
                return
            target, rh, rpins, ex2, size = rec
            if size:
                self._release(size)
            if self.quota is not None:
                self.quota.assertions -= 1
            if self._observing:
                self._observing.discard(a)
            if ex2 is not None:
                self._unpin_export(ex2)
            if rpins:
                self._drop_pins(rpins)
            if target is not None:
                target.on_retract(rh)
        else:  # S
            if type(a) is not Embedded or type(a.value) is not WireRef:
                raise ProtocolError(f"<S> needs an embedded peer reference, not {short(a)}", Symbol("malformed-event"))
            wr = a.value
            if wr.mine:
                # Everything before this event has been applied: answer (after the turn
                # of a multi-event packet, once its effects have been dispatched).
                ob = self._encode_int(wr.oid)
                if self._syncs is not None:
                    self._syncs.append(ob)
                else:
                    self._answer_sync(ob)
            else:
                local = self._import_wireref(wr, None)
                if isinstance(local, Entity):
                    local.on_message(True)

    def _refuse(self, h: int, why: str) -> None:
        """Refuse the peer's new assertion under handle ``h`` (the memory budget is
        full): tell the peer with ``<refused h message memory-full>``.  Nothing of it is
        kept; from now on retractions of handles this relay does not know are expected
        (the peer's of refused assertions) and ignored."""
        self.refused += 1
        if self.refused == 1:
            log.warning("%s: assertion refused: %s", self.name, why)
        self._seal()
        self._outbox.append(refused_packet(h, why))
        if not self._dirty:
            self._dirty = True
            if self.on_dirty is not None:
                self.on_dirty(self)

    def _release(self, size: int) -> None:
        self._held -= size
        self._budget.held -= size  # type: ignore[union-attr]

    # -- membranes -----------------------------------------------------------------------

    def _wireref_in(self, v: Value) -> WireRef:
        """Decoder hook: the content of each ``#:`` in a packet."""
        self._saw_embedded = True
        if type(v) is Embedded and type(v.value) is WireRef:
            # ``#:#:[0 1]``: syndicate-py 0.19 writes the peer of a Sync this way
            # (protocol.prs: ``<S @peer #:#t>``); read it as the reference it wraps.
            return v.value
        return WireRef.from_value(v)

    def _rewrite_in(self, v: Value, pins: list[Any]) -> Value:
        """``v`` with its WireRefs replaced by local objects (pinned in ``pins``)."""
        t = type(v)
        if t is Embedded:
            return Embedded(self._import_wireref(v.value, pins))
        if t is Record:
            label = self._rewrite_in(v.label, pins)
            fields = tuple([self._rewrite_in(x, pins) for x in v.fields])
            return Record._make(label, fields)
        if t is Sequence:
            return tuple.__new__(Sequence, [self._rewrite_in(x, pins) for x in v])
        if t is Set:
            return Set([self._rewrite_in(x, pins) for x in v])
        if t is Dictionary:
            return Dictionary(
                [(self._rewrite_in(k, pins), self._rewrite_in(x, pins)) for k, x in v.items()]
            )
        return v

    def _import_wireref(self, wr: Any, pins: list[Any] | None) -> Any:
        if type(wr) is not WireRef:  # pragma: no cover - the decoder hook made it
            raise ProtocolError("embedded value is not a wire reference", False)
        oid = wr.oid
        if wr.mine:
            imp = self._imports.get(oid)
            if imp is None:
                if len(self._imports) >= self.limits.max_imports:
                    raise ProtocolError(
                        f"too many references: the limit is {self.limits.max_imports} per "
                        "connection",
                        Symbol("too-many-references"),
                    )
                imp = self._imports[oid] = RemoteEntity(self, oid)
            if pins is not None:
                imp.count += 1
                pins.append(imp)
            return imp
        ex = self._exports.get(oid)
        if ex is None:
            if self._strict and not 0 <= oid < self._next_oid:
                raise ProtocolError(f"reference to unknown OID {oid}", wr.to_value())
            return _Inert()  # withdrawn since (see _apply)
        if pins is not None:
            ex.count += 1
            pins.append(ex)
        if not wr.caveats:
            return ex.obj
        # The peer hands back one of our objects with caveats: enforce them here.
        try:
            att = Attenuation(wr.caveats)
        except SturdyError as e:
            raise ProtocolError(f"invalid caveat in reference to OID {oid}: {e}", False) from None
        if ex.target is None:
            return _Inert()
        return AttenuatedEntity(ex.target, att)

    def _drop_pins(self, pins: list[Any]) -> None:
        for p in pins:
            if type(p) is RemoteEntity:
                p.count -= 1
                if p.count <= 0 and not p.permanent and self._imports.get(p.oid) is p:
                    del self._imports[p.oid]
            else:
                self._unpin_export(p)

    def _unpin_export(self, ex: _Export) -> None:
        ex.count -= 1
        if ex.count <= 0 and not ex.permanent and self._exports.get(ex.oid) is ex:
            del self._exports[ex.oid]
            self._export_by_obj.pop(ex.obj, None)

    def _embed_out(self, obj: Any) -> Value:
        """Encoder hook: the wire reference for a local object in an outbound value."""
        self._embedded_out = True
        t = type(obj)
        if t is RemoteEntity and obj.relay is self:
            return tuple.__new__(Sequence, (1, obj.oid))
        if t is AttenuatedRef:
            tgt = obj.target
            if type(tgt) is RemoteEntity and tgt.relay is self:
                return tuple.__new__(Sequence, (1, tgt.oid, *obj.attenuation.caveats))
        ex = self._export_by_obj.get(obj)
        if ex is None:
            oid = self._next_oid
            self._next_oid = oid + 1
            ex = _Export(oid, obj, _deliverable(obj))
            self._exports[oid] = ex
            self._export_by_obj[obj] = ex
            if self._pins is None:
                self._hold_transient(ex)
        pins = self._pins
        if pins is not None:
            ex.count += 1
            pins.append(ex)
        return tuple.__new__(Sequence, (0, ex.oid))

    def _hold_transient(self, ex: _Export) -> None:
        """Keep a reference exported only in a message alive for a while (the peer may
        use it); the oldest of these are dropped beyond 1024, unless pinned since."""
        ex.count += 1
        q = self._transient
        q.append(ex)
        if len(q) > 1024:
            self._unpin_export(q.popleft())

    # -- output --------------------------------------------------------------------------

    def _encode_int(self, n: int) -> bytes:
        out: list[bytes] = []
        self._write(n, out, 0)
        return b"".join(out)

    def emit_captures(self, head: bytes, parts: tuple[bytes, ...], size: int) -> None:
        """Append the event ``[oid <M [parts...]>]`` to the Turn being built, ``head``
        being its start up to the parts (a proxy's :attr:`RemoteEntity.msg_head`): a
        message of captures given by their encodings (``size``: their length in all), as
        a message router splices them from received bytes."""
        if self.closed:
            return
        frags = self._frags
        if not frags:
            frags.append(_B_SEQ)
            self._frag_size = 1
            if not self._dirty:
                self._dirty = True
                if self.on_dirty is not None:
                    self.on_dirty(self)
        frags.append(head)
        frags += parts
        frags.append(_B_END3)
        self.events_out += 1
        self._frag_size += len(head) + size + 3
        if self._frag_size >= self._max_out:
            self._seal()

    def emit_run(self, head: bytes, parts: list[bytes]) -> None:
        """:meth:`emit_captures` of one part each, for each of ``parts`` in turn."""
        if self.closed:
            return
        frags = self._frags
        if not frags:
            frags.append(_B_SEQ)
            self._frag_size = 1
            if not self._dirty:
                self._dirty = True
                if self.on_dirty is not None:
                    self.on_dirty(self)
        size = self._frag_size + (len(head) + 3) * len(parts) + sum(map(len, parts))
        if size < self._max_out:
            end = _B_END3
            for part in parts:
                frags += (head, part, end)
            self.events_out += len(parts)
            self._frag_size = size
            return
        for part in parts:
            self.emit_captures(head, (part,), len(part))

    def emit_bodies(self, oid_bytes: bytes, bodies: list[bytes]) -> None:
        """Append the events ``[oid <M body>]``, one for each of ``bodies`` (canonical
        encodings of messages, sent as they are: a link forwarding what it received)."""
        if self.closed:
            return
        frags = self._frags
        size = self._frag_size
        max_out = self._max_out
        hm = _HDR_M
        end = _B_END2
        lo = len(oid_bytes) + 7
        for body in bodies:
            if not frags:
                frags.append(_B_SEQ)
                size = 1
                if not self._dirty:
                    self._dirty = True
                    if self.on_dirty is not None:
                        self.on_dirty(self)
            frags += (_B_SEQ, oid_bytes, hm, body, end)
            size += lo + len(body)
            self.events_out += 1
            if size >= max_out:
                self._frag_size = size
                self._seal()
                size = 0
                if self.closed:  # (over its memory budget)
                    return
        self._frag_size = size

    def _emit(self, oid_bytes: bytes, hdr: bytes, body: bytes) -> None:
        """Append the event ``[oid <hdr body>]`` to the Turn being built."""
        frags = self._frags
        if not frags:
            frags.append(_B_SEQ)
            self._frag_size = 1
            if not self._dirty:
                self._dirty = True
                if self.on_dirty is not None:
                    self.on_dirty(self)
        frags += (_B_SEQ, oid_bytes, hdr, body, _B_END2)
        self.events_out += 1
        self._frag_size += len(oid_bytes) + len(body) + 7
        if self._frag_size >= self._max_out:
            self._seal()

    def _body(self, value: Value, handle: int | None = None) -> bytes:
        """The encoding of ``value`` (then ``handle``) inside an event (may raise)."""
        out: list[bytes] = []
        self._write(value, out, 3)
        if handle is not None:
            self._write(handle, out, 3)
        return b"".join(out)

    def _send_assert(self, proxy: RemoteEntity, value: Value, handle: int) -> None:
        if self.closed or handle in self._out:
            return
        if len(self._out) >= self.limits.max_outbound_assertions:
            self.fail(
                f"too many matches: this connection's observers hold "
                f"{self.limits.max_outbound_assertions} assertions, the limit; observe "
                "narrower patterns",
                Symbol("too-many-matches"),
            )
            return
        pins: list[Any] = [proxy]
        proxy.count += 1
        # One assertion reaching many observers of this peer (the captures are the same
        # objects each time) is encoded once; only the references it exports are pinned
        # again, if they are all still exported.
        c = self._acache
        if (
            c is not None
            and type(value) is Sequence
            and len(value) == len(c[0])
            and all(map(is_, value, c[0]))
            and all(self._exports.get(ex.oid) is ex for ex in c[2])
        ):
            for ex in c[2]:
                ex.count += 1
                pins.append(ex)
            self._out[handle] = pins
            if self._budget is not None:
                self._held += DELIVERY_OVERHEAD
                self._budget.held += DELIVERY_OVERHEAD
            self._other_out += 1
            self._emit(proxy.oid_bytes, _HDR_A, c[1] + self._encode_int(handle))
            return
        self._pins = pins
        try:
            vbody = self._body(value)
        except (TypeError, ValueError) as e:
            self._drop_pins(pins)
            log.warning("%s: cannot send assertion %s: %s", self.name, short(value), e)
            return
        finally:
            self._pins = None
        self._acache = (value, vbody, pins[1:]) if type(value) is Sequence else None
        self._out[handle] = pins
        if self._budget is not None:
            self._held += DELIVERY_OVERHEAD
            self._budget.held += DELIVERY_OVERHEAD
        self._other_out += 1
        self._emit(proxy.oid_bytes, _HDR_A, vbody + self._encode_int(handle))

    def _send_retract(self, proxy: RemoteEntity, handle: int) -> None:
        if self.closed:
            return
        pins = self._out.pop(handle, None)
        if pins is None:
            return
        if self._budget is not None:
            self._release(DELIVERY_OVERHEAD)
        self._drop_pins(pins)
        self._other_out += 1
        self._emit(proxy.oid_bytes, _HDR_R, self._encode_int(handle))

    def _send_message(self, proxy: RemoteEntity, value: Value) -> None:
        if self.closed:
            return
        if _received:
            r = _received.get(id(value))
            if r is not None and r[0] is value:  # forwarded as it came in
                self._emit(proxy.oid_bytes, _HDR_M, r[1])
                return
        # Fan-out: every observer of a message gets a sequence of the *same* captured
        # objects; without embedded references their encoding is the same, so it is
        # made once (a one-entry cache shared by all relays).
        global _cached
        c = _cached
        if (
            c is not None
            and type(value) is Sequence
            and len(value) == len(c[0])
            and all(map(is_, value, c[0]))
        ):
            body = c[1]
        else:
            self._embedded_out = False
            try:
                body = self._body(value)
            except (TypeError, ValueError) as e:
                log.warning("%s: cannot send message %s: %s", self.name, short(value), e)
                return
            _cached = (value, body) if type(value) is Sequence and not self._embedded_out else None
        self._emit(proxy.oid_bytes, _HDR_M, body)

    def _send_messages(self, proxy: RemoteEntity, values: list[Value]) -> None:
        received = _received
        if not received:
            for v in values:
                self._send_message(proxy, v)
            return
        oid = proxy.oid_bytes
        run: list[bytes] = []  # bodies as they came in (see keep_received), in a row
        for v in values:
            r = received.get(id(v))
            if r is not None and r[0] is v:
                run.append(r[1])
                continue
            if run:
                self.emit_bodies(oid, run)
                run = []
            self._send_message(proxy, v)
        if run:
            self.emit_bodies(oid, run)

    def _emit_message_bytes(self, oid_bytes: bytes, body: bytes) -> None:
        if not self.closed:  # a sync's answer
            self._other_out += 1
            self._emit(oid_bytes, _HDR_M, body)

    def _answer_sync(self, oid_bytes: bytes) -> None:
        gate = self.sync_gate
        if gate is not None and gate(lambda: self._emit_message_bytes(oid_bytes, _B_TRUE)):
            return
        self._emit_message_bytes(oid_bytes, _B_TRUE)

    def send_sync(self, proxy: RemoteEntity, peer: Entity) -> None:
        """Queue ``<S #:peer>`` to ``proxy``: the peer answers by sending ``#t`` to ``peer``
        (exported transiently) once it has processed everything sent before."""
        if not self.closed:
            self._other_out += 1
            self._emit(proxy.oid_bytes, _HDR_S, self._body(Embedded(peer)))

    def _seal(self) -> None:
        frags = self._frags
        if frags:
            frags.append(_B_END)
            packet = b"".join(frags)
            self._outbox.append(packet)
            frags.clear()
            self._frag_size = 0
            self.packets_out += 1
            if self._budget is not None:
                # Thrice: the packet, and two copies on its way to the socket (the
                # packets joined, then the transport's buffer) until the host writes it.
                self._charge_output(3 * len(packet))

    def _charge_output(self, n: int) -> None:
        """Output for the peer is held too, from when it is encoded until the host says
        it is sent (:meth:`output_held`): past the memory budget and its output reserve
        (a new observer matching much, say), the connection is closed rather than the
        burst built."""
        b = self._budget
        assert b is not None
        self._pending_out += n
        b.output += n
        if b.output_over() and not self.closed and self._pending_out > (b.limit >> 6):
            n = self._pending_out
            self._outbox.clear()
            self._frags.clear()
            self._frag_size = 0
            self.output_held(0)
            self.fail(f"the server's memory budget ({b.option} {format_bytes(b.limit)}) is "
                      f"full: the {format_bytes(n // 3)} to send to this connection would "
                      f"pass it; observe narrower patterns, or ask the operator to raise "
                      f"{b.option}", MEMORY_FULL)

    def output_held(self, n: int) -> None:
        """The host still holds ``n`` bytes of output for the peer (after writing what
        :meth:`take_packets` gave it, or as it drains): the memory budget's charge for
        this relay's output becomes that (no-op without a budget)."""
        b = self._budget
        if b is not None:
            b.output += n - self._pending_out
            self._pending_out = n

    def take_packets(self) -> list[bytes]:
        """Every pending packet, encoded (the current Turn is finished first)."""
        self._seal()
        out = self._outbox
        self._outbox = []
        self._dirty = False
        return out

    def data_to_send(self) -> bytes:
        """Every pending packet concatenated (for stream transports)."""
        return b"".join(self.take_packets())

    @property
    def has_output(self) -> bool:
        return bool(self._frags or self._outbox)

    # -- ending --------------------------------------------------------------------------

    def fail(self, message: str, detail: Value = False) -> None:
        """Stop with a protocol error: queue ``<error message detail>`` after what is
        already pending, set :attr:`wants_close` and retract what the peer asserted."""
        if self.closed:
            return
        log.info("%s: protocol error: %s", self.name, message)
        self._seal()
        self._outbox.append(error_packet(message, detail))
        self.error = (message, detail)
        self.wants_close = True
        if not self._dirty:
            self._dirty = True
            if self.on_dirty is not None:
                self.on_dirty(self)
        self._shutdown()

    def close(self) -> None:
        """The connection is gone: retract everything the peer asserted, drop output."""
        self._shutdown()
        self._frags.clear()
        self._outbox.clear()
        self.output_held(0)

    def _shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.input_paused = False
        self._pending_input = b""
        inbound = self._in
        self._in = {}
        if self.quota is not None:
            self.quota.assertions -= len(inbound)
        budget = self._budget
        if budget is not None:
            budget.held -= self._held
            budget.relays -= 1
            self._held = 0
        self._imports.clear()
        self._exports.clear()
        self._export_by_obj.clear()
        self._transient.clear()
        self._out.clear()
        if inbound:
            # The peer's observers go first: retracting its other assertions then
            # costs nothing at them.  Kept in reverse, so each step pops from the end.
            first = [inbound.pop(h) for h in self._observing if h in inbound]
            targets = [(t, lh) for t, lh, _p, _e, _s in (*inbound.values(), *first)
                       if t is not None]
            self._observing = set()
            self._retracting = targets
            self._retract_step()

    def _retract_step(self) -> None:
        targets = self._retracting
        n = self.retract_chunk or len(targets)
        part = targets[:-n - 1:-1] if n < len(targets) else targets[::-1]
        del targets[len(targets) - len(part):]
        if self._turn is not None and len(part) > 1:
            with self._turn():
                self._retract_all(part)
        else:
            self._retract_all(part)

    @property
    def retracting(self) -> bool:
        """True while a closed relay still has assertions of the peer to retract (see
        :attr:`retract_chunk`)."""
        return bool(self._retracting)

    def retract_more(self) -> bool:
        """Retract the next chunk of a closed peer's assertions; True while more remain."""
        if self._retracting:
            self._retract_step()
        return bool(self._retracting)

    def _retract_all(self, targets: list[tuple[Entity, int]]) -> None:
        for t, lh in targets:
            try:
                t.on_retract(lh)
            except Exception:
                log.exception("%s: retracting handle %d on close failed", self.name, lh)

    # -- inspection ----------------------------------------------------------------------

    @property
    def messages_out(self) -> int:
        """Messages delivered to the peer (its observers hearing a message)."""
        return self.events_out - self._other_out

    @property
    def observers(self) -> int:
        """The peer's live ``<Observe ...>`` assertions."""
        return len(self._observing)

    def stats(self) -> dict[str, int]:
        """Table sizes: live inbound and outbound assertions, imported and exported OIDs."""
        return {
            "assertions_in": len(self._in),
            "assertions_out": len(self._out),
            "imports": len(self._imports),
            "exports": len(self._exports),
        }


class _Inert:
    """What a reference to an object that no longer exists resolves to (events dropped)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<inert>"


def _deliverable(obj: Any) -> Entity | None:
    """The entity that receives events addressed to an exported ``obj``."""
    if isinstance(obj, Entity):
        return obj
    if type(obj) is AttenuatedRef and isinstance(obj.target, Entity):
        return AttenuatedEntity(obj.target, obj.attenuation)
    return None


_KINDS = {_ASSERT: (0x41, 2), _RETRACT: (0x52, 1), _MESSAGE: (0x4D, 1), _SYNC: (0x53, 1)}


def _envelope(ev: Value) -> tuple[int, int, Any, Any]:
    """Check the shape of a decoded ``[oid <A|R|M|S ...>]``: ``(oid, kind, a, b)``."""
    if type(ev) is not Sequence or len(ev) != 2:
        raise ProtocolError(
            f"malformed turn event {short(ev)}: expected [oid event]", Symbol("malformed-event")
        )
    oid, e = ev
    if type(oid) is not int:
        raise ProtocolError(f"an OID must be an integer, not {short(oid)}", Symbol("malformed-event"))
    if type(e) is not Record:
        raise _bad_event(e)
    kind = _KINDS.get(e.label) if type(e.label) is Symbol else None
    f = e.fields
    if kind is None or len(f) != kind[1]:
        raise _bad_event(e)
    return (oid, kind[0], f[0], f[1] if kind[1] == 2 else None)


def _bad_event(e: Value) -> ProtocolError:
    return ProtocolError(
        f"malformed event {short(e)}: expected <A assertion handle>, <R handle>, <M body> "
        "or <S #:peer>",
        Symbol("malformed-event"),
    )


def _decode_detail(e: DecodeError) -> Value:
    if isinstance(e, DecodeTooLarge):
        return Symbol("packet-too-large")
    return Symbol("malformed-packet")
