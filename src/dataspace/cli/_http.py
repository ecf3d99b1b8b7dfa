"""What ``dataspace info`` and ``dataspace top`` share: reading the server's JSON
endpoints (``dataspace serve --http``) with its capability as a bearer token."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import ssl
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from ..datadir import DATA_DIR_HELP, ROOT_STURDYREF, resolve_data_dir
from ..net.sniff import SYNDICATE, identify
from ..net.tls import ClientTLS, TLSConfigError, explain_closed, explain_handshake_error
from ._client import add_tls_args

DEFAULT_URL = "http://127.0.0.1:7480"

HTTP_HELP = f"""\
The server must run with an HTTP port: `dataspace serve --http 127.0.0.1:7480`.  --url
(default $DATASPACE_HTTP, else {DEFAULT_URL}) is that port; --token is the capability
sent as the bearer token: the sturdyref text, or @FILE holding it (default: the data
directory's root.sturdyref, which `dataspace serve` writes).  A server started with
--http-open needs no token.  A server with a certificate (--tls-cert) serves HTTPS: give
--url https://HOST:PORT and, unless its CA is in the system's trust store, --tls-ca FILE.
"""


class HttpFail(Exception):
    """A one-line reason the server could not be read (what to do next included)."""


def add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", metavar="URL",
                   help=f"the server's HTTP port (default $DATASPACE_HTTP or {DEFAULT_URL})")
    p.add_argument("--token", metavar="CAP",
                   help="the capability to send: sturdyref text or @FILE (default: "
                   "DATA_DIR/root.sturdyref)")
    p.add_argument("--data-dir", metavar="DIR", help=DATA_DIR_HELP)
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for an answer (default 5)")
    add_tls_args(p, "an https:// --url", server_name=False)


class Api:
    """GETs JSON from a server's HTTP port."""

    def __init__(self, args: argparse.Namespace) -> None:
        url = args.url or os.environ.get("DATASPACE_HTTP") or DEFAULT_URL
        if "://" not in url:
            url = "http://" + url
        self.base = url.rstrip("/") + "/"
        self.timeout = args.timeout
        u = urlsplit(self.base)
        self.host, self.secure = u.hostname or "", u.scheme == "https"
        try:
            self.port = u.port or (443 if self.secure else 80)
        except ValueError:
            raise HttpFail(f"bad port in {url}") from None
        self.tls: ClientTLS | None = None
        self.context: ssl.SSLContext | None = None
        given = [f"--{k.replace('_', '-')}" for k in ("tls_ca", "tls_cert", "tls_key")
                 if getattr(args, k, None)]
        if self.secure:
            self.tls = ClientTLS.from_env(
                getattr(args, "tls_ca", None), getattr(args, "tls_cert", None),
                getattr(args, "tls_key", None),
                insecure_skip_verify=bool(getattr(args, "tls_insecure_skip_verify", False)))
            try:
                self.context = self.tls.ssl_context()
            except TLSConfigError as e:
                raise HttpFail(str(e)) from None
        elif given:
            raise HttpFail(f"{' '.join(given)} given for {self.base}, which is not HTTPS: "
                           f"write --url https://{u.netloc}/")
        self.token = _token(args)

    def get(self, path: str) -> Any:
        req = urllib.request.Request(self.base + path.lstrip("/"))
        if self.token:
            req.add_header("Authorization", "Bearer " + self.token)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self.context) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                why = json.loads(e.read()).get("error", e.reason)
            except (ValueError, AttributeError):
                why = e.reason
            hint = ""
            if e.code == 401:
                hint = " (give the server's root sturdyref with --token @FILE or --data-dir)"
            elif e.code == 404:
                hint = " (is this a dataspace server's HTTP port?)"
            elif e.code == 426:
                hint = (" (that is a WebSocket port, a --ws port of the broker: --url takes "
                        "the port given to `dataspace serve --http`)")
            raise HttpFail(f"{self.base}{path.lstrip('/')}: {e.code} {why}{hint}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            why = self._explain(reason if isinstance(reason, BaseException) else e)
            if why is not None:
                raise HttpFail(why) from None
            if isinstance(e, http.client.HTTPException):
                raise HttpFail(f"{self.base}: {_not_http(e)}") from None
            raise HttpFail(f"cannot reach {self.base}: {reason}; is `dataspace serve --http "
                           "HOST:PORT` running there? (give its address with --url)") from None
        except ValueError as e:
            raise HttpFail(f"{self.base}{path.lstrip('/')}: not JSON ({e})") from None

    def _explain(self, e: BaseException) -> str | None:
        """What TLS has to do with ``e`` (the wrong scheme, a certificate refused)."""
        if isinstance(e, ConnectionRefusedError | TimeoutError):
            return None
        if self.secure and isinstance(e, ssl.SSLError):
            assert self.tls is not None
            return asyncio.run(explain_handshake_error(e, self.host, self.port, self.tls,
                                                       scheme="https"))
        if not self.secure and isinstance(e, ConnectionError | http.client.HTTPException):
            return asyncio.run(explain_closed(self.host, self.port, str(e), None, 0,
                                              scheme="http"))
        return None


def _not_http(e: http.client.HTTPException) -> str:
    """What answered, when it did not answer in HTTP (the broker's own port, say)."""
    advice = ("--url takes the port given to `dataspace serve --http HOST:PORT` "
              f"({DEFAULT_URL} by default)")
    line = e.args[0] if e.args and isinstance(e.args[0], str) else ""
    if isinstance(e, http.client.BadStatusLine) and line:
        what = identify(line.encode("latin-1", "replace"))
        if what == SYNDICATE:
            return (f"that port speaks the Syndicate protocol, not HTTP: it is the broker's "
                    f"port, not its HTTP port; {advice}")
        if what is not None:
            return f"that port speaks {what}, not HTTP; {advice}"
    if isinstance(e, http.client.RemoteDisconnected):
        return (f"that port closed the connection without an HTTP answer (is it the broker's "
                f"Syndicate port?); {advice}")
    return f"that port does not speak HTTP; it may be the broker's Syndicate port; {advice}"


def _token(args: argparse.Namespace) -> str | None:
    text = args.token
    if text is None:
        path = resolve_data_dir(args.data_dir, create=False) / ROOT_STURDYREF
        try:
            return path.read_text().strip()
        except OSError:
            return None  # maybe an --http-open server; a 401 says what to do
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as f:
                return f.read().strip()
        except OSError as e:
            raise HttpFail(f"cannot read the token from {text[1:]}: {e.strerror or e}") from None
    return text.strip()


def size(n: float | None) -> str:
    """Bytes for people: 512 B, 1.5 KiB, 3.2 MiB ..."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def duration(s: float | None) -> str:
    """Seconds for people: 45s, 12m03s, 5h02m, 3d04h."""
    if s is None:
        return "-"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s // 60 % 60:02d}m"
    return f"{s // 86400}d{s // 3600 % 24:02d}h"
