"""Processor graphs over durable streams, with exactly-once delivery (seed 002).

>>> import tempfile
>>> from dataspace.streams import open_store
>>> g = Graph("demo")
>>> g.source("numbers")
>>> _ = g.map("double", "numbers", "doubled", lambda n: n * 2)
>>> store = open_store(tempfile.mkdtemp())
>>> _ = store.append_many("numbers", [1, 2, 3])
>>> with LocalEngine(g, store) as engine:
...     _ = engine.drain()
>>> [e.value for e in store.read("doubled")]
[2, 4, 6]
>>> store.close()

* :mod:`.graph` -- the graph model (:class:`Graph`, processor kinds, validation).
* :mod:`.exactly_once` -- backing-stream records, the delivery hash, the recovery component.
* :mod:`.local` -- the local engine (:class:`LocalEngine`); :mod:`.engine` -- the engine
  interface and registry (``spark``, the default, in :mod:`.spark`; ``local``).
* :mod:`.reset` -- reprocessing a graph from the start (:func:`reset_graph`, ``dataspace
  pipeline reset``).
* :mod:`.sinks` -- :class:`SQLiteSink`, the idempotent side-effecting sink pattern.
* :mod:`.loader` -- loading a graph from a Python file (``dataspace pipeline run``).

The SIGKILL crash harnesses are in :mod:`dataspace.testing` (``python -m
dataspace.testing.pipeline_crash``, ``python -m dataspace.testing.spark_crash``).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .engine import (
        DEFAULT_ENGINE,
        ENGINES,
        Engine,
        EngineError,
        MissingSource,
        ProcStats,
        get_engine,
    )
    from .exactly_once import delivery_hash
    from .graph import Context, Delivery, Graph, GraphError, Message, Processor
    from .local import Crash, LocalEngine
    from .reset import reset_graph

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "Context",
    "Crash",
    "Delivery",
    "Engine",
    "EngineError",
    "Graph",
    "GraphError",
    "LocalEngine",
    "Message",
    "MissingSource",
    "ProcStats",
    "Processor",
    "delivery_hash",
    "get_engine",
    "reset_graph",
]

_WHERE = {
    "DEFAULT_ENGINE": "engine",
    "ENGINES": "engine",
    "Engine": "engine",
    "EngineError": "engine",
    "MissingSource": "engine",
    "ProcStats": "engine",
    "get_engine": "engine",
    "delivery_hash": "exactly_once",
    "Context": "graph",
    "Delivery": "graph",
    "Graph": "graph",
    "GraphError": "graph",
    "Message": "graph",
    "Processor": "graph",
    "Crash": "local",
    "LocalEngine": "local",
    "reset_graph": "reset",
}


__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
