"""Server addresses as people write them.

=============================  ===========================================
``7411``, ``:7411``            TCP on the default host (127.0.0.1)
``HOST:PORT``, ``[::1]:PORT``  TCP
``tcp://HOST:PORT``            TCP
``tls://HOST:PORT``            TCP with TLS (see :mod:`.tls`)
``unix:PATH``, ``/abs/path``   Unix stream socket (also ``./rel/path``)
``ws://HOST:PORT/PATH``        WebSocket (one packet per binary message)
``wss://HOST:PORT/PATH``       WebSocket over TLS
=============================  ===========================================

Syndicate transport addresses (``<tcp "HOST" PORT>``, ``<unix "PATH">``, ``<ws "URL">``)
are accepted too.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "Address", "AddressError", "is_loopback",
           "parse_address"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7411
"""The default TCP port of ``dataspace serve`` (and of clients)."""


class AddressError(ValueError):
    """An address that cannot be understood."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address, possibly in brackets, or ``localhost``) is on the
    loopback interface, so that only this machine can reach it."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Address:
    """Where a server listens / a client connects: ``kind`` is tcp, tls, unix, ws or wss."""

    kind: str
    host: str = ""
    port: int = 0
    path: str = ""

    @property
    def secure(self) -> bool:
        """Whether the address asks for TLS (``tls://`` and ``wss://``)."""
        return self.kind in ("tls", "wss")

    @property
    def websocket(self) -> bool:
        """Whether this is a WebSocket address (``ws://`` or ``wss://``)."""
        return self.kind in ("ws", "wss")

    @property
    def host_port(self) -> str:
        """``HOST:PORT`` (an IPv6 host in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        """The WebSocket URL (``ws`` and ``wss`` addresses)."""
        scheme = "wss" if self.kind == "wss" else "ws"
        return f"{scheme}://{self.host_port}{self.path or '/'}"

    def with_kind(self, kind: str) -> Address:
        """The same place with another kind (``tcp`` <-> ``tls``, ``ws`` <-> ``wss``)."""
        return Address(kind, self.host, self.port, self.path)

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        if self.websocket:
            return self.url
        if self.kind == "tls":
            return f"tls://{self.host_port}"
        return self.host_port


def _port(text: str, whole: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise AddressError(f"bad port {text!r} in {whole!r}: expected a number") from None
    if not 0 <= port <= 65535:
        raise AddressError(f"port {port} in {whole!r} is out of range (0-65535)")
    return port


def _host_port(text: str, whole: str, default_host: str) -> tuple[str, int]:
    if text.isdigit():
        return default_host, _port(text, whole)
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or not text[end + 1 : end + 2] == ":":
            raise AddressError(f"bad address {whole!r}: expected [IPV6]:PORT")
        return text[1:end], _port(text[end + 2 :], whole)
    host, sep, port = text.rpartition(":")
    if not sep:
        raise AddressError(f"bad address {whole!r}: expected HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT})")
    return host or default_host, _port(port, whole)


def parse_address(text: str, *, default_kind: str = "tcp", default_host: str = DEFAULT_HOST) -> Address:
    """Read an address (see the module docstring); raises :class:`AddressError`.

    ``default_kind`` says what a bare ``HOST:PORT`` is (``"tcp"`` or ``"ws"``).
    """
    s = text.strip()
    if not s:
        raise AddressError("empty address")
    if s.startswith("<"):
        return _from_transport_value(s)
    if s.startswith("unix:"):
        path = s[5:]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise AddressError(f"bad address {text!r}: unix: needs a path")
        return Address("unix", path=path)
    if s.startswith(("/", "./", "../", "~")):
        return Address("unix", path=s)
    if s.startswith(("ws://", "wss://")):
        kind = "wss" if s.startswith("wss://") else "ws"
        u = urlsplit(s)
        if not u.hostname:
            raise AddressError(f"bad address {text!r}: {kind}:// needs a host")
        try:
            port = u.port or (443 if kind == "wss" else 80)
        except ValueError:
            raise AddressError(f"bad port in {text!r}") from None
        return Address(kind, u.hostname, port, u.path or "/")
    kind = default_kind
    if s.startswith("tcp://"):
        s = s[6:]
        kind = "ws" if default_kind == "ws" else "tcp"
    elif s.startswith("tls://"):
        s = s[6:]
        kind = "wss" if default_kind == "ws" else "tls"
    elif "://" in s:
        scheme = s.split("://", 1)[0]
        raise AddressError(f"bad address {text!r}: {scheme}:// is not a server address; use "
                           "HOST:PORT, tls://HOST:PORT, ws://HOST:PORT/, wss://HOST:PORT/ or "
                           "unix:PATH")
    host, port = _host_port(s, text, default_host)
    if kind in ("ws", "wss"):
        return Address(kind, host, port, "/")
    return Address(kind, host, port)


def _from_transport_value(text: str) -> Address:
    from ..values import ParseError, Record, Symbol, parse

    try:
        v = parse(text)
    except ParseError as e:
        raise AddressError(f"bad transport address {text!r}: {e}") from None
    if type(v) is Record and type(v.label) is Symbol:
        f = v.fields
        name = v.label.name
        if name == "tcp" and len(f) == 2 and type(f[0]) is str and type(f[1]) is int:
            return Address("tcp", f[0], _port(str(f[1]), text))
        if name == "unix" and len(f) == 1 and type(f[0]) is str:
            return Address("unix", path=f[0])
        if name == "ws" and len(f) == 1 and type(f[0]) is str:
            return parse_address(f[0])
    raise AddressError(
        f"bad transport address {text!r}: expected <tcp \"HOST\" PORT>, <unix \"PATH\"> or "
        "<ws \"URL\">"
    )
