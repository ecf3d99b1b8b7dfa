"""What the two pipeline crash harnesses share: the graph and its data, the exact
outputs it must give, the child's life and the parent's plumbing.

The graph (processor ids ``crash/...``)::

    left ─┐                      ┌─ even ── store (sink: SQLite table, idempotent by hash)
          ├─ pair (join) ─ pairs ┤
    right ┘                      └─ odd ──┐
                                          ├─ merge (alts) ── merged
    extra ────────────────────────────────┘
    errors: pair raises on some pairs, merge on some extras (the graph's error stream)

A *child* process (``python -m HARNESS child ...``) produces ``N`` seeded messages into
each of the three sources (in random-sized chunks, resuming by index, so production is
exactly-once too) while its engine processes them, and says what it does in lines on its
standard output (``ready``, progress, ``failed ...``, ``done``).  The *parent* kills it,
restarts it, and at the end :func:`verify` checks that the sources, ``pairs``,
``merged``, the error stream and the sink's table hold exactly :func:`expected`.

:mod:`.pipeline_crash` kills the local engine's child at random moments;
:mod:`.spark_crash` kills the Spark engine's whole driver at the connector's fault points
and at random moments.  Both run campaigns (:func:`campaigns`, a fresh store and seed
each) from one command line (:func:`harness_main`).
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cli._voice import plural
from ..pipeline.graph import Graph
from ..pipeline.sinks import SQLiteSink
from ..progress import Progress
from ..values import Record, Sequence, Symbol, encode
from .common import say as line

__all__ = [
    "SOURCES",
    "STORE_ENV",
    "Campaign",
    "build_graph",
    "campaign_databases",
    "campaigns",
    "drive",
    "expected",
    "harness_main",
    "inputs",
    "line",
    "location",
    "spawn_child",
    "verify",
]

SOURCES = ("left", "right", "extra")
_L, _R, _X, _P, _M = (Symbol(s) for s in ("L", "R", "X", "P", "M"))

STORE_ENV = "DATASPACE_CRASH_STORE"
"""The store's URL for the children (not on their command line: it may hold a password)."""


# -- the graph and its outputs -----------------------------------------------------------


def inputs(n: int, seed: int) -> dict[str, list[Record]]:
    """The seeded messages of each source (the same for every run of a campaign)."""
    out = {}
    for s, label in zip(SOURCES, (_L, _R, _X)):
        rng = random.Random(f"{seed}:{s}")
        out[s] = [Record(label, [i, rng.randrange(1000)]) for i in range(n)]
    return out


def _pair(left: Record, right: Record) -> Record:
    i, a = left.fields
    _j, b = right.fields
    if (i * 7 + b) % 53 == 0:
        raise ValueError(f"pair {i} rejected")
    return Record(_P, [i, a + b])


def _route(p: Record) -> dict[str, Record]:
    return {"even" if p.fields[1] % 2 == 0 else "odd": p}


def _merge(v: Record) -> Record:
    if v.label == _X and v.fields[1] % 41 == 0:
        raise ValueError(f"extra {v.fields[0]} rejected")
    return Record(_M, [v])


def build_graph(directory: str | os.PathLike[str]) -> Graph:
    """The crash-test graph; its sink writes to ``directory/sink.db``."""
    g = Graph("crash", error_stream="errors")
    g.source(*SOURCES, create=True)  # the producer writes them while the graph runs
    g.join("pair", ["left", "right"], "pairs", _pair)
    g.fork("route", "pairs", ["even", "odd"], _route)
    g.alts("merge", ["odd", "extra"], "merged", _merge)
    g.sink("store", "even", SQLiteSink(Path(directory) / "sink.db", "pairs",
                                       ["i INTEGER", "total INTEGER"],
                                       to_row=lambda p: tuple(p.fields)), batch=True)
    return g


def expected(n: int, seed: int) -> dict[str, Counter[Any]]:
    """The exact multisets the outputs must hold at the end."""
    src = inputs(n, seed)
    pairs: Counter[Any] = Counter()
    merged: Counter[Any] = Counter()
    table: Counter[Any] = Counter()
    errors: Counter[Any] = Counter()
    odd = []
    for left, right in zip(src["left"], src["right"]):
        try:
            p = _pair(left, right)
        except ValueError:
            errors[("crash/pair", encode(Sequence([left, right])))] += 1
            continue
        pairs[encode(p)] += 1
        if p.fields[1] % 2 == 0:
            table[tuple(p.fields)] += 1
        else:
            odd.append(p)
    for v in odd + src["extra"]:
        try:
            merged[encode(_merge(v))] += 1
        except ValueError:
            errors[("crash/merge", encode(Sequence([v])))] += 1
    return {"pairs": pairs, "merged": merged, "table": table, "errors": errors}


def location(directory: str | os.PathLike[str]) -> str:
    """The store of a run: ``$DATASPACE_CRASH_STORE`` when set, else the directory's."""
    return os.environ.get(STORE_ENV) or os.fspath(directory)


def verify(directory: str | os.PathLike[str], n: int, seed: int, store: str | None = None) -> list[str]:
    """Compare the store (``store``, else the directory's) and the sink's table with
    :func:`expected`; the problems found."""
    from ..streams import open_store

    want = expected(n, seed)
    problems: list[str] = []
    with open_store(store or directory) as st:
        src = inputs(n, seed)
        for s in SOURCES:
            got = [e.data for e in st.iter_entries(s)]
            if got != [encode(v) for v in src[s]]:
                problems.append(f"source {s}: {plural(len(got), 'entry', 'entries')}, expected the {n} seeded ones")
        got_streams = {
            "pairs": Counter(e.data for e in st.iter_entries("pairs")),
            "merged": Counter(e.data for e in st.iter_entries("merged")),
            "errors": Counter(
                (e.value.fields[0], encode(e.value.fields[3])) for e in st.iter_entries("errors")
            ),
        }
    db = Path(directory) / "sink.db"
    rows = sqlite3.connect(db).execute("SELECT i, total FROM pairs").fetchall() if db.exists() else []
    got_streams["table"] = Counter(tuple(r) for r in rows)
    for name, got in got_streams.items():
        exp = want[name]
        if got != exp:
            dup = sum(((got - exp) & got).values())
            lost = sum((exp - got).values())
            extra = sum((got - exp).values())
            problems.append(f"{name}: {lost} lost, {extra} unexpected ({dup} duplicates); "
                            f"{sum(got.values())} present, {sum(exp.values())} expected")
    return problems


# -- the child ---------------------------------------------------------------------------


def _produce(directory: str, n: int, seed: int, run: int, done: threading.Event) -> None:
    from ..streams import open_store

    src = inputs(n, seed)
    datas = {s: [encode(v) for v in src[s]] for s in SOURCES}
    rng = random.Random(f"{seed}:producer:{run}")
    with open_store(location(directory)) as store:
        while True:
            left = [s for s in SOURCES if store.next_index(s) < n]
            if not left:
                break
            s = rng.choice(left)
            with store.transaction() as tx:
                at = tx.next_index(s)
                chunk = datas[s][at : at + rng.randint(1, 200)]
                tx.append_encoded(s, chunk)
    done.set()


def drive(engine: Any, store: Any, directory: str, n: int, seed: int, run: int,
          progress: Callable[[Any], None], interval: float) -> int:
    """A child's life, whatever the engine: say ``ready``, produce the run's share of the
    messages in a thread while processing until everything is produced and processed,
    then say ``done`` (``failed ...`` and 1 if a processor failed)."""
    engine.start()
    line("ready")
    produced = threading.Event()
    threading.Thread(target=_produce, args=(directory, n, seed, run, produced), daemon=True).start()
    while True:
        gen = store.generation()
        engine.run(until_idle=True, on_progress=progress, progress_interval=interval)
        if engine.failed:
            line(f"failed {engine.failed}")
            return 1
        if produced.is_set() and engine.idle():
            break
        store.wait_change(gen, 1.0)
    engine.close()
    store.close()
    line("done")
    return 0


# -- the parent --------------------------------------------------------------------------


def spawn_child(module: str, directory: str, n: int, seed: int, run: int, batch: int, *,
                env: dict[str, str] | None = None, new_session: bool = False,
                ) -> tuple[subprocess.Popen[str], queue.Queue[str | None]]:
    """Start ``python -m MODULE child ...``; its stdout lines arrive on the queue (None at
    its end)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "child", "--dir", directory,
         "--messages", str(n), "--seed", str(seed), "--run", str(run), "--batch", str(batch)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
        start_new_session=new_session,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for text in proc.stdout:
            lines.put(text.strip())
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def child_stderr(proc: subprocess.Popen[str]) -> str:
    """The end of what a child wrote to its standard error (for a problem's line)."""
    try:
        return (proc.stderr.read() if proc.stderr else "")[-3000:]
    except (OSError, ValueError):
        return ""


@dataclass
class Campaign:
    """What a campaign did: kills, runs and the problems found (each harness adds where
    its kills landed)."""

    directory: str
    messages: int
    seed: int
    kills: int = 0
    runs: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def landed(self) -> str:
        """Where the kills landed, for the campaign's line."""
        return ""


def campaigns(
    kills: int,
    *,
    base: str,
    seed: int,
    campaign_kills: int,
    messages: Callable[[int], int],
    run: Callable[..., Campaign],
    say: Callable[[str], None] | None = None,
    stores: Callable[[int], str] | None = None,
    drop: Callable[[int], None] | None = None,
) -> tuple[int, list[Campaign]]:
    """Campaigns of ``campaign_kills`` kills until ``kills`` kills are done or a campaign
    finds a problem; returns (kills done, results).  Campaign ``c`` runs
    ``run(directory, kills=k, messages=messages(k), seed=seed + c, store=URL)`` in a
    directory of its own under ``base``; ``stores(c)`` gives its store's URL (default
    None: an SQLite store in its directory) and ``drop(c)`` removes it after a pass."""
    done = 0
    results: list[Campaign] = []
    bar = Progress(total=kills, what="kills", quiet=True)  # its words: count, rate, ETA
    while done < kills:
        campaign = len(results)
        k = min(campaign_kills, kills - done)
        n = messages(k)
        d = os.path.join(base, f"campaign-{campaign}")
        os.makedirs(d, exist_ok=True)
        if say:
            say(f"campaign {campaign}: seed {seed + campaign}, {plural(n, 'message')} per source, "
                f"{plural(k, 'kill')}")
        url = stores(campaign) if stores is not None else None
        r = run(d, kills=k, messages=n, seed=seed + campaign, store=url)
        results.append(r)
        if drop is not None and not r.problems:
            drop(campaign)
        done += r.kills
        bar.update(done)
        if say:
            say(f"  {'OK' if not r.problems else 'FAILED'}: {plural(r.kills, 'kill')}{r.landed()}, "
                f"{plural(r.runs, 'run')}, {r.seconds:.1f}s; total {bar.text()}")
            for p in r.problems:
                say(f"  problem: {p}")
        if r.problems:
            if say:
                say(f"  the store is kept in {d}")
            break
        if r.kills == 0:
            if say:
                say("  no kill landed (the work finished first): use more --messages")
            break
    return done, results


def harness_main(argv: list[str] | None, *, prog: str, description: str,
                 child: Callable[..., int], soak: Callable[..., Any], kills: int,
                 campaign_kills: int, batch: int, messages_help: str, tmp_prefix: str,
                 what: str, examples: str, store_option: bool = False) -> int:
    """The command line of a crash harness: ``child ...`` (one run, internal) or a soak of
    ``--kills`` kills in campaigns of ``--campaign-kills``, each on a fresh store."""
    ap = argparse.ArgumentParser(prog=prog, description=textwrap.fill(description, 78),
                                 epilog=examples,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    ch = sub.add_parser("child", help="(internal) one run of the graph")
    ch.add_argument("--dir", required=True)
    ch.add_argument("--messages", type=int, required=True)
    ch.add_argument("--seed", type=int, required=True)
    ch.add_argument("--run", type=int, default=0)
    ch.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--kills", type=int, default=kills, metavar="N",
                    help=f"total kills (default {kills})")
    ap.add_argument("--campaign-kills", type=int, default=campaign_kills, metavar="N",
                    help=f"kills per campaign (a fresh store per campaign; default {campaign_kills})")
    ap.add_argument("--messages", type=int, default=None, metavar="N",
                    help=f"messages per source per campaign (default: {messages_help})")
    ap.add_argument("--seed", type=int, default=None, metavar="S",
                    help="first seed (default: random)")
    ap.add_argument("--dir", metavar="DIR", help="keep the stores here (default: a temporary directory)")
    if store_option:
        ap.add_argument("--store", metavar="URL",
                        help="run on PostgreSQL: a database per campaign is created on the "
                        "server of this postgresql:// URL (and dropped after a pass)")
    args = ap.parse_args(argv)
    if args.cmd == "child":
        return child(args.dir, args.messages, args.seed, args.run, args.batch)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    base = args.dir or tempfile.mkdtemp(prefix=tmp_prefix)
    extra: dict[str, Any] = {}
    if getattr(args, "store", None):
        extra = campaign_databases(args.store, f"dataspace_crash_{seed}")
    done, results = soak(args.kills, base=base, seed=seed, campaign_kills=args.campaign_kills,
                         messages=args.messages, say=line, **extra)
    ok = done >= args.kills and not any(r.problems for r in results)
    line(f"PASSED: {done} {what}, every output exactly once" if ok
         else f"FAILED after {plural(done, 'kill')} (seed {seed}; the stores are kept in {base})")
    if ok and not args.dir:
        shutil.rmtree(base, ignore_errors=True)  # a passed run leaves nothing behind
    return 0 if ok else 1


def campaign_databases(url: str, prefix: str) -> dict[str, Callable[[int], Any]]:
    """``stores`` and ``drop`` for :func:`campaigns`: a database ``PREFIX_N`` per campaign
    on the PostgreSQL server of ``url`` (created by connecting to the URL's database)."""
    import urllib.parse

    import psycopg

    from ..datadir import store_location

    if store_location(url).kind != "postgresql":
        raise SystemExit(f"--store {url}: give a postgresql:// URL (the SQLite store is the default)")
    u = urllib.parse.urlsplit(url)

    def name(campaign: int) -> str:
        return f"{prefix}_{campaign}"

    def stores(campaign: int) -> str:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name(campaign)}" WITH (FORCE)')
            c.execute(f'CREATE DATABASE "{name(campaign)}"')
        return urllib.parse.urlunsplit(u._replace(path="/" + name(campaign)))

    def drop(campaign: int) -> None:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name(campaign)}" WITH (FORCE)')

    return {"stores": stores, "drop": drop}
