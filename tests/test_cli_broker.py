"""The broker's commands as people run them: serve, observe, assert, send."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest

from broker_support import PY, Changes, ServerProcess, async_test, kill, read_line_matching
from dataspace.client import connect
from dataspace.protocol.sturdy import SturdyRef


def run_cli(*args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dataspace.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


async def cli(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        PY, "-m", "dataspace.cli", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


@pytest.mark.parametrize("command", ["serve", "observe", "assert", "send"])
def test_help_has_examples(command):
    r = run_cli(command, "--help")
    assert r.returncode == 0
    assert "examples:" in r.stdout and f"dataspace {command}" in r.stdout


@async_test
async def test_serve_observe_assert_send(tmp_path):
    data = tmp_path / "data"
    srv = ServerProcess(data)
    await srv.start()
    try:
        # Exactly one line on stdout, the capability, also written to the data directory.
        assert SturdyRef.parse(srv.sturdyref) == SturdyRef.parse((data / "root.sturdyref").read_text())
        conn = ("--server", srv.address, "--data-dir", str(data))
        obs = await cli("observe", "<Present $who>", "--count", "2", *conn)
        msgs = await cli("observe", "<Says $who $what>", "--captures", "--count", "2", *conn)
        # Wait until both observers have subscribed (subscriptions are assertions too).
        watcher = await connect(srv.address, srv.sturdyref)
        interest = Changes()
        watcher.observe("<Observe $pattern _>", **interest.kw())
        await interest.until(lambda s: len(s.present) >= 3)  # theirs and this one
        await watcher.close()
        held = await cli("assert", '<Present "alice">', *conn)
        assert held.stderr is not None
        await asyncio.wait_for(held.stderr.readline(), 20)  # "asserted <Present "alice">"
        r = await asyncio.to_thread(run_cli, "send", '<Says "alice" "hi">', "-", *conn,
                                    stdin='<Says "bob" "yo">\n')
        assert r.returncode == 0, r.stderr
        held.send_signal(signal.SIGINT)  # Ctrl-C retracts and exits cleanly
        assert await asyncio.wait_for(held.wait(), 20) == 0
        out, err = await asyncio.wait_for(obs.communicate(), 20)
        assert obs.returncode == 0, err
        assert out.decode().splitlines() == ['+ <Present "alice">', '- <Present "alice">']
        out, err = await asyncio.wait_for(msgs.communicate(), 20)
        assert out.decode().splitlines() == ['! ["alice" "hi"]', '! ["bob" "yo"]']
        # A SIGTERM stops the server cleanly; stdout held the one sturdyref line only.
        assert await srv.stop(signal.SIGTERM) == 0
        assert await srv.proc.stdout.read() == b""  # type: ignore[union-attr]
    finally:
        await srv.stop(signal.SIGKILL)


@async_test
async def test_assert_is_reasserted_when_the_server_restarts(tmp_path):
    data = tmp_path / "data"
    srv = await ServerProcess(data).start()
    try:
        conn = ("--server", srv.address, "--data-dir", str(data))
        held = await cli("assert", '<Present "carol">', *conn)
        err = held.stderr
        assert err is not None
        assert (await asyncio.wait_for(err.readline(), 20)).startswith(b"asserted")
        assert (await asyncio.wait_for(err.readline(), 20)).startswith(b"dataspace assert: holding")
        await srv.stop(signal.SIGKILL)
        # It says the assertion is gone meanwhile, and when it holds it again.
        assert await asyncio.wait_for(err.readline(), 20) == (
            b"dataspace assert: connection lost (the server no longer holds the assertions); "
            b"reconnecting\n")
        await srv.start()
        assert await asyncio.wait_for(err.readline(), 30) == (
            b"dataspace assert: reconnected; asserted again, holding\n")
        obs = await cli("observe", "<Present $who>", "--count", "1", *conn)
        out, _ = await asyncio.wait_for(obs.communicate(), 30)
        assert out.decode().splitlines() == ['+ <Present "carol">']
        await kill(held)
    finally:
        await srv.stop()


def test_errors_say_what_to_do(tmp_path):
    r = run_cli("send", "x", "--server", "127.0.0.1:1", "--cap", '<ref {oid: "root" sig: #x"00000000000000000000000000000000"}>')
    assert r.returncode == 1 and "no server at 127.0.0.1:1: start one with `dataspace serve" in r.stderr
    r = run_cli("observe", "_", "--data-dir", str(tmp_path / "none"))
    assert r.returncode == 1 and "dataspace serve" in r.stderr and "root.sturdyref" in r.stderr
    # The command line is told about its flags, not about connect()'s arguments.
    assert "--cap" in r.stderr and "--data-dir" in r.stderr and "cap=" not in r.stderr
    r = run_cli("send", "<unclosed", "--data-dir", str(tmp_path))
    assert r.returncode == 2 and "cannot read" in r.stderr
    r = run_cli("observe", "<Present $who", "--data-dir", str(tmp_path))
    assert r.returncode == 2 and "bad pattern" in r.stderr
    cfg = tmp_path / "bad.pr"
    cfg.write_text("{listen: 1}")
    r = run_cli("serve", "--config", str(cfg))
    assert r.returncode == 2 and "unknown setting listen" in r.stderr
    r = run_cli("serve", "--tcp", "nonsense")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr


@async_test
async def test_serve_with_a_config_file_and_a_port_in_use(tmp_path):
    data = tmp_path / "data"
    srv = await ServerProcess(data).start()
    try:
        cfg = tmp_path / "server.pr"
        cfg.write_text(f'# test\n{{tcp: ["127.0.0.1:{srv.port}"] data-dir: "{tmp_path / "d2"}"}}\n')
        r = await asyncio.to_thread(run_cli, "serve", "--config", str(cfg))
        assert r.returncode == 1 and "another `dataspace serve` running" in r.stderr
        assert r.stdout == ""
        out: list[str] = []
        p = await asyncio.create_subprocess_exec(
            PY, "-m", "dataspace.cli", "serve", "--config", str(cfg), "--tcp", "127.0.0.1:0",
            "-v", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            await read_line_matching(p, r"^sturdyref: <ref ", out)
            await read_line_matching(p, r"listening on 127\.0\.0\.1:\d+", out)
            assert (tmp_path / "d2" / "root.sturdyref").exists()
            p.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(p.wait(), 20) == 0
        finally:
            await kill(p)
    finally:
        await srv.stop()


@async_test
async def test_a_second_server_on_one_data_directory_is_warned(tmp_path):
    """A second `dataspace serve` with the same data directory (the default one, say, in
    another terminal) started in silence: the two shared a capability, a server id (so a
    link between them is refused as a link to itself) and a store.  It is said once."""
    data = tmp_path / "data"
    first = await ServerProcess(data).start()
    second = ServerProcess(data)
    try:
        await second.start()
        said = [x for x in second.stderr_lines if "warning" in x]
        assert said == [f"dataspace serve: warning: another `dataspace serve` (pid "
                        f"{first.proc.pid}) uses the data directory {data}: the two share its "
                        "capability, its server id (a link between them is refused) and its "
                        "stream store; give this one its own --data-dir DIR\n"], said
        assert not any("warning" in x for x in first.stderr_lines)
        # Once the first is gone (kill -9 included) the directory is free again.
        await first.stop(signal.SIGKILL)
        await second.stop()
        third = await ServerProcess(data).start()
        assert not any("warning" in x for x in third.stderr_lines), third.stderr_lines
        await third.stop()
    finally:
        await first.stop(signal.SIGKILL)
        await second.stop(signal.SIGKILL)


@pytest.mark.parametrize("how", ["--store", "config"])
@async_test
async def test_serve_records_streams_from_its_dataspace(tmp_path, store_url, how):
    """Into the store --store names, or the configuration file's store key (SQLite and
    PostgreSQL); the status line shows the store with its password masked."""
    from dataspace.datadir import store_location
    from dataspace.streams import open_store
    from dataspace.values import parse

    data = tmp_path / "data-dir"
    where: tuple[str, ...] = ("--store", store_url)
    if how == "config":
        (tmp_path / "server.pr").write_text(f'{{store: "{store_url}"}}')
        where = ("--config", str(tmp_path / "server.pr"))
    srv = ServerProcess(data, extra=("--record", "chat:<Says $who $text>",
                                     "--record", "presence,events=assert+retract:<Present _>",
                                     *where))
    await srv.start()
    status = "".join(srv.stderr_lines)
    assert f"recording 2 stream(s) into {store_location(store_url).display}" in status
    if store_url.startswith("postgresql:"):
        assert store_url not in status and "***" in status
    ds = await connect(srv.address, srv.sturdyref)
    try:
        h = ds.assert_(parse('<Present "ann">'))
        ds.send(parse('<Says "ann" "hi">'))
        ds.send(parse("<Other 1>"))
        await ds.sync()
        ds.retract(h)
        await ds.sync()
        store = open_store(store_url)
        try:
            # Recorders commit from their own thread: wait on the store, bounded.
            assert await asyncio.to_thread(store.wait_for, "chat", 0, 20)
            assert await asyncio.to_thread(store.wait_for, "presence", 1, 20)
            assert [e.value for e in store.read("chat")] == [parse('<Says "ann" "hi">')]
            assert [e.value for e in store.read("presence")] == [
                parse('<assert <Present "ann">>'), parse('<retract <Present "ann">>'),
            ]
        finally:
            store.close()
    finally:
        await ds.close()
        assert await srv.stop() == 0


def test_serve_rejects_bad_recorder_specs(tmp_path):
    r = run_cli("serve", "--data-dir", str(tmp_path), "--record", "chat")
    assert r.returncode == 2 and "STREAM[,OPTION=VALUE...]:PATTERN" in r.stderr
    r = run_cli("serve", "--data-dir", str(tmp_path), "--record", "x,dataspace=nope:<a>")
    assert r.returncode == 2 and "which the server does not have" in r.stderr


@pytest.mark.parametrize("damage", ["garbage", "truncated", "directory"])
def test_serve_refuses_a_damaged_store_before_listening(tmp_path, damage):
    """A --record server whose stream store is damaged says so in the one line that
    `dataspace stream ls` gives for that store, before it listens or prints a sturdyref."""
    data = tmp_path / "data"
    data.mkdir()
    db = data / "streams.sqlite3"
    if damage == "garbage":
        db.write_bytes(bytes(range(7, 256)) * 20)
    elif damage == "truncated":
        db.write_bytes(b"SQLite format 3\x00" + b"\x00" * 20)
    else:
        db.mkdir()  # cannot be read as a file
    ls = run_cli("stream", "ls", "--data-dir", str(data))
    assert ls.returncode == 1
    [line] = ls.stderr.splitlines()
    assert line.startswith("dataspace stream: ") and str(db) in line, line
    problem = line[len("dataspace stream: "):]
    assert "streams.sqlite3/streams.sqlite3" not in problem  # the path is the store file's
    r = run_cli("serve", "--data-dir", str(data), "--tcp", "127.0.0.1:0",
                "--record", "chat:<Says $who $text>")
    assert r.returncode == 1
    assert r.stdout == ""  # no sturdyref line
    assert r.stderr.splitlines() == [f"dataspace serve: {problem}"]
    assert not (data / "root.sturdyref").exists()


@async_test
async def test_observe_subscribes_as_the_client_does_so_producers_see_the_demand(tmp_path):
    """`dataspace observe P` asserts exactly the <Observe P' #:observer> that the client's
    observe(P) asserts (P' the wire form of P), so a producer waiting for demand with
    during('<Observe <group <rec Says> {0: <lit $who>}> _>') sees it."""
    from broker_support import running_server, tcp_address
    from dataspace.pattern import parse_pattern, to_preserves
    from dataspace.values import parse

    async with running_server(tmp_path) as server:
        producer = await connect(tcp_address(server), server.sturdyref)
        demand: list[object] = []
        wanted = asyncio.Event()

        def produce_for(who):
            demand.append(who)
            wanted.set()

        producer.during("<Observe <group <rec Says> {0: <lit $who>}> _>", produce_for)
        patterns = Changes()
        producer.observe("<Observe $pattern _>", **patterns.kw())
        await producer.sync()
        obs = await cli("observe", '<Says "alice" $text>', "--count", "2",
                        "--server", tcp_address(server), "--data-dir", str(tmp_path / "data"))
        try:
            await asyncio.wait_for(wanted.wait(), 20)
            assert demand == ["alice"]
            await patterns.until(lambda s: len(s.present) == 3)
            ours = ("<Observe <group <rec Says> {0: <lit $who>}> _>", "<Observe $pattern _>")
            assert set(patterns.present) == {
                (to_preserves(parse_pattern(p)),) for p in (*ours, '<Says "alice" $text>')
            }
            with producer.turn():
                for text in ('<Says "alice" "hi">', '<Says "bob" "no">', '<Says "alice" "yo">'):
                    producer.send(parse(text))
            out, err = await asyncio.wait_for(obs.communicate(), 20)
            assert obs.returncode == 0, err
            assert out.decode().splitlines() == ['! <Says "alice" "hi">', '! <Says "alice" "yo">']
            assert err.decode() == ""
        finally:
            await kill(obs)
            await producer.close()


@async_test
async def test_observe_prints_the_pattern_filled_with_its_captures(tmp_path):
    from broker_support import running_server, tcp_address
    from dataspace.values import parse

    async with running_server(tmp_path) as server:
        ds = await connect(tcp_address(server), server.sturdyref)
        conn = ("--server", tcp_address(server), "--data-dir", str(tmp_path / "data"))
        ds.assert_(parse('<Job 7 {state: "done" owner: "ann" tags: [a b]}>'))
        ds.assert_(parse('<Job 8 {state: "done" owner: "bob"}>'))
        await ds.sync()
        r = await asyncio.to_thread(
            run_cli, "observe", '<Job $id {state: "done" owner: _ tags: [_ $t]}>', "--count", "1", *conn)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == ['+ <Job 7 {owner: _ state: "done" tags: [_ b]}>']
        r = await asyncio.to_thread(
            run_cli, "observe", '<Job $id {state: "done" owner: _ tags: [_ $t]}>', "--count", "1",
            "--captures", *conn)
        assert r.stdout.splitlines() == ["+ [7 b]"]
        # A bind around a compound captures it whole; the binds inside it are not repeated.
        r = await asyncio.to_thread(run_cli, "observe", "<Job 8 <$d {owner: $o}>>", "--count", "1", *conn)
        assert r.stdout.splitlines() == ['+ <Job 8 {owner: "bob" state: "done"}>']
        await ds.close()


@async_test
async def test_observe_says_connection_lost_only_when_it_was(tmp_path):
    from dataspace.values import parse

    data = tmp_path / "data"
    srv = await ServerProcess(data).start()
    holder = await connect(srv.address, srv.sturdyref, reconnect=False)
    try:
        conn = ("--server", srv.address, "--data-dir", str(data))
        holder.assert_(parse('<Present "dan">'))
        await holder.sync()
        # --count 1: a normal exit is not a lost connection.
        r = await asyncio.to_thread(run_cli, "observe", "<Present $who>", "--count", "1", *conn)
        assert r.returncode == 0 and r.stdout == '+ <Present "dan">\n'
        assert r.stderr == ""
        # Ctrl-C: neither.
        obs = await cli("observe", "<Present $who>", *conn)
        assert obs.stdout is not None and obs.stderr is not None
        line = await asyncio.wait_for(obs.stdout.readline(), 20)
        assert line == b'+ <Present "dan">\n'
        obs.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(obs.communicate(), 20)
        assert obs.returncode == 0 and err == b"" and out == b""
        # The server really goes away: said once, then that it is back.
        await holder.close()
        obs = await cli("observe", "<Present $who>", *conn)
        assert obs.stdout is not None and obs.stderr is not None
        try:
            held = await cli("assert", '<Present "eve">', *conn)
            line = await asyncio.wait_for(obs.stdout.readline(), 20)
            assert line == b'+ <Present "eve">\n'
            await srv.stop(signal.SIGKILL)
            line = await asyncio.wait_for(obs.stderr.readline(), 20)
            assert line == b"dataspace observe: connection lost; reconnecting\n"
            assert await asyncio.wait_for(obs.stdout.readline(), 20) == b'- <Present "eve">\n'
            await srv.start()
            line = await asyncio.wait_for(obs.stderr.readline(), 30)
            assert line == b"dataspace observe: reconnected\n"
            await kill(held)
            obs.send_signal(signal.SIGINT)
            out, err = await asyncio.wait_for(obs.communicate(), 20)
            assert obs.returncode == 0 and err == b""
        finally:
            await kill(obs)
    finally:
        await holder.close()
        await srv.stop()


@async_test
async def test_every_command_taking_a_cap_accepts_at_file(tmp_path):
    data = tmp_path / "data"
    srv = await ServerProcess(data).start()
    try:
        ref = tmp_path / "ref.pr"
        ref.write_text(srv.sturdyref + "\n")
        # An empty data directory: the capability can only come from the file.
        conn = ("--server", srv.address, "--data-dir", str(tmp_path / "empty"), "--cap", f"@{ref}")
        obs = await cli("observe", "<Says $who $text>", "--count", "2", *conn)
        held = await cli("assert", '<Present "fay">', *conn)
        try:
            watcher = await connect(srv.address, srv.sturdyref)
            seen = Changes()
            watcher.observe("<Present $who>", **seen.kw())
            watcher.observe("<Observe $p _>", **seen.kw())
            # fay's presence, and the subscriptions of observe and of the watcher (x2)
            await seen.until(lambda s: ("fay",) in s.present and len(s.present) >= 4)
            await watcher.close()
            r = await asyncio.to_thread(run_cli, "send", '<Says "fay" "hi">', '<Says "fay" "bye">', *conn)
            assert r.returncode == 0, r.stderr
            out, err = await asyncio.wait_for(obs.communicate(), 20)
            assert obs.returncode == 0, err
            assert out.decode().splitlines() == ['! <Says "fay" "hi">', '! <Says "fay" "bye">']
        finally:
            await kill(obs)
            await kill(held)
        # Errors name the file; a path given without @ gets a hint.
        r = run_cli("send", "<x>", "--server", srv.address, "--cap", f"@{tmp_path / 'nope.pr'}")
        assert r.returncode == 1
        assert r.stderr.strip() == f"dataspace send: --cap: cannot read the ref: {tmp_path / 'nope.pr'} does not exist"
        r = run_cli("observe", "_", "--server", srv.address, "--cap", str(ref))
        assert r.returncode == 1 and f"write @{ref}" in r.stderr
    finally:
        await srv.stop()


def test_send_from_stdin_reports_the_line_and_column_of_the_input(tmp_path):
    # Parsing comes before connecting: no server is needed to see the error.
    r = run_cli("send", "-", "--data-dir", str(tmp_path), stdin="<Tick 1>\n\n  <Tick 3 [1 2 }>\n<Tick 4>\n")
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == (
        "dataspace send: cannot read standard input, line 3, column 16: unexpected '}'")
    r = run_cli("send", "-", "--data-dir", str(tmp_path), stdin="<Tick 1>\n<Tick 2> <Tick 3>\n")
    assert r.returncode == 2
    assert "line 2, column 10: unexpected text after the value" in r.stderr
