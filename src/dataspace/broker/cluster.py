"""A cluster of brokers: a full mesh of routes with one-hop forwarding (docs/cluster.md).

A server started with ``--cluster HOST:PORT`` listens there for *routes* from the other
members and dials the members it is given (``--routes``) and those they tell it of
(:mod:`dataspace.protocol.cluster`, sans-IO, decides: membership, gossip, one route per
pair, keepalive).  A route is a link session (:class:`~dataspace.broker.link.LinkSession`
with ``route=True``) of the root dataspace's link hub: the seed's subscription
upstreaming runs on it both ways, and the data path forwards messages as the bytes they
came in.  It differs from a link in the forwarding rule -- what arrives over a route is
delivered to local observers and links, never to another route (one hop) -- and in
needing no cycle check.

The route handshake, on the member's cluster port (its own listener: nothing else is
reachable there):

1. the dialer resolves the route capability at the port's gatekeeper (oid
   ``"route:NAME"``, signed with a key derived from the cluster secret and the cluster
   name: a stranger, or a member of another cluster, is rejected there);
2. it asserts ``<route-request {cluster: NAME id: ID version: 1 address: ADDRESS
   incarnation: [START NONCE] nonce: NONCE} #:control #:data>`` to what it resolved;
3. the member answers on ``control`` with ``<route-accept {cluster: ... id: ...
   address: ... incarnation: ...} #:control #:data>``, or ``<route-refused WHY>``;
4. from then on both ends send the link protocol's messages (the seed's requests and
   confirmations, the cycle check's ``<tree-...>``) and the cluster's own
   (``<route-ping>``, ``<route-members [[ID ADDRESS] ...]>``, ``<route-refused WHY>``)
   to each other's ``control``, and the values to ``data``, as links do.

TLS: the listener and the dialer take an :class:`ssl.SSLContext` each (``ssl_server``,
``ssl_client``): a server with a certificate gives both (its cluster port speaks TLS, and it
dials members with TLS, checking their certificates against ``--tls-ca``; see
:meth:`~dataspace.broker.config.ServerConfig.route_tls`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import ssl as _ssl
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..dataspace import Entity, fresh_handle
from ..net.address import AddressError, parse_address
from ..net.connection import Connection, StreamConnection
from ..net.flow import Hub
from ..net.reclaim import Reclaimer
from ..net.sniff import identify
from ..net.tls import is_not_tls, server_protocol, speaks_tls
from ..protocol.cluster import (
    ITSELF,
    MESSAGES,
    ROUTE_ACCEPT,
    ROUTE_REFUSED,
    ROUTE_REQUEST,
    ClusterError,
    Membership,
    RouteInfo,
    route_key,
    route_oid,
)
from ..protocol.gatekeeper import ACCEPTED, REJECTED, RESOLVE, Bindings, Gatekeeper
from ..protocol.groups import Rank
from ..protocol.relay import Quota, Relay
from ..protocol.sturdy import mint
from ..values import Embedded, Record, Symbol, Value, stringify
from .link import LINK_FLOW, LINK_RELAY_LIMITS, LinkHub, LinkSession

__all__ = ["CLUSTER_STATUS_FILE", "SECRET_FILE", "Cluster", "ClusterSpec", "make_secret",
           "read_secret"]

log = logging.getLogger(__name__)

CLUSTER_STATUS_FILE = "cluster.json"
"""Where a member writes its cluster's status (read by ``dataspace cluster status``)."""
SECRET_FILE = "cluster.secret"
"""The cluster secret's file in the data directory, when ``--cluster-secret`` is not given."""
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a connection to the cluster port has to become a route."""
STRANGER_TIMEOUT = 3.0
"""Seconds a connection to the cluster port has to show the route capability (a member
resolves it as soon as it is connected: one round trip); until then it is a *stranger*."""
STRANGER_INPUT = 8 << 10
"""Bytes a stranger may send (a member's request for the route capability is under 300
bytes; a route's packets may be large, up to 16 MiB, once it has shown it)."""
MAX_STRANGERS = 256
"""Strangers a cluster port holds at once.  When they are as many, a new connection
closes the oldest stranger of the network address that has the most (so an address
flooding the port cycles its own connections, never another's), and a member's dial,
which shows the capability within a round trip, always finds a place: strangers holding
every slot and reconnecting at once never keep a member out."""
STRANGER_BYTES = 32 << 10
"""What a stranger costs the member, counted in its memory budget (its connection's
objects, measured at about 30 KiB, and what it may send)."""
MAX_ROUTE_CONNECTIONS = 1_000
"""Connections the cluster port holds at once (routes and handshakes)."""
MAX_HANDSHAKES = MAX_STRANGERS
"""(The name of :data:`MAX_STRANGERS` before issue 29.)"""
UNSPECIFIED = ("0.0.0.0", "::", "")


def make_secret() -> str:
    """A new cluster secret, as the text of its file (32 random bytes in hex)."""
    return secrets.token_hex(32) + "\n"


def read_secret(path: Path) -> bytes:
    """The cluster secret in ``path`` (hex text, or at least 16 bytes of anything);
    raises ``ValueError`` saying what is wrong."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"the cluster secret {path} does not exist: make one with "
                         f"`dataspace cluster secret {path}` and copy it to every "
                         "member") from None
    except OSError as e:
        raise ValueError(f"cannot read the cluster secret {path}: {e.strerror or e}") from None
    text = data.strip()
    try:
        secret = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        secret = text
    if len(secret) < 16:
        raise ValueError(f"the cluster secret {path} is too short (at least 16 bytes): make "
                         f"one with `dataspace cluster secret {path}`")
    with contextlib.suppress(OSError):
        if path.stat().st_mode & 0o077:
            log.warning("the cluster secret %s can be read by other users: chmod 600 it", path)
    return secret


DEFAULT_MAX_MEMBERS = 64
"""The default :attr:`ClusterSpec.max_members`: a cluster has a handful to a few dozen
members (``cluster: {max-members: N}``, ``--cluster-max-members N``)."""


@dataclass(frozen=True)
class ClusterSpec:
    """How this member joins its cluster."""

    listen: str
    """``HOST:PORT`` to listen on for routes."""
    routes: tuple[str, ...] = ()
    """Addresses of members to dial (more are learned from them)."""
    name: str = "dataspace"
    secret: bytes = b""
    advertise: str | None = None
    """The address other members dial to reach this one (default: ``listen``, its host
    taken from the connection when it is 0.0.0.0 or ::)."""
    ping: float = 1.0
    dead: float = 3.0
    max_members: int = DEFAULT_MAX_MEMBERS
    """The most members this one keeps in its table (gossip beyond it is ignored)."""


SAY_AGAIN = 60.0
"""Seconds between two lines of one cause that is counted rather than logged each time
(gossip beyond the table, dials of members only gossip named, connections the server
closes for a timeout)."""


class CountedWarnings:
    """One warning per cause, then a count: a line saying how many more, at most every
    :data:`SAY_AGAIN` seconds (so a flood of one cause writes a few lines, not one each);
    the others go to ``logger`` at DEBUG (unless ``debug=False``: a caller that says each
    at DEBUG itself, as a quiet ``Connection.fail`` does).  Time comes in as an argument."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self.log = logger
        self._causes: dict[str, list[float]] = {}  # cause -> [more since last line, when]

    def say(self, cause: str, text: str, now: float, *, debug: bool = True) -> None:
        c = self._causes.get(cause)
        if c is None:
            if len(self._causes) >= 64:  # (causes are few; never a table a peer grows)
                self._causes.clear()
            self._causes[cause] = [0, now]
            self.log.warning("%s", text)
            return
        c[0] += 1
        if now - c[1] >= SAY_AGAIN:
            self.log.warning("%s (%d more like it in the last %.0f s)", text, int(c[0]) - 1,
                             now - c[1])
            c[0], c[1] = 0, now
        elif debug:
            self.log.debug("%s", text)


# ---------------------------------------------------------------------------------------
# Entities of the handshake


class _Acceptor(Entity):
    """What the route capability designates on the cluster port."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def on_assert(self, value: Value, handle: int) -> None:
        self.cluster.accept(value, handle)

    def on_retract(self, handle: int) -> None:
        self.cluster.request_gone(handle)


class _Resolver(Entity):
    def __init__(self, fut: asyncio.Future[Any]) -> None:
        self.fut = fut

    def on_assert(self, value: Value, handle: int) -> None:
        if self.fut.done() or type(value) is not Record or not value.fields:
            return
        if value.label == ACCEPTED and type(value.fields[0]) is Embedded:
            self.fut.set_result(value.fields[0].value)
        elif value.label == REJECTED:
            self.fut.set_exception(ConnectionError(
                f"the member's cluster port rejected the route capability "
                f"({stringify(value.fields[0])}): is it in another cluster (--cluster-name), "
                "or given another --cluster-secret?"))


class _Attempt:
    """One dial of a route, until its session exists."""

    def __init__(self, cluster: Cluster, address: str, conn: Connection, nonce: str,
                 fut: asyncio.Future[None]) -> None:
        self.address = address
        self.conn = conn
        self.nonce = nonce
        self.fut = fut
        self.session: LinkSession | None = None
        self.ctl = _DialControl(cluster, self)
        self.data = _DialData()


class _DialControl(Entity):
    def __init__(self, cluster: Cluster, attempt: _Attempt) -> None:
        self.cluster = cluster
        self.attempt = attempt

    def on_message(self, value: Value) -> None:
        s = self.attempt.session
        if s is not None:
            s.on_control(value)
        else:
            self.cluster._answered(self.attempt, value)


class _DialData(Entity):
    def __init__(self) -> None:
        self.session: LinkSession | None = None

    def on_assert(self, value: Value, handle: int) -> None:
        if self.session is not None:
            self.session.on_data_assert(value, handle)

    def on_retract(self, handle: int) -> None:
        if self.session is not None:
            self.session.on_data_retract(handle)

    def on_message(self, value: Value) -> None:
        if self.session is not None:
            self.session.on_data_message(value)

    def attach(self, session: LinkSession) -> None:
        self.session = session
        self.on_message = session.on_data_message  # type: ignore[method-assign]
        self.on_messages = session.on_data_messages

    @property
    def accepts_encoded(self) -> bool:
        """A route's messages may come as runs of encoded messages, routed on their bytes
        (see ``link._Data.accepts_encoded``)."""
        s = self.session
        return s is not None and s.hub.ds.router is not None


ONE_RULE = ("one rule for the whole cluster: every member a certificate (--tls-cert, "
            "--tls-key, --tls-ca), or none")


def _route_error(e: BaseException) -> str:
    """One line for a failed route dial (TLS failures say what to change)."""
    if isinstance(e, _ssl.SSLCertVerificationError):
        return (f"the member's certificate was refused ({e.verify_message}): every member "
                "needs --tls-ca naming the CA that signed the others' certificates, and a "
                "certificate for the address the others dial")
    if isinstance(e, _ssl.SSLError):
        if is_not_tls(e):
            return ("the member does not speak TLS on its cluster port (it has no "
                    "certificate), and this member dials with TLS (it has one): "
                    f"{ONE_RULE}")
        return f"TLS failed ({e.reason or e}): {ONE_RULE}"
    return str(e) or type(e).__name__


SPEAKS_TLS = ("the member speaks TLS on its cluster port (it has a certificate), and this "
              f"member dials without (it has none): {ONE_RULE}")
"""Why a member without a certificate gets no route to one with (its connection is closed
without a word: asked again with a TLS handshake to tell)."""
HEARS_TLS = ("a member dials this one with TLS (it has a certificate) and this member has "
             f"none: {ONE_RULE}")


# ---------------------------------------------------------------------------------------
# The cluster


class Cluster:
    """This member's routes (see the module docstring).  ``hub``: the root dataspace's
    link hub; ``net_hub``: the server's connection hub; ``turn``: the server's turn
    context for relays."""

    def __init__(self, hub: LinkHub, spec: ClusterSpec, net_hub: Hub, *, turn: Any = None,
                 ssl_server: _ssl.SSLContext | None = None,
                 ssl_client: _ssl.SSLContext | None = None,
                 rng: random.Random | None = None) -> None:
        self.hub = hub
        self.spec = spec
        self.net_hub = net_hub
        self.turn = turn
        self.ssl_server = ssl_server
        self.ssl_client = ssl_client
        self.quota: Quota | None = None
        """What routes' relays charge what other members assert here to (the server's
        memory budget); None: nothing is charged."""
        self.rng = rng or random.Random()
        self.me = hub.server_id
        self.name = spec.name
        self.cap = mint(route_oid(spec.name), route_key(spec.secret, spec.name))
        self.bindings = Bindings()
        self.bindings.bind(self.cap.oid, route_key(spec.secret, spec.name), _Acceptor(self),
                           "route")
        self.incarnation = (time.time(), secrets.token_hex(8))
        self.address = ""
        """Where other members dial this one (known once listening)."""
        self.listen_address = ""
        self.membership: Membership | None = None
        self.connections: set[Connection] = set()
        self._relay_conn: dict[Relay, Connection] = {}
        self._of_conn: dict[Connection, LinkSession] = {}
        self._requests: dict[int, LinkSession] = {}
        self._handshaking: dict[Connection, float] = {}
        """Connections not yet routes, and since when (``time.monotonic()``)."""
        self._strangers: dict[Connection, str] = {}
        """Those that have not shown the route capability yet, oldest first, with their
        network address."""
        self._dialing: dict[str, asyncio.Task[None]] = {}
        self._failures: dict[str, int] = {}
        self._said = CountedWarnings()
        self._server: asyncio.AbstractServer | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._closing = False
        self.refused = 0
        """Route requests refused (another cluster, to itself, malformed)."""
        self._reclaimer = Reclaimer("strangers on the cluster port", 256, interval=5.0)
        self.strangers_closed = 0
        """Strangers closed: to make room for newer ones (:data:`MAX_STRANGERS`), for
        sending too much (:data:`STRANGER_INPUT`) or too slowly (:data:`STRANGER_TIMEOUT`)."""
        self.heard_tls = 0
        """TLS handshakes on this member's plain cluster port (a member with a certificate
        dialing one without)."""
        self.established = 0
        """Routes whose handshake completed since the start."""
        self.on_change: list[Any] = []
        """Called after each step of the membership machine (for tests and monitors)."""

    # -- starting and stopping ----------------------------------------------------------

    async def start(self) -> None:
        """Listen on the cluster address and start dialing (raises OSError)."""
        a = parse_address(self.spec.listen, default_kind="tcp")
        loop = asyncio.get_running_loop()

        def plain() -> StreamConnection:
            return StreamConnection(self.net_hub, LINK_FLOW, self._session)

        # (With TLS, the handshake comes first: bounded in time and in number, its
        # buffers small; see net.tls.)
        self._server = await loop.create_server(
            plain if self.ssl_server is None else server_protocol(plain, self.ssl_server),
            a.host, a.port, reuse_address=True)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.listen_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.address = self.spec.advertise or self.listen_address
        self.membership = Membership(self.me, self.address, self.spec.routes,
                                     random=self.rng.random, ping=self.spec.ping,
                                     dead=self.spec.dead, incarnation=self.incarnation,
                                     max_members=self.spec.max_members)
        self.membership.start(time.monotonic())
        log.debug("cluster %s: listening for routes on %s (member %s)", self.name,
                  self.listen_address, self.me)
        self._apply()

    async def close(self) -> None:
        self._closing = True
        self._reclaimer.close()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for t in list(self._dialing.values()):
            t.cancel()
        for t in list(self._dialing.values()):
            with contextlib.suppress(BaseException):
                await t
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close("the server is shutting down")
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            self._server = None

    # -- the cluster port ----------------------------------------------------------------

    def _session(self, conn: Connection) -> Relay:
        relay = Relay(limits=LINK_RELAY_LIMITS, name=f"route:{conn.name}", turn=self.turn,
                      quota=self.quota)
        relay.export_at(0, Gatekeeper(self.bindings, on_rejected=relay.fail,
                                      on_accepted=lambda _b, _c: self._shown(conn)))
        if self._closing or len(self.connections) >= MAX_ROUTE_CONNECTIONS:
            self.refused += 1
            relay.fail("the cluster port is full or shutting down", Symbol("server-full"))
            return relay
        if len(self._strangers) >= MAX_STRANGERS:
            self._make_room()
        self._track(conn, relay)
        self._handshaking[conn] = time.monotonic()
        self._strangers[conn] = conn.peer_host or ""
        conn.max_input = STRANGER_INPUT
        self._notify()
        timer = asyncio.get_running_loop().call_later(STRANGER_TIMEOUT,
                                                      self._handshake_check, conn)
        conn.on_close.append(lambda _c: timer.cancel())
        return relay

    def _make_room(self) -> None:
        """Close the oldest stranger of the address that has the most."""
        counts = Counter(self._strangers.values())
        host = max(counts, key=counts.__getitem__)
        oldest = next(c for c, h in self._strangers.items() if h == host)
        del self._strangers[oldest]
        self._handshaking.pop(oldest, None)
        self.strangers_closed += 1
        oldest.fail("the cluster port is busy: this connection was the oldest of those that "
                    "had not shown the route capability", Symbol("server-full"), quiet=True)

    def held_bytes(self) -> int:
        """What strangers on the cluster port make this member hold (for the server's
        memory budget: they are peers, as clients are)."""
        return len(self._strangers) * STRANGER_BYTES

    def _shown(self, conn: Connection) -> None:
        """``conn`` showed the route capability: a member, not a stranger (its packets
        may be large from now on; it has HANDSHAKE_TIMEOUT to become a route)."""
        if self._strangers.pop(conn, None) is not None:
            conn.max_input = None

    def _track(self, conn: Connection, relay: Relay) -> None:
        self.connections.add(conn)
        self._relay_conn[relay] = conn
        conn.on_close.append(self._conn_closed)

    def _handshake_check(self, conn: Connection) -> None:
        if conn.closed or conn in self._of_conn:
            return
        since = self._handshaking.get(conn)
        if since is None:
            return
        if conn in self._strangers:
            del self._strangers[conn]
            self._handshaking.pop(conn, None)
            self.strangers_closed += 1
            conn.fail(f"the route capability was not shown within {STRANGER_TIMEOUT:g} s",
                      Symbol("handshake-timeout"), quiet=True)
            return
        left = since + HANDSHAKE_TIMEOUT - time.monotonic()
        if left > 0:
            timer = asyncio.get_running_loop().call_later(left, self._handshake_check, conn)
            conn.on_close.append(lambda _c: timer.cancel())
            return
        self._handshaking.pop(conn, None)
        self.strangers_closed += 1
        conn.fail(f"no route handshake within {HANDSHAKE_TIMEOUT:g} s",
                  Symbol("handshake-timeout"), quiet=True)

    def _conn_closed(self, conn: Connection) -> None:
        self.connections.discard(conn)
        if conn not in self._of_conn:  # (never a route: a stranger, or a dial that failed)
            self._reclaimer.closed()
        if conn in self._handshaking and self.ssl_server is None and identify(conn.head) == "TLS":
            # (Once a warning; a stranger speaking TLS here does not fill the log.)
            self.heard_tls += 1
            (log.warning if self.heard_tls == 1 else log.debug)(
                "route from %s: %s", conn.peer_host or conn.name, HEARS_TLS)
        self._handshaking.pop(conn, None)
        if (self._strangers.pop(conn, None) is not None and conn.max_input is not None
                and conn.bytes_in > conn.max_input):
            self.strangers_closed += 1  # (closed for sending too much: see data_received)
        if conn.relay is not None:
            self._relay_conn.pop(conn.relay, None)
        s = self._of_conn.pop(conn, None)
        if s is None:
            self._notify()
            return
        reason = conn.close_reason
        self.hub.end(s, f"the connection closed ({reason})" if reason else None)
        for h, other in list(self._requests.items()):
            if other is s:
                del self._requests[h]
        if self.membership is not None:
            self.membership.closed(s, time.monotonic())
            self._apply()

    def _info(self, dialer: str, nonce: str) -> RouteInfo:
        return RouteInfo(self.name, self.me, self.address, self.incarnation, dialer, nonce)

    def accept(self, req: Value, handle: int) -> None:
        """A ``<route-request INFO #:control #:data>`` came to the cluster port."""
        if (type(req) is not Record or req.label != ROUTE_REQUEST or len(req.fields) != 3
                or type(req.fields[1]) is not Embedded or type(req.fields[2]) is not Embedded):
            return
        info_v, ctl, data = req.fields
        ctl_ref, data_ref = ctl.value, data.value
        if not isinstance(ctl_ref, Entity) or not isinstance(data_ref, Entity):
            return
        relay = getattr(ctl_ref, "relay", None)
        conn = self._relay_conn.get(relay) if relay is not None else None
        if conn is None or conn.closed or conn in self._of_conn or self.membership is None:
            return
        try:
            info = RouteInfo.from_value(info_v)
            if info.cluster != self.name:
                raise ClusterError(f"this member is in cluster {self.name!r}, not "
                                   f"{info.cluster!r}")
        except ClusterError as e:
            self.refused += 1
            log.warning("route from %s: refused: %s", conn.name, e)
            ctl_ref.on_message(Record(ROUTE_REFUSED, [str(e)]))
            return
        if info.address:
            host, _sep, port = info.address.rpartition(":")
            if host.strip("[]") in UNSPECIFIED and conn.peer_host:
                # It listens on every interface: reach it where it came from.
                h = conn.peer_host
                info = RouteInfo(info.cluster, info.peer, f"[{h}]:{port}" if ":" in h
                                 else f"{h}:{port}", info.incarnation, info.dialer, info.nonce)
        s = LinkSession(self.hub, f"from {info.address or conn.name}", info.peer, relay,
                        dialed=False, route=True)
        s.peer_rank = Rank(False, info.incarnation[0], info.peer)  # (for groups)
        s.ctl_out, s.data_out = ctl_ref, data_ref
        s.conn = conn
        s.control_hook = self._control
        self._of_conn[conn] = s
        self._handshaking.pop(conn, None)
        self._strangers.pop(conn, None)
        conn.max_input = None
        self._requests[handle] = s
        self.established += 1
        ctl_ref.on_message(Record(ROUTE_ACCEPT, [self._info(info.dialer, info.nonce).to_value(),
                                                 Embedded(s.ctl_in), Embedded(s.data_in)]))
        self.membership.established(s, info, time.monotonic(), target=None)
        self._apply()

    def request_gone(self, handle: int) -> None:
        s = self._requests.pop(handle, None)
        if s is not None and s.conn is not None and not s.conn.closed:
            s.conn.close("the peer withdrew its route request")

    # -- dialing ------------------------------------------------------------------------

    def _dial(self, address: str, nonce: str) -> None:
        if address in self._dialing or self._closing:
            return
        task = asyncio.get_running_loop().create_task(self._dial_task(address, nonce))
        self._dialing[address] = task
        task.add_done_callback(lambda _t: self._dialing.pop(address, None))

    async def _dial_task(self, address: str, nonce: str) -> None:
        try:
            await self._dial_once(address, nonce)
            self._failures.pop(address, None)
        except asyncio.CancelledError:
            raise
        except (OSError, ConnectionError, TimeoutError, ClusterError, AddressError) as e:
            m = self.membership
            if m is not None and m.is_itself(address):
                # This member's own port answered (and closed the route first).
                log.info("route to %s: this is this member's own address: not dialed "
                         "again", address)
                m.dial_failed(address, "itself", time.monotonic())
                self._apply()
                return
            why = _route_error(e)
            if m is not None and not m.vouched(address):
                # Named by gossip only, never reached: counted, not logged each time (a
                # member's bug could name thousands that do not exist).
                self._failures.pop(address, None)
                self._said.say("unreached", f"route to {address} (a member named by gossip, "
                               f"never reached): {why}; retrying with backoff "
                               "(`dataspace cluster status` lists the members)",
                               time.monotonic())
            else:
                n = self._failures[address] = self._failures.get(address, 0) + 1
                (log.warning if n == 1 or n % 20 == 0 else log.debug)(
                    "route to %s: %s (attempt %d; retrying with backoff)", address, why, n)
            if m is not None and not self._closing:
                m.dial_failed(address, why, time.monotonic())
                self._apply()
            if len(self._failures) > 4 * MAX_ROUTE_CONNECTIONS and m is not None:
                for a in [a for a in self._failures if a not in m.targets]:
                    del self._failures[a]

    async def _dial_once(self, address: str, nonce: str) -> None:
        a = parse_address(address, default_kind="tcp")
        if a.kind != "tcp":
            raise ClusterError(f"a route address is HOST:PORT, not {address}")
        loop = asyncio.get_running_loop()

        def session(conn: Connection) -> Relay:
            return Relay(limits=LINK_RELAY_LIMITS, name=f"route:{address}", turn=self.turn,
                         quota=self.quota)

        try:
            _t, conn = await asyncio.wait_for(loop.create_connection(
                lambda: StreamConnection(self.net_hub, LINK_FLOW, session),
                a.host, a.port, ssl=self.ssl_client,
                server_hostname=a.host if self.ssl_client is not None else None),
                HANDSHAKE_TIMEOUT)
        except TimeoutError:
            raise ConnectionError(f"no connection within {HANDSHAKE_TIMEOUT:g} s") from None
        try:
            await self._handshake(address, nonce, conn)
        except ConnectionError:
            if (self.ssl_client is None and conn.closed and conn.bytes_in == 0
                    and await speaks_tls(a.host, a.port)):
                # A TLS port closes a plain connection without a word: say why.
                raise ConnectionError(SPEAKS_TLS) from None
            raise

    async def _handshake(self, address: str, nonce: str, conn: Connection) -> None:
        loop = asyncio.get_running_loop()
        relay = conn.relay
        assert relay is not None
        self._track(conn, relay)
        try:
            fut: asyncio.Future[Any] = loop.create_future()
            relay.import_ref(0).on_assert(
                Record(RESOLVE, [self.cap.to_value(), Embedded(_Resolver(fut))]), fresh_handle())
            self.net_hub.flush(None)
            ref = await self._wait(fut, conn, "resolving the route capability")
            done: asyncio.Future[None] = loop.create_future()
            attempt = _Attempt(self, address, conn, nonce, done)
            ref.on_assert(Record(ROUTE_REQUEST, [
                self._info(self.me, attempt.nonce).to_value(), Embedded(attempt.ctl),
                Embedded(attempt.data)]), fresh_handle())
            self.net_hub.flush(None)
            await self._wait(done, conn, "waiting for the route to be accepted")
        except BaseException:
            if conn not in self._of_conn:
                conn.close("route not established")
            raise

    def _answered(self, attempt: _Attempt, v: Value) -> None:
        """The member dialed answered the route request (in the relay's turn: the
        session exists before the data that follows the answer is read)."""
        fut = attempt.fut
        if fut.done():
            return
        if type(v) is Record and v.label == ROUTE_REFUSED:
            why = v.fields[0] if v.fields and type(v.fields[0]) is str else "refused"
            fut.set_exception(ConnectionError(f"the member refused the route: {why[:300]}"))
            return
        try:
            if (type(v) is not Record or v.label != ROUTE_ACCEPT or len(v.fields) != 3
                    or type(v.fields[1]) is not Embedded or type(v.fields[2]) is not Embedded):
                raise ClusterError(f"the member answered the route request with "
                                   f"{stringify(v)[:80]}")
            info = RouteInfo.from_value(v.fields[0], dialer=self.me, nonce=attempt.nonce)
            if info.cluster != self.name:
                raise ClusterError(f"the member is in cluster {info.cluster!r}, not "
                                   f"{self.name!r}")
        except ClusterError as e:
            fut.set_exception(e)
            return
        conn = attempt.conn
        if conn.closed or self.membership is None:
            fut.set_exception(ConnectionError("the connection closed"))
            return
        s = LinkSession(self.hub, f"to {attempt.address}", info.peer, conn.relay, dialed=True,
                        route=True)
        s.peer_rank = Rank(False, info.incarnation[0], info.peer)  # (for groups)
        s.ctl_in = attempt.ctl  # type: ignore[assignment]
        s.data_in = attempt.data  # type: ignore[assignment]
        attempt.data.attach(s)
        s.ctl_out, s.data_out = v.fields[1].value, v.fields[2].value
        s.conn = conn
        s.control_hook = self._control
        attempt.session = s
        self._of_conn[conn] = s
        self.established += 1
        fut.set_result(None)
        self.membership.established(s, info, time.monotonic(), target=attempt.address)
        self._apply()

    async def _wait(self, fut: asyncio.Future[Any], conn: Connection, what: str) -> Any:
        closed = asyncio.ensure_future(conn.wait_closed())
        try:
            await asyncio.wait({fut, closed}, timeout=HANDSHAKE_TIMEOUT,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
        if not fut.done():
            fut.cancel()
            relay = conn.relay
            reason = (relay.peer_error[0] if relay is not None and relay.peer_error
                      else conn.close_reason)
            raise ConnectionError(f"{what}: {reason or f'no answer within {HANDSHAKE_TIMEOUT:g} s'}")
        return fut.result()

    # -- the machine ----------------------------------------------------------------------

    def _control(self, s: LinkSession, v: Value) -> bool:
        """A control message on a route that the link protocol does not know."""
        if type(v) is not Record or self.membership is None:
            return False
        if v.label == ROUTE_ACCEPT:
            return True  # (a duplicate)
        if v.label not in MESSAGES:
            return False
        m = self.membership
        ignored = m.members_ignored
        try:
            why = m.message(s, v, time.monotonic())
        except ClusterError as e:
            s.fail(f"bad route message: {e}")
            return True
        if why is not None:
            log.info("route %s: the peer closes it: %s", s.name, why)
        if m.members_ignored > ignored:
            self._said.say("table", f"route {s.name}: its gossip names more members than "
                           f"this member keeps ({m.max_members}, --cluster-max-members): "
                           f"{m.members_ignored - ignored} ignored", time.monotonic())
        self._apply()
        return True

    def _apply(self) -> None:
        """Carry out what the membership machine decided; re-arm its timer."""
        m = self.membership
        if m is None:
            return
        for eff in m.take_effects():
            kind = eff[0]
            if kind == "send":
                s = eff[1]
                s.send_control(eff[2])
            elif kind == "dial":
                self._dial(eff[1], eff[2])
            elif kind == "ready":
                s = eff[1]
                if not s.closed:
                    self.hub.begin(s)
            elif kind == "close":
                self._close_route(eff[1], eff[2], tell=eff[3])
        if not self._closing:
            self._arm()
        self._notify()

    def _notify(self) -> None:
        for fn in self.on_change:
            try:
                fn()
            except Exception:  # pragma: no cover - a monitor's bug must not break routes
                log.exception("cluster change callback failed")

    def _close_route(self, s: LinkSession, why: str, *, tell: bool) -> None:
        was = s.ready
        self.hub.end(s, why)
        if why == ITSELF:
            if s.dialed:  # (the answer came before the close: this end says it)
                log.info("route %s: this is this member's own address: not dialed again",
                         s.name)
            else:
                log.debug("route %s: closed: %s", s.name, why)
        else:
            # A route not taken (never ready), or one closed while another to the same
            # member is up -- replaced by a newer one: the race of two members dialing
            # each other, a restarted member's new route -- loses nothing: INFO.  A
            # warning is for a member no longer reached this way.
            m = self.membership
            kept = m.by_peer.get(s.peer_id) if m is not None else None
            other = m.routes.get(kept) if m is not None and kept is not s else None
            replaced = other is not None and other.ready
            (log.info if (tell and not was) or replaced else log.warning)(
                "route %s: closed: %s", s.name, why)
        conn = s.conn
        if conn is None or conn.closed:
            return
        if not tell:
            conn.close(why)  # nothing gets through: do not wait for a send
        elif s.relay is not None:
            # After the turn under way: what it sends (an accepted route's answer, which
            # names this member) reaches the peer before the close, so a dialer learns
            # whom its address reaches even when the route is not kept (a duplicate, a
            # route to itself) and does not dial it again.
            relay = s.relay
            asyncio.get_running_loop().call_soon(
                lambda: relay.fail(f"route: {why}", Symbol("route-closed")))

    def _arm(self) -> None:
        m = self.membership
        assert m is not None
        when = m.next_deadline()
        if when is None:
            return
        if self._timer is not None:
            if self._timer_at <= when:
                return
            self._timer.cancel()
        self._timer_at = when
        self._timer = asyncio.get_running_loop().call_later(
            max(0.0, when - time.monotonic()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        m = self.membership
        if m is None or self._closing:
            return
        now = time.monotonic()
        for s in self.hub.sessions:
            if s.route and s.conn is not None:
                # A route this member is not reading (flow control: its consumers are
                # slow) is silent because of us, not of the peer.
                m.heard(s, now if s.conn.held_reasons else s.conn.last_input)
        m.tick(now)
        self._apply()

    # -- status ---------------------------------------------------------------------------

    def routes(self) -> list[LinkSession]:
        return [s for s in self.hub.sessions if s.route]

    def status(self) -> dict[str, Any]:
        """Members, routes and what crosses them (``dataspace cluster status``)."""
        m = self.membership
        now = time.monotonic()
        routes = []
        for s in self.routes():
            row = s.status()
            row["direction"] = "out" if s.dialed else "in"
            row["address"] = s.name
            if m is not None and s.peer_id in m.members:
                row["member_address"] = m.members[s.peer_id].address
            routes.append(row)
        members = m.status(now) if m is not None else []
        return {
            "time": time.time(), "cluster": self.name, "id": self.me, "address": self.address,
            "listen": self.listen_address, "incarnation": self.incarnation[0],
            "members": members, "size": 1 + sum(1 for r in members if r.get("up")),
            "routes": routes, "refused": self.refused, "established": self.established,
            "strangers": len(self._strangers), "strangers_closed": self.strangers_closed,
            "members_ignored": m.members_ignored if m is not None else 0,
            "max_members": self.spec.max_members,
            "stalls": m.stalls if m is not None else 0, "pid": os.getpid(),
            "keepalive": {"ping": self.spec.ping, "dead": self.spec.dead},
        }
