"""`dataspace info` and `dataspace top` as subprocesses against `dataspace serve --http`:
the summary once (text and JSON), top's snapshot without a terminal, and top live in a
pseudo-terminal (keys sort, q quits).  Waits are bounded and wait on output."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import select
import subprocess
import time

from broker_support import PY, TIMEOUT, ServerProcess, async_test
from dataspace._build import BUILD
from dataspace.client import connect
from dataspace.values import parse


async def _cli(*args: str) -> tuple[int, str, str]:
    p = await asyncio.create_subprocess_exec(
        PY, "-m", "dataspace.cli", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"})
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
        assert "sort:" not in out  # no key help without a terminal
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
