"""The memory attack of issue 21 against a real ``dataspace serve``: peak RSS, refusals,
and whether a round-trip probe stays served.

40 connections from 10 loopback addresses (127.0.2.1-10), each within its own limits,
assert ``<MemoryHog K I "xxx...">`` values of 2 KB as fast as the server takes them
(turns of 50), and retract whatever the server refuses (as a client that understands
refusals does), for ``--seconds``.  Meanwhile a probe process does ``sync()`` every 50 ms
and the server's RSS is sampled every 50 ms from /proc.  Then the attackers close and the
time until the server's memory comes back (within 10% of what the attack took) is
measured.

With the server's defaults (``--max-memory`` a quarter of the machine's memory, at most
1 GiB) the attack is refused once the budget is full; ``--compare-off`` runs it a second
time with ``--max-memory off`` (the server before issue 21: only the count of assertions,
1,000,000, was limited).

Run:  .venv/bin/python benchmarks/bench_memory_attack.py                 (about 40 s)
      .venv/bin/python benchmarks/bench_memory_attack.py --compare-off   (about 1.5 min)
      .venv/bin/python benchmarks/bench_memory_attack.py --max-memory 256M --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from dataspace.protocol.sturdy import SturdyRef
from dataspace.testing.broker_soak import MEMORY_SOURCES, Probe, ServerUnderTest, memory_attack

MIB = 1 << 20


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def _budget(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url + "api/server", timeout=5) as r:
            return json.loads(r.read()).get("memory_budget")  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


async def run_once(max_memory: str | None, seconds: float, connections: int,
                   value_size: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    args = ["--http", "127.0.0.1:0", "--http-open"]
    if max_memory is not None:
        args += ["--max-memory", max_memory]
    server = ServerUnderTest(tmp / "data", args)
    probe: Probe | None = None
    try:
        server.start()
        url = next(m.group(1) for line in server.lines()
                   if (m := re.search(r"HTTP on (http://\S+/)", line)))
        probe = Probe(server.address, server.sturdyref, 0.05, 5.0)
        if not await asyncio.to_thread(probe.start):
            raise RuntimeError("the probe did not connect")
        mem = server.memory_kib()
        assert mem is not None
        baseline = mem[0] * 1024
        limit = (_budget(url) or {}).get("limit", 0)
        stop = asyncio.Event()
        samples: list[tuple[float, int]] = []
        used_peak = 0
        t0 = time.monotonic()

        async def sample() -> None:
            nonlocal used_peak
            n = 0
            while not stop.is_set():
                m = server.memory_kib()
                if m is not None:
                    samples.append((time.monotonic() - t0, m[0] * 1024))
                if n % 10 == 0:
                    b = await asyncio.to_thread(_budget, url)
                    if b is not None:
                        used_peak = max(used_peak, b["used"])
                n += 1
                probe.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.05)

        async def timer() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), seconds)
            stop.set()

        cap = SturdyRef.parse(server.sturdyref)
        sampler = asyncio.ensure_future(sample())
        clock = asyncio.ensure_future(timer())
        stats = await memory_attack(server.address, cap, stop, connections=connections,
                                    sources=MEMORY_SOURCES, value_size=value_size)
        stop.set()
        await asyncio.gather(sampler, clock)
        attack_s = time.monotonic() - t0
        hwm = (server.memory_kib() or (0, 0))[1] * 1024
        peak = max([hwm] + [r for _t, r in samples])
        # The attackers are gone: how long until the memory is back?
        t1 = time.monotonic()
        grown = peak - baseline
        back_after = None
        while time.monotonic() - t1 < 60:
            m = server.memory_kib()
            if m is not None and m[0] * 1024 - baseline <= 0.1 * grown:
                back_after = time.monotonic() - t1
                break
            await asyncio.sleep(0.1)  # pacing the reads of /proc, not synchronisation
        end = server.memory_kib()
        final = _budget(url) or {}
        await asyncio.to_thread(probe.stop)
        lat = probe.latencies
        kinds: dict[str, int] = {}
        for s in stats:
            kinds[s.kind] = kinds.get(s.kind, 0) + 1
        return {
            "max_memory": max_memory or "default",
            "budget_bytes": limit,
            "seconds": round(attack_s, 1),
            "connections": connections,
            "value_size": value_size,
            "assertions_sent": sum(s.sent for s in stats),
            "refusals": sum(s.refused for s in stats),
            "connections_refused": sum(1 for s in stats if s.refused),
            "outcomes": kinds,
            "rss_baseline_mib": round(baseline / MIB, 1),
            "rss_peak_mib": round(peak / MIB, 1),
            "rss_grown_mib": round(grown / MIB, 1),
            "budget_used_peak_mib": round(max(used_peak, final.get("peak", 0)) / MIB, 1),
            "memory_back_after_s": None if back_after is None else round(back_after, 1),
            "rss_end_mib": round(end[0] / 1024, 1) if end else None,
            "probe": {"count": len(lat), "failures": probe.failures,
                      "p50_ms": round(_pct(lat, 0.5) * 1000, 2),
                      "p99_ms": round(_pct(lat, 0.99) * 1000, 2),
                      "max_ms": round(max(lat, default=0.0) * 1000, 1)},
        }
    finally:
        if probe is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(probe.stop)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def show(r: dict[str, Any]) -> str:
    p = r["probe"]
    budget = f"{r['budget_bytes'] / MIB:.0f} MiB" if r["budget_bytes"] else "off"
    back = (f"{r['memory_back_after_s']} s" if r["memory_back_after_s"] is not None
            else "not within 60 s")
    return "\n".join([
        f"--max-memory {r['max_memory']} (budget {budget}): {r['connections']} connections x "
        f"{r['value_size']} B values for {r['seconds']} s",
        f"  RSS {r['rss_baseline_mib']} -> peak {r['rss_peak_mib']} MiB (+{r['rss_grown_mib']}); "
        f"the budget's own count peaked at {r['budget_used_peak_mib']} MiB",
        f"  {r['assertions_sent']:,} assertions sent, {r['refusals']:,} refused "
        f"({r['connections_refused']} connections refused); outcomes {r['outcomes']}",
        f"  probe: {p['count']} round trips, {p['failures']} failed, p50 {p['p50_ms']} ms, "
        f"p99 {p['p99_ms']} ms, max {p['max_ms']} ms",
        f"  memory back after the attackers closed: {back} (RSS {r['rss_end_mib']} MiB)",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-memory", default=None, metavar="SIZE",
                    help="the server's --max-memory (default: the server's default)")
    ap.add_argument("--seconds", type=float, default=15.0, help="attack time (default 15)")
    ap.add_argument("--connections", type=int, default=40)
    ap.add_argument("--value-size", type=int, default=2048)
    ap.add_argument("--compare-off", action="store_true",
                    help="run again with --max-memory off (the server before the budget)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = ap.parse_args(argv)
    runs = [args.max_memory] + (["off"] if args.compare_off else [])
    results = []
    for mm in runs:
        r = asyncio.run(run_once(mm, args.seconds, args.connections, args.value_size))
        print(show(r), flush=True)
        results.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
