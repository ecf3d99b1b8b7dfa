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
