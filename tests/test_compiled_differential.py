"""The compiled core against its pure-Python source, in one process.

The same hypothesis-generated inputs go through the compiled modules (the running build)
and through the pure source of the same modules (``dataspace._build.load_pure``); the
results must agree: encodings, decoded values, errors, order, equality, hashes, text,
matches and skeletons.  Values cross from one build to the other through their canonical
encoding, the one representation both share.

Where the compiled core is expected (``DATASPACE_EXPECT_COMPILED=1``: ``make test`` on a
machine with a C compiler, and CI) but pure Python runs, these tests fail rather than
skip.  Under ``DATASPACE_PURE=1`` (``make test-pure``) only the build checks run.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import pickle
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dataspace._build as build
from dataspace import pattern as cpat
from dataspace.values import binary as cbin
from dataspace.values import model as cmodel
from dataspace.values import text as ctext
from strategies import annotated_values, values

EXPECTED = os.environ.get("DATASPACE_EXPECT_COMPILED", "") == "1"


def _need_compiled() -> None:
    if build.BUILD.compiled:
        return
    if EXPECTED:
        pytest.fail(
            "the compiled core was expected (DATASPACE_EXPECT_COMPILED=1) but pure Python "
            f"runs: {build.BUILD.reason}; rebuild it with `make setup`"
        )
    pytest.skip(f"pure Python runs ({build.BUILD.reason})")


@pytest.fixture(scope="module")
def pure() -> Any:
    _need_compiled()

    class Pure:
        model = build.load_pure("dataspace.values.model")
        binary = build.load_pure("dataspace.values.binary")
        text = build.load_pure("dataspace.values.text")
        pattern = build.load_pure("dataspace.pattern")

    return Pure


def test_the_build_is_what_it_says() -> None:
    """The modules imported are the ones the build reports, compiled or source."""
    # Every core module imported, so the figure does not depend on which tests ran first
    # (alone, this file has not imported the relay or the router by now).
    mods = [importlib.import_module(m) for m in build.COMPILED_MODULES]
    if build.BUILD.compiled:
        assert all(build.is_compiled_module(m) for m in mods)
        assert cmodel.COMPILED and cpat.COMPILED
        assert build.build_info()["running"] == list(build.COMPILED_MODULES)
        assert build.BUILD.describe().startswith("compiled: mypyc")
    else:
        assert not any(build.is_compiled_module(m) for m in mods)
        assert not cmodel.COMPILED
        assert build.build_info()["running"] == []
    if EXPECTED:
        assert build.BUILD.compiled, build.BUILD.reason


def test_pure_modules_load_beside_the_compiled_ones(pure: Any) -> None:
    for m in (pure.model, pure.binary, pure.text, pure.pattern):
        assert m.__name__.startswith(build.PURE_PREFIX)
        assert m.__file__.endswith(".py") and not build.is_compiled_module(m)
    assert not pure.model.COMPILED and not pure.pattern.COMPILED
    # The pure modules use each other, not the compiled ones...
    assert pure.binary.Record is pure.model.Record is not cmodel.Record
    assert pure.pattern.Record is pure.model.Record
    # ...but share the exception classes with the running build.
    assert pure.binary.DecodeError is cbin.DecodeError


def test_pure_at_run_time_imports_the_source() -> None:
    """DATASPACE_PURE=1 makes a process import the .py files even beside extensions."""
    code = (
        "import dataspace._build as b, dataspace.values.model as m, dataspace.pattern as p;"
        "print(b.BUILD.compiled, m.COMPILED, p.COMPILED, m.__file__.endswith('.py'))"
    )
    env = dict(os.environ, DATASPACE_PURE="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False", "True"]


def _to_pure(pure: Any, v: Any, annotations: bool = False) -> Any:
    data = cbin.encode(v, annotations=annotations, canonical=not annotations)
    return pure.binary.decode(data, annotations=annotations)


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """What a call did: ("ok", result) or ("error", (type name, message))."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as e:
        return "error", (type(e).__name__, str(e))


SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(values)
def test_values_encode_decode_hash_and_text_agree(pure: Any, v: Any) -> None:
    data = cbin.encode(v)
    pv = pure.binary.decode(data)
    cv = cbin.decode(data)
    assert pure.binary.encode(pv) == data
    assert cbin.encode(v, canonical=False) == pure.binary.encode(pv, canonical=False) or (
        # Insertion order of sets and dictionaries may differ after a canonical round trip.
        cbin.decode(cbin.encode(v, canonical=False)) == cv
    )
    # (Through key(): Python hashes a bare NaN by identity.)
    assert hash(cmodel.key(cv)) == hash(pure.model.key(pv))
    assert ctext.stringify(cv) == pure.text.stringify(pv) and str(cv) == str(pv)
    assert repr(cv) == repr(pv)
    assert cbin.encode(ctext.parse(ctext.stringify(cv))) == data
    assert pure.binary.encode(pure.text.parse(pure.text.stringify(pv))) == data
    assert cbin.encode(cmodel.strip(cv)) == pure.binary.encode(pure.model.strip(pv))


@SETTINGS
@given(values, values)
def test_order_and_equality_agree(pure: Any, a: Any, b: Any) -> None:
    pa, pb = _to_pure(pure, a), _to_pure(pure, b)
    assert cmodel.compare(a, b) == pure.model.compare(pa, pb)
    assert (a == b) == (pa == pb)
    assert (cmodel.key(a) == cmodel.key(b)) == (pure.model.key(pa) == pure.model.key(pb))
    sa, sb = cmodel.sort_key(a), cmodel.sort_key(b)
    psa, psb = pure.model.sort_key(pa), pure.model.sort_key(pb)
    assert (sa < sb) == (psa < psb) and (sa == sb) == (psa == psb)
    if type(a) is type(b) and not isinstance(a, bool | int | float | str | bytes):
        assert (a < b) == (pa < pb) and (a >= b) == (pa >= pb)  # the classes' own order
    ordered = sorted([a, b, a], key=cmodel.sort_key)
    pordered = sorted([pa, pb, pa], key=pure.model.sort_key)
    assert [cbin.encode(x) for x in ordered] == [pure.binary.encode(x) for x in pordered]


@SETTINGS
@given(st.lists(values, max_size=5))
def test_containers_built_from_python_data_agree(pure: Any, xs: list[Any]) -> None:
    pxs = [_to_pure(pure, x) for x in xs]
    for make in ("Sequence", "Set"):
        c = _outcome(getattr(cmodel, make), xs)
        p = _outcome(getattr(pure.model, make), pxs)
        assert c[0] == p[0]
        if c[0] == "ok":
            assert cbin.encode(c[1]) == pure.binary.encode(p[1])
            assert hash(c[1]) == hash(p[1]) and len(c[1]) == len(p[1])
    pairs = list(zip(xs, range(len(xs))))
    ppairs = list(zip(pxs, range(len(pxs))))
    cd, pd = cmodel.Dictionary(pairs), pure.model.Dictionary(ppairs)
    assert cbin.encode(cd) == pure.binary.encode(pd) and hash(cd) == hash(pd)
    for x, px in zip(xs, pxs):
        assert (x in cd) == (px in pd) and cd.get(x) == pd.get(px)
    assert cbin.encode(cmodel.Set(xs) | cmodel.Set(xs[:1])) == pure.binary.encode(
        pure.model.Set(pxs) | pure.model.Set(pxs[:1])
    )


@SETTINGS
@given(annotated_values)
def test_annotations_agree(pure: Any, v: Any) -> None:
    data = cbin.encode(v, annotations=True)
    assert pure.binary.encode(_to_pure(pure, v, True), annotations=True) == data
    cv = cbin.decode(data, annotations=True)
    pv = pure.binary.decode(data, annotations=True)
    assert cmodel.annotations_equal(cv, cv) and pure.model.annotations_equal(pv, pv)
    assert ctext.stringify(cv) == pure.text.stringify(pv)
    assert hash(cmodel.key(cv)) == hash(pure.model.key(pv))


@SETTINGS
@given(st.binary(max_size=40))
def test_arbitrary_bytes_decode_alike(pure: Any, data: bytes) -> None:
    for kw in ({}, {"annotations": True}, {"max_depth": 3}):
        c = _outcome(cbin.decode, data, **kw)
        p = _outcome(pure.binary.decode, data, **kw)
        assert c[0] == p[0], (c, p)
        if c[0] == "ok":
            assert cbin.encode(c[1], annotations=True) == pure.binary.encode(
                p[1], annotations=True
            )
        else:
            assert c[1] == p[1]


@SETTINGS
@given(st.lists(values, min_size=1, max_size=4), st.integers(1, 9))
def test_stream_decoders_agree(pure: Any, vs: list[Any], chunk: int) -> None:
    data = b"".join(cbin.encode(v) for v in vs) + b"\xb4"
    cd, pd = cbin.Decoder(), pure.binary.Decoder()
    cout: list[bytes] = []
    pout: list[bytes] = []
    for i in range(0, len(data), chunk):
        cd.feed(data[i : i + chunk])
        pd.feed(data[i : i + chunk])
        cout += [cbin.encode(x) for x in cd]
        pout += [pure.binary.encode(x) for x in pd]
        assert cd.buffered == pd.buffered
    assert cout == pout == [cbin.encode(v) for v in vs]


@SETTINGS
@given(st.text(max_size=30))
def test_arbitrary_text_parses_alike(pure: Any, text: str) -> None:
    c = _outcome(ctext.parse, text)
    p = _outcome(pure.text.parse, text)
    assert c[0] == p[0]
    if c[0] == "ok":
        assert cbin.encode(c[1]) == pure.binary.encode(p[1])
    else:
        assert c[1] == p[1]


patterns = st.recursive(
    st.one_of(
        st.just(cpat.DISCARD),
        st.just(cpat.Bind()),
        st.integers().map(cpat.Lit),
        st.text(max_size=4).map(cpat.Lit),
        values.filter(lambda v: type(v) not in (cmodel.Record, cmodel.Sequence, cmodel.Dictionary)).map(
            cpat.Lit
        ),
    ),
    lambda ch: st.one_of(
        ch.map(cpat.Bind),
        st.builds(
            cpat.Rec,
            st.sampled_from([cmodel.Symbol("a"), cmodel.Symbol("Says"), "str", 3]),
            st.dictionaries(st.integers(0, 3), ch, max_size=3),
        ),
        st.dictionaries(st.integers(0, 3), ch, max_size=3).map(cpat.Arr),
        st.lists(st.tuples(st.one_of(st.text(max_size=3), st.integers()), ch), max_size=3).map(
            cpat.Dict
        ),
    ),
    max_leaves=10,
)


def _pattern_to_pure(pure: Any, p: Any) -> Any:
    return pure.pattern.from_preserves(_to_pure(pure, cpat.to_preserves(p)))


@SETTINGS
@given(patterns, st.lists(values, max_size=4))
def test_patterns_match_alike(pure: Any, p: Any, vs: list[Any]) -> None:
    # Both sides through the canonical encoding (which orders the members of sets).
    p = cpat.from_preserves(cbin.decode(cbin.encode(cpat.to_preserves(p))))
    pp = _pattern_to_pure(pure, p)
    assert str(p) == str(pp) and repr(p) == repr(pp) and hash(p) == hash(pp)
    assert cbin.encode(cpat.to_preserves(p)) == pure.binary.encode(pure.pattern.to_preserves(pp))
    assert repr(cpat.skeleton(p)) == repr(pure.pattern.skeleton(pp))
    assert repr(cpat.skeleton(p).index_checks) == repr(pure.pattern.skeleton(pp).index_checks)
    assert p.binding_names() == pp.binding_names()
    assert str(p.normalized()) == str(pp.normalized())
    # Values the pattern matches (by construction), and others.
    inst = cpat.instantiate(p, [cmodel.Symbol("x")] * len(p.binding_names()))
    for v in [inst, *vs]:
        pv = _to_pure(pure, v)
        cm, pm = cpat.match(p, v), pure.pattern.match(pp, pv)
        assert (cm is None) == (pm is None)
        if cm is not None:
            assert cbin.encode(cmodel.Sequence(cm)) == pure.binary.encode(pure.model.Sequence(pm))
        lp, plp = cpat.lit(v), pure.pattern.lit(pv)
        assert str(lp) == str(plp) and cpat.match(lp, v) == () and pure.pattern.match(plp, pv) == ()


@SETTINGS
@given(patterns, annotated_values)
def test_patterns_and_values_pickle_and_copy_in_both_builds(pure: Any, p: Any, v: Any) -> None:
    # Compiled classes have no default way to be pickled or copied: each says its own.
    pp = _pattern_to_pure(pure, p)
    pv = _to_pure(pure, v, True)
    for pat, val, binary in ((p, v, cbin), (pp, pv, pure.binary)):
        for again in (lambda o: pickle.loads(pickle.dumps(o)), copy.copy, copy.deepcopy):
            q = again(pat)
            assert q == pat and str(q) == str(pat) and type(q) is type(pat)
            w = again(val)
            assert binary.encode(w, annotations=True) == binary.encode(val, annotations=True)


@SETTINGS
@given(st.text(max_size=30))
def test_arbitrary_pattern_text_parses_alike(pure: Any, text: str) -> None:
    c = _outcome(cpat.parse_pattern, text)
    p = _outcome(pure.pattern.parse_pattern, text)
    assert c[0] == p[0]
    assert (str(c[1]) == str(p[1])) if c[0] == "ok" else (c[1] == p[1])


# ---------------------------------------------------------------------------------------
# Deep values: a clean error in both builds, never a crash of the compiled one's C stack.


def _nest(model: Any, depth: int, kind: str) -> Any:
    v: Any = 1
    for _ in range(depth):
        if kind == "record":
            v = model.Record(model.Symbol("r"), [v])
        elif kind == "sequence":
            v = model.Sequence([v])
        elif kind == "dictionary":
            v = model.Dictionary([("k", v)])
        else:
            v = model.Set([v])
    return v


@pytest.mark.parametrize("kind", ["record", "sequence", "dictionary", "set"])
def test_deep_values_are_refused_cleanly_by_both_builds(kind: str) -> None:
    builds = [(cmodel, cbin)]
    if build.BUILD.compiled:
        builds.append(
            (build.load_pure("dataspace.values.model"), build.load_pure("dataspace.values.binary"))
        )
    for model, binary in builds:
        deep = _nest(model, 100_000, kind)
        other = _nest(model, 100_000, kind)
        if kind != "set":  # (a set hashes its element when built: its hash is cached)
            with pytest.raises(RecursionError):
                hash(deep)
            with pytest.raises(RecursionError):
                model.Set([deep])
        with pytest.raises(RecursionError):
            model.compare(deep, other)
        with pytest.raises(RecursionError):
            model.strip(deep)
        with pytest.raises(RecursionError):
            model.annotations_equal(deep, other)
        with pytest.raises(ValueError, match="deep"):
            binary.encode(deep, max_depth=1_000_000)
        with pytest.raises(binary.DecodeLimitExceeded):
            binary.decode(b"\xb5" * 100_000, max_depth=1_000_000)
        # At the codecs' limit everything works.
        ok = _nest(model, model.MAX_DEPTH - 1, kind)
        assert binary.decode(binary.encode(ok)) == ok
        assert hash(ok) == hash(binary.decode(binary.encode(ok)))
        assert model.compare(ok, ok) == 0


def test_deep_natural_data_is_refused_cleanly() -> None:
    data: Any = 1
    for _ in range(100_000):
        data = [data]
    with pytest.raises(RecursionError):
        cmodel.preserve(data)
    d: Any = 1
    for _ in range(100_000):
        d = {"k": d}
    with pytest.raises(RecursionError):
        cmodel.Record(cmodel.Symbol("r"), [d])


def test_deep_patterns_are_refused_cleanly() -> None:
    p: Any = cpat.DISCARD
    with pytest.raises(cpat.PatternError, match="deeper"):
        for _ in range(100_000):
            p = cpat.Bind(p)
    assert p._depth == 256 and hash(p) == hash(p)
    assert cpat.match(p, 1) == (1,) * 256


# ---------------------------------------------------------------------------------------
# The package shipped to Spark executors as a zip (addPyFile): compiled where it can be.

_ZIP_PROBE = (
    # (Spark's workers put the zip on the path by a relative name: so does the probe.)
    "import json, os, sys; os.chdir(os.path.dirname(sys.argv[1]));"
    "sys.path.insert(1, './' + os.path.basename(sys.argv[1]));"
    "import dataspace._build as b, dataspace.values.model as m;"
    "from dataspace.values import encode, parse;"
    "print(json.dumps([b.BUILD.compiled, b.BUILD.reason, m.__file__,"
    " encode(parse('<a 1>')).hex()]))"
)


def _probe_zip(zpath: Any, **env: str) -> list[Any]:
    e = {k: v for k, v in os.environ.items() if k != "DATASPACE_PURE"}
    e.update(env)
    out = subprocess.run(
        [sys.executable, "-c", _ZIP_PROBE, str(zpath)],
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "WARNING" not in out.stderr, out.stderr
    result: list[Any] = json.loads(out.stdout)
    assert result[3] == "b4b30161b0010184"
    return result


def test_a_zip_of_the_package_runs_compiled_where_the_platform_matches(tmp_path: Any) -> None:
    import zipfile

    from dataspace.pipeline.spark.session import write_package_zip

    zpath = tmp_path / "dataspace.zip"
    write_package_zip(zpath)
    names = zipfile.ZipFile(zpath).namelist()
    assert "dataspace/values/model.py" in names
    if build.BUILD.compiled:
        compiled, _reason, file, _ = _probe_zip(zpath)
        assert compiled, _reason
        # Extracted beside the zip (the import system cannot load extensions from a zip).
        assert file.startswith(str(tmp_path / "dataspace-core-")) and build.is_compiled_module(
            type("M", (), {"__file__": file})
        )
        # A second process uses the same extracted copy.
        assert _probe_zip(zpath)[2] == file
        assert len(list(tmp_path.glob("dataspace-core-*"))) == 1
        # DATASPACE_PURE on an executor: the source in the zip.
        compiled, reason, file, _ = _probe_zip(zpath, DATASPACE_PURE="1")
        assert not compiled and file.startswith("./dataspace.zip/") and "DATASPACE_PURE" in reason
        # A core built for another platform or Python: the source, without a warning.
        other = tmp_path / "other" / "dataspace.zip"
        other.parent.mkdir()
        with zipfile.ZipFile(zpath) as src, zipfile.ZipFile(other, "w") as dst:
            for n in src.namelist():
                data = src.read(n)
                if n == f"dataspace/{build.INFO_FILE}":
                    info = json.loads(data)
                    info["ext_suffix"] = ".cpython-399-sparc-linux-gnu.so"
                    data = json.dumps(info).encode()
                dst.writestr(n, data)
        compiled, reason, file, _ = _probe_zip(other)
        assert not compiled and file.startswith("./dataspace.zip/") and "built for" in reason
        assert not list(other.parent.glob("dataspace-core-*"))
        # A zip with no build record at all (a pure install's): said as on the driver.
        bare = tmp_path / "bare" / "dataspace.zip"
        bare.parent.mkdir()
        with zipfile.ZipFile(zpath) as src, zipfile.ZipFile(bare, "w") as dst:
            for n in src.namelist():
                if n != f"dataspace/{build.INFO_FILE}" and not n.endswith(build.extension_suffix()):
                    dst.writestr(n, src.read(n))
        compiled, reason, file, _ = _probe_zip(bare)
        assert not compiled and file.startswith("./dataspace.zip/")
        assert reason == "no compiled core installed"
    else:
        assert not any(n.endswith(build.extension_suffix()) for n in names)
        compiled, reason, file, _ = _probe_zip(zpath)
        assert not compiled and file.startswith("./dataspace.zip/")


# ---------------------------------------------------------------------------------------
# The index, the dataspace, the router and the relay: the same operations through the
# compiled modules and through their pure source, compared event by event and byte by
# byte.

SMALL_ATOMS = [1, 1.0, True, 0, -1, 300, 2**70, "x", "y", cmodel.Symbol("s"), b"x"]
small_atoms = st.sampled_from(SMALL_ATOMS)
small_labels = st.sampled_from([cmodel.Symbol("A"), cmodel.Symbol("B"), "A"])
small_keys = st.sampled_from(["k", "l", 1, True])

small_values = st.recursive(
    small_atoms,
    lambda ch: st.one_of(
        st.builds(cmodel.Record, small_labels, st.lists(ch, max_size=3)),
        st.lists(ch, max_size=3).map(cmodel.Sequence),
        st.lists(small_atoms, max_size=3).map(
            lambda xs: cmodel.Set({cmodel.key(x): x for x in xs}.values())),
        st.dictionaries(small_keys, ch, max_size=3).map(
            lambda d: cmodel.Dictionary({cmodel.key(k): (k, v) for k, v in d.items()}.values())),
    ),
    max_leaves=6,
)

small_patterns = st.recursive(
    st.one_of(st.just(cpat.DISCARD), st.just(cpat.Bind()), small_atoms.map(cpat.Lit)),
    lambda ch: st.one_of(
        ch.map(cpat.Bind),
        st.builds(cpat.Rec, small_labels, st.dictionaries(st.integers(0, 2), ch, max_size=3)),
        st.dictionaries(st.integers(0, 2), ch, max_size=3).map(cpat.Arr),
        st.lists(st.tuples(small_keys, ch), max_size=3).map(cpat.Dict),
    ),
    max_leaves=5,
)


@pytest.fixture(scope="module")
def pure_core() -> Any:
    """The pure index, dataspace, router, relay and wire, beside the compiled ones."""
    _need_compiled()

    class Pure:
        model = build.load_pure("dataspace.values.model")
        binary = build.load_pure("dataspace.values.binary")
        pattern = build.load_pure("dataspace.pattern")
        index = build.load_pure("dataspace.index")
        dataspace = build.load_pure("dataspace.dataspace")
        route = build.load_pure("dataspace.protocol.route")
        relay = build.load_pure("dataspace.protocol.relay")
        wire = build.load_pure("dataspace.protocol.wire")

    for m in (Pure.index, Pure.dataspace, Pure.route, Pure.relay, Pure.wire):
        assert m.__file__.endswith(".py") and m.__name__.startswith(build.PURE_PREFIX)
    # They use each other, not the compiled modules.
    assert Pure.relay.Entity is Pure.dataspace.Entity
    assert Pure.route.Dataspace is Pure.dataspace.Dataspace
    assert Pure.dataspace.Index is Pure.index.Index
    return Pure


def test_the_new_core_modules_run_compiled() -> None:
    """Each module listed runs compiled in the compiled build (the list is the build's)."""
    from dataspace import dataspace as cds
    from dataspace import index as cix
    from dataspace.protocol import relay as crelay
    from dataspace.protocol import route as croute
    from dataspace.protocol import wire as cwire

    names = {m.__name__ for m in (cds, cix, crelay, croute, cwire)}
    assert names <= set(build.COMPILED_MODULES)
    if build.BUILD.compiled:
        assert all(build.is_compiled_module(m) for m in (cds, cix, crelay, croute, cwire))


@st.composite
def index_scenarios(draw: Any) -> Any:
    pats = draw(st.lists(small_patterns, min_size=1, max_size=4))
    vals = draw(st.lists(small_values, min_size=1, max_size=5))
    op = st.one_of(
        st.tuples(st.just("handler"), st.integers(0, len(pats) - 1), st.integers(0, 2),
                  st.booleans()),
        st.tuples(st.just("unhandler"), st.integers(0, len(pats) - 1), st.integers(0, 2)),
        st.tuples(st.just("assert"), st.integers(0, len(vals) - 1)),
        st.tuples(st.just("retract"), st.integers(0, len(vals) - 1)),
        st.tuples(st.just("message"), st.integers(0, len(vals) - 1)),
        st.tuples(st.just("compact")),
    )
    return pats, vals, draw(st.lists(op, min_size=1, max_size=40))


def _index_run(ix_cls: Any, pattern_of: Any, value_of: Any, encode: Any, seq: Any,
               pats: list[Any], vals: list[Any], ops: list[Any]) -> list[Any]:
    """The log of one run: every callback event (with its captures' encoding) and,
    after each operation, the index's sizes and what it holds."""
    log: list[Any] = []
    ix = ix_cls()

    def callback(name: int) -> Any:
        return lambda event, caps: log.append((name, event, encode(seq(caps))))

    cbs = [callback(i) for i in range(3)]
    ps = [pattern_of(p) for p in pats]
    vs = [value_of(v) for v in vals]
    for op in ops:
        if op[0] == "handler":
            ix.add_handler(ps[op[1]], cbs[op[2]], op[3])
        elif op[0] == "unhandler":
            ix.remove_handler(ps[op[1]], cbs[op[2]])
        elif op[0] == "assert":
            ix.add_assertion(vs[op[1]])
        elif op[0] == "retract":
            ix.remove_assertion(vs[op[1]])
        elif op[0] == "message":
            ix.send_message(vs[op[1]])
        else:
            ix.compact()
        log.append(("state", ix.stats(), sorted(encode(v) for v in ix.assertions()),
                    [ix.count(v) for v in vs]))
        log.append(("matches", [[(h.pattern is not None, len(cbs_)) for h, cbs_ in
                                 ix.message_matches(v)] for v in vs]))
    return log


@SETTINGS
@given(index_scenarios())
def test_index_match_sets_under_churn_agree(pure_core: Any, scenario: Any) -> None:
    """Handlers added and removed between assertions, retractions and messages: every
    callback event, in order, and the index's state after each step are the same."""
    from dataspace.index import Index

    pats, vals, ops = scenario
    pats = [cpat.from_preserves(cbin.decode(cbin.encode(cpat.to_preserves(p)))) for p in pats]
    compiled = _index_run(Index, lambda p: p, lambda v: v, cbin.encode, cmodel.Sequence,
                          pats, vals, ops)
    pure = _index_run(pure_core.index.Index,
                      lambda p: pure_core.pattern.from_preserves(
                          pure_core.binary.decode(cbin.encode(cpat.to_preserves(p)))),
                      lambda v: pure_core.binary.decode(cbin.encode(v)),
                      pure_core.binary.encode, pure_core.model.Sequence, pats, vals, ops)
    assert compiled == pure


# A stack per build: a dataspace with a router, and server-side relays of clients that
# send raw packets (their bytes made once, with the compiled codec, and fed to both).


class _Stack:
    def __init__(self, mods: Any, clients: int, max_entries: int, metered: bool) -> None:
        self.mods = mods
        ds = mods.dataspace.Dataspace("t")
        if metered:
            ds.max_turn_events = 6
        self.ds = ds
        self.router = mods.route.MessageRouter(ds, max_entries=max_entries)
        entity = mods.dataspace.DataspaceEntity(ds)
        self.relays = []
        for i in range(clients):
            r = mods.relay.Relay(name=f"c{i}", turn=ds.turn)
            r.export_at(0, entity)
            self.relays.append(r)

    def feed(self, client: int, data: bytes) -> None:
        self.relays[client].receive_data(data)

    def output(self) -> list[Any]:
        st_ = self.router.stats
        return [[r.take_packets(), r.closed, r.error and r.error[0]] for r in self.relays] + [
            (st_.routed, st_.hits, st_.misses, st_.evictions, st_.invalidations,
             self.router.entries(), len(self.ds.index.bag))]


def _turn(events: list[Any]) -> bytes:
    from dataspace.protocol.wire import WireRef

    return cbin.encode(cmodel.Sequence([cmodel.Sequence(e) for e in events]),
                       embedded=lambda w: w.to_value() if isinstance(w, WireRef) else w)


def _message_event(body: bytes) -> bytes:
    return b"\xb5\xb0\x00\xb4\xb3\x01M" + body + b"\x84\x84"


@st.composite
def relay_scenarios(draw: Any) -> Any:
    pats = draw(st.lists(small_patterns, min_size=1, max_size=4))
    vals = draw(st.lists(small_values, min_size=1, max_size=6))
    client = st.integers(0, 2)
    op = st.one_of(
        st.tuples(st.just("observe"), client, st.integers(0, len(pats) - 1)),
        st.tuples(st.just("unobserve"), client, st.integers(0, 9)),
        st.tuples(st.just("assert"), client, st.integers(0, len(vals) - 1)),
        st.tuples(st.just("turn"), client, st.lists(st.integers(0, len(vals) - 1), min_size=1,
                                                     max_size=6), st.booleans()),
        st.tuples(st.just("each"), client, st.lists(st.integers(0, len(vals) - 1), min_size=1,
                                                     max_size=6), st.integers(1, 40)),
        st.tuples(st.just("close"), client),
    )
    return (pats, vals, draw(st.lists(op, min_size=1, max_size=25)),
            draw(st.sampled_from([2, 8192])), draw(st.booleans()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(relay_scenarios())
def test_whole_packets_through_relay_and_dataspace_agree(pure_core: Any, scenario: Any) -> None:
    """Clients observe, assert and send messages (in Turns of many, one per packet, in
    canonical encodings and not, whole or cut into reads); the packets every client is
    sent back are byte-identical from the compiled and the pure relay, dataspace and
    router, and so are the router's cache decisions."""
    import dataspace.dataspace as cds
    import dataspace.protocol.relay as crelay
    import dataspace.protocol.route as croute
    from dataspace.protocol.wire import WireRef

    class Compiled:
        dataspace = cds
        route = croute
        relay = crelay

    pats, vals, ops, cap, metered = scenario
    stacks = [_Stack(Compiled, 3, cap, metered), _Stack(pure_core, 3, cap, metered)]
    # Handles are numbered by a counter of each build's dataspace module (they go out in
    # the packets): the pure one starts where the compiled one is.
    pure_core.dataspace._ids.n = cds._ids.n
    handles = [0] * 3
    live: list[list[int]] = [[], [], []]
    for op in ops:
        c = op[1]
        if op[0] == "observe":
            handles[c] += 1
            h = handles[c]
            live[c].append(h)
            obs = cmodel.Record(cmodel.Symbol("Observe"), [
                cpat.to_preserves(pats[op[2]]), cmodel.Embedded(WireRef(True, 5 + h))])
            data = _turn([[0, cmodel.Record(cmodel.Symbol("A"), [obs, h])]])
        elif op[0] == "unobserve":
            if not live[c]:
                continue
            h = live[c].pop(op[2] % len(live[c]))
            data = _turn([[0, cmodel.Record(cmodel.Symbol("R"), [h])]])
        elif op[0] == "assert":
            handles[c] += 1
            data = _turn([[0, cmodel.Record(cmodel.Symbol("A"), [vals[op[2]], handles[c]])]])
        elif op[0] == "turn":
            bodies = [cbin.encode(vals[j]) for j in op[2]]
            if not op[3]:  # an annotation on each: decoded, not routed on its bytes
                bodies = [b"\x85\xb1\x01n" + b for b in bodies]
            data = b"\xb5" + b"".join(_message_event(b) for b in bodies) + b"\x84"
        elif op[0] == "each":
            data = b"".join(b"\xb5" + _message_event(cbin.encode(vals[j])) + b"\x84"
                            for j in op[2])
        else:
            for s in stacks:
                s.relays[c].close()
            live[c] = []
            continue
        if op[0] == "each":  # cut into reads of op[3] bytes
            chunks = [data[i:i + op[3]] for i in range(0, len(data), op[3])]
        else:
            chunks = [data]
        for s in stacks:
            for chunk in chunks:
                s.feed(c, chunk)
        compiled, pure = (s.output() for s in stacks)
        assert compiled == pure, op
