"""Scry: remote readers follow streams by path (seed 004), as sans-IO machines.

No sockets, no clocks (``now`` comes in), no store: the host moves datagrams, reads
entries when the publisher asks (:meth:`Publisher.take_loads`) and reports appends.

**Paths and datagrams.**  ``/chat/34`` is entry 34 of stream ``chat``.  Every datagram is
one binary Preserves record::

    reader -> publisher
      <scry-get STREAM INDEX FRAG>       fragment FRAG of entry INDEX (0: the first)
      <scry-head STREAM>                 where does the stream end?
    publisher -> reader
      <scry-frag STREAM INDEX FRAG TOTAL HASH NEXT DATA WAITING>
                                         DATA: bytes FRAG*FRAGMENT.. of the entry's
                                         encoded value, TOTAL fragments in all, HASH the
                                         BLAKE2b-128 of the whole entry (checked when it is
                                         reassembled), NEXT the stream's next index;
                                         WAITING: in a broadcast, the index the reader is
                                         now remembered for (else #f)
      <scry-wait STREAM INDEX>           INDEX does not exist yet: the reader is remembered
                                         and will be sent its first fragment when it does
      <scry-head STREAM NEXT FIRST>      NEXT: the next index; FIRST: the oldest kept
      <scry-gone STREAM INDEX FIRST>     retention removed INDEX; FIRST is the oldest kept
      <scry-error STREAM MESSAGE>        e.g. the stream is not published

**The publisher** (:class:`Publisher`) answers a request for an existing entry from a
cache of recent entries' fragments (loading the entry once, through the host, on a
miss).  A request for an entry that does not exist yet is *premature*: the publisher
knows each published stream's end from the host (which follows the store's own
wake-ups), so it drops a premature request without touching the store -- the first one
included, which is the "better rule" than the seed's "subscribe after the second
premature request": with one end per stream there is nothing per path to subscribe to.
It remembers who asked, in memory only (the *shield table*: path -> requesters, bounded
in paths, requesters and age), and says so in a small ``<scry-wait>``.  When the entry
appears, it loads it once and *broadcasts* its first fragment to every requester at
once, then again after 33 ms and after 1 s (optimistic broadcast: unacknowledged; a
reader that missed all three still polls), and carries those requesters over to the
next path -- a reader that just got entry 34 will ask for 35 -- so a following reader
sends no request per entry at all while broadcasts reach it.  A requester is still
forgotten when it has not asked for ``shield_age`` seconds: readers poll at least every
30 s, so only gone readers are.  Requests further than ``ahead`` entries into the future
are not remembered (answered with the stream's end, from memory), so a flood of requests
for future paths cannot grow memory.

**The reader** (:class:`Reader`) delivers each entry once, in order.  It asks for the
next path; if that is premature, its request (dropped by the publisher) registered it
for the broadcast, and it polls again on a dynamic interval (:class:`HazardPoll` by
default, estimated from recent inter-arrival times; :class:`PoissonPoll` and
:class:`FixedPoll` for comparison), re-requests missing fragments, and verifies each
entry's hash.  It pipelines requests when it knows entries are waiting (``NEXT``).
With ``start=None`` it first asks where the stream ends (``<scry-head STREAM>``) and
follows from there.  It notices when nothing answers its requests for ``quiet`` seconds
(a :class:`ReaderNotice` for its host to report; it keeps trying, or gives up after
``give_up`` seconds).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from ..values import DecodeError, Record, Symbol, Value, decode, encode

__all__ = [
    "FRAGMENT",
    "FixedPoll",
    "HazardPoll",
    "PoissonPoll",
    "PollModel",
    "Publisher",
    "PublisherStats",
    "Reader",
    "ReaderNotice",
    "ScryError",
    "decode_datagram",
    "entry_hash",
]

FRAGMENT = 1024
"""Bytes of an entry per fragment: with the header, a datagram stays under 1,400 bytes."""
MAX_DATAGRAM = 1400 + 256
"""Largest datagram either side accepts."""
MAX_STREAM = 200

GET, HEAD, FRAG, GONE, ERROR, WAIT = (
    Symbol(s) for s in ("scry-get", "scry-head", "scry-frag", "scry-gone", "scry-error",
                        "scry-wait"))
REPEATS = (0.033, 1.0)
"""Delays after the first broadcast of a new entry at which it is broadcast again."""


class ScryError(ValueError):
    """A malformed datagram (dropped and counted by whoever received it)."""


def entry_hash(data: bytes) -> bytes:
    """The integrity check of an entry: BLAKE2b-128 of its encoded value."""
    return hashlib.blake2b(data, digest_size=16).digest()


def _nat(v: Any, what: str, limit: int = 1 << 62) -> int:
    if type(v) is not int or not 0 <= v < limit:
        raise ScryError(f"{what} must be a non-negative integer")
    return v


def _stream(v: Any) -> str:
    if type(v) is not str or not 0 < len(v) <= MAX_STREAM:
        raise ScryError("a stream name is a string of 1-200 characters")
    return v


def decode_datagram(data: bytes) -> Record:
    """Decode and check the shape of one datagram; raises :class:`ScryError`."""
    if len(data) > MAX_DATAGRAM:
        raise ScryError(f"datagram of {len(data)} bytes is over {MAX_DATAGRAM}")
    try:
        v = decode(data, max_depth=8)
    except (DecodeError, ValueError) as e:
        raise ScryError(f"not a Preserves value: {e}") from None
    if type(v) is not Record or type(v.label) is not Symbol:
        raise ScryError("a datagram is a <scry-...> record")
    f = v.fields
    lab = v.label
    want = {GET: (3,), HEAD: (1, 3), FRAG: (8,), GONE: (3,), ERROR: (2,), WAIT: (2,)}.get(lab)
    if want is None or len(f) not in want:
        raise ScryError(f"unknown or malformed datagram <{lab.name} ...>")
    _stream(f[0])
    if lab == GET:
        _nat(f[1], "the index")
        _nat(f[2], "the fragment", 1 << 20)
    elif lab == WAIT:
        _nat(f[1], "the index")
    elif lab == FRAG:
        _nat(f[1], "the index")
        total = _nat(f[3], "the total", 1 << 20)
        frag = _nat(f[2], "the fragment", 1 << 20)
        if not frag < total or type(f[4]) is not bytes or len(f[4]) != 16:
            raise ScryError("malformed fragment")
        _nat(f[5], "the next index")
        if type(f[6]) is not bytes or len(f[6]) > FRAGMENT:
            raise ScryError("malformed fragment data")
        if f[7] is not False:
            _nat(f[7], "the index waited for")
    elif lab == HEAD and len(f) == 3:  # the answer: <scry-head STREAM NEXT FIRST>
        _nat(f[1], "the next index")
        _nat(f[2], "the first index")
    elif lab == GONE:
        _nat(f[1], "the index")
        _nat(f[2], "the first index")
    return v


def _get(stream: str, index: int, frag: int) -> bytes:
    return encode(Record(GET, [stream, index, frag]))


# ---------------------------------------------------------------------------------------
# The publisher


@dataclass
class PublisherStats:
    requests: int = 0          # datagrams received
    served: int = 0            # fragments sent in answer to a request
    cache_hits: int = 0
    loads: int = 0             # entries read from the store (through the host)
    premature: int = 0         # requests for entries that do not exist yet
    shielded: int = 0          # ... of which dropped by an existing shield
    too_far: int = 0           # ... for entries too far ahead (dropped, not remembered)
    shield_full: int = 0       # requesters not remembered: the shield table is full
    waits: int = 0             # premature requests acknowledged (<scry-wait ...>)
    broadcasts: int = 0        # first fragments pushed to requesters
    repeats: int = 0           # ... of which repeats (33 ms, 1 s)
    not_published: int = 0
    gone: int = 0
    heads: int = 0
    malformed: int = 0
    unreadable: int = 0        # entries the store could not give (damaged): not answered


class _Shield:
    __slots__ = ("born", "requesters")

    def __init__(self, now: float) -> None:
        self.born = now
        self.requesters: OrderedDict[Hashable, float] = OrderedDict()  # addr -> last asked


class _Entry:
    __slots__ = ("frags", "hash", "size")

    def __init__(self, data: bytes) -> None:
        self.size = len(data)
        self.hash = entry_hash(data)
        self.frags = [data[i:i + FRAGMENT] for i in range(0, len(data), FRAGMENT)] or [b""]


class Publisher:
    """The publishing side (see the module docstring).

    * ``ahead`` -- how many entries past a stream's end a request may be and still be
      remembered (default 64);
    * ``max_paths`` / ``max_requesters`` / ``shield_age`` -- bounds of the shield table
      (paths over all streams, requesters per path, seconds a requester is remembered);
    * ``cache_bytes`` -- bytes of recent entries' fragments kept;
    * ``repeats`` -- delays of the repeated broadcasts.
    """

    def __init__(self, *, ahead: int = 64, max_paths: int = 10_000, max_requesters: int = 10_000,
                 shield_age: float = 120.0, cache_bytes: int = 16 << 20,
                 repeats: tuple[float, ...] = REPEATS) -> None:
        self.ahead = ahead
        self.max_paths = max_paths
        self.max_requesters = max_requesters
        self.shield_age = shield_age
        self.cache_bytes = cache_bytes
        self.repeats = repeats
        self.heads: dict[str, tuple[int, int]] = {}     # stream -> (next, first)
        self.shields: dict[tuple[str, int], _Shield] = {}
        self.cache: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self._cached = 0
        self._loading: dict[tuple[str, int], list[tuple[Hashable, int]]] = {}
        self._broadcast_on_load: dict[tuple[str, int], list[tuple[Hashable, Any]]] = {}
        self._timers: list[tuple[float, tuple[str, int], list[tuple[Hashable, Any]], bool]] = []
        self._out: list[tuple[bytes, Hashable]] = []
        self._loads: list[tuple[str, int]] = []
        self.stats = PublisherStats()

    # -- what the host says ---------------------------------------------------------------

    def publish(self, stream: str, next_index: int, first_index: int | None = None) -> None:
        """Serve ``stream``, which ends before ``next_index``."""
        self.heads[stream] = (next_index, next_index if first_index is None else first_index)

    def appended(self, stream: str, next_index: int, now: float,
                 first_index: int | None = None) -> None:
        """``stream`` grew (or retention moved its start): answer the shielded paths that
        now exist with a broadcast (their entries are loaded first)."""
        old = self.heads.get(stream)
        if old is None:
            return
        first = old[1] if first_index is None else first_index
        self.heads[stream] = (max(next_index, old[0]), first)
        if next_index <= old[0]:
            return
        for path in sorted(p for p in self.shields if p[0] == stream and p[1] < next_index):
            shield = self.shields.pop(path)
            if not shield.requesters:
                continue
            # The requesters will ask for the following path next: remember them there
            # now (with the time they last asked), if it does not exist yet.
            follow = (stream, path[1] + 1)
            if follow[1] >= next_index and (follow in self.shields
                                            or len(self.shields) < self.max_paths):
                nxt = self.shields.get(follow)
                if nxt is None:
                    nxt = self.shields[follow] = _Shield(now)
                for a, t in shield.requesters.items():
                    if a not in nxt.requesters and len(nxt.requesters) < self.max_requesters:
                        nxt.requesters[a] = t
                waiting: int | bool = follow[1]
            else:
                waiting = False
            addrs = [(a, waiting) for a in shield.requesters]
            e = self.cache.get(path)
            if e is not None:
                self._broadcast(path, e, addrs, now, repeat=False)
            else:
                self._broadcast_on_load.setdefault(path, []).extend(addrs)
                self._load(path)

    def entry(self, stream: str, index: int, data: bytes | None, now: float) -> None:
        """The host read ``stream``/``index`` (None: it is not there)."""
        path = (stream, index)
        waiting = self._loading.pop(path, [])
        bcast = self._broadcast_on_load.pop(path, [])
        if data is None:
            head = self.heads.get(stream)
            first = head[1] if head else 0
            for addr, _frag in waiting:
                self._send(Record(GONE, [stream, index, first]), addr)
                self.stats.gone += 1
            return
        e = _Entry(data)
        self._remember(path, e)
        for addr, frag in waiting:
            self._answer(path, e, frag, addr)
        if bcast:
            self._broadcast(path, e, bcast, now, repeat=False)

    def unreadable(self, stream: str, index: int) -> None:
        """The host could not read ``stream``/``index`` (its store is damaged): forget
        who waits for it, answering nothing -- never a wrong entry, nor "gone" -- so
        that readers ask again and, if the store stays damaged, time out."""
        path = (stream, index)
        self._loading.pop(path, None)
        self._broadcast_on_load.pop(path, None)
        self.stats.unreadable += 1

    # -- requests -----------------------------------------------------------------------

    def datagram(self, data: bytes, addr: Hashable, now: float) -> None:
        """A datagram from ``addr``: answered, remembered, or dropped (and counted)."""
        self.stats.requests += 1
        try:
            v = decode_datagram(data)
        except ScryError:
            self.stats.malformed += 1
            return
        lab, f = v.label, v.fields
        stream = f[0]
        head = self.heads.get(stream)
        if lab == GET:
            if head is None:
                self.stats.not_published += 1
                self._send(Record(ERROR, [stream, f"stream {stream!r} is not published here"]),
                           addr)
                return
            self._get(stream, f[1], f[2], addr, head, now)
        elif lab == HEAD and len(f) == 1:
            if head is None:
                self.stats.not_published += 1
                self._send(Record(ERROR, [stream, f"stream {stream!r} is not published here"]),
                           addr)
                return
            self.stats.heads += 1
            self._send(Record(HEAD, [stream, head[0], head[1]]), addr)
        else:
            self.stats.malformed += 1  # answers are not requests

    def _get(self, stream: str, index: int, frag: int, addr: Hashable,
             head: tuple[int, int], now: float) -> None:
        nxt, first = head
        path = (stream, index)
        if index >= nxt:
            # Premature: no store, no answer; remember who asked (bounded).
            self.stats.premature += 1
            if index >= nxt + self.ahead:
                # Not remembered; the stream's end, from memory, says we are here.
                self.stats.too_far += 1
                self._send(Record(HEAD, [stream, nxt, first]), addr)
                return
            shield = self.shields.get(path)
            if shield is None:
                if len(self.shields) >= self.max_paths:
                    self._expire(now)
                    if len(self.shields) >= self.max_paths:
                        self.stats.shield_full += 1
                        self._send(Record(HEAD, [stream, nxt, first]), addr)
                        return
                shield = self.shields[path] = _Shield(now)
            else:
                self.stats.shielded += 1
            reqs = shield.requesters
            if addr in reqs:
                reqs.move_to_end(addr)
            elif len(reqs) >= self.max_requesters:
                reqs.popitem(last=False)  # the longest silent goes
                self.stats.shield_full += 1
            reqs[addr] = now
            # A small acknowledgement, from memory: the reader knows it will hear of the
            # entry, and polls only as insurance against lost broadcasts.
            self.stats.waits += 1
            self._send(Record(WAIT, [stream, index]), addr)
            return
        if index < first:
            self.stats.gone += 1
            self._send(Record(GONE, [stream, index, first]), addr)
            return
        e = self.cache.get(path)
        if e is not None:
            self.stats.cache_hits += 1
            self.cache.move_to_end(path)
            self._answer(path, e, frag, addr)
            return
        self._loading.setdefault(path, []).append((addr, frag))
        self._load(path)

    def _load(self, path: tuple[str, int]) -> None:
        if path not in self._loads:
            self._loads.append(path)
            self.stats.loads += 1

    def _answer(self, path: tuple[str, int], e: _Entry, frag: int, addr: Hashable) -> None:
        if frag >= len(e.frags):
            return  # no such fragment: nothing to say
        self.stats.served += 1
        self._send_frag(path, e, frag, addr, False)

    def _send_frag(self, path: tuple[str, int], e: _Entry, frag: int, addr: Hashable,
                   waiting: Any) -> None:
        stream, index = path
        nxt = self.heads.get(stream, (index + 1, 0))[0]
        self._send(Record(FRAG, [stream, index, frag, len(e.frags), e.hash, nxt,
                                 e.frags[frag], waiting]), addr)

    def _broadcast(self, path: tuple[str, int], e: _Entry, addrs: list[tuple[Hashable, Any]],
                   now: float, repeat: bool) -> None:
        for a, waiting in addrs:
            self._send_frag(path, e, 0, a, waiting)
        self.stats.broadcasts += len(addrs)
        if repeat:
            self.stats.repeats += len(addrs)
            return
        for d in self.repeats:
            self._timers.append((now + d, path, addrs, True))

    def _remember(self, path: tuple[str, int], e: _Entry) -> None:
        old = self.cache.pop(path, None)
        if old is not None:
            self._cached -= old.size
        self.cache[path] = e
        self._cached += e.size
        while self._cached > self.cache_bytes and len(self.cache) > 1:
            _p, gone = self.cache.popitem(last=False)
            self._cached -= gone.size

    def _expire(self, now: float) -> None:
        limit = now - self.shield_age
        for path, shield in list(self.shields.items()):
            reqs = shield.requesters
            while reqs and next(iter(reqs.values())) < limit:
                reqs.popitem(last=False)
            if not reqs:
                del self.shields[path]

    def _send(self, v: Value, addr: Hashable) -> None:
        self._out.append((encode(v), addr))

    # -- time ---------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Send the repeated broadcasts that are due; forget old requesters."""
        due = [t for t in self._timers if t[0] <= now]
        if due:
            self._timers = [t for t in self._timers if t[0] > now]
            for _t, path, addrs, _r in due:
                e = self.cache.get(path)
                if e is not None:
                    self._broadcast(path, e, addrs, now, repeat=True)
        if self.shields and len(self.shields) > self.max_paths // 2:
            self._expire(now)

    def next_deadline(self) -> float | None:
        return min((t[0] for t in self._timers), default=None)

    def take_outgoing(self) -> list[tuple[bytes, Hashable]]:
        out, self._out = self._out, []
        return out

    def take_loads(self) -> list[tuple[str, int]]:
        """Entries the host must read (then call :meth:`entry` with each)."""
        out, self._loads = self._loads, []
        return out

    REQUESTER_BYTES = 320
    """About what one remembered requester holds (its address and time in a path's
    table: 280 bytes measured for an IPv4 address, more for IPv6)."""
    PATH_BYTES = 512
    """About what one remembered path holds (its key, shield and empty table)."""

    def held_bytes(self) -> int:
        """What remote readers make the publisher hold, for the server's memory budget:
        the cached fragments, the remembered paths and requesters, and the addresses
        waiting for a repeated broadcast."""
        requesters = sum(len(s.requesters) for s in self.shields.values())
        repeats = sum(len(t[2]) for t in self._timers)
        return (self._cached + requesters * self.REQUESTER_BYTES
                + len(self.shields) * self.PATH_BYTES + len(self._timers) * 128 + repeats * 64)

    def memory(self) -> dict[str, int]:
        """Sizes of the in-memory tables (bounded: see the constructor)."""
        return {"shield_paths": len(self.shields),
                "requesters": sum(len(s.requesters) for s in self.shields.values()),
                "cached_entries": len(self.cache), "cached_bytes": self._cached,
                "timers": len(self._timers)}


# ---------------------------------------------------------------------------------------
# Poll models (the reader's dynamic interval)


class PollModel:
    """When a waiting reader polls again.  :meth:`observe` is told each entry's arrival
    (reader time); :meth:`delay` gives the wait before the next poll, after the ``k``-th
    poll of the current wait (k from 0), ``since_last`` seconds after the last entry.

    A reader whose request was acknowledged (``<scry-wait>``) will be sent the entry when
    it appears, so it polls only as insurance against a lost broadcast: at a moment by
    which the entry has most probably arrived (``hit``, default 0.9).  Waits are kept
    between ``min_delay`` and ``max_delay`` (30 s, well within the publisher's memory of
    a requester)."""

    min_delay = 0.05
    max_delay = 30.0

    def observe(self, now: float) -> None:
        pass

    def delay(self, since_last: float, k: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def _clamp(self, d: float) -> float:
        return min(self.max_delay, max(self.min_delay, d))


class FixedPoll(PollModel):
    """Naive polling every ``seconds`` (what a reader without a model does)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def delay(self, since_last: float, k: int) -> float:
        return self.seconds


class PoissonPoll(PollModel):
    """The seed's first idea: arrivals as a Poisson process, its rate estimated from an
    exponentially weighted mean of the recent gaps (``alpha``); the poll comes when the
    entry has arrived with probability ``hit`` (the ``hit`` quantile of the exponential
    gap: ``-ln(1 - hit) * mean``), and each unanswered poll doubles the wait."""

    def __init__(self, hit: float = 0.9, alpha: float = 0.3, initial: float = 2.0) -> None:
        self.hit = hit
        self.alpha = alpha
        self.mean = initial
        self.last: float | None = None

    def observe(self, now: float) -> None:
        if self.last is not None:
            gap = max(0.0, now - self.last)
            self.mean += self.alpha * (gap - self.mean)
        self.last = now

    def delay(self, since_last: float, k: int) -> float:
        first = -math.log(1 - self.hit) * max(self.mean, 1e-3)
        return self._clamp(first * (2 ** k))


class HazardPoll(PollModel):
    """An empirical model that fits bursty traffic: the last ``window`` gaps stand for the
    distribution of the next one, and the poll comes when the entry has arrived with
    probability ``hit`` *given that it had not after the time already waited* (the
    conditional, or hazard, view: right after a burst's message the next one is probably
    close; deep into a quiet spell it is probably far, and the wait grows with the time
    already spent).  Beyond every gap seen it backs off, doubling.  Two parameters:
    ``hit`` and ``window``."""

    def __init__(self, hit: float = 0.9, window: int = 64, initial: float = 2.0) -> None:
        self.hit = hit
        self.gaps: deque[float] = deque(maxlen=window)
        self.initial = initial
        self.last: float | None = None
        self._sorted: list[float] | None = None

    def observe(self, now: float) -> None:
        if self.last is not None:
            self.gaps.append(max(1e-4, now - self.last))
            self._sorted = None
        self.last = now

    def delay(self, since_last: float, k: int) -> float:
        gaps = self._sorted
        if gaps is None:
            gaps = self._sorted = sorted(self.gaps)
        if len(gaps) < 3:
            return self._clamp(self.initial * (2 ** k))
        later = [g for g in gaps if g > since_last]
        if not later:  # longer than anything seen: back off from where we are
            return self._clamp(max(since_last, gaps[-1]) * (2 ** k) / 2)
        # The smallest d with P(gap <= since_last + d | gap > since_last) >= hit.
        i = min(len(later) - 1, max(0, math.ceil(self.hit * len(later)) - 1))
        return self._clamp(later[i] - since_last)


# ---------------------------------------------------------------------------------------
# The reader


@dataclass
class ReaderStats:
    requests: int = 0      # datagrams sent
    polls: int = 0         # requests for the next entry, not known to exist yet
    retries: int = 0       # ... sent again because nothing answered
    refetches: int = 0     # requests for missing fragments
    waits: int = 0         # acknowledgements heard: remembered for the broadcast
    entries: int = 0
    fragments: int = 0
    duplicates: int = 0    # fragments or entries received again (dropped)
    malformed: int = 0
    bad_hash: int = 0
    ignored: int = 0       # for another stream or path than expected


@dataclass(frozen=True)
class ReaderNotice:
    """Something the reader's user should hear of (the host says it: a line, a log record).

    ``kind``:

    * ``"ready"`` -- the publisher answered for the first time; ``index`` is the first
      entry awaited (with ``start=None``, the next to be appended);
    * ``"silent"`` -- nothing answered any request for ``seconds`` (the reader keeps
      trying); ``malformed``: datagrams heard meanwhile that were not scry datagrams;
    * ``"back"`` -- the publisher answers again, after ``seconds`` of silence;
    * ``"gave-up"`` -- nothing answered for ``seconds`` (the reader's ``give_up``):
      :attr:`Reader.error` is set and the reader sends nothing more.
    """

    kind: str
    seconds: float = 0.0
    index: int | None = None
    malformed: int = 0


class _Partial:
    __slots__ = ("asked", "frags", "hash", "total")

    def __init__(self, total: int, h: bytes) -> None:
        self.total = total
        self.hash = h
        self.frags: dict[int, bytes] = {}
        self.asked = 0.0


class Reader:
    """The reading side for one stream (see the module docstring).

    ``start``: the first index to deliver, or None for "the next entry to be appended"
    (the reader asks the publisher where the stream ends first).  ``poll``: a
    :class:`PollModel` (default :class:`HazardPoll`).  ``window``: entries requested at
    once when the stream is known to be ahead.  ``refetch``: seconds before an
    unanswered request (a poll, missing fragments) is sent again.  ``quiet``: seconds
    without any answer to a request before a ``"silent"`` notice (:meth:`take_notices`);
    ``give_up``: seconds without any answer before the reader stops (:attr:`error` set;
    None: it keeps trying for ever).
    """

    def __init__(self, stream: str, start: int | None, *, poll: PollModel | None = None,
                 window: int = 16, refetch: float = 0.2, max_entry: int = 16 << 20,
                 quiet: float = 3.0, give_up: float | None = None) -> None:
        _stream(stream)
        self.stream = stream
        self.next = start
        self.poll = poll if poll is not None else HazardPoll()
        self.window = window
        self.refetch = refetch
        self.max_entry = max_entry
        self.known_next = -1          # the publisher's NEXT, as last heard
        self.first = 0
        self.partial: dict[int, _Partial] = {}
        self.done: dict[int, bytes] = {}   # reassembled, waiting for their turn
        self._out: list[bytes] = []
        self._entries: list[tuple[int, bytes]] = []
        self._poll_at: float | None = None     # the next insurance poll
        self._asked: float | None = None       # a poll not answered yet (frag or wait)
        self._k = 0                   # polls in this wait
        self._tries = 0               # sends of the current poll not answered
        self._remembered = -1         # the index the publisher said it keeps us for
        self._miss = 0.0              # share of polls left unanswered (EWMA)
        self._last_arrival: float | None = None
        self._asked_head = 0.0
        self.quiet = quiet
        self.give_up = give_up
        self._unanswered: float | None = None  # the first request sent since the last answer
        self._bad_before = 0          # stats.malformed when that request was sent
        self._silent = False          # the "silent" notice was given for this silence
        self._ready = False           # the publisher has answered once
        self._notices: list[ReaderNotice] = []
        self.error: str | None = None
        self.stats = ReaderStats()

    def begin(self, now: float) -> None:
        """Start: ask where the stream ends, or for the first entry."""
        if self.next is None:
            self._ask_head(now)
        else:
            self._poll(now)

    def _ask_head(self, now: float) -> None:
        self._asked_head = now
        self._send(encode(Record(HEAD, [self.stream])), now)

    def _send(self, data: bytes, now: float) -> None:
        self.stats.requests += 1
        self._out.append(data)
        if self._unanswered is None:
            self._unanswered = now
            self._bad_before = self.stats.malformed

    def _poll(self, now: float) -> None:
        """Ask for the next entry (which may not exist yet: then this registers us)."""
        assert self.next is not None
        self.stats.polls += 1
        self._send(_get(self.stream, self.next, 0), now)
        self._asked = now
        self._tries = 0
        self._poll_at = None

    def _since(self, now: float) -> float:
        return now - self._last_arrival if self._last_arrival is not None else 0.0

    def _insurance(self, now: float) -> float:
        """The wait before an insurance poll: the model's, shortened when datagrams get
        lost (an unanswered poll means a lost request or answer, about twice the loss
        rate; with loss p all three broadcasts of an entry are missed with p**3)."""
        d = self.poll.delay(self._since(now), self._k)
        loss = self._miss / 2
        if loss > 0.15:  # p**3 over 0.3%: the tail would be the insurance poll's
            d = min(d, max(2.0, self.poll.max_delay * 0.15 / loss))
        return d

    # -- datagrams ----------------------------------------------------------------------

    def datagram(self, data: bytes, now: float) -> None:
        """A datagram from the publisher (the host checks it came from there)."""
        try:
            v = decode_datagram(data)
        except ScryError:
            self.stats.malformed += 1
            return
        f = v.fields
        if f[0] != self.stream:
            self.stats.ignored += 1
            return
        if self.error is not None:
            return  # stopped
        lab = v.label
        if lab == GET or (lab == HEAD and len(f) == 1):
            self.stats.ignored += 1  # a request, not an answer
            return
        if self._silent:
            assert self._unanswered is not None
            self._notices.append(ReaderNotice("back", now - self._unanswered, self.next))
            self._silent = False
        self._unanswered = None
        awaited = self.next
        self._handle(lab, f, now)
        if not self._ready and self.next is not None and self.error is None:
            self._ready = True
            self._notices.append(ReaderNotice(
                "ready", 0.0, self.next if awaited is None or lab == GONE else awaited))

    def _handle(self, lab: Symbol, f: list[Any], now: float) -> None:
        if lab == FRAG:
            self._frag(f[1], f[2], f[3], f[4], f[5], f[6], now, f[7])
        elif lab == WAIT:
            if self.next is not None and f[1] == self.next and self._asked is not None:
                # Remembered: we will be sent it.  Poll again only as insurance.
                self.stats.waits += 1
                self._asked = None
                self._miss *= 0.9
                self._poll_at = now + self._insurance(now)
                self._k += 1
            else:
                self.stats.ignored += 1
        elif lab == HEAD and len(f) == 3:
            if self.next is None:
                self.next = max(f[1], f[2])
                self.known_next = f[1]
                self._k = 0
                self._poll(now)
            elif f[1] > self.known_next:
                # The answer to a request too far ahead (not remembered): keep polling.
                self.known_next = f[1]
        elif lab == GONE:
            idx, first = f[1], f[2]
            if self.next is not None and idx == self.next and first > self.next:
                self.first = first
                self.next = first  # retention removed them: carry on from what is kept
                self._k = 0
                self._poll(now)
        elif lab == ERROR:
            self.error = f[1] if type(f[1]) is str else "error"
        else:
            self.stats.ignored += 1

    def _frag(self, index: int, frag: int, total: int, h: bytes, nxt: int, data: bytes,
              now: float, waiting: Any = False) -> None:
        self.stats.fragments += 1
        if waiting is not False and waiting > self._remembered:
            self._remembered = waiting  # a broadcast: the publisher keeps us for this one
        if nxt > self.known_next:
            self.known_next = nxt
        if self.next is None or index < self.next or index in self.done:
            self.stats.duplicates += 1
            return
        if index >= self.next + max(self.window, 1) * 4:
            self.stats.ignored += 1
            return
        if total > self.max_entry // FRAGMENT + 1:
            self.stats.malformed += 1
            return
        if index == self.next:
            if self._asked is not None:
                self._miss *= 0.9
            self._asked = None
            self._poll_at = None
        p = self.partial.get(index)
        if p is None or p.hash != h or p.total != total:
            p = self.partial[index] = _Partial(total, h)
            p.asked = now
        if frag in p.frags:
            self.stats.duplicates += 1
            return
        p.frags[frag] = data
        if len(p.frags) < total:
            if frag == 0:
                # A new entry's first fragment (often a broadcast): fetch the rest now.
                for i in range(1, total):
                    if i not in p.frags:
                        self.stats.refetches += 1
                        self._send(_get(self.stream, index, i), now)
                p.asked = now
            return
        whole = b"".join(p.frags[i] for i in range(total))
        del self.partial[index]
        if entry_hash(whole) != h:
            self.stats.bad_hash += 1
            if index == self.next:
                self._poll(now)  # ask again: it may have been a forgery
            return
        self.done[index] = whole
        self._deliver(now)

    def _deliver(self, now: float) -> None:
        delivered = False
        while self.next is not None and self.next in self.done:
            self._entries.append((self.next, self.done.pop(self.next)))
            self.stats.entries += 1
            self.next += 1
            delivered = True
        if not delivered:
            return
        self.poll.observe(now)
        self._last_arrival = now
        self._k = 0
        # Ask for what follows: a window of entries known to exist, then (registering
        # for the broadcast) the next one that does not exist yet.
        assert self.next is not None
        upto = min(self.known_next, self.next + self.window)
        for i in range(self.next, upto):
            if i not in self.partial and i not in self.done:
                q = self.partial[i] = _Partial(0, b"")  # asked, nothing yet
                q.asked = now
                self._send(_get(self.stream, i, 0), now)
        if self.next >= self.known_next and self.next not in self.partial:
            if self._remembered == self.next:
                # Carried over by the broadcast: no request, only an insurance poll later.
                self._asked = None
                self._poll_at = now + self._insurance(now)
                self._k = 1
            else:
                self._poll(now)

    # -- time ---------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Send again what was not answered; poll when the insurance poll is due; say when
        nothing answers (and give up, with ``give_up``)."""
        if self.error is not None:
            return
        if self._unanswered is not None:
            # (The same sums as next_deadline(): a deadline that has passed is acted on.)
            silent = now - self._unanswered
            bad = self.stats.malformed - self._bad_before
            if self.give_up is not None and self._unanswered + self.give_up <= now:
                self.error = f"no answer for {silent:.0f} s"
                self._notices.append(ReaderNotice("gave-up", silent, self.next, bad))
                return
            if not self._silent and self._unanswered + self.quiet <= now:
                self._silent = True
                self._notices.append(ReaderNotice("silent", silent, self.next, bad))
        if self.next is None:
            if self._asked_head + self.refetch * 5 <= now:
                self._ask_head(now)
            return
        for index, p in list(self.partial.items()):
            if p.asked + self.refetch > now:  # the same sum next_deadline() reports
                continue
            p.asked = now
            if p.total == 0:
                self.stats.refetches += 1
                self._send(_get(self.stream, index, 0), now)
                continue
            for i in range(p.total):
                if i not in p.frags:
                    self.stats.refetches += 1
                    self._send(_get(self.stream, index, i), now)
        if self._asked is not None and self._asked + self.refetch <= now:
            # Neither the entry nor an acknowledgement: lost; ask again (backing off).
            self.stats.retries += 1
            self.stats.polls += 1
            self._miss += 0.1 * (1.0 - self._miss)
            self._send(_get(self.stream, self.next, 0), now)
            self._tries += 1
            self._asked = now + min(self.refetch * (2 ** min(self._tries, 5)), 5.0) - self.refetch
        elif self._poll_at is not None and self._poll_at <= now:
            self._poll(now)

    def next_deadline(self) -> float | None:
        if self.error is not None:
            return None
        ds = [p.asked + self.refetch for p in self.partial.values()]
        if self._unanswered is not None:
            if not self._silent:
                ds.append(self._unanswered + self.quiet)
            if self.give_up is not None:
                ds.append(self._unanswered + self.give_up)
        if self._asked is not None:
            ds.append(self._asked + self.refetch)
        if self._poll_at is not None:
            ds.append(self._poll_at)
        if self.next is None:
            ds.append(self._asked_head + self.refetch * 5)
        return min(ds, default=None)

    def take_outgoing(self) -> list[bytes]:
        out, self._out = self._out, []
        return out

    def take_notices(self) -> list[ReaderNotice]:
        """What the user should hear of since the last call (see :class:`ReaderNotice`)."""
        out, self._notices = self._notices, []
        return out

    def silent_for(self, now: float) -> float:
        """Seconds since the first request nothing has answered yet (0: none waiting)."""
        return 0.0 if self._unanswered is None else now - self._unanswered

    def take_entries(self) -> list[tuple[int, bytes]]:
        """Entries in order, each once: ``(index, encoded value)``."""
        out, self._entries = self._entries, []
        return out
