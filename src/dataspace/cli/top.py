"""``dataspace top``: a live, sortable table of a server's connections, rates and busiest
patterns (like nats-top), read from its HTTP port's JSON endpoints.

Drawn with the standard library alone (no rich, no curses): a :class:`Screen` is lines of
styled text cut to the width, printed plain (a pipe, ``str()``) or with ANSI escape
sequences; :class:`Terminal` is the live screen -- the alternate screen, the cursor hidden,
keys without Enter -- and restores the terminal on every way out."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import select
import shutil
import signal
import sys
import threading
import time
import unicodedata
import urllib.error
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, TextIO

from ._http import HTTP_HELP, Api, HttpFail, add_http_args, duration
from ._voice import plural

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
  dataspace top                                live, from http://127.0.0.1:7480
  dataspace top --sort o                       busiest receivers first
  dataspace top --url http://10.0.0.2:7480 --token @admin.sturdyref
  dataspace top | cat                          not a terminal: one snapshot
  dataspace top --once --json | jq .server     the screen's figures as JSON
  dataspace top --json --interval 5            a JSON line every 5 s

A server that goes away (a restart) is waited for: top says "server gone,
reconnecting" and carries on when it is back; q or Ctrl-C quits at once.

keys (on a terminal): """ + ", ".join(f"{k} {what}" for k, (_f, what) in SORTS.items()) + """,
  r reverse the order, q (or Ctrl-C) quit

""" + HTTP_HELP


def register(sub: Any) -> None:
    p = sub.add_parser(
        "top", help="a live table of a server's connections, rates and busiest patterns",
        description="Show a running server's connections (subscriptions, assertions, "
        "messages and bytes in and out with their rates, pending output), its totals, "
        "its busiest patterns and its groups of observers that share work, refreshed every --interval seconds, sortable with keys (like "
        "nats-top).  Without a terminal it prints one snapshot and exits; --json prints "
        "what the screen shows as JSON.  Needs the server's root capability (connection "
        "details are the administrator's).",
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
    p.add_argument("--json", action="store_true",
                   help="what the screen shows as JSON, one object per line every --interval "
                   "until Ctrl-C (with --once: one object); for jq")
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
        if prev is not None and _instance(prev.server) != _instance(server):
            prev = None  # the server restarted (or another one answers): counters start again
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
        old = ({(p["pattern"], p.get("own")): p for p in prev.subs["patterns"]}
               if prev is not None and prev.subs else {})
        if self.subs is not None:
            for p in self.subs["patterns"]:
                o = old.get((p["pattern"], p.get("own")))
                p["rate"] = (p["delivered"] - o["delivered"]) / dt if o and dt > 0 else None
        was = {_group_key(g): g for g in prev.server.get("groups") or ()} if prev else {}
        for g in self.server.get("groups") or ():
            o = was.get(_group_key(g))
            g["rate"] = ((g["messages"] - o["messages"]) / dt
                         if o and dt > 0 and g["messages"] >= o["messages"] else None)


def _group_key(g: dict[str, Any]) -> tuple[Any, ...]:
    return g.get("dataspace"), g.get("group"), g.get("pattern")


def _instance(server: dict[str, Any]) -> tuple[Any, Any]:
    """Which run of which server a reading is of (a restart keeps the server's id)."""
    return server.get("server_id"), server.get("started")


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
# Styled text cut to a width: plain for a pipe, ANSI escape sequences for a terminal


Segment = tuple[str, str]
"""Text and its style: space-separated names of :data:`SGR` ("" for none)."""
Line = list[Segment]

SGR = {"bold": "1", "dim": "2", "reverse": "7", "red": "31", "yellow": "33"}
"""The styles top uses, as Select Graphic Rendition parameters (ECMA-48)."""
COLOURS = {"red", "yellow"}
"""The styles left out under ``NO_COLOR`` (bold, dim and reverse stay)."""
ELLIPSIS = "…"

_BIDI = {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def clean(s: str) -> str:
    """``s`` safe to put on a terminal: control characters (an escape sequence in the
    name a client gave itself) and bidirectional overrides shown as ``?``."""
    if s.isprintable():
        return s
    return "".join("?" if unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in _BIDI
                   else ch for ch in s)


def _char_cells(ch: str) -> int:
    if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def cells(s: str) -> int:
    """The columns ``s`` takes on a terminal (a CJK character two, a combining mark none)."""
    return len(s) if s.isascii() else sum(map(_char_cells, s))


def cut(s: str, width: int, mark: str = ELLIPSIS) -> str:
    """``s`` in at most ``width`` columns: whole, else cut and ended with ``mark``."""
    if cells(s) <= width:
        return s
    room, used, out = max(0, width - cells(mark)), 0, []
    for ch in s:
        used += _char_cells(ch)
        if used > room:
            break
        out.append(ch)
    return "".join(out) + (mark if width >= cells(mark) else "")


def _line_cells(line: Line) -> int:
    return sum(cells(t) for t, _style in line)


def _cut_line(line: Line, width: int, mark: str = ELLIPSIS) -> Line:
    """``line`` in at most ``width`` columns (cut in the segment that crosses it)."""
    if _line_cells(line) <= width:
        return line
    out: Line = []
    left = width
    for text, style in line:
        w = cells(text)
        if w < left or (w == left and not mark):
            out.append((text, style))
            left -= w
            continue
        out.append((cut(text, left, mark), style))
        break
    return out


class Screen:
    """What top shows: lines of styled text, none wider than ``width`` columns.  ``str()``
    is the plain text (a pipe, a file, a test); :meth:`styled` the lines with ANSI
    escapes."""

    def __init__(self, width: int) -> None:
        self.width = max(1, width)
        self.lines: list[Line] = []

    def add(self, *segments: Segment | str) -> None:
        """One line (cut to the width; text made safe by :func:`clean`)."""
        line = [(clean(s), "") if isinstance(s, str) else (clean(s[0]), s[1]) for s in segments]
        self.lines.append(_cut_line(line, self.width, ""))

    def extend(self, lines: Sequence[Line]) -> None:
        for line in lines:
            self.add(*line)

    def plain(self) -> list[str]:
        return ["".join(t for t, _s in line).rstrip() for line in self.lines]

    def __str__(self) -> str:
        return "\n".join(self.plain())

    def styled(self, colour: bool = True) -> list[str]:
        """The lines with SGR escapes for their styles (``colour``: False under
        ``NO_COLOR``), each ending with its attributes reset."""
        out = []
        for line in self.lines:
            parts = []
            while line and not line[-1][1] and line[-1][0].rstrip() != line[-1][0]:
                text = line[-1][0].rstrip()  # trailing blanks: cleared, not written
                line = line[:-1] + ([(text, "")] if text else [])
            for text, style in line:
                codes = [SGR[n] for n in style.split() if colour or n not in COLOURS]
                parts.append(f"\x1b[{';'.join(codes)}m{text}\x1b[0m" if codes and text else text)
            out.append("".join(parts))
        return out


class Table:
    """A table without borders: a title, bold headings, one space between columns.  Each
    column is as wide as its heading and cells (at least ``min_width``, at most
    ``max_width``: longer cells are cut with …); a table wider than the screen narrows its
    left-aligned (text) columns, never a heading."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.columns: list[tuple[str, bool, int, int | None]] = []
        self.rows: list[list[Line]] = []

    def add_column(self, head: str, right: bool = False, min_width: int = 0,
                   max_width: int | None = None) -> None:
        self.columns.append((head, right, max(min_width, len(head)), max_width))

    def add_row(self, *cells_: str | Line) -> None:
        self.rows.append([[(c, "")] if isinstance(c, str) else c for c in cells_])

    def lines(self, width: int) -> list[Line]:
        """The title, the headings and the rows, for a ``width``-column screen: columns
        that do not fit once the text columns are as narrow as they go are left out, from
        the right (the first always shows)."""
        rows = [[[(clean(t), s) for t, s in cell] for cell in row] for row in self.rows]
        widths: list[int] = []
        for i, (_head, _right, low, high) in enumerate(self.columns):
            w = max([low] + [_line_cells(r[i]) for r in rows])
            widths.append(max(low, min(w, high)) if high is not None else w)
        n = len(widths)
        while n > 1 and sum(self.columns[i][2] if not self.columns[i][1] else widths[i]
                            for i in range(n)) + n - 1 > width:
            n -= 1
        widths = widths[:n]
        over = sum(widths) + n - 1 - width
        while over > 0:  # the widest text column that can give a column back
            free = [i for i, (_h, right, low, _x) in enumerate(self.columns[:n])
                    if not right and widths[i] > low]
            if not free:
                break
            i = max(free, key=lambda i: widths[i])
            widths[i] -= 1
            over -= 1
        out: list[Line] = [[(cut(clean(self.title), width), "")]] if self.title else []
        heads: Line = []
        for i, (head, right, _low, _high) in enumerate(self.columns[:n]):
            pad = (" " * (widths[i] - len(head)), "")
            heads += [(" " if i else "", "")] + ([pad, (head, "bold")] if right
                                                  else [(head, "bold"), pad])
        out.append(heads)
        for row in rows:
            line: Line = []
            for i, cell in enumerate(row[:n]):
                cell = _cut_line(cell, widths[i])
                pad = (" " * (widths[i] - _line_cells(cell)), "")
                line += [(" " if i else "", "")] + ([pad, *cell] if self.columns[i][1]
                                                    else [*cell, pad])
            out.append(line)
        return out


# ------------------------------------------------------------------------------------
# The connections table: as many columns as the width holds, most useful first


class Col:
    """A column of the connections table: its heading, how a row shows in it, its rank
    (lower ranks stay on a narrower screen; columns of one rank, such as IN and OUT,
    come and go together) and its width when the columns are chosen (the widest its
    cells are: numbers are short; longer text is cut with …), so that which columns
    show depends on the screen's width alone."""

    def __init__(self, head: str, rank: float, cell: Callable[[dict[str, Any]], str],
                 width: int, left: bool = False, sort: str | None = None) -> None:
        self.head, self.rank, self.cell, self.left, self.sort = head, rank, cell, left, sort
        self.width = max(width, len(head))


def _ds(c: dict[str, Any]) -> str:
    return ",".join(d["name"] + ("*" if d["attenuated"] else "") for d in c["dataspaces"]) or "-"


COLUMNS: list[Col] = [  # in the order shown
    Col("ID", 0, lambda c: str(c["id"]), 6, sort="id"),
    Col("CLIENT", 0, client, 21, left=True),  # an IPv4 address and port, whole
    Col("PEER", 14, lambda c: c["peer"], 21, left=True),
    Col("DS", 10, _ds, 8, left=True),
    Col("AGE", 8, lambda c: duration(c["age"]), 6, sort="age"),
    Col("SUBS", 2, lambda c: num(c["observers"]), 4, sort="observers"),
    Col("ASSERT", 1, lambda c: num(c["assertions_in"]), 4, sort="assertions_in"),
    Col("MATCH", 3, lambda c: num(c["assertions_out"]), 4, sort="assertions_out"),
    Col("MSGS IN", 9, lambda c: num(c["messages_in"]), 4),
    Col("MSGS OUT", 9, lambda c: num(c["messages_out"]), 4),
    Col("MSG IN/s", 4, lambda c: rate(c.get("msgs_in_rate")), 4, sort="msgs_in_rate"),
    Col("MSG OUT/s", 4, lambda c: rate(c.get("msgs_out_rate")), 4, sort="msgs_out_rate"),
    Col("BYTES IN", 12, lambda c: nbytes(c["bytes_in"]), 5),
    Col("BYTES OUT", 12, lambda c: nbytes(c["bytes_out"]), 5),
    Col("B IN/s", 16, lambda c: nbytes(c.get("bytes_in_rate")), 5, sort="bytes_in_rate"),
    Col("B OUT/s", 16, lambda c: nbytes(c.get("bytes_out_rate")), 5, sort="bytes_out_rate"),
    Col("PEND", 5, lambda c: nbytes(c["pending_output"]), 5, sort="pending_output"),
    Col("IDLE", 11, lambda c: duration(c.get("idle")), 6),
    Col("HELD", 6, lambda c: ",".join(c["held"]), 5, left=True),
]
CLIENT_MIN = 10
"""The CLIENT column is never narrower (it takes what the other columns leave, up to its
longest name; longer names are cut with …)."""
KEY_HEADS = {"c": "ID", "a": "ASSERT", "s": "SUBS", "m": "MATCH", "i": "MSG IN/s",
             "o": "MSG OUT/s", "b": "B IN/s", "B": "B OUT/s", "p": "PEND", "t": "AGE"}
"""The sort keys, by the heading of the column each sorts on."""


def columns_for(width: int, sort_field: str = "id") -> list[Col]:
    """The columns of a ``width``-character screen sorted on ``sort_field``, in their
    order: ID, CLIENT and the sort column always, then by rank until one does not fit
    (each at its :attr:`Col.width`, one space between): a wider screen only adds
    columns.  PEER and HELD keep their room when they have nothing to show (see
    :func:`choose_columns`), so that the set never depends on the rows."""
    groups: dict[float, list[tuple[int, Col]]] = {}
    for pos, col in enumerate(COLUMNS):
        groups.setdefault(-1 if col.sort == sort_field else col.rank, []).append((pos, col))
    chosen: list[tuple[int, Col]] = []
    used = -1  # one space between columns
    for _rank, group in sorted(groups.items()):
        w = sum(1 + col.width for _pos, col in group)
        if used + w > width and _rank > 0:
            break
        chosen += group
        used += w
    return [col for _pos, col in sorted(chosen, key=lambda x: x[0])]


def choose_columns(rows: list[dict[str, Any]], width: int,
                   sort_field: str) -> tuple[list[Col], int]:
    """The columns shown for ``rows`` (:func:`columns_for` the width, less PEER when no
    client gave a name and HELD when no connection is held: CLIENT takes their room),
    with the width the CLIENT column gets (what the others leave, up to its longest
    name, at least :data:`CLIENT_MIN`)."""
    cols = [c for c in columns_for(width, sort_field)
            if not (c.head == "PEER" and not any(r.get("name") and r["name"] != r["peer"]
                                                 for r in rows))
            and not (c.head == "HELD" and not any(r["held"] for r in rows))]

    def natural(col: Col) -> int:
        return max([len(col.head)] + [len(col.cell(r)) for r in rows])

    others = sum(1 + min(natural(c), c.width) for c in cols if c.head != "CLIENT")
    client_w = max(CLIENT_MIN, min(natural(COLUMNS[1]), width - others))
    return cols, client_w


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
           width: int = 200, height: int | None = None, notice: str | None = None) -> Screen:
    """The screen for ``width`` columns (and ``height`` rows on a terminal): the totals,
    the connections table with the columns that fit, and the busiest patterns; a
    ``notice`` (the server is gone) above them all, the rest as last seen."""
    sv = s.server
    r = s.rates
    head: list[Line] = [[(line, "")] for line in _pack([
        f"dataspace {sv['version']}", f"server {sv['server_id']}",
        f"up {duration(sv.get('uptime'))}", f"memory {nbytes(sv.get('memory_rss'))}",
        f"connections {num(sv['connections'])}", f"assertions {num(sv['assertions'])}",
        f"observers {num(sv['observers'])}", "turns " + _per_s(sv, r, "turns", num, rate),
        "messages in " + _per_s(sv, r, "messages_in", num, rate)
        + " out " + _per_s(sv, r, "messages_out", num, rate),
        "bytes in " + _per_s(sv, r, "bytes_in", nbytes, nbytes)
        + " out " + _per_s(sv, r, "bytes_out", nbytes, nbytes),
    ], width).split("\n")]
    errs = {k: v for k, v in sv.get("errors", {}).items() if v}
    if errs:
        parts = [f"{k} {num(v)}" for k, v in errs.items()]
        head += [[(line, "red")] for line in
                 _pack(["errors: " + parts[0], *parts[1:]], width).split("\n")]
    if notice:
        head.insert(0, [(notice, "bold yellow")])

    heads = [f"{k} {h}" for k, h in KEY_HEADS.items()]
    keys = ([[(line, "dim")] for line in
             _pack(["sort: " + heads[0], *heads[1:], "r reverse", "q quit"], width).split("\n")]
            if live else None)
    pats = list(s.subs["patterns"]) if s.subs is not None else []
    pat_rows = min(len(pats), 10)
    groups = sorted(sv.get("groups") or (), key=lambda g: (g.get("rate") or 0, g["messages"],
                                                          g["jobs"]), reverse=True)
    grp_rows = min(len(groups), GROUP_ROWS)
    room = lines
    if height is not None:  # a terminal: rows that do not fit are left out
        fixed = len(head) + 2  # + the table's title and headings
        if keys is not None and height - fixed - len(keys) >= 1:
            fixed += len(keys)
        else:  # a screen too short for the keys' help and one connection: the connection
            keys = None
        avail = max(1, height - fixed)
        # The groups get up to a sixth of the screen.
        grp_rows = max(0, min(grp_rows, avail // 6 - 2))
        avail = max(1, avail - (grp_rows + 2 if grp_rows else 0))
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
    t = Table(title)
    for col in cols:
        if col.head == "CLIENT":
            t.add_column(col.head, min_width=CLIENT_MIN, max_width=client_w)
        else:
            t.add_column(col.head, right=not col.left, max_width=col.width)
    for c in shown:
        t.add_row(*(col.cell(c) for col in cols))
    screen = Screen(width)
    screen.extend(head)
    screen.extend(t.lines(width))
    if pat_rows:
        pats.sort(key=lambda p: (p.get("rate") or 0, p["delivered"], p["observers"]),
                  reverse=True)
        pt = Table(f"busiest patterns in {s.subs['dataspace']}"  # type: ignore[index]
                   if s.subs is not None else "")
        pt.add_column("PATTERN", min_width=10,
                      max_width=max(10, width - 35))  # the other four and their spaces
        for head_ in ("OBSERVERS", "MATCHES", "EVENTS", "EVENTS/s"):
            pt.add_column(head_, right=True)
        for p in pats[:pat_rows]:
            own = p.get("own")
            pattern: Line | str = ([(f"({own}) ", "dim"), (p["pattern"], "")] if own
                                   else p["pattern"])
            pt.add_row(pattern, num(p["observers"]), num(p["matches"]),
                       num(p["delivered"]), rate(p.get("rate")))
        screen.extend(pt.lines(width))
    if grp_rows:
        screen.extend(_groups_table(groups[:grp_rows], len(groups), width).lines(width))
    if keys is not None:
        screen.extend(keys)
    return screen


GROUP_ROWS = 5
"""Groups shown at most (the busiest first); ``--json`` gives those of the summary."""


def _groups_table(groups: list[dict[str, Any]], total: int, width: int) -> Table:
    """The groups of observers: members, messages given (and their rate), jobs held and
    waiting, reassignments."""
    more = f" (busiest {len(groups)} of {total})" if total > len(groups) else ""
    t = Table(f"groups{more}")
    t.add_column("GROUP", min_width=5, max_width=16)
    t.add_column("PATTERN", min_width=7, max_width=max(7, width - 17 - 6 * 5 - 1))
    for col in ("MEMB", "MSGS", "MSG/s", "JOBS", "WAIT", "MOVED"):
        t.add_column(col, right=True)
    for g in groups:
        name = g["group"] if g.get("dataspace") in (None, "root") else \
            f"{g['group']} ({g['dataspace']})"
        t.add_row(name, g["pattern"], num(g.get("member_count")), num(g["messages"]),
                  rate(g.get("rate")), num(g["jobs"]), num(g["pending"]),
                  num(g["reassigned"]))
    return t


def _per_s(sv: dict[str, Any], rates: dict[str, float | None], key: str,
           total: Callable[[Any], str], per: Callable[[Any], str]) -> str:
    r = rates.get(key)
    return total(sv[key]) + ("" if r is None else f" ({per(r)}/s)")


# ------------------------------------------------------------------------------------
# The live screen on a terminal: ANSI escape sequences (ECMA-48 and xterm's private
# modes, which every terminal in use today understands), no curses


ENTER = "\x1b[?1049h\x1b[?25l\x1b[?7l\x1b[2J"
"""The alternate screen, the cursor hidden, no wrapping at the margin, cleared."""
LEAVE = "\x1b[0m\x1b[?7h\x1b[?25h\x1b[?1049l"
"""Back: attributes reset, wrapping on, the cursor shown, the normal screen as it was."""


def styles_for(out: TextIO) -> bool:
    """Whether ``out`` takes escape sequences: a terminal that is not ``TERM=dumb``."""
    try:
        return out.isatty() and os.environ.get("TERM") != "dumb"
    except ValueError:  # closed
        return False


_SEQUENCE = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|O.|[^\x1b])")
"""What a key other than a letter sends (an arrow: ``ESC [ A``; Alt-x: ``ESC x``)."""


class Terminal:
    """The live screen: in the alternate screen, the cursor hidden, keys read without Enter
    (cbreak: Ctrl-C still interrupts), redrawn at once when the window changes size (or
    the process is continued after Ctrl-Z).  Leaving -- q, Ctrl-C, an error, SIGTERM or
    SIGHUP -- gives the terminal back as it was; Ctrl-Z gives it back until ``fg``."""

    def __init__(self, out: TextIO, fd: int) -> None:
        self.out, self.fd = out, fd
        self.colour = not os.environ.get("NO_COLOR")
        self._saved: list[Any] | None = None
        self._handlers: dict[int, Any] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def __enter__(self) -> Terminal:
        try:
            self._enter()
            for sig, handler in ((signal.SIGWINCH, self._resized), (signal.SIGTSTP, self._suspend),
                                 (signal.SIGTERM, self._ended), (signal.SIGHUP, self._ended)):
                if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                    self._handlers[sig] = signal.signal(sig, handler)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers.clear()
        self._leave()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _enter(self) -> None:
        import termios
        import tty

        self._saved = termios.tcgetattr(self.fd)
        tty.setcbreak(self.fd, termios.TCSANOW)
        self._write(ENTER)

    def _leave(self) -> None:
        import termios

        self._write(LEAVE)
        if self._saved is not None:
            try:
                termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            except termios.error:  # the terminal is gone (SIGHUP)
                pass
            self._saved = None

    def _write(self, data: str) -> None:
        try:
            self.out.write(data)
            self.out.flush()
        except OSError:  # the terminal is gone: nothing left to restore on it
            pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b".")
        except (BlockingIOError, OSError):  # a wake is pending already
            pass

    def _resized(self, _sig: int, _frame: FrameType | None) -> None:
        self._wake()

    def _suspend(self, sig: int, _frame: FrameType | None) -> None:
        self._leave()
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)  # stopped here until continued (fg)
        signal.signal(sig, self._suspend)
        self._enter()
        self._wake()

    def _ended(self, sig: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + sig)  # the screen is left on the way out

    def size(self) -> tuple[int, int]:
        """Columns and lines ($COLUMNS and $LINES first, as for every program)."""
        size = shutil.get_terminal_size()
        return max(1, size.columns), max(1, size.lines)

    def draw(self, screen: Screen, height: int) -> None:
        """``screen`` from the top left, each line cleared after its end, the rest of the
        screen cleared; lines beyond ``height`` are left out (no scrolling)."""
        lines = screen.styled(self.colour)[:height]
        frame = [f"\x1b[{row};1H{text}" + ("\x1b[K" if cells(line_) < screen.width else "")
                 for row, (text, line_) in enumerate(zip(lines, screen.plain()), 1)]
        if len(lines) < height:
            frame.append(f"\x1b[{len(lines) + 1};1H\x1b[J")
        self._write("".join(frame))

    def read(self, timeout: float) -> str | None:
        """The keys typed within ``timeout`` seconds (None: none; "": woken to redraw;
        keys that send escape sequences, such as arrows, left out; "q" at the end of the
        input)."""
        ready, _w, _x = select.select([self.fd, self._wake_r], [], [], max(0.0, timeout))
        if self._wake_r in ready:
            os.read(self._wake_r, 64)
            return ""
        if not ready:
            return None
        data = os.read(self.fd, 64).decode(errors="replace")
        if not data:
            return "q"
        return data if data == "\x1b" else _SEQUENCE.sub("", data)  # Esc alone, or keys


# ------------------------------------------------------------------------------------
# A server that goes away (a restart): wait and reconnect


BACKOFF = (0.5, 1.0, 2.0, 4.0, 5.0)
"""Seconds before each attempt to reach a server that went away (then every 5 s)."""


def gone(e: HttpFail) -> str | None:
    """Why ``e`` means the server is not there now -- refused, reset, timed out,
    shutting down (503) -- as a few words; None for an answer that will not change by
    waiting (a token refused, not a dataspace server)."""
    cause: BaseException | None = e.__context__
    while cause is not None:
        if isinstance(cause, urllib.error.HTTPError):
            return f"{cause.code} {cause.reason}".lower() if cause.code in (502, 503, 504) else None
        if isinstance(cause, urllib.error.URLError) and isinstance(cause.reason, BaseException):
            cause = cause.reason
            continue
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, ConnectionResetError | http.client.RemoteDisconnected | BrokenPipeError):
            return "connection closed"
        if isinstance(cause, TimeoutError):
            return "no answer"
        if isinstance(cause, OSError):
            return cause.strerror.lower() if cause.strerror else type(cause).__name__
        cause = cause.__context__
    return None


class Reconnect:
    """The attempts to reach a server that went away: when the next is due and what the
    screen (or the log) says meanwhile."""

    def __init__(self, why: str, now: float) -> None:
        self.why = why
        self.attempts = 0
        self.next_at = now + BACKOFF[0]

    def failed(self, why: str, now: float) -> None:
        self.why = why
        self.attempts += 1
        self.next_at = now + BACKOFF[min(self.attempts, len(BACKOFF) - 1)]

    def notice(self, now: float) -> str:
        tried = f", {plural(self.attempts, 'attempt')}" if self.attempts else ""
        return (f"server gone ({self.why}{tried}), reconnecting in "
                f"{max(0.0, self.next_at - now):.0f}s; q quits")


def snapshot(s: Sample, sort: str, reverse: bool, lines: int) -> dict[str, Any]:
    """What the screen shows, as one JSON object: the server's figures and their rates
    per second (null before a second reading), the connections in the screen's order
    (at most ``lines``; every field of /api/connections, with the rates), the ten
    busiest patterns (``own``: the server's own observer, e.g. a recorder), and the
    server's groups of observers (``server.groups``, each with its ``rate`` of messages
    given per second)."""
    field = SORTS[sort][0]
    rows = sorted(s.conns["connections"], key=lambda c: c.get(field) or 0, reverse=field != "id")
    if reverse:
        rows.reverse()
    pats = None
    if s.subs is not None:
        pats = sorted(s.subs["patterns"], key=lambda p: (p.get("rate") or 0, p["delivered"],
                                                          p["observers"]), reverse=True)[:10]
    return {
        "time": round(time.time(), 3),
        "server": s.server,
        "rates": s.rates,
        "sort": field,
        "reverse": reverse,
        "connections": {"count": s.conns["count"], "shown": rows[:lines]},
        "patterns": (None if s.subs is None else
                     {"dataspace": s.subs["dataspace"], "busiest": pats}),
    }


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
    if args.json:
        try:
            return _run_json(api, args, first)
        except KeyboardInterrupt:
            return 0
    with_styles = styles_for(sys.stdout)
    if hasattr(sys.stdout, "reconfigure"):  # a name the output's encoding lacks: as ?
        sys.stdout.reconfigure(errors="replace")
    if not (with_styles and sys.stdin.isatty() and not args.once):
        # One snapshot: at the terminal's width (styled), else $COLUMNS or 200 (no wrapping)
        if with_styles:
            width = shutil.get_terminal_size().columns
        else:
            width = int(os.environ.get("COLUMNS", "0") or 0) or 200
        screen = render(first, args.sort, False, args.lines, False, width)
        text = (screen.styled(not os.environ.get("NO_COLOR")) if with_styles
                else screen.plain())
        sys.stdout.write("\n".join(text) + "\n")
        sys.stdout.flush()
        return 0
    try:
        return _live(api, args, first)
    except KeyboardInterrupt:  # Ctrl-C: the screen is left on the way here
        return 0


def _live(api: Api, args: argparse.Namespace, sample: Sample) -> int:
    """The live screen until q, Ctrl-C or an answer that waiting will not change."""
    sort, reverse = args.sort, False
    away: Reconnect | None = None
    failed: HttpFail | None = None
    with Terminal(sys.stdout, sys.stdin.fileno()) as term:
        def draw() -> None:
            w, h = term.size()
            notice = away.notice(time.monotonic()) if away is not None else None
            term.draw(render(sample, sort, reverse, args.lines, True, w, h, notice), h)

        draw()
        next_at = time.monotonic() + args.interval
        while failed is None:
            # While the server is away, the screen's countdown moves every second.
            due = next_at if away is None else min(away.next_at, time.monotonic() + 1.0)
            keys = term.read(due - time.monotonic())
            for key in keys or "":
                if key in ("q", "Q", "\x03", "\x1b"):
                    return 0
                if key == "r":
                    reverse = not reverse
                elif key in SORTS:
                    sort, reverse = key, False
            now = time.monotonic()
            if keys is None and (away is None or now >= away.next_at):
                try:
                    sample = Sample(api, args.dataspace, sample if away is None else None)
                    away = None
                except HttpFail as e:
                    why = gone(e)
                    if why is None:
                        failed = e
                        break
                    if away is None:
                        away = Reconnect(why, time.monotonic())
                    else:
                        away.failed(why, time.monotonic())
                next_at = time.monotonic() + args.interval
            draw()
    print(f"dataspace top: {failed}", file=sys.stderr)  # on the normal screen, which stays
    return 1


def _run_json(api: Api, args: argparse.Namespace, sample: Sample) -> int:
    """``--json``: a :func:`snapshot` per line, every --interval until Ctrl-C (once with
    --once); while the server is away, one line on standard error, and reconnecting."""
    out = sys.stdout
    out.write(json.dumps(snapshot(sample, args.sort, False, args.lines), ensure_ascii=False)
              + "\n")
    out.flush()
    if args.once:
        return 0
    away: Reconnect | None = None
    pause = threading.Event()  # never set: the wait between two readings
    next_at = time.monotonic() + args.interval
    while True:
        pause.wait(max(0.0, (next_at if away is None else away.next_at) - time.monotonic()))
        try:
            sample = Sample(api, args.dataspace, sample if away is None else None)
        except HttpFail as e:
            why = gone(e)
            if why is None:
                print(f"dataspace top: {e}", file=sys.stderr)
                return 1
            if away is None:
                away = Reconnect(why, time.monotonic())
                print(f"dataspace top: server gone ({why}), reconnecting ...", file=sys.stderr,
                      flush=True)
            else:
                away.failed(why, time.monotonic())
            continue
        if away is not None:
            away = None
            print(f"dataspace top: reconnected (server {sample.server.get('server_id')})",
                  file=sys.stderr, flush=True)
        out.write(json.dumps(snapshot(sample, args.sort, False, args.lines),
                             ensure_ascii=False) + "\n")
        out.flush()
        next_at = time.monotonic() + args.interval
