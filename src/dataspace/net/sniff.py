"""What answered: naming a peer's protocol from the first bytes it sent.

When a handshake fails because the peer does not speak the protocol we expected, the
first bytes it sent usually say what it does speak: ``HTTP/1.1 400 ...`` from a web
server, a TLS alert record, NATS's ``INFO {...}`` greeting, PostgreSQL's error message, or
a dataspace server's own ``<error ...>`` packet.  Errors then say "that port speaks HTTP"
rather than "malformed packet".  Pure functions of bytes: no socket here.
"""

from __future__ import annotations

__all__ = ["HEAD_BYTES", "SYNDICATE", "identify", "what_answered"]

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


def what_answered(head: bytes) -> str:
    """A phrase for errors: ``"that port speaks HTTP"``, or for bytes no protocol here
    knows, ``"that port answered with something else (first bytes: 47 45 54 ...)"``."""
    if not head:
        return "that port closed the connection without answering"
    name = identify(head)
    if name is not None:
        return f"that port speaks {name}"
    shown = " ".join(f"{b:02x}" for b in head[:8])
    printable = head[:16].decode("ascii", "replace")
    if printable.isprintable():
        shown += f" = {printable!r}"
    return f"that port answered with something else (first bytes: {shown})"
