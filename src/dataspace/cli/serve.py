"""``dataspace serve``: run the dataspace server in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import sys
from pathlib import Path
from typing import IO, Any

from ..broker.config import ConfigError, ServerConfig, load_config, parse_size
from ..broker.link import load_server_id
from ..broker.server import Server, listen_error
from ..datadir import DATA_DIR_HELP, resolve_data_dir
from ..net.address import DEFAULT_HOST, DEFAULT_PORT
from ..net.tls import CertInfo, TLSConfigError
from ..streams import Store, StoreError, check_stream_name, recorder_specs, start_recorders
from ..streams.cluster import ClusterRecording
from ..streams.recorder import RecorderSpec, stop_recorders
from ..streams.scry import ScryServer, start_scry_udp
from ._client import stop_event
from ._store import add_store_argument, open_data_store

EXAMPLES = f"""\
examples:
  dataspace serve                              TCP on {DEFAULT_HOST}:{DEFAULT_PORT} (default)
  dataspace serve --tcp 0.0.0.0:{DEFAULT_PORT}           every interface: mind firewalls
  dataspace serve --unix /tmp/ds.sock --ws 127.0.0.1:7412
  dataspace serve --config server.pr -v        settings from a file, info logs
  dataspace serve --data-dir ./state           root.key, root.sturdyref there
  dataspace serve --record 'chat:<Says $who $text>'
                                               every <Says ...> message into
                                               the stream chat
  dataspace serve --record 'presence,events=all,max-age=7d:<Present _>'
                                               presence messages, assertions
                                               and retractions
  dataspace serve --record 'chat:<Says $who $text>' --store postgresql://db/app
                                               into a PostgreSQL store
  dataspace serve --http 127.0.0.1:7480        the web inspector, metrics and
                                               JSON endpoints (`dataspace top`)
  dataspace serve --link 10.0.0.2:7411 --link-cap @peer.sturdyref
                                               share the root dataspace with
                                               another server
  dataspace serve --tcp 0.0.0.0:{DEFAULT_PORT} --tls-cert server.crt --tls-key server.key
                                               TLS for every client (they dial
                                               tls://HOST:{DEFAULT_PORT}; SIGHUP reloads
                                               the files)
  dataspace serve --tls-cert server.crt --tls-key server.key \\
      --tls-client-ca ca.crt                   mutual TLS: clients need a
                                               certificate signed by ca.crt
  dataspace serve --link tls://10.0.0.2:7411 --link-cap @peer.sturdyref \\
      --tls-ca ca.crt                          a link over TLS, checking the
                                               peer's certificate
  dataspace serve --cluster 0.0.0.0:7422 --routes 10.0.0.1:7422,10.0.0.2:7422
                                               a member of a cluster (each
                                               member listens for routes; one
                                               route address is enough;
                                               <data-dir>/cluster.secret on
                                               every member)

At start the server prints one line, `sturdyref: <ref {{...}}>`, the capability of its root
dataspace, and writes it to <data-dir>/root.sturdyref, where `dataspace observe`, `assert`
and `send` find it.  Ctrl-C (SIGINT) or SIGTERM stops it cleanly.  See docs/broker.md for the
configuration file and the limits; docs/security.md for TLS; docs/streams.md for recording (the stream store is
<data-dir>/streams.sqlite3 unless --store names another; read it with `dataspace stream
tail`).
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the dataspace server (the broker) in the foreground",
        description="Run a dataspace server speaking the Syndicate protocol: programs "
        "connect, resolve a sturdyref, then assert, observe and send.  Listens on "
        f"loopback TCP port {DEFAULT_PORT} unless told otherwise.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tcp", action="append", metavar="HOST:PORT",
                   help=f"listen on TCP (repeatable; default {DEFAULT_HOST}:{DEFAULT_PORT} when "
                   "no listener is given; port 0 picks a free port)")
    p.add_argument("--unix", action="append", metavar="PATH",
                   help="listen on a Unix stream socket (repeatable)")
    p.add_argument("--ws", action="append", metavar="HOST:PORT",
                   help="listen for WebSocket connections (repeatable)")
    p.add_argument("--config", metavar="FILE",
                   help="read settings from a Preserves text file (options given here win)")
    p.add_argument("--data-dir", metavar="DIR",
                   help=DATA_DIR_HELP)
    add_store_argument(p)
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="more logging (-v info, -vv debug)")
    p.add_argument("--record", action="append", metavar="SPEC",
                   help="record into a stream what PATTERN matches in a dataspace: "
                   "STREAM[,events=message+assert+retract|all][,capture=yes][,max-count=N]"
                   "[,max-age=7d][,dataspace=NAME]:PATTERN (repeatable; adds to the "
                   "config's record list)")
    p.add_argument("--scry-udp", metavar="HOST:PORT",
                   help="serve the --publish'ed streams to remote readers over UDP "
                   "(`dataspace scry follow udp://HOST:PORT/STREAM`; docs/scry.md)")
    p.add_argument("--http", metavar="HOST:PORT",
                   help="the HTTP port: the web inspector (open http://HOST:PORT/ in a "
                   "browser), /metrics (Prometheus), /healthz, the JSON endpoints under /api/ "
                   "(a capability of the server as a bearer token: `dataspace info` and "
                   "`dataspace top` read them) and the scry gateway for --publish'ed streams "
                   "(docs/http.md, docs/operations.md)")
    p.add_argument("--http-open", action="store_true", default=None,
                   help="serve /metrics and /api/ without a token (allowed on a loopback "
                   "--http address only)")
    p.add_argument("--publish", action="append", metavar="STREAM",
                   help="a stream remote readers may read by path (repeatable; only these "
                   "are readable)")
    p.add_argument("--link", action="append", metavar="ADDRESS",
                   help="link this server's root dataspace with the server at ADDRESS "
                   "(HOST:PORT, tls://HOST:PORT, ws://..., wss://..., or a Unix socket "
                   "path; several separated by commas: a cluster's members, whichever is "
                   "up); needs --link-cap; repeatable (docs/links.md)")
    p.add_argument("--link-cap", action="append", metavar="CAP",
                   help="the capability for the matching --link: the peer's root sturdyref "
                   "text, or @FILE holding it (a capability without caveats)")
    t = p.add_argument_group("TLS (docs/security.md)")
    t.add_argument("--tls-cert", metavar="FILE",
                   help="the server's certificate (PEM, with its chain): TLS on every TCP "
                   "listener (clients connect to tls://HOST:PORT), wss on every WebSocket "
                   "listener and HTTPS on --http; SIGHUP (or the file's change) reloads it")
    t.add_argument("--tls-key", metavar="FILE", help="the private key of --tls-cert (PEM)")
    t.add_argument("--tls-client-ca", metavar="FILE",
                   help="mutual TLS: clients must present a certificate signed by this CA")
    t.add_argument("--tls-ca", metavar="FILE",
                   help="the CA that tls:// and wss:// links trust (default: the system's "
                   "trust store); links show --tls-cert to peers that ask for a certificate")
    c = p.add_argument_group("cluster (docs/cluster.md)")
    c.add_argument("--cluster", metavar="HOST:PORT",
                   help="be a member of a cluster: listen for routes from the other members "
                   "here (a full mesh of routes; clients and links may use any member)")
    c.add_argument("--routes", action="append", metavar="HOST:PORT,...",
                   help="cluster addresses of other members to dial (comma-separated, "
                   "repeatable); members tell each other of the rest, so one is enough")
    c.add_argument("--cluster-name", metavar="NAME",
                   help="the cluster's name (default dataspace): members of another "
                   "cluster are refused")
    c.add_argument("--cluster-secret", metavar="FILE",
                   help="the cluster secret, the same file on every member (default "
                   "<data-dir>/cluster.secret; make one with `dataspace cluster secret FILE`)")
    c.add_argument("--cluster-advertise", metavar="HOST:PORT",
                   help="the address other members dial to reach this one (default: "
                   "--cluster, its host taken from the connection when it is 0.0.0.0)")
    c.add_argument("--cluster-max-members", type=int, metavar="N",
                   help="the most members this one keeps track of (default 64): members "
                   "that gossip names beyond it are ignored")
    g = p.add_argument_group("limits (defaults in docs/broker.md)")
    g.add_argument("--max-packet-size", type=int, metavar="BYTES",
                   help="largest packet accepted (default 1048576)")
    g.add_argument("--max-assertions", type=int, metavar="N",
                   help="assertions one connection may hold (default 100000)")
    g.add_argument("--max-references", type=int, metavar="N",
                   help="references one connection may hold (default 10000)")
    g.add_argument("--max-observers", type=int, metavar="N",
                   help="<Observe ...> assertions one connection may hold (default 10000)")
    g.add_argument("--max-matches", type=int, metavar="N",
                   help="assertions one connection's observers may be told of at once "
                   "(default 500000)")
    g.add_argument("--max-turn-events", type=int, metavar="N",
                   help="deliveries one turn (packet) may cause; a larger one is refused "
                   "and its connection closed (default 100000)")
    g.add_argument("--max-total-assertions", type=int, metavar="N",
                   help="assertions all connections together may hold (default 1000000)")
    g.add_argument("--max-memory", metavar="SIZE",
                   help="bytes clients may make the server hold (assertions, buffers, links): "
                   "past it new assertions are refused, the connections live on; e.g. 512M, "
                   "2G, 25%% (of this machine's memory), off (default: a quarter of this "
                   "machine's memory, at most 1G)")
    g.add_argument("--max-buffered", type=int, metavar="BYTES",
                   help="bytes queued to all connections together; past it the longest "
                   "queue is disconnected (default 268435456)")
    g.add_argument("--work-rate", type=int, metavar="EVENTS",
                   help="events per second a connection's own requests may deliver back to "
                   "it before it is slowed (default 100000)")
    g.add_argument("--throttle-limit", type=float, metavar="SECONDS",
                   help="close a connection slowed this long within a minute (default 10; "
                   "0 = never)")
    g.add_argument("--max-debt", type=int, metavar="BYTES",
                   help="undelivered bytes a connection may cause before it is no longer "
                   "read (default 1048576)")
    g.add_argument("--max-send-queue", type=int, metavar="BYTES",
                   help="bytes queued to a slow consumer before it is disconnected "
                   "(default 16777216)")
    g.add_argument("--max-connections", type=int, metavar="N",
                   help="connections served at once; more are refused with an error "
                   "(default 10000)")
    g.add_argument("--max-connections-per-address", type=int, metavar="N",
                   help="connections one source address may hold (default: a quarter of "
                   "--max-connections)")
    g.add_argument("--connect-rate", type=float, metavar="PER_SECOND",
                   help="new connections per second from one address, after a burst of ten "
                   "times as many (default 100; 0 = unlimited)")
    g.add_argument("--idle-timeout", type=float, metavar="SECONDS",
                   help="close a connection that holds nothing and sends nothing for this "
                   "long (default 300; 0 = never)")
    g.add_argument("--send-timeout", type=float, metavar="SECONDS",
                   help="disconnect a consumer whose queue does not drain for this long "
                   "(default 30)")
    g.add_argument("--handshake-timeout", type=float, metavar="SECONDS",
                   help="time a connection has to resolve a sturdyref, and a connection to "
                   "the HTTP port to send its first request (default 30; 0 = none)")
    g.add_argument("--keepalive", type=float, metavar="SECONDS",
                   help="TCP keepalive idle time (default 60; 0 = off)")
    g.add_argument("--ws-ping-interval", type=float, metavar="SECONDS",
                   help="WebSocket ping interval (default 20; 0 = off)")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The configuration file (if any) with the command-line options applied."""
    cfg = load_config(args.config) if args.config else ServerConfig()
    cfg = cfg.override(
        tcp=args.tcp, unix=args.unix, ws=args.ws, data_dir=args.data_dir, store=args.store,
        max_packet_size=args.max_packet_size, max_assertions=args.max_assertions,
        max_references=args.max_references, max_debt=args.max_debt,
        max_send_queue=args.max_send_queue, max_connections=args.max_connections,
        max_observers=args.max_observers, max_matches=args.max_matches,
        max_turn_events=args.max_turn_events, max_total_assertions=args.max_total_assertions,
        max_buffered=args.max_buffered, work_rate=args.work_rate,
        throttle_limit=args.throttle_limit,
        max_connections_per_address=args.max_connections_per_address,
        connect_rate=args.connect_rate, idle_timeout=args.idle_timeout,
        send_timeout=args.send_timeout,
        handshake_timeout=args.handshake_timeout, keepalive=args.keepalive,
        ws_ping_interval=args.ws_ping_interval,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
        tls_ca=args.tls_ca,
    )
    if args.max_memory is not None:
        cfg = cfg.override(max_memory=parse_size(args.max_memory))
    if args.record:
        cfg = cfg.override(record=[*cfg.record, *args.record])
    cfg = cfg.override(scry_udp=args.scry_udp, http=args.http, http_open=args.http_open)
    if args.publish:
        cfg = cfg.override(publish=[*cfg.publish, *args.publish])
    links, caps = args.link or [], args.link_cap or []
    if len(links) != len(caps):
        raise ConfigError(f"{len(links)} --link but {len(caps)} --link-cap: give one "
                          "--link-cap per --link, in the same order")
    if links:
        cfg = cfg.override(link=[*cfg.link, *zip(links, caps)])
    routes = [r.strip() for arg in args.routes or [] for r in arg.split(",") if r.strip()]
    cfg = cfg.override(cluster=args.cluster, cluster_name=args.cluster_name,
                       cluster_secret=args.cluster_secret,
                       cluster_advertise=args.cluster_advertise,
                       cluster_max_members=args.cluster_max_members,
                       routes=[*cfg.routes, *routes] if routes else None)
    cfg.check(prefix="--")
    _recorder_specs(cfg)
    for name in cfg.publish:
        try:
            check_stream_name(name)
        except ValueError as e:
            raise ConfigError(f"publish: {e}") from None
    return cfg


def _recorder_specs(cfg: ServerConfig) -> list[RecorderSpec]:
    """The config's recorder specs, checked (a bad one is a ConfigError)."""
    try:
        specs = recorder_specs(cfg.record)
    except ValueError as e:
        raise ConfigError(f"record: {e}") from None
    names = {"root"} | {b.dataspace for b in cfg.bind}
    for s in specs:
        if (s.dataspace or "root") not in names:
            raise ConfigError(
                f"record: stream {s.stream!r} records from dataspace {s.dataspace!r}, which "
                f"the server does not have (it has: {', '.join(sorted(names))})"
            )
    return specs


def _link_events(verbose: int = 0) -> None:
    """Links and routes going up and down, and why, are printed even without -v (and a
    cluster member taking the lead of a recorded stream); each failed attempt of a link that keeps failing only with it (without, a warning when
    the reason changes and once a minute: dataspace.broker.link.FailureWarnings)."""
    for name in ("dataspace.broker.link", "dataspace.broker.cluster",
                 "dataspace.streams.cluster"):
        lg = logging.getLogger(name)
        if lg.getEffectiveLevel() > logging.INFO:
            lg.setLevel(logging.INFO)
    if not verbose:
        logging.getLogger("dataspace.broker.link.retries").setLevel(logging.WARNING)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"dataspace serve: {e}", file=sys.stderr)
        return 2
    verbose = max(getattr(args, "verbose", 0) or 0, cfg.verbose)
    if verbose:
        logging.getLogger().setLevel(logging.INFO if verbose == 1 else logging.DEBUG)
    _link_events(verbose)  # (a server that only accepts links says so too)
    _tune_gc()
    return asyncio.run(_serve(cfg))


def _tune_gc() -> None:
    """The cyclic collector, tuned for a server process.  Routing a message allocates a
    few small containers (the offsets of its items, the run it is part of), all freed by
    reference counting; with the default threshold (700 allocations) the collector ran
    every few packets and took 10-13% of the server's CPU under load, walking the
    long-lived tables (the index, the connections) each time.  Those are frozen out of
    its walks once started, and the first generation is collected every 50,000
    allocations (cycles are rare here: what they hold is freed a little later)."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def _say_tls(server: Server) -> None:
    tls = server.tls
    assert tls is not None
    info = tls.info
    what = f" ({info.describe()}, valid until {info.not_after:%Y-%m-%d})" if info and \
        info.not_after else ""
    mutual = (f"; clients need a certificate signed by {tls.client_ca}" if tls.mutual
              else "")
    print(f"dataspace serve: TLS with {tls.cert}{what}{mutual}; SIGHUP reloads it",
          file=sys.stderr, flush=True)


def _reload_tls(server: Server) -> None:
    """SIGHUP: read the certificate files again for every listener, the cluster port
    and the routes this member dials (new connections get them).  What happened is said
    once, here (not also by the server's log)."""
    assert server.tls is not None
    try:
        info = server.reload_tls()
    except TLSConfigError as e:
        _say_not_reloaded(str(e), "SIGHUP")
        return
    _say_reloaded(server, info, "SIGHUP")


def _say_not_reloaded(why: str, trigger: str) -> None:
    print(f"dataspace serve: cannot reload TLS ({trigger}): {why}; still serving the "
          "previous certificate (fix the files, or send SIGHUP once they are complete)",
          file=sys.stderr, flush=True)


def _say_reloaded(server: Server, info: CertInfo | None, why: str) -> None:
    assert server.tls is not None
    what = f" ({info.describe()}, valid until {info.not_after:%Y-%m-%d})" if info and \
        info.not_after else ""
    print(f"dataspace serve: reloaded the TLS certificate {server.tls.cert}{what} ({why}): "
          "new connections get it", file=sys.stderr, flush=True)


LOCK_FILE = "serve.lock"
"""In the data directory: locked (and holding the pid) while a server uses it."""


def _claim(data_dir: Path) -> IO[str] | None:
    """Lock the data directory for this server (released when the process ends, however
    it ends).  A directory another running server holds is said once: the two would
    share its capability, its server id (links between them are refused as links of a
    server to itself) and its stream store.  A warning, not a refusal."""
    try:
        f = open(data_dir / LOCK_FILE, "a+", encoding="utf-8")  # held open: the lock
    except OSError:
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip()
        f.close()
        who = f"another `dataspace serve` (pid {pid})" if pid.isdigit() else \
            "another `dataspace serve`"
        print(f"dataspace serve: warning: {who} uses the data directory {data_dir}: the two "
              "share its capability, its server id (a link between them is refused) and its "
              "stream store; give this one its own --data-dir DIR", file=sys.stderr,
              flush=True)
        return None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


async def _serve(cfg: ServerConfig) -> int:
    # Everything that can fail on the data directory's contents is checked before the
    # server listens or prints its sturdyref: a damaged stream store is one line and a
    # non-zero exit, as `dataspace stream ls` reports it, not a traceback after start.
    store: Store | None = None
    try:
        specs = _recorder_specs(cfg)
        data_dir = resolve_data_dir(cfg.data_dir)
        if specs or cfg.publish or cfg.scry_udp or cfg.http:
            store = open_data_store(data_dir, create=True, store=cfg.store)
    except (StoreError, OSError, ConfigError, ValueError) as e:
        print(f"dataspace serve: {e}", file=sys.stderr)
        return 1
    server = Server(cfg, data_dir=data_dir)
    recorders: list[Any] = []
    cluster_rec: list[ClusterRecording] = []
    if store is not None and specs:
        server.before_listening.append(
            lambda: _start_recording(cfg, server, store, specs, recorders, cluster_rec))
    try:
        await server.start()
    except (OSError, ConfigError, ValueError, StoreError) as e:
        for cr in cluster_rec:
            cr.stop()
        stop_recorders(recorders)
        for cr in cluster_rec:
            cr.release()
        await server.close()
        if store is not None:
            store.close()
        print(f"dataspace serve: {e}", file=sys.stderr)
        return 1
    with contextlib.closing(_claim(data_dir) or open(os.devnull, encoding="utf-8")):
        return await _run(cfg, server, store, recorders,
                          cluster_rec[0] if cluster_rec else None)


def _start_recording(cfg: ServerConfig, server: Server, store: Store,
                     specs: list[RecorderSpec], recorders: list[Any],
                     cluster_rec: list[ClusterRecording]) -> None:
    """The recorders, started once the server's dataspaces exist and before anything
    listens (so no client's sync is answered before they are in place).  In a cluster,
    the root dataspace's record as a member (docs/cluster.md, "Recording in a cluster")."""
    spec_c = cfg.cluster_spec(server.data_dir) if cfg.cluster else None  # type: ignore[arg-type]
    for spec in specs:
        ds = server.dataspaces[spec.dataspace or "root"]
        recorders += start_recorders(ds, [spec], store)
    # A client's sync() is answered once what it sent before is in the store.
    assert server.sync_gate is not None
    for r in recorders:
        r.on_progress = server.sync_gate.progress
        server.add_durable_source(r)
    if spec_c is None:
        return
    root = server.dataspaces["root"]
    mine = [r for r in recorders if r.dataspace is root]
    if not mine:
        return

    def members() -> dict[str, bool]:
        cl = server.cluster
        m = cl.membership if cl is not None else None
        return {p: bool(x.up) for p, x in m.members.items()} if m is not None else {}

    assert server.data_dir is not None
    cr = ClusterRecording(store, mine, member=load_server_id(server.data_dir),
                          cluster=spec_c.name, hub=lambda: server.links.get("root"),
                          members=members, dead=spec_c.dead)
    cr.declare()
    cluster_rec.append(cr)
    server.cluster_status_extra.append(cr.status)


async def _run(cfg: ServerConfig, server: Server, store: Store | None,
               recorders: list[Any], cluster_rec: ClusterRecording | None) -> int:
    stop = stop_event()
    started = False
    scry_server: ScryServer | None = None
    http: Any = None  # dataspace.web.HttpServer (aiohttp is imported only when used)
    try:
        if cluster_rec is not None:
            cluster_rec.start()
        udp = cfg.host_port("scry_udp")
        if udp is not None:
            assert store is not None
            try:
                scry_server = await start_scry_udp(store, udp[0], udp[1], cfg.publish)
            except OSError as e:
                raise listen_error(e, cfg.scry_udp or "", "--scry-udp") from None
            # What its readers make it hold counts in the memory budget (--max-memory).
            server.memory_sources.append(scry_server.held_bytes)
        http_address = cfg.host_port("http")
        if http_address is not None:
            from ..web import start_http

            try:
                http = await start_http(*http_address, store=store, publish=cfg.publish,
                                        server=server, recorders=recorders,
                                        open_access=cfg.http_open,
                                        ssl_context=server.tls.http_context if server.tls else None,
                                        first_request_timeout=cfg.handshake_timeout)
            except OSError as e:
                raise listen_error(e, cfg.http or "", "--http") from None
        print(f"sturdyref: {server.sturdyref}", flush=True)
        for a in server.addresses:
            print(f"dataspace serve: listening on {a}", file=sys.stderr)
        if server.tls is not None:
            _say_tls(server)
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, _reload_tls, server)
            server.tls.on_change = lambda info: _say_reloaded(server, info, "its files changed")
            server.tls.on_error = lambda why: _say_not_reloaded(why, "its files changed")
        if scry_server is not None:
            h, port = scry_server.address
            print(f"dataspace serve: scry on udp://{h}:{port}/ for "
                  f"{', '.join(cfg.publish) or 'no stream (give --publish STREAM)'}",
                  file=sys.stderr, flush=True)
        if http is not None:
            access = ("open to this machine without a token" if cfg.http_open else
                      "for a capability of the server as a bearer token")
            print(f"dataspace serve: HTTP on {http.url} (scry gateway for: "
                  f"{', '.join(cfg.publish) or 'no stream; give --publish STREAM'}; "
                  f"/metrics and /api/ {access}); the web inspector: open {http.url} in a "
                  "browser", file=sys.stderr, flush=True)
        if recorders and store is not None:
            if cluster_rec is not None and server.cluster is not None:
                print(f"dataspace serve: recording {len(recorders)} stream(s) into "
                      f"{store.display} as a member of cluster {server.cluster.name}: each "
                      "message once, by the member it enters through; a store every member "
                      "records into is one stream for the cluster (the same --store: "
                      "PostgreSQL, or one SQLite file on one machine), a store of its own "
                      "holds all this member sees (`dataspace cluster status` says who "
                      "shares it)", file=sys.stderr, flush=True)
            else:
                print(f"dataspace serve: recording {len(recorders)} stream(s) into "
                      f"{store.display}", file=sys.stderr, flush=True)
        for spec in cfg.link_specs():
            print(f"dataspace serve: linking to {spec.address} (`dataspace link status` "
                  "shows the links)", file=sys.stderr, flush=True)
        if server.cluster is not None:
            cl = server.cluster
            routes = ", ".join(cfg.routes) or "none yet: the others dial this one"
            print(f"dataspace serve: cluster {cl.name}: routes on {cl.listen_address} "
                  f"(member {cl.me}, dialed as {cl.address}; dialing: {routes}; `dataspace "
                  "cluster status` shows the members)", file=sys.stderr, flush=True)
        print(f"dataspace serve: data directory {server.data_dir}; Ctrl-C stops the server",
              file=sys.stderr, flush=True)
        started = True
        await stop.wait()
    except (StoreError, OSError, ValueError) as e:
        print(f"dataspace serve: {e}", file=sys.stderr)
        return 1
    finally:
        if started:
            print("dataspace serve: shutting down", file=sys.stderr, flush=True)
        if http is not None:  # readers first: event streams end cleanly
            await http.close()
        if scry_server is not None:
            await scry_server.close()
            with contextlib.suppress(ValueError):
                server.memory_sources.remove(scry_server.held_bytes)
        # Recorders first: what they queued is committed, and the server's own shutdown
        # (every connection closing) is not recorded as if clients had left.
        if cluster_rec is not None:
            cluster_rec.stop()
        stop_recorders(recorders)
        if cluster_rec is not None:
            cluster_rec.release()
        if store is not None:
            store.close()
        await server.close()
    return 0
