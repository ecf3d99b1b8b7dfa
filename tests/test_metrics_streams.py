"""/metrics with the stream store: each stream's length and last index, each named
tailer's lag, each graph's state and lag (as Kafka users watch consumer lag), bounded
in labels and cheap to scrape, from a real server's HTTP port (issue 28, section 5)."""

from __future__ import annotations

import threading
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from broker_support import async_test, running_server
from dataspace.pipeline import Graph, LocalEngine
from dataspace.streams import open_store
from dataspace.streams.base import StoreError
from dataspace.values import Record, Symbol
from dataspace.web import metrics, start_http
from test_web_api import Api, api


def _graph() -> Graph:
    g = Graph("shout")
    g.source("words")
    g.map("upper", "words", "loud", lambda v: Record(Symbol("loud"), [v]))
    return g


def _series(m: dict[str, float], name: str) -> dict[str, float]:
    return {k: v for k, v in m.items() if k == name or k.startswith(name + "{")}


@async_test
async def test_metrics_give_streams_tailers_and_graphs(tmp_path):
    async with api(tmp_path) as a:
        with open_store(tmp_path / "data") as store:
            store.create_stream("words")
            store.create_stream("empty")
            with store.transaction() as tx:
                for i in range(10):
                    tx.append("words", f"w{i}")
            with LocalEngine(_graph(), store) as engine:
                engine.drain()
                with store.transaction() as tx:
                    for i in range(3):
                        tx.append("words", f"late{i}")
                m = await a.metrics()  # while the engine holds the graph
                assert m["dataspace_graph_running{graph=shout}"] == 1
            after = await a.metrics()
        assert m["dataspace_store_up"] == 1
        assert _series(m, "dataspace_stream_entries") == {
            "dataspace_stream_entries{stream=chat}": 0,
            "dataspace_stream_entries{stream=empty}": 0,
            "dataspace_stream_entries{stream=loud}": 10,
            "dataspace_stream_entries{stream=words}": 13}
        assert _series(m, "dataspace_stream_last_index") == {
            "dataspace_stream_last_index{stream=loud}": 9,
            "dataspace_stream_last_index{stream=words}": 12}  # none before the first entry
        assert m["dataspace_stream_first_index{stream=words}"] == 0
        assert m["dataspace_stream_last_append_time_seconds{stream=words}"] > 1.7e9
        # The processor's tailer on its input: where it is, and how far behind.
        assert _series(m, "dataspace_tailer_lag_entries") == {
            "dataspace_tailer_lag_entries{stream=words,tailer=shout/upper}": 3}
        assert m["dataspace_tailer_position{stream=words,tailer=shout/upper}"] == 10
        assert m["dataspace_graph_lag_entries{graph=shout}"] == 3
        assert m["dataspace_processor_lag_entries{graph=shout,processor=upper}"] == 3
        assert m["dataspace_processor_steps{graph=shout,processor=upper}"] >= 1
        assert m["dataspace_graph_processors{graph=shout}"] == 1
        assert m["dataspace_graph_last_progress_seconds{graph=shout}"] > 1.7e9
        assert m["dataspace_graphs"] == 1
        # The store's own streams (a processor's backing stream) have no series of their
        # own: counted, and shown through their graphs.
        assert m["dataspace_streams{kind=user}"] == 4
        assert m["dataspace_streams{kind=internal}"] >= 1
        assert not any("stream=__" in k for k in m), [k for k in m if "stream=__" in k]
        assert m["dataspace_streams_unlisted"] == 0
        # The engine gone, the graph is not running; its lag stays.
        assert after["dataspace_graph_running{graph=shout}"] == 0
        assert after["dataspace_graph_lag_entries{graph=shout}"] == 3


class RowsOnly:
    """A store through which only the rows of streams and tailers (and locks) can be
    read: reading an entry fails the test."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def streams(self, include_internal: bool = False, with_damaged: bool = False) -> Any:
        return self._store.streams(include_internal, with_damaged=with_damaged)

    def lock_holder(self, name: str) -> Any:
        return self._store.lock_holder(name)

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a scrape read the store's {name}")


def _text(snap: metrics.StoreSnapshot) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.StoreCollector(snap)).decode()  # type: ignore[arg-type]


def _samples(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_the_labels_are_bounded_and_no_entry_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "MAX_STREAMS", 3)
    monkeypatch.setattr(metrics, "MAX_TAILERS", 2)
    monkeypatch.setattr(metrics, "MAX_GRAPHS", 1)
    monkeypatch.setattr(metrics, "MAX_PROCESSORS", 1)
    with open_store(tmp_path / "s.sqlite3") as store:
        for i in range(5):
            store.create_stream(f"s{i}")
            with store.transaction() as tx:
                tx.append(f"s{i}", i)
                for t in range(2):
                    tx.set_position(f"s{i}", f"reader{t}", 0)
        for g in ("a", "b"):
            for p in ("p", "q"):
                store.create_stream(f"__backing/{g}/{p}")
        snap = metrics.store_snapshot(RowsOnly(store))  # type: ignore[arg-type]
    m = _samples(_text(snap))
    assert sorted(k for k in m if k.startswith("dataspace_stream_entries")) == [
        "dataspace_stream_entries{stream=s0}", "dataspace_stream_entries{stream=s1}",
        "dataspace_stream_entries{stream=s2}"]
    assert m["dataspace_streams_unlisted"] == 2
    assert len([k for k in m if k.startswith("dataspace_tailer_lag_entries")]) == 2
    assert m["dataspace_tailers_unlisted"] == 10 - 2
    assert [k for k in m if k.startswith("dataspace_graph_lag")] == [
        "dataspace_graph_lag_entries{graph=a}"]
    assert len([k for k in m if k.startswith("dataspace_processor_lag")]) == 1
    assert m["dataspace_graphs"] == 2


class Stuck:
    """A store whose reads hang until released, or fail."""

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.fail = fail
        self.calls = 0

    def streams(self, include_internal: bool = False, with_damaged: bool = False) -> list[Any]:
        self.calls += 1
        if self.fail:
            raise StoreError("the disk is on fire")
        self.release.wait(30)
        return []

    def lock_holder(self, name: str) -> None:
        return None

    def close(self) -> None:
        self.release.set()


@async_test
async def test_a_store_that_fails_or_hangs_leaves_the_rest_of_the_scrape(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "STORE_TIMEOUT", 0.3)
    for store in (Stuck(fail=True), Stuck()):
        async with running_server(tmp_path) as server:
            http = await start_http("127.0.0.1", 0, store=store, publish=(),  # type: ignore[arg-type]
                                    server=server)
            try:
                async with aiohttp.ClientSession() as session:
                    a = Api(server, http, session, store, [])
                    m = await a.metrics()
                    assert m["dataspace_store_up"] == 0
                    assert "dataspace_connections" in m  # the server's own figures are there
                    assert not any(k.startswith("dataspace_stream_") for k in m)
                    m = await a.metrics()
                    assert m["dataspace_store_up"] == 0
                    # A hung read is not started again while it hangs.
                    assert store.calls == (2 if store.fail else 1)
            finally:
                store.release.set()
                await http.close()
