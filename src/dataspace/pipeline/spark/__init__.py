"""Running pipelines on Apache Spark through PySpark (see docs/spark.md).

* :mod:`.session` -- set-up: the Java check, one SparkSession per process, quiet logs,
  ``PYSPARK_PYTHON``, shipping the package to cluster workers;
* :mod:`.source` -- ``spark.read`` / ``spark.readStream.format("dataspace")``: streams as
  DataFrames, offsets are stream indices, partitions are index ranges;
* :mod:`.sink` -- ``writeStream.format("dataspace")``: each micro-batch committed once,
  keyed by the delivery hash of seed 002;
* :mod:`.engine` -- :class:`SparkEngine` (``dataspace pipeline run``'s default engine);
* :mod:`.placement` -- where a master's work runs, and so where the connector reads a
  store (the executors, or the driver for an SQLite store on a cluster);
* :mod:`.route` -- matching a table of values against a table of patterns;
* :mod:`.classdata`, :mod:`.warmup` -- the JVM's class-data archive: made once, mapped
  by every session's JVM (half the start-up);
* :mod:`.faultpoints` -- the fault points a crash harness arms (the harness itself:
  :mod:`dataspace.testing.spark_crash`); :mod:`.reaper` -- killing a driver's session;
* :mod:`.status` -- reading the engine's progress files (no Spark needed).

PySpark is imported lazily: ``import dataspace.pipeline.spark`` does not start or import
Spark; the names below are loaded on first use.
"""

from __future__ import annotations

from ..._lazy import lazy_exports

__all__ = [
    "SparkEngine",
    "SparkSetupError",
    "check_java",
    "get_session",
    "load_patterns",
    "register",
    "route",
    "stop_session",
]

_WHERE = {
    "SparkEngine": "engine",
    "SparkSetupError": "session",
    "check_java": "session",
    "get_session": "session",
    "register": "session",
    "stop_session": "session",
    "route": "route",
    "load_patterns": "route",
}


__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
