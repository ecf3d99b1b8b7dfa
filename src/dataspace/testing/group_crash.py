"""The consumer group crash test: workers killed with ``kill -9`` lose no entry, and --
with their acknowledgements in the transaction of their results -- write none twice.

A stream ``jobs`` gets entries ``<job N>`` appended all along; worker processes (each a
consumer of the group ``workers``, ``python -m dataspace.testing.group_crash worker``)
read batches, and either

* ``--mode tx``: append ``<done N>`` to ``results`` and acknowledge the batch in one
  transaction (exactly once), or
* ``--mode plain``: acknowledge after "handling" (at least once).

At random moments a random worker is killed with SIGKILL; it is started again under its
name -- at once (it gets its own pending entries back first), or after longer than the
group's idle timeout (the others claim them meanwhile).  Each worker logs each delivery
(index, deliveries, when) to a file of its own before handling it.  At the end, once the
appends stop and every entry is acknowledged, the harness checks:

* every entry appended was acknowledged (the group's position is the stream's end and
  nothing is pending);
* ``tx``: ``results`` holds each entry's result exactly once;
* every redelivery followed a crash of the consumer that had it, or its idle timeout:
  the delivery before it was made by a process that was killed, or at least the idle
  timeout earlier;
* ``stream info --check`` (the store's check) is clean.

::

    python -m dataspace.testing.group_crash --kills 200              # make soak-groups
    python -m dataspace.testing.group_crash --kills 200 --postgres   # ... on PostgreSQL
    python -m dataspace.testing.group_crash --kills 6 --mode plain   # what the suite runs

Exit status 0 when every check held, 1 otherwise (the first problems are printed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..cli._voice import plural
from ..streams import open_store
from ..streams.base import AckLost
from ..values import Record, Symbol
from .common import say

__all__ = ["GroupCrashResult", "main", "run"]

STREAM = "jobs"
GROUP = "workers"
RESULTS = "results"
_JOB = Symbol("job")
_DONE = Symbol("done")


@dataclass
class GroupCrashResult:
    """What a run did and found."""

    kills: int = 0
    appended: int = 0
    deliveries: int = 0
    redeliveries: int = 0
    after_crash: int = 0
    after_timeout: int = 0
    problems: list[str] = field(default_factory=list)


# -- a worker (a process of its own) ----------------------------------------------------------


def worker(url: str, name: str, mode: str, log_path: str, batch: int) -> int:
    """Consume as ``name`` until SIGTERM, logging each delivery before handling it."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_a: stop.set())
    pid = os.getpid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"L {pid} {name}\n".encode())
    with open_store(url) as store:
        c = store.group(STREAM, GROUP, create=False).consumer(name)
        while not stop.is_set():
            got = c.read(batch, block=0.2)
            if not got:
                continue
            os.write(fd, "".join(f"D {d.index} {d.deliveries} {d.delivered_ns} {pid}\n"
                                 for d in got).encode())
            if mode == "tx":
                try:
                    with store.transaction() as t:
                        for d in got:
                            t.append(RESULTS, Record(_DONE, [d.index]))
                        t.ack(got)
                except AckLost:
                    os.write(fd, f"X {pid}\n".encode())  # another consumer has them now
                    continue
            else:
                c.ack(got)
            os.write(fd, "".join(f"A {d.index} {pid}\n" for d in got).encode())
    os.close(fd)
    return 0


# -- the harness ----------------------------------------------------------------------------


class _Workers:
    """The worker processes, by name; started again after a kill."""

    def __init__(self, url: str, mode: str, base: Path, batch: int) -> None:
        self.url = url
        self.mode = mode
        self.base = base
        self.batch = batch
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: dict[int, int] = {}  # pid -> when it was killed (ns)

    def start(self, name: str) -> None:
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "dataspace.testing.group_crash", "worker", "--store-url",
             self.url, "--name", name, "--mode", self.mode, "--log",
             str(self.base / f"{name}.log"), "--batch", str(self.batch)],
            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def kill(self, name: str) -> None:
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            self.killed[p.pid] = time.time_ns()
        p.wait(30)

    def died(self) -> list[str]:
        """Workers that ended on their own (a failure: their error)."""
        out = []
        for name, p in self.procs.items():
            if p.poll() is not None and p.pid not in self.killed:
                err = (p.stderr.read() if p.stderr else b"").decode(errors="replace").strip()
                out.append(f"worker {name} exited ({p.returncode}): {err.splitlines()[-1] if err else ''}")
        return out

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)


def run(url: str, kills: int, *, consumers: int = 3, mode: str = "tx", idle: float = 1.0,
        seed: int = 0, base: Path | None = None, batch: int = 10,
        say: Callable[[str], None] = lambda s: None) -> GroupCrashResult:
    """One run against the store at ``url`` (empty of ``jobs``, ``results``): ``kills``
    SIGKILLs of ``consumers`` workers while entries are appended; then the checks."""
    rng = random.Random(seed)
    result = GroupCrashResult()
    own = base is None
    base = Path(tempfile.mkdtemp(prefix="dataspace-groupcrash-")) if base is None else base
    base.mkdir(parents=True, exist_ok=True)
    store = open_store(url)
    store.create_group(STREAM, GROUP, idle_timeout=idle)
    store.create_stream(RESULTS)
    workers = _Workers(url, mode, base, batch)
    names = [f"w{k}" for k in range(consumers)]
    for n in names:
        workers.start(n)
    appending = threading.Event()
    appending.set()
    appended = [0]

    def appender() -> None:
        with open_store(url) as s:
            while appending.is_set():
                k = rng.randint(1, 8)
                s.append_many(STREAM, [Record(_JOB, [appended[0] + i]) for i in range(k)])
                appended[0] += k
                time.sleep(0.005)  # pacing of the load, not synchronisation

    t = threading.Thread(target=appender, daemon=True)
    t.start()
    try:
        for k in range(kills):
            time.sleep(rng.uniform(0.05, 0.4))  # a random moment (pacing, not a wait)
            name = rng.choice(names)
            workers.kill(name)
            result.kills += 1
            if rng.random() < 0.3:
                time.sleep(idle * 1.5)  # the others claim its entries meanwhile
            workers.start(name)
            if (k + 1) % 20 == 0:
                say(f"{plural(k + 1, 'kill')}, {plural(appended[0], 'entry', 'entries')} appended")
            dead = workers.died()
            if dead:
                result.problems += dead
                break
        appending.clear()
        t.join(30)
        result.appended = appended[0]
        # Every entry acknowledged, in bounded time.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            info = store.group_info(STREAM, GROUP)
            if info.next == result.appended and info.pending == 0:
                break
            if workers.died():
                break
            store.wait_change(store.generation(), 0.5)
        else:
            info = store.group_info(STREAM, GROUP)
        result.problems += workers.died()
        if info.next != result.appended or info.pending:
            result.problems.append(f"{result.appended:,} entries appended, but the group is at "
                                   f"{info.next:,} with {info.pending} pending after 120 s")
    finally:
        appending.clear()
        workers.stop()
    _check(store, base, names, workers.killed, mode, idle, batch, result)
    result.problems += store.check()
    store.close()
    if own and not result.problems:
        shutil.rmtree(base, ignore_errors=True)
    return result


def _check(store: object, base: Path, names: list[str], killed: dict[int, int], mode: str,
           idle: float, batch: int, result: GroupCrashResult) -> None:
    deliveries: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)  # idx -> n -> (t, pid)
    for name in names:
        path = base / f"{name}.log"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            f = line.split()
            if f and f[0] == "D" and len(f) == 5:
                i, n, t, pid = (int(x) for x in f[1:])
                if n in deliveries[i]:
                    result.problems.append(f"entry {i} delivered as delivery {n} twice")
                deliveries[i][n] = (t, pid)
                result.deliveries += 1
    unexplained = 0
    for i, ds in deliveries.items():
        for n, (t, _pid) in ds.items():
            if n == 1:
                continue
            result.redeliveries += 1
            before = ds.get(n - 1)
            if before is None:  # its process died before it logged it: a crash
                unexplained += 1
                continue
            t0, pid0 = before
            if pid0 in killed and killed[pid0] >= t0:
                result.after_crash += 1
            elif t - t0 >= idle * 1e9 * 0.999:
                result.after_timeout += 1
            else:
                result.problems.append(
                    f"entry {i} delivered again (delivery {n}) {(t - t0) / 1e9:.3f} s after "
                    f"delivery {n - 1} to pid {pid0}, which was not killed: neither a crash nor "
                    f"the idle timeout ({idle} s)")
    # A worker killed after its read committed and before it logged the read loses the
    # log lines of the whole batch: each kill explains up to ``batch`` of these.
    if unexplained > len(killed) * batch:
        result.problems.append(f"{unexplained} redeliveries whose earlier delivery no log has, "
                               f"more than the {plural(len(killed), 'kill')} can explain "
                               f"(reads of {batch})")
    result.after_crash += unexplained
    missing = [i for i in range(result.appended) if i not in deliveries]
    if missing and len(missing) > len(killed) * batch:
        result.problems.append(f"{len(missing)} entries never logged as delivered")
    if mode == "tx":
        got = Counter(e.value.fields[0] for e in store.iter_entries(RESULTS))  # type: ignore[attr-defined]
        twice = sorted(i for i, n in got.items() if n > 1)
        lost = sorted(set(range(result.appended)) - set(got))
        if twice:
            result.problems.append(f"{len(twice)} results written more than once (the first: "
                                   f"entry {twice[0]})")
        if lost:
            result.problems.append(f"{len(lost)} entries have no result (the first: {lost[0]})")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        wp = argparse.ArgumentParser(prog="python -m dataspace.testing.group_crash worker")
        wp.add_argument("--store-url", required=True)
        wp.add_argument("--name", required=True)
        wp.add_argument("--mode", choices=("tx", "plain"), required=True)
        wp.add_argument("--log", required=True)
        wp.add_argument("--batch", type=int, default=10)
        a = wp.parse_args(argv[1:])
        return worker(a.store_url, a.name, a.mode, a.log, a.batch)
    ap = argparse.ArgumentParser(
        prog="python -m dataspace.testing.group_crash",
        description="Kill consumers of a consumer group with SIGKILL at random moments\n"
        "while entries are appended; check that every entry is acknowledged, each\n"
        "result written once (--mode tx: results and acknowledgement in one\n"
        "transaction), and every redelivery followed a crash or the idle timeout.",
        epilog="examples:\n  python -m dataspace.testing.group_crash --kills 200\n"
        "  python -m dataspace.testing.group_crash --kills 50 --postgres --mode plain",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=200, help="how many kills (default 200)")
    ap.add_argument("--consumers", type=int, default=4, help="worker processes (default 4)")
    ap.add_argument("--mode", choices=("tx", "plain", "both"), default="both",
                    help="acknowledgements in the results' transaction (tx), plain, or a run "
                    "of each (both, the default)")
    ap.add_argument("--idle", type=float, default=1.0,
                    help="the group's idle timeout in seconds (default 1)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    ap.add_argument("--store", metavar="URL",
                    help="an empty store to use (default: a SQLite store in a temporary "
                    "directory)")
    ap.add_argument("--postgres", action="store_true",
                    help="start a throwaway PostgreSQL server and use a database of it")
    args = ap.parse_args(argv)
    if args.postgres and args.store:
        ap.error("give --store URL or --postgres, not both")
    if args.kills < 1 or args.consumers < 1 or args.idle <= 0:
        ap.error("--kills and --consumers must be at least 1, --idle above 0")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    modes = ("tx", "plain") if args.mode == "both" else (args.mode,)
    failed = False
    with contextlib.ExitStack() as stack:
        pg = None
        if args.postgres:
            from ..streams.pgserver import TempPostgres

            pg = stack.enter_context(TempPostgres())
            say(f"PostgreSQL on {pg.url().split('@')[-1]}")
        for k, mode in enumerate(modes):
            if args.store and len(modes) > 1:
                ap.error("--store takes one --mode (an empty store per run)")
            base = Path(tempfile.mkdtemp(prefix="dataspace-groupcrash-"))
            url = args.store or (pg.create_database(f"groupcrash{k}") if pg else str(base / "data"))
            say(f"consumer group crash test: {plural(args.consumers, 'consumer')}, {plural(args.kills, 'kill')}, "
                f"acknowledgements {'in the results transaction' if mode == 'tx' else 'plain'}, "
                f"idle timeout {args.idle:g} s, seed {seed}")
            try:
                r = run(url, args.kills, consumers=args.consumers, mode=mode, idle=args.idle,
                        seed=seed, base=base, say=say)
            except KeyboardInterrupt:
                say(f"interrupted (logs kept in {base})")
                return 130
            for p in r.problems[:10]:
                say(f"PROBLEM: {p}")
            if r.problems:
                failed = True
                say(f"FAILED after {plural(r.kills, 'kill')} (seed {seed}; logs kept in {base})")
                continue
            shutil.rmtree(base, ignore_errors=True)
            once = "each result written exactly once" if mode == "tx" else "each at least once"
            say(f"PASSED: {plural(r.kills, 'kill')}, {plural(r.appended, 'entry', 'entries')} acknowledged, {once}; "
                f"{plural(r.redeliveries, 'redelivery', 'redeliveries')} of "
                f"{plural(r.deliveries, 'delivery', 'deliveries')}, "
                f"{r.after_crash:,} after a crash and {r.after_timeout:,} after the idle "
                "timeout, none otherwise")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
