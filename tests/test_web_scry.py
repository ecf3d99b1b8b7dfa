"""The scry HTTP gateway (dataspace.web): real HTTP over loopback with aiohttp's client
against a real server (in-process, and `dataspace serve --http` in a subprocess).

Every wait is bounded and waits on something (a response, a line, the gateway's own
state changes), never on a sleep."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from broker_support import PY, TIMEOUT, ServerProcess, async_test, running_server
from dataspace.streams import SQLiteStore, open_store
from dataspace.values import encode, parse
from dataspace.web import SCRY, HttpServer, ScryGateway, ScryLimits, start_http


@dataclass
class Gateway:
    http: HttpServer
    store: SQLiteStore
    session: aiohttp.ClientSession
    data_dir: Path

    @property
    def gw(self) -> ScryGateway:
        return self.http.app[SCRY]

    def url(self, path: str) -> str:
        return self.http.url + path.lstrip("/")

    async def get(self, path: str, **kw: object) -> tuple[int, bytes, dict[str, str]]:
        async with self.session.get(self.url(path), **kw) as r:  # type: ignore[arg-type]
            return r.status, await r.read(), dict(r.headers)


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, publish: tuple[str, ...] = ("chat",),
                  **limits: object) -> AsyncIterator[Gateway]:
    """A broker, its store and its HTTP port on free loopback ports, and a client."""
    data = tmp_path / "data"
    store = open_store(data)
    try:
        async with running_server(tmp_path) as server:
            http = await start_http("127.0.0.1", 0, store=store, publish=publish,
                                    server=server, scry_limits=ScryLimits(**limits))  # type: ignore[arg-type]
            try:
                timeout = aiohttp.ClientTimeout(total=TIMEOUT)
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    yield Gateway(http, store, session, data)
            finally:
                await http.close()
    finally:
        store.close()


async def append_elsewhere(data_dir: Path, stream: str, *values: str) -> None:
    """`dataspace stream append` in another process (its commit wakes us via the store's
    cross-process wake-up)."""
    p = await asyncio.create_subprocess_exec(
        PY, "-m", "dataspace.cli", "stream", "append", stream, *values,
        "--data-dir", str(data_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = await asyncio.wait_for(p.communicate(), TIMEOUT)
    assert p.returncode == 0, err.decode()


class Events:
    """A Server-Sent Events reader over an aiohttp response."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.comments: list[str] = []

    async def next(self, timeout: float = TIMEOUT) -> dict[str, str]:
        """The next event (its fields); comments are kept in ``comments``."""
        async def read() -> dict[str, str]:
            fields: dict[str, str] = {}
            while True:
                line = await self.resp.content.readline()
                if not line:
                    raise EOFError("the event stream ended")
                text = line.decode().rstrip("\n")
                if not text:
                    if fields:
                        return fields
                    continue
                if text.startswith(":"):
                    self.comments.append(text)
                    continue
                name, _, value = text.partition(":")
                fields[name] = value.removeprefix(" ")

        return await asyncio.wait_for(read(), timeout)

    async def entries(self, n: int) -> list[tuple[int, dict[str, object]]]:
        out = []
        for _ in range(n):
            ev = await self.next()
            assert "event" not in ev, ev
            out.append((int(ev["id"]), json.loads(ev["data"])))
        return out

    async def first_comment(self) -> str:
        """Wait for the opening comment (the stream is being served from then on)."""
        line = await asyncio.wait_for(self.resp.content.readline(), TIMEOUT)
        assert line.startswith(b": stream "), line
        await asyncio.wait_for(self.resp.content.readline(), TIMEOUT)
        return line.decode().strip()


# ------------------------------------------------------------------------------------
# Long polls


@async_test
async def test_long_poll_is_answered_when_another_process_appends(tmp_path):
    async with gateway(tmp_path) as g:
        req = asyncio.ensure_future(g.get("/scry/chat/0?timeout=120"))
        # Held: the request waits for entry 0 (nothing appended yet).
        await g.gw.wait_until(lambda: g.gw.watch is not None and g.gw.watch.waiting == 1,
                              TIMEOUT)
        assert not req.done()
        await append_elsewhere(g.data_dir, "chat", '<Says "alice" "hi">')
        t0 = time.monotonic()
        status, body, headers = await asyncio.wait_for(req, TIMEOUT)
        # At once: a missed wake-up would hold the request for its 120 s.
        assert time.monotonic() - t0 < 10
        assert status == 200
        assert headers["Content-Type"] == "application/json; charset=utf-8"
        doc = json.loads(body)
        assert doc["stream"] == "chat" and doc["index"] == 0
        assert doc["value"] == '<Says "alice" "hi">'
        assert abs(doc["time"] - time.time()) < 60
        # An entry that exists is answered at once.
        status, body, _ = await g.get("/scry/chat/0")
        assert status == 200 and json.loads(body)["index"] == 0


@async_test
async def test_long_poll_times_out_with_204(tmp_path):
    async with gateway(tmp_path) as g:
        g.store.append("chat", parse("<one>"))
        status, body, _ = await g.get("/scry/chat/1?timeout=0.2")
        assert status == 204 and body == b""
        status, _, _ = await g.get("/scry/chat/5?timeout=0")
        assert status == 204
        assert g.gw.stats()["timeouts"] == 2
        assert g.gw.active == 0


@async_test
async def test_many_waiting_readers_share_one_read(tmp_path):
    async with gateway(tmp_path) as g:
        n = 20
        reqs = [asyncio.ensure_future(g.get("/scry/chat/0?timeout=120")) for _ in range(n)]
        await g.gw.wait_until(lambda: g.gw.watch is not None and g.gw.watch.waiting == n,
                              TIMEOUT)
        reads = g.gw.stats()["store_reads"]
        g.store.append("chat", parse('<Says "bob" "to all">'))
        answers = await asyncio.wait_for(asyncio.gather(*reqs), TIMEOUT)
        assert {s for s, _, _ in answers} == {200}
        assert {json.loads(b)["value"] for _, b, _ in answers} == {'<Says "bob" "to all">'}
        # The entry was read once (plus at most one read that raced the append), not
        # once per reader.
        assert g.gw.stats()["store_reads"] - reads <= 2


@async_test
async def test_binary_format(tmp_path):
    async with gateway(tmp_path) as g:
        v = parse('<Says "carol" #[AAEC] 1.5 {a: [1 2]}>')
        g.store.append("chat", v)
        for kw in ({"headers": {"Accept": "application/preserves"}},
                   {"params": {"format": "binary"}}):
            status, body, headers = await g.get("/scry/chat/0", **kw)
            assert status == 200
            assert headers["Content-Type"] == "application/preserves"
            assert headers["Scry-Index"] == "0"
            assert body == encode(v)
        # JSON wins when asked for by name.
        status, body, _ = await g.get("/scry/chat/0?format=json",
                                      headers={"Accept": "application/preserves"})
        assert parse(json.loads(body)["value"]) == v


@async_test
async def test_removed_entry_is_410_with_the_first_kept(tmp_path):
    async with gateway(tmp_path, publish=("logs",)) as g:
        g.store.create_stream("logs", max_count=2)
        for i in range(5):
            g.store.append("logs", i)
        status, body, _ = await g.get("/scry/logs/1")
        assert status == 410
        doc = json.loads(body)
        assert doc["first"] == 3 and "removed by retention" in doc["error"]
        status, body, _ = await g.get("/scry/logs/4")
        assert status == 200 and json.loads(body)["value"] == "4"
        status, body, _ = await g.get("/scry/logs")
        assert json.loads(body) == {"stream": "logs", "next": 5, "first": 3}


@async_test
async def test_unpublished_streams_are_404_and_never_data(tmp_path):
    async with gateway(tmp_path) as g:
        g.store.append("secret", parse('"the password"'))
        for path in ("/scry/secret/0", "/scry/secret", "/scry/secret?from=0",
                     "/scry/secret/0?format=binary"):
            status, body, _ = await g.get(path, headers={"Accept": "text/event-stream"}
                                          if "from" in path else {})
            assert status == 404, path
            assert json.loads(body) == {"error": "stream 'secret' is not published here"}
            assert b"password" not in body
        status, body, _ = await g.get("/scry/")
        assert json.loads(body) == {"streams": [{"stream": "chat", "next": 0, "first": None}]}


@async_test
async def test_malformed_requests_are_400(tmp_path, caplog):
    async with gateway(tmp_path) as g:
        for path in ("/scry/chat/abc", "/scry/chat/-1", "/scry/chat/1.5",
                     "/scry/chat/99999999999999999999", "/scry/chat/1?timeout=soon",
                     "/scry/chat/1?timeout=-3", "/scry/chat/1?timeout=nan",
                     "/scry/chat/1?format=xml", "/scry/chat?from=yesterday",
                     "/scry/a/b/c", "/scry/bad%20name/0", "/scry/..%2Fetc/0",
                     "/scry/" + "x" * 300):
            status, body, headers = await g.get(path)
            assert status == 400, path
            assert headers["Content-Type"].startswith("application/json")
            assert json.loads(body)["error"], path
        # Not HTTP at all: aiohttp's 400, one debug line in the log (no traceback).
        with caplog.at_level(logging.DEBUG):
            r, w = await asyncio.open_connection("127.0.0.1", g.http.port)
            w.write(b"GET /scry/chat HTTP/1.1\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n")
            answer = await asyncio.wait_for(r.read(), TIMEOUT)
            w.close()
        assert answer.startswith(b"HTTP/1.0 400 ") or answer.startswith(b"HTTP/1.1 400 ")
        assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
        assert not [rec for rec in caplog.records if rec.exc_info]
        status, body, _ = await g.get("/scry/chat", headers={"Last-Event-ID": "x"})
        assert status == 200  # not an event stream: the head
        status, body, _ = await g.get("/scry/chat?from=0", headers={"Last-Event-ID": "x"})
        assert status == 400 and "Last-Event-ID" in json.loads(body)["error"]
        assert g.gw.active == 0


# ------------------------------------------------------------------------------------
# Server-Sent Events


@async_test
async def test_events_in_order_with_ids_and_resume_after_last_event_id(tmp_path):
    # No keep-alive within the test's waits: only the store's wake-up can deliver.
    async with gateway(tmp_path, keepalive=120) as g:
        g.store.append_many("chat", [parse(f'<Says "a" "{i}">') for i in range(3)])
        async with g.session.get(g.url("/scry/chat?from=start")) as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            ev = Events(r)
            got = await ev.entries(3)
            assert [i for i, _ in got] == [0, 1, 2]
            assert [d["value"] for _, d in got] == [f'<Says "a" "{i}">' for i in range(3)]
            assert all(d["index"] == i and d["stream"] == "chat" for i, d in got)
            # Appended by another process: delivered at once, in order.
            await append_elsewhere(g.data_dir, "chat", '<Says "b" "3">', '<Says "b" "4">')
            got = await ev.entries(2)
            assert [(i, d["value"]) for i, d in got] == [(3, '<Says "b" "3">'),
                                                       (4, '<Says "b" "4">')]
        # An EventSource reconnecting sends the last id it saw: resume after it.
        async with g.session.get(g.url("/scry/chat?from=start"),
                                 headers={"Last-Event-ID": "2"}) as r:
            got = await Events(r).entries(2)
            assert [i for i, _ in got] == [3, 4]
        # from=N, and the default from=next (an EventSource asks with its Accept).
        async with g.session.get(g.url("/scry/chat?from=4")) as r:
            assert [i for i, _ in await Events(r).entries(1)] == [4]
        async with g.session.get(g.url("/scry/chat"),
                                 headers={"Accept": "text/event-stream"}) as r:
            ev = Events(r)
            assert await ev.first_comment() == ": stream chat from 5"
            g.store.append("chat", parse("<later>"))
            assert [(i, d["value"]) for i, d in await ev.entries(1)] == [(5, "<later>")]


@async_test
async def test_events_report_a_gap_left_by_retention(tmp_path):
    async with gateway(tmp_path, publish=("logs",)) as g:
        g.store.create_stream("logs", max_count=2)
        g.store.append_many("logs", list(range(6)))
        async with g.session.get(g.url("/scry/logs?from=1")) as r:
            ev = Events(r)
            gap = await ev.next()
            assert gap["event"] == "gap"
            assert json.loads(gap["data"]) == {"stream": "logs", "from": 1, "to": 4}
            assert [i for i, _ in await ev.entries(2)] == [4, 5]


@async_test
async def test_keepalive_comments_on_a_quiet_stream(tmp_path):
    async with gateway(tmp_path, keepalive=0.2) as g:
        async with g.session.get(g.url("/scry/chat?from=next")) as r:
            ev = Events(r)
            await ev.first_comment()
            line = await asyncio.wait_for(r.content.readline(), TIMEOUT)
            assert line == b": keep-alive\n"


@async_test
async def test_server_stop_ends_event_streams_and_long_polls_cleanly(tmp_path):
    async with gateway(tmp_path) as g:
        async with g.session.get(g.url("/scry/chat?from=0")) as r:
            await Events(r).first_comment()
            poll = asyncio.ensure_future(g.get("/scry/chat/0?timeout=120"))
            await g.gw.wait_until(lambda: g.gw.active == 2 and g.gw.watch is not None
                                  and g.gw.watch.waiting == 2, TIMEOUT)
            await asyncio.wait_for(g.http.close(), TIMEOUT)
            # The event stream ends with the chunked terminator: a clean end, no error.
            rest = await asyncio.wait_for(r.content.read(), TIMEOUT)
            assert rest == b""
            status, body, _ = await asyncio.wait_for(poll, TIMEOUT)
            assert status == 503 and "shutting down" in json.loads(body)["error"]


# ------------------------------------------------------------------------------------
# Bounds


@async_test
async def test_cap_on_waiting_requests_is_503_and_slots_come_back(tmp_path):
    async with gateway(tmp_path, max_waiting=2) as g:
        s1 = await g.session.get(g.url("/scry/chat?from=next"))
        s2 = await g.session.get(g.url("/scry/chat?from=next"))
        try:
            await Events(s1).first_comment()
            await Events(s2).first_comment()
            assert g.gw.active == 2
            status, body, headers = await g.get("/scry/chat/0?timeout=5")
            assert status == 503
            assert "too many waiting requests" in json.loads(body)["error"]
            assert headers["Retry-After"]
            status, _, _ = await g.get("/scry/chat?from=0")
            assert status == 503
            # Heads are not capped (they never wait).
            status, _, _ = await g.get("/scry/chat")
            assert status == 200
        finally:
            s1.close()  # the client goes away: its slot is freed
        await g.gw.wait_until(lambda: g.gw.active == 1, TIMEOUT)
        status, _, _ = await g.get("/scry/chat/0?timeout=0")
        assert status == 204
        s2.close()
        await g.gw.wait_until(lambda: g.gw.active == 0, TIMEOUT)
        assert g.gw.stats()["refused_busy"] == 2


@async_test
async def test_a_client_that_reads_nothing_is_disconnected(tmp_path):
    # Entries keep coming, the client never reads: the server's buffering for it stays
    # bounded (the socket's buffer and one batch), and after send_timeout it is dropped.
    async with gateway(tmp_path, send_timeout=0.5) as g:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(sock, ("127.0.0.1", g.http.port))
            await loop.sock_sendall(sock, b"GET /scry/chat?from=0 HTTP/1.1\r\n"
                                          b"Host: localhost\r\n\r\n")
            await g.gw.wait_until(lambda: g.gw.active == 1, TIMEOUT)
            big = parse('"' + "x" * 20_000 + '"')

            async def keep_appending() -> None:
                while True:
                    await asyncio.to_thread(g.store.append_many, "chat", [big] * 50)

            feeder = asyncio.ensure_future(keep_appending())
            try:
                await g.gw.wait_until(lambda: g.gw.active == 0, TIMEOUT)
            finally:
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feeder
            stats = g.gw.stats()
            assert stats["slow_clients_closed"] == 1
            assert stats["cache_bytes"] <= ScryLimits().cache_bytes
        finally:
            sock.close()


# ------------------------------------------------------------------------------------
# dataspace serve --http


@async_test
async def test_serve_http_gateway_end_to_end(tmp_path):
    data = tmp_path / "data"
    srv = ServerProcess(data, extra=("--http", "127.0.0.1:0", "--publish", "chat",
                                     "--record", "chat:<Says $who $text>"))
    await srv.start()
    try:
        line = next(s for s in srv.stderr_lines if "HTTP on" in s)
        m = re.search(r"HTTP on (http://127\.0\.0\.1:\d+/) \(scry gateway for: chat; ", line)
        assert m, line
        # The HTTP line comes before the "Ctrl-C stops" line.
        assert "Ctrl-C stops" in srv.stderr_lines[-1]
        base = m.group(1)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as s:
            async with s.get(base + "scry/chat?from=next") as r:
                ev = Events(r)
                assert await ev.first_comment() == ": stream chat from 0"
                # Recorded by the server from a client's message ...
                p = await asyncio.create_subprocess_exec(
                    PY, "-m", "dataspace.cli", "send", '<Says "dan" "hello">',
                    "--server", srv.address, "--data-dir", str(data),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
                _, err = await asyncio.wait_for(p.communicate(), TIMEOUT)
                assert p.returncode == 0, err
                # ... and appended by another process.
                await append_elsewhere(data, "chat", '<Says "eve" "hey">')
                got = await ev.entries(2)
                assert [(i, d["value"]) for i, d in got] == [
                    (0, '<Says "dan" "hello">'), (1, '<Says "eve" "hey">')]
            async with s.get(base + "scry/other/0") as r:
                assert r.status == 404
            # Stopping the server ends an open event stream cleanly.
            async with s.get(base + "scry/chat?from=next") as r:
                await Events(r).first_comment()
                assert await srv.stop(signal.SIGINT) == 0
                assert await asyncio.wait_for(r.content.read(), TIMEOUT) == b""
    finally:
        await srv.stop(signal.SIGKILL)


def test_serve_http_address_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(
            [PY, "-m", "dataspace.cli", "serve", "--tcp", "127.0.0.1:0", "--data-dir",
             str(tmp_path / "data"), "--http", f"127.0.0.1:{port}", "--publish", "chat"],
            capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 1
    assert r.stdout == ""  # no sturdyref printed: the server did not start
    lines = [s for s in r.stderr.splitlines() if "shutting down" not in s]
    assert len(lines) == 1 and lines[0].startswith("dataspace serve: ") and "ddress" in lines[0]


@pytest.mark.parametrize("name", ["bad name", "", "a" * 201])
def test_publish_names_are_checked(tmp_path, name):
    r = subprocess.run(
        [PY, "-m", "dataspace.cli", "serve", "--tcp", "127.0.0.1:0", "--data-dir",
         str(tmp_path / "data"), "--http", "127.0.0.1:0", "--publish", name],
        capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode != 0
    assert "invalid stream name" in r.stderr
