"""A Spark standalone cluster on loopback for the tests: one Master and one Worker, started
from the pyspark install (its ``bin/spark-class``; nothing is downloaded).

The Worker cannot see the driver's data: it runs in a mount namespace of its own
(``unshare -m``, as root) with a tmpfs over the directory that holds the tests' data (the
pytest base directory), so the executors it starts see an empty directory where the
driver keeps its stores, checkpoints and marker files.  :meth:`Cluster.start` proves it:
a marker file the driver writes there is absent when looked up through the Worker's own
root (``/proc/PID/root``).  Every wait is bounded; :meth:`Cluster.stop` kills every
process of the Master's and the Worker's sessions.

The Worker can be killed (with its executors) while an application runs
(:meth:`Cluster.kill_worker`); a supervisor thread starts a new Worker when one dies, as
a service manager would, so the application gets a new executor and carries on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from dataspace.pipeline.spark.classdata import QUICK_JIT  # (the cluster's JVMs too)

START_TIMEOUT = 120.0
EXECUTOR_MEMORY = "512m"
WORKER_MEMORY = "1g"  # at least spark.executor.memory
WORKER_CORES = 2


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_session(sid: int) -> None:
    from dataspace.pipeline.spark.reaper import kill_session

    kill_session(sid)


def _session_pids(sid: int) -> list[int]:
    from dataspace.pipeline.spark.reaper import session_pids

    return session_pids(sid)


def _wait_session_gone(sid: int, timeout: float) -> bool:
    """Wait (bounded) until no process of session ``sid`` is left (pidfds: no polling)."""
    import select

    deadline = time.monotonic() + timeout
    while True:
        left = _session_pids(sid)
        if not left:
            return True
        if time.monotonic() > deadline:
            return False
        _kill_session(sid)
        for pid in left:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            finally:
                os.close(fd)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process goes (a pytest killed by a
    timeout must not leave a cluster behind; the JVM keeps it across the execs)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class ClusterError(RuntimeError):
    """The cluster did not start (the message has the log's tail)."""


class Cluster:
    """A running standalone cluster (see the module docstring)."""

    def __init__(self, hidden: Path, scratch: Path | None = None) -> None:
        self.hidden = Path(hidden).resolve()
        self.scratch = Path(scratch or tempfile.mkdtemp(prefix="dataspace-cluster-")).resolve()
        if self.scratch == self.hidden or self.hidden in self.scratch.parents:
            raise ValueError("the cluster's scratch directory must not be inside the hidden one")
        self.shared = self.scratch / "shared"  # seen by the driver and the worker alike
        self.port = free_port()
        self.ui_port = free_port()
        self.master_url = f"spark://127.0.0.1:{self.port}"
        self.master: subprocess.Popen[bytes] | None = None
        self.worker: subprocess.Popen[bytes] | None = None
        self.worker_ui_port = 0
        self.workers_started = 0
        self._closing = False
        self._cv = threading.Condition()
        self._supervisor: threading.Thread | None = None

    # -- environment -------------------------------------------------------------------

    def _env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        for k in list(env):
            if k.startswith(("PYSPARK_", "SPARK_", "DATASPACE_SPARK_FAULT")):
                del env[k]
        env.update(SPARK_HOME=str(spark_home()), SPARK_LOCAL_IP="127.0.0.1",
                   SPARK_CONF_DIR=str(self.scratch / "conf"), SPARK_DAEMON_MEMORY="256m",
                   SPARK_DAEMON_JAVA_OPTS=QUICK_JIT,
                   SPARK_LOG_DIR=str(self.scratch / "logs"))
        env.update(extra)
        return env

    def driver_env(self, **extra: str) -> dict[str, str]:
        """The environment of a driver process for this cluster (loopback only)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DATASPACE_SPARK_FAULT")}
        env["SPARK_LOCAL_IP"] = "127.0.0.1"
        env.update(extra)
        return env

    def conf(self) -> dict[str, str]:
        """Spark settings a driver on this cluster uses (one executor with both cores)."""
        return {"spark.executor.memory": EXECUTOR_MEMORY, "spark.cores.max": str(WORKER_CORES),
                "spark.executor.cores": str(WORKER_CORES), "spark.executor.extraJavaOptions": QUICK_JIT,
                "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}

    def conf_args(self) -> list[str]:
        """:meth:`conf` as ``--conf KEY=VALUE`` arguments of ``dataspace pipeline``."""
        return [a for k, v in self.conf().items() for a in ("--conf", f"{k}={v}")]

    # -- start and stop ------------------------------------------------------------------

    def start(self) -> Cluster:
        for d in ("conf", "logs", "work", "shared"):
            (self.scratch / d).mkdir(parents=True, exist_ok=True)
        self.hidden.mkdir(parents=True, exist_ok=True)
        try:
            self._start_master()
            self._start_worker()
        except BaseException:
            self.stop()
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="spark-worker-supervisor",
                                            daemon=True)
        self._supervisor.start()
        return self

    def _spawn(self, args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:  # the child has its own copy of the descriptor
            return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    env=env, cwd=self.scratch, start_new_session=True,
                                    preexec_fn=_die_with_parent)

    def _start_master(self) -> None:
        cls = str(spark_home() / "bin" / "spark-class")
        env = self._env(SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false")
        self.master = self._spawn(
            [cls, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
             "--port", str(self.port), "--webui-port", str(self.ui_port)],
            self.scratch / "logs" / "master.log", env)
        self._wait(lambda s: s.get("status") == "ALIVE", self.master, "master")

    def _start_worker(self) -> None:
        cls = str(spark_home() / "bin" / "spark-class")
        self.worker_ui_port = free_port()
        env = self._env(PYSPARK_PYTHON=sys.executable, SPARK_WORKER_DIR=str(self.scratch / "work"))
        script = 'mount -t tmpfs -o size=16m tmpfs "$0" && exec "$@"'
        proc = self._spawn(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(self.hidden),
             cls, "org.apache.spark.deploy.worker.Worker", self.master_url,
             "--host", "127.0.0.1", "--port", str(free_port()),
             "--webui-port", str(self.worker_ui_port),
             "--cores", str(WORKER_CORES), "--memory", WORKER_MEMORY],
            self.scratch / "logs" / f"worker-{self.workers_started}.log", env)
        ui = f":{self.worker_ui_port}"
        self._wait(lambda s: any(w.get("state") == "ALIVE" and str(w.get("webuiaddress", "")).endswith(ui)
                                 for w in s.get("workers", [])), proc, "worker")
        self.check_hidden(proc.pid)
        with self._cv:
            self.worker = proc
            self.workers_started += 1
            self._cv.notify_all()

    def state(self) -> dict[str, Any]:
        """The master's state (its web UI's JSON)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return dict(json.load(r))

    def _wait(self, ready: Any, proc: subprocess.Popen[bytes], what: str) -> None:
        """Poll the master's JSON until ``ready(state)`` (bounded: a daemon JVM starting)."""
        deadline = time.monotonic() + START_TIMEOUT
        delay = 0.1
        while True:
            if proc.poll() is not None:
                raise ClusterError(f"the Spark {what} exited with {proc.returncode}: "
                                   f"{self.log_tail(what)}")
            with contextlib.suppress(OSError, ValueError):
                if ready(self.state()):
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"the Spark {what} was not ready within {START_TIMEOUT:g}s: "
                                   f"{self.log_tail(what)}")
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    def log_tail(self, what: str = "worker", n: int = 3000) -> str:
        logs = sorted((self.scratch / "logs").glob(f"{what}*.log"), key=lambda p: p.stat().st_mtime)
        return logs[-1].read_text(errors="replace")[-n:] if logs else "(no log)"

    def check_hidden(self, pid: int | None = None) -> None:
        """Prove that the worker (``pid``, default the current one) does not see the hidden
        directory: a marker written there now is absent through the worker's root; one in
        the shared directory is present."""
        if pid is None:
            assert self.worker is not None
            pid = self.worker.pid
        marker = self.hidden / f"driver-only-{os.getpid()}"
        marker.write_text("the worker must not see this\n")
        shared = self.shared / "visible"
        shared.write_text("the worker sees this\n")
        root = f"/proc/{pid}/root"
        if os.path.exists(root + str(marker)):
            raise ClusterError(f"the worker sees {marker}: the mount namespace does not hide it")
        if not os.path.exists(root + str(shared)):
            raise ClusterError(f"the worker does not see {shared}")
        if not os.path.exists(root + str(self.hidden)):
            raise ClusterError(f"the worker has no (empty) {self.hidden}")

    @property
    def worker_sid(self) -> int:
        assert self.worker is not None
        return self.worker.pid  # started with a session of its own

    def kill_worker(self) -> None:
        """SIGKILL the worker and its executors (its whole session); the supervisor
        starts a new one."""
        _kill_session(self.worker_sid)

    def wait_workers(self, n: int, timeout: float = START_TIMEOUT) -> None:
        """Wait until ``n`` workers have been started in all (restarts included)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self.workers_started >= n, timeout):
                raise ClusterError(f"worker {n} did not start within {timeout:g}s")

    def _supervise(self) -> None:
        while True:
            proc = self.worker
            if proc is None:
                return
            proc.wait()
            if self._closing:
                return
            _wait_session_gone(proc.pid, 30.0)
            try:
                self._start_worker()
            except Exception as e:  # the tests waiting for a worker will say so
                with self._cv:
                    self.worker = None
                    self._cv.notify_all()
                print(f"spark_cluster: could not restart the worker: {e}", file=sys.stderr)
                return

    def stop(self) -> None:
        self._closing = True
        self._end(self.worker)
        if self._supervisor is not None:  # it may be starting a worker: let it finish
            self._supervisor.join(START_TIMEOUT)
        self._end(self.worker)
        self._end(self.master)
        shutil.rmtree(self.scratch, ignore_errors=True)

    @staticmethod
    def _end(p: subprocess.Popen[bytes] | None) -> None:
        if p is not None:
            _kill_session(p.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
            _wait_session_gone(p.pid, 30.0)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def store_clients_in_session(sid: int, url: str) -> list[int]:
    """The processes of session ``sid`` connected to the PostgreSQL database of ``url``:
    the server's client ports of that database (``pg_stat_activity``) matched to sockets
    (``/proc/net/tcp*``) and the sockets to processes (``/proc/PID/fd``).  Which side of
    the cluster talks to the store."""
    import urllib.parse

    import psycopg

    with psycopg.connect(url, autocommit=True) as c:
        ports = {int(p) for (p,) in c.execute(
            "SELECT client_port FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND client_port IS NOT NULL")}
    server = urllib.parse.urlsplit(url).port or 5432
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table, encoding="ascii") as f:
            next(f)
            for line in f:
                cols = line.split()
                local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
                if (state == "01" and int(local.rsplit(":", 1)[1], 16) in ports
                        and int(remote.rsplit(":", 1)[1], 16) == server):
                    inodes.add(f"socket:[{inode}]")
    mine = []
    for pid in _session_pids(sid):
        with contextlib.suppress(OSError):
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(_readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                mine.append(pid)
    return mine


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def can_unshare() -> str | None:
    """None when this process may hide a directory in a mount namespace of its own (what
    the worker needs), else why not."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    with tempfile.TemporaryDirectory(prefix="dataspace-unshare-") as d:
        try:
            r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                'mount -t tmpfs tmpfs "$0"', d],
                               capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"unshare -m failed: {e}"
    if r.returncode != 0:
        return (f"unshare -m with a tmpfs mount failed ({r.stderr.strip() or r.returncode}): run "
                "as root, in a container with CAP_SYS_ADMIN")
    return None


__all__ = ["Cluster", "ClusterError", "can_unshare", "free_port", "store_clients_in_session", "spark_home"]
