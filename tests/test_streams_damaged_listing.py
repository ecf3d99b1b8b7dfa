"""One damaged stream no longer hides the others (issue 28, after §1): `stream ls`, the
web API's /api/streams, /metrics and the inspector's Streams page list every stream and
mark the damaged one with its reason; a recorder appending to a damaged stream stops
recording that stream with one error line (counted), the others go on.  Both stores; the
damage is done to the rows behind the store's back (store_damage.Raw)."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from broker_support import async_test
from dataspace.cli import main
from dataspace.dataspace import Dataspace
from dataspace.streams import StoreCorrupt, open_store
from dataspace.streams.recorder import start_recorders, stop_recorders
from dataspace.values import parse
from store_damage import Raw
from test_web_inspector import browser, page, serve  # noqa: F401 (fixtures)


def _three(store: Any) -> None:
    """Streams a (2 entries), b (1, a tailer) and c (3)."""
    store.append_many("a", [parse("<x 1>"), parse("<x 2>")])
    store.append_many("b", [parse("<y 1>")])
    store.set_position("b", "reader", 1)
    store.append_many("c", [parse("<z 1>"), parse("<z 2>"), parse("<z 3>")])


def _damage(url: str) -> None:
    """a's row (its next index lowered by one bit) and b's tailer (its position)."""
    raw = Raw(url)
    try:
        assert raw.flip_column("streams", "next_index", 0, "a")
        assert raw.flip_column("tailers", "position", 1, "b", "reader")
    finally:
        raw.close()


def test_streams_with_damaged_lists_every_stream_and_marks_the_damaged(store_url: str) -> None:
    with open_store(store_url) as s:
        _three(s)
    _damage(store_url)
    with open_store(store_url) as s:
        with pytest.raises(StoreCorrupt):
            s.streams()
        got = {i.name: i for i in s.streams(with_damaged=True)}
        assert list(got) == ["a", "b", "c"]
        assert "does not match its checksum" in (got["a"].damaged or "")
        assert "tailer 'reader'" in (got["b"].damaged or "")
        assert (got["a"].next, got["a"].first, got["a"].tailers) == (0, None, ())
        assert got["c"].damaged is None and got["c"].count == 3


def test_stream_ls_lists_every_stream_marks_the_damaged_and_exits_1(
        store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with open_store(store_url) as s:
        _three(s)
    _damage(store_url)
    assert main(["stream", "ls", "--store", store_url]) == 1
    out, err = capsys.readouterr()
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[1:]}
    assert set(rows) == {"a", "b", "c"}
    assert rows["a"][1] == "DAMAGED" and rows["b"][1] == "DAMAGED"
    assert rows["c"][1:3] == ["3", "0..2"]
    lines = err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("dataspace stream: stream 'a' in ")
    assert " is damaged: its bookkeeping row" in lines[0]
    assert " is damaged: the row of its tailer 'reader'" in lines[1]
    assert "dataspace stream info a --check" in lines[0]

    assert main(["stream", "ls", "--store", store_url, "--json"]) == 1
    out, err = capsys.readouterr()
    got = {r["name"]: r for r in json.loads(out)}
    assert got["a"]["damaged"].startswith("its bookkeeping row") and got["a"]["length"] is None
    assert got["c"]["damaged"] is None and got["c"]["length"] == 3
    assert len(err.splitlines()) == 2


def test_a_sound_store_lists_with_exit_0(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with open_store(tmp_path) as s:
        _three(s)
    assert main(["stream", "ls", "--data-dir", str(tmp_path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert all(r["damaged"] is None for r in json.loads(out)) and err == ""


@async_test
async def test_api_streams_and_metrics_list_the_others_with_the_damaged_marked(tmp_path: Any) -> None:
    from test_web_api import api

    url = str(tmp_path / "data")
    with open_store(url) as s:
        _three(s)
    _damage(url)
    async with api(tmp_path, record=()) as a:
        data = await a.json("/api/streams")
        got = {r["name"]: r for r in data["streams"]}
        assert list(got) == ["a", "b", "c"]
        assert got["a"]["damaged"].startswith("its bookkeeping row")
        assert got["a"]["next"] is None and got["a"]["tailers"] == []
        assert got["c"]["damaged"] is None and got["c"]["length"] == 3
        m = await a.metrics()
        assert m["dataspace_store_up"] == 1
        assert m["dataspace_streams_damaged"] == 2
        assert m["dataspace_stream_damaged{stream=a}"] == 1
        assert "dataspace_stream_entries{stream=a}" not in m
        assert m["dataspace_stream_entries{stream=c}"] == 3


def test_a_recorder_of_a_damaged_stream_stops_with_one_line_and_the_others_record(
        store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    with open_store(store_url) as s:
        _three(s)
    _damage(store_url)
    ds = Dataspace()
    with open_store(store_url) as s, caplog.at_level(logging.INFO, "dataspace.streams.recorder"):
        # a with retention is made at start (its row read there), c is written later.
        recs = start_recorders(ds, ["a,max-count=100:<x _>", "c:<z _>"], s)
        try:
            for k in range(5):
                ds.send(parse(f"<x {k}>"))
                ds.send(parse(f"<z {k}>"))
            ra, rc = recs
            assert rc.flush(10) and not ra.flush(10)
            assert isinstance(ra.failed, StoreCorrupt) and rc.failed is None
            assert (ra.recorded, ra.dropped) == (0, 5)
            assert rc.recorded == 5
        finally:
            stop_recorders(recs)
        assert s.read("c", 3)[-1].value == parse("<z 4>")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    msg = errors[0].getMessage()
    assert "\n" not in msg and errors[0].exc_info is None
    assert msg.startswith("recorder a: stream 'a' in ") and "is damaged" in msg
    assert msg.endswith("recording of this stream stops, the other recorders go on")


def test_a_recorder_whose_stream_is_damaged_later_stops_once(tmp_path: Any,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    url = str(tmp_path / "data")
    ds = Dataspace()
    with open_store(url) as s, caplog.at_level(logging.INFO, "dataspace.streams.recorder"):
        recs = start_recorders(ds, ["a:<x _>", "c:<z _>"], s)
        try:
            ds.send(parse("<x 0>"))
            assert recs[0].flush(10)
            raw = Raw(url)
            assert raw.flip_column("streams", "first_index", 3, "a")
            raw.close()
            for k in range(1, 4):
                ds.send(parse(f"<x {k}>"))
                ds.send(parse(f"<z {k}>"))
            assert recs[1].flush(10) and not recs[0].flush(10)
            assert recs[0].dropped == 3 and recs[0].recorded == 1
        finally:
            stop_recorders(recs)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None


def test_the_inspectors_streams_page_lists_the_others_and_marks_the_damaged(
        tmp_path: Any, serve: Any, page: Any) -> None:  # noqa: F811 (fixtures)
    from test_web_inspector import expect

    url = str(tmp_path / "data0")  # the data directory of serve's first server
    with open_store(url) as s:
        _three(s)
    _damage(url)
    srv = serve("--http-open", "--record", "chat:<Says $who $text>")
    srv.send('<Says "alice" "hi">')
    pg = page.goto(srv.url + "inspector/streams")
    rows = pg.locator("table.grid tbody tr")
    expect(rows).to_have_count(4)
    expect(rows.nth(0).locator('td[data-col="name"]')).to_have_text("a damaged")
    expect(rows.nth(2).locator('td[data-col="name"]')).to_have_text("c")
    expect(rows.nth(2).locator('td[data-col="length"]')).to_have_text("3")
    notes = pg.locator("ul.damaged li")
    expect(notes).to_have_count(2)
    expect(notes.nth(0)).to_contain_text("a is damaged: its bookkeeping row")
    page.screenshot()
