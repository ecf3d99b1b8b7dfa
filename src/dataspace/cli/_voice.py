"""Log records as the command's own lines.

Library code logs (``logging``); a command's user should read what it says as the
command speaking -- ``dataspace pipeline: processor shout/upper: ...`` -- not as a log
file's timestamped ``2025-01-01 12:00:00,123 WARNING dataspace.pipeline.spark.engine:``
line, and each record as one line.  With ``-v`` the full log format comes back (time,
level, logger, tracebacks), since then the user asked for the machinery.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["plural", "speak_as"]


def plural(n: int, one: str, many: str | None = None) -> str:
    """A count and its noun, agreeing: ``1 attempt``, ``2 attempts``, ``1,000 entries``
    (``many`` for nouns that do not just take an s)."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"


class _Voice(logging.Formatter):
    def __init__(self, prog: str) -> None:
        super().__init__()
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage().strip()
        first, _, rest = msg.partition("\n")
        if record.exc_info and record.exc_info[1] is not None:
            e = record.exc_info[1]
            said = f"{type(e).__name__}: {e}".splitlines()[0]
            if said not in first:
                first += f" ({said})"
        if rest or record.exc_info:
            first += " (-v says more)"
        return f"{self.prog}: {first}"


def speak_as(prog: str, verbose: int) -> None:
    """Make the log handler :func:`logging.basicConfig` put on standard error print
    records as ``PROG: message`` on one line (unless ``verbose``)."""
    if verbose:
        return
    for h in logging.getLogger().handlers:
        if type(h) is logging.StreamHandler and getattr(h, "stream", None) is sys.stderr:
            h.setFormatter(_Voice(prog))
