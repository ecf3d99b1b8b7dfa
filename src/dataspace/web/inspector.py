"""The web inspector: pages on the HTTP port that read its JSON endpoints.

Routes (no token needed for the pages themselves: they hold no data; what they show comes
from ``/api/...`` with the token in the cookie ``dataspace_token``, set by the page's
sign-in box, or from an ``--http-open`` server):

``GET /``
    The list of pages and the server's health.
``GET /inspector/PAGE``
    A page: ``overview`` (counters with live sparklines), ``connections``, ``dataspace``
    (the assertions matching a pattern, live), ``observe`` (a pattern's + / - / ! events
    as they arrive), ``streams`` (a stream's tail with search), ``pipelines`` (the
    processor graphs drawn, lag on the edges), ``links``.
``GET /inspector/static/FILE``
    The pages' scripts (JavaScript modules: ``inspector.js`` the entry point, ``lib.js``
    and ``pv.js`` the shared parts, ``page-NAME.js`` one per page) and stylesheet.

Every page is the same HTML shell (``static/inspector.html``); the entry script draws
the page its path names.  There is no build step and nothing is loaded from another host
(the ``Content-Security-Policy`` says so to the browser).  See docs/operations.md.
"""

from __future__ import annotations

import hashlib
import logging
from importlib import resources
from pathlib import PurePosixPath

from aiohttp import web

from .context import WebContext

__all__ = ["PAGES", "setup"]

log = logging.getLogger(__name__)

PAGES: dict[str, str] = {
    "overview": "the server's counters with live sparklines",
    "connections": "who is connected, with what",
    "dataspace": "the current assertions matching a pattern, live",
    "observe": "a pattern's events (+ / - / !) as they arrive",
    "streams": "the durable streams and a stream's tail with search",
    "pipelines": "the processor graphs, with lag on the edges",
    "links": "the links to other brokers",
}
"""The pages under ``/inspector/``, with what each shows."""

_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
"""The files of ``static/`` served, by their suffix (every such file there is served)."""

_HEADERS = {
    # Everything comes from this server; values are inserted as text, never as HTML,
    # and no inline script runs.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class _File:
    """A file of the inspector, read once from the package."""

    def __init__(self, name: str, body: bytes) -> None:
        self.body = body
        self.content_type = _TYPES[PurePosixPath(name).suffix]
        self.etag = '"' + hashlib.blake2s(self.body, digest_size=12).hexdigest() + '"'

    def response(self, request: web.Request) -> web.Response:
        if self.etag in request.headers.get("If-None-Match", ""):
            return web.Response(status=304, headers={**_HEADERS, "ETag": self.etag})
        return web.Response(body=self.body, content_type=self.content_type, charset="utf-8",
                            headers={**_HEADERS, "ETag": self.etag})


def _files() -> dict[str, _File]:
    """Every file of ``static/`` with a suffix of :data:`_TYPES`, read once."""
    out: dict[str, _File] = {}
    for entry in resources.files(__package__).joinpath("static").iterdir():
        name = entry.name
        if entry.is_file() and PurePosixPath(name).suffix in _TYPES:
            out[name] = _File(name, entry.read_bytes())
    return out


def setup(app: web.Application, ctx: WebContext) -> None:
    """Add ``/``, ``/inspector/PAGE`` and ``/inspector/static/FILE``."""
    files = _files()
    shell = files["inspector.html"]

    async def index(request: web.Request) -> web.StreamResponse:
        return shell.response(request)

    async def page(request: web.Request) -> web.StreamResponse:
        name = request.match_info["page"]
        if name not in PAGES:
            raise web.HTTPNotFound()
        return shell.response(request)

    async def to_index(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/")

    async def static(request: web.Request) -> web.StreamResponse:
        f = files.get(request.match_info["file"])
        if f is None or f is shell:
            raise web.HTTPNotFound()
        return f.response(request)

    r = app.router
    r.add_get("/", index)
    r.add_get("/inspector", to_index)
    r.add_get("/inspector/", to_index)
    r.add_get("/inspector/static/{file}", static)
    r.add_get("/inspector/{page}", page)
    log.debug("inspector pages: %s", ", ".join(PAGES))
