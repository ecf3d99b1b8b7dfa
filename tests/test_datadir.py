"""The data directory and the root key file."""

from __future__ import annotations

import stat

import pytest

from dataspace.datadir import default_data_dir, load_or_create_key, resolve_data_dir


def test_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("DATASPACE_DATA_DIR", str(tmp_path / "env"))
    assert default_data_dir() == tmp_path / "env"
    assert resolve_data_dir(tmp_path / "explicit") == tmp_path / "explicit"
    assert (tmp_path / "explicit").is_dir()
    monkeypatch.delenv("DATASPACE_DATA_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_data_dir() == tmp_path / "xdg" / "dataspace"


def test_key_is_created_once_with_mode_0600(tmp_path):
    p = tmp_path / "root.key"
    k1 = load_or_create_key(p)
    assert len(k1) == 32 and stat.S_IMODE(p.stat().st_mode) == 0o600
    assert load_or_create_key(p) == k1
    assert [x.name for x in tmp_path.iterdir()] == ["root.key"]  # no temporary left


def test_a_foreign_key_file_is_a_clear_error(tmp_path):
    p = tmp_path / "root.key"
    p.write_bytes(b"not a key")
    with pytest.raises(ValueError, match="is not a dataspace key"):
        load_or_create_key(p)


def test_a_path_that_does_not_exist_is_a_data_directory(tmp_path):
    """docs/streams.md's quick tour: open_store("/tmp/demo") makes the data directory
    /tmp/demo, which every command then takes as --data-dir (it once made a file there)."""
    from dataspace.cli import main
    from dataspace.streams import open_store

    demo = tmp_path / "demo"
    with open_store(demo) as s:
        s.append("chat", 1)
        assert s.path == demo / "streams.sqlite3"
    assert demo.is_dir() and stat.S_IMODE(demo.stat().st_mode) == 0o700
    assert main(["stream", "append", "--data-dir", str(demo), "chat", "2"]) == 0
    with open_store(demo / "streams.sqlite3") as s:  # the file itself works as well
        assert [e.value for e in s.read("chat")] == [1, 2]


def test_store_file_is_the_one_rule(tmp_path, monkeypatch):
    from dataspace.datadir import store_file
    from dataspace.pipeline.spark._store import db_path

    monkeypatch.chdir(tmp_path)
    assert store_file("new", create=False) == tmp_path / "new" / "streams.sqlite3"
    assert not (tmp_path / "new").exists()
    assert store_file("x.sqlite3") == tmp_path / "x.sqlite3"  # names the file
    assert store_file(f"file:{tmp_path}/d") == tmp_path / "d" / "streams.sqlite3"
    assert (tmp_path / "d").is_dir()
    assert store_file(f"file://{tmp_path}/d") == tmp_path / "d" / "streams.sqlite3"
    (tmp_path / "f").write_bytes(b"")
    assert store_file("f") == tmp_path / "f"
    assert db_path("new") == str(tmp_path / "new" / "streams.sqlite3")  # Spark's: the same
    assert store_file(f"sqlite:{tmp_path}/s.sqlite3") == tmp_path / "s.sqlite3"
    assert store_file(f"sqlite://{tmp_path}/e") == tmp_path / "e" / "streams.sqlite3"
    with pytest.raises(ValueError, match="is a PostgreSQL store, not a file"):
        store_file("postgresql://db.example/streams")


def test_store_location_names_sqlite_and_postgresql_stores_and_nothing_else(tmp_path, monkeypatch):
    from dataspace.datadir import store_location

    monkeypatch.chdir(tmp_path)
    pg = store_location("postgresql://app:s3cret@db.example:5433/streams?sslmode=require")
    assert (pg.kind, pg.path) == ("postgresql", None)
    assert pg.url.endswith("app:s3cret@db.example:5433/streams?sslmode=require")
    assert str(pg) == pg.display == "postgresql://app:***@db.example:5433/streams?sslmode=require"
    assert store_location("postgres://db.example/x").kind == "postgresql"
    sq = store_location("sqlite:data", create=False)
    assert (sq.kind, sq.path) == ("sqlite", tmp_path / "data" / "streams.sqlite3")
    for bad in ("mysql://u:pw@h/db", "http://example.com/x", "postgresql:streams", "sqlite:"):
        with pytest.raises(ValueError) as e:
            store_location(bad)
        assert "pw" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_mask_url_hides_every_password():
    from dataspace.datadir import mask_url

    assert mask_url("postgresql://u:p%40ss@h/db") == "postgresql://u:***@h/db"
    assert mask_url("postgresql://u@h/db?password=x&sslmode=require") == (
        "postgresql://u@h/db?password=***&sslmode=require")
    assert mask_url("postgresql://h/db") == "postgresql://h/db"
    assert mask_url("/var/lib/dataspace") == "/var/lib/dataspace"


def test_a_file_given_as_data_directory_is_a_clear_error(tmp_path, capsys):
    from dataspace.cli import main

    (tmp_path / "f").write_text("x")
    with pytest.raises(OSError, match="is a file, not a directory"):
        resolve_data_dir(tmp_path / "f")
    for argv in (["stream", "append", "chat", "1"], ["stream", "ls"]):
        assert main([*argv, "--data-dir", str(tmp_path / "f")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("dataspace stream: the data directory ") and "is a file" in err
