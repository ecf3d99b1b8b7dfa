"""Graph definition and validation: bad graphs are rejected before anything runs."""

from __future__ import annotations

import pytest

from dataspace.pipeline import Graph, GraphError


def ok_graph() -> Graph:
    g = Graph("g", error_stream="errors")
    g.source("a", "b")
    g.join("j", ["a", "b"], "ab", lambda x, y: [x, y])
    g.fork("f", "ab", ["x", "y"])
    g.alts("m", ["x", "y"], "merged")
    g.sink("s", "merged", lambda v, d: None)
    g.processor("p", ["a"], ["p1", "p2"], lambda ctx, v: ctx.emit("p1", v))
    g.map("errs", "errors", "error-log", lambda v: v)
    return g


def test_a_valid_graph():
    g = ok_graph()
    g.validate()
    assert [p.name for p in g.order()][:3] == ["j", "f", "m"]
    assert g.proc_id("j") == "g/j"
    assert set(g.streams()) >= {"a", "b", "ab", "x", "y", "merged", "errors", "p1", "p2"}


def test_decorators():
    g = Graph("g")
    g.source("in")

    @g.map("double", "in", "out")
    def double(v):
        return v * 2

    assert double(2) == 4
    assert g.processors["double"].fn is double
    g.validate()


def problems(g: Graph) -> str:
    with pytest.raises(GraphError) as e:
        g.validate()
    return str(e.value)


def test_unknown_stream():
    g = Graph("g")
    g.source("a")
    g.map("m", "nope", "out", lambda v: v)
    msg = problems(g)
    assert "reads unknown stream 'nope'" in msg and "graph.source('nope')" in msg


def test_cycle():
    g = Graph("g")
    g.source("a")
    g.alts("m", ["a", "c"], "b", lambda v: v)
    g.map("n", "b", "c", lambda v: v)
    assert "cycle: m -> n -> m" in problems(g)


@pytest.mark.parametrize("build, expected", [
    (lambda g: g.map("m", "a", "o", lambda x, y: x), "needs 2 arguments"),
    (lambda g: g.join("j", ["a"], "o", lambda x: x), "join 'j' needs at least 2 inputs, got 1"),
    (lambda g: g.join("j", ["a", "b"], "o", lambda x: x), "takes only 1 argument"),
    (lambda g: g.fork("f", "a", ["o"]), "fork 'f' needs at least 2 outputs, got 1"),
    (lambda g: g.alts("x", ["a", "b"], ["o", "p"]), "alts 'x' needs 1 output, got 2"),
    (lambda g: g.sink("s", "a", lambda v: None), "takes only 1 argument"),
    (lambda g: g.sink("s", "a", lambda vs, d: None, batch=True), None),
    (lambda g: g.map("m", "a", "o", "not a function"), "is not callable"),
    (lambda g: g.map("m", "a", "o"), "map 'm' needs a function"),
    (lambda g: g.processor("p", ["a"], ["o"], lambda v: v), "takes only 1 argument"),
    (lambda g: g.processor("p", ["a", "b"], ["o"], lambda ctx, v: v, mode="sideways"), "mode must be"),
    (lambda g: g.map("m", "a", "o", lambda v, *, k: v), "keyword-only"),
    (lambda g: g.map("m", "a", "a", lambda v: v), "reads a stream it writes"),
    (lambda g: g.join("j", ["a", "a"], "o", lambda x, y: x), "reads the same stream twice"),
    (lambda g: g.map("m", "a", "b", lambda v: v), "declared as a source but written by m"),
    (lambda g: g.map("m", "a", "__x", lambda v: v), "reserved"),
    (lambda g: g.map("m", "a", "bad name", lambda v: v), "invalid stream name"),
    (lambda g: (g.map("m", "a", "o", lambda v: v), g.map("m", "b", "p", lambda v: v)), "used twice"),
    (lambda g: g.map("m", "a", "o", print), None),  # builtins are trusted
    (lambda g: g.map("m", "a", "o", lambda *vs: vs), None),
])
def test_shapes(build, expected):
    g = Graph("g")
    g.source("a", "b")
    build(g)
    if expected is None:
        g.validate()
    else:
        assert expected in problems(g)


def test_every_problem_is_listed():
    g = Graph("g", error_stream="a")
    g.source("a")
    g.map("m", "x", "y", lambda v: v)
    g.join("j", ["a"], "z", lambda v: v)
    msg = problems(g)
    assert "error stream 'a' is also a source" in msg
    assert "unknown stream 'x'" in msg
    assert "join 'j' needs at least 2 inputs" in msg


def test_empty_graph_and_bad_names():
    assert "no processors" in problems(Graph("g"))
    with pytest.raises(GraphError):
        Graph("a/b")
    with pytest.raises(ValueError):
        Graph("bad name")


def test_every_problem_is_listed_with_a_duplicate_name_among_them(tmp_path):
    """A duplicate name once hid the first processor: a false "reads unknown stream", and
    neither the cycle nor the arity error behind it was reported."""
    g = Graph("g")
    g.source("chat")
    g.map("a", "chat", "x", lambda v: v)
    g.map("b", "x", "y", lambda v, w: v)         # wrong arity
    g.map("c", "y", "z", lambda v: v)
    g.map("c", "z", "y", lambda v: v)            # duplicate name, and a cycle y -> z -> y
    msg = problems(g)
    lines = msg.splitlines()[1:]
    assert "processor name 'c' used twice" in msg
    assert "map 'b': the function needs 2 arguments" in msg
    assert "the graph has a cycle: c -> c -> c" in msg
    assert "unknown stream" not in msg, msg
    assert len(lines) == 3, msg


def _graph(name="g", error_stream=None, source="a", proc="m", output="o"):
    g = Graph(name, error_stream=error_stream)
    g.source(source)
    g.map(proc, source, output, lambda v: v)
    return g


@pytest.mark.parametrize("kwargs, what", [
    ({"name": "__g"}, "graph name '__g'"),
    ({"error_stream": "__errors"}, "stream name '__errors'"),
    ({"proc": "__p"}, "processor name '__p'"),
    ({"source": "__in"}, "stream name '__in'"),
    ({"output": "__o"}, "stream name '__o'"),
])
def test_reserved_names_are_refused_for_every_name_a_graph_has(kwargs, what):
    """One rule (streams.check_user_name): a processor named __x was once accepted."""
    msg = problems(_graph(**kwargs))
    assert f"{what}: names starting with __ are reserved for the store's own streams" in msg
