"""Pipelines on a Spark standalone cluster (tests/spark_cluster.py: a Master and a Worker on
loopback, the Worker unable to see the driver's data) with a PostgreSQL store: the
executors do the reading (readOn=executor), run the functions and stage the outputs in
the store; the driver's commit makes them visible.

A process has one SparkSession (the run's own is local[2]), so the cluster's drivers are
processes of their own: tests/cluster_driver.py, once, for ``dataspace pipeline run``
(the command's code in that process), the connector and routing; the Spark crash
harness's children for the SIGKILL test.  Proof that the executors did the work: they
do not see a marker file the driver wrote, and the store's connections after a read
belong to processes of the Worker's session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import dataspace.values.model
from dataspace._build import BUILD
from dataspace.pattern import match, parse_pattern
from dataspace.pipeline.spark.session import read_on
from dataspace.pipeline.spark.source import OptionError, parse_options
from dataspace.streams import open_store
from dataspace.values import encode, parse, stringify

pytest.importorskip("pyspark")

TIMEOUT = 300.0
HERE = Path(__file__).resolve().parent


# -- no cluster needed -------------------------------------------------------------------------


def test_where_the_connector_reads():
    assert read_on("local[2]", "/data/streams.sqlite3") == "executor"
    assert read_on("local-cluster[2,1,1024]", "/data/streams.sqlite3") == "executor"
    assert read_on("spark://h:7077", "/data/streams.sqlite3") == "driver"
    assert read_on("spark://h:7077", "postgresql://app@db/app") == "executor"
    assert read_on("yarn", "postgres://app@db/app") == "executor"


def test_a_store_url_neither_sqlite_nor_postgresql_is_refused(tmp_path):
    for url in ("mysql://u:secret@h/db", "redis://localhost/0"):
        with pytest.raises(OptionError, match="not a stream store URL") as e:
            parse_options({"store": url, "stream": "x"})
        assert "secret" not in str(e.value)
    assert not list(tmp_path.iterdir())
    assert not any(p.name.startswith(("mysql", "redis")) for p in Path.cwd().iterdir())


# -- the cluster -----------------------------------------------------------------------------


def test_the_worker_cannot_see_the_drivers_data(spark_cluster, tmp_path):
    marker = tmp_path / "marker"
    marker.write_text("driver only\n")
    root = f"/proc/{spark_cluster.worker.pid}/root"
    assert marker.exists() and not os.path.exists(root + str(marker))
    assert os.path.exists(root + str(spark_cluster.shared))
    spark_cluster.check_hidden()


GRAPH = """\
import os

from dataspace.pipeline import Graph

MARKER = {marker!r}
graph = Graph({name!r})
graph.source("nums", "words", "extra")
graph.map("where", "nums", "where", lambda v: os.path.exists(MARKER))
graph.map("double", "nums", "doubled", lambda v: v * 2)
if {full!r}:
    graph.join("pair", ["nums", "words"], "pairs", lambda n, w: [n, w])
    graph.alts("either", ["words", "extra"], "merged", lambda v: v)

    @graph.dataframe("big", "nums", "big")
    def big(df):
        return df.where("cast(text as int) >= 30").select("index", "value")
"""

NUMS, WORDS, EXTRA = list(range(40)), [f"w{i}" for i in range(30)], [f"x{i}" for i in range(10)]


def _graph_file(d: Path, name: str, marker: Path, full: bool) -> Path:
    g = d / f"{name}.py"
    g.write_text(GRAPH.format(marker=str(marker), name=name, full=full))
    return g


def _fill(url) -> None:
    with open_store(url) as store:
        store.append_many("nums", NUMS)
        store.append_many("words", WORDS)
        store.append_many("extra", EXTRA)


@pytest.fixture(scope="module")
def driver_run(spark_cluster, pg_server, tmp_path_factory, spark_jvm_archive):
    """tests/cluster_driver.py run once on the cluster: its RESULT, the stores it used and
    the connector's input values."""
    d = tmp_path_factory.mktemp("cluster-driver")
    marker = d / "marker"
    marker.write_text("driver only\n")
    names = [f"cluster_{what}_{os.getpid()}" for what in ("connector", "pipeline")]
    url, pipe_url = (pg_server.create_database(n) for n in names)
    values = [parse(f'<Says "u{i % 4}" "m{i}">') if i % 3 else i for i in range(100)]
    with open_store(url) as s:
        s.append_many("a", values)
    with open_store(d / "sqlite") as s:
        s.append_many("s", range(7))
    _fill(pipe_url)
    _fill(d / "pipe-sqlite")
    run = ["pipeline", "run", "--master", spark_cluster.master_url, "--until-idle", "--batch", "16"]
    cfg = {"master": spark_cluster.master_url, "conf": spark_cluster.conf(), "pg_url": url,
           "sqlite_dir": str(d / "sqlite"), "marker": str(marker), "checkpoint": str(d / "ckpt"),
           "worker_sid": spark_cluster.worker_sid, "log": str(d / "spark.log"),
           "pipeline_runs": [
               {"name": "postgresql", "store": pipe_url,
                "argv": [*run, str(_graph_file(d, "cluster", marker, True)), "--store", pipe_url,
                         "--data-dir", str(d / "pipe-data")]},
               {"name": "sqlite",
                "argv": [*run, str(_graph_file(d, "sqlite_cluster", marker, False)),
                         "--data-dir", str(d / "pipe-sqlite")]},
           ]}
    (d / "cfg.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, str(HERE / "cluster_driver.py"), str(d / "cfg.json")],
                       capture_output=True, text=True, timeout=TIMEOUT,
                       env=spark_cluster.driver_env(), cwd=d)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    yield json.loads(lines[-1][len("RESULT "):]), values, {"postgresql": pipe_url, "sqlite": d / "pipe-sqlite"}
    for n in names:
        pg_server.drop_database(n)


def test_the_connector_reads_on_the_executors(driver_run, spark_cluster):
    res, values, _stores = driver_run
    assert res["master"] == spark_cluster.master_url
    assert res["executor_sees_marker"] == [False]
    assert res["batch_partitions"] == 4
    assert res["batch_rows"] == [[i, stringify(v)] for i, v in enumerate(values)]
    # The reads opened the store in the executors' Python workers (the Worker's session).
    assert res["executor_clients"], "no connection to the store from the worker's processes"


def test_the_executors_run_the_drivers_core(driver_run):
    """The package zip carries the compiled core; executors on the driver's platform run
    it (extracted beside the zip), others would run the source (test_compiled_differential
    covers that choice)."""
    res, _values, _stores = driver_run
    [(compiled, describe, model_file)] = res["executor_core"]
    assert (compiled, describe) == (BUILD.compiled, BUILD.describe()), res["executor_core"]
    assert ("/dataspace-core-" in model_file) == BUILD.compiled  # not the driver's own file
    assert model_file != dataspace.values.model.__file__


def test_streaming_read_and_writers_on_the_cluster(driver_run):
    res, values, _stores = driver_run
    assert res["copied"] == res["a"] == [encode(v).hex() for v in values]
    assert res["stream_batches"] == 3  # 100 rows, 40 per batch
    assert res["written"] == sorted(f"<w {i}>" for i in range(30))
    # The write tasks staged their rows in the store (the driver only committed them):
    # the streaming writer's batches of 40, 40 and 20 rows in 20-row partitions, and the
    # batch writer's 3 partitions.
    assert res["writers_staged"] == {"parts": 8, "left": 0}, res["writers_staged"]


def test_routing_on_the_cluster(driver_run):
    res, values, _stores = driver_run
    want = []
    for pid, text in (("says", "<Says $who _>"), ("num", "$n")):
        pat = parse_pattern(text)
        for i, v in enumerate(values):
            caps = match(pat, v)
            if caps is not None:
                want.append([pid, i, [stringify(c) for c in caps]])
    assert res["route"] == sorted(want)


def test_executor_reads_of_an_sqlite_store_on_a_cluster_are_refused(driver_run, spark_cluster):
    res, _values, _stores = driver_run
    for key in ("sqlite_error", "sqlite_stream_error"):
        err = res[key]
        assert "\n" not in err.strip(), err
        assert f"readOn=executor: the executors of {spark_cluster.master_url} cannot open the SQLite store" in err
        assert "postgresql://USER@HOST/DATABASE" in err
    assert res["sqlite_jobs"] == []  # refused while planning: no job started
    assert res["sqlite_driver_rows"] == list(range(7))


def test_the_shipped_package_zip_is_removed_when_the_session_ends(driver_run):
    res, _values, _stores = driver_run
    assert len(res["zip_dirs"]) == 1 and res["zip_present"]
    assert Path(res["zip_dirs"][0]).name.startswith("dataspace-pyfiles-")
    assert res["zip_after_stop"] == []


def test_pipeline_run_on_the_cluster_reads_and_works_on_the_executors(driver_run, spark_cluster):
    """``pipeline run --master spark://... --store postgresql://...`` of a map, a join, an
    alts and a DataFrame processor: exactly the expected outputs; the functions ran where
    the driver's marker is invisible; the store's connections after the run are the
    executors' (they did the reading)."""
    res, _values, stores = driver_run
    run = res["pipeline_runs"]["postgresql"]
    assert run["rc"] == 0, run["stderr"]
    assert f"engine spark on {spark_cluster.master_url}" in run["stdout"]
    assert "driver does all the reading" not in run["stderr"]
    assert run["executor_clients"], "no connection to the graph's store from the worker's processes"
    # ...and the writing: the read tasks of map, join and alts staged their outputs (the
    # commits took every part: nothing is left), so no output went through the driver.
    staged = run["staged"]
    assert staged["registered"] >= 3 and staged["left"] == staged["tables_left"] == 0, staged
    with open_store(stores["postgresql"]) as store:
        assert [e.value for e in store.read("doubled")] == [2 * i for i in NUMS]
        assert [e.value for e in store.read("where")] == [False] * len(NUMS)
        assert [e.value for e in store.read("pairs")] == [[n, w] for n, w in zip(NUMS, WORDS)]
        assert Counter(e.value for e in store.read("merged")) == Counter(WORDS + EXTRA)
        assert [e.value for e in store.read("big")] == NUMS[30:]


def test_pipeline_run_with_an_sqlite_store_on_a_cluster_reads_on_the_driver(driver_run):
    res, _values, stores = driver_run
    run = res["pipeline_runs"]["sqlite"]
    assert run["rc"] == 0, run["stderr"]
    notes = [x for x in run["stderr"].splitlines() if "driver does all the reading" in x]
    assert len(notes) == 1, run["stderr"]
    assert "a PostgreSQL store (--store postgresql://USER@HOST/DATABASE) lets the executors do it" in notes[0]
    with open_store(stores["sqlite"]) as store:
        assert [e.value for e in store.read("doubled")] == [2 * i for i in NUMS]
        # the driver read the rows; the executors still ran the functions
        assert [e.value for e in store.read("where")] == [False] * len(NUMS)


def test_sigkills_of_the_driver_and_of_the_worker_on_the_cluster(spark_cluster, pg_url, tmp_path):
    """The Spark crash harness on the cluster with a PostgreSQL store: the driver killed
    inside a commit, then the Worker with its executor killed in the middle of a batch (a
    new Worker takes over, the driver carries on); the outputs are exactly the expected
    multisets.  (Every point and random moments: the local harness, test_spark_crash.)"""
    from dataspace.testing.spark_crash import run_campaign

    lines: list[str] = []
    before = spark_cluster.workers_started
    res = run_campaign(str(tmp_path), kills=2, messages=100, seed=11, batch=40,
                       plan=["commit-inside", "stage"], store=pg_url,
                       master=spark_cluster.master_url, conf=spark_cluster.conf(),
                       worker_sid=lambda: spark_cluster.worker_sid,
                       fault_base=str(spark_cluster.shared), say=lines.append)
    assert res.problems == [], "\n".join(lines + res.problems)
    assert res.points == {"commit-inside": 1, "stage": 1}, res.points
    spark_cluster.wait_workers(before + 1)
