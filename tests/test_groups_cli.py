"""`dataspace observe PATTERN --group NAME [--rebalance]`: workers on the command line
sharing messages and jobs (issue 31, phase 2), against a real server on loopback."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess

from broker_support import (
    PY,
    TIMEOUT,
    Changes,
    async_test,
    kill,
    running_server,
    tcp_address,
)
from dataspace.client import connect
from dataspace.values import Record, Symbol


def job(i: int) -> Record:
    return Record(Symbol("Job"), [i])


async def spawn_cli(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        PY, "-m", "dataspace.cli", *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def lines_until(proc: asyncio.subprocess.Process, seen: list[str], pred) -> None:
    """Read ``proc``'s lines into ``seen`` until ``pred(seen)`` (bounded)."""
    async def loop() -> None:
        while not pred(seen):
            line = await proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise EOFError(f"the command ended; it printed {seen}")
            seen.append(line.decode().rstrip("\n"))

    await asyncio.wait_for(loop(), TIMEOUT)


def events(seen: list[str], prefix: str) -> list[int]:
    return [int(m.group(1)) for s in seen if (m := re.match(rf"^\{prefix} <Job (\d+)>$", s))]


@async_test
async def test_workers_on_the_command_line_share_messages_and_jobs(tmp_path):
    async with running_server(tmp_path) as server:
        conn = ("--server", tcp_address(server), "--data-dir", str(tmp_path / "data"))
        me = await connect(tcp_address(server), server.sturdyref)
        members = Changes()  # the memberships, as any client can see them
        me.observe("<ObserveGroup $group $pattern $who>", **members.kw())
        await me.sync()
        a = await spawn_cli("observe", "<Job $id>", "--group", "workers", *conn)
        b = await spawn_cli("observe", "<Job $id>", "-g", "workers", *conn)
        a_out: list[str] = []
        b_out: list[str] = []
        try:
            await members.until(lambda c: len(c.present) == 2)
            assert {caps[0] for caps in members.present} == {"workers"}
            for i in range(10):
                me.send(job(i))
            for i in range(20, 24):
                me.assert_(job(i))
            await me.sync()
            await lines_until(a, a_out, lambda s: len(events(s, "!")) == 5
                              and len(events(s, "+")) == 2)
            await lines_until(b, b_out, lambda s: len(events(s, "!")) == 5
                              and len(events(s, "+")) == 2)
            assert sorted(events(a_out, "!") + events(b_out, "!")) == list(range(10))
            assert sorted(events(a_out, "+") + events(b_out, "+")) == list(range(20, 24))
            # Ctrl-C on a: it leaves, and b takes its jobs (printing their + lines).
            a_jobs = events(a_out, "+")
            a.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(a.wait(), TIMEOUT) == 0
            await lines_until(b, b_out, lambda s: len(events(s, "+")) == 4)
            assert sorted(events(b_out, "+")) == list(range(20, 24))
            assert events(b_out, "+")[2:] == a_jobs
            # A third joins with --rebalance: it takes half of b's jobs, which b is told.
            c = await spawn_cli("observe", "<Job $id>", "--group", "workers",
                                "--rebalance", *conn)
            c_out: list[str] = []
            try:
                await lines_until(c, c_out, lambda s: len(events(s, "+")) == 2)
                await lines_until(b, b_out, lambda s: len(events(s, "-")) == 2)
                assert sorted(events(b_out, "-")) == sorted(events(c_out, "+"))
            finally:
                await kill(c)
        finally:
            await kill(a)
            await kill(b)
        await me.close()


def test_group_options_are_checked(capsys, monkeypatch):
    from dataspace.cli import main

    monkeypatch.setenv("COLUMNS", "80")

    def run(*args: str) -> tuple[int, str]:
        code = main(["observe", *args, "--server", "127.0.0.1:1"])
        return code, capsys.readouterr().err

    code, err = run("<Job $id>", "--rebalance")
    assert code == 2 and err.count("\n") == 1 and "--rebalance goes with --group NAME" in err
    code, err = run("<Job $id>", "--group", "")
    assert code == 2 and "must not be empty" in err
    code, err = run("<Job $id>", "--group", "x" * 300)
    assert code == 2 and "at most 256 bytes" in err
    try:
        main(["observe", "--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert "--group NAME" in out and "--rebalance" in out
    assert "observe '<Job $id $file>' --group resize" in out
    assert max(map(len, out.splitlines())) <= 80
