"""Addresses of the wrong kind for the port they reach (issue 28, section 3): every pair of
the scheme a client is given (tcp, tls, ws, wss, http, https, unix) and the kind of
listener that answers there, against real listeners on loopback.  Each failure is one line
that names what answers, and the address it advises works."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import trustme

from broker_support import async_test
from dataspace.broker import Server, ServerConfig
from dataspace.client import connect
from dataspace.net.sniff import PROBE_REQUEST, listener_kind, mismatch, wrong_scheme
from dataspace.web import start_http

WITHIN = 15.0
"""Seconds within which each failure must be reported."""

SCHEMES = {"tcp": "{}", "tls": "tls://{}", "ws": "ws://{}/", "wss": "wss://{}/"}
NAMES = {
    "tcp": "a plain dataspace TCP port (no TLS)",
    "tls": "a dataspace TCP port with TLS",
    "ws": "a WebSocket port without TLS",
    "wss": "a WebSocket port with TLS",
    "http": "an HTTP port",
    "https": "an HTTPS port",
}


@dataclass
class Listeners:
    """One plain and one TLS server, each with a TCP, a WebSocket and an HTTP port, and a
    Unix socket on the plain one."""

    where: dict[str, str]  # kind -> HOST:PORT
    caps: dict[str, str]  # kind -> the sturdyref of the server that listens there
    ca: Path
    unix: Path


@contextlib.asynccontextmanager
async def listeners(tmp_path: Path) -> AsyncIterator[Listeners]:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "server.crt"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    unix = tmp_path / "ds.sock"
    plain = Server(ServerConfig(tcp=["127.0.0.1:0"], ws=["127.0.0.1:0"], unix=[str(unix)]),
                   data_dir=tmp_path / "plain")
    tls = Server(ServerConfig(tcp=["127.0.0.1:0"], ws=["127.0.0.1:0"],
                              tls_cert=str(tmp_path / "server.crt"),
                              tls_key=str(tmp_path / "server.key")), data_dir=tmp_path / "tls")
    await plain.start()
    await tls.start()
    webs = []
    try:
        assert tls.tls is not None
        webs.append(await start_http("127.0.0.1", 0, store=None, publish=[], server=plain))
        webs.append(await start_http("127.0.0.1", 0, store=None, publish=[], server=tls,
                                     ssl_context=tls.tls.http_context))

        def at(server: Server, kind: str) -> str:
            return next(a for a in server.addresses if a.kind == kind).host_port

        where = {"tcp": at(plain, "tcp"), "tls": at(tls, "tls"), "ws": at(plain, "ws"),
                 "wss": at(tls, "wss"), "http": webs[0].url.split("//")[1].rstrip("/"),
                 "https": webs[1].url.split("//")[1].rstrip("/")}
        caps = {k: str(plain.sturdyref if k in ("tcp", "ws", "http") else tls.sturdyref)
                for k in where}
        yield Listeners(where, caps, tmp_path / "ca.crt", unix)
    finally:
        for w in webs:
            await w.close()
        await tls.close()
        await plain.close()


async def _fails(address: str, cap: str, ca: Path) -> str:
    """The one-line error connecting to ``address`` fails with, within :data:`WITHIN`."""
    try:
        ds = await asyncio.wait_for(connect(address, cap, reconnect=False, connect_timeout=5,
                                            tls_ca=str(ca) if address.startswith(("tls", "wss"))
                                            else None), WITHIN)
    except ConnectionError as e:
        msg = str(e)
        assert msg and "\n" not in msg, msg
        return msg
    await ds.close()
    raise AssertionError(f"{address} connected")


async def _works(address: str, cap: str, ca: Path) -> None:
    ds = await connect(address, cap, reconnect=False, connect_timeout=5,
                       tls_ca=str(ca) if address.startswith(("tls", "wss")) else None)
    await ds.sync()
    await ds.close()


def _advised(msg: str) -> str:
    """The address a message advises (the first after 'use ')."""
    m = re.search(r"\buse (\S+)", msg)
    assert m, msg
    return m.group(1)


@async_test
async def test_every_scheme_against_every_kind_of_port(tmp_path):
    """The matrix: each client scheme against each kind of listener.  The diagonal
    connects; off it, the message names the kind that answers, and the address it advises
    connects (for a dataspace port) -- `wss://` to a plain TCP port advised `ws://`, which
    failed in turn."""
    async with listeners(tmp_path) as ls:
        for asked, form in SCHEMES.items():
            for found, hp in ls.where.items():
                address = form.format(hp)
                cap = ls.caps[found]
                if asked == found:
                    await _works(address, cap, ls.ca)
                    continue
                msg = await _fails(address, cap, ls.ca)
                at = f"{asked} -> {found}: {msg}"
                secure_twin = {"tcp": "tls", "tls": "tcp", "ws": "wss", "wss": "ws"}[asked]
                if found == secure_twin:  # TLS alone differs: the TLS messages of docs/security.md
                    said = "speaks TLS" if found in ("tls", "wss") else "does not speak TLS"
                    assert f"the server at {hp} {said}: use " in msg, at
                else:
                    assert msg.startswith(f"{hp} is {NAMES[found]}"), at
                    assert f", not {NAMES[asked]}" in msg, at
                if found in ("http", "https"):
                    assert "clients connect to the server's TCP port" in msg, at
                    continue
                advised = _advised(msg)
                assert advised == SCHEMES[found].format(hp) or advised == f"tcp://{hp}", at
                await _works(advised, cap, ls.ca)


@async_test
async def test_web_urls_and_unix_paths_say_what_is_there(tmp_path):
    async with listeners(tmp_path) as ls:
        for found, hp in ls.where.items():
            for scheme in ("http", "https"):
                url = f"{scheme}://{hp}/"
                msg = await _fails(url, ls.caps[found], ls.ca)
                at = f"{url} ({found}): {msg}"
                assert msg.startswith(f"{url} is not a server address ({scheme}:// is for the "
                                      "--http port"), at
                if found in ("http", "https"):
                    assert "clients connect to the server's TCP port" in msg, at
                else:
                    assert f"and {hp} is {NAMES[found]}: use " in msg, at
                    await _works(_advised(msg), ls.caps[found], ls.ca)
        cap = ls.caps["tcp"]
        await _works(f"unix:{ls.unix}", cap, ls.ca)
        assert await _fails(f"unix:{tmp_path / 'none.sock'}", cap, ls.ca) == (
            f"no server at unix:{tmp_path / 'none.sock'}: start one with `dataspace serve "
            f"--unix {tmp_path / 'none.sock'}`")
        assert await _fails(f"unix:{ls.ca}", cap, ls.ca) == (
            f"unix:{ls.ca} is a file, not a socket: give the path of the server's --unix "
            "socket (the server says 'listening on unix:PATH' as it starts)")
        assert (await _fails(f"unix:{tmp_path}", cap, ls.ca)).startswith(
            f"unix:{tmp_path} is a directory: give the path of the server's --unix socket")

        # A Unix socket with something else behind it.
        async def http(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.read(1)
            w.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            await w.drain()
            w.close()

        other = await asyncio.start_unix_server(http, str(tmp_path / "web.sock"))
        try:
            assert await _fails(f"unix:{tmp_path / 'web.sock'}", cap, ls.ca) == (
                f"unix:{tmp_path / 'web.sock'} is not a dataspace server: that socket speaks "
                "HTTP, not the Syndicate protocol (give the path of the server's --unix socket)")
        finally:
            other.close()


@async_test
async def test_another_protocols_port_is_named_whatever_the_scheme(tmp_path):
    """A port of none of these kinds (a NATS server's greeting) is told what it speaks,
    whatever the scheme (tls:// was advised to drop TLS, wss:// to use ws://)."""
    async def nats(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b'INFO {"server_id":"x"}\r\n')
        await w.drain()
        await r.read(100)
        w.close()

    srv = await asyncio.start_server(nats, "127.0.0.1", 0)
    try:
        hp = f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        async with listeners(tmp_path) as ls:
            for address in (hp, f"tls://{hp}", f"ws://{hp}/", f"wss://{hp}/"):
                msg = await _fails(address, ls.caps["tcp"], ls.ca)
                assert msg.startswith(f"{hp} is not a dataspace server: that port speaks NATS, "
                                      "not the Syndicate protocol"), msg
    finally:
        srv.close()


def test_the_probes_answers_are_read_as_the_kinds():
    assert PROBE_REQUEST.startswith(b"GET / HTTP/1.1\r\n") and b"Upgrade: websocket" in PROBE_REQUEST
    assert listener_kind(b"HTTP/1.1 101 Switching Protocols\r\n", tls=False) == "ws"
    assert listener_kind(b"HTTP/1.1 101 Switching Protocols\r\n", tls=True) == "wss"
    assert listener_kind(b"HTTP/1.1 200 OK\r\n", tls=False) == "http"
    assert listener_kind(b"HTTP/1.0 400 Bad Request", tls=True) == "https"
    assert listener_kind(b"\xb4\xb3\x05error\xb1\x10malformed packet", tls=False) == "tcp"
    assert listener_kind(b"\xb4\xb3\x05error", tls=True) == "tls"
    assert listener_kind(b'INFO {"server_id"', tls=False) is None
    assert listener_kind(b"", tls=False) is None
    assert mismatch("wss", "tcp", "h:1") == ("h:1 is a plain dataspace TCP port (no TLS), not a "
                                             "WebSocket port with TLS: use tcp://h:1 or h:1")
    assert wrong_scheme("http://h:1/", "ws", "h:1").endswith(
        "and h:1 is a WebSocket port without TLS: use ws://h:1/")


def test_send_to_a_plain_port_with_wss_names_it_and_the_advice_works(tmp_path):
    """The issue's case, as a user types it: `send --server wss://HOST:PORT/` to a plain
    TCP port advised ws://, which then failed."""
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATASPACE_")}
    with subprocess.Popen([sys.executable, "-m", "dataspace.cli", "serve", "--tcp", "127.0.0.1:0",
                           "--data-dir", str(data)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env) as server:
        try:
            assert server.stderr is not None
            hp = None
            for _ in range(50):  # its first lines, up to "listening on"
                line = server.stderr.readline()
                assert line, "the server ended"
                if m := re.search(r"listening on (127\.0\.0\.1:\d+)", line):
                    hp = m.group(1)
                    break
            assert hp is not None

            def send(where: str) -> subprocess.CompletedProcess[str]:
                return subprocess.run([sys.executable, "-m", "dataspace.cli", "send", "-v", "<x>",
                                       "--server", where, "--data-dir", str(data)],
                                      capture_output=True, text=True, timeout=60, env=env)

            r = send(f"wss://{hp}/")
            assert r.returncode == 1
            assert r.stderr == (f"dataspace send: {hp} is a plain dataspace TCP port (no TLS), "
                                f"not a WebSocket port with TLS: use tcp://{hp} or {hp}\n")
            for advised in (f"tcp://{hp}", hp):
                r = send(advised)
                assert (r.returncode, r.stderr) == (0, "sent <x>\n"), r.stderr
        finally:
            server.terminate()
            server.wait(30)
