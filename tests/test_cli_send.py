"""`dataspace send --count N` (numbered repeats, as `nats pub --count`) and `send -
--lines` (each line of standard input sent as it is read), with Ctrl-C and EOF, against a
real server on loopback (issue 28, section 5)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from broker_support import PY, TIMEOUT, Changes, async_test, kill, running_server, tcp_address
from dataspace.client import RemoteDataspace, connect


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dataspace.cli", *args], capture_output=True,
                          text=True, timeout=60, input=stdin)


async def spawn_send(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        PY, "-m", "dataspace.cli", "send", *args, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


@contextlib.asynccontextmanager
async def watched(tmp_path: Path, pattern: str,
                  ) -> AsyncIterator[tuple[tuple[str, ...], RemoteDataspace, Changes]]:
    """A server on loopback: the options that point the command at it, and a client
    watching the messages that match ``pattern`` (with what it has seen)."""
    async with running_server(tmp_path) as server:
        conn = ("--server", tcp_address(server), "--data-dir", str(tmp_path / "data"))
        watcher = await connect(tcp_address(server), server.sturdyref)
        try:
            seen = Changes()
            watcher.observe(pattern, **seen.kw())
            await watcher.sync()
            yield conn, watcher, seen
        finally:
            await watcher.close()


@async_test
async def test_send_count_numbers_the_messages_in_order(tmp_path):
    async with watched(tmp_path, "$m") as (conn, _watcher, seen):
        r = await asyncio.to_thread(run_cli, "send", "--count", "3", "<Tick $n>",
                                    "<Tock [$n] $$n>", "--json", *conn)
        assert r.returncode == 0, r.stderr
        want = ["<Tick 1>", "<Tock [1] $n>", "<Tick 2>", "<Tock [2] $n>", "<Tick 3>",
                "<Tock [3] $n>"]
        await seen.until(lambda s: len(s.messages()) >= 6)
        from dataspace.values import stringify

        assert [stringify(m[0]) for m in seen.messages()] == want
        rows = [json.loads(x) for x in r.stdout.splitlines()]
        assert [(row["n"], row["text"], row["sent"]) for row in rows] == [
            (i // 2 + 1, t, True) for i, t in enumerate(want)]
        assert rows[0]["value"] == {"@record": "Tick", "@fields": [1]}
        # The lines of standard input are numbered too.
        r = await asyncio.to_thread(run_cli, "send", "-", "--count", "2", *conn,
                                    stdin="<Line $n>\n")
        assert r.returncode == 0, r.stderr
        await seen.until(lambda s: len(s.messages()) >= 8)
        assert [stringify(m[0]) for m in seen.messages()[6:]] == ["<Line 1>", "<Line 2>"]


@async_test
async def test_send_count_interrupted_says_how_many_went(tmp_path):
    async with watched(tmp_path, "<Beat $n>") as (conn, watcher, seen):
        proc = await spawn_send("--count", "1000", "--interval", "0.05", "<Beat $n>", *conn)
        try:
            await seen.until(lambda s: len(s.messages()) >= 3)
            proc.send_signal(signal.SIGINT)
            _out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
        finally:
            await kill(proc)
        assert proc.returncode == 130, err
        await watcher.sync()  # everything the command confirmed has reached the watcher
        n = len(seen.messages())
        assert 3 <= n < 1000
        assert err.decode().splitlines() == [
            f"dataspace send: interrupted: {n} of 1000 message(s) sent"]
        assert [m[0] for m in seen.messages()] == list(range(1, n + 1))


@async_test
async def test_send_lines_sends_each_line_as_it_is_read(tmp_path):
    async with watched(tmp_path, "<L $n>") as (conn, _watcher, seen):
        proc = await spawn_send("<L 0>", "-", "--lines", *conn)
        assert proc.stdin is not None
        try:
            proc.stdin.write(b"<L 1>\n")
            await proc.stdin.drain()
            # Sent while standard input is still open: not held until EOF.
            await seen.until(lambda s: s.messages() == [(0,), (1,)])
            proc.stdin.write(b"\nnot a value <\n<L 2>\n")
            await proc.stdin.drain()
            await seen.until(lambda s: len(s.messages()) == 3)
            proc.stdin.close()  # EOF ends it
            _out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
        finally:
            await kill(proc)
        assert seen.messages() == [(0,), (1,), (2,)]
        assert proc.returncode == 1  # a line was not sent
        assert err.decode().splitlines() == [
            "dataspace send: line 3 not sent: column 5: unexpected text after the value: "
            "'a value <' (one value per line, e.g. <Says \"alice\" \"hi\">)"]

        # Ctrl-C ends it too, standard input still open: what was read has gone (status 0).
        proc = await spawn_send("-", "--lines", "-v", *conn)
        assert proc.stdin is not None and proc.stderr is not None
        try:
            proc.stdin.write(b"<L 3>\n")
            await proc.stdin.drain()
            line = await asyncio.wait_for(proc.stderr.readline(), TIMEOUT)
            assert line == b"sent <L 3>\n"
            await seen.until(lambda s: len(s.messages()) == 4)
            proc.send_signal(signal.SIGINT)
            _out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
        finally:
            await kill(proc)
        assert (proc.returncode, err) == (0, b"")


def test_send_refuses_what_it_cannot_use(capsys):
    from dataspace.cli import main

    for args, message in [
        (("--count", "2", "<Tick $m>"), "dataspace send: <Tick $m>: $m names nothing to fill "
         "in (it may use $n); write $$m for the symbol $m"),
        (("--count", "0", "<Tick $n>"), "dataspace send: --count must be at least 1, not 0"),
        (("<A>", "--lines"), "dataspace send: --lines sends the lines of standard input: "
         "give - as a VALUE"),
        (("-", "--lines", "--count", "2"), "dataspace send: --count repeats the VALUEs given"),
        (("--interval", "-1", "<A>"), "dataspace send: --interval must be 0 or more seconds"),
    ]:
        assert main(["send", *args, "--server", "127.0.0.1:1"]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith(message) and len(err.splitlines()) == 1, err
