"""`dataspace info` and `dataspace top` as subprocesses against `dataspace serve --http`:
the summary once (text and JSON), top's snapshot without a terminal, and top live in a
pseudo-terminal (keys sort, q quits, a resize, the terminal given back).  Waits are bounded
and wait on output."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path

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
        assert "\x1b" not in out  # nor any escape sequence

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


@contextlib.contextmanager
def _top_on_a_terminal(url: str, data_dir: Path, columns: int,
                       lines: int) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``dataspace top --interval 0.2`` on a new terminal of ``columns`` x ``lines``: the
    process and the terminal's end to read and type on (closed after; the process killed
    if it is still running)."""
    master, slave = pty.openpty()
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = subprocess.Popen(
            [PY, "-m", "dataspace.cli", "top", "--url", url, "--data-dir", str(data_dir),
             "--interval", "0.2"],
            stdin=slave, stdout=slave, stderr=slave, close_fds=True,
            env={**os.environ, "COLUMNS": str(columns), "LINES": str(lines), "TERM": "xterm"})
        os.close(slave)
        yield proc, master
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        os.close(master)


@async_test
async def test_top_live_in_a_terminal_sorts_by_key_and_quits(tmp_path):
    srv, url = await _server(tmp_path)
    try:
        ds = await connect(srv.address, srv.sturdyref, reconnect=False)
        await ds.sync()
        with _top_on_a_terminal(url, tmp_path / "data", 200, 50) as (proc, master):
            seen: list[str] = []
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, _read_until, master, r"sorted by connection id",
                                       seen)
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
    return str(render(s, sort, False, 30, height is not None, width, height)).split("\n")


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
    loop = asyncio.get_running_loop()
    try:
        with _top_on_a_terminal(f"http://127.0.0.1:{port}", tmp_path / "data", 100,
                                30) as (proc, master):
            seen: list[str] = []
            await loop.run_in_executor(None, _read_until, master, r"connections: 0, sorted",
                                       seen)
            assert await srv.stop() == 0
            await loop.run_in_executor(None, _read_until, master,
                                       r"server gone \(connection refused.*reconnecting", seen)
            seen.clear()
            await srv.start()
            await loop.run_in_executor(None, _read_until, master, r"connections: 0, sorted",
                                       seen)
            os.write(master, b"q")
            code = await loop.run_in_executor(None, proc.wait, TIMEOUT)
            assert code == 0, "".join(seen)[-2000:]
    finally:
        await srv.stop()


def test_top_shows_control_characters_in_what_it_is_given_as_question_marks():
    """What top shows comes from the server, and through it from clients: an escape
    sequence in a name or a pattern would reach the terminal.  It is shown as ``?``; the
    only escapes on the screen are top's own styles."""
    s = _fake(2)
    s.conns["connections"][0]["name"] = "evil\x1b]0;pwned\x07\x1b[2J\u202ename"
    s.subs["patterns"][0]["pattern"] = "<Says \x1b[31m $>"  # type: ignore[index]
    screen = render(s, "c", False, 30, True, 120, 40)
    text = str(screen)
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, text
    assert "evil?]0;pwned??[2J?name" in text and "<Says ?[31m $>" in text
    styled = "\n".join(screen.styled())
    assert set(re.findall(r"\x1b[^a-zA-Z]*[a-zA-Z]", styled)) <= {
        "\x1b[0m", "\x1b[1m", "\x1b[2m", "\x1b[31m"}, styled


# ------------------------------------------------------------------------------------
# The terminal: drawn with ANSI escapes, and given back as it was


class _Terminal:
    """A terminal of ``cols`` x ``rows`` as far as top's escapes go (the cursor's
    position, erasing in the line and below, the alternate screen, the cursor shown or
    hidden): what it shows, and how far each frame (from the top left) reached, in columns
    and rows.  Anything else top writes fails."""

    CSI = re.compile(r"\x1b\[([?0-9;]*)([@-~])")

    def __init__(self, cols: int, rows: int) -> None:
        self.cols, self.rows = cols, rows
        self.grid = [[" "] * cols for _ in range(rows)]
        self.y = self.x = 0
        self.alt, self.cursor, self.entered, self.left = False, True, 0, 0
        self.frames: list[list[int]] = []  # [columns, rows] reached by each frame
        self.rest = ""

    def resize(self, cols: int, rows: int) -> None:
        self.grid = [(r + [" "] * cols)[:cols] for r in self.grid[:rows]]
        self.grid += [[" "] * cols for _ in range(rows - len(self.grid))]
        self.cols, self.rows = cols, rows

    def lines(self) -> list[str]:
        return ["".join(r).rstrip() for r in self.grid]

    def feed(self, data: str) -> None:
        data, self.rest, i = self.rest + data, "", 0
        while i < len(data):
            if data[i] == "\x1b":
                m = self.CSI.match(data, i)
                if m is None:
                    assert re.fullmatch(r"\x1b(\[[?0-9;]*)?", data[i:]), repr(data[i:i + 20])
                    self.rest = data[i:]  # the rest of it comes with the next read
                    return
                self._csi(m.group(1), m.group(2))
                i = m.end()
                continue
            if self.alt:
                assert data[i] >= " ", repr(data[i])  # no \r, \n or other control
                if self.frames:
                    f = self.frames[-1]
                    f[0], f[1] = max(f[0], self.x + 1), max(f[1], self.y + 1)
                if self.y < self.rows and self.x < self.cols:
                    self.grid[self.y][self.x] = data[i]
                self.x += 1
            i += 1

    def _csi(self, params: str, final: str) -> None:
        if params.startswith("?") and final in "hl":
            on = final == "h"
            if params == "?1049":
                self.alt = on
                self.entered += on
                self.left += not on
                self.grid = [[" "] * self.cols for _ in range(self.rows)]
            elif params == "?25":
                self.cursor = on
            else:
                assert params == "?7", params  # wrapping at the margin: off, then on again
        elif final == "H":
            row, col = [*params.split(";"), "1", "1"][:2] if params else ("1", "1")
            self.y, self.x = int(row or 1) - 1, int(col or 1) - 1
            if (self.y, self.x) == (0, 0) and self.alt:
                self.frames.append([0, 0])
        elif final == "K":
            assert params in ("", "0"), params
            self.grid[self.y][self.x:] = [" "] * max(0, self.cols - self.x)
        elif final == "J":
            if params == "2":
                self.grid = [[" "] * self.cols for _ in range(self.rows)]
            else:
                assert params in ("", "0"), params
                self.grid[self.y][self.x:] = [" "] * max(0, self.cols - self.x)
                for r in range(self.y + 1, self.rows):
                    self.grid[r] = [" "] * self.cols
        else:
            assert final == "m" and re.fullmatch(r"[0-9;]*", params), (params, final)


def _follow(fd: int, term: _Terminal, until: Callable[[_Terminal], bool],
            timeout: float = TIMEOUT) -> None:
    """Feed what top writes to ``term`` until ``until(term)`` holds."""
    deadline = time.monotonic() + timeout
    while not until(term):
        left = deadline - time.monotonic()
        assert left > 0, "\n".join(term.lines())
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # the program ended (EIO)
                data = b""
            if not data:
                assert until(term), "\n".join(term.lines())
                return
            term.feed(data.decode())


def _window(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _drawn(term: _Terminal) -> bool:
    """A whole frame is on the screen (its last line is the keys' help)."""
    return term.alt and any(line.endswith("q quit") for line in term.lines())


@async_test
async def test_top_follows_a_resize_and_gives_the_terminal_back(tmp_path):
    """Drawn with ANSI escape sequences: the alternate screen, the cursor hidden, no line
    wider than the window.  Resized (the terminal sends SIGWINCH), top draws again at once
    for the new size (here --interval is long: nothing else draws).  q, Ctrl-C (the
    terminal sends SIGINT) and SIGTERM leave the alternate screen, show the cursor and put
    the terminal back in its mode (echo, lines edited); Ctrl-Z (SIGTSTP) gives it back
    until the process is continued.  A pipe gets no escape sequence (the snapshot test)."""
    srv, url = await _server(tmp_path)
    loop = asyncio.get_running_loop()
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    try:
        for end in ("q", signal.SIGINT, signal.SIGTERM):
            master, slave = pty.openpty()
            keep = os.dup(slave)  # to read its mode once top has ended
            _window(master, 100, 30)
            mode = termios.tcgetattr(slave)
            assert mode[3] & termios.ECHO and mode[3] & termios.ICANON
            proc = subprocess.Popen(
                [PY, "-m", "dataspace.cli", "top", "--url", url, "--data-dir",
                 str(tmp_path / "data"), "--interval", "60"],
                stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                env={**env, "TERM": "xterm"})
            os.close(slave)
            term = _Terminal(100, 30)
            try:
                # (The first frame waits on a process start and its first fetch: on a
                # loaded machine that took longer than TIMEOUT once, the screen blank.)
                await loop.run_in_executor(None, _follow, master, term, _drawn, 3 * TIMEOUT)
                assert term.entered == 1 and not term.cursor
                assert term.frames[0][0] <= 100 and term.frames[0][1] <= 30, term.frames
                assert term.lines()[0].startswith("dataspace 0.1.0  server ")
                assert any(line.lstrip().startswith("ID CLIENT ") for line in term.lines())
                if end == "q":
                    # Narrower and shorter: drawn again at once, every line within.
                    _window(master, 44, 20)
                    term.resize(44, 20)
                    proc.send_signal(signal.SIGWINCH)
                    await loop.run_in_executor(None, _follow, master, term, lambda t: (
                        re.fullmatch(r"dataspace 0\.1\.0  server [0-9a-f]+", t.lines()[0])
                        is not None and _drawn(t)))
                    assert len(term.frames) == 2 and term.frames[1][0] <= 44, term.frames
                    assert term.frames[1][1] <= 20, term.frames
                    assert any(line.lstrip().startswith("ID CLIENT ") for line in term.lines())
                    # Ctrl-Z: the terminal as it was; continued: the screen again.
                    proc.send_signal(signal.SIGTSTP)
                    await loop.run_in_executor(None, _follow, master, term,
                                               lambda t: t.left == 1 and t.cursor)
                    proc.send_signal(signal.SIGCONT)
                    await loop.run_in_executor(None, _follow, master, term,
                                               lambda t: t.entered == 2 and _drawn(t))
                    assert not term.cursor
                    os.write(master, b"q")
                else:
                    proc.send_signal(end)
                code = await loop.run_in_executor(None, proc.wait, TIMEOUT)
                assert code == (143 if end == signal.SIGTERM else 0), (end, code)
                await loop.run_in_executor(None, _follow, master, term,
                                           lambda t: not t.alt and t.cursor)
                assert term.left == term.entered, end
                assert termios.tcgetattr(keep) == mode, end  # echo and lines again
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(TIMEOUT)
                os.close(master)
                os.close(keep)
    finally:
        assert await srv.stop() == 0


def test_top_and_clients_import_neither_rich_nor_curses():
    """Issue 33: rich (with Pygments, about 14 MB) is no dependency any more; top draws
    with the standard library's escapes, not curses (which some Pythons lack)."""
    out = subprocess.run(
        [PY, "-c", "import sys, dataspace.cli.top, dataspace.cli.clients; print(sorted("
         "m for m in sys.modules if m.split('.')[0] in ('rich', 'pygments', 'curses')))"],
        capture_output=True, text=True, timeout=TIMEOUT, check=True)
    assert out.stdout.strip() == "[]", out.stdout
