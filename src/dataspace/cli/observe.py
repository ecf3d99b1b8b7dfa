"""``dataspace observe PATTERN``: print matching assertions and messages as they happen."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from ..pattern import Pattern, PatternError, instantiate, parse_pattern
from ..values import Sequence, Symbol, Value, stringify
from ._client import CONNECTION_HELP, add_connection_args, open_dataspace, stop_event

EXAMPLES = """\
examples:
  dataspace observe '<Present $who>'                who is present, live
  dataspace observe '<Says "alice" $text>'          alice's messages
  dataspace observe '$v'                            everything asserted and sent
  dataspace observe '<Says $who $text>' --captures  just the captured fields
  dataspace observe '<Present _>' --count 1         wait for the first match, then exit

output (one line per event, values in Preserves text):
  + VALUE    a match appeared (those present at start come first)
  - VALUE    it went (retracted, or its owner disconnected)
  ! VALUE    a matching message
  VALUE is the pattern with each $ replaced by what it captured; a _ of the pattern
  stays _ (the server sends subscribers only the captures).  Matches that differ only
  where the pattern has _ are one match.  With --captures, VALUE is the sequence of the
  captures.

patterns: _ matches anything, $name captures, other values match themselves; records,
sequences and dictionaries match the fields they list (extra fields are ignored).  The
subscription is <Observe PATTERN #:observer> with PATTERN in the Syndicate wire form,
exactly as dataspace.client's observe() asserts it, so producers that watch for demand
see it.

""" + CONNECTION_HELP


def register(sub: Any) -> None:
    p = sub.add_parser(
        "observe",
        help="print matching assertions and messages as they happen",
        description="Subscribe to PATTERN on a dataspace server and print every matching "
        "assertion as it appears and disappears, and every matching message, until Ctrl-C "
        "(like mosquitto_sub or `nats sub`).  If the server goes away the command "
        "reconnects; what it held shows as retractions, then the current state.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("pattern", metavar="PATTERN", help="what to watch, e.g. '<Present $who>'")
    p.add_argument("--captures", action="store_true",
                   help="print the sequence of captures instead of the pattern filled with them")
    p.add_argument("--count", type=int, metavar="N", default=0,
                   help="exit after printing N events")
    add_connection_args(p)
    p.set_defaults(func=run)


def _embedded_text(obj: Any) -> Value:
    oid = getattr(obj, "oid", None)
    return Symbol(f"ref:{oid}" if oid is not None else f"<{type(obj).__name__}>")


def run(args: argparse.Namespace) -> int:
    try:
        pattern = parse_pattern(args.pattern)
    except PatternError as e:
        print(f"dataspace observe: {e}\n  e.g. dataspace observe '<Present $who>'", file=sys.stderr)
        return 2
    if args.count < 0:
        print("dataspace observe: --count must be >= 0", file=sys.stderr)
        return 2
    return asyncio.run(_observe(args, pattern))


async def _observe(args: argparse.Namespace, pattern: Pattern) -> int:
    ds = await open_dataspace("dataspace observe", args)
    if ds is None:
        return 1
    stop = stop_event()
    printed = 0
    out = sys.stdout

    def emit(prefix: str, caps: tuple[Value, ...]) -> None:
        nonlocal printed
        if stop.is_set():
            return
        v = Sequence(caps) if args.captures else instantiate(pattern, caps)
        try:
            out.write(f"{prefix} {stringify(v, embedded=_embedded_text)}\n")
            out.flush()
        except (BrokenPipeError, ValueError):
            stop.set()
            return
        printed += 1
        if args.count and printed >= args.count:
            stop.set()

    # The same subscription as dataspace.client's observe(pattern) -- and any Syndicate
    # client's -- so that producers watching <Observe ...> for demand see this one too.
    ds.observe(
        pattern,
        on_assert=lambda *c: emit("+", c),
        on_retract=lambda *c: emit("-", c),
        on_message=lambda *c: emit("!", c),
    )
    ds.on_disconnect.append(
        lambda: print("dataspace observe: connection lost; reconnecting", file=sys.stderr, flush=True)
    )
    ds.on_reconnect.append(
        lambda: print("dataspace observe: reconnected", file=sys.stderr, flush=True)
    )
    ended = asyncio.ensure_future(ds.wait_closed())
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ended, waiter}, return_when=asyncio.FIRST_COMPLETED)
    ended.cancel()
    waiter.cancel()
    await ds.close()
    if ds.error is not None:
        print(f"dataspace observe: {ds.error}", file=sys.stderr)
        return 1
    return 0
