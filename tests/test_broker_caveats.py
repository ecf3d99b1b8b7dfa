"""What a capability with caveats reveals, and what its holder can do with it (issue 9,
item 1): references learned through an attenuated capability carry its caveats, and the
observers of other subscriptions are opaque to it."""

from __future__ import annotations

import asyncio

from broker_support import Changes, async_test, running_server, tcp_address
from dataspace.client import connect
from dataspace.dataspace import Entity
from dataspace.protocol.sturdy import attenuate
from dataspace.values import Embedded, Record, Symbol, parse

OBSERVE_ONLY = parse("<rewrite <bind <rec Observe [<_> <_>]>> <ref 0>>")
REPLY_TOO = parse(
    "<or [<rewrite <bind <rec Observe [<_> <_>]>> <ref 0>> "
    "<rewrite <bind <rec Reply [<_>]>> <ref 0>>]>"
)


async def learn_observers(ds, pattern: str = "<Observe $p $o>") -> tuple[Changes, asyncio.Event]:
    seen = Changes()
    ds.observe(pattern, **seen.kw())
    await ds.sync()
    return seen, seen.event


async def settle(*clients) -> None:
    """Everything each client sent before has been applied, and what the server sent
    because of it has reached the others (a sync per client, in order)."""
    for c in clients:
        await c.sync()
    for c in clients:
        await c.sync()


@async_test
async def test_an_observe_only_capability_cannot_make_another_clients_callbacks_fire(tmp_path):
    async with running_server(tmp_path) as server:
        addr = tcp_address(server)
        victim = await connect(addr, server.sturdyref)
        heard = Changes()
        victim.observe("<Says $who $text>", **heard.kw())
        await victim.sync()

        spy = await connect(addr, attenuate(server.sturdyref, OBSERVE_ONLY))
        seen = Changes()
        spy.observe("<Observe $p $o>", **seen.kw())
        # The spy sees the victim's subscription (observing is what its caveat allows).
        await seen.until(lambda s: any(isinstance(c[1], Embedded) for c in s.present))
        refs = [c[1].value for c in seen.present]
        for ref in refs:
            ref.on_message(parse('<Says "admin" "forged message">'))
            ref.on_message(parse('["admin" "forged message"]'))  # the captures' own shape
            ref.on_assert(parse('["admin" "forged assertion"]'), 77)
            ref.on_assert(Record(Symbol("Observe"), [parse("<bind <_>>"), Embedded(Entity())]), 78)
        # Through the dataspace, as before, the caveat refuses it.
        spy.send(parse('<Says "admin" "through the dataspace">'))
        await settle(spy, victim)
        assert heard.log == [], heard.log
        await spy.close()
        await victim.close()


@async_test
async def test_observers_stay_distinguishable_and_their_going_is_seen(tmp_path):
    async with running_server(tmp_path) as server:
        addr = tcp_address(server)
        victim = await connect(addr, server.sturdyref)
        spy = await connect(addr, attenuate(server.sturdyref, OBSERVE_ONLY))
        seen = Changes()
        spy.observe("<Observe <group <rec Says> $fields> $o>", **seen.kw())
        s1 = victim.observe("<Says $who $text>")
        victim.observe("<Says \"bob\" $text>")
        await seen.until(lambda s: len(s.present) == 2)
        s1.cancel()
        await seen.until(lambda s: len(s.present) == 1)
        assert len([e for e in seen.log if e[0] == "-"]) == 1
        await spy.close()
        await victim.close()


@async_test
async def test_references_learned_through_caveats_carry_them(tmp_path):
    """A service asserts <Service #:reply>; a holder allowed to send <Reply _> can answer
    through the reference it learned, and nothing else."""
    async with running_server(tmp_path) as server:
        addr = tcp_address(server)
        service = await connect(addr, server.sturdyref)
        got: list = []
        arrived = asyncio.Event()

        class Reply(Entity):
            def on_message(self, value):
                got.append(value)
                arrived.set()

        service.assert_(Record(Symbol("Service"), [Embedded(Reply())]))
        await service.sync()
        client = await connect(addr, attenuate(server.sturdyref, REPLY_TOO))
        seen = Changes()
        client.observe("<Service $k>", **seen.kw())
        await seen.until(lambda s: bool(s.present))
        (k,) = next(iter(seen.present))
        k.value.on_message(parse('<Says "admin" "not allowed">'))
        k.value.on_message(parse("<Reply 42>"))
        await asyncio.wait_for(arrived.wait(), 20)
        await settle(client, service)
        assert got == [parse("<Reply 42>")]
        await client.close()
        await service.close()


@async_test
async def test_the_root_capability_is_full_authority(tmp_path):
    """Without caveats nothing is wrapped: the holder of the root capability reaches the
    observer itself (as in Syndicate); this is what attenuation takes away."""
    async with running_server(tmp_path) as server:
        addr = tcp_address(server)
        victim = await connect(addr, server.sturdyref)
        heard = Changes()
        victim.observe("<Says $who $text>", **heard.kw())
        admin = await connect(addr, server.sturdyref)
        seen = Changes()
        admin.observe("<Observe <group <rec Says> $f> $o>", **seen.kw())
        await seen.until(lambda s: bool(s.present))
        (_f, o) = next(iter(seen.present))
        o.value.on_message(parse('["admin" "direct"]'))
        await heard.until(lambda h: ("!", ("admin", "direct")) in h.log)
        await admin.close()
        await victim.close()


@async_test
async def test_a_caveat_can_restrict_what_its_holder_is_told(tmp_path):
    """The <attenuate> template in a caveat wraps the holder's own observer: here it is
    never told what mallory says (the observer hears capture sequences)."""
    caveat = parse(
        "<rewrite <rec Observe [<bind <_>> <bind Embedded>]> "
        "<rec Observe [<ref 0> <attenuate <ref 1> [<reject <arr [<lit \"mallory\"> <_>]>>]>]>>"
    )
    async with running_server(tmp_path) as server:
        addr = tcp_address(server)
        talker = await connect(addr, server.sturdyref)
        reader = await connect(addr, attenuate(server.sturdyref, caveat))
        heard = Changes()
        reader.observe("<Says $who $text>", **heard.kw())
        await reader.sync()
        talker.send(parse('<Says "mallory" "psst">'))
        talker.send(parse('<Says "alice" "hi">'))
        talker.assert_(parse('<Says "mallory" "held">'))
        talker.assert_(parse('<Says "bob" "held">'))
        await heard.until(lambda h: ("bob", "held") in h.present and ("!", ("alice", "hi")) in h.log)
        await settle(talker, reader)
        assert all(c[0] != "mallory" for _k, c in heard.log), heard.log
        await reader.close()
        await talker.close()
