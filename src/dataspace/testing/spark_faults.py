"""Crash points for the SIGKILL tests of the Spark engine: the harness's side of
:mod:`dataspace.pipeline.spark.faultpoints`.

The connector calls its fault points (``source``, ``partitions``, ``read``, ``stage``,
``write``, ``sink``, ``commit-inside``, ``commit-after``: see that module) and, when the
environment names this module's :func:`point` as the hook, this module decides whether
to kill.  Nothing happens unless the environment says so -- Spark's workers inherit the
driver's (:func:`environment` gives the lot)::

    DATASPACE_SPARK_FAULT_HOOK=dataspace.testing.spark_faults:point
    DATASPACE_SPARK_FAULT=commit-after:2      # the 2nd time any process gets there...
    DATASPACE_SPARK_FAULT_DIR=/tmp/run-7      # ...counted here (a file per point)...
    DATASPACE_SPARK_FAULT_SID=12345           # ...kill every process of session 12345

:func:`~dataspace.pipeline.spark.reaper.kill_session` kills the whole driver -- the
Python driver, the JVM, and the Python workers (which PySpark puts in their own process
group, in the same session) -- with SIGKILL, as a crash of the machine's driver would.
The session id guard makes sure a stray variable cannot kill anything but the test's own
child session.
"""

from __future__ import annotations

import fcntl
import os

from ..pipeline.spark.faultpoints import HOOK_ENV, POINTS
from ..pipeline.spark.reaper import kill_session

__all__ = ["ENV", "HOOK", "HOOK_ENV", "POINTS", "environment", "point"]

ENV = "DATASPACE_SPARK_FAULT"
HOOK = "dataspace.testing.spark_faults:point"

_spec: dict[str, int] | None = None


def environment(fault: str, directory: str) -> dict[str, str]:
    """The variables that arm ``fault`` (``POINT:N``), counted in ``directory``; the
    session to kill (``DATASPACE_SPARK_FAULT_SID``) is the child's to set."""
    return {HOOK_ENV: HOOK, ENV: fault, f"{ENV}_DIR": directory}


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
    """The hook: kills the session when the environment asks for it here now."""
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
