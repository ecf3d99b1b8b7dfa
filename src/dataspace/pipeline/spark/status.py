"""What the Spark engine left on disk about each processor's query: checkpoint, running
totals and last progress (stdlib only: ``pipeline status`` reads it without Spark).

Per processor, under ``DATA_DIR/spark/GRAPH/PROCESSOR/`` (or ``--checkpoint-dir``):

``checkpoint/``
    Spark's checkpoint (offset log, commit log, state).
``totals.json``
    Written by the sink after each committed batch: ``batches``, ``in`` (input
    messages), ``out`` (messages written), ``errors``, the last ``batch`` id, ``time_ms``.
``progress.json``
    Written by the running engine every progress interval: the query's last progress
    (``batch``, ``input_rows``, ``processed_rows_per_s``, ``duration_ms``...).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .offsets import offset_ranges

__all__ = ["QueryStatus", "checkpoint_state", "default_data_dir_for", "graph_dir", "query_status",
           "store_graph_dir"]


def graph_dir(data_dir: str | os.PathLike[str], graph: str) -> Path:
    """Where the Spark engine keeps a graph's checkpoints and progress files."""
    return Path(data_dir) / "spark" / graph


def store_graph_dir(store_url: str, data_dir: str | os.PathLike[str], graph: str) -> Path:
    """:func:`graph_dir` for a graph on the store at ``store_url``: ``DATA_DIR/spark/GRAPH``
    for an SQLite store, ``DATA_DIR/spark/pg-KEY/GRAPH`` for a PostgreSQL one (KEY names
    its server and database, so two stores' checkpoints never mix)."""
    if "://" in store_url:
        from ...streams.postgres import store_key

        return Path(data_dir) / "spark" / f"pg-{store_key(store_url)}" / graph
    return graph_dir(data_dir, graph)


def default_data_dir_for(store: Any) -> Path:
    """Where a store's Spark files go by default: the SQLite store's directory, else the
    default data directory."""
    path = getattr(store, "path", None)
    if path is not None:
        return Path(path).resolve().parent
    from ...datadir import default_data_dir

    return default_data_dir()


def checkpoint_state(ck: str | os.PathLike[str]) -> tuple[int | None, int | None, dict[str, tuple[int, int]] | None]:
    """(last batch of the offset log, last committed batch, the ranges of that last
    batch) of a Spark checkpoint directory; Nones for what is absent.  A batch that
    repeats the previous one's offsets ran without new input: its ranges are empty."""
    ck = Path(ck)

    def last(sub: str) -> int | None:
        try:
            ns = [int(n) for n in os.listdir(ck / sub) if n.isdigit()]
        except OSError:
            return None
        return max(ns) if ns else None

    n, c = last("offsets"), last("commits")
    if n is None:
        return None, c, None

    def ranges_of(k: int) -> dict[str, tuple[int, int]] | None:
        try:
            lines = (ck / "offsets" / str(k)).read_text().splitlines()
        except OSError:
            return None
        out: dict[str, tuple[int, int]] = {}
        for line in lines[2:]:
            try:
                out.update(offset_ranges(json.loads(line)))
            except ValueError:
                continue
        return out

    ranges = ranges_of(n)
    if ranges and n > 0 and ranges_of(n - 1) == ranges:  # a batch without new input
        ranges = {s: (b, b) for s, (_a, b) in ranges.items()}
    return n, c, ranges


def _json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


class QueryStatus(dict):  # type: ignore[type-arg]
    """``query_status`` result: ``offsets``/``committed`` batch ids, ``totals`` and
    ``progress`` dictionaries (or None)."""


def query_status(proc_dir: str | os.PathLike[str]) -> QueryStatus | None:
    """The Spark status of one processor, or None if it never ran on Spark."""
    d = Path(proc_dir)
    if not d.is_dir():
        return None
    n, c, ranges = checkpoint_state(d / "checkpoint")
    return QueryStatus(offsets=n, committed=c, ranges=ranges, totals=_json(d / "totals.json"),
                       progress=_json(d / "progress.json"))
