"""A discrete-event simulation of scry (seed 004): one publisher, many readers, a network
that loses, duplicates and delays datagrams, in simulated time.

The property tests and ``benchmarks/bench_scry.py`` run the real machines of
:mod:`.scry` through it: nothing here but the clock, the network and a dictionary
standing for the store.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .scry import PollModel, Publisher, Reader

__all__ = ["SimResult", "Trace", "simulate", "trace"]


@dataclass
class SimResult:
    entries: int
    readers: int
    requests: int                 # datagrams from readers
    delivered: list[list[int]]    # per reader: indices in delivery order
    latencies: list[float]        # append -> delivery, every reader and entry
    publisher_seconds: float      # CPU time in Publisher.datagram
    publisher_requests: int
    store_reads: int
    premature: int
    broadcasts: int
    memory: dict[str, int] = field(default_factory=dict)
    firsts: list[int | None] = field(default_factory=list)  # per reader: its first index
    appended_then: list[int] = field(default_factory=list)  # ... entries appended by then

    @property
    def requests_per_entry_per_reader(self) -> float:
        return self.requests / max(1, self.entries * self.readers)

    def pct(self, p: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


Trace = list[float]
"""Append times (seconds), increasing."""


def trace(kind: str, seed: int, duration: float = 600.0) -> Trace:
    """Seeded traces: ``bursty`` (chat: clusters of messages separated by long quiet gaps),
    ``steady`` (a feed: one every second or so) and ``idle`` (a mostly idle channel)."""
    rng = random.Random(f"{kind}:{seed}")
    t = 0.0
    out: list[float] = []
    if kind == "bursty":
        while t < duration:
            t += rng.expovariate(1 / 60.0)           # quiet for about a minute
            for _ in range(rng.randint(3, 25)):      # then a conversation
                t += rng.expovariate(1 / 2.5)
                out.append(t)
    elif kind == "steady":
        while t < duration:
            t += rng.uniform(0.8, 1.2)
            out.append(t)
    elif kind == "idle":
        while t < duration:
            t += rng.expovariate(1 / 180.0)
            out.append(t)
    else:
        raise ValueError(f"unknown trace {kind!r}")
    return [x for x in out if x < duration]


def simulate(
    times: Sequence[float],
    readers: int,
    *,
    loss: float = 0.0,
    dup: float = 0.0,
    delay: tuple[float, float] = (0.001, 0.004),
    poll: Callable[[], PollModel] | None = None,
    broadcast: bool = True,
    seed: int = 0,
    size: Callable[[int], int] = lambda i: 40,
    settle: float = 60.0,
    publisher: Callable[[], Publisher] | None = None,
    start: int | None = 0,
) -> SimResult:
    """Run one trace: entries appended at ``times``; ``readers`` following from ``start``
    (None: the next entry to be appended, as ``dataspace scry follow`` does by default);
    each datagram lost with probability ``loss``, duplicated with ``dup``, delayed by a
    uniform ``delay``.  ``broadcast=False`` disables the optimistic broadcast (the
    publisher still remembers requesters, but never pushes)."""
    rng = random.Random(seed)
    pub = publisher() if publisher is not None else Publisher()
    if not broadcast:
        pub.appended = _no_broadcast(pub)  # type: ignore[method-assign]
    store: dict[int, bytes] = {}
    pub.publish("chat", 0, 0)
    rs = [Reader("chat", start, poll=poll() if poll is not None else None)
          for _ in range(readers)]
    firsts: list[int | None] = [start] * readers
    appended_then = [0] * readers
    appended = 0
    delivered: list[list[int]] = [[] for _ in rs]
    latencies: list[float] = []
    seq = itertools.count()
    events: list[tuple[float, int, str, Any]] = []

    def push(t: float, kind: str, arg: Any) -> None:
        heapq.heappush(events, (t, next(seq), kind, arg))

    def send(t: float, to: str, arg: Any) -> None:
        if rng.random() < loss:
            return
        copies = 2 if rng.random() < dup else 1
        for _ in range(copies):
            push(t + rng.uniform(*delay), to, arg)

    cpu = 0.0
    requests = 0
    end = (times[-1] if times else 0.0) + settle
    for i, t in enumerate(times):
        push(t, "append", i)
    for k in range(len(rs)):
        push(0.0, "start", k)

    def run_pub(now: float) -> None:
        for data, addr in pub.take_outgoing():
            send(now, "to-reader", (addr, data))
        for stream, index in pub.take_loads():
            pub.entry(stream, index, store.get(index), now)
            for data, addr in pub.take_outgoing():
                send(now, "to-reader", (addr, data))
        d = pub.next_deadline()
        if d is not None:
            push(d, "pub-tick", None)

    def run_reader(k: int, now: float) -> None:
        nonlocal requests
        r = rs[k]
        if firsts[k] is None and r.next is not None:  # learned where the stream ends
            firsts[k] = r.next
            appended_then[k] = appended
        for data in r.take_outgoing():
            requests += 1
            send(now, "to-pub", (k, data))
        for index, _data in r.take_entries():
            delivered[k].append(index)
            latencies.append(now - times[index])
        d = r.next_deadline()
        if d is not None:
            push(max(d, now), "reader-tick", (k, d))

    while events:
        now, _s, kind, arg = heapq.heappop(events)
        if now > end:
            break
        if kind == "append":
            store[arg] = bytes(size(arg))
            appended = arg + 1
            pub.appended("chat", arg + 1, now)
            run_pub(now)
        elif kind == "start":
            rs[arg].begin(now)
            run_reader(arg, now)
        elif kind == "to-pub":
            k, data = arg
            t0 = time.perf_counter()
            pub.datagram(data, k, now)
            cpu += time.perf_counter() - t0
            run_pub(now)
        elif kind == "to-reader":
            k, data = arg
            rs[k].datagram(data, now)
            run_reader(k, now)
        elif kind == "pub-tick":
            pub.tick(now)
            run_pub(now)
        elif kind == "reader-tick":
            k, _due = arg
            r = rs[k]
            d = r.next_deadline()
            if d is not None and d <= now:
                r.tick(now)
                run_reader(k, now)
    return SimResult(
        entries=len(times), readers=readers, requests=requests, delivered=delivered,
        latencies=latencies, publisher_seconds=cpu, publisher_requests=pub.stats.requests,
        store_reads=pub.stats.loads, premature=pub.stats.premature,
        broadcasts=pub.stats.broadcasts, memory=pub.memory(), firsts=firsts,
        appended_then=appended_then,
    )


def _no_broadcast(pub: Publisher) -> Callable[..., None]:
    original = pub.appended

    def appended(stream: str, next_index: int, now: float, first_index: int | None = None) -> None:
        shields = pub.shields
        pub.shields = {}
        try:
            original(stream, next_index, now, first_index)
        finally:
            pub.shields = {p: s for p, s in shields.items() if p[1] >= next_index}

    return appended
