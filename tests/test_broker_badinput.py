"""Bad input over real sockets: each bad connection gets an <error ...> and is closed; the
server and every other connection carry on, and nothing else is lost."""

from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from broker_support import (
    Changes,
    RawClient,
    async_test,
    error_messages,
    running_server,
    tcp_address,
    ws_address,
)
from dataspace.client import connect
from dataspace.protocol.wire import Error, parse_packet
from dataspace.values import Decoder, encode, parse


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


NESTED = b"\xb5" * 5000 + b"\x84" * 5000

BEFORE_RESOLVE = [
    (b"\xff\xfe\xfd", "invalid tag"),
    (b"\x84", "unexpected end marker"),
    (encode(parse('"just a string"')), "malformed packet"),
    (encode(parse("[[99 <M 1>]]")), "unknown OID 99"),
    (encode(parse("[[0 <R 5>]]")), "unknown handle"),
    (encode(parse("[[0 <A 1 1>] [0 <A 2 1>]]")), "already in use"),
    (encode(parse("[[0 <Q>]]")), "malformed event"),
    (NESTED, "nested more than"),
    # A header announcing a 5 MB string: refused at once, without buffering it.
    (b"\xb5\xb5\xb0\x00\xb4\xb3\x01M\xb1" + varint(5_000_000) + b"abc", "max_value_size"),
    (encode(parse('[[0 <A <resolve <ref {oid: "root" sig: #x"00"}> #:[0 1]> 1>]]')), "not a sturdyref"),
    (encode(parse('[[0 <A <resolve <ref {oid: "root" sig: #x"000102030405060708090a0b0c0d0e0f"}> #:[0 1]> 1>]]')),
     "invalid signature"),
    (encode(parse('[[0 <A <resolve <ref {oid: "nope" sig: #x"000102030405060708090a0b0c0d0e0f"}> #:[0 1]> 1>]]')),
     "no object"),
    (encode(parse("[[0 <A <resolve 1> 1>]]")), "malformed resolve"),
    (encode(parse("[[0 <M #:[7 7]>]]")), "malformed wire reference"),
    (encode(parse("[[0 <M #:[1 55]>]]")), "reference to unknown OID 55"),
]


@async_test
async def test_bad_input_closes_only_the_bad_connection(tmp_path):
    async with running_server(tmp_path, max_packet_size=1 << 20) as server:
        addr = tcp_address(server)
        good = await connect(addr, server.sturdyref)
        seen = Changes()
        good.observe("<Present $who>", **seen.kw())
        good.observe("<Echo $n>", **seen.kw())
        good.assert_(parse('<Present "good">'))
        await seen.until(lambda s: ("good",) in s.present)

        async def check_alive(i: int) -> None:
            good.send(parse(f"<Echo {i}>"))
            await seen.until(lambda s: (i,) in s.messages())

        for i, (data, fragment) in enumerate(BEFORE_RESOLVE):
            raw = await RawClient.open(addr)
            await raw.send(data)
            msgs = error_messages(await raw.read_until_closed())
            assert msgs and fragment in msgs[-1], (data[:40], msgs)
            raw.close()
            await check_alive(i)

        # The same after a successful resolve, with assertions that must then go away.
        after = [
            (encode(parse("[[1 <R 999>]]")), "unknown handle"),
            (encode(parse("[[1 <A 1 5>] [1 <A 2 5>]]")), "already in use"),
            (encode(parse('[[1 <M "x">]]')) + b"\x00\x01", "invalid tag"),
            (b"\xb5\xb5\xb0\x01\x01\xb4\xb3\x01M\xb2" + varint(2 << 20) + b"\x00" * (2 << 20), "max_value_size"),
        ]
        for j, (data, fragment) in enumerate(after):
            raw = await RawClient.open(addr)
            ref = await raw.resolve(server.sturdyref)
            ref.on_assert(parse(f'<Present "bad-{j}">'), 40)
            await raw.flush_relay()
            await seen.until(lambda s, j=j: (f"bad-{j}",) in s.present)
            raw.writer.write(data)
            msgs = error_messages(await raw.read_until_closed())
            assert msgs and fragment in msgs[-1], msgs
            raw.close()
            await seen.until(lambda s, j=j: (f"bad-{j}",) not in s.present)
            await check_alive(100 + j)

        await good.sync()
        assert set(seen.present) == {("good",)}
        assert server.stats()["connections"] == 1
        assert good.connected
        await good.close()


@async_test
async def test_bad_websocket_messages(tmp_path):
    async with running_server(tmp_path, ws=["127.0.0.1:0"], max_packet_size=64 * 1024) as server:
        url = ws_address(server)
        good = await connect(url, server.sturdyref)
        seen = Changes()
        good.observe("<Echo $n>", **seen.kw())
        await good.sync()
        cases = [
            ("a text message", "text WebSocket message"),
            (encode(parse("[[0 <M 1>]]")) + b"\x80", "after the packet"),
            (encode(parse("[[0 <M 1>]]"))[:-1], "ends in the middle"),
            (encode(parse("[[0 <M 1>]]")) + b"\x00" * 70000, "larger than the limit"),
            (encode(parse("[[42 <M 1>]]")), "unknown OID 42"),
        ]
        for i, (msg, fragment) in enumerate(cases):
            async with ws_connect(url, max_size=None) as ws:
                await ws.send(msg)
                errors = []
                with pytest.raises(ConnectionClosed):
                    while True:
                        data = await asyncio.wait_for(ws.recv(), 20)
                        d = Decoder()
                        d.feed(data)
                        p = parse_packet(d.try_next())
                        if isinstance(p, Error):
                            errors.append(p.message)
                assert errors and fragment in errors[-1], errors
            good.send(parse(f"<Echo {i}>"))
            await seen.until(lambda s, i=i: (i,) in s.messages())
        # Far too large for the WebSocket layer itself: refused there (close code 1009).
        async with ws_connect(url, max_size=None) as ws:
            await ws.send(b"\x00" * (200 * 1024))
            with pytest.raises(ConnectionClosed) as e:
                await asyncio.wait_for(ws.recv(), 20)
            assert e.value.rcvd is not None and e.value.rcvd.code == 1009
        await good.sync()
        assert good.connected
        await good.close()
