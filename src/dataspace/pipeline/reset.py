"""Reprocessing a graph from the start (``dataspace pipeline reset``), and which graphs
read a stream (``dataspace stream rm`` asks before removing one).

What a graph keeps in a store, under its name (see :mod:`.exactly_once`): per processor
``graph/processor``, a *tailer* of that name on each input stream (where it goes on) and
the *backing stream* ``__backing/graph/processor`` (its steps: snapshots and attempt
records); the Spark engine also keeps a checkpoint per processor under
``DATA_DIR/spark/GRAPH``.  :func:`reset_graph` removes all of it, so that the next run
starts every processor at the first stored entry of its sources -- the way Kafka Streams'
application reset tool does -- and never removes what a source holds.

What the graph *wrote* is the user's choice, since reprocessing writes it again:

* ``outputs="delete"``: the streams the graph writes (its processors' outputs and its
  error stream) are removed too; the next run writes them afresh, each result once;
* ``outputs="keep"``: they stay, and the next run appends its results after the old ones
  (a consumer of an output then sees every result twice).  Processors reading an
  intermediate stream (one the graph writes and reads) start at its end, so they read
  only what the reprocessing writes;
* ``outputs=None`` (the default): refused (:class:`ResetRefused`) when any output holds
  entries, naming them -- a reset never duplicates or deletes results silently.

Consumer groups (:mod:`dataspace.streams.groups`) are readers of their own, outside any
graph: a reset leaves those of the graph's sources as they are; those of an output it
removes go with it (their pending entries too: the plan names them); those of an output
it keeps stay where they are, so they get the reprocessed results as new entries after
the old ones (the plan says so).

A sink's own record of delivered steps (:class:`~.sinks.SQLiteSink`'s deliveries table)
is outside the store: a reprocessed step that reads exactly the messages of an earlier
one has the same delivery hash and is skipped there; clear the sink's tables to redo its
effects.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..streams.base import Store, StreamNotFound
from .engine import EngineError, claim_graph, graph_holder
from .exactly_once import backing_stream
from .graph import Graph

__all__ = ["OUTPUTS", "ResetPlan", "ResetRefused", "graph_readers", "plan_reset", "reset_graph"]

OUTPUTS = ("keep", "delete")
_BACKING = backing_stream("")  # "__backing/"


class ResetRefused(EngineError):
    """The reset would duplicate or lose something without being told to (the message
    says what and which option decides)."""


def graph_readers(store: Store, stream: str) -> list[str]:
    """The processors (``graph/processor``) that read ``stream``: its tailers named like a
    processor id that has a backing stream (what every engine keeps for a processor it
    ran).  Empty for a stream that does not exist."""
    try:
        info = store.stream_info(stream)
    except StreamNotFound:
        return []
    return [t.name for t in info.tailers
            if "/" in t.name and store.has_stream(backing_stream(t.name))]


@dataclass
class ResetPlan:
    """What :func:`reset_graph` removes (or did)."""

    graph: str
    outputs: str | None
    tailers: list[tuple[str, str]] = field(default_factory=list)
    """(stream, tailer) removed: the processors start at the stream's first entry."""
    to_end: list[tuple[str, str, int]] = field(default_factory=list)
    """(stream, tailer, index): intermediate streams kept; the tailer starts at their end."""
    backing: list[str] = field(default_factory=list)
    """Backing streams removed."""
    written: dict[str, int] = field(default_factory=dict)
    """The streams the graph writes that exist, with their entry counts."""
    spark_dirs: list[Path] = field(default_factory=list)
    """Spark checkpoint directories removed."""
    groups: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    """The consumer groups of the streams the graph writes, (name, pending entries) by
    stream: removed with their stream, or left where they are."""
    source_groups: dict[str, list[str]] = field(default_factory=dict)
    """The consumer groups of the streams the graph only reads: not touched."""

    @property
    def deleted_outputs(self) -> list[str]:
        return list(self.written) if self.outputs == "delete" else []

    def lines(self) -> list[str]:
        """What the plan does, one line per kind of thing (for the command's output)."""
        out = []
        if self.tailers:
            by: dict[str, list[str]] = {}
            for s, t in self.tailers:
                by.setdefault(s, []).append(t)
            out.append("positions: " + "; ".join(f"{s} ({', '.join(ts)})" for s, ts in by.items())
                       + " -- read again from the first stored entry")
        if self.to_end:
            out.append("intermediate streams kept, read from their end: "
                       + ", ".join(f"{s} at {i:,}" for s, _t, i in self.to_end))
        if self.backing:
            out.append(f"backing streams: {', '.join(self.backing)}")
        if self.spark_dirs:
            out.append(f"Spark checkpoints: {', '.join(str(d) for d in self.spark_dirs)}")
        if self.written:
            listed = ", ".join(f"{s} ({_entries(n)})" for s, n in self.written.items())
            if self.outputs == "delete":
                out.append(f"output streams removed: {listed}")
            else:
                out.append(f"output streams kept (the next run appends after them): {listed}")
        groups = {s: gs for s, gs in self.groups.items() if s in self.written and gs}
        if groups:
            listed = "; ".join(f"{s} ({', '.join(_group(g, n) for g, n in gs)})"
                               for s, gs in groups.items())
            if self.outputs == "delete":
                out.append(f"consumer groups removed with their streams: {listed}")
            else:
                out.append("consumer groups of kept outputs, left where they are (they get the "
                           f"reprocessed results as new entries): {listed}")
        if self.source_groups:
            listed = "; ".join(f"{s} ({', '.join(gs)})" for s, gs in self.source_groups.items())
            out.append(f"consumer groups of its sources, not touched: {listed}")
        return out

    @property
    def empty(self) -> bool:
        return not (self.tailers or self.to_end or self.backing or self.spark_dirs
                    or self.deleted_outputs)


def _entries(n: int) -> str:
    return f"{n:,} {'entry' if n == 1 else 'entries'}"


def _group(name: str, pending: int) -> str:
    return f"{name} with {pending:,} pending" if pending else name


def _written(graph: Graph) -> list[str]:
    out = list(graph.producers())
    if graph.error_stream and graph.error_stream not in out:
        out.append(graph.error_stream)
    return out


def plan_reset(store: Store, graph: Graph, *, outputs: str | None = None,
               spark_dirs: Sequence[Path] = ()) -> ResetPlan:
    """What :func:`reset_graph` would do (read-only); :class:`ResetRefused` when it
    would refuse (see the module docstring).  ``spark_dirs``: the graph's Spark
    directories to remove (those that exist are listed)."""
    if outputs not in (None, *OUTPUTS):
        raise ValueError(f"outputs must be None, 'keep' or 'delete', not {outputs!r}")
    name = graph.name
    plan = ResetPlan(name, outputs)
    written = _written(graph)
    inputs = {s for p in graph.processors.values() for s in p.inputs}
    prefix = f"{name}/"
    procs = {graph.proc_id(p) for p in graph.processors.values()}
    # Backing streams of the graph's processors -- those it has now, and those of
    # processors since renamed or removed (their tailers go too).
    streams = store.streams(include_internal=True)
    plan.backing = [s.name for s in streams if s.name.startswith(_BACKING + prefix)]
    ids = procs | {b[len(_BACKING):] for b in plan.backing}
    for s in streams:
        if s.internal:
            continue
        if s.name in written:
            plan.written[s.name] = s.count
            plan.groups[s.name] = [(g.name, g.pending) for g in s.groups]
        elif s.name in inputs and s.groups:
            plan.source_groups[s.name] = [g.name for g in s.groups]
        for t in s.tailers:
            if t.name not in ids:
                continue
            if s.name in written and s.name in inputs and outputs == "keep":
                plan.to_end.append((s.name, t.name, s.next))
            elif not (s.name in written and outputs == "delete"):
                plan.tailers.append((s.name, t.name))
    plan.spark_dirs = [Path(d) for d in spark_dirs if Path(d).exists()]
    ran = bool(plan.backing or plan.tailers or plan.to_end or plan.spark_dirs)
    # Outputs matter when the graph ran here -- or when told to delete them (which also
    # finishes a reset interrupted before it got to them).
    plan.written = {s: n for s, n in plan.written.items()
                    if outputs == "delete" or (ran and n)}
    if outputs is None and plan.written:
        listed = ", ".join(f"{s} ({_entries(n)})" for s, n in plan.written.items())
        raise ResetRefused(
            f"graph {name!r} has written results to {listed}; reprocessing writes them "
            "again: add --delete-outputs to remove those streams (each result then once), "
            "or --keep-outputs to append the new results after the old ones")
    if outputs == "delete":
        for s in plan.written:
            others = sorted({r for r in graph_readers(store, s) if r not in ids})
            if others:
                raise ResetRefused(
                    f"the output {s!r} of graph {name!r} is read by {', '.join(others)}; "
                    "reset that graph too, or keep the outputs (--keep-outputs)")
    return plan


def reset_graph(store: Store, graph: Graph, *, outputs: str | None = None,
                spark_dirs: Sequence[Path] = (), dry_run: bool = False) -> ResetPlan:
    """Make the next run of ``graph`` process its sources from the start (see the module
    docstring): remove its tailers, backing streams and ``spark_dirs``, and with
    ``outputs="delete"`` the streams it writes.  Refused while the graph runs (its lock
    ``graph:NAME`` is held -- and held here while the reset works, so no run starts
    meanwhile).  Returns what was done; ``dry_run``: what would be, changing nothing.

    Not one transaction (a store deletes a stream in a transaction of its own), but
    every partial state is safe: the processors then carry on where they were, and
    running the reset again finishes it.  The order: Spark checkpoints, tailers, backing
    streams, then the outputs."""
    holder = graph_holder(store, graph.name)
    if holder is not None:
        raise EngineError(f"graph {graph.name!r} is running on this store ({holder}); stop "
                          "it first -- a reset under a running graph would break exactly-once")
    plan = plan_reset(store, graph, outputs=outputs, spark_dirs=spark_dirs)
    if dry_run:
        return plan
    lock = claim_graph(store, graph.name)
    try:
        for d in plan.spark_dirs:
            if d.is_dir():
                shutil.rmtree(d)
            else:
                with contextlib.suppress(FileNotFoundError):
                    d.unlink()
        for s, t in plan.tailers:
            store.delete_tailer(s, t)
        for s, t, i in plan.to_end:
            store.set_position(s, t, i)
        for b in plan.backing:
            store.delete_stream(b)
        for s in plan.deleted_outputs:
            store.delete_stream(s)
    finally:
        lock.release()
    return plan
