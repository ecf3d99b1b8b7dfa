"""Where dataspace keeps its files: the data directory and what lives in it.

The data directory is, in order of precedence: an explicit ``--data-dir`` argument, the
``DATASPACE_DATA_DIR`` environment variable, ``$XDG_DATA_HOME/dataspace``, or
``~/.local/share/dataspace``.  It holds:

* ``root.key`` -- the secret key of the server's root capability (32 random bytes,
  created on first use, file mode 0600);
* ``root.sturdyref`` -- the root capability in Preserves text, for clients;
* ``streams.sqlite3`` -- the embedded stream store.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = [
    "ROOT_KEY",
    "ROOT_STURDYREF",
    "STREAMS_DB",
    "default_data_dir",
    "load_or_create_key",
    "resolve_data_dir",
]

ROOT_KEY = "root.key"
ROOT_STURDYREF = "root.sturdyref"
STREAMS_DB = "streams.sqlite3"

KEY_BYTES = 32


def default_data_dir() -> Path:
    """The data directory when none is given explicitly."""
    env = os.environ.get("DATASPACE_DATA_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "dataspace"


def resolve_data_dir(explicit: str | os.PathLike[str] | None = None, *, create: bool = True) -> Path:
    """The data directory to use (``explicit`` wins), created (mode 0700) if asked."""
    d = Path(explicit).expanduser() if explicit else default_data_dir()
    if create:
        try:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise OSError(
                f"cannot create the data directory {d}: {e.strerror}; choose another with "
                "--data-dir or DATASPACE_DATA_DIR"
            ) from e
    return d


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
