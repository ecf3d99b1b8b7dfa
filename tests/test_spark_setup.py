"""Spark set-up on a fresh machine: the Java check, the workers' interpreter, the package
on workers (the classic failures of a PySpark deployment)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from dataspace.pipeline.spark.session import (
    JAVA_HINT,
    SparkSetupError,
    check_java,
    is_local,
    java_version,
    ship_package,
)


def _fake_java(tmp_path, banner: str, code: int = 0) -> str:
    """A JAVA_HOME whose bin/java prints ``banner`` on stderr, as java -version does."""
    home = tmp_path / f"jdk{len(list(tmp_path.glob('jdk*')))}"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f"#!/bin/sh\necho '{banner}' >&2\nexit {code}\n")
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    return str(home)


@pytest.mark.parametrize(("banner", "major"), [
    ('openjdk version "17.0.15" 2025-04-15', 17),
    ('openjdk version "21" 2023-09-19', 21),
    ('java version "1.8.0_392"', 8),
    ('openjdk version "11.0.2" 2019-01-15', 11),
    ("Error: could not find libjava.so", None),
])
def test_java_version_reads_the_major_version(tmp_path, banner, major):
    assert java_version(os.path.join(_fake_java(tmp_path, banner), "bin", "java")) == major


def test_missing_or_old_java_is_one_line_that_names_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "nothing-here"))
    with pytest.raises(SparkSetupError) as e:
        check_java()
    assert str(e.value).startswith(JAVA_HINT) and "JAVA_HOME points to no java" in str(e.value)
    monkeypatch.setenv("JAVA_HOME", _fake_java(tmp_path, 'java version "1.8.0_392"'))
    with pytest.raises(SparkSetupError) as e:
        check_java()
    msg = str(e.value)
    assert "\n" not in msg and "openjdk-17" in msg and "found Java 8" in msg
    monkeypatch.setenv("JAVA_HOME", _fake_java(tmp_path, "broken", code=1))
    with pytest.raises(SparkSetupError, match="-version failed"):
        check_java()
    monkeypatch.setenv("JAVA_HOME", _fake_java(tmp_path, 'openjdk version "17.0.15" 2025-04-15'))
    assert check_java() == 17


def test_workers_run_this_interpreter_and_import_the_package(spark):
    def probe(_: int) -> tuple[str, str]:
        import sys as s

        import dataspace

        return s.executable, os.path.dirname(dataspace.__file__)

    got = set(spark.sparkContext.parallelize(range(4), 2).map(probe).collect())
    import dataspace

    assert got == {(sys.executable, os.path.dirname(dataspace.__file__))}
    assert os.environ["PYSPARK_PYTHON"] == sys.executable


def test_the_shipped_package_is_importable_from_its_zip(tmp_path):
    added: list[str] = []

    class FakeContext:
        def addPyFile(self, path: str) -> None:
            added.append(path)

    class FakeSession:
        sparkContext = FakeContext()

    path = ship_package(FakeSession())  # type: ignore[arg-type]
    assert added == [path]
    names = zipfile.ZipFile(path).namelist()
    assert "dataspace/__init__.py" in names and "dataspace/pipeline/spark/sink.py" in names
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import dataspace.pipeline.spark.sink as m; "
            "print(m.__file__)")
    r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(path)


def test_local_masters():
    assert is_local("local") and is_local("local[*]") and is_local("local[2]")
    assert not is_local("spark://h:7077") and not is_local("yarn")


def test_a_programs_sigint_handler_survives_starting_spark(tmp_path):
    """PySpark's SparkContext replaces the SIGINT handler with one that raises
    KeyboardInterrupt wherever the main thread is (inside py4j calls: four tracebacks and
    exit 130 for `pipeline run` on a Ctrl-C while Spark started).  A handler the program
    installed stays; Python's default one is still PySpark's to replace."""
    code = """if True:
        import signal, sys
        from dataspace.pipeline.spark.session import get_session, stop_session
        def mine(signum, frame):
            pass
        signal.signal(signal.SIGINT, mine)
        spark, created = get_session("local[1]", log_file=sys.argv[1])
        try:
            print(created, signal.getsignal(signal.SIGINT) is mine)
        finally:
            stop_session()
    """
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "spark.log")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True"]


def test_sessions_from_python_log_where_the_docs_say():
    """get_session() from Python logs to DEFAULT_LOG, which docs/spark.md did not name."""
    import tempfile

    from dataspace.pipeline.spark.session import DEFAULT_LOG

    assert DEFAULT_LOG == os.path.join(tempfile.gettempdir(), f"dataspace-spark-{os.getuid()}",
                                       "spark.log")
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "spark.md")).read()
    text = " ".join(doc.split())
    assert ("`get_session(log_file=...)` from Python (default `$TMPDIR/dataspace-spark-UID/spark.log`, "
            "`dataspace.pipeline.spark.session.DEFAULT_LOG`") in text


def test_shipped_zips_are_removed_with_the_session_and_after_a_kill(tmp_path, monkeypatch):
    """The zip goes at the session's end (remove_shipped, called by stop_session and at
    exit); one left by a process killed with SIGKILL goes at the next ship_package."""
    from dataspace.pipeline.spark import session

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    orphan = tmp_path / f"dataspace-pyfiles-{dead}-abc"
    alive = tmp_path / f"dataspace-pyfiles-{os.getppid()}-abc"
    for d in (orphan, alive):
        d.mkdir()

    class FakeContext:
        def addPyFile(self, path: str) -> None:
            pass

    class FakeSession:
        sparkContext = FakeContext()

    monkeypatch.setattr(session, "_shipped", [])
    path = Path(ship_package(FakeSession()))  # type: ignore[arg-type]
    assert path.parent.parent == tmp_path and path.exists()
    assert not orphan.exists() and alive.exists()
    session.remove_shipped()
    assert not path.parent.exists() and alive.exists()


def test_files_named_like_imported_modules_are_named(tmp_path, monkeypatch, caplog):
    """Where Spark's Python processes start without the launcher (a cluster's planning
    processes on the driver), the working directory is first on their sys.path: the
    session names the files there that would replace a module (a copy.py)."""
    from dataspace.pipeline.spark import session

    (tmp_path / "copy.py").write_text("x = 1\n")
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("")
    (tmp_path / "helpers.py").write_text("")  # the user's own: no module of that name
    (tmp_path / "mygraphlib.py").write_text("")  # the user's own, imported from there
    (tmp_path / "sys.py").write_text("")  # built in: nothing can replace it
    import importlib.util

    spec = importlib.util.spec_from_file_location("mygraphlib", tmp_path / "mygraphlib.py")
    assert spec is not None and spec.loader is not None
    mine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mine)
    monkeypatch.setitem(sys.modules, "mygraphlib", mine)
    (tmp_path / "notes").mkdir()  # not a package
    (tmp_path / "copy.txt").write_text("")
    assert session.shadowing_files(tmp_path) == ["copy.py", "json"]
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING", logger=session.__name__):
        session._warn_shadowing()
    [rec] = caplog.records
    assert rec.getMessage() == (
        f"copy.py, json in the working directory {tmp_path} have the name of modules Spark's "
        "Python processes import, and those started on this machine would import them from "
        "there instead: rename them, or run from another directory")
    (tmp_path / "copy.py").unlink()
    (tmp_path / "json" / "__init__.py").unlink()
    caplog.clear()
    session._warn_shadowing()
    assert not caplog.records
