"""Failure injection at each step of the persistence component (as Cues' tests do).

A fault hook raises :class:`Crash` at a chosen point of a chosen step: nothing is cleaned
up (the open transaction is abandoned, as in a kill).  A new engine on the same store
then runs the recovery component; we check the branch it took, the tailer positions it
restored, and that after draining every output is there exactly once.

Both commit policies run: ``group`` (the default: a crash rolls back to the last group)
and ``each-write`` (every write of the persistence component is durable on its own, as in
a store without multi-stream transactions -- the only way to reach branch 3b).
"""

from __future__ import annotations

import sqlite3
from collections import Counter

import pytest

from dataspace.pipeline import Crash, Graph, LocalEngine
from dataspace.pipeline.exactly_once import (
    ATTEMPT_NIL,
    ATTEMPT_OUTPUT,
    alts_record,
    attempt_record,
    backing_stream,
    delivery_hash,
    recover,
    snapshot_record,
)
from dataspace.pipeline.local import POINTS
from dataspace.pipeline.sinks import SQLiteSink
from dataspace.streams import open_store
from dataspace.values import encode

N = 10
BATCH = 3  # several steps per run


def build(kind: str, tmp_path) -> tuple[Graph, list[str], dict]:
    """A one-processor graph (plus feeds) of each kind; returns graph, outputs, inputs."""
    g = Graph("g", error_stream="errors")
    if kind == "map":  # outputs, nils and errors mixed
        g.source("in")
        g.map("p", "in", "out", lambda v: None if v % 4 == 1 else (1 // 0 if v % 4 == 2 else v * 10))
        return g, ["out", "errors"], {"in": list(range(N))}
    if kind == "errors":  # every message fails: attempt-error
        g.source("in")
        g.map("p", "in", "out", lambda v: 1 // 0)
        return g, ["out", "errors"], {"in": list(range(N))}
    if kind == "nil":  # nothing written: attempt-nil
        g.source("in")
        g.map("p", "in", "out", lambda v: None)
        return g, ["out"], {"in": list(range(N))}
    if kind == "alts":
        g.source("x", "y")
        g.alts("p", ["x", "y"], "out", lambda v: v)
        return g, ["out"], {"x": list(range(N)), "y": list(range(100, 100 + N))}
    if kind == "join-fork":
        g.source("l", "r")
        g.join("p", ["l", "r"], "pairs", lambda a, b: [a, b])
        g.fork("q", "pairs", ["a", "b"], lambda v: {"a": v[0], "b": v[1]})
        return g, ["pairs", "a", "b"], {"l": list(range(N)), "r": list(range(50, 50 + N))}
    if kind == "sink":  # side effects, made idempotent by the delivery hash
        g.source("x", "y")
        g.sink("p", ["x", "y"], SQLiteSink(tmp_path / "sink.db", "rows", ["v INTEGER"],
                                           to_row=lambda v: (v,)), batch=True, mode="alts")
        return g, [], {"x": list(range(N)), "y": list(range(100, 100 + N))}
    raise AssertionError(kind)


def feed(store, inputs):
    # Interleave the inputs' appends so alts has a real commit order to follow.
    for i in range(N):
        for s, vals in inputs.items():
            store.append(s, vals[i])


def outputs(store, streams, tmp_path):
    out = {s: [e.value for e in store.read(s, 0, 10_000)] for s in streams}
    db = tmp_path / "sink.db"
    if db.exists():
        out["sink"] = sorted(r[0] for r in sqlite3.connect(db).execute("select v from rows"))
    return out


def reference(kind, tmp_path):
    d = tmp_path / "ref"
    d.mkdir()
    g, outs, inputs = build(kind, d)
    with open_store(d) as store:
        feed(store, inputs)
        with LocalEngine(g, store, batch=BATCH) as e:
            e.drain()
        return outputs(store, outs, d)


def inject(kind, commit, point, occurrence, tmp_path):
    """Crash at the ``occurrence``-th time ``point`` is reached; recover; drain.

    Returns (branch taken by processor p at restart, whether the crash happened)."""
    d = tmp_path / f"{commit}-{point}-{occurrence}"
    d.mkdir()
    g, outs, inputs = build(kind, d)
    seen = Counter()

    def fault(proc, where):
        if where == point and proc in ("g/p", ""):
            seen[where] += 1
            if seen[where] == occurrence:
                raise Crash(f"{where} #{occurrence}")

    with open_store(d) as store:
        feed(store, inputs)
        crashed = False
        # group_ms=0: one step per processor per group, so a crash can follow commits.
        e = LocalEngine(g, store, batch=BATCH, commit=commit, fault=fault, group_ms=0)
        try:
            e.drain()
        except Crash:
            crashed = True
        finally:
            e.close()
        with LocalEngine(g, store, batch=BATCH) as e2:
            e2.start()
            branch = e2.recovery()["p"]
            q = e2.procs[[x.p.name for x in e2.procs].index("p")]
            rec = recover(store, "g/p")
            # The tailers are where the branch says: the snapshot's starts for a retry,
            # its ends after a delivered step.
            if rec.retry:
                assert q.positions == [rec.starts[s] for s in q.inputs]
            elif rec.ends is not None:
                assert q.positions == [rec.ends[s] for s in q.inputs]
            e2.drain()
        got = outputs(store, outs, d)
    return branch, crashed, got


KINDS = ["map", "errors", "nil", "alts", "join-fork", "sink"]


@pytest.mark.parametrize("commit", ["group", "each-write"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_crash_at_any_point_loses_and_duplicates_nothing(kind, commit, tmp_path):
    want = reference(kind, tmp_path)
    for point in POINTS:
        for occurrence in (1, 2):
            branch, crashed, got = inject(kind, commit, point, occurrence, tmp_path)
            assert got == want, (point, occurrence, branch)
            if not crashed:
                continue
            # Which branches are possible after a crash at this point.
            if commit == "group" and not (kind == "sink" and point in (
                    "before-function", "function", "attempt", "output", "nil", "commit")):
                # Rolled back to the end of the last committed group.
                assert branch in ("1a", "1d+3a", "1e+3a", "1f+3a"), (point, branch)
            elif point in ("snapshot", "read"):
                assert branch == "1b", (point, branch)
            elif point in ("alts-snapshot", "before-function", "function") or (
                    kind == "sink" and commit == "group"):
                assert branch in ("1b", "1c+1b"), (point, branch)
                assert branch == ("1c+1b" if kind in ("alts", "sink") else "1b")
            elif point == "attempt":
                assert branch in ("1d+3b", "1e+3b"), (point, branch)
            elif point in ("output", "nil", "commit"):
                assert branch in ("1d+3a", "1e+3a", "1f+3a"), (point, branch)


@pytest.mark.parametrize("kind, commit, point, occurrence, branch", [
    ("map", "group", "snapshot", 1, "1a"),
    ("map", "each-write", "snapshot", 1, "1b"),
    ("map", "each-write", "read", 2, "1b"),
    ("alts", "each-write", "alts-snapshot", 1, "1c+1b"),
    ("sink", "group", "function", 2, "1c+1b"),
    ("map", "each-write", "attempt", 1, "1d+3b"),
    ("errors", "each-write", "attempt", 1, "1e+3b"),
    ("map", "each-write", "output", 1, "1d+3a"),
    ("errors", "group", "commit", 2, "1e+3a"),
    ("nil", "each-write", "nil", 1, "1f+3a"),
    ("join-fork", "group", "commit", 2, "1d+3a"),
    ("nil", "group", "nil", 2, "1f+3a"),
])
def test_every_recovery_branch_is_reached_and_restores_the_state(
        kind, commit, point, occurrence, branch, tmp_path):
    want = reference(kind, tmp_path)
    got_branch, crashed, got = inject(kind, commit, point, occurrence, tmp_path)
    assert crashed
    assert got_branch == branch
    assert got == want


def test_side_effect_retry_gets_the_same_delivery_hash(tmp_path):
    """Crash after the sink's effect but before the engine's commit: the retry runs the
    function again with the same messages and hash, and the sink skips it."""
    calls = []
    g = Graph("g")
    g.source("x", "y")
    g.sink("p", ["x", "y"], lambda vs, d: calls.append((list(vs), d.hash)), batch=True, mode="alts")

    def fault(proc, where):
        if proc == "g/p" and where == "function":
            raise Crash

    with open_store(tmp_path) as store:
        feed(store, {"x": list(range(N)), "y": list(range(100, 100 + N))})
        e = LocalEngine(g, store, batch=4, fault=fault)
        with pytest.raises(Crash):
            e.drain()
        e.close()
        assert len(calls) == 1
        with LocalEngine(g, store, batch=4) as e2:
            e2.drain()
            assert e2.recovery()["p"] == "1c+1b"
    assert calls[1] == calls[0]  # same messages, same order, same hash
    assert sorted(v for vs, _h in calls[1:] for v in vs) == sorted(
        list(range(N)) + list(range(100, 100 + N)))


# -- the recovery component on hand-written backing streams ------------------------------


def backing(store, *records):
    with store.transaction() as tx:
        for r in records:
            tx.append(backing_stream("g/p"), r)


def test_recover_branches_on_crafted_records(tmp_path):
    starts, ends = {"in": 0}, {"in": 3}
    snap = snapshot_record("g/p", starts, ends)
    h = delivery_hash("g/p", starts, ends)
    with open_store(tmp_path / "a") as s:
        assert recover(s, "g/p").branch == "1a"
        backing(s, snap)
        r = recover(s, "g/p")
        assert (r.branch, r.retry, r.starts, r.ends) == ("1b", True, starts, ends)
        backing(s, alts_record(["in", "in", "in"]))
        r = recover(s, "g/p")
        assert (r.branch, r.order) == ("1c+1b", ("in", "in", "in"))
        backing(s, attempt_record(ATTEMPT_NIL, h))
        r = recover(s, "g/p")
        assert (r.branch, r.retry, r.delivered_hash) == ("1f+3a", False, h)
        backing(s, snap, attempt_record(ATTEMPT_NIL, b"\0" * 16))  # a nil of another step
        assert recover(s, "g/p").branch == "1f+3b"
    with open_store(tmp_path / "b") as s:
        # An attempt naming an output whose hash is another step's: 3b.
        s.append("out", 1, meta=encode({"hash": b"x" * 16}))
        backing(s, snap, attempt_record(ATTEMPT_OUTPUT, h, "out", 0))
        assert recover(s, "g/p").branch == "1d+3b"
    with open_store(tmp_path / "c") as s:
        # The output was written, then removed by retention: the recorded hash decides.
        s.create_stream("out", max_count=1)
        s.append("out", 1)
        s.append("out", 2)
        backing(s, snap, attempt_record(ATTEMPT_OUTPUT, h, "out", 0))
        assert recover(s, "g/p").branch == "1d+3a"
        # ...but an index never written is a failed attempt, whatever the record says.
        backing(s, snap, attempt_record(ATTEMPT_OUTPUT, h, "out", 7))
        assert recover(s, "g/p").branch == "1d+3b"


def test_recover_reads_back_past_many_records(tmp_path):
    starts, ends = {"in": 0}, {"in": 1}
    with open_store(tmp_path) as s:
        backing(s, snapshot_record("g/p", starts, ends),
                *[alts_record(["in"]) for _ in range(300)])
        r = recover(s, "g/p")
        assert r.branch == "1c+1b" and r.starts == starts


def test_corrupt_backing_records_are_reported(tmp_path):
    from dataspace.pipeline.exactly_once import BackingCorrupt

    with open_store(tmp_path) as s:
        backing(s, "not a record")
        with pytest.raises(BackingCorrupt, match="not a backing record"):
            recover(s, "g/p")
    with open_store(tmp_path / "x") as s:
        backing(s, attempt_record(ATTEMPT_NIL, b"h" * 16))
        with pytest.raises(BackingCorrupt, match="no snapshot"):
            recover(s, "g/p")
