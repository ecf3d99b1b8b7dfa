"""The SIGKILL crash harness for the Spark engine: a graph killed at chosen and random
points must still deliver everything exactly once.

The graph and the data are the local harness's (:mod:`.pipeline_common`):
``join -> fork -> SQLite sink (idempotent by the delivery hash) + alts``, with errors
going to the error stream, N seeded messages per source produced while the graph runs.
A *child* process runs the graph on the Spark engine (``local[2]``: the Python driver,
the JVM with its executors, Spark's Python workers); the *parent* kills the whole driver
-- every process of the child's session, with SIGKILL -- and restarts it, again and
again, then lets a last run finish and checks that the sources, ``pairs``, ``merged``,
the error stream and the sink's table hold exactly the expected multisets.

Kill points (:mod:`dataspace.pipeline.spark.faultpoints`, armed by :mod:`.spark_faults`;
the N-th time any process of the run gets there):

=================  ==========================================================
``source``         the stream reader's ``latestOffset`` (driver)
``partitions``     planning a batch, after Spark logged its offsets (driver)
``read``           a partition being read (executor)
``stage``          a read task has staged its outputs, not yet committed (executor)
``write``          a write task, rows in hand (executor)
``sink``           a side-effecting function has run, our commit not yet (driver)
``commit-inside``  our commit's writes done, not committed (driver)
``commit-after``   our commit durable, Spark's commit log not yet written (driver)
``random``         a random moment after the driver reported ready (parent kills)
``startup``        a random moment while Spark starts (parent kills)
=================  ==========================================================

::

    python -m dataspace.testing.spark_crash --kills 10     # what CI runs (~2 min)
    python -m dataspace.testing.spark_crash --kills 200    # the soak (make soak-spark)

The test suite (tests/test_spark_crash.py) calls :func:`run_campaign`.

Every run starts a JVM, so a campaign first makes the JVM's class-data archive
(:mod:`dataspace.pipeline.spark.warmup`, once per machine), and the children's JVMs run the JIT's first tier
only (``-XX:TieredStopAtLevel=1`` in ``SPARK_SUBMIT_OPTS``): a JVM that lives seconds
gains nothing from the optimising compiler, whose threads took the cores from Spark's
start-up (a start 30% faster on 2 cores).

**On a cluster** (``master="spark://..."``, a PostgreSQL ``store``): the driver is killed
as above; the executor points ``read``, ``stage`` and ``write`` kill the *worker's* session instead
-- the Worker, its executor and the executor's Python workers -- in the middle of a
batch, while the driver lives on: Spark runs the batch's tasks again on the executor of
the Worker that replaces it (``worker_sid`` names the session to kill; the fault
counters must be in ``fault_base``, a directory the worker sees too).
"""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..cli._voice import plural
from ..pipeline.spark import warmup
from ..pipeline.spark.classdata import QUICK_JIT
from ..pipeline.spark.reaper import kill_session, reap_session
from .pipeline_common import (
    STORE_ENV,
    Campaign,
    build_graph,
    campaigns,
    child_stderr,
    drive,
    harness_main,
    line,
    location,
    spawn_child,
    verify,
)
from .spark_faults import ENV, HOOK, HOOK_ENV, POINTS, environment

__all__ = ["CHOSEN", "EXECUTOR_POINTS", "CampaignResult", "child", "main", "run_campaign", "soak"]

CHOSEN = POINTS
"""The chosen kill points (see the module docstring)."""

EXECUTOR_POINTS = ("read", "stage", "write")
"""The points reached on executors: on a cluster they kill the worker, not the driver."""

MASTER_ENV = "DATASPACE_CRASH_MASTER"
CONF_ENV = "DATASPACE_CRASH_SPARK_CONF"
EXECUTOR_SID_ENV = f"{ENV}_EXECUTOR_SID"


# -- the child -------------------------------------------------------------------------------


def child(directory: str, n: int, seed: int, run: int, batch: int) -> int:
    """One run of the graph on Spark: produce and process until everything is done."""
    from ..pipeline.spark.engine import SparkEngine
    from ..streams import open_store

    os.environ[f"{ENV}_SID"] = str(os.getsid(0))  # the fault points may kill this session
    conf = json.loads(os.environ.get(CONF_ENV) or "{}")
    if os.environ.get(ENV) and os.environ.get(EXECUTOR_SID_ENV):
        # A cluster's executors inherit the worker's environment, not ours: the fault goes
        # to them as the application's executorEnv, naming the worker's session to kill.
        for k, v in ((HOOK_ENV, HOOK), (ENV, os.environ[ENV]),
                     (f"{ENV}_DIR", os.environ.get(f"{ENV}_DIR", "")),
                     (f"{ENV}_SID", os.environ[EXECUTOR_SID_ENV])):
            conf[f"spark.executorEnv.{k}"] = v
    store = open_store(location(directory))
    engine = SparkEngine(build_graph(directory), store, master=os.environ.get(MASTER_ENV) or "local[2]",
                         batch=batch, partition_rows=max(1, batch // 2), wait_ms=50, conf=conf,
                         data_dir=directory, log_file=os.path.join(directory, "spark.log"))
    return drive(engine, store, directory, n, seed, run,
                 lambda stats: line(f"progress {sum(s.steps for s in stats)}"), 0.5)


# -- the parent ------------------------------------------------------------------------------


@dataclass
class CampaignResult(Campaign):
    """A campaign of the Spark engine: also the kills per point."""

    points: dict[str, int] = field(default_factory=dict)

    def landed(self) -> str:
        return f" {self.points}"


def _spawn(directory: str, n: int, seed: int, run: int, batch: int, fault: str | None,
           fault_dir: str, extra_env: dict[str, str] | None = None,
           ) -> tuple[subprocess.Popen[str], queue.Queue[str | None]]:
    env = dict(os.environ)
    env.pop(ENV, None)
    env.pop(HOOK_ENV, None)
    # A child's JVM lives seconds (it is killed): the JIT's first tier only, whose compiler
    # threads leave the cores to Spark's start-up (30% faster starts on 2 cores).
    if "TieredStopAtLevel" not in env.get("SPARK_SUBMIT_OPTS", ""):
        env["SPARK_SUBMIT_OPTS"] = f"{env.get('SPARK_SUBMIT_OPTS', '')} {QUICK_JIT}".strip()
    env.update(extra_env or {})
    if fault:
        env.update(environment(fault, fault_dir))
    return spawn_child("dataspace.testing.spark_crash", directory, n, seed, run, batch,
                       env=env, new_session=True)


def run_campaign(
    directory: str,
    *,
    kills: int,
    messages: int,
    seed: int,
    batch: int = 40,
    plan: list[str] | None = None,
    max_nth: int = 1,
    timeout: float = 240.0,
    say: Callable[[str], None] | None = None,
    store: str | None = None,
    master: str | None = None,
    conf: dict[str, str] | None = None,
    worker_sid: Callable[[], int] | None = None,
    fault_base: str | None = None,
) -> CampaignResult:
    """Kill the child ``kills`` times -- at the points of ``plan`` in order (default: each
    chosen point once, then random moments), the first to ``max_nth``-th time a run
    gets there -- then let one run finish and verify.

    ``store`` (a URL; default the directory's SQLite store), ``master`` and ``conf``
    are the child's; with ``worker_sid`` (the current Spark worker's session) the
    executor points kill the worker instead of the driver (see the module docstring)."""
    warmup.ensure(say=say)  # every restart starts a JVM: each maps the class-data archive
    rng = random.Random(f"{seed}:spark-kills")
    extra_env = {STORE_ENV: store} if store else {}
    if master:
        extra_env[MASTER_ENV] = master
    if conf:
        extra_env[CONF_ENV] = json.dumps(conf)
    plan = list(plan) if plan is not None else [*CHOSEN, "startup", "random", "random"]
    res = CampaignResult(directory, messages, seed)
    t0 = time.monotonic()
    attempts = 0
    while True:
        kill_now = res.kills < kills
        point = plan[res.kills % len(plan)] if kill_now else None
        fault = None
        if point in CHOSEN:
            fault = f"{point}:{rng.randint(1, max_nth)}"
        fault_dir = tempfile.mkdtemp(prefix="faults-", dir=fault_base or directory)
        remote = worker_sid is not None and point in EXECUTOR_POINTS
        env = dict(extra_env)
        if remote:
            assert worker_sid is not None
            env[EXECUTOR_SID_ENV] = str(worker_sid())
        proc, lines = _spawn(directory, messages, seed, res.runs, batch, fault, fault_dir, env)
        res.runs += 1
        attempts += 1
        killed = finished = False
        try:
            deadline = time.monotonic() + timeout
            if point == "startup":
                try:
                    proc.wait(timeout=rng.uniform(0.2, 4.0))
                except subprocess.TimeoutExpired:
                    kill_session(proc.pid)
                    killed = True
            ready_at: float | None = None
            while not killed:
                if ready_at is not None and time.monotonic() >= ready_at:
                    kill_session(proc.pid)  # a random moment of a running driver
                    killed = True
                    break
                wait = deadline - time.monotonic()
                if ready_at is not None:
                    wait = min(wait, ready_at - time.monotonic())
                try:
                    said = lines.get(timeout=max(0.0, wait))
                except queue.Empty:
                    if ready_at is not None:
                        continue
                    res.problems.append(f"run {res.runs}: no progress for {timeout}s: {child_stderr(proc)}")
                    break
                if said is None:  # the child ended: killed by a fault point, or finished
                    rc = proc.wait(timeout)
                    if rc == 0:
                        finished = True
                    elif rc == -9 and fault:
                        killed = True
                    else:
                        res.problems.append(f"run {res.runs}: child exited with {rc}: {child_stderr(proc)}")
                    break
                if said.startswith("failed"):
                    res.problems.append(f"run {res.runs}: {said}")
                if said == "ready" and point == "random":
                    ready_at = time.monotonic() + rng.uniform(0.5, 8.0)
        finally:
            if not reap_session(proc, 60.0):
                res.problems.append(f"run {res.runs}: processes of the killed driver would not die")
        if remote and fault and _fired(fault_dir, fault):
            killed = True  # the worker with its executor, mid-batch; the driver carried on
        if killed:
            res.kills += 1
            res.points[point or "?"] = res.points.get(point or "?", 0) + 1
            if say:
                say(f"  kill {res.kills}/{kills} at {fault or point} (run {res.runs}, "
                    f"{time.monotonic() - t0:.0f}s)")
        if res.problems or finished:
            break
        if not killed and not kill_now:
            break
        if attempts > 3 * kills + 5:
            res.problems.append("too many runs without the planned kills")
            break
    if not res.problems:
        if res.kills < kills:
            res.problems.append(f"the work finished after {res.kills} of {plural(kills, 'kill')}: use more "
                                "--messages")
        res.problems += verify(directory, messages, seed, store)
    res.seconds = time.monotonic() - t0
    return res


def _fired(fault_dir: str, fault: str) -> bool:
    """Whether the fault ``POINT:N`` was reached N times (its counter file)."""
    name, _, n = fault.partition(":")
    try:
        with open(os.path.join(fault_dir, f"{name}.count"), encoding="ascii") as f:
            return int(f.read().strip() or 0) >= int(n or 1)
    except (OSError, ValueError):
        return False


def soak(kills: int, *, base: str, seed: int, campaign_kills: int = 20,
         messages: int | None = None, say: Callable[[str], None] | None = None,
         ) -> tuple[int, list[Any]]:
    """Campaigns of ``campaign_kills`` kills (a fresh store and seed each) until ``kills``
    kills are done or a campaign finds a problem."""
    def run(directory: str, *, kills: int, messages: int, seed: int, store: str | None,
            ) -> CampaignResult:
        return run_campaign(directory, kills=kills, messages=messages, seed=seed,
                            max_nth=3, say=say, store=store)

    return campaigns(kills, base=base, seed=seed, campaign_kills=campaign_kills,
                     messages=lambda k: messages or max(600, 150 * k), run=run, say=say)


EXAMPLES = """\
examples:
  the run of the tests (2 minutes), and the soak (make soak-spark, an hour):
    python -m dataspace.testing.spark_crash --kills 10
    python -m dataspace.testing.spark_crash --kills 200
  a seed, and the stores kept in a directory:
    python -m dataspace.testing.spark_crash --kills 20 --seed 7 --dir /tmp/crash
"""


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    return harness_main(
        argv, prog="python -m dataspace.testing.spark_crash",
        description="SIGKILL crash test of the Spark engine: kill the driver (Python, JVM, "
        "workers) at chosen and random points, restart, and check every output is there "
        "exactly once.",
        child=child, soak=soak, kills=200, campaign_kills=20, batch=40,
        messages_help="150 per kill, at least 600", tmp_prefix="dataspace-spark-crash-",
        what="SIGKILLs of the Spark driver", examples=EXAMPLES)


if __name__ == "__main__":
    sys.exit(main())
