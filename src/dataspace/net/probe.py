"""What kind of port answers at an address: asked when a connection failed in a way that
says the address names the wrong kind (see :mod:`.sniff`).

:func:`what_listens` makes one or two short connections: a TLS handshake (certificates
not checked: nothing secret is sent), and over it, or in the clear when the port does not
speak TLS, :data:`~.sniff.PROBE_REQUEST`; the first bytes of the answer say which of
:data:`~.sniff.KINDS` the port is.  :func:`explain_mismatch` is the line for a client
whose address does not match it.  Only error paths call these: a connection that works
is never probed.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import stat
from urllib.parse import urlsplit

from .address import Address
from .sniff import (
    HEAD_BYTES,
    PROBE_REQUEST,
    SYNDICATE,
    identify,
    listener_kind,
    mismatch,
    what_answered,
    wrong_scheme,
)

__all__ = ["PROBE_TIMEOUT", "explain_mismatch", "explain_unix", "explain_url", "what_listens"]

PROBE_TIMEOUT = 3.0
"""Seconds each of the probe's connections may take, answer included."""


def _no_check_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def _ask(host: str, port: int, tls: bool, timeout: float) -> bytes | None:
    """The first bytes of the port's answer to the probe's request (over TLS when
    ``tls``); None when it could not be asked (refused, no TLS handshake, timed out)."""
    ctx = _no_check_context() if tls else None
    try:
        async with asyncio.timeout(timeout):
            r, w = await asyncio.open_connection(host, port, ssl=ctx,
                                                 server_hostname="" if tls else None,
                                                 ssl_handshake_timeout=timeout if tls else None)
            try:
                w.write(PROBE_REQUEST)
                await w.drain()
                head = b""
                while len(head) < 16:  # enough for "HTTP/1.1 101 " and a packet's start
                    got = await r.read(HEAD_BYTES - len(head))
                    if not got:
                        break
                    head += got
                return head
            finally:
                w.transport.abort()
    except (OSError, TimeoutError, ssl.SSLError, EOFError):
        return None


async def what_listens(host: str, port: int, timeout: float = PROBE_TIMEOUT) -> str | None:
    """The kind of port at ``host:port`` (``tcp``, ``tls``, ``ws``, ``wss``, ``http`` or
    ``https``: :data:`~.sniff.KINDS`), or None when it is none of them or does not say."""
    return (await _probe(host, port, timeout))[0]


async def _probe(host: str, port: int, timeout: float) -> tuple[str | None, bytes | None]:
    """The kind of port, and the first bytes it answered in the clear (when asked)."""
    head = await _ask(host, port, True, timeout)
    if head is not None:
        kind = listener_kind(head, tls=True)
        if kind is not None:
            return kind, None
    head = await _ask(host, port, False, timeout)
    return (None if head is None else listener_kind(head, tls=False)), head


async def explain_mismatch(address: Address, timeout: float = PROBE_TIMEOUT) -> str | None:
    """The line saying what answers at ``address`` and what address to use, when it is
    another kind of port than the address says (a plain TCP port for ``wss://`` ...), or
    for a ``tls://``, ``ws://`` or ``wss://`` address, what another protocol's port there
    answered (``that port speaks NATS``); None when it is the kind asked for or differs
    in TLS alone, or cannot be told (then the caller's own explanation stands)."""
    if address.kind == "unix":
        return None
    found, head = await _probe(address.host, address.port, timeout)
    if found is None:
        if head and address.kind != "tcp" and identify(head) != SYNDICATE:
            return (f"{address.host_port} is not a dataspace server: {what_answered(head)}, "
                    "not the Syndicate protocol")
        return None
    if found in (address.kind, _OTHER_TLS[address.kind]):
        return None
    return mismatch(address.kind, found, address.host_port)


_OTHER_TLS = {"tcp": "tls", "tls": "tcp", "ws": "wss", "wss": "ws"}
"""The kind that differs from an address's only in TLS: the callers already say that case
("speaks TLS: use tls://...", "does not speak TLS: use ...")."""




async def explain_url(text: str, timeout: float = PROBE_TIMEOUT) -> str | None:
    """The line for addresses ``text`` of which one is a web URL (``http://HOST:PORT/``,
    ``https://...``): it names what answers at that host and port (a WebSocket port:
    ``ws://``; the --http port ...) and the address to use; None when none is a web URL."""
    for part in text.split(","):
        part = part.strip()
        if not part.lower().startswith(("http://", "https://")):
            continue
        u = urlsplit(part)
        try:
            port = u.port or (443 if u.scheme.lower() == "https" else 80)
        except ValueError:
            return None
        if not u.hostname:
            return None
        host_port = f"[{u.hostname}]:{port}" if ":" in u.hostname else f"{u.hostname}:{port}"
        return wrong_scheme(part, await what_listens(u.hostname, port, timeout), host_port)
    return None


def explain_unix(path: str) -> str | None:
    """Why nothing answers at the Unix socket address ``path`` when it is not a socket (a
    regular file, a directory); None when it is one, or does not exist."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    what = "a directory" if stat.S_ISDIR(mode) else "a file, not a socket"
    return (f"unix:{path} is {what}: give the path of the server's --unix socket (the "
            "server says 'listening on unix:PATH' as it starts)")
