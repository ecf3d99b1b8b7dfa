"""The inspector's dataspace page shows the groups of observers sharing work (issue 31):
each group with its pattern and its members, in headless Chromium against `dataspace
serve --http` with workers run by `dataspace observe --group` (as test_web_inspector)."""

from __future__ import annotations

import re
from typing import Any

from test_web_inspector import TIMEOUT, Page, Proc, browser, clients, expect, page, serve  # noqa: F401


def test_the_dataspace_page_lists_groups_and_their_members(
        serve: Any, clients: list[Proc], page: Page) -> None:  # noqa: F811 (fixtures)
    srv = serve("--http-open")
    joined = srv.client("observe", "<ObserveGroup $group $pattern $who>", "--count", "2")
    clients.append(joined)
    for name in ("ann", "bob"):
        clients.append(Proc("observe", "<Job $id>", "--group", "resize", "--name", name,
                            "--server", srv.address, "--data-dir", str(srv.data_dir)))
    joined.wait_line(r'^\+ <ObserveGroup "resize"')
    joined.p.wait(TIMEOUT)
    assert len([s for s in joined.lines if s.startswith("+ <ObserveGroup")]) == 2
    clients.append(srv.client("assert", "<Job 1>", "<Job 2>", "<Job 3>"))
    for p in clients[1:3]:
        p.wait_line(r"^\+ <Job \d>$")  # each member holds a job: both have joined
    srv.send("<Job 7>", "<Job 8>")
    pg = page.goto(srv.url + "inspector/dataspace?pattern=" + "%3CJob%20%24id%3E")
    expect(pg.locator("#status")).to_have_text("live")
    row = pg.locator("#groups tr.group")
    expect(row).to_have_count(1, timeout=TIMEOUT * 1000)  # the list is read every 3 s
    expect(row.locator('td[data-col="group"] strong')).to_have_text("resize")
    expect(row.locator('td[data-col="group"] a.pick')).to_have_text("<Job $>")
    expect(row.locator('td[data-col="member_count"]')).to_have_text("2")
    expect(row.locator('td[data-col="messages"]')).to_have_text("2")
    expect(row.locator('td[data-col="jobs"]')).to_have_text("3")
    members = row.locator("li.member")
    expect(members).to_have_count(2)
    for i in (0, 1):  # (in the order they joined)
        expect(members.nth(i)).to_have_text(re.compile(r"^(ann|bob) #\d+: 1 message, (1 job|2 jobs)$"))
    assert {members.nth(i).inner_text().split()[0] for i in (0, 1)} == {"ann", "bob"}
    # The group's own subscription is the server's, marked so among the patterns.
    own = pg.locator("table.grid tbody tr.own", has_text="server: group resize")
    expect(own).to_have_count(1)
    page.screenshot()
    # kill -9 ann: bob holds every job, and the page says so.
    clients[1].kill9()
    expect(members).to_have_count(1, timeout=TIMEOUT * 1000)
    expect(members.nth(0)).to_have_text(re.compile(r"^bob #\d+: 1 message, 3 jobs$"))
    expect(row.locator('td[data-col="reassigned"]')).not_to_have_text("0")
