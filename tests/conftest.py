"""Shared test configuration."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

from dataspace.pipeline.spark.classdata import QUICK_JIT

# Let test modules import the shared hypothesis strategies (``from strategies import ...``).
sys.path.insert(0, os.path.dirname(__file__))

# The machine is shared and noisy: no per-example deadlines.  On CI, derandomize so that
# a run is reproducible from the commit alone.
settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else "default")

# Spark's JVMs in the tests (the shared session's, the commands', the cluster drivers') do
# test-sized work on a shared 2-core machine: the JIT's first tier only, whose compiler
# threads leave the cores to that work (the connector tests took 2/3 of the time, each JVM
# start about 30% less).  The product keeps the JVM's default.
os.environ.setdefault("SPARK_SUBMIT_OPTS", QUICK_JIT)


@pytest.fixture
def secret(tmp_path):
    """A cluster secret file, tmp_path/cluster.secret (mode 600), for the members of a
    test's cluster."""
    from dataspace.testing.common import write_secret

    return write_secret(tmp_path / "cluster.secret")


@pytest.fixture(scope="session")
def spark_jvm_archive():
    """The class-data archive of Spark's JVM (dataspace.pipeline.spark.warmup), made once
    per machine before the run's first JVM: every JVM the run starts after it -- the shared
    session's, the commands' and the crash harnesses' -- maps it and starts in about half
    the time.  None where it cannot be made: the tests then run as without it."""
    from dataspace.pipeline.spark.warmup import ensure

    return ensure()


@pytest.fixture(scope="session")
def spark_session(spark_jvm_archive):
    """One SparkSession (local[2]) shared by every Spark test of the run."""
    from dataspace.pipeline.spark.session import get_session, stop_session

    session, _created = get_session("local[2]", app_name="dataspace tests")
    yield session
    stop_session()


@pytest.fixture
def spark(spark_session):
    """The shared session, made the JVM's active and default one for this test's thread:
    Spark looks a Python data source up for a write (DataFrameWriter.save) in the active
    session, which an earlier test's Spark work in other threads can leave unset here
    (DATA_SOURCE_NOT_FOUND in the full suite, never alone)."""
    jvm = spark_session.sparkContext._jvm
    jss = spark_session._jsparkSession
    jvm.org.apache.spark.sql.SparkSession.setActiveSession(jss)
    jvm.org.apache.spark.sql.SparkSession.setDefaultSession(jss)
    return spark_session


# -- stream stores: every store test runs on SQLite and on a real PostgreSQL server ----------

_databases = iter(range(1, 1 << 30))


@pytest.fixture(scope="session")
def pg_server():
    """One PostgreSQL server for the whole run, started here on loopback in a temporary
    directory (dataspace.streams.pgserver).  No server binaries fails the run: the
    PostgreSQL store is part of what is tested, never skipped."""
    from dataspace.streams.pgserver import PostgresNotFound, TempPostgres

    try:
        server = TempPostgres().start()
    except PostgresNotFound as e:
        pytest.fail(f"the PostgreSQL store tests need a server: {e}", pytrace=False)
    yield server
    server.stop()


@pytest.fixture
def pg_url(pg_server):
    """A fresh, empty database on the session's server (dropped afterwards): its URL."""
    name = f"test_{os.getpid()}_{next(_databases)}"
    url = pg_server.create_database(name)
    yield url
    pg_server.drop_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    """Where a test's store is, once per backend: the SQLite store of a temporary data
    directory, then a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "data")
    return request.getfixturevalue("pg_url")


@pytest.fixture
def store(store_url):
    """An open store, once per backend (closed afterwards)."""
    from dataspace.streams import open_store

    s = open_store(store_url)
    yield s
    s.close()


# -- a Spark standalone cluster on loopback (tests/spark_cluster.py) ---------------------------


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory):
    """One standalone Master and Worker for the whole run, the Worker unable to see the
    tests' data (its own mount namespace, a tmpfs over the pytest base directory).  Like
    the PostgreSQL server, it is part of what is tested: what it needs missing fails."""
    from spark_cluster import Cluster, can_unshare

    why = can_unshare()
    if why:
        pytest.fail(f"the cluster tests need a Spark worker that cannot see the driver's data: {why}",
                    pytrace=False)
    cluster = Cluster(tmp_path_factory.getbasetemp()).start()
    yield cluster
    cluster.stop()
