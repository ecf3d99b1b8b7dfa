"""The HTTP port's monitoring endpoints (dataspace.web: /metrics, /healthz, /api/...):
real HTTP over loopback with aiohttp's client against a real server, real clients and a
real store (in-process), and `dataspace serve --http` in a subprocess.

Every wait is bounded and waits on something (a response, an event, a socket closing),
never on a sleep."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker_support import TIMEOUT, ServerProcess, async_test, running_server, tcp_address
from dataspace.broker import Server
from dataspace.client import connect
from dataspace.protocol.sturdy import attenuate, mint
from dataspace.streams import open_store
from dataspace.streams.recorder import start_recorders, stop_recorders
from dataspace.values import Record, Sequence, Symbol, parse
from dataspace.web import HttpServer, start_http
from dataspace.web.dataspaces import WATCHES


@dataclass
class Api:
    server: Server
    http: HttpServer
    session: aiohttp.ClientSession
    store: Any
    recorders: list[Any]

    @property
    def token(self) -> str:
        return str(self.server.sturdyref)

    def url(self, path: str) -> str:
        return self.http.url + path.lstrip("/")

    async def get(self, path: str, token: str | None = "root", **kw: Any
                  ) -> tuple[int, Any, dict[str, str]]:
        headers = dict(kw.pop("headers", {}))
        if token is not None:
            headers["Authorization"] = "Bearer " + (self.token if token == "root" else token)
        async with self.session.get(self.url(path), headers=headers, **kw) as r:
            body = await r.read()
            ctype = r.headers.get("Content-Type", "")
            data = json.loads(body) if ctype.startswith("application/json") else body.decode()
            return r.status, data, dict(r.headers)

    async def json(self, path: str, token: str | None = "root") -> Any:
        status, data, _h = await self.get(path, token)
        assert status == 200, (path, status, data)
        return data

    async def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, parsed by prometheus-client's own parser, by name
        and labels (``name{k=v,...}``)."""
        status, text, headers = await self.get("/metrics")
        assert status == 200, text
        assert headers["Content-Type"].startswith("text/plain; version=")
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


@contextlib.asynccontextmanager
async def api(tmp_path: Path, record: tuple[str, ...] = ("chat:<Says $who $text>",),
              settings: dict[str, Any] | None = None, **kw: Any) -> AsyncIterator[Api]:
    """A broker (``settings``), its store and recorders, its HTTP port (``kw``) and a
    client session."""
    store = open_store(tmp_path / "data")
    try:
        async with running_server(tmp_path, **(settings or {})) as server:
            recs = start_recorders(server.dataspaces["root"], list(record), store)
            try:
                http = await start_http("127.0.0.1", 0, store=store, publish=(), server=server,
                                        recorders=recs, **kw)
                try:
                    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
                    async with aiohttp.ClientSession(timeout=timeout) as session:
                        yield Api(server, http, session, store, recs)
                finally:
                    await http.close()
            finally:
                stop_recorders(recs)
    finally:
        store.close()


async def client(a: Api, cap: str | None = None) -> Any:
    return await connect(tcp_address(a.server), cap or a.token, reconnect=False)


class Sse:
    """A Server-Sent Events reader."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.comments: list[str] = []

    async def next(self) -> dict[str, str]:
        async def read() -> dict[str, str]:
            fields: dict[str, str] = {}
            while True:
                line = await self.resp.content.readline()
                if not line:
                    raise EOFError("the event stream ended")
                text = line.decode().rstrip("\n")
                if not text:
                    if fields:
                        return fields
                    continue
                if text.startswith(":"):
                    self.comments.append(text)
                    continue
                k, _, v = text.partition(":")
                fields[k] = v.removeprefix(" ")

        return await asyncio.wait_for(read(), TIMEOUT)

    async def data(self) -> dict[str, Any]:
        ev = await self.next()
        assert "event" not in ev, ev
        return json.loads(ev["data"])


# ------------------------------------------------------------------------------------
# /metrics


@async_test
async def test_metrics_parse_and_move_as_clients_act(tmp_path):
    async with api(tmp_path) as a:
        m0 = await a.metrics()
        assert m0["dataspace_connections"] == 0
        assert m0["dataspace_messages_received_total"] == 0
        assert m0["dataspace_process_resident_memory_bytes"] > 1_000_000
        assert m0["dataspace_dataspace_assertions{dataspace=root}"] == 1  # its <Observe>
        assert m0["dataspace_observers{dataspace=root}"] == 1  # the recorder's
        assert m0["dataspace_store_commit_seconds_count"] == 0
        assert m0['dataspace_server_info{server_id=' + a.server.server_id + ',version=0.1.0}'] == 1

        ds = await client(a)
        got: list[Any] = []
        ds.observe("<Says $who $text>", on_message=lambda *c: got.append(c))
        ds.assert_(parse('<Present "alice">'))
        with ds.turn():
            for i in range(5):
                ds.send(parse(f'<Says "alice" "m{i}">'))
        await ds.sync()
        assert a.recorders[0].flush(TIMEOUT)
        m1 = await a.metrics()
        assert m1["dataspace_connections"] == 1
        assert m1["dataspace_connections_accepted_total"] == 1
        assert m1["dataspace_messages_received_total"] == 5
        assert m1["dataspace_messages_sent_total"] == 5  # to its own observer
        assert m1["dataspace_turns_total"] >= 3
        assert m1["dataspace_received_bytes_total"] > m0["dataspace_received_bytes_total"]
        assert m1["dataspace_sent_bytes_total"] > 0
        assert m1["dataspace_observers{dataspace=root}"] == 2
        assert m1["dataspace_index_handlers{dataspace=root}"] >= 2
        assert m1["dataspace_index_nodes{dataspace=root}"] >= 2
        assert m1["dataspace_route_messages_total{dataspace=root}"] == 5  # on their bytes
        assert m1["dataspace_route_cache_total{dataspace=root,event=misses}"] >= 1
        assert m1["dataspace_recorder_recorded_total{stream=chat}"] == 5
        assert m1["dataspace_store_appends_total"] == 5
        n = m1["dataspace_store_commit_seconds_count"]
        assert n >= 1 and m1["dataspace_store_commit_seconds_bucket{le=+Inf}"] == n
        assert m1["dataspace_store_commit_seconds_sum"] > 0
        await ds.close()

        # A peer sending garbage is closed for a protocol error, counted by kind.
        r, w = await asyncio.open_connection(*tcp_address(a.server).split(":"))
        w.write(b"\xb4\xb3\x05hello\xff\xff\xff\x84")
        await w.drain()
        await asyncio.wait_for(r.read(), TIMEOUT)  # the server closes it
        w.close()
        m2 = await a.metrics()
        assert m2["dataspace_connection_errors_total{kind=protocol}"] == 1
        assert m2["dataspace_connection_errors_total{kind=limit}"] == 0
        assert m2["dataspace_connections"] == 0
        # Closed connections' bytes and messages are kept in the totals.
        assert m2["dataspace_messages_received_total"] == 5
        assert m2["dataspace_received_bytes_total"] >= m1["dataspace_received_bytes_total"]


@async_test
async def test_metrics_registry_is_per_server(tmp_path):
    from prometheus_client import REGISTRY

    async with api(tmp_path / "a") as a, api(tmp_path / "b") as b:
        ds = await client(a)
        await ds.sync()
        assert (await a.metrics())["dataspace_connections"] == 1
        assert (await b.metrics())["dataspace_connections"] == 0
        await ds.close()
    assert not any(n.startswith("dataspace_") for n in REGISTRY._names_to_collectors)


# ------------------------------------------------------------------------------------
# Tokens


def _only(*patterns: str) -> Any:
    """A caveat letting through what matches any of ``patterns`` (attenuation syntax)."""
    rw = [Record(Symbol("rewrite"), [Record(Symbol("bind"), [parse(p)]),
                                     Record(Symbol("ref"), [0])]) for p in patterns]
    return rw[0] if len(rw) == 1 else Record(Symbol("or"), [Sequence(rw)])


PRESENCE_ONLY = _only("<rec Present [<_>]>",
                      "<rec Observe [<rec group [<rec rec [<lit Present>]> <_>]> <_>]>")


@async_test
async def test_tokens(tmp_path):
    async with api(tmp_path) as a:
        status, body, headers = await a.get("/api/server", token=None)
        assert status == 401 and "Bearer" in headers["WWW-Authenticate"]
        assert "root.sturdyref" in body["error"]
        status, body, _ = await a.get("/api/server", token="not a ref")
        assert status == 401 and "not a sturdyref" in body["error"]
        forged = str(mint("root", b"another key"))
        status, body, _ = await a.get("/metrics", token=forged)
        assert status == 401 and "not a capability of this server" in body["error"]
        # The healthz endpoint and the scry gateway need none.
        assert (await a.get("/healthz", token=None))[0] == 200

        root = a.server.sturdyref
        assert root is not None
        guest = str(attenuate(root, PRESENCE_ONLY))
        s = await a.json("/api/server", guest)
        assert s["scope"] == "dataspace:root" and "listeners" not in s and "store" not in s
        c = await a.json("/api/connections", guest)
        assert c["connections"] == [] and c["count"] == 0
        for path in ("/metrics", "/api/links", "/api/streams", "/api/pipelines",
                     "/api/stream/chat"):
            status, body, _ = await a.get(path, guest)
            assert status == 403, path
            assert "root capability" in body["error"]

        # The cookie works too (for pages whose event streams cannot send headers).
        status, body, _ = await a.get("/api/server", token=None,
                                      headers={"Cookie": "dataspace_token=" + quote(a.token)})
        assert status == 200 and body["scope"] == "admin"


@async_test
async def test_what_an_attenuated_token_sees_follows_its_caveats(tmp_path):
    async with api(tmp_path) as a:
        ds = await client(a)
        ds.assert_(parse('<Present "alice">'))
        ds.assert_(parse('<Secret "s3cret">'))
        conn_ref = Record(Symbol("Lease"), [parse('"x"')])
        ds.assert_(conn_ref)
        await ds.sync()
        root = a.server.sturdyref
        assert root is not None
        guest = str(attenuate(root, PRESENCE_ONLY))

        rows = await a.json("/api/assertions?pattern=" + quote("<Present $who>"), guest)
        assert [r["captures"] for r in rows["assertions"]] == [['"alice"']]
        assert "value" not in rows["assertions"][0]  # not bound at the top: captures only
        assert rows["assertions"][0]["match"] == '<Present "alice">'
        status, body, _ = await a.get("/api/assertions?pattern=" + quote("<Secret $x>"), guest)
        assert status == 403 and "do not let it observe <Secret $x>" in body["error"]
        status, body, _ = await a.get("/api/watch?pattern=" + quote("$x"), guest)
        assert status == 403
        status, body, _ = await a.get("/api/subscriptions", guest)
        assert status == 403  # it may not observe <Observe _ _>
        status, body, _ = await a.get("/api/assertions?dataspace=other&pattern=_", guest)
        assert status == 403 and "reaches dataspace 'root' only" in body["error"]

        # The same with the root token: whole values, every pattern.
        rows = await a.json("/api/assertions?pattern=" + quote("$x"))
        values = sorted(r["value"] for r in rows["assertions"])
        assert '<Present "alice">' in values and '<Secret "s3cret">' in values
        assert rows["count"] == len(rows["assertions"]) and not rows["truncated"]

        # A caveat that hides some captures from the observer hides them here too.
        hide_bob = Record(Symbol("rewrite"), [
            parse("<rec Observe [<bind <_>> <bind Embedded>]>"),
            parse('<rec Observe [<ref 0> <attenuate <ref 1> [<reject <arr [<lit "bob">]>>]>]>'),
        ])
        ds.assert_(parse('<Present "bob">'))
        await ds.sync()
        shy = str(attenuate(root, PRESENCE_ONLY, hide_bob))
        rows = await a.json("/api/assertions?pattern=" + quote("<Present $who>"), shy)
        assert [r["captures"] for r in rows["assertions"]] == [['"alice"']]
        async with a.session.get(a.url("/api/watch?pattern=" + quote("<Present $who>")),
                                 headers={"Authorization": "Bearer " + shy}) as r:
            assert r.status == 200
            sse = Sse(r)
            assert (await sse.data())["captures"] == ['"alice"']
            assert (await sse.next())["event"] == "synced"
            ds.assert_(parse('<Present "bob">'))  # hidden
            ds.assert_(parse('<Present "carol">'))
            await ds.sync()
            ev = await sse.data()
            assert ev["event"] == "+" and ev["captures"] == ['"carol"']
        await ds.close()


@async_test
async def test_a_token_shown_whole_values_whenever_its_caveats_allow(tmp_path):
    """A token that may observe ``<$ P>`` is shown whole values for any ``P`` (``_``
    too: not one empty match); one that may not gets the captures, and for a pattern
    without captures only whether something matches (``presence_only``)."""
    async with api(tmp_path) as a:
        ds = await client(a)
        ds.assert_(parse('<Present "alice">'))
        ds.assert_(parse('<Present "bob">'))
        await ds.sync()
        root = a.server.sturdyref
        assert root is not None
        anything = str(attenuate(root, _only("<rec Observe [<_> <_>]>")))
        rows = await a.json("/api/assertions?pattern=_", anything)
        values = [r["value"] for r in rows["assertions"]]
        assert '<Present "alice">' in values and '<Present "bob">' in values, rows
        assert rows["count"] == len(values) and all(r["captures"] == [] for r in rows["assertions"])
        assert "presence_only" not in rows
        rows = await a.json("/api/assertions?pattern=" + quote("<Present $who>"), anything)
        assert rows["assertions"] == [
            {"captures": ['"alice"'], "match": '<Present "alice">', "value": '<Present "alice">'},
            {"captures": ['"bob"'], "match": '<Present "bob">', "value": '<Present "bob">'}]

        presence = str(attenuate(root, PRESENCE_ONLY))
        rows = await a.json("/api/assertions?pattern=" + quote("<Present _>"), presence)
        assert rows["presence_only"] is True and rows["count"] == 1
        assert rows["assertions"] == [{"captures": [], "match": "<Present _>"}]
        async with a.session.get(a.url("/api/watch?pattern=_"),
                                 headers={"Authorization": "Bearer " + anything}) as r:
            assert r.status == 200
            sse = Sse(r)
            seen = []
            while "event" not in (ev := await sse.next()):
                seen.append(json.loads(ev["data"])["value"])
            synced = json.loads(ev["data"])
            assert ev["event"] == "synced" and "presence_only" not in synced
            assert '<Present "alice">' in seen and '<Present "bob">' in seen
            assert synced["matches"] == len(seen) >= 3  # and the watch's own <Observe ...>
        await ds.close()


# ------------------------------------------------------------------------------------
# JSON endpoints


@async_test
async def test_server_connections_subscriptions_assertions(tmp_path):
    async with api(tmp_path) as a:
        ds = await client(a)
        other = await client(a, str(attenuate(a.server.sturdyref, PRESENCE_ONLY)))  # type: ignore[arg-type]
        ds.observe("<Says $who $text>", on_message=lambda *c: None)
        ds.observe("<Says $who $text>", on_message=lambda *c: None)
        for i in range(3):
            ds.assert_(parse(f'<Present "p{i}">'))
        ds.send(parse('<Says "a" "b">'))
        await ds.sync()
        other.assert_(parse('<Present "guest">'))
        await other.sync()

        s = await a.json("/api/server")
        assert s["connections"] == 2 and s["scope"] == "admin"
        assert s["dataspaces"]["root"]["observers"] == 3  # two and the recorder's
        assert s["messages_in"] == 1 and s["messages_out"] == 2
        assert s["memory_rss"] > 1_000_000 and s["uptime"] >= 0
        assert s["limits"]["max_connections"] == 10_000
        assert s["recorders"][0]["stream"] == "chat"
        assert s["listeners"] == [f"tcp {tcp_address(a.server)}"] or s["listeners"]

        c = await a.json("/api/connections")
        assert c["count"] == 2
        first, second = c["connections"]
        assert first["dataspaces"] == [{"name": "root", "attenuated": False}]
        assert second["dataspaces"] == [{"name": "root", "attenuated": True}]
        assert first["observers"] == 2 and first["assertions_in"] >= 5
        assert first["messages_in"] == 1 and first["bytes_in"] > 0 and first["bytes_out"] > 0
        assert first["pending_output"] == 0 and first["held"] == []
        assert first["transport"] == "tcp" and first["peer"].startswith("127.0.0.1:")

        subs = await a.json("/api/subscriptions")
        top = subs["patterns"][0]
        assert top == {"pattern": "<Says $ $>", "observers": 2, "remote": 2, "local": 0,
                       "delivered": 2, "matches": 0, "own": None}

        rows = await a.json("/api/assertions?pattern=" + quote("<Present $who>") + "&limit=2")
        assert rows["count"] == 4 and rows["truncated"] and len(rows["assertions"]) == 2
        assert all(r["copies"] == 1 for r in rows["assertions"])
        await other.close()
        await ds.close()


@async_test
async def test_bad_patterns_get_the_parsers_message_with_the_position(tmp_path):
    async with api(tmp_path) as a:
        for path in ("/api/assertions", "/api/watch"):
            status, body, _ = await a.get(path + "?pattern=" + quote("<Says $who"))
            assert status == 400
            assert body["error"].startswith("bad pattern: text ended inside '<'")
            assert body["line"] == 1 and body["column"] == 11 and body["position"] == 10
            status, body, _ = await a.get(path + "?pattern=" + quote('<a "x>'))
            assert status == 400 and "string" in body["error"] and "column" in body
            status, body, _ = await a.get(path)
            assert status == 400 and "give a pattern" in body["error"]
        status, body, _ = await a.get("/api/assertions?pattern=_&dataspace=nope")
        assert status == 404 and "no dataspace 'nope'" in body["error"]
        status, body, _ = await a.get("/api/assertions?pattern=_&limit=0")
        assert status == 400


@async_test
async def test_watch_events(tmp_path):
    async with api(tmp_path) as a:
        ds = await client(a)
        h = ds.assert_(parse('<Present "alice">'))
        await ds.sync()
        url = a.url("/api/watch?pattern=" + quote("<Present $who>"))
        async with a.session.get(url, headers={"Authorization": "Bearer " + a.token}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            sse = Sse(r)
            ev = await sse.data()
            assert ev == {"event": "+", "captures": ['"alice"'], "match": '<Present "alice">',
                          "value": '<Present "alice">'}
            synced = await sse.next()
            assert synced["event"] == "synced" and json.loads(synced["data"])["matches"] == 1
            ds.retract(h)
            await ds.sync()
            assert (await sse.data())["event"] == "-"
            sub = await a.json("/api/subscriptions")
            assert any(p["pattern"] == "<$ <Present $>>" for p in sub["patterns"])
        async with a.session.get(a.url("/api/watch?pattern=" + quote("<Ping $x _>")),
                                 headers={"Authorization": "Bearer " + a.token}) as r:
            sse = Sse(r)
            assert (await sse.next())["event"] == "synced"
            ds.send(parse('<Ping 1 "two">'))
            await ds.sync()
            assert await sse.data() == {"event": "!", "captures": ["1"], "match": "<Ping 1 _>",
                                        "value": '<Ping 1 "two">'}
        # The watch's <Observe> goes with its event stream.
        watches = a.http.app[WATCHES]

        async def gone() -> None:
            while True:
                watches.changed.clear()
                if not watches.active:
                    return
                await watches.changed.wait()

        await asyncio.wait_for(gone(), TIMEOUT)
        sub = await a.json("/api/subscriptions")
        assert not any("Ping" in p["pattern"] for p in sub["patterns"])
        await ds.close()


@async_test
async def test_watch_shows_references_readably(tmp_path):
    async with api(tmp_path) as a:
        ds = await client(a)
        got = asyncio.Event()
        # A service that asserts its own reference (the usual reply-to idiom).
        ds.during("<Ask $k>", lambda k: got.set())
        async with a.session.get(a.url("/api/watch?pattern=" + quote("<Observe $p $o>")),
                                 headers={"Authorization": "Bearer " + a.token}) as r:
            sse = Sse(r)
            seen = []
            while True:
                ev = await sse.next()
                if ev.get("event") == "synced":
                    break
                seen.append(json.loads(ev["data"]))
            texts = [e["captures"][1] for e in seen]
            assert any(re.fullmatch(r'#:<peer "127\.0\.0\.1:\d+" \d+>', t) for t in texts), texts
        await ds.close()


@async_test
async def test_healthz_says_why_not(tmp_path):
    async with api(tmp_path) as a:
        assert (await a.json("/healthz", None)) == {"status": "ready"}
        a.recorders[0].error = RuntimeError("disk on fire")
        status, body, _ = await a.get("/healthz", None)
        assert status == 503 and body["status"] == "unavailable"
        assert "recorder chat stopped: the store failed (disk on fire)" in body["reasons"]
        a.recorders[0].error = None


@async_test
async def test_streams_pipelines_and_a_stream_with_search(tmp_path):
    from dataspace.pipeline import Graph
    from dataspace.pipeline.local import LocalEngine

    async with api(tmp_path) as a:
        store = a.store
        store.append_many("words", [parse(f'"w{i}"') for i in range(50)])
        g = Graph("shout")
        g.source("words")
        g.map("upper", "words", "loud", lambda s: s.upper())
        with LocalEngine(g, store) as eng:
            eng.start()
            eng.run(until_idle=True)
        store.append_many("words", [parse(f'"x{i}"') for i in range(7)])  # lag 7

        st = await a.json("/api/streams")
        by = {s["name"]: s for s in st["streams"]}
        assert by["words"]["length"] == 57 and by["words"]["next"] == 57
        assert by["words"]["tailers"] == [
            {**by["words"]["tailers"][0], "name": "shout/upper", "position": 50, "lag": 7}]
        assert not any(n.startswith("__") for n in by)
        every = await a.json("/api/streams?all=1")
        assert any(s["name"] == "__backing/shout/upper" for s in every["streams"])

        pl = await a.json("/api/pipelines")
        (graph,) = pl["graphs"]
        assert graph["graph"] == "shout" and graph["lag"] == 7
        (proc,) = graph["processors"]
        assert proc["name"] == "upper" and proc["outputs"] == ["loud"]
        assert proc["inputs"] == [{"stream": "words", "position": 50, "next": 57, "lag": 7}]
        assert proc["last_step"]["kind"].startswith("attempt")
        assert {s["name"]: s["role"] for s in graph["streams"]} == {"words": "source",
                                                                   "loud": "output"}
        assert {"from": "words", "to": "upper", "lag": 7} in graph["edges"]

        tail = await a.json("/api/stream/words?limit=3")
        assert [e["index"] for e in tail["entries"]] == [54, 55, 56]
        assert tail["entries"][0]["value"] == '"x4"' and tail["next_before"] == 54
        fwd = await a.json("/api/stream/words?from=10&limit=2")
        assert [e["value"] for e in fwd["entries"]] == ['"w10"', '"w11"']
        found = await a.json("/api/stream/words?search=W4&limit=100")
        assert [e["value"] for e in found["entries"]] == ['"w4"'] + [f'"w4{i}"' for i in range(10)]
        status, _body, _ = await a.get("/api/stream/nope")
        assert status == 404
        status, _body, _ = await a.get("/api/stream/words?limit=x")
        assert status == 400


@async_test
async def test_a_damaged_stream_marks_its_graph_and_hides_no_other(tmp_path):
    """/api/pipelines failed whole (503) when one stream's bookkeeping was damaged: the
    graph that reads it is marked (which stream, what is wrong) with what is still known,
    and every other graph is as before."""
    from dataspace.pipeline import Graph
    from dataspace.pipeline.local import LocalEngine
    from store_damage import Raw

    async with api(tmp_path) as a:
        store = a.store
        store.append_many("words", [parse(f'"w{i}"') for i in range(50)])
        store.append_many("nums", [parse(str(i)) for i in range(40)])
        for g in (Graph("shout"), Graph("double")):
            src, out, fn = (("words", "loud", lambda s: s.upper()) if g.name == "shout"
                            else ("nums", "twice", lambda n: 2 * n))
            g.source(src)
            g.map("m", src, out, fn)
            with LocalEngine(g, store) as eng:
                eng.start()
                eng.run(until_idle=True)
        raw = Raw(str(tmp_path / "data"))
        assert raw.flip_column("streams", "next_index", 5, "nums")  # 40 -> 8
        raw.close()

        status, body, _ = await a.get("/api/pipelines")
        assert status == 200, body
        by = {g["graph"]: g for g in body["graphs"]}
        assert by["shout"]["damaged"] == [] and by["shout"]["lag"] == 0
        assert [s["damaged"] for s in by["shout"]["streams"]] == [None, None]
        (bad,) = by["double"]["damaged"]
        assert bad["stream"] == "nums" and bad["reason"], bad
        rows = {s["name"]: s for s in by["double"]["streams"]}
        assert rows["nums"]["damaged"] == bad["reason"] and rows["nums"]["next"] is None
        assert rows["twice"]["damaged"] is None and rows["twice"]["length"] == 40
        (proc,) = by["double"]["processors"]
        assert proc["damaged"] is None and proc["outputs"] == ["twice"]
        # (its tailers are the damaged stream's: unknown, as its next is)
        assert proc["inputs"] == [{"stream": "nums", "position": None, "next": None,
                                   "lag": None}]


@async_test
async def test_links_endpoint_and_metrics(tmp_path):
    async with running_server(tmp_path / "up") as up:
        link = [(tcp_address(up), str(up.sturdyref))]
        async with api(tmp_path / "down", settings={"link": link}) as a:
            changed = asyncio.Event()
            for hub in a.server.links.values():
                hub.on_change.append(changed.set)

            async def until_up() -> None:
                while not any(r.get("connected") for r in a.server.link_status()):
                    changed.clear()
                    await changed.wait()

            await asyncio.wait_for(until_up(), TIMEOUT)
            (row,) = (await a.json("/api/links"))["links"]
            assert row["link"] == tcp_address(up) and row["direction"] == "out"
            assert row["connected"] is True and row["peer_id"] == up.server_id
            m = await a.metrics()
            labels = f"dataspace=root,direction=out,link={tcp_address(up)}"
            assert m[f"dataspace_link_up{{{labels}}}"] == 1
            assert m[f"dataspace_link_sent_bytes_total{{{labels}}}"] > 0
            s = await a.json("/api/server")
            assert s["links"] == {"count": 1, "connected": 1}


# ------------------------------------------------------------------------------------
# --http-open, and the real command


@async_test
async def test_open_access_is_loopback_only(tmp_path):
    with pytest.raises(ValueError, match="loopback address only"):
        await start_http("0.0.0.0", 0, store=None, publish=(), open_access=True)
    async with api(tmp_path, open_access=True) as a:
        s = await a.json("/api/server", None)
        assert s["scope"] == "admin" and s["http_open"] is True


def test_serve_refuses_http_open_off_loopback(tmp_path):
    import subprocess

    from broker_support import PY

    r = subprocess.run([PY, "-m", "dataspace.cli", "serve", "--tcp", "127.0.0.1:0",
                        "--data-dir", str(tmp_path), "--http", "0.0.0.0:0", "--http-open"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2
    assert "refused on 0.0.0.0, which is not a loopback address" in r.stderr


@async_test
async def test_serve_http_end_to_end(tmp_path):
    data = tmp_path / "data"
    srv = ServerProcess(data, extra=("--http", "127.0.0.1:0", "--record",
                                     "chat:<Says $who $text>"))
    await srv.start()
    try:
        line = next(s for s in srv.stderr_lines if "HTTP on" in s)
        base = re.search(r"HTTP on (http://127\.0\.0\.1:\d+/)", line).group(1)  # type: ignore[union-attr]
        headers = {"Authorization": "Bearer " + srv.sturdyref}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as s:
            async with s.get(base + "api/watch?pattern=" + quote("<Says $who $text>"),
                             headers=headers) as w:
                sse = Sse(w)
                assert (await sse.next())["event"] == "synced"
                ds = await connect(srv.address, srv.sturdyref, reconnect=False)
                ds.send(parse('<Says "dan" "hello">'))
                await ds.sync()  # recorded (durable) when it returns
                ev = await sse.data()
                assert ev["value"] == '<Says "dan" "hello">'
                async with s.get(base + "metrics", headers=headers) as r:
                    text = await r.text()
                fams = {f.name: f for f in text_string_to_metric_families(text)}
                assert fams["dataspace_store_appends"].samples[0].value == 1
                assert fams["dataspace_messages_received"].samples[0].value == 1
                async with s.get(base + "api/stream/chat", headers=headers) as r:
                    assert (await r.json())["entries"][0]["value"] == '<Says "dan" "hello">'
                await ds.close()
    finally:
        assert await srv.stop() == 0

