"""The stream store over HTTP: streams, pipelines, a stream's entries with search.

Routes (JSON; the root capability only, see :mod:`dataspace.web.auth`; every store call
runs on the port's store threads):

``GET /api/streams`` (``?all=1``: the store's own ``__...`` streams too)
    Per stream: name, length, first and next index, retention, its tailers with their
    position and lag, and its consumer groups (:func:`group_row`: position, lag, pending
    entries, consumers); a stream whose bookkeeping is damaged is listed with the
    others, with ``damaged`` saying what is wrong (null for the sound ones).
``GET /api/pipelines``
    Per graph found in the store (backing streams ``__backing/GRAPH/PROCESSOR``): its
    processors with their input positions, lag and last step, and the graph's streams,
    as far as the backing records and the tailers tell them.
``GET /api/stream/NAME?from=N&limit=K&search=TEXT``
    Entries as Preserves text: from ``N`` onwards, or the last ``K`` (``before=M``: the
    ``K`` before ``M``); ``search`` keeps the entries whose text contains ``TEXT``
    (case-insensitive), scanning at most :data:`MAX_SCAN` entries per request and saying
    where to go on.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from ..streams.base import (
    Entry,
    GroupInfo,
    Store,
    StoreCorrupt,
    StoreError,
    StreamInfo,
    check_stream_name,
)
from ..values import Dictionary, Record, Symbol, decode
from .auth import Access, ApiError
from .context import WebContext, guarded, json_response
from .dataspaces import value_text

__all__ = ["MAX_SCAN", "group_row", "pipelines", "setup", "stream_row"]

BACKING = "__backing/"
MAX_SCAN = 100_000
"""Entries a search looks at in one request, at most."""
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
BACKING_WINDOW = 64
"""Recent backing records read per processor (its last step, its outputs)."""


def group_row(g: GroupInfo, now: float | None = None) -> dict[str, Any]:
    """A consumer group as ``GET /api/streams`` shows it: ``stream group ls --json``'s
    fields (:meth:`~dataspace.streams.groups.GroupInfo.as_json`)."""
    return g.as_json(now)


def stream_row(info: StreamInfo, published: bool = False) -> dict[str, Any]:
    """A stream as ``GET /api/streams`` shows it: ``damaged`` is null, or what is wrong
    with a damaged stream's bookkeeping (its other figures are then null)."""
    if info.damaged is not None:
        return {"name": info.name, "length": None, "first": None, "next": None,
                "created": None, "last_time": None, "max_count": None, "max_age": None,
                "internal": info.internal, "published": published, "tailers": [],
                "groups": [], "damaged": info.damaged}
    return {
        "name": info.name,
        "length": info.count,
        "first": info.first,
        "next": info.next,
        "created": info.created_ns / 1e9,
        "last_time": None if info.last_time_ns is None else info.last_time_ns / 1e9,
        "max_count": info.max_count,
        "max_age": info.max_age,
        "internal": info.internal,
        "published": published,
        "tailers": [t.as_json(info.next) for t in info.tailers],
        "groups": [group_row(g) for g in info.groups],
        "damaged": None,
    }


# ------------------------------------------------------------------------------------
# Pipelines: what the backing streams and the tailers say


def _record(e: Entry) -> tuple[str, list[Any]] | None:
    """A backing record's label and fields (the records of
    :mod:`dataspace.pipeline.exactly_once`), or None for anything else."""
    try:
        v = decode(e.data)
    except ValueError:
        return None
    if type(v) is not Record or type(v.label) is not Symbol:
        return None
    return v.label.name, list(v.fields)


def _ints(d: Any) -> dict[str, int]:
    if type(d) is not Dictionary:
        return {}
    return {k: x for k, x in d.items() if type(k) is str and type(x) is int}


def _processor(store: Store, info: StreamInfo, proc_id: str, by_name: dict[str, StreamInfo],
               tailers: dict[str, list[tuple[str, int]]]) -> dict[str, Any]:
    damaged = info.damaged
    recent: list[Entry] = []
    if damaged is None and info.next:
        try:
            recent = store.last(info.name, None, BACKING_WINDOW)
        except StoreCorrupt as e:  # (its entries: the graph is shown, this processor marked)
            damaged = e.reason or str(e)
    inputs: dict[str, dict[str, Any]] = {}
    outputs: list[str] = []
    errors: list[str] = []
    last: dict[str, Any] | None = None
    for e in recent:  # newest first
        rec = _record(e)
        if rec is None:
            continue
        label, f = rec
        if last is None:
            last = {"kind": label, "index": e.index, "time": e.time}
        if label == "snapshot" and len(f) == 3:
            starts, ends = _ints(f[1]), _ints(f[2])
            if last.get("step") is None:
                last["step"] = {s: [starts.get(s), ends.get(s)] for s in ends}
            for s in ends:
                inputs.setdefault(s, {})
        elif label in ("attempt-output", "attempt-error") and f and type(f[0]) is str:
            (outputs if label == "attempt-output" else errors).append(f[0])
    for stream, pos in tailers.get(proc_id, ()):
        inputs.setdefault(stream, {})["position"] = pos
    for stream, row in inputs.items():
        si = by_name.get(stream)
        if si is not None and si.damaged is not None:
            si = None  # (its row says nothing: next and lag unknown; the graph names it)
        row["stream"] = stream
        row["next"] = si.next if si is not None else None
        pos = row.get("position")
        row.setdefault("position", None)
        row["lag"] = None if pos is None or si is None else max(0, si.next - pos)
    return {
        "name": proc_id.split("/", 1)[1],
        "id": proc_id,
        "backing": info.name,
        "steps": info.count,
        "inputs": sorted(inputs.values(), key=lambda r: r["stream"]),
        "outputs": sorted(set(outputs)),
        "error_streams": sorted(set(errors)),
        "last_step": last,
        "lag": sum(r["lag"] or 0 for r in inputs.values()),
        "damaged": damaged,
    }


def pipelines(store: Store) -> list[dict[str, Any]]:
    """Every graph the store has run (store threads): ``GET /api/pipelines``.  A damaged
    stream (its bookkeeping, or a processor's backing entries) marks the graphs it is in
    -- ``damaged``: what is wrong, per stream -- and hides none of the others."""
    infos = store.streams(include_internal=True, with_damaged=True)
    by_name = {i.name: i for i in infos}
    tailers: dict[str, list[tuple[str, int]]] = {}
    for i in infos:
        for t in i.tailers:
            tailers.setdefault(t.name, []).append((i.name, t.position))
    graphs: dict[str, list[dict[str, Any]]] = {}
    for i in infos:
        if not i.name.startswith(BACKING):
            continue
        proc_id = i.name[len(BACKING):]
        if "/" not in proc_id:
            continue
        graph = proc_id.split("/", 1)[0]
        graphs.setdefault(graph, []).append(_processor(store, i, proc_id, by_name, tailers))
    holder = getattr(store, "lock_holder", None)
    out = []
    for graph, procs in sorted(graphs.items()):
        procs.sort(key=lambda p: p["name"])
        ins = {r["stream"] for p in procs for r in p["inputs"]}
        outs = {s for p in procs for s in p["outputs"]}
        errs = {s for p in procs for s in p["error_streams"]}
        streams = []
        damaged = {p["backing"]: p["damaged"] for p in procs if p["damaged"] is not None}
        for s in sorted(ins | outs | errs):
            si = by_name.get(s)
            if si is not None and si.damaged is not None:
                damaged[s] = si.damaged
                si = None
            streams.append({
                "name": s,
                "next": si.next if si is not None else None,
                "length": si.count if si is not None else None,
                "damaged": damaged.get(s),
                "role": "error" if s in errs else "source" if s not in outs else
                        "output" if s not in ins else "intermediate",
            })
        running = None
        if callable(holder):
            try:
                running = holder(f"graph:{graph}")
            except (StoreError, OSError, ValueError):
                running = None
        edges = [{"from": r["stream"], "to": p["name"], "lag": r["lag"]}
                 for p in procs for r in p["inputs"]]
        edges += [{"from": p["name"], "to": s, "lag": None} for p in procs for s in p["outputs"]]
        steps = [p["last_step"]["time"] for p in procs if p["last_step"] is not None]
        out.append({"graph": graph, "running": running, "processors": procs,
                    "streams": streams, "edges": edges,
                    "damaged": [{"stream": k, "reason": v} for k, v in sorted(damaged.items())],
                    "lag": sum(p["lag"] for p in procs),
                    "last_progress": max(steps) if steps else None})
    return out


# ------------------------------------------------------------------------------------
# A stream's entries


def _int_arg(request: web.Request, name: str, lo: int, hi: int) -> int | None:
    text = request.query.get(name)
    if text is None or text == "":
        return None
    if not text.isdigit() or not lo <= int(text) <= hi:
        raise ApiError(400, f"{name} {text!r}: give a number from {lo} to {hi}")
    return int(text)


def _entry_row(e: Entry) -> dict[str, Any]:
    try:
        text, cut = value_text(e.value, True)
    except ValueError as err:
        text, cut = f"#!undecodable ({err}): {e.data[:32].hex()}", False
    row: dict[str, Any] = {"index": e.index, "time": e.time, "value": text}
    if e.meta_data is not None:
        try:
            row["meta"] = value_text(e.meta, True)[0]
        except ValueError:
            row["meta"] = "#!undecodable"
    if cut:
        row["cut"] = True
    return row


def read_entries(store: Store, name: str, start: int | None, before: int | None, limit: int,
                 search: str | None) -> dict[str, Any]:
    """``GET /api/stream/NAME`` (store threads)."""
    if not store.has_stream(name):
        raise ApiError(404, f"no stream {name!r} in the store")
    nxt = store.next_index(name)
    first = store.first_index(name)
    out: dict[str, Any] = {"stream": name, "first": first, "next": nxt}
    needle = search.casefold() if search else None
    rows: list[dict[str, Any]] = []
    scanned = 0
    if start is not None:  # forwards from start
        pos = start
        while len(rows) < limit and pos < nxt and scanned < MAX_SCAN:
            chunk = store.read(name, pos, 1000 if needle else limit - len(rows))
            if not chunk:
                break
            for e in chunk:
                scanned += 1
                pos = e.index + 1
                row = _entry_row(e)
                if needle is None or needle in row["value"].casefold():
                    rows.append(row)
                    if len(rows) >= limit:
                        break
        out["entries"] = rows
        out["next_from"] = pos if pos < nxt else None
    else:  # backwards from before (default: the end), shown oldest first
        pos = nxt if before is None else min(before, nxt)
        while len(rows) < limit and scanned < MAX_SCAN and (first is not None and pos > first):
            chunk = store.last(name, pos, 1000 if needle else limit - len(rows))
            if not chunk:
                break
            for e in chunk:  # newest first
                scanned += 1
                pos = e.index
                row = _entry_row(e)
                if needle is None or needle in row["value"].casefold():
                    rows.append(row)
                    if len(rows) >= limit:
                        break
        rows.reverse()
        out["entries"] = rows
        out["next_before"] = pos if first is not None and pos > first else None
    out["scanned"] = scanned
    if search:
        out["search"] = search
    return out


def setup(app: web.Application, ctx: WebContext) -> None:
    """Add ``/api/streams``, ``/api/pipelines`` and ``/api/stream/NAME``."""

    def need_store(access: Access, what: str) -> Store:
        access.require_admin(what)
        if ctx.store is None:
            raise ApiError(404, "this server has no stream store (start it with --record, "
                           "--publish or --http to open DATA_DIR/streams.sqlite3)")
        return ctx.store

    async def api_streams(request: web.Request, access: Access) -> web.StreamResponse:
        store = need_store(access, "the streams")
        every = request.query.get("all", "") in ("1", "yes", "true")
        try:
            infos = await ctx.run_store(lambda: store.streams(every, with_damaged=True))
        except StoreError as e:
            raise ApiError(503, f"the stream store failed: {e}") from None
        pub = set(ctx.publish)
        return json_response({"time": time.time(),
                              "streams": [stream_row(i, i.name in pub) for i in infos]})

    async def api_pipelines(request: web.Request, access: Access) -> web.StreamResponse:
        store = need_store(access, "the pipelines")
        try:
            graphs = await ctx.run_store(pipelines, store)
        except StoreError as e:
            raise ApiError(503, f"the stream store failed: {e}") from None
        return json_response({"time": time.time(), "graphs": graphs})

    async def api_stream(request: web.Request, access: Access) -> web.StreamResponse:
        store = need_store(access, "a stream's entries")
        name = request.match_info["name"]
        try:
            check_stream_name(name)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        start = _int_arg(request, "from", 0, 2**63 - 1)
        before = _int_arg(request, "before", 0, 2**63 - 1)
        limit = _int_arg(request, "limit", 1, MAX_LIMIT) or DEFAULT_LIMIT
        search = request.query.get("search") or None
        if search is not None and len(search) > 1000:
            raise ApiError(400, "search text longer than 1000 characters")
        try:
            data = await ctx.run_store(read_entries, store, name, start, before, limit, search)
        except StoreError as e:
            raise ApiError(503, f"the stream store failed: {e}") from None
        return json_response(data)

    r = app.router
    r.add_get("/api/streams", guarded(ctx, api_streams), allow_head=False)
    r.add_get("/api/pipelines", guarded(ctx, api_pipelines), allow_head=False)
    r.add_get("/api/stream/{name:.+}", guarded(ctx, api_stream), allow_head=False)
