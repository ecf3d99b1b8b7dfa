"""The recording crash test: a message acknowledged by ``sync()`` survives ``kill -9``.

A real ``dataspace serve --record 'chat:<Says $who $text>'`` runs; a client sends
numbered messages ``<Says "crash" N>``, waiting for ``sync()`` after each (the server
answers a sync only once what came before it is committed to the stream).  At a random
moment the server is killed with SIGKILL; the harness then reads the stream and checks
that every acknowledged message is in it **exactly once** (a message sent but not
acknowledged may or may not be), restarts the server on the same data directory and
port, and goes on with the next numbers::

    python -m dataspace.testing.record_crash --kills 500     # the long run (make soak-record)
    python -m dataspace.testing.record_crash --kills 20      # what the test suite runs

Exit status 0 when every check held, 1 otherwise (the first problems are printed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import re
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..cli._voice import plural
from ..client import connect
from ..progress import Progress
from ..protocol.sturdy import SturdyRef
from ..streams import open_store
from ..values import Record, Symbol, parse
from .common import CrashResult, ServerProcess, once_problems, report, say

__all__ = ["CrashResult", "main", "run"]

log = logging.getLogger(__name__)

STREAM = "chat"
_SAYS = Symbol("Says")
START_TIMEOUT = 60.0


class _Server(ServerProcess):
    """``dataspace serve --record ...`` in a subprocess, restartable on the same port."""

    def __init__(self, data_dir: Path, store: str | None = None) -> None:
        self.data_dir = data_dir
        self.store = store
        self.port = 0
        self.sturdyref: SturdyRef | None = None

    async def start(self) -> None:
        args = [sys.executable, "-m", "dataspace.cli", "serve", "--tcp",
                f"127.0.0.1:{self.port}", "--data-dir", str(self.data_dir),
                "--record", f"{STREAM}:<Says $who $text>"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.store:
            # The store's URL (maybe with a password) goes in a configuration file, not on
            # the command line.
            cfg = self.data_dir.parent / "store.pr"
            cfg.write_text(f"{{store: {json.dumps(self.store)}}}")
            args += ["--config", str(cfg)]
        self.proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        line = (await asyncio.wait_for(self.proc.stdout.readline(), START_TIMEOUT)).decode()
        if not line.startswith("sturdyref: "):
            err = (await asyncio.wait_for(self.proc.stderr.read(), START_TIMEOUT)).decode()
            raise RuntimeError(f"the server did not start: {line!r} {err.strip()!r}")
        self.sturdyref = SturdyRef.from_value(parse(line[len("sturdyref: "):]))
        while True:
            s = (await asyncio.wait_for(self.proc.stderr.readline(), START_TIMEOUT)).decode()
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", s)
            if m:
                self.port = int(m.group(1))
            if "recording" in s or not s:
                break
        # Nobody reads the server's output from now on: it writes nothing more at the
        # default log level, so the pipes cannot fill up.

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def _recorded(location: Path | str) -> Counter[int]:
    """How many times each number is in the stream."""
    store = open_store(location)
    try:
        out: Counter[int] = Counter()
        if not store.has_stream(STREAM):
            return out
        start = 0
        while True:
            entries = store.read(STREAM, start, 10_000)
            if not entries:
                return out
            for e in entries:
                v = e.value
                if type(v) is Record and v.label == _SAYS and type(v.fields[1]) is int:
                    out[v.fields[1]] += 1
            start = entries[-1].index + 1
    finally:
        store.close()


async def _round(server: _Server, first: int, rng: random.Random,
                 acked: list[int]) -> int:
    """Send numbers from ``first``, each followed by a sync, until the server is killed
    at a random moment; returns the next number to send."""
    assert server.sturdyref is not None
    ds = await connect(server.address, server.sturdyref, reconnect=False)
    n = first
    deadline = time.monotonic() + rng.uniform(0.02, 0.5)

    async def killer() -> None:
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        await server.kill()

    task = asyncio.ensure_future(killer())
    try:
        while True:
            ds.send(Record(_SAYS, ["crash", n]))
            n += 1
            try:
                await ds.sync(timeout=30.0)
            except (ConnectionError, TimeoutError):
                break
            acked.append(n - 1)
    finally:
        await task
        with contextlib.suppress(Exception):
            await ds.close()
    return n


async def run(kills: int, *, seed: int, base: Path,
              say: Callable[[str], None] = lambda s: None, store: str | None = None) -> CrashResult:
    """Kill a recording server ``kills`` times and check the stream after each kill;
    ``store``: the store's URL (default: the data directory's SQLite store)."""
    rng = random.Random(seed)
    result = CrashResult()
    server = _Server(base / "data", store)
    acked: list[int] = []
    n = 0
    last_line = time.monotonic()
    bar = Progress(total=kills, what="kills", quiet=True)  # its words: count, rate, ETA
    try:
        for k in range(kills):
            await server.start()
            n = await _round(server, n, rng, acked)
            result.kills = k + 1
            counts = _recorded(store or server.data_dir)
            result.problems += once_problems(f"kill {k + 1}", acked, counts)
            result.acknowledged = len(acked)
            result.recorded = sum(counts.values())
            if result.problems:
                break
            now = time.monotonic()
            if now - last_line >= 5 or k + 1 == kills:
                last_line = now
                bar.update(k + 1)
                say(f"{bar.text()}: {len(acked)} acknowledged, "
                    f"{result.recorded} recorded, all acknowledged present once")
    finally:
        await server.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dataspace.testing.record_crash",
        description=textwrap.fill(
            "Kill a recording `dataspace serve` with SIGKILL at random moments while a "
            "client sends numbered messages and waits for sync() after each; check that "
            "every acknowledged message is in the stream exactly once.", 78),
        epilog="examples:\n  python -m dataspace.testing.record_crash --kills 500\n"
        "  python -m dataspace.testing.record_crash --kills 20 --seed 7 --dir /tmp/rec",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--kills", type=int, default=500, help="how many kills (default 500)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    ap.add_argument("--dir", help="keep the data directory here (default: a temporary one, "
                    "removed when the run passes)")
    ap.add_argument("--store", metavar="URL",
                    help="record into this store (e.g. an empty PostgreSQL database) instead "
                    "of the data directory's")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dataspace-reccrash-"))
    base.mkdir(parents=True, exist_ok=True)
    say(f"recording crash test: {plural(args.kills, 'kill')}, seed {seed}, data in {base}")
    result = asyncio.run(run(args.kills, seed=seed, base=base, say=say, store=args.store))
    return report(result, args.kills, f"{plural(result.kills, 'kill')}, "
                  f"{plural(result.acknowledged, 'acknowledged message')}, each in the "
                  "stream exactly once",
                  seed=seed, base=base, keep=bool(args.dir))


if __name__ == "__main__":
    sys.exit(main())
