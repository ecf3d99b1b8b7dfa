"""``dataspace info``: the server's summary, once (``GET /api/server``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ._http import HTTP_HELP, Api, HttpFail, add_http_args, duration, size

EXAMPLES = """\
examples:
  dataspace info                               the server at 127.0.0.1:7480
  dataspace info --url http://10.0.0.2:7480 --token @admin.sturdyref
  dataspace info --json                        as JSON (GET /api/server)

""" + HTTP_HELP


def register(sub: Any) -> None:
    p = sub.add_parser(
        "info", help="print a server's summary once (connections, traffic, memory, limits)",
        description="Print the summary of a running server -- version, uptime, connections, "
        "assertions per dataspace, observers, groups of observers that share work, messages "
        "and bytes in and out, errors, memory, links, recorders, limits -- read from its HTTP "
        "port (like Redis's INFO).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the JSON of GET /api/server")
    add_http_args(p)
    p.set_defaults(func=run)


def _n(x: Any) -> str:
    return f"{x:,}" if isinstance(x, int) else "-" if x is None else str(x)


def _of(x: Any, one: str) -> str:
    """A count and its noun, agreeing (``1 turn``, ``2 turns``; ``- turns`` unknown)."""
    return f"{_n(x)} {one if x == 1 else one + 's'}"


MAX_GROUP_LINES = 10
"""Groups of observers listed by ``info`` (the busiest first)."""


def group_line(g: dict[str, Any]) -> str:
    """One group of observers as ``info`` shows it."""
    ds = "" if g.get("dataspace") in (None, "root") else f" in {g['dataspace']}"
    waiting = f" ({_n(g['pending'])} waiting)" if g.get("pending") else ""
    dropped = f", {_n(g['dropped'])} to no member" if g.get("dropped") else ""
    return (f"group        {g['group']} {g['pattern']}{ds}: "
            f"{_of(g.get('member_count', 0), 'member')}, {_of(g['messages'], 'message')}"
            f"{dropped}, {_of(g['jobs'], 'job')}{waiting}, {_n(g['reassigned'])} moved")


def format_summary(s: dict[str, Any], url: str) -> list[str]:
    """The summary as lines of text."""
    head = f"dataspace {s.get('version')} at {url} (server {s.get('server_id')}"
    if "pid" in s:
        head += f", pid {s['pid']}"
    head += f"), up {duration(s.get('uptime'))}"
    if s.get("scope") != "admin":
        head += f"; seen as {s.get('scope')}"
    lines = [head]
    if isinstance(s.get("core"), dict):
        lines.append(f"core         {s['core'].get('describe')}")
    lines.append(f"connections  {_n(s.get('connections'))} open, {_n(s.get('connections_accepted'))} "
                 f"accepted, {_n(s.get('connections_refused'))} refused")
    dss = ", ".join(f"{name} {_n(d['assertions'])} ({_of(d['observers'], 'observer')})"
                    for name, d in sorted(s.get("dataspaces", {}).items()))
    lines.append(f"assertions   {_n(s.get('assertions'))} held by peers; distinct values: {dss}")
    lines.append(f"traffic      {_of(s.get('turns'), 'turn')}; messages {_n(s.get('messages_in'))} "
                 f"in, {_n(s.get('messages_out'))} out; {size(s.get('bytes_in'))} in, "
                 f"{size(s.get('bytes_out'))} out")
    errs = {k: v for k, v in (s.get("errors") or {}).items() if v}
    lines.append("errors       " + (", ".join(f"{k.replace('_', ' ')} {_n(v)}"
                                             for k, v in errs.items()) or "none"))
    lines.append(f"memory       {size(s.get('memory_rss'))} resident; "
                 f"{size(s.get('buffered'))} queued to peers")
    mb = s.get("memory_budget")
    if mb and mb.get("limit"):
        lines.append(f"budget       {size(mb['used'])} of {size(mb['limit'])} held for clients "
                     f"({100 * mb['used'] // mb['limit']}%, --max-memory); "
                     f"{_of(mb['refused'], 'assertion')} refused")
    elif mb is not None:
        lines.append("budget       off (--max-memory off): clients' memory is not bounded")
    if s.get("links", {}).get("count"):
        ln = s["links"]
        lines.append(f"links        {ln['connected']} of {ln['count']} connected")
    for r in s.get("recorders", ()):
        state = f", FAILED: {r['failed']}" if r.get("failed") else ""
        lines.append(f"recorder     {r['stream']}: {_n(r['recorded'])} recorded, "
                     f"{_n(r['dropped'])} dropped, {_n(r['queued'])} queued{state}")
    if s.get("store"):
        pub = ", ".join(s.get("published") or ()) or "none"
        lines.append(f"store        {s['store']} (published: {pub})")
    groups = s.get("groups") or []
    for g in groups[:MAX_GROUP_LINES]:
        lines.append(group_line(g))
    more = int(s.get("groups_total") or len(groups)) - min(len(groups), MAX_GROUP_LINES)
    if more > 0:
        lines.append(f"groups       ... and {more:,} more (dataspace top, /api/groups)")
    lim = s.get("limits") or {}
    if lim:
        lines.append(f"limits       max-connections {_n(lim.get('max_connections'))}, "
                     f"max-total-assertions {_n(lim.get('max_total_assertions'))}, "
                     f"max-packet-size {size(lim.get('max_packet_size'))}, "
                     f"max-send-queue {size(lim.get('max_send_queue'))}")
    return lines


def run(args: argparse.Namespace) -> int:
    try:
        api = Api(args)
        summary = api.get("/api/server")
    except HttpFail as e:
        print(f"dataspace info: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=2, ensure_ascii=False))
    else:
        print("\n".join(format_summary(summary, api.base)))
    return 0
