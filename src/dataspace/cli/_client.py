"""Shared by the client commands (observe, assert, send): options, connecting, signals."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

from ..client import (
    CapabilityError,
    CapabilityRejected,
    RemoteDataspace,
    connect,
    default_address,
)
from ..net.address import DEFAULT_HOST, DEFAULT_PORT
from ..values import ParseError, Value, parse

CONNECTION_HELP = f"""\
connecting:
  By default the command connects to $DATASPACE_SERVER or {DEFAULT_HOST}:{DEFAULT_PORT} with the
  capability in the data directory's root.sturdyref (written by `dataspace serve`).  Use
  --server for another address (HOST:PORT, unix:PATH, ws://HOST:PORT/) and --cap for
  another capability (Preserves text, e.g. from `dataspace cap`).
"""


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", metavar="ADDRESS", default=None,
                   help=f"server address (default $DATASPACE_SERVER or {DEFAULT_HOST}:{DEFAULT_PORT})")
    p.add_argument("--cap", metavar="STURDYREF", default=None,
                   help="capability as Preserves text (default: <data-dir>/root.sturdyref)")
    p.add_argument("--data-dir", metavar="DIR", default=None,
                   help="data directory holding root.sturdyref")


async def open_dataspace(prog: str, args: argparse.Namespace) -> RemoteDataspace | None:
    """Connect as the options say, or print what went wrong (and what to do) and return
    None."""
    try:
        return await connect(args.server or default_address(), args.cap, data_dir=args.data_dir)
    except CapabilityRejected as e:
        print(f"{prog}: {e}; is this the capability of that server? (--cap, --data-dir)",
              file=sys.stderr)
    except CapabilityError as e:
        print(f"{prog}: {e}", file=sys.stderr)
    except (ConnectionError, OSError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
    return None


def parse_value(prog: str, text: str) -> Value | None:
    try:
        return parse(text)
    except ParseError as e:
        print(
            f"{prog}: cannot read {text!r} as a value: {e}\n"
            f"  values are Preserves text, e.g. '<Says \"alice\" \"hi\">' (quote it for your shell)",
            file=sys.stderr,
        )
        return None


def stop_event() -> asyncio.Event:
    """An event set by Ctrl-C (SIGINT) or SIGTERM."""
    loop = asyncio.get_running_loop()
    ev = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, ev.set)
    return ev


def formatter() -> Any:
    return argparse.RawDescriptionHelpFormatter
