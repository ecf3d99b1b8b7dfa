"""Warming up Spark's start-up: making the class-data archive of :mod:`.classdata` once.

::

    python -m dataspace.pipeline.spark.warmup

runs a small graph (a step of each kind: join, fork, alts, an SQLite sink, errors) on the
Spark engine in a child process whose JVM writes the classes it loaded to an archive as it
exits; the child then checks that a JVM with the session's classpath starts with it, and
only then does the archive get its name.  Every later session's JVM maps it.  About a
minute on a 2-core machine; nothing to do when the archive exists.

One process makes it at a time: another that finds it being made carries on without it
(its sessions start as before).  A failure is logged (the child's output is kept beside
the archive, ``jvm-KEY.log``) and not retried for a day.  The Spark crash harness and the
test suite call :func:`ensure` before they start Spark.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..._extras import MissingExtra, require
from . import classdata
from .reaper import reap_session

if TYPE_CHECKING:
    from ..graph import Graph

__all__ = ["check", "ensure", "expected", "main"]

log = logging.getLogger(__name__)

RETRY_AFTER = 24 * 3600.0
"""Seconds before a failed attempt is made again."""


def _installation() -> tuple[str, str] | None:
    """The Java and the ``SPARK_HOME`` a local session here launches; None without Java."""
    from .session import find_java, launch_home

    java = find_java()
    if java is None:
        return None
    return java, launch_home()


def expected() -> Path | None:
    """The archive a local session here would use (made or not); None without Java."""
    inst = _installation()
    return None if inst is None else classdata.archive(*inst)


def ensure(timeout: float = 600.0, say: Callable[[str], None] | None = None) -> Path | None:
    """The class-data archive, made first if it is missing; None when there is none to use:
    turned off (``DATASPACE_SPARK_CDS=0``), no Java or PySpark, another process making it,
    or it could not be made (logged)."""
    if not classdata.enabled():
        return None
    try:
        inst = _installation()
    except (ImportError, OSError) as e:
        log.info("no class-data archive for Spark's JVM: %s", e)
        return None
    if inst is None:
        return None
    target = classdata.archive(*inst)
    if target.is_file():
        if not target.with_suffix(".for").exists():  # (made before records were kept)
            with contextlib.suppress(OSError):
                classdata.record(target, *inst)
        return target
    target.parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(target.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    tmp = target.with_name(f"{target.stem}.{os.getpid()}.tmp")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process makes the class-data archive %s: starting without it", target)
            if say is not None:
                say(f"another process makes the class-data archive of Spark's JVM ({target})")
            return None
        if target.is_file():
            return target
        for left in target.parent.glob(f"{target.stem}.*.tmp"):  # a maker killed before us
            with contextlib.suppress(OSError):
                left.unlink()
        failed = target.with_suffix(".failed")
        with contextlib.suppress(OSError):
            if time.time() - failed.stat().st_mtime < RETRY_AFTER:
                if say is not None:
                    say(f"the class-data archive of Spark's JVM could not be made lately "
                        f"({failed.read_text().strip()}; see {target.with_suffix('.log')}); "
                        f"remove {failed} to try again")
                return None
        if say is not None:
            say("making the class-data archive of Spark's JVM (once; about a minute) ...")
        t0 = time.monotonic()
        why = _make(tmp, target.with_suffix(".log"), timeout)
        if why is None:
            os.replace(tmp, target)
            with contextlib.suppress(OSError):
                failed.unlink()
            log.info("made the class-data archive %s in %.0fs", target, time.monotonic() - t0)
            if say is not None:
                say(f"class-data archive made in {time.monotonic() - t0:.0f}s: {target}")
            with contextlib.suppress(OSError):
                classdata.record(target, *inst)
            _prune(target, say)
            return target
        with contextlib.suppress(OSError):
            failed.write_text(why + "\n")
        log.warning("the class-data archive of Spark's JVM could not be made (%s; see %s): "
                    "Spark starts without it", why, target.with_suffix(".log"))
        return None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
        os.close(fd)


def _prune(target: Path, say: Callable[[str], None] | None) -> None:
    """Remove the archives of installations that are gone (see :func:`classdata.prune`)."""
    try:
        gone = classdata.prune(target)
    except OSError as e:
        log.info("could not prune old class-data archives beside %s: %s", target, e)
        return
    if gone:
        log.info("removed %d class-data archive(s) of Java or Spark installations that are "
                 "gone or changed: %s", len(gone), ", ".join(p.name for p in gone))
        if say is not None:
            say(f"removed {len(gone)} class-data archive(s) of Spark installations that are "
                "gone or changed")


def _make(tmp: Path, log_path: Path, timeout: float) -> str | None:
    """Run the child that makes the archive at ``tmp``; None if it did, else why not."""
    with open(log_path, "wb") as out:
        # -P: not the working directory first on the child's sys.path (a copy.py there
        # would be the standard library's copy, and the archive a day's failure).
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "dataspace.pipeline.spark.warmup", "child", str(tmp),
             "--timeout", str(timeout)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    try:
        rc: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        # (a JVM still writing, when it timed out)
        reap_session(proc, 60.0)
    if rc is None:
        return f"not done in {timeout:g}s"
    if rc != 0:
        return f"the child exited with {rc}"
    if not tmp.is_file():
        return "no archive written"
    return None


# -- the child ---------------------------------------------------------------------------------


def _pair(left: int, right: int) -> int:
    if left % 5 == 4:
        raise ValueError(f"pair {left} rejected")  # (the error stream's turn)
    return left + right


def _route(n: int) -> dict[str, int]:
    return {"even" if n % 2 == 0 else "odd": n}


def _graph(directory: str) -> Graph:
    """A step of each kind (join, fork, alts, an SQLite sink) and errors: the classes a
    graph's run loads."""
    from ..graph import Graph
    from ..sinks import SQLiteSink

    g = Graph("warmup", error_stream="errors")
    g.source("left", "right", "extra")
    g.join("pair", ["left", "right"], "pairs", _pair)
    g.fork("route", "pairs", ["even", "odd"], _route)
    g.alts("merge", ["odd", "extra"], "merged", lambda v: v)
    g.sink("store", "even", SQLiteSink(Path(directory) / "sink.db", "pairs", ["n INTEGER"],
                                       to_row=lambda v: (v,)), batch=True)
    return g


def child(out: str, timeout: float) -> int:
    """Run the graph on Spark with the JVM told to archive its classes at ``out``, stop
    Spark, wait for the JVM to write the archive, and check a JVM starts with it."""
    from pyspark import SparkContext

    from ...streams import open_store
    from .engine import SparkEngine
    from .session import stop_session

    classdata._dump_to = out
    with tempfile.TemporaryDirectory(prefix="dataspace-warmup-") as d:
        store = open_store(d)
        for s in ("left", "right", "extra"):
            store.append_many(s, list(range(12)))
        engine = SparkEngine(_graph(d), store, master="local[2]", batch=50,
                             data_dir=d, log_file=os.path.join(d, "spark.log"))
        try:
            engine.run(until_idle=True)
        finally:
            engine.close()
            store.close()
        if engine.failed:
            _err(f"the graph failed: {engine.failed}")
            return 1
        jvm = SparkContext._gateway.proc  # type: ignore[union-attr]
        cmd = _cmdline(jvm.pid)
        stop_session()
        # The JVM exits when its standard input closes, and writes the archive as it does.
        jvm.stdin.close()
        try:
            jvm.wait(timeout)
        except subprocess.TimeoutExpired:
            _err(f"the JVM did not exit within {timeout:g}s")
            return 1
    if not os.path.isfile(out) or not cmd or "-cp" not in cmd:
        _err(f"no archive written, or no classpath to check it with ({cmd})")
        return 1
    why = check(cmd[0], cmd[cmd.index("-cp") + 1], out)
    if why is not None:
        _err(why)
        return 1
    return 0


def check(java: str, classpath: str, path: str | os.PathLike[str]) -> str | None:
    """None if a JVM with ``classpath`` starts on the archive at ``path`` (``-Xshare:on``:
    it fails rather than start without), else what it said.  A JVM maps an archive that
    is cut short, and crashes: an archive is given its name only after this check."""
    with tempfile.TemporaryDirectory(prefix="dataspace-cds-check-") as d:  # its crash report
        r = subprocess.run([java, "-Xshare:on", f"-XX:SharedArchiveFile={os.path.abspath(path)}",
                            "-XX:-CreateCoredumpOnCrash", "-cp", classpath, "-version"],
                           capture_output=True, text=True, timeout=120, cwd=d)
    if r.returncode == 0:
        return None
    said = [x for x in (r.stdout + r.stderr).splitlines() if x.strip() and not x.startswith("#")]
    return f"a JVM does not start with the archive (exit {r.returncode}): {' '.join(said)[-500:]}"


def _out(text: str) -> None:
    """A line of the command's output (the CLI speaks; the library logs)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _err(text: str) -> None:
    """The child's reason for failing, for the log beside the archive."""
    sys.stderr.write(text + "\n")


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    prog = "python -m dataspace.pipeline.spark.warmup"
    if argv[:1] == ["child"]:
        # The run that writes the archive, started by ensure(); not a user's command (as
        # a subcommand, a mistyped option's value was reported as an invalid choice of
        # it).
        ch = argparse.ArgumentParser(prog=f"{prog} child")
        ch.add_argument("out")
        ch.add_argument("--timeout", type=float, default=600.0)
        cargs = ch.parse_args(argv[1:])
        return child(cargs.out, cargs.timeout)
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Make the class-data archive of Spark's JVM (once), so that Spark "
        "sessions start in about half the time.")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds the making may take (default 600)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not classdata.enabled():
        _out(f"{classdata.ENV}=0: Spark sessions do not use a class-data archive")
        return 0
    try:
        require("spark", "the class-data archive (a Spark session)")
    except MissingExtra as e:
        _err(f"{prog}: {e}")
        return 2
    path = ensure(args.timeout, say=_out)
    if path is None:
        _out("no class-data archive (Spark starts without one)")
        return 1
    _out(f"class-data archive: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
