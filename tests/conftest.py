"""Shared test configuration."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

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


@pytest.fixture(scope="session")
def spark():
    """One SparkSession (local[2]) shared by every Spark test of the run."""
    from dataspace.pipeline.spark.session import get_session, stop_session

    session, _created = get_session("local[2]", app_name="dataspace tests")
    yield session
    stop_session()
