"""Engines run graphs: ``spark`` (the default: Structured Streaming through PySpark,
:mod:`.spark`) and ``local`` (this process, :mod:`.local`).

An engine is created with a validated :class:`~.graph.Graph` and a stream store, and
implements :class:`Engine`.  ``dataspace pipeline run --engine NAME`` looks the name up in
:data:`ENGINES` (``module:Class``), so adding an engine is one entry and one module.
"""

from __future__ import annotations

import difflib
import importlib
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from .._extras import require
from ..streams.base import LockHeld, Store, StoreLock
from .graph import Graph

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "GUARANTEES",
    "Engine",
    "EngineError",
    "Interrupted",
    "MissingSource",
    "ProcStats",
    "check_sources",
    "claim_graph",
    "get_engine",
    "graph_holder",
    "holder_engine",
]

ENGINES: dict[str, str] = {
    "local": "dataspace.pipeline.local:LocalEngine",
    "spark": "dataspace.pipeline.spark:SparkEngine",
}
DEFAULT_ENGINE = "spark"
ENGINE_EXTRAS: dict[str, tuple[str, str]] = {"spark": ("spark", "the Spark engine")}
"""The extra an engine needs (pyproject.toml), and the engine's name in its message."""
GUARANTEES = ("exactly-once", "at-most-once")


class EngineError(RuntimeError):
    """The engine cannot run the graph (the message says why and what to do)."""


class MissingSource(EngineError):
    """A source stream of the graph does not exist in the store (``missing`` names them)."""

    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


def check_sources(graph: Graph, store: Store) -> None:
    """Refuse a graph whose declared sources are not in ``store``: :class:`MissingSource`,
    whose one line names them, the streams there, the likely intended name and the two
    ways out.  A source declared with ``graph.source(name, create=True)`` may be missing
    (the engine creates it).  Every engine calls this before it claims the graph or
    creates anything, so a refused run leaves no trace in the store; ``pipeline check``
    and ``pipeline run`` call it before anything starts (Spark included).

    A source that does not exist is almost always a typo, and a run over an empty stream
    it made up would wait forever (or report "idle") -- Kafka Streams refuses a missing
    source topic for the same reason."""
    missing = [s for s in graph.sources
               if s not in graph.created_sources and not store.has_stream(s)]
    if missing:
        there = [i.name for i in store.streams()]
        missing = [s for s in missing if s not in there]  # unless created meanwhile
        if missing:
            raise MissingSource(missing_sources_message(store, missing, there), missing)


def missing_sources_message(store: Store, missing: list[str], there: list[str]) -> str:
    """The one line of :func:`check_sources` (see there); ``there``: the store's streams."""
    if there:
        shown = ", ".join(there[:8]) + (f", ... ({len(there)} in all)" if len(there) > 8 else "")
        hint = f"streams there: {shown}"
    else:
        hint = "it has no streams yet"
    guesses = {s: difflib.get_close_matches(s, there, n=1) for s in missing}
    means = [f"{m[0]!r}" + (f" for {s!r}" if len(missing) > 1 else "")
             for s, m in guesses.items() if m]
    if means:
        hint += f"; did you mean {', '.join(means)}?"
    if len(missing) == 1:
        s = missing[0]
        return (f"source stream {s!r} does not exist in {store.display} ({hint}); create it "
                f"with `dataspace stream create {s}` or declare it with "
                f"graph.source({s!r}, create=True)")
    names = ", ".join(repr(s) for s in missing)
    return (f"source streams {names} do not exist in {store.display} ({hint}); create them "
            "with `dataspace stream create NAME` or declare them with "
            "graph.source(NAME, create=True)")


class Interrupted(EngineError):
    """The engine was stopped (Ctrl-C) while it was starting: nothing ran."""


def claim_graph(store: Store, graph: str, engine: str = "") -> StoreLock:
    """Claim ``graph`` on ``store`` for this process, whatever the engine: the store's lock
    ``graph:NAME`` (a ``flock``ed file beside an SQLite store, a session advisory lock on
    PostgreSQL), released when the process dies, its holder saying which ``engine`` runs
    the graph (:func:`graph_holder`).  Release the result to give it up;
    :class:`EngineError` when another process runs the graph -- two runs would break
    exactly-once."""
    try:
        return store.lock(f"graph:{graph}", f"engine {engine}" if engine else "")
    except LockHeld as e:
        raise EngineError(
            f"graph {graph!r} is already running on this store ({e.holder}); "
            "stop it first -- two runs of one graph would break exactly-once"
        ) from None


def graph_holder(store: Store, graph: str) -> str | None:
    """Who runs ``graph`` on the store (``"pid N, engine local"``, ``"pid N on HOST,
    engine spark"``), or None."""
    return store.lock_holder(f"graph:{graph}")


def holder_engine(holder: str | None) -> str | None:
    """The engine a :func:`graph_holder` names (None: not running, or a holder that did
    not say)."""
    if holder is None:
        return None
    m = re.search(r"\bengine (\w+)", holder)
    return m.group(1) if m else None


@dataclass
class ProcStats:
    """Progress of one processor (messages in = input messages consumed; out = output
    messages written; errors = error records written: each counted once committed; lag =
    unread entries per input, from the committed positions)."""

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
    activity: str = ""  # what it is doing now, if that takes long ("batch 3: 5,000 messages")
    activity_s: float = 0.0  # for how many seconds
    detail: str | None = None  # the failure's traceback (the user's code), with error
    retries: int = 0  # disruptions since the run started: tasks failed and run again (Spark)


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
    if name in ENGINE_EXTRAS:
        require(*ENGINE_EXTRAS[name])  # MissingExtra: one line saying how to install it
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise EngineError(f"the {name} engine is not available here ({e})") from e
    return getattr(mod, cls)  # type: ignore[no-any-return]
