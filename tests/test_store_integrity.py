"""Reads are verified: real stores damaged as disks damage them (SQLite pages misdirected,
cut short or overwritten, a flipped bit in a value; PostgreSQL rows changed behind the
store's back) are refused by every read path with the store's one-line "damaged" error,
never read as data -- the store's own reads, the local and Spark engines, the Spark
connector, export, copy, tailers, the scry publisher, the emitter (a recording's replay)
and ``stream info --check``; legitimate stores (retention, copies, imports) never trip
it; stores of the previous format migrate.  Plus a property test over random damage:
a read returns exactly what was written, or raises StoreCorrupt."""

from __future__ import annotations

import io
import logging
import shutil
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import store_damage as damage
from broker_support import async_test
from dataspace.cli import main
from dataspace.dataspace import Dataspace
from dataspace.pipeline import Graph, LocalEngine
from dataspace.streams import Emitter, StoreCorrupt, open_store
from dataspace.streams.copy import copy_streams
from dataspace.streams.scry import start_scry_udp
from dataspace.streams.transfer import export_stream
from dataspace.values import Record, Symbol, encode
from store_damage import Raw

N = 20_000
SAYS = Symbol("Says")


def value(i: int) -> Record:
    """Entry i's value: its text ``m000123x`` occurs once in the store file."""
    return Record(SAYS, [f"user-{i % 100}", f"m{i:06d}x", i])


def marker(i: int) -> bytes:
    return f"m{i:06d}x".encode()


def one_line(e: BaseException | str) -> str:
    text = str(e)
    assert "\n" not in text.strip(), text
    return text


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A data directory whose store holds ``ab``: N entries, every tenth with metadata
    (made once; each test damages a copy)."""
    d = tmp_path_factory.mktemp("template") / "data"
    with open_store(d) as s:
        with s.transaction() as tx:
            tx.append_encoded("ab", [encode(value(i)) for i in range(N)],
                              [encode(i) if i % 10 == 0 else None for i in range(N)])
        s.append_many("small", range(10))
    damage.checkpoint(d / "streams.sqlite3")
    return d


@pytest.fixture
def data(template, tmp_path) -> Path:
    d = tmp_path / "data"
    shutil.copytree(template, d)
    return d


KINDS = {
    # an interior page's child pointer moved to the next leaf: that leaf read twice
    "misdirected": lambda f: damage.misdirect_child(f, 0.5),
    # an interior page cut short a third of the way: range scans end there
    "cut": lambda f: damage.cut_interior(f, 0.33),
    # a leaf overwritten by a copy of the first leaf: well-formed, wrong rows
    "overwritten": lambda f: damage.copy_leaf(f, 0.5),
    # one bit of one value (entry 12345's text) flipped
    "flipped": lambda f: damage.flip_byte(f, marker(12345), 3),
    # pages of zeros: SQLite itself refuses them
    "zeroed": lambda f: damage.zero_pages(f, 0.33, 2),
}


def damaged(data: Path, kind: str) -> Path:
    KINDS[kind](data / "streams.sqlite3")
    return data


def assert_damaged(e: BaseException, stream: str = "ab") -> None:
    msg = one_line(e)
    assert f"stream {stream!r} in " in msg or "is damaged or is not a stream store" in msg, msg
    assert "damaged" in msg and ("restore" in msg), msg


# -- the store's own reads ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_read_of_a_damaged_sqlite_store_is_refused(data, kind):
    damaged(data, kind)
    with open_store(data) as s:
        reads = {
            "read_rows": lambda: s.read_rows("ab", 0, N, N),
            "read_columns": lambda: s.read_columns("ab", 0, N, meta=True),
            "read": lambda: s.read("ab", 0, N),
            "iter_entries": lambda: list(s.iter_entries("ab")),
            "last": lambda: s.last("ab", None, N),
        }
        for name, read in reads.items():
            with pytest.raises(StoreCorrupt) as e:
                read()
            assert_damaged(e.value), name
        # A stream elsewhere in the file reads as it was written -- unless the damage
        # reached it too: the cut lost everything after the third of the b-tree, which
        # holds "small" (its rows come after ab's).
        if kind != "cut":
            assert [x.value for x in s.read("small")] == list(range(10))
        else:
            with pytest.raises(StoreCorrupt):
                s.read("small")
        report = s.check_report()
        assert report.problems and all(one_line(p) for p in report.problems)


def test_the_issue_case_a_short_read_names_what_is_missing(data):
    """Pages cut a third of the way: SQLite answers a third of the rows, no error.  Every
    read of the stream sees its last entry missing (the stream's row is cross-checked
    against its highest stored index); a read whose range ends before the cut is refused
    for it too, and says which entry a read of the rest misses first."""
    damaged(data, "cut")
    raw = sqlite3.connect(data / "streams.sqlite3")
    got = raw.execute("SELECT count(*) FROM (SELECT idx FROM entries WHERE stream = 1 "
                      "AND idx >= 0 AND idx < ? ORDER BY idx)", (N,)).fetchone()[0]
    raw.close()
    assert 0 < got < N  # what an unchecked read returned
    with open_store(data) as s:
        for read in (lambda: s.read_rows("ab", 0, N, N), lambda: s.read_rows("ab", 0, 10, 10),
                     lambda: s.next_index("ab"), lambda: s.stream_info("ab")):
            with pytest.raises(StoreCorrupt) as e:
                read()
            assert one_line(e.value) == (
                f"stream 'ab' in {data / 'streams.sqlite3'} is damaged: entry {N - 1} (the last, "
                f"before its next index {N}) is missing (run `dataspace stream info ab --check`; "
                "restore the store from a backup)")


def test_a_flipped_bit_is_refused_where_the_entry_is_read_and_nowhere_else(data):
    damaged(data, "flipped")
    with open_store(data) as s:
        assert len(s.read_rows("ab", 0, 12345, N)) == 12345
        assert [r[0] for r in s.read_rows("ab", 12346, N, 10)] == list(range(12346, 12356))
        assert s.get("ab", 12344).value == value(12344)
        for read in (lambda: s.get("ab", 12345), lambda: s.read("ab", 12340, 10),
                     lambda: s.last("ab", 12346, 1), lambda: s.read_columns("ab", 12345, 12346)):
            with pytest.raises(StoreCorrupt, match=r"entry 12345 does not match its checksum"):
                read()
        # Indices alone (the Spark source's planning) cannot see it: no value was read.
        assert s.read_columns("ab", 0, N, values=False).indices == list(range(N))


def test_a_damaged_read_inside_a_transaction_commits_nothing(data):
    damaged(data, "misdirected")
    with open_store(data) as s:
        with pytest.raises(StoreCorrupt), s.transaction() as tx:
            tx.append("out", "before the read")
            tx.read_rows("ab", 0, N, N)
        assert not s.has_stream("out")


# -- the engines ----------------------------------------------------------------------------------

GRAPH = """
from dataspace.pipeline import Graph
from dataspace.values import Record, Symbol

graph = Graph("copy")
graph.source("ab")
graph.map("m", "ab", "ab2", lambda v: Record(Symbol("Out"), [v.fields[2]]))
"""


def check_outputs(data: Path) -> int:
    """What the graph committed before it stopped is right: ab2 holds Out(i) for i = 0,
    1, ... (none missing, none twice) and the processor's position is where it ends."""
    with open_store(data) as s:
        out = [e.value.fields[0] for e in s.iter_entries("ab2")] if s.has_stream("ab2") else []
        assert out == list(range(len(out)))
    # The position straight from the table: a read of it checks ab's row against its
    # entries, which the damage may have reached.
    raw = sqlite3.connect(data / "streams.sqlite3")
    pos = raw.execute("SELECT position FROM tailers WHERE name = 'copy/m'").fetchall()
    raw.close()
    assert (pos[0][0] if pos else 0) == len(out)
    return len(out)


@pytest.mark.parametrize("kind", ["cut", "misdirected", "flipped"])
def test_the_local_engine_stops_with_the_one_line_and_commits_nothing_damaged(
        data, tmp_path, kind, capsys, monkeypatch):
    damaged(data, kind)
    monkeypatch.setenv("DATASPACE_DATA_DIR", str(data))
    (tmp_path / "graph.py").write_text(GRAPH)
    assert main(["pipeline", "run", str(tmp_path / "graph.py"), "--until-idle",
                 "--engine", "local"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "stream 'ab' in " in err and "is damaged: entry " in err
    assert check_outputs(data) < N


def test_the_local_engine_api_raises_store_corrupt(data):
    damaged(data, "overwritten")
    g = Graph("copy")
    g.source("ab")
    g.map("m", "ab", "ab2", lambda v: Record(Symbol("Out"), [v.fields[2]]))
    with open_store(data) as s, LocalEngine(g, s, batch=1000) as e, pytest.raises(StoreCorrupt):
        e.drain()
    assert check_outputs(data) < N


# -- export, copy, tailers, the emitter, the scry publisher, info --check -----------------------


def test_export_stops_with_the_one_line_and_leaves_no_file(data, tmp_path, capsys):
    damaged(data, "cut")
    out = tmp_path / "ab.pr"
    assert main(["stream", "export", "ab", str(out), "--data-dir", str(data), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is damaged: entry " in err
    assert not out.exists() and not Path(str(out) + ".part").exists()
    with open_store(data) as s, pytest.raises(StoreCorrupt):
        export_stream(s, "ab", io.BytesIO(), fmt="binary")


def test_copy_stops_with_the_one_line(data, tmp_path, capsys):
    damaged(data, "misdirected")
    dst = tmp_path / "dst"
    assert main(["stream", "copy", str(data), str(dst)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is damaged: entry " in err
    with open_store(data) as s, open_store(tmp_path / "dst2") as d, pytest.raises(StoreCorrupt):
        copy_streams(s, d, ["ab"])


def test_a_tailer_does_not_move_past_a_damaged_read(data):
    damaged(data, "flipped")
    with open_store(data) as s:
        t = s.tailer("ab", "reader")
        assert len(t.read(12000)) == 12000
        with pytest.raises(StoreCorrupt, match="entry 12345"):
            t.read(1000)
        assert t.position == 12000 and s.position("ab", "reader") == 12000


def test_the_emitter_replays_nothing_of_a_damaged_batch(data):
    damaged(data, "flipped")
    ds = Dataspace()
    seen: list = []
    ds.observe("<Says _ _ $n>", on_message=seen.append)
    with open_store(data) as s:
        em = Emitter(s, "ab", ds, tailer="replay", batch=1000)
        for _ in range(12):
            assert em.pump() == 1000
        with pytest.raises(StoreCorrupt, match="entry 12345"):
            em.pump()
        assert seen == list(range(12000))  # nothing of the damaged batch
        assert em.sent == 12000 and s.position("ab", "replay") == 12000


@async_test
async def test_the_scry_publisher_serves_no_damaged_entry(data, caplog):
    from dataspace import scry

    damaged(data, "flipped")
    with open_store(data) as s:
        srv = await start_scry_udp(s, "127.0.0.1", 0, ["ab"])
        try:
            url = f"udp://127.0.0.1:{srv.address[1]}/ab/"
            got = await scry.get(url + "12344", timeout=30)
            assert got.value == value(12344)
            with caplog.at_level(logging.ERROR), pytest.raises(TimeoutError):
                await scry.get(url + "12345", timeout=1.5)  # no answer, ever
            assert srv.machine.stats.unreadable >= 1
            assert any("not serving damaged entries of ab" in r.getMessage() and
                       "entry 12345 does not match its checksum" in r.getMessage()
                       for r in caplog.records)
            got = await scry.get(url + "12346", timeout=30)  # the rest is served
            assert got.value == value(12346)
        finally:
            await srv.close()


@pytest.mark.parametrize("kind", ["cut", "flipped", "zeroed"])
def test_info_check_reports_the_damage(data, kind, capsys):
    damaged(data, kind)
    assert main(["stream", "info", "small", "--check", "--data-dir", str(data)]) == 1
    out = capsys.readouterr().out
    assert "integrity   PROBLEMS" in out
    if kind == "cut":
        assert "stream 'ab': " in out and "entries are missing (the first: " in out
    if kind == "flipped":
        assert "stream 'ab': 1 entry does not match its checksum (the first: 12345)" in out


def test_info_check_of_a_sound_store_counts_what_it_verified(template, capsys):
    assert main(["stream", "info", "ab", "--check", "--data-dir", str(template)]) == 0
    out = capsys.readouterr().out
    assert f"integrity   ok ({N + 10:,} entries in 2 streams read and verified)" in out


# -- rows changed behind the store's back, on both stores -------------------------------------


@pytest.fixture
def filled(store_url):
    """``ab``: 1,000 entries, every tenth with metadata, on both stores."""
    with open_store(store_url) as s, s.transaction() as tx:
        tx.append_encoded("ab", [encode(value(i)) for i in range(1000)],
                          [encode(i) if i % 10 == 0 else None for i in range(1000)])
        tx.append("other", "x")
    raw = Raw(store_url)
    yield store_url, raw
    raw.close()


DAMAGE = {
    "value": lambda raw: raw.flip("ab", 500),
    "meta": lambda raw: raw.flip("ab", 500, 1, "meta"),
    "deleted": lambda raw: raw("DELETE FROM T.entries WHERE stream = %s AND idx = 500", raw.sid("ab")),
    "first deleted": lambda raw: raw("DELETE FROM T.entries WHERE stream = %s AND idx = 0",
                                     raw.sid("ab")),
    "last deleted": lambda raw: raw("DELETE FROM T.entries WHERE stream = %s AND idx = 999",
                                    raw.sid("ab")),
    "moved": lambda raw: raw("UPDATE T.entries SET idx = 5000 WHERE stream = %s AND idx = 500",
                             raw.sid("ab")),
    "swapped": lambda raw: [raw("UPDATE T.entries SET idx = -1 WHERE stream = %s AND idx = 500", raw.sid("ab")),
                            raw("UPDATE T.entries SET idx = 500 WHERE stream = %s AND idx = 501", raw.sid("ab")),
                            raw("UPDATE T.entries SET idx = 501 WHERE stream = %s AND idx = -1", raw.sid("ab"))],
    # a row of another stream (value, metadata and checksum) answers for entry 500
    "foreign row": lambda raw: raw(
        "UPDATE T.entries SET value = o.value, meta = o.meta, checksum = o.checksum FROM "
        "(SELECT value, meta, checksum FROM T.entries WHERE stream = %s AND idx = 0) AS o "
        "WHERE stream = %s AND idx = 500", raw.sid("other"), raw.sid("ab")),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_rows_changed_behind_the_stores_back_are_refused(filled, kind, tmp_path):
    url, raw = filled
    DAMAGE[kind](raw)
    at = {"first deleted": 0, "last deleted": 999}.get(kind, 500)
    # Damage at the stream's ends (or beyond them) is seen by every read: each checks the
    # stream's row against its lowest and highest stored index.
    ends = kind in ("first deleted", "last deleted", "moved")
    with open_store(url) as s:
        for read in (lambda: s.read_rows("ab", 0, 1000, 1000),
                     lambda: s.read_rows("ab", at, 2000, 1),
                     lambda: s.read_columns("ab", 0, 10**6, meta=False),
                     lambda: s.read("ab", 0, 2000),
                     lambda: s.last("ab", None, 2000),
                     lambda: s.get("ab", at),
                     lambda: export_stream(s, "ab", io.BytesIO(), fmt="binary")):
            with pytest.raises(StoreCorrupt) as e:
                read()
            assert_damaged(e.value)
        if kind == "first deleted":
            with pytest.raises(StoreCorrupt, match=r"entry 0 \(its first index\) is missing"):
                s.first_index("ab")
        if ends:
            for read in (lambda: s.read_rows("ab", 100, 110, 10), lambda: s.get("ab", 100),
                         lambda: s.next_index("ab"), lambda: s.stream_info("ab")):
                with pytest.raises(StoreCorrupt) as e:
                    read()
                assert_damaged(e.value)
        else:  # reads that do not reach the damage are answered
            assert [r[0] for r in s.read_rows("ab", 100, 110, 10)] == list(range(100, 110))
            assert s.get("ab", 100).value == value(100)
        problems = s.check()
        assert any("stream 'ab'" in p for p in problems), problems


def test_the_engine_and_a_copy_stop_on_a_damaged_postgresql_store(pg_url, tmp_path):
    with open_store(pg_url) as s:
        s.append_many("ab", [value(i) for i in range(3000)])
    raw = Raw(pg_url)
    raw.flip("ab", 2500)
    raw.close()
    g = Graph("copy")
    g.source("ab")
    g.map("m", "ab", "ab2", lambda v: Record(Symbol("Out"), [v.fields[2]]))
    with open_store(pg_url) as s:
        with LocalEngine(g, s, batch=1000) as e, pytest.raises(StoreCorrupt, match="entry 2500"):
            e.drain()
        # What was committed (group commit: maybe nothing) is right, the rest is not there.
        out = [x.value.fields[0] for x in s.iter_entries("ab2")] if s.has_stream("ab2") else []
        assert out == list(range(len(out))) and len(out) <= 2000
        assert (s.position("ab", "copy/m") or 0) == len(out)
        with open_store(tmp_path / "dst") as d, pytest.raises(StoreCorrupt, match="entry 2500"):
            copy_streams(s, d)


# -- legitimate stores never trip it -------------------------------------------------------------


def test_retention_copies_imports_staging_and_transactions_read_clean(store_url, tmp_path):
    with open_store(store_url) as s:
        s.create_stream("kept", max_count=100)
        for k in range(5):  # retention cuts a prefix at each commit
            s.append_many("kept", range(k * 70, k * 70 + 70))
        assert s.first_index("kept") == 250 and s.stream_info("kept").count == 100
        assert [r[0] for r in s.read_rows("kept", 0, 10**6, 10**6)] == list(range(250, 350))
        assert [e.index for e in s.last("kept", None, 1000)] == list(range(349, 249, -1))
        assert s.get("kept", 10) is None and s.get("kept", 250).value == 250
        s.create_stream("aged", max_age=0.001)
        s.append_many("aged", range(10))
        s.apply_retention(now_ns=2**62)  # everything is old: the stream is empty
        assert s.first_index("aged") is None and s.read("aged") == []
        assert s.append("aged", "again") == 10 and [e.value for e in s.read("aged")] == ["again"]
        # Inside a transaction: its own appends, read back before the commit (then
        # retention cuts two more).
        with s.transaction() as tx:
            tx.append_encoded("kept", [encode("a"), encode("b")], [encode(1), None])
            assert [r[0] for r in tx.read_rows("kept", 340, 10**6, 100)] == list(range(340, 352))
            assert tx.get("kept", 351).value == "b" and tx.last("kept", None, 1)[0].index == 351
        # Staged rows, taken as they are and with their metadata rewritten.
        s.stage("p", "p/1", {"st": ([encode(1), encode(2)], [encode("ab"), None])})
        s.stage("p", "p/2", {"st": ([encode(3)], [encode("cd")])})
        s.attach_staged()
        with s.transaction() as tx:
            tx.append_staged("st", [("p/1", 2)])
            tx.append_staged("st", [("p/2", 1)], meta_cut=2, meta_suffix=b"\xb0\x01\x07")
            tx.drop_staged("p")
        got = s.read("st")
        assert [(e.value, e.meta_data) for e in got] == [
            (1, encode("ab")), (2, None), (3, encode("cd")[:-2] + b"\xb0\x01\x07")]
        assert s.check_report().problems == [] and s.check_report().unsealed == 0
        # A copy of the retained stream starts where the source does; an export of it
        # imported at its own indices too.
        with open_store(tmp_path / "copy") as d:
            copy_streams(s, d, ["kept", "aged"])
            assert d.first_index("kept") == 252
            assert [e.index for e in d.iter_entries("kept")] == list(range(252, 352))
            assert d.next_index("aged") == 11 and d.check() == []
        with open(tmp_path / "kept.bin", "wb") as f:
            export_stream(s, "kept", f, fmt="binary")
    assert main(["stream", "import", "kept", str(tmp_path / "kept.bin"), "--keep-indices",
                 "--store", str(tmp_path / "imported")]) == 0
    with open_store(tmp_path / "imported") as d:
        assert d.first_index("kept") == 252 and len(d.read_rows("kept", 0, 10**6, 10**6)) == 100
        assert d.check() == []


def test_reads_racing_appends_and_retention_never_look_damaged(store_url):
    """A writer appends (retention cutting the front at each commit) while a reader
    reads the same stream: the stream's row and its entries come from one snapshot."""
    import threading

    with open_store(store_url) as s:
        s.create_stream("r", max_count=300)
        s.append_many("r", range(300))
        done = threading.Event()
        errors: list[BaseException] = []

        def write() -> None:
            try:
                with open_store(store_url) as w:
                    for k in range(150):
                        w.append_many("r", range(k * 20, k * 20 + 20))
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)
            finally:
                done.set()

        t = threading.Thread(target=write)
        t.start()
        reads = 0
        try:
            while not done.is_set() or reads < 20:
                rows = s.read_rows("r", 0, 10**9, 10**9)
                assert 0 < len(rows) <= 320
                s.read("r", rows[0][0], 50)
                s.last("r", None, 100)
                s.first_index("r")
                s.read_columns("r", 0, 10**9, values=False)
                reads += 1
                assert reads < 100_000
        finally:
            t.join(60)
        assert not errors and not t.is_alive()


# -- stores written before checksums ---------------------------------------------------------------

V1_SCHEMA = """
CREATE TABLE streams (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL UNIQUE,
    next_index INTEGER NOT NULL DEFAULT 0, created_ns INTEGER NOT NULL, max_count INTEGER,
    max_age_ms INTEGER);
CREATE TABLE entries (stream INTEGER NOT NULL, idx INTEGER NOT NULL, seq INTEGER NOT NULL,
    time_ns INTEGER NOT NULL, value BLOB NOT NULL, meta BLOB, PRIMARY KEY (stream, idx))
    WITHOUT ROWID;
CREATE TABLE tailers (stream INTEGER NOT NULL, name TEXT NOT NULL, position INTEGER NOT NULL,
    updated_ns INTEGER NOT NULL, PRIMARY KEY (stream, name)) WITHOUT ROWID;
CREATE TABLE store_meta (key TEXT PRIMARY KEY, value);
INSERT INTO store_meta VALUES ('format', 'dataspace-streams');
INSERT INTO store_meta VALUES ('seq', 20);
INSERT INTO store_meta VALUES ('created_ns', 1);
INSERT INTO streams VALUES (1, 'old', 20, 1, NULL, NULL);
INSERT INTO streams VALUES (2, 'gone', 7, 1, NULL, NULL);
PRAGMA application_id = 1146319986;
PRAGMA user_version = 1;
"""


def test_a_store_of_the_previous_format_migrates_and_reads_its_old_entries(tmp_path, caplog):
    d = tmp_path / "data"
    d.mkdir()
    c = sqlite3.connect(d / "streams.sqlite3")
    c.executescript(V1_SCHEMA)
    c.executemany("INSERT INTO entries VALUES (1, ?, ?, 1, ?, NULL)",
                  [(i, i, encode(i)) for i in range(5, 20)])  # 0..4 gone by retention
    c.commit()
    c.close()
    with caplog.at_level(logging.WARNING), open_store(d) as s:
        assert [e.value for e in s.read("old")] == list(range(5, 20))  # unverified, noted
        assert s.first_index("old") == 5 and s.stream_info("gone").first is None
        s.append("old", 20)
        assert s.read("old", 20)[0].value == 20
        report = s.check_report()
        assert report.problems == [] and report.unsealed == 15 and report.entries == 16
        assert sqlite3.connect(d / "streams.sqlite3").execute("PRAGMA user_version").fetchone() == (4,)
        # Old entries carry no checksum, but their indices are still checked.
        raw = Raw(str(d))
        raw("DELETE FROM T.entries WHERE stream = 1 AND idx = 9")
        raw.close()
        with pytest.raises(StoreCorrupt, match="entry 9 missing"):
            s.read("old")
    notes = [r.getMessage() for r in caplog.records if "written before dataspace checksummed" in r.getMessage()]
    assert len(notes) == 1 and "'old'" in notes[0]


def test_a_postgresql_store_of_the_previous_format_migrates(pg_url, pg_server):
    with open_store(pg_url) as s:
        s.append_many("old", range(10))
    raw = Raw(pg_url)
    raw("ALTER TABLE T.entries DROP COLUMN checksum")
    raw("ALTER TABLE T.streams DROP COLUMN first_index")
    raw("ALTER TABLE T.streams DROP COLUMN checksum")
    raw("ALTER TABLE T.tailers DROP COLUMN checksum")
    raw("DROP TABLE T.pending")  # version 4's
    raw("DROP TABLE T.consumer_groups")
    raw("DELETE FROM T.entries WHERE idx < 3")
    raw("UPDATE T.store_meta SET value = '1' WHERE key = 'version'")
    raw.close()
    with open_store(pg_url) as s:
        assert [e.value for e in s.read("old")] == list(range(3, 10))
        assert s.first_index("old") == 3
        s.append("old", 10)
        report = s.check_report()
        assert report.problems == [] and report.unsealed == 7 and report.entries == 8
    raw = Raw(pg_url)
    assert raw("SELECT value FROM T.store_meta WHERE key = 'version'") == [("4",)]
    raw.close()


# -- random damage: a read returns exactly what was written, or StoreCorrupt -------------------

M = 300
ORIGINAL = [(i, encode(value(i)), encode(i) if i % 10 == 0 else None) for i in range(M)]

OPS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, M - 1), st.integers(0, 40)),
    st.tuples(st.just("flipmeta"), st.integers(0, M // 10 - 1).map(lambda k: 10 * k),
              st.integers(0, 3)),
    st.tuples(st.just("delete"), st.integers(0, M - 1)),
    st.tuples(st.just("move"), st.integers(0, M - 1), st.integers(M, M + 5)),
    st.tuples(st.just("swap"), st.integers(0, M - 1), st.integers(0, M - 1)),
)
READS = st.lists(st.tuples(st.integers(-2, M + 5), st.integers(0, M + 10), st.integers(0, M + 5)),
                 min_size=1, max_size=5)


def apply_ops(raw: Raw, ops: list) -> set[int]:
    """Damage ``ab`` by ``ops``; the indices touched."""
    touched: set[int] = set()
    sid = raw.sid("ab")
    for op in ops:
        kind, k = op[0], op[1]
        present = raw("SELECT count(*) FROM T.entries WHERE stream = %s AND idx = %s", sid, k)[0][0]
        if not present:
            continue
        if kind == "flip":
            raw.flip("ab", k, op[2])
        elif kind == "flipmeta":
            if not raw.flip("ab", k, op[2], "meta"):  # a swap brought an entry without meta
                continue
        elif kind == "delete":
            raw("DELETE FROM T.entries WHERE stream = %s AND idx = %s", sid, k)
        elif kind == "move":
            if raw("SELECT count(*) FROM T.entries WHERE stream = %s AND idx = %s", sid, op[2])[0][0]:
                continue
            raw("UPDATE T.entries SET idx = %s WHERE stream = %s AND idx = %s", op[2], sid, k)
            touched.add(op[2])
        elif kind == "swap":
            j = op[2]
            if j == k or not raw("SELECT count(*) FROM T.entries WHERE stream = %s AND idx = %s",
                                 sid, j)[0][0]:
                continue
            raw("UPDATE T.entries SET idx = -1 WHERE stream = %s AND idx = %s", sid, k)
            raw("UPDATE T.entries SET idx = %s WHERE stream = %s AND idx = %s", k, sid, j)
            raw("UPDATE T.entries SET idx = %s WHERE stream = %s AND idx = -1", j, sid)
            touched.add(j)
        touched.add(k)
    return touched


def check_reads(s, reads: list, touched: set[int] | None) -> int:
    """Every read is exact or refused -- and, when ``touched`` is known, refused only if
    it reaches a damaged index.  Returns how many were refused."""
    refused = 0
    # Damage at the stream's ends, or an entry moved beyond them, is seen by every read.
    ends = touched is not None and any(t in (0, M - 1) or t >= M for t in touched)
    for a, b, lim in reads:
        want = [o for o in ORIGINAL if max(a, 0) <= o[0] < b][:lim]
        clean = touched is not None and not ends and not any(max(a, 0) <= t < b for t in touched)
        clean_last = touched is not None and not ends and not any(t < b for t in touched)
        for name, expect in (("read_rows", want), ("read", want),
                             ("last", [o for o in ORIGINAL if o[0] < b][::-1][:lim])):
            try:
                if name == "read_rows":
                    got = [(r[0], r[2], r[3]) for r in s.read_rows("ab", a, b, lim)]
                elif name == "read":
                    got = [(e.index, e.data, e.meta_data) for e in s.read("ab", a, lim, b)]
                else:
                    got = [(e.index, e.data, e.meta_data) for e in s.last("ab", b, lim)]
            except StoreCorrupt as e:
                one_line(e)
                refused += 1
                assert not (clean_last if name == "last" else clean), (name, a, b, lim, touched, e)
                continue
            assert got == expect, (name, a, b, lim)
        k = max(0, min(a, M - 1))
        try:
            e = s.get("ab", k)
        except StoreCorrupt:
            assert touched is None or ends or k in touched
            refused += 1
        else:
            assert e is not None and (e.index, e.data, e.meta_data) == ORIGINAL[k]
    return refused


@pytest.fixture(scope="module")
def small_template(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("small") / "data"
    with open_store(d) as s, s.transaction() as tx:
        tx.append_encoded("ab", [o[1] for o in ORIGINAL], [o[2] for o in ORIGINAL])
    damage.checkpoint(d / "streams.sqlite3")
    return d


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=1, max_size=4), reads=READS)
def test_random_row_damage_is_refused_or_harmless_sqlite(small_template, tmp_path_factory, ops, reads):
    d = tmp_path_factory.mktemp("ex") / "data"
    shutil.copytree(small_template, d)
    raw = Raw(str(d))
    touched = apply_ops(raw, ops)
    raw.close()
    with open_store(d) as s:
        check_reads(s, reads, touched)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
                      min_size=1, max_size=3), reads=READS)
def test_random_bit_flips_in_the_file_are_refused_or_harmless(small_template, tmp_path_factory,
                                                              flips, reads):
    """Bits flipped anywhere in the entries' leaf pages: SQLite may refuse the page,
    answer other rows, or other bytes; the reads are exact or refused (what the
    checksum covers: index, value, metadata)."""
    d = tmp_path_factory.mktemp("ex") / "data"
    shutil.copytree(small_template, d)
    f = d / "streams.sqlite3"
    t = damage.tree(f)
    with open(f, "r+b") as fh:
        for where, bit in flips:
            page = t.leaves[int(where * len(t.leaves))]
            at = (page - 1) * t.page_size + int((where * len(t.leaves)) % 1 * t.page_size)
            fh.seek(at)
            byte = fh.read(1)[0]
            fh.seek(at)
            fh.write(bytes([byte ^ (1 << bit)]))
    try:
        s = open_store(d)
    except StoreCorrupt:
        return
    with s:
        check_reads(s, reads, None)


@pytest.fixture
def pg_filled(pg_url):
    with open_store(pg_url) as s, s.transaction() as tx:
        tx.append_encoded("ab", [o[1] for o in ORIGINAL], [o[2] for o in ORIGINAL])
    raw = Raw(pg_url)
    raw("CREATE TABLE public.backup AS SELECT * FROM T.entries")
    yield pg_url, raw
    raw.close()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=1, max_size=4), reads=READS)
def test_random_row_damage_is_refused_or_harmless_postgresql(pg_filled, ops, reads):
    url, raw = pg_filled
    raw("DELETE FROM T.entries")
    raw("INSERT INTO T.entries SELECT * FROM public.backup")
    touched = apply_ops(raw, ops)
    with open_store(url) as s:
        check_reads(s, reads, touched)


# -- Spark: the connector's partition reads and the engine ---------------------------------------


def test_the_spark_connector_refuses_a_damaged_store_in_one_line(spark, data):
    damaged(data, "cut")
    df = spark.read.format("dataspace").option("store", str(data)).option("stream", "ab").load()
    with pytest.raises(Exception) as e:
        df.collect()
    msg = str(e.value)
    assert msg.startswith(f"stream 'ab' in {data / 'streams.sqlite3'} is damaged: entry "), msg[:2000]
    one_line(msg)


def test_the_spark_engine_stops_with_the_one_line_and_commits_nothing_damaged(
        spark, data, tmp_path, capsys, monkeypatch):
    """The issue's case: pages cut a third of the way into the store; Spark used to
    report "idle", exit 0, with two thirds of the entries missing from ab2."""
    damaged(data, "cut")
    monkeypatch.setenv("DATASPACE_DATA_DIR", str(data))
    (tmp_path / "graph.py").write_text(GRAPH)
    assert main(["pipeline", "run", str(tmp_path / "graph.py"), "--until-idle"]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "Traceback" not in err and "is damaged: entry " in err, err[-3000:]
    assert [ln for ln in err.splitlines() if "is damaged" in ln] == [err.splitlines()[-1]]
    assert "idle" not in captured.out
    assert check_outputs(data) < N
