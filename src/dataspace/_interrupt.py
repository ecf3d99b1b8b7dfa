"""Ctrl-C before the ``dataspace`` command can take it: one line, exit 130.

Imported first by the package (before :mod:`._build`, which imports ``logging``,
``dataclasses`` and more), so that a Ctrl-C in the command's first fraction of a second
never prints a ``KeyboardInterrupt`` traceback from inside an import.  Only the command's
own process is touched (its console script, ``python -m dataspace[.cli]``); a program that
imports the package keeps Python's default handler.  Nothing but builtin modules here.
"""

from __future__ import annotations

# The interpreter's builtin module: ``signal`` itself imports ``enum``, which takes tens of
# milliseconds on a busy machine, long enough for a Ctrl-C to land inside it.
import _signal
import os
import sys

__all__ = ["interrupted_early", "is_the_command"]


def interrupted_early(signum: int, frame: object) -> None:
    """The SIGINT handler while the command's modules import: one line and exit 130."""
    os.write(2, b"dataspace: interrupted\n")
    os._exit(130)


def is_the_command() -> bool:
    """Whether this process is the ``dataspace`` command (its console script, ``python -m
    dataspace[.cli]``), not a program that imports the package."""
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    if len(argv) > 2 and argv[1] == "-m":
        return argv[2] in ("dataspace", "dataspace.cli")
    return len(argv) > 1 and os.path.basename(argv[1]) == "dataspace"


if is_the_command() and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    try:
        _signal.signal(_signal.SIGINT, interrupted_early)
    except ValueError:  # not the main thread
        pass
