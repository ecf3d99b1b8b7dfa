"""Connecting to an address of any kind, with TLS where it says ``tls://`` or ``wss://``.

:func:`dial` is what clients and links call; its TLS failures come back as
:class:`~.tls.TLSError` with one line saying what to do (see :mod:`.tls`), and
:func:`explain_early_close` says why a connection ended before the server answered when
TLS is the reason (a plain client on a TLS port, a client certificate refused).
"""

from __future__ import annotations

import ssl

from .address import Address
from .connection import Connection, SessionFactory, connect_stream
from .flow import FlowLimits, Hub
from .probe import explain_mismatch
from .tls import (
    HANDSHAKE_TIMEOUT,
    ClientTLS,
    TLSConfigError,
    TLSError,
    explain_closed,
    explain_handshake_error,
    speaks_tls,
)
from .websocket import connect_ws

__all__ = ["dial", "explain_early_close"]


async def dial(
    address: Address,
    hub: Hub,
    flow: FlowLimits,
    session: SessionFactory,
    max_packet: int,
    *,
    tls: ClientTLS | None = None,
    context: ssl.SSLContext | None = None,
    coalesce: bool = True,
) -> Connection:
    """Open a connection to ``address``; for ``tls`` and ``wss`` addresses ``context``
    (by default ``tls.ssl_context()``, or the system's trust store) is used.

    Raises :class:`~.tls.TLSError` for a failed TLS handshake, ``OSError`` or
    ``ConnectionError`` otherwise.
    """
    a = address
    if a.secure and context is None:
        try:
            context = (tls or ClientTLS()).ssl_context()
        except TLSConfigError as e:  # files changed since the start (a link's, say)
            raise TLSError(str(e)) from None
    if not a.secure:
        context = None
    name = tls.server_name if tls is not None else None
    try:
        if a.websocket:
            return await connect_ws(a.url, hub, flow, session, max_packet, ssl=context,
                                    server_hostname=name)
        if a.kind == "unix":
            return await connect_stream("unix", a.path, hub, flow, session, coalesce=coalesce)
        return await connect_stream("tcp", (a.host, a.port), hub, flow, session,
                                    coalesce=coalesce, ssl=context, server_hostname=name,
                                    ssl_handshake_timeout=HANDSHAKE_TIMEOUT)
    except ssl.SSLError as e:
        # Another kind of port (a plain TCP port for wss://): say which (see .probe).
        why = None if isinstance(e, ssl.SSLCertVerificationError) else await explain_mismatch(a)
        why = why or await explain_handshake_error(e, a.host, a.port, tls or ClientTLS(),
                                                   scheme="wss" if a.websocket else "tls")
        raise TLSError(why or f"the TLS handshake with {a} failed: {e}") from None
    except ConnectionRefusedError:
        raise
    except (ConnectionError, EOFError) as e:
        # A server and a client that disagree on TLS (a WebSocket server meets the
        # other's handshake or HTTP request and the connection is reset or closed), or a
        # wss:// server that closed after the handshake (a client certificate refused).
        if a.websocket:  # a TCP or HTTP port: say which (see .probe)
            why = await explain_mismatch(a)
            if why is not None:
                raise ConnectionError(why) from None
        if not a.secure:
            if a.kind == "ws":
                why = await explain_closed(a.host, a.port, str(e), None, 0, scheme="ws")
                if why is not None:
                    raise TLSError(why) from None
            raise
        if not await speaks_tls(a.host, a.port):
            plain = a.with_kind("ws" if a.websocket else "tcp")
            raise TLSError(f"the server at {a.host_port} does not speak TLS: use {plain} "
                           f"(without {a.kind}://), or start it with --tls-cert and "
                           "--tls-key") from None
        why = await explain_closed(a.host, a.port, str(e), tls or ClientTLS(), 0,
                                   scheme=a.kind)
        if why is not None:
            raise TLSError(why) from None
        raise


async def explain_early_close(address: Address, conn: Connection,
                              tls: ClientTLS | None) -> str | None:
    """Why ``conn`` (to ``address``) closed before the server answered, when TLS is the
    reason; None otherwise.  (A TLS port closes a plain client's connection without a
    word: this asks the port for a TLS handshake to tell.)"""
    if address.kind == "unix":
        return None
    return await explain_closed(address.host, address.port, conn.close_reason,
                                (tls or ClientTLS()) if address.secure else None, conn.bytes_in,
                                scheme=address.kind)
