"""Bounded memory: a fast publisher and a consumer that stops reading.

The publisher is back-pressured (the server stops reading it once its debt is over the
limit), then the consumer is disconnected -- at the send-queue limit, or when its queue
has not drained for ``send_timeout`` -- which releases the publisher.
"""

from __future__ import annotations

import asyncio

from broker_support import Changes, RawClient, async_test, running_server, tcp_address
from dataspace.client import RemoteDataspace, connect
from dataspace.dataspace import Entity
from dataspace.net.connection import Connection
from dataspace.values import Embedded, Record, Symbol, parse

BLOB = b"x" * 16384


def server_side(server, ds: RemoteDataspace) -> Connection:
    port = ds._conn.transport.get_extra_info("sockname")[1]  # type: ignore[union-attr]
    return next(c for c in server.connections if c.name.endswith(f":{port}"))


async def stalled_consumer(server) -> RawClient:
    """Resolves, asserts <Present "consumer">, subscribes to <Data _>, then never reads."""
    raw = await RawClient.open(tcp_address(server), rcvbuf=4096)
    ref = await raw.resolve(server.sturdyref)
    pattern = parse("<group <rec Data> {0: <bind <_>>}>")
    observer = Entity()  # never reached: we stop reading
    ref.on_assert(Record(Symbol("Observe"), [pattern, Embedded(observer)]), 2)
    ref.on_assert(parse('<Present "consumer">'), 3)
    await raw.flush_relay()
    return raw


async def publish(ds: RemoteDataspace, n: int, progress: list[int]) -> None:
    for i in range(n):
        ds.send(Record(Symbol("Data"), [BLOB]))
        progress[0] = i + 1
        await ds.drain()


@async_test
async def test_slow_consumer_back_pressure_then_send_timeout(tmp_path):
    async with running_server(tmp_path, max_debt=64 * 1024, max_send_queue=8 << 20,
                              send_timeout=1.0) as server:
        addr = tcp_address(server)
        watcher = await connect(addr, server.sturdyref)
        seen = Changes()
        watcher.observe("<Present $who>", **seen.kw())
        consumer = await stalled_consumer(server)
        await seen.until(lambda s: ("consumer",) in s.present)

        pub = await connect(addr, server.sturdyref)
        await pub.sync()
        account = server_side(server, pub).account
        paused, resumed = asyncio.Event(), asyncio.Event()
        on_pause, on_resume = account.on_pause, account.on_resume

        def pause() -> None:
            paused.set()
            on_pause()  # type: ignore[misc]

        def resume() -> None:
            resumed.set()
            on_resume()  # type: ignore[misc]

        account.on_pause, account.on_resume = pause, resume
        consumer_conn = next(c for c in server.connections if c.account is not account
                             and c.name != server_side(server, watcher).name)
        progress = [0]
        task = asyncio.ensure_future(publish(pub, 3000, progress))
        # 1. Back-pressure: the publisher's debt goes over the limit; it is no longer read.
        await asyncio.wait_for(paused.wait(), 20)
        assert consumer_conn.queued <= 8 << 20
        stuck_at = progress[0]
        assert stuck_at < 3000
        # 2. The consumer does not drain for send_timeout: it is disconnected, and what it
        #    asserted is retracted.
        await seen.until(lambda s: ("consumer",) not in s.present)
        # It is the send timeout that closed it, not the (8 MiB) queue limit.
        assert consumer_conn.closed
        assert "slow consumer: nothing could be sent for 1 s" in (consumer_conn.close_reason or "")
        # 3. The publisher's debt is repaid: it is read again and finishes.
        await asyncio.wait_for(resumed.wait(), 20)
        await asyncio.wait_for(task, 60)
        await pub.sync()
        assert progress[0] == 3000
        assert account.debt == 0 and not account.paused
        consumer.close()
        for c in (pub, watcher):
            await c.close()


@async_test
async def test_slow_consumer_disconnected_at_the_queue_limit(tmp_path):
    async with running_server(tmp_path, max_debt=64 << 20, max_send_queue=512 * 1024,
                              send_timeout=60.0) as server:
        addr = tcp_address(server)
        watcher = await connect(addr, server.sturdyref)
        seen = Changes()
        watcher.observe("<Present $who>", **seen.kw())
        consumer = await stalled_consumer(server)
        await seen.until(lambda s: ("consumer",) in s.present)
        watcher_name = server_side(server, watcher).name
        consumer_conn = next(c for c in server.connections if c.name != watcher_name)
        pub = await connect(addr, server.sturdyref)
        progress = [0]
        task = asyncio.ensure_future(publish(pub, 400, progress))
        await seen.until(lambda s: ("consumer",) not in s.present)
        # It is the queue limit that closed it, not the (60 s) send timeout.
        assert consumer_conn.closed
        assert "slow consumer: more than 524288 bytes waiting" in (consumer_conn.close_reason or "")
        await asyncio.wait_for(task, 60)
        await pub.sync()
        assert len(server.connections) == 2  # watcher and publisher remain
        assert progress[0] == 400
        consumer.close()
        for c in (pub, watcher):
            await c.close()


@async_test
async def test_many_messages_fan_out_with_bounded_queues(tmp_path):
    """Ten subscribers that do read keep up: nobody is disconnected, nothing is lost."""
    async with running_server(tmp_path, max_debt=256 * 1024) as server:
        addr = tcp_address(server)
        subs = [await connect(addr, server.sturdyref) for _ in range(10)]
        counts = [0] * 10
        done = asyncio.Event()

        def counter(i: int):
            def on(n: int) -> None:
                counts[i] += 1
                if all(c == 2000 for c in counts):
                    done.set()
            return on

        for i, s in enumerate(subs):
            s.observe("<Tick $n>", on_message=counter(i))
            await s.sync()
        pub = await connect(addr, server.sturdyref)
        for i in range(2000):
            pub.send(parse(f"<Tick {i}>"))
            if i % 100 == 0:
                await pub.drain()
        await asyncio.wait_for(done.wait(), 60)
        assert server.stats()["connections"] == 11
        for s in [*subs, pub]:
            await s.close()
