"""Groups across a cluster and its leaves (issue 31, phase 3), on real servers on
loopback: three cluster members (A, B, C) and a leaf linked to A, in this process.

A property test against a model on random schedules -- workers joining any server,
leaving, dying; jobs held (several holders, on several servers) and dropped; messages
sent at any server: once settled, every server counts every live worker, each job held
anywhere is assigned to exactly one live worker (a dead or departed worker's jobs
moved), one server coordinates, and each message reaches exactly one worker.  The
rules themselves are tested on a simulated cluster in test_protocol_groups.py; servers
killed and silenced are in test_groups_failover.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from broker_support import Changes, running_server, tcp_address
from dataspace.broker import Server
from dataspace.client import RemoteDataspace, connect
from dataspace.datadir import KEY_BYTES
from dataspace.groups import Groups
from dataspace.pattern import parse_pattern
from dataspace.testing.common import write_secret
from dataspace.values import Record, Symbol

PATTERN = parse_pattern("<Job $id>")
SERVERS = ("A", "B", "C", "L")
SETTLE = 20.0
EXAMPLES = 25


def job(i: int) -> Record:
    return Record(Symbol("Job"), [i])


class Worker:
    def __init__(self, at: int, client: RemoteDataspace, changes: Changes, sub: Any) -> None:
        self.at = at
        self.client = client
        self.changes = changes
        self.sub = sub
        self.state = "live"  # or "left" (cancelled, still connected) or "dead"
        self.got: Counter[int] = Counter()  # messages, by id


class Net:
    """Three members and a leaf, the workers and holders of one schedule, and the
    model: who is live, what is held, what was sent."""

    def __init__(self, servers: list[Server]) -> None:
        self.servers = servers
        self.event = asyncio.Event()
        for s in servers:
            s.links["root"].groups.on_change.append(self.event.set)
            for h in s.links.values():
                h.on_change.append(self.event.set)
        self.workers: list[Worker] = []
        self.holders: list[RemoteDataspace] = []
        self.held: list[tuple[int, int, Any]] = []  # (job, server, handle)
        self.sent = 0
        self.next_id = 10_000

    async def start_holders(self) -> None:
        self.holders = [await connect(tcp_address(s), s.sturdyref, name=f"holder-{x}")
                        for s, x in zip(self.servers, SERVERS)]

    def groups(self, s: Server) -> Groups:
        return Groups.of(s.dataspaces["root"])

    def live(self) -> list[Worker]:
        return [w for w in self.workers if w.state == "live"]

    # -- steps ---------------------------------------------------------------------------

    async def join(self, at: int) -> None:
        s = self.servers[at]
        c = await connect(tcp_address(s), s.sturdyref, reconnect=False,
                          name=f"worker-{len(self.workers)}")
        ch = Changes()
        ch.event = self.event  # (one event for the whole net)
        w = Worker(at, c, ch, None)

        def heard(i: int) -> None:
            w.got[i] += 1
            self.event.set()

        w.sub = c.observe("<Job $id>", on_assert=ch.on_assert, on_retract=ch.on_retract,
                          on_message=heard, group="g")
        await c.sync()
        self.workers.append(w)

    async def leave(self, k: int) -> None:
        live = self.live()
        if live:
            w = live[k % len(live)]
            w.state = "left"
            w.sub.cancel()
            await w.client.sync()

    async def die(self, k: int) -> None:
        live = self.live()
        if live:
            w = live[k % len(live)]
            w.state = "dead"
            await w.client.close()

    async def hold(self, j: int, at: int) -> None:
        c = self.holders[at]
        self.held.append((j, at, c.assert_(job(j))))
        await c.sync()

    async def drop(self, k: int) -> None:
        if self.held:
            _j, at, h = self.held.pop(k % len(self.held))
            self.holders[at].retract(h)
            await self.holders[at].sync()

    async def send(self, at: int, n: int) -> None:
        """``n`` messages entering at server ``at``, once settled: each reaches exactly
        one live worker (none if there is none)."""
        before = sum(sum(w.got.values()) for w in self.workers)
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        c = self.holders[at]
        for i in ids:
            c.send(job(i))
        await c.sync()
        if self.live():
            self.sent += n
            await self.until(lambda: sum(sum(w.got.values()) for w in self.workers)
                             >= before + n, f"{n} messages sent at {SERVERS[at]}")
            for i in ids:
                got = [w for w in self.workers if w.got[i]]
                assert len(got) == 1 and got[0].got[i] == 1 and got[0].state == "live", \
                    (i, [(w.at, w.state, w.got[i]) for w in got])

    # -- the model's checks --------------------------------------------------------------

    def unsettled(self) -> str | None:
        """None when settled, else what is not."""
        live = self.live()
        for s, x in zip(self.servers, SERVERS):
            g = self.groups(s).group("g", PATTERN)
            weight = g.node.weight() if g is not None else 0
            if weight != len(live):
                return f"{x} counts {weight} members, {len(live)} are live"
        held = {j for j, _at, _h in self.held}
        owners: dict[int, list[int]] = {}
        for k, w in enumerate(live):
            for (j,), n in w.changes.present.items():
                if n != 1:
                    return f"worker {k} told of job {j} {n} times"
                owners.setdefault(j, []).append(k)
        for j in held:
            if len(owners.get(j, [])) != (1 if live else 0):
                return f"job {j} held by workers {owners.get(j)}"
        for j in owners:
            if j not in held:
                return f"finished job {j} still held by {owners[j]}"
        if live:
            coordinators = [x for s, x in zip(self.servers, SERVERS)
                            if self.groups(s).group("g", PATTERN).node.coordinating]
            if coordinators != ["A"]:  # (the oldest member; a leaf never coordinates)
                return f"coordinators: {coordinators}"
        return None

    async def until(self, pred: Any, what: str, timeout: float = SETTLE) -> None:
        async def loop() -> None:
            while not pred():
                self.event.clear()
                await self.event.wait()

        try:
            await asyncio.wait_for(loop(), timeout)
        except TimeoutError:
            raise AssertionError(f"not within {timeout:g} s: {what}") from None

    async def settle(self) -> None:
        why: list[str | None] = [None]

        def ok() -> bool:
            why[0] = self.unsettled()
            return why[0] is None

        try:
            await self.until(ok, "settled")
        except AssertionError:
            raise AssertionError(f"not settled within {SETTLE:g} s: {why[0]}") from None

    async def run(self, steps: list[tuple[Any, ...]]) -> None:
        await self.settle()
        for step in steps:
            await getattr(self, step[0])(*step[1:])
            await self.settle()
        # Nothing delivered twice, ever (a late duplicate shows here).
        for w in self.workers:
            assert all(n == 1 for n in w.got.values()), w.got

    async def reset(self) -> None:
        """End the schedule: every worker and holding gone, every group forgotten."""
        for w in self.workers:
            if w.state != "dead":
                await w.client.close()
        for _j, at, h in self.held:
            self.holders[at].retract(h)
        for c in self.holders:
            await c.sync()
        self.workers.clear()
        self.held.clear()
        await self.until(lambda: all(self.groups(s).groups() == [] for s in self.servers),
                         "every server forgot the group")


@contextlib.asynccontextmanager
async def cluster_with_leaf(tmp_path: Path) -> Any:
    secret = write_secret(tmp_path / "cluster.secret")
    key = os.urandom(KEY_BYTES)
    async with contextlib.AsyncExitStack() as stack:
        ms: list[Server] = []
        for x in SERVERS[:3]:
            routes = [ms[0].cluster.address] if ms else []
            ms.append(await stack.enter_async_context(running_server(
                tmp_path / x, cluster="127.0.0.1:0", routes=routes,
                cluster_secret=str(secret), root_key=key)))
        leaf = await stack.enter_async_context(running_server(
            tmp_path / "L", link=[(tcp_address(ms[0]), str(ms[0].sturdyref))], root_key=key))
        net = Net([*ms, leaf])

        def wired() -> bool:
            return [len(s.links["root"].groups.sessions) for s in net.servers] == [3, 2, 2, 1]

        await net.until(wired, "the cluster meshed and the leaf linked")
        await net.start_holders()
        try:
            yield net
        finally:
            for c in net.holders:
                await c.close()


server_ix = st.integers(0, len(SERVERS) - 1)
joins = st.tuples(st.just("join"), server_ix)
holds = st.tuples(st.just("hold"), st.integers(0, 7), server_ix)
step = st.one_of(
    joins, joins, holds, holds,
    st.tuples(st.just("leave"), st.integers(0, 9)),
    st.tuples(st.just("die"), st.integers(0, 9)),
    st.tuples(st.just("drop"), st.integers(0, 9)),
    st.tuples(st.just("send"), server_ix, st.integers(1, 12)),
)
# Some workers and jobs first, then anything.
steps = st.builds(lambda a, b, c: a + b + c, st.lists(joins, min_size=2, max_size=5),
                  st.lists(holds, min_size=1, max_size=6),
                  st.lists(step, min_size=10, max_size=24))


def test_groups_across_a_cluster_and_its_leaf_against_a_model(tmp_path: Path) -> None:
    loop = asyncio.new_event_loop()
    stack = contextlib.AsyncExitStack()
    try:
        net: Net = loop.run_until_complete(
            asyncio.wait_for(stack.enter_async_context(cluster_with_leaf(tmp_path)), 60))
        examples = 0

        # A few short schedules on the same four servers (each starts from nothing).
        @settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(steps)
        def schedule(steps: list[tuple[Any, ...]]) -> None:
            nonlocal examples
            examples += 1
            try:
                loop.run_until_complete(asyncio.wait_for(net.run(steps), 90))
            finally:
                loop.run_until_complete(asyncio.wait_for(net.reset(), 30))

        schedule()
        assert examples == EXAMPLES
    finally:
        loop.run_until_complete(stack.aclose())
        loop.close()


def test_a_worked_example_with_weights(tmp_path: Path) -> None:
    """Workers on B, C and the leaf; messages entering at each server spread evenly over
    the three (weights: A tells the leaf of the cluster's 2, B of A's 1 and the leaf's);
    jobs held on A and the leaf are one job each; when the worker on the leaf dies its
    jobs move, after which A tells the cluster no one is behind the leaf."""
    async def main() -> None:
        async with cluster_with_leaf(tmp_path) as net:
            for at in (1, 2, 3):
                await net.join(at)
            await net.settle()
            a, b, c, leaf = (net.groups(s).group("g", PATTERN).node for s in net.servers)
            ids = {s.server_id: x for s, x in zip(net.servers, SERVERS)}
            assert {ids[n]: nb.weight for n, nb in a._nbrs.items()} == {"B": 1, "C": 1,
                                                                         "L": 1}
            assert {ids[n]: nb.weight for n, nb in leaf._nbrs.items()} == {"A": 2}
            assert {ids[n]: nb.weight for n, nb in b._nbrs.items()} == {"A": 1, "C": 1}
            for at in range(4):
                await net.send(at, 30)
            for w in net.workers:
                assert sum(w.got.values()) == 40, [sum(w.got.values()) for w in net.workers]
            for j in range(6):
                await net.hold(j, 0)
                await net.hold(j, 3)
            await net.settle()
            assert sorted(len(w.changes.present) for w in net.workers) == [2, 2, 2]
            await net.die(2)
            await net.settle()
            assert sorted(len(w.changes.present) for w in net.live()) == [3, 3]
            assert {ids[n]: nb.weight for n, nb in a._nbrs.items()}["L"] == 0
            assert all(not n.dropped for n in (a, b, c, leaf))
            await net.reset()

    asyncio.run(asyncio.wait_for(main(), 90))


def test_memberships_cross_as_weights_never_as_records(tmp_path: Path) -> None:
    """A's member is counted on B (a weight), but its <ObserveGroup> record never
    crosses: an observer of the records on B sees B's own member only (a record that
    crossed would make A's member a member on B as well: two shares)."""
    async def main() -> None:
        async with cluster_with_leaf(tmp_path) as net:
            await net.join(0)
            await net.join(1)
            await net.settle()
            watcher = net.holders[1]
            seen = Changes()
            watcher.observe("<ObserveGroup $g $p _>", **seen.kw())
            marks = Changes()
            watcher.observe("<Mark $m>", **marks.kw())
            await watcher.sync()
            net.holders[0].assert_(Record(Symbol("Mark"), [1]))  # (crosses A -> B)
            await marks.until(lambda c: bool(c.present))
            for c in (net.holders[0], watcher, net.holders[0], watcher):
                await c.sync()
            assert [(caps[0], n) for caps, n in seen.present.items()] == [("g", 1)]
            g = net.groups(net.servers[1]).group("g", PATTERN)
            assert len(g.node.members()) == 1 and g.node.weight() == 2
            await net.reset()

    asyncio.run(asyncio.wait_for(main(), 90))


def test_only_the_coordinator_asks_for_plain_copies_and_a_new_one_asks_at_once(
        tmp_path: Path) -> None:
    """A message entering at C for a group whose workers are on B and C crosses a route
    only to the coordinator (A, which must see every job) as plain data, and to B only
    when given to B's worker (directed): B's dispatcher asks its neighbours for nothing.
    When A goes, B (the next oldest) coordinates: it asks for the group's pattern then,
    and C's jobs come to it and are assigned."""
    async def main() -> None:
        async with cluster_with_leaf(tmp_path) as net:
            a, b, c, _leaf = net.servers
            await net.join(1)
            await net.join(2)
            for j in range(6):
                await net.hold(j, 2)
            await net.settle()
            routes = {s.peer_id: s for s in c.links["root"].sessions}
            before = {p: s.counters["messages_forwarded"] for p, s in routes.items()}
            await net.send(2, 30)
            plain = {p: s.counters["messages_forwarded"] - before[p]
                     for p, s in routes.items()}
            assert plain == {a.server_id: 30, b.server_id: 0}, plain
            assert [sum(w.got.values()) for w in net.workers] == [15, 15]
            # A goes (its routes close, as for kill -9): B coordinates and pulls C's jobs.
            await a.close()

            def reassigned() -> bool:
                gb = net.groups(b).group("g", PATTERN)
                held = sorted(j for w in net.workers for (j,) in w.changes.present)
                return gb is not None and gb.node.coordinating and held == list(range(6))

            await net.until(reassigned, "B coordinates C's jobs")
            assert sorted(len(w.changes.present) for w in net.workers) == [3, 3]
            for w in net.workers:
                await w.client.close()

    asyncio.run(asyncio.wait_for(main(), 90))
