"""The server over real loopback sockets: capabilities, transports, config, lifetimes."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest

from broker_support import (
    Changes,
    RawClient,
    async_test,
    error_messages,
    running_server,
    tcp_address,
    wait,
    ws_address,
)
from dataspace.broker import ConfigError, Server, ServerConfig, parse_config
from dataspace.client import connect
from dataspace.protocol.sturdy import SturdyRef, mint
from dataspace.values import parse


@async_test
async def test_root_capability_written_and_stable(tmp_path):
    async with running_server(tmp_path) as server:
        ref = server.sturdyref
        f = tmp_path / "data" / "root.sturdyref"
        assert SturdyRef.parse(f.read_text()) == ref
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / "data" / "root.key").st_mode) == 0o600
    async with running_server(tmp_path) as again:
        assert again.sturdyref == ref  # same data directory, same key, same capability


@async_test
async def test_clients_on_tcp_unix_and_websocket_share_the_dataspace(tmp_path):
    sock = str(tmp_path / "ds.sock")
    async with running_server(tmp_path, unix=[sock], ws=["127.0.0.1:0"]) as server:
        a = await connect(tcp_address(server), server.sturdyref)
        b = await connect(f"unix:{sock}", server.sturdyref)
        c = await connect(ws_address(server), server.sturdyref)
        seen = Changes()
        a.observe("<Present $who>", **seen.kw())
        a.observe("<Says $who $what>", **seen.kw())
        await a.sync()
        hb = b.assert_(parse('<Present "b">'))
        c.assert_(parse('<Present "c">'))
        c.send(parse('<Says "c" "over websocket">'))
        await seen.until(lambda s: {("b",), ("c",)} <= set(s.present) and s.messages())
        assert seen.messages() == [("c", "over websocket")]
        b.retract(hb)
        await seen.until(lambda s: ("b",) not in s.present)
        await c.close()  # its assertions go with it
        await seen.until(lambda s: not s.present)
        for x in (a, b):
            await x.close()


@async_test
async def test_config_bindings_for_other_dataspaces_and_syndicate_examples(tmp_path):
    cfg = parse_config(
        '{bind: [<ref {oid: "syndicate" key: #x""}> '
        '<ref {oid: "chat" key: #x"0102" dataspace: "chat"}>] tcp: ["127.0.0.1:0"]}'
    )
    server = Server(cfg, data_dir=tmp_path)
    await server.start()
    try:
        addr = tcp_address(server)
        # The sturdyref syndicate-py's examples use, for the empty key.
        example = SturdyRef.parse('<ref {oid: "syndicate" sig: #[acowDB2/oI+6aSEC3YIxGg==]}>')
        root_via_example = await connect(addr, example)
        chat = await connect(addr, mint("chat", b"\x01\x02"))
        root = await connect(addr, server.sturdyref)
        seen_root, seen_chat = Changes(), Changes()
        root.observe("<Present $x>", **seen_root.kw())
        chat.observe("<Present $x>", **seen_chat.kw())
        await root.sync()
        await chat.sync()
        root_via_example.assert_(parse('<Present "in-root">'))
        chat.assert_(parse('<Present "in-chat">'))
        await seen_root.until(lambda s: ("in-root",) in s.present)
        await seen_chat.until(lambda s: ("in-chat",) in s.present)
        await root.sync()
        assert set(seen_root.present) == {("in-root",)}
        assert set(seen_chat.present) == {("in-chat",)}
        assert set(server.dataspaces) == {"root", "chat"}
        for x in (root_via_example, chat, root):
            await x.close()
    finally:
        await server.close()


def test_config_errors_say_what_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="unknown setting"):
        parse_config("{listen: 1}")
    with pytest.raises(ConfigError, match="one dictionary"):
        parse_config("[1 2]")
    with pytest.raises(ConfigError, match="max-debt must be"):
        parse_config("{max-debt: -1}")
    with pytest.raises(ConfigError, match="max-debt must be a positive"):
        parse_config("{max-debt: 0}")
    with pytest.raises(ConfigError, match="binding is <ref"):
        parse_config("{bind: [1]}")
    with pytest.raises(ConfigError, match="bad port"):
        parse_config('{tcp: ["localhost:http"]}')
    with pytest.raises(ConfigError, match="not Preserves text"):
        parse_config("{tcp: [")
    # The settings without the outer braces (it once said "unexpected text after the value").
    with pytest.raises(ConfigError, match=r"^the config file is a dictionary \{\.\.\.\}: put \{"):
        parse_config('# settings\ntcp: ["127.0.0.1:7411"]\nrecord: ["chat:<Says _ _>"]\n')
    cfg = parse_config(
        '# comment\n{tcp: ["127.0.0.1:1"] unix: ["/tmp/x"] ws: ["127.0.0.1:2"] '
        'data-dir: "/tmp/d" verbose: 2 root-oid: "top" root-key: #x"01" max-packet-size: 5000 '
        "max-assertions: 7 max-references: 8 max-debt: 9 max-send-queue: 10 send-timeout: 1.5 "
        "handshake-timeout: 2 keepalive: 3 ws-ping-interval: 4}"
    )
    assert [str(a) for a in cfg.listeners()] == ["127.0.0.1:1", "unix:/tmp/x", "ws://127.0.0.1:2/"]
    assert cfg.relay_limits().max_assertions == 7 and cfg.flow_limits().send_timeout == 1.5
    assert cfg.root_oid == "top" and cfg.root_key == b"\x01" and cfg.verbose == 2
    assert [str(a) for a in ServerConfig().listeners()] == ["127.0.0.1:7411"]


@async_test
async def test_listen_errors_are_explained(tmp_path):
    async with running_server(tmp_path) as server:
        taken = tcp_address(server)
        other = Server(ServerConfig(tcp=[taken]), data_dir=tmp_path / "other")
        with pytest.raises(OSError, match="another `dataspace serve` running"):
            await other.start()


@async_test
async def test_forged_and_bad_sturdyrefs_close_only_that_connection(tmp_path):
    async with running_server(tmp_path) as server:
        addr = tcp_address(server)
        good = await connect(addr, server.sturdyref)
        h = good.assert_(parse('<Present "good">'))
        await good.sync()
        forged = SturdyRef("root", bytes(16))
        for bad in (forged, mint("root", b"guess"), mint("other", b"x")):
            raw = await RawClient.open(addr)
            answer_error = None
            try:
                await raw.resolve(bad)
            except AssertionError as e:
                answer_error = str(e)
            assert answer_error is not None and "rejected" in answer_error
            msgs = error_messages(await raw.read_until_closed())
            if raw.relay.peer_error:  # the error came in the same read as the answer
                msgs.append(raw.relay.peer_error[0])
            assert msgs and ("signature" in msgs[0] or "no object" in msgs[0])
            raw.close()
        await good.sync()
        assert good.connected and good.value_of(h) == parse('<Present "good">')
        assert server.stats()["connections"] == 1
        assert parse('<Present "good">') in server.dataspaces["root"]
        await good.close()


@async_test
async def test_handshake_timeout_closes_idle_connections(tmp_path, monkeypatch):
    async with running_server(tmp_path, handshake_timeout=0.3) as server:
        raw = await RawClient.open(tcp_address(server))
        msgs = error_messages(await raw.read_until_closed(timeout=10))
        assert any("no sturdyref resolved" in m for m in msgs)
        raw.close()
        # A client that resolves in time is not affected.  The timer takes the check
        # method when the connection is accepted, so wrap it before connecting.
        checked = asyncio.Event()
        seen = []
        real_check = server._handshake_check

        def check(conn, gk):
            real_check(conn, gk)
            seen.append(conn)
            checked.set()

        monkeypatch.setattr(server, "_handshake_check", check)
        ok = await connect(tcp_address(server), server.sturdyref)
        await asyncio.wait_for(checked.wait(), 10)
        assert len(seen) == 1 and not seen[0].closed
        await ok.sync()
        assert ok.connected and ok.reconnects == 0
        assert server.connections == {seen[0]}
        await ok.close()


@async_test
async def test_connection_close_retracts_everything(tmp_path):
    async with running_server(tmp_path) as server:
        addr = tcp_address(server)
        watcher = await connect(addr, server.sturdyref)
        seen = Changes()
        watcher.observe("<Item $n>", **seen.kw())
        watcher.observe("<Observe <group <rec Item> _> _>", on_assert=lambda: None)
        await watcher.sync()
        other = await connect(addr, server.sturdyref)
        for i in range(50):
            other.assert_(parse(f"<Item {i}>"))
        other.observe("<Item $n>", on_assert=lambda n: None)
        await seen.until(lambda s: len(s.present) == 50)
        before = len(server.dataspaces["root"].assertions())
        await other.close()
        await seen.until(lambda s: not s.present)
        await watcher.sync()
        assert len(server.dataspaces["root"].assertions()) == before - 51
        await watcher.close()


@async_test
async def test_server_close_disconnects_clients(tmp_path):
    server = Server(ServerConfig(tcp=["127.0.0.1:0"]), data_dir=tmp_path)
    await server.start()
    c = await connect(tcp_address(server), server.sturdyref, reconnect=False)
    await server.close()
    await asyncio.wait_for(c.wait_closed(), 10)
    assert not c.connected
    await c.close()


def test_server_refuses_bad_limits(tmp_path):
    with pytest.raises(ConfigError):
        Server(ServerConfig(max_packet_size=0), data_dir=tmp_path)


@async_test
async def test_connections_beyond_the_limit_are_refused_with_an_error(tmp_path):
    async with running_server(tmp_path, max_connections=1) as server:
        first = await connect(tcp_address(server), server.sturdyref)
        raw = await RawClient.open(tcp_address(server))
        msgs = error_messages(await raw.read_until_closed())
        assert any("too many connections (1)" in m for m in msgs)
        raw.close()
        assert first.connected and server.stats()["connections"] == 1
        gone = asyncio.Event()
        for c in server.connections:
            c.on_close.append(lambda _c: gone.set())
        await first.close()
        await wait(lambda: server.stats()["connections"] == 0, gone, timeout=10)
        second = await connect(tcp_address(server), server.sturdyref)  # room again
        assert second.connected
        await second.close()


def test_max_connections_is_a_setting_of_the_file():
    assert parse_config("{max-connections: 7}").max_connections == 7


def test_server_and_client_run_under_uvloop(tmp_path):
    """uvloop's transports are not asyncio.Transport subclasses: connections take them."""
    import uvloop  # in the test extra: the test runs, never skips

    async def main():
        async with running_server(tmp_path) as server:
            sub = await connect(tcp_address(server), server.sturdyref)
            pub = await connect(tcp_address(server), server.sturdyref)
            seen = Changes()
            sub.observe("<Says $who $text>", **seen.kw())
            await sub.sync()
            pub.send(parse('<Says "a" "hi">'))
            await seen.until(lambda s: s.messages() == [("a", "hi")])
            await sub.close()
            await pub.close()

    uvloop.run(asyncio.wait_for(main(), 60))


def test_serve_tunes_the_cyclic_collector_for_a_server():
    """`dataspace serve` freezes what it holds at start out of the collector's walks and
    collects its first generation rarely (routing allocates small containers per message;
    with the default threshold the collector took a tenth of the server's CPU)."""
    import subprocess
    import sys

    code = ("import gc; from dataspace.cli.serve import _tune_gc; d = gc.get_threshold(); "
            "_tune_gc(); print(d[0], gc.get_threshold()[0], gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    default, tuned, frozen = map(int, out)
    assert tuned >= 50 * default and frozen > 1000
