"""TLS for the listeners, the clients, the links and the HTTP port.

Server side
    :class:`ServerTLS` loads a certificate, its key and (for mutual TLS) the CA that
    client certificates must be signed by, checking each file with a one-line error
    (:class:`TLSConfigError`) that names it.  Its :attr:`~ServerTLS.context` is what every
    listener is given.  The files are looked at again (their size and modification time:
    three ``stat`` calls) at each new TLS handshake, and :meth:`~ServerTLS.reload` (the
    server's SIGHUP) reads them at once: a certificate that changed is served to the
    connections made from then on, while open connections keep the one they started
    with.  Files that cannot be used (a key written after its certificate, say) leave the
    previous certificate in service and are tried again when they next change.

Client side
    :class:`ClientTLS` says what a client trusts: a CA file, or the system's trust store;
    a client certificate and key for servers that ask for one; or a ready
    :class:`ssl.SSLContext`.  The server's name (or IP address) is checked against its
    certificate unless ``insecure_skip_verify`` says otherwise.

Memory
    A TLS connection costs the server its buffers: asyncio's gives each one a 256 KiB
    read buffer from the moment it is accepted, before any handshake, and what a closed
    one held stays with the process until a full garbage collection (its exceptions'
    tracebacks make cycles) and the C allocator giving it back.  :class:`TLSConnections`
    (one per :class:`ServerTLS`, for every listener given its contexts:
    :func:`server_protocol`) reads with a 32 KiB buffer, holds at most
    :data:`MAX_TLS_HANDSHAKES` connections in their handshake (a new one closes the
    oldest), counts what the live ones hold (:meth:`TLSConnections.held_bytes`, for the
    server's memory budget), and gives the memory back once many have closed.

Errors
    :func:`explain_handshake_error` and :func:`explain_closed` turn what OpenSSL says
    into one line naming the certificate, the CA file and what to do next;
    :func:`speaks_tls` tells a plain client that the port it reached speaks TLS.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import base64
import datetime
import ipaddress
import logging
import os
import re
import ssl
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .reclaim import Reclaimer

__all__ = [
    "HANDSHAKE_TIMEOUT",
    "MAX_TLS_HANDSHAKES",
    "TLS_CONNECTION_BYTES",
    "CertInfo",
    "ClientTLS",
    "ServerTLS",
    "TLSConnections",
    "TLSConfigError",
    "TLSError",
    "cert_info",
    "explain_closed",
    "explain_handshake_error",
    "fetch_certificate",
    "is_not_tls",
    "read_certificate",
    "server_protocol",
    "speaks_tls",
]

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a TLS handshake may take (a peer that connects and sends nothing is closed)."""

PROBE_TIMEOUT = 3.0
"""Seconds the error paths wait for a second look at a server (see :func:`speaks_tls`)."""


class TLSConfigError(ValueError):
    """A certificate, key or CA file that cannot be used (the message names it)."""


class TLSError(ConnectionError):
    """A TLS connection that failed; the message says why and what to do next."""


# ---------------------------------------------------------------------------------------
# Reading certificates (enough DER to name them in error messages)


@dataclass(frozen=True)
class CertInfo:
    """What an error message says about a certificate."""

    subject: str
    issuer: str
    not_before: datetime.datetime | None
    not_after: datetime.datetime | None
    names: tuple[str, ...]
    """Its subjectAltName entries, as ``DNS:name`` and ``IP:address``."""

    @property
    def self_signed(self) -> bool:
        return self.subject == self.issuer

    def describe(self) -> str:
        """``CN=server, issued by CN=Test CA``."""
        if self.self_signed:
            return f"{self.subject}, self-signed"
        return f"{self.subject}, issued by {self.issuer}"

    def expired(self, now: datetime.datetime | None = None) -> bool:
        now = now or datetime.datetime.now(datetime.UTC)
        return self.not_after is not None and now > self.not_after


class _DerError(ValueError):
    pass


def _tlv(data: bytes, pos: int, end: int) -> tuple[int, int, int]:
    """The DER element at ``pos``: (tag, start of contents, end of contents)."""
    if pos + 2 > end:
        raise _DerError("truncated")
    tag = data[pos]
    n = data[pos + 1]
    pos += 2
    if n & 0x80:
        k = n & 0x7F
        if not 1 <= k <= 4 or pos + k > end:
            raise _DerError("bad length")
        n = int.from_bytes(data[pos:pos + k], "big")
        pos += k
    if pos + n > end:
        raise _DerError("truncated")
    return tag, pos, pos + n


def _children(data: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    out = []
    pos = start
    while pos < end and len(out) < 64:
        t = _tlv(data, pos, end)
        out.append(t)
        pos = t[2]
    return out


_ATTRS = {b"\x55\x04\x03": "CN", b"\x55\x04\x0a": "O", b"\x55\x04\x0b": "OU"}


def _text(data: bytes, tag: int, start: int, end: int) -> str:
    raw = data[start:end]
    if tag == 0x1E:
        return raw.decode("utf-16-be", "replace")
    return raw.decode("utf-8" if tag == 0x0C else "latin-1", "replace")


def _name(data: bytes, start: int, end: int) -> str:
    attrs: list[tuple[str, str]] = []
    for _t, s, e in _children(data, start, end):  # SET OF
        for _t2, s2, e2 in _children(data, s, e):  # SEQUENCE {oid, value}
            kids = _children(data, s2, e2)
            if len(kids) == 2 and kids[0][0] == 0x06:
                key = _ATTRS.get(data[kids[0][1]:kids[0][2]])
                if key is not None:
                    attrs.append((key, _text(data, *kids[1])))
    cn = [f"CN={v}" for k, v in attrs if k == "CN"]
    return ", ".join(cn or [f"{k}={v}" for k, v in attrs]) or "(no name)"


def _time(data: bytes, tag: int, start: int, end: int) -> datetime.datetime | None:
    s = data[start:end].decode("ascii", "replace")
    fmt = "%y%m%d%H%M%SZ" if tag == 0x17 else "%Y%m%d%H%M%SZ"
    try:
        return datetime.datetime.strptime(s, fmt).replace(tzinfo=datetime.UTC)
    except ValueError:
        return None


def _alt_names(data: bytes, start: int, end: int) -> tuple[str, ...]:
    """The subjectAltName entries in the contents of the ``[3]`` extensions element."""
    names = []
    for _t, s, e in _children(data, start, end):  # Extensions ::= SEQUENCE OF Extension
        for _t2, s2, e2 in _children(data, s, e):
            kids = _children(data, s2, e2)  # extnID, critical?, extnValue
            if len(kids) < 2 or data[kids[0][1]:kids[0][2]] != b"\x55\x1d\x11":
                continue
            _ot, os_, oe = kids[-1]  # an OCTET STRING holding GeneralNames
            _st, gs, ge = _tlv(data, os_, oe)
            for gt, a, b in _children(data, gs, ge):
                if gt == 0x82:  # dNSName
                    names.append("DNS:" + data[a:b].decode("ascii", "replace"))
                elif gt == 0x87 and b - a in (4, 16):  # iPAddress
                    names.append(f"IP:{ipaddress.ip_address(data[a:b])}")
    return tuple(names)


def cert_info(der: bytes) -> CertInfo | None:
    """Subject, issuer, validity and alternative names of a DER certificate (None if it
    cannot be read: this is for messages only, never for a decision)."""
    try:
        _t, s, e = _tlv(der, 0, len(der))
        _t, ts, te = _tlv(der, s, e)  # tbsCertificate
        kids = _children(der, ts, te)
        if kids and kids[0][0] == 0xA0:  # [0] version
            kids = kids[1:]
        # serialNumber, signature, issuer, validity, subject, subjectPublicKeyInfo, ...
        if len(kids) < 6:
            return None
        issuer = _name(der, kids[2][1], kids[2][2])
        validity = _children(der, kids[3][1], kids[3][2])
        subject = _name(der, kids[4][1], kids[4][2])
        nb = _time(der, *validity[0]) if len(validity) == 2 else None
        na = _time(der, *validity[1]) if len(validity) == 2 else None
        names: tuple[str, ...] = ()
        for tag, a, b in kids[6:]:
            if tag == 0xA3:
                names = _alt_names(der, a, b)
        return CertInfo(subject, issuer, nb, na, names)
    except (_DerError, IndexError, ValueError):
        return None


_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", re.S)


def read_certificate(path: str | os.PathLike[str], what: str = "certificate") -> CertInfo | None:
    """The first certificate of a PEM file, described (None if the file holds none that
    can be read; :class:`TLSConfigError` if it cannot be read at all)."""
    data = _read(path, what)
    m = _PEM_CERT.search(data)
    if m is None:
        return None
    try:
        return cert_info(base64.b64decode(m.group(1), validate=False))
    except ValueError:
        return None


def _read(path: str | os.PathLike[str], what: str) -> bytes:
    p = Path(path).expanduser()
    try:
        with open(p, "rb") as f:
            return f.read(4 << 20)
    except FileNotFoundError:
        raise TLSConfigError(f"cannot read the {what} {p}: the file does not exist") from None
    except IsADirectoryError:
        raise TLSConfigError(f"cannot read the {what} {p}: it is a directory, not a file") from None
    except PermissionError:
        raise TLSConfigError(f"cannot read the {what} {p}: permission denied (the server runs "
                             f"as uid {os.getuid()}; make the file readable to it)") from None
    except OSError as e:
        raise TLSConfigError(f"cannot read the {what} {p}: {e.strerror or e}") from None


# ---------------------------------------------------------------------------------------
# Loading files into contexts


def _no_password() -> str:
    raise TLSConfigError("encrypted")


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str | None, role: str) -> None:
    """Load a certificate and its key into ``ctx``, each checked with a one-line error."""
    cert_pem = _read(cert, f"{role} certificate")
    if b"-----BEGIN CERTIFICATE-----" not in cert_pem:
        raise TLSConfigError(f"the {role} certificate {cert} holds no PEM certificate "
                             "(-----BEGIN CERTIFICATE-----): give the certificate file, not "
                             "the key or a DER file (openssl x509 -in FILE -inform der "
                             "converts one)")
    key_path = key or cert
    key_pem = _read(key_path, f"{role} key")
    if b"PRIVATE KEY-----" not in key_pem:
        if key:
            raise TLSConfigError(f"the {role} key {key_path} holds no PEM private key "
                                 "(-----BEGIN PRIVATE KEY-----): give the key the "
                                 "certificate was made with")
        # Only a certificate was named (it may hold its key too: it does not).
        raise TLSConfigError(f"the {role} certificate {cert} comes without its key: give "
                             "the key it was made with too (--tls-key FILE)")
    if b"ENCRYPTED" in key_pem:
        raise TLSConfigError(f"the {role} key {key_path} is encrypted with a passphrase: "
                             "decrypt it (openssl pkey -in KEY -out plain.key) and keep the "
                             "plain key readable only by the server's user")
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except TLSConfigError:  # pragma: no cover - caught by the ENCRYPTED check above
        raise TLSConfigError(f"the {role} key {key_path} is encrypted with a passphrase: "
                             "decrypt it first") from None
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise TLSConfigError(f"the {role} key {key_path} does not match the {role} "
                                 f"certificate {cert}: give the key the certificate was made "
                                 "with") from None
        raise TLSConfigError(f"cannot load the {role} certificate {cert} with the key "
                             f"{key_path}: {_ssl_reason(e)}") from None
    except OSError as e:
        raise TLSConfigError(f"cannot load the {role} certificate {cert}: "
                             f"{e.strerror or e}") from None


def _load_ca(ctx: ssl.SSLContext, cafile: str, what: str) -> None:
    pem = _read(cafile, what)
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise TLSConfigError(f"the {what} {cafile} holds no PEM certificate (-----BEGIN "
                             "CERTIFICATE-----): give the CA's certificate, not its key")
    try:
        ctx.load_verify_locations(cafile=str(Path(cafile).expanduser()))
    except (ssl.SSLError, OSError) as e:
        raise TLSConfigError(f"cannot load the {what} {cafile}: {_ssl_reason(e)}") from None


def _ssl_reason(e: BaseException) -> str:
    reason = getattr(e, "reason", None)
    if reason:
        return str(reason).replace("_", " ").lower()
    return str(e)


def _signature(paths: tuple[str, ...]) -> tuple[Any, ...]:
    out: list[Any] = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


class ServerTLS:
    """The server's certificate (and client CA), reloaded as it changes (module docs).

    Raises :class:`TLSConfigError` when the files cannot be used.
    """

    def __init__(self, cert: str, key: str | None = None, client_ca: str | None = None) -> None:
        self.cert = str(Path(cert).expanduser())
        self.key = str(Path(key).expanduser()) if key else None
        self.client_ca = str(Path(client_ca).expanduser()) if client_ca else None
        self._paths = tuple(p for p in (self.cert, self.key, self.client_ca) if p)
        self.reloads = 0
        """Times a changed certificate was loaded after the start."""
        self.last_error: str | None = None
        """Why the files, as they are now, could not be loaded (None once they could)."""
        self.on_change: Callable[[CertInfo | None], Any] | None = None
        """Called after the files' change was seen and loaded at a handshake."""
        self.on_error: Callable[[str], Any] | None = None
        """Called with the one line saying why, when the files' change was seen at a
        handshake and they cannot be used (instead of a warning in the log: the caller
        says it, once)."""
        self._tried = _signature(self._paths)
        self.current, self.current_http, self.info = self._load()
        self.context = self.current
        """The context to give every listener (it hands each new connection the
        certificate loaded last)."""
        self.context.sni_callback = self._hello
        self.http_context = self.current_http
        """The same for the HTTP port, which asks no client for a certificate (its
        bearer tokens are its access control, and browsers seldom hold certificates)."""
        if self.http_context is not self.context:
            self.http_context.sni_callback = self._hello_http
        self.connections = TLSConnections()
        """The TLS connections of every listener given :attr:`context` or
        :attr:`http_context` (see :func:`server_protocol`)."""
        _trackers[self.context] = _trackers[self.http_context] = self.connections

    @property
    def mutual(self) -> bool:
        """Whether clients must present a certificate signed by :attr:`client_ca`."""
        return self.client_ca is not None

    def _load(self) -> tuple[ssl.SSLContext, ssl.SSLContext, CertInfo | None]:
        def plain() -> ssl.SSLContext:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            _load_chain(ctx, self.cert, self.key, "server")
            return ctx

        ctx = http = plain()
        if self.client_ca:
            ctx = plain()
            _load_ca(ctx, self.client_ca, "client CA file")
            ctx.verify_mode = ssl.CERT_REQUIRED
        info = read_certificate(self.cert)
        if info is not None and info.expired():
            log.warning("the server certificate %s (%s) expired on %s: clients will refuse "
                        "it; renew it and send the server SIGHUP", self.cert, info.subject,
                        _date(info.not_after))
        return ctx, http, info

    def reload(self) -> CertInfo | None:
        """Read the files now; new connections get the new certificate.  Raises
        :class:`TLSConfigError` (the previous certificate stays in service) when they
        cannot be used."""
        self._tried = _signature(self._paths)
        try:
            ctx, http, info = self._load()
        except TLSConfigError as e:
            self.last_error = str(e)
            raise
        self.current, self.current_http, self.info = ctx, http, info
        self.last_error = None
        self.reloads += 1
        log.debug("TLS: loaded %s%s", self.cert,
                 f" ({info.describe()}, valid until {_date(info.not_after)})" if info else "")
        return info

    def check(self) -> None:
        """Reload if a file changed since it was last read (cheap: ``stat`` calls)."""
        if _signature(self._paths) == self._tried:
            return
        try:
            info = self.reload()
        except TLSConfigError as e:
            if self.on_error is not None:
                self.on_error(str(e))
            else:
                log.warning("TLS: %s; still serving the previous certificate (fix the files, "
                            "or send SIGHUP once they are complete)", e)
            return
        if self.on_change is not None:
            self.on_change(info)

    def _hello(self, sslobj: Any, server_name: str | None, ctx: ssl.SSLContext) -> None:
        # Called by OpenSSL with each ClientHello (with or without SNI): the place to
        # hand the connection the certificate loaded last.
        try:
            self.check()
            if self.current is not ctx:
                sslobj.context = self.current
        except Exception:  # pragma: no cover - never fail a handshake over a reload
            log.exception("TLS: cannot switch to the reloaded certificate")

    def _hello_http(self, sslobj: Any, server_name: str | None, ctx: ssl.SSLContext) -> None:
        try:
            self.check()
            if self.current_http is not ctx:
                sslobj.context = self.current_http
        except Exception:  # pragma: no cover - never fail a handshake over a reload
            log.exception("TLS: cannot switch to the reloaded certificate")


def _date(t: datetime.datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M UTC") if t is not None else "an unknown date"


# ---------------------------------------------------------------------------------------
# The server's TLS connections: their memory bounded, counted and given back


TLS_READ_BUFFER = 32 << 10
"""The read buffer of each TLS connection (asyncio's own is 256 KiB: two TLS records,
the most one read brings, fit in this)."""
TLS_CONNECTION_BYTES = TLS_READ_BUFFER + (48 << 10)
"""What one TLS connection costs the server, counted in its memory budget: the read
buffer, and OpenSSL's connection with its record buffers (measured: about 40 KiB)."""
MAX_TLS_HANDSHAKES = 512
"""TLS connections a server holds in their handshake at once (each for at most
:data:`HANDSHAKE_TIMEOUT`): a new one past it closes the oldest, so peers that never
start a handshake cannot hold more than this many buffers, nor keep others out."""
GIVE_BACK_AFTER = 64
"""After this many TLS connections closed, the server gives memory back to the system
(a full garbage collection, then ``malloc_trim``: :class:`~.reclaim.Reclaimer`), at most
every 10 seconds, a second after the last of them."""


class _ServerTLSProtocol(asyncio.sslproto.SSLProtocol):
    """asyncio's TLS protocol with a smaller read buffer, known to its
    :class:`TLSConnections`."""

    max_size = TLS_READ_BUFFER
    _tracker: TLSConnections

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._tracker._opened(self)

    def _on_handshake_complete(self, handshake_exc: BaseException | None) -> None:
        self._tracker._done(self)
        super()._on_handshake_complete(handshake_exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._tracker._closed(self)
        super().connection_lost(exc)


class TLSConnections:
    """The TLS connections of one server's listeners (see the module docstring)."""

    def __init__(self, max_handshakes: int = MAX_TLS_HANDSHAKES) -> None:
        self.max_handshakes = max_handshakes
        self.handshaking: dict[_ServerTLSProtocol, float] = {}
        """Connections in their handshake, oldest first, and since when."""
        self.live = 0
        """TLS connections open now (in their handshake or past it)."""
        self.closed = 0
        self.crowded = 0
        """Connections closed in their handshake to make room for a newer one."""
        self.reclaimer = Reclaimer("TLS connections", GIVE_BACK_AFTER)
        """Gives memory back to the system after many closed (``.runs``: how often)."""

    def held_bytes(self) -> int:
        """What the open TLS connections hold (for the server's memory budget)."""
        return self.live * TLS_CONNECTION_BYTES

    def protocol(self, app_factory: Callable[[], asyncio.BaseProtocol],
                 context: ssl.SSLContext,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT) -> Callable[[], asyncio.BaseProtocol]:
        """A protocol factory for ``loop.create_server`` (given no ``ssl``): TLS with
        ``context``, then ``app_factory``'s protocol."""
        def make() -> asyncio.BaseProtocol:
            loop = asyncio.get_running_loop()
            p = _ServerTLSProtocol(loop, app_factory(), context, None, server_side=True,
                                   ssl_handshake_timeout=handshake_timeout)
            p._tracker = self
            return p

        return make

    def _opened(self, p: _ServerTLSProtocol) -> None:
        self.live += 1
        hs = self.handshaking
        while len(hs) >= self.max_handshakes:
            oldest = next(iter(hs))
            del hs[oldest]
            self.crowded += 1
            t = oldest._transport
            if t is not None:
                t.abort()
        hs[p] = time.monotonic()

    def _done(self, p: _ServerTLSProtocol) -> None:
        self.handshaking.pop(p, None)

    def _closed(self, p: _ServerTLSProtocol) -> None:
        self.handshaking.pop(p, None)
        self.live -= 1
        self.closed += 1
        self.reclaimer.closed()

    def close(self) -> None:
        self.reclaimer.close()


_trackers: weakref.WeakKeyDictionary[ssl.SSLContext, TLSConnections] = \
    weakref.WeakKeyDictionary()


def server_protocol(app_factory: Callable[[], asyncio.BaseProtocol], context: ssl.SSLContext,
                    handshake_timeout: float = HANDSHAKE_TIMEOUT
                    ) -> Callable[[], asyncio.BaseProtocol]:
    """The protocol factory of a TLS listener with ``context`` (pass it to
    ``loop.create_server`` without ``ssl``): a :class:`ServerTLS`'s context counts its
    connections in that server's :class:`TLSConnections`; another context gets a
    tracker of its own."""
    tracker = _trackers.get(context)
    if tracker is None:
        tracker = _trackers[context] = TLSConnections()
    return tracker.protocol(app_factory, context, handshake_timeout)


# ---------------------------------------------------------------------------------------
# The client side


ENV_CA = "DATASPACE_TLS_CA"
ENV_CERT = "DATASPACE_TLS_CERT"
ENV_KEY = "DATASPACE_TLS_KEY"


@dataclass(frozen=True)
class ClientTLS:
    """What a client (or a link) trusts, and the certificate it shows when asked.

    * ``ca`` -- a PEM file of the CA(s) to trust; default: the system's trust store;
    * ``cert``, ``key`` -- a client certificate and its key (mutual TLS);
    * ``server_name`` -- the name to check the server's certificate against (default:
      the host connected to);
    * ``insecure_skip_verify`` -- accept any certificate for any name (for tests; a
      capability sent over such a connection can be read by whoever answers);
    * ``context`` -- a ready :class:`ssl.SSLContext` (the options above are then unused).
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None
    insecure_skip_verify: bool = False
    context: ssl.SSLContext | None = None

    @classmethod
    def from_env(cls, ca: str | None = None, cert: str | None = None, key: str | None = None,
                 **kw: Any) -> ClientTLS:
        """The options given, completed from ``$DATASPACE_TLS_CA``,
        ``$DATASPACE_TLS_CERT`` and ``$DATASPACE_TLS_KEY``."""
        return cls(ca=ca or os.environ.get(ENV_CA) or None,
                   cert=cert or os.environ.get(ENV_CERT) or None,
                   key=key or os.environ.get(ENV_KEY) or None, **kw)

    @property
    def trusted(self) -> str:
        """What the client trusts, for messages."""
        if self.context is not None:
            return "the SSLContext given"
        if self.ca:
            return f"the CA file {self.ca}"
        return "the system's trust store"

    def ssl_context(self) -> ssl.SSLContext:
        """The context to connect with (raises :class:`TLSConfigError` for bad files)."""
        if self.context is not None:
            return self.context
        if self.ca:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            _load_ca(ctx, self.ca, "CA file")
        else:
            ctx = ssl.create_default_context()  # the system's trust store
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert:
            _load_chain(ctx, self.cert, self.key, "client")
        elif self.key:
            raise TLSConfigError("a client key without its certificate: give --tls-cert too")
        if self.insecure_skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


# ---------------------------------------------------------------------------------------
# Explaining failures


async def fetch_certificate(host: str, port: int, server_name: str | None = None,
                            timeout: float = PROBE_TIMEOUT) -> CertInfo | None:
    """The certificate a server presents, without checking it (for error messages after
    a check failed); None if it cannot be had."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    name = server_name or (None if _is_ip(host) else host)
    try:
        _r, w = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx, server_hostname=name or "",
                                    ssl_handshake_timeout=timeout), timeout)
    except (OSError, TimeoutError, ssl.SSLError):
        return None
    try:
        obj = w.get_extra_info("ssl_object")
        der = obj.getpeercert(binary_form=True) if obj is not None else None
        return cert_info(der) if der else None
    finally:
        w.transport.abort()


async def _refuses_client(host: str, port: int, tls: ClientTLS) -> bool:
    """Whether the server ends a TLS 1.2 handshake that shows it the client certificate
    of ``tls`` (or none).  With TLS 1.3 a server refuses a client certificate after the
    client's handshake is done, and asyncio closes the connection without sending the
    alert that says why: TLS 1.2 makes the refusal a failed handshake."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    if tls.cert:
        try:
            _load_chain(ctx, tls.cert, tls.key, "client")
        except TLSConfigError:
            return False
    try:
        _r, w = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx, server_hostname="",
                                    ssl_handshake_timeout=PROBE_TIMEOUT), PROBE_TIMEOUT)
    except ssl.SSLError as e:
        return "VERSION" not in (e.reason or "")  # not a TLS 1.2 server: cannot tell
    except (OSError, TimeoutError):
        return True
    w.transport.abort()
    return False


async def speaks_tls(host: str, port: int, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether ``host:port`` answers a TLS handshake (asked when a plain connection was
    closed before the server said anything: it is how a TLS port treats a plain
    client)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        _r, w = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx, server_hostname="",
                                    ssl_handshake_timeout=timeout), timeout)
    except (OSError, TimeoutError, ssl.SSLError):
        return False
    w.transport.abort()
    return True


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


_NOT_TLS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG",
            "UNKNOWN_PROTOCOL", "HTTP_REQUEST", "RECORD_TOO_LARGE")


def is_not_tls(exc: BaseException) -> bool:
    """Whether a failed handshake says the other end does not speak TLS at all."""
    return isinstance(exc, ssl.SSLError) and (exc.reason or "") in _NOT_TLS
# X509_V_ERR_*: the chain does not lead to a trusted CA
_UNTRUSTED = {2, 18, 19, 20, 21, 27}
_EXPIRED, _NOT_YET_VALID = 10, 9
_NAME_MISMATCH = {62, 64}


async def explain_handshake_error(exc: BaseException, host: str, port: int, tls: ClientTLS,
                                  *, scheme: str = "tls") -> str | None:
    """One line for a failed TLS handshake with ``host:port`` (None if ``exc`` is not
    one).  ``scheme`` is how the user wrote the address (``tls``, ``wss`` or ``https``),
    for the advice."""
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    plain = {"tls": where, "wss": f"ws://{where}/", "https": f"http://{where}/"}.get(scheme, where)
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = exc.verify_code
        name = tls.server_name or host
        cert = await fetch_certificate(host, port, tls.server_name)
        about = f"the server's certificate ({cert.describe()})" if cert else \
            "the server's certificate"
        if code in _UNTRUSTED:
            fix = ("pass --tls-ca with the CA that signed it" if not tls.ca else
                   "pass --tls-ca with the CA that signed it (this file holds another CA)")
            return f"{about} at {where} is not signed by a CA in {tls.trusted}: {fix}"
        if code == _EXPIRED:
            until = f" on {_date(cert.not_after)}" if cert else ""
            return (f"{about} at {where} expired{until}: the server's operator must renew it "
                    "(a server reloads it on SIGHUP; see docs/security.md)")
        if code == _NOT_YET_VALID:
            since = f" before {_date(cert.not_before)}" if cert else ""
            return (f"{about} at {where} is not valid yet{since}: check this machine's clock "
                    "and the server's")
        if code in _NAME_MISMATCH:
            names = f" (it names {', '.join(cert.names)})" if cert and cert.names else ""
            return (f"{about} is not valid for {name}{names}: connect with a name the "
                    "certificate has, or give the server a certificate for "
                    f"{name} (docs/security.md)")
        return f"{about} at {where} was refused: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or ""
        if reason in _NOT_TLS:
            return (f"the server at {where} does not speak TLS: use {plain} (without "
                    f"{scheme}://), or start it with --tls-cert and --tls-key")
        alert = _alert(str(reason))
        if alert is not None:
            return alert.format(where=where, cert=tls.cert)
        if isinstance(exc, ssl.SSLEOFError) or "EOF" in str(exc):
            return (f"the server at {where} closed the connection during the TLS handshake "
                    "(does it speak TLS? is it asking for a client certificate?)")
        return f"the TLS handshake with {where} failed: {_ssl_reason(exc)}"
    return None


def _alert(text: str) -> str | None:
    t = text.upper()
    if "CERTIFICATE_REQUIRED" in t:
        return ("the server at {where} asks for a client certificate: pass --tls-cert FILE "
                "and --tls-key FILE (signed by a CA the server trusts)")
    if "UNKNOWN_CA" in t or "BAD_CERTIFICATE" in t or "CERTIFICATE_UNKNOWN" in t:
        return ("the server at {where} did not accept the client certificate {cert}: it is "
                "not signed by a CA the server trusts (its --tls-client-ca)")
    if "CERTIFICATE_EXPIRED" in t:
        return "the server at {where} says the client certificate {cert} has expired: renew it"
    return None


async def explain_closed(host: str, port: int, reason: str | None, tls: ClientTLS | None,
                         bytes_in: int, *, scheme: str) -> str | None:
    """Why a connection that was made closed before the server answered, when TLS is
    the reason (None otherwise).  ``scheme`` is the address's kind (``tcp``, ``ws`` or
    ``http`` for plain ones; ``tls``, ``wss``, ``https``)."""
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    if tls is not None:
        alert = _alert(reason or "")
        if alert is None and bytes_in == 0 and await _refuses_client(host, port, tls):
            alert = _alert("CERTIFICATE_REQUIRED" if not tls.cert else "UNKNOWN_CA")
        if alert is not None:
            return alert.format(where=where, cert=tls.cert)
        return None
    secure = {"tcp": f"tls://{where}", "ws": f"wss://{where}/", "http": f"https://{where}/"}
    if bytes_in == 0 and scheme in secure and await speaks_tls(host, port):
        return (f"the server at {where} speaks TLS: use {secure[scheme]} (with --tls-ca FILE "
                "if its certificate is not from a CA in the system's trust store)")
    return None
