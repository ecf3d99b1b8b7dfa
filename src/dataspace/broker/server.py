"""The dataspace server: dataspaces behind a gatekeeper, reachable over the network.

>>> import asyncio
>>> async def main():
...     server = Server(ServerConfig(tcp=["127.0.0.1:0"]), data_dir=tmp)   # doctest: +SKIP
...     await server.start()
...     print(server.sturdyref, server.addresses)
...     await server.close()

Each connection gets a :class:`~dataspace.protocol.relay.Relay` exporting a
:class:`~dataspace.protocol.gatekeeper.Gatekeeper` at OID 0.  A client resolves a
sturdyref there and receives a reference to a dataspace (the root one, or one a config
binding names), through which it asserts, observes and sends.  When a connection ends --
closed, timed out, killed, or cut for a protocol error -- everything it asserted is
retracted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

from ..datadir import ROOT_KEY, ROOT_STURDYREF, load_or_create_key, resolve_data_dir
from ..dataspace import Dataspace, DataspaceEntity
from ..net.address import Address
from ..net.connection import Connection, listen_tcp, listen_unix
from ..net.flow import Hub
from ..net.websocket import listen_ws
from ..protocol.gatekeeper import Bindings, Gatekeeper
from ..protocol.relay import Relay
from ..protocol.sturdy import SturdyRef, mint
from ..values import Symbol
from .config import ConfigError, ServerConfig

__all__ = ["Server"]

log = logging.getLogger(__name__)


class Server:
    """A running (after :meth:`start`) dataspace server.

    * ``config`` -- a :class:`~dataspace.broker.config.ServerConfig`;
    * ``data_dir`` -- overrides the configured data directory.

    After :meth:`start`: :attr:`sturdyref` (the root capability), :attr:`addresses`
    (where it listens, with real port numbers), :attr:`dataspaces`.
    """

    def __init__(self, config: ServerConfig | None = None, *, data_dir: str | Path | None = None) -> None:
        self.config = config or ServerConfig()
        self.relay_limits = self.config.relay_limits()
        self.flow = self.config.flow_limits()
        self._data_dir_arg = data_dir if data_dir is not None else self.config.data_dir
        self.data_dir: Path | None = None
        self.dataspaces: dict[str, Dataspace] = {}
        self._entities: dict[str, DataspaceEntity] = {}
        self.bindings = Bindings()
        self.sturdyref: SturdyRef | None = None
        self.addresses: list[Address] = []
        self.connections: set[Connection] = set()
        self.hub: Hub | None = None
        self._listeners: list[Any] = []
        self._unix_paths: list[str] = []
        self._turn: Callable[[], AbstractContextManager[Any]] | None = None
        self._stopping = False

    # -- setup ---------------------------------------------------------------------------

    def _dataspace(self, name: str) -> DataspaceEntity:
        ent = self._entities.get(name)
        if ent is None:
            ds = self.dataspaces[name] = Dataspace(name)
            ent = self._entities[name] = DataspaceEntity(ds)
        return ent

    def _setup(self) -> None:
        cfg = self.config
        self.data_dir = resolve_data_dir(self._data_dir_arg)
        key = cfg.root_key if cfg.root_key is not None else load_or_create_key(self.data_dir / ROOT_KEY)
        root = self._dataspace("root")
        self.bindings.bind(cfg.root_oid, key, root, "root")
        for b in cfg.bind:
            if not b.key:
                log.warning(
                    "binding for %r uses an empty key: anyone can make sturdyrefs for it", b.oid
                )
            self.bindings.bind(b.oid, b.key, self._dataspace(b.dataspace), b.dataspace)
        dss = list(self.dataspaces.values())
        if len(dss) == 1:
            self._turn = dss[0].turn
        else:
            self._turn = lambda: _all_turns(dss)
        self.sturdyref = mint(cfg.root_oid, key)
        _write_private(self.data_dir / ROOT_STURDYREF, str(self.sturdyref) + "\n")

    async def start(self) -> None:
        """Create the dataspaces, write ``root.sturdyref`` and start every listener.

        Raises ``OSError`` (with a message saying what to do) when a listener cannot
        start, and :class:`~dataspace.broker.config.ConfigError` for bad settings.
        """
        self._setup()
        self.hub = Hub(asyncio.get_running_loop())
        try:
            for addr in self.config.listeners():
                await self._listen(addr)
        except BaseException:
            await self.close()
            raise

    async def _listen(self, addr: Address) -> None:
        assert self.hub is not None
        try:
            if addr.kind == "tcp":
                srv = await listen_tcp(addr.host, addr.port, self.hub, self.flow, self._session)
                for sock in srv.sockets:
                    host, port = sock.getsockname()[:2]
                    self.addresses.append(Address("tcp", host, port))
            elif addr.kind == "unix":
                srv = await listen_unix(addr.path, self.hub, self.flow, self._session)
                self._unix_paths.append(addr.path)
                self.addresses.append(addr)
            elif addr.kind == "ws":
                srv = await listen_ws(
                    addr.host, addr.port, self.hub, self.flow, self._session,
                    self.relay_limits.max_packet_size,
                )
                for sock in srv.sockets:
                    host, port = sock.getsockname()[:2]
                    self.addresses.append(Address("ws", host, port, addr.path or "/"))
            else:  # pragma: no cover - parse_address only makes these kinds
                raise ConfigError(f"unknown listener kind {addr.kind}")
        except OSError as e:
            what = f"{addr.kind} {addr}"
            hint = ""
            if e.errno == 98:
                hint = ("; is another `dataspace serve` running? stop it, or choose another "
                        "address with --tcp/--ws HOST:PORT")
            elif e.errno == 13:
                hint = "; permission denied: use a port above 1023 or another path"
            raise OSError(e.errno, f"cannot listen on {what}: {e.strerror or e}{hint}") from None
        self._listeners.append(srv)
        log.info("listening on %s", self.addresses[-1])

    # -- connections ---------------------------------------------------------------------

    def _session(self, conn: Connection) -> Relay:
        relay = Relay(limits=self.relay_limits, name=conn.name, turn=self._turn)
        gk = Gatekeeper(self.bindings, on_rejected=relay.fail)
        relay.export_at(0, gk)
        if self._stopping:
            relay.fail("the server is shutting down", Symbol("shutdown"))
        elif len(self.connections) >= self.config.max_connections:
            log.warning("%s: refused: %d connections already", conn.name, len(self.connections))
            relay.fail(
                f"too many connections ({self.config.max_connections}); try again later",
                Symbol("too-many-connections"),
            )
            return relay
        self.connections.add(conn)
        conn.on_close.append(self.connections.discard)
        t = self.flow.handshake_timeout
        if t:
            timer = asyncio.get_running_loop().call_later(t, self._handshake_check, conn, gk)
            conn.on_close.append(lambda _c: timer.cancel())
        log.info("%s: connected", conn.name)
        conn.on_close.append(lambda c: log.info("%s: disconnected (%s)", c.name, c.close_reason))
        return relay

    def _handshake_check(self, conn: Connection, gk: Gatekeeper) -> None:
        if not conn.closed and gk.accepted == 0:
            conn.fail(
                f"no sturdyref resolved within {self.flow.handshake_timeout:g} s",
                Symbol("handshake-timeout"),
            )

    # -- running and stopping ------------------------------------------------------------

    async def close(self) -> None:
        """Stop listening and close every connection (their assertions are retracted)."""
        self._stopping = True
        for srv in self._listeners:
            srv.close()
        for conn in list(self.connections):
            conn.close("the server is shutting down")
        for srv in self._listeners:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(srv.wait_closed(), 5.0)
        self._listeners.clear()
        for p in self._unix_paths:
            with contextlib.suppress(OSError):
                os.unlink(p)
        self._unix_paths.clear()

    def stats(self) -> dict[str, Any]:
        """Connections, and per dataspace the number of distinct assertions."""
        return {
            "connections": len(self.connections),
            "dataspaces": {n: len(ds.assertions()) for n, ds in self.dataspaces.items()},
        }


@contextlib.contextmanager
def _all_turns(dss: list[Dataspace]) -> Iterator[None]:
    with ExitStack() as stack:
        for ds in dss:
            stack.enter_context(ds.turn())
        yield


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable by the owner only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
