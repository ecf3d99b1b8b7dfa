"""The Spark engine: each processor of a graph is a Structured Streaming query.

A processor's query reads its inputs with the ``dataspace`` source (one micro-batch = one
step: the start and end index of every input), applies the processor -- a plain Python
function, run with the local engine's own step code, or a DataFrame transformation -- and
commits through the ``dataspace`` sink: outputs, error records, snapshot, attempt record
and tailer positions in one store transaction, keyed by the delivery hash of seed 002
(:mod:`.sink` explains why a re-run batch writes nothing).  Every query has its own
checkpoint, ``DATA_DIR/spark/GRAPH/PROCESSOR/checkpoint`` by default.

At start the engine compares each checkpoint with what the store says was delivered (the
recovery component of seed 002):

* no checkpoint: the query starts at the store's positions (a new processor, or one that
  ran on the local engine);
* the checkpoint's last batch is the store's last delivered step, or it is in flight and
  starts where the store's positions are: Spark carries on (re-running the in-flight
  batch, which writes nothing if it was delivered);
* anything else (the store moved on under another engine, or was replaced): the
  checkpoint is stale; it is moved aside (``checkpoint.stale-TIME``) and the query starts
  at the store's positions.  DataFrame processors lose their aggregation state then
  (logged);
* the store holds an interrupted step of the local engine (recovery 1b/1c/3b): the first
  batch is pinned to exactly that step, so it is retried with the same delivery hash.

``run(until_idle=True)`` runs the processors one after the other in topological order,
each with ``Trigger.AvailableNow``, and repeats until no processor has input; otherwise
every query runs continuously (``latestOffset`` sleeps on the store's wake-ups while
idle) until :meth:`stop`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...progress import NO_PHASES, Phases
from ...streams.base import Store, StoreCorrupt, StoreLock
from ..engine import Engine, EngineError, Interrupted, ProcStats, check_sources, claim_graph
from ..exactly_once import backing_stream, recover, resume
from ..failure import with_source
from ..graph import Graph, Processor
from ._store import store_options
from .errors import damage_line
from .placement import read_on
from .session import SparkSetupError, StartInterrupted, get_session
from .sink import TRACEBACK_END, TRACEBACK_START, ProcSpec, encode_spec
from .status import checkpoint_state, default_data_dir_for, store_graph_dir

__all__ = ["SparkEngine"]

log = logging.getLogger(__name__)

DEFAULT_BATCH = 100_000
FINISH_TIMEOUT = 3600.0
"""Longest wait for the batches in flight when a run is stopped (then they are dropped:
the next run does them again)."""


class _Query:
    """One processor's query and bookkeeping."""

    def __init__(self, engine: SparkEngine, p: Processor) -> None:
        self.engine = engine
        self.p = p
        self.id = engine.graph.proc_id(p)
        self.dir = engine.root / p.name
        self.checkpoint = self.dir / "checkpoint"
        self.start_pos: dict[str, int] = {}
        self.first_batch: dict[str, dict[str, int]] | None = None
        self.recovery = ""
        self.note = "new checkpoint"
        self.query: Any = None
        self.run_id: str | None = None
        self.failed: str | None = None
        self.detail: str | None = None  # the failure's traceback (the user's frames)
        self.activity = ""  # what the query does now ("batch 3: 5,000 messages")
        self.activity_t0 = 0.0  # since when (time.monotonic())
        self.batch: int | None = None  # the batch in flight, if any
        self.failed_tasks = 0  # task attempts of the batch in flight that failed
        self.retries = 0  # failed task attempts since the run started (Spark runs them again)
        self.base = {"in": 0, "out": 0, "errors": 0, "batches": 0}
        self.last_progress: dict[str, Any] | None = None

    @property
    def mode(self) -> str:
        p = self.p
        if p.kind == "dataframe":
            return "each"
        if p.reads_alts:
            return "alts"
        return "join" if len(p.inputs) > 1 else "each"

    def totals(self) -> dict[str, int]:
        try:
            with open(self.dir / "totals.json", encoding="utf-8") as f:
                t = json.load(f)
            return {k: int(t.get(k, 0)) for k in ("in", "out", "errors", "batches")}
        except (OSError, ValueError):
            return {"in": 0, "out": 0, "errors": 0, "batches": 0}


class SparkEngine(Engine):
    """Runs a graph on Spark (see the module docstring).

    Options: ``master`` (default ``local[*]``; ignored when a session exists, e.g.
    ``spark=``), ``spark`` (a SparkSession to use), ``batch`` (most message sets per
    micro-batch, default 100,000), ``partition_rows`` (rows per task; default: the batch
    over the parallelism), ``checkpoint_dir`` (default ``DATA_DIR/spark/GRAPH``),
    ``verbose`` (Spark's warnings on the terminal), ``conf`` (extra Spark settings),
    ``log_file`` (the JVM's output; default ``DATA_DIR/spark/spark.log``), ``wait_ms``
    (longest sleep of an idle source before it answers Spark, default 250),
    ``data_dir`` (where checkpoints and logs go: default the SQLite store's directory, or
    for a PostgreSQL store the default data directory; a PostgreSQL store's checkpoints
    are under ``DATA_DIR/spark/pg-KEY/GRAPH``, KEY naming its server and database),
    ``phases`` (told of each phase of starting Spark: :class:`dataspace.progress.Phases`),
    ``cancel`` (an event that stops the start-up between two phases, e.g. Ctrl-C;
    default: :meth:`stop`).
    """

    name = "spark"

    def __init__(
        self,
        graph: Graph,
        store: Store,
        *,
        guarantee: str = "exactly-once",
        batch: int | None = None,
        master: str | None = None,
        spark: Any = None,
        partition_rows: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        verbose: int = 0,
        conf: dict[str, str] | None = None,
        log_file: str | os.PathLike[str] | None = None,
        wait_ms: int = 250,
        backing_keep: int = 1000,
        data_dir: str | os.PathLike[str] | None = None,
        staged: bool = True,
        phases: Phases | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        super().__init__(graph, store)
        if guarantee != "exactly-once":
            raise EngineError("the spark engine runs exactly-once only; use --engine local "
                              f"for {guarantee}")
        if batch is not None and batch < 1:
            raise EngineError("batch must be >= 1")
        self.store_url = store.url
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir_for(store)
        self.batch = batch or DEFAULT_BATCH
        self.master = master
        self.spark = spark
        self.partition_rows = partition_rows
        self.root = (Path(checkpoint_dir) if checkpoint_dir
                     else store_graph_dir(self.store_url, self.data_dir, graph.name))
        self.verbose = verbose
        self.conf = conf or {}
        self.log_file = log_file or (self.data_dir / "spark" / "spark.log")
        self.wait_ms = wait_ms
        self.backing_keep = max(backing_keep, 8)
        self.queries = [_Query(self, p) for p in graph.order()]
        self.started = False
        self._lock: StoreLock | None = None
        self.created_session = False
        self._progress_t = 0.0
        self._finishing = False  # stopping: the batches in flight finish first
        self.staged = staged
        """Pure processors (map, join, alts, fork) run in the read tasks, which stage
        their outputs in the store for the commit to take (nothing goes through Spark);
        False: the rows go through Spark to the write tasks, the outputs to the driver."""
        self.phases = phases or NO_PHASES
        self.cancel = cancel if cancel is not None else self._stop
        self.read_on = "executor"
        """Where the queries read the store: ``executor``, or ``driver`` for an SQLite
        store on a cluster (its executors cannot open the driver's file); set by start."""

    # -- start ---------------------------------------------------------------------------

    def _claim(self) -> None:
        self._lock = claim_graph(self.store, self.graph.name, self.name)

    def start(self) -> None:
        if self.started:
            return
        check_sources(self.graph, self.store)  # before the claim, the streams and Spark
        self._claim()
        try:
            with self.store.transaction() as tx:
                for s in self.graph.streams():
                    tx.create_stream(s)
                for q in self.queries:
                    tx.create_stream(backing_stream(q.id))
                    tx.set_retention(backing_stream(q.id), self.backing_keep, None)
            for q in self.queries:
                self._reconcile(q)
                t = q.totals()
                q.base = t
            if self.spark is None:
                try:
                    self.spark, self.created_session = get_session(
                        self.master, app_name=f"dataspace {self.graph.name}",
                        verbose=self.verbose, conf=self.conf, log_file=self.log_file,
                        phases=self.phases, cancel=self.cancel)
                except StartInterrupted as e:
                    raise Interrupted(str(e)) from None
                except SparkSetupError as e:
                    raise EngineError(str(e)) from None
            else:
                from .session import _register

                _register(self.spark)
            master = self.spark.sparkContext.master
            self.read_on = read_on(master, self.store_url)
            if self.read_on == "driver":
                log.info("%s: the driver reads every batch (an SQLite store on %s); a "
                         "PostgreSQL store lets the executors read", self.graph.name, master)
        except BaseException:
            self.close()
            raise
        self.started = True

    def _fresh(self, s: str) -> int:
        first = self.store.first_index(s)
        return first if first is not None else self.store.next_index(s)

    def _reconcile(self, q: _Query) -> None:
        rec = recover(self.store, q.id)
        ck = q.checkpoint
        q.recovery = rec.branch
        saved = {s: self.store.position(s, q.id) for s in q.p.inputs}
        r = resume(rec, saved, self._fresh, q.p.inputs)
        if r.note is not None:
            log.warning("%s: %s", q.id, r.note)
            q.recovery = f"{rec.branch} (superseded)"
        if r.retry:
            assert rec.starts is not None and rec.ends is not None
            q.start_pos = dict(rec.starts)
            q.first_batch = {"starts": dict(rec.starts), "ends": dict(rec.ends)}
            if ck.exists():
                self._set_aside(q, "the store holds an interrupted step, to retry",
                                "the store holds an interrupted step (of another engine's run)",
                                "Spark retries that step")
            q.note = "retrying the interrupted step"
            return
        pos = r.positions
        q.start_pos = pos
        if not ck.exists():
            return
        n, c, ranges = checkpoint_state(ck)
        if n is None:
            _clear_unfinished_first_batch(ck)
            return
        if ranges is None:
            return
        step = None if rec.starts is None else {s: (rec.starts[s], rec.ends[s]) for s in rec.starts}  # type: ignore[index]
        in_flight = c is None or c < n
        # The checkpoint is trusted only if the store is exactly where its last batch
        # leaves it: that batch delivered and the tailers at its end (nobody moved them
        # since, e.g. an at-most-once run, which keeps no backing records), or that batch
        # in flight and the tailers at its start.
        at_end = all(pos.get(s) == b for s, (_a, b) in ranges.items())
        at_start = all(pos.get(s) == a for s, (a, _b) in ranges.items())
        if (ranges == step and at_end) or (in_flight and at_start):
            q.note = f"checkpoint at batch {n}" + (" (in flight)" if in_flight else "")
            return
        self._set_aside(q, f"its last batch {n} ({ranges}) is not the store's state "
                           f"(delivered {step}, positions {pos})",
                        "the store moved on since its Spark checkpoint (another engine ran "
                        "it, or the store was replaced)", "Spark starts from the store's positions")
        q.note = "stale checkpoint set aside"

    def _set_aside(self, q: _Query, why: str, said: str, then: str) -> None:
        """Move ``q``'s checkpoint aside (kept: ``checkpoint.stale-TIME-PID``), saying
        ``said`` and ``then`` in one line (``why``, the details, at info level)."""
        dest = q.checkpoint.with_name(f"checkpoint.stale-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        os.replace(q.checkpoint, dest)
        extra = "; its aggregation state starts afresh" if q.p.kind == "dataframe" else ""
        log.warning("processor %s: %s; %s (the old checkpoint is kept as %s)%s", q.id, said, then,
                    dest.name, extra)
        log.info("%s: checkpoint set aside to %s: %s", q.id, dest, why)

    # -- queries -------------------------------------------------------------------------

    def _parallelism(self) -> int:
        try:
            return max(1, int(self.spark.sparkContext.defaultParallelism))
        except Exception:
            return 2

    def _source(self, q: _Query, streams: tuple[str, ...], mode: str, decode: bool,
                meta: bool, extra: dict[str, Any] | None = None) -> Any:
        pr = self.partition_rows or min(self.batch, max(1000, math.ceil(self.batch / self._parallelism())))
        opts = {
            **store_options(self.store_url),
            "streams": ",".join(streams),
            "mode": mode,
            "maxRowsPerBatch": str(self.batch),
            "partitionRows": str(pr),
            "startingOffsets": json.dumps({s: q.start_pos[s] for s in streams}),
            "decode": "true" if decode else "false",
            "includeMeta": "true" if meta else "false",
            "includeTime": "true" if q.p.kind == "dataframe" else "false",
            "readOn": self.read_on,
            "waitMs": str(self.wait_ms),
        }
        if q.first_batch is not None:
            fb = {k: {s: v[s] for s in streams} for k, v in q.first_batch.items()}
            opts["firstBatch"] = json.dumps(fb)
        for k, v in (extra or {}).items():
            opts[k] = v if isinstance(v, str) else json.dumps(v) if not isinstance(v, bool) else str(v).lower()
        return self.spark.readStream.format("dataspace").options(**opts).load()

    def _start_query(self, q: _Query, available_now: bool) -> Any:
        p = q.p
        # Python data sources are looked up in the JVM thread's active session, which a
        # thread other than the session's creator does not have.
        with contextlib.suppress(Exception):
            jvm = self.spark.sparkContext._jvm
            jvm.org.apache.spark.sql.SparkSession.setActiveSession(self.spark._jsparkSession)
        spec = ProcSpec(self.graph.name, p, self.graph.error_stream
                        if self.graph.error_stream not in p.inputs else None, str(q.dir))
        q.dir.mkdir(parents=True, exist_ok=True)
        mode = "append"
        if p.kind == "dataframe":
            opts = dict(p.options)
            mode = opts.pop("output_mode", "append")
            decode = bool(opts.pop("decode", True))
            meta = bool(opts.pop("include_meta", False))
            try:
                dfs = [self._source(q, (s,), "each", decode, meta, opts) for s in p.inputs]
            except Exception as e:  # a bad source option: the connector's one line
                raise EngineError(f"dataframe {p.name!r}: {e}") from e
            assert p.fn is not None
            try:
                out = p.fn(*dfs)
            except Exception as e:
                raise EngineError(f"dataframe {p.name!r}: the function raised "
                                  f"{type(e).__name__}: {e}") from e
            if out is None or not hasattr(out, "writeStream"):
                raise EngineError(f"dataframe {p.name!r}: the function must return a DataFrame, "
                                  f"not {type(out).__name__}")
        try:
            packed = encode_spec(spec)
        except Exception as e:
            raise EngineError(
                f"processor {p.name!r}: its function cannot be sent to Spark's Python workers "
                f"({type(e).__name__}: {e}); functions run in other processes, so they must "
                "be picklable -- open connections and locks inside the function, not around it"
            ) from e
        if p.kind != "dataframe":
            staged = self.staged and spec.on_executors and self.read_on == "executor"
            out = self._source(q, p.inputs, q.mode, False, p.messages,
                               {"processor": packed} if staged else None)
        w = (out.writeStream.format("dataspace")
             .options(**store_options(self.store_url))
             .option("processor", packed)
             .option("checkpointLocation", str(q.checkpoint))
             .outputMode(mode)
             .queryName(q.id))
        w = w.trigger(availableNow=True) if available_now else w.trigger(processingTime="0 seconds")
        q.query = w.start()
        with contextlib.suppress(Exception):
            q.run_id = str(q.query.runId)
        return q.query

    # -- running -------------------------------------------------------------------------

    def _has_input(self, q: _Query, nexts: dict[str, int] | None = None) -> bool:
        if q.failed:
            return False
        if q.first_batch is not None:
            return True  # a step to retry
        nexts = nexts or self.store.next_indices()
        avail = [nexts.get(s, 0) > self._pos(q, s) for s in q.p.inputs]
        return all(avail) if q.mode == "join" else any(avail)

    def _pos(self, q: _Query, s: str) -> int:
        p = self.store.position(s, q.id)
        return q.start_pos.get(s, 0) if p is None else p

    def run(
        self,
        stop: threading.Event | None = None,
        *,
        until_idle: bool = False,
        on_progress: Callable[[list[ProcStats]], None] | None = None,
        progress_interval: float = 1.0,
    ) -> list[ProcStats]:
        self.start()
        stop = stop or self._stop
        interval = progress_interval if progress_interval > 0 else 0.2
        self._progress_t = time.monotonic() + interval
        try:
            if until_idle:
                self._until_idle(stop, on_progress, interval)
            else:
                self._continuous(stop, on_progress, interval)
        finally:
            self._stop_queries()
            if on_progress is not None:
                with contextlib.suppress(Exception):
                    on_progress(self.stats())
        return self.stats()

    def _tick(self, on_progress: Callable[[list[ProcStats]], None] | None, interval: float,
              force: bool = False) -> None:
        now = time.monotonic()
        if now < self._progress_t and not force:
            return
        self._progress_t = now + interval
        for q in self.queries:
            with contextlib.suppress(Exception):  # progress must not stop the run
                self._observe(q)
        self._save_progress()
        if on_progress is not None:
            on_progress(self.stats())

    def _observe(self, q: _Query) -> None:
        """What ``q``'s query does now, when it takes a while: starting, or the batch in
        flight (its number and messages from the offset log, which Spark writes before
        running it; the tasks done from Spark's status tracker)."""
        if q.query is None:
            return  # not started (or starting: _starting said so)
        if not _active(q.query):
            q.activity, q.batch = "", None
            return
        n, c, ranges = checkpoint_state(q.checkpoint)
        if n is None or (c is not None and c >= n):  # no batch in flight
            if q.activity.startswith("starting"):
                try:
                    message = str(q.query.status.get("message", ""))
                except Exception:
                    message = ""
                if message.startswith("Initializing"):
                    return  # Spark still starts the query's sources
            q.activity, q.batch = "", None
            return
        if q.batch != n:
            q.batch = n
            q.failed_tasks = 0
            q.activity_t0 = time.monotonic()
            with contextlib.suppress(OSError):  # since Spark wrote the batch's offsets
                age = time.time() - os.stat(q.checkpoint / "offsets" / str(n)).st_mtime
                q.activity_t0 -= max(0.0, min(age, 3600.0))
        msgs = sum(b - a for a, b in ranges.values()) if ranges else 0
        what = ("finishing " if self._finishing else "") + f"batch {n}" + (
            f": {msgs:,} message{'' if msgs == 1 else 's'}" if msgs else "")
        tasks = self._tasks(q)
        if tasks is not None:
            what += f", tasks {tasks[0]}/{tasks[1]}"
            if tasks[2] > q.failed_tasks:  # an executor lost, a worker killed: retried
                q.retries += tasks[2] - q.failed_tasks
                q.failed_tasks = tasks[2]
        if q.failed_tasks:
            what += f", {q.failed_tasks} failed and retried"
        q.activity = what

    def _tasks(self, q: _Query) -> tuple[int, int, int] | None:
        """(tasks done, tasks, task attempts failed) of the query's running jobs, None
        if Spark does not say."""
        if q.run_id is None:
            return None
        try:
            tr = self.spark.sparkContext.statusTracker()
            active = set(tr.getActiveJobsIds())
            done = total = failed = 0
            for j in tr.getJobIdsForGroup(q.run_id):
                if j not in active:
                    continue
                info = tr.getJobInfo(j)
                for sid in (info.stageIds if info is not None else ()):
                    st = tr.getStageInfo(sid)
                    if st is not None:
                        done += st.numCompletedTasks
                        total += st.numTasks
                        failed += st.numFailedTasks
        except Exception:
            return None
        return (done, total, failed) if total else None

    def _starting(self, q: _Query, on_progress: Any, interval: float) -> None:
        """Say that ``q``'s query starts (a second or more: planning and a Python process
        for its source) before it blocks the run loop."""
        q.query = None  # the last round's, finished
        q.activity, q.batch = "starting its query", None
        q.activity_t0 = time.monotonic()
        self._tick(on_progress, interval, force=True)

    def _check(self, q: _Query) -> None:
        """Record a query that ended with an error."""
        if q.query is None or q.query.isActive:
            return
        exc = q.query.exception()
        if exc is not None and not q.failed:
            damage = damage_line(str(getattr(exc, "desc", None) or exc))
            if damage is not None:  # a read found the store damaged: stop, as locally
                raise StoreCorrupt(damage)
            q.failed, q.detail = _failure(exc)
            # (extra: a caller that reports the stop itself -- `pipeline run` -- leaves it
            # out.)
            log.error("processor %s stopped: %s", q.id, q.failed,
                      extra={"processor_stopped": q.id})
            if q.detail:
                log.info("%s: the function's traceback:\n%s", q.id, q.detail)

    def _until_idle(self, stop: threading.Event, on_progress: Any, interval: float) -> None:
        while not stop.is_set() and not self._stop.is_set():
            ran = False
            for q in self.queries:
                if stop.is_set() or self._stop.is_set():
                    break
                if not self._has_input(q):
                    continue
                ran = True
                self._starting(q, on_progress, interval)
                self._start_query(q, available_now=True)
                while q.query.isActive:
                    with contextlib.suppress(Exception):  # a failure: see _check
                        q.query.awaitTermination(min(interval, 1.0))
                    self._remember(q)
                    self._tick(on_progress, interval)
                    if stop.is_set() or self._stop.is_set():
                        self._finish_batches(on_progress, interval)
                        q.query.stop()
                self._remember(q)
                self._check(q)
                q.first_batch = None
            if not ran or all(q.failed for q in self.queries):
                break

    def _continuous(self, stop: threading.Event, on_progress: Any, interval: float) -> None:
        for q in self.queries:
            if stop.is_set() or self._stop.is_set():
                return  # stopped while queries were starting: start no more
            if not q.failed:
                self._starting(q, on_progress, interval)
                self._start_query(q, available_now=False)
        while not stop.is_set() and not self._stop.is_set():
            stop.wait(min(interval, 0.5))
            for q in self.queries:
                self._remember(q)
                self._check(q)
            self._tick(on_progress, interval)
            if all(q.failed for q in self.queries):
                break
        self._finish_batches(on_progress, interval)

    def _finish_batches(self, on_progress: Any, interval: float,
                        limit: float = FINISH_TIMEOUT) -> None:
        """Stopping (Ctrl-C, :meth:`stop`): let every batch in flight now commit before
        the queries are stopped -- a stopped query drops its batch, which the next run
        would do again.  The progress says ``finishing batch N`` meanwhile.  A batch
        that Spark starts after this one is stopped with its query; a query that ends
        (it failed) is not waited for; after ``limit`` seconds the queries are stopped
        anyway (the next run recovers, as from any stop)."""
        waiting: dict[_Query, int] = {}
        for q in self.queries:
            if q.query is None or not _active(q.query):
                continue
            n, c, _ranges = checkpoint_state(q.checkpoint)
            if n is not None and (c is None or c < n):
                waiting[q] = n
        if not waiting:
            return
        self._finishing = True
        log.info("stopping after the batches in flight: %s",
                 ", ".join(f"{q.id} batch {n}" for q, n in waiting.items()))
        deadline = time.monotonic() + limit
        pause = threading.Event()  # never set: a bounded wait between two looks
        try:
            while waiting and time.monotonic() < deadline:
                for q, n in list(waiting.items()):
                    _n, c, _r = checkpoint_state(q.checkpoint)
                    if (c is not None and c >= n) or not _active(q.query):
                        del waiting[q]
                        self._remember(q)
                with contextlib.suppress(Exception):
                    self._tick(on_progress, interval)
                if waiting:
                    pause.wait(min(interval, 0.2))
            if waiting:
                log.warning("stopping without waiting longer for %s",
                            ", ".join(f"{q.id} batch {n}" for q, n in waiting.items()))
        finally:
            self._finishing = False

    def _remember(self, q: _Query) -> None:
        if q.query is not None:
            with contextlib.suppress(Exception):
                lp = q.query.lastProgress
                # The last batch that read rows: its rate means something (batches run
                # without input, to close windows or to find nothing new, do not).
                if lp and (lp.get("numInputRows") or not q.last_progress):
                    q.last_progress = lp

    def _stop_queries(self) -> None:
        for q in self.queries:
            q.activity, q.batch = "", None
            if q.query is not None:
                with contextlib.suppress(Exception):
                    if q.query.isActive:
                        q.query.stop()
                self._remember(q)
                with contextlib.suppress(Exception):
                    self._check(q)
        self._save_progress()

    def _save_progress(self) -> None:
        for q in self.queries:
            lp = q.last_progress
            if not lp:
                continue
            data = {
                "query": q.id,
                "batch": lp.get("batchId"),
                "timestamp": lp.get("timestamp"),
                "input_rows": lp.get("numInputRows"),
                "input_rows_per_s": lp.get("inputRowsPerSecond"),
                "processed_rows_per_s": lp.get("processedRowsPerSecond"),
                "duration_ms": lp.get("durationMs"),
                "pid": os.getpid(),
                "saved_ms": int(time.time() * 1000),
            }
            with contextlib.suppress(OSError, TypeError, ValueError):
                q.dir.mkdir(parents=True, exist_ok=True)
                tmp = q.dir / f"progress.json.{os.getpid()}.tmp"
                tmp.write_text(json.dumps(data, default=str))
                os.replace(tmp, q.dir / "progress.json")

    # -- statistics ------------------------------------------------------------------------

    def stats(self) -> list[ProcStats]:
        nexts = self.store.next_indices()
        out = []
        now = time.monotonic()
        for q in self.queries:
            t = q.totals()
            lag = {s: max(0, nexts.get(s, 0) - self._pos(q, s)) for s in q.p.inputs}
            active = q.query is not None and _active(q.query)
            if q.failed:
                state = "failed"
            elif self._has_input(q, nexts):
                state = "running"
            elif any(lag.values()):
                state = "waiting"
            else:  # a query waiting for input is idle; one starting or in a batch is not
                state = "running" if active and q.activity else "idle"
            out.append(ProcStats(
                q.p.name, q.p.kind, t["in"] - q.base["in"], t["out"] - q.base["out"],
                t["errors"] - q.base["errors"], t["batches"] - q.base["batches"], lag, state,
                q.failed, q.recovery, q.activity if not q.failed else "",
                max(0.0, now - q.activity_t0), q.detail, q.retries))
        return out

    @property
    def failed(self) -> dict[str, str]:
        """Processors whose query stopped with an error: name -> error."""
        return {q.p.name: q.failed for q in self.queries if q.failed}

    def recovery(self) -> dict[str, str]:
        """The recovery branch (seed 002) each processor's store state gave at start."""
        return {q.p.name: q.recovery for q in self.queries}

    def checkpoints(self) -> dict[str, str]:
        """What start-up did with each processor's Spark checkpoint."""
        return {q.p.name: q.note for q in self.queries}

    def idle(self) -> bool:
        """No processor has input."""
        nexts = self.store.next_indices()
        return not any(self._has_input(q, nexts) for q in self.queries)

    def drain(self) -> list[ProcStats]:
        """Process until no processor has input; returns the statistics."""
        return self.run(until_idle=True)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stop_queries()
        if self._lock is not None:
            lock, self._lock = self._lock, None
            with contextlib.suppress(Exception):
                lock.release()


def _clear_unfinished_first_batch(ck: Path) -> None:
    """Remove what a killed driver left of a checkpoint's first offset-log entry.

    Spark writes an entry to a hidden temporary file and renames it; a driver killed
    between the two leaves the temporary file, and Spark refuses to start batch 0 in an
    offset log that is not empty (STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY).  Without
    any entry no batch ever ran, so the leftovers carry nothing."""
    for sub in ("offsets", "commits"):
        d = ck / sub
        with contextlib.suppress(OSError):
            for name in os.listdir(d):
                if name.startswith(".") and (name.endswith(".tmp") or name.endswith(".tmp.crc")):
                    log.info("%s: removing %s, left by a driver killed while writing it", ck, name)
                    with contextlib.suppress(OSError):
                        os.unlink(d / name)


def _active(query: Any) -> bool:
    try:
        return bool(query.isActive)
    except Exception:
        return False


def _failure(exc: Any) -> tuple[str, str | None]:
    """A query's exception as (its useful line, the traceback of the user's function if
    it carries one: see ``sink._unhandled``)."""
    text = str(getattr(exc, "desc", None) or exc)
    detail = None
    a = text.find(TRACEBACK_START + "\n")
    if a >= 0:
        b = text.find("\n" + TRACEBACK_END, a)
        if b > a:
            detail = with_source(text[a + len(TRACEBACK_START) + 1:b])
    return _summary(exc), detail


def _summary(exc: Any) -> str:
    """The useful line of a query's exception (our CommitError or the function's error)."""
    text = str(getattr(exc, "desc", None) or exc)
    for marker in ("CommitError: ", "EngineError: "):
        if marker in text:
            line = text.split(marker, 1)[1].splitlines()[0]
            return line.strip()
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    for x in reversed(lines):
        if "Error:" in x and not x.startswith("at "):
            return x[:500]
    return (lines[0] if lines else repr(exc))[:500]
