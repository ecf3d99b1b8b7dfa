"""Fuzzing the server over real sockets.

Random and mutated packets (before and after resolving the capability, over TCP and
WebSocket, whole or in pieces) are thrown at the server from many connections while three
well-behaved clients keep asserting, observing and exchanging messages.  At the end the
well-behaved clients must have lost nothing and see exactly their state; every fuzz
connection must be gone with everything it asserted; nothing may be logged as an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random

from websockets.asyncio.client import connect as ws_connect

from broker_support import Changes, async_test, running_server, tcp_address, wait, ws_address
from dataspace.client import connect
from dataspace.testing.broker_soak import fuzz_corpus, mutate
from dataspace.values import encode, parse

SEED = int(os.environ.get("FUZZ_SEED", "20251121"))
ROUNDS = int(os.environ.get("FUZZ_ROUNDS", "600"))


def corpus(cap: str) -> list[bytes]:
    """The soak's corpus of valid packets, with a forged resolve before the last one."""
    pool = fuzz_corpus(cap)
    forged = encode(parse('[[0 <A <resolve <ref {oid: "root" sig: #x"00"}> #:[0 1]> 1>]]'))
    return [*pool[:-1], forged, pool[-1]]


def fuzz_bytes(rng: random.Random, pool: list[bytes]) -> list[bytes]:
    """A few chunks to send on one connection."""
    kind = rng.randrange(4)
    if kind == 0:
        data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    elif kind == 1:
        data = mutate(rng, rng.choice(pool), pool)
    elif kind == 2:  # resolve for real, then valid and mutated packets
        data = pool[0] + b"".join(
            rng.choice(pool[1:12]) if rng.random() < 0.6 else mutate(rng, rng.choice(pool), pool)
            for _ in range(rng.randint(1, 6))
        )
    else:
        data = pool[0] + b"".join(rng.choice(pool[1:12]) for _ in range(rng.randint(1, 6)))
    # Cut into pieces at random points.
    cuts = sorted(rng.sample(range(len(data) + 1), min(len(data) + 1, rng.randint(0, 3))))
    pieces, prev = [], 0
    for c in [*cuts, len(data)]:
        pieces.append(data[prev:c])
        prev = c
    return [p for p in pieces if p]


async def fuzz_tcp(addr: str, chunks: list[bytes]) -> None:
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for c in chunks:
            writer.write(c)
            await writer.drain()
        # Read what the server answers; stop at its close, or after a short while.
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(0.3):
                while await reader.read(65536):
                    pass
    except ConnectionError:
        pass
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def fuzz_ws(url: str, chunks: list[bytes]) -> None:
    try:
        async with ws_connect(url, max_size=None, open_timeout=10) as ws:
            for c in chunks:
                await ws.send(c)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(0.3):
                    async for _ in ws:
                        pass
    except Exception:
        pass


@async_test
async def test_fuzz_while_good_clients_keep_working(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="dataspace")
    rng = random.Random(SEED)
    async with running_server(tmp_path, ws=["127.0.0.1:0"], max_packet_size=64 * 1024,
                              handshake_timeout=5.0) as server:
        closes = asyncio.Event()
        session = server._session

        def tracked(conn):  # type: ignore[no-untyped-def]
            relay = session(conn)
            conn.on_close.append(lambda _c: closes.set())
            return relay

        server._session = tracked  # type: ignore[method-assign]
        addr, url = tcp_address(server), ws_address(server)
        names = ["c0", "c1", "c2"]
        goods = [await connect(addr if i != 2 else url, server.sturdyref) for i in range(3)]
        members, beats = [], []
        for g, name in zip(goods, names, strict=True):
            m, b = Changes(), Changes()
            g.observe("<Member $who $k>", **m.kw())
            g.observe("<Heartbeat $who $n>", **b.kw())
            members.append(m)
            beats.append(b)
            for k in range(5):
                g.assert_(parse(f'<Member "{name}" {k}>'))
        for m in members:
            await m.until(lambda s: len(s.present) == 15)

        stop = asyncio.Event()
        sent = [0, 0, 0]

        async def heartbeat(i: int) -> None:
            g = goods[i]
            while not stop.is_set():
                with g.turn():
                    g.send(parse(f'<Heartbeat "{names[i]}" {sent[i]}>'))
                sent[i] += 1
                await g.sync()

        hb = [asyncio.ensure_future(heartbeat(i)) for i in range(3)]
        pool = corpus(str(server.sturdyref))
        sem = asyncio.Semaphore(8)

        async def one() -> None:
            async with sem:
                chunks = fuzz_bytes(rng, pool)
                if rng.random() < 0.15:
                    await fuzz_ws(url, chunks)
                else:
                    await fuzz_tcp(addr, chunks)

        await asyncio.gather(*(one() for _ in range(ROUNDS)))
        stop.set()
        await asyncio.gather(*hb)
        for g in goods:
            await g.sync()
        # Every fuzz connection is gone, and everything it asserted with it.
        await wait(lambda: len(server.connections) == 3, closes, timeout=30)
        for g in goods:
            await g.sync()
        for i, b in enumerate(beats):
            for j, name in enumerate(names):
                got = [n for who, n in b.messages() if who == name]
                assert got == list(range(len(got))), (i, name)  # in order, no gaps
                if j == i:
                    assert len(got) == sent[j]  # own heartbeats all came back
        for m in members:
            assert set(m.present) == {(n, k) for n in names for k in range(5)}
        root = server.dataspaces["root"].assertions()
        assert len(root) == 15 + 3 * 2, [a for a in root if "Fuzz" in str(a)][:5]
        assert all(g.connected for g in goods) and sum(sent) > 0
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        for g in goods:
            await g.close()
