"""The recorder and emitter through the network client (a real broker on loopback):
the same code as with the in-process Dataspace, since both have the same API."""

from __future__ import annotations

import asyncio

from broker_support import Changes, async_test, running_server, tcp_address
from dataspace.client import connect
from dataspace.streams import Emitter, Recorder, open_store
from dataspace.values import parse


@async_test
async def test_record_from_and_emit_into_a_remote_dataspace(tmp_path, store_url):
    async with running_server(tmp_path) as server:
        recorder_ds = await connect(tcp_address(server), server.sturdyref)
        sender = await connect(tcp_address(server), server.sturdyref)
        listener = await connect(tcp_address(server), server.sturdyref)
        with open_store(store_url) as store:
            rec = Recorder(recorder_ds, "<Says _ _>", store, "chat",
                           events=("message", "assert", "retract"))
            await recorder_ds.sync()
            h = sender.assert_(parse('<Says "alice" "present">'))
            for i in range(20):
                sender.send(parse(f'<Says "bob" "m{i}">'))
            sender.retract(h)
            await sender.sync()
            # Readers wake when the recorder commits (asyncio wait, no polling).
            assert await store.wait_for_async("chat", 21, timeout=20)
            assert await asyncio.to_thread(rec.flush, 20)
            got = [e.value for e in store.read("chat", 0, 100)]
            assert got[0] == parse('<assert <Says "alice" "present">>')
            assert got[1:21] == [parse(f'<message <Says "bob" "m{i}">>') for i in range(20)]
            assert got[21] == parse('<retract <Says "alice" "present">>')
            rec.close()

            # Replay the plain messages into the remote dataspace.
            store.append_many("replay", [parse(f'<Echo {i}>') for i in range(5)])
            heard = Changes()
            listener.observe("<Echo $n>", **heard.kw())
            await listener.sync()
            em = Emitter(store, "replay", sender)
            assert em.pump() == 5
            await sender.sync()
            await heard.until(lambda c: len(c.messages()) == 5)
            assert [m[0] for m in heard.messages()] == [0, 1, 2, 3, 4]
        for c in (recorder_ds, sender, listener):
            await c.close()
