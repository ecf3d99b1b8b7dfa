"""A driver program for the cluster tests (tests/test_spark_cluster.py): one SparkSession on
the standalone cluster; ``dataspace pipeline run`` of graphs on a PostgreSQL and an SQLite
store (the command's own code, in this process, on this session), the connector's reads
and writes on a PostgreSQL store, the refusal of executor reads of an SQLite store,
routing, and the end of the session.  One process, so that the cluster tests pay for one
driver's start-up.

``python tests/cluster_driver.py CONFIG.json`` prints ``RESULT <json>`` as its last line:
what the test checks.  A separate process because a process has one SparkSession (the
test run's own is local[2]).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

from dataspace.cli import main as cli_main
from dataspace.pipeline.spark import session as spark_session
from dataspace.pipeline.spark._store import store_options
from dataspace.pipeline.spark.route import route
from dataspace.pipeline.spark.session import get_session, stop_session
from dataspace.streams import open_store
from spark_cluster import store_clients_in_session


def one_line_error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # what a program sees: the connector's one line
        return str(e)
    return ""


def _has_registry(url: str) -> bool:
    import psycopg

    with psycopg.connect(url, autocommit=True) as c:
        return c.execute("SELECT to_regclass('dataspace.staged')").fetchone()[0] is not None


def staged_parts(url: str) -> dict[str, int]:
    """What the read tasks staged in the PostgreSQL store (only they call Store.stage):
    parts ever registered (the registry's identity sequence keeps counting after the
    commits delete its rows) and parts or tables left over (the commits take them)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as c:
        seq = c.execute("SELECT pg_get_serial_sequence('dataspace.staged', 'id')").fetchone()[0]
        last, called = c.execute(f"SELECT last_value, is_called FROM {seq}").fetchone()
        left = c.execute("SELECT count(*) FROM dataspace.staged").fetchone()[0]
        tables = c.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'dataspace' "
                           "AND tablename LIKE 'staged\\_%'").fetchone()[0]
    return {"registered": last if called else 0, "left": left, "tables_left": tables}


def _executor_core() -> tuple[bool, str, str]:
    import dataspace._build as b
    import dataspace.values.model as m

    return b.BUILD.compiled, b.BUILD.describe(), m.__file__


def main(config_path: str) -> int:
    with open(config_path, encoding="utf-8") as f:
        cfg = json.load(f)
    url, sqlite_dir, marker = cfg["pg_url"], cfg["sqlite_dir"], cfg["marker"]
    res: dict[str, Any] = {}

    spark, created = get_session(cfg["master"], app_name="dataspace cluster test", conf=cfg["conf"],
                                 log_file=cfg["log"])
    assert created
    sc = spark.sparkContext
    res["master"] = sc.master
    res["zip_dirs"] = [str(d) for d in spark_session._shipped]
    res["zip_present"] = all(os.path.isdir(d) for d in res["zip_dirs"])

    # Where the executors are: their processes do not see the driver's marker file.
    res["executor_sees_marker"] = sorted(set(sc.parallelize(range(4), 2).map(
        lambda _: os.path.exists(marker)).collect()))

    # Which core the executors' Python workers run: the compiled one shipped in the
    # package zip where their platform matches the driver's (here: the same machine).
    res["executor_core"] = sorted(set(sc.parallelize(range(2), 2).map(
        lambda _: _executor_core()).collect()))

    # dataspace pipeline run: the command's code on this session (it keeps a session it
    # did not start).
    runs = {}
    for run in cfg["pipeline_runs"]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli_main(run["argv"])
        runs[run["name"]] = entry = {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}
        if run.get("store"):  # who holds the store's connections: the executors read
            entry["executor_clients"] = store_clients_in_session(cfg["worker_sid"], run["store"])
            entry["staged"] = staged_parts(run["store"])
    res["pipeline_runs"] = runs

    # Batch read on the executors, from PostgreSQL.
    opts = store_options(url)
    df = (spark.read.format("dataspace").options(**opts).option("stream", "a")
          .option("partitionRows", 25).load())
    res["batch_partitions"] = df.rdd.getNumPartitions()
    res["batch_rows"] = sorted((r["index"], r["text"]) for r in df.collect())

    # Streaming read -> the streaming writer (exactly once), Trigger.AvailableNow.
    staged_before = staged_parts(url)["registered"] if _has_registry(url) else 0
    q = (spark.readStream.format("dataspace").options(**opts).option("stream", "a")
         .option("maxRowsPerBatch", 40).option("partitionRows", 20).load()
         .select("index", "value").writeStream.format("dataspace").options(**opts)
         .option("stream", "copied").option("checkpointLocation", cfg["checkpoint"])
         .trigger(availableNow=True).start())
    try:
        assert q.awaitTermination(240), "the streaming query did not finish"
    finally:
        q.stop()
    res["stream_batches"] = sum(1 for p in q.recentProgress if p["numInputRows"])

    # The batch writer: executors encode the rows, the driver commits the job.
    (spark.createDataFrame([(f"<w {i}>",) for i in range(30)], "text string")
     .repartition(3).write.format("dataspace").options(**opts).option("stream", "written")
     .mode("append").save())

    after = staged_parts(url)
    res["writers_staged"] = {"parts": after["registered"] - staged_before, "left": after["left"]}

    # Routing: the values read from PostgreSQL by the executors.
    pats = [("says", "<Says $who _>"), ("num", "$n")]
    res["route"] = sorted((r["pattern"], r["index"], r["captures_text"])
                          for r in route(spark, pats, "a", store=url).collect())

    # The executors' Python workers hold the store's connections (they did the reading).
    res["executor_clients"] = store_clients_in_session(cfg["worker_sid"], url)

    # An SQLite store on a cluster: readOn=executor (the default) is refused before any job
    # runs; readOn=driver reads on the driver.
    sc.setJobGroup("sqlite", "SQLite store on a cluster")
    res["sqlite_error"] = one_line_error(lambda: spark.read.format("dataspace").option(
        "store", sqlite_dir).option("stream", "s").load().collect())
    res["sqlite_stream_error"] = one_line_error(lambda: spark.readStream.format("dataspace").option(
        "store", sqlite_dir).option("stream", "s").load())
    res["sqlite_jobs"] = list(sc.statusTracker().getJobIdsForGroup("sqlite"))
    res["sqlite_driver_rows"] = sorted(r["index"] for r in spark.read.format("dataspace").option(
        "store", sqlite_dir).option("stream", "s").option("readOn", "driver").load().collect())
    sc.setJobGroup("other", "")

    stop_session()
    res["zip_after_stop"] = [d for d in res["zip_dirs"] if os.path.exists(d)]
    with open_store(url) as st:
        res["copied"] = [e.data.hex() for e in st.read("copied", 0, 10**6)]
        res["a"] = [e.data.hex() for e in st.read("a", 0, 10**6)]
        res["written"] = sorted(str(e.value) for e in st.read("written", 0, 10**6))
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
