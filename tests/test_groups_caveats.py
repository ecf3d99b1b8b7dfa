"""Groups and capabilities with caveats (issue 31, phase 3): a member that joined through
an attenuated capability is told its jobs and messages through those caveats, as an
``<Observe>`` observer is -- the references in what it is told carry them -- and a
client's member claims a weight of at most 100."""

from __future__ import annotations

import asyncio

from broker_support import Changes, async_test, running_server, tcp_address
from dataspace.client import connect
from dataspace.dataspace import Entity
from dataspace.groups import Groups, member_record
from dataspace.protocol.sturdy import attenuate
from dataspace.values import Embedded, Record, Symbol, parse

GROUP_AND_REPLY = parse(
    "<or [<rewrite <bind <rec ObserveGroup [<_> <_> <_>]>> <ref 0>> "
    "<rewrite <bind <rec Reply [<_>]>> <ref 0>>]>"
)


class Reply(Entity):
    def __init__(self) -> None:
        self.got: list = []
        self.arrived = asyncio.Event()

    def on_message(self, value):
        self.got.append(value)
        self.arrived.set()


@async_test
async def test_a_member_joined_through_caveats_learns_references_that_carry_them(tmp_path):
    """A service holds <Job #:reply> (a job and a message); a worker whose capability
    allows joining groups and sending <Reply _> takes the job and hears the message: it
    can answer through the references it learned, and nothing else.  (Before the fix it
    was given the service's reference itself, with full authority.)"""
    async with running_server(tmp_path) as server:
        addr = tcp_address(server)
        service = await connect(addr, server.sturdyref)
        reply = Reply()
        service.assert_(Record(Symbol("Job"), [Embedded(reply)]))
        await service.sync()
        worker = await connect(addr, attenuate(server.sturdyref, GROUP_AND_REPLY))
        seen = Changes()
        worker.observe("<Job $k>", group="g", **seen.kw())
        await seen.until(lambda s: bool(s.present))
        service.send(Record(Symbol("Job"), [Embedded(reply)]))
        await seen.until(lambda s: bool(s.messages()))
        (k,) = next(iter(seen.present))
        (m,) = seen.messages()[0]
        for ref in (k.value, m.value):
            ref.on_message(parse('<Says "admin" "not allowed">'))
        k.value.on_message(parse("<Reply 42>"))
        m.value.on_message(parse("<Reply 43>"))
        await worker.sync()
        await asyncio.wait_for(reply.arrived.wait(), 20)
        await service.sync()
        await worker.sync()
        await service.sync()
        assert sorted(reply.got, key=repr) == [parse("<Reply 42>"), parse("<Reply 43>")]
        # The member is the worker's own observer, wrapped: the server's group has it.
        (st,) = Groups.of(server.dataspaces["root"]).stats()
        assert len(st["members"]) == 1 and st["members"][0]["jobs"] == 1
        await worker.close()
        await service.close()


@async_test
async def test_a_client_claims_a_weight_of_at_most_100(tmp_path):
    """weight: 100 counts as 100 members; 101 is refused (the record is ignored, with a
    line in the server's log): a client cannot take a busy group's whole share."""
    async with running_server(tmp_path) as server:
        addr = tcp_address(server)
        c = await connect(addr, server.sturdyref)
        heavy, light, greedy = Reply(), Reply(), Reply()
        ds = server.dataspaces["root"]
        c.assert_(member_record("w", "<Job $i>", heavy, weight=100))
        c.assert_(member_record("w", "<Job $i>", light))
        rec = member_record("w", "<Job $i>", greedy)
        c.assert_(Record(rec.label, [*rec.fields, parse("{weight: 101}")]))
        await c.sync()
        groups = Groups.of(ds)
        (st,) = groups.stats()
        assert sorted(m["weight"] for m in st["members"]) == [1, 100]
        assert groups.malformed == 1
        for i in range(101):
            c.send(Record(Symbol("Job"), [i]))
        await c.sync()
        await asyncio.wait_for(light.arrived.wait(), 20)
        await c.sync()
        assert (len(heavy.got), len(light.got), len(greedy.got)) == (100, 1, 0)
        await c.close()
