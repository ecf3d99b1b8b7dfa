"""``dataspace assert VALUE``: assert values on a server, held until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any

from ..protocol.wire import short
from ..values import stringify
from ._client import (
    CONNECTION_HELP,
    add_connection_args,
    open_dataspace,
    parse_value,
    stop_event,
    warn_dropped,
)

EXAMPLES = """\
examples:
  dataspace assert '<Present "alice">'              present until Ctrl-C
  dataspace assert '<Present "bob">' '<Status "bob" "busy">'
  dataspace assert '<Lease "job-7">' --for 30       hold for 30 s, then retract

The assertion lasts while the command runs: Ctrl-C (or SIGTERM, or the process dying)
retracts it.  If the server restarts, the command reconnects and asserts it again.
With a capability whose caveats drop a VALUE (the server would ignore it), the command
says so and does not claim it; when they drop every VALUE it exits with status 1.

""" + CONNECTION_HELP


def register(sub: Any) -> None:
    p = sub.add_parser(
        "assert",
        help="assert values on a server, held until Ctrl-C",
        description="Assert each VALUE (Preserves text) into the server's dataspace and hold "
        "the assertions until interrupted; observers see them appear and, on exit, disappear.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("values", nargs="+", metavar="VALUE", help="a value, e.g. '<Present \"alice\">'")
    p.add_argument("--for", dest="duration", type=float, metavar="SECONDS", default=None,
                   help="retract and exit after this many seconds")
    add_connection_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    vals = [parse_value("dataspace assert", t) for t in args.values]
    if any(v is None for v in vals):
        return 2
    if args.duration is not None and args.duration < 0:
        print("dataspace assert: --for must be >= 0", file=sys.stderr)
        return 2
    return asyncio.run(_assert(args, vals))


async def _assert(args: argparse.Namespace, vals: list[Any]) -> int:
    ds = await open_dataspace("dataspace assert", args)
    if ds is None:
        return 1
    dropped = [warn_dropped("dataspace assert", ds, v, what="assertion") for v in vals]
    if all(dropped):
        await ds.close()
        print("dataspace assert: nothing to hold: the capability allows none of these "
              "assertions", file=sys.stderr)
        return 1
    stop = stop_event()
    refused: dict[Any, str] = {}
    ds.on_refused.append(lambda v, msg: refused.setdefault(v, msg))
    handles = [ds.assert_(v) for v in vals]
    await ds.sync()
    for v, gone in zip(vals, dropped):
        if v in refused:  # the server's memory budget is full
            print(f"dataspace assert: the server refused {short(v, 80)}: {refused[v]}",
                  file=sys.stderr)
        elif not gone:
            print(f"asserted {stringify(v)}", file=sys.stderr)
    if all(gone or v in refused for v, gone in zip(vals, dropped)):
        await ds.close()
        return 1
    print("dataspace assert: holding; Ctrl-C retracts and exits", file=sys.stderr, flush=True)
    # While the connection is down the server holds nothing of ours: say so, as observe
    # does, rather than "holding" through it in silence.
    ds.on_disconnect.append(lambda: print(
        "dataspace assert: connection lost (the server no longer holds the assertions); "
        "reconnecting", file=sys.stderr, flush=True))
    ds.on_reconnect.append(lambda: print(
        "dataspace assert: reconnected; asserted again, holding", file=sys.stderr, flush=True))
    ended = asyncio.ensure_future(ds.wait_closed())
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ended, waiter}, timeout=args.duration, return_when=asyncio.FIRST_COMPLETED)
    ended.cancel()
    waiter.cancel()
    for h in handles:
        ds.retract(h)
    if ds.connected:
        with contextlib.suppress(ConnectionError, TimeoutError):
            await ds.sync(timeout=5)
    await ds.close()
    if ds.error is not None:
        print(f"dataspace assert: {ds.error}", file=sys.stderr)
        return 1
    return 0
