"""A client's sync() on a recording server means "durable" (issue 9, item 3)."""

from __future__ import annotations

import asyncio

import pytest

from broker_support import async_test, running_server, tcp_address
from dataspace.broker.server import SyncGate
from dataspace.client import connect
from dataspace.testing.record_crash import run
from dataspace.values import parse


class FakeSource:
    def __init__(self) -> None:
        self.given = 0
        self.done = 0
        self.failed = None

    def mark(self):
        return self.given

    def reached(self, mark):
        return self.done >= mark


class FakeRelay:
    def __init__(self) -> None:
        self.failures = []

    def fail(self, message, detail=False):
        self.failures.append(message)


@async_test
async def test_sync_gate_answers_in_order_once_durable():
    gate = SyncGate(asyncio.get_running_loop())
    answers = []
    relay = FakeRelay()
    assert gate.hold(lambda: answers.append("free"), relay) is False  # no source: at once
    src = FakeSource()
    gate.sources.append(src)
    assert gate.hold(lambda: answers.append("idle"), relay) is False  # nothing pending
    src.given = 3
    assert gate.hold(lambda: answers.append("a"), relay) is True
    src.given = 5
    assert gate.hold(lambda: answers.append("b"), relay) is True
    src.done = 5  # both reached now: a later sync must still not overtake them
    assert gate.hold(lambda: answers.append("c"), relay) is True
    gate.release()
    assert answers == ["a", "b", "c"]
    src.given = 9
    assert gate.hold(lambda: answers.append("d"), relay) is True
    src.failed = OSError("disk gone")
    gate.release()
    assert answers == ["a", "b", "c"]  # not answered: the store failed
    assert relay.failures and "stream store failed" in relay.failures[0]


@async_test
async def test_sync_waits_for_the_recorder(tmp_path):
    """In process: the sync answer is held until the recorder's writer has committed."""
    from dataspace.streams import open_store, start_recorders

    async with running_server(tmp_path) as server:
        store = open_store(tmp_path / "store")
        (rec,) = start_recorders(server.dataspaces["root"], ["chat:<Says $who $text>"], store)
        rec.on_progress = server.sync_gate.progress
        server.add_durable_source(rec)
        ds = await connect(tcp_address(server), server.sturdyref)
        for i in range(50):
            ds.send(parse(f'<Says "a" {i}>'))
            await ds.sync()
            # Acknowledged: already committed, visible in the store right now.
            assert rec.recorded == i + 1
        assert server.sync_gate.held_total > 0
        await ds.close()
        rec.close()
        store.close()


@async_test
async def test_a_message_dropped_for_a_full_queue_fails_the_syncs_that_cover_it(tmp_path):
    """A store that takes no batch for block_timeout while the queue is full: the value
    that found no room is dropped and counted, and no sync after it is answered as if it
    were durable (the connection is closed with the store-failed error, now and for a
    client that syncs later); what was queued before the drop is still committed."""
    import threading

    from dataspace.streams import Recorder, open_store

    async with running_server(tmp_path) as server:
        store = open_store(tmp_path / "store")
        entered, release, marker = threading.Event(), threading.Event(), threading.Event()
        transaction = store.transaction

        def blocked_transaction(*args, **kwargs):  # the first commit waits for release
            if not entered.is_set():
                entered.set()
                release.wait(20)
            return transaction(*args, **kwargs)

        root = server.dataspaces["root"]
        rec = Recorder(root, "<Says $who $text>", store, "chat", max_queue=1,
                       block_timeout=0.2)
        store.transaction = blocked_transaction
        rec.on_progress = server.sync_gate.progress
        server.add_durable_source(rec)
        # Delivered after the drop (a connection's turns are taken in order).
        root.observe("<Marker>", on_message=lambda *caps: marker.set())
        ds = await connect(tcp_address(server), server.sturdyref, reconnect=False)
        try:
            ds.send(parse('<Says "a" 0>'))  # taken by the writer, which blocks
            assert await asyncio.to_thread(entered.wait, 20)
            ds.send(parse('<Says "a" 1>'))  # the queue is full now
            ds.send(parse('<Says "a" 2>'))  # no room for 0.2 s: dropped
            ds.send(parse("<Marker>"))
            sync = asyncio.ensure_future(ds.sync(timeout=20))
            assert await asyncio.to_thread(marker.wait, 20)
            release.set()  # the store goes on: 0 and 1 are committed, 2 never will be
            with pytest.raises(ConnectionError):
                await sync
        finally:
            release.set()
            await ds.close()
        assert rec.dropped == 1 and "fell behind" in str(rec.failed)
        assert server.errors["store"] == 1
        # A client that syncs later is not told that what it sent is durable either.
        late = await connect(tcp_address(server), server.sturdyref, reconnect=False)
        try:
            late.send(parse('<Says "b" 3>'))
            with pytest.raises(ConnectionError):
                await late.sync(timeout=20)
        finally:
            await late.close()
        assert rec.dropped == 2
        rec.close()
        assert [e.value for e in store.read("chat", 0, 10)] == [
            parse('<Says "a" 0>'), parse('<Says "a" 1>')]
        store.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_acknowledged_messages_survive_kill_9_of_a_recording_server(tmp_path, backend, request):
    """20 kills on the SQLite store, 8 on PostgreSQL (serve --record with its store in the
    configuration file)."""
    kills, store = 20, None
    if backend == "postgresql":
        kills, store = 8, request.getfixturevalue("pg_url")
    result = asyncio.run(run(kills, seed=20261124, base=tmp_path, store=store))
    assert result.kills == kills
    assert result.acknowledged > 0
    assert result.problems == []


@async_test
async def test_a_sync_the_store_could_not_honour_says_the_servers_reason(tmp_path):
    """The server closes a connection whose sync it cannot honour with its reason (the
    store failed): sync() says that reason, not only 'lost'; so do later calls on the
    closed client, and `dataspace send` (which syncs before it exits)."""
    import subprocess
    import sys

    from dataspace.streams import Recorder, open_store

    async with running_server(tmp_path) as server:
        store = open_store(tmp_path / "store")

        def on_fire(*args, **kwargs):
            raise OSError("disk on fire")

        rec = Recorder(server.dataspaces["root"], "<Says $who $text>", store, "chat")
        store.transaction = on_fire
        rec.on_progress = server.sync_gate.progress
        server.add_durable_source(rec)
        ds = await connect(tcp_address(server), server.sturdyref, reconnect=False)
        try:
            ds.send(parse('<Says "a" 0>'))
            with pytest.raises(ConnectionError) as e:
                await ds.sync(timeout=20)
            why = ("the stream store failed (disk on fire); what this connection sent may "
                   "not be recorded")
            assert str(e.value) == f"{tcp_address(server)} closed the connection during " \
                                   f"sync: {why}"
            with pytest.raises(ConnectionError) as e:
                await ds.sync(timeout=20)
            assert str(e.value) == f"not connected to {tcp_address(server)}: it closed the " \
                                   f"connection: {why}"
            with pytest.raises(ConnectionError, match="it closed the connection: the stream"):
                await ds.query("<Says $who $text>")
        finally:
            await ds.close()
        cmd = [sys.executable, "-m", "dataspace.cli", "send", '<Says "b" 1>', "--server",
               tcp_address(server), "--data-dir", str(tmp_path / "data")]
        r = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True,
                                    timeout=60)
        assert r.returncode == 1
        assert r.stderr.splitlines() == [
            f"dataspace send: {tcp_address(server)} closed the connection during sync: "
            f"{why}; the messages may not have been delivered"], r.stderr
        rec.close()
        store.close()
