"""Recording in a cluster (issue 30, docs/cluster.md "Recording in a cluster"): members
recording into one store record each message once (where it enters the cluster) and
each assertion event once (the stream's leader), checked against one server recording
the same schedule; members with stores of their own each hold everything they see.

In-process members (the serve command's own wiring, ``cli.serve._start_recording``) on
real sockets; the crash test with kill -9 of member processes is
tests/test_cluster_record_crash.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from broker_support import async_test, tcp_address
from dataspace.broker import Server
from dataspace.broker.config import ServerConfig
from dataspace.cli.cluster import print_status
from dataspace.cli.serve import _start_recording
from dataspace.client import RemoteDataspace, connect
from dataspace.datadir import KEY_BYTES
from dataspace.streams import open_store, recorder_specs, start_recorders, stop_recorders
from dataspace.streams.cluster import ClusterRecording
from dataspace.streams.recorder import Recorder
from dataspace.values import Record, Symbol, parse

TIMEOUT = 30.0


async def until(pred: Callable[[], bool], timeout: float = TIMEOUT, what: str = "") -> None:
    """Wait (bounded) for a condition of several processes' state: looked at every 20 ms."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what or pred}")
        await asyncio.sleep(0.02)


class Member:
    """An in-process member recording as `dataspace serve --record ... --store ...` does."""

    def __init__(self, server: Server, store: Any, recorders: list[Recorder],
                 cr: ClusterRecording | None) -> None:
        self.server = server
        self.store = store
        self.recorders = recorders
        self.cr = cr
        self.gone = False

    @property
    def address(self) -> str:
        return tcp_address(self.server)

    def recorder(self, stream: str) -> Recorder:
        return next(r for r in self.recorders if r.stream == stream)

    async def leave(self) -> None:
        """Stop as the serve command does: recorders first, then the server."""
        if self.gone:
            return
        self.gone = True
        if self.cr is not None:
            await asyncio.to_thread(self.cr.stop)
        await asyncio.to_thread(stop_recorders, self.recorders)
        if self.cr is not None:
            self.cr.release()
        await self.server.close()
        self.store.close()


async def start_member(data_dir: Path, secret: Path, root_key: bytes, store_url: str,
                       specs: list[str], routes: list[str], cluster: bool = True) -> Member:
    cfg = ServerConfig(tcp=["127.0.0.1:0"], root_key=root_key, record=specs,
                       **({"cluster": "127.0.0.1:0", "routes": routes,
                           "cluster_secret": str(secret)} if cluster else {}))
    server = Server(cfg, data_dir=data_dir)
    store = open_store(store_url)
    recorders: list[Recorder] = []
    crs: list[ClusterRecording] = []
    parsed = recorder_specs(specs)
    server.before_listening.append(
        lambda: _start_recording(cfg, server, store, parsed, recorders, crs))
    try:
        await server.start()
    except BaseException:
        stop_recorders(recorders)
        for cr in crs:
            cr.release()
        await server.close()
        store.close()
        raise
    if crs:
        crs[0].start()
    return Member(server, store, recorders, crs[0] if crs else None)


@contextlib.asynccontextmanager
async def members(tmp_path: Path, secret: Path, stores: list[str],
                  specs: list[str]) -> AsyncIterator[list[Member]]:
    root_key = os.urandom(KEY_BYTES)
    ms: list[Member] = []
    try:
        for i, url in enumerate(stores):
            routes = [ms[0].server.cluster.address] if ms else []
            ms.append(await start_member(tmp_path / f"m{i}", secret, root_key, url, specs,
                                         routes))
        ids = {m.server.server_id for m in ms}

        def meshed() -> bool:
            for m in ms:
                st = m.server.cluster_status()
                up = {r["peer_id"] for r in st["routes"] if r.get("connected")}
                if up != ids - {m.server.server_id}:
                    return False
            return True

        await until(meshed, what="the mesh")
        yield ms
    finally:
        for m in reversed(ms):
            await m.leave()


def leaders(ms: list[Member], stream: str) -> list[Member]:
    return [m for m in ms if not m.gone and m.recorder(stream).leading
            and m.recorder(stream).takeovers > 0]


async def clients(ms: list[Member]) -> list[RemoteDataspace]:
    return [await connect(m.address, m.server.sturdyref) for m in ms]


_SAYS = Symbol("Says")


# ---------------------------------------------------------------------------------------
# Each message once


@async_test
async def test_each_message_once_in_a_shared_store_from_every_member_and_a_leaf(
        tmp_path, secret, store_url, capsys):
    async with members(tmp_path, secret, [store_url] * 3, ["chat:<Says $w $t>"]) as ms:
        cs = await clients(ms)
        obs = []
        for c in cs:  # every member sees every message (so every recorder hears each)
            seen: list[Any] = []
            c.observe("<Says $w $n>", on_message=lambda *a, s=seen: s.append(a))
            obs.append(seen)
            await c.sync()
        # A leaf linked to member 0: its messages are recorded once, by member 0.
        leaf = Server(ServerConfig(tcp=["127.0.0.1:0"]), data_dir=tmp_path / "leaf")
        leaf.config = leaf.config.override(link=[(ms[0].address, str(ms[0].server.sturdyref))])
        await leaf.start()
        try:
            await until(lambda: any(s.ready for s in leaf.links["root"].sessions),
                        what="the leaf's link")
            lc = await connect(tcp_address(leaf), leaf.sturdyref)
            for n in range(10):
                for i, c in enumerate(cs):
                    c.send(Record(_SAYS, [f"c{i}", n]))
                lc.send(Record(_SAYS, ["leaf", n]))
            for c in cs:
                await c.sync()  # acknowledged: committed by the member it is on
            await lc.sync()
            await until(lambda: all(len(o) == 40 for o in obs), what="every message seen")
            for m in ms:
                m.recorder("chat").flush()
            got = [(e.value.fields[0], e.value.fields[1]) for e in ms[0].store.read("chat")]
            want = [(w, n) for w in ("c0", "c1", "c2", "leaf") for n in range(10)]
            assert sorted(got) == sorted(want), len(got)  # each once (not three times)
            # The member a message entered through recorded it; the others skipped it.
            by = [m.recorder("chat") for m in ms]
            assert [r.recorded for r in by] == [20, 10, 10]
            assert [r.skipped for r in by] == [20, 30, 30]
            await lc.close()
        finally:
            await leaf.close()
        for c in cs:
            await c.close()
        # The status says who shares the store (cluster status, the inspector).
        await until(lambda: len(ms[1].server.cluster_status()["recording"]["shared_with"]) == 2,
                    what="the store's sharing seen")
        rec = ms[1].server.cluster_status()["recording"]
        assert rec["summary"].endswith("shared with every other member: one stream for the "
                                       "cluster, each message once")
        assert {s["stream"] for s in rec["streams"]} == {"chat"}
        # `dataspace cluster status` says it, and who leads the stream.
        await until(lambda: all(s["led_by"] for s in
                                ms[1].server.cluster_status()["recording"]["streams"]))
        print_status(ms[1].server.cluster_status())
        text = capsys.readouterr().out
        assert "  recording into " in text and "one stream for the cluster" in text, text
        assert re.search(r"    stream chat \(message\): led by (this member|member [0-9a-f]{16}); "
                         r"10 recorded here, 30 left to the member they entered through", text), text


@async_test
async def test_routes_carry_nothing_for_recorders_that_share_a_store(tmp_path, secret):
    """Each member records its own: the recorders' interest is not asked of routes (a
    recorder of assertion events excepted: its leader needs the cluster's view)."""
    url = str(tmp_path / "shared")
    async with members(tmp_path, secret, [url] * 2,
                       ["chat:<Says $w $t>", "presence,events=all:<Present $w>"]) as ms:
        await until(lambda: all("chat" in m.cr._exempt and "presence" not in m.cr._exempt
                                for m in ms if m.cr is not None), what="the exemptions")
        c = await connect(ms[0].address, ms[0].server.sturdyref)
        for n in range(10):
            c.send(Record(_SAYS, ["a", n]))
        await c.sync()
        assert ms[0].store.next_index("chat") == 10
        routes = ms[0].server.cluster_status()["routes"]
        assert [r["messages_forwarded"] for r in routes] == [0], routes
        assert ms[1].recorder("chat").skipped == 0  # (nothing came)
        await c.close()


# ---------------------------------------------------------------------------------------
# Assertion events once, against one server


def events_by_value(entries: list[Any]) -> dict[str, list[str]]:
    """Each value's assertion events in stream order (messages left out)."""
    out: dict[str, list[str]] = {}
    for e in entries:
        v = e.value
        if type(v) is Record and v.label.name in ("assert", "retract"):
            out.setdefault(str(v.fields[0]), []).append(v.label.name)
    return out


@async_test
async def test_assertion_events_once_as_one_server_records_them(tmp_path, secret, store_url):
    """A random schedule of assertions by clients of three members (bag semantics: a
    value may be held on several members), members leaving (their clients' assertions
    go, once) and the leader leaving (another takes over), played on the cluster and on
    one server: each value's events are the same in both streams."""
    rng = random.Random(int(os.environ.get("CLUSTER_RECORD_SEED", "30")))
    spec = ["presence,events=all:<Present $who>"]
    model_dir = tmp_path / "model"
    async with members(tmp_path, secret, [store_url] * 3, spec) as ms:
        model = await start_member(model_dir, secret, os.urandom(KEY_BYTES),
                                   str(model_dir / "store"), spec, [], cluster=False)
        try:
            await until(lambda: len(leaders(ms, "presence")) == 1, what="a leader")
            # Two clients per member, and their twins on the one server.
            cl = [await connect(m.address, m.server.sturdyref) for m in ms for _ in range(2)]
            twin = [await connect(model.address, model.server.sturdyref) for _ in cl]
            owner = [i // 2 for i in range(len(cl))]
            held: list[dict[str, list[int]]] = [{} for _ in cl]  # client -> value -> handles
            twin_held: list[dict[str, list[int]]] = [{} for _ in cl]
            names = [f"p{k}" for k in range(6)]

            def count(name: str) -> int:
                return sum(len(h.get(name, ())) for i, h in enumerate(held)
                           if not ms[owner[i]].gone)

            async def settle(name: str) -> None:
                want = count(name) > 0
                v = parse(f'<Present "{name}">')
                await until(lambda: all((m.server.dataspaces["root"].count(v) > 0) == want
                                        for m in ms if not m.gone), what=f"{name} settled")

            async def step(i: int, name: str, add: bool) -> None:
                v = parse(f'<Present "{name}">')
                for c, h in ((cl[i], held[i]), (twin[i], twin_held[i])):
                    if add:
                        h.setdefault(name, []).append(c.assert_(v))
                    else:
                        c.retract(h[name].pop())
                    await c.sync()
                await settle(name)

            async def play(steps: int) -> None:
                for _ in range(steps):
                    live = [i for i in range(len(cl)) if not ms[owner[i]].gone]
                    i = rng.choice(live)
                    name = rng.choice(names)
                    add = not held[i].get(name) or rng.random() < 0.4
                    await step(i, name, add)

            async def leaves(k: int) -> None:
                """Member k goes: its clients' assertions go (on the one server too)."""
                await ms[k].leave()
                for i in range(len(cl)):
                    if owner[i] == k:
                        for hs in twin_held[i].values():
                            for h in hs:
                                twin[i].retract(h)
                        await twin[i].sync()
                        twin_held[i].clear()
                for name in names:
                    await settle(name)
                await until(lambda: len(leaders(ms, "presence")) == 1, what="a leader")

            await play(40)
            # A member that does not lead goes, then the leader.
            lead = leaders(ms, "presence")[0]
            await leaves(next(k for k, m in enumerate(ms) if m is not lead and not m.gone))
            await play(30)
            await leaves(ms.index(leaders(ms, "presence")[0]))
            await play(30)
            for m in ms:
                if not m.gone:
                    assert m.recorder("presence").flush()
            assert model.recorder("presence").flush()
            got = events_by_value(ms[0].store.read("presence") if not ms[0].gone
                                  else open_store(store_url).read("presence"))
            want = events_by_value(model.store.read("presence"))
            assert got == want
            for evs in want.values():  # (the model alternates, starting with an assert)
                assert evs == ["assert", "retract"] * (len(evs) // 2) + ["assert"] * (len(evs) % 2)
            for c in cl + twin:
                with contextlib.suppress(Exception):
                    await c.close()
        finally:
            await model.leave()


# ---------------------------------------------------------------------------------------
# Stores of their own


@async_test
async def test_members_with_stores_of_their_own_each_hold_what_they_see(tmp_path, secret):
    stores = [str(tmp_path / "own0"), str(tmp_path / "own1")]
    async with members(tmp_path, secret, stores, ["chat:<Says $w $t>"]) as ms:
        # Each leads its own store's stream, and learns that the other records elsewhere.
        def known() -> bool:
            return all(m.recorder("chat").leading and m.cr is not None and m.cr._peers
                       and all(p.records.get("chat") is False for p in m.cr._peers.values())
                       and "chat" not in m.cr._exempt  # (the routes asked for its messages)
                       and all(r.get("pending") == 0
                               for r in m.server.cluster_status()["routes"])
                       for m in ms)

        await until(known, what="each member's peer known to record elsewhere")
        cs = await clients(ms)
        for n in range(5):
            for i, c in enumerate(cs):
                c.send(Record(_SAYS, [f"c{i}", n]))
        for c in cs:
            await c.sync()
        want = sorted((f"c{i}", n) for i in range(2) for n in range(5))
        for m in ms:
            await until(lambda m=m: m.recorder("chat").recorded == 10, what="all recorded")
            got = [(e.value.fields[0], e.value.fields[1]) for e in m.store.read("chat")]
            assert sorted(got) == want
        await until(lambda: "a store of its own" in
                    ms[0].server.cluster_status()["recording"]["summary"])
        for c in cs:
            await c.close()


def test_a_lone_server_records_as_before(tmp_path):
    """Outside a cluster nothing changes: a recorder records everything it sees."""
    from dataspace import Dataspace

    store = open_store(str(tmp_path / "d"))
    ds = Dataspace()
    (rec,) = start_recorders(ds, ["p,events=all:<Present _>"], store)
    h = ds.assert_(parse('<Present "a">'))
    ds.send(parse('<Present "m">'))
    ds.retract(h)
    assert rec.flush()
    assert [str(e.value) for e in store.read("p")] == [
        '<assert <Present "a">>', '<message <Present "m">>', '<retract <Present "a">>']
    stop_recorders([rec])
    store.close()


# ---------------------------------------------------------------------------------------
# Readers follow the cluster


@async_test
async def test_a_scry_follower_of_several_publishers_moves_on_without_gap_or_repeat(
        tmp_path, store_url):
    """Members sharing a store publish its streams with the same indices: a follower
    given all their addresses reads from the first, and when it stops answering goes on
    from the next with the entry it awaits."""
    from dataspace import scry
    from dataspace.streams.scry import start_scry_udp

    stores = [open_store(store_url) for _ in range(3)]
    pubs = [await start_scry_udp(s, "127.0.0.1", 0, ["chat"]) for s in stores]
    writer = stores[0]
    writer.create_stream("chat")
    lines: list[str] = []
    got: list[int] = []
    url = "udp://" + ",".join(f"127.0.0.1:{p.address[1]}" for p in pubs) + "/chat"
    try:
        writer.append_many("chat", [Record(_SAYS, ["w", i]) for i in range(5)])

        async def read() -> None:
            async for e in scry.follow(url, "start", notify=lines.append):
                got.append(e.index)
                assert e.value == Record(_SAYS, ["w", e.index])
                if e.index == 4:
                    await pubs[0].close()  # the one it follows goes
                    writer.append_many("chat", [Record(_SAYS, ["w", i]) for i in range(5, 9)])
                if e.index == 8:
                    await pubs[1].close()  # and the next
                    writer.append_many("chat", [Record(_SAYS, ["w", i]) for i in range(9, 12)])
                if e.index == 11:
                    return

        await asyncio.wait_for(read(), TIMEOUT)
        assert got == list(range(12))
        assert lines[0] == f"following udp://127.0.0.1:{pubs[0].address[1]}/chat from entry 0"
        moves = [x for x in lines if "trying" in x]
        assert moves == [
            f"udp://127.0.0.1:{pubs[0].address[1]}/chat: no answer for 3 s; trying "
            f"udp://127.0.0.1:{pubs[1].address[1]}/chat from entry 5",
            f"udp://127.0.0.1:{pubs[1].address[1]}/chat: no answer for 3 s; trying "
            f"udp://127.0.0.1:{pubs[2].address[1]}/chat from entry 9"], lines
    finally:
        for p in pubs:
            with contextlib.suppress(Exception):
                await p.close()
        for s in stores:
            s.close()


def test_scry_urls_of_several_publishers_are_parsed_and_bad_ones_said():
    from dataspace.scry import ScryError, parse_urls

    assert parse_urls("udp://a:1,b:2,[::1]:3/chat") == (
        [("a", 1), ("b", 2), ("::1", 3)], "chat", None)
    assert parse_urls(["udp://a:1/chat/4", "udp://b:2/chat/4"], index=True) == (
        [("a", 1), ("b", 2)], "chat", 4)
    with pytest.raises(ScryError, match="names another stream"):
        parse_urls(["udp://a:1/chat", "udp://b:2/news"])
    with pytest.raises(ScryError, match="not a scry URL: 'udp://a:1,b/chat'"):
        parse_urls("udp://a:1,b/chat")


@async_test
async def test_every_members_http_gateway_serves_the_shared_store_with_the_same_indices(
        tmp_path, store_url):
    """Two members' HTTP ports on one store: the same entry at the same index from
    either, and a long poll at one answered by an append through the other."""
    import json

    import aiohttp

    from dataspace.web import start_http

    stores = [open_store(store_url) for _ in range(2)]
    https = [await start_http("127.0.0.1", 0, store=s, publish=["chat"]) for s in stores]
    try:
        stores[0].append_many("chat", [Record(_SAYS, ["w", i]) for i in range(3)])
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as s:
            async def get(h: Any, path: str) -> Any:
                async with s.get(h.url + path.lstrip("/")) as r:
                    assert r.status == 200, await r.text()
                    return json.loads(await r.read())

            for i in range(3):
                a, b = await get(https[0], f"/scry/chat/{i}"), await get(https[1], f"/scry/chat/{i}")
                assert a["index"] == b["index"] == i and a["value"] == b["value"] == f'<Says "w" {i}>'
            waiting = asyncio.ensure_future(get(https[1], "/scry/chat/3?timeout=60"))
            stores[0].append("chat", Record(_SAYS, ["w", 3]))
            doc = await asyncio.wait_for(waiting, TIMEOUT)
            assert doc["index"] == 3 and doc["value"] == '<Says "w" 3>'
    finally:
        for h in https:
            await h.close()
        for st in stores:
            st.close()


@async_test
async def test_two_members_with_one_id_recording_into_one_store_is_an_error(
        tmp_path, secret, monkeypatch):
    """A copied data directory (one server.id) would make two members one recorder: the
    second says so, in one line, after waiting for the lock a moment."""
    import dataspace.streams.cluster as sc
    from dataspace.streams import StoreError

    monkeypatch.setattr(sc, "MEMBER_LOCK_WAIT", 0.3)
    url = str(tmp_path / "shared")
    key = os.urandom(KEY_BYTES)
    first = await start_member(tmp_path / "m", secret, key, url, ["chat:<Says $w $t>"], [])
    try:
        with pytest.raises(StoreError, match=r"^another process records as member "
                           rf"{first.server.server_id} of cluster dataspace into .*: is the "
                           r"data directory \(its server.id\) copied from another member\?$"):
            await start_member(tmp_path / "m", secret, key, url, ["chat:<Says $w $t>"],
                               [first.server.cluster.address])
    finally:
        await first.leave()


# ---------------------------------------------------------------------------------------
# The leader's fence and takeover, without a cluster (two views of one cluster)


def _events(store: Any, stream: str) -> list[str]:
    return [str(e.value) for e in store.read(stream)]


def test_a_leader_that_lost_the_lead_without_noticing_writes_nothing(store):
    """Two recorders of one stream, each on its member's view: A leads, then B takes the
    lead while A has not noticed (cut from the store's lock, not from its clients).  A's
    next event is refused by the fence in its own transaction, and it is told."""
    from dataspace import Dataspace

    da, db = Dataspace(), Dataspace()
    ra = Recorder(da, "<Present $who>", store, "p", events=("assert", "retract"))
    rb = Recorder(db, "<Present $who>", store, "p", events=("assert", "retract"))
    ra.leader_only = rb.leader_only = True
    lost: list[str] = []
    ra.on_lost = lost.append
    try:
        for ds in (da, db):
            ds.assert_(parse('<Present "x">'))
        assert ra.lead("A") and ra.flush()
        assert _events(store, "p") == ['<assert <Present "x">>']
        assert rb.lead("B") and rb.flush()  # its view agrees: nothing to reconcile
        assert _events(store, "p") == ['<assert <Present "x">>']
        da.assert_(parse('<Present "y">'))  # A still believes it leads
        assert ra.flush()
        assert lost and not ra.leading and ra.discarded == 1
        db.assert_(parse('<Present "z">'))
        assert rb.flush()
        assert _events(store, "p") == ['<assert <Present "x">>', '<assert <Present "z">>']
    finally:
        ra.close()
        rb.close()


def test_a_leader_recording_for_a_member_drops_a_value_over_the_limit_alone(store):
    """A message that entered at a member which does not record the stream is recorded
    by the leader: one over the entry limit is dropped and counted there as at its own
    clients' (it reached the store and stopped the recorder for every later one)."""
    from dataspace import Dataspace
    from dataspace.streams.base import MAX_VALUE_SIZE

    ds = Dataspace()
    r = Recorder(ds, "<Says $who $text>", store, "chat")
    r.origin = lambda: "route-to-b"  # every message entered at member b ...
    r.peer_records = lambda route: False  # ... which records nothing: its leader does
    try:
        assert r.lead("A") and r.flush()
        ds.send(parse('<Says "b" "first">'))
        ds.send(Record(Symbol("Says"), ["b", "x" * (MAX_VALUE_SIZE + 1)]))
        ds.send(parse('<Says "b" "last">'))
        assert r.flush() and r.error is None, r.error
        assert r.dropped == 1
        assert [str(e.value) for e in store.read("chat")] == [
            '<Says "b" "first">', '<Says "b" "last">']
    finally:
        r.close()


def test_a_new_leader_reconciles_from_the_last_checkpoint_and_the_events_after_it(
        store, monkeypatch):
    """B takes over from A: it writes a retract for what A recorded present and is gone,
    an assert for what is present and A never recorded, from A's checkpoint (a small
    CHECKPOINT_MIN: several) and the events after the last one."""
    import dataspace.streams.recorder as rmod
    from dataspace import Dataspace

    monkeypatch.setattr(rmod, "CHECKPOINT_MIN", 3)
    da, db = Dataspace(), Dataspace()
    ra = Recorder(da, "<Present $who>", store, "p", events=("assert", "retract"))
    rb = Recorder(db, "<Present $who>", store, "p", events=("assert", "retract"))
    ra.leader_only = rb.leader_only = True
    try:
        assert ra.lead("A") and ra.flush()
        hs = {n: da.assert_(parse(f'<Present "{n}">')) for n in "abcdefg"}
        assert ra.flush()
        for n in "bdf":
            da.retract(hs[n])
        assert ra.flush()
        # A's checkpoints: at its takeover (empty), after the 7 asserts (7 >= 3); the 3
        # retracts after it are under the next threshold (as many as present): B replays
        # them from the stream.
        assert [len(e.value.fields[3]) for e in store.read("__presence/p")] == [0, 7]
        # B's view: a, c, e present (as A's) and h new; g gone.
        for n in "aceh":
            db.assert_(parse(f'<Present "{n}">'))
        ra.resign()
        assert rb.lead("B") and rb.flush()
        tail = _events(store, "p")[-2:]
        assert sorted(tail) == ['<assert <Present "h">>', '<retract <Present "g">>'], tail
        present: dict[str, int] = {}
        for e in store.read("p"):
            who = str(e.value.fields[0])
            present[who] = present.get(who, 0) + (1 if e.value.label.name == "assert" else -1)
        assert {w for w, n in present.items() if n} == {f'<Present "{n}">' for n in "aceh"}
    finally:
        ra.close()
        rb.close()
