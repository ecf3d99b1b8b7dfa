"""Following streams by path from another machine (seed 004): the reader's API.

>>> async def main():                                     # doctest: +SKIP
...     async for entry in scry.follow("udp://127.0.0.1:7413/chat", start=0):
...         print(entry.index, entry.value)

A server publishes streams with ``dataspace serve --scry-udp HOST:PORT --publish STREAM``.
:func:`follow` yields each entry once, in order, for as long as you iterate, across packet
loss and publisher restarts (it keeps polling, on a dynamic interval, while the publisher
is away); :func:`get` waits for one entry.  When nothing answers for 3 s it says so once
(a warning on the ``dataspace.scry`` logger, or your ``notify``) and keeps trying, unless
``timeout`` says when to give up.  See docs/scry.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from .net.udp import open_udp
from .protocol.scry import FixedPoll, HazardPoll, PoissonPoll, PollModel, Reader, ReaderNotice
from .values import Value, decode

log = logging.getLogger(__name__)

QUIET = 3.0
"""Seconds without any answer before :func:`follow` says that nothing answers."""

__all__ = ["ScryEntry", "ScryError", "follow", "get", "parse_url", "poll_model"]

_URL = re.compile(r"udp://(?P<host>\[[^\]]+\]|[^:/]+):(?P<port>\d+)/(?P<path>.+)")


class ScryError(Exception):
    """The publisher refused (the stream is not published there), or a bad URL."""


@dataclass(frozen=True)
class ScryEntry:
    """One entry read by path: its index, value and canonical encoding."""

    stream: str
    index: int
    data: bytes

    @property
    def value(self) -> Value:
        return decode(self.data)


def parse_url(url: str, *, index: bool = False) -> tuple[str, int, str, int | None]:
    """``udp://HOST:PORT/STREAM`` (or ``.../STREAM/INDEX`` with ``index``): host, port,
    stream, index.  Raises :class:`ScryError` naming what is wrong."""
    m = _URL.fullmatch(url)
    if m is None:
        raise ScryError(f"not a scry URL: {url!r}; expected udp://HOST:PORT/STREAM"
                        + ("/INDEX" if index else ""))
    host = m["host"].strip("[]")
    port = int(m["port"])
    path = m["path"]
    idx: int | None = None
    if index:
        stream, _, tail = path.rpartition("/")
        if not stream or not tail.isdigit():
            raise ScryError(f"{url!r} names no entry: expected udp://HOST:PORT/STREAM/INDEX")
        path, idx = stream, int(tail)
    if not 0 < port < 65536:
        raise ScryError(f"bad port in {url!r}")
    return host, port, path, idx


def poll_model(spec: str | PollModel | None) -> PollModel:
    """``adaptive`` (the default: :class:`HazardPoll`), ``poisson``, or ``fixed:SECONDS``."""
    if isinstance(spec, PollModel):
        return spec
    if spec is None or spec == "adaptive":
        return HazardPoll()
    if spec == "poisson":
        return PoissonPoll()
    if spec.startswith("fixed:"):
        try:
            s = float(spec[6:])
        except ValueError:
            s = -1.0
        if s > 0:
            return FixedPoll(s)
    raise ScryError(f"bad poll schedule {spec!r}: use adaptive, poisson or fixed:SECONDS")


def _say(url: str, stream: str, n: ReaderNotice, refused: bool, give_up: float | None) -> str:
    """One line for a :class:`ReaderNotice` (see :func:`follow`)."""
    if n.kind == "ready":
        return f"following {url} from entry {n.index}"
    if n.kind == "back":
        return f"{url} answers again (after {n.seconds:.0f} s of silence)"
    if n.malformed:
        why = (f"only {n.malformed} datagram(s) that are not scry answers: is that port a "
               "server's --scry-udp?")
    else:
        host_port = url[len("udp://"):].split("/", 1)[0]
        why = ("nothing listens on that port: " if refused else "") + (
            f"is a server publishing {stream!r} there? start one with: "
            f"dataspace serve --scry-udp {host_port} --publish {stream}")
    if n.kind == "gave-up":
        return f"no answer from {url} for {n.seconds:.0f} s ({why}); giving up"
    tail = "still trying" + ("" if give_up is None else f", giving up after {give_up:g} s")
    return f"no answer from {url} after {n.seconds:.0f} s ({why}); {tail}"


def _log_notice(n: ReaderNotice, line: str) -> None:
    log.log(logging.WARNING if n.kind in ("silent", "gave-up") else logging.INFO, "%s", line)


async def follow(
    url: str,
    start: int | str | None = None,
    *,
    poll: str | PollModel | None = None,
    timeout: float | None = None,
    notify: Callable[[str], None] | None = None,
) -> AsyncIterator[ScryEntry]:
    """Yield the entries of the stream at ``url`` once each, in order, from ``start`` (an
    index; ``"start"``: the oldest kept; None or ``"next"``: the next to be appended).

    When nothing answers for 3 s, one line says so (``notify(line)``, or a warning on
    this module's logger) and the reader keeps trying; ``timeout``: seconds without any
    answer after which it gives up, raising :class:`ScryError` (default: never).
    ``notify`` also hears ``following URL from entry N`` when the publisher first answers,
    and ``URL answers again`` after a silence (logged at INFO without it)."""
    host, port, stream, _ = parse_url(url)
    if timeout is not None and not timeout > 0:
        raise ScryError(f"bad timeout {timeout!r}: a number of seconds above 0")
    if start == "start":
        first: int | None = 0
    elif start is None or start == "next":
        first = None
    elif isinstance(start, int) and start >= 0:
        first = start
    else:
        raise ScryError(f"bad start {start!r}: an index, 'start' or 'next'")
    reader = Reader(stream, first, poll=poll_model(poll), quiet=QUIET, give_up=timeout)
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    peer: list[Any] = []

    def datagram(data: bytes, addr: Any) -> None:
        if peer and addr[:2] != peer[0][:2]:
            return  # only the publisher's datagrams
        reader.datagram(data, loop.time())
        wake.set()

    udp = await open_udp(datagram, remote=(host, port))
    peer.append(udp.transport.get_extra_info("peername") if udp.transport else (host, port))
    try:
        reader.begin(loop.time())
        while True:
            for data in reader.take_outgoing():
                udp.send(data)
            for n in reader.take_notices():
                line = _say(url, stream, n, udp.errors > 0, timeout)
                if n.kind == "gave-up":
                    raise ScryError(line)
                if notify is not None:
                    notify(line)
                else:
                    _log_notice(n, line)
            for index, data in reader.take_entries():
                yield ScryEntry(stream, index, data)
            if reader.error is not None:
                raise ScryError(f"{url}: {reader.error}")
            d = reader.next_deadline()
            wait = None if d is None else max(0.0, d - loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), wait)
            wake.clear()
            reader.tick(loop.time())
    finally:
        udp.close()


async def get(url: str, *, timeout: float | None = None, poll: str | PollModel | None = None,
              notify: Callable[[str], None] | None = None) -> ScryEntry:
    """The entry at ``udp://HOST:PORT/STREAM/INDEX``, waiting for it to exist (at most
    ``timeout`` seconds in all: then :class:`TimeoutError`).  ``notify``: as for
    :func:`follow` (it says when nothing answers)."""
    host, port, stream, index = parse_url(url, index=True)

    def relay(line: str) -> None:
        if notify is not None and not line.startswith("following "):
            notify(line)  # (which entry is awaited is in the URL)

    async def one() -> ScryEntry:
        async for e in follow(f"udp://{host}:{port}/{stream}", start=index, poll=poll,
                              notify=relay if notify is not None else None):
            if e.index != index:
                raise ScryError(f"{url}: entry {index} is gone (retention); the oldest kept "
                                f"is {e.index}")
            return e
        raise ScryError(f"{url}: the stream ended")  # pragma: no cover - follow never ends

    return await asyncio.wait_for(one(), timeout)
