"""Linked servers form a forest: a new link carries data only once it is known to close
no cycle (sans-IO: no sockets, no clocks; time and randomness come in as arguments).

One :class:`Forest` per server (per linked dataspace).  Its host says when a link's
connection is established (:meth:`Forest.opened`, the handshake done) and when it closes
(:meth:`Forest.closed`), hands it the tree messages that arrive on a link's control
entity (:meth:`Forest.message`), sends what :meth:`Forest.take_outgoing` gives, and
lets data cross a link only while :meth:`Forest.is_up` says so
(:meth:`Forest.take_events` says when a link comes up or is refused).

**The rule.**  Links that are *up* (carrying data) always form a forest.  A new link is
*checked* first: it goes up only if its two ends are in different trees; otherwise it is
*refused* -- the new link, never one that is up: the tree that was there is not
disturbed.  When new links are checked at the same time and would close a cycle together,
one goes up and the others are refused, decided by their ids (below), never both and
never neither.

**Clusters.**  The members of a cluster (``dataspace.protocol.cluster``) are joined by
*routes*, a full mesh, and the forest treats a whole cluster as one node: the host says
when a route is up (:meth:`Forest.route_up`) and when it closes (:meth:`Forest.closed`).
A lock wave crosses routes one hop, as data does: a member locked from a link, or as an
end, passes the lock on over its links and its routes; a member locked over a route
passes it on over its links only.  So a leaf linked to one member is in one tree with the
whole cluster (never a cycle), and a second link from that tree to any member is refused.
Routes themselves are never checked nor refused (a cluster is a full mesh by design).

**How.**  A check locks both trees:

1. The dialing end (the *decider*) sends ``<tree-check ID K>`` over the new link (``K``
   counts the attempts) and locks its own tree: it locks itself, then sends
   ``<tree-lock ID K SIDE>`` on each of its up links; each server reached locks itself
   and passes the lock on over its other up links, then answers its parent with
   ``<tree-echo ID K SIDE [SERVER ...] MET BUSY>``: the servers of its subtree, whether
   the wave met the other end's wave (``MET``: the two ends are in one tree), whether some
   server was busy with another check (``BUSY``).  The accepting end does the same on its
   side and reports to the decider: ``<tree-report ID K [SERVER ...] MET BUSY>``.
2. The decider decides: *again* if either side was busy (both unlock; it tries again
   after a short random delay); *refused* if the waves met (or the trees share a
   server); else *up*.  It sends ``<tree-decide ID K up|refused|again REASON>``, marks
   the link, and unlocks its tree (``<tree-unlock ID K SIDE>`` down the same links); the
   accepting end does the same when the decision arrives.  A link up at the decider is up
   at the other end before any data comes (one connection: the decision is ahead).

While a server is locked by one check, no other link of its tree can go up (that needs
the lock), so each check sees its trees exactly as they are when it decides.  Two checks
that meet at a server are ordered by ID -- ``[LOW HIGH DIALER NONCE]``, the two servers'
ids in order, the dialer's, and the dialer's random nonce for the connection -- the
smaller first: a check meeting a server locked by a later one waits there for it; a
check meeting an earlier one gives up this attempt (*wait-die*: no deadlock, and the
earliest wins).  A lost server or link unlocks what it held (its subtree is no longer in
the tree), and the decider gives an attempt up after ``timeout`` seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from ..values import Record, Sequence, Symbol, Value

__all__ = ["MESSAGES", "Forest", "ForestError", "LinkId"]

CHECK = Symbol("tree-check")
LOCK = Symbol("tree-lock")
ECHO = Symbol("tree-echo")
UNLOCK = Symbol("tree-unlock")
REPORT = Symbol("tree-report")
DECIDE = Symbol("tree-decide")
MESSAGES = frozenset({CHECK, LOCK, ECHO, UNLOCK, REPORT, DECIDE})
"""The labels of the tree messages (the host hands these to :meth:`Forest.message`)."""

UP, REFUSED, AGAIN = "up", "refused", "again"
MAX_ID = 200
MAX_MEMBERS = 10_000
MAX_QUEUE = 1_000

LinkId = tuple[str, str, str, str]
"""A check's id: the two servers' ids in order, the dialer's id, the dialer's nonce."""


class ForestError(ValueError):
    """A malformed tree message (the host closes the link that sent it)."""


def _str(v: Any, what: str) -> str:
    if type(v) is not str or not 0 < len(v) <= MAX_ID:
        raise ForestError(f"{what} must be a string of 1-{MAX_ID} characters")
    return v


def _nat(v: Any, what: str) -> int:
    if type(v) is not int or not 0 < v < 1 << 62:
        raise ForestError(f"{what} must be a positive integer")
    return v


def _id(v: Any) -> LinkId:
    if type(v) is not Sequence or len(v) != 4:
        raise ForestError("a check's id is [LOW HIGH DIALER NONCE]")
    lo, hi, dialer, nonce = (_str(x, "a server id") for x in v)
    if not lo < hi or dialer not in (lo, hi):
        raise ForestError("a check's id is [LOW HIGH DIALER NONCE], LOW < HIGH")
    return (lo, hi, dialer, nonce)


def _members(v: Any) -> frozenset[str]:
    if type(v) is not Sequence or len(v) > MAX_MEMBERS:
        raise ForestError(f"a tree is a list of at most {MAX_MEMBERS} server ids")
    return frozenset(_str(x, "a server id") for x in v)


def _bool(v: Any, what: str) -> bool:
    if type(v) is not bool:
        raise ForestError(f"{what} must be #t or #f")
    return v


def _idv(i: LinkId) -> Sequence:
    return Sequence(list(i))


@dataclass
class _Req:
    """A request for this server's lock: from an up link (a wave), or local (``link`` is
    None: this server is an end of the link being checked)."""

    link: Hashable | None
    id: LinkId
    attempt: int
    side: str


@dataclass
class _Lock:
    id: LinkId
    attempt: int
    side: str
    parent: Hashable | None          # None: this server is the end that locks
    children: list[Hashable] = field(default_factory=list)
    waiting: set[Hashable] = field(default_factory=set)
    members: set[str] = field(default_factory=set)
    met: bool = False
    via: str | None = None           # at an end: the neighbour the other wave was met through
    busy: bool = False
    done: bool = False


@dataclass
class _Report:
    members: frozenset[str]
    met: bool
    via: str | None
    busy: bool


@dataclass
class _Check:
    """A link being checked (this server is one of its ends)."""

    link: Hashable
    peer: str
    decider: bool
    id: LinkId | None
    attempt: int = 0
    started: float = 0.0
    mine: _Report | None = None
    theirs: _Report | None = None
    retry_at: float | None = None
    aborts: int = 0
    refused: str | None = None


class Forest:
    """One server's part in keeping its links a forest (see the module docstring).

    ``me``: this server's id.  ``random``: a function returning floats in [0, 1) (the
    jitter of retries).  ``timeout``: seconds after which the decider gives an attempt up
    (and tries again).  ``again``: the first delay before another attempt, doubling up to
    ``again_max``.
    """

    def __init__(self, me: str, *, random: Callable[[], float], timeout: float = 20.0,
                 again: float = 0.05, again_max: float = 5.0) -> None:
        self.me = _str(me, "a server id")
        self.random = random
        self.timeout = timeout
        self.again = again
        self.again_max = again_max
        self.up: dict[Hashable, str] = {}          # link -> the peer's id
        self.routes: dict[Hashable, str] = {}      # route (cluster) -> the peer's id
        self.checks: dict[Hashable, _Check] = {}
        self.lock: _Lock | None = None
        self.queue: list[_Req] = []
        self._out: list[tuple[Hashable, Value]] = []
        self._events: list[tuple[str, Hashable, str | None]] = []
        self._now = 0.0

    # -- what the host says -------------------------------------------------------------

    def opened(self, link: Hashable, peer: str, *, dialed: bool, nonce: str, now: float) -> None:
        """A link's connection is established with server ``peer``; ``dialed``: this
        server dialed it (and decides), with ``nonce`` (random, for this connection)."""
        self._now = now
        _str(peer, "a server id")
        lo, hi = sorted((self.me, peer))
        c = _Check(link, peer, dialed, (lo, hi, self.me, _str(nonce, "a nonce")) if dialed else None)
        self.checks[link] = c
        if dialed:
            self._attempt(c, 1)

    def route_up(self, route: Hashable, peer: str, now: float) -> None:
        """A route to cluster member ``peer`` is up (its end is :meth:`closed` too).  A
        lock held here is not passed on over it: the check under way decides without
        that member's links, as it would had the route come up a moment later."""
        self._now = now
        self.routes[route] = _str(peer, "a server id")

    def closed(self, link: Hashable, now: float) -> None:
        """A link's (or route's) connection closed (up or not)."""
        self._now = now
        self.queue = [r for r in self.queue if r.link != link]
        gone = self.up.pop(link, None)
        if gone is None:
            gone = self.routes.pop(link, None)
        if gone is not None:
            lock = self.lock
            if lock is not None:
                if lock.parent == link:
                    self._unlock()  # cut off from the end that locked us
                elif link in lock.waiting:  # that part of the tree is gone
                    lock.waiting.discard(link)
                    lock.children.remove(link)
                    if not lock.waiting and not lock.done:
                        self._finish(lock)
        c = self.checks.pop(link, None)
        if c is not None:
            self._drop_local(c)
        self._serve_queue()

    def is_up(self, link: Hashable) -> bool:
        return link in self.up

    def state(self, link: Hashable) -> str | None:
        """``up``, ``checking``, ``refused`` or None (not a link known here)."""
        if link in self.up:
            return UP
        c = self.checks.get(link)
        if c is None:
            return None
        return REFUSED if c.refused is not None else "checking"

    # -- messages -----------------------------------------------------------------------

    def message(self, link: Hashable, v: Value, now: float) -> None:
        """A tree message arrived on ``link`` (raises :class:`ForestError` if malformed)."""
        self._now = now
        if type(v) is not Record or v.label not in MESSAGES:
            raise ForestError("not a tree message")
        f = v.fields
        lab = v.label
        want = {CHECK: 2, LOCK: 3, ECHO: 6, UNLOCK: 3, REPORT: 5, DECIDE: 4}[lab]
        if len(f) != want:
            raise ForestError(f"<{lab.name} ...> has {want} fields")
        i, k = _id(f[0]), _nat(f[1], "an attempt")
        if lab == LOCK:
            side = _str(f[2], "a side")
            if link not in self.up and link not in self.routes:
                # Only over links that are up (a link's decision comes before any lock).
                self._send(link, Record(ECHO, [_idv(i), k, side, Sequence(), False, True]))
                return
            self._acquire(_Req(link, i, k, side))
        elif lab == ECHO:
            self._echo(link, i, k, _str(f[2], "a side"), _members(f[3]),
                       _bool(f[4], "met"), _bool(f[5], "busy"))
        elif lab == UNLOCK:
            side = _str(f[2], "a side")
            self.queue = [r for r in self.queue
                          if not (r.link == link and r.id == i and r.attempt == k)]
            lock = self.lock
            if (lock is not None and lock.parent == link and lock.id == i
                    and lock.attempt == k and lock.side == side):
                self._unlock()
            self._serve_queue()
        else:
            c = self.checks.get(link)
            if c is None:
                raise ForestError(f"<{lab.name} ...> on a link that is not being checked")
            self._on_end(c, lab, i, k, f)
        self._serve_queue()

    def _on_end(self, c: _Check, lab: Symbol, i: LinkId, k: int, f: list[Any]) -> None:
        lo, hi = sorted((self.me, c.peer))
        if i[:3] != (lo, hi, self.me if c.decider else c.peer):
            raise ForestError("a check's id does not name this link's two servers")
        if lab == CHECK:
            if c.decider:
                raise ForestError("<tree-check ...> from the accepting end")
            if c.id is not None and c.id != i:
                raise ForestError("<tree-check ...> with another nonce")
            if k <= c.attempt:
                return  # (a duplicate)
            self._drop_local(c)
            c.id = i
            self._attempt(c, k)
        elif lab == REPORT:
            if not c.decider:
                raise ForestError("<tree-report ...> from the deciding end")
            if i != c.id or k != c.attempt or c.theirs is not None:
                return  # of an attempt given up
            met = f[3]
            if met is not False and met is not True:
                met = _str(met, "the server met through")
            c.theirs = _Report(_members(f[2]), met is not False,
                               met if type(met) is str else None, _bool(f[4], "busy"))
            self._decide_maybe(c)
        elif lab == DECIDE:
            if c.decider:
                raise ForestError("<tree-decide ...> from the accepting end")
            outcome, reason = f[2], f[3]
            if outcome not in (UP, REFUSED, AGAIN):
                raise ForestError("a decision is up, refused or again")
            reason = reason if type(reason) is str else ""
            if i != c.id or k != c.attempt:
                return
            self._apply(c, outcome, reason[:1000])

    # -- the ends of a link being checked -------------------------------------------------

    def _attempt(self, c: _Check, k: int) -> None:
        assert c.id is not None
        c.attempt = k
        c.started = self._now
        c.mine = c.theirs = None
        c.retry_at = None
        if c.decider:
            self._send(c.link, Record(CHECK, [_idv(c.id), k]))
        self._acquire(_Req(None, c.id, k, self.me))

    def _mine_done(self, c: _Check, r: _Report) -> None:
        c.mine = r
        if c.decider:
            self._decide_maybe(c)
            return
        assert c.id is not None
        met: Value = (r.via if r.via is not None else True) if r.met else False
        self._send(c.link, Record(REPORT, [_idv(c.id), c.attempt, Sequence(sorted(r.members)),
                                           met, r.busy]))
        if r.busy:  # the decision will be "again": let the others go meanwhile
            self._drop_local(c)

    def _decide_maybe(self, c: _Check) -> None:
        mine, theirs = c.mine, c.theirs
        if (mine is not None and mine.busy) or (theirs is not None and theirs.busy):
            self._decide(c, AGAIN, "")
        elif mine is not None and theirs is not None:
            why = None
            if mine.met or theirs.met:
                why = self._cycle(c, mine, theirs)
            elif mine.members & theirs.members:
                both = sorted(mine.members & theirs.members)[0]
                why = f"server {both} is reachable from both {self.me} and {c.peer}"
            if why is None:
                self._decide(c, UP, "")
            else:
                self._decide(c, REFUSED, f"this link would close a cycle: {why}")

    def _cycle(self, c: _Check, mine: _Report, theirs: _Report) -> str:
        """Why: the other end is already in this end's tree (say through which link)."""
        for frm, to, r in ((self.me, c.peer, mine), (c.peer, self.me, theirs)):
            if r.met and r.via is not None:
                if r.via == to:
                    return f"{frm} and {to} are already linked"
                return f"{frm} already reaches {to} through its link with {r.via}"
        return f"{self.me} and {c.peer} are already in one tree of links"

    def _decide(self, c: _Check, outcome: str, reason: str) -> None:
        assert c.id is not None
        self._send(c.link, Record(DECIDE, [_idv(c.id), c.attempt, outcome, reason]))
        self._apply(c, outcome, reason)

    def _apply(self, c: _Check, outcome: str, reason: str) -> None:
        if outcome == UP:
            # Up first, then unlock: a check waiting here must see the joined tree.
            del self.checks[c.link]
            self.up[c.link] = c.peer
            self._drop_local(c)
            self._events.append((UP, c.link, None))
        elif outcome == REFUSED:
            self._drop_local(c)
            c.refused = reason
            self._events.append((REFUSED, c.link, reason))
        else:
            self._drop_local(c)
            if c.decider:
                c.aborts += 1
                d = min(self.again_max, self.again * 2 ** min(c.aborts, 20))
                c.retry_at = self._now + d * (0.5 + self.random())
        self._serve_queue()

    def _drop_local(self, c: _Check) -> None:
        """This end no longer holds or wants its lock for ``c``."""
        if c.id is None:
            return
        self.queue = [r for r in self.queue if not (r.link is None and r.id == c.id)]
        lock = self.lock
        if lock is not None and lock.parent is None and lock.id == c.id:
            self._unlock()

    # -- the lock -----------------------------------------------------------------------

    def _acquire(self, r: _Req) -> None:
        lock = self.lock
        if lock is None:
            self._grant(r)
        elif lock.id == r.id:
            # The other end's wave got here first (the two ends are in one tree), or an
            # older attempt of the same check still holds this server: give this one up.
            if lock.attempt == r.attempt and lock.side != r.side:
                self._answer(r, met=True)
            else:
                self._answer(r, busy=True)
        elif r.id < lock.id and len(self.queue) < MAX_QUEUE:
            self.queue.append(r)  # earlier than the holder: wait for it
        else:
            self._answer(r, busy=True)  # later: give up this attempt

    def _answer(self, r: _Req, *, met: bool = False, busy: bool = False) -> None:
        if r.link is None:
            c = self._local(r)
            if c is not None:
                self._mine_done(c, _Report(frozenset({self.me}), met, None, busy))
        else:
            self._send(r.link, Record(ECHO, [_idv(r.id), r.attempt, r.side, Sequence(), met,
                                             busy]))

    def _local(self, r: _Req) -> _Check | None:
        for c in self.checks.values():
            if c.id == r.id and c.attempt == r.attempt and c.mine is None:
                return c
        return None

    def _grant(self, r: _Req) -> None:
        lock = self.lock = _Lock(r.id, r.attempt, r.side, r.link, members={self.me})
        # One hop over routes: a lock that came over a route goes on over links only.
        onward = list(self.up) if r.link in self.routes else [*self.up, *self.routes]
        for link in onward:
            if link != r.link:
                lock.children.append(link)
                lock.waiting.add(link)
                self._send(link, Record(LOCK, [_idv(r.id), r.attempt, r.side]))
        if not lock.waiting:
            self._finish(lock)

    def _echo(self, link: Hashable, i: LinkId, k: int, side: str, members: frozenset[str],
              met: bool, busy: bool) -> None:
        lock = self.lock
        if (lock is None or lock.done or lock.id != i or lock.attempt != k or lock.side != side
                or link not in lock.waiting):
            return  # of a lock given up
        lock.waiting.discard(link)
        if len(lock.members) + len(members) <= MAX_MEMBERS:
            lock.members |= members
        else:
            busy = True  # too big a tree to say: try again (and fail the same way)
        if (met or self._other_end(lock) in members) and not lock.met:
            lock.met = True  # the other end is in this tree: through this link
            lock.via = self.up.get(link) or self.routes.get(link)
        lock.busy = lock.busy or busy
        if lock.busy or not lock.waiting:
            self._finish(lock)

    @staticmethod
    def _other_end(lock: _Lock) -> str:
        lo, hi = lock.id[0], lock.id[1]
        return hi if lock.side == lo else lo

    def _finish(self, lock: _Lock) -> None:
        lock.done = True
        if lock.parent is None:
            c = self._local(_Req(None, lock.id, lock.attempt, lock.side))
            if c is not None:
                self._mine_done(c, _Report(frozenset(lock.members), lock.met, lock.via,
                                           lock.busy))
        else:
            self._send(lock.parent, Record(ECHO, [
                _idv(lock.id), lock.attempt, lock.side, Sequence(sorted(lock.members)),
                lock.met, lock.busy]))

    def _unlock(self) -> None:
        lock = self.lock
        assert lock is not None
        self.lock = None
        for link in lock.children:
            if link in self.up or link in self.routes:
                self._send(link, Record(UNLOCK, [_idv(lock.id), lock.attempt, lock.side]))

    def _serve_queue(self) -> None:
        while self.lock is None and self.queue:
            r = min(self.queue, key=lambda q: q.id)
            self.queue.remove(r)
            if r.link is None and self._local(r) is None:
                continue  # that check has moved on
            self._grant(r)
            lock = self.lock
            if lock is not None:  # wait-die: those later than the new holder give up
                later = [q for q in self.queue if q.id > lock.id]
                self.queue = [q for q in self.queue if q.id < lock.id]
                for q in later:
                    self._answer(q, busy=True)

    # -- time ---------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Give up attempts older than ``timeout``; start the attempts that are due."""
        self._now = now
        for c in list(self.checks.values()):
            if not c.decider or c.refused is not None or c.link not in self.checks:
                continue
            if c.retry_at is not None:
                if c.retry_at <= now:
                    self._attempt(c, c.attempt + 1)
            elif c.started + self.timeout <= now:
                self._decide(c, AGAIN, "")
        self._serve_queue()

    def next_deadline(self) -> float | None:
        ds = []
        for c in self.checks.values():
            if c.decider and c.refused is None:
                ds.append(c.retry_at if c.retry_at is not None else c.started + self.timeout)
        return min(ds, default=None)

    def take_outgoing(self) -> list[tuple[Hashable, Value]]:
        """``(link, message)`` to send on each link's control entity, in order."""
        out, self._out = self._out, []
        return out

    def take_events(self) -> list[tuple[str, Hashable, str | None]]:
        """``("up", link, None)`` and ``("refused", link, REASON)``, in order."""
        out, self._events = self._events, []
        return out

    def _send(self, link: Hashable, v: Value) -> None:
        self._out.append((link, v))
