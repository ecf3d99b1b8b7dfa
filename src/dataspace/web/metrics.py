"""``GET /metrics``: the server's figures in the Prometheus text format.

Built on ``prometheus-client`` with a registry of the HTTP port's own (never the
process-wide default one: two servers in one process do not mix).  Nothing is counted
here: the broker keeps plain integer counters where the work happens (connections,
relays, recorders), and a collector reads them at scrape time, so the hot paths pay an
integer increment and no more.

Naming follows Prometheus: a ``dataspace_`` prefix, base units (seconds, bytes), counters
ending in ``_total``; labels only where their values are bounded by the configuration
(``dataspace``, a link's address, a recorder's stream, an error's kind from a fixed
set) or by a cap of this module: the groups of observers and their members
(:data:`MAX_GROUPS`, :data:`MAX_GROUP_MEMBERS`), the store's streams, their named
tailers and consumer groups and the pipelines' graphs and processors (:data:`MAX_STREAMS`,
:data:`MAX_TAILERS`, :data:`MAX_CONSUMER_GROUPS`, :data:`MAX_GRAPHS`, :data:`MAX_PROCESSORS`),
read at each scrape from the rows of streams, tailers and groups and the pending counts
(no entry is read), on the port's store threads, within
:data:`STORE_TIMEOUT`.  The whole list, with what each means, is in docs/operations.md.

Access: the root capability (or ``--http-open``); see :mod:`dataspace.web.auth`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
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
from ..streams.base import Store, StreamInfo
from ..streams.recorder import COMMIT_BUCKETS
from .auth import Access
from .broker import group_rows
from .context import WebContext, guarded
from .dataspaces import WATCHES
from .scry import SCRY

__all__ = ["MAX_CONSUMER_GROUPS", "MAX_GRAPHS", "MAX_GROUPS", "MAX_GROUP_MEMBERS",
           "MAX_PROCESSORS", "MAX_STREAMS",
           "MAX_TAILERS", "METRICS",
           "ServerCollector", "StoreCollector", "StoreSnapshot", "make_registry", "setup",
           "store_snapshot"]

log = logging.getLogger(__name__)

MAX_STREAMS = 100
"""Streams with series of their own (``stream`` label), the first by name; the store's
own ``__...`` streams never have (their graphs do)."""
MAX_TAILERS = 500
"""Named tailers with series of their own (``stream``, ``tailer``), of the listed streams."""
MAX_CONSUMER_GROUPS = 500
"""Consumer groups with series of their own (``stream``, ``group``), of the listed streams."""
MAX_GRAPHS = 50
"""Pipeline graphs with series of their own (``graph``), the first by name."""
MAX_PROCESSORS = 500
"""Processors with series of their own (``graph``, ``processor``), of the listed graphs."""
MAX_GROUPS = 100
"""Groups of observers with series of their own (``dataspace``, ``group``, ``pattern``),
the first by dataspace, name and pattern."""
MAX_GROUP_MEMBERS = 500
"""Group members with series of their own (``member``: ``CLIENT#CONNECTION``), of the
listed groups, in the order they joined."""
MAX_LABEL = 100
"""Longest label value from a client (a group's name or pattern, a client's name): cut."""
STORE_TIMEOUT = 5.0
"""Seconds a scrape waits for the store; past it the store's series are left out and
``dataspace_store_up`` is 0."""
BACKING = "__backing/"
"""The prefix of a processor's backing stream: ``__backing/GRAPH/PROCESSOR``."""


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
            yield from self._groups(server)
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

    def _groups(self, server: Any) -> Iterator[Metric]:
        rows = group_rows(server)
        rows.sort(key=lambda r: (r["dataspace"], r["group"], r["pattern"]))
        listed = rows[:MAX_GROUPS]
        yield _gauge("dataspace_groups", "Groups of observers that share work (one per "
                     "group name and pattern with members).", len(rows))
        yield _gauge("dataspace_groups_unlisted", f"Groups without series of their own "
                     f"(beyond the first {MAX_GROUPS}).", len(rows) - len(listed))
        g = ["dataspace", "group", "pattern"]
        per_group = {  # a group row's field: its series
            "member_count": _gauge("dataspace_group_members", "Members of a group now.",
                                   labels=g),
            "messages": _counter("dataspace_group_messages_total",
                                 "Messages given to a member of a group (one member each).",
                                 labels=g),
            "dropped": _counter("dataspace_group_messages_dropped_total",
                                "Messages that found no live member of a group.", labels=g),
            "jobs": _gauge("dataspace_group_jobs",
                           "Jobs (distinct matching assertions) of a group now.", labels=g),
            "pending": _gauge("dataspace_group_jobs_waiting",
                              "Jobs of a group assigned to no member (none could take them).",
                              labels=g),
            "reassigned": _counter("dataspace_group_reassignments_total",
                                   "Jobs of a group assigned again (their member left or died, "
                                   "or a rebalance moved them).", labels=g),
        }
        m = [*g, "member"]
        m_given = _counter("dataspace_group_member_messages_total",
                           "Messages given to one member of a group.", labels=m)
        m_jobs = _gauge("dataspace_group_member_jobs",
                        "Jobs assigned to one member of a group now.", labels=m)
        shown = 0
        unlisted = 0
        for r in listed:
            lv = [r["dataspace"], _label(r["group"]), _label(r["pattern"])]
            for key, fam in per_group.items():
                fam.add_metric(lv, r[key])
            for i, mem in enumerate(r["members"]):
                if shown >= MAX_GROUP_MEMBERS:
                    unlisted += 1
                    continue
                shown += 1
                conn = mem.get("connection")
                who = (f"{_label(str(mem.get('client')))}#{conn}" if conn is not None
                       else f"{mem.get('client')}#{i}")
                m_given.add_metric([*lv, who], mem["messages"])
                m_jobs.add_metric([*lv, who], mem["jobs"])
        yield from (*per_group.values(), m_given, m_jobs)
        yield _gauge("dataspace_group_members_unlisted",
                     f"Group members without series of their own (beyond {MAX_GROUP_MEMBERS}, "
                     "or of unlisted groups).",
                     unlisted + sum(r["member_count"] for r in rows[MAX_GROUPS:]))

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


# ------------------------------------------------------------------------------------
# The stream store: streams, tailers, graphs


@dataclass
class StoreSnapshot:
    """What one scrape read of the store (on a store thread): every stream's row with its
    tailers, and who runs each graph (None: no engine holds its lock)."""

    streams: list[StreamInfo] = field(default_factory=list)
    holders: dict[str, str | None] = field(default_factory=dict)
    error: str | None = None
    """Why the store could not be read (then nothing else is set)."""
    seconds: float = 0.0


def _graphs(infos: list[StreamInfo]) -> dict[str, list[tuple[str, StreamInfo]]]:
    """The graphs found in the store, by name: each with its processors' names and
    backing streams."""
    graphs: dict[str, list[tuple[str, StreamInfo]]] = {}
    for i in infos:
        if i.name.startswith(BACKING):
            graph, sep, proc = i.name[len(BACKING):].partition("/")
            if sep and graph and proc:
                graphs.setdefault(graph, []).append((proc, i))
    return graphs


def store_snapshot(store: Store) -> StoreSnapshot:
    """Read what the store's metrics need (store threads): the stream and tailer rows and
    the graphs' locks; never an entry."""
    t0 = time.perf_counter()
    infos = store.streams(include_internal=True, with_damaged=True)
    holder = getattr(store, "lock_holder", None)
    holders: dict[str, str | None] = {}
    for graph in sorted(_graphs(infos))[:MAX_GRAPHS]:
        holders[graph] = holder(f"graph:{graph}") if callable(holder) else None
    return StoreSnapshot(infos, holders, seconds=time.perf_counter() - t0)


class StoreCollector(Collector):
    """The metrics of one :class:`StoreSnapshot` (a collector made per scrape)."""

    def __init__(self, snap: StoreSnapshot | None) -> None:
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        snap = self.snap
        if snap is None:  # the server has no store
            return
        yield _gauge("dataspace_store_up", "1 when this scrape could read the stream store "
                     "(its streams' series are then present).", 0 if snap.error else 1)
        if snap.error is not None:
            return
        yield _gauge("dataspace_store_read_seconds",
                     "Time this scrape took to read the store's stream and tailer rows.",
                     snap.seconds)
        yield from self._streams(snap)
        yield from self._graphs(snap)

    def _streams(self, snap: StoreSnapshot) -> Iterator[Metric]:
        user = [i for i in snap.streams if not i.internal]
        count = _gauge("dataspace_streams", "Streams in the store: the users' and the store's "
                       "own (__..., e.g. processors' backing streams).", labels=["kind"])
        count.add_metric(["user"], len(user))
        count.add_metric(["internal"], len(snap.streams) - len(user))
        yield count
        listed = user[:MAX_STREAMS]
        yield _gauge("dataspace_streams_unlisted",
                     f"Users' streams without series of their own (beyond the first "
                     f"{MAX_STREAMS} by name).", len(user) - len(listed))
        s = ["stream"]
        entries = _gauge("dataspace_stream_entries", "Entries a stream holds now (its length).",
                         labels=s)
        last = _gauge("dataspace_stream_last_index",
                      "Index of the last entry appended to a stream (absent before the first).",
                      labels=s)
        first = _gauge("dataspace_stream_first_index",
                       "Index of the oldest entry a stream still holds (absent when empty).",
                       labels=s)
        when = _gauge("dataspace_stream_last_append_time_seconds",
                      "When the last entry held was appended (seconds since the epoch).",
                      labels=s)
        broken = _gauge("dataspace_stream_damaged",
                        "1 for a stream whose bookkeeping is damaged (its other series are "
                        "absent): `dataspace stream info STREAM --check` says what.", labels=s)
        t = ["stream", "tailer"]
        position = _gauge("dataspace_tailer_position",
                          "The next index a named tailer reads from its stream.", labels=t)
        lag = _gauge("dataspace_tailer_lag_entries",
                     "Entries appended to a stream that a named tailer has not read yet.",
                     labels=t)
        gl = ["stream", "group"]
        gpos = _gauge("dataspace_consumer_group_position",
                      "The next index a consumer group delivers from its stream.", labels=gl)
        glag = _gauge("dataspace_consumer_group_lag_entries",
                      "Entries of its stream a consumer group has not been delivered yet.",
                      labels=gl)
        gpending = _gauge("dataspace_consumer_group_pending_entries",
                          "Entries delivered to a consumer group's consumers and not "
                          "acknowledged yet.", labels=gl)
        gold = _gauge("dataspace_consumer_group_oldest_pending_seconds",
                      "How long the oldest pending entry of a consumer group has waited since "
                      "it was delivered (absent when none is pending).", labels=gl)
        gconsumers = _gauge("dataspace_consumer_group_consumers",
                            "Consumers of a consumer group with entries pending.", labels=gl)
        groups = 0
        groups_unlisted = 0
        now = time.time()
        tailers = 0
        unlisted = 0
        for i in listed:
            if i.damaged is not None:
                broken.add_metric([i.name], 1)
                continue
            for g in i.groups:
                if groups >= MAX_CONSUMER_GROUPS:
                    groups_unlisted += 1
                    continue
                groups += 1
                gpos.add_metric([i.name, g.name], g.next)
                glag.add_metric([i.name, g.name], g.lag)
                gpending.add_metric([i.name, g.name], g.pending)
                gconsumers.add_metric([i.name, g.name], len(g.consumers))
                if g.oldest_ns is not None:
                    gold.add_metric([i.name, g.name], max(0.0, now - g.oldest_ns / 1e9))
            entries.add_metric([i.name], i.count)
            if i.next > 0:
                last.add_metric([i.name], i.next - 1)
            if i.first is not None:
                first.add_metric([i.name], i.first)
            if i.last_time_ns is not None:
                when.add_metric([i.name], i.last_time_ns / 1e9)
            for tl in i.tailers:
                if tailers >= MAX_TAILERS:
                    unlisted += 1
                    continue
                tailers += 1
                position.add_metric([i.name, tl.name], tl.position)
                lag.add_metric([i.name, tl.name], max(0, i.next - tl.position))
        yield from (entries, last, first, when, broken, position, lag)
        yield _gauge("dataspace_streams_damaged", "Streams whose bookkeeping is damaged (the "
                     "store's own included).", sum(i.damaged is not None for i in snap.streams))
        yield from (gpos, glag, gpending, gold, gconsumers)
        yield _gauge("dataspace_consumer_groups_unlisted",
                     f"Consumer groups without series of their own (beyond "
                     f"{MAX_CONSUMER_GROUPS}, or of unlisted streams).",
                     groups_unlisted + sum(len(i.groups) for i in user[MAX_STREAMS:]))
        yield _gauge("dataspace_tailers_unlisted",
                     f"Named tailers without series of their own (beyond {MAX_TAILERS}, or "
                     "on unlisted streams).",
                     unlisted + sum(len(i.tailers) for i in user[MAX_STREAMS:]))

    def _graphs(self, snap: StoreSnapshot) -> Iterator[Metric]:
        graphs = _graphs(snap.streams)
        # A processor reads its inputs with tailers named after it (GRAPH/PROCESSOR).
        reads: dict[str, list[tuple[StreamInfo, int]]] = {}
        for i in snap.streams:
            for tl in i.tailers:
                reads.setdefault(tl.name, []).append((i, tl.position))
        g = ["graph"]
        running = _gauge("dataspace_graph_running",
                         "1 while an engine runs the graph (holds its lock), else 0.", labels=g)
        glag = _gauge("dataspace_graph_lag_entries",
                      "Entries of its input streams the graph's processors have not read yet.",
                      labels=g)
        progress = _gauge("dataspace_graph_last_progress_seconds",
                          "When a processor of the graph last recorded a step (seconds since "
                          "the epoch).", labels=g)
        procs = _gauge("dataspace_graph_processors", "Processors of the graph.", labels=g)
        p = ["graph", "processor"]
        plag = _gauge("dataspace_processor_lag_entries",
                      "Entries of its input streams a processor has not read yet.", labels=p)
        steps = _gauge("dataspace_processor_steps",
                       "Records in a processor's backing stream (snapshots and attempts).",
                       labels=p)
        names = sorted(graphs)
        shown = 0
        for graph in names[:MAX_GRAPHS]:
            total = 0
            newest: int | None = None
            members = sorted(graphs[graph], key=lambda x: x[0])
            for proc, backing in members:
                proc_lag = sum(max(0, si.next - pos) for si, pos in reads.get(f"{graph}/{proc}", ()))
                total += proc_lag
                if backing.last_time_ns is not None:
                    newest = max(newest or 0, backing.last_time_ns)
                if shown < MAX_PROCESSORS:
                    shown += 1
                    plag.add_metric([graph, proc], proc_lag)
                    steps.add_metric([graph, proc], backing.count)
            running.add_metric([graph], 1 if snap.holders.get(graph) else 0)
            glag.add_metric([graph], total)
            procs.add_metric([graph], len(members))
            if newest is not None:
                progress.add_metric([graph], newest / 1e9)
        yield from (running, glag, progress, procs, plag, steps)
        yield _gauge("dataspace_graphs", "Pipeline graphs found in the store (by their "
                     "processors' backing streams).", len(names))


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

    reading: list[asyncio.Future[StoreSnapshot]] = []  # a store read still under way

    async def read_store() -> StoreSnapshot | None:
        store = ctx.store
        if store is None:
            return None
        if reading and not reading[0].done():
            # The last scrape's read has not come back (a stuck store): no second one.
            return StoreSnapshot(error="the last scrape's read of the store has not finished")
        fut = asyncio.ensure_future(ctx.run_store(store_snapshot, store))
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
        reading[:] = [fut]
        try:
            return await asyncio.wait_for(asyncio.shield(fut), STORE_TIMEOUT)
        except TimeoutError:
            log.warning("/metrics: the stream store did not answer within %g s", STORE_TIMEOUT)
            return StoreSnapshot(error="timeout")
        except Exception as e:
            log.warning("/metrics: cannot read the stream store: %s", e)
            return StoreSnapshot(error=str(e))

    async def metrics(request: web.Request, access: Access) -> web.StreamResponse:
        access.require_admin("/metrics")
        t0 = time.perf_counter()
        snap = await read_store()
        body = generate_latest(reg) + generate_latest(StoreCollector(snap))  # type: ignore[arg-type]
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
        for k, fam in (*gauges.items(), *cfams.items()):
            if isinstance(row.get(k), int):
                fam.add_metric(lv, row[k])
    yield up
    yield since
    yield from gauges.values()
    yield from cfams.values()


def _label(text: str) -> str:
    """A label value from a client, at most :data:`MAX_LABEL` characters."""
    return text if len(text) <= MAX_LABEL else text[:MAX_LABEL - 1] + "…"
