"""Processor graphs: streams connected by processors, defined in Python.

>>> g = Graph("orders", error_stream="orders.errors")
>>> g.source("orders")
>>> g.source("prices")
>>> @g.join("priced", ["orders", "prices"], "priced")
... def price(order, price):
...     return order  # ...
>>> @g.fork("route", "priced", ["eu", "us"])
... def route(v):
...     return {"eu": v}
>>> g.validate()

Kinds of processor (each is one node reading one or more streams):

=========  ==========================  ============================================
kind       shape                       function
=========  ==========================  ============================================
map        1 input, 1 output           ``fn(value) -> value | None``
join       >= 2 inputs, 1 output       ``fn(v1, v2, ...) -> value | None`` (one
                                       message from each input per step)
alts       >= 2 inputs, 1 output       ``fn(value) -> value | None`` (whichever input
                                       has a message first; ``fn`` optional)
fork       1 input, >= 2 outputs       ``fn(value) -> {output: value or [values]}``
                                       (``fn`` optional: copy to every output)
sink       >= 1 input, no output       ``fn(value, delivery)`` -- side effects; or with
                                       ``batch=True`` ``fn(values, delivery)`` per step
processor  >= 1 input, any outputs     ``fn(ctx, *values)``; ``ctx.emit(stream, value)``
dataframe  >= 1 input, 1 output        ``fn(df, ...) -> DataFrame``: a Spark DataFrame
                                       transformation, one streaming DataFrame per input
                                       (Spark engine only; see docs/spark.md)
=========  ==========================  ============================================

A function returning ``None`` writes nothing (the input still counts as delivered).  With
``messages=True`` functions receive :class:`Message` objects (value, stream, index, time,
metadata) instead of bare values.  A function that raises sends an error record to the
graph's error stream when one is configured; otherwise the processor stops and its input
is kept for a retry after restart.

:meth:`Graph.validate` rejects before anything runs, listing every problem at once:
unknown input streams, streams both declared as source and written by a processor,
cycles, processors of the wrong shape (counts of inputs/outputs, function arity),
duplicate names, names reserved for the store (``__...``: graph, processor or stream).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..streams.base import check_stream_name, check_user_name

__all__ = [
    "KINDS",
    "Context",
    "Delivery",
    "Graph",
    "GraphError",
    "Message",
    "Processor",
]

KINDS = ("map", "join", "alts", "fork", "sink", "processor", "dataframe")


class GraphError(ValueError):
    """The graph is not valid (the message lists every problem found)."""


class Message:
    """An input message as given to functions declared with ``messages=True``."""

    __slots__ = ("_value", "data", "index", "meta", "stream", "time_ns")

    def __init__(self, stream: str, index: int, data: bytes, time_ns: int, meta: Any, value: Any) -> None:
        self.stream = stream
        self.index = index
        self.data = data
        self.time_ns = time_ns
        self.meta = meta
        self._value = value

    @property
    def value(self) -> Any:
        """The message's value."""
        return self._value

    @property
    def time(self) -> float:
        """When it was appended (seconds since the epoch)."""
        return self.time_ns / 1e9

    def __repr__(self) -> str:
        return f"Message({self.stream!r}, {self.index}, {self._value!r})"


@dataclass(frozen=True)
class Delivery:
    """What a side-effecting function gets to make its effects idempotent.

    ``hash`` is the delivery hash of the step (16 bytes, BLAKE2b of the canonical encoding
    of the step's snapshot: processor id, start and end index of every input); it is the
    same on every retry of the step.  ``seq`` numbers the message sets within the step
    (0, 1, ...), so ``(hash, seq)`` -- :attr:`key` -- identifies one message set for good.
    ``positions`` are the input indices of this message set.
    """

    hash: bytes
    proc: str
    seq: int = 0
    positions: Mapping[str, int] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """A stable text key for one message set: ``hash-hex:seq``."""
        return f"{self.hash.hex()}:{self.seq}"

    @property
    def hex(self) -> str:
        """The delivery hash in hex."""
        return self.hash.hex()


class Context:
    """Given to imperative processors: ``emit`` outputs, see the delivery and messages."""

    __slots__ = ("_out", "delivery", "messages", "outputs")

    def __init__(self, outputs: Sequence[str]) -> None:
        self.outputs = tuple(outputs)
        self._out: list[tuple[str, Any]] = []
        self.delivery: Delivery | None = None
        self.messages: tuple[Message, ...] = ()

    def emit(self, stream: str, value: Any) -> None:
        """Write ``value`` to the output ``stream`` (one of the processor's outputs)."""
        if stream not in self.outputs:
            raise GraphError(f"emit to {stream!r}: not an output of this processor ({', '.join(self.outputs) or 'none'})")
        self._out.append((stream, value))


@dataclass
class Processor:
    """One node of a graph (built by the :class:`Graph` methods, not directly)."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fn: Callable[..., Any] | None
    mode: str = "join"  # how inputs are read: "join" (one from each) or "alts" (any one)
    side_effects: bool = False
    batch: bool = False
    messages: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # engine-specific (dataframe)

    @property
    def reads_alts(self) -> bool:
        return self.mode == "alts" and len(self.inputs) > 1


class Graph:
    """A processor graph (see the module docstring).

    ``name`` identifies the graph in the store: processor ids are ``name/processor``, and
    their tailers and backing streams are kept under that id -- renaming a graph or a
    processor starts it afresh.  ``error_stream`` receives an error record per message
    whose function raised (None: such errors stop the processor).
    """

    def __init__(self, name: str, *, error_stream: str | None = None) -> None:
        check_stream_name(name)
        if "/" in name:
            raise GraphError(f"graph name {name!r}: '/' is not allowed")
        self.name = name
        self.error_stream = error_stream
        self.sources: list[str] = []
        self.created_sources: set[str] = set()
        """Sources declared with ``create=True``: created empty at start if missing."""
        self.processors: dict[str, Processor] = {}
        self._nodes: list[Processor] = []  # every processor added, duplicates included
        self._problems: list[str] = []

    # -- building ---------------------------------------------------------------------

    def source(self, *streams: str, create: bool = False) -> None:
        """Declare input streams fed from outside the graph (appenders, recorders).

        A source must exist in the store when the graph starts: an engine refuses a
        graph whose source is missing (a typo must not run quietly over an empty stream
        it made up), as ``dataspace pipeline check`` does.  ``create=True`` says the
        stream may not exist yet -- it is written later (a recorder, another program) --
        and the engine creates it empty at start."""
        for s in streams:
            if s in self.sources:
                self._problems.append(f"source {s!r} declared twice")
            else:
                self.sources.append(s)
            if create:
                self.created_sources.add(s)

    def _add(self, p: Processor) -> Processor:
        # A duplicate is kept for validation (its streams, shape and function are checked
        # like any other's), but the first processor of a name is the one that counts.
        if p.name in self.processors:
            self._problems.append(f"processor name {p.name!r} used twice")
        else:
            self.processors[p.name] = p
        self._nodes.append(p)
        return p

    def _node(
        self,
        kind: str,
        name: str,
        inputs: str | Iterable[str],
        outputs: str | Iterable[str],
        fn: Callable[..., Any] | None,
        *,
        mode: str = "join",
        side_effects: bool = False,
        batch: bool = False,
        messages: bool = False,
    ) -> Any:
        ins = (inputs,) if isinstance(inputs, str) else tuple(inputs)
        outs = (outputs,) if isinstance(outputs, str) else tuple(outputs)
        node = self._add(Processor(name, kind, ins, outs, fn, mode, side_effects, batch, messages))
        if fn is not None:
            return fn

        def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
            node.fn = f
            return f

        return decorate  # used as a decorator (or ignored, for the kinds where fn is optional)

    def map(self, name: str, input: str, output: str, fn: Callable[..., Any] | None = None,
            *, messages: bool = False) -> Any:
        """One input, one output: ``fn(value) -> value | None``.  Also a decorator."""
        return self._node("map", name, input, output, fn, messages=messages)

    def join(self, name: str, inputs: Iterable[str], output: str,
             fn: Callable[..., Any] | None = None, *, messages: bool = False) -> Any:
        """One message from each input per step: ``fn(v1, v2, ...)``.  Also a decorator."""
        return self._node("join", name, inputs, output, fn, messages=messages)

    def alts(self, name: str, inputs: Iterable[str], output: str,
             fn: Callable[..., Any] | None = None, *, messages: bool = False) -> Any:
        """Whichever input has a message first (in commit order): ``fn(value)``;
        without ``fn`` messages are copied through."""
        return self._node("alts", name, inputs, output, fn, mode="alts", messages=messages)

    def fork(self, name: str, input: str, outputs: Iterable[str],
             fn: Callable[..., Any] | None = None, *, messages: bool = False) -> Any:
        """One step writes to several streams: ``fn(value) -> {output: value}``; without
        ``fn`` every message is copied to every output."""
        return self._node("fork", name, input, outputs, fn, messages=messages)

    def sink(self, name: str, inputs: str | Iterable[str], fn: Callable[..., Any] | None = None,
             *, batch: bool = False, mode: str = "join", messages: bool = False) -> Any:
        """Side effects: ``fn(value, delivery)`` per message set (values of every input
        first, for several inputs), or ``fn(values, delivery)`` per step with
        ``batch=True``.  Delivered at least once; make effects idempotent with the
        delivery hash (see :class:`dataspace.pipeline.sinks.SQLiteSink`)."""
        return self._node("sink", name, inputs, (), fn, mode=mode, side_effects=True,
                          batch=batch, messages=messages)

    def processor(self, name: str, inputs: str | Iterable[str], outputs: str | Iterable[str] = (),
                  fn: Callable[..., Any] | None = None, *, mode: str = "join",
                  side_effects: bool = False, messages: bool = False) -> Any:
        """Imperative: ``fn(ctx, *values)`` calling ``ctx.emit(stream, value)`` any number
        of times.  ``mode`` is ``"join"`` or ``"alts"``."""
        return self._node("processor", name, inputs, outputs, fn, mode=mode,
                          side_effects=side_effects, messages=messages)

    def dataframe(self, name: str, inputs: str | Iterable[str], output: str,
                  fn: Callable[..., Any] | None = None, *, output_mode: str = "append",
                  **options: Any) -> Any:
        """A Spark DataFrame transformation (Spark engine only): ``fn(df, ...)`` gets one
        streaming DataFrame per input (the connector's columns: ``stream``, ``index``,
        ``time``, ``value``, ``text``, ``label``, ``fields``...) and returns a DataFrame
        whose rows become the messages of ``output`` -- so Spark SQL, joins and windowed
        aggregations work on streams.  ``output_mode`` is Spark's ``append`` (windowed
        aggregations: with a watermark) or ``complete``; other keyword options go to the
        input sources (e.g. ``decode=False``).  Also a decorator.  See docs/spark.md."""
        if output_mode not in ("append", "complete"):
            self._problems.append(
                f"dataframe {name!r}: output_mode must be append or complete, not "
                f"{output_mode!r} (Spark's Python sinks have no update mode)")
        node = self._node("dataframe", name, inputs, output, fn)
        self._nodes[-1].options = {"output_mode": output_mode, **options}
        return node

    # -- queries ----------------------------------------------------------------------

    def proc_id(self, p: Processor | str) -> str:
        """The processor id (``graph/processor``): the key of its tailers and backing stream."""
        return f"{self.name}/{p if isinstance(p, str) else p.name}"

    def streams(self) -> list[str]:
        """Every stream the graph touches (sources, outputs, the error stream)."""
        out = list(self.sources)
        for p in self._nodes:
            out += [s for s in p.inputs + p.outputs if s not in out]
        if self.error_stream and self.error_stream not in out:
            out.append(self.error_stream)
        return out

    def producers(self) -> dict[str, list[str]]:
        """Output stream -> the processors writing it."""
        prod: dict[str, list[str]] = {}
        for p in self._nodes:
            for s in p.outputs:
                prod.setdefault(s, []).append(p.name)
        return prod

    def order(self) -> list[Processor]:
        """Processors in topological order (upstream first); the graph must be valid."""
        prod = self.producers()
        done: set[str] = set()
        out: list[Processor] = []

        def visit(p: Processor) -> None:
            if p.name in done:
                return
            done.add(p.name)
            for s in p.inputs:
                for q in prod.get(s, []):
                    visit(self.processors[q])
            out.append(p)

        for p in self.processors.values():
            visit(p)
        return out

    # -- validation -------------------------------------------------------------------

    def validate(self) -> None:
        """Raise :class:`GraphError` listing every problem (before anything runs)."""
        problems = list(self._problems)
        if not self._nodes:
            problems.append("the graph has no processors")
        try:
            check_user_name(self.name, "graph")
        except ValueError as e:
            problems.append(str(e))
        for s in self.streams():
            try:
                check_user_name(s)
            except ValueError as e:
                problems.append(str(e))
        prod = self.producers()
        for s in self.sources:
            if s in prod:
                problems.append(
                    f"stream {s!r} is declared as a source but written by {', '.join(prod[s])}"
                )
        if self.error_stream:
            if self.error_stream in self.sources:
                problems.append(f"the error stream {self.error_stream!r} is also a source")
            if self.error_stream in prod:
                problems.append(f"the error stream {self.error_stream!r} is also written by {', '.join(prod[self.error_stream])}")
        known = set(self.sources) | set(prod) | ({self.error_stream} if self.error_stream else set())
        for p in self._nodes:
            problems += _shape_problems(p)
            try:
                check_user_name(p.name, "processor")
                if "/" in p.name:
                    raise ValueError(f"processor name {p.name!r}: '/' is not allowed")
            except ValueError as e:
                problems.append(str(e))
            for s in p.inputs:
                if s not in known:
                    problems.append(
                        f"processor {p.name!r} reads unknown stream {s!r}: declare it with "
                        f"graph.source({s!r}) or write it from a processor"
                    )
            if len(set(p.inputs)) != len(p.inputs):
                problems.append(f"processor {p.name!r} reads the same stream twice")
            if len(set(p.outputs)) != len(p.outputs):
                problems.append(f"processor {p.name!r} writes the same stream twice")
            if set(p.inputs) & set(p.outputs):
                problems.append(f"processor {p.name!r} reads a stream it writes")
        cycle = self._cycle()
        if cycle:
            problems.append("the graph has a cycle: " + " -> ".join(cycle))
        if problems:
            raise GraphError(
                f"graph {self.name!r} is not valid:\n  " + "\n  ".join(dict.fromkeys(problems))
            )

    def _cycle(self) -> list[str] | None:
        """A cycle through processors (named), duplicates included, or None."""
        nodes = self._nodes
        consumers: dict[str, list[int]] = {}
        for k, q in enumerate(nodes):
            for s in q.inputs:
                consumers.setdefault(s, []).append(k)
        state: dict[int, int] = {}
        stack: list[int] = []

        def visit(k: int) -> list[str] | None:
            state[k] = 1
            stack.append(k)
            for s in nodes[k].outputs:
                for q in consumers.get(s, ()):
                    if state.get(q) == 1:
                        return [nodes[x].name for x in (*stack[stack.index(q):], q)]
                    if q not in state:
                        found = visit(q)
                        if found:
                            return found
            stack.pop()
            state[k] = 2
            return None

        for k in range(len(nodes)):
            if k not in state:
                found = visit(k)
                if found:
                    return found
        return None

    def __repr__(self) -> str:
        return f"<Graph {self.name}: {len(self.processors)} processors>"


_SHAPES = {
    # kind: (min inputs, max inputs, min outputs, max outputs)
    "map": (1, 1, 1, 1),
    "join": (2, None, 1, 1),
    "alts": (2, None, 1, 1),
    "fork": (1, 1, 2, None),
    "sink": (1, None, 0, 0),
    "processor": (1, None, 0, None),
    "dataframe": (1, None, 1, 1),
}


def _count(n: int, lo: int, hi: int | None, what: str) -> str | None:
    if n < lo or (hi is not None and n > hi):
        want = str(lo) if hi == lo else f"at least {lo}" if hi is None else f"{lo} to {hi}"
        return f"{want} {what}{'' if want == '1' else 's'}, got {n}"
    return None


def _shape_problems(p: Processor) -> list[str]:
    out = []
    lo_i, hi_i, lo_o, hi_o = _SHAPES[p.kind]
    for msg in (_count(len(p.inputs), lo_i, hi_i, "input"), _count(len(p.outputs), lo_o, hi_o, "output")):
        if msg:
            out.append(f"{p.kind} {p.name!r} needs {msg}")
    if p.mode not in ("join", "alts"):
        out.append(f"processor {p.name!r}: mode must be 'join' or 'alts', not {p.mode!r}")
    if p.fn is None:
        if p.kind not in ("alts", "fork"):
            out.append(f"{p.kind} {p.name!r} needs a function")
        return out
    if not callable(p.fn):
        out.append(f"{p.kind} {p.name!r}: {p.fn!r} is not callable")
        return out
    # How many positional arguments the function is called with.
    per_set = 1 if p.mode == "alts" else len(p.inputs)
    if p.kind == "sink":
        nargs = 2 if p.batch else per_set + 1
    elif p.kind == "dataframe":
        nargs = len(p.inputs)
    elif p.kind == "processor":
        nargs = 1 + per_set
    else:
        nargs = per_set
    problem = _arity_problem(p.fn, nargs)
    if problem:
        out.append(f"{p.kind} {p.name!r}: the function {problem} (it is called with {nargs} "
                   f"argument{'s' if nargs != 1 else ''}: {_call_shape(p)})")
    return out


def _call_shape(p: Processor) -> str:
    if p.kind == "dataframe":
        return ", ".join(f"DataFrame of {s}" for s in p.inputs)
    v = "message" if p.messages else "value"
    per = [v] if p.mode == "alts" else [f"{v} of {s}" for s in p.inputs]
    if p.kind == "sink":
        return "values, delivery" if p.batch else ", ".join([*per, "delivery"])
    if p.kind == "processor":
        return ", ".join(["ctx", *per])
    return ", ".join(per)


def _arity_problem(fn: Callable[..., Any], n: int) -> str | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # builtins without signatures: trust them
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        required = sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                       and p.default is p.empty)
        return None if required <= n else f"needs {required} arguments"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    kw_required = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if kw_required:
        return f"has required keyword-only arguments ({', '.join(kw_required)})"
    if required > n:
        return f"needs {required} arguments"
    if len(positional) < n:
        return f"takes only {len(positional)} argument{'s' if len(positional) != 1 else ''}"
    return None
