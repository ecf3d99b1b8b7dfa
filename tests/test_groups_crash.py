"""Jobs survive workers killed with kill -9 (issue 31): worker processes in a group take
jobs (assertions) while jobs keep arriving; workers are killed at random and replaced.
Every job is eventually assigned to a live worker and finished (its holder retracts it
when the worker says it is done), none is left unassigned, and after each kill -- once
the server has seen the connection close -- every job is held by exactly one live member
or the group has none."""

from __future__ import annotations

import asyncio
import random
import signal

from broker_support import async_test, kill, read_line_matching, running_server, spawn, tcp_address
from dataspace.client import connect
from dataspace.groups import Groups
from dataspace.values import Record, Symbol

WORKER = """
import asyncio, sys
from dataspace.client import connect
from dataspace.values import Record, Symbol

async def main():
    ds = await connect(sys.argv[1], sys.argv[2], name=sys.argv[3], reconnect=False)
    todo = asyncio.Queue()
    ds.observe("<Job $id>", on_assert=todo.put_nowait, group="crash")
    await ds.sync()
    print("ready", flush=True)
    while True:
        i = await todo.get()
        await asyncio.sleep(0.02)  # (the work)
        ds.send(Record(Symbol("Done"), [i, sys.argv[3]]))

asyncio.run(main())
"""

WORKERS = 3
KILLS = 10
JOBS = 200


@async_test
async def test_jobs_survive_workers_killed_at_random(tmp_path):
    rng = random.Random(31)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    async with running_server(tmp_path) as server:
        addr, cap = tcp_address(server), str(server.sturdyref)
        ds = server.dataspaces["root"]
        groups = Groups.of(ds)
        producer = await connect(addr, server.sturdyref)
        held: dict[int, int] = {}  # job -> its handle, until done
        done_by: dict[int, str] = {}
        all_done = asyncio.Event()

        def on_done(i: int, who: str) -> None:
            h = held.pop(i, None)
            if h is not None:  # (a second Done, from a worker it had moved from: ignored)
                done_by[i] = who
                producer.retract(h)
                if len(done_by) == JOBS:
                    all_done.set()

        producer.observe("<Done $id $who>", on_message=on_done)
        await producer.sync()

        procs: dict[str, asyncio.subprocess.Process] = {}
        ready: dict[str, asyncio.Task[str]] = {}  # worker -> its "ready" line
        serial = 0

        async def start_worker() -> None:
            nonlocal serial
            serial += 1
            name = f"w{serial}"
            p = procs[name] = await spawn(str(script), addr, cap, name)
            ready[name] = asyncio.ensure_future(read_line_matching(p, "^ready$", []))

        moved: list[int] = []  # reassignments so far, at each kill

        def check_settled() -> None:
            (st,) = groups.stats() or [None]
            if st is None:
                return
            moved.append(st["reassigned"])
            live = st["members"]
            held_now = sum(m["jobs"] for m in live)
            assert held_now + st["pending"] == st["jobs"]
            if live:
                assert st["pending"] == 0, st  # none unassigned while a member lives
            assert all(m["alive"] for m in live), st  # the dead one was taken out

        try:
            for _ in range(WORKERS):
                await start_worker()
            await asyncio.gather(*ready.values())
            killed = 0
            next_job = 0
            batches = 20
            for b in range(batches):
                for _ in range(JOBS // batches):
                    held[next_job] = producer.assert_(Record(Symbol("Job"), [next_job]))
                    next_job += 1
                await producer.sync()
                if b % 2 == 1 and killed < KILLS:
                    up = sorted(n for n, t in ready.items() if t.done())
                    while len(up) < 2:  # (another to take the victim's jobs)
                        await asyncio.wait([t for t in ready.values() if not t.done()],
                                           return_when=asyncio.FIRST_COMPLETED)
                        up = sorted(n for n, t in ready.items() if t.done())
                    victim = rng.choice(up)
                    ready.pop(victim).result()
                    conn = next(c for c in server.connections if c.client_name == victim)
                    closed = asyncio.Event()
                    conn.on_close.append(lambda _c, e=closed: (check_settled(), e.set()))
                    procs[victim].send_signal(signal.SIGKILL)
                    await asyncio.wait_for(closed.wait(), 20)
                    await procs.pop(victim).wait()
                    killed += 1
                    await start_worker()  # (joins when it is up: jobs wait meanwhile)
            await asyncio.wait_for(all_done.wait(), 60)
            assert killed == KILLS
            assert sorted(done_by) == list(range(JOBS))
            assert not held
            await producer.sync()
            (st,) = groups.stats()
            assert st["jobs"] == 0 and st["pending"] == 0
            assert len(moved) == KILLS and moved[-1] > 0  # (kills took jobs from workers)
        finally:
            for t in ready.values():
                t.cancel()
            for p in procs.values():
                await kill(p)
        await producer.close()
