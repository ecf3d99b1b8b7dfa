"""``dataspace clients``: a server's connections, once (``GET /api/connections``), as
Redis's ``CLIENT LIST`` and ``nats server report connections`` give them."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

from ._http import HTTP_HELP, Api, HttpFail, add_http_args, duration
from .top import nbytes, num

PROG = "dataspace clients"

SORTS: dict[str, tuple[str, bool]] = {  # --sort KEY: (the row's field, biggest first)
    "id": ("id", False),
    "name": ("name", False),
    "address": ("peer", False),
    "age": ("age", True),
    "assertions": ("assertions", True),
    "observers": ("observers", True),
    "msgs-in": ("messages_in", True),
    "msgs-out": ("messages_out", True),
    "bytes-in": ("bytes_in", True),
    "bytes-out": ("bytes_out", True),
    "idle": ("idle", True),
}

EXAMPLES = """\
examples:
  dataspace clients                            every connection, by id
  dataspace clients --sort msgs-in             the busiest senders first
  dataspace clients --sort age --reverse       the newest first
  dataspace clients --json | jq -r 'select(.tls | not) | .peer'
  dataspace clients --url http://10.0.0.2:7480 --token @admin.sturdyref

columns: ID, CLIENT (the name it gave: --name, connect(name=...); - if none), ADDRESS
(its address and port), AGE (connected for), VIA (tcp, tls, unix, ws, wss: TLS shows as
tls and wss), ASSERT (what it asserts now, its subscriptions not counted), SUBS (its
subscriptions: observers), MSG IN / MSG OUT (messages it sent / was delivered), B IN /
B OUT (bytes received from it / sent to it).  Counts are short (1.2k, 34k, 1.2M), bytes
in powers of 1024 (1.5K, 3.4M).  On a terminal the table fits its width: CLIENT takes
what the other columns leave (cut with …); in a pipe nothing is cut.

--json prints one object per line per connection, with the fields of GET
/api/connections (docs/operations.md): id, peer, name, address, transport, tls,
tls_version, since, age, assertions, observers, assertions_in, assertions_out,
messages_in, messages_out, bytes_in, bytes_out, pending_output, idle, ...

--sort KEY: """ + ", ".join(SORTS) + """ (numbers biggest first; --reverse turns it).

""" + HTTP_HELP


def register(sub: Any) -> None:
    p = sub.add_parser(
        "clients", aliases=["connections"],
        help="list a server's connections once (names, addresses, traffic, TLS)",
        description="List the connections of a running server -- each client's name, "
        "address, age, assertions, subscriptions, messages and bytes in and out, TLS or "
        "not -- read from its HTTP port (like Redis's CLIENT LIST; `dataspace top` shows "
        "them live).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sort", "-s", default="id", choices=list(SORTS), metavar="KEY",
                   help="order by KEY (default id; see below)")
    p.add_argument("--reverse", "-r", action="store_true", help="the other order")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per connection, per line (GET /api/connections' "
                   "rows)")
    add_http_args(p)
    p.set_defaults(func=run)


class Col:
    """A column: its heading, its cell, whether it is left-aligned, and its rank (the
    higher ranks go first when the terminal is too narrow)."""

    def __init__(self, head: str, cell: Callable[[dict[str, Any]], str], rank: int = 0,
                 left: bool = False) -> None:
        self.head, self.cell, self.rank, self.left = head, cell, rank, left


def _name(c: dict[str, Any]) -> str:
    return str(c.get("name") or "-")


COLUMNS = [
    Col("ID", lambda c: str(c["id"])),
    Col("CLIENT", _name, left=True),
    Col("ADDRESS", lambda c: str(c.get("peer") or "-"), 1, left=True),
    Col("AGE", lambda c: duration(c.get("age")), 3),
    Col("VIA", lambda c: str(c.get("transport") or "-"), 2, left=True),
    Col("ASSERT", lambda c: num(c.get("assertions", c.get("assertions_in"))), 1),
    Col("SUBS", lambda c: num(c.get("observers")), 1),
    Col("MSG IN", lambda c: num(c.get("messages_in")), 2),
    Col("MSG OUT", lambda c: num(c.get("messages_out")), 2),
    Col("B IN", lambda c: nbytes(c.get("bytes_in")), 4),
    Col("B OUT", lambda c: nbytes(c.get("bytes_out")), 4),
]
CLIENT_MIN = 8
"""The CLIENT column's width at least, on a terminal (longer names are cut with …)."""
ADDRESS_MAX = 21
"""The ADDRESS column's width at most, on a terminal: any IPv4 address and port fit, a
longer one (IPv6, a Unix socket's path) keeps its end (``…/run/ds.sock``)."""
ADDRESS_MIN = 12
"""... and at least, before whole columns go."""


def table(rows: list[dict[str, Any]], width: int | None) -> list[str]:
    """The rows as lines of a table that fits ``width`` characters (None: as wide as the
    cells make it, nothing cut).  Narrower than the cells: ADDRESS keeps its end, down
    to :data:`ADDRESS_MIN`; then the columns of the highest rank go, together; CLIENT
    takes what the others leave (at least :data:`CLIENT_MIN`)."""
    cols = list(COLUMNS)
    cells = [[col.cell(r) for col in cols] for r in rows]
    natural = [max([len(col.head)] + [len(row[i]) for row in cells])
               for i, col in enumerate(cols)]
    widths = list(natural)
    if width is not None and sum(widths) + len(widths) - 1 > width:
        while True:
            widths = list(natural)
            at = {col.head: i for i, col in enumerate(cols)}
            name_at, address_at = at["CLIENT"], at.get("ADDRESS")
            others = sum(w for i, w in enumerate(widths) if i != name_at) + len(widths) - 1
            if address_at is not None:
                address = min(widths[address_at], ADDRESS_MAX)
                others -= widths[address_at] - address
                cut = min(max(0, others + CLIENT_MIN - width), address - ADDRESS_MIN)
                widths[address_at] = address - max(0, cut)
                others -= max(0, cut)
            top = max(col.rank for col in cols)
            if others + CLIENT_MIN <= width or top == 0:
                widths[name_at] = max(CLIENT_MIN, min(natural[name_at], width - others))
                break
            keep = [i for i, col in enumerate(cols) if col.rank != top]
            cols = [cols[i] for i in keep]
            natural = [natural[i] for i in keep]
            cells = [[row[i] for i in keep] for row in cells]
    out = []
    for row in [[col.head for col in cols], *cells]:
        parts = []
        for i, (col, text) in enumerate(zip(cols, row)):
            w = widths[i]
            if len(text) > w:
                text = "…" + text[len(text) - w + 1:] if col.head == "ADDRESS" else \
                    text[: w - 1] + "…"
            parts.append(text.ljust(w) if col.left else text.rjust(w))
        out.append(" ".join(parts).rstrip())
    return out


def _key(field: str) -> Callable[[dict[str, Any]], Any]:
    def key(c: dict[str, Any]) -> Any:
        v = c.get(field)
        if field in ("name", "peer"):
            return (v is None, str(v or ""))
        return v if isinstance(v, int | float) else 0

    return key


def run(args: argparse.Namespace) -> int:
    try:
        api = Api(args)
        doc = api.get("/api/connections")
    except HttpFail as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    if doc.get("scope") != "admin":
        print(f"{PROG}: this token sees only how many connections there are "
              f"({doc.get('count', 0):,}): give the server's root sturdyref (--token "
              "@root.sturdyref, or --data-dir DIR of the server)", file=sys.stderr)
        return 1
    rows = list(doc.get("connections") or ())
    field, biggest_first = SORTS[args.sort]
    rows.sort(key=_key("id"))
    rows.sort(key=_key(field), reverse=biggest_first != args.reverse)
    if args.json:
        for r in rows:
            sys.stdout.write(json.dumps(r, ensure_ascii=False) + "\n")
        sys.stdout.flush()
        return 0
    width = None
    if sys.stdout.isatty():
        width = shutil.get_terminal_size().columns
    elif os.environ.get("COLUMNS", "").isdigit():
        width = int(os.environ["COLUMNS"])
    print("\n".join(table(rows, width)), flush=True)
    if not rows:
        print(f"{PROG}: no connections", file=sys.stderr)
    return 0
