"""What answered: naming a peer's protocol from the first bytes it sent.

When a handshake fails because the peer does not speak the protocol we expected, the
first bytes it sent usually say what it does speak: ``HTTP/1.1 400 ...`` from a web
server, a TLS alert record, NATS's ``INFO {...}`` greeting, PostgreSQL's error message, or
a dataspace server's own ``<error ...>`` packet.  Errors then say "that port speaks HTTP"
rather than "malformed packet".

When a client's address names the wrong kind of port (``wss://`` for a plain TCP port,
``tls://`` for a WebSocket port ...), :mod:`.probe` asks the port a question every kind
here answers differently -- :data:`PROBE_REQUEST`, an HTTP request to upgrade to a
WebSocket, over TLS when the port speaks TLS -- and :func:`listener_kind` reads the answer:
a WebSocket port switches protocols (``101``), an HTTP port answers it otherwise, and a
dataspace port sends its ``<error ...>`` packet.  :func:`mismatch` is the line that names
what answers and the address to use.  Pure functions of bytes: no socket here.
"""

from __future__ import annotations

__all__ = ["HEAD_BYTES", "KINDS", "PROBE_REQUEST", "SYNDICATE", "identify", "listener_kind",
           "mismatch", "what_answered", "wrong_scheme"]

HEAD_BYTES = 64
"""How many of a peer's first bytes connections keep for :func:`identify`."""

SYNDICATE = "the Syndicate protocol"


def identify(head: bytes) -> str | None:
    """The protocol whose first bytes ``head`` are, when recognisable: ``"HTTP"``,
    ``"TLS"``, ``"SSH"``, ``"NATS"``, ``"Redis"``, ``"PostgreSQL"``, ``"AMQP"`` or
    :data:`SYNDICATE` (a dataspace or Syndicate server's packet); else None."""
    if head.startswith(b"HTTP/"):
        return "HTTP"
    # A TLS record: content type 20-23 (change cipher spec, alert, handshake, data),
    # then the major version 3.
    if len(head) >= 2 and 20 <= head[0] <= 23 and head[1] == 3:
        return "TLS"
    if head.startswith(b"SSH-"):
        return "SSH"
    if head.startswith(b"INFO {"):
        return "NATS"
    if head.startswith((b"-ERR", b"-NOAUTH", b"-WRONGPASS")):
        return "Redis"
    # PostgreSQL: an ErrorResponse 'E', a 4-byte length, then fields starting with 'S'
    # (severity); or 'N' refusing SSL.
    if len(head) >= 6 and head[:1] == b"E" and head[5:6] == b"S":
        return "PostgreSQL"
    if head.startswith(b"AMQP"):
        return "AMQP"
    # A Preserves record (0xB4) whose label is a symbol (0xB3): every Syndicate packet
    # on the wire (<error ...> in particular) starts so.
    if head.startswith(b"\xb4\xb3"):
        return SYNDICATE
    return None


def what_answered(head: bytes, where: str = "port") -> str:
    """A phrase for errors: ``"that port speaks HTTP"``, or for bytes no protocol here
    knows, ``"that port answered with something else (first bytes: 47 45 54 ...)"``
    (``where``: ``"socket"`` for a Unix socket)."""
    if not head:
        return f"that {where} closed the connection without answering"
    name = identify(head)
    if name is not None:
        return f"that {where} speaks {name}"
    shown = " ".join(f"{b:02x}" for b in head[:8])
    printable = head[:16].decode("ascii", "replace")
    if printable.isprintable():
        shown += f" = {printable!r}"
    return f"that {where} answered with something else (first bytes: {shown})"


# -- what kind of port: tcp, tls, ws, wss, http, https ---------------------------------------

PROBE_REQUEST = (
    b"GET / HTTP/1.1\r\nHost: dataspace-probe\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\nSec-WebSocket-Key: ZGF0YXNwYWNlIHByb2JlIQ==\r\n"
    b"Sec-WebSocket-Version: 13\r\n\r\n"
)
"""What :mod:`.probe` sends to tell the kinds of port apart: a WebSocket upgrade request
(no capability, nothing of the client's)."""

KINDS = ("tcp", "tls", "ws", "wss", "http", "https")
"""The kinds of port :func:`listener_kind` tells apart."""

_TLS_HINT = " (with --tls-ca FILE if its certificate is not from a CA in the system's trust store)"

_NAMES = {
    "tcp": "a plain dataspace TCP port (no TLS)",
    "tls": "a dataspace TCP port with TLS",
    "ws": "a WebSocket port without TLS",
    "wss": "a WebSocket port with TLS",
    "http": "an HTTP port (as a server's --http port is: the inspector, /metrics, /api/)",
    "https": "an HTTPS port (as a server's --http port with TLS is: the inspector, /metrics, "
             "/api/)",
}


def listener_kind(head: bytes, tls: bool) -> str | None:
    """The kind of port (one of :data:`KINDS`) whose answer to :data:`PROBE_REQUEST` began
    with ``head`` (sent over TLS when ``tls``); None when the answer is not one of theirs."""
    if head.startswith(b"HTTP/"):
        status = head.split(b" ", 2)[1:2]
        if status == [b"101"]:
            return "wss" if tls else "ws"
        return "https" if tls else "http"
    if identify(head) == SYNDICATE:
        return "tls" if tls else "tcp"
    return None


def _use(kind: str, host_port: str) -> str:
    if kind == "tcp":
        return f"use tcp://{host_port} or {host_port}"
    if kind == "tls":
        return f"use tls://{host_port}{_TLS_HINT}"
    if kind in ("ws", "wss"):
        return f"use {kind}://{host_port}/" + (_TLS_HINT if kind == "wss" else "")
    return ("clients connect to the server's TCP port (HOST:PORT, 7411 by default) or its "
            "--ws port (ws://HOST:PORT/)")


def wrong_scheme(url: str, found: str | None, host_port: str) -> str:
    """The line for a web URL (``http://``, ``https://``) given as a server's address:
    what answers at ``host_port`` (``found``, one of :data:`KINDS`, None if not known)
    and the address to use."""
    scheme = url.split("://", 1)[0]
    head = f"{url} is not a server address ({scheme}:// is for the --http port: the " \
        "inspector, `dataspace info --url`)"
    if found is None or found in ("http", "https"):
        return (f"{head}: clients connect to the server's TCP port (HOST:PORT or "
                "tls://HOST:PORT, 7411 by default), a --ws port (ws://HOST:PORT/ or "
                "wss://HOST:PORT/) or unix:PATH")
    return f"{head}, and {host_port} is {_NAMES[found]}: {_use(found, host_port)}"


def mismatch(asked: str, found: str, host_port: str) -> str:
    """The line for an address of kind ``asked`` (tcp, tls, ws or wss) that reached a port
    of kind ``found`` at ``host_port``: what answers there and what to use instead, e.g.
    ``127.0.0.1:7411 is a plain dataspace TCP port (no TLS), not a WebSocket port with TLS:
    use tcp://127.0.0.1:7411 or 127.0.0.1:7411``."""
    return f"{host_port} is {_NAMES[found]}, not {_NAMES[asked]}: {_use(found, host_port)}"
