"""Serving streams to remote readers by path over UDP (seed 004): the host of
:class:`dataspace.protocol.scry.Publisher` over a :class:`~.base.Store`.

The publisher machine never touches the store for a premature request: this host tells
it where each published stream ends, following the store's own wake-ups (appends by
any process: the server's recorders, ``dataspace stream append``, a pipeline), and reads
an entry once when the machine asks for it (a cache miss, or a new entry to broadcast).

Reads are verified (:mod:`.integrity`): an entry of a damaged store is never served --
the error goes to the log (one line, once per stream), the readers waiting for that
entry get no answer (they ask again, then time out), and the rest is served as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Hashable, Sequence
from typing import Any

from ..net.udp import Datagrams, open_udp
from ..protocol.scry import Publisher
from .base import Store, StoreCorrupt, check_stream_name

__all__ = ["ScryServer", "start_scry_udp"]

log = logging.getLogger(__name__)


class ScryServer:
    """Serves ``publish`` (stream names) of ``store`` over UDP (see the module docstring)."""

    def __init__(self, store: Store, publish: Sequence[str], **limits: Any) -> None:
        for s in publish:
            check_stream_name(s)
        self.store = store
        self.names = list(dict.fromkeys(publish))
        self.machine = Publisher(**limits)
        self.udp: Datagrams | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._watch: asyncio.Task[None] | None = None
        self._damaged: set[str] = set()  # streams whose damage was logged

    async def start(self, host: str, port: int) -> None:
        self._loop = asyncio.get_running_loop()
        for s in self.names:
            try:
                nxt, first = self._head(s)
            except StoreCorrupt as e:  # damaged bookkeeping: serve none of it (logged once)
                self._refuse(s, e)
                nxt = first = 0
            self.machine.publish(s, nxt, first)
        self.udp = await open_udp(self._datagram, local=(host, port))
        self._watch = self._loop.create_task(self._follow())

    @property
    def address(self) -> tuple[str, int]:
        assert self.udp is not None
        return self.udp.address

    def _head(self, s: str) -> tuple[int, int]:
        if not self.store.has_stream(s):
            return 0, 0
        nxt = self.store.next_index(s)
        first = self.store.first_index(s)
        return nxt, nxt if first is None else first

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _datagram(self, data: bytes, addr: Hashable) -> None:
        self.machine.datagram(data, addr, self._now())
        self._flush()

    def _flush(self) -> None:
        m = self.machine
        udp = self.udp
        while True:
            for data, addr in m.take_outgoing():
                if udp is not None:
                    udp.send(data, addr)
            loads = m.take_loads()
            if not loads:
                break
            now = self._now()
            for stream, index in loads:
                try:
                    got = self.store.read(stream, index, 1) if self.store.has_stream(stream) else []
                except StoreCorrupt as e:
                    self._refuse(stream, e)
                    m.unreadable(stream, index)
                    continue
                m.entry(stream, index, got[0].data if got and got[0].index == index else None, now)
        d = m.next_deadline()
        if d is not None and self._loop is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(d, self._tick)

    def _refuse(self, stream: str, e: StoreCorrupt) -> None:
        if stream not in self._damaged:
            self._damaged.add(stream)
            log.error("scry: not serving damaged entries of %s: %s", stream, e)

    def _tick(self) -> None:
        self._timer = None
        self.machine.tick(self._now())
        self._flush()

    async def _follow(self) -> None:
        """Tell the machine each time a published stream grows (the store's wake-ups)."""
        store = self.store
        heads = {s: self.machine.heads.get(s) for s in self.names}  # as start() published
        while True:
            gen = store.generation()
            for s in self.names:
                try:
                    h = self._head(s)
                except StoreCorrupt as e:  # its bookkeeping is damaged: keep the old head
                    self._refuse(s, e)
                    continue
                if h != heads[s]:
                    heads[s] = h
                    self.machine.appended(s, h[0], self._now(), h[1])
            self._flush()
            await store.wait_change_async(gen, None)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
        if self._timer is not None:
            self._timer.cancel()
        if self.udp is not None:
            self.udp.close()

    def stats(self) -> dict[str, Any]:
        return {**vars(self.machine.stats), **self.machine.memory()}

    def held_bytes(self) -> int:
        """What remote readers make this server hold (see :meth:`Publisher.held_bytes`):
        counted in the broker's memory budget when it has one."""
        return self.machine.held_bytes()


async def start_scry_udp(store: Store, host: str, port: int, publish: Sequence[str]) -> ScryServer:
    """Start serving ``publish`` on ``host:port`` (UDP); raises OSError if it cannot bind."""
    srv = ScryServer(store, publish)
    await srv.start(host, port)
    log.info("scry: serving %s on udp://%s:%d/", ", ".join(publish), *srv.address)
    return srv
