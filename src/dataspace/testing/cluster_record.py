"""The cluster recording crash test: acknowledged means durable, on any member.

Three ``dataspace serve`` members of one cluster record into one store (an SQLite file
they share, or ``--store postgresql://...``) what their dataspace sees::

    --record 'chat:<Says $who $n>' --record 'presence,events=all:<Present $who>'

Clients, each given every member's address, hold ``<Present "cK">`` and send numbered
messages ``<Says "cK" N>`` in batches, with a ``sync()`` after each batch; a batch is
*acknowledged* when its sync returned on the connection that sent it.  Meanwhile a
member is killed with SIGKILL at random moments and restarted on the same ports (its
clients fail over to the others and back).  After each kill the harness reads the stream:

* every acknowledged message is in it **exactly once**, and no message is in it twice
  (a message sent but not acknowledged may be missing);

and at the end, once the clients have left and the members have settled:

* each ``<Present "cK">`` has its events once: ``<assert>`` and ``<retract>`` alternate,
  starting with an assert, and none is left present.

It also measures the time from a member's death to the next acknowledged batch of each
of its clients on another member (failover).  ::

    python -m dataspace.testing.cluster_record --kills 200          # make soak-cluster-record
    python -m dataspace.testing.cluster_record --kills 5 --store postgresql://.../db

Exit status 0 when every check held, 1 otherwise (the first problems are printed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cli._voice import plural
from ..client import RemoteDataspace, connect
from ..datadir import KEY_BYTES
from ..progress import Progress
from ..protocol.sturdy import SturdyRef
from ..streams import open_store
from ..values import Record, Symbol, parse
from .common import (
    CrashResult,
    ServerProcess,
    free_port,
    once_problems,
    report,
    say,
    write_root_key,
    write_secret,
)

__all__ = ["ClusterCrashResult", "main", "run"]

CHAT = "chat"
PRESENCE = "presence"
SPECS = (f"{CHAT}:<Says $who $n>", f"{PRESENCE},events=all:<Present $who>")
_SAYS = Symbol("Says")
_PRESENT = Symbol("Present")
START_TIMEOUT = 60.0


@dataclass
class ClusterCrashResult(CrashResult):
    """What a run did and found."""

    batches: int = 0
    failovers: list[float] = field(default_factory=list)
    """Seconds from a member's death to each of its clients' next acknowledged batch."""
    sync_latencies: list[float] = field(default_factory=list)


class Member(ServerProcess):
    """One member in a subprocess (restartable on the same ports); its output goes to
    files, read for its start lines only (a member says more: routes going up and down)."""

    def __init__(self, base: Path, i: int, routes: list[str], secret: Path, key: bytes,
                 config: Path | None, specs: tuple[str, ...] = SPECS,
                 extra: tuple[str, ...] = (), cluster: bool = True) -> None:
        self.dir = base / f"m{i}"
        write_root_key(self.dir, key)
        self.port = free_port()
        self.cluster_port = free_port()
        self.routes = routes
        self.secret = secret
        self.config = config
        self.specs = specs
        self.extra = extra
        self.cluster = cluster
        """False: a server alone (no cluster options), for comparisons."""
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def cluster_address(self) -> str:
        return f"127.0.0.1:{self.cluster_port}"

    async def start(self) -> None:
        args = [sys.executable, "-m", "dataspace.cli", "serve", "--data-dir", str(self.dir),
                "--tcp", self.address, *self.extra]
        if self.cluster:
            args += ["--cluster", self.cluster_address, "--routes", ",".join(self.routes),
                     "--cluster-secret", str(self.secret)]
        for s in self.specs:
            args += ["--record", s]
        if self.config is not None:
            args += ["--config", str(self.config)]
        self.starts += 1
        err = self.dir / f"serve.{self.starts}.err"
        with open(self.dir / "serve.out", "wb") as out, open(err, "wb") as e:
            self.proc = await asyncio.create_subprocess_exec(
                *args, stdout=out, stderr=e, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # its start lines, in the file (bounded)
            text = err.read_text(errors="replace")
            if "Ctrl-C stops the server" in text:
                return
            if self.proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"member {self.dir.name} did not start: {text.strip()[-600:]}")
            await asyncio.sleep(0.05)


def start_cluster(base: Path, n: int, store: str | None,
                  specs: tuple[str, ...] = SPECS, cluster: bool = True) -> list[Member]:
    """``n`` members (not started): one secret and root key, every member given every
    member's cluster address (itself included), one store.  ``cluster=False``: ``n``
    lone servers (one, to compare with)."""
    base.mkdir(parents=True, exist_ok=True)
    secret = write_secret(base / "cluster.secret")
    key = os.urandom(KEY_BYTES)
    # The store's URL (maybe with a password) goes in a configuration file.
    config = base / "store.pr"
    config.write_text(f"{{store: {json.dumps(store or str(base / 'store'))}}}")
    config.chmod(0o600)
    ms = [Member(base, i, [], secret, key, config, specs, cluster=cluster) for i in range(n)]
    for m in ms:
        m.routes = [x.cluster_address for x in ms]
    return ms


def read_stream(store: str, stream: str) -> list[Any]:
    s = open_store(store, create=False)
    try:
        if not s.has_stream(stream):
            return []
        return list(s.iter_entries(stream))
    finally:
        s.close()


def chat_counts(entries: list[Any]) -> Counter[tuple[str, int]]:
    out: Counter[tuple[str, int]] = Counter()
    for e in entries:
        v = e.value
        if type(v) is Record and v.label == _SAYS and len(v.fields) == 2:
            out[(str(v.fields[0]), v.fields[1])] += 1  # type: ignore[index]
    return out


def presence_problems(entries: list[Any], want: set[str]) -> list[str]:
    """Each value's events alternate from an assert; those of ``want`` end present and
    the others absent."""
    events: dict[str, list[str]] = {}
    for e in entries:
        v = e.value
        if type(v) is Record and v.label.name in ("assert", "retract") and v.fields:
            events.setdefault(str(v.fields[0]), []).append(v.label.name)
    out = []
    for value, evs in events.items():
        for i, ev in enumerate(evs):
            if ev != ("assert" if i % 2 == 0 else "retract"):
                out.append(f"{value}: events {' '.join(evs[max(0, i - 3):i + 2])} "
                           f"(event {i + 1} of {len(evs)}): twice in a row")
                break
        present = len(evs) % 2 == 1
        name = value.split('"')[1] if '"' in value else value
        if present != (name in want):
            out.append(f"{value}: {'present' if present else 'absent'} at the end "
                       f"({plural(len(evs), 'event')})")
    return out


class Sender:
    """A client with every member's address: holds <Present NAME>, sends numbered
    batches with a sync after each."""

    def __init__(self, name: str, addresses: list[str], cap: SturdyRef, batch: int,
                 limit: int | None = None) -> None:
        self.name = name
        self.limit = limit
        """Stop sending after this many messages (None: until stopped)."""
        self.addresses = addresses
        self.cap = cap
        self.batch = batch
        self.acked: list[int] = []
        self.n = 0
        self.ds: RemoteDataspace | None = None
        self.latencies: list[float] = []
        self.lost_at: float | None = None  # when its member died (set by the killer)
        self.failovers: list[float] = []
        self.handle: int | None = None

    async def run(self, stop: asyncio.Event) -> None:
        ds = self.ds = await connect(self.addresses, self.cap, connect_timeout=5.0)
        self.handle = ds.assert_(Record(_PRESENT, [self.name]))
        while not stop.is_set() and (self.limit is None or self.n < self.limit):
            if not ds.connected:
                with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                    await asyncio.wait_for(ds.wait_connected(), 1.0)
                continue
            r0, d0 = ds.reconnects, ds.dropped_messages
            first = self.n
            for i in range(first, first + self.batch):
                ds.send(Record(_SAYS, [self.name, i]))
            self.n += self.batch
            t0 = time.monotonic()
            try:
                await ds.sync(timeout=30.0)
            except (ConnectionError, TimeoutError):
                continue
            if ds.reconnects != r0 or ds.dropped_messages != d0:
                continue  # (sent on a connection that went: not acknowledged)
            now = time.monotonic()
            self.latencies.append(now - t0)
            self.acked.extend(range(first, first + self.batch))
            if self.lost_at is not None:
                self.failovers.append(now - self.lost_at)
                self.lost_at = None

    async def close(self) -> None:
        if self.ds is not None:
            with contextlib.suppress(Exception):
                await self.ds.close()


async def run(kills: int, *, seed: int, base: Path, store: str | None = None,
              members: int = 3, clients: int = 3, batch: int = 5,
              say: Callable[[str], None] = lambda s: None) -> ClusterCrashResult:
    """Kill a member of a recording cluster ``kills`` times (see the module docstring)."""
    rng = random.Random(seed)
    result = ClusterCrashResult()
    url = store or str(base / "store")
    ms = start_cluster(base, members, store)
    senders: list[Sender] = []
    tasks: list[asyncio.Task[None]] = []
    stop = asyncio.Event()
    bar = Progress(total=kills, what="kills", quiet=True, rate=False)
    last_line = time.monotonic()
    try:
        for m in ms:
            await m.start()
        cap = SturdyRef.from_value(parse((ms[0].dir / "root.sturdyref").read_text()))
        addrs = [m.address for m in ms]
        for k in range(clients):
            rot = addrs[k % members:] + addrs[:k % members]  # each starts on another member
            senders.append(Sender(f"c{k}", rot, cap, batch))
        tasks = [asyncio.ensure_future(s.run(stop)) for s in senders]

        def check(when: str) -> bool:
            counts = chat_counts(read_stream(url, CHAT))
            result.problems += once_problems(
                when, [(s.name, i) for s in senders for i in s.acked], counts)
            result.acknowledged = sum(len(s.acked) for s in senders)
            result.recorded = sum(counts.values())
            return not result.problems

        for k in range(kills):
            await asyncio.sleep(rng.uniform(0.3, 1.2))  # (the clients send meanwhile)
            victim = rng.choice([m for m in ms if m.alive])
            for s in senders:
                if s.ds is not None and s.ds.connected and str(s.ds.address) == victim.address:
                    s.lost_at = time.monotonic()
            await victim.kill()
            result.kills = k + 1
            if not check(f"kill {k + 1}"):
                break
            await asyncio.sleep(rng.uniform(0.1, 0.8))
            await victim.start()
            now = time.monotonic()
            if now - last_line >= 5 or k + 1 == kills:
                last_line = now
                bar.update(k + 1)
                say(f"{bar.text()}: {result.acknowledged} acknowledged, {result.recorded} "
                    "recorded, every acknowledged one once")
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        if not result.problems:
            check("the end")
        # The clients leave: each value's events once, none left present.
        for s in senders:
            await s.close()
        if not result.problems:
            deadline = time.monotonic() + 30
            while True:
                probs = presence_problems(read_stream(url, PRESENCE), set())
                if not probs or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            result.problems += [f"presence: {p}" for p in probs[:10]]
        result.batches = sum(len(s.latencies) for s in senders)
        result.sync_latencies = [x for s in senders for x in s.latencies]
        result.failovers = [x for s in senders for x in s.failovers]
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        for s in senders:
            await s.close()
        for m in ms:
            await m.stop()
    return result


def _ms(xs: list[float], q: float) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    return f"{1000 * xs[min(len(xs) - 1, int(q * len(xs)))]:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dataspace.testing.cluster_record",
        description="Kill members of a recording cluster with SIGKILL at random moments\n"
        "while clients given every member's address send numbered messages with a\n"
        "sync() after each batch; check that every acknowledged message is in the\n"
        "shared stream exactly once and that presence events are recorded once.",
        epilog="examples:\n  python -m dataspace.testing.cluster_record --kills 200\n"
        "  python -m dataspace.testing.cluster_record --kills 20 --seed 7 \\\n"
        "      --store postgresql://app@localhost/app",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--kills", type=int, default=200, help="how many kills (default 200)")
    ap.add_argument("--members", type=int, default=3, help="cluster members (default 3)")
    ap.add_argument("--clients", type=int, default=3, help="sending clients (default 3)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    ap.add_argument("--dir", help="keep the members' data here (default: a temporary "
                    "directory, removed when the run passes)")
    ap.add_argument("--store", metavar="URL",
                    help="the members' shared store (e.g. an empty PostgreSQL database; "
                    "default: one SQLite file in the run's directory)")
    ap.add_argument("--postgres", action="store_true",
                    help="start a throwaway PostgreSQL server (this machine's server "
                    "binaries) and share a database of it")
    args = ap.parse_args(argv)
    if args.postgres and args.store:
        ap.error("give --store URL or --postgres, not both")
    if args.kills < 1 or args.members < 2 or args.clients < 1:
        ap.error("--kills and --clients must be at least 1, --members at least 2")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dataspace-clusterrec-"))
    say(f"cluster recording crash test: {plural(args.members, 'member')}, "
        f"{plural(args.clients, 'client')}, "
        f"{plural(args.kills, 'kill')}, seed {seed}, data in {base}")
    with contextlib.ExitStack() as stack:
        store = args.store
        if args.postgres:
            from ..streams.pgserver import TempPostgres

            pg = stack.enter_context(TempPostgres())
            store = pg.create_database("clusterrec")
            say(f"PostgreSQL on {pg.url().split('@')[-1]}")
        try:
            result = asyncio.run(run(args.kills, seed=seed, base=base, store=store,
                                     members=args.members, clients=args.clients, say=say))
        except KeyboardInterrupt:
            say(f"interrupted (data kept in {base})")
            return 130
    lat = result.sync_latencies
    return report(
        result, args.kills, f"{plural(result.kills, 'kill')}, "
        f"{plural(result.acknowledged, 'acknowledged message')}, each in the stream exactly once; presence events once; sync p50 "
        f"{_ms(lat, 0.5)}, p99 {_ms(lat, 0.99)}; failover to the next acknowledged batch: "
        f"median {_ms(result.failovers, 0.5)} ({len(result.failovers)} seen)",
        seed=seed, base=base, keep=bool(args.dir))


if __name__ == "__main__":
    sys.exit(main())

