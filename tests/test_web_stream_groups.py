"""Consumer groups where an operator looks (issue 32): /api/streams, /metrics (lag per
group, with bounded labels) and the inspector's Streams page in headless Chromium, against
a real server and store, consumers run by `dataspace stream consume`."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

from broker_support import async_test
from dataspace.streams import open_store
from dataspace.values import parse
from test_web_inspector import TIMEOUT, browser, expect, page, serve  # noqa: F401 (fixtures)


def _work(url: str) -> None:
    with open_store(url) as s:
        s.append_many("jobs", [parse(f"<job {i}>") for i in range(5)])
        g = s.group("jobs", "workers", max_deliveries=4)
        g.consumer("w1").read(2)
        s.group("jobs", "audit", start="latest")


@async_test
async def test_api_streams_and_metrics_show_each_group(tmp_path: Any, monkeypatch: Any) -> None:
    from dataspace.web import metrics
    from test_web_api import api

    _work(str(tmp_path / "data"))
    async with api(tmp_path, record=()) as a:
        data = await a.json("/api/streams")
        (row,) = [r for r in data["streams"] if r["name"] == "jobs"]
        by = {g["name"]: g for g in row["groups"]}
        assert (by["workers"]["next"], by["workers"]["lag"], by["workers"]["pending"]) == (2, 3, 2)
        assert by["workers"]["consumers"][0]["name"] == "w1"
        assert by["workers"]["max_deliveries"] == 4 and by["workers"]["dead_letter"] == "jobs.dead"
        assert (by["audit"]["next"], by["audit"]["lag"], by["audit"]["pending"]) == (5, 0, 0)
        m = await a.metrics()
        assert m["dataspace_consumer_group_position{group=workers,stream=jobs}"] == 2
        assert m["dataspace_consumer_group_lag_entries{group=workers,stream=jobs}"] == 3
        assert m["dataspace_consumer_group_pending_entries{group=workers,stream=jobs}"] == 2
        assert m["dataspace_consumer_group_consumers{group=workers,stream=jobs}"] == 1
        assert m["dataspace_consumer_group_oldest_pending_seconds{group=workers,stream=jobs}"] >= 0
        assert "dataspace_consumer_group_oldest_pending_seconds{group=audit,stream=jobs}" not in m
        assert m["dataspace_consumer_groups_unlisted"] == 0
        monkeypatch.setattr(metrics, "MAX_CONSUMER_GROUPS", 1)
        m = await a.metrics()
        assert len([k for k in m if k.startswith("dataspace_consumer_group_lag_entries")]) == 1
        assert m["dataspace_consumer_groups_unlisted"] == 1


def test_the_streams_page_shows_the_groups_of_a_stream_as_they_consume(
        tmp_path: Any, serve: Any, page: Any) -> None:  # noqa: F811 (fixtures)
    data = tmp_path / "data0"  # the data directory of serve's first server
    _work(str(data))
    srv = serve("--http-open")
    pg = page.goto(srv.url + "inspector/streams?stream=jobs")
    cell = pg.locator('table.grid tbody tr td[data-col="groups"]').first
    expect(cell).to_have_text("audit (0 / 0), workers (3 / 2)")
    row = pg.locator("#groups tr.group", has_text="workers")
    expect(row.locator('td[data-col="lag"]')).to_have_text("3")
    expect(row.locator('td[data-col="pending"]')).to_have_text("2")
    expect(row.locator("li.consumer")).to_have_text([re.compile(r"^w1: 2 pending, oldest ")])
    page.screenshot()
    # Another consumer takes the rest and acknowledges it: the page follows.
    r = subprocess.run([sys.executable, "-m", "dataspace.cli", "stream", "consume", "jobs", "-g",
                        "workers", "-c", "w2", "--ack", "-n", "3", "--data-dir", str(data)],
                       capture_output=True, text=True, timeout=TIMEOUT * 3)
    assert r.returncode == 0, r.stderr
    expect(row.locator('td[data-col="lag"]')).to_have_text("0", timeout=TIMEOUT * 1000)
    expect(row.locator('td[data-col="pending"]')).to_have_text("2")
    expect(row.locator('td[data-col="next"]')).to_have_text("5")
    page.screenshot("-consumed")
