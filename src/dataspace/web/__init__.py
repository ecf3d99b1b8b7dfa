"""The HTTP port of the server (``dataspace serve --http HOST:PORT``).

One aiohttp application on the broker's event loop, assembled from route modules
(:mod:`dataspace.web.app`).  Today it serves the scry gateway (:mod:`dataspace.web.scry`):
published streams read by path, as long polls and Server-Sent Events.  See docs/http.md.
"""

from .app import DEFAULT_MODULES, HttpServer, make_app, start_http
from .context import CONTEXT, RouteModule, WebContext, json_error, json_response
from .scry import SCRY, ScryGateway, ScryLimits

__all__ = [
    "CONTEXT",
    "DEFAULT_MODULES",
    "SCRY",
    "HttpServer",
    "RouteModule",
    "ScryGateway",
    "ScryLimits",
    "WebContext",
    "json_error",
    "json_response",
    "make_app",
    "start_http",
]
