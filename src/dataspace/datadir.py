"""Where dataspace keeps its files: the data directory and what lives in it.

The data directory is, in order of precedence: an explicit ``--data-dir`` argument, the
``DATASPACE_DATA_DIR`` environment variable, ``$XDG_DATA_HOME/dataspace``, or
``~/.local/share/dataspace``.  It holds:

* ``root.key`` -- the secret key of the server's root capability (32 random bytes,
  created on first use, file mode 0600);
* ``root.sturdyref`` -- the root capability in Preserves text, for clients;
* ``streams.sqlite3`` -- the embedded stream store.

:func:`store_file` is the one rule that turns what a user gave -- a data directory, a
store file, a ``file:`` URL -- into the store's file; :func:`~dataspace.streams.open_store`,
every command and the Spark connector all call it.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

__all__ = [
    "ROOT_KEY",
    "ROOT_STURDYREF",
    "STREAMS_DB",
    "default_data_dir",
    "load_or_create_key",
    "resolve_data_dir",
    "store_file",
]

ROOT_KEY = "root.key"
ROOT_STURDYREF = "root.sturdyref"
STREAMS_DB = "streams.sqlite3"

KEY_BYTES = 32

DATA_DIR_HELP = (
    "data directory (default: $DATASPACE_DATA_DIR, else $XDG_DATA_HOME/dataspace, else "
    "~/.local/share/dataspace)"
)
"""The ``--data-dir`` help of every command."""

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def default_data_dir() -> Path:
    """The data directory when none is given explicitly."""
    env = os.environ.get("DATASPACE_DATA_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "dataspace"


def resolve_data_dir(explicit: str | os.PathLike[str] | None = None, *, create: bool = True) -> Path:
    """The data directory to use (``explicit`` wins), created (mode 0700) if asked.

    Raises ``OSError`` with a one-line message when it cannot be: a file is in the way,
    or the directory cannot be created.
    """
    d = Path(explicit).expanduser() if explicit else default_data_dir()
    if d.exists() and not d.is_dir():
        raise OSError(
            f"the data directory {d} is a file, not a directory; choose another with "
            "--data-dir or DATASPACE_DATA_DIR"
        )
    if create:
        _make_dir(d)
    return d


def _make_dir(d: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise OSError(
            f"cannot create the data directory {d}: {e.strerror}; choose another with "
            "--data-dir or DATASPACE_DATA_DIR"
        ) from e


def store_file(location: str | os.PathLike[str], *, create: bool = True) -> Path:
    """The stream store's file for ``location`` -- the one rule for the API, every command
    and the Spark connector:

    * an existing directory is a data directory: the store is its ``streams.sqlite3``;
    * an existing file is the store file itself;
    * a path that does not exist is a data directory (created, mode 0700, when
      ``create``), unless its name ends in ``.sqlite3``: then it names the store file;
    * ``file:PATH`` and ``file://PATH`` are ``PATH``.

    Other URLs (``postgresql://...``) name stores this version cannot open:
    ``ValueError``.  The result is absolute, so that processes started elsewhere (Spark's
    workers) find the same file.
    """
    text = os.fspath(location)
    if text.startswith("file:"):
        text = text[len("file:"):]
        if text.startswith("//"):
            text = text[2:]
    elif _URL.match(text):
        scheme = text.split(":", 1)[0]
        raise ValueError(
            f"{text}: {scheme} stores are not supported by this version; give a data "
            "directory or a streams.sqlite3 file"
        )
    p = Path(text).expanduser().absolute()
    if p.is_dir():
        return p / STREAMS_DB
    if p.exists() or p.suffix == ".sqlite3":
        return p
    if create:
        _make_dir(p)
    return p / STREAMS_DB


def load_or_create_key(path: str | os.PathLike[str]) -> bytes:
    """Read a secret key file, creating it with fresh random bytes (mode 0600) if absent.

    Raises ``ValueError`` with a clear message if the file exists but is not a key.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        key = secrets.token_bytes(KEY_BYTES)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, p)  # atomic, and fails if another process won the race
        except FileExistsError:
            return load_or_create_key(p)
        finally:
            tmp.unlink(missing_ok=True)
        return key
    if len(data) != KEY_BYTES:
        raise ValueError(
            f"{p} is not a dataspace key ({len(data)} bytes, expected {KEY_BYTES}); "
            "move it away to have a new key generated"
        )
    return data
