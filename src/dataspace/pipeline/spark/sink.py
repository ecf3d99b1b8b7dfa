"""Writing to streams from Spark, exactly once: the ``dataspace`` sink.

::

    df.writeStream.format("dataspace").option("store", URL).option("stream", "out")
      .option("checkpointLocation", CKPT).start()

``store`` is a store URL (a data directory, ``sqlite:PATH``, ``postgresql://...``);
``path`` is its older name, kept for SQLite stores.

**Where the work is done.**  For the engine's pure processors (map, join, alts, fork) the
*read* tasks do everything (:func:`stage_partition`): they read their index ranges from
the store, apply the function with the local engine's step code, and *stage* the outputs
and error records in the store (:meth:`~dataspace.streams.base.Store.stage`: written
aside under a token of the task attempt, invisible to readers); the one row each passes
on names what it staged, and the write task hands that to the commit.  So the data never
goes through Spark or the driver, and on a cluster with a PostgreSQL store the executors
do the reading and the writing.  Otherwise (DataFrame processors, the ``stream`` option)
write tasks turn their rows into encoded output messages and send them to the driver in
their commit messages.

**How a micro-batch is committed.**  The driver's :meth:`StreamWriter.commit`

1. reads the batch's offsets -- the start and end index of every dataspace input -- from
   Spark's offset log (``CKPT/offsets/<batchId>``, written by Spark *before* the batch ran,
   and re-used unchanged when Spark re-runs an uncommitted batch after a crash);
2. asks the recovery component (seed 002) what the store last delivered for this
   processor: if it is this very step (same processor id, starts and ends, hence the same
   delivery hash), it writes nothing -- the crash came between our commit and Spark's
   commit log, and Spark is re-running the batch;
3. otherwise writes the outputs, the error records, the snapshot, the attempt record
   and the tailer positions in **one store transaction**
   (:func:`~dataspace.pipeline.exactly_once.commit_step`); staged outputs are appended
   inside the store (``INSERT ... SELECT``) by the tokens of the successful task
   attempts, each checked for its row count, and everything the processor staged is
   dropped in the same transaction (attempts that lost, batches that never committed).

So a batch is in the store once or not at all, whatever is killed when.  The store also
refuses a batch that does not start where the processor's last delivered step ended (a
stale or foreign checkpoint would otherwise write data twice).

**Rows to messages.**  A processor spec (from the engine) runs the graph's function on
each partition with the local engine's own code (same results, errors, metadata).
Otherwise a row becomes a value: a binary ``value`` column is taken as canonical
Preserves (checked); else a string ``text`` column is parsed as Preserves text; else the
row becomes a dictionary ``{column: value}`` (symbols as keys, nulls left out,
timestamps and dates as ISO-8601 strings, decimals as text, arrays as sequences,
structs and maps as dictionaries).  When the rows have an ``index`` column (and a
``stream`` column, or a single input), the output's metadata names it as the source.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..._extras import require

try:
    from pyspark.sql.datasource import (
        DataSourceArrowWriter,
        DataSourceStreamArrowWriter,
        WriterCommitMessage,
    )
    from pyspark.sql.types import StructType
except ImportError:
    require("spark", "the Spark connector")  # PySpark missing: said in one line
    raise

from ...streams.base import MAX_VALUE_SIZE, check_user_name
from ...streams.integrity import StreamDigest, checksums
from ...values import Dictionary, Sequence, Symbol, decode, encode, parse
from ..exactly_once import (
    MetaEncoder,
    Recovery,
    Resume,
    Staged,
    commit_step,
    delivery_hash,
    recover,
    resume,
    source_metas,
)
from ..graph import Graph, Processor
from . import faultpoints as faults
from ._store import location_option, store_for
from .offsets import KEY, offset_ranges

__all__ = [
    "BatchWriter",
    "CommitError",
    "ProcSpec",
    "StreamWriter",
    "batch_offsets",
    "decode_spec",
    "encode_spec",
]

log = logging.getLogger(__name__)

EXECUTOR_KINDS = frozenset({"map", "join", "alts", "fork"})


class CommitError(RuntimeError):
    """The batch cannot be committed (the message says why and what to do)."""


# -- the processor spec (engine -> workers) ----------------------------------------------


@dataclass
class ProcSpec:
    """What the writer needs to run one processor of a graph."""

    graph: str
    processor: Processor
    error_stream: str | None = None
    stats_dir: str | None = None

    @property
    def proc_id(self) -> str:
        return f"{self.graph}/{self.processor.name}"

    @property
    def on_executors(self) -> bool:
        """Pure functions run in the write tasks; side effects and imperative processors
        (which see the delivery hash) run on the driver, in the commit."""
        p = self.processor
        return p.kind in EXECUTOR_KINDS and not p.side_effects

    @property
    def on_driver(self) -> bool:
        return self.processor.kind in ("sink", "processor") or self.processor.side_effects


def encode_spec(spec: ProcSpec) -> str:
    """The spec as an option string (cloudpickle, base64)."""
    from pyspark import cloudpickle

    return base64.b64encode(cloudpickle.dumps(spec)).decode("ascii")


def decode_spec(text: str) -> ProcSpec:
    import pickle

    spec = pickle.loads(base64.b64decode(text))
    if not isinstance(spec, ProcSpec):
        raise CommitError("the processor option does not hold a processor spec")
    return spec


def _runner(spec: ProcSpec) -> Any:
    """The local engine's processor runtime for ``spec`` (its ``_run`` is the function
    application: the same results, errors and metadata as the local engine)."""
    from ..local import _Proc

    return _Proc(Graph(spec.graph, error_stream=spec.error_stream), spec.processor)


# -- commit messages --------------------------------------------------------------------------


@dataclass
class BatchPart(WriterCommitMessage):
    """What one write task sends to the driver: encoded outputs per stream (metadata
    without the hash, or source positions), error records, input rows for functions run
    on the driver, the alts order of its message sets, and how many rows it read."""

    outputs: dict[str, tuple[list[bytes], list[Any]]] = field(default_factory=dict)
    errors: tuple[list[bytes], list[Any]] = field(default_factory=lambda: ([], []))
    rows: dict[str, list[tuple[Any, ...]]] | None = None
    order: list[str] | None = None
    consumed: int = 0
    hash: bytes | None = None  # the delivery hash the outputs' metadata ends with, if any
    staged: dict[str, list[tuple[str, int, bytes | None]]] | None = None
    """Outputs (and error records, under the error stream's name) the task staged in the
    store instead of carrying them: per stream, (token, rows, hash) parts."""
    sums: dict[str, int] | None = None
    """Per stream staged, the sum of the staged rows' checksums (less the index) as the
    task computed them from what it produced, where their metadata is final (the commit
    compares it with what it appended); None where it is not known."""


_INPUT_COLUMNS = frozenset({"stream", "index", "seq", "value", "meta", "staged"})


def _columns(batches: Iterator[Any], wanted: frozenset[str] | None = None) -> dict[str, list[Any]]:
    """The rows of a write task as Python lists per column (only the ``wanted`` ones:
    timestamps, for one, are slow to convert)."""
    cols: dict[str, list[Any]] = {}
    for b in batches:
        for name, col in zip(b.schema.names, b.columns):
            if wanted is None or name in wanted:
                cols.setdefault(name, []).extend(col.to_pylist())
    return cols


def _inputs(cols: dict[str, list[Any]], spec: ProcSpec) -> tuple[list[list[tuple[Any, ...]]], list[int] | None]:
    """Rows per input -- ``(index, seq, value, meta)`` as the local engine reads them --
    and the alts order (input number per message set, commit order)."""
    p = spec.processor
    ins = p.inputs
    at = {s: i for i, s in enumerate(ins)}
    rows: list[list[tuple[Any, ...]]] = [[] for _ in ins]
    streams = cols.get("stream", [])
    metas = cols.get("meta") or [None] * len(streams)
    for s, i, q, v, m in zip(streams, cols.get("index", []), cols.get("seq", []),
                             cols.get("value", []), metas):
        k = at.get(s)
        if k is None:
            raise CommitError(f"{spec.proc_id}: a row of stream {s!r}, not an input")
        rows[k].append((i, q, v, m))
    for r in rows:
        r.sort()
    return rows, _order(rows, spec)


def _order(rows: list[list[tuple[Any, ...]]], spec: ProcSpec) -> list[int] | None:
    """The alts order of rows per input (input number per message set, commit order);
    None for other kinds, after checking that a join's inputs line up."""
    p = spec.processor
    ins = p.inputs
    order = None
    if p.reads_alts:
        order = [k for _q, k in sorted((row[1], k) for k, r in enumerate(rows) for row in r)]
    elif len(ins) > 1:
        n = {len(r) for r in rows}
        if len(n) > 1:
            raise CommitError(f"{spec.proc_id}: a join task got unequal inputs "
                              f"({', '.join(f'{s}: {len(r)}' for s, r in zip(ins, rows))})")
    return order


def _output_name(name: str) -> str:
    try:
        return check_user_name(name)
    except ValueError as e:
        raise CommitError(f"option stream: {e}") from None


TRACEBACK_START = "-- the function's traceback --"
TRACEBACK_END = "-- end of the function's traceback --"


def _unhandled(spec: ProcSpec, u: Any) -> CommitError:
    # What the function raised, where (the local engine's line): the engine says which
    # processor stopped and that the batch is kept.  The user's traceback rides along
    # between markers, through Spark's error, to the driver (engine._failure).
    return CommitError(f"{u.line}\n{TRACEBACK_START}\n{u.detail}\n{TRACEBACK_END}")


def run_on_executor(spec: ProcSpec, cols: dict[str, list[Any]], h: bytes | None = None) -> BatchPart:
    """Apply a pure function to one partition's rows; with the batch's delivery hash
    ``h`` the outputs' metadata is complete (the commit then writes it as it is)."""
    rows, order = _inputs(cols, spec)
    return _apply(spec, rows, order, h)


def _apply(spec: ProcSpec, rows: list[list[tuple[Any, ...]]], order: list[int] | None,
           h: bytes | None) -> BatchPart:
    from ..local import _Unhandled

    ins = spec.processor.inputs
    part = BatchPart(consumed=sum(len(r) for r in rows), hash=h)
    if spec.processor.reads_alts:
        part.order = [ins[k] for k in order or []]
    if not any(rows):
        return part
    proc = _runner(spec)
    try:
        outs, errs, _n = proc._run(rows, order, h, h is not None)
    except _Unhandled as u:
        raise _unhandled(spec, u) from u.exc
    part.outputs = {s: (list(d), list(m)) for s, (d, m) in outs.items()}
    part.errors = (list(errs[0]), list(errs[1]))
    return part


# -- staged writes: the read task computes and writes, the commit makes it visible ------------

_specs: dict[str, ProcSpec] = {}


def spec_of(text: str) -> ProcSpec:
    """The processor spec of an option string, decoded once per worker process."""
    spec = _specs.get(text)
    if spec is None:
        if len(_specs) > 64:
            _specs.clear()
        spec = _specs[text] = decode_spec(text)
    return spec


def stage_partition(url: str, spec: ProcSpec, ranges: list[tuple[str, int, int]],
                    starts: Mapping[str, int], ends: Mapping[str, int]) -> bytes:
    """Run a pure processor over one partition of a micro-batch -- its index ranges of
    the batch ``starts`` to ``ends`` -- where the rows are read, and stage the outputs
    and error records in the store under a token of this task attempt: nothing of the
    data goes through Spark.  Returns the pickled :class:`BatchPart` naming the staged
    rows, which the write task hands to the commit (one row per partition)."""
    import pickle
    import uuid

    store = store_for(url)
    ins = spec.processor.inputs
    rows_in: list[list[tuple[Any, ...]]] = [[] for _ in ins]
    for s, a, b in ranges:
        if s not in ins:
            raise CommitError(f"{spec.proc_id}: a range of stream {s!r}, not an input")
        rows_in[ins.index(s)] += store.read_rows(s, a, b, b - a)  # the local engine's rows
        faults.point("read")
    h = delivery_hash(spec.proc_id, starts, ends)
    part = _apply(spec, rows_in, _order(rows_in, spec), h)
    rows: dict[str, tuple[list[bytes], list[Any]]] = {s: o for s, o in part.outputs.items() if o[0]}
    if part.errors[0]:
        if spec.error_stream is None or spec.error_stream in rows:
            raise CommitError(f"{spec.proc_id}: error records without an error stream")
        rows[spec.error_stream] = part.errors
    token = f"{spec.proc_id}/{uuid.uuid4().hex}"
    if rows:
        store.stage(spec.proc_id, token, rows)
    faults.point("stage")
    summary = BatchPart(order=part.order, consumed=part.consumed, hash=h,
                        staged={s: [(token, len(d), h)] for s, (d, _m) in rows.items()},
                        sums={s: sum(checksums(s, d, m)) for s, (d, m) in rows.items()})
    return pickle.dumps(summary, protocol=pickle.HIGHEST_PROTOCOL)


def _stage_rows(url: str, owner: str, stream: str, datas: list[bytes], metas: list[Any],
                h: bytes | None) -> BatchPart:
    """A write task's rows staged in the store (for the connector's writers and DataFrame
    processors, whose rows come through Spark): the commit message names them."""
    import uuid

    token = f"{owner}/{uuid.uuid4().hex}"
    store_for(url, create=True).stage(owner, token, {stream: (datas, metas)})
    faults.point("stage")
    # Without a hash (a batch write) the metadata is final: the commit checks the sum.
    return BatchPart(staged={stream: [(token, len(datas), h)]},
                     sums=None if h is not None else {stream: sum(checksums(stream, datas, metas))})


def _merge_staged(blobs: list[bytes]) -> BatchPart:
    """One write task's partitions' summaries as one commit message."""
    import pickle

    out = BatchPart(staged={}, sums={})
    assert out.staged is not None
    for b in blobs:
        p = pickle.loads(b)
        if not isinstance(p, BatchPart):
            raise CommitError("a staged row that is not a batch summary")
        out.consumed += p.consumed
        for s, lst in (p.staged or {}).items():
            out.staged.setdefault(s, []).extend(lst)
        _add_sums(out, p)
        if p.order is not None:
            out.order = (out.order or []) + p.order
    return out


def _add_sums(out: BatchPart, p: BatchPart) -> None:
    """``p``'s checksum sums into ``out``'s: a stream that a part staged without one has
    none (the commit then checks its rows' count and indices only)."""
    for s in p.staged or {}:
        if out.sums is None:
            return
        if p.sums is None or s not in p.sums:
            out.sums[s] = -1  # unknown
        elif out.sums.get(s, 0) >= 0:
            out.sums[s] = out.sums.get(s, 0) + p.sums[s]


def drop_staged(store: Any, owner: str) -> None:
    """Remove what ``owner``'s tasks staged (batches aborted, task attempts that lost)."""
    store.attach_staged()
    with store.transaction() as tx:
        n = tx.drop_staged(owner)
    if n:
        log.info("%s: %d staged rows of unfinished tasks removed", owner, n)
    collect_later(store)


_collecting: set[str] = set()
_collect_lock = threading.Lock()


def collect_later(store: Any) -> None:
    """Free the space of dropped staged rows in a background thread (one per store at
    a time), while Spark goes on with the next batch."""
    key = store.url
    with _collect_lock:
        if key in _collecting:
            return
        _collecting.add(key)

    def run() -> None:
        try:
            store.collect_staged()
        except Exception as e:  # the next collection frees them
            log.debug("collecting staged rows of %s: %s", store.display, e)
        finally:
            with _collect_lock:
                _collecting.discard(key)

    threading.Thread(target=run, name="dataspace-collect-staged", daemon=True).start()


# -- rows to values -----------------------------------------------------------------------------


def _plain(x: Any) -> Any:
    """A Spark value (as pyarrow gives it) as a Preserves value."""
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return x
    if isinstance(x, (datetime.datetime, datetime.date, datetime.time)):
        return x.isoformat()
    if isinstance(x, decimal.Decimal):
        return str(x)
    if isinstance(x, dict):
        return Dictionary({Symbol(k): _plain(v) for k, v in x.items() if v is not None})
    if isinstance(x, list):
        if x and all(isinstance(e, tuple) and len(e) == 2 for e in x):  # a map
            return Dictionary({_plain(k): _plain(v) for k, v in x})
        return Sequence(_plain(e) for e in x)
    if isinstance(x, datetime.timedelta):
        return x.total_seconds()
    return str(x)


def rows_to_values(cols: dict[str, list[Any]], inputs: tuple[str, ...] = ()) -> tuple[list[bytes], list[Any]]:
    """Encoded values and source positions of rows (see the module docstring)."""
    names = list(cols)
    n = len(cols[names[0]]) if names else 0
    datas: list[bytes] = []
    if "value" in cols and (n == 0 or isinstance(next((v for v in cols["value"] if v is not None), b""), bytes)):
        for v in cols["value"]:
            if v is None:
                raise CommitError("a row has a null value column")
            try:
                decode(v)
            except ValueError as e:
                raise CommitError(f"a row's value column is not canonical Preserves: {e}") from e
            if len(v) > MAX_VALUE_SIZE:
                raise CommitError(f"a value of {len(v)} bytes is over the {MAX_VALUE_SIZE}-byte limit")
            datas.append(v)
    elif "text" in cols:
        for t in cols["text"]:
            try:
                datas.append(encode(parse(t)))
            except (ValueError, TypeError) as e:
                raise CommitError(f"a row's text column is not Preserves text: {e}") from e
    else:
        for k in range(n):
            d = Dictionary({Symbol(c): _plain(cols[c][k]) for c in names if cols[c][k] is not None})
            datas.append(encode(d))
    srcs: list[Any] = [{}] * n
    idx = cols.get("index")
    if idx is not None and all(type(i) is int for i in idx):
        st = cols.get("stream")
        if st is not None and all(isinstance(s, str) for s in st):
            srcs = [{s: i} for s, i in zip(st, idx)]
        elif len(inputs) == 1:
            srcs = [{inputs[0]: i} for i in idx]
    return datas, srcs


# -- the offsets of a batch, from Spark's offset log ----------------------------------------------


def _local_dir(location: str) -> str:
    loc = location
    if loc.startswith("file://"):
        loc = loc[len("file://"):]
    elif loc.startswith("file:"):
        loc = loc[len("file:"):]
    if "://" in loc:
        raise CommitError(
            f"checkpoint {location}: the dataspace sink reads the checkpoint's offset log, so "
            "it must be on a file system mounted on the driver (a local path, NFS, FUSE)"
        )
    return os.path.abspath(loc)


def _log_ranges(path: str, batch_id: int) -> dict[str, tuple[int, int]]:
    """The dataspace ranges in one offset-log entry (CommitError if unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise CommitError(f"cannot read Spark's offset log {path}: {e.strerror}") from e
    if not lines or not lines[0].startswith("v"):
        raise CommitError(f"{path}: not a Spark offset log entry")
    ranges: dict[str, tuple[int, int]] = {}

    def take(off: Any) -> None:
        for s, r in offset_ranges(off).items():
            if s in ranges and ranges[s] != r:
                raise CommitError(f"batch {batch_id} reads stream {s!r} twice, over different "
                                  "ranges; a processor reads each stream once")
            ranges[s] = r

    for line in lines[2:]:
        line = line.strip()
        if not line or line == "-":
            continue
        try:
            off = json.loads(line)
        except ValueError:
            continue
        if isinstance(off, dict) and KEY in off:
            take(off)
        elif isinstance(off, dict):  # a map of source name -> offset
            for v in off.values():
                if isinstance(v, dict) and KEY in v:
                    take(v)
    return ranges


def batch_offsets(checkpoint: str, batch_id: int) -> tuple[dict[str, int], dict[str, int]]:
    """The start and end index of every dataspace stream read by batch ``batch_id`` of the
    query checkpointed at ``checkpoint`` (from Spark's offset log).

    A batch whose offsets repeat the previous batch's is one Spark runs without new input
    (to let a watermark close windows): it reads nothing, ``starts == ends``.  Two such
    batches in a row (processing-time timers) cannot be told from a re-run by their
    offsets, so the sink refuses them."""
    base = os.path.join(_local_dir(checkpoint), "offsets")
    ranges = _log_ranges(os.path.join(base, str(batch_id)), batch_id)
    if not ranges:
        raise CommitError(
            f"batch {batch_id}: the query reads no dataspace stream; the dataspace sink keys "
            "each batch by its input offsets, so its input must come from "
            "spark.readStream.format('dataspace')"
        )

    def previous(n: int) -> dict[str, tuple[int, int]] | None:
        p = os.path.join(base, str(n))
        return _log_ranges(p, n) if n >= 0 and os.path.exists(p) else None

    before = previous(batch_id - 1)
    if before == ranges:  # a batch without new data
        if previous(batch_id - 2) == before:
            raise CommitError(
                f"batches {batch_id - 1} and {batch_id} both ran without new input (processing-"
                "time timers?); the dataspace sink identifies a batch by its input offsets "
                "and cannot tell the second from a re-run of the first"
            )
        ends = {s: b for s, (_a, b) in ranges.items()}
        return dict(ends), ends
    return {s: a for s, (a, _b) in ranges.items()}, {s: b for s, (_a, b) in ranges.items()}


# -- the streaming writer -----------------------------------------------------------------------


def _delivered(rec: Recovery, starts: Mapping[str, int], ends: Mapping[str, int]) -> bool:
    return not rec.retry and rec.starts == dict(starts) and rec.ends == dict(ends)


def _check_continuity(pid: str, rec: Recovery, r: Resume, starts: Mapping[str, int],
                      ends: Mapping[str, int]) -> None:
    """The batch must be the step the store expects next (see ``exactly_once.resume``)."""
    if r.retry:
        if rec.starts != dict(starts) or rec.ends != dict(ends):
            raise CommitError(
                f"{pid}: the store holds an interrupted step ({rec.starts} to {rec.ends}) and "
                f"Spark's batch is another ({dict(starts)} to {dict(ends)}); run the graph once "
                "with --engine local to finish that step, or remove the query's checkpoint"
            )
        return
    if rec.ends is None and r.note is None:
        return
    want = r.positions
    gap = {s: (want[s], a) for s, a in starts.items() if s in want and want[s] != a}
    if gap:
        raise CommitError(
            f"{pid}: this batch starts at {dict(starts)} but the store expects the next step "
            f"at {want}: the Spark checkpoint does not belong to this store's state "
            "(stale, copied or from another store); committing would lose or duplicate "
            "messages. Remove the checkpoint to start from the store's positions"
        )


class StreamWriter(DataSourceStreamArrowWriter):
    """The streaming writer (see the module docstring)."""

    def __init__(self, options: Mapping[str, str], schema: StructType, stage: bool = False) -> None:
        self.stage = stage  # the write tasks reach the store: they stage their rows
        try:
            path = location_option(options, "the dataspace sink")
        except ValueError as e:
            raise CommitError(str(e)) from None
        if not path:
            raise CommitError("the dataspace sink needs .option('store', URL) (a data directory, "
                              "sqlite:PATH or postgresql://...)")
        self.path = path
        self.checkpoint = options.get("checkpointLocation")
        if not self.checkpoint:
            raise CommitError("the dataspace sink needs .option('checkpointLocation', DIR): its "
                              "offset log identifies each batch")
        spec = options.get("processor")
        self.spec = decode_spec(spec) if spec else None
        # The rows are the read tasks' summaries of what they staged (the engine's query
        # of a pure processor), never a user's column that happens to have that name.
        self.staged_input = (self.spec is not None and self.spec.on_executors
                             and schema is not None and list(schema.fieldNames()) == ["staged"])
        if self.spec is not None:
            self.pid = self.spec.proc_id
            self.outputs = self.spec.processor.outputs
            self.inputs = self.spec.processor.inputs
            self.error_stream = self.spec.error_stream
            self.stats_dir = self.spec.stats_dir
        else:
            out = options.get("stream")
            if not out:
                raise CommitError("the dataspace sink needs .option('stream', NAME)")
            self.outputs = (_output_name(out),)
            self.inputs = tuple(s for s in (options.get("inputs") or "").split(",") if s)
            self.error_stream = None
            self.stats_dir = None
            import hashlib

            self.pid = options.get("id") or (
                "spark:" + hashlib.blake2b(_local_dir(self.checkpoint).encode(), digest_size=6).hexdigest()
            )

    # -- executors ------------------------------------------------------------------------

    def write(self, iterator: Iterator[Any]) -> BatchPart:
        spec = self.spec
        runs = spec is not None and (spec.on_executors or spec.on_driver)
        cols = _columns(iterator, _INPUT_COLUMNS if runs else None)
        faults.point("write")
        if self.staged_input:
            return _merge_staged(cols.get("staged", []))
        if spec is not None and spec.on_executors:
            return run_on_executor(spec, cols, self._task_hash())
        if spec is not None and spec.on_driver:
            rows, order = _inputs(cols, spec)
            return BatchPart(rows=dict(zip(spec.processor.inputs, rows)),
                             order=None if order is None else [spec.processor.inputs[k] for k in order],
                             consumed=sum(len(r) for r in rows))
        if not cols:
            return BatchPart()
        datas, srcs = rows_to_values(cols, self.inputs)
        if self.stage:
            h = self._task_hash()
            return _stage_rows(self.path, self.pid, self.outputs[0], datas,
                               source_metas(srcs, MetaEncoder(()).suffix(h)), h)
        return BatchPart(outputs={self.outputs[0]: (datas, srcs)})

    def _task_hash(self) -> bytes | None:
        """The delivery hash of the micro-batch this write task is part of, from Spark's
        offset log when the task can read it (the checkpoint on a file system it sees, as
        in local mode), else None (the commit adds the hash).  The commit checks it."""
        try:
            from pyspark import TaskContext

            tc = TaskContext.get()
            bid = None if tc is None else tc.getLocalProperty("streaming.sql.batchId")
            if bid is None or self.checkpoint is None:
                return None
            starts, ends = batch_offsets(self.checkpoint, int(bid))
        except (CommitError, ValueError, OSError):
            return None
        return delivery_hash(self.pid, starts, ends)

    # -- the driver ---------------------------------------------------------------------------

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        assert self.checkpoint is not None
        starts, ends = batch_offsets(self.checkpoint, batchId)
        parts = [m for m in messages if isinstance(m, BatchPart)]
        store = store_for(self.path)
        pid = self.pid
        rec = recover(store, pid)
        staging = any(part.staged is not None for part in parts)
        if _delivered(rec, starts, ends):
            log.info("%s: batch %s (%s to %s) is already in the store; nothing written",
                     pid, batchId, starts, ends)
            if staging:
                drop_staged(store, pid)
            return
        saved = {s: store.position(s, pid) for s in starts}
        _check_continuity(pid, rec, resume(rec, saved, lambda s: starts[s], list(starts)),
                          starts, ends)
        spec = self.spec
        outputs: dict[str, Any] = {}
        errors: Any = []
        order: list[str] | None = None
        hashed = False
        sums: dict[str, int] = {}
        if spec is not None and spec.on_driver:
            outputs, errors, order = self._run_on_driver(spec, parts, starts, ends)
        elif staging:
            got: dict[str, list[tuple[str, int, bytes | None]]] = {}
            summed = BatchPart(sums={})
            for part in parts:
                for s, lst in (part.staged or {}).items():
                    got.setdefault(s, []).extend(lst)
                _add_sums(summed, part)
                if part.order is not None:
                    order = (order or []) + part.order
            # The tasks' sums hold where the metadata they staged is final (their hash is
            # the batch's: the commit does not rewrite it).
            h = delivery_hash(pid, starts, ends)
            sums = {s: v for s, v in (summed.sums or {}).items()
                    if v >= 0 and all(hh == h for _t, _n, hh in got.get(s, []))}
            errs = got.pop(self.error_stream, []) if self.error_stream else []
            outputs = {s: Staged(tuple(lst)) for s, lst in got.items()}
            errors = Staged(tuple(errs))
        else:
            h = delivery_hash(pid, starts, ends)
            hashed = bool(parts) and all(part.hash == h for part in parts)
            for part in parts:
                unhash = _unhasher(part.hash) if not hashed and part.hash is not None else None
                for s, (datas, srcs) in part.outputs.items():
                    outputs.setdefault(s, []).extend(zip(datas, srcs if unhash is None else map(unhash, srcs)))
                e_datas, e_metas = part.errors
                errors.extend(zip(e_datas, e_metas if unhash is None else map(unhash, e_metas)))
                if part.order is not None:
                    order = (order or []) + part.order
        if spec is not None and spec.processor.reads_alts and order is None:
            order = []
        ordered = {s: outputs[s] for s in self.outputs if s in outputs}
        for s in outputs:
            if s not in ordered:
                raise CommitError(f"{pid}: output to {s!r}, not one of {', '.join(self.outputs)}")
        faults.point("sink")
        if staging:
            store.attach_staged()  # SQLite: the tasks' staging files
            store.defer_checkpoints()  # SQLite: the log is folded in the background instead
        tx = store.begin()
        try:
            counts = {s: len(v) for s, v in ordered.items()}
            if self.error_stream is not None and len(errors):
                counts[self.error_stream] = counts.get(self.error_stream, 0) + len(errors)
            before = {s: tx.next_index(s) for s in counts}
            wrote = commit_step(tx, pid, starts, ends, ordered, errors=errors,
                                error_stream=self.error_stream,
                                order=order if spec is not None and spec.processor.reads_alts else None,
                                hashed=hashed)
            if wrote:
                verify_appended(store, pid, before, counts, sums)
            if staging:
                tx.drop_staged(pid)
            faults.point("commit-inside")
        except BaseException:
            tx.rollback()
            raise
        tx.commit()
        if staging:
            collect_later(store)
        faults.point("commit-after")
        if wrote and self.stats_dir:
            n_out = sum(len(v) for v in ordered.values())
            _add_totals(self.stats_dir, batchId, sum(ends[s] - starts[s] for s in ends),
                        n_out, len(errors))

    def _run_on_driver(self, spec: ProcSpec, parts: list[BatchPart], starts: dict[str, int],
                       ends: dict[str, int]) -> tuple[dict[str, list[tuple[bytes, Any]]], list[tuple[bytes, Any]], list[str] | None]:
        """Sinks and imperative processors: the whole batch in one call of the local
        engine's step function, with the batch's delivery hash (side effects happen here,
        before our commit: after a crash Spark re-runs the batch with the same hash)."""
        from ..local import _Unhandled

        ins = spec.processor.inputs
        rows: list[list[tuple[Any, ...]]] = [[] for _ in ins]
        order_names: list[str] = []
        for part in parts:
            for k, s in enumerate(ins):
                rows[k].extend((part.rows or {}).get(s, []))
            if part.order:
                order_names += part.order
        for r in rows:
            r.sort()
        order = None
        if spec.processor.reads_alts:
            order = [k for _q, k in sorted((row[1], k) for k, r in enumerate(rows) for row in r)]
        h = delivery_hash(spec.proc_id, starts, ends)
        proc = _runner(spec)
        try:
            outs, errs, _n = proc._run(rows, order, h, False)
        except _Unhandled as u:
            raise _unhandled(spec, u) from u.exc
        outputs = {s: list(zip(d, m)) for s, (d, m) in outs.items()}
        errors = list(zip(errs[0], errs[1]))
        return outputs, errors, None if order is None else [ins[k] for k in order]

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.info("%s: batch %s aborted; nothing was written", self.pid, batchId)
        if any(isinstance(m, BatchPart) and m.staged is not None for m in messages):
            try:
                drop_staged(store_for(self.path), self.pid)
            except Exception as e:  # the next commit removes them
                log.warning("%s: could not remove the staged rows of batch %s: %s",
                            self.pid, batchId, e)


def verify_appended(store: Any, who: str, before: Mapping[str, int],
                    counts: Mapping[str, int], sums: Mapping[str, int] | None = None) -> None:
    """Inside a commit's transaction, before it commits: each stream of ``counts`` holds,
    from where it ended before (``before``), exactly the batch's rows -- their count, first
    and last index (one aggregate, checked as a read of that range is) and, where
    ``sums`` has the stream, the sum of their checksums as the tasks computed them from
    what they produced.  A :class:`CommitError` otherwise: the transaction is rolled
    back, nothing of the batch is committed."""
    for s, n in counts.items():
        at = before[s]
        got = store.digest(s, at)
        want = StreamDigest()
        want.add_sums(at, n, (sums or {}).get(s, 0))
        if (got.count, got.first, got.last) != (want.count, want.first, want.last):
            raise CommitError(f"{who}: the commit wrote {got} to {s!r} where the batch has "
                              f"{n} rows to append at index {at}; nothing was committed")
        if sums is not None and s in sums and got.total != want.total:
            raise CommitError(f"{who}: the {n} rows the commit appended to {s!r} at index {at} "
                              "are not the rows the tasks staged (their checksums differ); "
                              "nothing was committed")


def _unhasher(h: bytes) -> Any:
    """Metadata ending with hash ``h`` -> the same without a hash (the form the commit
    completes), for a task whose hash is not the batch's (it read another checkpoint)."""
    enc = MetaEncoder(())
    cut, tail = len(enc.suffix(h)), enc.suffix(None)

    def unhash(m: Any) -> Any:
        return m[:-cut] + tail if type(m) is bytes else m

    return unhash


def _add_totals(d: str, batch: int, consumed: int, produced: int, errors: int) -> None:
    """Running totals of a processor's commits (for progress and status)."""
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "totals.json")
    try:
        with open(path, encoding="utf-8") as f:
            t = json.load(f)
    except (OSError, ValueError):
        t = {"batches": 0, "in": 0, "out": 0, "errors": 0}
    t["batches"] += 1
    t["in"] += consumed
    t["out"] += produced
    t["errors"] += errors
    t["batch"] = batch
    t["time_ms"] = int(time.time() * 1000)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(t, f)
    os.replace(tmp, path)


# -- the batch writer -------------------------------------------------------------------------


class BatchWriter(DataSourceArrowWriter):
    """``df.write.format("dataspace")``: appends every row of the job in one transaction
    when the job commits (all or nothing; a job run twice appends twice)."""

    def __init__(self, options: Mapping[str, str], schema: StructType, stage: bool = False) -> None:
        import uuid

        self.stage = stage  # the write tasks reach the store: they stage their rows
        self.owner = f"write:{uuid.uuid4().hex}"  # this job's staged rows
        try:
            path = location_option(options, "df.write.format('dataspace')")
        except ValueError as e:
            raise CommitError(str(e)) from None
        out = options.get("stream")
        if not path or not out:
            raise CommitError("df.write.format('dataspace') needs .option('store', URL) "
                              "and .option('stream', NAME)")
        self.path = path
        self.stream = _output_name(out)

    def write(self, iterator: Iterator[Any]) -> BatchPart:
        cols = _columns(iterator)
        if not cols:
            return BatchPart()
        datas, srcs = rows_to_values(cols)
        if self.stage:
            return _stage_rows(self.path, self.owner, self.stream, datas, [None] * len(datas), None)
        return BatchPart(outputs={self.stream: (datas, srcs)})

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        parts = [m for m in messages if isinstance(m, BatchPart)]
        store = store_for(self.path, create=True)
        if self.stage:
            store.attach_staged()
        with store.transaction() as tx:
            tx.create_stream(self.stream)
            before = {self.stream: tx.next_index(self.stream)}
            summed = BatchPart(sums={})
            if self.stage:
                taken = [(t, n) for p in parts for t, n, _h in (p.staged or {}).get(self.stream, [])]
                tx.append_staged(self.stream, taken)
                tx.drop_staged(self.owner)
                count = sum(n for _t, n in taken)
                for p in parts:
                    _add_sums(summed, p)
            else:
                datas = [d for p in parts for d in p.outputs.get(self.stream, ([], []))[0]]
                tx.append_encoded(self.stream, datas)
                count = len(datas)
                summed.sums = {self.stream: sum(checksums(self.stream, datas))}
            verify_appended(store, "df.write", before, {self.stream: count},
                            {s: v for s, v in (summed.sums or {}).items() if v >= 0})
        if self.stage:
            collect_later(store)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        if self.stage:
            try:
                drop_staged(store_for(self.path, create=True), self.owner)
            except Exception as e:  # staged rows nobody takes; the space is lost until dropped
                log.warning("df.write: could not remove the staged rows of an aborted job: %s", e)
