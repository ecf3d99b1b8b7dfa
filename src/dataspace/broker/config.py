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
      tls-cert: "/etc/dataspace/server.crt"   # TLS on every TCP, WebSocket and HTTP
      tls-key: "/etc/dataspace/server.key"    #   listener (docs/security.md)
      tls-client-ca: "/etc/dataspace/ca.crt"  # mutual TLS: clients need a certificate
      tls-ca: "/etc/dataspace/ca.crt"         # the CA links trust (default: the system's)
      link: [                                 # linked servers (docs/links.md)
        {address: "10.0.0.2:7411" cap: "@/etc/dataspace/peer.sturdyref"}
        {address: "tls://10.0.0.3:7411" cap: "@peer3.sturdyref" tls-ca: "peer3-ca.crt"}
      ]
      cluster: {                              # a cluster of servers (docs/cluster.md)
        listen: "0.0.0.0:7422"                # where the other members dial this one
        routes: ["10.0.0.2:7422" "10.0.0.3:7422"]   # members to dial (one is enough)
        name: "dataspace"                     # the cluster's name
        secret: "/etc/dataspace/cluster.secret"  # default: <data-dir>/cluster.secret
        # advertise: "10.0.0.1:7422"          # default: listen (its host as seen by peers)
        # max-members: 64                     # members kept track of (gossip beyond: ignored)
      }
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
import difflib
import os
import re
import ssl
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
from ..net.tls import ClientTLS, ServerTLS, TLSConfigError
from ..protocol.budget import format_bytes
from ..protocol.relay import RelayLimits
from ..protocol.sturdy import SturdyError, SturdyRef
from ..values import Dictionary, ParseError, Record, Sequence, Symbol, Value, parse, stringify
from .cluster import SECRET_FILE, ClusterSpec, read_secret
from .link import LinkSpec

__all__ = ["BindingSpec", "ConfigError", "ServerConfig", "default_max_memory", "load_config",
           "parse_config", "parse_size"]

LINK_TLS_KEYS = ("tls-ca", "tls-cert", "tls-key", "tls-server-name")
"""The TLS settings a link of the configuration file may have (each overrides the
server's: ``tls-ca``, and its own certificate shown to peers that ask for one)."""


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
    # Links to other servers: (address, capability text or @FILE), see broker.link, and
    # optionally a third item, the link's own TLS settings {"tls-ca": FILE ...}.
    link: list[tuple[str, str] | tuple[str, str, dict[str, str]]] = field(default_factory=list)
    # TLS (docs/security.md): the certificate and key of every TCP, WebSocket and HTTP
    # listener; the CA client certificates must be signed by (mutual TLS); the CA links
    # trust (default: the system's trust store).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    tls_ca: str | None = None
    # A cluster (see broker.cluster): where to listen for routes, members to dial, the
    # cluster's name and secret file (default: the data directory's cluster.secret).
    cluster: str | None = None
    routes: list[str] = field(default_factory=list)
    cluster_name: str = "dataspace"
    cluster_secret: str | None = None
    cluster_advertise: str | None = None
    route_ping: float = 1.0
    route_dead: float = 3.0
    cluster_max_members: int = 64  # the members a member keeps (gossip beyond: ignored)
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
        for a in out:
            if a.kind not in ("tcp", "tls", "unix", "ws", "wss"):
                raise ConfigError(f"cannot listen on {a}: give HOST:PORT")
        if self.tls_cert:  # TLS on every TCP and WebSocket listener
            out = [a.with_kind({"tcp": "tls", "ws": "wss"}.get(a.kind, a.kind)) for a in out]
        return out

    def server_tls(self) -> ServerTLS | None:
        """The server's certificate, loaded (None without ``tls_cert``); raises
        :class:`ConfigError` naming a file that cannot be used."""
        if not self.tls_cert:
            return None
        try:
            return ServerTLS(self.tls_cert, self.tls_key, self.tls_client_ca)
        except TLSConfigError as e:
            raise ConfigError(str(e)) from None

    def route_tls(self) -> tuple[ServerTLS | None, ssl.SSLContext | None]:
        """The TLS of a member's routes: with a certificate (``tls_cert``) its cluster port
        speaks TLS (a :class:`ServerTLS` of its own -- its handshakes and buffers are
        counted apart from the listeners' -- mutual when ``tls_client_ca`` is given) and it
        dials members with TLS (:meth:`route_client_tls`); without one, (None, None).  One
        rule for the whole cluster: give every member a certificate, or none."""
        server = self.server_tls()
        if server is None:
            return None, None
        try:
            client = self.route_client_tls()
        except TLSConfigError as e:
            raise ConfigError(f"routes: {e}") from None
        return server, client

    def route_client_tls(self) -> ssl.SSLContext:
        """The context a member dials other members with: it checks their certificates
        against ``tls_ca`` (default: the system's trust store) and shows its own.  Raises
        :class:`TLSConfigError` for files that cannot be used."""
        return ClientTLS(ca=self.tls_ca, cert=self.tls_cert, key=self.tls_key).ssl_context()

    def clear_text_warning(self) -> str | None:
        """What crosses a network in clear with these settings (listeners on an address
        other than loopback without TLS), or None; said once at start (a warning, not a
        refusal: a network of one's own is the owner's call)."""
        if self.tls_cert:
            return None
        exposed = [str(a) for a in self.listeners()
                   if a.kind in ("tcp", "ws") and not is_loopback(a.host)]
        try:
            http = self.host_port("http")
        except ConfigError:
            http = None
        if http is not None and not is_loopback(http[0]):
            exposed.append(f"http://{http[0]}:{http[1]}/")
        if self.cluster:
            try:
                host = parse_address(self.cluster, default_kind="tcp").host
            except AddressError:
                host = "127.0.0.1"  # check() says what is wrong with it
            if not is_loopback(host):
                exposed.append(f"the cluster port {self.cluster}")
        if not exposed:
            return None
        return (f"listening on {', '.join(exposed)} without TLS: capabilities (sturdyrefs, "
                "the HTTP port's token) and everything clients send will cross the network "
                "in clear; give --tls-cert and --tls-key (docs/security.md), or listen on "
                "127.0.0.1")

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
        for item in self.link:
            address, cap = item[0], item[1]
            opts: dict[str, str] = item[2] if len(item) > 2 else {}  # type: ignore[misc]
            parts = [a.strip() for a in address.split(",") if a.strip()]
            if not parts:
                raise ConfigError(f"link {address!r}: no address")
            addrs = []
            for part in parts:  # several: the members of a cluster, tried in turn
                try:
                    addrs.append(parse_address(part, default_kind="tcp"))
                except AddressError as e:
                    raise ConfigError(f"link {address!r}: {e}") from None
            if len({a.secure for a in addrs}) > 1:
                raise ConfigError(f"link {address}: some of its addresses use TLS and some do "
                                  "not; write them all with tls:// (or wss://), or none")
            addr = addrs[0]
            if opts and not addr.secure:
                raise ConfigError(f"link {address}: TLS settings for an address without TLS: "
                                  f"write tls://{addr.host_port}")
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
            tls = None
            if addr.secure:
                # A link shows the server's own certificate to a peer that asks for one.
                cert = opts.get("tls-cert") or self.tls_cert
                key = opts.get("tls-key") or (self.tls_key if cert == self.tls_cert else None)
                tls = ClientTLS(ca=opts.get("tls-ca") or self.tls_ca, cert=cert, key=key,
                                server_name=opts.get("tls-server-name"))
            out.append(LinkSpec(address, ref, tls))
        return out

    def check_cluster(self, prefix: str = "") -> None:
        """Raise :class:`ConfigError` for cluster settings that cannot work."""
        from ..protocol.cluster import ClusterError, check_cluster_name

        if not self.cluster:
            if self.routes:
                raise ConfigError(f"{prefix}routes names members of a cluster: give "
                                  f"{prefix}cluster HOST:PORT too (where this member listens "
                                  "for routes)")
            return
        for what, a in [(f"{prefix}cluster", self.cluster), *((f"{prefix}routes", r) for r in
                                                              self.routes),
                        (f"{prefix}cluster-advertise", self.cluster_advertise)]:
            if a is None:
                continue
            try:
                addr = parse_address(a, default_kind="tcp")
            except AddressError as e:
                raise ConfigError(f"{what} {a!r}: {e}") from None
            if addr.kind != "tcp":
                raise ConfigError(f"{what} {a!r}: routes run over TCP: give HOST:PORT")
        try:
            check_cluster_name(self.cluster_name)
        except ClusterError as e:
            raise ConfigError(f"{prefix}cluster-name: {e}") from None
        if type(self.cluster_max_members) is not int or self.cluster_max_members < 1:
            raise ConfigError(f"{prefix}cluster-max-members must be a whole number of at "
                              f"least 1, not {self.cluster_max_members!r}")
        if not 0 < self.route_ping < self.route_dead:
            raise ConfigError("the cluster's ping must be positive and below its dead time "
                              f"(ping {self.route_ping:g} s, dead {self.route_dead:g} s)")

    def cluster_spec(self, data_dir: Path) -> ClusterSpec | None:
        """The cluster to join (None: not a member), its secret read: ``cluster_secret``
        or the data directory's ``cluster.secret``."""
        self.check_cluster()
        if not self.cluster:
            return None
        path = (Path(self.cluster_secret).expanduser() if self.cluster_secret
                else data_dir / SECRET_FILE)
        try:
            secret = read_secret(path)
        except ValueError as e:
            hint = ("" if self.cluster_secret else
                    " (or give the secret's file with --cluster-secret FILE)")
            raise ConfigError(f"{e}{hint}") from None
        return ClusterSpec(listen=self.cluster, routes=tuple(self.routes),
                           name=self.cluster_name, secret=secret,
                           advertise=self.cluster_advertise, ping=self.route_ping,
                           dead=self.route_dead, max_members=self.cluster_max_members)

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
        for spec in self.link_specs():
            if spec.tls is not None:
                try:
                    spec.tls.ssl_context()
                except TLSConfigError as e:
                    raise ConfigError(f"link {spec.address}: {e}") from None
        self.check_cluster(prefix)
        self.host_port("scry_udp", prefix)
        self.host_port("http", prefix)
        if (self.tls_key or self.tls_client_ca) and not self.tls_cert:
            raise ConfigError("tls-key and tls-client-ca go with tls-cert: give the "
                              "certificate too (--tls-cert FILE)")
        if self.tls_cert and not self.tls_key:
            raise ConfigError("tls-cert needs its key: give --tls-key FILE too")
        if not self.tls_cert and any(a.secure for a in self.listeners()):
            raise ConfigError("a tls:// or wss:// listener needs a certificate: give "
                              "--tls-cert FILE and --tls-key FILE")
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
_FILE_KEYS = {"tls-cert": "tls_cert", "tls-key": "tls_key", "tls-client-ca": "tls_client_ca",
              "tls-ca": "tls_ca"}
_KNOWN = sorted(
    [*_INT_KEYS, *_SECONDS_KEYS, *_LIST_KEYS, *_FILE_KEYS, "data-dir", "store", "root-oid",
     "root-key", "bind", "max-memory", "record", "link", "cluster", "scry-udp", "http",
     "http-open", "publish"]
)


def _short(v: Value) -> str:
    try:
        s = stringify(v)
    except Exception:  # pragma: no cover
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _unknown_key(k: Value, x: Value, known: list[str], what: str, listed: str,
                 where: str = "") -> ConfigError:
    """The error for the key ``k`` (its value ``x``) that is none of ``known``: ``what``
    names it (``setting``, ``key``), ``where`` where it is (`` in cluster``), ``listed``
    says what there is.  A
    misspelt name gets the likely one (as command-line options do), and a key written as a
    string (JSON's ``"tcp": [...]``) is shown as the symbol it must be."""
    name = k if type(k) is str else k.name if type(k) is Symbol else None
    if type(k) is str and name in known:
        return ConfigError(f"the {what} {_short(k)}{where} is a string: keys are symbols, written "
                           f"without quotes: {name}: {_short(x)} (the file is Preserves text, "
                           "not JSON)")
    guess = difflib.get_close_matches(name, known, n=1, cutoff=0.6) if name else []
    hint = f"did you mean {guess[0]}?" if guess else ""
    if type(k) is str:
        hint += (" " if hint else "") + ("keys are symbols, written without quotes: "
                                         f"{guess[0] if guess else name}: ...")
    return ConfigError(f"unknown {what} {_short(k)}{where}{f' ({hint})' if hint else ''}; "
                       f"{listed}")


def _boolean(name: str, x: Value) -> str:
    """The error text for a setting ``name`` that must be a boolean."""
    if type(x) is Symbol and x.name in ("true", "false"):  # JSON's
        return f"{name} must be #t or #f, not {x.name} (Preserves writes {x.name} as " \
            f"#{x.name[0]})"
    return f"{name} must be #t or #f, not {_short(x)}"


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
            raise _unknown_key(k, x, _KNOWN, "setting", f"the settings are: {', '.join(_KNOWN)}")
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
        elif name in _FILE_KEYS:
            if type(x) is not str or not x:
                raise ConfigError(f'{name} must be a file name, e.g. {name}: "/etc/dataspace/'
                                  f'{"server.key" if name == "tls-key" else "server.crt"}"')
            changes[_FILE_KEYS[name]] = x
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
                raise ConfigError(_boolean("http-open", x))
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
        elif name == "cluster":
            changes.update(_cluster(x))
        elif name == "record":
            if type(x) is not Sequence:
                raise ConfigError(
                    'record must be a list of recorder specs, e.g. record: ["chat:<Says $who $text>"]'
                )
            changes["record"] = list(x)
    cfg = dataclasses.replace(cfg, **changes)
    cfg.check()
    return cfg


_CLUSTER_KEYS = {"listen": "cluster", "routes": "routes", "name": "cluster_name",
                 "secret": "cluster_secret", "advertise": "cluster_advertise",
                 "ping": "route_ping", "dead": "route_dead",
                 "max-members": "cluster_max_members"}


def _cluster(x: Value) -> dict[str, Any]:
    example = ('cluster: {listen: "0.0.0.0:7422" routes: ["10.0.0.2:7422"] name: "dataspace" '
               'secret: "/etc/dataspace/cluster.secret"}')
    if type(x) is not Dictionary:
        raise ConfigError(f"cluster must be a dictionary, e.g. {example}")
    out: dict[str, Any] = {}
    for k, v in x.items():
        name = k.name if type(k) is Symbol else None
        if name not in _CLUSTER_KEYS:
            raise _unknown_key(k, v, list(_CLUSTER_KEYS), "key",
                               f"it has: {', '.join(_CLUSTER_KEYS)}", " in cluster")
        if name == "routes":
            if type(v) is not Sequence or not all(type(a) is str for a in v):
                raise ConfigError('cluster routes must be a list of "HOST:PORT" strings')
            out["routes"] = list(v)
        elif name in ("ping", "dead"):
            if type(v) not in (int, float) or not v > 0:
                raise ConfigError(f"cluster {name} must be a positive number of seconds")
            out[_CLUSTER_KEYS[name]] = float(v)
        elif name == "max-members":
            if type(v) is not int or v < 1:
                raise ConfigError("cluster max-members must be a whole number of at least 1")
            out[_CLUSTER_KEYS[name]] = v
        else:
            if type(v) is not str or not v:
                raise ConfigError(f"cluster {name} must be a non-empty string")
            out[_CLUSTER_KEYS[name]] = v
    if "cluster" not in out:
        raise ConfigError(f"cluster needs listen: \"HOST:PORT\", e.g. {example}")
    return out


def _link(item: Value) -> tuple[str, str] | tuple[str, str, dict[str, str]]:
    if type(item) is not Dictionary:
        raise ConfigError('a link is {address: "HOST:PORT" cap: "<ref {...}>" or "@FILE"}')
    keys = ["address", "cap", *LINK_TLS_KEYS]
    for k, v in item.items():
        if type(k) is not Symbol or k.name not in keys:
            raise _unknown_key(k, v, keys, "key", f"a link has address and cap, and may "
                               f"have {', '.join(LINK_TLS_KEYS)}", " in a link")
    addr = item.get(Symbol("address"))
    cap = item.get(Symbol("cap"))
    if type(addr) is not str or not addr:
        raise ConfigError(f"the link {_short(item)} needs address: \"HOST:PORT\"")
    if type(cap) is Record:
        cap = stringify(cap)
    if type(cap) is not str or not cap:
        raise ConfigError(f"the link {_short(item)} needs cap: a sturdyref or \"@FILE\"")
    tls: dict[str, str] = {}
    for k in LINK_TLS_KEYS:
        v = item.get(Symbol(k))
        if v is None:
            continue
        if type(v) is not str or not v:
            raise ConfigError(f"{k} of the link {_short(item)} must be a string")
        tls[k] = v
    return (addr, cap, tls) if tls else (addr, cap)


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
