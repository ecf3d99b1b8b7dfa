"""syndicate-py (unmodified, in subprocesses) as a client of our server."""

from __future__ import annotations

import os
import signal

import pytest

from broker_support import (
    Changes,
    async_test,
    kill,
    read_line_matching,
    running_server,
    spawn,
    tcp_address,
    ws_address,
)
from dataspace.client import connect
from dataspace.protocol.sturdy import attenuate
from dataspace.values import parse

SCRIPT = os.path.join(os.path.dirname(__file__), "interop_syndicate_client.py")

pytest.importorskip("syndicate")


def tcp_transport(server) -> str:
    host, port = tcp_address(server).rsplit(":", 1)
    return f'<tcp "{host}" {port}>'


@async_test
async def test_syndicate_py_clients_interoperate(tmp_path):
    async with running_server(tmp_path, ws=["127.0.0.1:0"]) as server:
        ours = await connect(tcp_address(server), server.sturdyref)
        seen = Changes()
        ours.observe("<Present $who>", **seen.kw())
        ours.observe("<Says $who $what>", **seen.kw())
        ours.observe("<Pong $who $n>", **seen.kw())
        await ours.sync()

        alice_out: list[str] = []
        bob_out: list[str] = []
        alice = await spawn(SCRIPT, tcp_transport(server), str(server.sturdyref), "alice")
        bob = None
        try:
            await read_line_matching(alice, r"^\+ alice$", alice_out)
            # bob over WebSocket
            bob = await spawn(SCRIPT, f'<ws "{ws_address(server)}">', str(server.sturdyref), "bob")
            await read_line_matching(bob, r"^\+ alice$", bob_out)
            await read_line_matching(alice, r"^\+ bob$", alice_out)
            await read_line_matching(alice, r"^says bob hello$", alice_out)
            await seen.until(lambda s: {("alice",), ("bob",)} <= set(s.present))
            await seen.until(lambda s: ("bob", "hello") in s.messages())
            # Request/response: our message reaches their on_message, theirs reaches us.
            ours.send(parse("<Ping 1>"))
            await seen.until(lambda s: {("alice", 1), ("bob", 1)} <= set(s.messages()))
            # Our assertions reach their `during`.
            ours.assert_(parse('<Present "ours">'))
            await read_line_matching(alice, r"^\+ ours$", alice_out)
            await read_line_matching(bob, r"^\+ ours$", bob_out)
            # kill -9 bob: everything bob asserted is retracted, alice's `during` ends.
            bob.send_signal(signal.SIGKILL)
            await bob.wait()
            await read_line_matching(alice, r"^- bob$", alice_out)
            await seen.until(lambda s: ("bob",) not in s.present)
            assert parse('<Secret "bob">') not in server.dataspaces["root"]
            assert parse('<Secret "alice">') in server.dataspaces["root"]
        finally:
            await kill(alice)
            if bob is not None:
                await kill(bob)
        await seen.until(lambda s: set(s.present) == {("ours",)})
        await ours.close()


@async_test
async def test_attenuated_sturdyref_is_enforced_for_syndicate_py(tmp_path):
    async with running_server(tmp_path) as server:
        ours = await connect(tcp_address(server), server.sturdyref)
        seen = Changes()
        ours.observe("<Present $who>", **seen.kw())
        ours.observe("<Says $who $what>", **seen.kw())
        await ours.sync()
        # Only <Present x> and subscriptions may pass; the holder cannot remove the caveat.
        ref = attenuate(server.sturdyref, parse(
            "<or [<rewrite <bind <rec Present [<_>]>> <ref 0>>"
            " <rewrite <bind <rec Observe [<_> <_>]>> <ref 0>>]>"
        ))
        out: list[str] = []
        carol = await spawn(SCRIPT, tcp_transport(server), str(ref), "carol")
        try:
            await seen.until(lambda s: ("carol",) in s.present)
            await read_line_matching(carol, r"^connected$", out)
            # Her subscriptions pass the caveat, so what others send reaches her.
            ours.send(parse('<Says "ours" "to carol">'))
            await read_line_matching(carol, r"^says ours to carol$", out)
            await ours.sync()
            root = server.dataspaces["root"]
            assert parse('<Present "carol">') in root
            assert parse('<Secret "carol">') not in root  # rejected by the caveat
            assert ("carol", "hello") not in seen.messages()  # her message was dropped
        finally:
            await kill(carol)
        await seen.until(lambda s: ("carol",) not in s.present)
        await ours.close()


@async_test
async def test_the_syndicate_py_example_in_the_docs_runs_from_any_directory(tmp_path):
    import asyncio
    import subprocess
    from pathlib import Path

    from broker_support import PY

    doc = (Path(__file__).parent.parent / "docs" / "broker.md").read_text(encoding="utf-8")
    section = doc[doc.index("## Other Syndicate clients"):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("```", start)]
    assert '<tcp "127.0.0.1" 7411>' in code
    elsewhere = tmp_path / "elsewhere"  # not the data directory
    elsewhere.mkdir()
    async with running_server(tmp_path) as server:  # data directory: tmp_path / "data"
        script = elsewhere / "example.py"
        script.write_text(code.replace('<tcp "127.0.0.1" 7411>', tcp_transport(server)))
        proc = await asyncio.create_subprocess_exec(
            PY, str(script), cwd=elsewhere, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "DATASPACE_DATA_DIR": str(tmp_path / "data")},
        )
        out: list[str] = []
        try:
            await read_line_matching(proc, r"^\+ bob$", out)
            assert parse('<Present "bob">') in server.dataspaces["root"]
        finally:
            await kill(proc)


SYNC_SCRIPT = os.path.join(os.path.dirname(__file__), "interop_syndicate_sync.py")


@async_test
async def test_syndicate_py_turn_sync_is_answered(tmp_path):
    """syndicate-py's turn.sync sends <S #:#:[0 1]>: it must be answered, the rest of the
    turn applied, and the connection kept (it used to be closed as a malformed reference,
    and syndicate-py reconnected in a tight loop)."""
    async with running_server(tmp_path) as server:
        ours = await connect(tcp_address(server), server.sturdyref)
        seen = Changes()
        ours.observe("<Synced $i>", **seen.kw())
        ours.observe("<After $i>", **seen.kw())
        await ours.sync()
        out: list[str] = []
        proc = await spawn(SYNC_SCRIPT, tcp_transport(server), str(server.sturdyref), "5")
        try:
            await read_line_matching(proc, r"^done$", out)
            assert [line for line in out if line.startswith("synced")] == [
                f"synced {i}" for i in range(5)]
            await seen.until(lambda s: len(s.present) == 5 and len(s.messages()) == 5)
            assert server.refused == 0 and len(server.connections) == 2  # no reconnection
        finally:
            await kill(proc)
        await ours.close()


@async_test
async def test_a_syndicate_py_client_refused_for_memory_keeps_its_connection(tmp_path):
    """The memory budget's refusals are <refused ...> extension packets, which syndicate-py
    ignores: its assertions are not held, its connection lives on (an <error> packet
    would have closed it)."""
    blob = "x" * 2048
    async with running_server(tmp_path, max_memory=1 << 20) as server:
        addr = tcp_address(server)
        ours = await connect(addr, server.sturdyref)
        seen = Changes()
        ours.observe("<Present $who>", **seen.kw())
        ours.observe("<Says $who $what>", **seen.kw())
        await ours.sync()
        fillers = []
        for k in range(3):  # each until refused: together they fill the budget
            f = await connect(addr, server.sturdyref)
            fillers.append(f)
            for i in range(0, 2000, 20):
                for j in range(20):
                    f.assert_(parse(f'<Fill {k} {i + j} "{blob}">'))
                await f.sync()
                if f.refused:
                    break
        assert server.memory is not None and server.memory.used > 0.9 * (1 << 20)
        refused_before = server.memory.refused
        alice_out: list[str] = []
        alice = await spawn(SCRIPT, tcp_transport(server), str(server.sturdyref), "alice")
        try:
            await read_line_matching(alice, r"^connected$", alice_out)
            await seen.until(lambda s: ("alice", "hello") in s.messages())
            conn = max(server.connections, key=lambda c: c.id)  # alice's, the newest
            assert conn.relay is not None and conn.relay.refused > 0 and not conn.closed
            assert server.memory.refused > refused_before
            assert ("alice",) not in seen.present
            assert parse('<Secret "alice">') not in server.dataspaces["root"]
            await ours.sync()
            assert not conn.closed and alice.returncode is None
        finally:
            await kill(alice)
        for f in fillers:
            await f.close()
        await ours.close()
