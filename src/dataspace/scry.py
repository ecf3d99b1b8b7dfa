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

__all__ = ["ScryEntry", "ScryError", "follow", "get", "parse_url", "parse_urls", "poll_model"]

_URL = re.compile(r"udp://(?P<host>\[[^\]]+\]|[^:/,]+):(?P<port>\d+)/(?P<path>.+)")

SWITCH = 3.0
"""Seconds without an answer from one of several publishers before :func:`follow` moves
to the next (it polls at least every :data:`SWITCH_POLL` seconds while waiting, so a
publisher that died is noticed within about the sum of the two)."""
SWITCH_POLL = 2.0


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


def parse_urls(url: str | list[str] | tuple[str, ...], *,
               index: bool = False) -> tuple[list[tuple[str, int]], str, int | None]:
    """Several publishers of one stream: ``udp://HOST:PORT,HOST:PORT,.../STREAM`` (the
    members of a cluster sharing a store), or a list of ``udp://HOST:PORT/STREAM`` URLs
    of one stream.  Returns the addresses, the stream and the index (with ``index``)."""
    urls = [url] if isinstance(url, str) else list(url)
    if not urls:
        raise ScryError("no scry URL given")
    addrs: list[tuple[str, int]] = []
    stream: str | None = None
    idx: int | None = None
    for u in urls:
        if not u.startswith("udp://"):
            raise ScryError(f"not a scry URL: {u!r}; expected udp://HOST:PORT/STREAM"
                            + ("/INDEX" if index else ""))
        hosts, _slash, path = u[len("udp://"):].partition("/")
        for part in hosts.split(","):
            h, p, st, i = _parse_one(f"udp://{part.strip()}/{path}", u, index)
            if stream is not None and (st, i) != (stream, idx):
                raise ScryError(f"{u!r} names another stream than {urls[0]!r}: give the "
                                "addresses of one stream's publishers")
            stream, idx = st, i
            addrs.append((h, p))
    assert stream is not None
    return addrs, stream, idx


def parse_url(url: str, *, index: bool = False) -> tuple[str, int, str, int | None]:
    """``udp://HOST:PORT/STREAM`` (or ``.../STREAM/INDEX`` with ``index``): host, port,
    stream, index.  Raises :class:`ScryError` naming what is wrong.  Several publishers
    (``udp://HOST:PORT,HOST:PORT/STREAM``): the first's (see :func:`parse_urls`)."""
    addrs, stream, idx = parse_urls(url, index=index)
    return addrs[0][0], addrs[0][1], stream, idx


def _parse_one(url: str, given: str, index: bool) -> tuple[str, int, str, int | None]:
    m = _URL.fullmatch(url)
    if m is None:
        tail = "/INDEX" if index else ""
        raise ScryError(f"not a scry URL: {given!r}; expected udp://HOST:PORT/STREAM{tail}"
                        + (f" (several publishers: udp://HOST:PORT,HOST:PORT/STREAM{tail})"
                           if "," in given else ""))
    host = m["host"].strip("[]")
    port = int(m["port"])
    path = m["path"]
    idx: int | None = None
    if index:
        stream, _, tail = path.rpartition("/")
        if not stream or not tail.isdigit():
            raise ScryError(f"{given!r} names no entry: expected udp://HOST:PORT/STREAM/INDEX")
        path, idx = stream, int(tail)
    if not 0 < port < 65536:
        raise ScryError(f"bad port in {given!r}")
    return host, port, path, idx


def _url(host: str, port: int, stream: str) -> str:
    return f"udp://[{host}]:{port}/{stream}" if ":" in host else f"udp://{host}:{port}/{stream}"


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


class _Capped(PollModel):
    """A poll model whose waits are at most ``cap`` seconds (a follower of several
    publishers must hear soon that its publisher went)."""

    def __init__(self, inner: PollModel, cap: float) -> None:
        self.inner = inner
        self.max_delay = min(inner.max_delay, cap)
        self.min_delay = inner.min_delay

    def observe(self, now: float) -> None:
        self.inner.observe(now)

    def delay(self, since_last: float, k: int) -> float:
        return min(self.max_delay, self.inner.delay(since_last, k))


class _Gone(Exception):
    """The publisher followed stopped answering, or refused (several publishers: the
    follower moves to the next)."""

    def __init__(self, why: str, refused: bool = False) -> None:
        super().__init__(why)
        self.refused = refused


async def _read(host: str, port: int, reader: Reader,
                on_notice: Callable[[ReaderNotice, bool], None]) -> AsyncIterator[ScryEntry]:
    """Run ``reader`` against the publisher at ``host:port``: its entries, in order;
    ``on_notice(notice, refused)`` for each notice (it may raise to stop)."""
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
                on_notice(n, udp.errors > 0)
            for index, data in reader.take_entries():
                yield ScryEntry(reader.stream, index, data)
            if reader.error is not None:
                raise _Gone(reader.error, refused=True)
            d = reader.next_deadline()
            wait = None if d is None else max(0.0, d - loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), wait)
            wake.clear()
            reader.tick(loop.time())
    finally:
        udp.close()


async def follow(
    url: str | list[str] | tuple[str, ...],
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
    and ``URL answers again`` after a silence (logged at INFO without it).

    **Several publishers** of one stream -- the members of a cluster that share a store,
    which serve its streams with the same indices -- are given as
    ``udp://HOST:PORT,HOST:PORT/STREAM`` or a list of URLs: the follower reads from the
    first that answers and, when that one stops answering (3 s without an answer; it
    polls at least every 2 s), goes on from the next with the entry it awaits: no gap,
    no repeat.  Each move is said in one line; ``timeout`` is then the time without an
    answer from any of them."""
    addrs, stream, _ = parse_urls(url)
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

    def tell(n: ReaderNotice | None, line: str) -> None:
        if notify is not None:
            notify(line)
        elif n is not None:
            _log_notice(n, line)
        else:
            log.warning("%s", line)

    if len(addrs) == 1:
        host, port = addrs[0]
        text = url if isinstance(url, str) else url[0]
        reader = Reader(stream, first, poll=poll_model(poll), quiet=QUIET, give_up=timeout)

        def said(n: ReaderNotice, refused: bool) -> None:
            line = _say(text, stream, n, refused, timeout)
            if n.kind == "gave-up":
                raise ScryError(line)
            tell(n, line)

        try:
            async for e in _read(host, port, reader, said):
                yield e
        except _Gone as g:
            raise ScryError(f"{text}: {g}") from None
        return

    # Several publishers: one reader at a time, the next from where the last stopped.
    loop = asyncio.get_running_loop()
    names = [_url(h, p, stream) for h, p in addrs]
    nxt = first
    at = 0
    answered_at = loop.time()
    refusals: dict[int, str] = {}
    unanswered_round = 0
    said_round = False
    moved_from = ""
    while True:
        name = names[at]
        reader = Reader(stream, nxt, poll=_Capped(poll_model(poll), SWITCH_POLL),
                        quiet=SWITCH + 1.0, give_up=SWITCH)
        answered = False

        def said_many(n: ReaderNotice, refused: bool, name: str = name,
                      moved_from: str = moved_from) -> None:
            nonlocal answered, answered_at
            if n.kind in ("ready", "back"):
                answered = True
                answered_at = loop.time()
                if n.kind == "ready":
                    tell(n, f"following {name} from entry {n.index}" + (
                        f" (moved from {moved_from})" if moved_from else ""))
            elif n.kind == "gave-up":
                raise _Gone(f"no answer for {n.seconds:.0f} s")

        try:
            async for e in _read(addrs[at][0], addrs[at][1], reader, said_many):
                answered_at = loop.time()
                nxt = e.index + 1
                yield e
        except _Gone as g:
            if reader.next is not None:
                nxt = reader.next  # the entry awaited: the next publisher goes on from it
            if g.refused:
                refusals[at] = str(g)
                if len(refusals) == len(addrs):
                    raise ScryError(f"every publisher refused {stream!r}: " + "; ".join(
                        f"{names[i]}: {w}" for i, w in sorted(refusals.items()))) from None
            else:
                refusals.pop(at, None)
            unanswered_round = 0 if answered else unanswered_round + 1
            if answered:
                said_round = False
            silent = loop.time() - answered_at
            if timeout is not None and silent >= timeout:
                raise ScryError(f"no answer from {', '.join(names)} for {silent:.0f} s; "
                                "giving up") from None
            at = (at + 1) % len(addrs)
            if answered or not moved_from:
                moved_from = name
            if unanswered_round < len(addrs):
                tell(None, f"{name}: {g}; trying {names[at]}" + (
                    f" from entry {nxt}" if nxt is not None else ""))
            elif not said_round:
                said_round = True
                tell(None, f"no answer from any of {', '.join(names)} (is a server "
                     f"publishing {stream!r} there?); still trying" + (
                         "" if timeout is None else f", giving up after {timeout:g} s"))


async def get(url: str, *, timeout: float | None = None, poll: str | PollModel | None = None,
              notify: Callable[[str], None] | None = None) -> ScryEntry:
    """The entry at ``udp://HOST:PORT/STREAM/INDEX``, waiting for it to exist (at most
    ``timeout`` seconds in all: then :class:`TimeoutError`).  ``notify``: as for
    :func:`follow` (it says when nothing answers)."""
    addrs, stream, index = parse_urls(url, index=True)
    urls = [_url(h, p, stream) for h, p in addrs]

    def relay(line: str) -> None:
        if notify is not None and not line.startswith("following "):
            notify(line)  # (which entry is awaited is in the URL)

    async def one() -> ScryEntry:
        async for e in follow(urls if len(urls) > 1 else urls[0], start=index, poll=poll,
                              notify=relay if notify is not None else None):
            if e.index != index:
                raise ScryError(f"{url}: entry {index} is gone (retention); the oldest kept "
                                f"is {e.index}")
            return e
        raise ScryError(f"{url}: the stream ended")  # pragma: no cover - follow never ends

    return await asyncio.wait_for(one(), timeout)
