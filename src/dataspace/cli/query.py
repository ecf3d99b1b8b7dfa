"""``dataspace query PATTERN``: print the assertions matching a pattern now, then exit."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from ..pattern import Arr, Dict, Discard, Pattern, PatternError, Rec, parse_pattern
from ._client import CONNECTION_HELP, add_connection_args, check_subscription, open_dataspace
from .observe import event_line

EXAMPLES = """\
examples:
  dataspace query '<Present $who>'                  who is present now
  dataspace query '<Present $who>' --captures       just the captured fields
  dataspace query '<Lease $job $owner>' --json      a JSON object per match
  dataspace query '$v'                              every assertion

output: one line per distinct match, in Preserves order: the pattern with each $ filled
with what it captured (with --captures, the sequence of the captures; with --json, one
object {"text": ..., "values": [...]} per line: see `dataspace observe --help`).
Nothing is printed when nothing matches (a note goes to stderr); the exit status is 0
either way.

A one-shot `observe` (like `redis-cli KEYS` or `nats kv ls`): it subscribes, waits until
the server has answered a round trip -- by then the server has sent every assertion
matching at that moment -- and exits.  Messages are not assertions: use `observe` to
see them.  In Python: `await ds.query(PATTERN)`.

""" + CONNECTION_HELP


def register(sub: Any) -> None:
    p = sub.add_parser(
        "query",
        help="print the assertions matching a pattern now, then exit",
        description="Print every assertion matching PATTERN on a dataspace server at this "
        "moment, once each, then exit (a one-shot observe).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("pattern", metavar="PATTERN", help="what to list, e.g. '<Present $who>'")
    p.add_argument("--captures", action="store_true",
                   help="print the sequence of captures instead of the pattern filled with them")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per match: {\"text\", \"values\"}")
    p.add_argument("--timeout", type=float, metavar="SECONDS", default=30.0,
                   help="how long to wait for the server's answer (default 30)")
    add_connection_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        pattern = parse_pattern(args.pattern)
    except PatternError as e:
        print(f"dataspace query: {e}\n  e.g. dataspace query '<Present $who>'", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print(f"dataspace query: --timeout must be more than 0 seconds, not {args.timeout:g}",
              file=sys.stderr)
        return 2
    return asyncio.run(_query(args, pattern))


async def _query(args: argparse.Namespace, pattern: Pattern) -> int:
    ds = await open_dataspace("dataspace query", args)
    if ds is None:
        return 1
    try:
        if not check_subscription("dataspace query", ds, pattern):
            return 1
        matches = await ds.query(pattern, timeout=args.timeout)
    except (ConnectionError, TimeoutError) as e:
        print(f"dataspace query: {e}", file=sys.stderr)
        return 1
    finally:
        await ds.close()
    out = sys.stdout
    for caps in matches:
        out.write(event_line(args, pattern, None, caps) + "\n")
    out.flush()
    if not matches:
        print(f"dataspace query: no assertion matches {pattern}", file=sys.stderr)
    elif not pattern.binding_names() and _has_discard(pattern):
        # `query _` (as one types `KEYS *`) printed a lone "_": say why, and what lists.
        print(f"dataspace query: {pattern} captures nothing, so every match shows as that one "
              "line; write $ where you want the values (e.g. '$v' for every assertion, "
              "'<Present $who>')", file=sys.stderr)
    return 0


def _has_discard(p: Pattern) -> bool:
    """Whether ``p`` has a ``_`` somewhere (assertions differing there show as one)."""
    if isinstance(p, Discard):
        return True
    if isinstance(p, (Rec, Arr)):
        return any(_has_discard(q) for _i, q in (p.fields if isinstance(p, Rec) else p.items))
    if isinstance(p, Dict):
        return any(_has_discard(q) for _k, q in p.entries)
    return False
