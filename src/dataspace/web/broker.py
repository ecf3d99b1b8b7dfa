"""The server's own state over HTTP: health, summary, connections, links.

Routes (JSON; every ``/api/...`` route needs a token, see :mod:`dataspace.web.auth`):

``GET /healthz``
    200 ``{"status": "ready"}`` while the server serves; 503 ``{"status": "unavailable",
    "reasons": [...]}`` when it does not (not started, shutting down, a recorder
    stopped because the store failed, the store does not answer).  No token needed.
``GET /api/server``
    The summary (:func:`server_summary`).
``GET /api/connections``
    One row per connection (:func:`connection_row`); the administrator only (others get
    the count).
``GET /api/links``
    The links' status rows (``Server.link_status()``); the administrator only.
``GET /api/cluster``
    The cluster's members and routes (``Server.cluster_status()``, what ``dataspace
    cluster status`` shows), or ``{"cluster": null}`` for a server in no cluster; the
    administrator only.

The groups of observers that share work (``<ObserveGroup ...>``) are in the summary
(``groups``: each group's figures) and, member by member, at ``GET /api/groups``
(:mod:`dataspace.web.dataspaces`); :func:`group_rows` makes both.

See docs/operations.md for every field.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from aiohttp import web

from .. import __version__
from .._build import build_info
from ..groups import Groups
from .auth import Access, ApiError
from .context import WebContext, guarded, json_response

__all__ = ["MAX_SUMMARY_GROUPS", "connection_row", "group_rows", "health", "rss_bytes",
           "server_summary", "setup"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """This process's resident memory in bytes (None where it cannot be read)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        try:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        except (ImportError, OSError):  # pragma: no cover - not on Linux
            return None


def _limits(server: Any) -> dict[str, Any]:
    cfg = server.config
    rl, fl = server.relay_limits, server.flow
    return {
        "max_connections": cfg.max_connections,
        "max_connections_per_address": cfg.per_address_limit(),
        "connect_rate": cfg.connect_rate,
        "max_total_assertions": cfg.max_total_assertions,
        "max_memory": server.memory.limit if server.memory is not None else 0,
        "max_buffered": cfg.buffered_limit(),
        "max_turn_events": cfg.max_turn_events,
        "idle_timeout": cfg.idle_timeout,
        "max_packet_size": rl.max_packet_size,
        "max_assertions": rl.max_assertions,
        "max_references": rl.max_imports,
        "max_observers": rl.max_observers,
        "max_matches": rl.max_outbound_assertions,
        "max_debt": fl.max_debt,
        "max_send_queue": fl.max_send_queue,
        "send_timeout": fl.send_timeout,
        "handshake_timeout": fl.handshake_timeout,
        "work_rate": fl.work_rate,
        "throttle_limit": fl.throttle_limit,
        "keepalive": fl.keepalive,
        "ws_ping_interval": fl.ws_ping_interval,
    }


MAX_SUMMARY_GROUPS = 50
"""Groups listed in the summary (the busiest first); ``groups_total`` counts them all."""


def _member_describer(server: Any, admin: bool) -> Any:
    """A function giving a group member's connection fields (``connection``: its id,
    ``client``: the name its client gave or its address, ``peer``), from its observer:
    a peer's reference, found by its relay; ``in process`` for code in the server."""
    by_relay = {id(c.relay): c for c in server.connections if c.relay is not None}

    def describe(observer: Any) -> dict[str, Any]:
        conn = by_relay.get(id(getattr(observer, "relay", None)))
        if conn is None:
            return {"connection": None, "client": "in process" if getattr(
                observer, "relay", None) is None else "gone", "peer": None}
        if not admin:
            return {"connection": conn.id, "client": None, "peer": None}
        return {"connection": conn.id, "client": conn.client_name or conn.name,
                "peer": conn.name}

    return describe


def group_rows(server: Any, dataspaces: list[str] | None = None, members: bool = True,
               admin: bool = True) -> list[dict[str, Any]]:
    """Every group of observers of the server's dataspaces (those named, or all): its
    dataspace, name, pattern, member count and figures (messages given and dropped,
    jobs, jobs waiting, reassignments); with ``members``, each member's (its
    connection, messages given to it, jobs it holds).  Without ``admin``, the members'
    connections are given by id only."""
    out: list[dict[str, Any]] = []
    describe = _member_describer(server, admin) if members else None
    for name, ds in server.dataspaces.items():
        if dataspaces is not None and name not in dataspaces:
            continue
        g = Groups.find(ds)
        if g is None:
            continue
        for row in g.stats(describe):
            row["dataspace"] = name
            ms = row["members"]
            row["member_count"] = len(ms)
            if members:
                for m in ms:
                    m.pop("observer", None)  # (the connection says who it is)
            else:
                del row["members"]
            out.append(row)
    return out


def _recorder_row(r: Any) -> dict[str, Any]:
    return {
        "stream": r.stream,
        "pattern": str(r.pattern),
        "recorded": r.recorded,
        "dropped": r.dropped,
        "queued": r.queued,
        "commits": r.commits,
        "commit_seconds": round(r.commit_seconds, 6),
        "failed": None if r.error is None else str(r.error),
    }


def server_summary(ctx: WebContext, access: Access) -> dict[str, Any]:
    """The server summary (``GET /api/server``) as ``access`` may see it: the
    administrator sees every dataspace, the listeners, links, recorders and store; a
    dataspace's token its own dataspace and the server-wide counters."""
    server = ctx.server
    now = time.time()
    started = server.started_at
    totals = server.totals()
    resolves = sum(server.resolve_requests(c)[0] for c in server.connections)
    dataspaces = {
        name: {"assertions": len(ds.index.bag), "observers": ds.observer_count()}
        for name, ds in server.dataspaces.items()
        if access.admin or name == access.dataspace
    }
    out: dict[str, Any] = {
        "version": __version__,
        "core": build_info(),  # compiled or pure-Python core, and why
        "server_id": server.server_id,
        "scope": access.scope,
        "now": now,
        "started": started,
        "uptime": None if started is None else now - started,
        "connections": len(server.connections),
        "connections_accepted": server.accepted,
        "connections_refused": server.refused,
        "assertions": max(0, server.quota.assertions - resolves),
        "resolves": resolves,
        "dataspaces": dataspaces,
        "observers": sum(d["observers"] for d in dataspaces.values()),
        "turns": totals["turns_in"],
        "messages_in": totals["messages_in"],
        "messages_out": totals["messages_out"],
        "bytes_in": totals["bytes_in"],
        "bytes_out": totals["bytes_out"],
        "errors": dict(server.errors),
        "slow_consumers_closed": server.errors["slow_consumer"],
        "buffered": server.hub.buffered if server.hub is not None else 0,
        "memory_rss": rss_bytes(),
        "memory_budget": server.memory_stats(),
        "limits": _limits(server),
    }
    groups = group_rows(server, list(dataspaces), members=False)
    groups.sort(key=lambda g: (-g["messages"] - g["jobs"], g["dataspace"], g["group"]))
    out["groups_total"] = len(groups)
    out["groups"] = groups[:MAX_SUMMARY_GROUPS]
    if access.admin:
        links = server.link_status()
        gate = server.sync_gate
        out.update({
            "pid": os.getpid(),
            "listeners": [str(a) for a in server.addresses],
            "data_dir": str(server.data_dir) if server.data_dir is not None else None,
            "store": ctx.store.display if ctx.store is not None else None,
            "published": list(ctx.publish),
            "recorders": [_recorder_row(r) for r in ctx.recorders],
            "links": {"count": len(links),
                      "connected": sum(1 for r in links if r.get("connected"))},
            "cluster": _cluster_summary(server),
            "syncs_held": gate.held_total if gate is not None else 0,
            "http_open": ctx.open_access,
        })
    return out


def _cluster_summary(server: Any) -> dict[str, Any] | None:
    st = server.cluster_status() if hasattr(server, "cluster_status") else None
    if st is None:
        return None
    return {"name": st["cluster"], "address": st["address"], "members_up": st["size"],
            "members_known": 1 + len(st["members"]),
            "routes_up": sum(1 for r in st["routes"] if r.get("connected"))}


def _transport(conn: Any) -> tuple[str, str | None]:
    """How ``conn`` is carried (``tcp``, ``tls``, ``unix``, ``ws``, ``wss``) and its TLS
    version (None without TLS)."""
    ws = type(conn).__name__.startswith("WebSocket")
    if not ws and conn.name.startswith("unix"):
        return "unix", None
    t = getattr(getattr(conn, "ws", None), "transport", None) if ws else \
        getattr(conn, "transport", None)
    tls = t.get_extra_info("ssl_object") if t is not None else None
    if tls is None:
        return ("ws" if ws else "tcp"), None
    try:
        version = tls.version()
    except (AttributeError, ValueError):  # pragma: no cover - a closing socket
        version = None
    return ("wss" if ws else "tls"), version


def connection_row(server: Any, conn: Any, now: float | None = None) -> dict[str, Any]:
    """One connection as ``GET /api/connections`` shows it."""
    now = time.time() if now is None else now
    relay = conn.relay
    st = relay.stats() if relay is not None else {}
    resolves, answers = server.resolve_requests(conn)  # the protocol's, not the user's
    transport, tls_version = _transport(conn)
    assertions_in = max(0, st.get("assertions_in", 0) - resolves)
    observers = relay.observers if relay is not None else 0
    return {
        "id": conn.id,
        "peer": conn.name,
        "name": conn.client_name,
        "address": conn.peer_host,
        "transport": transport,
        "tls": transport in ("tls", "wss"),
        "tls_version": tls_version,
        "since": conn.since,
        "age": now - conn.since,
        "dataspaces": [{"name": n, "attenuated": a} for n, a in server.resolved.get(conn, ())],
        "assertions_in": assertions_in,
        "assertions": max(0, assertions_in - observers),
        "observers": observers,
        "assertions_out": max(0, st.get("assertions_out", 0) - answers),
        "resolves": resolves,
        "references": st.get("imports", 0),
        "turns": relay.turns_in if relay is not None else 0,
        "messages_in": relay.messages_in if relay is not None else 0,
        "messages_out": relay.messages_out if relay is not None else 0,
        "events_out": relay.events_out if relay is not None else 0,
        "bytes_in": conn.bytes_in,
        "bytes_out": conn.bytes_out,
        "pending_output": conn.pending_output,
        "debt": conn.account.debt,
        "throttled_seconds": round(conn.throttled_total(), 3),
        "held": list(conn.held_reasons),
        "idle": max(0.0, time.monotonic() - conn.last_input),
    }


async def health(ctx: WebContext) -> tuple[bool, list[str]]:
    """Whether the server is ready, and if not why."""
    server = ctx.server
    reasons: list[str] = []
    if server is None or server.started_at is None:
        reasons.append("the server has not started")
    elif server.stopping:
        reasons.append("the server is shutting down")
    elif not server.addresses:
        reasons.append("the server listens nowhere")
    for r in ctx.recorders:
        if r.error is not None:
            reasons.append(f"recorder {r.stream} stopped: the store failed ({r.error})")
    if ctx.store is not None:
        try:
            async with asyncio.timeout(5.0):
                await ctx.run_store(ctx.store.next_indices)
        except TimeoutError:
            reasons.append("the stream store does not answer (5 s)")
        except Exception as e:
            reasons.append(f"the stream store failed: {e}")
    return not reasons, reasons


def setup(app: web.Application, ctx: WebContext) -> None:
    """Add ``/healthz``, ``/api/server``, ``/api/connections`` and ``/api/links``."""

    async def healthz(request: web.Request) -> web.StreamResponse:
        ok, reasons = await health(ctx)
        if ok:
            return json_response({"status": "ready"})
        return json_response({"status": "unavailable", "reasons": reasons,
                              "error": "; ".join(reasons)}, 503)

    async def api_server(request: web.Request, access: Access) -> web.StreamResponse:
        _need_server(ctx)
        return json_response(server_summary(ctx, access))

    async def api_connections(request: web.Request, access: Access) -> web.StreamResponse:
        server = _need_server(ctx)
        if not access.admin:
            return json_response({"scope": access.scope, "count": len(server.connections),
                                  "connections": [],
                                  "note": "connection details need the root capability"})
        now = time.time()
        rows = [connection_row(server, c, now) for c in server.connections]
        rows.sort(key=lambda r: r["id"])
        return json_response({"scope": access.scope, "count": len(rows), "connections": rows})

    async def api_links(request: web.Request, access: Access) -> web.StreamResponse:
        server = _need_server(ctx)
        access.require_admin("the links")
        return json_response({"time": time.time(), "links": server.link_status()})

    async def api_cluster(request: web.Request, access: Access) -> web.StreamResponse:
        server = _need_server(ctx)
        access.require_admin("the cluster")
        st = server.cluster_status() if hasattr(server, "cluster_status") else None
        return json_response(st if st is not None else {"time": time.time(), "cluster": None})

    r = app.router
    r.add_get("/healthz", healthz, allow_head=False)
    r.add_get("/api/server", guarded(ctx, api_server), allow_head=False)
    r.add_get("/api/connections", guarded(ctx, api_connections), allow_head=False)
    r.add_get("/api/links", guarded(ctx, api_links), allow_head=False)
    r.add_get("/api/cluster", guarded(ctx, api_cluster), allow_head=False)


def _need_server(ctx: WebContext) -> Any:
    if ctx.server is None:
        raise ApiError(404, "no broker behind this HTTP port")
    return ctx.server

