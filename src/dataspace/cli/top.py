"""``dataspace top``: a live, sortable table of a server's connections, rates and busiest
patterns (like nats-top), read from its HTTP port's JSON endpoints."""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ._http import HTTP_HELP, Api, HttpFail, add_http_args, duration

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
        server = api.get("/api/server")
        conns = api.get("/api/connections")
        try:
            subs: dict[str, Any] | None = api.get(f"/api/subscriptions?dataspace={dataspace}")
        except HttpFail:
            subs = None  # a token that may not see them
        self._set(server, conns, subs, prev, time.monotonic())

    @classmethod
    def of(cls, server: dict[str, Any], conns: dict[str, Any], subs: dict[str, Any] | None,
           prev: Sample | None = None, t: float = 0.0) -> Sample:
        """A sample of readings already made (``t``: when, in seconds)."""
        self = cls.__new__(cls)
        self._set(server, conns, subs, prev, t)
        return self

    def _set(self, server: dict[str, Any], conns: dict[str, Any],
             subs: dict[str, Any] | None, prev: Sample | None, t: float) -> None:
        self.t, self.server, self.conns, self.subs = t, server, conns, subs
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


# ------------------------------------------------------------------------------------
# Numbers for a narrow screen


def num(n: float | None) -> str:
    """A count in at most 4 characters: 999, 1.2k, 34k, 123k, 1.2M, 3.4G."""
    if n is None:
        return "-"
    n = round(n)
    if abs(n) < 1000:
        return str(n)
    for unit in ("k", "M", "G", "T"):
        n /= 1000
        if abs(n) < 999.5 or unit == "T":
            return f"{n:.1f}{unit}" if abs(n) < 9.95 else f"{n:.0f}{unit}"
    return str(n)  # pragma: no cover


def rate(x: float | None) -> str:
    """A rate per second: - before the second sample, 0, 0.5, 12, 1.2k."""
    if x is None:
        return "-"
    if x == 0 or x >= 9.95:
        return num(x)
    return f"{x:.1f}"


def nbytes(n: float | None) -> str:
    """Bytes in at most 5 characters, powers of 1024 as ``du -h``: 512B, 1.5K, 34K, 3.4M."""
    if n is None:
        return "-"
    if abs(n) < 1024:
        return f"{n:.0f}B"
    for unit in ("K", "M", "G", "T"):
        n /= 1024
        if abs(n) < 1023.5 or unit == "T":
            return f"{n:.1f}{unit}" if abs(n) < 9.95 else f"{n:.0f}{unit}"
    return f"{n:.0f}T"  # pragma: no cover


def client(c: dict[str, Any]) -> str:
    """Who a connection is: the name its client gave, else its peer address."""
    return str(c.get("name") or c["peer"])


# ------------------------------------------------------------------------------------
# The connections table: as many columns as the width holds, most useful first


class Col:
    """A column of the connections table: its heading, how a row shows in it, and its
    rank (lower ranks stay on a narrower screen; columns of one rank, such as IN and
    OUT, come and go together)."""

    def __init__(self, head: str, rank: float, cell: Callable[[dict[str, Any]], str],
                 left: bool = False, sort: str | None = None) -> None:
        self.head, self.rank, self.cell, self.left, self.sort = head, rank, cell, left, sort


def _ds(c: dict[str, Any]) -> str:
    return ",".join(d["name"] + ("*" if d["attenuated"] else "") for d in c["dataspaces"]) or "-"


COLUMNS: list[Col] = [  # in the order shown
    Col("ID", 0, lambda c: str(c["id"]), sort="id"),
    Col("CLIENT", 0, client, left=True),
    Col("PEER", 14, lambda c: c["peer"], left=True),
    Col("DS", 13, _ds, left=True),
    Col("AGE", 8, lambda c: duration(c["age"]), sort="age"),
    Col("SUBS", 2, lambda c: num(c["observers"]), sort="observers"),
    Col("ASSERT", 1, lambda c: num(c["assertions_in"]), sort="assertions_in"),
    Col("MATCH", 3, lambda c: num(c["assertions_out"]), sort="assertions_out"),
    Col("MSGS IN", 9, lambda c: num(c["messages_in"])),
    Col("MSGS OUT", 9, lambda c: num(c["messages_out"])),
    Col("MSG IN/s", 4, lambda c: rate(c.get("msgs_in_rate")), sort="msgs_in_rate"),
    Col("MSG OUT/s", 4, lambda c: rate(c.get("msgs_out_rate")), sort="msgs_out_rate"),
    Col("BYTES IN", 11, lambda c: nbytes(c["bytes_in"])),
    Col("BYTES OUT", 11, lambda c: nbytes(c["bytes_out"])),
    Col("B IN/s", 16, lambda c: nbytes(c.get("bytes_in_rate")), sort="bytes_in_rate"),
    Col("B OUT/s", 16, lambda c: nbytes(c.get("bytes_out_rate")), sort="bytes_out_rate"),
    Col("PEND", 5, lambda c: nbytes(c["pending_output"]), sort="pending_output"),
    Col("IDLE", 15, lambda c: duration(c.get("idle"))),
    Col("HELD", 6, lambda c: ",".join(c["held"]), left=True),
]
CLIENT_MIN, CLIENT_MAX = 10, 28
"""The CLIENT column's width: at least this, and at most that when choosing the other
columns (it then takes what they leave; longer names are cut with …)."""
KEY_HEADS = {"c": "ID", "a": "ASSERT", "s": "SUBS", "m": "MATCH", "i": "MSG IN/s",
             "o": "MSG OUT/s", "b": "B IN/s", "B": "B OUT/s", "p": "PEND", "t": "AGE"}
"""The sort keys, by the heading of the column each sorts on."""


def choose_columns(rows: list[dict[str, Any]], width: int,
                   sort_field: str) -> tuple[list[Col], int]:
    """The columns that fit ``width`` characters for ``rows``, most useful first, in
    their order: ID and CLIENT always, the sort column always; PEER only when some
    client gave a name, HELD only when a connection is held now.  With the width the
    CLIENT column gets (what the others leave, up to its longest name)."""
    def natural(col: Col) -> int:
        return max([len(col.head)] + [len(col.cell(r)) for r in rows])

    groups: dict[float, list[tuple[int, Col]]] = {}
    for pos, col in enumerate(COLUMNS):
        if col.head == "PEER" and not any(r.get("name") and r["name"] != r["peer"] for r in rows):
            continue
        if col.head == "HELD" and not any(r["held"] for r in rows):
            continue
        groups.setdefault(-1 if col.sort == sort_field else col.rank, []).append((pos, col))
    chosen: list[tuple[int, Col]] = []
    used = -1  # one space between columns
    for _rank, group in sorted(groups.items()):
        w = 0
        for _pos, col in group:
            n = natural(col)
            w += 1 + (max(CLIENT_MIN, min(n, CLIENT_MAX)) if col.head == "CLIENT" else n)
        if chosen and used + w > width:
            continue  # a smaller group further down may still fit
        chosen += group
        used += w
    client_w = max(CLIENT_MIN, min(natural(COLUMNS[1]), CLIENT_MAX + max(0, width - used)))
    return [col for _pos, col in sorted(chosen, key=lambda x: x[0])], client_w


def _table(**kw: Any) -> Table:
    return Table(box=None, pad_edge=False, padding=(0, 1), collapse_padding=True,
                 show_edge=False, header_style="bold", title_justify="left", **kw)


def _pack(parts: list[str], width: int) -> str:
    """``parts`` joined by two spaces, on as many lines of ``width`` as they need."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += "  " + part
        else:
            lines.append(part)
    return "\n".join(lines)


def render(s: Sample, sort: str, reverse: bool, lines: int, live: bool,
           width: int = 200, height: int | None = None) -> Group:
    """The screen for ``width`` columns (and ``height`` rows on a terminal): the totals,
    the connections table with the columns that fit, and the busiest patterns."""
    sv = s.server
    r = s.rates
    head = Text(_pack([
        f"dataspace {sv['version']}", f"server {sv['server_id']}",
        f"up {duration(sv.get('uptime'))}", f"memory {nbytes(sv.get('memory_rss'))}",
        f"connections {num(sv['connections'])}", f"assertions {num(sv['assertions'])}",
        f"observers {num(sv['observers'])}", "turns " + _per_s(sv, r, "turns", num, rate),
        "messages in " + _per_s(sv, r, "messages_in", num, rate)
        + " out " + _per_s(sv, r, "messages_out", num, rate),
        "bytes in " + _per_s(sv, r, "bytes_in", nbytes, nbytes)
        + " out " + _per_s(sv, r, "bytes_out", nbytes, nbytes),
    ], width))
    errs = {k: v for k, v in sv.get("errors", {}).items() if v}
    if errs:
        parts = [f"{k} {num(v)}" for k, v in errs.items()]
        head.append("\n" + _pack(["errors: " + parts[0], *parts[1:]], width), style="red")

    heads = [f"{k} {h}" for k, h in KEY_HEADS.items()]
    keys = Text(_pack(["sort: " + heads[0], *heads[1:], "r reverse", "q quit"], width),
                style="dim") if live else None
    pats = list(s.subs["patterns"]) if s.subs is not None else []
    pat_rows = min(len(pats), 10)
    room = lines
    if height is not None:  # a terminal: rows that do not fit are left out
        fixed = len(head.plain.split("\n")) + 2  # + the table's title and headings
        if keys is not None:
            fixed += len(keys.plain.split("\n"))
        avail = max(1, height - fixed)
        # The patterns get what the connections leave, and a third of the screen at least.
        n = min(len(s.conns["connections"]), lines)
        pat_rows = max(0, min(pat_rows, max(avail - n, avail // 3) - 2))
        room = max(1, min(lines, avail - (pat_rows + 2 if pat_rows else 0)))

    field, what = SORTS[sort]
    rows = sorted(s.conns["connections"], key=lambda c: c.get(field) or 0,
                  reverse=field != "id")  # ids in order, every other column biggest first
    if reverse:
        rows.reverse()
    shown = rows[:room]
    title = (f"connections: {s.conns['count']:,}, sorted by {what}"
             + (" (reversed)" if reverse else "")
             + (f", first {len(shown)}" if len(rows) > len(shown) else ""))
    cols, client_w = choose_columns(shown, width, field)
    t = _table(title=title)
    for col in cols:
        if col.head == "CLIENT":
            t.add_column(col.head, no_wrap=True, overflow="ellipsis", min_width=CLIENT_MIN,
                         max_width=client_w)
        else:
            t.add_column(col.head, justify="left" if col.left else "right", no_wrap=True,
                         min_width=len(col.head))
    for c in shown:
        t.add_row(*(col.cell(c) for col in cols))
    parts: list[Any] = [head, t]
    if pat_rows:
        pats.sort(key=lambda p: (p.get("rate") or 0, p["delivered"], p["observers"]),
                  reverse=True)
        pt = _table(title=f"busiest patterns in {s.subs['dataspace']}"  # type: ignore[index]
                    if s.subs is not None else "")
        pt.add_column("PATTERN", no_wrap=True, overflow="ellipsis", min_width=10,
                      max_width=max(10, width - 35))  # the other four and their spaces
        for col in ("OBSERVERS", "MATCHES", "EVENTS", "EVENTS/s"):
            pt.add_column(col, justify="right", no_wrap=True, min_width=len(col))
        for p in pats[:pat_rows]:
            pt.add_row(p["pattern"], num(p["observers"]), num(p["matches"]),
                       num(p["delivered"]), rate(p.get("rate")))
        parts.append(pt)
    if keys is not None:
        parts.append(keys)
    return Group(*parts)


def _per_s(sv: dict[str, Any], rates: dict[str, float | None], key: str,
           total: Callable[[Any], str], per: Callable[[Any], str]) -> str:
    r = rates.get(key)
    return total(sv[key]) + ("" if r is None else f" ({per(r)}/s)")


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
            render(first, args.sort, False, args.lines, False, width))
        return 0
    sort, reverse, sample = args.sort, False, first
    console = Console(highlight=False)

    def screen() -> Group:
        w, h = console.size
        return render(sample, sort, reverse, args.lines, True, w, h)

    try:
        with _keys() as fd, Live(screen(), console=console, screen=True,
                                 auto_refresh=False) as live:
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
                live.update(screen(), refresh=True)
    except KeyboardInterrupt:
        return 0
