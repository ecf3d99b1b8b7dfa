"""PostgreSQL going away under an open store: said once, in our words, and said when it is
back (not psycopg_pool's raw two-line warning at every retry)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import urllib.parse

import pytest

from dataspace.streams import StoreError, _pglog, open_store

LONG = 60.0


class Proxy:
    """A TCP forwarder on loopback in front of the test server: ``down()`` closes every
    connection and the port (connections are refused, as from a stopped server); ``up()``
    listens on the same port again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        self.listener: socket.socket | None = None
        self.up()

    def up(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(16)
        self.port = ls.getsockname()[1]
        self.listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                c, _ = ls.accept()
            except OSError:
                return
            s = socket.create_connection(self.target)
            with self.lock:
                self.socks += [c, s]
            for a, b in ((c, s), (s, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_RDWR)

    def down(self) -> None:
        assert self.listener is not None
        with contextlib.suppress(OSError):  # wakes the accept (a close alone leaves it)
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.lock:
            socks, self.socks = self.socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def test_a_stopped_server_is_said_once_in_our_words_and_its_return_too(pg_url, caplog):
    u = urllib.parse.urlsplit(pg_url)
    proxy = Proxy((u.hostname, u.port))
    url = urllib.parse.urlunsplit(u._replace(netloc=u.netloc.replace(f":{u.port}", f":{proxy.port}")))
    where = f"127.0.0.1:{proxy.port}"
    caplog.set_level(logging.DEBUG, logger="psycopg.pool")
    with open_store(url) as store:
        store.append("s", 1)
        with caplog.at_level(logging.WARNING):
            proxy.down()
            with pytest.raises(StoreError):
                store.next_index("s")  # the pool's connection is gone: it reconnects
            # The pool retries (after 1 s, 2 s, ...): wait for its second refused attempt.
            assert _pglog.wait_attempts(where, 2, LONG)
            proxy.up()
            assert _pglog.wait_answered(where, LONG)  # the pool's next attempt got in
            assert store.next_index("s") == 1
    said = [(r.name, r.levelno, r.getMessage()) for r in caplog.records
            if r.levelno >= logging.WARNING and "wake-up" not in r.getMessage()]
    assert said == [
        ("dataspace.streams.postgres", logging.WARNING,
         f"PostgreSQL at {where} is not answering (connection refused); retrying ..."),
        ("dataspace.streams.postgres", logging.WARNING, f"PostgreSQL at {where} answers again"),
    ]
