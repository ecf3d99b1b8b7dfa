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
    with pytest.raises(ValueError, match="postgresql stores are not supported"):
        store_file("postgresql://db.example/streams")


def test_a_file_given_as_data_directory_is_a_clear_error(tmp_path, capsys):
    from dataspace.cli import main

    (tmp_path / "f").write_text("x")
    with pytest.raises(OSError, match="is a file, not a directory"):
        resolve_data_dir(tmp_path / "f")
    for argv in (["stream", "append", "chat", "1"], ["stream", "ls"]):
        assert main([*argv, "--data-dir", str(tmp_path / "f")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("dataspace stream: the data directory ") and "is a file" in err
