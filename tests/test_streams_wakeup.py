"""Readers wake when data arrives: in-process (threads, asyncio) and across processes --
on SQLite through inotify on a side file, on PostgreSQL through LISTEN/NOTIFY (every test
taking ``store_url`` runs on both).

Every wait is bounded; nothing here sleeps to synchronise.  The reader's store wait is
wrapped: the data is appended only once the reader is in that wait, and the test checks
that the wait ended because the store changed, not because it timed out.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from dataspace.streams import open_store
from dataspace.streams.wakeup import inotify_available

LONG = 30.0  # a reader's own timeout: far longer than any wake-up should take


def _child(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _watch_waits(store, waiting: threading.Event) -> list[bool]:
    """Wrap ``store.wait_change`` and ``wait_change_async``: ``waiting`` is set when a wait
    begins, and the list returned gets, for each wait, True if it ended because the store
    changed and False if it timed out."""
    woken: list[bool] = []
    real, real_async = store.wait_change, store.wait_change_async

    def wait_change(generation, timeout):
        waiting.set()
        g = real(generation, timeout)
        woken.append(g != generation)
        return g

    async def wait_change_async(generation, timeout):
        waiting.set()
        g = await real_async(generation, timeout)
        woken.append(g != generation)
        return g

    store.wait_change = wait_change
    store.wait_change_async = wait_change_async
    return woken


def _readline(proc: subprocess.Popen[str], timeout: float = LONG) -> str:
    """One line of the child's stdout, waiting at most ``timeout`` seconds."""
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not out:
        proc.kill()
        raise AssertionError(f"child printed nothing within {timeout}s: {proc.stderr.read()}")
    return out[0].strip()


def test_blocking_reader_wakes_on_append_in_another_thread(store_url):
    with open_store(store_url) as store:
        t = store.tailer("chat")
        got: list[object] = []
        waiting = threading.Event()
        done = threading.Event()
        woken = _watch_waits(store, waiting)

        def reader():
            got.extend(e.value for e in t.poll(timeout=LONG))
            done.set()

        threading.Thread(target=reader, daemon=True).start()
        assert waiting.wait(LONG)
        store.append("chat", "hello")
        assert done.wait(LONG)
        assert got == ["hello"]
        assert woken and woken[-1], woken  # the append ended the wait, not the timeout


def test_wait_for_returns_false_on_timeout_without_spurious_changes(store_url):
    with open_store(store_url) as store:
        store.append("s", 1)
        g = store.generation()
        assert store.wait_for("s", 1, timeout=0.05) is False
        # Nothing was written: the generation did not move (nobody is polling files).
        assert store.wait_change(g, 0.05) == g


def test_asyncio_reader_wakes(store_url):
    async def main():
        with open_store(store_url) as store:
            t = store.tailer("chat")
            task = asyncio.create_task(t.poll_async(timeout=LONG))
            await asyncio.sleep(0)  # let the task start waiting (ordering, not timing)
            store.append("chat", "hi")
            entries = await asyncio.wait_for(task, LONG)
            return [e.value for e in entries]

    assert asyncio.run(main()) == ["hi"]


def test_asyncio_follow_ends_on_idle(store_url):
    async def main():
        with open_store(store_url) as store:
            store.append_many("s", [1, 2])
            return [e.value async for e in store.tailer("s").follow_async(idle_timeout=0.05)]

    assert asyncio.run(main()) == [1, 2]


def _cross_process(store_url: str) -> None:
    if not store_url.startswith("postgresql:") and not inotify_available():
        pytest.skip("cross-process wake-ups of SQLite stores use inotify (Linux)")


def test_reader_in_another_process_wakes_on_our_append(store_url):
    _cross_process(store_url)
    with open_store(store_url) as store:
        store.create_stream("chat")
        child = _child(
            """
            import sys
            from dataspace.streams import open_store
            s = open_store(sys.argv[1])
            t = s.tailer("chat", start="latest")
            print(s.wakeup_mode, flush=True)
            real_wait, woken = s.wait_change, []

            def wait_change(generation, timeout):
                if not woken:
                    print("waiting", flush=True)
                g = real_wait(generation, timeout)
                woken.append(g != generation)
                return g

            s.wait_change = wait_change
            entries = t.poll(timeout=float(sys.argv[2]))
            print([e.value for e in entries], flush=True)
            print("woken" if woken and woken[-1] else f"not woken: {woken}", flush=True)
            """,
            store_url, str(LONG),
        )
        try:
            assert _readline(child) == ("listen" if store_url.startswith("postgresql:") else "inotify")
            assert _readline(child) == "waiting"
            store.append("chat", "from the parent")
            assert _readline(child) == "['from the parent']"
            assert _readline(child) == "woken"
            assert child.wait(LONG) == 0
        finally:
            if child.poll() is None:
                child.kill()


@pytest.mark.parametrize("use_asyncio", [False, True])
def test_our_reader_wakes_on_append_in_another_process(store_url, use_asyncio):
    _cross_process(store_url)
    with open_store(store_url) as store:
        t = store.tailer("chat", start="latest")
        store.generation()  # the watch is in place before the child can write
        child = _child(
            """
            import sys
            from dataspace.streams import open_store
            sys.stdin.readline()
            with open_store(sys.argv[1]) as s:
                s.append("chat", "from the child")
            """,
            store_url,
        )
        try:
            result: list[object] = []
            waiting = threading.Event()
            done = threading.Event()
            woken = _watch_waits(store, waiting)

            def reader():
                if use_asyncio:
                    entries = asyncio.run(t.poll_async(timeout=LONG))
                else:
                    entries = t.poll(timeout=LONG)
                result.extend(e.value for e in entries)
                done.set()

            threading.Thread(target=reader, daemon=True).start()
            assert waiting.wait(LONG)
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.wait(LONG) == 0
            assert done.wait(LONG)
            assert result == ["from the child"]
            assert woken and woken[-1], woken  # the append ended the wait, not the timeout
        finally:
            if child.poll() is None:
                child.kill()


@pytest.mark.skipif(not inotify_available(), reason="cross-process wake-ups use inotify (Linux)")
def test_wakeups_survive_the_wal_being_recreated(tmp_path):
    """SQLite deletes the WAL when the last connection closes; the watch is on the
    directory, so a reader in a process that reopens later still wakes."""
    db = tmp_path / "streams.sqlite3"
    open_store(tmp_path).close()
    assert not os.path.exists(str(db) + "-wal")
    with open_store(tmp_path) as store:
        g = store.generation()
        child = _child(
            """
            import sys
            from dataspace.streams import open_store
            with open_store(sys.argv[1]) as s:
                s.append("x", 1)
            """,
            str(tmp_path),
        )
        assert child.wait(LONG) == 0
        assert store.wait_change(g, LONG) != g
        assert store.next_index("x") == 1


@pytest.mark.skipif(not inotify_available(), reason="cross-process wake-ups use inotify (Linux)")
def test_writer_killed_between_commit_and_signal_still_wakes_readers(tmp_path):
    """The commit is visible but the writer died before signalling: the kernel closing its
    descriptors (IN_CLOSE_WRITE on the WAL) wakes the reader."""
    with open_store(tmp_path) as store:
        store.create_stream("x")
        g = store.generation()
        child = _child(
            """
            import os, signal, sys
            from dataspace.streams import open_store
            s = open_store(sys.argv[1])
            s._notifier.signal = lambda: None   # die before signalling
            s.append("x", 1)
            os.kill(os.getpid(), signal.SIGKILL)
            """,
            str(tmp_path),
        )
        assert child.wait(LONG) == -9
        assert store.wait_change(g, LONG) != g  # woken by the dead writer's close
        assert store.next_index("x") == 1
