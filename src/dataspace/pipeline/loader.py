"""Loading a graph from a Python file (``dataspace pipeline run GRAPH.py``).

The file is run as a script (its directory first on ``sys.path``, so it can import its
neighbours) and must leave a :class:`~.graph.Graph` behind: a variable named ``graph``,
a function ``build_graph()`` returning one, or exactly one ``Graph`` among its globals.
The graph is validated before it is returned.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path

from .graph import Graph, GraphError

__all__ = ["GraphLoadError", "load_graph"]


class GraphLoadError(ValueError):
    """The graph file could not be loaded (the message says where and why)."""


def load_graph(path: str | os.PathLike[str]) -> Graph:
    """Run the graph file at ``path`` and return its validated graph."""
    p = Path(path)
    if not p.is_file():
        raise GraphLoadError(f"no graph file at {p} (expected a Python file defining `graph`)")
    directory = str(p.resolve().parent)
    sys.path.insert(0, directory)
    try:
        try:
            ns = runpy.run_path(str(p), run_name="__dataspace_graph__")
        except SyntaxError as e:
            raise GraphLoadError(
                f"{p}:{e.lineno}: syntax error: {e.msg}"
            ) from None
        except SystemExit as e:
            raise GraphLoadError(f"{p} called exit({e.code}) while being loaded") from None
        except Exception as e:
            tb = traceback.extract_tb(e.__traceback__)
            where = next((f"{f.filename}:{f.lineno}" for f in reversed(tb)
                          if Path(f.filename).resolve() == p.resolve()), str(p))
            raise GraphLoadError(f"{where}: loading the graph raised {type(e).__name__}: {e}") from e
    finally:
        try:
            sys.path.remove(directory)
        except ValueError:
            pass
    graph = ns.get("graph")
    if graph is None and callable(ns.get("build_graph")):
        try:
            graph = ns["build_graph"]()
        except Exception as e:
            raise GraphLoadError(f"{p}: build_graph() raised {type(e).__name__}: {e}") from e
    if graph is None:
        found = [v for v in ns.values() if isinstance(v, Graph)]
        if len(found) == 1:
            graph = found[0]
        elif len(found) > 1:
            raise GraphLoadError(
                f"{p} defines {len(found)} graphs; name the one to run `graph`"
            )
    if not isinstance(graph, Graph):
        raise GraphLoadError(
            f"{p} does not define a graph: assign a dataspace.pipeline.Graph to a variable "
            "named `graph` (or define build_graph() returning one)"
        )
    try:
        graph.validate()
    except GraphError as e:
        raise GraphLoadError(f"{p}: {e}") from None
    return graph
