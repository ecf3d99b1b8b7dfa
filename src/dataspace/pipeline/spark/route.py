"""Routing at Spark scale: a table of values matched against a table of patterns.

::

    from dataspace.pipeline.spark import get_session, route
    spark, _ = get_session()
    matches = route(spark, ["<Says $who _>", "<Present $who>"], "chat", data_dir=DATA_DIR)
    matches.show()          # pattern, index, captures, captures_text
    route(spark, patterns, "chat", store="postgresql://app@db/app")   # a store by URL

The patterns (concise syntax, :func:`dataspace.pattern.parse_pattern`) are broadcast;
every Python worker builds the skeleton index (:class:`dataspace.index.Index`) of all of
them **once** -- for its first partition, then reuses it for every other partition of the
job (workers are reused) -- and sends each value through it as a message: the index
visits only the handlers the value's shape and constants lead to, so the cost per value
does not grow with the number of patterns.  One output row per (pattern, value) match:

==============  ==================  =================================================
column          type                meaning
==============  ==================  =================================================
pattern         string              the pattern's id
index           bigint              the value's index (stream index, or the dataset's
                                    ``index`` column, else a generated unique id)
captures        array<binary>       the captured values, canonical binary Preserves
captures_text   array<string>       the same in Preserves text
==============  ==================  =================================================

Values come from a stream of the store, or from a Parquet/JSON dataset with a binary
``value`` column (canonical Preserves) or a string ``text`` column (Preserves text);
undecodable values are skipped (and counted in the log).
"""

from __future__ import annotations

import functools
import gc
import hashlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ...index import Index
from ...pattern import PatternError, parse_pattern
from ...progress import NO_PHASES, Phases
from ...values import ParseError, decode, encode, parse, stringify

__all__ = [
    "OUTPUT_SCHEMA",
    "RouteError",
    "find_values",
    "load_patterns",
    "route",
    "route_to",
    "values_frame",
]

log = logging.getLogger(__name__)

OUTPUT_SCHEMA = "pattern string, index bigint, captures array<binary>, captures_text array<string>"


class RouteError(ValueError):
    """Bad patterns or values (the message says where)."""


def parse_patterns(lines: Iterable[str], where: str = "patterns") -> list[tuple[str, str]]:
    """``(id, pattern text)`` from lines: one pattern per line, ``ID<TAB>PATTERN`` to name
    it (otherwise its number, from 0, is its id); blank lines and ``;`` comments skip."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith(";"):
            continue
        if "\t" in line:
            pid, _, text = line.partition("\t")
            pid, text = pid.strip(), text.strip()
        else:
            pid, text = str(len(out)), line
        try:
            parse_pattern(text)
        except (PatternError, ParseError, ValueError) as e:
            raise RouteError(f"{where}:{n}: not a pattern: {e}") from None
        if pid in seen:
            raise RouteError(f"{where}:{n}: pattern id {pid!r} used twice")
        seen.add(pid)
        out.append((pid, text))
    return out


def load_patterns(path: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """The patterns of a text file (see :func:`parse_patterns`)."""
    with open(path, encoding="utf-8") as f:
        return parse_patterns(f, str(path))


# -- the matcher (runs in Python workers) --------------------------------------------------------

_cache: dict[Any, tuple[Index, list[Any], list[str]]] = {}  # in workers
_broadcasts: dict[str, Any] = {}  # on the driver: the last table's broadcast


def _index_for(key: Any, bc: Any) -> tuple[Index, list[Any], list[str]]:
    """The index of the broadcast patterns, built once per worker process (``key``: the
    table's content hash; the broadcast is not even loaded when the index is cached)."""
    got = _cache.get(key)
    if got is None:
        sink: list[Any] = []
        ix = Index(sink)
        ids = []
        for n, (pid, text) in enumerate(bc.value):
            ix.add_handler(parse_pattern(text), n)  # type: ignore[arg-type]  # sink mode: tags
            ids.append(pid)
        sink.clear()
        if _cache:  # one pattern table at a time; the old one may go
            _cache.clear()
            gc.unfreeze()
        got = _cache[key] = (ix, sink, ids)
        # The index is long-lived and large (millions of objects at 100,000 patterns): keep
        # the cyclic collector from traversing it again and again while values stream by.
        gc.collect()
        gc.freeze()
    return got


def _match_batches(bc: Any, key: str, text_captures: bool, batches: Iterator[Any]) -> Iterator[Any]:
    import pyarrow as pa

    ix, sink, ids = _index_for(key, bc)
    send = ix.send_message
    bad = 0
    for b in batches:
        names = b.schema.names
        idx = b.column(names.index("index")).to_pylist()
        if "value" in names:
            vals = b.column(names.index("value")).to_pylist()
            text = False
        else:
            vals = b.column(names.index("text")).to_pylist()
            text = True
        o_p: list[str] = []
        o_i: list[int] = []
        o_c: list[list[bytes]] = []
        o_t: list[list[str]] = []
        for i, data in zip(idx, vals):
            if data is None:
                bad += 1
                continue
            try:
                v = parse(data) if text else decode(data)
            except ValueError:
                bad += 1
                continue
            send(v)
            if not sink:
                continue
            for _ev, tags, caps in sink:
                enc = [encode(c) for c in caps]
                txt = [stringify(c) for c in caps] if text_captures else None
                for t in tags:
                    o_p.append(ids[t])
                    o_i.append(i)
                    o_c.append(enc)
                    o_t.append(txt)  # type: ignore[arg-type]
            sink.clear()
        yield pa.RecordBatch.from_arrays(
            [pa.array(o_p, pa.string()), pa.array(o_i, pa.int64()),
             pa.array(o_c, pa.list_(pa.binary())), pa.array(o_t, pa.list_(pa.string()))],
            names=["pattern", "index", "captures", "captures_text"])
    if bad:
        log.warning("routing skipped %d undecodable values", bad)


# -- the job ---------------------------------------------------------------------------------


def find_values(source: str | os.PathLike[str], data_dir: str | os.PathLike[str] | None = None,
                *, store: str | None = None) -> tuple[Path | str, str | None]:
    """Where the values to route are, checked without Spark: ``(dataset path, None)``
    when ``source`` is a path that exists, else ``(store URL or file, stream)`` for the
    stream ``source`` of ``store`` (a store URL) or of the store in ``data_dir``.
    :class:`RouteError` names what is missing."""
    p = Path(source)
    if p.exists():
        return p, None
    from ...datadir import mask_url, store_file
    from ...streams import StoreError, open_store

    where: Path | str
    if store is not None:
        where, shown = store, mask_url(store)
    elif data_dir is None:
        raise RouteError(f"{source}: no such file or directory, and no data directory to find "
                         "a stream of that name in")
    else:
        where = shown = store_file(data_dir, create=False)
        if not where.exists():
            raise RouteError(f"{source}: no such file or directory, and no stream store in {data_dir}")
    try:
        with open_store(where, create=False) as st:
            known = st.has_stream(str(source))
    except (StoreError, ValueError) as e:
        raise RouteError(str(e)) from None
    if not known:
        raise RouteError(f"{source}: no such file or directory, nor a stream of that name "
                         f"in {shown} (dataspace stream ls lists them)")
    return where, str(source)


def values_frame(spark: Any, source: str | os.PathLike[str], data_dir: str | os.PathLike[str] | None = None,
                 *, store: str | None = None) -> Any:
    """Values to route: a Parquet/JSON dataset (file or directory) when ``source`` is a
    path that exists, otherwise the stream ``source`` of ``store`` (a store URL) or of
    the store in ``data_dir`` (:func:`find_values`).  The frame has ``index`` and
    ``value`` (or ``text``) columns.  On a cluster the executors read a PostgreSQL
    store; an SQLite store is read by the driver (:func:`.placement.read_on`)."""
    from pyspark.sql import functions as F

    from ._store import store_options, store_url
    from .placement import read_on

    p, stream = find_values(source, data_dir, store=store)
    if stream is not None:
        url = store_url(p)
        return (spark.read.format("dataspace").options(**store_options(url))
                .option("readOn", read_on(spark.sparkContext.master, url))
                .option("stream", stream).option("decode", "false").load().select("index", "value"))
    files = [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file())
    suffixes = {x.suffix.lower() for x in files}
    if ".json" in suffixes or ".jsonl" in suffixes or p.suffix.lower() in (".json", ".jsonl"):
        df = spark.read.json(str(p))
    else:
        df = spark.read.parquet(str(p))
    cols = df.columns
    if "value" not in cols and "text" not in cols:
        raise RouteError(f"{source}: the dataset needs a binary 'value' column (canonical "
                         f"Preserves) or a string 'text' column; it has {', '.join(cols)}")
    vcol = "value" if "value" in cols else "text"
    if "index" in cols:
        return df.select(F.col("index").cast("bigint").alias("index"), vcol)
    return df.select(F.monotonically_increasing_id().alias("index"), vcol)


def route(
    spark: Any,
    patterns: Sequence[str] | Sequence[tuple[str, str]] | Any,
    values: Any,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    store: str | None = None,
    text_captures: bool = True,
) -> Any:
    """Match ``values`` (a DataFrame with ``index`` and ``value``/``text`` columns, a
    stream name or a dataset path: :func:`values_frame`) against ``patterns`` (texts,
    ``(id, text)`` pairs, or a DataFrame with ``id`` and ``pattern`` columns); returns the
    DataFrame of matches (see the module docstring)."""
    if hasattr(patterns, "collect"):
        pats = [(str(r["id"]), str(r["pattern"])) for r in patterns.select("id", "pattern").collect()]
    else:
        pats = [(str(n), p) if isinstance(p, str) else (str(p[0]), str(p[1]))
                for n, p in enumerate(patterns)]
    vdf = values if hasattr(values, "mapInArrow") else values_frame(spark, values, data_dir, store=store)
    # The table's content is the cache key: a job with the same patterns reuses the
    # broadcast and the index each worker built for an earlier job.
    key = hashlib.blake2b(repr(pats).encode(), digest_size=16).hexdigest()
    bc = _broadcasts.get(key)
    if bc is None:
        for pid, text in pats:  # checked here, once per table, not in every worker
            try:
                parse_pattern(text)
            except (PatternError, ParseError, ValueError) as e:
                raise RouteError(f"pattern {pid}: {e}") from None
        for old in _broadcasts.values():
            old.unpersist()
        _broadcasts.clear()
        bc = _broadcasts[key] = spark.sparkContext.broadcast(pats)
    fn = functools.partial(_match_batches, bc, key, text_captures)
    return vdf.mapInArrow(fn, OUTPUT_SCHEMA)


def route_to(spark: Any, patterns: Sequence[tuple[str, str]], source: str, out: str,
             *, data_dir: str | os.PathLike[str] | None = None, fmt: str | None = None,
             store: str | None = None, phases: Phases | None = None) -> tuple[int, int]:
    """Run :func:`route` and write the matches to ``out`` (Parquet, or JSON by format or
    extension); returns (values read, matches written).  On a cluster ``out`` must be
    where the executors write and the driver reads alike (HDFS, S3, a shared mount).
    ``phases`` hears of the reading and the matching as each begins and ends."""
    phases = phases or NO_PHASES
    phases.begin("reading the values")
    vdf = values_frame(spark, source, data_dir, store=store)
    n_values = vdf.count()
    phases.end(f"{n_values:,} values to match")
    res = route(spark, patterns, vdf)
    fmt = fmt or ("json" if str(out).lower().endswith((".json", ".jsonl")) else "parquet")
    phases.begin(f"matching {n_values:,} values against {len(patterns):,} patterns")
    w = res.write.mode("overwrite")
    (w.json(out) if fmt == "json" else w.parquet(out))
    n_matches = spark.read.json(out).count() if fmt == "json" else spark.read.parquet(out).count()
    phases.end(f"{n_matches:,} matches written to {out}")
    return n_values, n_matches
