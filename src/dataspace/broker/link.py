"""Linked brokers: a dataspace shared by several servers, each link carrying only what the
other side's subscribers want (seed 001, see :mod:`dataspace.protocol.upstream`).

A server started with ``--link ADDRESS --link-cap CAP`` keeps one connection to the server
at ADDRESS (reconnecting with backoff), resolves CAP there, and asserts into the
dataspace it designates::

    <link-request {id: SERVER-ID version: 2 cap: CAP} #:control #:data>

The other server answers on ``control`` with ``<link-accept {id: SERVER-ID version: 2}
#:control #:data>`` (or ``<link-refused MESSAGE>``).  From then on the link is symmetric;
each side is the *subscriber* of what it wants from the other and the *producer* of what
the other wants, and sends to the other's entities:

``control``  Syndicate messages: the seed's requests ``<subscribe SEQ LOW CHAIN>``,
             ``<reject ...>``, ``<reset ...>`` and answers ``<confirm KIND SEQ>``;
             the ``<tree-...>`` messages of the check that the link closes no cycle
             (:mod:`dataspace.protocol.linktree`); ``<link-refused MESSAGE>``.
``data``     the values themselves: a message as a message, an assertion as an
             assertion (retracted by the sender, or by the connection closing), so the
             Syndicate protocol's own lifetimes carry presence across the link.

What a server forwards to a link: a message or assertion of its dataspace that the
link's producer trie covers (assertions: never ``<Observe ...>`` or ``<link-request
...>`` records), never back to the link it came from, and an assertion only while some
source other than that link holds it (bag semantics across the link).  What it wants
from a link: the prefixes of the patterns of its own observers (``<Observe PATTERN _>``
in its dataspace) and of what its *other* links want from it (so chains and trees of
servers work).  Data crosses a link only once it is *up*: checked to close no cycle
(:mod:`dataspace.protocol.linktree`); a link that would close one is refused, and its
dialer tries again every 30-60 s.  See docs/links.md.

Only a capability without caveats may link (a linked server can assert and send
anything, as its own clients can): the acceptor checks the ``cap`` of the request
against its own keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..dataspace import OBSERVE, Dataspace, Encoded, Entity, Subscription, fresh_handle
from ..dataspace import _decoded as _values_of  # Encoded runs decoded, in order
from ..groups import OBSERVE_GROUP
from ..net.address import Address, parse_address
from ..net.connection import Connection
from ..net.dial import dial, explain_early_close
from ..net.flow import FlowLimits, Hub
from ..net.tls import ClientTLS
from ..pattern import Bind, PatternError, from_preserves
from ..protocol.gatekeeper import ACCEPTED, REJECTED, RESOLVE, Bindings
from ..protocol.linktree import MESSAGES as TREE_MESSAGES
from ..protocol.linktree import Forest, ForestError
from ..protocol.relay import Quota, Relay, RelayLimits, keep_received
from ..protocol.sturdy import SturdyError, SturdyRef, validate
from ..protocol.upstream import (
    CONFIRM,
    REQUESTS,
    Chain,
    Producer,
    Subscriber,
    UpstreamError,
    chain_key,
    chain_matches,
    pattern_chain,
)
from ..values import Dictionary, Embedded, Record, Symbol, Value, decode, key, stringify
from ..values.model import _PLAIN
from .grouplinks import (
    GROUP_JOB,
    GROUP_MESSAGE,
    GROUP_RANK,
    GROUP_WEIGHT,
    GroupLinks,
    directed_at,
    group_messages_in,
    parse_rank,
    rank_value,
)

__all__ = ["LinkHub", "LinkSpec", "load_server_id"]

log = logging.getLogger(__name__)
retry_log = logging.getLogger(__name__ + ".retries")
"""Each failed attempt of a link that keeps failing, at INFO (``dataspace serve -v``); the
warnings :class:`FailureWarnings` chooses go to :data:`log`."""

VERSION = 2
"""Version 2: links are checked for cycles by locking both trees (the ``<tree-...>``
messages), where version 1 exchanged reach sets (``<link-reach ...>``)."""
LINK_REQUEST = Symbol("link-request")
LINK_ACCEPT = Symbol("link-accept")
LINK_REFUSED = Symbol("link-refused")
SERVER_ID = "server.id"
"""The file in the data directory that holds this server's link identity."""
STATUS_FILE = "links.json"
"""Where a server writes its links' status (read by ``dataspace link status``)."""

_ID = Symbol("id")
_VERSION = Symbol("version")
_CAP = Symbol("cap")
_NAME = Symbol("name")
_NONCE = Symbol("nonce")
REFUSED_RETRY = (30.0, 60.0)
"""Seconds (a random wait in this range) before a refused link is tried again."""
GONE_KEEP = 600.0
"""Seconds an accepted link that went down (or was refused) stays in the status."""
GONE_MAX = 64

LINK_RELAY_LIMITS = RelayLimits(
    max_packet_size=16 << 20, max_assertions=10_000_000, max_imports=1_000_000,
    max_observers=1_000_000, max_outbound_assertions=10_000_000, strict=False,
)
LINK_FLOW = FlowLimits(max_debt=16 << 20, max_send_queue=256 << 20, send_timeout=60.0,
                       handshake_timeout=0.0)


def load_server_id(data_dir: Path) -> str:
    """This server's identity on links: created once, kept in the data directory."""
    p = data_dir / SERVER_ID
    try:
        text = p.read_text(encoding="utf-8").strip()
        if text:
            return text
    except FileNotFoundError:
        pass
    sid = secrets.token_hex(8)
    tmp = p.with_name(f".{SERVER_ID}.{os.getpid()}.tmp")
    tmp.write_text(sid + "\n", encoding="utf-8")
    os.replace(tmp, p)
    return sid


@dataclass(frozen=True)
class LinkSpec:
    """A link to dial: the peer's address and a capability (without caveats) there.
    ``address`` may list several, separated by commas (the members of a cluster): the
    dialer tries them in turn, and keeps one link up to whichever answers."""

    address: str
    cap: SturdyRef
    tls: ClientTLS | None = None
    """What the link trusts on a ``tls://`` or ``wss://`` address (and the certificate
    it shows a peer that asks for one)."""

    @property
    def name(self) -> str:
        return self.address

    @property
    def addresses(self) -> list[str]:
        return [a.strip() for a in self.address.split(",") if a.strip()]


def _forwardable(v: Value) -> bool:
    """Assertions that never cross a link: subscriptions (interest crosses as the seed's
    requests), memberships of groups (a group's members cross only as the weights of
    :mod:`dataspace.broker.grouplinks`) and the links' own handshakes."""
    return not (type(v) is Record and (v.label == OBSERVE or v.label == OBSERVE_GROUP
                                       or v.label == LINK_REQUEST))


def _head(v: Value) -> Any:
    return ("rec", key(v.label)) if type(v) is Record else type(v).__name__


# ---------------------------------------------------------------------------------------
# One established link


def _count_of(vs: list[Any]) -> int:
    return sum(len(v.msgs) if type(v) is Encoded else 1 for v in vs)


class _Control(Entity):
    def __init__(self, session: LinkSession) -> None:
        self.session = session

    def on_message(self, value: Value) -> None:
        self.session.on_control(value)


class _Data(Entity):
    def __init__(self, session: LinkSession) -> None:
        self.session = session
        # The data path, the hottest, goes straight to the session (no call in between).
        self.on_message = session.on_data_message  # type: ignore[method-assign]
        self.on_messages = session.on_data_messages

    def on_assert(self, value: Value, handle: int) -> None:
        self.session.on_data_assert(value, handle)

    def on_retract(self, handle: int) -> None:
        self.session.on_data_retract(handle)

    def on_message(self, value: Value) -> None:
        self.session.on_data_message(value)

    @property
    def accepts_encoded(self) -> bool:
        """Runs of the peer's messages may come as :class:`Encoded` (not decoded): once
        the link has settled, they go into the dataspace as they are and are routed on
        their bytes (see :meth:`LinkSession.on_data_messages`)."""
        return self.session.hub.ds.router is not None


class _Forward:
    """A link in its dataspace's message router (see
    :meth:`~dataspace.protocol.route.MessageRouter.add_forwarder`): the runs of messages
    routed on their bytes that the peer wants (its producer decides, and the router
    caches the decision) go out as the bytes they came in, without being decoded here.
    Messages sent as values reach the link through the dataspace's tap instead."""

    __slots__ = ("counters", "delivered", "session")

    def __init__(self, session: LinkSession) -> None:
        self.session = session
        self.counters = session.counters
        self.delivered = 0

    def decide(self, value: Value) -> bool:
        return self.session.prod.forward(value)

    def seen(self, n: int) -> None:
        """``n`` messages were routed here (not from this link): all suppressed until
        forwarded."""
        self.counters["messages_suppressed"] += n

    def emit_run(self, head: bytes, parts: list[bytes]) -> None:
        """Forward the messages whose encodings are ``parts``, in order."""
        s = self.session
        if s.closed:
            return
        out = s.data_out
        send = getattr(out, "send_bodies", None)
        if send is not None:
            send(parts)
        else:  # (a peer's entity that takes values only: tests' in-memory links)
            for p in parts:
                out.on_message(decode(p))
        c = self.counters
        c["messages_forwarded"] += len(parts)
        c["messages_suppressed"] -= len(parts)

    def emit_captures(self, head: bytes, parts: tuple[bytes, ...], size: int) -> None:
        self.emit_run(head, list(parts))

    def deliver_body(self, body: bytes) -> None:
        """The message, queued as ``[message]`` (see the router's emit)."""
        self.delivered += 1
        self.emit_run(b"", [body[1:-1]])


class LinkSession:
    """An established link, on either side (see the module docstring)."""

    def __init__(self, hub: LinkHub, name: str, peer_id: str, relay: Relay | None,
                 dialed: bool, route: bool = False) -> None:
        self.hub = hub
        self.name = name
        self.peer_id = peer_id
        self.relay = relay
        self.dialed = dialed
        self.route = route
        """A route between members of a cluster (broker.cluster), not a link: what
        arrives over it goes on to local observers and links, never to another route."""
        self.conn: Connection | None = None
        """The connection, when the host knows it (routes)."""
        self.peer_rank: Any = None
        """The peer server's rank for groups (:class:`dataspace.protocol.groups.Rank`),
        once known: a route's from its handshake, a link's from its ``<group-rank>``."""
        self.control_hook: Callable[[LinkSession, Value], bool] | None = None
        """Control messages the link protocol does not know go here first (the cluster's
        route messages); True: handled."""
        self.ctl_out: Any = None    # the peer's control entity
        self.data_out: Any = None   # the peer's data entity
        self.ctl_in = _Control(self)
        self.data_in = _Data(self)
        self.sub = Subscriber(eager=True, rto=hub.rto, rto_max=hub.rto_max)
        self.prod = Producer(max_entries=hub.max_entries)
        self.wants: dict[Any, Chain] = {}   # the peer's positive chains (it asked for them)
        self.fwd: dict[Any, tuple[Value, int]] = {}  # assertions forwarded to the peer
        self.injected: dict[int, tuple[int, Value]] = {}  # peer handle -> (local handle, value)
        self.injected_count: dict[Any, int] = {}
        self.echo: deque[Value] = deque()   # messages injected, to recognise as ours
        self.fw: _Forward | None = None  # in the router while the link is up (if it has one)
        self.skip: tuple[Any, ...] | None = None
        """The forwarders that must not hear what comes over this link: its own; for a
        route, every route's (see LinkHub.update_skips)."""
        self.ready = False
        """Data crosses only once the link is up: checked to close no cycle."""
        self.settled = False
        """The subscriber's :attr:`~Subscriber.settled`, as of the last control step."""
        self.refused: str | None = None
        """Why the check refused this link (it would close a cycle)."""
        self.nonce = secrets.token_hex(8) if dialed else ""
        self.closed = False
        self.since = time.time()
        self.up_since: float | None = None
        self.counters = {
            "messages_forwarded": 0, "messages_suppressed": 0, "messages_received": 0,
            "messages_dropped": 0, "assertions_forwarded": 0, "assertions_received": 0,
        }

    # -- starting and ending -------------------------------------------------------------

    def start(self) -> None:
        now = time.monotonic()
        self.sub.start(now)
        for chain in self.hub.interest_for(self):
            self.sub.add_interest(chain, now)
        self.prod.start()
        self.flush_control()

    def send_control(self, v: Value) -> None:
        if not self.closed and self.ctl_out is not None:
            self.ctl_out.on_message(v)

    def flush_control(self, changed: bool = True) -> None:
        """Send what the two machines queued; then, if anything was sent or ``changed``
        (a request was answered), re-arm the timer and tell the monitors.  The data path
        passes ``changed=False``: a message that asks nothing costs nothing here."""
        sent = False
        for m in self.sub.take_outgoing():
            self.send_control(m)
            sent = True
        for m in self.prod.take_outgoing():
            self.send_control(m)
            sent = True
        if sent or changed:
            self.hub.schedule_tick()
            self.hub.notify()
        # Every change of the subscriber is followed by this call: the data path reads
        # the flag instead of asking the machine for each message.
        self.settled = self.sub.settled

    def fail(self, why: str) -> None:
        """Close the link with an error (the connection is closed too)."""
        if self.closed:
            return
        log.warning("link %s: %s; closing it", self.name, why)
        self.hub.last_error[self.name] = why
        self.send_control(Record(LINK_REFUSED, [why]))
        relay = self.relay
        if relay is not None:
            relay.fail(f"link: {why}", Symbol("link-error"))
        self.hub.end(self)

    # -- control ------------------------------------------------------------------------

    def on_control(self, v: Value) -> None:
        if self.closed:
            return
        try:
            if type(v) is not Record:
                raise UpstreamError(f"not a link message: {stringify(v)[:80]}")
            lab = v.label
            if lab in REQUESTS:
                chain = self.prod.on_request(v)
                if chain is not None:
                    self.hub.producer_changed(self, chain)
            elif lab == CONFIRM:
                self.sub.on_confirm(v, time.monotonic())
            elif lab in TREE_MESSAGES:
                try:
                    self.hub.forest.message(self, v, time.monotonic())
                except ForestError as e:
                    raise UpstreamError(str(e)) from None
                self.hub.flush_forest()
                if self.closed:
                    return
            elif lab == LINK_REFUSED:
                why = v.fields[0] if v.fields and type(v.fields[0]) is str else "refused"
                self.hub.last_error[self.name] = f"the peer refused the link: {why}"
                log.warning("link %s: the peer refused the link: %s", self.name, why)
                if self.refused is None:
                    # Refused all the same (the far end may decide first): the dialer
                    # tries again slowly, and the link's status says why meanwhile.
                    self.refused = why
                self.hub.end(self)
                return
            elif lab == LINK_ACCEPT:
                return  # a duplicate
            elif lab == GROUP_WEIGHT or lab == GROUP_RANK:
                self._group_control(v)
            elif self.control_hook is not None and self.control_hook(self, v):
                if self.closed:
                    return
            else:
                raise UpstreamError(f"unknown link message <{stringify(lab)} ...>")
        except UpstreamError as e:
            self.fail(f"bad link message: {e}")
            return
        self.flush_control()

    def _group_control(self, v: Record) -> None:
        """``<group-weight ...>`` (a neighbour's members of a group) or ``<group-rank
        RANK>`` (the peer's rank for groups, sent as a link comes up)."""
        wire = self.hub.groups
        try:
            if v.label == GROUP_RANK:
                if len(v.fields) != 1:
                    raise ValueError("<group-rank RANK> has one field")
                rank = parse_rank(v.fields[0])
                if self.peer_rank is None:
                    self.peer_rank = rank
            elif wire is not None:
                wire.control(self, v)
        except ValueError as e:
            raise UpstreamError(f"bad group message: {e}") from None

    # -- data from the peer -------------------------------------------------------------

    def on_data_message(self, v: Value) -> None:
        self._as_peer(self._data_message, v)

    def _as_peer(self, handle: Callable[[Any], None], arg: Any) -> None:
        """``handle(arg)`` with this link as the one delivering: who delivered what its
        callbacks see is known while they run (LinkHub.peer)."""
        hub = self.hub
        prev, hub.peer = hub.peer, self
        try:
            handle(arg)
        finally:
            if not hub.route_turns:
                hub.peer = prev

    def _data_message(self, v: Value) -> None:
        if self.closed or not self.ready:
            return
        if type(v) is Encoded:
            self.on_data_messages([v])
            return
        if type(v) is Record and v.label == GROUP_MESSAGE:  # (directed to a group here)
            if self.hub.groups is not None:
                self.hub.groups.message_value(self, v)
            return
        self.counters["messages_received"] += 1
        hub = self.hub
        if not self.settled:  # settled: the peer forwards only what we asked for
            wanted = self.sub.received(v, time.monotonic())
            self.flush_control(changed=False)
            if not wanted:
                self.counters["messages_dropped"] += 1
                return
        if hub.tapping:  # the tap hears it, and must know it as ours
            (hub.route_echo if self.route else self.echo).append(v)
        hub.ds.send(v)

    def on_data_messages(self, vs: list[Value]) -> None:
        """The messages of one packet from the peer (see :meth:`on_data_message`)."""
        self._as_peer(self._data_messages, vs)

    def _data_messages(self, vs: list[Value]) -> None:
        if self.closed or not self.ready:
            return
        hub = self.hub
        if not self.settled:  # each message is looked at: decoded
            for v in _values_of(vs):
                self._data_message(v)
            return
        self.counters["messages_received"] += _count_of(vs)
        tapping = hub.tapping
        echo = hub.route_echo if self.route else self.echo
        skip = self.skip
        send = hub.ds.send
        groups = hub.groups
        for v in vs:
            if type(v) is Encoded:
                if groups is not None and group_messages_in(v.buf, v.msgs):
                    self._directed_run(v, skip)
                    continue
                # Routed on its bytes: the router's forwarders, not the tap, hear it,
                # and this link's (a route's: every route's) are told to skip it.
                v.skip = skip
            elif type(v) is Record and v.label == GROUP_MESSAGE:
                if groups is not None:
                    groups.message_value(self, v)
                continue
            elif tapping:  # the tap hears it, and must know it as ours
                echo.append(v)
            send(v)

    def _directed_run(self, v: Encoded, skip: Any) -> None:
        """A run of encoded messages holding ``<group-message ...>``\\ s (directed to a
        group here): those go to the groups, the others into the dataspace, in order."""
        buf = v.buf
        send = self.hub.ds.send
        groups = self.hub.groups
        assert groups is not None
        plain: list[list[int]] = []
        for m in v.msgs:
            d = directed_at(buf, m)
            if d is None:
                plain.append(m)
                continue
            if plain:
                e = Encoded(buf, plain)
                e.skip = skip
                send(e)
                plain = []
            groups.message_in(self, d[0], body=d[1])
        if plain:
            e = Encoded(buf, plain)
            e.skip = skip
            send(e)

    def on_data_assert(self, v: Value, handle: int) -> None:
        if self.closed or handle in self.injected:
            return
        if type(v) is Record and v.label == GROUP_JOB:  # (a job directed to a group here)
            if self.hub.groups is not None:
                self.hub.groups.job_in(self, v, handle)
            return
        if type(v) not in _PLAIN:
            return  # not a Preserves value we can hold
        self.counters["assertions_received"] += 1
        self.sub.received(v, time.monotonic())
        self.flush_control(changed=False)
        k = key(v)
        n = self.injected_count.get(k, 0)
        self.injected_count[k] = n + 1
        if n == 0:
            self.hub.watch(k, +1)
        if self.route:
            held = self.hub.route_held
            held[k] = held.get(k, 0) + 1
        self.injected[handle] = (self.hub.ds.assert_(v), v)

    def on_data_retract(self, handle: int) -> None:
        rec = self.injected.pop(handle, None)
        if rec is None:
            if self.hub.groups is not None:  # (a job directed to a group here, maybe)
                self.hub.groups.job_out(self, handle)
            return
        local, v = rec
        k = key(v)
        n = self.injected_count.get(k, 0) - 1
        if n > 0:
            self.injected_count[k] = n
        else:
            self.injected_count.pop(k, None)
            self.hub.watch(k, -1)
        if self.route:
            held = self.hub.route_held
            m = held.get(k, 0) - 1
            if m > 0:
                held[k] = m
            else:
                held.pop(k, None)
        self.hub.ds.retract(local)

    def retract_injected(self) -> None:
        for handle in list(self.injected):
            self.on_data_retract(handle)

    # -- data to the peer ---------------------------------------------------------------

    def forward_messages(self, msgs: Any) -> None:
        """The messages of one turn here (a sequence): forward those the peer wants."""
        echo = self.echo
        ready = self.ready
        decide = self.prod.forward
        wanted = []
        n = 0
        for v in msgs:
            if echo and echo[0] is v:
                echo.popleft()  # it came from this link: never back
                continue
            if not ready:
                continue
            n += 1
            if decide(v):
                wanted.append(v)
        if not n:
            return
        c = self.counters
        c["messages_forwarded"] += len(wanted)
        c["messages_suppressed"] += n - len(wanted)
        if wanted:
            out = self.data_out
            send = getattr(out, "send_messages", None) if len(wanted) > 1 else None
            if send is not None:
                send(wanted)
            else:
                for v in wanted:
                    out.on_message(v)

    def reassess(self, k: Any, v: Value | None, count: int) -> None:
        """Forward or withdraw one assertion (``count``: its copies here).  A link gets
        it while some holder other than that link has it; a route, while some holder
        other than every route has it (one hop: what came over a route goes to no
        other route)."""
        want = (
            v is not None
            and self.ready
            and count > (self.hub.route_held.get(k, 0) if self.route
                         else self.injected_count.get(k, 0))
            and _forwardable(v)
            and self.prod.forward(v, assertion=True)
        )
        have = self.fwd.get(k)
        if want and have is None:
            h = fresh_handle()
            self.fwd[k] = (v, h)  # type: ignore[assignment]
            self.counters["assertions_forwarded"] += 1
            self.data_out.on_assert(v, h)
        elif have is not None and not want:
            del self.fwd[k]
            self.data_out.on_retract(have[1])

    # -- status -------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``up`` (data crosses), ``checking`` (for cycles), ``refused`` or ``down``."""
        if self.closed:
            return "down"
        if self.ready:
            return "up"
        return "refused" if self.refused is not None else "checking"

    def status(self) -> dict[str, Any]:
        s = self.sub.summary()
        prod = self.prod.entries()
        out: dict[str, Any] = {
            "connected": self.ready and not self.closed,
            "state": self.state,
            "peer_id": self.peer_id,
            "since": self.up_since if self.up_since is not None else self.since,
            "dialed": self.dialed,
            "upstreamed": s.subscribed,
            "canonical": s.canonical,
            "negative": s.negative,
            "pending": s.pending,
            "requests_sent": s.requests_sent,
            "retransmissions": s.retransmissions,
            "peer_wants": sum(1 for c, pos in prod if pos and c),
            "peer_everything": any(pos and not c for c, pos in prod),
            "peer_negative": sum(1 for _c, pos in prod if not pos),
            "assertions_held_for_peer": len(self.fwd),
            "assertions_from_peer": len(self.injected),
            **self.counters,
        }
        if self.refused is not None:
            out["refused"] = self.refused
        if self.route:
            out["route"] = True
        conn = self.hub.connection_of(self)
        if conn is not None:
            out["bytes_in"] = conn.bytes_in
            out["bytes_out"] = conn.bytes_out
        return out


# ---------------------------------------------------------------------------------------
# Every link of one dataspace


class LinkHub:
    """The links of one dataspace: interest, forwarding, handshakes, cycles, status."""

    def __init__(self, ds: Dataspace, *, server_id: str, bindings: Bindings,
                 loop: asyncio.AbstractEventLoop, name: str = "root",
                 rto: float = 1.0, rto_max: float = 30.0, max_entries: int = 100_000,
                 connections: Callable[[], Any] | None = None) -> None:
        self.ds = ds
        self.name = name
        self.server_id = server_id
        self.bindings = bindings
        self.loop = loop
        self.rto, self.rto_max, self.max_entries = rto, rto_max, max_entries
        self._connections = connections
        self.sessions: list[LinkSession] = []
        self.last_error: dict[str, str] = {}
        self.dialers: list[LinkDialer] = []
        self._rng = random.Random()
        self.forest = Forest(server_id, random=self._rng.random)
        """Which links are up: the check that a new link closes no cycle."""
        self.gone: dict[str, dict[str, Any]] = {}
        """Accepted links that went down or were refused, by peer id (for the status)."""
        self._said: dict[str, str] = {}  # peer id -> the last refusal logged as a warning
        # Local interest: Observe pattern (key) -> [chain, count]
        self._interest: dict[Any, list[Any]] = {}
        self._present: dict[Any, Value] = {}
        self._by_head: dict[Any, dict[Any, Value]] = {}
        self._watched: dict[Any, int] = {}
        self._catch_all: Subscription | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._tick_at = 0.0
        self.tapping = False  # see _tap_messages
        self.route_held: dict[Any, int] = {}
        """Copies of each assertion held here for the peers of routes (all routes)."""
        self.route_echo: deque[Value] = deque()
        """Messages that arrived over routes, to recognise in the tap (one hop)."""
        self.peer: LinkSession | None = None
        """The session -- route or link -- whose messages are being delivered here
        (while their callbacks run: a group's dispatcher leaves them to the server where
        they entered), or None: what is delivered now entered this server here."""
        self.route_turns = 0
        """Turns of route and link connections under way (see :meth:`route_turn`)."""
        self.groups: GroupLinks | None = None
        """The dataspace's groups across this hub's sessions (set by the server)."""
        self._route_exempt: dict[Any, int] = {}  # see exempt_from_routes
        self._exempt: dict[Any, int] = {}  # see exempt_from_sessions
        self._requests: dict[Any, LinkSession] = {}   # key of a link request -> session
        self.status_writer: Callable[[], None] | None = None
        self.on_change: list[Callable[[], Any]] = []
        """Called after each change of a link's state (for tests and monitors)."""
        # Links are accepted on every dataspace, and local interest is followed always
        # (so a link starts with it); the catch-all observer starts with the first link.
        req = ds.observe_hidden(Bind(from_preserves(_request_pattern())),
                                on_assert=self.accept, on_retract=self._request_removed)
        obs = ds.observe_hidden("<Observe $pattern $observer>", on_assert=self._observe_added,
                                on_retract=self._observe_removed)
        self._subs = [req, obs]

    @property
    def route_peer(self) -> LinkSession | None:
        """The route whose messages are being delivered here (while their callbacks run:
        a recorder in a cluster records only what originates with this member), or
        None: what is delivered now entered the cluster here (a link's messages too:
        they enter the cluster at the member the link is attached to)."""
        p = self.peer
        return p if p is not None and p.route else None

    def route_turn(self, turn: Callable[[], Any] | None) -> Callable[[], Any] | None:
        """The turn context for the relays of route and link connections: ``turn``
        (the server's), keeping :attr:`peer` set until the turn's callbacks have run
        (a turn's deliveries are dispatched when it ends, after the session's entity
        has returned)."""
        if turn is None:
            return None

        @contextlib.contextmanager
        def route_turn() -> Any:
            prev = self.peer
            self.route_turns += 1
            try:
                with turn():
                    yield
            finally:
                self.route_turns -= 1
                self.peer = prev

        return route_turn

    def close(self) -> None:
        for d in self.dialers:
            d.stop()
        for s in list(self.sessions):
            self.end(s)
        for sub in self._subs:
            sub.cancel()
        if self._tick is not None:
            self._tick.cancel()

    # -- local interest -------------------------------------------------------------------

    def _observe_added(self, pattern: Value, observer: Value) -> None:
        try:
            chain = pattern_chain(from_preserves(pattern))
        except PatternError:
            return
        k = key(pattern)
        e = self._interest.get(k)
        if e is None:
            self._interest[k] = [chain, 1]
            routes, links = self._wants(k)
            for s in self.sessions:
                if routes if s.route else links:
                    s.sub.add_interest(chain, time.monotonic())
                    s.flush_control()
        else:
            before = self._wants(k)
            e[1] += 1
            self._session_interest(k, before)

    def _observe_removed(self, pattern: Value, observer: Value) -> None:
        k = key(pattern)
        e = self._interest.get(k)
        if e is None:
            return
        before = self._wants(k)
        e[1] -= 1
        if e[1] <= 0:
            del self._interest[k]
            for s in self.sessions:
                if before[0] if s.route else before[1]:
                    s.sub.remove_interest(e[0], time.monotonic())
                    s.flush_control()
        else:
            self._session_interest(k, before)

    def exempt_from_routes(self, pattern: Value, delta: int) -> None:
        """``delta`` (+1 or -1) observers of ``pattern`` (an ``<Observe>``'s pattern)
        want what originates here and on links, not what comes over routes (a recorder
        in a cluster: a route's messages are recorded by the member they entered
        through).  Routes are asked for ``pattern`` only while more observers want it
        than are exempt."""
        self._exempt_change(self._route_exempt, pattern, delta)

    def exempt_from_sessions(self, pattern: Value, delta: int) -> None:
        """``delta`` (+1 or -1) observers of ``pattern`` want nothing from routes or
        links (a group's dispatcher on a server that does not coordinate the group's
        jobs: messages are given to groups where they enter, and directed on).  Neither
        is asked for ``pattern`` while no more observers want it than are exempt."""
        self._exempt_change(self._exempt, pattern, delta)

    def _exempt_change(self, table: dict[Any, int], pattern: Value, delta: int) -> None:
        k = key(pattern)
        before = self._wants(k)
        n = table.get(k, 0) + delta
        if n > 0:
            table[k] = n
        else:
            table.pop(k, None)
        self._session_interest(k, before)

    def _routes_want(self, k: Any) -> bool:
        e = self._interest.get(k)
        return e is not None and e[1] > self._route_exempt.get(k, 0) + self._exempt.get(k, 0)

    def _links_want(self, k: Any) -> bool:
        e = self._interest.get(k)
        return e is not None and e[1] > self._exempt.get(k, 0)

    def _wants(self, k: Any) -> tuple[bool, bool]:
        """Whether routes, and whether links, are asked for pattern ``k``."""
        return self._routes_want(k), self._links_want(k)

    def _session_interest(self, k: Any, before: tuple[bool, bool]) -> None:
        """Ask the routes or links for pattern ``k`` or stop, where whether they are
        asked changed."""
        after = self._wants(k)
        if after == before:
            return
        chain = self._interest[k][0] if k in self._interest else None
        if chain is None:
            return
        now = time.monotonic()
        for s in self.sessions:
            i = 0 if s.route else 1
            if after[i] == before[i]:
                continue
            if after[i]:
                s.sub.add_interest(chain, now)
            else:
                s.sub.remove_interest(chain, now)
            s.flush_control()

    def interest_for(self, session: LinkSession) -> list[Chain]:
        """What ``session`` wants from its peer: local observers' prefixes and what the
        other links want from here (and, for a link, what the routes want; for a route,
        not what the other routes want: what comes over a route goes to no route)."""
        if self._exempt or (session.route and self._route_exempt):
            want = self._routes_want if session.route else self._links_want
            out = [e[0] for k, e in self._interest.items() if want(k)]
        else:
            out = [e[0] for e in self._interest.values()]
        for s in self.sessions:
            if s is not session and s.ready and not (session.route and s.route):
                out += s.wants.values()
        return out

    @staticmethod
    def _passes(frm: LinkSession, to: LinkSession) -> bool:
        """Whether what arrives over ``frm`` goes on over ``to`` (so ``to`` asks its
        peer for what ``frm``'s peer wants): not back, and never route to route."""
        return to is not frm and not (frm.route and to.route)

    def producer_changed(self, session: LinkSession, chain: Chain) -> None:
        """The peer of ``session`` asked for (or dropped) ``chain``: pass it on to the other
        links, and re-decide the assertions it covers."""
        self._tap_messages()
        if session.fw is not None and self.ds.router is not None:
            self.ds.router.forwarder_changed(session.fw, chain, session.prod.has(chain))
        k = chain_key(chain)
        positive = session.prod.wants(chain)
        had = k in session.wants
        # What a link's peer wants is passed on to the other links once the link is up
        # (a link refused as a cycle never asks the rest of the tree for anything).
        if positive and not had:
            session.wants[k] = chain
            if session.ready:
                for s in self.sessions:
                    if self._passes(session, s):
                        s.sub.add_interest(chain, time.monotonic())
                        s.flush_control()
        elif had and not positive:
            del session.wants[k]
            if session.ready:
                for s in self.sessions:
                    if self._passes(session, s):
                        s.sub.remove_interest(chain, time.monotonic())
                        s.flush_control()
        for v in self._candidates(chain):
            vk = key(v)
            session.reassess(vk, v, self.ds.count(v))

    def _candidates(self, chain: Chain) -> list[Value]:
        if not chain:
            return list(self._present.values())
        _path, item = chain[0]
        head = ("rec", item[1]) if item[0] == "rec" else None
        pool = self._by_head.get(head, {}) if head is not None else self._present
        return [v for v in pool.values() if chain_matches(chain, v)]

    # -- what happens here --------------------------------------------------------------

    def _ensure_catch_all(self) -> None:
        """With the first link: watch local interest and everything asserted and sent
        here; with the last one gone, stop (a server without links pays nothing)."""
        if self._catch_all is None and self.sessions:
            # Assertions only: messages come through the dataspace's tap, a turn's at once.
            sub = self.ds.observe_hidden("$v", on_assert=self._added, on_retract=self._removed)
            self._catch_all = sub
            self.ds.watch_counts(self._count_changed)
            self._tap_messages()
        elif self._catch_all is not None and not self.sessions:
            self._catch_all.cancel()
            self._catch_all = None
            self._tap_messages()
            self.ds.watch_counts(None)
            self._present.clear()
            self._by_head.clear()
            self._watched.clear()

    def _tap_messages(self) -> None:
        """Hear the messages sent here (the dataspace's tap: a turn's messages at once)
        only while some peer may want one (its producer has a POSITIVE entry): a link
        whose peer wants nothing from this side costs this side's messages nothing.
        Messages injected from a link are remembered (the echo queues) only while
        tapping; when it stops, those queues are dropped."""
        on = False
        if self._catch_all is not None:
            for s in self.sessions:
                if s.prod.positives:
                    on = True
                    break
        if on == self.tapping:
            return
        self.tapping = on
        self.ds.tap_messages(self._messages if on else None)
        keep_received(on)  # forward messages as the bytes they came in
        if not on:
            for s in self.sessions:
                s.echo.clear()
            self.route_echo.clear()

    def _added(self, v: Value) -> None:
        if not _forwardable(v):
            return  # (subscriptions never cross: a server with many is not slowed)
        k = key(v)
        self._present[k] = v
        self._by_head.setdefault(_head(v), {})[k] = v
        n = self.ds.count(v)
        for s in self.sessions:
            s.reassess(k, v, n)

    def _removed(self, v: Value) -> None:
        if not _forwardable(v):
            return
        k = key(v)
        self._present.pop(k, None)
        bucket = self._by_head.get(_head(v))
        if bucket is not None:
            bucket.pop(k, None)
            if not bucket:
                del self._by_head[_head(v)]
        for s in self.sessions:
            s.reassess(k, None, 0)

    def _messages(self, msgs: Any) -> None:
        local = msgs
        echo = self.route_echo
        if echo:  # some came over routes: those go to links, never to routes (one hop)
            local = []
            for v in msgs:
                if echo and echo[0] is v:
                    echo.popleft()
                else:
                    local.append(v)
        for s in self.sessions:
            s.forward_messages(local if s.route else msgs)

    def watch(self, k: Any, delta: int) -> None:
        n = self._watched.get(k, 0) + delta
        if n > 0:
            self._watched[k] = n
        else:
            self._watched.pop(k, None)
        self.ds.watch_key(k, delta)

    def _count_changed(self, v: Value) -> None:
        k = key(v)
        if k not in self._present:
            return
        n = self.ds.count(v)
        for s in self.sessions:
            s.reassess(k, v, n)

    # -- sessions -------------------------------------------------------------------------

    def begin(self, session: LinkSession) -> None:
        """A link is established: its control starts at once; its data once the check
        that it closes no cycle has passed (:meth:`ready`)."""
        self.sessions.append(session)
        if not session.dialed and not session.route:
            self.gone.pop(session.peer_id, None)
        self._ensure_catch_all()
        session.start()
        if session.route:  # a route needs no check: data crosses it at once
            self.forest.route_up(session, session.peer_id, time.monotonic())
            self.ready(session)
        else:
            self.forest.opened(session, session.peer_id, dialed=session.dialed,
                               nonce=session.nonce or "-", now=time.monotonic())
            self.flush_forest()
        self._tap_messages()
        self.write_status()

    def flush_forest(self) -> None:
        """Send what the cycle check queued, and act on what it decided."""
        f = self.forest
        while True:
            out = f.take_outgoing()
            events = f.take_events()
            if not out and not events:
                break
            for link, msg in out:
                link.send_control(msg)
            for kind, link, why in events:
                if kind == "up":
                    self.ready(link)
                elif kind == "refused":
                    self.refuse(link, why or "refused")
        self.schedule_tick()

    def ready(self, session: LinkSession) -> None:
        """The check passed: data crosses from now on (the peer knows it first)."""
        if session.closed or session.ready:
            return
        session.ready = True
        session.up_since = time.time()
        router = self.ds.router
        if router is not None:
            session.fw = _Forward(session)
            router.add_forwarder(session.fw, [c for c, _p in session.prod.entries()])
            self.update_skips()
        self.last_error.pop(session.name, None)
        self._said.pop(session.peer_id, None)
        now = time.monotonic()
        for chain in session.wants.values():
            for s in self.sessions:
                if self._passes(session, s):
                    s.sub.add_interest(chain, now)
                    s.flush_control()
        for k, v in list(self._present.items()):
            session.reassess(k, v, self.ds.count(v))
        if self.groups is not None:  # groups: the peer is a neighbour now
            if not session.route:  # (a route's rank came with its handshake)
                session.send_control(Record(GROUP_RANK, [rank_value(self.groups.rank)]))
            self.groups.session_up(session)
        log.info("%s %s: up (peer %s)", "route" if session.route else "link", session.name,
                 session.peer_id)
        self.write_status()

    def update_skips(self) -> None:
        """What each session's incoming runs tell the router to skip: its own
        forwarder; a route's, every route's (what came over a route goes on to links
        and local observers, never to another route)."""
        routes = tuple(s.fw for s in self.sessions if s.route and s.fw is not None)
        for s in self.sessions:
            if s.route:
                s.skip = routes or None
            else:
                s.skip = (s.fw,) if s.fw is not None else None

    def refuse(self, session: LinkSession, why: str) -> None:
        """The check refused the link (it would close a cycle): no data ever crossed it.
        Its dialer closes it and tries again later; the links that are up stay up."""
        session.refused = why
        self.last_error[session.name] = why
        retry = " (it is tried again every 30-60 s)" if session.dialed else ""
        if self._said.get(session.peer_id) != why:
            self._said[session.peer_id] = why
            log.warning("link %s: refused: %s%s", session.name, why, retry)
        else:
            log.info("link %s: refused again: %s", session.name, why)
        # The accepting end closes the connection once it has heard the decision (so
        # both ends say why); the dialer does, after 5 s, if it is still open.
        if session.dialed:
            self.loop.call_later(5.0, self._close_refused, session)
        else:
            self.loop.call_soon(self._close_refused, session)
        self.write_status()

    def _close_refused(self, session: LinkSession) -> None:
        if session.closed:
            return
        conn = self.connection_of(session)
        if conn is not None and not conn.closed:
            conn.close(f"link refused: {session.refused}")

    def end(self, session: LinkSession, why: str | None = None) -> None:
        if session.closed:
            return
        was_up = session.ready
        session.closed = True
        if session in self.sessions:
            self.sessions.remove(session)
        if self.groups is not None:  # what it directed to groups here goes, ours moves
            self.groups.session_down(session)
        if session.fw is not None:
            if self.ds.router is not None:
                self.ds.router.remove_forwarder(session.fw)
            session.fw = None
            self.update_skips()
        if was_up:
            now = time.monotonic()
            for chain in session.wants.values():
                for s in self.sessions:
                    if self._passes(session, s):
                        s.sub.remove_interest(chain, now)
                        s.flush_control()
        session.wants.clear()
        session.retract_injected()
        session.fwd.clear()
        for h, s in list(self._requests.items()):
            if s is session:
                del self._requests[h]
        self.forest.closed(session, time.monotonic())
        self.flush_forest()
        self._ensure_catch_all()
        self._tap_messages()
        if why is None and session.refused is None:
            why = self.last_error.get(session.name)
        if was_up:
            log.info("%s %s: down (peer %s)%s", "route" if session.route else "link",
                     session.name, session.peer_id, f": {why}" if why else "")
        if not session.dialed and not session.route:
            now_t = time.time()
            self.gone[session.peer_id] = {
                "link": session.name, "direction": "in", "dataspace": self.name,
                "connected": False, "state": "refused" if session.refused else "down",
                "peer_id": session.peer_id, "down_since": now_t,
                **({"refused": session.refused} if session.refused else {}),
                **({"last_error": session.refused or why} if session.refused or why else {}),
            }
            for pid, row in list(self.gone.items()):
                if now_t - row["down_since"] > GONE_KEEP or len(self.gone) > GONE_MAX:
                    del self.gone[pid]
        self.write_status()

    # -- accepting links (the other side dialed) ---------------------------------------------

    def _request_removed(self, req: Value) -> None:
        # The dialing server retracted its request, or its connection closed.
        s = self._requests.pop(key(req), None)
        if s is not None:
            conn = self.connection_of(s)
            reason = conn.close_reason if conn is not None else None
            self.end(s, f"the connection closed ({reason})" if reason else
                     "the peer ended the link or its connection closed")

    def accept(self, req: Value) -> None:
        """A ``<link-request INFO #:control #:data>`` appeared here (asserted by a dialing
        server): answer on its control entity."""
        if type(req) is not Record or len(req.fields) != 3:
            return
        info, ctl, data = req.fields
        if type(ctl) is not Embedded or type(data) is not Embedded:
            return
        ctl_ref, data_ref = ctl.value, data.value
        if not isinstance(ctl_ref, Entity) or not isinstance(data_ref, Entity):
            return
        relay = getattr(ctl_ref, "relay", None)
        why = self._check_request(info)
        peer_id = info.get(_ID) if type(info) is Dictionary else None
        name = f"from {relay.name if relay is not None else '?'}"
        if why is not None:
            log.warning("link %s: refused: %s", name, why)
            self.last_error[name] = why
            ctl_ref.on_message(Record(LINK_REFUSED, [why]))
            return
        s = LinkSession(self, name, str(peer_id), relay, dialed=False)
        s.ctl_out, s.data_out = ctl_ref, data_ref
        self._requests[key(req)] = s
        if relay is not None:
            # Its turns keep the session known while their deliveries run (see peer):
            # the link's connection is a client's, whose turns are the server's.
            relay._turn = self.route_turn(relay._turn)
        ctl_ref.on_message(Record(LINK_ACCEPT, [
            Dictionary({_ID: self.server_id, _VERSION: VERSION, _NAME: self.name}),
            Embedded(s.ctl_in), Embedded(s.data_in)]))
        self.begin(s)

    def _check_request(self, info: Value) -> str | None:
        if type(info) is not Dictionary:
            return "a link request needs {id: ... version: ... cap: ...}"
        if info.get(_VERSION) != VERSION:
            return f"link protocol version {info.get(_VERSION)!r} is not {VERSION}"
        peer = info.get(_ID)
        if type(peer) is not str or not peer:
            return "a link request needs the server's id"
        if peer == self.server_id:
            return "a server cannot link to itself"
        if any(s.peer_id == peer for s in self.sessions):
            return f"server {peer} is already linked to this one"
        try:
            cap = SturdyRef.from_value(info.get(_CAP))
        except SturdyError as e:
            return f"the link request's capability is not a sturdyref: {e}"
        if cap.caveats:
            return ("links need a capability without caveats (a linked server can assert "
                    "and send anything here)")
        if not any(validate(cap, b.key) for b in self.bindings.lookup(cap.oid)):
            return "the link request's capability is not one of this server's"
        return None

    # -- timers and status ----------------------------------------------------------------

    def schedule_tick(self) -> None:
        deadlines = [d for s in self.sessions if (d := s.sub.next_deadline()) is not None]
        d = self.forest.next_deadline()
        if d is not None:
            deadlines.append(d)
        if not deadlines:
            return
        when = min(deadlines)
        if self._tick is not None:
            if self._tick_at <= when:
                return  # the timer set goes off first, and re-arms itself then
            self._tick.cancel()
        self._tick_at = when
        self._tick = self.loop.call_later(max(0.0, when - time.monotonic()), self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        now = time.monotonic()
        self.forest.tick(now)
        self.flush_forest()
        for s in list(self.sessions):
            s.sub.tick(now)
            s.flush_control()
        self.schedule_tick()

    def connection_of(self, session: LinkSession) -> Connection | None:
        if session.conn is not None:
            return session.conn
        if session.relay is None:
            return None
        for d in self.dialers:
            if d.conn is not None and d.conn.relay is session.relay:
                return d.conn
        for c in self._connections() if self._connections is not None else ():
            if c.relay is session.relay:
                return c
        return None

    def status(self) -> list[dict[str, Any]]:
        out = []
        up = {s.name: s for s in self.sessions}
        for d in self.dialers:
            s = d.session
            row = {"link": d.spec.address, "direction": "out", "dataspace": self.name}
            if len(d.spec.addresses) > 1:
                row["peer_address"] = d.current
            if s is not None and not s.closed:
                row.update(s.status())
                if d.refused and "refused" not in row:  # checked again, refused last time
                    row["refused"] = d.refused
            else:
                row.update({"connected": False, "attempts": d.attempts,
                            "state": "refused" if d.refused else "connecting",
                            "down_since": d.down_since})
                if d.last_peer:
                    row["peer_id"] = d.last_peer
                if d.refused:
                    row["refused"] = d.refused
                if d.next_attempt is not None:
                    row["next_attempt"] = d.next_attempt
            if d.spec.address in self.last_error:
                row["last_error"] = self.last_error[d.spec.address]
            out.append(row)
        live = set()
        for name, s in up.items():
            if s.dialed or s.route:
                continue
            live.add(s.peer_id)
            row = {"link": name, "direction": "in", "dataspace": self.name, **s.status()}
            out.append(row)
        for pid, row in self.gone.items():
            if pid not in live:
                out.append(dict(row))
        return out

    def write_status(self) -> None:
        """Have the server write every link's status (see ``dataspace link status``)."""
        if self.status_writer is not None:
            self.status_writer()
        self.notify()

    def notify(self) -> None:
        for fn in self.on_change:
            try:
                fn()
            except Exception:  # pragma: no cover - a monitor's bug must not break links
                log.exception("link change callback failed")


def _request_pattern() -> Value:
    from ..pattern import parse_pattern, to_preserves

    return to_preserves(parse_pattern("<link-request _ _ _>"))


# ---------------------------------------------------------------------------------------
# Dialing a link (the side configured with --link)


class _Resolver(Entity):
    def __init__(self, fut: asyncio.Future[Any]) -> None:
        self.fut = fut

    def on_assert(self, value: Value, handle: int) -> None:
        if self.fut.done() or type(value) is not Record or not value.fields:
            return
        if value.label == ACCEPTED and type(value.fields[0]) is Embedded:
            self.fut.set_result(value.fields[0].value)
        elif value.label == REJECTED:
            self.fut.set_exception(ConnectionError(f"the capability was rejected: "
                                                   f"{stringify(value.fields[0])}"))


class _DialControl(Entity):
    """The dialer's control entity before the session exists: waits for the answer."""

    def __init__(self, dialer: LinkDialer) -> None:
        self.dialer = dialer

    def on_message(self, value: Value) -> None:
        d = self.dialer
        s = d.session
        if s is not None:
            s.on_control(value)
        elif d._answer is not None and not d._answer.done():
            d.on_answer(value)
        else:
            d.early.append(value)  # after the answer, before the session: kept in order


class _DialData(Entity):
    def __init__(self, dialer: LinkDialer) -> None:
        self.dialer = dialer

    def on_assert(self, value: Value, handle: int) -> None:
        if self.dialer.session is not None:
            self.dialer.session.on_data_assert(value, handle)

    def on_retract(self, handle: int) -> None:
        if self.dialer.session is not None:
            self.dialer.session.on_data_retract(handle)

    def on_message(self, value: Value) -> None:
        if self.dialer.session is not None:
            self.dialer.session.on_data_message(value)

    def attach(self, session: LinkSession) -> None:
        """The session exists: messages go straight to it from now on (the data path,
        the hottest, without a call in between)."""
        self.on_message = session.on_data_message  # type: ignore[method-assign]
        self.on_messages = session.on_data_messages

    @property
    def accepts_encoded(self) -> bool:
        """As :attr:`_Data.accepts_encoded` (this is the dialing side's)."""
        return self.dialer.hub.ds.router is not None


REPEAT_WARNING = 60.0
"""Seconds before a link's same connection failure is warned of again."""


class FailureWarnings:
    """Which of a link's failed attempts are warned of: the first, each whose reason
    differs from the one before, and then at most one every ``every`` seconds while the
    reason stays the same, saying how many attempts failed since the last warning.  The
    others are details (:data:`retry_log`).  Time comes in as an argument."""

    def __init__(self, every: float = REPEAT_WARNING) -> None:
        self.every = every
        self.reason: str | None = None
        self.warned_at = 0.0
        self.since = 0  # failed attempts since the last warning

    def failed(self, reason: str, now: float) -> str | None:
        """An attempt failed for ``reason`` at ``now`` (seconds): None if it is not
        warned of, else what the warning adds ("" the first time, else e.g. " (still
        failing: 7 attempts in 61 s)")."""
        if reason != self.reason:
            self.reason, self.warned_at, self.since = reason, now, 0
            return ""
        self.since += 1
        if now - self.warned_at < self.every:
            return None
        said = f" (still failing: {self.since} attempt{'s' if self.since != 1 else ''} in " \
            f"{now - self.warned_at:.0f} s)"
        self.warned_at, self.since = now, 0
        return said

    def reset(self) -> None:
        """The link is up: its next failure is warned of at once."""
        self.reason = None
        self.since = 0


def _dial_failure(e: BaseException, address: str) -> str:
    """Why a link could not connect, in words (not ``[Errno 111] Connect call failed``)."""
    if isinstance(e, ConnectionRefusedError):
        return f"no server at {address} (connection refused): is the server there running?"
    if isinstance(e, FileNotFoundError):
        return f"no server at {address} (no such socket): is the server there running?"
    if isinstance(e, TimeoutError) and not str(e):
        return f"no answer from {address}"
    if isinstance(e, OSError) and e.strerror and not isinstance(e, ConnectionError):
        return f"cannot connect to {address}: {e.strerror}"
    return str(e) or type(e).__name__


class LinkDialer:
    """Keeps the link of one ``--link`` connected, reconnecting with backoff."""

    def __init__(self, hub: LinkHub, spec: LinkSpec, net_hub: Hub,
                 turn: Callable[[], Any] | None, backoff: tuple[float, float] = (0.1, 10.0),
                 refused_retry: tuple[float, float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hub = hub
        self.spec = spec
        self.net_hub = net_hub
        self.turn = turn
        self.backoff = backoff
        self.refused_retry = REFUSED_RETRY if refused_retry is None else refused_retry
        self.session: LinkSession | None = None
        self.conn: Connection | None = None
        self.attempts = 0
        self.connects = 0
        self.refused: str | None = None
        """Why the last connection was refused as a cycle (None once a link is up)."""
        self.down_since = time.time()
        self.next_attempt: float | None = None  # (epoch seconds)
        self.last_peer = ""
        self._at = 0  # which of the spec's addresses is dialed (several: a cluster's members)
        self._stop = asyncio.Event()
        self._answer: asyncio.Future[Value] | None = None
        self.early: list[Value] = []
        self._task: asyncio.Task[None] | None = None
        self._rng = random.Random()
        self._clock = clock  # (for the warnings' once a minute)
        self.quota: Quota | None = None
        """Charged for what the peer asserts here (the server's memory budget), if set."""

    @property
    def current(self) -> str:
        """The address dialed now (one of the spec's)."""
        return self.spec.addresses[self._at]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        self._stop.set()
        if self.conn is not None:
            self.conn.close("the server is shutting down")

    async def wait_stopped(self) -> None:
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, 5.0)

    def on_answer(self, v: Value) -> None:
        fut = self._answer
        if fut is not None and not fut.done():
            fut.set_result(v)

    def _jitter(self, delay: float) -> float:
        """The wait before the next attempt: a random 50-100% of ``delay`` (which doubles
        up to the backoff's cap: the cap is the longest wait)."""
        return delay * (0.5 + 0.5 * self._rng.random())

    async def _run(self) -> None:
        lo, hi = self.backoff
        delay = lo
        n = len(self.spec.addresses)
        failed = 0  # addresses that failed in a row (a round: each was tried once)
        warnings = FailureWarnings()
        while not self._stop.is_set():
            self.attempts += 1
            self.next_attempt = None
            wait: float | None = None
            try:
                await self._connect_once()
                delay = lo
                failed = 0
                warnings.reset()
                assert self.conn is not None
                await self.conn.wait_closed()
                reason = self.conn.close_reason
                s = self.session
                if s is not None and s.refused is not None:
                    # Refused as a cycle (said when it was): tried again slowly, as the
                    # links that close the cycle may go meanwhile.
                    a, b = self.refused_retry
                    wait = a + (b - a) * self._rng.random()
                elif not self._stop.is_set():
                    log.warning("link %s: connection lost (%s); reconnecting",
                                self.spec.address, reason)
                    if n > 1:  # the member is likely gone: the next one at once
                        self._at = (self._at + 1) % n
                        wait = 0.0
            except (OSError, ConnectionError, TimeoutError) as e:
                msg = _dial_failure(e, self.current)
                if n > 1:
                    if self.current not in msg:
                        msg = f"{self.current}: {msg}"
                    self._at = (self._at + 1) % n
                    failed += 1
                else:
                    msg = _dial_failure(e, self.spec.address)
                self.hub.last_error[self.spec.address] = msg
                if n > 1 and failed % n:
                    wait = 0.0  # the next address of this round at once
                    retry_log.info("link %s: %s; trying %s", self.spec.address, msg,
                                   self.current)
                else:
                    wait = self._jitter(delay)
                    delay = min(hi, delay * 2)
                    # The same failure again (a peer that stays down, a CA that stays
                    # wrong) is a warning once a minute, not at every attempt; the
                    # attempts between are details (-v).
                    said = warnings.failed(msg, self._clock())
                    if said is not None:
                        log.warning("link %s: %s; retrying in %.1f s%s", self.spec.address,
                                    msg, wait, said)
                    else:
                        retry_log.info("link %s: %s; retrying in %.1f s", self.spec.address,
                                       msg, wait)
            finally:
                s = self.session
                self.session = None
                self.refused = s.refused if s is not None else None
                if s is not None:
                    self.last_peer = s.peer_id
                    self.hub.end(s, None if s.refused else
                                 f"the connection closed ({self.conn.close_reason})"
                                 if self.conn is not None and self.conn.close_reason else None)
                if self.conn is not None and not self.conn.closed:
                    self.conn.close("link ended")
                self.conn = None
                self.down_since = time.time()
            if self._stop.is_set():
                return
            if wait is None:
                wait = self._jitter(delay)
                delay = min(hi, delay * 2)
            self.next_attempt = time.time() + wait
            self.hub.write_status()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), wait)

    async def _open(self) -> Connection:
        a: Address = parse_address(self.current, default_kind="tcp")

        def session(conn: Connection) -> Relay:
            return Relay(limits=LINK_RELAY_LIMITS, name=f"link:{self.spec.address}",
                         turn=self.hub.route_turn(self.turn), quota=self.quota)

        return await dial(a, self.net_hub, LINK_FLOW, session, LINK_RELAY_LIMITS.max_packet_size,
                          tls=self.spec.tls, coalesce=False)

    async def _connect_once(self) -> None:
        loop = asyncio.get_running_loop()
        conn = await asyncio.wait_for(self._open(), 10.0)
        self.conn = conn
        relay = conn.relay
        assert relay is not None
        fut: asyncio.Future[Any] = loop.create_future()
        gk = relay.import_ref(0)
        gk.on_assert(Record(RESOLVE, [self.spec.cap.to_value(), Embedded(_Resolver(fut))]),
                     fresh_handle())
        self.net_hub.flush(None)
        try:
            ref = await self._wait(fut, conn, "resolving the capability")
        except ConnectionError:
            # (the address dialed: the spec may list several, a cluster's members)
            why = await explain_early_close(parse_address(self.current, default_kind="tcp"),
                                            conn, self.spec.tls) if conn.closed else None
            if why is not None:
                raise ConnectionError(why) from None
            raise
        answer: asyncio.Future[Value] = loop.create_future()
        self._answer = answer
        self.early = []
        ctl, data = _DialControl(self), _DialData(self)
        info = Dictionary({_ID: self.hub.server_id, _VERSION: VERSION,
                           _CAP: self.spec.cap.to_value(), _NAME: self.hub.name})
        ref.on_assert(Record(LINK_REQUEST, [info, Embedded(ctl), Embedded(data)]), fresh_handle())
        self.net_hub.flush(None)
        v = await self._wait(answer, conn, "waiting for the link to be accepted")
        if type(v) is Record and v.label == LINK_REFUSED:
            why = v.fields[0] if v.fields else "refused"
            raise ConnectionError(f"the peer refused the link: {why}")
        if (type(v) is not Record or v.label != LINK_ACCEPT or len(v.fields) != 3
                or type(v.fields[0]) is not Dictionary
                or type(v.fields[1]) is not Embedded or type(v.fields[2]) is not Embedded):
            raise ConnectionError(f"the peer answered the link request with {stringify(v)[:80]}")
        peer_id = v.fields[0].get(_ID)
        if peer_id == self.hub.server_id:
            raise ConnectionError("this link leads back to this same server")
        s = LinkSession(self.hub, self.spec.address, str(peer_id), relay, dialed=True)
        s.ctl_in, s.data_in = ctl, data  # type: ignore[assignment]
        data.attach(s)
        s.ctl_out, s.data_out = v.fields[1].value, v.fields[2].value
        self.session = s
        self.connects += 1
        self.hub.begin(s)
        early, self.early = self.early, []
        for m in early:
            s.on_control(m)
        self.net_hub.flush(None)

    async def _wait(self, fut: asyncio.Future[Any], conn: Connection, what: str) -> Any:
        closed = asyncio.ensure_future(conn.wait_closed())
        try:
            await asyncio.wait({fut, closed}, timeout=10.0, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
        if not fut.done():
            fut.cancel()
            relay = conn.relay
            reason = (relay.peer_error[0] if relay is not None and relay.peer_error
                      else conn.close_reason)
            raise ConnectionError(f"{what}: {reason or 'no answer within 10 s'}")
        return fut.result()


def write_status_file(path: Path, hubs: list[LinkHub]) -> None:
    rows = [row for h in hubs for row in h.status()]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # The pid lets `dataspace link status` tell a stopped server from a running one at once
    # (the file stays after a server stops, and its time alone takes seconds to go stale).
    doc = {"time": time.time(), "pid": os.getpid(), "links": rows}
    tmp.write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")
    os.replace(tmp, path)
