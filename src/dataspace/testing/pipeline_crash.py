"""The crash harness of the local engine: a graph killed with SIGKILL at random moments
must still deliver everything exactly once.

The graph and its data are :mod:`.pipeline_common`'s (join -> fork -> SQLite sink, plus
alts; errors to the graph's error stream).  A *child* process produces ``N`` seeded
messages into each of the three sources while its engine processes them.  The *parent*
starts the child, kills it with SIGKILL at a random moment -- during start-up/recovery,
or after a random number of committed groups plus a random delay, so kills land inside
steps, inside commits, inside the sink's transaction -- restarts it, and repeats.  After
the last kill it lets a child run to the end and checks that the sources, ``pairs``,
``merged``, the error stream and the sink's table hold exactly the expected multisets: no
duplicate, no loss, errors counted as delivered.

``--kills K`` runs campaigns of ``--campaign-kills`` kills each (a fresh store and seed
per campaign) until K kills are done::

    python -m dataspace.testing.pipeline_crash --kills 1000        # the soak (make soak)
    python -m dataspace.testing.pipeline_crash --kills 50            # what CI runs
    python -m dataspace.testing.pipeline_crash --kills 200 --store postgresql://u:pw@host/postgres

The store is the campaign directory's SQLite store, or with ``--store`` a PostgreSQL
database per campaign, created (and dropped after a pass) on the server of that URL (its
user needs the CREATEDB privilege).  The children get the store's URL in the environment
(``DATASPACE_CRASH_STORE``), not on their command line.

The test suite (tests/test_crash.py) calls :func:`soak` from this module.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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

__all__ = ["STORE_ENV", "CampaignResult", "child", "main", "run_campaign", "soak", "verify"]


# -- the child ---------------------------------------------------------------------------


def child(directory: str, n: int, seed: int, run: int, batch: int) -> int:
    """One run of the graph: produce and process until everything is done."""
    from ..pipeline.local import LocalEngine
    from ..streams import open_store

    store = open_store(location(directory))
    engine = LocalEngine(build_graph(directory), store, batch=batch, group_ms=5)
    return drive(engine, store, directory, n, seed, run,
                 lambda _stats: line(f"commit {engine.commits}"), 0.0)


# -- the parent --------------------------------------------------------------------------


@dataclass
class CampaignResult(Campaign):
    """A campaign of the local engine: also how many kills hit start-up or recovery, and
    how many commits the children reported."""

    kills_before_ready: int = 0
    commits_seen: int = 0

    def landed(self) -> str:
        return f" ({self.kills_before_ready} during start-up/recovery)"


def _spawn(directory: str, n: int, seed: int, run: int, batch: int, store: str | None = None,
           ) -> tuple[subprocess.Popen[str], queue.Queue[str | None]]:
    env = None if store is None else {**os.environ, STORE_ENV: store}
    return spawn_child("dataspace.testing.pipeline_crash", directory, n, seed, run, batch, env=env)


def _kill_after(proc: subprocess.Popen[str], seconds: float, timeout: float) -> bool:
    """Kill the child with SIGKILL ``seconds`` from now unless it has ended by then;
    whether it was killed."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout)
    return True


def run_campaign(
    directory: str,
    *,
    kills: int,
    messages: int,
    seed: int,
    batch: int = 50,
    max_commits: int = 6,
    timeout: float = 120.0,
    say: Callable[[str], None] | None = None,
    store: str | None = None,
) -> CampaignResult:
    """Kill a child ``kills`` times at random moments, then let one finish and verify.
    ``store``: the store's URL (default: the directory's SQLite store)."""
    rng = random.Random(f"{seed}:kills")
    res = CampaignResult(directory, messages, seed)
    t0 = time.monotonic()
    finished = False
    while not finished:
        kill_now = res.kills < kills
        proc, lines = _spawn(directory, messages, seed, res.runs, batch, store)
        res.runs += 1
        try:
            if kill_now and rng.random() < 0.1:
                # Kill during start-up or recovery, at a random moment.
                if _kill_after(proc, rng.uniform(0.05, 0.4), timeout):
                    res.kills += 1
                    res.kills_before_ready += 1
                    continue
            target = rng.randint(0, max_commits) if kill_now else None
            commits = 0
            deadline = time.monotonic() + timeout
            while True:
                try:
                    said = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    proc.kill()
                    res.problems.append(f"run {res.runs}: no progress for {timeout}s: {child_stderr(proc)}")
                    return res
                if said is None:  # the child exited
                    rc = proc.wait(timeout)
                    if rc == 0:  # it finished everything (before a planned kill, maybe)
                        finished = True
                        break
                    res.problems.append(f"run {res.runs}: child exited with {rc}: {child_stderr(proc)}")
                    return res
                if said.startswith("failed"):
                    res.problems.append(f"run {res.runs}: {said}")
                if target is None:
                    continue
                if said.startswith("commit"):
                    commits += 1
                    res.commits_seen += 1
                if (said == "ready" and target == 0) or (
                        said.startswith("commit") and commits >= target):
                    # A random moment a little later: inside a step or a commit.
                    if _kill_after(proc, rng.uniform(0.0, 0.02), timeout):
                        res.kills += 1
                    break
            if say is not None and kill_now:
                say(f"  kill {res.kills}/{kills} after {commits} commits")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout)
    res.problems += verify(directory, messages, seed, store)
    res.seconds = time.monotonic() - t0
    return res


def soak(
    kills: int,
    *,
    base: str,
    seed: int,
    campaign_kills: int = 50,
    messages: int | None = None,
    say: Callable[[str], None] | None = None,
    stores: Callable[[int], str] | None = None,
    drop: Callable[[int], None] | None = None,
) -> tuple[int, list[Any]]:
    """Campaigns of ``campaign_kills`` kills (fresh store and seed each) until ``kills``
    kills are done or a campaign finds a problem; returns (kills done, results).
    ``stores(campaign)`` gives each campaign's store URL (default: an SQLite store in the
    campaign's directory) and ``drop(campaign)`` removes it after a pass."""
    return campaigns(kills, base=base, seed=seed, campaign_kills=campaign_kills,
                     messages=lambda k: messages or max(2000, 600 * k),
                     run=run_campaign, say=say, stores=stores, drop=drop)


EXAMPLES = """\
examples:
  the soak (make soak), and the run of the tests:
    python -m dataspace.testing.pipeline_crash --kills 1000
    python -m dataspace.testing.pipeline_crash --kills 50 --seed 7
  on PostgreSQL (a database per campaign: the user needs CREATEDB):
    python -m dataspace.testing.pipeline_crash --store postgresql://db/postgres
"""


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    return harness_main(
        argv, prog="python -m dataspace.testing.pipeline_crash",
        description="SIGKILL crash test of the exactly-once engine: kill a running graph at "
        "random moments, restart it, and check the outputs hold exactly the expected "
        "multisets.",
        child=child, soak=soak, kills=1000, campaign_kills=50, batch=50,
        messages_help="600 per kill", tmp_prefix="dataspace-crash-", what="SIGKILLs",
        examples=EXAMPLES, store_option=True)


if __name__ == "__main__":
    sys.exit(main())
