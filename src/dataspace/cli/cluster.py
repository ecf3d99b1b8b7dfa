"""``dataspace cluster``: the members and routes of a running cluster member; a new
cluster secret."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..broker.cluster import CLUSTER_STATUS_FILE, SECRET_FILE, make_secret
from ..datadir import DATA_DIR_HELP, resolve_data_dir
from ._voice import plural
from .link import STALE, _age

EXAMPLES = f"""\
examples:
  dataspace cluster secret ./cluster.secret   a new secret, for every member
  dataspace cluster status                    members and routes of the server
                                              using the data directory
  dataspace cluster status --data-dir ./a     the member run with --data-dir ./a
  dataspace cluster status --json             as JSON (what the server writes)

A member (`dataspace serve --cluster HOST:PORT ...`) writes its cluster's status to
DATA_DIR/{CLUSTER_STATUS_FILE} every 2 seconds; `status` reads it.  Without
--cluster-secret, a member reads its secret from DATA_DIR/{SECRET_FILE}.  See
docs/cluster.md.
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "cluster", help="the members and routes of a cluster; a new cluster secret",
        description="A cluster is a full mesh of routes between servers: one dataspace, "
        "any member can die and its clients fail over to another (docs/cluster.md).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    csub = p.add_subparsers(dest="cluster_cmd", metavar="COMMAND")
    st = csub.add_parser("status", help="members, routes up or down, what crosses them",
                         epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("--data-dir", metavar="DIR", help=DATA_DIR_HELP)
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.set_defaults(func=run_status)
    se = csub.add_parser("secret", help="write a new cluster secret to FILE (mode 600)",
                         epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    se.add_argument("file", metavar="FILE",
                    help=f"where to write it (e.g. DATA_DIR/{SECRET_FILE}); an existing file "
                    "is kept unless --force")
    se.add_argument("--force", action="store_true", help="replace an existing file")
    se.set_defaults(func=run_secret)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_secret(args: argparse.Namespace) -> int:
    path = Path(args.file).expanduser()
    if path.exists() and not args.force:
        print(f"dataspace cluster: {path} exists (a cluster's members must share one "
              "secret: copy this one to the new member, or give --force to replace it)",
              file=sys.stderr)
        return 1
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, make_secret().encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        print(f"dataspace cluster: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote a new cluster secret to {path}; copy it to every member (as "
          f"DATA_DIR/{SECRET_FILE}, or pass --cluster-secret FILE)")
    return 0


def _route_lines(r: dict[str, Any]) -> list[str]:
    arrow = "->" if r.get("direction") == "out" else "<-"
    where = r.get("member_address") or r.get("address")
    since = r.get("since")
    up = f"up for {_age(since)}" if r.get("connected") and since else r.get("state", "down")
    out = [f"  {arrow} {r.get('peer_id')} at {where}  {up}"]
    out.append(f"       upstreamed {r.get('upstreamed', 0)} of {r.get('canonical', 0)} wanted, "
               f"{r.get('pending', 0)} pending; the peer wants {r.get('peer_wants', 0)}")
    out.append(f"       messages: {r.get('messages_forwarded', 0):,} forwarded, "
               f"{r.get('messages_suppressed', 0):,} suppressed, "
               f"{r.get('messages_received', 0):,} received; assertions: "
               f"{r.get('assertions_held_for_peer', 0):,} held for the peer, "
               f"{r.get('assertions_from_peer', 0):,} from it")
    if "bytes_out" in r:
        out.append(f"       bytes: {r['bytes_out']:,} out, {r['bytes_in']:,} in")
    return out


def _recording_lines(rec: dict[str, Any], me: str) -> list[str]:
    """What this member records (docs/cluster.md, "Recording in a cluster")."""
    out = [f"  {rec.get('summary', '')}"]
    for s in rec.get("streams", []):
        lead = s.get("led_by")
        who = ("this member" if s.get("leader") else f"member {lead}" if lead else
               "no member yet")
        events = "+".join(s.get("events", []))
        out.append(f"    stream {s.get('stream')} ({events}): led by {who}; "
                   f"{s.get('recorded', 0):,} recorded here, {s.get('skipped', 0):,} left to "
                   "the member they entered through")
    if rec.get("error"):
        out.append(f"    the store: {rec['error']}")
    return out


def print_status(doc: dict[str, Any], running: bool = True) -> None:
    members = doc.get("members", [])
    up = [m for m in members if m.get("up")]
    print(f"cluster {doc.get('cluster')}: member {doc.get('id')} at {doc.get('address')}; "
          f"{1 + len(up)} of {plural(1 + len(members), 'member')} up"
          + ("" if running else " (when the server last wrote its status)"))
    rec = doc.get("recording")
    if isinstance(rec, dict):
        for line in _recording_lines(rec, str(doc.get("id"))):
            print(line)
    routes = doc.get("routes", [])
    for r in routes:
        for line in _route_lines(r):
            print(line)
    routed = {r.get("peer_id") for r in routes}
    for m in members:
        if m.get("up") and m.get("id") in routed:
            continue
        who = m.get("id") or "(not reached yet)"
        since = m.get("since_s")
        state = "down" if m.get("id") else "not reached"
        line = f"  member {who} at {m.get('address')}: {state}"
        if since is not None and running:
            line += f" for {_age(time.time() - since)}"
        if "attempts" in m:
            line += f" (attempts {m['attempts']}"
            line += f", last error: {m['last_error']})" if m.get("last_error") else ")"
        print(line)
    ignored, closed = doc.get("members_ignored", 0), doc.get("strangers_closed", 0)
    if ignored or closed or doc.get("strangers"):
        print(f"  strangers on the cluster port: {doc.get('strangers', 0)} now, {closed:,} "
              f"closed; members named by gossip past the table ({doc.get('max_members', 64)}): "
              f"{ignored:,} ignored")


def run_status(args: argparse.Namespace) -> int:
    data_dir = resolve_data_dir(args.data_dir, create=False)
    path = data_dir / CLUSTER_STATUS_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        print(f"dataspace cluster: no cluster status at {path}: the server using {data_dir} "
              "is not a cluster member (start it with --cluster HOST:PORT), or is not "
              "running", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"dataspace cluster: cannot read {path}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    written = float(doc.get("time", 0))
    running = time.time() - written <= STALE
    if not running:
        print(f"dataspace cluster: {path} was written {_age(written)} ago: the server is not "
              "running; what follows is its last status", file=sys.stderr)
    print_status(doc, running)
    return 0
