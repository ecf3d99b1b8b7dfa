"""A Spark run from a working directory holding a file named like a module of the standard
library (``copy.py``): Spark's Python processes start with ``python -m``, which puts the
working directory first on ``sys.path``; through the session's launcher they have it last,
so the standard library's module is the one imported, and a module of the user's there is
still found by the executors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dataspace.streams import open_store

pytest.importorskip("pyspark")

LONG = 240.0

GRAPH = """
from dataspace.pipeline import Graph
import helpers

graph = Graph("cp")
graph.source("a")
graph.map("m", "a", "b", helpers.double)   # pickled by reference: imported by the executors
"""

HELPERS = """
def double(v):
    return v * 2
"""


def _dataspace() -> list[str]:
    """The `dataspace` command as a user runs it (its script: the working directory is not
    on the driver's sys.path; python -m would put it there)."""
    script = Path(sys.executable).with_name("dataspace")
    return [str(script)] if script.exists() else [sys.executable, "-P", "-m", "dataspace.cli"]


@pytest.mark.parametrize("server", ["1", "0"], ids=["fork-server", "no-fork-server"])
def test_a_copy_py_in_the_working_directory_does_not_break_a_spark_run(
        spark_jvm_archive, tmp_path, server):
    (tmp_path / "copy.py").write_text("x = 1  # a user's file, named like the standard library's copy\n")
    (tmp_path / "helpers.py").write_text(HELPERS)
    (tmp_path / "g.py").write_text(GRAPH)
    data = tmp_path / "data"
    with open_store(data) as s:
        s.append_many("a", [1, 2, 3])
    env = {**os.environ, "DATASPACE_DATA_DIR": str(data), "DATASPACE_SPARK_FORKSERVER": server}
    r = subprocess.run([*_dataspace(), "pipeline", "run", "g.py", "--until-idle", "-q",
                        "--master", "local[1]"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=LONG)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deepcopy" not in r.stdout + r.stderr
    with open_store(data) as s:
        assert [e.value for e in s.read("b")] == [2, 4, 6]
