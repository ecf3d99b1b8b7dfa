"""`dataspace reply` (a responder on the command line, as `nats reply`) and `dataspace
request --replies N / --wait SECONDS` (several replies), with real servers on loopback
(issue 28, section 5)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from broker_support import (
    PY,
    TIMEOUT,
    ServerProcess,
    async_test,
    kill,
    read_line_matching,
    running_server,
    tcp_address,
)
from dataspace.client import connect
from dataspace.values import Record, Symbol


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dataspace.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


async def acli(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run_cli, *args)


async def spawn_cli(*args: str) -> asyncio.subprocess.Process:
    """A long-running command, its stdout and stderr merged (read with
    read_line_matching)."""
    return await asyncio.create_subprocess_exec(
        PY, "-m", "dataspace.cli", *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def interrupt(proc: asyncio.subprocess.Process) -> int:
    """Ctrl-C, then the exit status (bounded)."""
    proc.send_signal(signal.SIGINT)
    try:
        return await asyncio.wait_for(proc.wait(), TIMEOUT)
    finally:
        await kill(proc)


def conn_args(server: Any, tmp_path: Path) -> tuple[str, ...]:
    return ("--server", tcp_address(server), "--data-dir", str(tmp_path / "data"))


@async_test
async def test_reply_answers_each_request_with_its_template(tmp_path):
    async with running_server(tmp_path) as server:
        conn = conn_args(server, tmp_path)
        responder = await spawn_cli("reply", '<Ask "time" $id>', "--with",
                                    '<Answer $id "12:00" [$1 $$id]>', *conn)
        seen: list[str] = []
        try:
            await read_line_matching(responder, r"answering <Ask \"time\" \$id>; Ctrl-C", seen)
            r = await acli("request", '<Ask "time" 7>', "--reply", "<Answer 7 $t $rest>", *conn)
            assert (r.returncode, r.stdout, r.stderr) == (
                0, '<Answer 7 "12:00" [7 $id]>\n', "")
            await read_line_matching(responder, r"^<Ask \"time\" 7> -> <Answer 7 \"12:00\" "
                                     r"\[7 \$id\]>$", seen)
            r = await acli("request", '<Ask "time" "r2">', "--reply", '<Answer "r2" $t _>',
                           "--captures", *conn)
            assert r.stdout == '["12:00"]\n', r.stderr
            # Not a request (the pattern does not match): no answer.
            r = await acli("request", '<Ask "date" 8>', "--reply", "<Answer 8 $t _>",
                           "--timeout", "0.3", *conn)
            assert r.returncode == 1
        finally:
            assert await interrupt(responder) == 0
        # The request lines are all it printed, and Ctrl-C ended it without a traceback.
        rest = (await responder.stdout.read()).decode()  # type: ignore[union-attr]
        assert "Traceback" not in rest and "Traceback" not in "".join(seen)


@async_test
async def test_reply_json_and_count(tmp_path):
    async with running_server(tmp_path) as server:
        conn = conn_args(server, tmp_path)
        responder = await asyncio.create_subprocess_exec(
            PY, "-m", "dataspace.cli", "reply", "<Ping $who>", "--with", "<Pong $who>",
            "--json", "--count", "2", *conn, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert responder.stderr is not None and responder.stdout is not None
        line = await asyncio.wait_for(responder.stderr.readline(), TIMEOUT)
        assert b"answering <Ping $who>" in line
        for who in ("ann", "bob"):
            r = await acli("request", f'<Ping "{who}">', "--reply", f'<Pong "{who}">', *conn)
            assert r.returncode == 0, r.stderr
        # --count 2: it exits by itself after the second request.
        assert await asyncio.wait_for(responder.wait(), TIMEOUT) == 0
        rows = [json.loads(x) for x in (await responder.stdout.read()).decode().splitlines()]
        assert [{k: v for k, v in row.items() if k != "time"} for row in rows] == [
            {"request": '<Ping "ann">', "values": ["ann"], "replies": ['<Pong "ann">']},
            {"request": '<Ping "bob">', "values": ["bob"], "replies": ['<Pong "bob">']}]
        assert all(isinstance(row["time"], float) for row in rows)


@async_test
async def test_reply_runs_a_command_per_request(tmp_path):
    async with running_server(tmp_path) as server:
        conn = conn_args(server, tmp_path)
        # Its output is the reply: the request on stdin, the captures in the environment.
        script = 'read req; echo "<Got \\"$DATASPACE_who\\" $DATASPACE_2 $req>"'
        responder = await spawn_cli("reply", "<Ask $who $n>", "--command", script, *conn)
        seen: list[str] = []
        try:
            await read_line_matching(responder, "answering", seen)
            r = await acli("request", '<Ask "bob" 3>', "--reply", '<Got "bob" $n $req>', *conn)
            assert (r.returncode, r.stdout) == (0, '<Got "bob" 3 <Ask "bob" 3>>\n'), r.stderr
        finally:
            assert await interrupt(responder) == 0

        # With --with, $stdout is what it printed, as a string.
        responder = await spawn_cli("reply", "<Ask $who>", "--command",
                                    'printf "%s-x\\n\\n" "$DATASPACE_1"', "--with",
                                    "<Out $who $stdout>", *conn)
        try:
            await read_line_matching(responder, "answering", [])
            r = await acli("request", '<Ask "ann">', "--reply", '<Out "ann" $s>', *conn)
            assert r.stdout == '<Out "ann" "ann-x">\n', r.stderr
        finally:
            assert await interrupt(responder) == 0


@async_test
async def test_a_failing_or_slow_command_sends_no_reply_and_says_why(tmp_path):
    pidfile = tmp_path / "pid"
    async with running_server(tmp_path) as server:
        conn = conn_args(server, tmp_path)
        script = (f'case "$DATASPACE_1" in fail) exit 3;; slow) echo $$ > {pidfile}; '
                  'exec sleep 60;; noise) echo "not a value <";; *) echo "<Done>";; esac')
        responder = await spawn_cli("reply", "<Job $what>", "--command", script,
                                    "--command-timeout", "1", "--json", *conn)
        seen: list[str] = []
        try:
            await read_line_matching(responder, "answering", seen)
            watcher = await connect(tcp_address(server), server.sturdyref)
            done: list[Any] = []
            got = asyncio.Event()
            watcher.observe("<Done>", on_message=lambda: (done.append(1), got.set()))
            await watcher.sync()
            for what in ("fail", "noise", "slow", "ok"):
                watcher.send(Record(Symbol("Job"), [what]))
            await watcher.sync()
            await read_line_matching(responder, r'<Job "fail">: the command exited with '
                                     r"status 3; no reply sent", seen)
            failed = json.loads(await read_line_matching(responder, r'^\{.*"error"', seen))
            assert {k: v for k, v in failed.items() if k != "time"} == {
                "request": '<Job "fail">', "values": ["fail"], "replies": [],
                "error": "the command exited with status 3"}
            await read_line_matching(responder, r'<Job "noise">: line 1 of the command\'s '
                                     r"output is not a value", seen)
            await read_line_matching(responder, r'<Job "slow">: the command ran longer than '
                                     r"1 s \(--command-timeout\) and was stopped; no reply", seen)
            # The slow command (and its process group) was ended, not left behind.
            pid = int(pidfile.read_text())
            try:
                os.kill(pid, 0)
                raise AssertionError(f"the slow command {pid} still runs")
            except ProcessLookupError:
                pass
            await read_line_matching(responder, r'"request": "<Job \\"ok\\">", "values": '
                                     r'\["ok"\], "replies": \["<Done>"\]\}$', seen)
            await asyncio.wait_for(got.wait(), TIMEOUT)
            assert done == [1]  # only the one that succeeded was answered
            await watcher.close()
        finally:
            assert await interrupt(responder) == 0


def test_reply_and_request_refuse_what_they_cannot_use(capsys):
    from dataspace.cli import main

    cases = [
        (("reply", "<Ask $id>"), "dataspace reply: say how to answer: --with TEMPLATE"),
        (("reply", "<Ask $id>", "--with", "<Answer $idd>"),
         "dataspace reply: --with <Answer $idd>: $idd names nothing to fill in (it may use "
         "$1, $id); write $$idd for the symbol $idd"),
        (("reply", "<Ask $id>", "--with", "<Answer $2>"), "$2 names nothing to fill in"),
        (("reply", "<Ask $id>", "--with", "<$id 1>"), "cannot be filled in as a record's label"),
        (("reply", "<Ask $id>", "--with", "<Answer"), "dataspace reply: --with: cannot read"),
        (("reply", "<Ask $id>", "--with", "<A>", "--count", "0"),
         "dataspace reply: --count must be at least 1, not 0"),
        (("reply", "<Ask $stdout>", "--command", "true", "--with", "<A $stdout>"),
         "PATTERN names a capture $stdout"),
        (("reply", "<Ask", "--with", "<A>"), "dataspace reply: "),
        (("request", "<Ping>", "--reply", "<Pong>", "--replies", "-1"),
         "dataspace request: --replies must be 0"),
        (("request", "<Ping>", "--reply", "<Pong>", "--wait", "0"),
         "dataspace request: --wait must be more than 0 seconds, not 0"),
    ]
    for args, message in cases:
        assert main([*args, "--server", "127.0.0.1:1"]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith(f"dataspace {args[0]}: ") and message in err, (args, err)
        assert "Traceback" not in err
        assert len(err.strip().splitlines()) <= 2, err


@async_test
async def test_reply_reconnects_when_the_server_restarts(tmp_path):
    srv = await ServerProcess(tmp_path / "data").start()
    responder = None
    try:
        conn = ("--server", srv.address, "--data-dir", str(tmp_path / "data"))
        responder = await spawn_cli("reply", "<Ask $id>", "--with", "<Answer $id>", *conn)
        seen: list[str] = []
        await read_line_matching(responder, "answering", seen)
        r = await acli("request", "<Ask 1>", "--reply", "<Answer 1>", *conn)
        assert r.returncode == 0, r.stderr
        await srv.stop()
        await read_line_matching(responder, "connection lost; reconnecting", seen)
        await srv.start()
        await read_line_matching(responder, "reconnected; answering again", seen)
        r = await acli("request", "<Ask 2>", "--reply", "<Answer 2>", *conn)
        assert (r.returncode, r.stdout) == (0, "<Answer 2>\n"), r.stderr
        assert await interrupt(responder) == 0
    finally:
        if responder is not None:
            await kill(responder)
        await srv.stop()


@async_test
async def test_request_gathers_several_replies(tmp_path):
    async with running_server(tmp_path) as server:
        conn = conn_args(server, tmp_path)
        responders = []
        for name in ("a", "b"):
            ds = await connect(tcp_address(server), server.sturdyref)
            ds.observe("<Ping $id>", on_message=lambda i, ds=ds, name=name: ds.send(
                Record(Symbol("Pong"), [i, name])))
            await ds.sync()
            responders.append(ds)

        def pongs(out: str) -> list[str]:
            return sorted(out.splitlines())

        r = await acli("request", "<Ping 1>", "--reply", "<Pong 1 $who>", "--replies", "2",
                       *conn)
        assert (r.returncode, pongs(r.stdout)) == (0, ['<Pong 1 "a">', '<Pong 1 "b">']), r.stderr
        # The default is the first reply only.
        # Fewer than asked within --timeout: those that came are printed, status 1.
        r = await acli("request", "<Ping 3>", "--reply", "<Pong 3 $who>", "--replies", "3",
                       "--timeout", "0.5", "--json", *conn)
        assert r.returncode == 1
        assert sorted(json.loads(x)["values"][0] for x in r.stdout.splitlines()) == ["a", "b"]
        assert r.stderr == "dataspace request: 2 of 3 replies within 0.5 s\n"
        # --wait: every reply within the window, success if any came.
        r = await acli("request", "<Ping 4>", "--reply", "<Pong 4 $who>", "--wait", "0.5",
                       *conn)
        assert (r.returncode, pongs(r.stdout)) == (0, ['<Pong 4 "a">', '<Pong 4 "b">'])
        r = await acli("request", "<Ping 5>", "--reply", "<Pong 5 $who>", "--replies", "0",
                       "--timeout", "0.5", *conn)
        assert (r.returncode, pongs(r.stdout)) == (0, ['<Pong 5 "a">', '<Pong 5 "b">'])
        r = await acli("request", "<Nobody>", "--reply", "<Pong 6 $who>", "--wait", "0.3",
                       *conn)
        assert r.returncode == 1 and r.stderr.startswith(
            "dataspace request: no reply matching <Pong 6 $who> within 0.3 s")
        for ds in responders:
            await ds.close()
