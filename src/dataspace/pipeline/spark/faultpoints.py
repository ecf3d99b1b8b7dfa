"""Fault points: the places where the Spark connector lets a test harness act.

The connector calls :func:`point` at chosen places: ``source`` (the stream reader's
``latestOffset``, on the driver), ``partitions`` (planning a batch, on the driver),
``read`` (a partition's read, on an executor), ``stage`` (a read task of a pure
processor has staged its outputs, on an executor), ``write`` (a write task, on an
executor), ``sink`` (a side-effecting function has run, before our commit),
``commit-inside`` (our commit's writes are done but not committed) and ``commit-after``
(our commit is durable, Spark's commit log not yet written).

Nothing happens unless the environment names a hook, ``MODULE:FUNCTION``, called with
the point's name; the environment is what reaches every process of a run (Spark's
executors and Python workers inherit the driver's)::

    DATASPACE_SPARK_FAULT_HOOK=dataspace.testing.spark_faults:point

The crash harness (:mod:`dataspace.testing.spark_faults`) kills the whole driver there.
The product imports no harness: the hook is looked up by name, and only when set.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

__all__ = ["HOOK_ENV", "POINTS", "point"]

HOOK_ENV = "DATASPACE_SPARK_FAULT_HOOK"
POINTS = ("source", "partitions", "read", "stage", "write", "sink", "commit-inside", "commit-after")

_hook: tuple[str, Callable[[str], None]] | None = None


def point(name: str) -> None:
    """A fault point: calls the hook the environment names, if any, with ``name``."""
    spec = os.environ.get(HOOK_ENV)
    if not spec:
        return
    global _hook
    if _hook is None or _hook[0] != spec:
        module, _, attr = spec.partition(":")
        fn = getattr(importlib.import_module(module), attr or "point")
        _hook = (spec, fn)
    _hook[1](name)
