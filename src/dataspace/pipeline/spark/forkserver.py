"""A fork server for the Python processes Spark starts afresh in every session and query.

Spark runs a Python streaming source's planning (``initialOffset``, ``latestOffset``,
``partitions``, ``commit``) in a process of its own, started with
``python -m pyspark.sql.streaming.python_streaming_source_runner`` when the query starts
-- not forked from its daemon, as task workers are.  That process imports PySpark,
PyArrow and this package before the query's first batch can be planned: about 0.3 s on
a 2-core machine, at every query start (``pipeline run --until-idle`` starts one query
per processor with input, per round).  The task workers come from daemons
(``python -m pyspark.daemon MODULE``), one per kind of work -- looking up, creating and
planning the data source, the read and write tasks, the streaming sink -- each a fresh
interpreter that imports PySpark at the session's first batch: six of them one after
the other, 3-4 s of a 2-core machine before the first batch of a new session is done.

In local mode the session (:mod:`.session`) points Spark's Python executable at a
*launcher*: a small script that, for the modules in :data:`MODULES`, asks this server
-- started with the session, those imports done once -- to fork a child that runs the
module with the launcher's arguments, environment, working directory and standard
streams (passed over a Unix socket), then waits for the child and exits with its
status; signals the launcher gets (Spark stops a worker with SIGTERM) go to the child.
A daemon forked so forks its workers in turn, with the modules they import loaded.
Anything else and whenever the server cannot be reached, the launcher ``exec``\\s the
real interpreter as Spark would have, so the server is an optimisation, never a
dependency.

Either way a module runs with the working directory *last* on ``sys.path``, not first as
``python -m`` puts it: the driver's working directory is the user's, and a file there
named like a module of the standard library or of an installed package (``copy.py``,
``types.py``, ``numpy.py``) would replace that module in every one of Spark's Python
processes ("module 'copy' has no attribute 'deepcopy'").  The user's own modules there
(a graph's helpers) are still found, after everything installed.  The launcher is used
with the server switched off too, for that alone.

The socket lives in a directory only this user can enter.  The server exits when its
parent (the driver) goes: its standard input is a pipe from the driver.  The server
kills a child whose launcher disappeared (Spark killed it with SIGKILL), and the children
left when it stops.  Ctrl-C at the terminal stays the driver's: the server runs in a
process group of its own and ignores SIGINT, and a child ignores the signals its
launcher ignores (Spark's processes ignore SIGINT, as PySpark starts the JVM so), as a
fresh interpreter would.  ``DATASPACE_SPARK_FORKSERVER=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["ENV", "MODULES", "PRELOAD", "ForkServer", "enabled", "launchable", "serve"]

log = logging.getLogger(__name__)

ENV = "DATASPACE_SPARK_FORKSERVER"

MODULES = ("pyspark.sql.streaming.python_streaming_source_runner", "pyspark.daemon")
"""The ``-m`` modules the launcher hands to the server (the rest are exec'd)."""

PRELOAD = (
    "pyspark.sql.streaming.python_streaming_source_runner",
    "pyspark.daemon",
    "pyspark.worker",
    "pyspark.sql.worker.lookup_data_sources",
    "pyspark.sql.worker.create_data_source",
    "pyspark.sql.worker.plan_data_source_read",
    "pyspark.sql.worker.write_into_data_source",
    "pyspark.sql.worker.commit_data_source_write",
    "pyspark.sql.worker.python_streaming_sink_runner",
    "dataspace.pipeline.spark.source",
    "dataspace.pipeline.spark.sink",
    "dataspace.streams.sqlite",
    "dataspace.streams.postgres",
)
"""Imported by the server before it forks (those that fail to import are skipped)."""

_LAUNCHER = '''#!{python} -IS
# The dataspace fork-server launcher (dataspace.pipeline.spark.forkserver): made for one
# Spark session; removed with it.
import os
import sys

PYTHON = {python!r}
SOCKET = {socket!r}
MODULES = {modules!r}


def _recv(s, n):
    buf = b""
    while len(buf) < n:
        got = s.recv(n - len(buf))
        if not got:
            break
        buf += got
    return buf


def _forked(argv):
    import json
    import signal
    import socket
    import struct

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(SOCKET)
        ignored = [int(g) for g in SIGNALS if signal.getsignal(g) == signal.SIG_IGN]
        body = json.dumps({{"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                           "ignored": ignored}}).encode()
        socket.send_fds(s, [struct.pack("!I", len(body)) + body], [0, 1, 2])
        got = _recv(s, 4)
    except OSError:
        return None
    pid = struct.unpack("!i", got)[0] if len(got) == 4 else 0
    if pid <= 0:
        return None  # refused: run it the ordinary way (below)

    def forward(sig, _frame):
        try:
            os.kill(pid, sig)
        except OSError:
            pass

    for sig in SIGNALS:
        if signal.getsignal(sig) != signal.SIG_IGN:  # ignored ones stay so (the child's too)
            signal.signal(sig, forward)
    try:
        got = _recv(s, 4)
    except OSError:
        got = b""
    code = struct.unpack("!i", got)[0] if len(got) == 4 else 1
    if code < 0:  # killed by a signal: die the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


argv = sys.argv[1:]
if len(argv) >= 2 and argv[0] == "-m":
    if SOCKET is not None and argv[1] in MODULES and os.environ.get({env!r}) != "0":
        _forked(argv)
    # As `python -m`, with the working directory last on sys.path instead of first.
    os.execv(PYTHON, [PYTHON, "-P", "-c", {boot!r}, *argv[1:]])
os.execv(PYTHON, [PYTHON, *argv])
'''

_BOOT = '''\
import os, runpy, sys
try:
    _cwd = os.getcwd()
except OSError:
    _cwd = None
if _cwd is not None and _cwd not in sys.path:
    sys.path.append(_cwd)
del sys.argv[0], _cwd
if hasattr(runpy, "_run_module_as_main"):
    runpy._run_module_as_main(sys.argv[0])
else:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
'''
"""What the launcher's interpreter runs (``python -P -c``) for a ``-m MODULE`` it does not
hand to the server: the module as ``python -m`` runs it (``runpy._run_module_as_main``
is what ``-m`` calls), with the working directory appended to ``sys.path``."""


def launchable(python: str = sys.executable) -> bool:
    """Whether a launcher can run ``python``: it names it on its ``#!`` line (no spaces,
    not too long)."""
    return " " not in python and len(python) < 200


def enabled(python: str = sys.executable) -> bool:
    """Whether sessions use the fork server: not with ``DATASPACE_SPARK_FORKSERVER=0``,
    nor where the launcher cannot name ``python`` (:func:`launchable`)."""
    return (os.environ.get(ENV, "1") != "0" and hasattr(socket, "send_fds") and hasattr(os, "fork")
            and launchable(python))


def _base() -> Path:
    base = Path(tempfile.gettempdir()) / f"dataspace-spark-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    return base


def remove_orphans(base: Path, pattern: str, pid_at: int) -> None:
    """Remove the directories of ``base`` matching ``pattern`` whose owner process -- the
    pid at ``pid_at`` in the ``-``-separated name -- is gone (killed with SIGKILL, so
    nothing removed them); those of live processes, other users' included, stay."""
    for d in base.glob(pattern):
        pid = d.name.split("-")[pid_at]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:  # alive (another user's): not ours to remove
            continue


class ForkServer:
    """One session's fork server and its launcher (see the module docstring); with
    ``serve=False`` the launcher alone, which runs every module itself (``exec``), with
    the working directory last on ``sys.path``."""

    def __init__(self, python: str = sys.executable, log_file: str | os.PathLike[str] | None = None,
                 modules: tuple[str, ...] = MODULES, preload: tuple[str, ...] = PRELOAD,
                 serve: bool = True) -> None:
        base = _base()
        remove_orphans(base, "fork-*-*", 1)  # servers of killed drivers
        self.dir = Path(tempfile.mkdtemp(prefix=f"fork-{os.getpid()}-", dir=base))
        self.socket = str(self.dir / "sock")
        self.launcher = str(self.dir / "python")
        text = _LAUNCHER.format(python=python, socket=self.socket if serve else None,
                                modules=tuple(modules), env=ENV, boot=_BOOT)
        with open(self.launcher, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(self.launcher, 0o700)
        self.proc: subprocess.Popen[bytes] | None = None
        if not serve:
            return
        env = dict(os.environ)
        # Spark's workers run with PYTHONHASHSEED=0 unless the driver's says otherwise;
        # a child has its parent's hash seed, so the server starts with theirs.
        env["PYTHONHASHSEED"] = os.environ.get("PYTHONHASHSEED", "0")
        err: Any = subprocess.DEVNULL
        if log_file is not None:
            err = open(log_file, "ab")  # the server keeps its own copy
        try:
            # -P: not the working directory on the server's sys.path (nor, through it, on
            # its children's): a copy.py there would be what the preloads import as copy.
            self.proc = subprocess.Popen(
                [python, "-P", "-m", __name__, str(self.dir),
                 json.dumps([list(modules), list(preload)])],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, env=env, close_fds=True,
                process_group=0)  # Ctrl-C at the terminal is the driver's to handle
        except OSError:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        finally:
            if log_file is not None:
                err.close()

    def ready(self, timeout: float) -> bool:
        """Wait until the server accepts requests (it says so on its standard output
        once its imports are done and it listens); False if it did not within
        ``timeout`` or died.  Sessions do not wait: until then launchers exec."""
        import select

        if self.proc is None or self.proc.stdout is None:
            return False
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return bool(r) and self.proc.stdout.read(1) == b"R"

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server (its children, if any, with it) and remove its directory."""
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()  # the server's signal to go
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
            if proc.stdout is not None:
                proc.stdout.close()  # the ready pipe (ForkServer.ready)
        shutil.rmtree(self.dir, ignore_errors=True)


# -- the server -------------------------------------------------------------------------------


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = conn.recv(n - len(buf))
        if not got:
            raise ConnectionError("the launcher went away")
        buf += got
    return buf


def _child(req: dict[str, Any], fds: list[int], others: list[Any]) -> None:
    """In the forked child: become the process Spark asked for, then exit with its status."""
    code = 1
    try:
        # The signal dispositions of a fresh interpreter started by the launcher: Spark's
        # JVM ignores SIGINT (PySpark starts it so), and so do the processes it starts.
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in req.get("ignored", ()):
            signal.signal(sig, signal.SIG_IGN)
        for o in others:
            with contextlib.suppress(OSError):
                o.close() if hasattr(o, "close") else os.close(o)
        for k, fd in enumerate(fds[:3]):
            os.dup2(fd, k)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        cwd = req["cwd"]
        os.chdir(cwd)
        env = req["env"]
        os.environ.clear()
        os.environ.update(env)
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[:0] = extra
        if cwd not in sys.path:  # last, not first as `python -m` has it (module docstring)
            sys.path.append(cwd)
        if env.get("PYTHONUNBUFFERED"):
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.reconfigure(write_through=True)  # type: ignore[union-attr]
        import runpy
        import warnings

        # The module is preloaded: runpy warns that it runs a fresh copy as __main__ (on
        # Spark's log, or the terminal with --verbose), which is what a fresh interpreter does.
        warnings.filterwarnings("ignore", message=r".* found in sys\.modules after import of package",
                                category=RuntimeWarning)
        sys.argv = req["argv"][1:]  # the module's arguments after it (argv[0]: runpy's)
        runpy.run_module(req["argv"][1], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            sys.stderr.write(f"{e.code}\n")  # as the interpreter does for sys.exit(text)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code & 0xFF)


def serve(d: str, modules: tuple[str, ...] = MODULES, preload: tuple[str, ...] = PRELOAD) -> None:
    """Run the server of directory ``d`` until standard input closes (the driver's pipe),
    forking children for ``modules`` after importing ``preload``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops us by closing the pipe
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as e:  # that module is imported by the child instead
            log.debug("fork server: not preloading %s: %s", name, e)
    seed = os.environ.get("PYTHONHASHSEED", "")
    path = os.path.join(d, "sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    os.write(1, b"R")  # ready (ForkServer.ready)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: None)  # seen through the wake-up pipe
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "signal")
    sel.register(0, selectors.EVENT_READ, "parent")
    children: dict[int, socket.socket] = {}

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
                with contextlib.suppress(KeyError, ValueError):
                    sel.unregister(conn)
                conn.close()

    def accept() -> None:
        conn, _ = listener.accept()
        fds: list[int] = []
        try:
            conn.settimeout(5.0)
            msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
            if len(msg) < 4 or len(fds) != 3:
                raise ValueError("a request without its header or streams")
            n = struct.unpack("!I", msg[:4])[0]
            body = msg[4:] + _recv_exact(conn, n - (len(msg) - 4))
            req = json.loads(body)
            argv = req["argv"]
            if argv[0] != "-m" or argv[1] not in modules or req["env"].get("PYTHONHASHSEED", "") != seed:
                raise ValueError(f"not for this server: {argv}")
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            pid = os.fork()
            if pid == 0:
                _child(req, fds, [sel, listener, conn, wake_r, wake_w, *children.values()])
            conn.settimeout(None)
            conn.sendall(struct.pack("!i", pid))
            children[pid] = conn
            sel.register(conn, selectors.EVENT_READ, pid)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            log.warning("fork server: a request refused: %s", e)
            with contextlib.suppress(OSError):
                conn.sendall(struct.pack("!i", 0))  # the launcher execs instead
            conn.close()
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    try:
        while True:
            for key, _ in sel.select():
                what = key.data
                if what == "accept":
                    accept()
                elif what == "signal":
                    got = b""
                    with contextlib.suppress(OSError):
                        while chunk := os.read(wake_r, 512):
                            got += chunk
                    reap()
                    if signal.SIGTERM in got:
                        return
                elif what == "parent":
                    if not os.read(0, 512):
                        return
                else:  # a launcher's connection: it closed (killed) before its child ended
                    conn = key.fileobj
                    assert isinstance(conn, socket.socket)
                    with contextlib.suppress(OSError):
                        if conn.recv(16):
                            continue
                    sel.unregister(conn)
                    with contextlib.suppress(OSError):
                        os.kill(what, signal.SIGKILL)
    finally:
        for pid in list(children):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.unlink(path)
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    _mods, _pre = json.loads(sys.argv[2]) if len(sys.argv) > 2 else (MODULES, PRELOAD)
    serve(sys.argv[1], tuple(_mods), tuple(_pre))
