"""Groups of observers across linked servers and a cluster (sans-IO).

In one process a :class:`~dataspace.groups.Pool` shares a group's messages and jobs
among its members.  Across servers the members of one group are spread over many of
them, and the rule is "once per group across the whole system" -- a cluster (a full mesh
of routes, forwarding one hop) and the trees of links hanging off it -- not once per
server.  :class:`GroupNode` is one server's part of that for one (group, pattern): no
sockets, no clocks, no randomness; its host tells it what happens and carries out what it
returns.  The broker runs one per (dataspace, group, pattern) on each server
(:mod:`dataspace.broker.grouplinks`: announcements on a session's control entity,
directed messages and jobs on its data entity); its own tests run a simulated
three-member cluster with a leaf against a model.

**Slots.**  A node's pool holds its *local members* (weight 1 each) and one *stand-in*
per neighbour (route or link) that has members behind it, weighted by how many: the
neighbour announces it (:meth:`GroupNode.announced`).  What a node announces to a
neighbour N (:meth:`GroupNode.announcement`) counts what traffic from N may reach through
it: its local members, plus the stand-ins of its other neighbours that traffic from N may
go on to -- for a link, every other route and link; for a route, only links (routes
forward one hop: what comes over a route never goes on over another).  Split horizon on a
tree of links around a full mesh of routes: no count ever comes back to where it was
made, so weights cannot feed themselves.

**Messages: the node where one enters decides.**  ``message(None)`` is a message that
entered here (a local client sent it): the pool picks a local member or a stand-in,
round-robin by weight.  A message directed to a stand-in is sent on to that neighbour,
whose node is asked ``message(FROM)`` and picks again among the slots that traffic from
``FROM`` may reach.  Each hop picks exactly one slot, so a message reaches at most one
member of the group, and exactly one when the weights are settled.  A message that
crossed a link or route as plain data (for plain observers) is never given to
:meth:`GroupNode.message`: its origin already chose.

**Jobs: one coordinator decides.**  A node is told of the group's job assertions
(:meth:`GroupNode.job_seen`) held on any node its host hears of -- the coordinator's
host asks for every one: several holders on several servers are one job.  Only the *coordinator* assigns them: the node of
best :class:`Rank` in the connected system -- a cluster member before a leaf, then the
one that started first, then the smallest id -- which every node learns from its
neighbours' announcements (the same split horizon: settled, all agree).  The rank of a
server depends on nothing a client does, so the coordinator changes only when it dies or
the system splits or joins, not when members come and go.  Its assignment to a stand-in
is sent on as a directed assignment (an assertion, so a connection closing retracts it),
assigned again at the neighbour (:meth:`GroupNode.job_directed`), and so on to one
member.  Assignments are sticky at every hop: a stand-in keeps its jobs while its
neighbour has members (a new member behind it changes its weight, not its jobs).

What a failover can do:

* a member leaves or dies: its node moves its jobs to another slot at once; if it was
  the last member behind a stand-in, the job waits there until the neighbour's weight
  of 0 arrives upstream, which moves it (within one announcement's trip);
* a server dies: its neighbours retract what it directed to them, drop its stand-in and
  move what they had given it; if it was the coordinator, the next best node becomes
  coordinator on every node once they all see it gone, and assigns every job anew
  (not sticky across coordinators);
* until then -- a silent coordinator's routes are closed only after the routes'
  keepalive bound -- two nodes can each believe they coordinate, and a job can be held
  by one member under each; never by two members under one coordinator.  Where the two
  directions of one job meet on a node they count as one (the pool is a bag).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from ..groups import ASSIGN, MAX_WEIGHT, MEMBER, UNASSIGN, Effect, Node

__all__ = ["ASSIGN", "LINK", "MEMBER", "NODE", "ROUTE", "UNASSIGN", "Effect", "GroupNode",
           "Rank"]

ROUTE = "route"
"""A neighbour in the same cluster: what comes from it goes on to links only."""
LINK = "link"
"""A linked neighbour: what comes from it goes on to every other neighbour."""
NODE = "node"
"""The kind of a slot that is a neighbour's stand-in: ``(NODE, ID)``."""


@dataclass(frozen=True, order=True)
class Rank:
    """How eligible a server is to coordinate a group's jobs: smaller is better."""

    leaf: bool
    """False for a cluster member (a cluster member coordinates before any leaf)."""
    since: float
    """When this incarnation of the server started (the route handshake's incarnation):
    an older server keeps coordinating when a newer one appears."""
    node: str
    """The server's id: the last tie-break."""


class _Neighbour:
    __slots__ = ("kind", "rank", "said", "weight")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.weight = 0  # members behind it, as it announced
        self.rank: Rank | None = None  # the best rank behind it, as it announced
        self.said: tuple[int, Rank] | None = None  # what we last announced to it


class GroupNode(Node):
    """One server's part of one (group, pattern) across servers (module docstring).

    Slots in the pool are ``(MEMBER, member)`` for local members (joined, left and given
    jobs as in :class:`~dataspace.groups.Node`) and ``(NODE, ID)`` for a neighbour's
    stand-in; the :data:`Effect` lists returned name them: assigning a job to ``(NODE,
    ID)`` means asserting a directed assignment to that neighbour, unassigning means
    retracting it.
    """

    def __init__(self, rank: Rank) -> None:
        super().__init__()
        self.rank = rank
        self._nbrs: dict[str, _Neighbour] = {}
        self._routes: set[Any] = set()  # route slots: excluded for traffic from a route
        # (from, job) -> [count, the exclusion its copies came with]
        self._directed: dict[tuple[str, Hashable], list[Any]] = {}
        self.dropped = 0
        """Messages directed here that found no slot (weights were changing)."""

    # -- neighbours ----------------------------------------------------------------------

    def neighbour_up(self, node: str, kind: str, rank: Rank | None = None) -> list[Effect]:
        """A route (``ROUTE``) or link (``LINK``) to ``node`` is up.  ``rank``: that
        server's own, if known (from the route's or link's handshake): the best rank
        behind it is no worse, so a node that is not the coordinator knows it before the
        neighbour has announced anything (and does not assign jobs meanwhile)."""
        if kind not in (ROUTE, LINK):
            raise ValueError(f"a neighbour is a {ROUTE} or a {LINK}, not {kind!r}")
        if node in self._nbrs:
            raise ValueError(f"{node} is a neighbour already")
        nb = self._nbrs[node] = _Neighbour(kind)
        nb.rank = rank
        if kind == ROUTE:
            self._routes.add((NODE, node))
        return self._recheck([])

    def neighbour_down(self, node: str) -> list[Effect]:
        """The route or link to ``node`` closed: what it directed here is retracted, its
        stand-in goes (its jobs move), and the coordinator may change."""
        nb = self._nbrs.pop(node, None)
        if nb is None:
            return []
        effects: list[Effect] = []
        for fk in [fk for fk in self._directed if fk[0] == node]:
            n, ex = self._directed.pop(fk)
            for _ in range(n):
                effects += self.pool.remove(fk[1], ex)
        effects += self.pool.leave((NODE, node), tell=False)
        self._routes.discard((NODE, node))
        return self._recheck(effects)

    def announced(self, node: str, weight: int, rank: Rank | None) -> list[Effect]:
        """``node`` says how many members are behind it (for traffic from here) and the
        best rank there."""
        nb = self._nbrs[node]
        nb.rank = rank
        slot = (NODE, node)
        effects: list[Effect] = []
        weight = min(weight, MAX_WEIGHT)
        if weight > 0:
            if slot in self.pool:
                self.pool.set_weight(slot, weight)
            else:
                effects = self.pool.join(slot, weight)
        elif slot in self.pool:
            effects = self.pool.leave(slot, tell=True)
        nb.weight = weight
        return self._recheck(effects)

    def announcement(self, node: str) -> tuple[int, Rank]:
        """What to announce to ``node``: the members reachable through here for its
        traffic, and the best rank of this side (this node included)."""
        weight = self.local_weight()
        best = self.rank
        from_route = self._nbrs[node].kind == ROUTE
        for nid, nb in self._nbrs.items():
            if nid == node or (from_route and nb.kind == ROUTE):
                continue
            weight += nb.weight
            if nb.rank is not None and nb.rank < best:
                best = nb.rank
        return min(weight, MAX_WEIGHT), best

    def take_announcements(self) -> list[tuple[str, int, Rank]]:
        """The announcements that changed since they were last taken: send each to its
        neighbour (who calls :meth:`announced`)."""
        out = []
        for nid, nb in self._nbrs.items():
            a = self.announcement(nid)
            if a != nb.said:
                nb.said = a
                out.append((nid, a[0], a[1]))
        return out

    def coordinator(self) -> Rank:
        """The best rank this node knows of (itself included): the coordinator."""
        best = self.rank
        for nb in self._nbrs.values():
            if nb.rank is not None and nb.rank < best:
                best = nb.rank
        return best

    def weight(self) -> int:
        """Members reachable from here for a message entering here."""
        return self.local_weight() + sum(nb.weight for nb in self._nbrs.values())

    def idle(self) -> bool:
        """No member here, none behind any neighbour, no job given to this node: its
        host may forget it (its last announcements, all of weight 0, sent first)."""
        return (not self._members and not self._directed
                and not any(nb.weight for nb in self._nbrs.values()))

    def neighbours(self) -> list[str]:
        """The neighbours' ids."""
        return list(self._nbrs)

    # -- messages ------------------------------------------------------------------------

    def message(self, came_from: Any = None) -> tuple[str, Any] | None:
        """Where a message goes: ``(MEMBER, member)``, ``(NODE, ID)`` (send it on;
        that node is asked with ``came_from`` = this node), or None (no member: dropped).
        ``came_from``: None for a message that entered here, else the neighbour that
        directed it here."""
        if came_from is None:
            return self.pool.pick()
        t = self.pool.pick(self._exclude(came_from))
        if t is None:
            self.dropped += 1
        return t

    # -- jobs (plain copies: job_seen and job_gone, as a Node) ------------------------------

    def job_directed(self, came_from: str, job: Hashable) -> list[Effect]:
        """``came_from`` assigned ``job`` to this node's stand-in there."""
        fk = (came_from, job)
        d = self._directed.get(fk)
        if d is None:
            d = self._directed[fk] = [0, frozenset(self._exclude(came_from))]
        d[0] += 1
        return self.pool.add(job, d[1])

    def job_undirected(self, came_from: str, job: Hashable) -> list[Effect]:
        """``came_from`` took that assignment back."""
        fk = (came_from, job)
        d = self._directed.get(fk)
        if d is None:
            return []
        d[0] -= 1
        if not d[0]:
            del self._directed[fk]
        return self.pool.remove(job, d[1])

    # -- internals -----------------------------------------------------------------------

    def _exclude(self, came_from: str) -> set[Any]:
        nb = self._nbrs.get(came_from)
        ex = {(NODE, came_from)}
        if nb is not None and nb.kind == ROUTE:
            ex |= self._routes
        return ex

    def _recheck(self, effects: list[Effect]) -> list[Effect]:
        """Start or stop coordinating when the best rank known changed."""
        now = self.coordinator() == self.rank
        if now and not self.coordinating:
            self.coordinating = True
            for job in self._seen:
                effects += self.pool.add(job)
        elif self.coordinating and not now:
            self.coordinating = False
            for job in self._seen:
                effects += self.pool.remove(job)
        return effects
