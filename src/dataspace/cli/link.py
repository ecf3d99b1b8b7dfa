"""``dataspace link``: the links of a running server to other servers."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from ..broker.link import STATUS_FILE
from ..datadir import DATA_DIR_HELP, resolve_data_dir

EXAMPLES = """\
examples:
  dataspace link status                    every link of the server using the
                                           data directory
  dataspace link status --data-dir ./a     the server run with --data-dir ./a
  dataspace link status --json             as JSON (what the server writes)

A server started with --link (and any server a link reaches) writes its links' status to
DATA_DIR/links.json every 2 seconds; this command reads it.  See docs/links.md.
"""

STALE = 10.0
"""Seconds after which the status file is old: the server is probably not running."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "link", help="show the links of a running server to other servers",
        description="Links share a dataspace between servers; each carries only what the "
        "other side's subscribers want (docs/links.md).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lsub = p.add_subparsers(dest="link_cmd", metavar="COMMAND")
    st = lsub.add_parser("status", help="each link: connected or not, subscriptions, traffic",
                         epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("--data-dir", metavar="DIR", help=DATA_DIR_HELP)
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.set_defaults(func=run_status)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _age(t: float, now: float | None = None) -> str:
    s = max(0.0, (time.time() if now is None else now) - t)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _state_line(r: dict[str, Any], written: float, running: bool) -> str:
    """What a link is doing, in words: ``connected for 54 s, peer ...``, ``refused ...``."""
    state = r.get("state") or ("up" if r.get("connected") else "down")
    peer = f", peer {r['peer_id']}" if r.get("peer_id") else ""
    since = r.get("since") if state in ("up", "checking") else r.get("down_since")
    if not running:
        # The server is gone: its last status says nothing about now (no counting up).
        was = {"up": "was connected", "checking": "was being checked for cycles",
               "refused": "was refused", "down": "was down",
               "connecting": "was not connected"}.get(state, f"was {state}")
        held = f" for {_age(since, written)}" if since else ""
        return f"{was}{held} when the server last wrote its status, {_age(written)} ago{peer}"
    if state == "up":
        return f"connected for {_age(since)}{peer}" if since else f"connected{peer}"
    if state == "checking":
        return f"checking that it closes no cycle{peer}"
    nxt = r.get("next_attempt")
    retry = f"; next attempt in {max(0.0, nxt - time.time()):.0f} s" if nxt else ""
    if state == "refused":
        if r.get("direction") == "in" and since:
            return f"refused {_age(since)} ago{peer}"
        return f"refused{peer}{retry}"
    if r.get("direction") == "in":
        return f"down for {_age(since)}{peer}" if since else f"down{peer}"
    return f"not connected (attempts: {r.get('attempts', 0)}){retry}"


def _alive(pid: object) -> bool:
    """Whether the server process that wrote the status still runs (True when the file
    names none: an older server's).  The status file is in the server's own data
    directory, so its pid is of this machine."""
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        return True
    return True


def run_status(args: argparse.Namespace) -> int:
    data_dir = resolve_data_dir(args.data_dir, create=False)
    path = data_dir / STATUS_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        print(f"dataspace link: no link status at {path}: the server using {data_dir} has "
              "no links (start it with --link ADDRESS --link-cap CAP), or is not running",
              file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"dataspace link: cannot read {path}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    written = float(doc.get("time", 0))
    gone = not _alive(doc.get("pid"))
    running = time.time() - written <= STALE and not gone
    if not running:
        why = (f"its process {doc['pid']} has ended" if gone
               else f"{path} was written {_age(written)} ago")
        print(f"dataspace link: the server is not running ({why}): its links are down; "
              f"what follows is its last status, written {_age(written)} ago", file=sys.stderr)
    rows = doc.get("links", [])
    if not rows:
        print("no links")
        return 0
    for r in rows:
        arrow = "->" if r.get("direction") == "out" else "<-"
        print(f"{arrow} {r.get('link')}  [{r.get('dataspace')}]  {_state_line(r, written, running)}")
        if r.get("refused"):
            print(f"     refused: {r['refused']}")
        elif r.get("last_error"):
            print(f"     last error: {r['last_error']}")
        if "upstreamed" not in r:
            continue
        print(f"     upstreamed {r.get('upstreamed', 0)} of {r.get('canonical', 0)} wanted, "
              f"{r.get('negative', 0)} negative, {r.get('pending', 0)} pending; "
              f"the peer wants {r.get('peer_wants', 0)} ({r.get('peer_negative', 0)} negative)")
        print(f"     messages: {r.get('messages_forwarded', 0)} forwarded, "
              f"{r.get('messages_suppressed', 0)} suppressed, {r.get('messages_received', 0)} "
              f"received; assertions: {r.get('assertions_held_for_peer', 0)} held for the peer, "
              f"{r.get('assertions_from_peer', 0)} from it")
        if "bytes_out" in r:
            print(f"     bytes: {r['bytes_out']:,} out, {r['bytes_in']:,} in; requests sent "
                  f"{r.get('requests_sent', 0)} ({r.get('retransmissions', 0)} retransmitted)")
    return 0
