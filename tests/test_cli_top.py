"""`dataspace info` and `dataspace top` as subprocesses against `dataspace serve --http`:
the summary once (text and JSON), top's snapshot without a terminal, and top live in a
pseudo-terminal (keys sort, q quits).  Waits are bounded and wait on output."""

from __future__ import annotations

import asyncio
import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import time

from rich.console import Console

from broker_support import PY, TIMEOUT, ServerProcess, async_test
from dataspace._build import BUILD
from dataspace.cli.top import COLUMNS, Sample, render
from dataspace.client import connect
from dataspace.values import parse


async def _cli(*args: str, columns: int = 200) -> tuple[int, str, str]:
    p = await asyncio.create_subprocess_exec(
        PY, "-m", "dataspace.cli", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": str(columns)})
    out, err = await asyncio.wait_for(p.communicate(), TIMEOUT)
    assert p.returncode is not None
    return p.returncode, out.decode(), err.decode()


async def _server(tmp_path) -> tuple[ServerProcess, str]:
    srv = ServerProcess(tmp_path / "data", extra=("--http", "127.0.0.1:0",
                                                  "--record", "chat:<Says $who $text>"))
    await srv.start()
    line = next(s for s in srv.stderr_lines if "HTTP on" in s)
    url = re.search(r"HTTP on (http://127\.0\.0\.1:\d+)/", line).group(1)  # type: ignore[union-attr]
    return srv, url


@async_test
async def test_info_and_top_snapshot(tmp_path):
    srv, url = await _server(tmp_path)
    data = str(tmp_path / "data")
    try:
        ds = await connect(srv.address, srv.sturdyref, reconnect=False)
        ds.observe("<Says $who $text>", on_message=lambda *c: None)
        ds.assert_(parse('<Present "alice">'))
        with ds.turn():
            for i in range(3):
                ds.send(parse(f'<Says "alice" "m{i}">'))
        await ds.sync()

        code, out, err = await _cli("info", "--url", url, "--data-dir", data)
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].startswith(f"dataspace 0.1.0 at {url}/ (server ")
        assert lines[1] == f"core         {BUILD.describe()}"  # compiled or pure Python
        assert "connections  1 open, 1 accepted, 0 refused" in out
        assert "messages 3 in, 3 out" in out
        assert "recorder     chat: 3 recorded, 0 dropped, 0 queued" in out

        code, out, err = await _cli("info", "--json", "--url", url, "--data-dir", data)
        assert code == 0, err
        s = json.loads(out)
        assert s["connections"] == 1 and s["messages_in"] == 3 and s["scope"] == "admin"
        assert s["core"]["compiled"] == BUILD.compiled and s["core"]["modules"] == list(BUILD.modules)

        # Not a terminal: one snapshot, then exit.
        code, out, err = await _cli("top", "--url", url, "--token", "@" + data + "/root.sturdyref")
        assert code == 0, err
        assert "connections: 1, sorted by connection id" in out
        assert re.search(r"^\s*\d+\s+127\.0\.0\.1:\d+\s+root\s", out, re.M), out
        assert "busiest patterns in root" in out and "<Says $ $>" in out
        # The recorder's subscription is the server's own: marked so.
        assert "(recorder chat) <$ <Says $who $text>>" in out, out
        assert "sort:" not in out  # no key help without a terminal

        # --once --json: what the screen shows, as one object.
        code, out, err = await _cli("top", "--once", "--json", "--url", url, "--data-dir", data)
        assert code == 0, err
        doc = json.loads(out)
        assert doc["server"]["connections"] == 1 and doc["server"]["messages_in"] == 3
        assert doc["rates"]["messages_in"] is None  # one reading: no rate yet
        assert doc["sort"] == "id" and doc["connections"]["count"] == 1
        [row] = doc["connections"]["shown"]
        assert row["observers"] == 1 and row["assertions_in"] == 2 and "msgs_in_rate" in row
        busiest = {(p["pattern"], p["own"]) for p in doc["patterns"]["busiest"]}
        assert {("<Says $ $>", None), ("<$ <Says $who $text>>", "recorder chat")} <= busiest
        await ds.close()
    finally:
        assert await srv.stop() == 0


@async_test
async def test_info_and_top_say_what_is_wrong(tmp_path):
    srv, url = await _server(tmp_path)
    try:
        code, _out, err = await _cli("info", "--url", url, "--token", "nonsense")
        assert code == 1 and "401" in err and "--token" in err and err.count("\n") == 1
        code, _out, err = await _cli("top", "--url", "http://127.0.0.1:1")
        assert code == 1 and "cannot reach http://127.0.0.1:1/" in err
    finally:
        await srv.stop()


def _read_until(fd: int, pattern: str, seen: list[str], timeout: float = TIMEOUT) -> None:
    """Read the terminal until ``pattern`` appears in what it shows."""
    deadline = time.monotonic() + timeout
    rx = re.compile(pattern)
    while not rx.search("".join(seen)):
        left = deadline - time.monotonic()
        assert left > 0, f"no {pattern!r} in {''.join(seen)[-2000:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                seen.append(os.read(fd, 65536).decode(errors="replace"))
            except OSError:  # the program ended
                assert rx.search("".join(seen)), "".join(seen)[-2000:]
                return


@async_test
async def test_top_live_in_a_terminal_sorts_by_key_and_quits(tmp_path):
    srv, url = await _server(tmp_path)
    master, slave = pty.openpty()
    proc: subprocess.Popen[bytes] | None = None
    try:
        ds = await connect(srv.address, srv.sturdyref, reconnect=False)
        await ds.sync()
        proc = subprocess.Popen(
            [PY, "-m", "dataspace.cli", "top", "--url", url, "--data-dir",
             str(tmp_path / "data"), "--interval", "0.2"],
            stdin=slave, stdout=slave, stderr=slave, close_fds=True,
            env={**os.environ, "COLUMNS": "200", "LINES": "50", "TERM": "xterm"})
        os.close(slave)
        seen: list[str] = []
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, _read_until, master, r"sorted by connection id", seen)
        await loop.run_in_executor(None, _read_until, master, r"r reverse\s+q quit", seen)
        os.write(master, b"o")
        await loop.run_in_executor(None, _read_until, master,
                                   r"sorted by messages out per second", seen)
        os.write(master, b"r")
        await loop.run_in_executor(None, _read_until, master, r"\(reversed\)", seen)
        os.write(master, b"q")
        code = await loop.run_in_executor(None, proc.wait, TIMEOUT)
        assert code == 0, "".join(seen)[-2000:]
        await ds.close()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        os.close(master)
        await srv.stop()


# ------------------------------------------------------------------------------------
# What top shows: the counts of what the client did, and a screen that fits 80 columns


@async_test
async def test_a_client_that_asserted_one_value_shows_assert_1_match_0(tmp_path):
    """The gatekeeper's resolve request and its answer are the protocol's, not the
    user's: they are counted apart (``resolves``), not in ASSERT and MATCH."""
    srv, url = await _server(tmp_path)
    data = str(tmp_path / "data")
    try:
        alice = await connect(srv.address, srv.sturdyref, reconnect=False)
        alice.assert_(parse('<Present "alice">'))
        await alice.sync()
        seen = asyncio.Event()
        bob = await connect(srv.address, srv.sturdyref, reconnect=False)
        bob.observe("<Present $who>", on_assert=lambda *c: seen.set())
        await asyncio.wait_for(seen.wait(), TIMEOUT)
        await bob.sync()

        code, out, err = await _cli("info", "--json", "--url", url, "--data-dir", data)
        assert code == 0, err
        s = json.loads(out)
        assert s["assertions"] == 2 and s["resolves"] == 2  # the value and bob's observer

        code, out, err = await _cli("top", "--url", url, "--data-dir", data, columns=80)
        assert code == 0, err
        lines = out.splitlines()
        heads = next(i for i, s in enumerate(lines) if s.startswith("ID "))
        names = lines[heads].split()
        assert all(len(s) <= 80 for s in lines), out
        rows = {}
        for line in lines[heads + 1:heads + 3]:
            cells = re.split(r"\s+", line.strip())
            rows[int(cells[0])] = dict(zip(names, cells, strict=False))
        a, b = (rows[k] for k in sorted(rows))  # alice connected first
        assert (a["SUBS"], a["ASSERT"], a["MATCH"]) == ("0", "1", "0"), out
        assert (b["SUBS"], b["ASSERT"], b["MATCH"]) == ("1", "1", "1"), out
        await alice.close()
        await bob.close()
    finally:
        assert await srv.stop() == 0


def _fake(n: int) -> Sample:
    """A sample of ``n`` busy connections (big counters, a long address, a named client,
    one held) and a long pattern, as the endpoints would give them."""
    server = {"version": "0.1.0", "server_id": "0123456789abcdef", "uptime": 3 * 86400 + 7,
              "memory_rss": 3 * 2**30, "connections": n, "assertions": 1_234_567,
              "observers": 5_432, "turns": 98_765_432, "messages_in": 12_345_678_901,
              "messages_out": 9_876_543, "bytes_in": 5 * 2**40, "bytes_out": 123_456_789,
              "errors": {"slow_consumer": 3}}
    conns = []
    for i in range(n):
        conns.append({
            "id": 10_000 + i, "peer": f"[2001:db8:1234:5678::{i:x}]:54321",
            "dataspaces": [{"name": "root", "attenuated": i % 2 == 1}], "age": 4000.0 + i,
            "observers": 12 * i, "assertions_in": 123_456 + i, "assertions_out": 7_654_321,
            "messages_in": 1_234_567 * (i + 1), "messages_out": 42, "bytes_in": 3_500_000,
            "bytes_out": 12 * 2**30, "pending_output": 2**21, "held": ["debt"] if i == 1 else [],
            "idle": 0.5})
    conns[0]["name"] = "billing-worker-with-a-very-long-name"
    subs = {"dataspace": "root", "patterns": [
        {"pattern": "<Order $id <Customer $name $address $phone> $items $total $when>",
         "observers": 1500, "matches": 2_000_000, "delivered": 77_000_000}]}
    prev = Sample.of(server, {"count": n, "connections": [dict(c) for c in conns]}, subs, t=0.0)
    for c in conns:
        c["messages_in"] += 2500
    server = {**server, "messages_in": server["messages_in"] + 1000}
    return Sample.of(server, {"count": n, "connections": conns},
                     {"dataspace": "root", "patterns": [dict(p) for p in subs["patterns"]]},
                     prev=prev, t=1.0)


def _screen(s: Sample, width: int, height: int | None = None, sort: str = "c") -> list[str]:
    console = Console(width=width, record=True, highlight=False, color_system=None,
                      file=io.StringIO())
    console.print(render(s, sort, False, 30, height is not None, width, height))
    return console.export_text().rstrip("\n").split("\n")


def _headings(lines: list[str]) -> str:
    return next(s for s in lines if s.lstrip().startswith("ID "))


def test_top_fits_80_columns_with_every_heading_whole():
    lines = _screen(_fake(3), 80)
    assert all(len(s) <= 80 for s in lines), "\n".join(lines)
    head = _headings(lines)
    assert _whole_headings(head) == ["ID", "CLIENT", "SUBS", "ASSERT", "MATCH", "MSG IN/s",
                                     "MSG OUT/s", "PEND", "HELD"], head
    rows = lines[lines.index(head) + 1:lines.index(head) + 4]
    assert [r.split()[0] for r in rows] == ["10000", "10001", "10002"]  # the ID, always
    # The client's name when it gave one (cut to fit), else its address; human numbers.
    assert rows[0].split()[1].startswith("billing-worker") and "…" in rows[0]
    assert rows[1].split()[1].startswith("[2001:db8:1234:5678::1]:54")  # cut: HELD's room
    assert "[2001:db8:1234:5678::2]:54321" in "\n".join(_screen(_fake(3), 90))  # whole
    assert rows[0].split()[2:8] == ["0", "123k", "7.7M", "2.5k", "0", "2.0M"], rows[0]
    assert "messages in 12G (1.0k/s)" in "\n".join(lines)
    assert "bytes in 5.0T" in "\n".join(lines)


def _whole_headings(head: str) -> list[str]:
    """The headings of ``head``, each checked to be a whole heading of top's table."""
    known = [c.head for c in COLUMNS]
    found, rest = [], head.strip()
    while rest:
        name = next((k for k in sorted(known, key=len, reverse=True)
                     if rest == k or rest.startswith(k + " ")), None)
        assert name is not None, f"not a whole heading at {rest!r} in {head!r}"
        found.append(name)
        rest = rest[len(name):].lstrip()
    return found


def test_top_at_120_columns_adds_the_totals_and_the_sort_column_always_shows():
    lines = _screen(_fake(3), 120)
    assert all(len(s) <= 120 for s in lines), "\n".join(lines)
    assert _whole_headings(_headings(lines)) == [
        "ID", "CLIENT", "DS", "AGE", "SUBS", "ASSERT", "MATCH", "MSGS IN", "MSGS OUT",
        "MSG IN/s", "MSG OUT/s", "PEND", "IDLE", "HELD"]
    row = next(s for s in lines if s.startswith("10001 "))
    assert "root* 1h06m" in row and row.rstrip().endswith("debt")  # through caveats; held
    # Wider: the byte counters, and the peer's address beside the name a client gave.
    heads = _whole_headings(_headings(_screen(_fake(3), 160)))
    assert {"PEER", "BYTES IN", "BYTES OUT"} <= set(heads), heads
    # Sorting by bytes out per second shows that column even at 80 (PEND and HELD make room).
    heads = _whole_headings(_headings(_screen(_fake(3), 80, sort="B")))
    assert heads[-2:] == ["B OUT/s", "PEND"], heads


def test_top_live_fits_an_80x24_terminal():
    lines = _screen(_fake(50), 80, 24)
    assert len(lines) <= 24 and all(len(s) <= 80 for s in lines), "\n".join(lines)
    assert any("first" in s and "sorted by connection id" in s for s in lines)
    assert any(s.startswith("busiest patterns in root") for s in lines)
    assert lines[-2].startswith("sort: c ID  a ASSERT") and lines[-1].endswith("q quit")


def test_the_columns_depend_on_the_width_alone_as_the_docs_say():
    """Issue 28: at 80 columns top showed columns docs/operations.md did not list (which
    ones depended on the rows: short names let more in).  The docs' table says from which
    width each column shows; the code computes the same, whatever the rows."""
    from dataspace.cli.top import columns_for

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "operations.md")).read()
    table = doc.split("<!-- top-columns:", 1)[1].split("\n\n", 1)[0]
    want: dict[str, int] = {}
    for line in table.splitlines()[3:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for head in cells[0].split(", "):
            want[head] = 0 if cells[2] == "always" else int(cells[2])
    assert sorted(want) == sorted(c.head for c in COLUMNS)
    for width in range(30, 221):
        shown = {c.head for c in columns_for(width)}
        assert shown == {h for h, w in want.items() if w <= width}, width
    # And on the screen: short names and small numbers do not let more columns in; one
    # held connection shows HELD in the room kept for it.
    few = _fake(2)
    for c in few.conns["connections"]:
        c.update(name="a", messages_in=1, bytes_out=1, held=[])
    for width, heads in ((80, ["ID", "CLIENT", "SUBS", "ASSERT", "MATCH", "MSG IN/s",
                               "MSG OUT/s", "PEND"]),
                         (120, ["ID", "CLIENT", "DS", "AGE", "SUBS", "ASSERT", "MATCH",
                                "MSGS IN", "MSGS OUT", "MSG IN/s", "MSG OUT/s", "PEND",
                                "IDLE"])):
        lines = _screen(few, width)
        assert _whole_headings(_headings(lines)) == heads, lines
        assert all(len(s) <= width for s in lines)
    lines = _screen(_fake(3), 80)
    assert _whole_headings(_headings(lines))[-1] == "HELD"


def _http_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@async_test
async def test_top_waits_for_a_restarted_server_and_carries_on(tmp_path):
    """Issue 28: `top` exited ("cannot reach ...") when the server restarted.  It says
    the server is gone, tries again with backoff, and carries on with the new server (a
    real server, restarted on the same ports); Ctrl-C quits at once.  --json streams an
    object per reading, which a test can read without a terminal."""
    port = _http_port()
    srv = ServerProcess(tmp_path / "data", extra=("--http", f"127.0.0.1:{port}"))
    await srv.start()
    url = f"http://127.0.0.1:{port}"
    p = await asyncio.create_subprocess_exec(
        PY, "-m", "dataspace.cli", "top", "--json", "--interval", "0.2", "--url", url,
        "--data-dir", str(tmp_path / "data"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.stdout is not None and p.stderr is not None
    try:
        first = json.loads(await asyncio.wait_for(p.stdout.readline(), TIMEOUT))
        assert await srv.stop() == 0
        line = (await asyncio.wait_for(p.stderr.readline(), TIMEOUT)).decode()
        assert line.startswith("dataspace top: server gone ("), line
        assert "reconnecting" in line and p.returncode is None
        await srv.start()  # the same ports
        line = (await asyncio.wait_for(p.stderr.readline(), TIMEOUT)).decode()
        assert line.startswith("dataspace top: reconnected (server "), line

        async def a_reading_of_the_new_run() -> dict:
            while True:
                doc = json.loads(await p.stdout.readline())
                if doc["server"]["started"] != first["server"]["started"]:
                    return doc

        doc = await asyncio.wait_for(a_reading_of_the_new_run(), TIMEOUT)
        assert doc["server"]["server_id"] == first["server"]["server_id"]  # the same server
        assert doc["rates"]["messages_in"] is None  # its counters start again: no rate yet
        p.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(p.wait(), TIMEOUT) == 0
        assert (await p.stderr.read()) == b""
    finally:
        if p.returncode is None:
            p.kill()
            await p.wait()
        await srv.stop()


@async_test
async def test_top_on_a_terminal_says_the_server_is_gone_and_comes_back(tmp_path):
    """The same on a terminal: the screen says "server gone, reconnecting", q quits."""
    port = _http_port()
    srv = ServerProcess(tmp_path / "data", extra=("--http", f"127.0.0.1:{port}"))
    await srv.start()
    master, slave = pty.openpty()
    proc: subprocess.Popen[bytes] | None = None
    loop = asyncio.get_running_loop()
    try:
        proc = subprocess.Popen(
            [PY, "-m", "dataspace.cli", "top", "--url", f"http://127.0.0.1:{port}",
             "--data-dir", str(tmp_path / "data"), "--interval", "0.2"],
            stdin=slave, stdout=slave, stderr=slave, close_fds=True,
            env={**os.environ, "COLUMNS": "100", "LINES": "30", "TERM": "xterm"})
        os.close(slave)
        seen: list[str] = []
        await loop.run_in_executor(None, _read_until, master, r"connections: 0, sorted", seen)
        assert await srv.stop() == 0
        await loop.run_in_executor(None, _read_until, master,
                                   r"server gone \(connection refused.*reconnecting", seen)
        seen.clear()
        await srv.start()
        await loop.run_in_executor(None, _read_until, master, r"connections: 0, sorted", seen)
        os.write(master, b"q")
        code = await loop.run_in_executor(None, proc.wait, TIMEOUT)
        assert code == 0, "".join(seen)[-2000:]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        os.close(master)
        await srv.stop()
