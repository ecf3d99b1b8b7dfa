"""Recorder (dataspace -> stream) and emitter (stream -> dataspace) with a real Dataspace,
on both stores (the ``store`` fixture of tests/conftest.py: SQLite, then PostgreSQL)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import pytest

from dataspace.dataspace import Dataspace
from dataspace.streams import (
    Emitter,
    Recorder,
    RecorderSpec,
    open_store,
    parse_recorder_spec,
    start_recorders,
)
from dataspace.streams.recorder import stop_recorders
from dataspace.values import Sequence, parse


def test_recorder_appends_matching_messages(store):
    ds = Dataspace()
    rec = Recorder(ds, '<Says "alice" _>', store, "alice")
    ds.send(parse('<Says "alice" "hi">'))
    ds.send(parse('<Says "bob" "ignored">'))
    ds.send(parse('<Says "alice" "bye">'))
    h = ds.assert_(parse('<Says "alice" "an assertion, not a message">'))
    assert rec.flush(10)
    assert [e.value for e in store.read("alice")] == [
        parse('<Says "alice" "hi">'), parse('<Says "alice" "bye">')
    ]
    rec.close()
    ds.send(parse('<Says "alice" "after close">'))
    ds.retract(h)
    assert store.next_index("alice") == 2
    assert rec.recorded == 2 and rec.dropped == 0


def test_recorder_records_assertion_events_wrapped(store):
    ds = Dataspace()
    with Recorder(ds, "<Present $who>", store, "presence", events=("message", "assert", "retract")) as rec:
        h = ds.assert_(parse('<Present "alice">'))
        ds.send(parse('<Present "ping">'))
        ds.retract(h)
        assert rec.flush(10)
    assert [e.value for e in store.read("presence")] == [
        parse('<assert <Present "alice">>'),
        parse('<message <Present "ping">>'),
        parse('<retract <Present "alice">>'),
    ]


def test_recorder_with_captures(store):
    ds = Dataspace()
    with Recorder(ds, "<Says $who $text>", store, "caps", capture=True) as rec:
        ds.send(parse('<Says "a" "b">'))
        assert rec.flush(10)
    assert store.read("caps")[0].value == Sequence(["a", "b"])


def test_recorder_batches_a_burst_in_few_transactions(store):
    ds = Dataspace()
    with Recorder(ds, "<n $>", store, "burst") as rec:
        for i in range(5000):
            ds.send(parse(f"<n {i}>"))
        assert rec.flush(30)
    assert [e.value for e in store.read("burst", 0, 10_000)] == [parse(f"<n {i}>") for i in range(5000)]


def test_recorder_rejects_bad_events(store):
    with pytest.raises(ValueError, match="events"):
        Recorder(Dataspace(), "_", store, "x", events=("nope",))


def test_emitter_sends_entries_as_messages_and_resumes(store):
    store.append_many("cmds", [parse(f"<cmd {i}>") for i in range(5)])
    ds = Dataspace()
    seen = []
    ds.observe("<cmd $n>", on_message=seen.append)
    em = Emitter(store, "cmds", ds, tailer="emitter")
    assert em.pump(3) == 3
    assert seen == [0, 1, 2]
    em2 = Emitter(store, "cmds", ds, tailer="emitter")  # a restart resumes
    assert em2.pump() == 2
    assert seen == [0, 1, 2, 3, 4]


def test_emitter_run_follows_appends_from_another_thread(store):
    ds = Dataspace()
    seen = []
    got_three = threading.Event()

    def on(n):
        seen.append(n)
        if len(seen) == 3:
            got_three.set()

    ds.observe("<cmd $n>", on_message=on)
    em = Emitter(store, "cmds", ds, start="latest")
    stop = threading.Event()
    store.create_stream("cmds")

    def writer():
        for i in range(3):
            store.append("cmds", parse(f"<cmd {i}>"))

    w = threading.Thread(target=writer)
    w.start()
    # The emitter runs in this thread (the dataspace's owner) until the third arrives.
    threading.Thread(target=lambda: (got_three.wait(30), stop.set()), daemon=True).start()
    em.run(stop)
    w.join(30)
    assert seen == [0, 1, 2]


def test_emitter_run_async(store):
    async def main():
        ds = Dataspace()
        seen = []
        stop = asyncio.Event()

        def on(n):
            seen.append(n)
            if n == 1:
                stop.set()

        ds.observe("<cmd $n>", on_message=on)
        em = Emitter(store, "cmds", ds)
        task = asyncio.create_task(em.run_async(stop))
        await asyncio.sleep(0)
        store.append_many("cmds", [parse("<cmd 0>"), parse("<cmd 1>")])
        return await asyncio.wait_for(task, 30), seen

    assert asyncio.run(main()) == (2, [0, 1])


def test_record_then_replay_into_another_dataspace(store):
    src, dst = Dataspace(), Dataspace()
    with Recorder(src, "<Says _ _>", store, "chat") as rec:
        for i in range(10):
            src.send(parse(f'<Says "u{i % 3}" "m{i}">'))
        assert rec.flush(10)
    heard = []
    dst.observe("<Says $who $text>", on_message=lambda who, text: heard.append((who, text)))
    assert Emitter(store, "chat", dst).run(idle_timeout=0.05) == 10
    assert heard == [(f"u{i % 3}", f"m{i}") for i in range(10)]


def test_recorded_entries_survive_kill_9(store_url):
    """Once flush() returned, the entries are committed: SIGKILL cannot take them away."""
    script = textwrap.dedent(
        """
        import os, signal, sys
        from dataspace.dataspace import Dataspace
        from dataspace.streams import Recorder, open_store
        from dataspace.values import parse
        store = open_store(sys.argv[1])
        ds = Dataspace()
        rec = Recorder(ds, "<n _>", store, "kept")
        for i in range(1000):
            ds.send(parse(f"<n {i}>"))
        assert rec.flush(30)
        print("flushed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    r = subprocess.run([sys.executable, "-c", script, store_url], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == -9 and r.stdout.strip() == "flushed", r.stderr
    with open_store(store_url) as s:
        assert [e.value for e in s.read("kept", 0, 2000)] == [parse(f"<n {i}>") for i in range(1000)]


# -- recorder specs (for dataspace serve) -------------------------------------------------


def test_parse_recorder_spec():
    s = parse_recorder_spec("chat:<Says $who $text>")
    assert s == RecorderSpec("chat", "<Says $who $text>")
    s = parse_recorder_spec("presence,events=all,max-age=7d,max-count=100:<Present _>")
    assert s.events == ("message", "assert", "retract")
    assert s.max_age == 7 * 86400 and s.max_count == 100
    s = parse_recorder_spec("d,events=assert+retract,capture=yes,dataspace=lobby:{a: $x}")
    assert s.events == ("assert", "retract") and s.capture and s.dataspace == "lobby"
    assert s.pattern == "{a: $x}"
    assert RecorderSpec.from_mapping(
        {"stream": "chat", "pattern": "<Says _ _>", "events": ["message"], "max-age": "1h"}
    ).max_age == 3600


@pytest.mark.parametrize("bad, msg", [
    ("no pattern here", "expected STREAM"),
    ("chat:", "expected STREAM"),
    ("bad name:<x>", "invalid stream name"),
    ("chat,colour=red:<x>", "invalid recorder option"),
    ("chat,events=everything:<x>", "events must be"),
    ("chat,max-count=lots:<x>", "max-count"),
    ("chat,max-age=forever:<x>", "invalid duration"),
    ("chat:<Says", "bad pattern"),
])
def test_bad_recorder_specs(bad, msg):
    with pytest.raises(ValueError, match=msg):
        parse_recorder_spec(bad)


def test_start_recorders_sets_retention(store):
    ds = Dataspace()
    recs = start_recorders(ds, ["a,max-count=2:<a _>", {"stream": "b", "pattern": "<b _>"}], store)
    for i in range(5):
        ds.send(parse(f"<a {i}>"))
        ds.send(parse(f"<b {i}>"))
    for r in recs:
        assert r.flush(10)
    stop_recorders(recs)
    assert [e.value for e in store.read("a")] == [parse("<a 3>"), parse("<a 4>")]
    assert store.stream_info("b").count == 5


def test_recorder_specs_from_a_preserves_config():
    from dataspace.streams import recorder_specs

    cfg = parse('["chat:<Says $who $text>" {stream: "presence" pattern: "<Present _>" '
                'events: [message assert retract] max-age: "7d" dataspace: "lobby" capture: #t}]')
    chat, presence = recorder_specs(cfg)
    assert chat.stream == "chat" and chat.events == ("message",)
    assert presence.events == ("message", "assert", "retract")
    assert presence.max_age == 7 * 86400 and presence.dataspace == "lobby" and presence.capture
    with pytest.raises(ValueError, match="text or a dictionary"):
        recorder_specs([42])
