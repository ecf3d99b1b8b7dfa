"""``dataspace send VALUE``: send messages to a server's observers."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from ..values import ParseError, Value, parse, stringify
from ._client import CONNECTION_HELP, add_connection_args, open_dataspace, parse_value, warn_dropped

EXAMPLES = """\
examples:
  dataspace send '<Says "alice" "hello">'
  dataspace send '<Tick 1>' '<Tick 2>' '<Tick 3>'      several, in order, in one turn
  printf '<Tick %s>\\n' 1 2 3 | dataspace send -        one value per line from stdin

  dataspace send -v '<Says "alice" "hello">'         say what was sent, once the server has it

A message reaches the observers present when it arrives and is then gone; the command
exits once the server has processed it (-v then prints `sent VALUE` for each).  With a
capability whose caveats drop a VALUE, the server ignores it: the command says so and
exits with status 1 (the other values are sent).

""" + CONNECTION_HELP


def register(sub: Any) -> None:
    p = sub.add_parser(
        "send",
        help="send messages to a server's observers",
        description="Send each VALUE (Preserves text) as a message to the server's dataspace.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("values", nargs="+", metavar="VALUE",
                   help="a value, e.g. '<Says \"alice\" \"hi\">', or - to read lines from stdin")
    p.add_argument("-v", "--verbose", dest="confirm", action="store_true",
                   help="print `sent VALUE` (stderr) for each value once the server has "
                   "processed it")
    add_connection_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    vals: list[Value] = []
    for t in args.values:
        if t == "-":
            from_stdin = _read_stdin_values(sys.stdin.read())
            if from_stdin is None:
                return 2
            vals += from_stdin
        else:
            v = parse_value("dataspace send", t)
            if v is None:
                return 2
            vals.append(v)
    return asyncio.run(_send(args, vals))


def _read_stdin_values(text: str) -> list[Value] | None:
    """One value per (non-blank) line; an error names its line and column in the input."""
    vals = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            vals.append(parse(line))
        except ParseError as e:
            where = f"line {lineno}" if e.column is None else f"line {lineno}, column {e.column}"
            print(f"dataspace send: cannot read standard input, {where}: {e.reason}\n"
                  f"  one value per line, e.g. <Says \"alice\" \"hi\">", file=sys.stderr)
            return None
    return vals


async def _send(args: argparse.Namespace, vals: list[Any]) -> int:
    ds = await open_dataspace("dataspace send", args)
    if ds is None:
        return 1
    dropped = [warn_dropped("dataspace send", ds, v, what="message") for v in vals]
    try:
        with ds.turn():
            for v in vals:
                ds.send(v)
        await ds.sync()
    except (ConnectionError, TimeoutError) as e:
        print(f"dataspace send: {e}; the messages may not have been delivered", file=sys.stderr)
        return 1
    finally:
        await ds.close()
    if args.confirm:
        for v, gone in zip(vals, dropped):
            if not gone:
                print(f"sent {stringify(v)}", file=sys.stderr)
    if any(dropped):
        n = sum(dropped)
        print(f"dataspace send: {n} of {len(vals)} message(s) dropped by the capability's "
              "caveats", file=sys.stderr)
        return 1
    return 0
