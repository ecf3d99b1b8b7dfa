"""Server CPU per delivered message: `dataspace serve` beside nats-server, from outside.

Both servers run as processes of their own; both are driven with raw sockets and
pre-encoded packets (for ours: Syndicate protocol Turn packets in Preserves binary, sent
after the gatekeeper handshake; for NATS: ``PUB Msg 16`` lines), and the subscribers only
count payloads in the bytes they receive (they decode nothing).  The figure is the server
process's own CPU time (utime + stime from /proc/PID/stat) over the messages delivered
while it was measured, in µs per delivered message, and the ratio to nats-server's.

Cases (one publisher or subscriber = one connection):

* ``1 -> 1 batched``: 100 messages per Turn (NATS: the same PUBs, pipelined);
* ``1 -> 1 one per Turn``: a Turn packet per message (NATS: the same pipelined PUBs:
  its protocol has no turns);
* ``1 -> 10``: batched, ten subscribers each receiving every message;
* ``10 -> 1``: batched, ten publishers, one subscriber receiving everything.

The publishers keep a bounded window of messages in flight (sent, not yet counted by the
subscribers), so nothing piles up in a server and nothing is dropped.

Run:  .venv/bin/python benchmarks/bench_server_cpu.py          (about a minute)
      .venv/bin/python benchmarks/bench_server_cpu.py --quick  (a smoke run)
      .venv/bin/python benchmarks/bench_server_cpu.py --no-nats
      .venv/bin/python benchmarks/bench_server_cpu.py --profile DIR  (py-spy record of
                                                    our server per case, if installed)
      .venv/bin/python benchmarks/bench_server_cpu.py --baseline OLD/src  (the server of an
                                                    older checkout beside, same run)

Builds: ``--builds pure,compiled`` runs our server once per build in the same run
(``DATASPACE_PURE=1`` in the server's environment selects the pure modules); the compiled
build is measured only when compiled modules are present.  One run, not best of several:
the ratios, not the absolute figures, are what carries from one machine to another.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dataspace.dataspace import OBSERVE, Entity
from dataspace.pattern import parse_pattern, to_preserves
from dataspace.protocol.relay import Relay, RelayLimits, RemoteEntity
from dataspace.protocol.sturdy import SturdyRef
from dataspace.values import Embedded, Record, Sequence, Symbol, Value, encode

PAYLOAD = b"0123456789abcdef"
"""The 16 bytes every message carries; the subscribers count them."""
MSG = Symbol("Msg")
NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"
CLK_TCK = os.sysconf("SC_CLK_TCK")
TIMEOUT = 120.0


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


def compiled_present() -> bool:
    """Whether compiled modules of dataspace are installed beside the pure ones."""
    import dataspace

    root = Path(dataspace.__file__).parent
    return any(root.rglob("*.so"))


# ---------------------------------------------------------------------------------------
# Servers


UVLOOP_MAIN = ("import sys, uvloop; uvloop.install(); from dataspace.cli import main; "
               "sys.exit(main(sys.argv[1:]))")


class OurServer:
    def __init__(self, build: str, uvloop: bool = False, src: str | None = None) -> None:
        self.build = build
        self.uvloop = uvloop
        self.src = src  # another source tree to run (PYTHONPATH), e.g. the code before
        self.dir = tempfile.mkdtemp(prefix="bench-cpu-")
        self.proc: subprocess.Popen[str] | None = None
        self.address = ("127.0.0.1", 0)
        self.cap = ""

    def start(self) -> OurServer:
        env = dict(os.environ)
        if self.build == "pure":
            env["DATASPACE_PURE"] = "1"
        else:
            env.pop("DATASPACE_PURE", None)
        if self.src is not None:
            env["PYTHONPATH"] = os.pathsep.join([self.src, *filter(None, [
                env.get("PYTHONPATH")])])
        main = ["-c", UVLOOP_MAIN] if self.uvloop else ["-m", "dataspace.cli"]
        self.proc = subprocess.Popen(
            [sys.executable, *main, "serve", "--tcp", "127.0.0.1:0",
             "--data-dir", self.dir, "--max-assertions", "1000000"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        assert self.proc.stdout and self.proc.stderr
        line = self.proc.stdout.readline()
        if not line.startswith("sturdyref: "):
            raise SystemExit(f"dataspace serve did not start: {line}{self.proc.stderr.read()}")
        self.cap = line[len("sturdyref: "):].strip()
        for line in self.proc.stderr:
            m = re.search(r"listening on (127\.0\.0\.1):(\d+)", line)
            if m:
                self.address = (m.group(1), int(m.group(2)))
            if "Ctrl-C stops" in line:
                break
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class NatsServer:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ("127.0.0.1", free_port())

    def start(self) -> NatsServer:
        if not os.path.exists(NATS_SERVER):
            raise SystemExit(
                f"{NATS_SERVER} not found: this benchmark runs nats-server beside ours as the "
                "reference; install it (apt-get install -y nats-server) or pass --no-nats"
            )
        self.proc = subprocess.Popen(
            [NATS_SERVER, "-a", self.address[0], "-p", str(self.address[1])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(self.address, 0.2):
                return self
            time.sleep(0.05)  # a benchmark waiting for a port, not a test
        raise SystemExit("nats-server did not start")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


# ---------------------------------------------------------------------------------------
# Our protocol: the handshake through a sans-IO relay, then raw bytes


class _Answer(Entity):
    def __init__(self) -> None:
        self.value: Value = None
        self.got = False

    def on_assert(self, value: Value, handle: int) -> None:
        self.value = value
        self.got = True

    def on_message(self, value: Value) -> None:
        self.value = value
        self.got = True


def _pump(sock: socket.socket, relay: Relay, until: _Answer) -> None:
    deadline = time.monotonic() + 30
    out = relay.data_to_send()
    if out:
        sock.sendall(out)
    while not until.got:
        if time.monotonic() > deadline:
            raise SystemExit("our server did not answer the handshake within 30 s")
        data = sock.recv(1 << 16)
        if not data:
            raise SystemExit(f"our server closed the connection: {relay.peer_error}")
        relay.receive_data(data)
        out = relay.data_to_send()
        if out:
            sock.sendall(out)


@dataclass
class Peer:
    sock: socket.socket
    relay: Relay | None = None
    ds: RemoteEntity | None = None


def our_connect(srv: OurServer) -> Peer:
    sock = socket.create_connection(srv.address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    relay = Relay(limits=RelayLimits(strict=False, max_packet_size=64 << 20))
    answer = _Answer()
    relay.import_ref(0).on_assert(
        Record(Symbol("resolve"), [SturdyRef.parse(srv.cap).to_value(), Embedded(answer)]), 1)
    _pump(sock, relay, answer)
    v = answer.value
    if not (type(v) is Record and v.label == Symbol("accepted")):
        raise SystemExit(f"the gatekeeper refused the capability: {v}")
    return Peer(sock, relay, v.fields[0].value)


def our_subscribe(peer: Peer, pattern: str) -> None:
    assert peer.relay is not None and peer.ds is not None
    sink = Entity()
    peer.ds.on_assert(Record(OBSERVE, [to_preserves(parse_pattern(pattern)), Embedded(sink)]), 2)
    synced = _Answer()
    peer.relay.send_sync(peer.ds, synced)
    _pump(peer.sock, peer.relay, synced)


def our_block(peer: Peer, batch: int, turns: int) -> bytes:
    """``turns`` Turn packets of ``batch`` messages ``<Msg i PAYLOAD>`` each (or, with
    batch 1, ``turns`` packets of one message)."""
    assert peer.ds is not None
    oid = peer.ds.oid
    m = Symbol("M")
    payload = PAYLOAD.decode()
    out = []
    for t in range(turns):
        events = [Sequence((oid, Record(m, [Record(MSG, [t * batch + i, payload])])))
                  for i in range(batch)]
        out.append(encode(Sequence(events)))
    return b"".join(out)


# ---------------------------------------------------------------------------------------
# NATS


def _nats_until(sock: socket.socket, token: bytes) -> None:
    buf = b""
    deadline = time.monotonic() + 10
    while token not in buf:
        if time.monotonic() > deadline:
            raise SystemExit(f"nats-server did not answer {token!r}")
        data = sock.recv(1 << 16)
        if not data:
            raise SystemExit("nats-server closed the connection")
        buf += data


def nats_connect(srv: NatsServer) -> Peer:
    sock = socket.create_connection(srv.address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _nats_until(sock, b"INFO")
    sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"echo":false}\r\nPING\r\n')
    _nats_until(sock, b"PONG")
    return Peer(sock)


def nats_subscribe(peer: Peer, sid: int) -> None:
    peer.sock.sendall(f"SUB Msg {sid}\r\nPING\r\n".encode())
    _nats_until(peer.sock, b"PONG")


def nats_block(messages: int) -> bytes:
    return (b"PUB Msg 16\r\n" + PAYLOAD + b"\r\n") * messages


# ---------------------------------------------------------------------------------------
# The driver: publishers write blocks while the window allows, subscribers count


@dataclass
class Result:
    delivered: int
    cpu: float
    wall: float

    @property
    def us(self) -> float:
        return 1e6 * self.cpu / self.delivered if self.delivered else float("nan")


def drive(pid: int, pubs: list[socket.socket], subs: list[socket.socket], block: bytes,
          per_block: int, target_cpu: float, window: int, warm: int) -> Result:
    """Publish ``block`` (``per_block`` messages) on every publisher over and over; count
    deliveries (``PAYLOAD`` occurrences) on every subscriber.  After ``warm`` deliveries,
    measure the server's CPU until it has used ``target_cpu`` seconds, then stop
    publishing and wait for every message sent to arrive."""
    fanout = len(subs)
    sel = selectors.DefaultSelector()
    tails: dict[Any, bytes] = {}
    for s in subs:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, "sub")
        tails[s] = b""
    pending: dict[Any, memoryview] = {}
    waiting: list[socket.socket] = []  # publishers whose window is full (not polled)
    for p in pubs:
        p.setblocking(False)
        pending[p] = memoryview(b"")
        sel.register(p, selectors.EVENT_WRITE, "pub")
    sent = 0  # messages in the blocks begun so far
    received = 0
    publishing = True
    measuring = False
    cpu0 = wall0 = 0.0
    got0 = 0
    lm = len(PAYLOAD) - 1
    deadline = time.monotonic() + TIMEOUT
    next_check = 0.0
    while True:
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out: {received} of {sent * fanout} deliveries arrived")
        if not measuring and received >= warm:
            measuring = True
            cpu0, wall0, got0 = cpu_seconds(pid), time.perf_counter(), received
        if measuring and publishing:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.02
                if cpu_seconds(pid) - cpu0 >= target_cpu:
                    publishing = False
        if not publishing and received >= sent * fanout and not any(pending.values()):
            break
        for key, _ev in sel.select(1.0):
            s = key.fileobj
            if key.data == "sub":
                data = s.recv(1 << 20)  # type: ignore[union-attr]
                if not data:
                    raise SystemExit("a server closed a subscriber's connection")
                buf = tails[s] + data
                received += buf.count(PAYLOAD)
                tails[s] = buf[-lm:]
                if b"PING\r\n" in data:  # nats-server's keepalive (a rare, whole line)
                    s.send(b"PONG\r\n")  # type: ignore[union-attr]
                if waiting and publishing and \
                        sent * fanout - received + per_block * fanout <= window:
                    for w in waiting:
                        sel.register(w, selectors.EVENT_WRITE, "pub")
                    waiting.clear()
                continue
            mv = pending[s]
            if not mv:
                if not publishing:
                    sel.unregister(s)
                    continue
                if sent * fanout - received + per_block * fanout > window:
                    sel.unregister(s)
                    waiting.append(s)  # type: ignore[arg-type]
                    continue
                mv = memoryview(block)
                sent += per_block
            n = s.send(mv)  # type: ignore[union-attr]
            pending[s] = mv = mv[n:]
            if not mv and not publishing:
                sel.unregister(s)
    cpu = cpu_seconds(pid) - cpu0
    wall = time.perf_counter() - wall0
    sel.close()
    return Result(received - got0, cpu, wall)


# ---------------------------------------------------------------------------------------
# Cases


@dataclass
class Case:
    name: str
    pubs: int
    subs: int
    batch: int  # messages per Turn (ours)


CASES = [
    Case("1 -> 1 batched (100 per Turn)", 1, 1, 100),
    Case("1 -> 1 one per Turn", 1, 1, 1),
    Case("1 -> 10 batched", 1, 10, 100),
    Case("10 -> 1 batched", 10, 1, 100),
]

BLOCK = 1000  # messages per block written at once


def run_ours(srv: OurServer, case: Case, target: float) -> Result:
    subs = [our_connect(srv) for _ in range(case.subs)]
    for s in subs:
        our_subscribe(s, "<Msg $i $p>")
    pubs = [our_connect(srv) for _ in range(case.pubs)]
    block = our_block(pubs[0], case.batch, BLOCK // case.batch)
    # Every publisher resolved the same dataspace: their connections number it alike.
    assert all(p.ds is not None and p.ds.oid == pubs[0].ds.oid for p in pubs)  # type: ignore[union-attr]
    try:
        return drive(srv.pid, [p.sock for p in pubs], [s.sock for s in subs], block, BLOCK,
                     target, window=20 * BLOCK * max(1, case.subs), warm=5 * BLOCK * case.subs)
    finally:
        for p in [*subs, *pubs]:
            p.sock.close()


def run_nats(srv: NatsServer, case: Case, target: float) -> Result:
    subs = [nats_connect(srv) for _ in range(case.subs)]
    for i, s in enumerate(subs):
        nats_subscribe(s, i + 1)
    pubs = [nats_connect(srv) for _ in range(case.pubs)]
    try:
        return drive(srv.pid, [p.sock for p in pubs], [s.sock for s in subs], nats_block(BLOCK),
                     BLOCK, target, window=20 * BLOCK * max(1, case.subs),
                     warm=5 * BLOCK * case.subs)
    finally:
        for p in [*subs, *pubs]:
            p.sock.close()


@contextlib.contextmanager
def profiling(pid: int, out: Path | None, name: str) -> Iterator[None]:
    """py-spy record of ``pid`` while the block runs (when ``out`` is given)."""
    if out is None:
        yield
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    # The compiled core's functions are C functions, seen only in native stacks (which
    # py-spy reads only while it pauses the process: the shares hold, the rate drops).
    mode = ["--native"] if name.startswith("compiled") else ["--nonblocking"]
    p = subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw",
                          "--output", str(out / f"{slug}.txt"), *mode],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        p.send_signal(2)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# Categories of the server's time, by the function a sample was in (its own time; a
# py-spy frame reads "function (file:line)" for Python code and "CPyDef_module___Class___
# method (lib.so)" for the compiled core's C functions, with --native).
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    ("decode packets", re.compile(
        r"^(make_reader|_read_varint|Decoder|_envelope|scan|scan_rel|skip|_scan_ordered|_utf8|"
        r"_varint|_scan_messages)[ .]|^Relay\.(_fast_events|_fast_turn|receive_data|_go_on|"
        r"_decode_loop|_packet|_wireref_in|_run_of_turns) |^Encoded\.|"
        r"^CPyDef_(route___(scan|skip|_scan_ordered|_utf8|_varint)|binary___|relay____scan_messages|"
        r"relay___Relay____(fast_events|fast_turn|go_on|decode_loop|packet|run_of_turns)|"
        r"relay___Relay___receive_data)|^dataspace___Encoded")),
    ("encode deliveries", re.compile(
        r"^make_writer|^Relay\.(_send_message|_send_messages|_emit|_body|_seal|take_packets|"
        r"_encode_int|data_to_send|_send_assert|_send_retract|emit_captures|emit_run|"
        r"emit_bodies) |"
        r"^MessageRouter\.(emit|_emit_one)[ .]|^RemoteEntity\.send_body|"
        r"^CPyDef_(relay___Relay___?_?(send_message|send_messages|emit|body|seal|take_packets|"
        r"encode_int|data_to_send|send_assert|send_retract|emit_captures|emit_run|"
        r"emit_bodies|charge_output)|route___MessageRouter___?_?(emit|emit_one)|"
        r"relay___RemoteEntity)")),
    ("index lookup / routing", re.compile(
        r"dataspace/index\.py|dataspace/pattern\.py|dataspace/values/model\.py|<string>|"
        r"dataspace/protocol/route\.py|^CPyDef_(index___|pattern___|model___|route___)")),
    ("dataspace turn and dispatch", re.compile(
        r"dataspace/dataspace\.py|contextlib\.py|dataspace/protocol/relay\.py|"
        r"^CPyDef_(dataspace___|relay___)")),
    ("asyncio, sockets, flow", re.compile(
        r"asyncio/|selectors\.py|dataspace/net/|socket\.py|^(send|recv|epoll_\w+|__libc_\w+|"
        r"write|read) \(")),
    ("allocation, copying, GC, refcounts (C runtime)", re.compile(
        r"^(malloc|free|realloc|calloc|gc_collect\w*|_?Py\w*(Dealloc|_Dealloc|Alloc)\w*|"
        r"\w+_dealloc|CPyTagged_\w+|CPyList_\w+|CPyDict_\w+|mem\w+) \(|"
        r"^0x[0-9a-f]+ \((libc|libpython)")),
]


def summarise(path: Path) -> list[tuple[str, float]]:
    """Share of samples per category in a py-spy raw (folded) profile."""
    counts: dict[str, int] = {}
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not n.isdigit():
                continue
            leaf = stack.rsplit(";", 1)[-1]
            cat = next((name for name, rx in CATEGORIES if rx.search(leaf)), "other")
            counts[cat] = counts.get(cat, 0) + int(n)
            total += int(n)
    names = [c for c, _rx in CATEGORIES] + ["other"]
    return [(c, 100 * counts.get(c, 0) / max(1, total)) for c in names]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (a smoke test)")
    ap.add_argument("--cpu", type=float, default=None,
                    help="server CPU seconds measured per case (default 2.0; 0.3 with --quick)")
    ap.add_argument("--no-nats", action="store_true", help="our server alone")
    ap.add_argument("--builds", default="pure,compiled",
                    help="builds of our server to run, comma-separated (default pure,compiled: "
                         "compiled only when compiled modules are present)")
    ap.add_argument("--uvloop", action="store_true",
                    help="also run our server under uvloop (pip install uvloop)")
    ap.add_argument("--baseline", metavar="SRC", default=None,
                    help="also run the server from this source tree (a directory holding "
                         "the dataspace package, e.g. an older checkout's src/), as "
                         "'baseline', in the same run")
    ap.add_argument("--cases", default="", help="run only the cases whose name contains this")
    ap.add_argument("--profile", type=Path, default=None,
                    help="record a py-spy profile (raw folded stacks) of our server per case "
                         "into this directory")
    ap.add_argument("--summarise", type=Path, nargs="*", default=None,
                    help="only print the category summary of these py-spy raw profiles")
    args = ap.parse_args()
    if args.summarise is not None:
        for f in args.summarise:
            print(f"{f.name}: " + ", ".join(f"{n} {x:.0f}%" for n, x in summarise(f)))
        return 0
    target = args.cpu if args.cpu is not None else (0.3 if args.quick else 2.0)
    builds = [b.strip() for b in args.builds.split(",") if b.strip()]
    have_compiled = compiled_present()
    if "compiled" in builds and not have_compiled:
        builds.remove("compiled")
    if args.uvloop:
        try:
            import uvloop  # noqa: F401
        except ImportError:
            raise SystemExit("--uvloop needs uvloop: .venv/bin/pip install uvloop") from None
        builds += [f"{b}+uvloop" for b in builds]
    if args.baseline is not None:
        if not (Path(args.baseline) / "dataspace" / "__init__.py").exists():
            raise SystemExit(f"--baseline {args.baseline}: no dataspace package there; give "
                             "the src/ directory of a checkout")
        builds.insert(0, "baseline")
    cases = [c for c in CASES if args.cases in c.name]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}; server CPU measured per case: {target:g} s; "
          f"builds: {', '.join(builds)}{'' if have_compiled else ' (no compiled modules present)'}")
    rows: dict[str, dict[str, Result]] = {c.name: {} for c in cases}
    # Every server runs from the start; the cases take turns on them, so that what the
    # shared machine does meanwhile weighs on all of them alike.
    nats = None if args.no_nats else NatsServer().start()
    servers: dict[str, OurServer] = {}
    try:
        for build in builds:
            base = build.split("+")[0]
            servers[build] = OurServer(
                "pure" if base == "baseline" else base, uvloop=build.endswith("+uvloop"),
                src=args.baseline if base == "baseline" else None).start()
        for c in cases:
            if nats is not None:
                rows[c.name]["nats"] = run_nats(nats, c, target)
            for build, srv in servers.items():
                with profiling(srv.pid, args.profile, f"{build}-{c.name}"):
                    rows[c.name][build] = run_ours(srv, c, target)
    finally:
        if nats is not None:
            nats.stop()
        for srv in servers.values():
            srv.stop()
    head = f"{'case':<32}" + "".join(f"{b + ' µs/msg':>22}{'ratio':>8}" for b in builds)
    if not args.no_nats:
        head += f"{'nats µs/msg':>14}"
    print(head)
    for c in cases:
        r = rows[c.name]
        line = f"{c.name:<32}"
        n = r.get("nats")
        for b in builds:
            x = r[b]
            ratio = f"{x.us / n.us:7.1f}x" if n is not None else f"{'':>8}"
            line += f"{x.us:22.2f}{ratio}"
        if n is not None:
            line += f"{n.us:14.3f}"
        print(line)
    if args.profile is not None:
        print(f"where our server's CPU went (py-spy samples, own time; {args.profile}):")
        for build in builds:
            for c in cases:
                slug = re.sub(r"[^a-z0-9]+", "-", f"{build}-{c.name}".lower()).strip("-")
                f = args.profile / f"{slug}.txt"
                if f.exists():
                    parts = ", ".join(f"{n} {x:.0f}%" for n, x in summarise(f))
                    print(f"  {build}, {c.name}: {parts}")
    print("(delivered messages / server CPU seconds / wall seconds per measurement:)")
    for c in cases:
        print(f"  {c.name}: " + "; ".join(
            f"{k} {x.delivered:,} / {x.cpu:.2f} / {x.wall:.2f}" for k, x in rows[c.name].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
