"""The ``dataspace`` command.

Each subcommand lives in its own module of this package, exposing
``register(subparsers) -> None``, which adds an argparse subparser whose ``func`` default
is ``run(args) -> int``.  Add a module name to ``COMMANDS`` to add a command.
"""

from __future__ import annotations

import argparse
import importlib
import logging

from .. import __version__

COMMANDS = ["demo"]

EPILOG = """\
examples:
  dataspace demo                      simulated users chatting in an in-process dataspace
  dataspace COMMAND --help            help on one command
"""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="dataspace",
        description="A dataspace broker and toolkit: shared live state, events and "
        "exactly-once pipelines over Preserves values.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dataspace {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0,
        help="more logging (-v info, -vv debug); logs go to stderr",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dataspace`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
