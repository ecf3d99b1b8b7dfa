"""Copies, exports, imports and the Spark connector's commits verify what they wrote
against what they read before they say they are done (issue 28 §1): a destination that
holds other bytes, an export that lost entries on the way, a commit that appended other
rows than its tasks staged -- each is an error that says so, never "copied", "exported",
"imported" or a committed batch."""

from __future__ import annotations

import io

import pytest

from dataspace.cli import main
from dataspace.streams import open_store
from dataspace.streams.copy import CopyMismatch, copy_streams
from dataspace.streams.integrity import checksums
from dataspace.streams.postgres import PostgresStore, PostgresTransaction
from dataspace.streams.sqlite import SQLiteStore, SQLiteTransaction
from dataspace.streams.transfer import WriteMismatch, export_stream
from dataspace.values import encode


def flip(data: bytes, at: int = 2) -> bytes:
    b = bytearray(data)
    b[at % len(b)] ^= 1
    return bytes(b)


def tx_class(url: str) -> type:
    return PostgresTransaction if url.startswith("postgresql:") else SQLiteTransaction


def test_a_copy_whose_destination_holds_other_bytes_is_not_copied(store_url, tmp_path,
                                                                 monkeypatch, capsys):
    src = str(tmp_path / "src")
    with open_store(src) as s:
        s.append_many("ab", range(50))
    cls = tx_class(store_url)
    original = cls.copy_in

    def mangling(self, stream, rows):  # a destination that stores other bytes
        rows = [(i, t, flip(v) if i == 17 else v, m, o) for i, t, v, m, o in rows]
        return original(self, stream, rows)

    monkeypatch.setattr(cls, "copy_in", mangling)
    assert main(["stream", "copy", src, store_url]) == 1
    out, err = capsys.readouterr()
    assert "dataspace stream: copied" not in out and "Traceback" not in err
    assert err.startswith("dataspace stream: copy: ") and "does not hold what was read from" in err
    assert "stream 'ab' there has entries whose checksums differ from those read" in err, err
    with open_store(src) as s, open_store(store_url) as d, pytest.raises(CopyMismatch):
        copy_streams(s, d, replace=True)
    monkeypatch.setattr(cls, "copy_in", original)
    with open_store(src) as s, open_store(store_url) as d:
        r = copy_streams(s, d, replace=True)
        assert r.entries == 50 and [e.value for e in d.read("ab")] == list(range(50))


def test_an_import_whose_store_holds_other_bytes_fails(store_url, tmp_path, monkeypatch, capsys):
    f = tmp_path / "in.pr"
    f.write_text("".join(f"<n {i}>\n" for i in range(30)))
    cls = tx_class(store_url)
    original = cls.append_encoded

    def mangling(self, stream, datas, metas=None):
        return original(self, stream, [flip(d) if k == 3 else d for k, d in enumerate(datas)],
                        metas)

    monkeypatch.setattr(cls, "append_encoded", mangling)
    assert main(["stream", "import", "nums", str(f), "--store", store_url, "-q"]) == 1
    out, err = capsys.readouterr()
    assert "imported" not in out and "Traceback" not in err
    assert "'nums' in " in err and "holds entries whose checksums differ from those read" in err
    assert err.rstrip().endswith("nothing was imported"), err


def test_an_export_that_lost_entries_on_the_way_says_so(store_url, monkeypatch, capsys):
    with open_store(store_url) as s:
        s.append_many("ab", range(100))
    cls = PostgresStore if store_url.startswith("postgresql:") else SQLiteStore
    original = cls.read_columns

    def losing(self, name, start, end, **kw):  # a read path that drops an entry
        c = original(self, name, start, end, **kw)
        k = c.indices.index(40) if 40 in c.indices else None
        if k is not None:
            for col in c:
                if col:
                    del col[k]
        return c

    monkeypatch.setattr(cls, "read_columns", losing)
    assert main(["stream", "export", "ab", "--store", store_url, "-q"]) == 1
    _out, err = capsys.readouterr()
    assert "dataspace stream: exported" not in err and "Traceback" not in err
    assert ("99 entries (indices 0..99) of 'ab' were exported where its bookkeeping said 100 "
            "entries (indices 0..99) when the export started") in err, err


def test_an_export_during_retention_names_what_it_lost(store_url):
    """Retention removing entries the export had not read yet: they are named, and the
    export is not a whole one."""
    with open_store(store_url) as s, open_store(store_url) as other:
        s.append_many("ab", range(100))
        cut = []

        def progress(done, total):
            if done == 10 and not cut:  # after the first chunk: retention cuts ahead
                other.create_stream("ab", max_count=50)
                cut.append(other.apply_retention())

        with pytest.raises(WriteMismatch) as e:
            export_stream(s, "ab", io.BytesIO(), chunk=10, progress=progress)
        assert cut == [50]
        assert str(e.value).startswith("entries 10..49 of 'ab' were removed during the export "
                                       "(by retention?) and are not in it (60 entries")


def test_the_connectors_commit_checks_what_it_appended(store_url):
    from dataspace.pipeline.spark.sink import CommitError, verify_appended

    rows = [encode(i) for i in range(5)]
    with open_store(store_url) as s:
        s.append_many("out", ["before"])
        good = sum(checksums("out", rows))
        for n, sums, ok in ((5, {"out": good}, True), (5, None, True), (4, None, False),
                            (6, None, False), (5, {"out": good + 1}, False)):
            with pytest.raises(RuntimeError) if ok else pytest.raises(CommitError) as e, \
                    s.transaction() as tx:
                before = {"out": tx.next_index("out")}
                tx.append_encoded("out", rows)
                verify_appended(s, "p", before, {"out": n}, sums)
                raise RuntimeError("roll back: only checking")
            if not ok:
                assert "nothing was committed" in str(e.value)
        assert s.next_index("out") == 1
