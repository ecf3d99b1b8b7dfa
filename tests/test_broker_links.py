"""Linked brokers (issue 10): servers on loopback, linked; what crosses and what does not.

In-process servers where the test needs to look inside (link state, counters), real
`dataspace serve` processes where a process must die (kill -9 of a client, of a server).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from broker_support import (
    PY,
    Changes,
    RawClient,
    ServerProcess,
    async_test,
    kill,
    read_line_matching,
    running_server,
    spawn,
    tcp_address,
)
from dataspace.broker import Server
from dataspace.broker.config import ConfigError, ServerConfig
from dataspace.client import connect
from dataspace.protocol.sturdy import SturdyRef, attenuate
from dataspace.values import Dictionary, Embedded, Record, Symbol, parse

TIMEOUT = 20.0


class LinkWatch:
    """Waits on servers' link state, re-checking whenever one of them changes."""

    def __init__(self, *servers: Server) -> None:
        self.servers = servers
        self.event = asyncio.Event()
        for server in servers:
            for hub in server.links.values():
                hub.on_change.append(self.event.set)

    def rows(self) -> list[dict]:
        return [r for srv in self.servers for r in srv.link_status()]

    async def until(self, pred: Callable[[list[dict]], bool], timeout: float = TIMEOUT) -> None:
        async def loop() -> None:
            while not pred(self.rows()):
                self.event.clear()
                await self.event.wait()

        await asyncio.wait_for(loop(), timeout)

    async def up(self, n: int = 1) -> None:
        await self.until(lambda rows: sum(1 for r in rows if r.get("connected")) >= n)

    async def settled(self) -> None:
        """Every link connected, nothing pending, and the root artifact gone."""
        await self.until(lambda rows: rows and all(
            r.get("connected") and r.get("pending") == 0 and not r.get("peer_everything")
            for r in rows))


@contextlib.asynccontextmanager
async def linked(tmp_path: Path, *names: str, links: dict[str, list[str]] | None = None,
                 **settings) -> AsyncIterator[dict[str, Server]]:
    """Servers started in order; ``links[x] = [y, ...]``: x dials each y (started before)."""
    servers: dict[str, Server] = {}
    async with contextlib.AsyncExitStack() as stack:
        for name in names:
            spec = [(tcp_address(servers[y]), str(servers[y].sturdyref))
                    for y in (links or {}).get(name, [])]
            servers[name] = await stack.enter_async_context(
                running_server(tmp_path / name, link=spec, **settings))
        yield servers


async def client(server: Server):
    return await connect(tcp_address(server), server.sturdyref)


# ---------------------------------------------------------------------------------------
# Both ways, bag semantics, lifetimes


@async_test
async def test_messages_and_assertions_cross_both_ways(tmp_path):
    async with linked(tmp_path, "u", "d", links={"d": ["u"]}) as s:
        cd, cu = await client(s["d"]), await client(s["u"])
        on_d, on_u = Changes(), Changes()
        cd.observe("<Says $who $text>", **on_d.kw())
        cd.observe("<Present $who>", **on_d.kw())
        cu.observe("<Present $who>", **on_u.kw())
        cu.observe("<Says $who $text>", **on_u.kw())
        await cd.sync()
        await cu.sync()
        await LinkWatch(s["d"], s["u"]).settled()
        hb = cu.assert_(parse('<Present "bob">'))
        cd.assert_(parse('<Present "alice">'))
        cu.send(parse('<Says "bob" "hi">'))
        await on_d.until(lambda c: ("bob",) in c.present and ("bob", "hi") in c.messages())
        await on_u.until(lambda c: ("alice",) in c.present)
        cu.retract(hb)
        await on_d.until(lambda c: ("bob",) not in c.present)
        cd.send(parse('<Says "dan" "back">'))
        await on_u.until(lambda c: ("dan", "back") in c.messages())
        await cd.sync()
        await cu.sync()
        await cd.sync()
        # Each message exactly once on each side: nothing came back over the link.
        assert on_d.messages() == [("bob", "hi"), ("dan", "back")]
        assert on_u.messages() == [("bob", "hi"), ("dan", "back")]
        for c in (cd, cu):
            await c.close()


@async_test
async def test_a_side_nobody_across_wants_from_hears_no_messages_until_someone_does(tmp_path):
    # d's messages are wanted by no one on u: d's link does not even hear them (no
    # callback per message); once u observes, they cross -- and nothing ever echoes back.
    async with linked(tmp_path, "u", "d", links={"d": ["u"]}) as s:
        cd, cu = await client(s["d"]), await client(s["u"])
        on_d, on_u = Changes(), Changes()
        cd.observe("<Says $who $text>", **on_d.kw())
        await cd.sync()
        watch = LinkWatch(s["d"], s["u"])
        await watch.settled()
        hub_d, hub_u = next(iter(s["d"].links.values())), next(iter(s["u"].links.values()))
        assert hub_u.tapping and not hub_d.tapping
        for i in range(3):
            cu.send(parse(f'<Says "u" "{i}">'))
        await on_d.until(lambda c: len(c.messages()) == 3)
        cu.observe("<Says $who $text>", **on_u.kw())
        await cu.sync()
        await watch.until(lambda rows: all(r.get("pending") == 0 for r in rows)
                          and hub_d.tapping)
        cd.send(parse('<Says "d" "up">'))
        cu.send(parse('<Says "u" "down">'))
        await on_u.until(lambda c: ("d", "up") in c.messages())
        await on_d.until(lambda c: ("u", "down") in c.messages())
        for c in (cd, cu, cd, cu):
            await c.sync()
        assert on_d.messages()[:3] == [("u", "0"), ("u", "1"), ("u", "2")]
        assert sorted(on_d.messages()[3:]) == [("d", "up"), ("u", "down")]
        assert sorted(on_u.messages()) == [("d", "up"), ("u", "down")]
        for c in (cd, cu):
            await c.close()


@async_test
async def test_an_assertion_made_on_both_sides_goes_only_when_both_retract(tmp_path):
    async with linked(tmp_path, "u", "d", links={"d": ["u"]}) as s:
        cd, cu = await client(s["d"]), await client(s["u"])
        od, ou = Changes(), Changes()
        cd.observe("<Present $who>", **od.kw())
        cu.observe("<Present $who>", **ou.kw())
        await LinkWatch(s["d"]).up()
        hd = cd.assert_(parse('<Present "carol">'))
        await ou.until(lambda c: ("carol",) in c.present)
        hu = cu.assert_(parse('<Present "carol">'))
        await cu.sync()
        await cd.sync()
        cd.retract(hd)
        await cd.sync()
        await cu.sync()
        # Still held by u's client: present on both sides.
        assert s["d"].dataspaces["root"].count(parse('<Present "carol">')) >= 1
        assert ("carol",) in od.present and ("carol",) in ou.present
        cu.retract(hu)
        await od.until(lambda c: ("carol",) not in c.present)
        await ou.until(lambda c: ("carol",) not in c.present)
        for c in (cd, cu):
            await c.close()


@async_test
async def test_a_client_killed_on_the_far_side_is_retracted_here(tmp_path):
    async with linked(tmp_path, "u", "d", links={"d": ["u"]}) as s:
        cd = await client(s["d"])
        od = Changes()
        cd.observe("<Present $who>", **od.kw())
        await cd.sync()
        await LinkWatch(s["d"]).up()
        out: list[str] = []
        proc = await spawn("-m", "dataspace.cli", "assert", '<Present "victim">',
                           "--server", tcp_address(s["u"]), "--cap", str(s["u"].sturdyref))
        try:
            await od.until(lambda c: ("victim",) in c.present)
            proc.send_signal(signal.SIGKILL)
            await od.until(lambda c: ("victim",) not in c.present)
        finally:
            await kill(proc)
        del out
        await cd.close()


# ---------------------------------------------------------------------------------------
# What crosses


@async_test
async def test_only_what_the_far_side_wants_crosses(tmp_path):
    async with linked(tmp_path, "u", "d", links={"d": ["u"]}) as s:
        wd, wu = LinkWatch(s["d"]), LinkWatch(s["u"])
        cd, cu = await client(s["d"]), await client(s["u"])
        od = Changes()
        cd.observe('<Says "user-7" $text>', **od.kw())
        await cd.sync()
        await wd.settled()
        await wu.settled()
        before = wu.rows()[0]["messages_forwarded"]
        for i in range(20):
            for t in range(5):
                cu.send(Record(Symbol("Says"), [f"user-{i}", f"t{t}"]))
        await od.until(lambda c: len(c.messages()) == 5)
        await cu.sync()
        row = wu.rows()[0]
        assert row["messages_forwarded"] - before == 5
        assert row["messages_suppressed"] >= 95
        # Assertions too: only the wanted one is held for the peer.
        for i in range(10):
            cu.assert_(Record(Symbol("Says"), [f"user-{i}", "held"]))
        await od.until(lambda c: ("held",) in c.present)
        await cu.sync()
        assert wu.rows()[0]["assertions_held_for_peer"] == 1
        for c in (cd, cu):
            await c.close()


@async_test
async def test_interest_follows_subscriptions_going(tmp_path):
    async with linked(tmp_path, "u", "d", links={"d": ["u"]}) as s:
        wu = LinkWatch(s["u"])
        cd, cu = await client(s["d"]), await client(s["u"])
        subs = [cd.observe(f'<Says "user-{i}" $t>') for i in range(30)]
        await cd.sync()
        await wu.until(lambda rows: rows and rows[0]["peer_wants"] == 30)
        for sub in subs[:20]:
            sub.cancel()
        await cd.sync()
        await wu.until(lambda rows: rows[0]["peer_wants"] == 10)
        for sub in subs[20:]:
            sub.cancel()
        await wu.until(lambda rows: rows[0]["peer_wants"] == 0 and not rows[0]["peer_everything"])
        for c in (cd, cu):
            await c.close()


# ---------------------------------------------------------------------------------------
# Chains and cycles


@async_test
async def test_a_chain_of_three_servers(tmp_path):
    # a <- b <- c: b dials a, c dials b.  An observer on c sees what is published on a.
    async with linked(tmp_path, "a", "b", "c", links={"b": ["a"], "c": ["b"]}) as s:
        await LinkWatch(s["b"]).up(2)
        cc, ca = await client(s["c"]), await client(s["a"])
        oc = Changes()
        cc.observe("<Present $who>", **oc.kw())
        cc.observe("<Says $who $text>", **oc.kw())
        oa = Changes()
        ca.observe("<Present $who>", **oa.kw())
        await cc.sync()
        await LinkWatch(s["a"]).settled()
        h = ca.assert_(parse('<Present "from-a">'))
        cc.assert_(parse('<Present "from-c">'))
        ca.send(parse('<Says "a" "hello c">'))
        await oc.until(lambda c: ("from-a",) in c.present and ("a", "hello c") in c.messages())
        await oa.until(lambda c: ("from-c",) in c.present)
        ca.retract(h)
        await oc.until(lambda c: ("from-a",) not in c.present)
        assert oc.messages() == [("a", "hello c")]
        for c in (cc, ca):
            await c.close()


@async_test
async def test_a_link_that_would_close_a_cycle_is_refused(tmp_path):
    async with linked(tmp_path, "a", "b", links={"b": ["a"]}) as s:
        await LinkWatch(s["b"]).up()
        # c dials both a and b: a -- b and c -- a and c -- b would be a cycle.
        c_cfg = [(tcp_address(s["a"]), str(s["a"].sturdyref)),
                 (tcp_address(s["b"]), str(s["b"].sturdyref))]
        async with running_server(tmp_path / "c", link=c_cfg) as c:
            w = LinkWatch(s["a"], s["b"], c)
            await w.until(lambda rows: any("cycle" in (r.get("last_error") or "") for r in rows))
            # Whatever link was refused, a message sent on c reaches a's observer once.
            ca, cc = await client(s["a"]), await client(c)
            oa = Changes()
            ca.observe("<Says $who $text>", **oa.kw())
            await ca.sync()
            await w.until(lambda rows: all(r.get("pending", 0) == 0 and not r.get("peer_everything")
                                           for r in rows if r.get("connected")))
            cc.send(parse('<Says "c" "once">'))
            await oa.until(lambda o: ("c", "once") in o.messages())
            await cc.sync()
            await ca.sync()
            assert oa.messages().count(("c", "once")) == 1
            for cl in (ca, cc):
                await cl.close()


# ---------------------------------------------------------------------------------------
# Cuts, restarts, bad peers


class CutProxy:
    """A TCP proxy whose connections can be cut (all at once) and which refuses new ones
    while cut."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.writers: list[asyncio.StreamWriter] = []
        self.cut = False
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if self.cut:
            w.close()
            return
        ur, uw = await asyncio.open_connection(self.host, self.port)
        self.writers += [w, uw]

        async def pipe(a: asyncio.StreamReader, b: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await a.read(65536):
                    b.write(data)
                    await b.drain()
            with contextlib.suppress(Exception):
                b.close()

        await asyncio.gather(pipe(r, uw), pipe(ur, w))

    def cut_all(self) -> None:
        self.cut = True
        for w in self.writers:
            with contextlib.suppress(Exception):
                w.transport.abort()
        self.writers.clear()

    def close(self) -> None:
        self.cut_all()
        if self.server is not None:
            self.server.close()


@async_test
async def test_after_a_cut_both_sides_converge(tmp_path):
    async with running_server(tmp_path / "u") as u:
        proxy = CutProxy(tcp_address(u))
        addr = await proxy.start()
        try:
            async with running_server(tmp_path / "d", link=[(addr, str(u.sturdyref))]) as d:
                wd = LinkWatch(d)
                cd, cu = await client(d), await client(u)
                od = Changes()
                cd.observe("<Present $who>", **od.kw())
                await cd.sync()
                h1 = cu.assert_(parse('<Present "before">'))
                await od.until(lambda c: ("before",) in c.present)
                proxy.cut_all()
                await wd.until(lambda rows: not rows[0].get("connected"))
                # While cut: what went on u's side is not seen (the link's copies went).
                await od.until(lambda c: ("before",) not in c.present)
                cu.retract(h1)
                cu.assert_(parse('<Present "during">'))
                await cu.sync()
                proxy.cut = False
                await od.until(lambda c: ("during",) in c.present and ("before",) not in c.present)
                assert wd.rows()[0]["connected"]
                for c in (cd, cu):
                    await c.close()
        finally:
            proxy.close()


@async_test
async def test_a_killed_server_is_reconnected_after_its_restart(tmp_path):
    u = await ServerProcess(tmp_path / "u").start()
    try:
        cap = str(u.sturdyref)
        async with running_server(tmp_path / "d", link=[(u.address, cap)]) as d:
            wd = LinkWatch(d)
            cd = await client(d)
            od = Changes()
            cd.observe("<Present $who>", **od.kw())
            await cd.sync()
            await wd.up()
            cu = await connect(u.address, SturdyRef.parse(cap))
            cu.assert_(parse('<Present "on-u">'))
            await od.until(lambda c: ("on-u",) in c.present)
            await u.stop(signal.SIGKILL)
            await od.until(lambda c: ("on-u",) not in c.present)
            await wd.until(lambda rows: not rows[0]["connected"])
            await u.start()  # same data directory and port
            # The client reconnects and re-asserts; the link reconnects and carries it.
            await od.until(lambda c: ("on-u",) in c.present, timeout=40)
            await cu.close()
            await cd.close()
    finally:
        await u.stop()


@async_test
async def test_a_bad_link_peer_is_closed_with_an_error_and_the_server_goes_on(tmp_path):
    async with running_server(tmp_path / "u") as u:
        raw = await RawClient.open(tcp_address(u))
        ref = await raw.resolve(u.sturdyref)
        from dataspace.protocol.wire import WireRef

        info = Dictionary({Symbol("id"): "mallory", Symbol("version"): 1,
                           Symbol("cap"): u.sturdyref.to_value()})
        req = Record(Symbol("link-request"), [info, Embedded(WireRef(True, 5)),
                                              Embedded(WireRef(True, 6))])
        ref.on_assert(req, 2)
        await raw.flush_relay()
        # The server answers <link-accept ... #:ctl #:data>: find its control OID...
        accept = None
        while accept is None:
            data = await asyncio.wait_for(raw.reader.read(65536), TIMEOUT)
            assert data
            raw.decoder.feed(data)
            from dataspace.protocol.wire import parse_packet

            while (v := raw.decoder.try_next()) is not None:
                for ev in getattr(parse_packet(v), "events", []):
                    body = getattr(ev.event, "body", None)
                    if isinstance(body, Record) and body.label == Symbol("link-accept"):
                        accept = body
        ctl_oid = accept.fields[1].value.oid
        # ...and send it garbage.
        from dataspace.values import encode

        bad = encode(parse(f"[[{ctl_oid} <M <subscribe oops>>]]"))
        await raw.send(bad)
        packets = await raw.read_until_closed()
        errors = [p.message for p in packets if hasattr(p, "message")]
        assert errors and errors[-1].startswith("link: bad link message"), errors
        assert not u.link_status() or not any(r.get("connected") for r in u.link_status())
        # The server is fine.
        c = await client(u)
        await c.sync()
        await c.close()


@async_test
async def test_a_capability_with_caveats_cannot_link(tmp_path):
    async with running_server(tmp_path / "u") as u:
        weak = attenuate(u.sturdyref, parse("<rewrite <bind <_>> <ref 0>>"))
        with pytest.raises(ConfigError, match="without caveats"):
            ServerConfig(link=[(tcp_address(u), str(weak))]).check()
        # And the acceptor refuses such a request outright.
        async with running_server(tmp_path / "d") as d:
            from dataspace.broker.link import LinkDialer, LinkSpec

            hub = d.links["root"]
            dialer = LinkDialer(hub, LinkSpec(tcp_address(u), weak), d.hub, None)
            with pytest.raises(ConnectionError, match="without caveats"):
                await dialer._connect_once()
            if dialer.conn is not None:
                dialer.conn.close()


def test_link_status_command(tmp_path):
    async def go() -> str:
        async with linked(tmp_path, "u", "d", links={"d": ["u"]}) as s:
            await LinkWatch(s["d"]).settled()
            s["d"]._write_links()
            status = await asyncio.create_subprocess_exec(
                PY, "-m", "dataspace.cli", "link", "status", "--data-dir", str(s["d"].data_dir),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(status.communicate(), TIMEOUT)
            doc = json.loads((Path(s["d"].data_dir) / "links.json").read_text())
            assert doc["links"][0]["connected"] is True
            return out.decode() + err.decode()

    text = asyncio.run(asyncio.wait_for(go(), 120))
    assert "connected" in text and "->" in text and "upstreamed" in text, text


@async_test
async def test_serve_prints_link_events(tmp_path):
    u = await ServerProcess(tmp_path / "u").start()
    try:
        proc = await spawn("-m", "dataspace.cli", "serve", "--tcp", "127.0.0.1:0",
                           "--data-dir", str(tmp_path / "d"), "--link", u.address,
                           "--link-cap", str(u.sturdyref))
        seen: list[str] = []
        try:
            await read_line_matching(proc, r"linking to 127\.0\.0\.1", seen)
            await read_line_matching(proc, r"link 127\.0\.0\.1:\d+: up", seen)
        finally:
            await kill(proc)
    finally:
        await u.stop()


# ---------------------------------------------------------------------------------------
# The forwarding path, without sockets: what a turn of messages costs the link


def test_a_turn_of_messages_crosses_as_one_packet_of_the_bytes_they_came_in():
    """U forwards the messages of a publisher's turn with one call of the dataspace's tap
    (no match and no callback per message), in one packet on the link, each as the bytes
    it was received in (not encoded again: an integer written in two bytes where one
    would do stays so)."""
    from dataspace.broker.link import LINK_REACH, LINK_RELAY_LIMITS, LinkHub, LinkSession
    from dataspace.dataspace import Dataspace, DataspaceEntity
    from dataspace.pattern import parse_pattern
    from dataspace.protocol.gatekeeper import Bindings
    from dataspace.protocol.relay import Relay
    from dataspace.protocol.upstream import Subscriber, pattern_chain
    from dataspace.values import Sequence, encode

    loop = asyncio.new_event_loop()
    try:
        ds = Dataspace("u")
        ds.max_turn_events = 100_000
        hub = LinkHub(ds, server_id="u", bindings=Bindings(), loop=loop)
        link = Relay(limits=LINK_RELAY_LIMITS, turn=ds.turn)  # U's end of the link
        s = LinkSession(hub, "from d", "d", link, dialed=False)
        s.ctl_out, s.data_out = link.import_ref(10), link.import_ref(11)
        hub.begin(s)
        sub = Subscriber()  # D's machine: D wants <Says "user-7" _>
        sub.start(0.0)
        sub.add_interest(pattern_chain(parse_pattern('<Says "user-7" $text>')), 0.0)
        for request in sub.take_outgoing():
            s.on_control(request)
        s.on_control(Record(LINK_REACH, [Sequence(["d"])]))
        link.take_packets()
        taps: list[int] = []
        inner = hub._messages
        hub.ds.tap_messages(lambda msgs: (taps.append(len(msgs)), inner(msgs)))

        pub = Relay(turn=ds.turn)  # the publisher's connection on U
        pub.export_at(1, DataspaceEntity(ds))
        odd = b"\xb4\xb3\x04Says\xb1\x06user-7\xb0\x02\x00\x05\x84"  # <Says "user-7" 5>
        bodies = [encode(parse(f'<Says "user-7" "{i}">')) for i in range(49)] + [odd]
        packet = b"\xb5" + b"".join(b"\xb5\xb0\x01\x01\xb4\xb3\x01M" + b + b"\x84\x84"
                                    for b in bodies) + b"\x84"
        pub.receive_data(packet)
        assert taps == [50]
        out = link.take_packets()
        assert len(out) == 1
        assert out[0] == b"\xb5" + b"".join(b"\xb5\xb0\x01\x0b\xb4\xb3\x01M" + b + b"\x84\x84"
                                            for b in bodies) + b"\x84"
        assert s.counters["messages_forwarded"] == 50
    finally:
        hub.close()
        loop.close()
