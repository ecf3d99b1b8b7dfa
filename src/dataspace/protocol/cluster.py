"""A cluster of brokers: membership, gossip, one route per pair and route keepalive
(sans-IO: no sockets, no clocks; time and randomness come in as arguments).

One :class:`Membership` per member.  Its host (``dataspace.broker.cluster``) says when a
route's handshake is done (:meth:`Membership.established`), when a route's connection
closed (:meth:`Membership.closed`), when a dial failed (:meth:`Membership.dial_failed`),
when input last arrived on a route (:meth:`Membership.heard`) and hands it the cluster's
control messages (:meth:`Membership.message`); it carries out what
:meth:`Membership.take_effects` says:

``("dial", ADDRESS, NONCE)``
    open a route to the member listening at ``ADDRESS``, with ``NONCE`` as the route
    request's nonce (then report it established, or the dial failed);
``("ready", ROUTE)``
    data crosses this route from now on (it is the one route to its peer);
``("close", ROUTE, WHY, TELL)``
    close this route's connection (a duplicate, a route to itself, a silent peer); if
    ``TELL``, say why to the peer first (a silent one is closed at once);
``("send", ROUTE, VALUE)``
    send ``VALUE`` on the route's control entity (a ping, the members it knows).

**A full mesh.**  Each member keeps one route to every other member it knows.  It knows
the members it is configured with (``seeds``: addresses, dialed until they answer and
whenever their route is down) and those its peers tell it of: when a route comes up both
ends send ``<route-members [[ID ADDRESS] ...]>`` (themselves and every member they have
a route to), and each member tells its other routes of a new one.  So a new member needs
one address of the cluster.  A member learned by gossip is dialed by the one of the two
with the smaller id at once, by the other after ``grace`` seconds without a route (in
case the first cannot reach it); one that has no route for ``forget`` seconds is
forgotten (seeds never are).

**One route per pair.**  Two members that dial each other at once get two routes.  Both
ends keep the same one, by a rule that depends only on what both know of the two
routes: the route of the peer's newest *incarnation* (a member's start time and a
random nonce: a restarted member's new route replaces its old one, which may linger on a
network that lost it), and between routes of one incarnation the one dialed by the
member with the smaller id, then the greater dial nonce.  The route kept is made ready
before the other is closed, so what the peer holds is never gone meanwhile.

**Itself.**  A seed list may name this member (every member given the same list): a
dial of such an address reaches this member's own port.  Either end that learns it marks
the address as this member's own, never dialed again: the accepting end knows the request's
nonce as one of its own dials, the dialing end reads its own id (and incarnation) in the
answer.  A member of another incarnation with this member's id (two members sharing one
id, a copied data directory) is not this member: its routes are refused, the address kept.

**What gossip can make a member do** is bounded, so that one member's bug (or a rogue
holding the secret) cannot take the others down: the table of members holds at most
``max_members`` (beyond it, gossiped members are ignored and counted:
:attr:`Membership.members_ignored`; a member that routes here is always kept); at most
``max_dialing`` dials are in flight and at most ``dial_rate`` begin per second (seeds
first, then members that had a route, then those dialed least), and members only
gossip named (never reached) take at most half of them; and a member learned by
gossip that never had a route is forgotten after ``forget_unreached`` seconds (one that
had, after ``forget``).

**Keepalive.**  Every ``ping`` seconds a ``<route-ping>`` goes on every route; a route on
which nothing arrived for ``dead`` seconds is closed (its peer's assertions are retracted
by the host).  If this member itself was stalled (its ticks late by more than ``2 *
ping``), the routes are given one more ``ping`` before being judged: the silence was ours.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from ..values import Dictionary, Record, Sequence, Symbol, Value

__all__ = [
    "MEMBERS",
    "MESSAGES",
    "PING",
    "ROUTE_ACCEPT",
    "ROUTE_REFUSED",
    "ROUTE_REQUEST",
    "VERSION",
    "ITSELF",
    "ClusterError",
    "Membership",
    "RouteInfo",
    "check_address",
    "check_cluster_name",
    "route_key",
    "route_oid",
]

VERSION = 1
PING = Symbol("route-ping")
MEMBERS = Symbol("route-members")
ROUTE_REQUEST = Symbol("route-request")
ROUTE_ACCEPT = Symbol("route-accept")
ROUTE_REFUSED = Symbol("route-refused")
MESSAGES = frozenset({PING, MEMBERS, ROUTE_REFUSED})
ITSELF = "this address leads back to this member (a route to itself is not needed)"
"""Why a route to this member itself is closed (the ``close`` effect's WHY)."""
"""Control messages of routes that the host hands to :meth:`Membership.message`."""

MAX_ID = 200
MAX_ADDRESS = 300
MAX_MEMBERS = 1_000
MAX_NAME = 100

_CLUSTER = Symbol("cluster")
_ID = Symbol("id")
_VERSION = Symbol("version")
_ADDRESS = Symbol("address")
_INCARNATION = Symbol("incarnation")
_NONCE = Symbol("nonce")


class ClusterError(ValueError):
    """A malformed cluster message or handshake (the host closes that route)."""


def check_cluster_name(name: Any) -> str:
    """A cluster name: 1-100 printable characters, no spaces."""
    if (type(name) is not str or not 0 < len(name) <= MAX_NAME
            or not all(c.isprintable() and not c.isspace() for c in name)):
        raise ClusterError(f"a cluster name is 1-{MAX_NAME} printable characters without "
                           f"spaces, not {name!r:.60}")
    return name


def check_address(a: Any) -> str:
    """A member's cluster address as a peer says it: ``HOST:PORT`` (checked for shape
    only; the host parses it when it dials)."""
    if type(a) is not str or not 0 < len(a) <= MAX_ADDRESS:
        raise ClusterError(f"a member's address is HOST:PORT, not {a!r:.60}")
    host, sep, port = a.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f"a member's address is HOST:PORT, not {a!r:.60}")
    if not all(c.isprintable() and not c.isspace() for c in a):
        raise ClusterError(f"a member's address is HOST:PORT, not {a!r:.60}")
    return a


def _str(v: Any, what: str, limit: int = MAX_ID) -> str:
    if type(v) is not str or not 0 < len(v) <= limit:
        raise ClusterError(f"{what} must be a string of 1-{limit} characters")
    return v


def route_oid(cluster: str) -> str:
    """The object a route capability names on a member's cluster port."""
    return f"route:{check_cluster_name(cluster)}"


def route_key(secret: bytes, cluster: str) -> bytes:
    """The key that signs the route capability of ``cluster``, derived from the cluster
    secret (the same file on every member): members with another secret or another
    cluster name cannot route."""
    if len(secret) < 16:
        raise ClusterError("a cluster secret has at least 16 bytes")
    return hmac.new(secret, b"dataspace route key\0" + check_cluster_name(cluster).encode(),
                    hashlib.blake2s).digest()


# ---------------------------------------------------------------------------------------
# The handshake


@dataclass(frozen=True)
class RouteInfo:
    """What one end of a route says of itself in the handshake, and of the route."""

    cluster: str
    peer: str
    """The id of the member that sent it."""
    address: str
    """Where that member listens for routes (its advertised address), or ``""``."""
    incarnation: tuple[float, str]
    """That member's start time and a random nonce: a restart makes a new one."""
    dialer: str
    """The id of the member that dialed this route."""
    nonce: str
    """The dialer's random nonce for this route's connection."""

    def to_value(self) -> Dictionary:
        d: dict[Value, Value] = {
            _CLUSTER: self.cluster, _ID: self.peer, _VERSION: VERSION,
            _INCARNATION: Sequence([float(self.incarnation[0]), self.incarnation[1]]),
            _NONCE: self.nonce,
        }
        if self.address:
            d[_ADDRESS] = self.address
        return Dictionary(d)

    @classmethod
    def from_value(cls, v: Value, *, dialer: str | None = None,
                   nonce: str | None = None) -> RouteInfo:
        """Read a handshake dictionary.  The dialer's request carries the route's nonce
        (``dialer``/``nonce`` None: taken from it, the sender being the dialer); the
        acceptor's answer is read with the ``dialer`` and ``nonce`` of the request."""
        if type(v) is not Dictionary:
            raise ClusterError("a route handshake is a dictionary {cluster: ... id: ...}")
        if v.get(_VERSION) != VERSION:
            raise ClusterError(f"route protocol version {v.get(_VERSION)!r} is not {VERSION}")
        cluster = check_cluster_name(v.get(_CLUSTER))
        peer = _str(v.get(_ID), "a member id")
        address = v.get(_ADDRESS, "")
        if address != "":
            check_address(address)
        inc = v.get(_INCARNATION)
        if (type(inc) is not Sequence or len(inc) != 2 or type(inc[0]) is not float
                or inc[0] != inc[0]):
            raise ClusterError("a route handshake's incarnation is [START NONCE]")
        inc_nonce = _str(inc[1], "an incarnation nonce")
        if dialer is None:
            dialer = peer
            nonce = _str(v.get(_NONCE), "a route nonce")
        assert nonce is not None
        return cls(cluster, peer, address, (inc[0], inc_nonce), dialer, nonce)


def members_message(members: Iterable[tuple[str, str]]) -> Record:
    return Record(MEMBERS, [Sequence([Sequence([i, a]) for i, a in sorted(members)])])


def _read_members(v: Record) -> list[tuple[str, str]]:
    if len(v.fields) != 1 or type(v.fields[0]) is not Sequence or len(v.fields[0]) > MAX_MEMBERS:
        raise ClusterError(f"<route-members [[ID ADDRESS] ...]> lists at most {MAX_MEMBERS}")
    out = []
    for m in v.fields[0]:
        if type(m) is not Sequence or len(m) != 2:
            raise ClusterError("<route-members [[ID ADDRESS] ...]>")
        out.append((_str(m[0], "a member id"), check_address(m[1])))
    return out


# ---------------------------------------------------------------------------------------
# The machine


@dataclass
class _Route:
    info: RouteInfo
    target: str | None
    """The address dialed (this end dialed it), or None (accepted)."""
    since: float
    heard: float
    ready: bool = False


@dataclass
class _Target:
    """An address to keep a route to: a seed (explicit) or a member learned by gossip."""

    address: str
    explicit: bool
    peer: str | None = None
    since: float = 0.0
    next_at: float = 0.0
    delay: float = 0.0
    attempts: int = 0
    dialing: bool = False
    nonce: str = ""
    """The nonce of the dial in flight (``dialing``)."""
    itself: bool = False
    """This address leads back to this member (a seed list that names every member)."""
    last_error: str | None = None


@dataclass
class _Member:
    address: str
    since: float
    """Since when it is up (a route is ready) or down (learned, or its route went)."""
    up: bool = False
    incarnation: tuple[float, str] | None = None
    reached: bool = False
    """It had a route (ready) at some time."""


class Membership:
    """One member's view of its cluster (see the module docstring).

    ``me``: this member's id; ``address``: where it listens for routes, as peers should
    dial it (``""``: not said); ``seeds``: the configured route addresses; ``random``:
    floats in [0, 1) (jitter, dial nonces); ``incarnation``: this member's, as its
    handshakes say it (a route from this id with another is another member sharing the
    id, not this one); times in seconds.
    """

    def __init__(self, me: str, address: str, seeds: Iterable[str], *,
                 random: Callable[[], float], ping: float = 1.0, dead: float = 3.0,
                 backoff: tuple[float, float] = (0.1, 5.0), grace: float = 2.0,
                 forget: float = 120.0, forget_unreached: float = 30.0,
                 max_members: int = 64, max_dialing: int = 8, dial_rate: float = 10.0,
                 incarnation: tuple[float, str] | None = None) -> None:
        self.me = _str(me, "a member id")
        self.incarnation = incarnation
        self.address = check_address(address) if address else ""
        if not 0 < ping < dead:
            raise ValueError("the route ping interval must be positive and below the "
                             "time after which a silent route is dead")
        self.random = random
        self.ping, self.dead, self.backoff = ping, dead, backoff
        self.grace, self.forget = grace, forget
        self.forget_unreached = forget_unreached
        if max_members < 1 or max_dialing < 1 or not dial_rate > 0:
            raise ValueError("max_members and max_dialing must be at least 1, dial_rate "
                             "positive")
        self.max_members, self.max_dialing, self.dial_rate = max_members, max_dialing, dial_rate
        self._tokens = float(max_dialing)
        self._tokens_at = 0.0
        self._token_ready_at = 0.0
        self.members_ignored = 0
        """Members named by gossip and ignored: the table was full (``max_members``)."""
        self.routes: dict[Hashable, _Route] = {}
        self.by_peer: dict[str, Hashable] = {}
        """The ready route to each peer."""
        self.members: dict[str, _Member] = {}
        self.targets: dict[str, _Target] = {}
        for a in seeds:
            if a not in self.targets:
                self.targets[a] = _Target(a, explicit=True, delay=backoff[0])
        self._effects: list[tuple[Any, ...]] = []
        self._dials: dict[str, str] = {}
        """The nonce of each dial in flight -> the address dialed (a request carrying one
        of them reached this member itself)."""
        self._dial_seq = 0
        self._next_ping = 0.0
        self._last_tick: float | None = None
        self._had_routes = False
        self.stalls = 0
        """Times this member found itself stalled (its ticks late by more than 2 pings)."""

    # -- what the host says -------------------------------------------------------------

    def start(self, now: float) -> None:
        """Begin: dial every seed."""
        self._next_ping = now + self.ping
        self._last_tick = now
        for t in self.targets.values():
            t.since = now
        self._dial_due(now)

    def dial_failed(self, address: str, why: str, now: float) -> None:
        """The dial of ``address`` failed (no connection, refused, timed out)."""
        t = self.targets.get(address)
        if t is None:
            return
        self._end_dial(t)
        if not t.itself:  # (else the accepting end, this member, closed it)
            t.last_error = why
            self._backoff(t, now)
        self._dial_due(now)  # (a dial ended: another may begin)

    def established(self, route: Hashable, info: RouteInfo, now: float,
                    target: str | None = None) -> bool:
        """A route's handshake is done: ``info`` is what the peer said of itself,
        ``target`` the address this end dialed (None: it accepted the route).  Returns
        False if the route is closed at once (to itself, or a duplicate kept out)."""
        kept = self._established(route, info, now, target)
        self._dial_due(now)  # (a dial ended: another may begin)
        return kept

    def _established(self, route: Hashable, info: RouteInfo, now: float,
                     target: str | None) -> bool:
        t = self.targets.get(target) if target is not None else None
        if t is not None:
            self._end_dial(t)
            t.attempts = 0
            t.last_error = None
        if info.peer == self.me:
            return self._itself(route, info, t, now)
        if t is not None:
            t.peer = info.peer
            if t.explicit:  # a seed stands for the member: no second target for it
                for a, other in list(self.targets.items()):
                    if other is not t and not other.explicit and other.peer == info.peer:
                        self._end_dial(other)
                        del self.targets[a]
        r = _Route(info, target, now, now)
        self.routes[route] = r
        m = self.members.get(info.peer)
        if m is None:
            m = self.members[info.peer] = _Member(info.address, now)
        if info.address:
            m.address = info.address
            self._learn(info.peer, info.address, now)
        cur = self.by_peer.get(info.peer)
        if cur is None or not self.routes[cur].ready:  # (none, or one judged dead)
            self._ready(route, now)
            return True
        if self._prefer(r, self.routes[cur]):
            self._ready(route, now)
            self._effects.append(("close", cur, f"replaced by a newer route to {info.peer}",
                                  True))
            return True
        self._effects.append(("close", route, f"a route to {info.peer} is already up", True))
        return False

    def closed(self, route: Hashable, now: float) -> None:
        """A route's connection closed (whatever the reason)."""
        r = self.routes.pop(route, None)
        if r is None:
            return
        peer = r.info.peer
        if self.by_peer.get(peer) is route:
            del self.by_peer[peer]
            m = self.members.get(peer)
            if m is not None:
                m.up = False
                m.since = now
        if r.target is not None:
            t = self.targets.get(r.target)
            if t is not None:
                if now - r.since >= 10 * self.ping:
                    t.delay = self.backoff[0]  # it lived: start again quickly
                self._backoff(t, now)
        for t in self.targets.values():
            if t.peer == peer and t.next_at < now:
                t.since = now  # (the grace of the member with the greater id starts now)
        self._dial_due(now)

    def heard(self, route: Hashable, when: float) -> None:
        """Input arrived on ``route`` at ``when`` (the host's last read on it)."""
        r = self.routes.get(route)
        if r is not None and when > r.heard:
            r.heard = when

    def message(self, route: Hashable, v: Value, now: float) -> str | None:
        """A control message of the cluster arrived on ``route``.  Returns a refusal the
        peer sent (``<route-refused WHY>``: the host logs it), else None.  Raises
        :class:`ClusterError` if malformed."""
        if type(v) is not Record:
            raise ClusterError("not a route message")
        r = self.routes.get(route)
        if r is not None and now > r.heard:
            r.heard = now
        if v.label == PING:
            return None
        if v.label == ROUTE_REFUSED:
            why = v.fields[0] if v.fields and type(v.fields[0]) is str else "refused"
            return why[:500]
        if v.label == MEMBERS:
            for peer, address in _read_members(v):
                if peer != self.me:
                    self._learn(peer, address, now)
            self._dial_due(now)
            return None
        raise ClusterError(f"unknown route message <{v.label}>")

    def tick(self, now: float) -> None:
        """Pings, silent routes, dials that are due, members to forget."""
        last = self._last_tick
        self._last_tick = now
        if self._had_routes and last is not None and now - last > 2 * self.ping:
            # This member was stalled (not the routes silent): judge them later.
            self.stalls += 1
            for r in self.routes.values():
                r.heard = max(r.heard, now - self.dead + self.ping)
        for route, r in list(self.routes.items()):
            if r.ready and now >= r.heard + self.dead:
                self._effects.append(("close", route, f"no word from {r.info.peer} for "
                                      f"{now - r.heard:.1f} s (routes are pinged every "
                                      f"{self.ping:g} s and closed after {self.dead:g} s of "
                                      "silence)", False))
                r.ready = False  # (judged once; the host closes it)
        if now >= self._next_ping:
            self._next_ping = now + self.ping
            for route, r in self.routes.items():
                if r.ready:
                    self._effects.append(("send", route, Record(PING, [])))
        self._had_routes = any(r.ready for r in self.routes.values())
        self._forget_due(now)
        self._dial_due(now)

    def next_deadline(self) -> float | None:
        """When :meth:`tick` has something to do, if ever."""
        ds = [self._next_ping] if self.routes else []
        for r in self.routes.values():
            if r.ready:
                ds.append(r.heard + self.dead)
        # (With every dial slot taken, the end of a dial starts the next.)
        can_dial = self._in_flight() < self.max_dialing
        can_gossiped = sum(1 for a in self._dials.values()
                           if not self.vouched(a)) < max(1, self.max_dialing // 2)
        for t in self.targets.values():
            if self._wants_dial(t, float("inf")):
                if can_dial and (can_gossiped or self.vouched(t.address)):
                    ds.append(max(t.next_at, self._grace_end(t), self._token_ready_at))
        for peer, m in self.members.items():
            if not m.up and peer not in self.by_peer and not self._seed_of(peer):
                ds.append(m.since + (self.forget if m.reached else self.forget_unreached))
        return min(ds, default=None)

    def take_effects(self) -> list[tuple[Any, ...]]:
        out, self._effects = self._effects, []
        return out

    # -- inspection ---------------------------------------------------------------------

    def vouched(self, address: str) -> bool:
        """Whether ``address`` is a seed, or a member's that had a route (not only named
        by gossip): its failures are worth a line each."""
        t = self.targets.get(address)
        if t is None:
            return False
        m = self.members.get(t.peer) if t.peer is not None else None
        return t.explicit or (m is not None and m.reached)

    def is_itself(self, address: str) -> bool:
        """Whether ``address`` (a target) is known to lead back to this member."""
        t = self.targets.get(address)
        return t is not None and t.itself

    def is_ready(self, route: Hashable) -> bool:
        r = self.routes.get(route)
        return r is not None and r.ready

    def status(self, now: float) -> list[dict[str, Any]]:
        """Every member known (this one excepted): id, address, up or not and since when,
        whether it is a seed, dial attempts and the last dial error."""
        out = []
        seen = set()
        for peer, m in sorted(self.members.items()):
            seen.add(peer)
            t = next((t for t in self.targets.values() if t.peer == peer), None)
            row: dict[str, Any] = {"id": peer, "address": m.address, "up": m.up,
                                   "since_s": round(now - m.since, 3),
                                   "seed": bool(t and t.explicit), "reached": m.reached}
            if t is not None and not m.up:
                row["attempts"] = t.attempts
                if t.last_error:
                    row["last_error"] = t.last_error
            out.append(row)
        for t in self.targets.values():
            if t.peer is None and not t.itself:
                row = {"id": None, "address": t.address, "up": False,
                       "since_s": round(now - t.since, 3), "seed": True,
                       "attempts": t.attempts}
                if t.last_error:
                    row["last_error"] = t.last_error
                out.append(row)
        return out

    # -- internals ----------------------------------------------------------------------

    def _prefer(self, a: _Route, b: _Route) -> bool:
        """Whether route ``a`` is kept rather than ``b`` (both to one peer): the same
        answer at both ends."""
        ia, ib = a.info, b.info
        if ia.incarnation != ib.incarnation:
            return ia.incarnation > ib.incarnation
        low = min(self.me, ia.peer)
        return (ia.dialer == low, ia.nonce) > (ib.dialer == low, ib.nonce)

    def _ready(self, route: Hashable, now: float) -> None:
        r = self.routes[route]
        peer = r.info.peer
        r.ready = True
        r.heard = now
        self.by_peer[peer] = route
        m = self.members[peer]
        m.up = True
        m.reached = True
        m.since = now
        m.incarnation = r.info.incarnation
        self._effects.append(("ready", route))
        # Gossip: tell the new peer every member we have a route to, and the others of it.
        known = [(self.me, self.address)] if self.address else []
        known += [(p, self.members[p].address) for p in self.by_peer
                  if p != peer and self.members[p].address]
        self._effects.append(("send", route, members_message(known)))
        if r.info.address:
            news = members_message([(peer, r.info.address)])
            for p, other in self.by_peer.items():
                if p != peer:
                    self._effects.append(("send", other, news))

    def _itself(self, route: Hashable, info: RouteInfo, t: _Target | None,
                now: float) -> bool:
        """A route whose other end says it is this member (``t``: the target this end
        dialed, or None: it accepted the route)."""
        same = self.incarnation is None or info.incarnation == self.incarnation
        if t is None and same:
            # Accepted: if the request is one of this member's own dials, its address is
            # this member's (whatever the dialing end hears first: an answer or a close).
            address = self._dials.get(info.nonce)
            t = self.targets.get(address) if address is not None else None
            if t is not None and not t.dialing:
                t = None
        if not same:
            why = (f"the member at the other end has this member's id {self.me} (two members "
                   "share one id: give each its own data directory, or remove the copy's "
                   "server.id)")
            if t is not None:
                t.last_error = why
                self._backoff(t, now)
            self._effects.append(("close", route, why, True))
            return False
        if t is not None:
            t.itself = True
            t.last_error = None
        self._effects.append(("close", route, ITSELF, False))  # (nobody else to tell)
        return False

    def _end_dial(self, t: _Target) -> None:
        t.dialing = False
        if t.nonce:
            self._dials.pop(t.nonce, None)
            t.nonce = ""

    def _learn(self, peer: str, address: str, now: float) -> None:
        """A member exists at ``address``: keep a route to it (if the table has room)."""
        m = self.members.get(peer)
        if m is None:
            if len(self.members) >= self.max_members:
                self.members_ignored += 1
                return
            m = self.members[peer] = _Member(address, now)
        elif not m.address:
            m.address = address
        if any(t.peer == peer for t in self.targets.values()):
            return  # a seed, or learned already
        t = self.targets.get(address)
        if t is not None:
            if t.peer is None:
                t.peer = peer
            return
        self.targets[address] = _Target(address, explicit=False, peer=peer, since=now,
                                        delay=self.backoff[0])

    def _grace_end(self, t: _Target) -> float:
        if t.explicit or t.peer is None or self.me < t.peer:
            return t.since
        return t.since + self.grace

    def _wants_dial(self, t: _Target, now: float) -> bool:
        if t.dialing or t.itself:
            return False
        if t.peer is not None and t.peer in self.by_peer:
            return False
        return t.next_at <= now and self._grace_end(t) <= now

    def _in_flight(self) -> int:
        return len(self._dials)

    def _seed_of(self, peer: str) -> bool:
        return any(t.explicit and t.peer == peer for t in self.targets.values())

    def _forget_due(self, now: float) -> None:
        """Forget members learned by gossip that have had no route for long enough."""
        for peer, m in list(self.members.items()):
            if m.up or peer in self.by_peer or self._seed_of(peer):
                continue
            if now < m.since + (self.forget if m.reached else self.forget_unreached):
                continue
            del self.members[peer]
            for a, t in list(self.targets.items()):
                if t.peer == peer and not t.explicit:
                    self._end_dial(t)
                    del self.targets[a]

    def _dial_due(self, now: float) -> None:
        free = self.max_dialing - self._in_flight()
        if free <= 0:
            return
        due = [t for t in self.targets.values() if self._wants_dial(t, now)]
        if not due:
            return
        # The bucket: dial_rate tokens a second, up to max_dialing.
        self._tokens = min(float(self.max_dialing),
                           self._tokens + (now - self._tokens_at) * self.dial_rate)
        self._tokens_at = now
        if len(due) > 1:
            due.sort(key=self._dial_order)
        # Members only gossip named take half the slots at most: the others are kept
        # for seeds and members that had a route (black holes cannot hold them all).
        gossiped = sum(1 for a in self._dials.values() if not self.vouched(a))
        for t in due[:free]:
            if self._tokens < 1.0 - 1e-9:
                break
            if not self.vouched(t.address):
                if gossiped >= max(1, self.max_dialing // 2):
                    continue
                gossiped += 1
            self._tokens = max(0.0, self._tokens - 1.0)
            t.dialing = True
            t.attempts += 1
            self._dial_seq += 1
            t.nonce = f"{int(self.random() * (1 << 48)):012x}{self._dial_seq:x}"
            self._dials[t.nonce] = t.address
            self._effects.append(("dial", t.address, t.nonce))
        self._token_ready_at = (now if self._tokens >= 1.0 - 1e-9
                                else now + max(1e-3, (1.0 - self._tokens) / self.dial_rate))

    def _dial_order(self, t: _Target) -> tuple[bool, bool, int, str]:
        """Seeds first, then members that had a route, then those dialed least."""
        m = self.members.get(t.peer) if t.peer is not None else None
        return (not t.explicit, not (m is not None and m.reached), t.attempts, t.address)

    def _backoff(self, t: _Target, now: float) -> None:
        lo, hi = self.backoff
        d = max(lo, t.delay)
        t.next_at = now + d * (0.5 + self.random())
        t.delay = min(hi, d * 2)
