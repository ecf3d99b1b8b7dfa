"""Class-data sharing for Spark's driver JVM: the classes a run loaded, archived once and
mapped by every later JVM, so that a session starts in about half the time.

Starting Spark loads some 20,000 classes from its jars; reading, parsing and verifying
them is most of what the JVM does in the 10-25 s a session takes to start on a small
machine, and much of its first batch.  Java can write the classes a JVM has loaded to an
archive as it exits (``-XX:ArchiveClassesAtExit``); a later JVM maps that archive
(``-XX:SharedArchiveFile``) and finds them there, parsed and verified.  On a 2-core
machine a local session was ready in 4-7 s instead of 9-18 s.

* :func:`archive` -- where the archive of a ``java`` and a ``SPARK_HOME`` is:
  ``$TMPDIR/dataspace-spark-UID/jvm-KEY.jsa`` (about 170 MB), KEY naming the Java and the
  Spark jars (a new Java, a reinstalled PySpark: a new archive);
* :func:`java_options` -- what :mod:`.session` adds to the driver JVM's options: the
  archive when it exists.  ``DATASPACE_SPARK_CDS=0`` turns it off;
* :mod:`.warmup` makes it (``python -m dataspace.pipeline.spark.warmup``, about a minute
  once); the Spark crash harness and the test suite do so before they start Spark;
* :func:`record` and :func:`prune` -- beside each archive, the Java and the Spark it was
  made for (``jvm-KEY.for``); when a new archive is made, the archives whose Java or Spark
  is gone or changed (a deleted virtualenv, a reinstalled PySpark: they would never be
  mapped again) are removed, so the directory does not grow by 170 MB per installation.

An archive only ever has its name once it is complete and a JVM has started with it
(:mod:`.warmup`).  A JVM that cannot use it (other JVM options, other jars) says so in
its log and starts as without it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

__all__ = ["ENV", "QUICK_JIT", "archive", "enabled", "java_options", "prune", "record"]

ENV = "DATASPACE_SPARK_CDS"

QUICK_JIT = "-XX:TieredStopAtLevel=1"
"""The JIT's first tier only: for JVMs that live seconds (the crash harness's children,
the tests'), which gain nothing from the optimising compiler, whose threads take the
cores from Spark's start-up (a start about 30% faster on 2 cores).  The product keeps the
JVM's default."""

_dump_to: str | None = None
"""Set by :mod:`.warmup`'s child: the JVM it starts writes its classes there as it exits."""


def enabled() -> bool:
    """Whether sessions use the archive (``DATASPACE_SPARK_CDS=0``: not)."""
    return os.environ.get(ENV, "1") != "0"


def _stat(path: str | Path) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_size}:{st.st_mtime_ns}"


def archive(java: str, spark_home: str) -> Path:
    """The archive's path for the JVM ``java`` launched with ``spark_home`` (the path as
    the launcher sees it: the classpath is made of it)."""
    real = os.path.realpath(java)
    jdk = Path(real).parent.parent
    jars = os.path.join(spark_home, "jars")
    try:
        n_jars = len(os.listdir(jars))
    except OSError:
        n_jars = -1
    ident = "\0".join([real, _stat(real), _stat(jdk / "lib" / "server" / "libjvm.so"),
                       spark_home, os.path.realpath(jars), _stat(os.path.realpath(jars)),
                       str(n_jars)])
    key = hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()
    return Path(tempfile.gettempdir()) / f"dataspace-spark-{os.getuid()}" / f"jvm-{key}.jsa"


def java_options(java: str, spark_home: str) -> list[str]:
    """The driver JVM's options for class-data sharing: the archive if it exists (none
    when turned off, or when its path would need quoting in Spark's option string)."""
    if _dump_to is not None:
        return [f"-XX:ArchiveClassesAtExit={_dump_to}"]
    if not enabled():
        return []
    path = archive(java, spark_home)
    if not path.is_file() or any(c.isspace() or c in "'\"\\" for c in str(path)):
        return []
    return [f"-XX:SharedArchiveFile={path}"]


_FAMILY = (".jsa", ".lock", ".log", ".failed", ".for")
"""The files of one archive: the archive, its maker's lock, log and failure note, and the
record of what it was made for."""


def record(path: Path, java: str, spark_home: str) -> None:
    """Note beside the archive ``path`` the Java and the Spark it is for (see
    :func:`prune`)."""
    path.with_suffix(".for").write_text(f"{java}\n{spark_home}\n")


def prune(keep: Path) -> list[Path]:
    """Remove the archives beside ``keep`` whose recorded Java and Spark would no longer
    be given that archive (either is gone or changed, so no JVM maps it again), with
    their other files; the archives removed.  An archive without a record (made before
    records were kept) is left alone.  A JVM that has one mapped keeps its mapping."""
    removed: list[Path] = []
    for note in sorted(keep.parent.glob("jvm-*.for")):
        path = note.with_suffix(".jsa")
        if path == keep:
            continue
        try:
            java, spark_home = note.read_text().splitlines()[:2]
        except (OSError, ValueError):
            continue
        if archive(java, spark_home) == path:
            continue  # still the one for that installation
        for suffix in _FAMILY:
            try:
                path.with_suffix(suffix).unlink()
            except FileNotFoundError:
                pass
            except OSError:
                break  # (not ours to remove: leave the rest, and its record)
        else:
            removed.append(path)
    return removed
