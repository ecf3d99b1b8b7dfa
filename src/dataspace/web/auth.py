"""Who may see what on the HTTP port: bearer tokens that are capabilities of the server.

A request to the monitoring endpoints (``/metrics``, ``/api/...``) carries a capability
of the server, as a bearer token::

    Authorization: Bearer <ref {oid: "root" sig: #x"..."}>

(or in the cookie ``dataspace_token``, URL-encoded, for pages whose event streams cannot
set headers).  The token is checked exactly as the gatekeeper checks a sturdyref: its oid
must be bound on the server and its signature valid for a key bound to that oid.  Then:

* the **root capability** (the server's root oid and key, no caveats) is the
  administrator: every endpoint, every dataspace, every connection;
* any other valid token (an attenuated root capability, or a capability of another
  binding) reaches **its own dataspace only, through its caveats**: it may watch and
  list what it could observe over the protocol (its caveats are applied to
  ``<Observe PATTERN #:observer>``, exactly as the server applies them to a subscription
  made through it), and it sees the server's summary for its dataspace, never another
  connection's details, the links, the streams or the pipelines.

``dataspace serve --http-open`` makes every request the administrator, without a token:
refused on an address that is not loopback.  The scry gateway (``/scry/...``) never
asks for a token: it serves published streams.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from aiohttp import web

from ..net.address import is_loopback
from ..protocol.sturdy import Attenuation, SturdyError, SturdyRef, validate

__all__ = ["TOKEN_COOKIE", "Access", "ApiError", "Authorizer", "is_loopback"]

TOKEN_COOKIE = "dataspace_token"
"""The cookie that may carry the token instead of the ``Authorization`` header."""

MAX_TOKEN = 16 * 1024
"""The longest token read (a sturdyref with many caveats is a few KiB)."""


class ApiError(Exception):
    """A request answered with an error: ``status``, the message, headers and extra
    JSON fields."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.extra = extra


@dataclass(frozen=True)
class Access:
    """What a request may see.

    ``admin``: the root capability (or ``--http-open``): everything.  Otherwise
    ``dataspace`` is the one dataspace the token reaches and ``attenuation`` its caveats
    (None: none).
    """

    admin: bool
    dataspace: str | None = None
    attenuation: Attenuation | None = None
    open: bool = False

    @property
    def scope(self) -> str:
        """``"admin"`` or ``"dataspace:NAME"`` (shown in answers)."""
        return "admin" if self.admin else f"dataspace:{self.dataspace}"

    def check_dataspace(self, name: str) -> None:
        """Raise 403 unless this access reaches dataspace ``name``."""
        if not self.admin and name != self.dataspace:
            raise ApiError(403, f"this token reaches dataspace {self.dataspace!r} only, not "
                           f"{name!r}")

    def require_admin(self, what: str) -> None:
        """Raise 403 unless this is the administrator (``what``: a noun phrase such as
        ``"the pipelines"``; the message reads "reading the pipelines needs ...")."""
        if not self.admin:
            raise ApiError(403, f"reading {what} needs the server's root capability (this "
                           f"token reaches dataspace {self.dataspace!r} through its caveats); "
                           "sign in with DATA_DIR/root.sturdyref")


class Authorizer:
    """Checks tokens against the server's bindings (``server.bindings``,
    ``server.root_binding``); ``open_access`` makes every request the administrator."""

    def __init__(self, server: Any, open_access: bool = False) -> None:
        self.server = server
        self.open_access = open_access
        self._cache: OrderedDict[str, Access] = OrderedDict()

    def access(self, request: web.Request) -> Access:
        """The access of ``request``; raises :class:`ApiError` 401 without a valid
        token."""
        if self.open_access:
            return Access(admin=True, open=True)
        text = _token(request)
        if text is None:
            raise _unauthorized("this endpoint needs a capability of the server: send "
                                "`Authorization: Bearer <ref {...}>` with the root sturdyref "
                                "(DATA_DIR/root.sturdyref) or an attenuation of it")
        hit = self._cache.get(text)
        if hit is not None:
            self._cache.move_to_end(text)
            return hit
        acc = self._check(text)
        self._cache[text] = acc
        if len(self._cache) > 256:
            self._cache.popitem(last=False)
        return acc

    def _check(self, text: str) -> Access:
        server = self.server
        if server is None or server.root_binding is None:
            raise ApiError(503, "the server is not running")
        try:
            ref = SturdyRef.parse(text)
        except (SturdyError, ValueError) as e:
            raise _unauthorized(f"the token is not a sturdyref: {e}") from None
        binding = next((b for b in server.bindings.lookup(ref.oid) if validate(ref, b.key)),
                       None)
        if binding is None:
            raise _unauthorized("the token is not a capability of this server (unknown oid "
                                "or invalid signature)")
        if binding is server.root_binding and not ref.caveats:
            return Access(admin=True)
        try:
            att = Attenuation(ref.caveats) if ref.caveats else None
        except SturdyError as e:
            raise _unauthorized(f"the token has an invalid caveat: {e}") from None
        return Access(admin=False, dataspace=binding.name or "root", attenuation=att)


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, {"WWW-Authenticate": 'Bearer realm="dataspace"'})


def _token(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    text: str | None = None
    if auth[:7].lower() == "bearer ":
        text = auth[7:].strip()
    elif TOKEN_COOKIE in request.cookies:
        text = unquote(request.cookies[TOKEN_COOKIE]).strip()
    if not text:
        return None
    if len(text) > MAX_TOKEN:
        raise _unauthorized(f"the token is longer than {MAX_TOKEN} characters")
    if text.startswith("%3C") or text.startswith("%3c"):
        text = unquote(text)  # URL-encoded sturdyref text
    return text
