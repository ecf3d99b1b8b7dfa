"""Engines run graphs: ``spark`` (the default: Structured Streaming through PySpark,
:mod:`.spark`) and ``local`` (this process, :mod:`.local`).

An engine is created with a validated :class:`~.graph.Graph` and a stream store, and
implements :class:`Engine`.  ``dataspace pipeline run --engine NAME`` looks the name up in
:data:`ENGINES` (``module:Class``), so adding an engine is one entry and one module.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from ..streams.base import Store
from .graph import Graph

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "GUARANTEES",
    "Engine",
    "EngineError",
    "ProcStats",
    "claim_graph",
    "get_engine",
    "graph_holder",
]

ENGINES: dict[str, str] = {
    "local": "dataspace.pipeline.local:LocalEngine",
    "spark": "dataspace.pipeline.spark:SparkEngine",
}
DEFAULT_ENGINE = "spark"
GUARANTEES = ("exactly-once", "at-most-once")


class EngineError(RuntimeError):
    """The engine cannot run the graph (the message says why and what to do)."""


def _lock_path(db_path: str | os.PathLike[str], graph: str) -> str:
    db = str(db_path)
    return os.path.join(os.path.dirname(db), os.path.basename(db) + "-locks", f"{graph}.lock")


def claim_graph(db_path: str | os.PathLike[str], graph: str) -> int:
    """Claim ``graph`` on the store at ``db_path`` for this process, whatever the engine:
    an exclusive ``flock`` on a lock file holding our pid, released by the kernel when the
    process dies.  Returns the file descriptor (close it to release); :class:`EngineError`
    when another process runs the graph -- two runs would break exactly-once."""
    path = _lock_path(db_path, graph)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip()
        finally:
            os.close(fd)
        raise EngineError(
            f"graph {graph!r} is already running on this store (pid {other or '?'}); "
            "stop it first -- two runs of one graph would break exactly-once"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def graph_holder(db_path: str | os.PathLike[str], graph: str) -> str | None:
    """The pid of the process running ``graph`` on the store (as text), or None."""
    try:
        fd = os.open(_lock_path(db_path, graph), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    finally:
        os.close(fd)
    return None


@dataclass
class ProcStats:
    """Progress of one processor (messages in = input messages consumed; out = output
    messages written; errors = error records written; lag = unread entries per input)."""

    name: str
    kind: str
    consumed: int = 0
    produced: int = 0
    errors: int = 0
    steps: int = 0
    lag: dict[str, int] = field(default_factory=dict)
    state: str = "idle"  # idle | running | waiting (a join missing inputs) | failed
    error: str | None = None
    recovery: str = ""


class Engine(ABC):
    """What every engine offers (see :class:`~.local.LocalEngine` for the options)."""

    name = "?"

    def __init__(self, graph: Graph, store: Store) -> None:
        graph.validate()
        self.graph = graph
        self.store = store
        self._stop = threading.Event()

    @abstractmethod
    def start(self) -> None:
        """Claim the graph and run the recovery component for every processor."""

    @abstractmethod
    def run(
        self,
        stop: threading.Event | None = None,
        *,
        until_idle: bool = False,
        on_progress: Callable[[list[ProcStats]], None] | None = None,
        progress_interval: float = 1.0,
    ) -> list[ProcStats]:
        """Process until ``stop`` is set (or :meth:`stop` is called), or with
        ``until_idle`` until no processor has input; returns the final statistics."""

    @abstractmethod
    def stats(self) -> list[ProcStats]:
        """Current statistics (lag read from the store)."""

    def stop(self) -> None:
        """Ask :meth:`run` to finish its current step, commit and return."""
        self._stop.set()
        try:
            self.store.wake()
        except Exception:  # the store may already be closed
            pass

    @abstractmethod
    def close(self) -> None:
        """Release the graph (no writes)."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def get_engine(name: str) -> type[Engine]:
    """The engine class registered as ``name`` (``EngineError`` if unknown/unavailable)."""
    target = ENGINES.get(name)
    if target is None:
        raise EngineError(f"unknown engine {name!r}; available: {', '.join(sorted(ENGINES))}")
    module, _, cls = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise EngineError(f"the {name} engine is not available here ({e})") from e
    return getattr(mod, cls)  # type: ignore[no-any-return]
