"""Groups of observers across links and a cluster: one dataspace's groups
(:mod:`dataspace.groups`) carried over its link hub's sessions -- routes and links --
by the rules of :mod:`dataspace.protocol.groups` (docs/broker.md, "Sharing work").

Each (group, pattern) that has members anywhere in the connected system has, on every
server, a :class:`~dataspace.protocol.groups.GroupNode` (one per dataspace, group and
pattern): its neighbours are the hub's sessions that are up, each with the rank its
handshake gave (a route's: the member's incarnation; a link's: what the peer said).
What crosses a session for groups, beside the link protocol's own:

``control``  ``<group-rank [LEAF SINCE SERVER]>``, once as a link comes up: the
             sender's rank (a route's comes with its handshake: the member's
             incarnation);
             ``<group-weight ID GROUP PATTERN WEIGHT [LEAF SINCE SERVER]>``: how many
             members are behind the sender for the receiver's traffic, and the best rank
             on the sender's side (:meth:`GroupNode.announcement`); ``ID`` names the
             group on the sender, for what the receiver directs to it.  Sent when it
             changes; a group with no member anywhere announces weight 0 and is
             forgotten.
``data``     ``<group-message ID [CAPTURE ...]>``: a message given to the receiver's
             stand-in (``ID`` the receiver's), picked again there; and, asserted,
             ``<group-job ID [CAPTURE ...]>``: a job the sender assigned to the
             receiver's stand-in, retracted when it takes it back -- or by the
             connection closing.

Messages that cross a session as plain data (for plain observers) are never dispatched
to groups again: the link hub marks what it delivers with its session
(:attr:`~dataspace.broker.link.LinkHub.peer`), and a group's dispatcher ignores what a
session delivers (:meth:`GroupLinks.origin`).  Only the coordinator's dispatcher asks
the neighbours for the group's pattern (it must see every job held anywhere); the
others' interest is exempt from the sessions, so they are sent no plain copies for the
group.  ``<ObserveGroup>`` records never cross.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from ..dataspace import fresh_handle
from ..groups import ASSIGN, MAX_WEIGHT, Groups, Node, Wire, check_group_name
from ..pattern import Pattern, PatternError, from_preserves, to_preserves
from ..protocol.groups import LINK, ROUTE, GroupNode, Rank
from ..values import Record, Sequence, Symbol, Value, decode, encode, key

if TYPE_CHECKING:
    from .link import LinkHub, LinkSession

__all__ = ["GROUP_JOB", "GROUP_MESSAGE", "GROUP_RANK", "GROUP_WEIGHT", "GroupLinks",
           "directed_at", "group_messages_in", "parse_rank", "rank_value"]

log = logging.getLogger(__name__)

GROUP_WEIGHT = Symbol("group-weight")
GROUP_RANK = Symbol("group-rank")
GROUP_MESSAGE = Symbol("group-message")
GROUP_JOB = Symbol("group-job")
GROUP_MESSAGE_LABEL = encode(GROUP_MESSAGE)
"""The label of a directed message as it is encoded (the data path looks for it in runs
of messages it does not decode)."""
_GM_HEAD = b"\xb4" + GROUP_MESSAGE_LABEL
_B_SEQ = b"\xb5"
_B_END = b"\x84"


def rank_value(r: Rank) -> Value:
    """A rank on the wire: ``[LEAF SINCE SERVER]``."""
    return Sequence([r.leaf, float(r.since), r.node])


def parse_rank(v: Any) -> Rank:
    """A rank from the wire (``ValueError`` says what is wrong)."""
    if (type(v) is not Sequence or len(v) != 3 or type(v[0]) is not bool
            or type(v[1]) is not float or type(v[2]) is not str or not v[2]):
        raise ValueError("a rank is [LEAF SINCE SERVER] (a boolean, a double, a string)")
    return Rank(v[0], v[1], v[2])


class _Wired:
    """What the wire keeps of one group."""

    __slots__ = ("exempt", "id", "pattern", "peer_ids")

    def __init__(self, gid: int, pattern: Value) -> None:
        self.id = gid
        self.pattern = pattern  # (its wire form, for announcements and interest)
        self.peer_ids: dict[str, int] = {}  # neighbour -> its ID for this group
        self.exempt = False  # its dispatcher's interest kept off the sessions


class GroupLinks(Wire):
    """The groups of one link hub's dataspace, across its sessions (module docstring).
    ``rank``: this server's (:class:`~dataspace.protocol.groups.Rank`)."""

    def __init__(self, hub: LinkHub, groups: Groups, rank: Rank) -> None:
        self.hub = hub
        self.groups = groups
        self.rank = rank
        self.sessions: dict[str, LinkSession] = {}
        """The sessions that are up, by their peer's id: the nodes' neighbours."""
        self._ids: dict[int, Any] = {}  # this server's IDs of its groups
        self._next_id = 0
        self._out: dict[str, dict[tuple[int, Hashable], int]] = {}
        """Per neighbour, (group ID, job) -> the handle of the job asserted there."""
        self._in: dict[LinkSession, dict[int, tuple[Any, Hashable]]] = {}
        """Per session, the handles of jobs it directed here -> (group, job)."""
        self._early: dict[LinkSession, dict[tuple[str, Pattern], tuple[int, int, Rank]]] = {}
        """Announcements from a link not yet up on this side (its peer decided first)."""
        self.unknown = 0
        """Directed messages and jobs for a group this server no longer has (its last
        member went while they crossed): dropped."""
        self.on_change: list[Any] = []
        """Called after each change of a group's node (for tests and monitors)."""
        groups.set_wire(self)

    # -- what Groups calls ----------------------------------------------------------------

    def node(self, name: str, pattern: Pattern) -> Node:
        n = GroupNode(self.rank)
        for nid, s in self.sessions.items():
            n.neighbour_up(nid, ROUTE if s.route else LINK, s.peer_rank)
        return n

    def opened(self, g: Any) -> None:
        self._next_id += 1
        g.wire = _Wired(self._next_id, to_preserves(g.pattern))
        self._ids[self._next_id] = g
        self._interest(g)  # (before its dispatcher observes: no interest comes and goes)

    def _interest(self, g: Any) -> None:
        """Only the coordinator's dispatcher asks the neighbours for the group's pattern:
        it must see every job held anywhere; the others need no plain copies (a message
        is given to the group where it enters, and directed on), so theirs is exempt
        from the sessions (:meth:`LinkHub.exempt_from_sessions`) -- a message crossing
        to a member costs one directed copy, not one plain copy per server.  A server
        that takes over as coordinator asks then, and is sent what is held."""
        w = g.wire
        exempt = not g.node.coordinating
        if exempt != w.exempt:
            w.exempt = exempt
            self.hub.exempt_from_sessions(w.pattern, 1 if exempt else -1)

    def closed(self, g: Any) -> None:
        w = g.wire
        if w is None:
            return
        if w.exempt:
            w.exempt = False
            self.hub.exempt_from_sessions(w.pattern, -1)
        g.wire = None
        self._ids.pop(w.id, None)
        for nid, out in self._out.items():
            for k in [k for k in out if k[0] == w.id]:
                h = out.pop(k)
                s = self.sessions.get(nid)
                if s is not None:
                    s.data_out.on_retract(h)

    def changed(self, g: Any) -> None:
        w = g.wire
        if w is None:
            return
        self._interest(g)
        for nid, weight, rank in g.node.take_announcements():
            s = self.sessions.get(nid)
            if s is not None:
                s.send_control(Record(GROUP_WEIGHT, [w.id, g.name, w.pattern, weight,
                                                     rank_value(rank)]))
        for fn in self.on_change:
            try:
                fn()
            except Exception:  # pragma: no cover - a monitor's bug must not break groups
                log.exception("group change callback failed")

    def message(self, g: Any, to: Any, value: Any, body: bytes | None,
                parts: tuple[bytes, ...] | None) -> None:
        s = self.sessions.get(to)
        w = g.wire
        pid = w.peer_ids.get(to) if w is not None else None
        if s is None or pid is None:
            self.unknown += 1
            return
        out = s.data_out
        if value is not None:  # (decoded: may hold references, which the relay carries)
            out.on_message(Record(GROUP_MESSAGE, [pid, value]))
            return
        caps = body if body is not None else b"".join((_B_SEQ, *(parts or ()), _B_END))
        msg = b"".join((_GM_HEAD, encode(pid), caps, _B_END))
        send = getattr(out, "send_bodies", None)
        if send is not None:
            send([msg])
        else:  # (a peer's entity that takes values only: tests' in-memory links)
            out.on_message(decode(msg))

    def job(self, g: Any, what: str, to: Any, job: Hashable, caps: tuple[Any, ...]) -> None:
        s = self.sessions.get(to)
        w = g.wire
        if w is None:
            return
        out = self._out.setdefault(to, {})
        k = (w.id, job)
        if what == ASSIGN:
            pid = w.peer_ids.get(to)
            if s is None or pid is None:  # (a stand-in is a neighbour that announced)
                return
            h = fresh_handle()
            out[k] = h
            s.data_out.on_assert(Record(GROUP_JOB, [pid, Sequence(caps)]), h)
        else:
            h = out.pop(k, None)
            if h is not None and s is not None:
                s.data_out.on_retract(h)

    def origin(self) -> Any:
        return self.hub.peer

    # -- what the link hub calls -------------------------------------------------------------

    def session_up(self, s: LinkSession) -> None:
        """``s`` is up (data crosses it): every group gets a neighbour."""
        nid = s.peer_id
        old = self.sessions.get(nid)
        if old is not None and old is not s:
            self.session_down(old)
        self.sessions[nid] = s
        kind = ROUTE if s.route else LINK
        for g in self.groups.groups():
            self.groups.apply(g, g.node.neighbour_up(nid, kind, s.peer_rank))
        for (name, pattern), (gid, weight, rank) in self._early.pop(s, {}).items():
            self._announced(s, name, pattern, gid, weight, rank)

    def session_down(self, s: LinkSession) -> None:
        """``s`` ended: what it directed here goes, what was directed to it moves."""
        self._early.pop(s, None)
        nid = s.peer_id
        if self.sessions.get(nid) is not s:
            return
        del self.sessions[nid]
        came = self._in.pop(s, {})
        out = self._out.pop(nid, {})
        for h in out.values():  # (a closed connection drops these: it retracted them)
            s.data_out.on_retract(h)
        for g in self.groups.groups():
            if g.wire is not None:
                g.wire.peer_ids.pop(nid, None)
            jobs = [job for gg, job in came.values() if gg is g]
            self.groups.apply(g, g.node.neighbour_down(nid), jobs)

    def control(self, s: LinkSession, v: Record) -> None:
        """A ``<group-weight ...>`` from ``s``'s peer (``ValueError``: malformed)."""
        f = v.fields
        if len(f) != 5:
            raise ValueError("<group-weight ID GROUP PATTERN WEIGHT RANK> has 5 fields")
        gid, name, pat, weight, rank_v = f
        if type(gid) is not int or gid < 0:
            raise ValueError("a group's ID is a non-negative integer")
        if type(name) is not str:
            raise ValueError("a group's name is a string")
        check_group_name(name)
        try:
            pattern = from_preserves(pat)
        except PatternError as e:
            raise ValueError(f"malformed pattern: {e}") from None
        if type(weight) is not int or not 0 <= weight <= MAX_WEIGHT:
            raise ValueError(f"a weight is an integer from 0 to {MAX_WEIGHT}")
        rank = parse_rank(rank_v)
        if self.sessions.get(s.peer_id) is not s:  # not up on this side yet
            self._early.setdefault(s, {})[(name, pattern)] = (gid, weight, rank)
            return
        self._announced(s, name, pattern, gid, weight, rank)

    def _announced(self, s: LinkSession, name: str, pattern: Pattern, gid: int, weight: int,
                   rank: Rank) -> None:
        g = self.groups.group(name, pattern, create=weight > 0)
        if g is None or g.wire is None:
            return
        nid = s.peer_id
        g.wire.peer_ids[nid] = gid
        self.groups.apply(g, g.node.announced(nid, weight, rank))

    def message_in(self, s: LinkSession, gid: Any, body: bytes | None = None,
                   value: Any = None) -> None:
        """A ``<group-message ID CAPTURES>`` from ``s``: ``body`` the encoding of the
        captures' sequence (or ``value``, the sequence decoded)."""
        g = self._ids.get(gid) if type(gid) is int else None
        if g is None or self.sessions.get(s.peer_id) is not s:
            self.unknown += 1
            return
        if body is not None:
            self.groups.directed_message(g, s.peer_id, body)
        elif type(value) is Sequence:
            self.groups._message(g, value, None, None, 0, False, s.peer_id)

    def message_value(self, s: LinkSession, v: Record) -> None:
        """A ``<group-message ...>`` that came decoded."""
        if len(v.fields) == 2:
            self.message_in(s, v.fields[0], value=v.fields[1])
        else:
            self.unknown += 1

    def job_in(self, s: LinkSession, v: Record, handle: int) -> None:
        """A ``<group-job ID CAPTURES>`` asserted by ``s``'s peer."""
        f = v.fields
        g = self._ids.get(f[0]) if len(f) == 2 and type(f[0]) is int else None
        if g is None or type(f[1]) is not Sequence or self.sessions.get(s.peer_id) is not s:
            self.unknown += 1
            return  # (its retraction is ignored too)
        caps = f[1]
        job = key(caps)
        self._in.setdefault(s, {})[handle] = (g, job)
        g.caps.setdefault(job, tuple(caps))
        self.groups.apply(g, g.node.job_directed(s.peer_id, job))

    def job_out(self, s: LinkSession, handle: int) -> None:
        """``s``'s peer retracted the job it directed here under ``handle``."""
        d = self._in.get(s)
        r = d.pop(handle, None) if d else None
        if r is None:
            return
        g, job = r
        if g.wire is not None:  # (still this server's group)
            self.groups.apply(g, g.node.job_undirected(s.peer_id, job), (job,))

    def status(self) -> dict[str, Any]:
        """For tests and monitors: this server's rank, neighbours and dropped traffic."""
        return {"rank": rank_value(self.rank), "neighbours": sorted(self.sessions),
                "groups": len(self._ids), "unknown": self.unknown}


def group_messages_in(buf: bytes, msgs: list[list[int]]) -> bool:
    """Whether a run of encoded messages (:class:`~dataspace.dataspace.Encoded`'s
    ``buf`` and ``msgs``) may hold a directed message: its label occurs in their bytes."""
    last = msgs[-1]
    return buf.find(GROUP_MESSAGE_LABEL, msgs[0][0], last[0] + last[-1]) >= 0


def directed_at(buf: bytes, m: list[int]) -> tuple[Any, bytes] | None:
    """(ID, the encoding of the captures' sequence) of the message at ``m`` (its offsets
    in ``buf``, as :class:`~dataspace.dataspace.Encoded` keeps them) if it is a
    ``<group-message ID [CAPTURE ...]>``, else None."""
    s = m[0]
    if (len(m) != 6 or buf[s] != 0xB4
            or buf[s + m[1]:s + m[2]] != GROUP_MESSAGE_LABEL or buf[s + m[3]] != 0xB5):
        return None
    return decode(buf[s + m[2]:s + m[3]]), buf[s + m[3]:s + m[4]]
