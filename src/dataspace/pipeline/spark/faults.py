"""Crash points for the SIGKILL tests of the Spark engine.

The connector calls :func:`point` at chosen places: ``source`` (the stream reader's
``latestOffset``, on the driver), ``partitions`` (planning a batch, on the driver),
``read`` (a partition's read, on an executor), ``stage`` (a read task of a pure
processor has staged its outputs, on an executor), ``write`` (a write task, on an
executor), ``sink`` (a side-effecting function has run, before our commit),
``commit-inside`` (our commit's writes are done but not committed) and ``commit-after``
(our commit is durable, Spark's commit log not yet written).

Nothing happens unless the environment says so -- Spark's workers inherit the driver's::

    DATASPACE_SPARK_FAULT=commit-after:2      # the 2nd time any process gets there...
    DATASPACE_SPARK_FAULT_DIR=/tmp/run-7      # ...counted here (a file per point)...
    DATASPACE_SPARK_FAULT_SID=12345           # ...kill every process of session 12345

:func:`kill_session` kills the whole driver -- the Python driver, the JVM, and the Python
workers (which PySpark puts in their own process group, in the same session) -- with
SIGKILL, as a crash of the machine's driver would.  The session id guard makes sure a
stray variable cannot kill anything but the test's own child session.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import time

__all__ = ["ENV", "POINTS", "kill_session", "point", "reap_session", "session_pids"]

ENV = "DATASPACE_SPARK_FAULT"
POINTS = ("source", "partitions", "read", "stage", "write", "sink", "commit-inside", "commit-after")

_spec: dict[str, int] | None = None


def _parse() -> dict[str, int]:
    global _spec
    if _spec is None:
        out = {}
        for part in os.environ.get(ENV, "").split(","):
            name, _, n = part.strip().partition(":")
            if name:
                out[name] = int(n or 1)
        _spec = out
    return _spec


def point(name: str) -> None:
    """A crash point: kills the session when the environment asks for it here now."""
    if not os.environ.get(ENV):
        return
    want = _parse().get(name)
    if want is None:
        return
    d = os.environ.get(f"{ENV}_DIR")
    sid = os.environ.get(f"{ENV}_SID")
    if not d or not sid or int(sid) != os.getsid(0):
        return
    fd = os.open(os.path.join(d, f"{name}.count"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        n = int(os.pread(fd, 32, 0) or b"0") + 1
        os.pwrite(fd, str(n).encode().ljust(31), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    if n == want:
        kill_session()


def session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (Linux: from /proc; zombies, already dead
    and only waiting to be reaped, are left out)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] != b"Z":
            out.append(int(name))
    return out


def kill_session(sid: int | None = None) -> None:
    """SIGKILL every process of session ``sid`` (default: ours), this one last."""
    me = os.getpid()
    sid = os.getsid(0) if sid is None else sid
    for pid in session_pids(sid):
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    if os.getsid(0) == sid:
        os.kill(me, signal.SIGKILL)


def _wait_gone(pid: int, timeout: float) -> None:
    """Wait (bounded) for a process that is not our child to end: a pidfd becomes
    readable when it exits."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return  # already gone
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


def reap_session(proc: subprocess.Popen[str] | subprocess.Popen[bytes], timeout: float) -> bool:
    """Kill whatever is left of the session ``proc`` leads (a JVM, Python workers) and
    wait until it is gone; False if it would not go within ``timeout`` seconds."""
    sid = proc.pid
    deadline = time.monotonic() + timeout
    kill_session(sid)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    while True:
        left = session_pids(sid)
        if not left:
            return True
        if time.monotonic() > deadline:
            return False
        kill_session(sid)
        for pid in left:
            _wait_gone(pid, max(0.0, deadline - time.monotonic()))
