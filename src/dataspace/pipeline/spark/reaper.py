"""Process sessions: every live process of a session, killed and reaped.

A Spark driver run in a child process of its own session (``start_new_session=True``)
is the Python driver, the JVM with its executors and the Python workers PySpark starts
(in their own process group, in the same session).  :func:`reap_session` kills whatever
is left of such a session and waits until it is gone: the warm-up's child, the crash
harnesses' drivers, the test suite's Spark workers.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time

__all__ = ["kill_session", "reap_session", "session_pids"]


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
