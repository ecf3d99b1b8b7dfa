"""``GET /metrics``: the server's figures in the Prometheus text format.

Built on ``prometheus-client`` with a registry of the HTTP port's own (never the
process-wide default one: two servers in one process do not mix).  Nothing is counted
here: the broker keeps plain integer counters where the work happens (connections,
relays, recorders), and a collector reads them at scrape time, so the hot paths pay an
integer increment and no more.

Naming follows Prometheus: a ``dataspace_`` prefix, base units (seconds, bytes), counters
ending in ``_total``; labels only where their values are bounded by the configuration
(``dataspace``, a link's address, a recorder's stream, an error's kind from a fixed
set).  The whole list, with what each means, is in docs/operations.md.

Access: the root capability (or ``--http-open``); see :mod:`dataspace.web.auth`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .. import __version__
from ..broker.server import ERROR_KINDS
from ..streams.recorder import COMMIT_BUCKETS
from .auth import Access
from .context import WebContext, guarded
from .dataspaces import WATCHES
from .scry import SCRY

__all__ = ["METRICS", "ServerCollector", "make_registry", "setup"]


def _counter(name: str, doc: str, value: float | None = None,
             labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value, labels=labels)


def _gauge(name: str, doc: str, value: float | None = None,
           labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value, labels=labels)


class ServerCollector(Collector):
    """Reads a broker's counters (and its recorders' and HTTP port's) at each scrape."""

    def __init__(self, ctx: WebContext, app: web.Application | None = None) -> None:
        self.ctx = ctx
        self.app = app

    def collect(self) -> Iterator[Metric]:
        server = self.ctx.server
        if server is not None:
            yield from self._server(server)
            yield from self._links(server)
            yield from self._cluster(server)
        yield from self._recorders()
        yield from self._http()

    def _server(self, server: Any) -> Iterator[Metric]:
        info = _gauge("dataspace_server_info", "The server's version and id (value 1).",
                      labels=["version", "server_id"])
        info.add_metric([__version__, server.server_id], 1)
        yield info
        if server.started_at is not None:
            yield _gauge("dataspace_start_time_seconds",
                         "When the server started (seconds since the epoch).", server.started_at)
        yield _gauge("dataspace_connections", "Connections open now.", len(server.connections))
        yield _counter("dataspace_connections_accepted_total",
                       "Connections accepted since the start.", server.accepted)
        yield _counter("dataspace_connections_refused_total",
                       "Connections refused (limits, connect rate, shutting down).",
                       server.refused)
        errors = _counter("dataspace_connection_errors_total",
                          "Connections closed for an error, by kind.", labels=["kind"])
        for kind in ERROR_KINDS:
            errors.add_metric([kind], server.errors[kind])
        yield errors
        yield _counter("dataspace_slow_consumers_closed_total",
                       "Connections closed because they did not take what was sent to them.",
                       server.errors["slow_consumer"])
        t = server.totals()
        yield _counter("dataspace_turns_total",
                       "Turns (packets of events) received from peers and applied.",
                       t["turns_in"])
        yield _counter("dataspace_messages_received_total",
                       "Messages peers sent to the server.", t["messages_in"])
        yield _counter("dataspace_messages_sent_total",
                       "Messages the server delivered to peers' observers.", t["messages_out"])
        yield _counter("dataspace_received_bytes_total",
                       "Bytes received from peers.", t["bytes_in"])
        yield _counter("dataspace_sent_bytes_total", "Bytes sent to peers.", t["bytes_out"])
        yield _gauge("dataspace_assertions",
                     "Assertions peers hold now (the quota of max-total-assertions).",
                     server.quota.assertions)
        yield _gauge("dataspace_buffered_bytes",
                     "Bytes queued to all connections beyond their sockets.",
                     server.hub.buffered if server.hub is not None else 0)
        mem = server.memory_stats()
        yield _gauge("dataspace_memory_budget_bytes",
                     "The memory budget for what clients make the server hold (max-memory; "
                     "0 = off).", mem["limit"])
        yield _gauge("dataspace_memory_held_bytes",
                     "Bytes held for clients, as the memory budget counts them.", mem["used"])
        yield _counter("dataspace_memory_refusals_total",
                       "Assertions refused because the memory budget was full.", mem["refused"])
        gate = server.sync_gate
        yield _counter("dataspace_syncs_held_total",
                       "Syncs whose answer waited until what came before was durable.",
                       gate.held_total if gate is not None else 0)
        distinct = _gauge("dataspace_dataspace_assertions",
                          "Distinct values asserted in a dataspace now.", labels=["dataspace"])
        observers = _gauge("dataspace_observers", "Observers installed in a dataspace now.",
                           labels=["dataspace"])
        nodes = _gauge("dataspace_index_nodes", "Nodes of a dataspace's skeleton index.",
                       labels=["dataspace"])
        shapes = _gauge("dataspace_index_shapes",
                        "Pattern shapes in a dataspace's skeleton index.", labels=["dataspace"])
        groups = _gauge("dataspace_index_constant_groups",
                        "Constant groups (shape + constant paths) of a dataspace's index.",
                        labels=["dataspace"])
        handlers = _gauge("dataspace_index_handlers",
                          "Handlers (distinct pattern captures) of a dataspace's index.",
                          labels=["dataspace"])
        routed = _counter("dataspace_route_messages_total",
                          "Messages from peers routed on their encoded bytes.",
                          labels=["dataspace"])
        cache = _counter("dataspace_route_cache_total",
                         "The message router's match cache: hits, misses, evictions, "
                         "invalidations.", labels=["dataspace", "event"])
        entries = _gauge("dataspace_route_cache_entries",
                         "Entries in the message router's match cache now.",
                         labels=["dataspace"])
        for name, ds in server.dataspaces.items():
            st = ds.index.stats()
            distinct.add_metric([name], st["assertions"])
            observers.add_metric([name], ds.observer_count())
            nodes.add_metric([name], st["nodes"])
            shapes.add_metric([name], st["shapes"])
            groups.add_metric([name], st["groups"])
            handlers.add_metric([name], st["handlers"])
            router = ds.router
            if router is not None:
                rs = router.stats
                routed.add_metric([name], rs.routed)
                for event in ("hits", "misses", "evictions", "invalidations"):
                    cache.add_metric([name, event], getattr(rs, event))
                entries.add_metric([name], router.entries())
        yield from (distinct, observers, nodes, shapes, groups, handlers, routed, cache, entries)

    def _links(self, server: Any) -> Iterator[Metric]:
        rows = server.link_status()
        labels = ["link", "direction", "dataspace"]

        def values(row: dict[str, Any]) -> list[str]:
            name = row["link"]
            if row.get("direction") == "in" and row.get("peer_id"):
                name = f"peer:{row['peer_id']}"  # stable across the peer's reconnections
            return [str(name), str(row.get("direction", "")), str(row.get("dataspace", ""))]

        yield from _session_metrics("link", rows, labels, values)

    def _cluster(self, server: Any) -> Iterator[Metric]:
        st = server.cluster_status() if hasattr(server, "cluster_status") else None
        if st is None:
            return
        members = _gauge("dataspace_cluster_members", "Members of the cluster: up (this one "
                         "included) and known.", labels=["state"])
        members.add_metric(["up"], st["size"])
        members.add_metric(["known"], 1 + len(st["members"]))
        yield members
        yield _counter("dataspace_cluster_routes_established_total",
                       "Routes whose handshake completed.", value=st["established"])
        yield _counter("dataspace_cluster_route_requests_refused_total",
                       "Route requests refused (another cluster, malformed).",
                       value=st["refused"])
        yield from _session_metrics("route", st["routes"], ["peer", "direction"],
                                    lambda r: [str(r.get("peer_id")), str(r.get("direction"))])

    def _recorders(self) -> Iterator[Metric]:
        recs = self.ctx.recorders
        labels = ["stream"]
        recorded = _counter("dataspace_recorder_recorded_total",
                            "Values a recorder committed to its stream.", labels=labels)
        dropped = _counter("dataspace_recorder_dropped_total",
                           "Values a recorder dropped (queue full, store failed, too large).",
                           labels=labels)
        queued = _gauge("dataspace_recorder_queued", "Values waiting to be committed.",
                        labels=labels)
        failed = _gauge("dataspace_recorder_failed",
                        "1 when a recorder stopped because the store failed.", labels=labels)
        buckets = [0] * (len(COMMIT_BUCKETS) + 1)
        total_s = 0.0
        appends = 0
        for r in recs:
            lv = [r.stream]
            recorded.add_metric(lv, r.recorded)
            dropped.add_metric(lv, r.dropped)
            queued.add_metric(lv, r.queued)
            failed.add_metric(lv, 1 if r.error is not None else 0)
            for i, n in enumerate(r.commit_buckets):
                buckets[i] += n
            total_s += r.commit_seconds
            appends += r.recorded
        yield from (recorded, dropped, queued, failed)
        yield _counter("dataspace_store_appends_total",
                       "Entries the server's recorders appended to the store.", appends)
        cum = 0
        hb: list[tuple[str, float]] = []
        for bound, n in zip((*COMMIT_BUCKETS, float("inf")), buckets):
            cum += n
            hb.append(("+Inf" if bound == float("inf") else repr(bound), cum))
        yield HistogramMetricFamily("dataspace_store_commit_seconds",
                                    "Time the recorders' store commits took (fsync included).",
                                    buckets=hb, sum_value=total_s)

    def _http(self) -> Iterator[Metric]:
        app = self.app
        if app is None:
            return
        watches = app.get(WATCHES)
        if watches is not None:
            yield _gauge("dataspace_http_watches", "Live /api/watch event streams.",
                         len(watches.active))
        gw = app.get(SCRY)
        if gw is not None:
            st = gw.stats()
            yield _gauge("dataspace_scry_http_waiting",
                         "Scry long polls and event streams being served.", st["active"])
            yield _counter("dataspace_scry_http_entries_sent_total",
                           "Entries the scry gateway sent.", st.get("entries_sent", 0))


def make_registry(ctx: WebContext, app: web.Application | None = None) -> CollectorRegistry:
    """A registry of its own with the server's collector and the process's (memory,
    CPU, file descriptors as ``dataspace_process_...``)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ServerCollector(ctx, app))
    ProcessCollector(namespace="dataspace", registry=reg)
    return reg


METRICS = web.AppKey("dataspace.web.metrics", CollectorRegistry)


def setup(app: web.Application, ctx: WebContext) -> None:
    """Add ``GET /metrics``."""
    reg = make_registry(ctx, app)
    app[METRICS] = reg

    async def metrics(request: web.Request, access: Access) -> web.StreamResponse:
        access.require_admin("/metrics")
        t0 = time.perf_counter()
        body = generate_latest(reg)
        body += (b"# HELP dataspace_scrape_duration_seconds Time this scrape took.\n"
                 b"# TYPE dataspace_scrape_duration_seconds gauge\n"
                 b"dataspace_scrape_duration_seconds %.6f\n" % (time.perf_counter() - t0))
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST,
                                                "Cache-Control": "no-store"})

    app.router.add_get("/metrics", guarded(ctx, metrics), allow_head=False)


def _session_metrics(kind: str, rows: list[dict[str, Any]], labels: list[str],
                     values: Any) -> Iterator[Metric]:
    """The metrics of links' (``kind`` link) or routes' (``kind`` route) status rows."""
    up = _gauge(f"dataspace_{kind}_up", f"1 while a {kind} is connected.", labels=labels)
    since = _gauge(f"dataspace_{kind}_connected_since_seconds",
                   f"When the {kind}'s session began (seconds since the epoch).",
                   labels=labels)
    gauges = {
        "upstreamed": _gauge(f"dataspace_{kind}_upstreamed_prefixes",
                             "Prefixes of local interest subscribed at the peer.",
                             labels=labels),
        "peer_wants": _gauge(f"dataspace_{kind}_peer_prefixes",
                             "Prefixes the peer subscribed here.", labels=labels),
        "assertions_held_for_peer": _gauge(f"dataspace_{kind}_assertions_forwarded",
                                           "Assertions forwarded to the peer now.",
                                           labels=labels),
        "assertions_from_peer": _gauge(f"dataspace_{kind}_assertions_received",
                                       "Assertions the peer forwarded here now.",
                                       labels=labels),
    }
    counters = {
        "messages_forwarded": (f"dataspace_{kind}_messages_forwarded_total",
                               "Messages forwarded to the peer."),
        "messages_suppressed": (f"dataspace_{kind}_messages_suppressed_total",
                                "Messages the peer did not want (not forwarded)."),
        "messages_received": (f"dataspace_{kind}_messages_received_total",
                              "Messages the peer forwarded here."),
        "assertions_forwarded": (f"dataspace_{kind}_assertion_forwards_total",
                                 "Assertions forwarded to the peer (each time)."),
        "assertions_received": (f"dataspace_{kind}_assertion_receipts_total",
                                "Assertions the peer forwarded here (each time)."),
        "requests_sent": (f"dataspace_{kind}_requests_sent_total",
                          "Subscription requests sent to the peer."),
        "retransmissions": (f"dataspace_{kind}_retransmissions_total",
                            "Subscription requests sent again."),
        "bytes_in": (f"dataspace_{kind}_received_bytes_total",
                     f"Bytes received on the {kind}'s connection."),
        "bytes_out": (f"dataspace_{kind}_sent_bytes_total",
                      f"Bytes sent on the {kind}'s connection."),
    }
    cfams = {k: _counter(n, d, labels=labels) for k, (n, d) in counters.items()}
    for row in rows:
        lv = values(row)
        up.add_metric(lv, 1 if row.get("connected") else 0)
        if isinstance(row.get("since"), int | float):
            since.add_metric(lv, row["since"])
        for k, fam in gauges.items():
            if isinstance(row.get(k), int):
                fam.add_metric(lv, row[k])
        for k, fam in cfams.items():
            if isinstance(row.get(k), int):
                fam.add_metric(lv, row[k])
    yield up
    yield since
    yield from gauges.values()
    yield from cfams.values()

