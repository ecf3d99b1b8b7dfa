"""The ``dataspace`` Spark data source: streams as DataFrames, batch and streaming.

::

    spark.read.format("dataspace").option("store", DATA_DIR).option("stream", "chat").load()
    spark.readStream.format("dataspace").option("store", "postgresql://app@db/app")
         .option("stream", "chat").option("maxRowsPerBatch", 10000).load()

``store`` is a store URL (a data directory, a ``.sqlite3`` file, ``sqlite:PATH``,
``postgresql://...``); ``path`` is its older name, kept for SQLite stores.

**Offsets are stream indices** and every offset says where its micro-batch started and
ended, per stream: ``{"dataspace": {"chat": {"start": 100, "end": 250}}}``.  Spark writes
the offset of batch N to its offset log before running the batch and re-runs an
uncommitted batch with exactly that offset, so the batch's extent -- and with it the
delivery hash of seed 002 -- is in Spark's own write-ahead log; the writer reads it from
there (:mod:`.sink`).  Spark compares offsets for equality only, so carrying the start is
free; the first batch's start is the initial offset (``startingOffsets``).

**Partitions are index ranges** (``partitionRows`` each); **admission control** is by
rows: ``maxRowsPerBatch`` becomes the default read limit (``ReadMaxRows``), and a
``ReadAllAvailable`` limit from Spark (``Trigger.Once``) reads everything.
``Trigger.AvailableNow`` is supported (the target is the streams' ends when the query
starts).  Several streams in one source are read by ``mode``:

* ``each`` (default): every stream advances independently; the row budget is shared;
* ``join``: the same number of entries from every stream per batch (the join processor's
  message sets: the k-th entry of each);
* ``alts``: entries of all streams merged in commit order (``seq``), up to the budget.

When there is no new data, ``latestOffset`` sleeps until the store changes (the store's
wake-ups, no polling) for at most ``waitMs`` before answering, so idle queries cost
nothing and new data starts a batch at once.

**Rows** (schema in :func:`schema_for`): ``stream``, ``index``, ``seq``, ``time``,
``value`` (canonical binary Preserves), optionally ``meta``, and with ``decode`` (the
default) ``text``, ``label`` and ``fields``.  Reads produce Arrow record batches.
"""

from __future__ import annotations

import dataclasses
import datetime
import heapq
import itertools
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..._extras import require

try:
    from pyspark.sql.datasource import (
        DataSource,
        DataSourceReader,
        DataSourceStreamReader,
        InputPartition,
    )
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadLimit,
        ReadMaxRows,
        ReadMinRows,
        SupportsTriggerAvailableNow,
    )
    from pyspark.sql.types import StructType
except ImportError:
    require("spark", "the Spark connector")  # PySpark missing: said in one line
    raise

from ...datadir import mask_url
from ...streams.base import MAX_INDEX, Columns, StoreError, StreamNotFound
from . import faultpoints as faults
from ._store import location_option, store_for
from .offsets import KEY, make_offset, offset_ranges
from .placement import read_on

__all__ = [
    "KEY",
    "DataspaceDataSource",
    "SourceOptions",
    "make_offset",
    "offset_ranges",
    "parse_options",
    "schema_for",
]

log = logging.getLogger(__name__)

MODES = ("each", "join", "alts")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


class OptionError(ValueError):
    """A bad option of the dataspace data source (the message names it)."""


@dataclass(frozen=True)
class SourceOptions:
    """The parsed options (see docs/spark.md for each)."""

    path: str  # the store's URL (see _store.location_option)
    streams: tuple[str, ...]
    mode: str = "each"
    max_rows: int | None = 100_000
    partition_rows: int = 50_000
    starting: Any = "earliest"
    ending: Any = "latest"
    decode: bool = True
    meta: bool = False
    time: bool = True
    read_on: str = "executor"
    wait_ms: int = 500
    tailer: str | None = None
    first_batch: dict[str, dict[str, int]] | None = None
    arrow: bool = True
    processor: str | None = None  # a packed processor spec: read tasks run and stage it


def _bool(opts: Mapping[str, str], name: str, default: bool) -> bool:
    v = opts.get(name)
    if v is None:
        return default
    v = str(v).strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise OptionError(f"option {name}: expected true or false, not {v!r}")


def _int(opts: Mapping[str, str], name: str, default: int | None, lo: int = 1) -> int | None:
    v = opts.get(name)
    if v is None:
        return default
    t = str(v).strip().lower()
    if name == "maxRowsPerBatch" and t in ("all", "none", "0", "unlimited"):
        return None
    try:
        n = int(t)
    except ValueError:
        raise OptionError(f"option {name}: expected a whole number, not {v!r}") from None
    if n < lo:
        raise OptionError(f"option {name}: must be at least {lo}, not {n}")
    return n


def _offsets_option(v: str | None, name: str, default: str) -> Any:
    if v is None:
        return default
    t = str(v).strip()
    if t.lower() in ("earliest", "latest"):
        return t.lower()
    try:
        d = json.loads(t)
    except ValueError:
        raise OptionError(f"option {name}: 'earliest', 'latest' or JSON like "
                          f'{{"stream": 42}}, not {t!r}') from None
    if not isinstance(d, dict) or not all(
            isinstance(k, str) and type(x) is int and 0 <= x <= MAX_INDEX for k, x in d.items()):
        raise OptionError(f'option {name}: JSON must map stream names to indices, like {{"chat": 42}}')
    return d


def parse_options(opts: Mapping[str, str]) -> SourceOptions:
    """Validate the data source's options (raises :class:`OptionError`)."""
    try:
        path = location_option(opts, "the dataspace source")
    except ValueError as e:
        raise OptionError(str(e)) from None
    if not path:
        raise OptionError("the dataspace source needs .option('store', URL) (a data "
                          "directory, a .sqlite3 file, sqlite:PATH or postgresql://...) or "
                          ".load(DATA_DIR)")
    names = opts.get("streams") or opts.get("stream")
    if not names:
        raise OptionError("the dataspace source needs .option('stream', NAME) (or 'streams', "
                          "comma-separated)")
    streams = tuple(s.strip() for s in str(names).split(",") if s.strip())
    if len(set(streams)) != len(streams):
        raise OptionError(f"option streams: {names!r} names a stream twice")
    mode = str(opts.get("mode") or "each").lower()
    if mode not in MODES:
        raise OptionError(f"option mode: one of {', '.join(MODES)}, not {mode!r}")
    read_on = str(opts.get("readOn") or "executor").lower()
    if read_on not in ("executor", "driver"):
        raise OptionError(f"option readOn: executor or driver, not {read_on!r}")
    if opts.get("processor") and read_on != "executor":
        raise OptionError("option processor: its read tasks run the processor, so they must "
                          "read the store themselves (readOn=executor)")
    first = opts.get("firstBatch")
    first_batch = None
    if first:
        first_batch = json.loads(first)
    return SourceOptions(
        path=path,
        streams=streams,
        mode=mode,
        max_rows=_int(opts, "maxRowsPerBatch", 100_000),
        partition_rows=_int(opts, "partitionRows", 50_000) or 50_000,
        starting=_offsets_option(opts.get("startingOffsets"), "startingOffsets", "earliest"),
        ending=_offsets_option(opts.get("endingOffsets"), "endingOffsets", "latest"),
        decode=_bool(opts, "decode", True),
        meta=_bool(opts, "includeMeta", False),
        time=_bool(opts, "includeTime", True),
        read_on=read_on,
        wait_ms=_int(opts, "waitMs", 500, lo=0) or 0,
        tailer=opts.get("tailer") or None,
        first_batch=first_batch,
        arrow=_bool(opts, "arrow", True),
        processor=opts.get("processor") or None,
    )


def schema_for(o: SourceOptions) -> str:
    """The DataFrame schema (DDL) for these options."""
    if o.processor is not None:
        return "staged binary"
    cols = ["stream string", "index bigint", "seq bigint", "time timestamp", "value binary"]
    if not o.time:
        cols.remove("time timestamp")
    if o.meta:
        cols.append("meta binary")
    if o.decode:
        cols += ["text string", "label string", "fields array<string>"]
    return ", ".join(cols)


# -- reading ----------------------------------------------------------------------------------


class RangePartition(InputPartition):
    """One task's share of a batch: index ranges ``(stream, start, end)``; with
    ``readOn=driver`` also the rows, read by the driver (for clusters whose workers cannot
    open the store)."""

    def __init__(self, ranges: list[tuple[str, int, int]], data: list[Columns] | None = None,
                 batch: tuple[dict[str, int], dict[str, int]] | None = None) -> None:
        super().__init__(ranges)
        self.ranges = ranges
        self.data = data
        self.batch = batch  # the micro-batch's starts and ends (staged processing)

    def __repr__(self) -> str:
        return f"RangePartition({self.ranges})"


def _split(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)] if hi > lo else []


def _existing_store(path: str) -> Any:
    """The store at ``path`` for a read: StoreError (one line) if there is none."""
    if "://" not in path and not os.path.exists(path):
        raise StoreError(f"no stream store at {path}; check the source's store option (a data "
                         "directory or its streams.sqlite3)")
    return store_for(path)


def _plan_partitions(o: SourceOptions, ranges: Mapping[str, tuple[int, int]]) -> list[RangePartition]:
    """Partitions for a batch reading ``ranges`` (see the module docstring for modes)."""
    store = store_for(o.path)
    size = o.partition_rows
    parts: list[list[tuple[str, int, int]]] = []
    if o.mode == "join" and len(ranges) > 1:
        eff = {}
        for s, (a, b) in ranges.items():
            first = store.first_index(s)
            eff[s] = max(a, first if first is not None else b)
        k = min(b - eff[s] for s, (_a, b) in ranges.items())
        for x, y in _split(0, max(k, 0), size):
            parts.append([(s, eff[s] + x, eff[s] + y) for s in ranges])
    elif o.mode == "alts" and len(ranges) > 1:
        # Merge by commit order; each partition is a run of the merged order, so the
        # concatenation of the partitions' outputs is in commit order.
        heads = []
        for s, (a, b) in ranges.items():
            if b > a:
                c = store.read_columns(s, a, b, values=False)
                heads.append([(q, s, i) for q, i in zip(c.seqs, c.indices)])
        merged = list(heapq.merge(*heads))
        for x, y in _split(0, len(merged), size):
            lo: dict[str, int] = {}
            hi: dict[str, int] = {}
            for _q, s, i in merged[x:y]:
                lo.setdefault(s, i)
                hi[s] = i + 1
            parts.append([(s, lo[s], hi[s]) for s in lo])
    else:
        for s, (a, b) in ranges.items():
            parts += [[(s, x, y)] for x, y in _split(a, b, size)]
    out = []
    for p in parts:
        data = None
        if o.read_on == "driver":
            data = [store.read_columns(s, a, b, meta=o.meta) for s, a, b in p]
        out.append(RangePartition(p, data))
    return out


def read_partition(o: SourceOptions, part: RangePartition) -> Iterator[Any]:
    """The rows of one partition, as Arrow record batches (or tuples with arrow=false)."""
    store = None
    for k, (s, a, b) in enumerate(part.ranges):
        if part.data is not None:
            cols = part.data[k]
        else:
            if store is None:
                store = store_for(o.path)
            cols = store.read_columns(s, a, b, meta=o.meta)
        faults.point("read")
        if not cols.indices:
            continue
        if o.arrow:
            yield to_arrow(s, cols, o)
        else:
            yield from to_tuples(s, cols, o)


def _decoded(values: list[bytes]) -> tuple[list[str], list[str | None], list[list[str] | None]]:
    from ...values import Record, Symbol, decode, stringify

    texts: list[str] = []
    labels: list[str | None] = []
    fields: list[list[str] | None] = []
    for data in values:
        try:
            v = decode(data)
        except ValueError as e:
            texts.append(f"#!undecodable ({e})")
            labels.append(None)
            fields.append(None)
            continue
        texts.append(stringify(v))
        if type(v) is Record:
            lab = v.label
            labels.append(lab.name if type(lab) is Symbol else stringify(lab))
            fields.append([stringify(f) for f in v.fields])
        else:
            labels.append(None)
            fields.append(None)
    return texts, labels, fields


def to_arrow(stream: str, cols: Columns, o: SourceOptions) -> Any:
    """One Arrow record batch of the schema :func:`schema_for`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(cols.indices)
    arrays = [pa.repeat(stream, n), pa.array(cols.indices, pa.int64()),
              pa.array(cols.seqs, pa.int64())]
    names = ["stream", "index", "seq"]
    if o.time:
        arrays.append(pc.divide(pa.array(cols.times, pa.int64()), 1000)
                      .cast(pa.timestamp("us", tz="UTC")))
        names.append("time")
    arrays.append(pa.array(cols.values, pa.binary()))
    names.append("value")
    if o.meta:
        arrays.append(pa.array(cols.metas, pa.binary()))
        names.append("meta")
    if o.decode:
        texts, labels, fields = _decoded(cols.values)
        arrays += [pa.array(texts, pa.string()), pa.array(labels, pa.string()),
                   pa.array(fields, pa.list_(pa.string()))]
        names += ["text", "label", "fields"]
    return pa.RecordBatch.from_arrays(arrays, names=names)


def to_tuples(stream: str, cols: Columns, o: SourceOptions) -> Iterator[tuple[Any, ...]]:
    """The same rows as plain tuples (the non-Arrow path, kept for comparison)."""
    extra: list[Any] = []
    if o.meta:
        extra.append(cols.metas)
    if o.decode:
        extra += list(_decoded(cols.values))
    td = datetime.timedelta
    for k, (i, q, t, v) in enumerate(zip(cols.indices, cols.seqs, cols.times, cols.values)):
        if o.time:
            yield (stream, i, q, _EPOCH + td(microseconds=t // 1000), v, *(x[k] for x in extra))
        else:
            yield (stream, i, q, v, *(x[k] for x in extra))


# -- batch reads -----------------------------------------------------------------------------


def _resolve_start(store: Any, s: str, starting: Any) -> int:
    if isinstance(starting, dict) and s in starting:
        return int(starting[s])
    nxt = store.next_index(s)
    if starting == "latest":
        return nxt
    first = store.first_index(s)
    return nxt if first is None else first


class _BatchReader(DataSourceReader):
    def __init__(self, o: SourceOptions) -> None:
        self.o = o

    def partitions(self) -> list[RangePartition]:
        o = self.o
        if o.processor is not None:
            raise OptionError("option processor: for streaming queries only (the sink's "
                              "commit takes what the read tasks stage)")
        store = _existing_store(o.path)
        missing = [s for s in o.streams if not store.has_stream(s)]
        if missing:
            names = ", ".join(repr(s) for s in missing)
            raise StreamNotFound(f"no stream named {names} in {mask_url(o.path)} (dataspace stream ls "
                                 "lists them)")
        ranges = {}
        for s in o.streams:
            a = _resolve_start(store, s, o.starting if o.starting != "latest" else "earliest")
            b = store.next_index(s)
            if isinstance(o.ending, dict) and s in o.ending:
                b = min(b, int(o.ending[s]))
            ranges[s] = (a, max(a, b))
        # Nothing to read is one empty partition: Spark gives a reader without partitions
        # a partition of its own.
        return _plan_partitions(dataclasses.replace(o, mode="each"), ranges) or [RangePartition([])]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        if not isinstance(partition, RangePartition):
            raise TypeError(f"the dataspace source cannot read {partition!r}")
        return read_partition(self.o, partition)


# -- streaming reads -------------------------------------------------------------------------


class _StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, o: SourceOptions) -> None:
        self.o = o
        self.target: dict[str, int] | None = None

    def _store(self) -> Any:
        return store_for(self.o.path)

    def initialOffset(self) -> dict[str, Any]:
        store = self._store()
        pos = {s: _resolve_start(store, s, self.o.starting) for s in self.o.streams}
        return make_offset(pos, pos)

    def prepareForTriggerAvailableNow(self) -> None:
        store = self._store()
        self.target = {s: store.next_index(s) for s in self.o.streams}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadAllAvailable() if self.o.max_rows is None else ReadMaxRows(self.o.max_rows)

    def reportLatestOffset(self) -> dict[str, Any] | None:
        store = self._store()
        nexts = {s: store.next_index(s) for s in self.o.streams}
        return make_offset(nexts, nexts)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        faults.point("source")
        prev = {s: r[1] for s, r in offset_ranges(start).items()}
        for s in self.o.streams:
            prev.setdefault(s, _resolve_start(self._store(), s, self.o.starting))
        fb = self.o.first_batch
        if fb is not None and prev == fb["starts"]:
            return make_offset(fb["starts"], fb["ends"])  # the step recovery must retry
        store = self._store()
        gen = store.generation()
        ends = self._plan(prev, limit)
        if ends == prev and self.target is None and self.o.wait_ms > 0:
            # Nothing new: sleep until the store changes (bounded), then look once more.
            store.wait_change(gen, self.o.wait_ms / 1000.0)
            ends = self._plan(prev, limit)
        if ends == prev:
            return start
        return make_offset(prev, ends)

    def _plan(self, prev: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        """Where the next batch ends in each stream (``prev`` when nothing is new)."""
        store = self._store()
        o = self.o
        budget: int | None = None
        min_rows = 0
        if isinstance(limit, ReadMaxRows):
            budget = limit.max_rows
        elif isinstance(limit, ReadMinRows):
            min_rows = limit.min_rows
        nexts = {s: store.next_index(s) for s in o.streams}
        if self.target is not None:
            nexts = {s: min(n, self.target.get(s, n)) for s, n in nexts.items()}
        eff: dict[str, int] = {}
        avail: dict[str, int] = {}
        for s in o.streams:
            p, n = prev[s], nexts[s]
            if n <= p:
                eff[s], avail[s] = p, 0
                continue
            first = store.first_index(s)
            e = max(p, first if first is not None else n)
            eff[s], avail[s] = e, max(0, n - e)
        total = sum(avail.values())
        if total == 0 or (min_rows and total < min_rows and self.target is None):
            return dict(prev)
        ends = dict(prev)
        if o.mode == "join" and len(o.streams) > 1:
            k = min(avail.values())
            if budget is not None:
                k = min(k, budget)
            if k > 0:
                ends = {s: eff[s] + k for s in o.streams}
            return ends
        if budget is None or total <= budget:
            return {s: (eff[s] + avail[s]) if avail[s] else prev[s] for s in o.streams}
        live = [s for s in o.streams if avail[s]]
        if o.mode == "alts" and len(live) > 1:
            heads = []
            for s in live:
                c = store.read_columns(s, eff[s], eff[s] + min(avail[s], budget), values=False)
                heads.append([(q, s) for q in c.seqs])
            taken: dict[str, int] = dict.fromkeys(live, 0)
            for _q, s in itertools.islice(heapq.merge(*heads), budget):
                taken[s] += 1
            return {s: eff[s] + taken[s] if taken.get(s) else prev[s] for s in o.streams}
        # each: share the budget, smallest backlogs first (water filling).
        take: dict[str, int] = {}
        left = budget
        order = sorted(live, key=lambda s: avail[s])
        for k, s in enumerate(order):
            share = left // (len(order) - k)
            take[s] = min(avail[s], share)
            left -= take[s]
        return {s: eff[s] + take[s] if take.get(s) else prev[s] for s in o.streams}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[RangePartition]:
        faults.point("partitions")
        ranges = offset_ranges(end)
        try:
            before = offset_ranges(start)
        except ValueError:
            before = {}
        for s, (a, _b) in ranges.items():
            if s in before and before[s][1] != a:
                log.warning("batch offsets disagree: the previous batch ended at %s in %s, "
                            "this one starts at %s", before[s][1], s, a)
        parts = _plan_partitions(self.o, ranges)
        if self.o.processor is not None:
            batch = ({s: a for s, (a, _b) in ranges.items()}, {s: b for s, (_a, b) in ranges.items()})
            for p in parts:
                p.batch = batch
        return parts

    def read(self, partition: InputPartition) -> Iterator[Any]:
        if not isinstance(partition, RangePartition):
            raise TypeError(f"the dataspace source cannot read {partition!r}")
        if self.o.processor is not None:
            return _staged(self.o, partition)
        return read_partition(self.o, partition)

    def commit(self, end: dict[str, Any]) -> None:
        if self.o.tailer:
            ranges = offset_ranges(end)
            with self._store().transaction() as tx:
                tx.set_positions([(s, self.o.tailer, b) for s, (_a, b) in ranges.items()])

    def stop(self) -> None:
        pass


def _staged(o: SourceOptions, part: RangePartition) -> Iterator[Any]:
    """A partition of a staged query: the processor runs here and stages its outputs;
    one row names them (see :func:`.sink.stage_partition`)."""
    import pyarrow as pa

    from .sink import spec_of, stage_partition

    assert o.processor is not None and part.batch is not None
    blob = stage_partition(o.path, spec_of(o.processor), part.ranges, *part.batch)
    yield pa.RecordBatch.from_arrays([pa.array([blob], pa.binary())], names=["staged"])


# -- the data source ---------------------------------------------------------------------


def _executors_reach(master: str, url: str) -> bool:
    """Whether the executors of ``master`` can open the store at ``url``."""
    return read_on(master, url) == "executor"


class DataspaceDataSource(DataSource):
    """``format("dataspace")``: streams of a dataspace store, batch and streaming, read
    and write (see :mod:`dataspace.pipeline.spark.source` and ``.sink``)."""

    master: str | None = None
    """The session's master, set by ``session.register`` (None: not known)."""

    @classmethod
    def name(cls) -> str:
        return "dataspace"

    def _options(self) -> SourceOptions:
        o = parse_options(self.options)
        if o.read_on == "executor" and self.master and not _executors_reach(self.master, o.path):
            raise OptionError(
                f"readOn=executor: the executors of {self.master} cannot open the SQLite store "
                f"{o.path} (a file on the driver's machine); give them a PostgreSQL store, "
                ".option('store', 'postgresql://USER@HOST/DATABASE'), or read on the driver "
                "with .option('readOn', 'driver')")
        return o

    def schema(self) -> str:
        if self.options.get("stream") or self.options.get("streams"):
            return schema_for(self._options())
        return schema_for(SourceOptions(path="", streams=()))

    def reader(self, schema: StructType) -> DataSourceReader:
        return _BatchReader(self._options())

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return _StreamReader(self._options())

    def _tasks_write(self) -> bool:
        """Whether the write tasks can stage their rows in the store (they reach it)."""
        from ._store import is_postgres, location_option

        try:
            url = location_option(self.options, "the dataspace sink")
        except ValueError:
            return False
        if url is None:
            return False
        return is_postgres(url) or (self.master is not None and _executors_reach(self.master, url))

    def writer(self, schema: StructType, overwrite: bool) -> Any:
        from .sink import BatchWriter

        return BatchWriter(self.options, schema, stage=self._tasks_write())

    def streamWriter(self, schema: StructType, overwrite: bool) -> Any:
        from .sink import StreamWriter

        return StreamWriter(self.options, schema, stage=self._tasks_write())

