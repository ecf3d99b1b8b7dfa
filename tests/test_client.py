"""Our client (dataspace.client): the Dataspace API over the network, and reconnection."""

from __future__ import annotations

import asyncio
import signal

import pytest

from broker_support import (
    Changes,
    ServerProcess,
    async_test,
    kill,
    read_line_matching,
    running_server,
    spawn,
    tcp_address,
    ws_address,
)
from dataspace.client import (
    CapabilityError,
    CapabilityMissing,
    CapabilityRejected,
    connect,
    load_capability,
)
from dataspace.protocol.sturdy import mint
from dataspace.values import parse


@async_test
async def test_same_api_as_the_in_process_dataspace(tmp_path):
    async with running_server(tmp_path) as server:
        ds = await connect(tcp_address(server), data_dir=tmp_path / "data")
        other = await connect(tcp_address(server), server.sturdyref)
        seen = Changes()
        sub = ds.observe("<Present $who>", **seen.kw())
        await ds.sync()
        # assert_/retract/value_of
        h = other.assert_(parse('<Present "a">'))
        assert other.value_of(h) == parse('<Present "a">')
        await seen.until(lambda s: ("a",) in s.present)
        assert other.retract(h) and not other.retract(h) and other.value_of(h) is None
        await seen.until(lambda s: not s.present)
        # Bag semantics: two handles, one appearance.
        h1 = other.assert_(parse('<Present "b">'))
        h2 = other.assert_(parse('<Present "b">'))
        await other.sync()
        await ds.sync()
        other.retract(h1)
        await other.sync()
        await ds.sync()
        assert seen.present == {("b",): 1}
        other.retract(h2)
        await seen.until(lambda s: not s.present)
        assert [k for k, c in seen.log if c == ("b",)] == ["+", "-"]
        # A turn: made and retracted inside it, never seen; messages in order.
        msgs = Changes()
        ds.observe("<Tick $n>", **msgs.kw())
        await ds.sync()
        with other.turn():
            t = other.assert_(parse('<Present "ghost">'))
            other.retract(t)
            for i in range(5):
                other.send(parse(f"<Tick {i}>"))
        await msgs.until(lambda s: len(s.messages()) == 5)
        assert msgs.messages() == [(i,) for i in range(5)]
        await ds.sync()
        assert ("ghost",) not in [c for _k, c in seen.log]
        # A turn that raises sends nothing.
        with pytest.raises(RuntimeError), other.turn():
            other.assert_(parse('<Present "never">'))
            raise RuntimeError("boom")
        await other.sync()
        await ds.sync()
        assert ("never",) not in [c for _k, c in seen.log]
        # cancel
        sub.cancel()
        other.assert_(parse('<Present "late">'))
        await other.sync()
        await ds.sync()
        assert ("late",) not in [c for _k, c in seen.log]
        await ds.close()
        await other.close()


@async_test
async def test_during_facets_and_failing_callbacks(tmp_path):
    async with running_server(tmp_path) as server:
        ds = await connect(tcp_address(server), server.sturdyref)
        other = await connect(tcp_address(server), server.sturdyref)
        log: list[str] = []
        replies = Changes()
        other.observe("<Welcome $who>", **replies.kw())

        def setup(who):
            log.append(f"start {who}")
            ds.assert_(parse(f'<Welcome "{who}">'))  # lives as long as the presence
            if who == "crash":
                raise ValueError("a bug in a callback")
            return lambda: log.append(f"stop {who}")

        ds.during("<Present $who>", setup)
        await ds.sync()
        h = other.assert_(parse('<Present "x">'))
        await replies.until(lambda s: ("x",) in s.present)
        other.retract(h)
        await replies.until(lambda s: ("x",) not in s.present)
        assert log == ["start x", "stop x"]
        # A failing callback is logged; the client carries on.
        other.assert_(parse('<Present "crash">'))
        await other.sync()
        await ds.sync()
        assert "start crash" in log and ds.connected
        await ds.close()
        await other.close()


@async_test
async def test_connect_errors_say_what_to_do(tmp_path):
    with pytest.raises(ConnectionError, match="start one with `dataspace serve"):
        await connect("127.0.0.1:1", mint("root", b"k"))
    with pytest.raises(ConnectionError, match="dataspace serve --unix"):
        await connect(f"unix:{tmp_path}/nothing.sock", mint("root", b"k"))
    with pytest.raises(CapabilityMissing, match="does not exist") as info:
        load_capability(data_dir=tmp_path / "empty")
    # Python callers are told the Python way, not about the command line's --cap.
    assert "cap=" in str(info.value) and "data_dir=" in str(info.value)
    assert "--" not in str(info.value)
    assert info.value.path == tmp_path / "empty" / "root.sturdyref"
    with pytest.raises(CapabilityError, match="cap="):
        await connect("127.0.0.1:1", data_dir=tmp_path / "empty")
    with pytest.raises(CapabilityError, match="not a usable sturdyref"):
        load_capability("<ref {}>")
    async with running_server(tmp_path) as server:
        with pytest.raises(CapabilityRejected, match="invalid signature"):
            await connect(tcp_address(server), mint("root", b"wrong key"), reconnect=False)


@async_test
async def test_reconnect_after_the_server_is_killed_and_restarted(tmp_path):
    srv = await ServerProcess(tmp_path / "data").start()
    try:
        ds = await connect(srv.address, srv.sturdyref, backoff=(0.02, 0.2))
        other = await connect(srv.address, srv.sturdyref, backoff=(0.02, 0.2))
        seen = Changes()
        ds.observe("<Present $who>", **seen.kw())
        ds.assert_(parse('<Present "me">'))
        other.assert_(parse('<Present "other">'))
        await seen.until(lambda s: set(s.present) == {("me",), ("other",)})
        lost = asyncio.Event()
        ds.on_disconnect.append(lost.set)
        await srv.stop(signal.SIGKILL)
        await asyncio.wait_for(lost.wait(), 20)
        # Observers are told of the gap: everything retracted.
        await seen.until(lambda s: not s.present)
        assert not ds.connected
        ds.send(parse("<Lost>"))
        assert ds.dropped_messages == 1
        await srv.start()  # same port, same data directory, same key
        await ds.wait_connected(30)
        await other.wait_connected(30)
        # Then fresh state: our held assertion and the other client's, re-asserted.
        await seen.until(lambda s: set(s.present) == {("me",), ("other",)})
        assert ds.reconnects >= 1
        await ds.close()
        await other.close()
    finally:
        await srv.stop()


CLIENT_SCRIPT = """
import asyncio, sys
from dataspace.client import connect
from dataspace.values import parse
async def main():
    ds = await connect(sys.argv[1], sys.argv[2])
    for i in range(20):
        ds.assert_(parse(f'<Lease "worker" {i}>'))
    await ds.sync()
    print("holding", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


@async_test
async def test_kill_9_of_a_client_process_retracts_its_assertions(tmp_path):
    async with running_server(tmp_path) as server:
        watcher = await connect(tcp_address(server), server.sturdyref)
        seen = Changes()
        watcher.observe("<Lease $who $n>", **seen.kw())
        await watcher.sync()
        script = tmp_path / "client.py"
        script.write_text(CLIENT_SCRIPT)
        proc = await spawn(str(script), tcp_address(server), str(server.sturdyref))
        try:
            await read_line_matching(proc, "^holding$", [])
            await seen.until(lambda s: len(s.present) == 20)
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            await seen.until(lambda s: not s.present)
        finally:
            await kill(proc)
        await watcher.close()


@async_test
async def test_callbacks_are_turns_and_a_failing_one_is_discarded(tmp_path, caplog):
    # The same callback semantics as the in-process Dataspace.
    async with running_server(tmp_path) as server:
        ds = await connect(tcp_address(server), server.sturdyref)
        got = asyncio.Event()

        def bad(_x):
            ds.assert_(parse("<from-bad>"))
            raise RuntimeError("boom")

        def good(_x):
            ds.assert_(parse("<from-good>"))
            got.set()

        ds.observe("<a $x>", on_assert=bad)
        ds.observe("<a $x>", on_assert=good)
        ds.assert_(parse("<a 1>"))
        await asyncio.wait_for(got.wait(), 20)
        await ds.sync()
        root = server.dataspaces["root"]
        assert parse("<from-good>") in root
        assert parse("<from-bad>") not in root
        assert "boom" in caplog.text
        await ds.close()


@async_test
async def test_captured_references_print_readably(tmp_path, capsys):
    """print(k) of a reference captured by during() works (it raised TypeError: cannot
    write the embedded RemoteEntity object as text)."""
    from dataspace.dataspace import Entity
    from dataspace.values import Embedded, Record, Symbol, stringify

    async with running_server(tmp_path) as server:
        producer = await connect(tcp_address(server), server.sturdyref)
        consumer = await connect(tcp_address(server), server.sturdyref)
        texts: list[str] = []
        seen = asyncio.Event()

        def on_fib(n, k):
            try:
                print(n, k)
                texts.append(str(k))
                texts.append(stringify(Record(Symbol("fib"), [n, k])))
            finally:
                seen.set()

        consumer.during("<fib $n $k>", on_fib)
        await consumer.sync()
        producer.assert_(Record(Symbol("fib"), [10, Embedded(Entity())]))
        await asyncio.wait_for(seen.wait(), 20)
        k_text, fib_text = texts
        assert k_text.startswith('#:<object "<RemoteEntity ') and k_text.endswith('>">'), k_text
        assert fib_text == f"<fib 10 {k_text}>"
        assert capsys.readouterr().out == f"10 {k_text}\n"
        await producer.close()
        await consumer.close()


@async_test
async def test_cancelling_a_task_that_is_closing_a_client_cancels_it(tmp_path):
    # Ctrl-C under asyncio.run cancels the main task; if that task is in close(), the
    # cancellation must go on up (close() used to swallow it, and the program carried on).
    async with running_server(tmp_path) as server:
        ds = await connect(tcp_address(server), data_dir=tmp_path / "data")
        closing = asyncio.ensure_future(ds.close())
        await asyncio.sleep(0)  # let close() start waiting
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(closing, 10.0)
        await ds.close()  # and closing again afterwards is harmless


# ---------------------------------------------------------------------------------------
# One-shot reads (query, request), client names, and what answered a failed handshake


async def _query_and_request(ds, peer, settle) -> None:
    """The same calls against the in-process Dataspace and the client: ``peer`` asserts
    and answers, ``settle()`` waits until the peer's actions have been processed."""
    from dataspace.values import Symbol

    assert await ds.query("<Present $who>") == []
    peer.assert_(parse('<Present "bob">'))
    peer.assert_(parse('<Present "alice">'))
    peer.assert_(parse('<Present "alice">'))  # bag semantics: one match
    peer.assert_(parse("<Present carol>"))
    await settle()
    # Every distinct match, in Preserves order (strings before symbols), once.
    assert await ds.query("<Present $who>") == [("alice",), ("bob",), (Symbol("carol"),)]
    assert await ds.query("<Present _>") == [()]  # something matches, nothing captured
    assert await ds.query("<Absent _>") == []
    # The query's subscription is gone afterwards: nothing observes <Present ...>.
    assert await ds.query("<Observe <group <rec Present> _> _>") == []

    peer.observe("<Ask $id $n>", on_message=lambda i, n: peer.send(parse(f"<Answer {i} {n * 2}>")))
    await settle()
    assert await ds.request(parse("<Ask 1 21>"), "<Answer 1 $x>") == (42,)
    # Only a matching reply counts (another request's answer does not).
    assert await ds.request(parse("<Ask 2 5>"), "<Answer 2 $x>", timeout=10) == (10,)
    with pytest.raises(TimeoutError, match=r"no reply matching <Answer 3 \$x> within 0.3 s"):
        await ds.request(parse("<Nobody 3>"), "<Answer 3 $x>", timeout=0.3)
    with pytest.raises(RuntimeError, match="inside a turn"), ds.turn():
        await ds.query("<Present $who>")


@async_test
async def test_query_and_request_in_process_and_remote_alike(tmp_path):
    from dataspace import Dataspace

    local = Dataspace()

    async def nothing() -> None:
        pass

    await _query_and_request(local, local, nothing)
    async with running_server(tmp_path) as server:
        ds = await connect(tcp_address(server), server.sturdyref)
        peer = await connect(tcp_address(server), server.sturdyref)
        await _query_and_request(ds, peer, peer.sync)
        await peer.close()
        await ds.close()
        with pytest.raises(ConnectionError, match="not connected"):
            await ds.query("<Present $who>")


@async_test
async def test_a_query_sees_what_was_there_when_the_server_answered(tmp_path):
    """query() waits for the server's answer, not a timeout: a large state arrives whole."""
    async with running_server(tmp_path) as server:
        peer = await connect(tcp_address(server), server.sturdyref)
        with peer.turn():
            for i in range(5000):
                peer.assert_(parse(f"<Item {i}>"))
        await peer.sync()
        ds = await connect(tcp_address(server), server.sturdyref)
        got = await ds.query("<Item $n>")
        assert got == [(i,) for i in range(5000)]
        await ds.close()
        await peer.close()


@async_test
async def test_clients_name_themselves_to_the_server(tmp_path):
    async with running_server(tmp_path, idle_timeout=0.5) as server:
        named = await connect(tcp_address(server), server.sturdyref, name="billing-worker\n#3")
        anonymous = await connect(tcp_address(server), server.sturdyref)
        long = await connect(tcp_address(server), server.sturdyref, name="x" * 500)
        names = sorted((c.client_name or "") for c in server.connections)
        # Control characters dropped, long names cut to 100 characters.
        assert names == ["", "billing-worker#3", "x" * 100]
        with pytest.raises(TypeError, match="name must be a string"):
            await connect(tcp_address(server), server.sturdyref, name=3)
        # A name is not something held: a named client holding nothing is idle like any;
        # the name travels again when it reconnects.
        gone = asyncio.Event()
        named.on_disconnect.append(gone.set)
        await asyncio.wait_for(gone.wait(), 20)
        await asyncio.wait_for(named.wait_connected(), 20)  # reconnects, named again
        await named.sync()
        assert "billing-worker#3" in [c.client_name for c in server.connections]
        for c in (named, anonymous, long):
            await c.close()


@async_test
async def test_a_handshake_with_something_else_says_what_answered(tmp_path):
    from aiohttp import web

    app = web.Application()
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    http_port = runner.addresses[0][1]
    try:
        async with running_server(tmp_path, ws=["127.0.0.1:0"]) as server:
            cap = server.sturdyref
            # What answers is named (net.probe), with the address to use.
            with pytest.raises(ConnectionError, match=r"127.0.0.1:\d+ is an HTTP port \(as a "
                               r"server's --http port is.*\), not a plain dataspace TCP port "
                               r"\(no TLS\): clients connect to the server's TCP port"):
                await connect(f"127.0.0.1:{http_port}", cap, reconnect=False)
            tcp = tcp_address(server)
            with pytest.raises(ConnectionError, match=rf"{tcp} is a plain dataspace TCP port "
                               rf"\(no TLS\), not a WebSocket port without TLS: use tcp://{tcp} "
                               rf"or {tcp}$"):
                await connect(f"ws://{tcp}/", cap, reconnect=False)
            with pytest.raises(ConnectionError, match=r"is an HTTP port .*, not a WebSocket port "
                               r"without TLS"):
                await connect(f"ws://127.0.0.1:{http_port}/", cap, reconnect=False)
            # A WebSocket port answers the protocol's first bytes (no HTTP request line)
            # with an HTTP 400 at once.
            ws = ws_address(server).removeprefix("ws://").rstrip("/")
            with pytest.raises(ConnectionError, match=rf"{ws} is a WebSocket port without TLS, "
                               rf"not a plain dataspace TCP port \(no TLS\): use ws://{ws}/$"):
                await connect(ws, cap, reconnect=False, connect_timeout=5)
        # A port that accepts and never answers (as an HTTP server waiting for its request
        # line would): said within the connect timeout.
        held: list[asyncio.StreamWriter] = []  # (kept open: a collected writer may close its socket)
        quiet = await asyncio.start_server(lambda r, w: held.append(w), "127.0.0.1", 0)
        try:
            q = f"127.0.0.1:{quiet.sockets[0].getsockname()[1]}"
            with pytest.raises(ConnectionError, match=rf"no answer from {q} within 1 s: is it "
                               r"a dataspace server's port\? \(a WebSocket or HTTP port waits"):
                await connect(q, cap, reconnect=False, connect_timeout=1)
        finally:
            for w in held:
                w.close()
            quiet.close()
    finally:
        await runner.cleanup()


def test_what_answered_is_read_from_the_first_bytes():
    from dataspace.net.sniff import SYNDICATE, identify, what_answered
    from dataspace.values import encode

    assert identify(b"HTTP/1.0 400 Bad Request\r\n") == "HTTP"
    assert identify(bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x46])) == "TLS"  # an alert
    assert identify(b'INFO {"server_id":"N"}\r\n') == "NATS"
    assert identify(b"SSH-2.0-OpenSSH_9.2\r\n") == "SSH"
    assert identify(b"E\x00\x00\x00\x5cSFATAL\x00") == "PostgreSQL"
    assert identify(encode(parse('<error "malformed packet" malformed-packet>'))) == SYNDICATE
    assert identify(b"\x00\x01garbage") is None
    assert what_answered(b"HTTP/1.1 200 OK") == "that port speaks HTTP"
    assert what_answered(b"") == "that port closed the connection without answering"
    assert what_answered(b"hello there") == \
        "that port answered with something else (first bytes: 68 65 6c 6c 6f 20 74 68 = 'hello there')"
