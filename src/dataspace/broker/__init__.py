"""The networked broker: a server of dataspaces speaking the Syndicate protocol.

* :class:`~dataspace.broker.server.Server` -- dataspaces, gatekeeper bindings, listeners;
* :mod:`~dataspace.broker.config` -- every setting, from a Preserves text file or the CLI.

The client side is :mod:`dataspace.client`.
"""

from .config import BindingSpec, ConfigError, ServerConfig, load_config, parse_config
from .server import Server

__all__ = ["BindingSpec", "ConfigError", "Server", "ServerConfig", "load_config", "parse_config"]
