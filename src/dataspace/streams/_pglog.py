"""psycopg_pool's warnings, said once in our words.

When PostgreSQL stops, the connection pool tries again every few seconds and logs each
attempt as a raw two-line warning (``error connecting in 'pool': connection failed:
connection to server at "127.0.0.1", port 5432 failed: Connection refused`` and libpq's
hint on a second line).  A store's pool is registered here (:func:`register_pool`) with
the server it talks to; a filter on the ``psycopg.pool`` logger turns those warnings into
one line of ours -- ``PostgreSQL at 127.0.0.1:5432 is not answering (connection refused);
retrying ...`` -- at most every :data:`REPEAT` seconds per server, and the pool's
reports of connections it discards into debug lines.  :func:`answered` says when the
server is back.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

__all__ = ["REPEAT", "answered", "pool_name", "register_pool", "unregister_pool",
           "wait_answered", "wait_attempts"]

log = logging.getLogger("dataspace.streams.postgres")

REPEAT = 30.0
"""The least seconds between two "not answering" lines about one server."""

_lock = threading.Lock()
_changed = threading.Condition(_lock)
_attempts: dict[str, int] = {}  # "HOST:PORT" -> failed attempts to connect (said or not)
_answers: dict[str, int] = {}  # "HOST:PORT" -> times it was said to answer again
_where: dict[str, str] = {}  # pool name -> "HOST:PORT"
_said: dict[str, float] = {}  # "HOST:PORT" -> when we last said it is not answering
_down: set[str] = set()  # servers said not to answer, not yet said to answer again
_numbers = itertools.count(1)
_installed = False


def server_of(url: str) -> str:
    """``HOST:PORT`` of a libpq URL (as far as it says; libpq's defaults otherwise)."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        d = conninfo_to_dict(url)
    except Exception:
        return "the server"
    host = str(d.get("host") or d.get("hostaddr") or "localhost")
    return f"{host}:{d.get('port') or 5432}"


def pool_name() -> str:
    """A name for a new pool, unique in this process."""
    return f"dataspace-store-{next(_numbers)}"


def register_pool(name: str, url: str) -> None:
    """Speak for the pool ``name``, which connects to ``url``."""
    global _installed
    with _lock:
        _where[name] = server_of(url)
        if not _installed:
            logging.getLogger("psycopg.pool").addFilter(_filter)
            _installed = True


def unregister_pool(name: str) -> None:
    with _lock:
        _where.pop(name, None)


def answered(name: str) -> None:
    """A connection of pool ``name`` was made: if its server was said to be down, say it
    is back (once)."""
    with _lock:
        where = _where.get(name)
        if where is None or where not in _down:
            return
        _down.discard(where)
        _said.pop(where, None)
        _answers[where] = _answers.get(where, 0) + 1
        _changed.notify_all()
    log.warning("PostgreSQL at %s answers again", where)


def wait_attempts(where: str, n: int, timeout: float) -> bool:
    """Wait until the pools connecting to ``where`` (``HOST:PORT``) failed ``n`` attempts."""
    with _changed:
        return _changed.wait_for(lambda: _attempts.get(where, 0) >= n, timeout)


def wait_answered(where: str, timeout: float) -> bool:
    """Wait until ``where`` was said to answer again."""
    with _changed:
        return _changed.wait_for(lambda: _answers.get(where, 0) > 0, timeout)


def _reason(ex: Any) -> str:
    """libpq's reason, short: ``connection refused``, ``timeout expired``..."""
    first = (str(ex).strip().splitlines() or [type(ex).__name__])[0]
    reason = first.rsplit("failed: ", 1)[-1].strip().rstrip(".")
    return reason[:1].lower() + reason[1:] if reason else type(ex).__name__


def _filter(record: logging.LogRecord) -> bool:
    """Let through what we do not speak for; say the rest our way."""
    args = record.args if isinstance(record.args, tuple) else ()
    name = args[0] if args and isinstance(args[0], str) else None
    with _lock:
        where = _where.get(name) if name is not None else None
    if record.msg == "error connecting in %r: %s" and where is not None and len(args) > 1:
        now = time.monotonic()
        with _lock:
            say = now - _said.get(where, -REPEAT) >= REPEAT
            if say:
                _said[where] = now
            _down.add(where)
            _attempts[where] = _attempts.get(where, 0) + 1
            _changed.notify_all()
        if say:
            log.warning("PostgreSQL at %s is not answering (%s); retrying ...", where,
                        _reason(args[1]))
        return False
    if isinstance(record.msg, str) and record.msg.startswith("reconnection attempt in pool") \
            and where is not None:
        log.debug("the pool of %s stopped retrying for now (the next use tries again)", where)
        return False
    if isinstance(record.msg, str) and record.msg.startswith(("discarding broken connection",
                                                               "discarding closed connection")):
        log.debug("a connection to PostgreSQL was lost (%s)", record.getMessage())
        return False
    return True
