"""Helpers for the library's own background threads."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["start_daemon"]


def start_daemon(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """Start a daemon thread that leaves SIGINT and SIGTERM to the main thread.

    A process-directed signal may be delivered to any thread that does not block it; if
    a helper thread took a Ctrl-C, a main thread blocked in a wait would never see its
    KeyboardInterrupt.  The mask is set in the new thread before ``target`` runs.
    """

    def run() -> None:
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        target(*args)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t
