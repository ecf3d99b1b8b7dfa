"""Links form a forest (dataspace.protocol.linktree), in simulated time: random topologies,
start orders, delays and cuts; the links up never close a cycle, a refused link is always
a new one, and every server ends up linked to every server its configured links reach."""

from __future__ import annotations

import heapq
import itertools
import os
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataspace.protocol.linktree import LOCK, Forest, ForestError
from dataspace.values import Record, Sequence, Symbol

CI = os.environ.get("CI") is not None


@dataclass(eq=False)
class Conn:
    """One connection of a configured link: ``a`` dialed ``b``."""

    a: str
    b: str
    n: int
    open_a: bool = False
    open_b: bool = False
    closed: bool = False


@dataclass
class Sim:
    ids: list[str]
    edges: list[tuple[str, str]]          # configured links: (dialer, acceptor)
    rng: random.Random
    delay: tuple[float, float] = (0.001, 0.05)
    refused_retry: tuple[float, float] = (30.0, 60.0)
    now: float = 0.0
    forests: dict[str, Forest] = field(default_factory=dict)
    events: list = field(default_factory=list)
    seq: itertools.count = field(default_factory=itertools.count)
    conns: dict[tuple[str, str], Conn | None] = field(default_factory=dict)
    fifo: dict[tuple[int, str], float] = field(default_factory=dict)
    refused: list[tuple[str, str, str]] = field(default_factory=list)
    went_up: list[tuple[str, str]] = field(default_factory=list)
    counter: itertools.count = field(default_factory=itertools.count)

    def push(self, t: float, kind: str, *arg) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, arg))

    def start(self, x: str, t: float) -> None:
        self.push(t, "start", x)

    # -- the network --------------------------------------------------------------------

    def send(self, conn: Conn, frm: str, msg) -> None:
        to = conn.b if frm == conn.a else conn.a
        key = (conn.n, to)
        t = max(self.fifo.get(key, 0.0), self.now + self.rng.uniform(*self.delay))
        self.fifo[key] = t
        self.push(t, "deliver", conn, to, msg)

    def flush(self, x: str) -> None:
        f = self.forests[x]
        for _ in range(10_000):
            out, evs = f.take_outgoing(), f.take_events()
            if not out and not evs:
                break
            for conn, msg in out:
                if not conn.closed:
                    self.send(conn, x, msg)
            for kind, conn, why in evs:
                if kind == "up" and x == conn.a:  # (the dialer decides; counted once)
                    self.went_up.append((conn.a, conn.b))
                elif kind == "refused":
                    # The accepting end closes it (so both ends hear why), the dialer
                    # after 5 s if it is still open; the dialer tries again later.
                    self.refused.append((conn.a, conn.b, why))
                    if x == conn.b:
                        self.close(conn, retry=self.rng.uniform(*self.refused_retry))
                    else:
                        self.push(self.now + 5.0, "close-refused", conn)
        d = f.next_deadline()
        if d is not None:
            self.push(max(d, self.now), "tick", x)
        self.check_forest()

    def close(self, conn: Conn, retry: float) -> None:
        if conn.closed:
            return
        conn.closed = True
        for x, opened in ((conn.a, conn.open_a), (conn.b, conn.open_b)):
            if opened:  # each end hears of it a moment later
                self.push(self.now + self.rng.uniform(*self.delay), "closed", conn, x)
        self.push(self.now + retry, "dial", conn.a, conn.b)

    # -- invariants -----------------------------------------------------------------------

    def up_edges(self) -> list[tuple[str, str]]:
        """Links up at either end (data may cross them)."""
        out = []
        for conn in self.conns.values():
            if conn is None:
                continue
            if ((conn.open_a and self.forests[conn.a].is_up(conn))
                    or (conn.open_b and self.forests[conn.b].is_up(conn))):
                out.append((conn.a, conn.b))
        return out

    def check_forest(self) -> None:
        parent = {x: x for x in self.ids}

        def find(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for a, b in self.up_edges():
            ra, rb = find(a), find(b)
            assert ra != rb, f"the links up close a cycle at {self.now:.3f}: {self.up_edges()}"
            parent[ra] = rb

    # -- running --------------------------------------------------------------------------

    def run(self, until: float, cuts: int = 0) -> None:
        for _ in range(cuts):
            self.push(self.rng.uniform(0.0, until / 2), "cut")
        for _ in range(200_000):
            if not self.events:
                return
            t, _s, kind, arg = heapq.heappop(self.events)
            if t > until:
                heapq.heappush(self.events, (t, _s, kind, arg))
                return
            self.now = t
            getattr(self, "on_" + kind.replace("-", "_"))(*arg)
        raise AssertionError("the simulation did not settle")

    def on_start(self, x: str) -> None:
        self.forests[x] = Forest(x, random=self.rng.random, timeout=20.0)
        for a, b in self.edges:
            if x in (a, b) and a in self.forests and b in self.forests:
                self.on_dial(a, b)

    def on_dial(self, a: str, b: str) -> None:
        old = self.conns.get((a, b))
        if old is not None and not old.closed:
            return
        conn = Conn(a, b, next(self.counter))
        self.conns[(a, b)] = conn
        # The acceptor answers the request (opened there), then the dialer hears it.
        t = self.now + self.rng.uniform(*self.delay)
        self.push(t, "open", conn, b)
        self.push(t + self.rng.uniform(*self.delay), "open", conn, a)

    def on_open(self, conn: Conn, x: str) -> None:
        if conn.closed:
            return
        f = self.forests[x]
        if x == conn.a:
            conn.open_a = True
            f.opened(conn, conn.b, dialed=True, nonce=f"n{conn.n}", now=self.now)
        else:
            conn.open_b = True
            f.opened(conn, conn.a, dialed=False, nonce="-", now=self.now)
        self.flush(x)

    def on_deliver(self, conn: Conn, to: str, msg) -> None:
        opened = conn.open_a if to == conn.a else conn.open_b
        if conn.closed or not opened:
            return
        self.forests[to].message(conn, msg, self.now)
        self.flush(to)

    def on_closed(self, conn: Conn, x: str) -> None:
        self.forests[x].closed(conn, self.now)
        self.flush(x)

    def on_tick(self, x: str) -> None:
        f = self.forests[x]
        d = f.next_deadline()
        if d is not None and d <= self.now:
            f.tick(self.now)
        self.flush(x)

    def on_close_refused(self, conn: Conn) -> None:
        self.close(conn, retry=self.rng.uniform(*self.refused_retry))

    def on_cut(self) -> None:
        live = [c for c in self.conns.values() if c is not None and not c.closed]
        if live:
            self.close(self.rng.choice(live), retry=self.rng.uniform(0.1, 2.0))

    # -- what it ends as ------------------------------------------------------------------

    def components(self) -> dict[str, str]:
        parent = {x: x for x in self.ids}

        def find(x: str) -> str:
            while parent[x] != x:
                x = parent[x]
            return x

        for a, b in self.edges:
            parent[find(a)] = find(b)
        return {x: find(x) for x in self.ids}


def spanning(sim: Sim) -> None:
    """Every server is linked (through links up at both ends) to every server its
    configured links reach."""
    parent = {x: x for x in sim.ids}

    def find(x: str) -> str:
        while parent[x] != x:
            x = parent[x]
        return x

    for conn in sim.conns.values():
        if conn is not None and not conn.closed and conn.open_a and conn.open_b:
            if sim.forests[conn.a].is_up(conn) and sim.forests[conn.b].is_up(conn):
                parent[find(conn.a)] = find(conn.b)
    comp = sim.components()
    for x in sim.ids:
        for y in sim.ids:
            if comp[x] == comp[y]:
                assert find(x) == find(y), (x, y, sim.up_edges(), sim.refused[-3:])


@st.composite
def topologies(draw):
    n = draw(st.integers(2, 6))
    ids = [f"s{i}" for i in draw(st.permutations(range(n)))]
    pairs = [(a, b) for i, a in enumerate(ids) for b in ids[i + 1:]]
    chosen = draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=len(pairs),
                           unique=True))
    edges = [(a, b) if draw(st.booleans()) else (b, a) for a, b in chosen]
    starts = draw(st.lists(st.floats(0.0, 2.0), min_size=n, max_size=n))
    return ids, edges, starts


@settings(max_examples=60 if not CI else 25, deadline=None, derandomize=CI,
          suppress_health_check=[HealthCheck.too_slow])
@given(topo=topologies(), seed=st.integers(0, 1 << 30), cuts=st.integers(0, 3),
       slow=st.booleans())
def test_links_up_always_form_a_forest_that_spans_what_is_configured(topo, seed, cuts, slow):
    ids, edges, starts = topo
    sim = Sim(ids, edges, random.Random(seed),
              delay=(0.001, 0.3) if slow else (0.0005, 0.01))
    for x, t in zip(ids, starts, strict=True):
        sim.start(x, t)
    sim.run(until=20.0, cuts=cuts)   # (cuts come in the first 10 s)
    sim.run(until=400.0)             # then settle: refused links are retried meanwhile
    spanning(sim)
    # A link refused is a new one: every refusal names a cycle, and no link up was ever
    # closed but by a cut.
    assert all("would close a cycle" in why for _a, _b, why in sim.refused)


def test_a_new_link_that_would_close_a_cycle_is_refused_and_the_tree_is_untouched():
    """The issue's X; Y --link X; Z --link X --link Y, one after the other."""
    sim = Sim(["x", "y", "z"], [("y", "x"), ("z", "x"), ("z", "y")], random.Random(1))
    sim.start("x", 0.0)
    sim.start("y", 0.0)
    sim.run(until=5.0)
    assert sim.went_up == [("y", "x")]
    sim.start("z", 5.0)
    sim.run(until=300.0)
    # z's two links were checked at once: one went up, the other is refused each time it
    # is tried (every 30-60 s), and y -- x was never disturbed.
    assert sim.went_up[0] == ("y", "x") and len(sim.went_up) == 2
    assert sim.went_up[1] in (("z", "x"), ("z", "y"))
    loser = ("z", "y") if sim.went_up[1] == ("z", "x") else ("z", "x")
    assert {(a, b) for a, b, _why in sim.refused} == {loser}
    assert len(sim.refused) >= 2 * 4  # both ends hear each refusal; tried 4+ times
    assert sim.conns[("y", "x")].closed is False
    why = sim.refused[0][2]
    assert why.startswith("this link would close a cycle: ") and "through from" not in why


def test_two_links_checked_at_once_that_close_a_cycle_together_one_goes_up():
    """a - b and c - d are up; a - c and b - d are checked at the same moment: either
    alone is fine, both would close a cycle.  Never both, never neither, whatever the
    timing."""
    outcomes = set()
    for seed in range(40):
        sim = Sim(["a", "b", "c", "d"], [("b", "a"), ("d", "c")], random.Random(seed),
                  delay=(0.001, 0.2))
        for x in "abcd":
            sim.start(x, 0.0)
        sim.run(until=5.0)
        assert len(sim.went_up) == 2
        sim.edges += [("a", "c"), ("b", "d")]
        sim.on_dial("a", "c")
        sim.on_dial("b", "d")
        sim.run(until=25.0)
        new = [e for e in sim.went_up[2:]]
        assert len(new) == 1, (seed, sim.went_up, sim.refused)
        outcomes.add(new[0])
    assert outcomes == {("a", "c"), ("b", "d")}  # the timing decides which, not a bias


def test_a_link_to_a_server_already_linked_is_refused():
    sim = Sim(["p", "q"], [("p", "q"), ("q", "p")], random.Random(3))
    sim.start("p", 0.0)
    sim.start("q", 0.0)
    sim.run(until=10.0)
    assert len(sim.went_up) == 1 and sim.refused


def test_malformed_tree_messages_are_refused_with_an_error():
    f = Forest("me", random=random.Random(0).random)
    f.opened("L", "peer", dialed=False, nonce="-", now=0.0)
    bad = [
        Record(Symbol("tree-lock"), []),
        Record(LOCK, [Sequence(["a", "b", "a", "n"]), 0, "a"]),      # attempt 0
        Record(LOCK, [Sequence(["b", "a", "a", "n"]), 1, "a"]),      # not in order
        Record(LOCK, [Sequence(["a", "b", "c", "n"]), 1, "a"]),      # dialer not an end
        Record(Symbol("tree-report"), [Sequence(["me", "peer", "me", "n"]), 1,
                                       Sequence(), False, False]),   # report to acceptor
        Record(Symbol("tree-echo"), [Sequence(["a", "b", "a", "n"]), 1, "a",
                                     Sequence([1]), False, False]),  # member not an id
        "not a record",
    ]
    for v in bad:
        with pytest.raises(ForestError):
            f.message("L", v, 0.0)


def test_a_lock_over_a_link_not_up_is_answered_busy():
    f = Forest("me", random=random.Random(0).random)
    f.opened("L", "peer", dialed=False, nonce="-", now=0.0)
    f.message("L", Record(LOCK, [Sequence(["a", "b", "a", "n"]), 1, "a"]), 0.0)
    (link, echo), = f.take_outgoing()
    assert link == "L" and echo.fields[-1] is True and f.lock is None
