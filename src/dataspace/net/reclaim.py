"""Giving memory back after many short-lived connections closed.

A connection's objects hold each other in cycles (its relay calls back into it, its
timers and exceptions refer to it), so what a closed one held is freed by the garbage
collector, not at once; a server tunes the collector to run seldom (``cli/serve.py``), so
under a churn of peers that never become clients (strangers on a cluster port, TLS
handshakes that never finish) that memory waited for a full collection that hardly
came, and what the C allocator got back it kept.  A :class:`Reclaimer` is told of each
close; after ``every`` of them it runs a full collection and gives the freed memory back
to the system (``malloc_trim``), ``delay`` seconds after the close that made them
``every`` and at most once per ``interval`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Callable

__all__ = ["Reclaimer", "malloc_trim"]

log = logging.getLogger(__name__)


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (another C library: nothing to trim)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim  # type: ignore[no-any-return]
    return None


class Reclaimer:
    """See the module docstring; ``what`` names the closes in the debug log."""

    def __init__(self, what: str, every: int, *, interval: float = 10.0,
                 delay: float = 1.0) -> None:
        self.what = what
        self.every = every
        self.interval = interval
        self.delay = delay
        self.runs = 0
        """Times memory was given back."""
        self._since = 0
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def closed(self, n: int = 1) -> None:
        """``n`` connections closed (call from the event loop)."""
        self._since += n
        if self._since < self.every or self._timer is not None:
            return  # (armed once: a churn that never pauses is reclaimed all the same)
        wait = max(self.delay, self._last + self.interval - time.monotonic())
        self._timer = asyncio.get_running_loop().call_later(wait, self._run)

    def _run(self) -> None:
        self._timer = None
        self._since = 0
        self._last = time.monotonic()
        t0 = time.perf_counter()
        gc.collect()
        trim = malloc_trim()
        if trim is not None:
            trim(0)
        self.runs += 1
        log.debug("gave memory back to the system after %s closed (%.0f ms)", self.what,
                  1000 * (time.perf_counter() - t0))

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
