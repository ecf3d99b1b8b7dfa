"""``dataspace scry``: read a stream by path from another machine (seed 004)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from .. import scry
from ..values import stringify
from ._json import to_json

EXAMPLES = """\
examples:
  dataspace scry follow udp://127.0.0.1:7413/chat     from the next entry on
  dataspace scry follow udp://127.0.0.1:7413/chat --from start
                                                    from the oldest kept
  dataspace scry follow udp://127.0.0.1:7413/chat --from 34 --count 10
  dataspace scry follow udp://10.0.0.2:7413/chat --poll fixed:1
                                                    a naive poller, to compare
  dataspace scry follow udp://a:7413,b:7413/chat      members: next if one goes
  dataspace scry get udp://127.0.0.1:7413/chat/34     one entry, waiting for it
  dataspace scry follow udp://127.0.0.1:7413/chat --json | jq .value

Each entry is printed once, in order, as `INDEX VALUE-TEXT` on its own line (stdout);
with --json as one object per line: {"index", "text" (Preserves text), "value" (in JSON,
as `dataspace observe --json` maps values: docs/broker.md)}.
On stderr: `following URL from entry N` once the publisher answers, and a line when
nothing answers for 3 s (it keeps trying; --timeout gives up).  The server publishes
streams with `dataspace serve --scry-udp HOST:PORT --publish STREAM`.  Ctrl-C stops.
See docs/scry.md.
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "scry", help="follow a stream published by a server, by path, over UDP",
        description="Read the entries of a stream a server publishes (--scry-udp, --publish) "
        "by path: the publisher broadcasts new entries to waiting readers, and readers poll "
        "on a dynamic interval.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ssub = p.add_subparsers(dest="scry_cmd", metavar="COMMAND")
    f = ssub.add_parser("follow", help="print each entry of a stream once, in order",
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    f.add_argument("url", metavar="udp://HOST:PORT[,HOST:PORT...]/STREAM")
    f.add_argument("--from", dest="start", default="next", metavar="N|start|next",
                   help="first entry: an index, start (the oldest kept) or next (the next "
                   "to be appended; the default)")
    f.add_argument("--count", type=int, metavar="K", help="stop after K entries")
    f.add_argument("--poll", default="adaptive", metavar="adaptive|poisson|fixed:SECONDS",
                   help="when to poll while waiting (default adaptive)")
    f.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="give up (exit 1) when nothing has answered for this long; default: "
                   "keep trying (saying so after 3 s)")
    f.add_argument("--json", action="store_true",
                   help="one JSON object per entry: {\"index\", \"text\", \"value\"}")
    f.set_defaults(func=run_follow)
    g = ssub.add_parser("get", help="print one entry, waiting for it to exist",
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("url", metavar="udp://HOST:PORT/STREAM/INDEX")
    g.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="give up after this long (exit 1); default: wait")
    g.add_argument("--json", action="store_true",
                   help="print the entry as a JSON object: {\"index\", \"text\", \"value\"}")
    g.set_defaults(func=run_get)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _line(index: int, entry: scry.ScryEntry, as_json: bool = False) -> str:
    try:
        text = stringify(entry.value)
    except Exception as e:  # pragma: no cover - the entry's hash was checked
        text = f"#!undecodable entry: {e}"
        if as_json:
            return json.dumps({"index": index, "text": text, "value": None})
    if as_json:
        return json.dumps({"index": index, "text": text, "value": to_json(entry.value)},
                          ensure_ascii=False)
    return f"{index} {text}"


def _notify(line: str) -> None:
    print(f"dataspace scry: {line}", file=sys.stderr, flush=True)


def _start(text: str) -> int | str:
    if text in ("start", "next"):
        return text
    if text.isdigit():
        return int(text)
    raise scry.ScryError(f"--from {text!r}: an index, start or next")


async def _follow(args: argparse.Namespace, start: int | str) -> int:
    n = 0
    async for e in scry.follow(args.url, start, poll=args.poll, timeout=args.timeout,
                               notify=_notify):
        sys.stdout.write(_line(e.index, e, args.json) + "\n")
        sys.stdout.flush()
        n += 1
        if args.count is not None and n >= args.count:
            break
    return 0


def run_follow(args: argparse.Namespace) -> int:
    if args.count is not None and args.count < 1:
        print("dataspace scry: --count must be at least 1", file=sys.stderr)
        return 2
    if args.timeout is not None and not args.timeout > 0:
        print("dataspace scry: --timeout must be a number of seconds above 0", file=sys.stderr)
        return 2
    try:
        scry.parse_url(args.url)
        scry.poll_model(args.poll)
        start = _start(args.start)
    except scry.ScryError as e:
        print(f"dataspace scry: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_follow(args, start))
    except scry.ScryError as e:
        print(f"dataspace scry: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def run_get(args: argparse.Namespace) -> int:
    try:
        scry.parse_url(args.url, index=True)
    except scry.ScryError as e:
        print(f"dataspace scry: {e}", file=sys.stderr)
        return 2
    try:
        e = asyncio.run(scry.get(args.url, timeout=args.timeout, notify=_notify))
    except scry.ScryError as e:
        print(f"dataspace scry: {e}", file=sys.stderr)
        return 1
    except TimeoutError:
        print(f"dataspace scry: {args.url} did not appear within {args.timeout:g} s",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    print(_line(e.index, e, args.json), flush=True)
    return 0
