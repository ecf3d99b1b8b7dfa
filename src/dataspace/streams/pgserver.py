"""A throwaway PostgreSQL server on loopback, for the tests, the benchmarks and the crash
harness of the PostgreSQL store: ``initdb`` into a temporary directory, ``postgres`` on a
free 127.0.0.1 port with its Unix socket in that directory, a fresh database per use.

>>> # with TempPostgres() as pg:
>>> #     url = pg.create_database("t1")      # postgresql://dataspace:...@127.0.0.1:PORT/t1
>>> #     ...
>>> #     pg.drop_database("t1")

It runs the server binaries of the machine (Debian's ``postgresql`` package puts them in
``/usr/lib/postgresql/VERSION/bin``; ``$DATASPACE_PG_BIN`` names another directory).
``initdb`` refuses to run as root, so as root both programs run as the ``postgres`` user
(which the package creates), in a directory it owns.  The server is a test server: no
fsync (nothing here survives the server's own crash; the store's clients are what the
tests kill), loopback only, password authentication over TCP.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

__all__ = ["PostgresNotFound", "TempPostgres", "find_bin_dir"]

SUPERUSER = "dataspace"


class PostgresNotFound(RuntimeError):
    """No PostgreSQL server binaries on this machine (the message says how to get them)."""


def _version_key(path: str) -> tuple[int, ...]:
    m = re.search(r"/postgresql/([0-9.]+)/", path)
    return tuple(int(x) for x in m.group(1).split(".") if x) if m else (0,)


def find_bin_dir() -> Path:
    """The directory holding ``initdb`` and ``postgres``: ``$DATASPACE_PG_BIN``, else
    the newest ``/usr/lib/postgresql/*/bin``, else ``$PATH``."""
    env = os.environ.get("DATASPACE_PG_BIN")
    if env:
        if not (Path(env) / "initdb").exists():
            raise PostgresNotFound(f"DATASPACE_PG_BIN={env} holds no initdb")
        return Path(env)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version_key)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb and shutil.which("postgres"):
        return Path(initdb).parent
    raise PostgresNotFound(
        "no PostgreSQL server binaries (initdb, postgres) on this machine; install them "
        "(Debian/Ubuntu: apt-get install -y postgresql; `make test` does it when run as "
        "root) or set DATASPACE_PG_BIN to their directory"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TempPostgres:
    """A PostgreSQL server in a temporary directory (see the module docstring)."""

    def __init__(self, *, start_timeout: float = 90.0, max_connections: int = 300) -> None:
        self.bin = find_bin_dir()
        self.start_timeout = start_timeout
        self.max_connections = max_connections
        self.password = secrets.token_hex(12)
        self.port = 0
        self.dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._ready = threading.Event()
        self._ended = threading.Event()
        self._log: list[str] = []
        self._as: dict[str, Any] = {}

    # -- life -----------------------------------------------------------------------------

    def _run_as(self) -> dict[str, Any]:
        """Popen arguments that run a program as the ``postgres`` user when we are root
        (``initdb`` refuses root); nothing otherwise."""
        if os.geteuid() != 0:
            return {}
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            raise PostgresNotFound(
                "running as root, and there is no 'postgres' user to run the server as "
                "(initdb refuses root); install the postgresql package, which creates it"
            ) from None
        return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}

    def start(self) -> TempPostgres:
        """initdb and start the server; returns once it accepts connections."""
        self._as = self._run_as()
        self.dir = Path(tempfile.mkdtemp(prefix="dataspace-pg-"))
        if self._as:
            os.chown(self.dir, self._as["user"], self._as["group"])
        data = self.dir / "data"
        pwfile = self.dir / "pwfile"
        pwfile.write_text(self.password + "\n")
        if self._as:
            os.chown(pwfile, self._as["user"], self._as["group"])
        env = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
        r = subprocess.run(
            [str(self.bin / "initdb"), "-D", str(data), "-U", SUPERUSER, f"--pwfile={pwfile}",
             "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C",
             "--no-sync"],
            cwd=self.dir, env=env, capture_output=True, text=True, timeout=self.start_timeout,
            **self._as,
        )
        pwfile.unlink()
        if r.returncode != 0:
            raise RuntimeError(f"initdb failed ({r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [str(self.bin / "postgres"), "-D", str(data), "-p", str(self.port),
             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.dir}",
             "-c", f"max_connections={self.max_connections}", "-c", "fsync=off",
             "-c", "full_page_writes=off", "-c", "synchronous_commit=on",
             "-c", "logging_collector=off", "-c", "log_min_messages=warning"],
            cwd=self.dir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True, **self._as,
        )
        threading.Thread(target=self._pump, name="temp-postgres-log", daemon=True).start()
        if not self._ready.wait(self.start_timeout) or (self._ended.is_set() and not self._ready.is_set()):
            tail = "\n".join(self._log[-20:])
            self.stop()
            raise RuntimeError(f"the PostgreSQL server did not start within {self.start_timeout}s:\n{tail}")
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self._log.append(line)
            del self._log[:-200]
            if "ready to accept connections" in line:
                self._ready.set()
        self._ended.set()
        self._ready.set()  # wakes start(), which then sees the server ended

    @property
    def log_tail(self) -> str:
        """The server's last log lines."""
        return "\n".join(self._log[-40:])

    def stop(self) -> None:
        """Fast shutdown (clients are disconnected), then remove the directory."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> TempPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- databases ------------------------------------------------------------------------

    def url(self, database: str = "postgres", *, password: str | None = None) -> str:
        """The URL of a database on this server (with the superuser's password)."""
        pw = self.password if password is None else password
        return f"postgresql://{SUPERUSER}:{pw}@127.0.0.1:{self.port}/{database}"

    def _admin(self) -> Any:
        import psycopg

        return psycopg.connect(self.url("postgres"), autocommit=True, connect_timeout=30)

    def create_database(self, name: str) -> str:
        """Create an empty database; returns its URL."""
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
            raise ValueError(f"database name {name!r}: lower-case letters, digits and _")
        with self._admin() as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop a database, disconnecting its clients."""
        with self._admin() as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def execute(self, database: str, sql: str) -> list[tuple[Any, ...]]:
        """Run one statement as the superuser in ``database``; the rows it returns."""
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True, connect_timeout=30) as c:
            cur = c.execute(sql)
            return list(cur.fetchall()) if cur.description else []
