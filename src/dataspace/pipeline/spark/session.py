"""Spark set-up that works on a fresh machine: a Java check before the JVM starts, one
SparkSession per process, quiet logs, the right Python on workers, the package on
cluster workers.

Classic failures this module prevents:

* **No Java, or too old a Java**: :func:`check_java` runs before the JVM is started and
  raises :class:`SparkSetupError` with one line that names what to install.
* **Workers run another Python** (``python3`` from ``PATH``, without this package):
  ``PYSPARK_PYTHON`` and ``PYSPARK_DRIVER_PYTHON`` are set to the running interpreter
  (for a cluster, a ``PYSPARK_PYTHON`` set by the user is kept: the workers' path may
  differ).
* **The package is not importable on workers**: in local mode workers run this
  interpreter (its ``site-packages`` has the package); for a cluster master,
  :func:`ship_package` zips the ``dataspace`` package and adds it with ``addPyFile``
  (the zip is removed when the session ends: :func:`stop_session`, or at exit).
* **Executors that cannot open the store**: an SQLite store is a file on the driver's
  machine; :func:`.placement.read_on` says where a cluster's reads go (the executors with a
  PostgreSQL store, else the driver), and :func:`register` tells the connector the
  master, so that it refuses ``readOn=executor`` on an SQLite store of a cluster
  before a job starts.
* **Slow query starts**: Spark starts a fresh Python process for each streaming query's
  source, 0.3 s of imports, and a daemon for each kind of Python task at the session's
  first batch; in local mode a fork server (:mod:`.forkserver`) started with the session
  forks them from preloaded imports instead.
* **A file in the working directory named like a module** (``copy.py``): ``python -m``
  puts the working directory first on ``sys.path``, so in Spark's Python processes it
  would replace the standard library's module ("module 'copy' has no attribute
  'deepcopy'").  In local mode they start through the fork server's launcher, which puts
  the working directory last (a graph's own modules there are still found); where
  they cannot (a cluster's planning processes on the driver), such files are named in a
  warning as the session starts (:func:`shadowing_files`).
* **Slow start-ups**: the driver's JVM maps the class-data archive of :mod:`.classdata`
  when one was made (:mod:`.warmup`): its classes parsed and verified already.
* **Silent start-up**: starting Spark takes 10-25 s (the JVM, the context, the session,
  the data source); ``phases`` (:class:`dataspace.progress.Phases`) is told of each as it
  begins and ends, and ``cancel`` (an event: Ctrl-C) stops the start-up between two of
  them (:class:`StartInterrupted`), so a command can say what it waits for and stop.
* **log4j noise on the user's terminal**: the JVM's own output goes to a log file
  (:data:`DEFAULT_LOG`, or the one given) and log4j logs errors only; ``verbose`` keeps
  Spark's usual warnings on the terminal.  The Spark UI is off unless asked for.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._extras import require
from ...progress import NO_PHASES, Phases
from .placement import is_local, read_on

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "JAVA_HINT",
    "MIN_JAVA",
    "SparkSetupError",
    "StartInterrupted",
    "check_java",
    "get_session",
    "is_local",
    "java_version",
    "read_on",
    "register",
    "remove_shipped",
    "shadowing_files",
    "ship_package",
    "stop_session",
]

log = logging.getLogger(__name__)

MIN_JAVA = 17
JAVA_HINT = (
    "Java 17 or newer is needed for Spark: install openjdk-17-jre (Debian: apt install "
    "openjdk-17-jre-headless) or set JAVA_HOME"
)

_LOG4J = """\
rootLogger.level = {level}
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{{yy/MM/dd HH:mm:ss}} %p %c{{1}}: %m%n%ex
# Known noise at start-up and shutdown, even at WARN.
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
logger.utils.name = org.apache.spark.util.Utils
logger.utils.level = error
"""

_lock = threading.Lock()
_created: SparkSession | None = None
_shipped: list[Path] = []  # directories of package zips added to sessions of this process
_fork: Any = None  # the session's fork server (forkserver.ForkServer), local mode


class SparkSetupError(RuntimeError):
    """Spark cannot start here; the message is one line that says what to do."""


class StartInterrupted(SparkSetupError):
    """The start-up was cancelled (its ``cancel`` event set: Ctrl-C) between two phases;
    what was started is stopped."""


def find_java() -> str | None:
    """The ``java`` Spark will run: ``$JAVA_HOME/bin/java``, else ``java`` on ``PATH``."""
    home = os.environ.get("JAVA_HOME")
    if home:
        cand = os.path.join(home, "bin", "java")
        return cand if os.access(cand, os.X_OK) else None
    return shutil.which("java")


def java_version(java: str) -> int | None:
    """The major version of ``java`` (8 for "1.8.0_x", 17 for "17.0.15"), None if it
    does not run or says something unexpected."""
    try:
        r = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', r.stderr + r.stdout)
    if not m:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major


def check_java() -> int:
    """The Java major version, or :class:`SparkSetupError` (one line) when Java is
    missing, does not run, or is older than :data:`MIN_JAVA`."""
    java = find_java()
    if java is None:
        where = "JAVA_HOME points to no java" if os.environ.get("JAVA_HOME") else "no java found"
        raise SparkSetupError(f"{JAVA_HINT} ({where})")
    v = java_version(java)
    if v is None:
        raise SparkSetupError(f"{JAVA_HINT} ({java} -version failed)")
    if v < MIN_JAVA:
        raise SparkSetupError(f"{JAVA_HINT} (found Java {v} at {java})")
    return v


def _log4j_file(level: str) -> str:
    d = Path(tempfile.gettempdir()) / f"dataspace-spark-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    f = d / f"log4j2-{level}.properties"
    text = _LOG4J.format(level=level)
    if not f.exists() or f.read_text() != text:
        tmp = f.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, f)
    return str(f)


DEFAULT_LOG = os.path.join(tempfile.gettempdir(), f"dataspace-spark-{os.getuid()}", "spark.log")


def get_session(
    master: str | None = None,
    *,
    app_name: str = "dataspace",
    verbose: int = 0,
    conf: dict[str, str] | None = None,
    log_file: str | os.PathLike[str] | None = None,
    phases: Phases | None = None,
    cancel: threading.Event | None = None,
) -> tuple[SparkSession, bool]:
    """The process's SparkSession and whether this call created it.

    An active session (a test fixture's, a pyspark shell's) is returned as it is: one
    session per process.  Otherwise Java is checked first, then a session is started on
    ``master`` (default ``local[*]``) with the settings of the module docstring; the JVM's
    output goes to ``log_file`` (default :data:`DEFAULT_LOG`) unless ``verbose``.
    ``conf`` adds or overrides Spark settings (``spark.ui.enabled=true`` brings the UI
    back).  The ``dataspace`` data source is registered on the session.

    ``phases`` hears of each phase of the start-up as it begins and ends (JVM, context,
    session, data source); once ``cancel`` is set the start-up stops at the end of the
    phase under way, stops what it started and raises :class:`StartInterrupted`.
    """
    global _created
    require("spark", "a Spark session")  # MissingExtra: how to install PySpark, one line
    phases = phases or NO_PHASES
    with _lock:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is None:  # e.g. called from another thread than the creator
            inst = SparkSession._instantiatedSession
            if inst is not None and inst.sparkContext._jsc is not None:
                active = inst
        if active is not None:
            if master and active.sparkContext.master != master:
                log.warning("a Spark session on %s is already running in this process; "
                            "using it instead of %s", active.sparkContext.master, master)
            register(active)
            return active, False
        check_java()
        master = master or "local[*]"
        _python_env(master)
        spark = _start(master, app_name, verbose, conf or {}, log_file, phases, cancel)
        if _fork is None:  # Spark's Python processes here have the working directory first
            _warn_shadowing()
        try:
            # The first use of the session's SQL state builds it (seconds): here.
            phases.begin("preparing Spark SQL and the dataspace data source")
            register(spark)
            phases.end("Spark SQL ready, dataspace data source registered")
            _check_cancel(cancel)
            if not is_local(master):
                phases.begin("shipping the dataspace package to the workers")
                ship_package(spark)
                phases.end("package shipped")
        except BaseException:
            _created = spark
            _stop_created()
            raise
        _created = spark
        return spark, True


def shadowing_files(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """The files and packages in ``directory`` (default: the working directory) named like
    a module this process has imported -- the standard library's, PySpark's, this
    package's: those Spark's Python processes import too -- e.g. ``copy.py``; where the
    directory is first on their ``sys.path`` (``python -m``), each replaces that module."""
    d = Path(directory if directory is not None else os.getcwd())
    found = []
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return []
    for name in names:
        if name.endswith(".py"):
            mod = name[:-3]
        elif (d / name / "__init__.py").is_file():
            mod = name
        else:
            continue
        where = getattr(sys.modules.get(mod), "__file__", None)
        if where is None or mod == "__main__":  # not loaded, or built in: not replaceable
            continue
        try:
            own = Path(where).resolve().is_relative_to(d.resolve())
        except OSError:
            own = False
        if not own:  # (a module of the user's there, the graph's helpers, is no shadow)
            found.append(name)
    return found


def _warn_shadowing() -> None:
    """Name the files of the working directory that would replace modules in Spark's
    Python processes started on this machine without the launcher (a cluster's planning
    processes on the driver: see :mod:`.forkserver`)."""
    found = shadowing_files()
    if found:
        one = len(found) == 1
        log.warning("%s in the working directory %s %s the name of %s Spark's Python "
                    "processes import, and those started on this machine would import %s "
                    "from there instead: rename %s, or run from another directory",
                    ", ".join(found), os.getcwd(), "has" if one else "have",
                    "a module" if one else "modules", "it" if one else "them",
                    "it" if one else "them")


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise StartInterrupted("interrupted while Spark was starting")


def _python_env(master: str) -> None:
    if is_local(master) or not os.environ.get("PYSPARK_PYTHON"):
        os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    if is_local(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # loopback only


def _start(master: str, app_name: str, verbose: int, extra: dict[str, str],
           log_file: str | os.PathLike[str] | None, phases: Phases,
           cancel: threading.Event | None) -> SparkSession:
    from pyspark import SparkConf
    from pyspark.java_gateway import launch_gateway
    from pyspark.sql import SparkSession

    cores = os.cpu_count() or 2
    m = re.fullmatch(r"local\[(\d+)\]", master)
    parallel = int(m.group(1)) if m else cores
    settings = {
        "spark.app.name": app_name,
        "spark.master": master,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": str(max(2, parallel)),
        "spark.driver.extraJavaOptions": "-Dlog4j2.configurationFile=file:"
        + _log4j_file("warn" if verbose else "error"),
        "spark.sql.streaming.noDataMicroBatches.enabled": "true",
    }
    if is_local(master):
        settings["spark.driver.host"] = "127.0.0.1"
        settings["spark.driver.bindAddress"] = "127.0.0.1"
    settings.update(extra)
    conf = SparkConf()
    for k, v in settings.items():
        conf.set(k, v)
    popen: dict[str, Any] = {}
    if not verbose:
        path = Path(log_file or DEFAULT_LOG)
        path.parent.mkdir(parents=True, exist_ok=True)
        out = open(path, "ab")  # the JVM keeps it for its lifetime
        popen = {"stdout": out, "stderr": out}
    fork = _start_fork_server(master, None if verbose else path)
    gateway = sc = None
    try:
        with _keep_sigint_handler():
            if not os.environ.get("PYSPARK_GATEWAY_PORT"):  # else spark-submit made one
                phases.begin("launching the JVM")
                with _workers_import_installed_pyspark():
                    if "spark.driver.extraJavaOptions" not in extra:  # else the caller's alone
                        _share_class_data(conf)
                    gateway = launch_gateway(conf, popen_kwargs=popen)
                phases.end("JVM up")
                _check_cancel(cancel)
            phases.begin("starting the Spark context")
            sc = _context(conf, gateway, fork)
            phases.end("Spark context ready")
        _check_cancel(cancel)
        sc.setLogLevel("WARN" if verbose else "ERROR")
        phases.begin("creating the Spark session")
        spark = SparkSession.builder.getOrCreate()
        phases.end("Spark session ready")
        _check_cancel(cancel)
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt):  # that one is "stop at once": no waiting
            if sc is not None:
                with contextlib.suppress(Exception):
                    sc.stop()
            elif gateway is not None:
                _stop_gateway(gateway)
        _stop_fork_server()
        raise
    if not verbose:
        # PySpark logs every failed query's error as JSON on stderr; the engine reports
        # failures itself (one line per processor).
        from pyspark.logger import PySparkLogger

        for name in ("DataFrameQueryContextLogger", "SQLQueryContextLogger"):
            PySparkLogger.getLogger(name).setLevel(logging.CRITICAL)
    return spark


def _share_class_data(conf: Any) -> None:
    """Add the class-data archive of the JVM about to be launched (:mod:`.classdata`) to
    the driver's Java options, when there is one."""
    from pyspark.find_spark_home import _find_spark_home

    from . import classdata

    java = find_java()
    if java is None:
        return
    opts = classdata.java_options(java, os.environ.get("SPARK_HOME") or _find_spark_home())
    if opts:
        conf.set("spark.driver.extraJavaOptions",
                 " ".join([conf.get("spark.driver.extraJavaOptions") or "", *opts]).strip())


def launch_home() -> str:
    """The ``SPARK_HOME`` a local session launches its JVM with (see
    :func:`_workers_import_installed_pyspark`)."""
    require("spark", "a Spark session")
    from pyspark.find_spark_home import _find_spark_home

    home = os.environ.get("SPARK_HOME")
    if home:
        return home
    try:
        linked = _home_without_zips()
    except OSError:
        linked = None
    return linked or _find_spark_home()


def _stop_gateway(gateway: Any) -> None:
    """Stop a JVM launched for a context that was never made (it exits when its standard
    input closes)."""
    with contextlib.suppress(Exception):
        gateway.shutdown()
    proc = getattr(gateway, "proc", None)
    if proc is not None:
        with contextlib.suppress(Exception):
            proc.stdin.close()
        try:
            proc.wait(30)
        except Exception:
            with contextlib.suppress(Exception):
                proc.kill()


def _start_fork_server(master: str, log_file: Path | None) -> Any:
    """The session's fork server (:mod:`.forkserver`) in local mode, when the workers run
    this interpreter; None otherwise or if it cannot start (Spark then starts its
    processes itself, as without one).  With the server switched off
    (``DATASPACE_SPARK_FORKSERVER=0``) its launcher alone, so that Spark's Python
    processes still have the working directory last on ``sys.path``, not first: a
    ``copy.py`` there does not replace the standard library's ``copy`` in them."""
    global _fork
    from . import forkserver

    if not (is_local(master) and os.environ.get("PYSPARK_PYTHON") == sys.executable
            and forkserver.launchable(sys.executable)):
        return None
    _stop_fork_server()
    try:
        _fork = forkserver.ForkServer(sys.executable, log_file=log_file,
                                      serve=forkserver.enabled(sys.executable))
    except OSError as e:
        log.debug("no fork server: %s", e)
        return None
    return _fork


def _context(conf: Any, gateway: Any, fork: Any) -> Any:
    """The SparkContext, its Python workers started through ``fork``'s launcher if any
    (PySpark reads the workers' Python from ``PYSPARK_PYTHON`` when the context starts)."""
    from pyspark import SparkContext

    if fork is None:
        return SparkContext(conf=conf, gateway=gateway)
    before = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = fork.launcher
    try:
        return SparkContext(conf=conf, gateway=gateway)
    finally:
        if before is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = before


def _stop_fork_server() -> None:
    global _fork
    fork, _fork = _fork, None
    if fork is not None:
        fork.stop()


atexit.register(_stop_fork_server)


@contextlib.contextmanager
def _workers_import_installed_pyspark() -> Iterator[None]:
    """Launch the JVM with a ``SPARK_HOME`` whose Python workers import PySpark from this
    interpreter's installation (compiled once, bytecode cached) rather than from
    ``SPARK_HOME/python/lib/pyspark.zip``.

    Spark puts that zip first on every Python worker's ``PYTHONPATH``, and modules
    imported from a zip are compiled anew in every process.  Daemon-forked workers pay it
    once, but Spark starts a fresh process for each Python streaming source (at every
    query start) and each planner call: about 0.5 s of imports each time on a 2-core
    machine.  The home used is a directory of links to the real one's parts without
    ``python/``, so the zips are absent and the workers' ``import pyspark`` finds this
    installation.  Only when the workers run this interpreter (local mode, or a cluster
    without a ``PYSPARK_PYTHON`` of its own) and ``SPARK_HOME`` is not set by the user
    (a Spark distribution's home is left alone).
    """
    if os.environ.get("SPARK_HOME") or os.environ.get("PYSPARK_PYTHON") != sys.executable:
        yield
        return
    try:
        home = _home_without_zips()
    except OSError as e:
        log.debug("Python workers import PySpark from its zip: %s", e)
        home = None
    if home is None:
        yield
        return
    os.environ["SPARK_HOME"] = home
    try:
        yield
    finally:
        os.environ.pop("SPARK_HOME", None)


def _home_without_zips() -> str | None:
    """The linked ``SPARK_HOME`` of :func:`_workers_import_installed_pyspark` (made once
    per PySpark installation and user), or None if this PySpark has no zip to avoid."""
    import hashlib

    import pyspark
    from pyspark.find_spark_home import _find_spark_home

    real = Path(_find_spark_home()).resolve()
    if not (real / "python" / "lib" / "pyspark.zip").exists() or not (real / "jars").is_dir():
        return None
    key = hashlib.blake2b(f"{real}:{pyspark.__version__}".encode(), digest_size=6).hexdigest()
    base = Path(tempfile.gettempdir()) / f"dataspace-spark-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    home = base / f"home-{key}"
    names = sorted(n for n in os.listdir(real) if n != "python")
    if home.is_dir() and sorted(os.listdir(home)) == names:
        return str(home)
    tmp = Path(tempfile.mkdtemp(prefix="home-", dir=base))
    for n in names:
        (tmp / n).symlink_to(real / n)
    try:
        os.replace(tmp, home)
    except OSError:  # made meanwhile by another process (or stale): use it if complete
        shutil.rmtree(tmp, ignore_errors=True)
        if not (home.is_dir() and sorted(os.listdir(home)) == names):
            shutil.rmtree(home, ignore_errors=True)
            return None
    return str(home)


@contextlib.contextmanager
def _keep_sigint_handler() -> Iterator[None]:
    """Keep a SIGINT handler the program installed across the creation of a SparkContext.

    PySpark replaces the handler with its own (cancel every job, raise KeyboardInterrupt
    wherever the main thread is, py4j calls included: tracebacks from py4j's threads).  A
    program that handles Ctrl-C itself -- ``dataspace pipeline run`` stops cleanly after
    the current step -- keeps its handler; Python's default one (and an ignored SIGINT)
    is left to PySpark.
    """
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT) if main else None
    try:
        yield
    finally:
        if callable(before) and before is not signal.default_int_handler:
            signal.signal(signal.SIGINT, before)


def register(spark: SparkSession) -> None:
    """Register the ``dataspace`` data source on ``spark`` and make the connector's errors
    one line (:mod:`.errors`); :func:`get_session` does it for its sessions."""
    require("spark", "the Spark connector")  # PyArrow too: its readers make Arrow batches
    from . import errors
    from .source import DataspaceDataSource

    errors.install()
    if not getattr(spark, "_dataspace_registered", False):
        # The class goes to the planner's Python process (pickled by value, being made
        # here) with the master, which that process cannot ask Spark for.
        cls = type(DataspaceDataSource.__name__, (DataspaceDataSource,),
                   {"master": spark.sparkContext.master, "__module__": DataspaceDataSource.__module__})
        spark.dataSource.register(cls)
        spark._dataspace_registered = True  # type: ignore[attr-defined]


_register = register  # the engine's older name


def stop_session() -> None:
    """Stop the session :func:`get_session` created (sessions it found are left alone)."""
    with _lock:
        _stop_created()


def _stop_created() -> None:
    global _created
    if _created is not None:
        try:
            _created.stop()
        finally:
            _created = None
            remove_shipped()
            _stop_fork_server()


def remove_shipped() -> None:
    """Remove the package zips :func:`ship_package` made in this process (at the end of
    the session that uses them; also at exit, for sessions stopped otherwise)."""
    while _shipped:
        shutil.rmtree(_shipped.pop(), ignore_errors=True)


atexit.register(remove_shipped)


def _remove_orphans() -> None:
    """Remove the package zips left by processes that are gone (named after their pid)."""
    from .forkserver import remove_orphans

    remove_orphans(Path(tempfile.gettempdir()), "dataspace-pyfiles-*-*", 2)


def ship_package(spark: SparkSession) -> str:
    """Zip the ``dataspace`` package and add it to the session (``addPyFile``), so that
    cluster workers can import it; returns the zip's path.  Spark serves the file from
    there for the session's life; :func:`stop_session` (or the exit) removes it, and the
    next call removes those of processes that died without an exit (SIGKILL)."""
    _remove_orphans()
    d = Path(tempfile.mkdtemp(prefix=f"dataspace-pyfiles-{os.getpid()}-"))
    _shipped.append(d)
    zpath = d / "dataspace.zip"
    write_package_zip(zpath)
    spark.sparkContext.addPyFile(str(zpath))
    log.info("shipped the dataspace package to the workers (%s)", zpath)
    return str(zpath)


def write_package_zip(zpath: Path) -> None:
    """The zip of the running ``dataspace`` package that executors import: its source and,
    where the compiled core runs, that core: executors of the same platform and Python
    run it (extracted beside the zip), others the source (see ``dataspace._build``)."""
    import dataspace
    from dataspace._build import compiled_files

    root = Path(dataspace.__file__).resolve().parent
    with zipfile.ZipFile(zpath, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(root.rglob("*.py")):
            z.write(f, Path("dataspace") / f.relative_to(root))
        for path, name in compiled_files():
            z.write(path, name)
