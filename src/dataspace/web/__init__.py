"""The HTTP port of the server (``dataspace serve --http HOST:PORT``).

One aiohttp application on the broker's event loop, assembled from route modules
(:mod:`dataspace.web.app`): the scry gateway (:mod:`dataspace.web.scry`: published
streams read by path, as long polls and Server-Sent Events), the server's state
(:mod:`.broker`), the dataspaces (:mod:`.dataspaces`), the stream store (:mod:`.streams`),
``/metrics`` (:mod:`.metrics`) and the web inspector's pages (:mod:`.inspector`); bearer tokens are capabilities of the server
(:mod:`.auth`).  See docs/http.md and docs/operations.md.
"""

from .app import DEFAULT_MODULES, HttpServer, make_app, start_http
from .auth import Access, ApiError
from .context import CONTEXT, RouteModule, WebContext, guarded, json_error, json_response
from .dataspaces import WATCHES, Watches
from .metrics import METRICS
from .scry import SCRY, ScryGateway, ScryLimits

__all__ = [
    "CONTEXT",
    "DEFAULT_MODULES",
    "METRICS",
    "SCRY",
    "WATCHES",
    "Access",
    "ApiError",
    "HttpServer",
    "RouteModule",
    "ScryGateway",
    "ScryLimits",
    "Watches",
    "WebContext",
    "guarded",
    "json_error",
    "json_response",
    "make_app",
    "start_http",
]
