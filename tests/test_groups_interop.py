"""A syndicate-py client joins a group by asserting the documented record
<ObserveGroup GROUP PATTERN #:observer> and shares messages and jobs with our clients
(issue 31)."""

from __future__ import annotations

import os
import signal

import pytest

from broker_support import (
    Changes,
    async_test,
    kill,
    read_line_matching,
    running_server,
    spawn,
    tcp_address,
)
from dataspace.client import connect
from dataspace.groups import Groups
from dataspace.values import Record, Symbol

pytest.importorskip("syndicate")

SCRIPT = os.path.join(os.path.dirname(__file__), "interop_syndicate_group.py")


def job(i: int) -> Record:
    return Record(Symbol("Job"), [i])


@async_test
async def test_a_syndicate_py_worker_shares_a_group_with_ours(tmp_path):
    async with running_server(tmp_path) as server:
        addr = tcp_address(server)
        host, port = addr.rsplit(":", 1)
        ours = await connect(addr, server.sturdyref)
        mine = Changes()
        ours.observe("<Job $id>", group="mixed", **mine.kw())
        done = Changes()
        producer = await connect(addr, server.sturdyref)
        producer.observe("<Done $id $who>", **done.kw())
        records = Changes()  # the memberships, as any client sees them
        producer.observe("<ObserveGroup $group $pattern $who>", **records.kw())
        await ours.sync()
        await producer.sync()
        out: list[str] = []
        theirs = await spawn(SCRIPT, f'<tcp "{host}" {port}>', str(server.sturdyref),
                             "mixed", "syndi")
        try:
            await read_line_matching(theirs, "^joined$", out)
            groups = Groups.of(server.dataspaces["root"])
            await records.until(lambda c: len(c.present) == 2)
            (st,) = groups.stats()
            assert len(st["members"]) == 2, st
            for i in range(10):
                producer.send(job(i))
            await producer.sync()
            await mine.until(lambda c: len(c.messages()) == 5)
            for i in range(5):
                await read_line_matching(theirs, rf"^! {2 * i + 1}$", out)
            assert [m[0] for m in mine.messages()] == [0, 2, 4, 6, 8]
            # Jobs: one each in turn; syndicate-py's worker says Done for its own.
            for i in range(100, 104):
                producer.assert_(job(i))
            await producer.sync()
            await mine.until(lambda c: len(c.present) == 2)
            theirs_jobs = sorted({100, 101, 102, 103} - {c[0] for c in mine.present})
            for j in theirs_jobs:
                await read_line_matching(theirs, rf"^\+ {j}$", out)
            await done.until(lambda c: {m[0] for m in c.messages()} == set(theirs_jobs))
            assert {m[1] for m in done.messages()} == {"syndi"}
            # kill -9 the syndicate-py worker: its jobs move to ours.
            theirs.send_signal(signal.SIGKILL)
            await theirs.wait()
            await mine.until(lambda c: len(c.present) == 4)
            (st,) = groups.stats()
            assert len(st["members"]) == 1 and st["reassigned"] == 2
        finally:
            await kill(theirs)
        await ours.close()
        await producer.close()
