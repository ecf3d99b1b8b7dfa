"""``dataspace request VALUE --reply PATTERN``: send a message, print the first reply."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from ..pattern import Pattern, PatternError, parse_pattern
from ..values import Value
from ._client import (
    CONNECTION_HELP,
    add_connection_args,
    check_subscription,
    open_dataspace,
    parse_value,
    warn_dropped,
)
from .observe import event_line

EXAMPLES = """\
examples:
  dataspace request '<Ask "time" "req-7">' --reply '<Answer "req-7" $t>'
  dataspace request '<Ask "time" "req-8">' --reply '<Answer "req-8" $t>' --captures
  dataspace request '<Ping>' --reply '<Pong $who>' --timeout 2

Request/reply over messages (like `nats req`): the command observes PATTERN first, then
sends VALUE, then prints the first message matching PATTERN -- the pattern filled with
its captures (--captures: the captures; --json: {"text", "values"}) -- and exits 0.
Observing before sending means a responder cannot answer too early.  Only messages are
replies; put something unique to the request in both (a request id), so that two
requests at once do not take each other's replies.  No reply within --timeout seconds:
exit status 1.  In Python: `await ds.request(VALUE, PATTERN)`.

""" + CONNECTION_HELP


def register(sub: Any) -> None:
    p = sub.add_parser(
        "request",
        help="send a message and print the first reply matching a pattern",
        description="Send VALUE as a message and wait for the first message matching "
        "--reply PATTERN (request/reply); print it and exit.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("value", metavar="VALUE", help="the request, e.g. '<Ask \"time\" \"req-7\">'")
    p.add_argument("--reply", metavar="PATTERN", required=True,
                   help="the pattern of the reply, e.g. '<Answer \"req-7\" $t>'")
    p.add_argument("--timeout", type=float, metavar="SECONDS", default=10.0,
                   help="how long to wait for the reply (default 10)")
    p.add_argument("--captures", action="store_true",
                   help="print the sequence of captures instead of the pattern filled with them")
    p.add_argument("--json", action="store_true",
                   help="print the reply as a JSON object: {\"text\", \"values\"}")
    add_connection_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    value = parse_value("dataspace request", args.value)
    if value is None:
        return 2
    try:
        pattern = parse_pattern(args.reply)
    except PatternError as e:
        print(f"dataspace request: --reply: {e}\n  e.g. --reply '<Answer \"req-7\" $t>'",
              file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print(f"dataspace request: --timeout must be more than 0 seconds, not {args.timeout:g}",
              file=sys.stderr)
        return 2
    return asyncio.run(_request(args, value, pattern))


async def _request(args: argparse.Namespace, value: Value, pattern: Pattern) -> int:
    prog = "dataspace request"
    ds = await open_dataspace(prog, args)
    if ds is None:
        return 1
    try:
        if warn_dropped(prog, ds, value, what="request") or \
                not check_subscription(prog, ds, pattern):
            return 1
        caps = await ds.request(value, pattern, timeout=args.timeout)
    except TimeoutError as e:
        print(f"{prog}: {e} (is a responder running? its reply must be a message matching "
              "--reply)", file=sys.stderr)
        return 1
    except ConnectionError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    finally:
        await ds.close()
    print(event_line(args, pattern, None, caps), flush=True)
    return 0
