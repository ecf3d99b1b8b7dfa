"""The client commands as a user of NATS, Redis or Kafka reaches for them: errors that
say what answered, limits named as typed, caveats known before the server drops a value,
one-shot queries, request/reply, JSON output, client names (issue 20, items 6-8)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker_support import Changes, async_test, running_server, tcp_address, ws_address
from dataspace.client import connect
from dataspace.protocol.sturdy import mint
from dataspace.values import parse

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dataspace.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd,
                          env=None if env is None else {**os.environ, **env})


async def acli(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """A command run while this test's event loop (and the server in it) keeps going."""
    return await asyncio.to_thread(run_cli, *args, **kw)


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    """The command's only line on stderr (a traceback or a second line fails)."""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@contextlib.asynccontextmanager
async def http_server() -> AsyncIterator[int]:
    """Some other web server on loopback (a 404 for everything): its port."""
    from aiohttp import web

    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------------------------------
# Item 6: errors that blame the right thing


@async_test
async def test_info_pointed_at_the_brokers_port_says_so_without_a_traceback(tmp_path):
    async with running_server(tmp_path, ws=["127.0.0.1:0"]) as server:
        r = await acli("info", "--url", f"http://{tcp_address(server)}", "--token", "x")
        assert r.returncode == 1
        assert one_line(r) == (
            f"dataspace info: http://{tcp_address(server)}/: that port speaks the Syndicate "
            "protocol, not HTTP: it is the broker's port, not its HTTP port; --url takes the "
            "port given to `dataspace serve --http HOST:PORT` (http://127.0.0.1:7480 by default)")
        ws = ws_address(server).removeprefix("ws://").rstrip("/")
        r = await acli("info", "--url", f"http://{ws}", "--token", "x")
        assert r.returncode == 1
        assert "426 Upgrade Required (that is a WebSocket port, a --ws port" in one_line(r)


@async_test
async def test_clients_pointed_at_an_http_port_are_told_it_speaks_http(tmp_path):
    async with http_server() as port, running_server(tmp_path) as server:
        data = ("--data-dir", str(tmp_path / "data"))
        r = await acli("send", "<x>", "--server", f"127.0.0.1:{port}", *data)
        assert r.returncode == 1
        line = one_line(r)
        assert line.startswith(f"dataspace send: 127.0.0.1:{port} is an HTTP port (as a "
                               "server's --http port is: the inspector, /metrics, /api/), not a "
                               "plain dataspace TCP port (no TLS): clients connect to the "
                               "server's TCP port (HOST:PORT, 7411 by default)")
        assert "malformed packet" not in line
        tcp = tcp_address(server)
        r = await acli("observe", "_", "--server", f"ws://{tcp}/", *data)
        assert r.returncode == 1 and one_line(r) == (
            f"dataspace observe: {tcp} is a plain dataspace TCP port (no TLS), not a WebSocket "
            f"port without TLS: use tcp://{tcp} or {tcp}")


@async_test
async def test_a_client_given_the_ws_port_as_host_port_is_told_it_speaks_http(tmp_path):
    """`send --server HOST:PORT` of the broker's --ws port: the WebSocket layer waited for
    an HTTP request line that never came and closed after 10 s ("closed the connection
    without answering"); the listener now answers a non-HTTP first byte at once."""
    async with running_server(tmp_path, ws=["127.0.0.1:0"]) as server:
        ws = ws_address(server).removeprefix("ws://").rstrip("/")
        r = await acli("send", "<x>", "--server", ws, "--data-dir", str(tmp_path / "data"))
        assert r.returncode == 1
        assert one_line(r) == (
            f"dataspace send: {ws} is a WebSocket port without TLS, not a plain dataspace TCP "
            f"port (no TLS): use ws://{ws}/"), r.stderr
        # The port still serves WebSocket clients.
        r = await acli("send", "-v", "<x>", "--server", ws_address(server),
                       "--data-dir", str(tmp_path / "data"))
        assert (r.returncode, r.stderr) == (0, "sent <x>\n"), r.stderr


@pytest.mark.parametrize("args, message", [
    (("--max-packet-size", "10"), "--max-packet-size must be an integer from 1024 to 67108864 "
     "bytes, not 10 (1 KiB to 64 MiB: a client's first packet, its capability, must fit"),
    (("--max-packet-size", str(1 << 30)), "--max-packet-size must be an integer from 1024 to "
     "67108864 bytes, not 1073741824"),
    (("--work-rate", "0"), "--work-rate must be a positive integer (events per second), not 0"),
    (("--max-debt", "0"), "--max-debt must be a positive integer (bytes), not 0"),
    (("--keepalive", "-1"), "--keepalive must be a non-negative number (seconds; 0 = off), "
     "not -1.0"),
])
def test_serve_names_a_bad_limit_as_typed_with_its_range(tmp_path, args, message):
    r = run_cli("serve", "--tcp", "127.0.0.1:0", "--data-dir", str(tmp_path), *args)
    assert r.returncode == 2
    assert one_line(r) == f"dataspace serve: {message}" or \
        one_line(r).startswith(f"dataspace serve: {message}")
    assert "_" not in one_line(r).split(":")[1].split()[0]  # work-rate, not work_rate


def test_a_bad_limit_in_the_config_file_is_named_as_the_file_has_it(tmp_path):
    cfg = tmp_path / "server.pr"
    cfg.write_text("{work-rate: 0}\n")
    r = run_cli("serve", "--config", str(cfg))
    assert r.returncode == 2
    assert one_line(r) == (f"dataspace serve: {cfg}: work-rate must be a positive integer "
                           "(events per second), not 0")


def _taken(kind: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, kind)
    s.bind(("127.0.0.1", 0))
    if kind == socket.SOCK_STREAM:
        s.listen()
    return s


@pytest.mark.parametrize("option, kind", [("--http", socket.SOCK_STREAM),
                                          ("--scry-udp", socket.SOCK_DGRAM),
                                          ("--tcp", socket.SOCK_STREAM),
                                          ("--ws", socket.SOCK_STREAM)])
def test_a_port_in_use_is_named_with_its_option(tmp_path, option, kind):
    with _taken(kind) as s:
        where = f"127.0.0.1:{s.getsockname()[1]}"
        args = ["serve", "--data-dir", str(tmp_path), option, where]
        if option not in ("--tcp", "--ws"):
            args += ["--tcp", "127.0.0.1:0", "--publish", "chat"]
        r = run_cli(*args)
    assert r.returncode == 1 and r.stdout == ""
    # One line: no "[Errno 98]", no "shutting down" after a server that never started.
    assert one_line(r) == (f"dataspace serve: cannot listen on {where} for {option}: address "
                           "already in use (is another `dataspace serve` running? stop it, or "
                           "choose another port)")


def test_observe_refuses_a_count_of_zero(tmp_path):
    r = run_cli("observe", "_", "--count", "0", "--data-dir", str(tmp_path))
    assert r.returncode == 2
    assert one_line(r) == ("dataspace observe: --count must be at least 1, not 0 (leave it out "
                           "to observe until Ctrl-C)")


def test_at_file_is_looked_for_here_then_in_the_data_directory(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    root = mint("root", b"k" * 32)
    (data / "root.sturdyref").write_text(str(root) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    only = ("--only", '<Says "alice" _>')
    # From another directory, the data directory's root.sturdyref (docs/capabilities.md).
    r = run_cli("cap", "attenuate", "@root.sturdyref", *only, cwd=elsewhere,
                env={"DATASPACE_DATA_DIR": str(data)})
    assert r.returncode == 0, r.stderr
    assert 'oid: "root"' in r.stdout and "caveats:" in r.stdout
    r2 = run_cli("cap", "attenuate", "@root.sturdyref", *only, "--data-dir", str(data),
                 cwd=elsewhere)
    assert r2.stdout == r.stdout
    # A file of that name here wins.
    other = mint("other", b"x" * 32)
    (elsewhere / "root.sturdyref").write_text(str(other))
    r = run_cli("cap", "show", "@root.sturdyref", "--data-dir", str(data), cwd=elsewhere)
    assert '"other"' in r.stdout
    # Not found: where it looked, and what to do.
    r = run_cli("cap", "attenuate", "@nope.pr", *only, "--data-dir", str(data), cwd=elsewhere)
    assert r.returncode == 2
    assert one_line(r) == (
        f"dataspace cap attenuate: cannot read the ref: no file nope.pr here ({elsewhere}) or "
        f"in the data directory {data}; give its path (@/path/to/nope.pr), or the server's "
        "data directory with --data-dir DIR")


@async_test
async def test_a_postgresql_url_at_an_http_port_is_told_it_speaks_http(tmp_path):
    async with http_server() as port:
        url = f"postgresql://u@127.0.0.1:{port}/db"
        r = await acli("stream", "ls", "--store", url, "--data-dir", str(tmp_path))
    assert r.returncode != 0
    line = one_line(r)
    assert f"{url}: that port speaks HTTP, not PostgreSQL; check the host and port" in line
    assert "SSL negotiation" not in line


# ---------------------------------------------------------------------------------------
# Item 7: the capability's caveats are known locally


@async_test
async def test_caveats_that_drop_what_a_command_sends_are_reported(tmp_path):
    async with running_server(tmp_path) as server:
        r = await acli("cap", "attenuate", str(server.sturdyref), "--only", '<Says "alice" _>')
        assert r.returncode == 0, r.stderr
        alice = tmp_path / "alice.pr"
        alice.write_text(r.stdout)
        conn = ("--server", tcp_address(server), "--cap", f"@{alice}")
        watcher = await connect(tcp_address(server), server.sturdyref)
        seen = Changes()
        watcher.observe("<Says $who $text>", **seen.kw())
        await watcher.sync()

        r = await acli("assert", '<Present "alice">', "--for", "5", *conn)
        assert r.returncode == 1
        assert r.stderr.splitlines() == [
            "dataspace assert: the capability's caveats drop <Present \"alice\">: the server "
            "will ignore this assertion (see `dataspace cap show` for the caveats)",
            "dataspace assert: nothing to hold: the capability allows none of these assertions"]

        r = await acli("send", '<Present "alice">', '<Says "alice" "hi">', "-v", *conn)
        assert r.returncode == 1
        assert r.stderr.splitlines() == [
            "dataspace send: the capability's caveats drop <Present \"alice\">: the server "
            "will ignore this message (see `dataspace cap show` for the caveats)",
            'sent <Says "alice" "hi">',
            "dataspace send: 1 of 2 message(s) dropped by the capability's caveats"]
        await seen.until(lambda s: s.messages() == [("alice", "hi")])

        for command in (("observe", "<Says $who $text>"), ("query", "<Says $who $text>"),
                        ("request", '<Says "alice" "?">', "--reply", "<Answer $x>")):
            r = await acli(*command, *conn)
            assert r.returncode == 1, command
            assert "the capability's caveats drop the subscription <Observe " in one_line(r)
            assert "nothing can match" in one_line(r)
        await watcher.close()


# ---------------------------------------------------------------------------------------
# Item 8: query, request, JSON, timestamps, send -v, names


@async_test
async def test_query_prints_the_matches_now_and_exits(tmp_path):
    async with running_server(tmp_path) as server:
        conn = ("--server", tcp_address(server), "--data-dir", str(tmp_path / "data"))
        r = await acli("query", "<Present $who>", *conn)
        assert (r.returncode, r.stdout) == (0, "")
        assert one_line(r) == "dataspace query: no assertion matches <Present $who>"
        peer = await connect(tcp_address(server), server.sturdyref)
        for who in ("bob", "alice", "alice"):
            peer.assert_(parse(f'<Present "{who}" {{since: 3}}>'))
        await peer.sync()
        r = await acli("query", "<Present $who $info>", *conn)
        assert r.returncode == 0 and r.stderr == ""
        assert r.stdout.splitlines() == ['<Present "alice" {since: 3}>',
                                         '<Present "bob" {since: 3}>']
        r = await acli("query", "<Present $who _>", "--captures", *conn)
        assert r.stdout.splitlines() == ['["alice"]', '["bob"]']
        r = await acli("query", "<Present $who $info>", "--json", *conn)
        assert [json.loads(x) for x in r.stdout.splitlines()] == [
            {"text": '<Present "alice" {since: 3}>', "values": ["alice", {"since": 3}]},
            {"text": '<Present "bob" {since: 3}>', "values": ["bob", {"since": 3}]}]
        # A pattern with _ and no $ (`query _`, as one types `KEYS *`) prints one line for
        # every match: said, with what lists them; a literal pattern needs no such note.
        r = await acli("query", "<Present _ _>", *conn)
        assert r.stdout == "<Present _ _>\n"
        assert one_line(r) == (
            "dataspace query: <Present _ _> captures nothing, so every match shows as that one "
            "line; write $ where you want the values (e.g. '$v' for every assertion, "
            "'<Present $who>')")
        r = await acli("query", '<Present "bob" {since: 3}>', *conn)
        assert (r.stdout, r.stderr) == ('<Present "bob" {since: 3}>\n', "")
        await peer.close()


@async_test
async def test_request_prints_the_first_matching_reply(tmp_path):
    async with running_server(tmp_path) as server:
        conn = ("--server", tcp_address(server), "--data-dir", str(tmp_path / "data"))
        responder = await connect(tcp_address(server), server.sturdyref)
        responder.observe("<Ask $id $n>", on_message=lambda i, n: (
            responder.send(parse(f"<Answer {i + 1000} 0>")),  # someone else's reply
            responder.send(parse(f"<Answer {i} {n * 2}>"))))
        await responder.sync()
        r = await acli("request", "<Ask 7 21>", "--reply", "<Answer 7 $x>", *conn)
        assert (r.returncode, r.stdout, r.stderr) == (0, "<Answer 7 42>\n", "")
        r = await acli("request", "<Ask 8 1>", "--reply", "<Answer 8 $x>", "--captures", *conn)
        assert r.stdout == "[2]\n"
        r = await acli("request", "<Ask 9 2>", "--reply", "<Answer 9 $x>", "--json", *conn)
        assert json.loads(r.stdout) == {"text": "<Answer 9 4>", "values": [4]}
        r = await acli("request", "<Nobody>", "--reply", "<Answer 10 $x>", "--timeout", "0.5",
                       *conn)
        assert r.returncode == 1
        assert one_line(r) == ("dataspace request: no reply matching <Answer 10 $x> within "
                               "0.5 s (is a responder running? its reply must be a message "
                               "matching --reply)")
        await responder.close()


@async_test
async def test_observe_json_and_timestamps(tmp_path):
    async with running_server(tmp_path) as server:
        conn = ("--server", tcp_address(server), "--data-dir", str(tmp_path / "data"))
        peer = await connect(tcp_address(server), server.sturdyref)
        peer.assert_(parse('<Item "a" sym #[AQI=] {k: 1} #{2 1} 1.5 [#t] <r>>'))
        await peer.sync()
        r = await acli("observe", "<Item $s $y $b $d $set $f $seq $rec>", "--json",
                       "--count", "1", *conn)
        assert r.returncode == 0, r.stderr
        event = json.loads(r.stdout)
        assert event.pop("event") == "+"
        assert abs(event.pop("time") - datetime.datetime.now().timestamp()) < 60
        assert event == {
            "text": '<Item "a" sym #x"0102" {k: 1} #{1 2} 1.5 [#t] <r>>',
            "values": ["a", {"@symbol": "sym"}, {"@bytes": "AQI="}, {"k": 1}, {"@set": [1, 2]},
                       1.5, [True], {"@record": "r", "@fields": []}]}
        r = await acli("observe", "<Item $s _ _ _ _ _ _ _>", "--timestamps", "--count", "1",
                       *conn)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} \+ <Item \"a\" _ _ _ _ _ _ _>\n",
                            r.stdout), r.stdout
        r = await acli("observe", "_", "--json", "--captures", *conn)
        assert r.returncode == 2 and "drop --captures" in one_line(r)
        await peer.close()


def test_the_json_mapping_of_values():
    from dataspace.cli._json import to_json

    assert to_json(parse('{"a": 1 "b": [1.0 "x"]}')) == {"a": 1, "b": [1.0, "x"]}
    # Keys that would be ambiguous: pairs.
    assert to_json(parse('{"@record": 1}')) == {"@dict": [["@record", 1]]}
    assert to_json(parse('{a: 1 "a": 2}')) == {"@dict": [["a", 2], [{"@symbol": "a"}, 1]]}
    assert to_json(parse("{1: 2}")) == {"@dict": [[1, 2]]}
    assert to_json(parse("<<compound label> 1>")) == {
        "@record": {"@record": "compound", "@fields": [{"@symbol": "label"}]}, "@fields": [1]}
    assert to_json(float("nan")) == {"@double": "NaN"}
    assert to_json(float("-inf")) == {"@double": "-Infinity"}
    assert to_json(parse("@note 12345678901234567890")) == 12345678901234567890
    json.dumps(to_json(parse('[#f "é" #"" #{}]')))  # all of it is JSON


@async_test
async def test_client_names_in_the_connections_endpoint(tmp_path):
    from dataspace.web import start_http

    async with running_server(tmp_path) as server:
        http = await start_http("127.0.0.1", 0, store=None, publish=(), server=server)
        conn = ("--server", tcp_address(server), "--data-dir", str(tmp_path / "data"))
        held = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dataspace.cli", "assert", '<Present "alice">',
            "--name", "alice's laptop", *conn, stderr=subprocess.PIPE)
        watching = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dataspace.cli", "observe", "<Present $who>", *conn,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert held.stderr is not None and watching.stdout is not None
            await asyncio.wait_for(held.stderr.readline(), 30)  # asserted ...
            await asyncio.wait_for(watching.stdout.readline(), 30)  # + <Present "alice">
            async with aiohttp.ClientSession() as s, s.get(
                    http.url + "api/connections",
                    headers={"Authorization": f"Bearer {server.sturdyref}"}) as resp:
                rows = (await resp.json())["connections"]
            assert sorted(r["name"] for r in rows) == ["alice's laptop", "dataspace observe"]
            assert all(re.fullmatch(r"127\.0\.0\.1:\d+", r["peer"]) for r in rows)
        finally:
            for p in (held, watching):
                p.terminate()
                await p.wait()
            await http.close()


def test_make_run_opens_the_http_port_the_tools_use_by_default():
    from dataspace.cli._http import DEFAULT_URL

    r = subprocess.run(["make", "-n", "run"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    serve = [x for x in r.stdout.splitlines() if "dataspace serve" in x]
    assert serve and serve[-1].endswith("dataspace serve --http " + DEFAULT_URL.split("//")[1])
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = quick.split("```sh\n", 1)[1].split("```", 1)[0]
    assert [x.split("#")[0].strip() for x in block.splitlines()] == ["make run", "make test"]
    assert "dataspace info" in quick and DEFAULT_URL in quick
