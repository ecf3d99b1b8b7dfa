"""Where dataspace keeps its files: the data directory and what lives in it.

The data directory is, in order of precedence: an explicit ``--data-dir`` argument, the
``DATASPACE_DATA_DIR`` environment variable, ``$XDG_DATA_HOME/dataspace``, or
``~/.local/share/dataspace``.  It holds:

* ``root.key`` -- the secret key of the server's root capability (32 random bytes,
  created on first use, file mode 0600);
* ``root.sturdyref`` -- the root capability in Preserves text, for clients;
* ``streams.sqlite3`` -- the embedded stream store.

:func:`store_location` is the one rule that turns what a user gave -- a data directory,
a store file, ``sqlite:PATH``, a ``file:`` URL or a ``postgresql://`` URL -- into the store
it names; :func:`~dataspace.streams.open_store`, every command and the Spark connector all
call it (:func:`store_file` is its SQLite half).  :func:`mask_url` is the one way a store
URL is shown: with its password masked.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ROOT_KEY",
    "ROOT_STURDYREF",
    "STREAMS_DB",
    "StoreLocation",
    "default_data_dir",
    "load_or_create_key",
    "mask_url",
    "resolve_data_dir",
    "store_file",
    "store_location",
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
_PG_SCHEMES = ("postgresql", "postgres")
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:@/?#]*):[^@/?#]*@")
_PW_PARAM = re.compile(r"((?:^|[?&\s])password=)[^&\s]*", re.IGNORECASE)

STORE_HELP = (
    "the stream store: a data directory or .sqlite3 file, sqlite:PATH, or "
    "postgresql://USER@HOST[:PORT]/DATABASE (default: DATA_DIR/streams.sqlite3)"
)
"""The ``--store`` help of every command."""


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


def mask_url(text: str | os.PathLike[str]) -> str:
    """``text`` as it may be shown or logged: a URL's password (``user:PASSWORD@`` or a
    ``password=`` parameter) replaced by ``***``.  Everything that prints or logs a store
    URL goes through this."""
    t = os.fspath(text)
    t = _USERINFO.sub(lambda m: m.group(1) + ":***@", t, count=1)
    return _PW_PARAM.sub(lambda m: m.group(1) + "***", t)


@dataclass(frozen=True)
class StoreLocation:
    """Where a stream store is: ``kind`` is ``"sqlite"`` (``path`` is the file) or
    ``"postgresql"`` (``url`` is the connection URL, password included: show
    :attr:`display`, never ``url``)."""

    kind: str
    url: str
    path: Path | None = None

    @property
    def display(self) -> str:
        """The location as it may be printed (the password masked)."""
        return str(self.path) if self.path is not None else mask_url(self.url)

    def __str__(self) -> str:
        return self.display


def store_location(location: str | os.PathLike[str], *, create: bool = True) -> StoreLocation:
    """The store named by ``location`` -- the one rule for the API, every command, the
    configuration file and the Spark connector:

    * ``postgresql://...`` (or ``postgres://...``): a PostgreSQL store, the URL as libpq
      reads it (``postgresql://USER:PASSWORD@HOST:PORT/DATABASE?sslmode=...``);
    * ``sqlite:PATH``, ``file:PATH`` (and ``sqlite://PATH``, ``file://PATH``): PATH;
    * any other ``SCHEME://`` is an error (``ValueError``), never a file of that name;
    * a path: the SQLite store of :func:`store_file`.
    """
    text = os.fspath(location)
    m = _URL.match(text)
    scheme = text.split(":", 1)[0].lower() if ":" in text else ""
    if scheme in _PG_SCHEMES:
        if not m:
            raise ValueError(f"{mask_url(text)}: a PostgreSQL store URL starts with "
                             f"{scheme}:// (postgresql://USER@HOST/DATABASE)")
        return StoreLocation("postgresql", text)
    if scheme in ("sqlite", "file"):
        rest = text[len(scheme) + 1:]
        if rest.startswith("//"):
            rest = rest[2:]
        if not rest:
            raise ValueError(f"{text}: give a path after {scheme}: (a data directory or a "
                             ".sqlite3 file)")
        p = _sqlite_path(rest, create)
        return StoreLocation("sqlite", str(p), p)
    if m:
        raise ValueError(
            f"{mask_url(text)}: not a stream store URL ({scheme}: is neither SQLite nor "
            "PostgreSQL); give a data directory, a .sqlite3 file, sqlite:PATH or "
            "postgresql://USER@HOST/DATABASE"
        )
    p = _sqlite_path(text, create)
    return StoreLocation("sqlite", str(p), p)


def store_file(location: str | os.PathLike[str], *, create: bool = True) -> Path:
    """The SQLite store's file for ``location`` (:func:`store_location`'s rule):

    * an existing directory is a data directory: the store is its ``streams.sqlite3``;
    * an existing file is the store file itself;
    * a path that does not exist is a data directory (created, mode 0700, when
      ``create``), unless its name ends in ``.sqlite3``: then it names the store file;
    * ``sqlite:PATH``, ``file:PATH``, ``sqlite://PATH`` and ``file://PATH`` are ``PATH``.

    A PostgreSQL URL is not a file: ``ValueError`` (use :func:`store_location`), as is
    any other URL.  The result is absolute, so that processes started elsewhere (Spark's
    workers) find the same file.
    """
    loc = store_location(location, create=create)
    if loc.path is None:
        raise ValueError(f"{loc.display} is a PostgreSQL store, not a file")
    return loc.path


def _sqlite_path(text: str, create: bool) -> Path:
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
