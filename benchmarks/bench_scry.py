"""Scry benchmark (seed 004): remote readers following a stream, on seeded traces.

The real publisher and reader machines (dataspace.protocol.scry) run in a discrete-event
simulation (dataspace.protocol.scrysim): simulated time, a network that loses datagrams
(0%, 10%, 30%) and delays them 1-4 ms, a dictionary for the store.  Traces:

* bursty -- a chat: conversations of 3-25 messages about 2.5 s apart, separated by quiet
  spells of about a minute;
* steady -- a feed: one entry every 0.8-1.2 s;
* idle   -- a mostly idle channel: one entry every three minutes or so.

For 1, 20 and 200 readers, four ways of following, side by side:

* adaptive  -- this project: acknowledged registration, optimistic broadcast (now, +33 ms,
               +1 s) with the requesters carried over to the next path, and insurance polls
               on the empirical hazard model (HazardPoll);
* poisson   -- the same with the seed's Poisson (EWMA) model instead;
* bcast-1s  -- broadcast, but polls every second (no dynamic interval);
* naive-1s  -- plain polling every second, no broadcast (what a naive reader gets).

Figures: requests per entry per reader, latency from append to delivery (p50, p99), the
publisher's CPU per request (its machine only), and reads of the store against premature
requests (a premature request never reads the store).  Every run checks that every
reader got every entry exactly once, in order.

Run:  .venv/bin/python benchmarks/bench_scry.py            (about 2 minutes)
      .venv/bin/python benchmarks/bench_scry.py --quick    (a smoke test)
"""

from __future__ import annotations

import argparse
import sys
import time

from bench_steps import finish, say, start_steps, step
from dataspace.protocol.scry import FixedPoll, HazardPoll, PoissonPoll
from dataspace.protocol.scrysim import SimResult, simulate, trace

METHODS = {
    "adaptive": (HazardPoll, True),
    "poisson": (PoissonPoll, True),
    "bcast-1s": (lambda: FixedPoll(1.0), True),
    "naive-1s": (lambda: FixedPoll(1.0), False),
}

def run(kind: str, readers: int, loss: float, method: str, seed: int, duration: float) -> SimResult:
    poll, bcast = METHODS[method]
    times = trace(kind, seed, duration)
    r = simulate(times, readers, loss=loss, poll=poll, broadcast=bcast, seed=seed)
    want = list(range(len(times)))
    bad = [i for i, d in enumerate(r.delivered) if d != want]
    if bad:
        raise SystemExit(f"{kind}/{readers}/{loss}/{method}: reader {bad[0]} got "
                         f"{r.delivered[bad[0]][:10]}... not every entry once in order")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter traces, fewer readers")
    ap.add_argument("--seed", type=int, default=1, help="trace and network seed (default 1)")
    args = ap.parse_args()
    duration = 300.0 if args.quick else 1800.0
    reader_counts = (1, 20) if args.quick else (1, 20, 200)
    # Steps: every simulation (3 traces x readers x losses x methods) and the targets' run.
    per_trace = sum(len(METHODS) * (1 if r == 200 else 3) for r in reader_counts)
    start_steps(3 * per_trace + 1)
    say(f"scry benchmark: seeded traces of {duration:.0f} s (seed {args.seed}), Python "
          f"{sys.version.split()[0]}; the real machines in simulated time")
    for kind in ("bursty", "steady", "idle"):
        n = len(trace(kind, args.seed, duration))
        say(f"\n{kind} trace: {n} entries")
        say(f"  {'readers':>7} {'loss':>5}  {'method':10} {'req/entry/reader':>17} "
              f"{'p50':>9} {'p99':>9} {'pub CPU/req':>12} {'store reads':>12} {'premature':>10}")
        for readers in reader_counts:
            for loss in (0.0, 0.1, 0.3):
                if readers == 200 and loss != 0.1:
                    continue  # the big case at the loss the targets name
                for method in METHODS:
                    t0 = time.perf_counter()
                    r = run(kind, readers, loss, method, args.seed, duration)
                    cpu = r.publisher_seconds / max(1, r.publisher_requests) * 1e6
                    say(f"  {readers:>7} {loss:>5.0%}  {method:10} "
                          f"{r.requests_per_entry_per_reader:>17.2f} "
                          f"{r.pct(50) * 1000:>7.1f}ms {r.pct(99) * 1000:>7.0f}ms "
                          f"{cpu:>10.1f}µs {r.store_reads:>12,} {r.premature:>10,}"
                          + (f"   ({time.perf_counter() - t0:.1f} s)" if readers == 200 else ""))
                    step(f"{kind}, {readers} readers, {loss:.0%} loss, {method}")
    # The targets of issue 11: bursty trace, 20 readers, 10% loss.
    r = run("bursty", 20, 0.1, "adaptive", args.seed, duration)
    step("targets: bursty, 20 readers, 10% loss, adaptive")
    ok = (r.requests_per_entry_per_reader <= 1.5 and r.pct(50) <= 0.020 and r.pct(99) <= 1.5)
    say(f"\ntargets (bursty, 20 readers, 10% loss): <= 1.5 requests per entry per reader "
          f"(got {r.requests_per_entry_per_reader:.2f}), p50 <= 20 ms (got "
          f"{r.pct(50) * 1000:.1f} ms), p99 <= 1.5 s (got {r.pct(99):.2f} s), every entry "
          f"once in order (yes), store reads {r.store_reads} for {r.entries} entries and "
          f"{r.premature:,} premature requests: {'MET' if ok else 'NOT MET'}")
    say("\ncommand: .venv/bin/python benchmarks/bench_scry.py" + (" --quick" if args.quick else ""))
    finish()


if __name__ == "__main__":
    main()
