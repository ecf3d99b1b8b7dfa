"""``dataspace observe PATTERN``: print matching assertions and messages as they happen."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import time
from typing import Any

from ..dataspace import Entity
from ..groups import MAX_GROUP_NAME, member_record
from ..pattern import Pattern, PatternError, instantiate, parse_pattern
from ..values import Sequence, Symbol, Value, stringify
from ._client import (
    CONNECTION_HELP,
    add_connection_args,
    check_subscription,
    open_dataspace,
    stop_event,
    through_caveats,
)
from ._json import to_json

EXAMPLES = """\
examples:
  dataspace observe '<Present $who>'                who is present, live
  dataspace observe '<Says "alice" $text>'          alice's messages
  dataspace observe '$v'                            everything asserted and sent
  dataspace observe '<Says $who $text>' --captures  just the captured fields
  dataspace observe '<Present _>' --count 1         the first match, then exit
  dataspace observe '<Says $who $text>' --json | jq -r '.values[1]'
  dataspace observe '<Present $who>' --timestamps   each line with its time
  dataspace observe '<Job $id $file>' --group resize
                               a worker of group resize: its share of the
                               messages, the jobs assigned to it (run several)

output (one line per event, values in Preserves text):
  + VALUE    a match appeared (those present at start come first)
  - VALUE    it went (retracted, or its owner disconnected)
  ! VALUE    a matching message
  VALUE is the pattern with each $ replaced by what it captured; a _ of the pattern
  stays _ (the server sends subscribers only the captures).  Matches that differ only
  where the pattern has _ are one match.  With --captures, VALUE is the sequence of the
  captures.  --timestamps puts the local time (2026-11-21T10:06:16.123) before each line.
  --json prints one JSON object per line instead:
    {"event": "+", "time": 1795000000.123, "text": "<Says \"alice\" \"hi\">",
     "values": ["alice", "hi"]}
  time is seconds since the epoch; text the value in Preserves text; values the
  captures in JSON (symbols, records ... as {"@symbol": ...}: docs/broker.md).

groups (--group NAME): the command joins the group NAME of observers of PATTERN
instead of observing alone.  Each matching message goes to one member of the group
(round-robin), so the members share them; each matching assertion is a job assigned to
one member: its + line is printed by that member only, and its - line when the job is
finished (its holder retracted it) or moved away.  When a member leaves (Ctrl-C, or its
connection dies) its jobs move at once to the others, which print their + lines.  A new
member gets new and moved work, not jobs already assigned -- unless --rebalance: then it
takes a share of them when it joins.  Plain observers of PATTERN still see everything.
The membership is <ObserveGroup NAME PATTERN #:observer> (docs/broker.md, "Sharing
work").

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
    p.add_argument("--count", type=int, metavar="N", default=None,
                   help="exit after printing N events (at least 1; default: run until Ctrl-C)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per event: {\"event\", \"time\", \"text\", \"values\"}")
    p.add_argument("--timestamps", "-t", action="store_true",
                   help="put the local time before each event")
    p.add_argument("--group", "-g", metavar="NAME", default=None,
                   help="join the group NAME: share its messages (one member each) and "
                   "take jobs (each matching assertion to one member)")
    p.add_argument("--rebalance", action="store_true",
                   help="with --group: take a share of the jobs already assigned on joining")
    add_connection_args(p)
    p.set_defaults(func=run)


def group_name_problem(name: str) -> str | None:
    """What is wrong with ``name`` as a group's name, or None."""
    if not name:
        return "a group's name must not be empty"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_GROUP_NAME:
        return f"a group's name is at most {MAX_GROUP_NAME} bytes long"
    return None


class _Probe(Entity):
    """Stands for this client's observer in a membership checked against caveats."""


def _check_group(ds: Any, pattern: Pattern, group: str) -> bool:
    rec = member_record(group, pattern, _Probe())
    if through_caveats(ds, rec) is None:
        print(f"dataspace observe: the capability's caveats drop the membership "
              f"<ObserveGroup {json.dumps(group)} ...>: nothing would reach this member "
              "(use a capability that allows <ObserveGroup ...>, e.g. one attenuated "
              "with --only '<rec ObserveGroup [<_> <_> <_>]>')", file=sys.stderr)
        return False
    return True


def _embedded_text(obj: Any) -> Value:
    oid = getattr(obj, "oid", None)
    return Symbol(f"ref:{oid}" if oid is not None else f"<{type(obj).__name__}>")


def run(args: argparse.Namespace) -> int:
    try:
        pattern = parse_pattern(args.pattern)
    except PatternError as e:
        print(f"dataspace observe: {e}\n  e.g. dataspace observe '<Present $who>'", file=sys.stderr)
        return 2
    if args.count is not None and args.count < 1:
        print(f"dataspace observe: --count must be at least 1, not {args.count} (leave it "
              "out to observe until Ctrl-C)", file=sys.stderr)
        return 2
    if args.json and args.captures:
        print("dataspace observe: --json already gives the captures (\"values\") and the "
              "value (\"text\"): drop --captures", file=sys.stderr)
        return 2
    if args.rebalance and args.group is None:
        print("dataspace observe: --rebalance goes with --group NAME (a member of a group "
              "takes a share of its jobs)", file=sys.stderr)
        return 2
    if args.group is not None:
        why = group_name_problem(args.group)
        if why is not None:
            print(f"dataspace observe: --group: {why}\n  e.g. dataspace observe "
                  f"'<Job $id>' --group workers", file=sys.stderr)
            return 2
    return asyncio.run(_observe(args, pattern))


def event_line(args: argparse.Namespace, pattern: Pattern, prefix: str | None,
               caps: tuple[Value, ...], now: float | None = None) -> str:
    """One event as ``observe`` prints it -- ``prefix`` (+, -, !) and the value -- or one
    match as ``query`` and ``request`` print it (``prefix`` None: the value alone).
    ``args.json``: a JSON object instead (with ``event`` and ``time`` when there is a
    prefix); ``args.captures``: the sequence of captures; ``args.timestamps``: the
    local time first."""
    if getattr(args, "json", False):
        obj: dict[str, Any] = {}
        if prefix is not None:
            obj["event"] = prefix
            obj["time"] = round(time.time() if now is None else now, 6)
        obj["text"] = stringify(instantiate(pattern, caps), embedded=_embedded_text)
        obj["values"] = [to_json(c, _embedded_text) for c in caps]
        return json.dumps(obj, ensure_ascii=False)
    v = Sequence(caps) if args.captures else instantiate(pattern, caps)
    line = stringify(v, embedded=_embedded_text)
    if prefix is not None:
        line = f"{prefix} {line}"
    if getattr(args, "timestamps", False):
        t = time.time() if now is None else now
        line = f"{datetime.datetime.fromtimestamp(t).isoformat(timespec='milliseconds')} {line}"
    return line


async def _observe(args: argparse.Namespace, pattern: Pattern) -> int:
    ds = await open_dataspace("dataspace observe", args)
    if ds is None:
        return 1
    ok = (check_subscription("dataspace observe", ds, pattern) if args.group is None
          else _check_group(ds, pattern, args.group))
    if not ok:
        await ds.close()
        return 1
    stop = stop_event()
    printed = 0
    out = sys.stdout

    def emit(prefix: str, caps: tuple[Value, ...]) -> None:
        nonlocal printed
        if stop.is_set():
            return
        try:
            out.write(event_line(args, pattern, prefix, caps, time.time()) + "\n")
            out.flush()
        except (BrokenPipeError, ValueError):
            stop.set()
            return
        printed += 1
        if args.count is not None and printed >= args.count:
            stop.set()

    # The same subscription as dataspace.client's observe(pattern) -- and any Syndicate
    # client's -- so that producers watching <Observe ...> for demand see this one too.
    # With --group, the membership <ObserveGroup NAME PATTERN #:observer> instead (its
    # group's one <Observe ...> shows the demand).
    ds.observe(
        pattern,
        on_assert=lambda *c: emit("+", c),
        on_retract=lambda *c: emit("-", c),
        on_message=lambda *c: emit("!", c),
        group=args.group,
        rebalance=args.rebalance,
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
