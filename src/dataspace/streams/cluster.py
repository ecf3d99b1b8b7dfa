"""Recording in a cluster: each message once, assertion events once (docs/cluster.md,
"Recording in a cluster").

Every member of a cluster sees every value (one hop), so recorders that each recorded
what they saw would record each message once per member.  Here:

* **Messages are recorded by their origin**: the member where a message enters the
  cluster (its client's, or its link's) records it; a member records a message that came
  over a route only when the member at the other end does not record that stream into
  this store, and then only if it *leads* the stream in this store (below).  So members
  recording into one store record each message once between them, and a member whose
  store is its own records everything it sees (no other member records there).  A
  client's ``sync()`` waits for its own member's recorder: acknowledged means committed,
  whichever member the client is on.
* **Assertion events, and the messages of members that do not record the stream here,
  are recorded by the stream's leader** in this store: one member at a time, chosen by
  the store's own lock ``cluster:NAME:stream:STREAM`` (PostgreSQL's session advisory
  lock, SQLite's file lock: released when the holder dies).  A member contends only
  once its view of the cluster is settled (its routes up and their subscriptions
  answered).  Every commit of the leader's events checks, in the same transaction, that
  its fence (its entry in ``__presence/STREAM``) is still the last one: a member that lost
  the lock without noticing (a network cut from the database) is refused, never writes
  twice.  A new leader reconciles first: from the last checkpoint of presence in
  ``__presence/STREAM`` and the events after it, it writes a ``<retract V>`` for each
  value the stream says is present and is not, an ``<assert V>`` for each that is.
* **Who records what into this store** is told by locks too: each recording member holds
  ``cluster:NAME:member:ID`` for its life, and declares the streams it records in
  ``__cluster/NAME`` (``<records ID [STREAM ...]>``), both before any of its routes comes
  up.  A member looks, for each route, whether the member at its other end holds that
  lock: while it does, its messages are its own to record; a member whose lock is free
  while its route stays up for the keepalive's dead time does not record here (a store of
  its own, or no recorder), and this store's leader records its messages.  What is not
  known yet is recorded by nobody here (never twice).

This module does the choosing (a thread, blocking store calls there) and tells the
recorders (:class:`~dataspace.streams.recorder.Recorder`'s ``origin``, ``peer_records``,
``leader_only``, :meth:`~dataspace.streams.recorder.Recorder.lead`).  It reads the
server's link hub and cluster through a few attributes only (``route_peer``, the route
sessions, the membership), on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..pattern import to_preserves
from ..values import Record, Symbol, encode
from .base import LockHeld, Store, StoreError, StoreLock
from .recorder import Recorder

__all__ = ["GRACE", "ClusterRecording", "members_stream", "recording_summary"]

log = logging.getLogger(__name__)

GRACE = 2.0
"""Seconds after its cluster starts before a member contends for the lead of a stream
(its routes are dialed and answered by then; it also waits for them to settle)."""
POLL = 0.25
"""Seconds between two looks at the locks and the routes."""
STATUS_EVERY = 2.0
"""Seconds between two looks at which members record into this store."""
_RECORDS = Symbol("records")
MEMBER_LOCK_WAIT = 10.0
"""Seconds a starting member waits for its member lock (held by its previous life, which
the database may notice gone a moment after a kill -9)."""


def members_stream(cluster: str) -> str:
    """The store's own stream where recording members of ``cluster`` declare streams."""
    return f"__cluster/{cluster}"


def member_lock(cluster: str, member: str) -> str:
    return f"cluster:{cluster}:member:{member}"


def stream_lock(cluster: str, stream: str) -> str:
    return f"cluster:{cluster}:stream:{stream}"


class _Peer:
    """What is known of the member at the other end of one route."""

    __slots__ = ("free_since", "id", "records")

    def __init__(self, peer_id: str) -> None:
        self.id = peer_id
        self.records: dict[str, bool] = {}
        """Per stream: True, it records the stream into this store (for the life of the
        route); False, it does not."""
        self.free_since: float | None = None
        """When its lock was first seen free (it is taken not to record here once its
        route has stayed up for the dead time after that)."""


class ClusterRecording:
    """The recorders of one member of a cluster (see the module docstring).

    * ``store`` -- the store they record into;
    * ``recorders`` -- the member's recorders (of its root dataspace: the cluster's);
    * ``member`` -- this member's id; ``cluster`` -- the cluster's name;
    * ``hub`` -- a callable giving the root dataspace's link hub (``route_peer`` and
      ``sessions``), read on the event loop;
    * ``members`` -- a callable giving ``{peer id: up}`` of the members known;
    * ``dead`` -- the routes' keepalive (seconds): a member whose lock is free this long
      while its route is up does not record here.
    """

    def __init__(self, store: Store, recorders: Iterable[Recorder], *, member: str,
                 cluster: str, hub: Callable[[], Any], members: Callable[[], dict[str, bool]],
                 dead: float = 3.0, grace: float = GRACE,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.store = store
        self.recorders = list(recorders)
        self.member = member
        self.cluster = cluster
        self._hub = hub
        self._members = members
        self.dead = dead
        self.grace = grace
        self.loop = loop
        self._peers: dict[Any, _Peer] = {}  # route session -> what its peer does
        self._routes: tuple[tuple[Any, str, bool], ...] = ()  # (session, peer, open)
        self._exempt: dict[str, Any] = {}  # stream -> its pattern, exempt from routes
        self._settled_since: float | None = None
        self._started = time.monotonic()
        self._locks: dict[str, StoreLock] = {}  # stream -> the lock of its lead
        self._member_lock: StoreLock | None = None
        self._lost: set[str] = set()
        self._sharing: dict[str, bool] = {}  # member id -> records into this store
        self._sharing_at = 0.0
        self._leaders: dict[str, str | None] = {}  # stream -> the member leading it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.error: str | None = None
        for r in self.recorders:
            self.attach(r)

    # -- wiring -------------------------------------------------------------------------

    def attach(self, rec: Recorder) -> None:
        """Make ``rec`` record as a member of the cluster (before it sees anything)."""
        rec.origin = self._origin
        rec.peer_records = self._peer_records(rec.stream)
        rec.leader_only = True
        rec.on_lost = lambda why, s=rec.stream: self._lost.add(s)

    def _origin(self) -> Any:
        hub = self._hub()
        return hub.route_peer if hub is not None else None

    def _peer_records(self, stream: str) -> Callable[[Any], bool | None]:
        peers = self._peers

        def records(route: Any) -> bool | None:
            p = peers.get(route)
            return None if p is None else p.records.get(stream)

        return records

    def declare(self) -> None:
        """Declare the streams this member records and take its member lock (call
        before any route is up: the others read them when its routes come up)."""
        name = members_stream(self.cluster)
        streams = sorted({r.stream for r in self.recorders})
        with self.store.transaction() as tx:
            tx.create_stream(name, max_count=1000)
            tx.append_encoded(name, [encode(Record(_RECORDS, [self.member, tuple(streams)]))])
        name = member_lock(self.cluster, self.member)
        deadline = time.monotonic() + MEMBER_LOCK_WAIT
        while True:
            try:
                self._member_lock = self.store.lock(name, note=f"member {self.member}")
                return
            except LockHeld as e:
                # (This member killed a moment ago: the database may not have noticed yet
                # that its old session is gone.)
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"another process records as member {self.member} of cluster "
                        f"{self.cluster} into {self.store.display} ({e}): is the data "
                        "directory (its server.id) copied from another member?") from None
                time.sleep(0.1)

    # -- running --------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start looking (on the running loop: the routes; in a thread: the store)."""
        self.loop = loop or self.loop or asyncio.get_running_loop()
        self._started = time.monotonic()
        self._look()
        self._thread = threading.Thread(target=self._run, name="cluster-recording",
                                        daemon=True)
        self._thread.start()

    def _look(self) -> None:
        """On the event loop: the routes and whether the view is settled."""
        self._timer = None
        hub = self._hub()
        now = time.monotonic()
        routes = []
        settled = True
        if hub is not None:
            for s in list(hub.sessions):
                if getattr(s, "route", False):
                    routes.append((s, s.peer_id, s.ready and not s.closed))
                    if s.ready and not s.closed and not s.settled:
                        settled = False
        self._routes = tuple(routes)
        if hub is not None and hasattr(hub, "exempt_from_routes"):
            self._ask_routes(hub)
        if settled and now - self._started >= self.grace:
            if self._settled_since is None:
                self._settled_since = now
        else:
            self._settled_since = None
        if not self._stop.is_set() and self.loop is not None:
            self._timer = self.loop.call_later(POLL, self._look)

    def _ask_routes(self, hub: Any) -> None:
        """Whether routes are asked for each stream's pattern: a member needs what comes
        over routes for a stream with assertion events (its leader needs the cluster's
        view, and any member may become its leader), or while it leads a stream that a
        member up does not record here (it records that one's messages).  Otherwise the
        routes carry nothing for the recorder: each member records its own."""
        peers = list(self._peers.values())
        for r in self.recorders:
            needs = ("assert" in r.events or "retract" in r.events or (
                r.leading and any(p.records.get(r.stream) is False for p in peers)))
            exempt = r.stream in self._exempt
            if needs and exempt:
                hub.exempt_from_routes(self._exempt.pop(r.stream), -1)
            elif not needs and not exempt and r.subscription is not None:
                pattern = to_preserves(r.subscription.pattern)
                self._exempt[r.stream] = pattern
                hub.exempt_from_routes(pattern, +1)

    def _run(self) -> None:
        while not self._stop.wait(POLL):
            try:
                self._step(time.monotonic())
                self.error = None
            except Exception as e:  # the store is down: try again, say it once
                if self.error != str(e):
                    log.warning("recording in the cluster: %s (trying again)", e)
                self.error = str(e)

    def _step(self, now: float) -> None:
        # Leads lost to another member (their fence moved), and those of recorders the
        # store failed (they record no more; another member may): give the lock back.
        for r in self.recorders:
            if r.failed is not None and r.stream in self._locks:
                self._lost.add(r.stream)
        while self._lost:
            stream = self._lost.pop()
            lk = self._locks.pop(stream, None)
            if lk is not None:
                lk.release()
        self._look_at_peers(now)
        if self._settled_since is not None:
            for r in self.recorders:
                if r.failed is None and r.stream not in self._locks:
                    self._contend(r)
        if now - self._sharing_at >= STATUS_EVERY:
            self._sharing_at = now
            self._look_at_sharing()

    def _contend(self, rec: Recorder) -> None:
        name = stream_lock(self.cluster, rec.stream)
        if self.store.lock_holder(name) is not None:
            return
        try:
            lk = self.store.lock(name, note=f"member {self.member}")
        except LockHeld:
            return
        self._locks[rec.stream] = lk
        rec.lead(self.member)
        log.info("recording in the cluster: this member leads stream %s in %s", rec.stream,
                 self.store.display)

    def _look_at_peers(self, now: float) -> None:
        routes = self._routes
        live = {s for s, _p, _o in routes}
        for s in list(self._peers):
            if s not in live:
                del self._peers[s]
        streams = {r.stream for r in self.recorders}
        for s, peer_id, open_ in routes:
            if not open_:
                continue
            p = self._peers.get(s)
            if p is None:
                p = self._peers[s] = _Peer(peer_id)
            if len(p.records) == len(streams):
                continue  # known for the life of the route
            holder = self.store.lock_holder(member_lock(self.cluster, peer_id))
            if holder is not None:
                declared = self._declared(peer_id)
                p.free_since = None
                p.records = {st: st in declared for st in streams}
                continue
            if p.free_since is None:
                p.free_since = now
            elif now - p.free_since >= self.dead and any(
                    x is s and o for x, _p, o in self._routes):
                # Free, while its route stayed up: alive, and not recording here.
                p.records = dict.fromkeys(streams, False)
                log.info("recording in the cluster: member %s does not record into %s; "
                         "this store's leaders record its messages", peer_id,
                         self.store.display)

    def _declared(self, peer_id: str) -> set[str]:
        for e in self.store.last(members_stream(self.cluster), limit=1000):
            v = e.value
            if (type(v) is Record and v.label == _RECORDS and len(v.fields) == 2
                    and v.fields[0] == peer_id and isinstance(v.fields[1], tuple)):
                return {x for x in v.fields[1] if isinstance(x, str)}
        return set()

    def _look_at_sharing(self) -> None:
        sharing = {}
        for peer_id, up in self._members().items():
            if peer_id and up:  # (a member that is down records nothing anywhere)
                sharing[peer_id] = self.store.lock_holder(
                    member_lock(self.cluster, peer_id)) is not None
        self._sharing = sharing
        leaders = {}
        for r in self.recorders:
            holder = self.store.lock_holder(stream_lock(self.cluster, r.stream)) or ""
            m = re.search(r"member ([0-9a-zA-Z_.-]+)", holder)
            leaders[r.stream] = m.group(1) if m else None
        self._leaders = leaders

    def stop(self) -> None:
        """Stop contending (then stop the recorders, which commit what they queued, then
        :meth:`release`)."""
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        t = self._thread
        if t is not None:
            t.join(5.0)

    def release(self) -> None:
        """Give up the leads and the member lock (after the recorders have stopped)."""
        for lk in self._locks.values():
            with contextlib.suppress(Exception):
                lk.release()
        self._locks.clear()
        if self._member_lock is not None:
            with contextlib.suppress(Exception):
                self._member_lock.release()
            self._member_lock = None

    # -- status ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``{"recording": {...}}`` for the cluster's status (``cluster status``, the
        inspector): the store, each stream (led here or not, recorded, skipped), which
        members record into this store, and the rule in one line."""
        sharing = dict(self._sharing)
        shared = sorted(m for m, yes in sharing.items() if yes)
        streams = []
        for r in self.recorders:
            lead = self.member if r.leading else self._leaders.get(r.stream)
            streams.append({
                "stream": r.stream, "leader": r.leading, "led_by": lead,
                "recorded": r.recorded,
                "skipped": r.skipped, "discarded": r.discarded, "takeovers": r.takeovers,
                "events": list(r.events),
            })
        doc = {
            "store": self.store.display, "streams": streams, "shared_with": shared,
            "members_elsewhere": sorted(m for m, yes in sharing.items() if not yes),
            "summary": recording_summary(self.store.display, len(shared), len(sharing)),
        }
        if self.error:
            doc["error"] = self.error
        return {"recording": doc}


def recording_summary(store: str, shared: int, others: int) -> str:
    """One line: what this member's streams hold, given how many of the ``others``
    members record into the same store."""
    if others == 0:
        return (f"recording into {store}: no other member is up; each message is recorded "
                "once, by the member it enters the cluster through")
    if shared == others:
        return (f"recording into {store}, shared with every other member: one stream for "
                "the cluster, each message once")
    if shared == 0:
        return (f"recording into {store}, a store of its own: it holds every message this "
                "member sees; for one stream of the cluster give every member the same "
                "store (PostgreSQL, or one SQLite file on one machine)")
    return (f"recording into {store}, shared with {shared} of {others} other members: each "
            "message once; this store's leader records the others' messages as it sees "
            "them")
