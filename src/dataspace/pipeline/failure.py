"""What a user's function did wrong, said the same way by every engine.

One line names the processor, the input entries, the place in the user's code and the
error::

    map 'upper' failed on entry chat/17: shout.py:5: AttributeError: 'int' object has no attribute 'upper'

and the traceback keeps the user's frames only (the engine's own frames, which call the
function, say nothing to its author).  The place is the innermost frame of the user's
code: not this package, not the standard library, not an installed library -- so an error
raised inside ``json.loads`` points at the user's line that called it; without such a
frame (the function was fine, its result was not) it is where the function is defined.
"""

from __future__ import annotations

import linecache
import os
import re
import sysconfig
import traceback
from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_TRACEBACK", "describe_failure", "with_source"]

MAX_TRACEBACK = 4000
"""The most characters of a traceback kept (in error records, and carried from Spark's
workers): its start and its end, which name the user's call and the error."""

_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the dataspace package
_LIBS = tuple(sorted({os.path.abspath(p) for k in ("stdlib", "platstdlib", "purelib", "platlib")
                      if (p := sysconfig.get_paths().get(k))}))


def _ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_OURS + os.sep)


def _library(filename: str) -> bool:
    f = os.path.abspath(filename)
    return f.startswith(_LIBS) or f.startswith("<frozen ")


def describe_failure(kind: str, name: str, positions: Mapping[str, int], e: BaseException,
                     fn: Any = None) -> tuple[str, str]:
    """(the one line, the traceback of the user's code) for ``e``, raised by the function
    ``fn`` of processor ``name`` (of ``kind``) on the input entries ``positions``."""
    frames = traceback.extract_tb(e.__traceback__)
    k = 0
    while k < len(frames) and _ours(frames[k].filename):  # the engine calling the function
        k += 1
    user = frames[k:]
    spot = next((f for f in reversed(user) if not _ours(f.filename) and not _library(f.filename)),
                user[0] if user else None)
    where = ""
    if spot is not None:
        where = f"{os.path.basename(spot.filename)}:{spot.lineno}: "
    else:
        code = getattr(fn, "__code__", None)
        if code is not None:
            where = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}: "
    entries = ", ".join(f"{s}/{i}" for s, i in positions.items())
    what = "entry" if len(positions) == 1 else "entries"
    msg = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__
    line = f"{kind} {name!r} failed on {what} {entries}: {where}{text}"
    te = traceback.TracebackException.from_exception(e)
    te.stack = traceback.StackSummary.from_list(user)
    tb = "".join(te.format())
    if len(tb) > MAX_TRACEBACK:
        half = MAX_TRACEBACK // 2
        tb = tb[:half] + "\n  ...\n" + tb[-half:]
    return line, tb.rstrip("\n")


_FRAME = re.compile(r'^  File "(.+)", line (\d+), in ')


def with_source(tb: str) -> str:
    """``tb`` with the source line under each frame that lacks one, read here: a
    traceback made on a Spark executor that could not read the user's file (another
    machine) gets its lines from the driver's copy."""
    lines = tb.splitlines()
    out: list[str] = []
    for k, line in enumerate(lines):
        out.append(line)
        m = _FRAME.match(line)
        if m and not (k + 1 < len(lines) and lines[k + 1].startswith("    ")):
            src = linecache.getline(m.group(1), int(m.group(2))).strip()
            if src:
                out.append("    " + src)
    return "\n".join(out)
