"""Groups of observers are visible (issue 31): ``/api/server``'s summary (what ``info``
prints), ``/api/groups`` member by member, the dispatcher marked as the server's own in
``/api/subscriptions``, ``/metrics`` per group and per member (bounded), and ``top``'s
groups table at 80 columns."""

from __future__ import annotations

from broker_support import Changes, async_test, tcp_address
from dataspace.cli.info import format_summary
from dataspace.cli.top import Sample, render
from dataspace.client import connect
from dataspace.protocol.sturdy import attenuate
from dataspace.values import Record, Symbol
from test_web_api import api


def job(i: int) -> Record:
    return Record(Symbol("Job"), [i])


@async_test
async def test_groups_in_the_summary_the_api_metrics_info_and_top(tmp_path):
    async with api(tmp_path) as a:
        addr = tcp_address(a.server)
        workers = [await connect(addr, a.token, name=f"worker-{n}") for n in "ab"]
        seen = [Changes(), Changes()]
        for w, c in zip(workers, seen):
            w.observe("<Job $id>", group="resize", **c.kw())
            await w.sync()
        producer = await connect(addr, a.token, name="producer")
        for i in range(6):
            producer.send(job(i))
        for i in (10, 11, 12):
            producer.assert_(job(i))
        await producer.sync()
        await seen[0].until(lambda c: len(c.messages()) == 3 and len(c.present) == 2)
        await seen[1].until(lambda c: len(c.messages()) == 3 and len(c.present) == 1)

        s = await a.json("/api/server")
        assert s["groups_total"] == 1
        (g,) = s["groups"]
        assert {k: g[k] for k in ("dataspace", "group", "pattern", "member_count", "messages",
                                  "dropped", "jobs", "pending", "reassigned")} == {
            "dataspace": "root", "group": "resize", "pattern": "<Job $>", "member_count": 2,
            "messages": 6, "dropped": 0, "jobs": 3, "pending": 0, "reassigned": 0}
        assert "members" not in g
        text = "\n".join(format_summary(s, a.http.url))
        assert "group        resize <Job $>: 2 members, 6 messages, 3 jobs, 0 moved" in text

        gs = await a.json("/api/groups?dataspace=root")
        (g,) = gs["groups"]
        conns = {c.client_name: c.id for c in a.server.connections}
        assert [(m["client"], m["connection"], m["messages"], m["jobs"], m["alive"])
                for m in g["members"]] == [("worker-a", conns["worker-a"], 3, 2, True),
                                           ("worker-b", conns["worker-b"], 3, 1, True)]
        subs = await a.json("/api/subscriptions?dataspace=root")
        assert [(p["pattern"], p["own"]) for p in subs["patterns"]
                if p["own"] and p["own"].startswith("group")] == [("<Job $>", "group resize")]

        m = await a.metrics()
        lv = "dataspace=root,group=resize,pattern=<Job $>"
        assert m["dataspace_groups"] == 1 and m["dataspace_groups_unlisted"] == 0
        assert m[f"dataspace_group_members{{{lv}}}"] == 2
        assert m[f"dataspace_group_messages_total{{{lv}}}"] == 6
        assert m[f"dataspace_group_jobs{{{lv}}}"] == 3
        assert m[f"dataspace_group_jobs_waiting{{{lv}}}"] == 0
        ma = f"dataspace=root,group=resize,member=worker-a#{conns['worker-a']},pattern=<Job $>"
        assert m[f"dataspace_group_member_messages_total{{{ma}}}"] == 3
        assert m[f"dataspace_group_member_jobs{{{ma}}}"] == 2

        # top: the groups table, at 80 columns; then worker-a goes and its jobs move.
        conns_api = await a.json("/api/connections")
        first = Sample.of(s, conns_api, subs, None, 0.0)
        await workers[0].close()
        await seen[1].until(lambda c: len(c.present) == 3)
        for i in range(4):
            producer.send(job(i))
        await producer.sync()
        await seen[1].until(lambda c: len(c.messages()) == 7)
        s2 = await a.json("/api/server")
        second = Sample.of(s2, await a.json("/api/connections"), subs, first, 2.0)
        screen = str(render(second, "c", False, 30, False, 80))  # as a pipe gets it
        assert max(map(len, screen.splitlines())) <= 80
        assert "groups" in screen and "MEMB" in screen and "MOVED" in screen, screen
        row = next(line for line in screen.splitlines() if line.startswith("resize"))
        assert row.split() == ["resize", "<Job", "$>", "1", "10", "2.0", "3", "0", "2"], row
        m = await a.metrics()
        assert m[f"dataspace_group_reassignments_total{{{lv}}}"] == 2
        assert m[f"dataspace_group_members{{{lv}}}"] == 1
        assert not any("worker-a" in k for k in m)

        # A token whose caveats do not let it observe <ObserveGroup ...>: 403.
        only_says = attenuate(a.server.sturdyref, [Record(Symbol("rewrite"), [
            Record(Symbol("bind"), [Record(Symbol("rec"), [Symbol("Says"), [
                Record(Symbol("_"), []), Record(Symbol("_"), [])]])]),
            Record(Symbol("ref"), [0])])])
        status, body, _h = await a.get("/api/groups", str(only_says))
        assert status == 403 and "<ObserveGroup _ _ _>" in body["error"], body
        for c in (producer, workers[1]):
            await c.close()
