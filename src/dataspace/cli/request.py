"""``dataspace request VALUE --reply PATTERN``: send a message, print the first reply (or
several: ``--replies N``, ``--wait SECONDS``)."""

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
    stop_event,
    warn_dropped,
)
from ._voice import plural
from .observe import event_line

EXAMPLES = """\
examples:
  dataspace request '<Ask "time" "req-7">' --reply '<Answer "req-7" $t>'
  dataspace request '<Ask "time" 8>' --reply '<Answer 8 $t>' --captures
  dataspace request '<Ping>' --reply '<Pong $who>' --timeout 2
  dataspace request '<Ping>' --reply '<Pong $who>' --replies 3   three replies
  dataspace request '<Ping>' --reply '<Pong $who>' --wait 1      all within 1 s

Request/reply over messages (like `nats req`): the command observes PATTERN first, then
sends VALUE, then prints the first message matching PATTERN -- the pattern filled with
its captures (--captures: the captures; --json: {"text", "values"}) -- and exits 0.
Observing before sending means a responder cannot answer too early.  Only messages are
replies; put something unique to the request in both (a request id), so that two
requests at once do not take each other's replies.  No reply within --timeout seconds:
exit status 1.  In Python: `await ds.request(VALUE, PATTERN)`.  `dataspace reply`
answers requests from the command line.

Several replies (several responders, a scatter-gather): --replies N prints each reply as
it comes, one per line, and exits after N (status 1 when fewer came within --timeout:
those that did are printed); --replies 0 takes every reply until --timeout.  --wait
SECONDS gathers replies for that long after sending (at most N with --replies) and exits
0 if any came.

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
                   help="how long to wait for the reply, or the --replies N (default 10)")
    p.add_argument("--replies", type=int, metavar="N", default=None,
                   help="print N replies, then exit (default 1, or every reply with --wait; "
                   "0: every reply until --timeout)")
    p.add_argument("--wait", type=float, metavar="SECONDS", default=None,
                   help="gather replies for SECONDS after sending, then exit (0 if any "
                   "came)")
    p.add_argument("--captures", action="store_true",
                   help="print the sequence of captures instead of the pattern filled with them")
    p.add_argument("--json", action="store_true",
                   help="print each reply as a JSON object: {\"text\", \"values\"}")
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
    if not args.timeout > 0:
        print(f"dataspace request: --timeout must be more than 0 seconds, not {args.timeout:g}",
              file=sys.stderr)
        return 2
    if args.wait is not None and not args.wait > 0:
        print(f"dataspace request: --wait must be more than 0 seconds, not {args.wait:g}",
              file=sys.stderr)
        return 2
    if args.replies is None:
        args.replies = 0 if args.wait is not None else 1
    if args.replies < 0:
        print(f"dataspace request: --replies must be 0 (every reply until --timeout) or more, "
              f"not {args.replies}", file=sys.stderr)
        return 2
    return asyncio.run(_request(args, value, pattern))


PROG = "dataspace request"


async def _request(args: argparse.Namespace, value: Value, pattern: Pattern) -> int:
    ds = await open_dataspace(PROG, args)
    if ds is None:
        return 1
    try:
        if warn_dropped(PROG, ds, value, what="request") or \
                not check_subscription(PROG, ds, pattern):
            return 1
        return await _gather(args, ds, value, pattern)
    except (ConnectionError, TimeoutError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    finally:
        await ds.close()


async def _gather(args: argparse.Namespace, ds: Any, value: Value, pattern: Pattern) -> int:
    """Observe the replies, send the request, print each reply as it comes until there
    are enough, the time is up, the connection is lost or Ctrl-C."""
    loop = asyncio.get_running_loop()
    replies: asyncio.Queue[tuple[Value, ...] | None] = asyncio.Queue()
    stop = stop_event()
    lost = False

    def on_lost() -> None:
        nonlocal lost
        lost = True
        replies.put_nowait(None)

    sub = ds.observe(pattern, on_message=lambda *caps: replies.put_nowait(caps))
    ds.on_disconnect.append(on_lost)
    window = args.wait if args.wait is not None else args.timeout
    want = args.replies
    got = 0
    stopper = asyncio.ensure_future(stop.wait())
    try:
        ds.send(value)
        deadline = loop.time() + window
        while want == 0 or got < want:
            left = deadline - loop.time()
            if left <= 0:
                break
            getter = asyncio.ensure_future(replies.get())
            done, _ = await asyncio.wait({getter, stopper}, timeout=left,
                                         return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                break
            caps = getter.result()
            if caps is None:
                break
            try:
                sys.stdout.write(event_line(args, pattern, None, caps) + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):
                return 0
            got += 1
    finally:
        stopper.cancel()
        sub.cancel()
    if stop.is_set():
        print(f"{PROG}: interrupted" + (f" after {got} repl{'y' if got == 1 else 'ies'}"
                                        if got else " before any reply"), file=sys.stderr)
        return 130
    if lost:
        print(f"{PROG}: the connection to the server was lost after {got} "
              f"repl{'y' if got == 1 else 'ies'}; send the request again", file=sys.stderr)
        return 1
    if got == 0:
        print(f"{PROG}: no reply matching {pattern} within {window:g} s (is a responder "
              "running? its reply must be a message matching --reply)", file=sys.stderr)
        return 1
    if args.wait is None and want and got < want:
        print(f"{PROG}: {got} of {plural(want, 'reply', 'replies')} within {window:g} s", file=sys.stderr)
        return 1
    return 0
