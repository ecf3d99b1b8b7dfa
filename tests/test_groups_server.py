"""Groups of observers served by one server (issue 31, phase 2): remote clients join with
``observe(..., group=NAME)`` (the ``<ObserveGroup ...>`` record), share messages one each
and jobs one member each; a closed connection's memberships end when it closes."""

from __future__ import annotations

import asyncio

import dataspace.groups as groups_module
from broker_support import Changes, async_test, running_server, tcp_address
from dataspace.client import connect
from dataspace.groups import Groups
from dataspace.pattern import parse_pattern, to_preserves
from dataspace.values import Record, Symbol, parse


def job(i: int) -> Record:
    return Record(Symbol("Job"), [i])


def jobs_of(c: Changes) -> set[int]:
    return {caps[0] for caps in c.present}


@async_test
async def test_remote_members_share_messages_and_jobs(tmp_path):
    async with running_server(tmp_path) as server:
        addr, cap = tcp_address(server), server.sturdyref
        workers = [await connect(addr, cap) for _ in range(3)]
        seen = [Changes() for _ in workers]
        for w, c in zip(workers, seen):
            w.observe("<Job $id>", group="resize", **c.kw())
            await w.sync()
        plain = Changes()
        producer = await connect(addr, cap)
        producer.observe("<Job $id>", **plain.kw())
        # A producer watching interest sees one plain <Observe <Job $id> ...> for the
        # group (its dispatcher), beside the plain observer's.
        interest = Changes()
        producer.observe("<Observe $pattern $who>", **interest.kw())
        await producer.sync()
        wire = to_preserves(parse_pattern("<Job $id>"))
        await interest.until(lambda c: sum(1 for p in c.present if p[0] == wire) == 2)

        # Messages: one member each, round-robin (an equal share); plain observers all.
        for i in range(30):
            producer.send(job(i))
        await producer.sync()
        await plain.until(lambda c: len(c.messages()) == 30)
        await asyncio.gather(*(c.until(lambda c: len(c.messages()) == 10) for c in seen))
        got = sorted(m[0] for c in seen for m in c.messages())
        assert got == list(range(30))

        # Jobs: each assertion to one member, least loaded first.
        handles = {i: producer.assert_(job(i)) for i in range(100, 106)}
        await producer.sync()
        await asyncio.gather(*(c.until(lambda c: len(c.present) == 2) for c in seen))
        held = [jobs_of(c) for c in seen]
        assert sorted(j for h in held for j in h) == list(range(100, 106))
        assert not plain.messages()[30:]
        # Its holder retracts a job: its member alone is told.
        holder = next(k for k, h in enumerate(held) if 100 in h)
        producer.retract(handles.pop(100))
        await seen[holder].until(lambda c: 100 not in jobs_of(c))
        await producer.sync()
        for w in workers:
            await w.sync()
        assert [jobs_of(c) for c in seen] == [h - {100} for h in held]

        # The server's view: one group, three members, messages and jobs per member.
        (st,) = Groups.of(server.dataspaces["root"]).stats()
        assert st["group"] == "resize" and st["pattern"] == "<Job $>"
        assert [m["messages"] for m in st["members"]] == [10, 10, 10]
        assert sorted(m["jobs"] for m in st["members"]) == [1, 2, 2]
        assert st["reassigned"] == 0

        # A member leaves (closes): its jobs move to the others, who are told.
        gone = held[0] - {100}
        await workers[0].close()
        await asyncio.gather(*(c.until(lambda c: sum(map(len, (c.present for c in seen[1:])))
                                       == 5) for c in seen[1:]))
        assert jobs_of(seen[1]) | jobs_of(seen[2]) == set(range(101, 106))
        assert gone <= jobs_of(seen[1]) | jobs_of(seen[2])
        assert not jobs_of(seen[1]) & jobs_of(seen[2])
        # ... and messages go to the two left only.
        for i in range(10):
            producer.send(job(i))
        await producer.sync()
        await asyncio.gather(*(c.until(lambda c: len(c.messages()) == 15) for c in seen[1:]))
        assert len(seen[0].messages()) == 10
        (st,) = Groups.of(server.dataspaces["root"]).stats()
        assert len(st["members"]) == 2 and st["reassigned"] == len(gone)

        # Leaving by cancel (the connection stays): its jobs move.
        (sub,) = workers[1]._subs
        assert jobs_of(seen[1])
        sub.cancel()
        await seen[2].until(lambda c: jobs_of(c) == set(range(101, 106)))
        for w in workers[1:]:
            await w.close()
        # Every member gone: the group is gone, its dispatcher stopped observing.
        await interest.until(lambda c: sum(1 for p in c.present if p[0] == wire) == 1)
        assert Groups.of(server.dataspaces["root"]).stats() == []
        await producer.close()


@async_test
async def test_a_closing_connection_leaves_its_groups_at_once(tmp_path):
    """A worker holding more assertions than a closing connection's first chunk of
    retractions: its <ObserveGroup> record goes later, but its membership ends -- and
    its jobs move -- as its connection closes (Server._closed reaps the groups)."""
    async with running_server(tmp_path) as server:
        addr, cap = tcp_address(server), server.sturdyref
        ds = server.dataspaces["root"]
        groups = Groups.of(ds)
        a_seen, b_seen = Changes(), Changes()
        a = await connect(addr, cap)
        a.observe("<Job $id>", group="g", **a_seen.kw())
        await a.sync()
        before = set(server.connections)
        b = await connect(addr, cap)
        b.observe("<Job $id>", group="g", **b_seen.kw())
        with b.turn():  # more than one chunk of retractions (5,000) on close
            for i in range(6000):
                b.assert_(Record(Symbol("Filler"), [i]))
        await b.sync()
        (b_conn,) = set(server.connections) - before
        producer = await connect(addr, cap)
        for i in range(10):
            producer.assert_(job(i))
        await producer.sync()
        await b_seen.until(lambda c: len(c.present) == 5)
        await a_seen.until(lambda c: len(c.present) == 5)

        at_close: list[tuple[bool, list[int]]] = []

        def check(_conn):  # runs right after the server's own close callback
            (st,) = groups.stats()
            at_close.append((b_conn.relay.retracting,
                             [m["jobs"] for m in st["members"]]))

        b_conn.on_close.append(check)
        await b.close()
        await a_seen.until(lambda c: len(c.present) == 10)
        # When the connection closed, its records were still being retracted, and yet
        # the group had one member left, holding every job.
        assert at_close == [(True, [10])]
        await a.close()
        await producer.close()


def test_messages_are_routed_on_their_bytes_to_members(tmp_path, monkeypatch):
    """A message from a peer reaches a remote member as the bytes it came in as: the
    dispatcher is one of the router's sinks, and nothing is decoded for it."""
    calls: dict[str, int] = {}

    def counting(name: str):
        fn = getattr(groups_module._Dispatcher, name)

        def counted(self, *args):
            calls[name] = calls.get(name, 0) + 1
            return fn(self, *args)

        return counted

    for name in ("on_message", "send_body", "emit_captures", "emit_run"):
        monkeypatch.setattr(groups_module._Dispatcher, name, counting(name))
    monkeypatch.setattr(groups_module, "decode", None)  # (a call would fail)
    asyncio.run(asyncio.wait_for(_routed_on_bytes(tmp_path), 60))
    assert calls.get("emit_captures", 0) + calls.get("emit_run", 0) > 0
    assert "on_message" not in calls


async def _routed_on_bytes(tmp_path):
    async with running_server(tmp_path) as server:
        addr, cap = tcp_address(server), server.sturdyref
        ds = server.dataspaces["root"]
        w = [Changes(), Changes()]
        clients = [await connect(addr, cap) for _ in w]
        for c, ch in zip(clients, w):
            c.observe("<Say $who $what>", group="g", **ch.kw())
            await c.sync()
        producer = await connect(addr, cap)
        for i in range(20):
            producer.send(parse(f'<Say "p" {i} "extra field">'))
        await producer.sync()
        await asyncio.gather(*(ch.until(lambda c: len(c.messages()) == 10) for ch in w))
        assert sorted(m[1] for ch in w for m in ch.messages()) == list(range(20))
        assert ds.router.stats.routed >= 20
        disp = [o for _v, _p, o, _d, _h in ds.observers()]
        assert len(disp) == 1 and "group 'g'" in repr(disp[0])
        for c in (*clients, producer):
            await c.close()


@async_test
async def test_in_process_members_of_a_server_dataspace(tmp_path):
    """In-process code in the server's process joins a group of a server's dataspace
    beside remote members (callbacks run after the turn that routed the message)."""
    async with running_server(tmp_path) as server:
        addr, cap = tcp_address(server), server.sturdyref
        ds = server.dataspaces["root"]
        local: list[int] = []
        ds.observe("<Job $id>", on_message=local.append, group="mixed")
        remote = Changes()
        c = await connect(addr, cap)
        c.observe("<Job $id>", group="mixed", **remote.kw())
        await c.sync()
        producer = await connect(addr, cap)
        for i in range(10):
            producer.send(job(i))
        await producer.sync()
        await remote.until(lambda r: len(r.messages()) == 5)
        assert sorted(local + [m[0] for m in remote.messages()]) == list(range(10))
        assert len(local) == 5
        await c.close()
        await producer.close()
