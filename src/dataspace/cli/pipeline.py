"""``dataspace pipeline``: run processor graphs over durable streams (exactly once)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._extras import require
from ..datadir import DATA_DIR_HELP, resolve_data_dir
from ..pipeline.engine import (
    DEFAULT_ENGINE,
    ENGINES,
    GUARANTEES,
    EngineError,
    Interrupted,
    ProcStats,
    check_sources,
    get_engine,
    graph_holder,
    holder_engine,
)
from ..pipeline.exactly_once import BackingCorrupt, recover
from ..pipeline.loader import GraphLoadError, load_graph
from ..progress import Eta, LiveLine, WallRate, hms
from ..streams import StoreError
from ._store import CREATE_HINT, add_store_argument, open_data_store, spark_data_dir

EPILOG = """\
examples:
  dataspace pipeline run graph.py                  Spark local[*], until Ctrl-C
  dataspace pipeline run graph.py --until-idle     stop once all input is done
  dataspace pipeline run graph.py --master spark://host:7077   a Spark cluster
  dataspace pipeline run graph.py --store postgresql://db/app   on PostgreSQL
  dataspace pipeline run graph.py --engine local --guarantee at-most-once
  dataspace pipeline status graph.py               position, lag, batches, rate
  dataspace pipeline status graph.py --json        the same as JSON (for jq)
  dataspace pipeline check graph.py                validate, without running it
  dataspace pipeline reset graph.py --delete-outputs   from the start next run
  dataspace pipeline route --patterns p.txt --values chat --out matches.parquet

A graph file is Python that defines `graph` (see docs/pipelines.md); this one
shouts what is said in stream chat (dataspace stream append chat '<Says "alice" "hi">'):

  from dataspace.pipeline import Graph
  graph = Graph("shout", error_stream="shout.errors")
  graph.source("chat")
  graph.map("upper", "chat", "loud", lambda says: says.fields[1].upper())
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "pipeline",
        help="run processor graphs over durable streams, exactly once",
        description="Processor graphs read durable streams and write streams, exactly once "
        "(seed 002): each processor step, its outputs and its tailer positions commit "
        "together, and a restart resumes where the last committed step ended.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("graph", metavar="GRAPH.py", help="Python file defining `graph`")
    common.add_argument("--data-dir", metavar="DIR",
                        help=DATA_DIR_HELP + "; Spark's checkpoints go here for a PostgreSQL store")
    add_store_argument(common)
    ss = p.add_subparsers(dest="pipeline_command", metavar="SUBCOMMAND")

    run = ss.add_parser("run", parents=[common], help="run a graph",
                        description="Run a graph: recover every processor (seed 002), then "
                        "process input as it arrives, printing a progress line (messages "
                        "in/out per processor, lag per input).  Ctrl-C stops cleanly after "
                        "the current step; a second Ctrl-C stops at once (still safe: the "
                        "next run recovers).",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--engine", choices=sorted(ENGINES), default=DEFAULT_ENGINE,
                     help=f"where to run: spark (Structured Streaming, one query per "
                     f"processor) or local (this process) (default {DEFAULT_ENGINE})")
    run.add_argument("--master", default="local[*]", metavar="URL",
                     help="Spark master: local[*] (default: this machine, every core), "
                     "local[N], spark://HOST:PORT, yarn, k8s://...")
    run.add_argument("--checkpoint-dir", metavar="DIR",
                     help="where Spark queries keep their checkpoints (default "
                     "DATA_DIR/spark/GRAPH); a cluster with stateful DataFrame processors "
                     "needs a directory its executors share")
    run.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                     help="extra Spark setting (repeatable), e.g. spark.ui.enabled=true")
    run.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                     help="more logging (Spark's warnings on the terminal too)")
    run.add_argument("--guarantee", choices=GUARANTEES, default="exactly-once",
                     help="delivery guarantee (default exactly-once; at-most-once: local "
                     "engine only)")
    run.add_argument("--batch", type=int, default=None, metavar="N",
                     help="most message sets per processor step / Spark micro-batch "
                     "(default: 1000 local, 100000 spark)")
    run.add_argument("--durability", choices=("full", "normal"), default="full",
                     help="full: every commit is fsynced (survives power loss); normal: "
                     "survives process crashes only (default full)")
    run.add_argument("--until-idle", action="store_true",
                     help="stop when no processor has input left")
    run.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                     help="how often the progress line is refreshed (default 1); not on a "
                     "terminal, a line is printed only when something changed, at most one "
                     "every 10 intervals")
    run.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    run.add_argument("--create-store", action="store_true",
                     help="create the store if there is none (default: refuse, so that a "
                     "mistyped --data-dir is an error; the graph's sources must exist or "
                     "be declared with graph.source(NAME, create=True))")
    run.set_defaults(func=run_run)

    st = ss.add_parser("status", parents=[common], help="positions, lag and last step per processor",
                       description="For each processor: its input positions and lag, and what "
                       "the recovery component would find (the last step delivered, or a "
                       "step to retry).  Reads the store only.",
                       epilog="examples:\n"
                       "  dataspace pipeline status orders.py           positions, lag, last step\n"
                       "  dataspace pipeline status orders.py --json | jq '.processors[].inputs'",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("--json", action="store_true",
                    help="one JSON object (graph, running, processors with their inputs' "
                    "positions and lag, Spark's figures, error stream)")
    st.set_defaults(func=run_status)

    rt = ss.add_parser(
        "route", help="match a table of values against a table of patterns, on Spark",
        description="A Spark batch job: every value (a stream of the store, or a Parquet/JSON "
        "dataset with a binary `value` or a text `text` column) is matched against every "
        "pattern (concise syntax, one per line; `ID<TAB>PATTERN` names it, otherwise its "
        "number is its id).  The skeleton index of the patterns is built once per worker "
        "from a broadcast; the output has one row per match: pattern, index, captures "
        "(canonical binary) and captures_text.",
        epilog="examples:\n"
        "  dataspace pipeline route --patterns p.txt --values chat --out matches.parquet\n"
        "  dataspace pipeline route --patterns p.txt --values events.parquet \\\n"
        "      --out matches.json --format json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    rt.add_argument("--patterns", required=True, metavar="FILE",
                    help="patterns, one per line (blank lines and ; comments skipped)")
    rt.add_argument("--values", required=True, metavar="STREAM|PATH",
                    help="a stream of the store, or a Parquet/JSON file or directory")
    rt.add_argument("--out", required=True, metavar="PATH", help="where to write the matches")
    rt.add_argument("--format", choices=("parquet", "json"), default=None,
                    help="output format (default: from --out's extension, else parquet)")
    rt.add_argument("--data-dir", metavar="DIR", help=DATA_DIR_HELP)
    add_store_argument(rt)
    rt.add_argument("--master", default="local[*]", metavar="URL", help="Spark master")
    rt.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Spark setting (repeatable)")
    rt.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                    help="more logging")
    rt.set_defaults(func=run_route)

    ck = ss.add_parser("check", parents=[common], help="validate a graph file",
                       description="Load and validate a graph file (cycles, unknown streams, "
                       "processor shapes) without running it, and check that its sources "
                       "exist in the store, as `pipeline run` does before it starts.")
    ck.add_argument("--no-store", action="store_true",
                    help="validate the file only, without looking at a store")
    ck.add_argument("--json", action="store_true",
                    help="one JSON object: the graph, its processors, inputs and outputs")
    ck.set_defaults(func=run_check)

    rs = ss.add_parser(
        "reset", parents=[common], help="reprocess a graph from the start on its next run",
        description="Forget where a graph is, so that its next run processes its sources "
        "from the first stored entry: remove its processors' positions (tailers named "
        "GRAPH/PROCESSOR), their backing streams (__backing/GRAPH/...) and their Spark "
        "checkpoints.  The sources are not touched.  The graph must not be running.  "
        "Reprocessing writes the graph's results again, so when its outputs hold entries "
        "say what becomes of them: --delete-outputs removes the streams it writes (its "
        "outputs and error stream: each result then once), --keep-outputs keeps them (the "
        "new results are appended after the old ones; processors reading an intermediate "
        "stream start at its end).  A sink's own delivery records (SQLiteSink's "
        "deliveries table) are outside the store and kept: clear them to redo its effects.",
        epilog="examples:\n"
        "  dataspace pipeline reset shout.py --dry-run          what a reset removes\n"
        "  dataspace pipeline reset shout.py --delete-outputs   start over, outputs too\n"
        "  dataspace pipeline reset shout.py --keep-outputs     reprocess, append again",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    what = rs.add_mutually_exclusive_group()
    what.add_argument("--delete-outputs", action="store_true",
                      help="also remove the streams the graph writes (outputs, error stream)")
    what.add_argument("--keep-outputs", action="store_true",
                      help="keep them: the next run appends its results after the old ones")
    rs.add_argument("--checkpoint-dir", metavar="DIR",
                    help="where the graph's Spark checkpoints are, if `pipeline run` was "
                    "given --checkpoint-dir (default DATA_DIR/spark/GRAPH)")
    rs.add_argument("--dry-run", "-n", action="store_true",
                    help="say what would be removed, change nothing")
    rs.set_defaults(func=run_reset)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _fail(msg: str, code: int = 1) -> int:
    print(f"dataspace pipeline: {msg}", file=sys.stderr)
    return code


def _n(x: int) -> str:
    return f"{x:,}"


def _count(n: int, one: str, many: str | None = None) -> str:
    """``1 processor``, ``4 processors``."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def format_progress(stats: list[ProcStats], rate: float | None = None,
                    dt: float | None = 0.0, eta: str | None = None) -> str:
    """One line: per processor messages in/out (errors), lag per input, what it is doing
    if that takes a while (``[batch 3: 5,000 messages, tasks 1/4, 0:12]``: seconds
    ``dt`` later than the statistics say; None leaves the time out) and state; with
    ``rate``, the messages per second, and ``eta`` (``ETA 0:56``, ``estimating ETA``)
    after it while there is lag to catch up."""
    parts = []
    for s in stats:
        lag = " ".join(f"{k}:{_n(v)}" for k, v in s.lag.items())
        part = f"{s.name} in {_n(s.consumed)} out {_n(s.produced)}"
        if s.errors:
            part += f" err {_n(s.errors)}"
        part += f" lag {lag}"
        if s.activity:
            part += f" [{s.activity}" + ("]" if dt is None else f", {hms(s.activity_s + dt)}]")
        if s.state == "failed":
            part += " FAILED"
        parts.append(part)
    line = " | ".join(parts)
    if rate is not None:
        # A slow function's rate is under 10/s: a decimal, rather than "0 msg/s".
        line += f" | {rate:,.1f} msg/s" if 0 < rate < 9.95 else f" | {_n(round(rate))} msg/s"
        if eta:
            line += f", catching up: {eta}"
    return line


LOG_GAP = 10
"""Not on a terminal, a progress line at most every LOG_GAP intervals (10 s by default)."""


class _Progress:
    """Renders progress on a :class:`~dataspace.progress.LiveLine`: one line rewritten on
    a terminal (kept moving during a long batch); otherwise (a log, a pipe) a line when
    something changed -- at most one every ``gap`` seconds, none while the graph is idle
    -- and every ten seconds while a batch runs.

    The rate is messages over wall time (:class:`~dataspace.progress.WallRate`): a batch
    that commits 5,000 messages after a minute is 83/s, not 5,000 in the second it
    landed, and idle time does not count.  The time left to catch up the lag is an
    :class:`~dataspace.progress.Eta`: measured from commit to commit, steady within a
    batch, ``estimating`` until a spell of work has two commits and after a failed task."""

    def __init__(self, out: Any, quiet: bool = False, *, live: LiveLine | None = None,
                 clock: Any = time.monotonic, gap: float | None = None) -> None:
        self.live = live if live is not None else LiveLine(out, quiet=quiet, ticker=False,
                                                           clock=clock)
        if gap is not None:
            self.live.gap = gap
        self.quiet = quiet
        self.clock = clock
        self.rate = WallRate()
        self.eta = Eta()

    def begin(self) -> None:
        """The run starts (nothing consumed yet): work done before the first report still
        has a rate."""
        t = self.clock()
        self.rate.add(t, 0, False)
        self.eta.update(t, 0, 0, False)

    def __call__(self, stats: list[ProcStats]) -> None:
        t = self.clock()
        n = sum(s.consumed for s in stats)
        # Busy: a processor has input it can take, or a batch (a query's start) is under
        # way; a query that waits for input is idle, and so is a join missing an input.
        busy = any(s.activity or (s.state == "running" and any(s.lag.values()))
                   for s in stats)
        lag = sum(v for s in stats if s.state != "failed" for v in s.lag.values())
        self.rate.add(t, n, busy)
        self.eta.update(t, n, lag, busy, sum(s.retries for s in stats))
        rate = self.rate.rate()
        shown = 0.0 if rate is None else rate
        eta = self.eta

        def render(dt: float) -> str:
            return format_progress(stats, shown, dt, _eta_text(eta.left(t + dt), lag, busy))

        self.live.status(render, key=format_progress(stats, None, None) + f" {round(shown)}",
                         busy=any(s.activity for s in stats))

    def end(self) -> None:
        self.live.close()


def _eta_text(left: float | None, lag: int, busy: bool) -> str | None:
    """What the progress line says of the time left: nothing when there is no lag, no
    work under way (a join waiting for its other input) or under a second to wait."""
    if not lag or not busy:
        return None
    if left is None:
        return "estimating ETA"
    return f"ETA {hms(left)}" if left >= 1 else None


def _open(args: argparse.Namespace, durability: str = "full", create: bool = False,
          create_hint: str = CREATE_HINT) -> Any:
    """The store of a pipeline command: never created unless ``create`` (``run
    --create-store``), so that a mistyped --data-dir is an error, not a new store."""
    return open_data_store(args.data_dir, create=create, durability=durability,
                           store=getattr(args, "store", None), create_hint=create_hint)


def run_check(args: argparse.Namespace) -> int:
    try:
        g = load_graph(args.graph)
    except GraphLoadError as e:
        return _fail(str(e), 2)
    if not args.no_store:
        try:
            with _open(args) as store:
                check_sources(g, store)
        except (EngineError, StoreError, OSError, ValueError) as e:
            return _fail(str(e))
    if args.json:
        print(json.dumps({
            "file": args.graph, "graph": g.name, "valid": True, "streams": sorted(g.streams()),
            "sources": list(g.sources), "error_stream": g.error_stream,
            "processors": [{"name": p.name, "kind": p.kind, "inputs": list(p.inputs),
                            "outputs": list(p.outputs)} for p in g.order()],
        }, indent=2, ensure_ascii=False))
        return 0
    print(f"{args.graph}: graph {g.name!r} is valid: {_count(len(g.processors), 'processor')}, "
          f"{_count(len(g.streams()), 'stream')}")
    for p in g.order():
        outs = ", ".join(p.outputs) or "(side effects)"
        print(f"  {p.kind:<9} {p.name:<20} {', '.join(p.inputs)} -> {outs}")
    return 0


def _conf(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise ValueError(f"--conf {item!r}: expected KEY=VALUE")
        out[k.strip()] = v
    return out


def _java_ok() -> str | None:
    """None when Java can run Spark, else the one-line error (checked before any JVM)."""
    from ..pipeline.spark.session import SparkSetupError, check_java

    try:
        check_java()
    except SparkSetupError as e:
        return str(e)
    return None


def run_run(args: argparse.Namespace) -> int:
    # Ctrl-C is ours from the first moment and said at once ("stopping ..."): the first
    # one stops cleanly (exit 0) in every phase -- loading the graph, starting Spark
    # (between two of its phases), recovering, running (after the current step) -- and a
    # second one stops at once (exit 130).
    stop = threading.Event()
    stores: list[Any] = []
    interrupted = {"n": 0}
    live = LiveLine(sys.stdout, prefix="dataspace pipeline: ", quiet=args.quiet)

    def on_sigint(signum: int, frame: Any) -> None:
        interrupted["n"] += 1
        if interrupted["n"] > 1:
            if args.engine == "spark":
                _exit_at_once(live)
            raise KeyboardInterrupt
        live.notice("dataspace pipeline: stopping ... (Ctrl-C again stops at once; the "
                    "next run recovers)")
        stop.set()
        for s in stores:
            with contextlib.suppress(Exception):
                s.wake()

    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, on_sigint) if main else None
    try:
        return _run(args, stop, stores, on_sigint if main else None, live)
    except KeyboardInterrupt:
        live.close()
        print(STOPPED_AT_ONCE, file=sys.stderr)
        return 130
    finally:
        live.close()
        if old is not None:
            signal.signal(signal.SIGINT, old)


STOPPED_AT_ONCE = "dataspace pipeline: stopped at once (the next run recovers)"


def _exit_at_once(live: LiveLine) -> None:
    """The second Ctrl-C of a Spark run: one line and exit 130, now.  A
    KeyboardInterrupt would land wherever the main thread is -- inside a py4j call as
    often as not, which logs "KeyboardInterrupt while sending command" with a traceback
    and leaves the JVM's answer unread.  Nothing needs unwinding: the JVM and the fork
    server exit when this process goes (their standard input closes), the store's
    transaction rolls back and its locks go with the process, and the next run recovers
    (seed 002)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()  # a write this signal interrupted makes that fail: no matter
    with contextlib.suppress(OSError, ValueError):
        if live.tty and live._width:  # below the live line, which stays as it was
            os.write(live.out.fileno(), b"\n")
        os.write(2, (STOPPED_AT_ONCE + "\n").encode())
    os._exit(130)


def _run(args: argparse.Namespace, stop: threading.Event, stores: list[Any],
         on_sigint: Any, live: LiveLine) -> int:
    if (args.batch is not None and args.batch < 1) or args.interval <= 0:
        return _fail("--batch must be >= 1 and --interval > 0", 2)
    try:
        conf = _conf(args.conf)
    except ValueError as e:
        return _fail(str(e), 2)
    try:
        g = load_graph(args.graph)
    except GraphLoadError as e:
        return _fail(str(e), 2)
    spark = args.engine == "spark"
    if spark:
        require("spark", "the Spark engine", hint="or run in this process with --engine local")
        problem = _java_ok()
        if problem:
            return _fail(f"{problem} -- or run in this process with --engine local")
    options: dict[str, Any] = {"guarantee": args.guarantee}
    if args.batch is not None:
        options["batch"] = args.batch
    if spark:
        options.update(master=args.master, checkpoint_dir=args.checkpoint_dir,
                       verbose=getattr(args, "verbose", 0), conf=conf, phases=live, cancel=stop)
    if stop.is_set():  # Ctrl-C while the graph loaded: no store opened, nothing ran
        return _stopped_before_start(args, live)
    try:
        engine_cls = get_engine(args.engine)
        store = _open(args, args.durability, create=args.create_store,
                      create_hint=CREATE_HINT + ", or run with --create-store")
    except (EngineError, StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    try:
        check_sources(g, store)  # before Spark starts; nothing is created when refused
    except (EngineError, StoreError) as e:
        store.close()
        return _fail(str(e))
    stores.append(store)
    if spark:
        try:
            options["data_dir"] = spark_data_dir(store, args.data_dir)
        except OSError as e:
            store.close()
            return _fail(str(e))
    progress = _Progress(sys.stdout, args.quiet, live=live, gap=LOG_GAP * args.interval)
    verbose = getattr(args, "verbose", 0)
    master = args.master if spark else None
    said: set[str] = set()

    def say_stopped(stats: list[ProcStats], echo: Callable[[str], None]) -> None:
        """Each processor that stopped, once, when it is seen stopped: GRAPH/PROCESSOR
        and what to do (the engine's own log record of it is left out: see _Stops)."""
        for s in stats:
            if s.state == "failed" and s.name not in said:
                said.add(s.name)
                echo(stopped_line(f"{g.name}/{s.name}", s.error or "", s.detail, verbose,
                                  master))

    def on_progress(stats: list[ProcStats]) -> None:
        progress(stats)
        say_stopped(stats, lambda line: live.echo(line, sys.stderr))

    engine = None
    stats: list[ProcStats] = []
    t0 = time.monotonic()
    stops = _Stops()
    try:
        if stop.is_set():
            return _stopped_before_start(args, live)
        engine = engine_cls(g, store, **options)
        with engine:
            if spark:
                live.echo(f"dataspace pipeline: starting Spark ({args.master}) ...")
            try:
                engine.start()
            except Interrupted:
                return _stopped_before_start(args, live)
            if on_sigint is not None:  # a session someone else started may have its own
                signal.signal(signal.SIGINT, on_sigint)
            if stop.is_set():  # Ctrl-C while starting: nothing ran, nothing to stop
                return _stopped_before_start(args, live)
            rec = getattr(engine, "recovery", None)
            branches = rec() if callable(rec) else {}
            retried = {k: v for k, v in branches.items() if v in ("1b", "1c+1b") or v.endswith("3b")}
            where = f"engine {args.engine}"
            if spark:
                where += f" on {engine.spark.sparkContext.master}"  # type: ignore[attr-defined]
            live.echo(f"dataspace pipeline: running graph {g.name!r} "
                      f"({_count(len(g.processors), 'processor')}, {args.guarantee}, {where}, "
                      f"store {store.display})"
                      + (f"; retrying the interrupted steps of {', '.join(retried)}" if retried else ""))
            if spark and getattr(engine, "read_on", "executor") == "driver":
                live.echo(f"dataspace pipeline: the driver does all the reading: the executors of "
                          f"{engine.spark.sparkContext.master} cannot open an SQLite store (a "  # type: ignore[attr-defined]
                          "file on this machine); a PostgreSQL store (--store postgresql://USER@HOST"
                          "/DATABASE) lets the executors do it", sys.stderr)
            t0 = time.monotonic()
            progress.begin()
            stats = engine.run(stop, until_idle=args.until_idle, on_progress=on_progress,
                               progress_interval=args.interval)
        progress.end()
    except KeyboardInterrupt:
        progress.end()
        raise
    except (EngineError, StoreError, BackingCorrupt) as e:
        progress.end()
        return _fail(str(e))
    finally:
        stops.close()
        store.close()
        if spark and getattr(engine, "created_session", False):
            from ..pipeline.spark.session import stop_session

            with contextlib.suppress(Exception):
                stop_session()
    failed = [s for s in stats if s.state == "failed"]
    total_in = sum(s.consumed for s in stats)
    total_out = sum(s.produced for s in stats)
    if not args.quiet:
        why = "interrupted" if stop.is_set() else "idle" if args.until_idle else "stopped"
        took = time.monotonic() - t0
        print(f"dataspace pipeline: {why}: {_count(total_in, 'message')} in, {_n(total_out)} out "
              f"in {hms(took)}")
    say_stopped(failed, lambda line: print(line, file=sys.stderr))  # (not shown yet)
    return 1 if failed else 0


class _Stops(logging.Filter):
    """While ``pipeline run`` runs, the engines' log records of a processor that stopped
    (marked ``processor_stopped``) are left out: the command says each stop itself, once,
    with the processor's full name and what to do (it said it twice, in two words)."""

    def __init__(self) -> None:
        super().__init__()
        self.handlers = list(logging.getLogger().handlers)
        for h in self.handlers:
            h.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "processor_stopped", None) is None

    def close(self) -> None:
        for h in self.handlers:
            h.removeFilter(self)


_LOST_WORKER = ("Python worker exited unexpectedly", "ExecutorLostFailure", "Lost executor",
                "Executor heartbeat timed out", "Worker lost")
"""What Spark says when a task's worker or executor went away under it (killed, out of
memory): nothing the function did, nothing to fix."""


def stopped_line(name: str, error: str, detail: str | None, verbose: int = 0,
                 master: str | None = None) -> str:
    """The line for a processor that stopped: its function failed (fix it, or give the
    graph an error stream), or -- no traceback of the function, Spark's words for a lost
    worker or executor -- the batch was lost with it (run again: it is retried, exactly
    once)."""
    if detail is None and any(m in error for m in _LOST_WORKER):
        why = error.split(" Consider setting ", 1)[0].rstrip(". ")  # (a faulthandler hint)
        if ": Job aborted due to stage failure: " in f": {why}":
            why = why.split("Job aborted due to stage failure: ", 1)[1]
        retry = ""
        if master is not None and master.startswith("local[") and "," not in master:
            retry = (f"; --master '{master[:-1]},4]' lets Spark retry a lost task by itself, "
                     "as a cluster does")
        return (f"dataspace pipeline: processor {name} stopped: Spark lost the worker running "
                f"its batch ({why}) -- not its function's doing: nothing of the batch was "
                f"committed and its input is kept; run again and the batch is retried, exactly "
                f"once{retry}")
    return (f"dataspace pipeline: processor {name} stopped: {error} (its input is kept; "
            "fix the function or configure an error stream, then run again"
            + ("" if verbose or not detail else "; -v shows the traceback") + ")")


def _stopped_before_start(args: argparse.Namespace, live: LiveLine | None = None) -> int:
    if live is not None:
        live.close()
    if not args.quiet:
        print("dataspace pipeline: interrupted before the graph started: nothing ran", flush=True)
    return 0


def run_status(args: argparse.Namespace) -> int:
    try:
        g = load_graph(args.graph)
    except GraphLoadError as e:
        return _fail(str(e), 2)
    try:
        store = _open(args, create=False)
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    try:
        doc = graph_status(store, g, args.data_dir)
    except StoreError as e:
        return _fail(str(e))
    finally:
        store.close()
    if args.json:
        print(json.dumps(doc, indent=2, ensure_ascii=False))
        return 0
    print(f"graph {g.name!r} on {doc['store']}: "
          f"{'running (' + doc['holder'] + ')' if doc['running'] else 'not running'}")
    for p in doc["processors"]:
        print(f"  {p['kind']:<9} {p['name']:<20} {_last_step(p)}")
        for i in p["inputs"]:
            if i["position"] is None:
                print(f"      {i['stream']:<22} position -        (stream at {_n(i['next'])})")
            else:
                print(f"      {i['stream']:<22} position {_n(i['position']):<8} lag {_n(i['lag'])}")
        if p["spark"] is not None:
            print(f"      {_spark_line(p['spark'])}")
    es = doc["error_stream"]
    if es is not None:
        print(f"  error stream {es['name']}: {_count(es['records'], 'record')}")
    return 0


def graph_status(store: Any, g: Any, data_dir: str | None) -> dict[str, Any]:
    """What ``pipeline status`` says of graph ``g`` on ``store``, as data (its --json)."""
    running = graph_holder(store, g.name)
    engine = holder_engine(running)
    nexts = store.next_indices()
    procs = []
    for p in g.order():
        pid = g.proc_id(p)
        row: dict[str, Any] = {"name": p.name, "kind": p.kind, "id": pid}
        try:
            rec = recover(store, pid)
            row["recovery"] = rec.branch
            row["last_step"] = ("never ran" if rec.branch == "1a" else
                                "to retry" if rec.retry else "delivered")
        except BackingCorrupt as e:
            row["recovery"] = None
            row["last_step"] = "damaged"
            row["damage"] = str(e)
        inputs = []
        for s in p.inputs:
            pos = store.position(s, pid)
            nxt = nexts.get(s, 0)
            inputs.append({"stream": s, "position": pos, "next": nxt,
                           "lag": None if pos is None else max(0, nxt - pos)})
        row["inputs"] = inputs
        # Spark's figures are the engine's that runs the graph now, or the last run's
        # (labelled so); while another engine runs it they would be stale: left out.
        row["spark"] = (None if running and engine != "spark" else
                        _spark_status(store, data_dir, g.name, p.name, live=bool(running)))
        procs.append(row)
    return {
        "graph": g.name, "store": store.display, "running": bool(running), "holder": running,
        "engine": engine, "processors": procs,
        "error_stream": ({"name": g.error_stream, "records": nexts.get(g.error_stream, 0)}
                         if g.error_stream else None),
    }


def _last_step(p: dict[str, Any]) -> str:
    last = p["last_step"]
    if last == "damaged":
        return f"backing stream damaged: {p['damage']}"
    if last == "never ran":
        return last
    return ("step to retry" if last == "to retry" else "last step delivered") + f" ({p['recovery']})"


def run_reset(args: argparse.Namespace) -> int:
    from ..pipeline.reset import reset_graph
    from ..pipeline.spark.status import store_graph_dir

    try:
        g = load_graph(args.graph)
    except GraphLoadError as e:
        return _fail(str(e), 2)
    outputs = "delete" if args.delete_outputs else "keep" if args.keep_outputs else None
    try:
        store = _open(args)
    except (StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    try:
        if args.checkpoint_dir:
            dirs = [Path(args.checkpoint_dir) / p for p in g.processors]
        else:
            try:
                dirs = [store_graph_dir(store.url, spark_data_dir(store, args.data_dir,
                                                                  create=False), g.name)]
            except OSError:
                dirs = []
        plan = reset_graph(store, g, outputs=outputs, spark_dirs=dirs, dry_run=args.dry_run)
    except (EngineError, StoreError, OSError, ValueError) as e:
        return _fail(str(e))
    finally:
        store.close()
    if plan.empty:
        print(f"graph {g.name!r} on {store.display}: nothing to reset (it never ran here)")
        return 0
    verb = "would reset" if args.dry_run else "reset"
    print(f"{verb} graph {g.name!r} on {store.display}:")
    for line in plan.lines():
        print(f"  {line}")
    if not args.dry_run:
        print(f"the next `dataspace pipeline run {args.graph}` processes its sources from "
              "the start")
    return 0


def _spark_status(store: Any, data_dir: str | None, graph: str, proc: str,
                  live: bool = False) -> dict[str, Any] | None:
    """A processor's Spark query (None if it never ran on Spark): the running query's
    (``live``), or the last Spark run's, with when it ended."""
    from ..pipeline.spark.status import query_status, store_graph_dir

    try:
        d = spark_data_dir(store, data_dir, create=False)
    except OSError:
        return None
    st = query_status(store_graph_dir(store.url, d, graph) / proc)
    if st is None:
        return None
    in_flight = st["offsets"] if st["offsets"] is not None and st["offsets"] != st["committed"] else None
    ranges = st.get("ranges") or {}
    t = st["totals"] or {}
    pr = st["progress"] or {}
    stamps = [x for x in (t.get("time_ms"), pr.get("saved_ms")) if isinstance(x, int)]
    return {
        "live": live,
        "committed": st["committed"],
        "started": st["offsets"],
        "in_flight": in_flight,
        "in_flight_messages": sum(b - a for a, b in ranges.values()) if in_flight is not None else 0,
        "totals": ({k: t.get(k, 0) for k in ("batches", "in", "out", "errors")} if t else None),
        "time": (time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(max(stamps) / 1000))
                 if stamps else None),
    }


def _spark_line(sp: dict[str, Any]) -> str:
    """The line of ``pipeline status`` about a processor's Spark query."""
    parts = []
    if sp["committed"] is not None:
        parts.append(f"batch {sp['committed']} committed")
    elif sp["started"] is None:
        parts.append("no batch yet")
    if sp["in_flight"] is not None:
        msgs = sp["in_flight_messages"]
        parts.append(f"batch {sp['in_flight']} in flight" + (f" ({_count(msgs, 'message')})" if msgs else "")
                     if sp["live"] else f"batch {sp['in_flight']} unfinished (the next run retries it)")
    t = sp["totals"]
    if t:
        parts.append(f"{_count(t['batches'], 'batch', 'batches')}, {_n(t['in'])} in, "
                     f"{_n(t['out'])} out"
                     + (f", {_count(t['errors'], 'error')}" if t["errors"] else ""))
    when = None
    if sp["time"] is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.strptime(sp["time"][:19], "%Y-%m-%dT%H:%M:%S"))
    if sp["live"]:
        return "spark: " + "; ".join(parts + ([f"progress at {when}"] if when else []))
    return "last Spark run" + (f" (until {when})" if when else "") + ": " + "; ".join(parts)


def run_route(args: argparse.Namespace) -> int:
    try:
        conf = _conf(args.conf)
    except ValueError as e:
        return _fail(str(e), 2)
    if not os.path.isfile(args.patterns):
        return _fail(f"no patterns file at {args.patterns}", 2)
    from ..pipeline.spark.route import RouteError, find_values, load_patterns, route_to

    # Everything that can be checked without Spark is checked before it starts (12 s).
    try:
        patterns = load_patterns(args.patterns)
        data_dir = resolve_data_dir(args.data_dir, create=False)
        find_values(args.values, data_dir, store=args.store)
    except (RouteError, OSError) as e:
        return _fail(str(e), 2)
    require("spark", "pipeline route (a Spark job)")
    problem = _java_ok()
    if problem:
        return _fail(problem)
    from ..pipeline.spark.session import get_session, stop_session

    t0 = time.monotonic()
    live = LiveLine(sys.stdout, prefix="dataspace pipeline route: ")
    live.echo(f"dataspace pipeline route: {_count(len(patterns), 'pattern')}, values {args.values}, "
              f"starting Spark ({args.master}) ...")
    created = False
    try:
        spark, created = get_session(args.master, app_name="dataspace route",
                                     verbose=getattr(args, "verbose", 0), conf=conf,
                                     log_file=data_dir / "spark" / "spark.log", phases=live)
        n_values, n_matches = route_to(spark, patterns, args.values, args.out,
                                       data_dir=data_dir, fmt=args.format, store=args.store,
                                       phases=live)
    except (RouteError, StoreError) as e:
        live.close()
        return _fail(str(e))
    finally:
        live.close()
        if created:
            with contextlib.suppress(Exception):
                stop_session()
    print(f"dataspace pipeline route: {_count(n_values, 'value')}, {_count(n_matches, 'match', 'matches')} -> "
          f"{args.out} ({time.monotonic() - t0:.1f}s)")
    return 0


