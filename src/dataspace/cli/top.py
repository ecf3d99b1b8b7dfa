"""``dataspace top``: a live, sortable table of a server's connections, rates and busiest
patterns (like nats-top), read from its HTTP port's JSON endpoints."""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ._http import HTTP_HELP, Api, HttpFail, add_http_args, duration, size

SORTS = {
    "c": ("id", "connection id"),
    "i": ("msgs_in_rate", "messages in per second"),
    "o": ("msgs_out_rate", "messages out per second"),
    "b": ("bytes_in_rate", "bytes in per second"),
    "B": ("bytes_out_rate", "bytes out per second"),
    "a": ("assertions_in", "assertions held"),
    "s": ("observers", "subscriptions"),
    "m": ("assertions_out", "matches held"),
    "p": ("pending_output", "pending output"),
    "t": ("age", "age"),
}

EXAMPLES = """\
examples:
  dataspace top                                the server at http://127.0.0.1:7480, live
  dataspace top --sort o                       busiest receivers first
  dataspace top --url http://10.0.0.2:7480 --token @admin.sturdyref
  dataspace top | cat                          not a terminal: one snapshot, then exit

keys (on a terminal): """ + ", ".join(f"{k} {what}" for k, (_f, what) in SORTS.items()) + """,
  r reverse the order, q (or Ctrl-C) quit

""" + HTTP_HELP


def register(sub: Any) -> None:
    p = sub.add_parser(
        "top", help="a live table of a server's connections, rates and busiest patterns",
        description="Show a running server's connections (subscriptions, assertions, "
        "messages and bytes in and out with their rates, pending output), its totals and "
        "its busiest patterns, refreshed every --interval seconds, sortable with keys (like "
        "nats-top).  Without a terminal it prints one snapshot and exits.  Needs the "
        "server's root capability (connection details are the administrator's).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval", "-d", type=float, default=1.0, metavar="SECONDS",
                   help="refresh interval (default 1)")
    p.add_argument("--sort", "-s", default="c", choices=sorted(SORTS),
                   help="the first sort key (see the keys below; default c)")
    p.add_argument("-n", "--lines", type=int, default=30, metavar="N",
                   help="show at most N connections (default 30)")
    p.add_argument("--dataspace", default="root", metavar="NAME",
                   help="the dataspace whose patterns are shown (default root)")
    p.add_argument("--once", action="store_true",
                   help="print one snapshot and exit, even on a terminal")
    add_http_args(p)
    p.set_defaults(func=run)


class Sample:
    """One reading of the endpoints, and the rates since the previous one."""

    def __init__(self, api: Api, dataspace: str, prev: Sample | None) -> None:
        self.t = time.monotonic()
        self.server = api.get("/api/server")
        self.conns = api.get("/api/connections")
        try:
            self.subs: dict[str, Any] | None = api.get(
                f"/api/subscriptions?dataspace={dataspace}")
        except HttpFail:
            self.subs = None  # a token that may not see them
        dt = self.t - prev.t if prev is not None else 0.0
        before = {c["id"]: c for c in prev.conns["connections"]} if prev else {}
        for c in self.conns["connections"]:
            p = before.get(c["id"])
            for key, field in (("msgs_in_rate", "messages_in"), ("msgs_out_rate", "messages_out"),
                               ("bytes_in_rate", "bytes_in"), ("bytes_out_rate", "bytes_out")):
                c[key] = (c[field] - p[field]) / dt if p is not None and dt > 0 else None
        self.dt = dt
        self.rates: dict[str, float | None] = {}
        for key in ("messages_in", "messages_out", "bytes_in", "bytes_out", "turns"):
            self.rates[key] = ((self.server[key] - prev.server[key]) / dt
                               if prev is not None and dt > 0 else None)
        old = ({p["pattern"]: p for p in prev.subs["patterns"]}
               if prev is not None and prev.subs else {})
        if self.subs is not None:
            for p in self.subs["patterns"]:
                o = old.get(p["pattern"])
                p["rate"] = (p["delivered"] - o["delivered"]) / dt if o and dt > 0 else None


def _rate(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{size(x)}/s" if unit == "B" else f"{x:,.0f}/s"


def render(s: Sample, sort: str, reverse: bool, lines: int, live: bool) -> Group:
    """The screen: a header, the connections table and the busiest patterns."""
    sv = s.server
    head = Text()
    head.append(f"dataspace {sv['version']} ", style="bold")
    head.append(f"server {sv['server_id']}  up {duration(sv.get('uptime'))}  "
                f"memory {size(sv.get('memory_rss'))}  connections {sv['connections']:,}  "
                f"assertions {sv['assertions']:,}  observers {sv['observers']:,}\n")
    r = s.rates
    head.append(f"messages in {sv['messages_in']:,} ({_rate(r['messages_in'])})  "
                f"out {sv['messages_out']:,} ({_rate(r['messages_out'])})  "
                f"bytes in {size(sv['bytes_in'])} ({_rate(r['bytes_in'], 'B')})  "
                f"out {size(sv['bytes_out'])} ({_rate(r['bytes_out'], 'B')})  "
                f"turns {sv['turns']:,} ({_rate(r['turns'])})")
    errs = {k: v for k, v in sv.get("errors", {}).items() if v}
    if errs:
        head.append("\nerrors " + ", ".join(f"{k} {v:,}" for k, v in errs.items()),
                    style="red")

    field, what = SORTS[sort]
    rows = sorted(s.conns["connections"], key=lambda c: c.get(field) or 0,
                  reverse=field != "id")  # ids in order, every other column biggest first
    if reverse:
        rows.reverse()
    title = (f"connections: {s.conns['count']:,}, sorted by {what}"
             + (" (reversed)" if reverse else "")
             + (f", first {lines}" if len(rows) > lines else ""))
    t = Table(title=title, title_justify="left", expand=False, pad_edge=False,
              box=None, header_style="bold")
    for col, just in (("ID", "right"), ("PEER", "left"), ("DS", "left"), ("AGE", "right"),
                      ("SUBS", "right"), ("ASSERT", "right"), ("MATCHES", "right"),
                      ("MSGS IN", "right"), ("MSGS OUT", "right"), ("IN/s", "right"),
                      ("OUT/s", "right"), ("BYTES IN", "right"), ("BYTES OUT", "right"),
                      ("PENDING", "right"), ("HELD", "left")):
        t.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for c in rows[:lines]:
        ds = ",".join(d["name"] + ("*" if d["attenuated"] else "") for d in c["dataspaces"])
        t.add_row(str(c["id"]), c["peer"], ds or "-", duration(c["age"]), f"{c['observers']:,}",
                  f"{c['assertions_in']:,}", f"{c['assertions_out']:,}",
                  f"{c['messages_in']:,}", f"{c['messages_out']:,}",
                  _rate(c.get("msgs_in_rate")), _rate(c.get("msgs_out_rate")),
                  size(c["bytes_in"]), size(c["bytes_out"]), size(c["pending_output"]),
                  ",".join(c["held"]) or "")
    parts: list[Any] = [head, t]
    if s.subs is not None and s.subs["patterns"]:
        pats = list(s.subs["patterns"])
        pats.sort(key=lambda p: (p.get("rate") or 0, p["delivered"], p["observers"]),
                  reverse=True)
        pt = Table(title=f"busiest patterns in {s.subs['dataspace']}", title_justify="left",
                   box=None, header_style="bold", pad_edge=False)
        for col, just in (("PATTERN", "left"), ("OBSERVERS", "right"), ("MATCHES", "right"),
                          ("EVENTS", "right"), ("EVENTS/s", "right")):
            pt.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
        for p in pats[:10]:
            pt.add_row(p["pattern"][:80], f"{p['observers']:,}", f"{p['matches']:,}",
                       f"{p['delivered']:,}", _rate(p.get("rate")))
        parts.append(pt)
    if live:
        parts.append(Text("sort: " + "  ".join(f"{k} {w}" for k, (_f, w) in SORTS.items())
                          + "  r reverse  q quit", style="dim"))
    return Group(*parts)


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """The terminal in cbreak mode (keys without Enter), restored at the end."""
    import termios
    import tty

    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def _key(fd: int, timeout: float) -> str | None:
    ready, _w, _x = select.select([fd], [], [], max(0.0, timeout))
    if not ready:
        return None
    data = os.read(fd, 1)
    return data.decode(errors="replace") if data else "q"


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0 or args.lines < 1:
        print("dataspace top: --interval must be > 0 and --lines >= 1", file=sys.stderr)
        return 2
    try:
        api = Api(args)
        first = Sample(api, args.dataspace, None)
    except HttpFail as e:
        print(f"dataspace top: {e}", file=sys.stderr)
        return 1
    if first.conns.get("scope") != "admin":
        print("dataspace top: this token sees no connection details: give the server's root "
              "sturdyref (--token @root.sturdyref or --data-dir)", file=sys.stderr)
    interactive = sys.stdout.isatty() and sys.stdin.isatty() and not args.once
    if not interactive:
        width = int(os.environ.get("COLUMNS", "0") or 0) or 200  # a file or pipe: no wrapping
        Console(highlight=False, width=width).print(
            render(first, args.sort, False, args.lines, False))
        return 0
    sort, reverse, sample = args.sort, False, first
    console = Console(highlight=False)
    try:
        with _keys() as fd, Live(render(sample, sort, reverse, args.lines, True),
                                 console=console, screen=True, auto_refresh=False) as live:
            next_at = time.monotonic() + args.interval
            while True:
                key = _key(fd, next_at - time.monotonic())
                if key in ("q", "Q", "\x03", "\x1b"):
                    return 0
                if key == "r":
                    reverse = not reverse
                elif key is not None and key in SORTS:
                    sort, reverse = key, False
                if key is None:
                    try:
                        sample = Sample(api, args.dataspace, sample)
                    except HttpFail as e:
                        live.stop()
                        print(f"dataspace top: {e}", file=sys.stderr)
                        return 1
                    next_at = time.monotonic() + args.interval
                live.update(render(sample, sort, reverse, args.lines, True), refresh=True)
    except KeyboardInterrupt:
        return 0
