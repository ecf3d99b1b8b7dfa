"""Consumer groups against a model (issue 32): appends, reads, acknowledgements (plain,
by index, in transactions with results), claims by hand, consumers crashing and
restarting, time passing and retention, in random order (a hypothesis state machine), on
both stores.  After every step the store's pending list is exactly the model's; no entry
is acknowledged twice, none is lost (each index is acknowledged, dead-lettered, pending or
not yet delivered), every transaction's results are there once or not at all, and the
dead-letter stream holds exactly what went there.

The model is the specification of a read (groups.py's docstring): a consumer's own
entries from before it started, then others' entries idle past the timeout, then new
ones; an entry that would be delivered more than K times goes to the dead-letter stream.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from dataspace.streams import open_store
from dataspace.streams.base import AckLost
from dataspace.streams.groups import Group
from dataspace.values import Symbol

S = 1_000_000_000
IDLE = 10  # seconds
K = 2  # max deliveries
KEEP = 6  # the stream's retention (max-count)
NAMES = ("a", "b", "c")
_runs = itertools.count()


@dataclass
class P:
    consumer: str
    deliveries: int
    at: int


@dataclass
class MC:
    """A consumer handle as the model sees it."""

    born: int
    recovering: bool = True
    cursor: int = -1
    held: list[Any] = field(default_factory=list)  # its deliveries not acknowledged yet


class Clock:
    def __init__(self) -> None:
        self.now = 10**18

    def __call__(self) -> int:
        return self.now


class GroupModel(RuleBasedStateMachine):
    store: Any = None  # set by the test, one per backend

    @initialize()
    def setup(self) -> None:
        k = next(_runs)
        self.stream, self.dead, self.results = f"jobs{k}", f"jobs{k}.dead", f"res{k}"
        self.clock = Clock()
        s = self.store
        s.create_stream(self.stream, max_count=KEEP)
        s.create_group(self.stream, "g", idle_timeout=IDLE, max_deliveries=K)
        self.g = Group(s, self.stream, "g", clock=self.clock)
        self.n = 0  # the stream's next index
        self.first = 0
        self.next = 0  # the group's
        self.pending: dict[int, P] = {}
        self.acked: set[int] = set()
        self.deads: list[int] = []
        self.done: list[int] = []  # results committed with their acknowledgement
        self.handles: dict[str, Any] = {}
        self.model: dict[str, MC] = {}
        self.stale: list[Any] = []  # deliveries of handles that crashed

    # -- helpers ---------------------------------------------------------------------

    def handle(self, name: str) -> Any:
        if name not in self.handles:
            self.handles[name] = self.g.consumer(name)
            self.model[name] = MC(self.clock.now)
        return self.handles[name]

    def retain(self) -> None:
        floor = min([*self.pending, self.next])
        cut = min(self.n - KEEP, floor)
        self.first = max(self.first, cut)

    def dead_letter(self, over: list[int]) -> None:
        for i in over:
            if i in self.pending:
                del self.pending[i]
                self.deads.append(i)

    def redeliver(self, name: str, rows: list[int], over: list[int]) -> list[int]:
        got = []
        for i in rows:
            p = self.pending[i]
            if p.deliveries >= K:
                over.append(i)
            else:
                self.pending[i] = P(name, p.deliveries + 1, self.clock.now)
                got.append(i)
        return got

    def model_read(self, name: str, count: int) -> list[int]:
        mc = self.model[name]
        now = self.clock.now
        while True:
            left = count
            got: list[int] = []
            over: list[int] = []
            if mc.recovering:
                rows = sorted(i for i, p in self.pending.items()
                              if p.consumer == name and i > mc.cursor and p.at < mc.born)[:left]
                mc.recovering = len(rows) == left
                mc.cursor = rows[-1] if rows else mc.cursor
                got += self.redeliver(name, rows, over)
                left = count - len(got)
            if left > 0:
                rows = sorted(i for i, p in self.pending.items()
                              if p.consumer != name and p.at <= now - IDLE * S)[:left]
                got += self.redeliver(name, rows, over)
                left = count - len(got)
            if left > 0:
                a = max(self.next, self.first)
                b = min(a + left, self.n)
                if b > a:
                    for i in range(a, b):
                        self.pending[i] = P(name, 1, now)
                    got += range(a, b)
                self.next = max(self.next, a, b)
            self.dead_letter(over)
            if over and not got:
                continue
            return got

    def model_claim(self, name: str, min_idle: int, count: int) -> list[int]:
        now = self.clock.now
        got: list[int] = []
        while True:
            rows = sorted(i for i, p in self.pending.items() if p.at <= now - min_idle * S)[:count]
            over: list[int] = []
            got += self.redeliver(name, rows, over)
            self.dead_letter(over)
            if not over:
                return got

    # -- rules -----------------------------------------------------------------------

    @rule(k=st.integers(1, 4))
    def append(self, k: int) -> None:
        self.store.append_many(self.stream, list(range(self.n, self.n + k)))
        self.n += k
        self.retain()

    @rule(name=st.sampled_from(NAMES), count=st.integers(1, 4))
    def read(self, name: str, count: int) -> None:
        c = self.handle(name)
        got = c.read(count)
        want = self.model_read(name, count)
        assert sorted(d.index for d in got) == sorted(want)
        for d in got:
            assert d.value == d.index and d.consumer == name
            assert d.deliveries == self.pending[d.index].deliveries
        self.model[name].held += got

    @rule(name=st.sampled_from(NAMES), data=st.data(), by_index=st.booleans())
    def ack(self, name: str, data: Any, by_index: bool) -> None:
        if name not in self.handles:
            return
        mc = self.model[name]
        pool = mc.held + self.stale
        if not pool:
            return
        chosen = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4, unique_by=id))
        if by_index:
            idxs = sorted({d.index for d in chosen})
            n = self.handles[name].ack(idxs)
            want = [i for i in idxs if i in self.pending]
        else:
            n = self.handles[name].ack(chosen)
            want = sorted({d.index for d in chosen if (p := self.pending.get(d.index)) is not None
                           and (p.consumer, p.deliveries) == (d.consumer, d.deliveries)})
        assert n == len(want)
        for i in want:
            assert i not in self.acked, f"entry {i} acknowledged twice"
            del self.pending[i]
            self.acked.add(i)
        mc.held = [d for d in mc.held if d.index in self.pending]

    @rule(name=st.sampled_from(NAMES), data=st.data())
    def ack_in_transaction(self, name: str, data: Any) -> None:
        if name not in self.handles or not (self.model[name].held or self.stale):
            return
        pool = self.model[name].held + self.stale
        chosen = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique_by=id))
        chosen = list({d.index: d for d in chosen}.values())
        ok = all((p := self.pending.get(d.index)) is not None
                 and (p.consumer, p.deliveries) == (d.consumer, d.deliveries) for d in chosen)
        try:
            with self.store.transaction() as t:
                for d in chosen:
                    t.append(self.results, d.index)
                assert t.ack(chosen) == len(chosen)
        except AckLost:
            assert not ok
        else:
            assert ok
            for d in chosen:
                assert d.index not in self.acked
                del self.pending[d.index]
                self.acked.add(d.index)
                self.done.append(d.index)

    @rule(name=st.sampled_from(NAMES), min_idle=st.sampled_from([0, 5, IDLE]),
          count=st.integers(1, 3))
    def claim(self, name: str, min_idle: int, count: int) -> None:
        self.handle(name)
        got = self.g.claim(name, min_idle=min_idle, count=count)
        want = self.model_claim(name, min_idle, count)
        assert sorted(d.index for d in got) == sorted(want)
        self.model[name].held += got

    @rule(name=st.sampled_from(NAMES))
    def crash(self, name: str) -> None:
        """The consumer's process dies; it starts again under its name."""
        if name not in self.handles:
            return
        self.stale += self.model[name].held
        del self.handles[name]
        self.clock.now += 1
        self.handle(name)

    @rule(seconds=st.sampled_from([1, 4, IDLE]))
    def tick(self, seconds: int) -> None:
        self.clock.now += seconds * S

    @rule()
    def apply_retention(self) -> None:
        self.store.apply_retention()
        self.retain()

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def pending_list_is_exact(self) -> None:
        if not hasattr(self, "g"):
            return
        got = [(p.index, p.consumer, p.deliveries, p.delivered_ns)
               for p in self.g.pending(limit=10_000)]
        assert got == [(i, p.consumer, p.deliveries, p.at) for i, p in sorted(self.pending.items())]
        info = self.g.info()
        assert info.next == self.next and info.pending == len(self.pending)
        first = self.store.first_index(self.stream)
        assert first == (self.first if self.first < self.n else None)

    @invariant()
    def nothing_lost_or_twice(self) -> None:
        if not hasattr(self, "g"):
            return
        below = set(range(self.next))
        assert below == self.acked | set(self.deads) | set(self.pending)
        assert not (self.acked & set(self.deads)) and not (self.acked & set(self.pending))
        results = [e.value for e in self.store.read(self.results)] if self.done else []
        assert sorted(results) == sorted(self.done) and len(set(results)) == len(results)
        dead = self.store.read(self.dead) if self.deads else []
        assert [e.meta[Symbol("index")] for e in dead] == self.deads
        assert all(e.value == e.meta[Symbol("index")] for e in dead)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_consumer_groups_follow_the_model(backend: str, tmp_path: Any,
                                          request: pytest.FixtureRequest) -> None:
    url = str(tmp_path / "data") if backend == "sqlite" else request.getfixturevalue("pg_url")
    with open_store(url) as store:
        GroupModel.store = store
        try:
            run_state_machine_as_test(
                GroupModel, settings=settings(max_examples=100 if backend == "sqlite" else 30,
                                              stateful_step_count=50, deadline=None))
        finally:
            GroupModel.store = None
