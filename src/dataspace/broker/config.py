"""The server configuration: every ``dataspace serve`` setting, from a file or the CLI.

A configuration file is one Preserves dictionary in text form, with symbol keys (``#``
followed by a space starts a comment)::

    # /etc/dataspace/server.pr
    {
      tcp: ["127.0.0.1:7411"]                 # listeners, each list may be empty
      unix: ["/run/dataspace/dataspace.sock"]
      ws: ["127.0.0.1:7412"]
      data-dir: "/var/lib/dataspace"          # root.key and root.sturdyref live here
      store: "postgresql://app@db/app"        # the stream store (default: data-dir's SQLite)
      verbose: 1                              # 0 warnings, 1 info, 2 debug
      root-oid: "root"                        # the OID of the root capability
      # root-key: #x"..."                     # default: <data-dir>/root.key
      max-packet-size: 1048576                # bytes
      max-assertions: 100000                  # per connection
      max-references: 10000                   # per connection
      max-observers: 10000                    # per connection
      max-matches: 500000                     # assertions delivered to one connection
      max-turn-events: 100000                 # deliveries one turn may cause
      max-total-assertions: 1000000           # the whole server
      max-memory: "1G"                        # bytes clients make it hold ("off": none)
      max-buffered: 268435456                 # bytes queued to all connections together
      max-debt: 1048576                       # bytes (flow control)
      max-send-queue: 16777216                # bytes (slow consumers)
      work-rate: 100000                       # events/s a peer may cause back to itself
      throttle-limit: 10.0                    # seconds slowed per minute before closing
      max-connections: 10000
      max-connections-per-address: 2500       # default: a quarter of max-connections
      connect-rate: 100                       # new connections per second per address
      send-timeout: 30.0                      # seconds
      handshake-timeout: 30.0                 # seconds
      idle-timeout: 300.0                     # seconds, for connections holding nothing
      keepalive: 60.0                         # seconds
      ws-ping-interval: 20.0                  # seconds
      scry-udp: "127.0.0.1:7413"              # remote readers (docs/scry.md)
      http: "127.0.0.1:7480"                  # the HTTP port (docs/http.md)
      http-open: #f                           # its /api and /metrics without a token (loopback only)
      publish: ["chat"]                       # streams readable by path (scry, HTTP)
      link: [                                 # linked servers (docs/links.md)
        {address: "10.0.0.2:7411" cap: "@/etc/dataspace/peer.sturdyref"}
      ]
      bind: [
        # syndicate-py's examples: <ref {oid: "syndicate" sig: #[acowDB2/oI+6aSEC3YIxGg==]}>
        <ref {oid: "syndicate" key: #x""}>
        # a separate dataspace, reached with refs for oid "chat" signed by this key
        <ref {oid: "chat" key: #x"8ac2c5f3..." dataspace: "chat"}>
      ]
    }

Every key is optional.  Command-line options override the file.  A binding without
``dataspace:`` gives access to the root dataspace.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..net.address import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    Address,
    AddressError,
    is_loopback,
    parse_address,
)
from ..net.flow import FlowLimits
from ..protocol.budget import format_bytes
from ..protocol.relay import RelayLimits
from ..protocol.sturdy import SturdyError, SturdyRef
from ..values import Dictionary, ParseError, Record, Sequence, Symbol, Value, parse, stringify
from .link import LinkSpec

__all__ = ["BindingSpec", "ConfigError", "ServerConfig", "default_max_memory", "load_config",
           "parse_config", "parse_size"]


class ConfigError(ValueError):
    """A configuration that cannot be used (the message says what to fix)."""


MIN_PACKET_SIZE = 1024
"""The smallest ``max-packet-size``: a client's first packet (the capability it presents,
with its caveats) must fit."""
MAX_PACKET_SIZE = 64 << 20
"""The largest ``max-packet-size``: the largest packet our own clients accept."""

SETTING_RANGES: dict[str, tuple[int | float, int | float | None, str]] = {
    "max_packet_size": (MIN_PACKET_SIZE, MAX_PACKET_SIZE, "bytes"),
    "max_assertions": (1, None, ""),
    "max_references": (1, None, ""),
    "max_observers": (1, None, ""),
    "max_matches": (1, None, ""),
    "max_turn_events": (1, None, ""),
    "max_total_assertions": (1, None, ""),
    "max_buffered": (1, None, "bytes"),
    "max_debt": (1, None, "bytes"),
    "max_send_queue": (1, None, "bytes"),
    "work_rate": (1, None, "events per second"),
    "max_connections": (1, None, ""),
    "max_connections_per_address": (1, None, ""),
    "throttle_limit": (0.0, None, "seconds; 0 = never"),
    "connect_rate": (0.0, None, "per second; 0 = unlimited"),
    "idle_timeout": (0.0, None, "seconds; 0 = never"),
    "send_timeout": (0.0, None, "seconds"),
    "handshake_timeout": (0.0, None, "seconds; 0 = none"),
    "keepalive": (0.0, None, "seconds; 0 = off"),
    "ws_ping_interval": (0.0, None, "seconds; 0 = off"),
}
"""The range of each number setting: (lowest, highest or None, unit)."""

RANGE_WHY = {
    "max_packet_size": " (1 KiB to 64 MiB: a client's first packet, its capability, must "
    "fit, and a client accepts no packet over 64 MiB; the default is 1048576)",
}


MIN_MEMORY = 1 << 20
"""The smallest ``max-memory`` (below it every client would be refused at once)."""
DEFAULT_MEMORY_CAP = 1 << 30
"""The default ``max-memory`` is a quarter of the machine's memory, at most this."""

_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?|(b)?|(%))", re.IGNORECASE)
_SHIFT = {"k": 10, "m": 20, "g": 30, "t": 40}


def physical_memory() -> int | None:
    """The memory this process may use: the machine's, or its control group's limit
    when lower (a container's); None where neither can be read."""
    try:
        total: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and (total is None or int(text) < total):
            total = int(text)
    return total


def default_max_memory() -> int:
    """The default ``max-memory``: a quarter of the memory this process may use (see
    :func:`physical_memory`), at most 1 GiB, at least 64 MiB: what a broker sharing a
    machine with other programs should take at most."""
    total = physical_memory()
    if total is None:
        return DEFAULT_MEMORY_CAP
    return max(64 << 20, min(DEFAULT_MEMORY_CAP, total // 4))


def parse_size(text: str | int, what: str = "--max-memory") -> int:
    """Bytes from ``512M``, ``2G``, ``1.5GiB``, ``300k``, ``1048576``, ``25%`` (of
    :func:`physical_memory`), or ``0``/``off`` (none: 0).  Units are binary (K = 1024)."""
    if type(text) is int:
        if text < 0:
            raise ConfigError(f"{what} must not be negative, not {text}")
        return text
    t = str(text).strip()
    if t.lower() in ("off", "none", "unlimited", "0"):
        return 0
    m = _SIZE.fullmatch(t)
    if m is None:
        raise ConfigError(f"{what} {t!r} is not a size: write e.g. 512M, 2G, 25% (of this "
                          "machine's memory) or off")
    number = float(m.group(1))
    if m.group(4):
        total = physical_memory()
        if total is None:
            raise ConfigError(f"{what} {t}: this machine's memory cannot be read; give a "
                              "size such as 512M")
        return int(total * number / 100)
    unit = m.group(2)
    return int(number * (1 << _SHIFT[unit.lower()])) if unit else int(number)


@dataclass(frozen=True)
class BindingSpec:
    """Sturdyrefs for ``oid`` signed with ``key`` reach the dataspace named ``dataspace``."""

    oid: Value
    key: bytes
    dataspace: str = "root"


@dataclass
class ServerConfig:
    """Every setting of the server (defaults: one TCP listener on 127.0.0.1:7411)."""

    tcp: list[str] = field(default_factory=list)
    unix: list[str] = field(default_factory=list)
    ws: list[str] = field(default_factory=list)
    data_dir: str | None = None
    # The stream store's URL (a path, sqlite:PATH or postgresql://...; checked and opened
    # by the serve command): default, the data directory's streams.sqlite3.
    store: str | None = field(default=None, repr=False)  # may hold a password
    verbose: int = 0
    root_oid: Value = "root"
    root_key: bytes | None = None
    max_packet_size: int = RelayLimits.max_packet_size
    max_assertions: int = RelayLimits.max_assertions
    max_references: int = RelayLimits.max_imports
    max_observers: int = RelayLimits.max_observers
    max_matches: int = RelayLimits.max_outbound_assertions
    max_turn_events: int = 100_000
    max_total_assertions: int = 1_000_000
    # Bytes clients may make the server hold (None: default_max_memory(); 0: no budget).
    max_memory: int | None = None
    max_buffered: int = 256 << 20
    max_debt: int = FlowLimits.max_debt
    max_send_queue: int = FlowLimits.max_send_queue
    work_rate: int = FlowLimits.work_rate
    throttle_limit: float = FlowLimits.throttle_limit
    max_connections: int = 10_000
    max_connections_per_address: int | None = None
    connect_rate: float = 100.0
    idle_timeout: float = 300.0
    send_timeout: float = FlowLimits.send_timeout
    handshake_timeout: float = FlowLimits.handshake_timeout
    keepalive: float = FlowLimits.keepalive
    ws_ping_interval: float = FlowLimits.ws_ping_interval
    bind: list[BindingSpec] = field(default_factory=list)
    # Links to other servers: (address, capability text or @FILE), see broker.link.
    link: list[tuple[str, str]] = field(default_factory=list)
    # Remote readers of streams (scry over UDP, HTTP) -- started by the serve command,
    # like the recorders: the broker layer knows nothing of streams.
    scry_udp: str | None = None
    http: str | None = None
    # The HTTP port's monitoring endpoints without a token (loopback addresses only).
    http_open: bool = False
    publish: list[str] = field(default_factory=list)
    # Streams to record from the server's dataspaces: recorder specs as text or
    # dictionaries (see dataspace.streams.recorder), checked and started by the serve
    # command -- the broker layer itself knows nothing of streams.
    record: list[Any] = field(default_factory=list)

    def listeners(self) -> list[Address]:
        """The addresses to listen on (TCP on 127.0.0.1:7411 when none is configured)."""
        out = []
        try:
            out += [parse_address(s, default_kind="tcp") for s in self.tcp]
            out += [Address("unix", path=p) for p in self.unix]
            out += [parse_address(s, default_kind="ws") for s in self.ws]
        except AddressError as e:
            raise ConfigError(str(e)) from None
        if not out:
            out.append(Address("tcp", DEFAULT_HOST, DEFAULT_PORT))
        return out

    def relay_limits(self) -> RelayLimits:
        self.check_ranges()
        try:
            return RelayLimits(
                max_packet_size=self.max_packet_size,
                max_assertions=self.max_assertions,
                max_imports=self.max_references,
                max_observers=self.max_observers,
                max_outbound_assertions=self.max_matches,
                max_outbound_packet=max(1024, min(256 * 1024, self.max_packet_size // 4)),
            )
        except ValueError as e:
            raise ConfigError(str(e).replace("max_imports", "max_references")) from None

    def flow_limits(self) -> FlowLimits:
        self.check_ranges()
        try:
            budget = self.memory_limit()
            return FlowLimits(
                max_debt=self.max_debt,
                # One slow consumer's queue (held two or three times over while it is
                # written) is at most a sixteenth of the memory budget.
                max_send_queue=(max(64 << 10, min(self.max_send_queue, budget >> 4)) if budget
                                else self.max_send_queue),
                work_rate=self.work_rate,
                work_burst=max(self.work_rate, 10 * self.work_rate),
                throttle_limit=float(self.throttle_limit),
                send_timeout=float(self.send_timeout),
                handshake_timeout=float(self.handshake_timeout),
                keepalive=float(self.keepalive),
                ws_ping_interval=float(self.ws_ping_interval),
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def memory_limit(self) -> int:
        """The memory budget in bytes (0: none): ``max_memory``, or its default."""
        return default_max_memory() if self.max_memory is None else self.max_memory

    def buffered_limit(self) -> int:
        """Bytes queued to all connections together: ``max_buffered``, at most half of
        the memory budget."""
        budget = self.memory_limit()
        return min(self.max_buffered, budget // 2) if budget else self.max_buffered

    def per_address_limit(self) -> int:
        """Connections one source address may hold (default: a quarter of the total)."""
        if self.max_connections_per_address is not None:
            return self.max_connections_per_address
        return max(1, self.max_connections // 4)

    def link_specs(self) -> list[LinkSpec]:
        """The links to dial, their capabilities read (``@FILE`` names a file)."""
        out = []
        for address, cap in self.link:
            try:
                parse_address(address, default_kind="tcp")
            except AddressError as e:
                raise ConfigError(f"link {address!r}: {e}") from None
            text = cap
            if cap.startswith("@"):
                try:
                    text = Path(cap[1:]).expanduser().read_text(encoding="utf-8")
                except OSError as e:
                    raise ConfigError(f"link {address}: cannot read the capability file "
                                      f"{cap[1:]}: {e.strerror or e}") from None
            try:
                ref = SturdyRef.parse(text.strip())
            except SturdyError as e:
                raise ConfigError(f"link {address}: not a sturdyref ({e}); pass the peer's "
                                  "root.sturdyref text or @FILE") from None
            if ref.caveats:
                raise ConfigError(f"link {address}: links need a capability without caveats "
                                  "(the peer refuses others)")
            out.append(LinkSpec(address, ref))
        return out

    def host_port(self, which: str, prefix: str = "") -> tuple[str, int] | None:
        """The ``scry_udp`` or ``http`` address as (host, port), or None if not set."""
        text = getattr(self, which)
        if not text:
            return None
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit() or int(port) > 65535:
            example = "127.0.0.1:7480" if which == "http" else "127.0.0.1:7413"
            raise ConfigError(f"{prefix}{which.replace('_', '-')} {text!r}: expected HOST:PORT, "
                              f"e.g. {example}")
        return (host.strip("[]") or DEFAULT_HOST, int(port))

    def check_ranges(self, prefix: str = "") -> None:
        """Raise :class:`ConfigError` for a number setting out of its range, naming the
        setting as the user wrote it: ``work-rate`` in a file, ``--work-rate`` on the
        command line (``prefix="--"``), with the range accepted."""
        for name, (lo, hi, unit) in SETTING_RANGES.items():
            v = getattr(self, name)
            if v is None and name == "max_connections_per_address":
                continue
            whole = type(lo) is int
            ok = (type(v) is int if whole else
                  isinstance(v, int | float) and not isinstance(v, bool) and v == v)
            if ok and lo <= v and (hi is None or v <= hi):
                continue
            option = prefix + name.replace("_", "-")
            if hi is not None:
                rng = f"an integer from {lo} to {hi}" + (f" {unit}" if unit else "")
            elif whole:
                rng = "a positive integer" + (f" ({unit})" if unit else "")
            else:
                rng = "a non-negative number" + (f" ({unit})" if unit else "")
            why = RANGE_WHY.get(name, "")
            raise ConfigError(f"{option} must be {rng}, not {v!r}{why}")
        m = self.max_memory
        if m is not None and (type(m) is not int or (m != 0 and m < MIN_MEMORY)):
            shown = format_bytes(m) if type(m) is int and m >= 0 else repr(m)
            raise ConfigError(f"{prefix}max-memory must be at least 1M (or off), not {shown}: "
                              "below it every client's first assertion would be refused")

    def check(self, prefix: str = "") -> None:
        """Raise :class:`ConfigError` for settings that cannot work together (naming
        them with ``prefix``: ``"--"`` for the command line's options)."""
        self.check_ranges(prefix)
        self.relay_limits()
        self.flow_limits()
        self.listeners()
        self.link_specs()
        self.host_port("scry_udp", prefix)
        self.host_port("http", prefix)
        if self.publish and not (self.scry_udp or self.http):
            raise ConfigError("publish names streams for remote readers: give --scry-udp "
                              "HOST:PORT or --http HOST:PORT too")
        if self.http_open:
            hp = self.host_port("http")
            if hp is None:
                raise ConfigError("http-open opens the HTTP port's monitoring endpoints: "
                                  "give --http HOST:PORT too")
            if not is_loopback(hp[0]):
                raise ConfigError(f"http-open serves the server's state to anyone without a "
                                  f"token, so it is refused on {hp[0]}, which is not a "
                                  "loopback address: use --http 127.0.0.1:PORT, or drop "
                                  "--http-open and send the root sturdyref as a bearer token")

    def override(self, **settings: Any) -> ServerConfig:
        """A copy with the given settings replaced (``None`` values are ignored)."""
        changes = {k: v for k, v in settings.items() if v is not None}
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------
# Reading the file

_INT_KEYS = {
    "verbose": "verbose",
    "max-packet-size": "max_packet_size",
    "max-assertions": "max_assertions",
    "max-references": "max_references",
    "max-debt": "max_debt",
    "max-send-queue": "max_send_queue",
    "max-connections": "max_connections",
    "max-observers": "max_observers",
    "max-matches": "max_matches",
    "max-turn-events": "max_turn_events",
    "max-total-assertions": "max_total_assertions",
    "max-buffered": "max_buffered",
    "work-rate": "work_rate",
    "max-connections-per-address": "max_connections_per_address",
}
_SECONDS_KEYS = {
    "throttle-limit": "throttle_limit",
    "connect-rate": "connect_rate",
    "idle-timeout": "idle_timeout",
    "send-timeout": "send_timeout",
    "handshake-timeout": "handshake_timeout",
    "keepalive": "keepalive",
    "ws-ping-interval": "ws_ping_interval",
}
_LIST_KEYS = {"tcp": "tcp", "unix": "unix", "ws": "ws"}
_KNOWN = sorted(
    [*_INT_KEYS, *_SECONDS_KEYS, *_LIST_KEYS, "data-dir", "store", "root-oid", "root-key", "bind",
     "max-memory",
     "record", "link", "scry-udp", "http", "http-open", "publish"]
)


def _short(v: Value) -> str:
    try:
        s = stringify(v)
    except Exception:  # pragma: no cover
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def load_config(path: str | Path) -> ServerConfig:
    """Read a configuration file; raises :class:`ConfigError` naming the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"no configuration file at {p}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the configuration file {p}: {e}") from None
    try:
        return parse_config(text)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def _is_bare_dictionary(text: str) -> bool:
    """Whether ``text`` is a dictionary's contents without the outer braces."""
    try:
        return type(parse("{\n" + text + "\n}", max_length=1 << 22)) is Dictionary
    except ParseError:
        return False


def parse_config(text: str) -> ServerConfig:
    """Read configuration text (see the module docstring)."""
    try:
        v = parse(text, max_length=1 << 22)
    except ParseError as e:
        if _is_bare_dictionary(text):
            raise ConfigError(
                "the config file is a dictionary {...}: put { before the first setting and } "
                "after the last"
            ) from None
        raise ConfigError(f"not Preserves text: {e}") from None
    if type(v) is not Dictionary:
        raise ConfigError(
            f"the configuration must be one dictionary {{tcp: [...] ...}}, not {_short(v)}"
        )
    cfg = ServerConfig()
    changes: dict[str, Any] = {}
    for k, x in v.items():
        name = k.name if type(k) is Symbol else None
        if name is None or name not in _KNOWN:
            raise ConfigError(
                f"unknown setting {_short(k)}; the settings are: {', '.join(_KNOWN)}"
            )
        if name in _INT_KEYS:
            if type(x) is not int or x < 0:
                raise ConfigError(f"{name} must be a non-negative integer, not {_short(x)}")
            changes[_INT_KEYS[name]] = x
        elif name in _SECONDS_KEYS:
            if type(x) not in (int, float) or x < 0:
                raise ConfigError(f"{name} must be a non-negative number, not {_short(x)}")
            changes[_SECONDS_KEYS[name]] = float(x)
        elif name in _LIST_KEYS:
            if type(x) is not Sequence or not all(type(a) is str for a in x):
                raise ConfigError(f"{name} must be a list of strings, e.g. {name}: [\"...\"]")
            changes[_LIST_KEYS[name]] = list(x)
        elif name == "max-memory":
            if type(x) is str or (type(x) is int and x >= 0):
                changes["max_memory"] = parse_size(x, "max-memory")
            else:
                raise ConfigError(f'max-memory must be a size such as "512M", "2G", "25%" or '
                                  f'"off", or a number of bytes, not {_short(x)}')
        elif name == "data-dir":
            if type(x) is not str:
                raise ConfigError(f"data-dir must be a string, not {_short(x)}")
            changes["data_dir"] = x
        elif name == "store":
            if type(x) is not str or not x:
                raise ConfigError('store must be a store URL string, e.g. store: '
                                  '"postgresql://app@db.example/app"')
            changes["store"] = x
        elif name == "root-oid":
            changes["root_oid"] = x
        elif name == "root-key":
            if type(x) is not bytes or not x:
                raise ConfigError(f"root-key must be a non-empty byte string #x\"...\", not {_short(x)}")
            changes["root_key"] = x
        elif name == "bind":
            if type(x) is not Sequence:
                raise ConfigError("bind must be a list [<ref {oid: ... key: ...}> ...]")
            changes["bind"] = [_binding(b) for b in x]
        elif name in ("scry-udp", "http"):
            if type(x) is not str or not x:
                raise ConfigError(f'{name} must be "HOST:PORT"')
            changes[name.replace("-", "_")] = x
        elif name == "http-open":
            if type(x) is not bool:
                raise ConfigError(f"http-open must be #t or #f, not {_short(x)}")
            changes["http_open"] = x
        elif name == "publish":
            if type(x) is not Sequence or not all(type(a) is str for a in x):
                raise ConfigError('publish must be a list of stream names, e.g. publish: ["chat"]')
            changes["publish"] = list(x)
        elif name == "link":
            if type(x) is not Sequence:
                raise ConfigError('link must be a list, e.g. link: [{address: "host:7411" '
                                  'cap: "@peer.sturdyref"}]')
            changes["link"] = [_link(item) for item in x]
        elif name == "record":
            if type(x) is not Sequence:
                raise ConfigError(
                    'record must be a list of recorder specs, e.g. record: ["chat:<Says $who $text>"]'
                )
            changes["record"] = list(x)
    cfg = dataclasses.replace(cfg, **changes)
    cfg.check()
    return cfg


def _link(item: Value) -> tuple[str, str]:
    if type(item) is not Dictionary:
        raise ConfigError('a link is {address: "HOST:PORT" cap: "<ref {...}>" or "@FILE"}')
    addr = item.get(Symbol("address"))
    cap = item.get(Symbol("cap"))
    if type(addr) is not str or not addr:
        raise ConfigError(f"the link {_short(item)} needs address: \"HOST:PORT\"")
    if type(cap) is Record:
        cap = stringify(cap)
    if type(cap) is not str or not cap:
        raise ConfigError(f"the link {_short(item)} needs cap: a sturdyref or \"@FILE\"")
    extra = set(item) - {Symbol("address"), Symbol("cap")}
    if extra:
        raise ConfigError(f"unknown keys in the link {_short(item)}; a link has address and cap")
    return (addr, cap)


def _binding(b: Value) -> BindingSpec:
    if (
        type(b) is not Record
        or b.label != Symbol("ref")
        or len(b.fields) != 1
        or type(b.fields[0]) is not Dictionary
    ):
        raise ConfigError(f"a binding is <ref {{oid: ... key: #x\"...\"}}>, not {_short(b)}")
    d = b.fields[0]
    if Symbol("oid") not in d or Symbol("key") not in d:
        raise ConfigError(f"the binding {_short(b)} needs both oid: and key:")
    k = d[Symbol("key")]
    if type(k) is not bytes:
        raise ConfigError(f"the key of binding {_short(b)} must be a byte string #x\"...\"")
    ds = d.get(Symbol("dataspace"), "root")
    if type(ds) is not str or not ds:
        raise ConfigError(f"the dataspace of binding {_short(b)} must be a non-empty string")
    return BindingSpec(d[Symbol("oid")], k, ds)
