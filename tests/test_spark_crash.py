"""SIGKILL crash test of the Spark engine: the whole driver -- Python driver, JVM with its
executors, Spark's Python workers -- is killed at each chosen point (a source callback,
planning, an executor read, staging and write, after a sink's side effect, inside our commit,
between our commit and Spark's commit log), during start-up and at random moments; after
each kill it restarts; at the end the outputs must be exactly the expected multisets.
The long run is ``python -m dataspace.testing.spark_crash --kills 200`` (``make
soak-spark``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dataspace.pipeline.spark import faultpoints
from dataspace.testing import spark_faults
from dataspace.testing.spark_crash import CHOSEN, run_campaign

pytest.importorskip("pyspark")

SEED = int(os.environ.get("CRASH_SEED", "20240611"))


def test_ten_sigkills_of_the_spark_driver_and_still_exactly_once(tmp_path):
    lines: list[str] = []
    res = run_campaign(str(tmp_path), kills=10, messages=300, seed=SEED, batch=50,
                       say=lines.append)
    assert res.problems == [], "\n".join(lines + res.problems)
    assert res.kills == 10
    assert set(res.points) == {*CHOSEN, "startup", "random"}, res.points


def test_fault_points_only_fire_in_their_own_session(tmp_path, monkeypatch):
    """A stray variable cannot kill anything outside the session it names; in the right
    session the N-th arrival (counted across processes) kills the whole session."""
    for k, v in spark_faults.environment("write:2", str(tmp_path)).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(f"{spark_faults.ENV}_SID", str(os.getsid(0) + 1))
    monkeypatch.setattr(spark_faults, "_spec", None)
    faultpoints.point("write")
    faultpoints.point("write")  # not our session: nothing happens
    assert not (tmp_path / "write.count").exists()
    code = ("import os, sys\n"
            "os.environ['DATASPACE_SPARK_FAULT_SID'] = str(os.getsid(0))\n"
            "from dataspace.pipeline.spark import faultpoints\n"
            "faultpoints.point('write'); print('first', flush=True)\n"
            "faultpoints.point('read'); faultpoints.point('write'); print('second', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k != f"{spark_faults.ENV}_SID"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, start_new_session=True)
    assert r.returncode == -9 and r.stdout == "first\n"
    assert (tmp_path / "write.count").read_text().strip() == "2"


def test_a_fault_point_without_a_hook_imports_no_harness(tmp_path):
    """The product names no harness: with the fault's variables but no hook, a fault
    point does nothing and imports nothing of dataspace.testing."""
    env = {**os.environ, **spark_faults.environment("write:1", str(tmp_path))}
    del env[faultpoints.HOOK_ENV]
    code = ("import os, sys\n"
            "os.environ['DATASPACE_SPARK_FAULT_SID'] = str(os.getsid(0))\n"
            "from dataspace.pipeline.spark import faultpoints\n"
            "faultpoints.point('write')\n"
            "print(sorted(m for m in sys.modules if m.startswith('dataspace.testing')))\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, start_new_session=True)
    assert (r.returncode, r.stdout) == (0, "[]\n"), r.stderr
    assert not (tmp_path / "write.count").exists()
