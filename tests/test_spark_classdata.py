"""The class-data archive of Spark's JVM (dataspace.pipeline.spark.classdata and .warmup):
made once, mapped by every session's JVM; an archive a JVM cannot start with never gets
its name; one process makes it at a time, a recent failure is not retried, and
``DATASPACE_SPARK_CDS=0`` turns it off."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from dataspace.pipeline.spark import classdata, warmup
from dataspace.pipeline.spark.session import find_java


def _jvm_cmdline() -> tuple[int, list[str]]:
    """The shared session's JVM: its pid and command line."""
    from pyspark import SparkContext

    pid = SparkContext._gateway.proc.pid  # type: ignore[union-attr]
    return pid, [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


def test_the_sessions_jvm_maps_the_archive(spark, spark_jvm_archive):
    """The run's archive exists (made by the fixture if it was missing), and the shared
    session's JVM started with it and has it mapped."""
    assert spark_jvm_archive is not None, "no class-data archive was made (see jvm-*.log)"
    assert spark_jvm_archive == warmup.expected() and spark_jvm_archive.stat().st_size > 10 << 20
    pid, cmd = _jvm_cmdline()
    assert any(a.endswith(f"-XX:SharedArchiveFile={spark_jvm_archive}") for a in cmd), cmd
    assert str(spark_jvm_archive) in Path(f"/proc/{pid}/maps").read_text()


def test_an_archive_a_jvm_cannot_start_with_is_refused(spark, spark_jvm_archive, tmp_path):
    """The check an archive passes before it gets its name: a JVM with the session's
    classpath starts on the real one; one cut short (a JVM killed while writing it, a
    full disk) or not an archive at all is refused with what the JVM said (a JVM given a
    cut archive crashes)."""
    assert spark_jvm_archive is not None
    _pid, cmd = _jvm_cmdline()
    java, cp = cmd[0], cmd[cmd.index("-cp") + 1]
    assert warmup.check(java, cp, spark_jvm_archive) is None
    cut = tmp_path / "cut.jsa"
    with open(spark_jvm_archive, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(1 << 20))
    junk = tmp_path / "junk.jsa"
    junk.write_bytes(b"not an archive\n" * 100)
    for bad in (cut, junk):
        why = warmup.check(java, cp, bad)
        assert why is not None and why.startswith("a JVM does not start with the archive"), why
        assert "\n" not in why


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """A temporary directory of the test's own (archives, locks, linked homes go there)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(classdata.ENV, raising=False)
    return tmp_path


def test_the_archive_is_used_when_it_exists_and_not_when_turned_off(own_tmp, monkeypatch):
    java = find_java()
    assert java is not None
    home = str(own_tmp / "spark-home")
    (Path(home) / "jars").mkdir(parents=True)
    path = classdata.archive(java, home)
    assert path.parent == own_tmp / f"dataspace-spark-{os.getuid()}" and path.suffix == ".jsa"
    assert classdata.java_options(java, home) == []  # not made yet
    path.parent.mkdir()
    path.write_bytes(b"archive")
    assert classdata.java_options(java, home) == [f"-XX:SharedArchiveFile={path}"]
    monkeypatch.setenv(classdata.ENV, "0")
    assert classdata.java_options(java, home) == [] and not classdata.enabled()
    monkeypatch.delenv(classdata.ENV)
    # Other jars (another installation, a reinstalled PySpark): another archive.
    (Path(home) / "jars" / "extra.jar").write_bytes(b"")
    assert classdata.archive(java, home) != path
    assert classdata.archive(java, str(own_tmp / "other-home")) != path


def test_ensure_leaves_it_to_the_process_making_it(own_tmp):
    """Another process holds the lock: ensure returns at once without an archive (the
    sessions start as before) and starts no JVM of its own."""
    target = warmup.expected()
    assert target is not None
    target.parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(target.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        said: list[str] = []
        assert warmup.ensure(say=said.append) is None
        assert said and "another process makes" in said[0]
    finally:
        os.close(fd)
    assert not target.with_suffix(".log").exists() and not target.exists()


def test_ensure_does_not_retry_a_recent_failure_nor_run_when_turned_off(own_tmp, monkeypatch):
    target = warmup.expected()
    assert target is not None
    target.parent.mkdir(mode=0o700, exist_ok=True)
    target.with_suffix(".failed").write_text("not done in 600s\n")
    said: list[str] = []
    assert warmup.ensure(say=said.append) is None
    assert said and "not done in 600s" in said[0] and "to try again" in said[0]
    assert not target.with_suffix(".log").exists()
    target.with_suffix(".failed").unlink()
    monkeypatch.setenv(classdata.ENV, "0")
    assert warmup.ensure() is None and not target.with_suffix(".log").exists()


def test_an_existing_archive_is_returned_as_it_is(own_tmp):
    target = warmup.expected()
    assert target is not None
    target.parent.mkdir(mode=0o700, exist_ok=True)
    target.write_bytes(b"made before")
    assert warmup.ensure() == target and target.read_bytes() == b"made before"


def test_a_mistyped_option_is_named_as_such(capsys):
    """The command's internal ``child`` run is not a subcommand a user can meet: a typo
    is reported as the unknown option it is (it read "invalid choice: '5'")."""
    with pytest.raises(SystemExit) as exc:
        warmup.main(["--timout", "5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --timout 5" in err and "child" not in err


def test_archives_of_installations_gone_or_changed_are_pruned(own_tmp):
    """Each archive is about 170 MB, one per Java and Spark: those no JVM would map again
    (a deleted virtualenv, a reinstalled PySpark) go when a new one is made; one still
    current, one without a record and the new one stay."""
    java = find_java()
    assert java is not None
    homes = {}
    for name in ("gone", "changed", "current", "new"):
        home = own_tmp / name
        (home / "jars").mkdir(parents=True)
        homes[name] = str(home)
    paths = {name: classdata.archive(java, home) for name, home in homes.items()}
    paths["new"].parent.mkdir(mode=0o700)
    for name, path in paths.items():
        for suffix in (".jsa", ".lock", ".log"):
            path.with_suffix(suffix).write_bytes(b"x")
        classdata.record(path, java, homes[name])
    unrecorded = paths["new"].with_name("jvm-0123456789abcdef.jsa")
    unrecorded.write_bytes(b"x")
    for f in (own_tmp / "gone" / "jars").iterdir():
        f.unlink()
    (own_tmp / "gone" / "jars").rmdir()
    (own_tmp / "gone").rmdir()
    (own_tmp / "changed" / "jars" / "pyspark-reinstalled.jar").write_bytes(b"")
    removed = classdata.prune(paths["new"])
    assert sorted(removed) == sorted([paths["gone"], paths["changed"]])
    left = sorted(p.name for p in paths["new"].parent.iterdir())
    assert left == sorted(
        [paths[n].with_suffix(s).name for n in ("current", "new")
         for s in (".jsa", ".lock", ".log", ".for")] + [unrecorded.name])
    assert classdata.prune(paths["new"]) == []
