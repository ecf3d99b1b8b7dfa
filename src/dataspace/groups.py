"""Groups of observers that share work: each message to one member, each assertion a job.

Every observer of a pattern hears every matching message and sees every matching
assertion.  A *group* is a pool of observers of one pattern that share them instead:

* each matching **message** goes to one live member of the group (and, as before, to
  every plain observer);
* each matching **assertion** is a *job*: it is *assigned* to one live member of the
  group, which alone is told of it (``on_assert``) and of its retraction
  (``on_retract``); when that member leaves or dies, each of its jobs moves to another
  live member, which is told.

>>> from dataspace.dataspace import Dataspace
>>> from dataspace.values import parse
>>> ds = Dataspace()
>>> groups = Groups.of(ds)
>>> got = []
>>> a = groups.join("resize", "<Job $id>", on_assert=lambda i: got.append(("a", i)))
>>> b = groups.join("resize", "<Job $id>", on_assert=lambda i: got.append(("b", i)))
>>> for i in range(4):
...     _ = ds.assert_(parse(f"<Job {i}>"))
>>> got
[('a', 0), ('b', 1), ('a', 2), ('b', 3)]
>>> a.cancel()                      # a leaves: its jobs move to b, which is told
>>> got[4:]
[('b', 0), ('b', 2)]

The design
----------
**On the wire.**  A member joins by asserting, in the dataspace, the record ::

    <ObserveGroup GROUP PATTERN #:OBSERVER>
    <ObserveGroup GROUP PATTERN #:OBSERVER {rebalance: #t  weight: N}>

``GROUP`` a string (the group's name, up to :data:`MAX_GROUP_NAME` bytes), ``PATTERN``
the pattern in the Syndicate wire form (``dataspacePatterns.Pattern``, as in
``<Observe PATTERN #:OBSERVER>``) and ``OBSERVER`` a reference.  In Preserves schema
terms (beside ``dataspace.prs``'s ``Observe``)::

    ObserveGroup = <ObserveGroup @group string @pattern dataspacePatterns.Pattern
                                 @observer #:any> / <ObserveGroup @group string
                                 @pattern dataspacePatterns.Pattern @observer #:any
                                 @options {symbol: any ...:...}> .

It leaves the record and the membership goes: retracting it, or the connection that
asserted it closing, is leaving.  The observer is told exactly what an ``<Observe ...>``
observer is told (so a Syndicate client handles both with the same code): a job is
asserted to it as the sequence of the captures (``[capture ...]``) and retracted under
that handle, a message is sent to it as the sequence of the captures.  Options, all
optional: ``rebalance: #t`` (this member takes a share of the jobs already assigned when
it joins, see below), ``weight: N`` (an integer from 1 to :data:`MAX_MEMBER_WEIGHT`,
100, default 1: the member counts as N members -- a larger claim would let one client
take nearly all of a busy group's work).  Unknown option keys are ignored (later
versions may add some); a record of the wrong shape is ignored with a one-line warning
in the log.  A member that joins through a capability with caveats is told through
them, as an ``<Observe>`` observer is (:class:`~dataspace.protocol.sturdy.AttenuatedEntity`).

Plain ``<Observe ...>`` assertions are unchanged.  A group's *dispatcher* observes its
pattern once, with a plain ``<Observe PATTERN #:dispatcher>``, while the group has
members: a producer watching interest sees someone wanting the pattern, whatever the
number of members.  A group is one name *and* one pattern: members of ``"resize"`` that
observe two different patterns form two pools, each sharing its own pattern's matches.

**Messages: round-robin.**  Each message goes to the next live member in join order,
cycling (:meth:`Pool.pick`); members of weight N count N times (smooth weighted
round-robin: the N turns are spread, not consecutive).  Members of equal speed each get
an equal share within one message, whatever their number; a slow member gets its share
all the same and falls behind through its connection's flow control, as a plain observer
does (a least-loaded rule needs a load signal that messages do not have: no
acknowledgements).  A member whose connection is gone is never chosen: it is found dead
when its turn comes (or by :meth:`Groups.reap`) and skipped, and its jobs move.  A message
that arrives while no member is live goes to no member of that group (as to an observer
that is not there).

**Jobs: least-loaded, sticky.**  A job is one distinct match of the pattern, as an
observer sees it: the captures.  The dataspace counts holders, so a value held by
several holders is one job, assigned when the first holder asserts it and finished when
the last retracts it (capture the whole value, ``<$ <Job _ _>>``, to make every distinct
value its own job).  A new job goes to the live member holding the fewest jobs per
weight, ties broken in turn (:meth:`Pool.add`).  An assignment is *sticky*: it stays
with its member until the job is finished or the member leaves or dies; then it moves to
the least-loaded live member, which is told (a member that left by retracting its record
and is still connected is told the retraction first).  So a new member gets new work,
not moved work -- unless it joins with ``rebalance``: then jobs move from the most
loaded members to the least loaded until no move would make the spread more even (for
equal weights: until every member holds within one job of every other), the most
recently assigned first.  Jobs that arrive while the group has no live member wait,
unassigned, for the first one.  In one process all of this happens within the turn that
caused it: a member that leaves has its jobs moved before anything else happens, and no
job is ever assigned to two members at once.

**Across links and a cluster** ("once per group across the whole system", not once per
server).  :mod:`dataspace.protocol.groups` holds the rules, sans-IO, as
:class:`~dataspace.protocol.groups.GroupNode` (a :class:`Node` with neighbours);
:mod:`dataspace.broker.grouplinks` carries them over a server's links and routes (a
:class:`Wire`: :attr:`Groups.wire`).  ``<ObserveGroup>`` records never cross:

* *Members across servers.*  On each server each neighbour (a route or link) is a
  *stand-in* in the group's pool, of weight N: the members reachable
  through it on the side of that neighbour's traffic (its own members, plus for a link
  everything behind its other routes and links, for a route only what is behind its
  links: routes forward one hop).  With the weights a message or job that crosses the
  system goes to each member with an equal share.
* *Messages: the server where the message enters decides* (the member its client is
  connected to, or the leaf it was sent at).  It picks among its local members and its
  neighbours' weighted stand-ins; a message directed to a neighbour is picked again
  there, among that server's members and its other neighbours (never back, never route to
  route).  Each hop picks exactly one, so each message reaches one member per group; a
  message that crosses a link or route as plain data (for plain observers) is never
  dispatched to groups again.  While weights change (a member leaving a far server) a
  message can reach no member of the group, but never two.
* *Jobs: one coordinator decides.*  An assertion may be held on several servers at once
  (bag semantics across the system), so the server that holds it cannot decide alone.
  The *coordinator* sees every job (its dispatcher alone asks the neighbours for the
  group's pattern; a server that becomes coordinator asks then) and alone assigns them: of the connected servers, a cluster member before a
  leaf, then the one that started first, then the smallest server id -- learned, like
  the weights, from what each neighbour announces.  It depends on no client, so members
  coming and going never change it.  Its directed assignments are assertions, so a route
  or link closing retracts them, and they move.  Settled, no job is assigned twice.
  During a failover two servers can each believe they coordinate (a silent coordinator's
  routes are not yet judged dead by all members: up to the routes' keepalive bound,
  ``dead`` seconds); then a job can be assigned to one member under each of them, never
  to more than one member per coordinator.  When the coordinator dies, the jobs it had
  assigned move (stickiness holds within one coordinator's reign).

**On one server.**  A server gives each of its dataspaces its :class:`Groups`, so any
client joins with the record (ours with ``observe(PATTERN, ..., group=NAME)``, the
command line with ``dataspace observe PATTERN --group NAME``).  A member is a peer's
reference: it is told over its connection; a message reaches it as the bytes of its
captures as they came in (the dispatcher is one of the message router's sinks, see
:class:`_Dispatcher`), never decoded.  When a connection closes the server calls
:meth:`Groups.reap` at once: its members are taken out and their jobs move, before its
records are retracted (a peer holding many assertions has them retracted in chunks).
A member's connection found closed when its turn comes is skipped.

This module is the dataspace layer: :class:`Pool` is the sharing rule as a pure state
machine (no dataspace, no clock, no randomness: members and jobs are opaque keys, and
each call returns what to tell whom), :class:`Node` one server's share of a group (a
pool of slots: its members, and across servers its neighbours' stand-ins), and
:class:`Groups` runs nodes on a
:class:`~dataspace.dataspace.Dataspace` through its public API (and two of its
internals: the facet current at a join, and ``_run_callback``, which runs a callback as
its own turn, isolated as the dataspace runs an observer's).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .dataspace import OBSERVE, Dataspace, Entity, Facet, Subscription, fresh_handle
from .pattern import (
    DISCARD,
    Bind,
    Pattern,
    PatternError,
    Rec,
    as_pattern,
    from_preserves,
    to_preserves,
)
from .values import Dictionary, Embedded, Record, Sequence, Symbol, Value, decode, key, stringify

__all__ = [
    "ASSIGN",
    "MAX_GROUP_NAME",
    "MAX_MEMBER_WEIGHT",
    "MAX_WEIGHT",
    "MEMBER",
    "OBSERVE_GROUP",
    "UNASSIGN",
    "Effect",
    "GroupMember",
    "GroupRecord",
    "GroupRecordError",
    "Groups",
    "Node",
    "Pool",
    "Wire",
    "check_group_name",
    "member_record",
    "parse_member_record",
    "subscribe_group",
]

log = logging.getLogger(__name__)

OBSERVE_GROUP = Symbol("ObserveGroup")
"""The label of the record a member asserts to join a group (see the module docstring)."""
MAX_GROUP_NAME = 256
"""Longest group name accepted, in bytes of UTF-8."""
MAX_WEIGHT = 1_000_000
"""Largest weight of a pool's member (a server's stand-in for the members behind a link
or route counts them: see :mod:`dataspace.protocol.groups`)."""
MAX_MEMBER_WEIGHT = 100
"""Largest weight an ``<ObserveGroup>`` record may claim: a client's member counts as at
most 100 (a larger claim would take nearly every message and job of a busy group)."""

_REBALANCE = Symbol("rebalance")
_WEIGHT = Symbol("weight")

ASSIGN = "assign"
"""Effect: tell ``member`` that ``job`` is now its (``on_assert``)."""
UNASSIGN = "unassign"
"""Effect: tell ``member`` that ``job`` is no longer its (``on_retract``)."""

Effect = tuple[str, Any, Any]
"""``(ASSIGN or UNASSIGN, member, job)``: what a :class:`Pool` says to tell whom, in order."""


# ---------------------------------------------------------------------------------------
# The rule, as a pure state machine


class _Slot:
    """One member of a pool."""

    __slots__ = ("current", "jobs", "member", "messages", "weight")

    def __init__(self, member: Hashable, weight: int) -> None:
        self.member = member
        self.weight = weight
        self.jobs: dict[Hashable, None] = {}  # held, in the order assigned
        self.messages = 0
        self.current = 0  # smooth weighted round-robin's running credit


class _Job:
    __slots__ = ("count", "exclude", "excludes", "had", "holder")

    def __init__(self) -> None:
        self.count = 0
        # Holders' exclusions (a copy that excludes nothing counts under None) and how
        # many copies came with each; ``exclude`` is their union: a job is never given
        # to a member that any of its copies excludes.
        self.excludes: dict[frozenset[Any] | None, int] = {}
        self.exclude: frozenset[Any] | None = None
        self.holder: _Slot | None = None
        self.had = False  # was assigned before (a later assignment is a move)

    def changed(self) -> None:
        ex: frozenset[Any] = frozenset()
        for e in self.excludes:
            if e:
                ex |= e
        self.exclude = ex or None


class Pool:
    """How one group shares one pattern's matches: members, messages, jobs.

    A pure state machine: members and jobs are any hashable keys; nothing here knows of
    dataspaces, connections or clocks.  :meth:`pick` names the member a message goes to;
    :meth:`join`, :meth:`leave`, :meth:`add`, :meth:`remove`, :meth:`rebalance` return the
    :data:`Effect` list saying whom to tell which job was assigned or unassigned, in
    order.  The rules are in the module docstring.

    ``exclude`` (of :meth:`pick`, :meth:`add` and :meth:`remove`): members that must not
    get this message or job (a server never sends one back to the neighbour it came
    from).  A job is given to no member that any of its holders' copies excludes (copies
    that came from two directions exclude both); it waits if no other member is live.
    """

    def __init__(self) -> None:
        self._slots: dict[Hashable, _Slot] = {}
        self._order: list[_Slot] = []  # join order
        self._rr = 0  # round-robin: the index of the next member
        self._jrr = 0  # jobs: where the search for the least loaded starts (ties in turn)
        self._weighted = 0  # members whose weight is not 1
        self._jobs: dict[Hashable, _Job] = {}
        self._pending: dict[Hashable, None] = {}  # jobs with no member, in arrival order
        self.messages = 0
        """Messages given to a member."""
        self.dropped = 0
        """Messages that found no live member."""
        self.reassigned = 0
        """Assignments of a job that had been assigned before (its member left, or a
        rebalance moved it)."""

    # -- members -------------------------------------------------------------------------

    def join(self, member: Hashable, weight: int = 1, rebalance: bool = False) -> list[Effect]:
        """``member`` joins with ``weight``: it gets the jobs that were waiting for a
        member; with ``rebalance``, a share of the others too."""
        if member in self._slots:
            raise ValueError(f"{member!r} is already a member")
        _check_weight(weight)
        s = _Slot(member, weight)
        self._slots[member] = s
        self._order.append(s)
        if weight != 1:
            self._weighted += 1
        effects: list[Effect] = []
        if self._pending:
            self._assign_pending(effects)
        if rebalance:
            self._rebalance(effects)
        return effects

    def leave(self, member: Hashable, tell: bool = True) -> list[Effect]:
        """``member`` left (or died): each of its jobs moves to the least-loaded live
        member, or waits if there is none.  ``tell``: first unassign them from it (it
        left but can still hear: it must not go on working on them); a dead member is
        told nothing.  Unknown members are ignored."""
        s = self._slots.pop(member, None)
        if s is None:
            return []
        i = self._order.index(s)
        del self._order[i]
        if i < self._rr:
            self._rr -= 1
        if i < self._jrr:
            self._jrr -= 1
        if s.weight != 1:
            self._weighted -= 1
        effects: list[Effect] = []
        held = list(s.jobs)
        s.jobs.clear()
        if tell:
            for job in held:
                effects.append((UNASSIGN, member, job))
        for job in held:
            j = self._jobs[job]
            j.holder = None
            self._place(job, j, effects)
        return effects

    def set_weight(self, member: Hashable, weight: int) -> None:
        """Change a member's weight (what it stands for changed).  Nothing moves: the
        new weight counts for what comes next."""
        _check_weight(weight)
        s = self._slots[member]
        if (s.weight != 1) != (weight != 1):
            self._weighted += 1 if weight != 1 else -1
        s.weight = weight

    def __contains__(self, member: object) -> bool:
        return member in self._slots

    def __len__(self) -> int:
        """How many members."""
        return len(self._order)

    def members(self) -> list[Any]:
        """The members, in join order."""
        return [s.member for s in self._order]

    def weight(self, member: Hashable) -> int:
        return self._slots[member].weight

    # -- messages ------------------------------------------------------------------------

    def pick(self, exclude: Iterable[Any] | None = None) -> Any:
        """The member the next message goes to (counted as delivered to it), or None
        when no member (but the excluded) is live: the message is dropped (counted)."""
        order = self._order
        n = len(order)
        if n and not self._weighted and not exclude:
            i = self._rr
            if i >= n:
                i = 0
            s = order[i]
            self._rr = i + 1
        else:
            ex = _as_set(exclude)
            best: _Slot | None = None
            total = 0
            for t in order:
                if ex and t.member in ex:
                    continue
                t.current += t.weight
                total += t.weight
                if best is None or t.current > best.current:
                    best = t
            if best is None:
                self.dropped += 1
                return None
            best.current -= total
            s = best
        s.messages += 1
        self.messages += 1
        return s.member

    # -- jobs ----------------------------------------------------------------------------

    def add(self, job: Hashable, exclude: Iterable[Any] | None = None) -> list[Effect]:
        """One more holder of ``job``: the first assigns it (to the least-loaded live
        member not in ``exclude``; it waits if there is none); later ones only count --
        unless their ``exclude`` names its member: then it moves."""
        ex = frozenset(exclude) if exclude else None
        j = self._jobs.get(job)
        fresh = j is None
        if j is None:
            j = self._jobs[job] = _Job()
        j.count += 1
        j.excludes[ex] = j.excludes.get(ex, 0) + 1
        effects: list[Effect] = []
        if fresh:
            j.exclude = ex
            s = self._choose(ex)
            if s is None:
                self._pending[job] = None
            else:
                self._give(s, job, j, effects)
        elif ex and j.excludes[ex] == 1:
            j.changed()
            h = j.holder
            if h is not None and h.member in ex:
                del h.jobs[job]
                j.holder = None
                effects.append((UNASSIGN, h.member, job))
                self._place(job, j, effects)
        return effects

    def remove(self, job: Hashable, exclude: Iterable[Any] | None = None) -> list[Effect]:
        """One holder of ``job`` fewer (the one that came with ``exclude``): when the
        last goes, its member is told (unknown jobs are ignored)."""
        j = self._jobs.get(job)
        if j is None:
            return []
        ex = frozenset(exclude) if exclude else None
        n = j.excludes.get(ex, 0)
        if n == 0:
            return []
        if n > 1:
            j.excludes[ex] = n - 1
        else:
            del j.excludes[ex]
        j.count -= 1
        if j.count > 0:
            effects: list[Effect] = []
            if ex and n == 1:
                j.changed()
                if j.holder is None:  # (what it excluded may take it now)
                    del self._pending[job]
                    self._place(job, j, effects)
            return effects
        del self._jobs[job]
        s = j.holder
        if s is None:
            self._pending.pop(job, None)
            return []
        del s.jobs[job]
        return [(UNASSIGN, s.member, job)]

    def holder(self, job: Hashable) -> Any:
        """The member ``job`` is assigned to (None: waiting, or no such job)."""
        j = self._jobs.get(job)
        return None if j is None or j.holder is None else j.holder.member

    def holders(self, job: Hashable) -> int:
        """How many holders ``job`` has (0: no such job)."""
        j = self._jobs.get(job)
        return 0 if j is None else j.count

    def jobs(self) -> list[Any]:
        """Every job, in arrival order."""
        return list(self._jobs)

    def jobs_of(self, member: Hashable) -> list[Any]:
        """The jobs assigned to ``member``, in the order it got them."""
        s = self._slots.get(member)
        return [] if s is None else list(s.jobs)

    def pending(self) -> list[Any]:
        """The jobs waiting for a member."""
        return list(self._pending)

    def messages_of(self, member: Hashable) -> int:
        """Messages given to ``member`` since it joined."""
        return self._slots[member].messages

    def rebalance(self) -> list[Effect]:
        """Move jobs from the most loaded members to the least loaded until no move
        makes the spread more even (equal weights: every member holds within one job of
        every other), the most recently assigned first; each move unassigns, then
        assigns."""
        effects: list[Effect] = []
        self._rebalance(effects)
        return effects

    # -- internals -----------------------------------------------------------------------

    def _choose(self, exclude: frozenset[Any] | None) -> _Slot | None:
        """The least-loaded member (jobs per weight) not in ``exclude``; among equals the
        first from where the last search chose, so ties go round."""
        order = self._order
        n = len(order)
        if not n:
            return None
        start = self._jrr
        if start >= n:
            start = 0
        best: _Slot | None = None
        at = 0
        for k in range(n):
            i = start + k
            if i >= n:
                i -= n
            s = order[i]
            if exclude and s.member in exclude:
                continue
            if best is None or len(s.jobs) * best.weight < len(best.jobs) * s.weight:
                best = s
                at = i
        if best is not None:
            self._jrr = at + 1
        return best

    def _place(self, job: Hashable, j: _Job, effects: list[Effect]) -> None:
        """Give an unassigned job to the least-loaded member it may go to, or let it wait."""
        t = self._choose(j.exclude)
        if t is None:
            self._pending[job] = None
        else:
            self._give(t, job, j, effects)

    def _give(self, s: _Slot, job: Hashable, j: _Job, effects: list[Effect]) -> None:
        j.holder = s
        s.jobs[job] = None
        if j.had:
            self.reassigned += 1
        j.had = True
        effects.append((ASSIGN, s.member, job))

    def _assign_pending(self, effects: list[Effect]) -> None:
        for job in list(self._pending):
            j = self._jobs[job]
            s = self._choose(j.exclude)
            if s is not None:
                del self._pending[job]
                self._give(s, job, j, effects)

    def _rebalance(self, effects: list[Effect]) -> None:
        # Each move lowers the sum over members of jobs**2 / weight (a move from a to b
        # is made only when (2*la - 1)/wa > (2*lb + 1)/wb, which is that sum falling), so
        # the loop ends; the bound is a second guard.
        for _ in range(len(self._jobs) * max(1, len(self._order)) + 1):
            move = self._best_move()
            if move is None:
                return
            a, b, job = move
            del a.jobs[job]
            effects.append((UNASSIGN, a.member, job))
            self._give(b, job, self._jobs[job], effects)

    def _best_move(self) -> tuple[_Slot, _Slot, Hashable] | None:
        """A move that evens the spread: from the most loaded member that has a job
        another may take, to the least loaded that may take it (its most recent job)."""
        order = self._order
        if len(order) < 2:
            return None
        tops = sorted(order, key=lambda s: Fraction(2 * len(s.jobs) - 1, s.weight), reverse=True)
        bottoms = sorted(order, key=lambda s: Fraction(2 * len(s.jobs) + 1, s.weight))
        for a in tops:
            la = len(a.jobs)
            if not la:
                return None  # (the rest hold nothing either)
            for b in bottoms:
                if b is a:
                    continue
                if (2 * la - 1) * b.weight <= (2 * len(b.jobs) + 1) * a.weight:
                    break  # (the rest of the bottoms are no less loaded)
                for job in reversed(a.jobs):
                    ex = self._jobs[job].exclude
                    if not ex or b.member not in ex:
                        return a, b, job
        return None

    def check(self) -> None:
        """Assert the machine's invariants (for tests): every job is held by exactly one
        member or waiting, and each member's list is exactly what names it."""
        held: dict[Any, _Slot] = {}
        for s in self._order:
            assert self._slots[s.member] is s
            for job in s.jobs:
                assert job not in held, f"{job!r} held twice"
                held[job] = s
        assert len(self._slots) == len(self._order)
        for job, j in self._jobs.items():
            assert j.count > 0 and j.count == sum(j.excludes.values())
            if j.holder is not None and j.exclude:
                assert j.holder.member not in j.exclude, f"{job!r} held by an excluded member"
            if j.holder is None:
                assert job in self._pending, f"{job!r} neither held nor waiting"
            else:
                assert held.get(job) is j.holder and job not in self._pending
        assert len(held) + len(self._pending) == len(self._jobs)
        assert self._weighted == sum(1 for s in self._order if s.weight != 1)


def _check_weight(weight: int) -> None:
    if type(weight) is not int or not 1 <= weight <= MAX_WEIGHT:
        raise ValueError(f"a member's weight is an integer from 1 to {MAX_WEIGHT}, "
                         f"not {weight!r}")


MEMBER = "member"
"""The kind of a :class:`Node`'s slot that is a member on this server."""


class Node:
    """One server's share of one (group, pattern): its own members and the jobs it
    sees, as a :class:`Pool` whose members are *slots*: ``(MEMBER, member)`` for a
    member here (:class:`dataspace.protocol.groups.GroupNode` adds ``("node", ID)``,
    a neighbouring server's stand-in).  The :data:`Effect` lists it returns name slots.

    Alone, a node *coordinates*: it assigns every job it sees.  A pure state machine,
    as :class:`Pool` is."""

    def __init__(self) -> None:
        self.pool = Pool()
        self._members: dict[Hashable, int] = {}  # local member -> its weight
        self._seen: dict[Hashable, int] = {}  # copies of each job seen here
        self.coordinating = True

    # -- local members -------------------------------------------------------------------

    def join(self, member: Hashable, weight: int = 1, rebalance: bool = False) -> list[Effect]:
        """A member here joined with ``weight`` (see :meth:`Pool.join`)."""
        effects = self.pool.join((MEMBER, member), weight, rebalance)
        self._members[member] = weight
        return self._recheck(effects)

    def leave(self, member: Hashable, tell: bool = True) -> list[Effect]:
        """A member here left (``tell``: it can still hear) or died."""
        if self._members.pop(member, None) is None:
            return []
        return self._recheck(self.pool.leave((MEMBER, member), tell))

    def members(self) -> list[Any]:
        """The members here, in join order."""
        return [s[1] for s in self.pool.members() if s[0] == MEMBER]

    def local_weight(self) -> int:
        """What the members here weigh together."""
        return sum(self._members.values())

    def idle(self) -> bool:
        """Nothing for this node to do: no member here (or, across servers, behind it)."""
        return not self._members

    # -- messages and jobs ---------------------------------------------------------------

    def message(self, came_from: Any = None) -> tuple[str, Any] | None:
        """The slot a message goes to (None: no member; dropped)."""
        return self.pool.pick()  # type: ignore[no-any-return]

    def job_seen(self, job: Hashable) -> list[Effect]:
        """One more plain copy of ``job`` is held (here, or on another server)."""
        n = self._seen.get(job, 0)
        self._seen[job] = n + 1
        if n == 0 and self.coordinating:
            return self.pool.add(job)
        return []

    def job_gone(self, job: Hashable) -> list[Effect]:
        """One plain copy of ``job`` fewer."""
        n = self._seen.get(job, 0)
        if n == 0:
            return []
        if n > 1:
            self._seen[job] = n - 1
            return []
        del self._seen[job]
        return self.pool.remove(job) if self.coordinating else []

    def seen(self) -> list[Any]:
        """The jobs this node sees held."""
        return list(self._seen)

    def has(self, job: Hashable) -> bool:
        """Whether this node still knows ``job`` (seen held, or given to it)."""
        return job in self._seen or self.pool.holders(job) > 0

    def _recheck(self, effects: list[Effect]) -> list[Effect]:
        return effects


def _as_set(exclude: Iterable[Any] | None) -> Any:
    if not exclude:
        return None
    return exclude if isinstance(exclude, (set, frozenset)) else frozenset(exclude)


# ---------------------------------------------------------------------------------------
# The record on the wire


class GroupRecordError(ValueError):
    """An ``<ObserveGroup ...>`` record of the wrong shape (the message says which part)."""


@dataclass(frozen=True)
class GroupRecord:
    """An ``<ObserveGroup GROUP PATTERN #:OBSERVER OPTIONS?>`` record, read."""

    group: str
    pattern: Pattern
    observer: Any
    weight: int = 1
    rebalance: bool = False


def member_record(group: str, pattern: Pattern | str | Value, observer: Any, *,
                  weight: int = 1, rebalance: bool = False) -> Record:
    """The record that makes ``observer`` a member of ``group`` for ``pattern`` (a
    Pattern, concise pattern text, or the wire form) when asserted; ``weight`` from 1 to
    :data:`MAX_MEMBER_WEIGHT`."""
    _check_group(group)
    if type(weight) is not int or not 1 <= weight <= MAX_MEMBER_WEIGHT:
        raise ValueError(f"a member's weight is an integer from 1 to {MAX_MEMBER_WEIGHT}, "
                         f"not {weight!r}")
    fields: list[Value] = [group, to_preserves(as_pattern(pattern)), Embedded(observer)]
    opts: dict[Value, Value] = {}
    if rebalance:
        opts[_REBALANCE] = True
    if weight != 1:
        opts[_WEIGHT] = weight
    if opts:
        fields.append(Dictionary(opts))
    return Record(OBSERVE_GROUP, fields)


def parse_member_record(value: Value) -> GroupRecord:
    """Read an ``<ObserveGroup ...>`` record; :class:`GroupRecordError` says what is
    wrong with one that is not well formed."""
    if type(value) is not Record or value.label != OBSERVE_GROUP:
        raise GroupRecordError("not an <ObserveGroup GROUP PATTERN #:OBSERVER> record")
    f = value.fields
    if len(f) not in (3, 4):
        raise GroupRecordError(f"<ObserveGroup> has 3 or 4 fields, not {len(f)}")
    group = f[0]
    if type(group) is not str:
        raise GroupRecordError(f"the group's name must be a string, not {_short(group)}")
    try:
        _check_group(group)
    except ValueError as e:
        raise GroupRecordError(str(e)) from None
    try:
        pattern = from_preserves(f[1])
    except PatternError as e:
        raise GroupRecordError(f"malformed pattern: {e}") from None
    if type(f[2]) is not Embedded:
        raise GroupRecordError(f"the observer must be a reference, not {_short(f[2])}")
    weight = 1
    rebalance = False
    if len(f) == 4:
        opts = f[3]
        if type(opts) is not Dictionary:
            raise GroupRecordError(f"the options must be a dictionary, not {_short(opts)}")
        w = opts.get(_WEIGHT, 1)
        if type(w) is not int or not 1 <= w <= MAX_MEMBER_WEIGHT:
            raise GroupRecordError(f"weight must be an integer from 1 to {MAX_MEMBER_WEIGHT}, "
                                   f"not {_short(w)}")
        weight = w
        r = opts.get(_REBALANCE, False)
        if type(r) is not bool:
            raise GroupRecordError(f"rebalance must be #t or #f, not {_short(r)}")
        rebalance = r
    return GroupRecord(group, pattern, f[2].value, weight, rebalance)


def check_group_name(group: str) -> None:
    """``ValueError`` (saying why) unless ``group`` is a valid group name."""
    _check_group(group)


def _check_group(group: str) -> None:
    if not group:
        raise ValueError("a group's name must not be empty")
    if len(group.encode("utf-8", "surrogatepass")) > MAX_GROUP_NAME:
        raise ValueError(f"a group's name is at most {MAX_GROUP_NAME} bytes long")


def _short(v: Any) -> str:
    try:
        s = stringify(v)
    except Exception:  # (not a Preserves value)
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


# ---------------------------------------------------------------------------------------
# Groups on a dataspace


_ENTITY = 0
_CALLBACKS = 1

_WATCH = Bind(Rec(OBSERVE_GROUP, [DISCARD, DISCARD, DISCARD]))

_B_SEQ = b"\xb5"  # a sequence's start and end, in the binary encoding
_B_END = b"\x84"


class GroupMember:
    """A member of a group in this process, from :meth:`Groups.join`;
    :meth:`cancel` leaves the group (its jobs move to the other members)."""

    __slots__ = ("__weakref__", "facet", "group", "groups", "handle", "live", "on_assert",
                 "on_message", "on_retract", "pattern")

    def __init__(self, groups: Groups, group: str, pattern: Pattern,
                 on_assert: Callable[..., Any] | None, on_retract: Callable[..., Any] | None,
                 on_message: Callable[..., Any] | None, facet: Facet | None) -> None:
        self.groups = groups
        self.group = group
        self.pattern = pattern
        self.on_assert = on_assert
        self.on_retract = on_retract
        self.on_message = on_message
        self.facet = facet
        self.handle: Any = None
        self.live = True

    def cancel(self) -> None:
        """Leave the group (retracts the ``<ObserveGroup ...>`` record).  Nothing more
        is delivered to this member; it is not told the retraction of its jobs."""
        if not self.live:
            return
        self.live = False
        if self.handle is not None:
            self.groups.dataspace.retract(self.handle)

    def jobs(self) -> list[tuple[Any, ...]]:
        """The captures of the jobs assigned to this member now."""
        return self.groups._jobs_of(self)

    def __repr__(self) -> str:
        return f"<GroupMember {self.group!r} {self.pattern}>"


class _Member:
    """A member as a pool knows it: its observer and how to tell it."""

    __slots__ = ("count", "gone", "handles", "head", "kind", "observer", "relay")

    def __init__(self, observer: Any, kind: int) -> None:
        self.observer = observer
        self.kind = kind
        self.count = 1  # <ObserveGroup> records naming it (distinct ones)
        self.gone = False  # found dead (or cancelled) before its record went
        self.handles: dict[Hashable, int] = {}  # an entity's: job -> handle it was told
        # A relay's proxy for a peer's object (see protocol.route's sinks): its relay
        # and the start of a message to it, so that a message's captures go to it as
        # the bytes they came in as.  None for any other observer.
        self.relay: Any = None
        self.head = b""
        if kind == _ENTITY:
            relay = getattr(observer, "relay", None)
            head = getattr(observer, "msg_head", None)
            if getattr(relay, "emit_captures", None) is not None and type(head) is bytes \
                    and hasattr(relay, "closed"):
                self.relay = relay
                self.head = head

    def __repr__(self) -> str:
        return repr(self.observer)


class _Dispatcher(Entity):
    """A group's observer of its pattern, asserted as a plain ``<Observe PATTERN
    #:dispatcher>``: it hears the matches and gives each to members.

    A server routes messages on their bytes (:mod:`dataspace.protocol.route`): to the
    router the dispatcher looks like a relay's proxy (it is its own ``relay``, with an
    empty ``msg_head``), so a message reaches it as the encodings of its captures, and
    goes on to a remote member as those same bytes, spliced into the member's
    connection's output -- never decoded.  Assertions (jobs) come as an
    ``<Observe>`` entity is told them: the captures as a sequence, and a handle."""

    __slots__ = ("closed", "g", "groups", "handles", "live", "msg_head", "relay")

    def __init__(self, groups: Groups, g: _Group) -> None:
        self.groups = groups
        self.g = g
        self.handles: dict[int, Hashable] = {}  # handle told -> job
        self.live = True
        self.relay = self
        self.msg_head = b""
        self.closed = False

    @property
    def alive(self) -> bool:
        return self.live

    # -- assertions: jobs

    def on_assert(self, value: Value, handle: int) -> None:
        if self.live:
            job = key(value)
            self.handles[handle] = job
            self.groups._job_added(self.g, job, tuple(value))

    def on_retract(self, handle: int) -> None:
        job = self.handles.pop(handle, None)
        if job is not None and self.live:
            self.groups._job_removed(self.g, job)

    # -- messages, decoded or as bytes (those that entered the system here only: one
    # that came over a link or route as plain data was dispatched where it entered)

    def _here(self, n: int) -> bool:
        groups = self.groups
        if groups.wire.origin() is None:
            return True
        groups.crossed += n
        return False

    def on_message(self, value: Value) -> None:
        if self.live and self._here(1):
            self.groups._message(self.g, value, None, None, 0, False)

    def send_body(self, body: bytes) -> None:
        """A message's captures as the encoding of their sequence (queued by a router)."""
        if self.live and self._here(1):
            self.groups._message(self.g, None, body, None, 0, False)

    def emit_captures(self, head: bytes, parts: tuple[bytes, ...], size: int) -> None:
        """A message's captures as their encodings (a router delivering at once)."""
        if self.live and self._here(1):
            self.groups._message(self.g, None, None, parts, size, True)

    def emit_run(self, head: bytes, parts: list[bytes]) -> None:
        """Messages of one capture each, in order (a router delivering a run at once)."""
        if self.live and self._here(len(parts)):
            message = self.groups._message
            g = self.g
            for part in parts:
                message(g, None, None, (part,), len(part), True)

    def __repr__(self) -> str:
        return f"<group {self.g.name!r} {self.g.pattern}>"


class _Group:
    """One (group, pattern) on a dataspace: its node (the pool) and its dispatcher."""

    __slots__ = ("caps", "disp", "handle", "members", "name", "node", "pattern", "reaping",
                 "wire")

    def __init__(self, name: str, pattern: Pattern, node: Node) -> None:
        self.name = name
        self.pattern = pattern
        self.node = node
        self.members = 0  # _Members (live or gone) whose record is asserted
        self.caps: dict[Hashable, tuple[Any, ...]] = {}  # job -> its captures
        self.disp: _Dispatcher | None = None
        self.handle: Any = None  # of the dispatcher's <Observe>
        self.reaping = False  # a reap is queued (a dead member met while routing)
        self.wire: Any = None  # what the wire keeps of it (see Groups.wire)

    @property
    def pool(self) -> Pool:
        return self.node.pool


_attached: weakref.WeakValueDictionary[int, Groups] = weakref.WeakValueDictionary()


class Wire:
    """What carries a dataspace's groups to other servers: the broker's links and routes
    set one (:meth:`Groups.set_wire`, :mod:`dataspace.broker.grouplinks`).  This base is
    a server alone: its nodes are plain :class:`Node`\\ s and nothing crosses."""

    def node(self, name: str, pattern: Pattern) -> Node:
        """A node for a new (group, pattern)."""
        return Node()

    def opened(self, g: Any) -> None:
        """``g`` (a group, with the node :meth:`node` made) is new."""

    def closed(self, g: Any) -> None:
        """``g`` is gone: no member here, none behind a neighbour."""

    def changed(self, g: Any) -> None:
        """What ``g``'s node stands for changed (a member here came, went or died)."""

    def message(self, g: Any, to: Any, value: Any, body: bytes | None,
                parts: tuple[bytes, ...] | None) -> None:
        """Give a message of ``g`` to the neighbour ``to`` (its node's slot
        ``("node", to)`` was picked): its captures as a sequence (``value``), the
        encoding of that sequence (``body``) or the encodings of the captures
        (``parts``)."""

    def job(self, g: Any, what: str, to: Any, job: Hashable, caps: tuple[Any, ...]) -> None:
        """``what`` (:data:`ASSIGN` or :data:`UNASSIGN`) ``job`` (``caps``, its
        captures) to or from the neighbour ``to``."""

    def origin(self) -> Any:
        """The neighbour whose plain data is being delivered now (None: what is
        delivered now entered the system here)."""
        return None


_ALONE = Wire()


class Groups:
    """The groups of one in-process :class:`~dataspace.dataspace.Dataspace`.

    Use :meth:`Groups.of` (one per dataspace: two would each dispatch every message).
    It watches the dataspace for ``<ObserveGroup ...>`` records (with a hidden
    subscription: the watch shows up as no one's interest), and for each (group,
    pattern) that has members it observes the pattern once and shares what matches
    among them.  Members are in-process callbacks (:meth:`join`, or
    ``Dataspace.observe(..., group=NAME)``) or entities (a record asserted by anyone, a
    remote peer's reference included: told as an ``<Observe ...>`` entity is).
    Callbacks run as the dataspace's callbacks do: each in a turn of its own, in the
    facet that was current when the member joined, its exceptions logged and its
    actions discarded.
    """

    def __init__(self, dataspace: Dataspace) -> None:
        if not isinstance(dataspace, Dataspace):
            raise TypeError(
                f"groups run on an in-process Dataspace, not a {type(dataspace).__name__}; "
                "a remote client joins a group with observe(PATTERN, group=NAME), which "
                "asserts <ObserveGroup GROUP PATTERN #:observer> at the server")
        old = _attached.get(id(dataspace))
        if old is not None and old.dataspace is dataspace and old._watch is not None:
            raise RuntimeError(f"{dataspace.name}: it has its groups already; use "
                               "Groups.of(dataspace)")
        self.dataspace = dataspace
        self._groups: dict[tuple[str, Pattern], _Group] = {}
        self._members: dict[tuple[str, Pattern, int], _Member] = {}
        self.malformed = 0
        """<ObserveGroup> records ignored because they were not well formed."""
        self.crossed = 0
        """Messages matching a group's pattern that came over a link or route as plain
        data: not dispatched here (the server where each entered the system did)."""
        self.wire: Wire = _ALONE
        """What carries the groups to other servers (see :meth:`set_wire`)."""
        _attached[id(dataspace)] = self
        self._watch: Subscription | None = dataspace.observe_hidden(
            _WATCH, on_assert=self._record_added, on_retract=self._record_removed)

    @classmethod
    def of(cls, dataspace: Dataspace) -> Groups:
        """The groups of ``dataspace`` (made at the first call)."""
        g = _attached.get(id(dataspace))
        if g is not None and g.dataspace is dataspace and g._watch is not None:
            return g
        return cls(dataspace)

    @staticmethod
    def find(dataspace: Any) -> Groups | None:
        """The groups of ``dataspace`` if it has them (none are made)."""
        g = _attached.get(id(dataspace))
        if g is not None and g.dataspace is dataspace and g._watch is not None:
            return g
        return None

    def set_wire(self, wire: Wire) -> None:
        """Carry the groups to other servers through ``wire`` (before any group exists:
        a server sets it as it starts)."""
        if self._groups:
            raise RuntimeError(f"{self.dataspace.name}: set the wire before any group exists")
        self.wire = wire

    def close(self) -> None:
        """Stop: the dispatchers stop observing, members hear nothing more."""
        if self._watch is None:
            return
        self._watch.cancel()
        self._watch = None
        for g in self._groups.values():
            self._stop(g)
        for m in self._members.values():
            self._unobserving(m)
        self._groups.clear()
        self._members.clear()
        if _attached.get(id(self.dataspace)) is self:
            del _attached[id(self.dataspace)]

    # -- joining -------------------------------------------------------------------------

    def join(
        self,
        group: str,
        pattern: Pattern | str | Value,
        on_assert: Callable[..., Any] | None = None,
        on_retract: Callable[..., Any] | None = None,
        on_message: Callable[..., Any] | None = None,
        *,
        rebalance: bool = False,
    ) -> GroupMember:
        """Join ``group`` as an observer of ``pattern`` (a Pattern, concise pattern
        text, or the wire form): ``on_message(*captures)`` for the messages given to
        this member, ``on_assert(*captures)`` for each job assigned to it and
        ``on_retract(*captures)`` when that job is finished (its last holder retracted
        it) or moved away by a rebalance.  ``rebalance``: take a share of the jobs
        already assigned at once (else only new and moved work comes).

        Asserts ``<ObserveGroup group pattern #:member>`` in the current facet: the
        membership ends with :meth:`GroupMember.cancel` or when the facet stops.
        (``Dataspace.observe(pattern, ..., group=group)`` does the same and returns a
        :class:`~dataspace.dataspace.Subscription`.)
        """
        if self._watch is None:
            raise RuntimeError("these groups are closed")
        if type(group) is not str:
            raise TypeError(f"a group's name is a string, not {type(group).__name__}")
        _check_group(group)
        pat = as_pattern(pattern)
        ds = self.dataspace
        member = GroupMember(self, group, pat, on_assert, on_retract, on_message,
                             getattr(ds, "_facet", None))
        member.handle = ds.assert_(member_record(group, pat, member, rebalance=rebalance))
        return member

    def reap(self) -> int:
        """Take out every member that can no longer hear (its connection closed, or it
        was cancelled) before its record is retracted: its jobs move now.  A server
        calls this when a connection closes (its records go later, in chunks).  Returns
        how many were taken out."""
        n = 0
        for g in list(self._groups.values()):
            n += self._reap_group(g)
        if n:
            self.dataspace.flush()
        return n

    def _reap_group(self, g: _Group) -> int:
        g.reaping = False
        n = 0
        for m in g.node.members():
            if not _alive(m):
                self._dead(g, m)
                n += 1
        return n

    # -- inspection ----------------------------------------------------------------------

    def stats(self, describe: Callable[[Any], dict[str, Any]] | None = None
              ) -> list[dict[str, Any]]:
        """Each (group, pattern) that has members (here or on other servers), for
        monitoring: its members here (in join order: the observer, its weight, the
        messages given to it, the jobs it holds, whether it can still hear -- a member
        found dead is taken out when its turn comes, or by :meth:`reap`), messages
        given and dropped, jobs, jobs waiting, reassignments; across servers, its
        ``neighbours`` (each neighbouring server's stand-in: its id, the members it
        stands for as its weight, the messages and jobs given to it) and whether this
        server ``coordinates`` its jobs.  ``describe``: more fields for a member, from
        its observer (a server adds its connection)."""
        out = []
        for g in self._groups.values():
            p = g.pool
            members = []
            neighbours = []
            for slot in p.members():
                if slot[0] != MEMBER:
                    neighbours.append({"server": slot[1], "weight": p.weight(slot),
                                       "messages": p.messages_of(slot),
                                       "jobs": len(p.jobs_of(slot))})
                    continue
                m = slot[1]
                row = {"observer": repr(m.observer), "weight": p.weight(slot),
                       "messages": p.messages_of(slot), "jobs": len(p.jobs_of(slot)),
                       "alive": _alive(m)}
                if describe is not None:
                    try:
                        row.update(describe(m.observer))
                    except Exception:  # a monitor's bug must not stop the stats
                        log.exception("describing a group member failed")
                members.append(row)
            out.append({
                "group": g.name,
                "pattern": str(g.pattern),
                "members": members,
                "messages": p.messages,
                "dropped": p.dropped,
                "jobs": len(g.caps),
                "pending": len(p.pending()),
                "reassigned": p.reassigned,
                **({} if type(g.node) is Node else
                   {"neighbours": neighbours, "coordinates": g.node.coordinating}),
            })
        out.sort(key=lambda d: (d["group"], d["pattern"]))
        return out

    @staticmethod
    def dispatcher_group(observer: Any) -> str | None:
        """The group whose dispatcher ``observer`` is (the observer of its
        ``<Observe PATTERN ...>``: the inspector marks it as the server's own), or None."""
        if type(observer) is _Dispatcher:
            return observer.g.name
        return None

    def _jobs_of(self, observer: GroupMember) -> list[tuple[Any, ...]]:
        g = self._groups.get((observer.group, observer.pattern))
        m = self._members.get((observer.group, observer.pattern, id(observer)))
        if g is None or m is None:
            return []
        return [g.caps[job] for job in g.pool.jobs_of((MEMBER, m))]

    # -- the watch -----------------------------------------------------------------------

    def _record_added(self, value: Value) -> None:
        try:
            rec = parse_member_record(value)
        except GroupRecordError as e:
            self.malformed += 1
            log.warning("%s: ignoring an <ObserveGroup> record: %s", self.dataspace.name, e)
            return
        obs = rec.observer
        if isinstance(obs, Entity):
            kind = _ENTITY
        elif type(obs) is GroupMember or type(obs) is Subscription:
            home = obs.groups.dataspace if type(obs) is GroupMember else obs.ds
            if home is not self.dataspace:
                log.warning("%s: ignoring an <ObserveGroup> record: its member belongs to "
                            "another dataspace", self.dataspace.name)
                return
            kind = _CALLBACKS
        else:
            self.malformed += 1
            log.warning("%s: ignoring an <ObserveGroup> record: its observer %s is not an "
                        "entity", self.dataspace.name, _short(obs))
            return
        mk = (rec.group, rec.pattern, id(obs))
        m = self._members.get(mk)
        if m is not None:
            m.count += 1
            return
        g = self._open(rec.group, rec.pattern)
        m = self._members[mk] = _Member(obs, kind)
        g.members += 1
        self._observing(m)
        if not _alive(m):
            m.gone = True  # (dead before it joined: it never takes part)
        else:
            self._tell(g, g.node.join(m, rec.weight, rec.rebalance))
        self._start(g)
        self._settle(g)

    def _open(self, name: str, pattern: Pattern) -> _Group:
        """The group of (name, pattern), made (its node from the wire) if it is new."""
        gk = (name, pattern)
        g = self._groups.get(gk)
        if g is None:
            g = self._groups[gk] = _Group(name, pattern, self.wire.node(name, pattern))
            self.wire.opened(g)
        return g

    def _start(self, g: _Group) -> None:
        """Observe the group's pattern (once), for its dispatcher."""
        if g.disp is None:
            g.disp = _Dispatcher(self, g)
            g.handle = self.dataspace.assert_(
                Record(OBSERVE, [to_preserves(g.pattern), Embedded(g.disp)]))

    def _settle(self, g: _Group) -> None:
        """After a change: the wire tells the neighbours; a group with nothing left to do
        (no member here, none behind a neighbour) goes."""
        gk = (g.name, g.pattern)
        if self._groups.get(gk) is not g:
            return  # (gone already)
        self.wire.changed(g)
        if g.members == 0 and g.node.idle():
            del self._groups[gk]
            self._stop(g)

    def _record_removed(self, value: Value) -> None:
        try:
            rec = parse_member_record(value)
        except GroupRecordError:
            return  # (it was ignored when it came)
        mk = (rec.group, rec.pattern, id(rec.observer))
        m = self._members.get(mk)
        if m is None:
            return
        m.count -= 1
        if m.count > 0:
            return
        del self._members[mk]
        self._unobserving(m)
        g = self._groups[(rec.group, rec.pattern)]
        if not m.gone:
            self._tell(g, g.node.leave(m, tell=m.kind == _ENTITY and _alive(m)))
            m.gone = True
        g.members -= 1
        self._settle(g)

    # -- for the wire (dataspace.broker.grouplinks) ------------------------------------

    def group(self, name: str, pattern: Pattern, create: bool = False) -> _Group | None:
        """The group of (name, pattern), or None; with ``create``, made (observing its
        pattern) if it is new: a neighbour has members of it."""
        g = self._groups.get((name, pattern))
        if g is None and create and self._watch is not None:
            g = self._open(name, pattern)
            self._start(g)
        return g

    def groups(self) -> list[_Group]:
        """Every group (for the wire)."""
        return list(self._groups.values())

    def apply(self, g: _Group, effects: list[Effect], jobs: Iterable[Hashable] = ()) -> None:
        """Carry out what ``g``'s node returned (the wire called it); then forget the
        captures of those of ``jobs`` the node no longer knows, tell the neighbours, and
        end the group if it has nothing left to do."""
        self._tell(g, effects)
        for job in jobs:
            self._forget(g, job)
        self._settle(g)

    def directed_message(self, g: _Group, came_from: Any, body: bytes) -> None:
        """A neighbour gave ``g``'s node one of its messages (the encoding of its
        captures' sequence): to a member here or on to another neighbour."""
        self._message(g, None, body, None, 0, False, came_from)

    def _stop(self, g: _Group) -> None:
        d = g.disp
        if d is not None:
            d.live = False
            d.closed = True
            g.disp = None
            h, g.handle = g.handle, None
            if h is not None:
                self.dataspace.retract(h)
        self.wire.closed(g)

    def _observing(self, m: _Member) -> None:
        # A member's reference counts as an observer's: a peer whose capability is
        # attenuated sees it as opaque in the <ObserveGroup> record, as it sees the
        # observers of <Observe> records (it may count them, never send to them).
        if m.kind == _ENTITY:
            obs = self.dataspace._observing
            k = id(m.observer)
            obs[k] = obs.get(k, 0) + 1

    def _unobserving(self, m: _Member) -> None:
        if m.kind == _ENTITY:
            obs = self.dataspace._observing
            k = id(m.observer)
            n = obs.get(k, 0) - 1
            if n > 0:
                obs[k] = n
            else:
                obs.pop(k, None)

    def _dead(self, g: _Group, m: _Member) -> None:
        m.gone = True
        m.handles.clear()
        self._tell(g, g.node.leave(m, tell=False))
        self.wire.changed(g)

    # -- the dispatcher ------------------------------------------------------------------

    def _job_added(self, g: _Group, job: Hashable, caps: tuple[Any, ...]) -> None:
        g.caps[job] = caps
        self._tell(g, g.node.job_seen(job))

    def _job_removed(self, g: _Group, job: Hashable) -> None:
        self._tell(g, g.node.job_gone(job))
        self._forget(g, job)

    def _forget(self, g: _Group, job: Hashable) -> None:
        if not g.node.has(job):
            g.caps.pop(job, None)

    def _message(self, g: _Group, value: Any, body: bytes | None,
                 parts: tuple[bytes, ...] | None, size: int, direct: bool,
                 came_from: Any = None) -> None:
        """Give one message to the next live member: its captures as a sequence
        (``value``), as the encoding of that sequence (``body``) or as the encodings of
        the captures (``parts``, ``size`` bytes in all).  ``direct``: a router
        delivering at once, inside the dataspace's turn: callbacks are queued, and a
        dead member is skipped and taken out after the turn.  ``came_from``: the
        neighbour that gave it to this server (None: it entered here).  The member may
        be a neighbour's stand-in: the wire takes it there."""
        node = g.node
        for _ in range(len(node.pool) + 1):
            t = node.message(came_from)
            if t is None:
                return
            if t[0] != MEMBER:
                self.wire.message(g, t[1], value, body, parts)
                return
            m = t[1]
            relay = m.relay
            if relay is not None:
                if m.gone or relay.closed:
                    self._found_dead(g, m, direct)
                    continue
                if parts is not None:
                    relay.emit_captures(m.head, parts, size)
                elif body is not None:
                    m.observer.send_body(body)
                else:
                    m.observer.on_message(value)
                return
            if not _alive(m):
                self._found_dead(g, m, direct)
                continue
            if value is None:
                if body is None:
                    assert parts is not None
                    body = b"".join((_B_SEQ, *parts, _B_END))
                value = decode(body)
            ob = m.observer
            if m.kind == _ENTITY:
                if direct:
                    self.dataspace._queue.append(("x", (ob.on_message,), (value,)))
                else:
                    self._run(ob.on_message, (value,), None)
            elif ob.on_message is not None:
                if direct:
                    self.dataspace._queue.append(
                        ("x", (self._run,), (ob.on_message, tuple(value), ob.facet)))
                else:
                    self._run(ob.on_message, tuple(value), ob.facet)
            return

    def _found_dead(self, g: _Group, m: _Member, direct: bool) -> None:
        if not direct:
            self._dead(g, m)
        elif not g.reaping:  # (inside the turn: its jobs move once it is applied)
            g.reaping = True
            self.dataspace._queue.append(("x", (self._reap_group,), (g,)))

    def _tell(self, g: _Group, effects: list[Effect]) -> None:
        for what, (kind, m), job in effects:
            if kind != MEMBER:  # a neighbour's stand-in
                self.wire.job(g, what, m, job, g.caps[job])
                continue
            if m.gone:
                continue  # (found dead while these were told: its jobs moved then)
            if not _alive(m):
                if what == ASSIGN:
                    self._dead(g, m)  # its jobs, this one included, move now
                continue
            ob = m.observer
            caps = g.caps[job]
            if what == ASSIGN:
                if m.kind == _ENTITY:
                    h = fresh_handle()
                    m.handles[job] = h
                    if m.relay is not None:  # (a peer's: queued on its connection)
                        ob.on_assert(Sequence(caps), h)
                    else:
                        self._run(ob.on_assert, (Sequence(caps), h), None)
                elif ob.on_assert is not None:
                    self._run(ob.on_assert, caps, ob.facet)
            elif m.kind == _ENTITY:
                h = m.handles.pop(job, None)
                if h is not None:
                    if m.relay is not None:
                        ob.on_retract(h)
                    else:
                        self._run(ob.on_retract, (h,), None)
            elif ob.on_retract is not None:
                self._run(ob.on_retract, caps, ob.facet)

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], facet: Facet | None) -> None:
        # A callback's own turn, in its facet, its failure logged and its actions
        # discarded: as the dataspace runs an observer's callbacks.
        self.dataspace._run_callback(fn, args, facet)

    def __repr__(self) -> str:
        return f"<Groups of {self.dataspace.name}: {len(self._groups)} pools>"


def _alive(m: _Member) -> bool:
    if m.gone:
        return False
    ob = m.observer
    if m.kind == _ENTITY:
        return getattr(ob, "alive", True) is not False
    return bool(ob.live)


def subscribe_group(ds: Any, pattern: Pattern | str | Value, on_assert: Any, on_retract: Any,
                    on_message: Any, group: Any, rebalance: bool) -> Any:
    """``ds.observe(pattern, ..., group=group)`` for an in-process or a remote
    dataspace: a subscription of that dataspace's kind whose observer joins ``group`` by
    ``<ObserveGroup group PATTERN #:observer>`` (in the current facet; ``cancel()``
    leaves).  An in-process dataspace gets its :class:`Groups` here."""
    if type(group) is not str:
        raise TypeError(f"a group's name is a string, not {type(group).__name__}")
    _check_group(group)
    if type(rebalance) is not bool:
        raise TypeError(f"rebalance is True or False, not {rebalance!r}")
    pat = as_pattern(pattern)
    if isinstance(ds, Dataspace):
        Groups.of(ds)
    sub = ds._new_subscription(pat, on_assert, on_retract, on_message)
    facet = ds._facet
    if facet is not None:
        facet.subscriptions.add(sub)
    sub.handle = ds.assert_(member_record(group, pat, ds._observer_of(sub),
                                          rebalance=rebalance))
    return sub
