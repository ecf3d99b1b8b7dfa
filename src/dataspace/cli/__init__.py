"""The ``dataspace`` command.

Each subcommand lives in its own module of this package, exposing
``register(subparsers) -> None``, which adds an argparse subparser whose ``func`` default
is ``run(args) -> int``.  Modules are discovered: adding a file adds a command (modules
whose names start with ``_`` are helpers, not commands).  ``ORDER`` only sets the order
in ``--help``.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import importlib
import logging
import os
import pkgutil
import signal
import sys
from typing import Any

from .. import __version__
from .._build import BUILD
from .._extras import MissingExtra
from .._interrupt import interrupted_early as _interrupted_early
from ._parser import Parser

ORDER = ["serve", "observe", "assert_", "send", "query", "request", "reply", "cap", "info",
         "clients", "top", "link", "cluster", "stream", "scry", "pipeline", "demo"]  # module names


def _discover() -> list[str]:
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


COMMANDS = _discover()

EPILOG = """\
examples:
  dataspace serve                         run the server (127.0.0.1:7411)
  dataspace observe '<Present $who>'      watch assertions appear and go
  dataspace assert '<Present "alice">'    hold an assertion until Ctrl-C
  dataspace send '<Says "alice" "hi">'    send a message
  dataspace send --count 10 '<Tick $n>'   send <Tick 1> ... <Tick 10>
  dataspace query '<Present $who>'        list what matches now, and exit
  dataspace request '<Ask 1>' --reply '<Answer 1 $x>'
                                          send a request, print the first reply
  dataspace reply '<Ask $id>' --with '<Answer $id "yes">'
                                          answer requests until Ctrl-C
  dataspace cap mint                      print the server's root capability
  dataspace clients                       list the server's connections
  dataspace top                           live connections, rates (serve --http)
  dataspace demo                          simulated users chatting, in process
  dataspace COMMAND --help                help on one command
"""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = Parser(
        prog="dataspace",
        description="A dataspace broker and toolkit: shared live state, events and "
        "exactly-once pipelines over Preserves values.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"dataspace {__version__} ({BUILD.describe()})"
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0,
        help="more logging (-v info, -vv debug); logs go to stderr",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def redeliver_interrupt(unraisable: Any) -> None:
    """``sys.unraisablehook`` of the command's process: a Ctrl-C that landed where Python
    can only report an exception and drop it (a weakref callback of the import system, a
    ``__del__``) is delivered again to the main thread, where the command takes it --
    instead of an "Exception ignored ... KeyboardInterrupt" traceback and a Ctrl-C lost."""
    exc_type = unraisable.exc_type
    if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
        # From another thread, once this one has left the hook: raised here, it would be
        # raised inside the hook (and dropped again).
        _thread.start_new_thread(_thread.interrupt_main, ())
        return
    sys.__unraisablehook__(unraisable)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dataspace`` console script."""
    if argv is None:  # the command's own process (a test calling main() keeps its hook)
        sys.unraisablehook = redeliver_interrupt
    try:
        if signal.getsignal(signal.SIGINT) is _interrupted_early:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt now
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C that no command took over: while the commands' modules import, or one a
        # command leaves to us.  One line, no traceback; a second one while we exit ends
        # the process at once.
        if argv is None:
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(signal.SIGINT, lambda *_: os._exit(130))
        print("dataspace: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command and args.command != "serve":  # a server keeps a log's format
        from ._voice import speak_as

        speak_as(f"dataspace {args.command}", args.verbose)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if argv is None and args.command == "serve":
        _use_system_allocator()
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        return 0
    except MissingExtra as e:  # Spark or PostgreSQL asked for, and not installed
        print(f"dataspace {args.command}: {e}", file=sys.stderr)
        return 2


def _use_system_allocator() -> None:
    """Run the server under the C library's allocator: re-execute this same command once
    with ``PYTHONMALLOC=malloc`` (same process id, same arguments).

    Python's own small-object allocator keeps a 1 MiB arena as long as one object in it
    lives, so after a load goes away a server kept most of the memory the load took;
    with the C allocator the server's ``malloc_trim`` gives it back.  It costs a few
    per cent of throughput.  A ``PYTHONMALLOC`` already set is left as it is (set
    ``PYTHONMALLOC=pymalloc`` to keep Python's allocator).
    """
    if os.environ.get("PYTHONMALLOC") or not sys.platform.startswith("linux"):
        return
    env = dict(os.environ, PYTHONMALLOC="malloc")
    try:
        os.execve(sys.executable, [sys.executable, "-m", "dataspace.cli", *sys.argv[1:]], env)
    except OSError as e:  # pragma: no cover - the interpreter cannot be run again
        logging.getLogger(__name__).warning("cannot switch to the system allocator: %s", e)
