"""Shared test configuration."""

from __future__ import annotations

import os
import sys

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
