"""Side-by-side timings of our Preserves codecs and the reference ``preserves`` package.

Run: ``.venv/bin/python benchmarks/bench_values.py [--quick]``

For two sample values -- ``<Says "alice" "hello world" 12345>`` and a ~1 KiB nested value
(records, sequences, dictionaries of strings, integers and symbols) -- prints µs/op and
ops/s of our binary ``encode``/``decode`` and text ``stringify``/``parse`` next to the
``preserves`` package's ``encode``/``decode``/``stringify``/``parse`` measured in the same
run, and the ratio (theirs / ours: above 1 means ours is faster).  Each figure is the best
of several timeit repeats, in CPU time of this process (``time.process_time``: the machine
is shared, and CPU time is what the codecs cost).  Operations that are not implemented
print ``n/a``.

Where the compiled core runs (``dataspace --version``), the pure-Python modules are timed
too, in the same process (``dataspace._build.load_pure``): the ``pure`` columns, and
``speed-up`` = pure time / compiled time.  ``DATASPACE_PURE=1`` times the pure build alone.

Then times our codecs on pathological inputs (the unit tests check only the results):
a binary string declaring 2**70 - 1 bytes, huge double literals, a long flat text
sequence, and a ~270 KB binary value fed to the streaming ``Decoder`` in 64-byte chunks.
Figures only: nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dataspace._build import BUILD, load_pure
from dataspace.values import (
    Decoder,
    DecodeShort,
    Dictionary,
    Embedded,
    Record,
    Sequence,
    Set,
    Symbol,
    decode,
    encode,
)
from dataspace.values import text as our_text

try:
    import preserves
except ImportError:  # pragma: no cover - the reference package is a test extra
    preserves = None


def says_sample() -> Any:
    return Record(Symbol("Says"), ["alice", "hello world", 12345])


def nested_sample() -> Any:
    """A ~1 KiB value shaped like dataspace traffic."""
    s = Symbol
    items = [
        Record(
            s("item"),
            [
                i,
                f"widget-{i}",
                s("active" if i % 2 else "idle"),
                Dictionary(
                    {s("qty"): i * 7, s("price"): 1000 + 37 * i, "tags": [s("new"), s("x")]}
                ),
            ],
        )
        for i in range(10)
    ]
    return Record(
        s("Inventory"),
        [
            "warehouse-12",
            Dictionary(
                {
                    "owner": "alice",
                    "region": s("eu-west"),
                    "version": 3,
                    "ids": Sequence(range(100, 118)),
                    s("limits"): Dictionary({"max": 65536, "min": -1}),
                }
            ),
            Sequence(items),
            Record(
                s("meta"),
                [
                    s("created"),
                    1700000000,
                    [Record(s("tag"), [f"label-{j}", j]) for j in range(5)],
                    "a somewhat longer free-text description of this inventory snapshot (v3, eu-west)",
                ],
            ),
        ],
    )


def to_reference(v: Any) -> Any:
    """Our value as the ``preserves`` package represents it."""
    t = type(v)
    if t is Symbol:
        return preserves.Symbol(v.name)
    if t is Record:
        return preserves.Record(to_reference(v.label), [to_reference(x) for x in v.fields])
    if t is Sequence:
        return tuple(to_reference(x) for x in v)
    if t is Set:
        return frozenset(to_reference(x) for x in v)
    if t is Dictionary:
        return preserves.ImmutableDict({to_reference(k): to_reference(x) for k, x in v.items()})
    if t is Embedded:
        return preserves.Embedded(v.value)
    return v


def _calls_for(fn: Callable[[], Any], target: float) -> int | None:
    """How many calls of ``fn`` take about ``target`` seconds (None: not implemented)."""
    try:
        fn()
    except NotImplementedError:
        return None
    number, elapsed = timeit.Timer(fn, timer=time.process_time).autorange()
    return max(1, int(number * target / max(elapsed, 1e-9)))


def best_times(
    fns: list[Callable[[], Any] | None], repeat: int, target: float
) -> list[float | None]:
    """Best seconds per call of each function over ``repeat`` rounds of ~``target`` s.

    The functions are timed in turn within each round, so a burst of load from other
    processes affects all of them alike rather than skewing one ratio.
    """
    numbers = [_calls_for(fn, target) if fn is not None else None for fn in fns]
    best: list[float | None] = [None] * len(fns)
    for _ in range(repeat):
        for i, (fn, number) in enumerate(zip(fns, numbers)):
            if fn is None or number is None:
                continue
            t = timeit.Timer(fn, timer=time.process_time).timeit(number) / number
            if best[i] is None or t < best[i]:  # type: ignore[operator]
                best[i] = t
    return best


def fmt(t: float | None) -> tuple[str, str]:
    if t is None:
        return "n/a", "n/a"
    return f"{t * 1e6:9.2f}", f"{1 / t:10.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer, shorter repeats (a few seconds)")
    args = ap.parse_args(argv)
    repeat, target = (3, 0.05) if args.quick else (7, 0.1)

    samples = {"says": says_sample(), "nested~1KiB": nested_sample()}
    ref_version = "not installed"
    if preserves is not None:
        try:
            ref_version = importlib.metadata.version("preserves")
        except importlib.metadata.PackageNotFoundError:
            ref_version = "unknown version"
    pure_binary = pure_text = None
    if BUILD.compiled:
        pure_binary = load_pure("dataspace.values.binary")
        pure_text = load_pure("dataspace.values.text")
    print(f"python {sys.version.split()[0]}; reference: preserves {ref_version}; "
          f"core: {BUILD.describe()}")
    header = (
        f"{'value':<12} {'op':<10} {'ours µs':>9} {'ours op/s':>10} "
        f"{'ref µs':>9} {'ref op/s':>10} {'ratio':>7}"
        + (f" {'pure µs':>9} {'ratio':>7} {'speed-up':>8}" if pure_binary else "")
    )
    print(header)
    print("-" * len(header))
    for name, v in samples.items():
        data = encode(v)
        ref_v = to_reference(v) if preserves else None
        try:
            text = our_text.stringify(v)
        except NotImplementedError:
            text = preserves.stringify(ref_v) if preserves else None
        ops: list[tuple[str, Callable[[], Any], Callable[[], Any] | None, Callable[[], Any] | None]] = [
            (
                "encode",
                lambda v=v: encode(v),
                preserves and (lambda r=ref_v: preserves.encode(r)),
                None,
            ),
            (
                "decode",
                lambda d=data: decode(d),
                preserves and (lambda d=data: preserves.decode(d)),
                None,
            ),
            (
                "stringify",
                lambda v=v: our_text.stringify(v),
                preserves and (lambda r=ref_v: preserves.stringify(r)),
                None,
            ),
            (
                "parse",
                lambda s=text: our_text.parse(s),
                preserves and (lambda s=text: preserves.parse(s)),
                None,
            ),
        ]
        if pure_binary is not None and pure_text is not None:
            pv = pure_binary.decode(data)  # the same value, built of the pure classes
            pure_ops = [
                lambda pv=pv: pure_binary.encode(pv),
                lambda d=data: pure_binary.decode(d),
                lambda pv=pv: pure_text.stringify(pv),
                lambda s=text: pure_text.parse(s),
            ]
            ops = [(n, o, r, p) for (n, o, r, _), p in zip(ops, pure_ops)]
        print(f"{name:<12} ({len(data)} bytes binary)")
        for op, ours, ref, pure in ops:
            t_ours, t_ref, t_pure = best_times([ours, ref or None, pure], repeat, target)
            ratio = f"{t_ref / t_ours:7.2f}" if t_ours and t_ref else "    n/a"
            line = (
                f"{'':<12} {op:<10} {fmt(t_ours)[0]:>9} {fmt(t_ours)[1]:>10} "
                f"{fmt(t_ref)[0]:>9} {fmt(t_ref)[1]:>10} {ratio}"
            )
            if pure_binary is not None:
                pratio = f"{t_ref / t_pure:7.2f}" if t_pure and t_ref else "    n/a"
                speedup = f"{t_pure / t_ours:8.2f}" if t_pure and t_ours else "     n/a"
                line += f" {fmt(t_pure)[0]:>9} {pratio} {speedup}"
            print(line)
    print("ratio = reference time / our time (above 1: ours is faster)")
    print()
    pathological(repeat)
    return 0


def _huge_declared_length() -> None:
    data = b"\xb2" + b"\xff" * 9 + b"\x01"  # a string of 2**70 - 1 bytes declared
    try:
        decode(data)
    except DecodeShort:
        pass


def _feed_in_chunks(data: bytes, size: int) -> list[Any]:
    d = Decoder()
    out: list[Any] = []
    for i in range(0, len(data), size):
        d.feed(data[i : i + size])
        out.extend(d)
    return out


def pathological(repeat: int) -> None:
    """Best-of-``repeat`` wall time of each pathological input (the tests' inputs)."""
    long_digits = "1" * 200_000 + ".5"
    huge_exponent = "1e999999999999999999"
    tiny_fraction = "0." + "0" * 100_000 + "1"
    flat_text = "[" + " ".join(['<a 1 "x">'] * 100_000) + "]"
    flat_value = our_text.parse(flat_text)
    chunked = encode(Sequence(range(60_000)))
    cases: list[tuple[str, Callable[[], Any], int]] = [
        ("binary: 2**70-1 byte length declared, decode", _huge_declared_length, 1000),
        ("text: 200,000-digit double literal, parse", lambda: our_text.parse(long_digits), 1),
        ("text: 1e999999999999999999, parse", lambda: our_text.parse(huge_exponent), 1),
        ("text: 0.<100,000 zeros>1, parse", lambda: our_text.parse(tiny_fraction), 1),
        ("text: 100,000 flat records, parse", lambda: our_text.parse(flat_text), 1),
        ("text: 100,000 flat records, stringify", lambda: our_text.stringify(flat_value), 1),
        (
            f"binary: {len(chunked) // 1000} KB value in 64-byte chunks, Decoder",
            lambda: _feed_in_chunks(chunked, 64),
            1,
        ),
    ]
    print(f"pathological inputs (best of {repeat})")
    width = max(len(name) for name, _, _ in cases)
    for name, fn, number in cases:
        best = min(timeit.Timer(fn).timeit(number) for _ in range(repeat))
        per = f" ({best / number * 1e6:.2f} µs each of {number})" if number > 1 else ""
        print(f"  {name:<{width}} {best * 1e3:11.3f} ms{per}")


if __name__ == "__main__":
    raise SystemExit(main())
