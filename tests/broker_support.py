"""Helpers for the broker tests: servers on free loopback ports, raw protocol clients,
subprocesses, and waiting on events with timeouts (never sleeping to synchronise)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from dataspace.broker import Server, ServerConfig
from dataspace.dataspace import Entity
from dataspace.protocol.relay import Relay, RelayLimits, RemoteEntity
from dataspace.protocol.sturdy import SturdyRef
from dataspace.protocol.wire import WireRef, parse_packet
from dataspace.values import Decoder, Embedded, Record, Symbol, Value, encode

PY = sys.executable
TIMEOUT = 20.0


@contextlib.asynccontextmanager
async def running_server(tmp_path: Path, **settings: Any) -> AsyncIterator[Server]:
    """An in-process server on a free loopback TCP port (plus whatever ``settings`` add)."""
    settings.setdefault("tcp", ["127.0.0.1:0"])
    server = Server(ServerConfig(**settings), data_dir=tmp_path / "data")
    await server.start()
    try:
        yield server
    finally:
        await server.close()


def tcp_address(server: Server) -> str:
    a = next(a for a in server.addresses if a.kind == "tcp")
    return f"{a.host}:{a.port}"


def ws_address(server: Server) -> str:
    return next(a for a in server.addresses if a.kind == "ws").url


async def wait(pred: Callable[[], bool], event: asyncio.Event, timeout: float = TIMEOUT) -> None:
    """Wait until ``pred()`` holds, re-checking each time ``event`` is set."""
    async def loop() -> None:
        while not pred():
            await event.wait()
            event.clear()

    await asyncio.wait_for(loop(), timeout)


class Changes:
    """Counts callbacks and lets a test wait for a condition on what it saw."""

    def __init__(self) -> None:
        self.log: list[tuple[str, tuple[Value, ...]]] = []
        self.present: dict[Any, int] = {}
        self.event = asyncio.Event()

    def on_assert(self, *caps: Value) -> None:
        self.log.append(("+", caps))
        self.present[caps] = self.present.get(caps, 0) + 1
        self.event.set()

    def on_retract(self, *caps: Value) -> None:
        self.log.append(("-", caps))
        n = self.present.get(caps, 0) - 1
        if n <= 0:
            self.present.pop(caps, None)
        else:
            self.present[caps] = n
        self.event.set()

    def on_message(self, *caps: Value) -> None:
        self.log.append(("!", caps))
        self.event.set()

    def kw(self) -> dict[str, Callable[..., None]]:
        return {"on_assert": self.on_assert, "on_retract": self.on_retract,
                "on_message": self.on_message}

    def messages(self) -> list[tuple[Value, ...]]:
        return [c for k, c in self.log if k == "!"]

    async def until(self, pred: Callable[[Changes], bool], timeout: float = TIMEOUT) -> None:
        await wait(lambda: pred(self), self.event, timeout)


# ---------------------------------------------------------------------------------------
# A raw protocol client: a socket and a sans-IO relay, for sending arbitrary bytes.


class _Answer(Entity):
    def __init__(self) -> None:
        self.value: Value = None
        self.event = asyncio.Event()

    def on_assert(self, value: Value, handle: int) -> None:
        self.value = value
        self.event.set()


class RawClient:
    """A TCP connection driven by hand: raw bytes out, decoded packets in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.relay = Relay(limits=RelayLimits(strict=False, max_packet_size=64 << 20))
        self.packets: list[Any] = []
        self.decoder = Decoder(embedded=WireRef.from_value, max_value_size=64 << 20)

    @classmethod
    async def open(cls, address: str, rcvbuf: int | None = None) -> RawClient:
        host, port = address.rsplit(":", 1)
        if rcvbuf is None:
            reader, writer = await asyncio.open_connection(host, int(port))
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
            reader, writer = await asyncio.open_connection(sock=sock, limit=rcvbuf)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def flush_relay(self) -> None:
        await self.send(self.relay.data_to_send())

    async def resolve(self, cap: SturdyRef) -> RemoteEntity:
        """Resolve ``cap`` through the relay; returns the dataspace reference."""
        answer = _Answer()
        gk = self.relay.import_ref(0)
        gk.on_assert(Record(Symbol("resolve"), [cap.to_value(), Embedded(answer)]), 1)
        await self.flush_relay()
        while not answer.event.is_set():
            data = await asyncio.wait_for(self.reader.read(65536), TIMEOUT)
            if not data:
                raise ConnectionError("closed during resolve")
            self.relay.receive_data(data)
            await self.flush_relay()
        v = answer.value
        assert isinstance(v, Record) and v.label == Symbol("accepted"), v
        return v.fields[0].value

    async def read_until_closed(self, timeout: float = TIMEOUT) -> list[Any]:
        """Every packet the server sends until it closes the connection."""
        async def loop() -> None:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    return
                self.decoder.feed(data)
                while (v := self.decoder.try_next()) is not None:
                    self.packets.append(parse_packet(v))

        with contextlib.suppress(ConnectionResetError):
            await asyncio.wait_for(loop(), timeout)
        return self.packets

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


def error_messages(packets: list[Any]) -> list[str]:
    from dataspace.protocol.wire import Error

    return [p.message for p in packets if isinstance(p, Error)]


def raw_packet(value: Value) -> bytes:
    return encode(value)


# ---------------------------------------------------------------------------------------
# Subprocesses


class ServerProcess:
    """``dataspace serve`` in a subprocess; knows its sturdyref and TCP port."""

    def __init__(self, data_dir: Path, port: int = 0, extra: tuple[str, ...] = ()) -> None:
        self.data_dir = data_dir
        self.args = [PY, "-m", "dataspace.cli", "serve", "--tcp", f"127.0.0.1:{port}",
                     "--data-dir", str(data_dir), *extra]
        self.proc: asyncio.subprocess.Process | None = None
        self.sturdyref = ""
        self.port = port
        self.stderr_lines: list[str] = []

    async def start(self) -> ServerProcess:
        self.proc = await asyncio.create_subprocess_exec(
            *self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), TIMEOUT)
        text = line.decode()
        if not text.startswith("sturdyref: "):
            err = await asyncio.wait_for(self.proc.stderr.read(), TIMEOUT)
            raise RuntimeError(f"server did not start: {text!r} {err.decode()!r}")
        self.sturdyref = text[len("sturdyref: "):].strip()
        while True:
            line = await asyncio.wait_for(self.proc.stderr.readline(), TIMEOUT)
            s = line.decode()
            self.stderr_lines.append(s)
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", s)
            if m:
                self.port = int(m.group(1))
            if "Ctrl-C stops" in s or not line:
                break
        self.args[5] = f"127.0.0.1:{self.port}"  # a restart reuses the port
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        p = self.proc
        if p is None or p.returncode is not None:
            return p.returncode if p else 0
        p.send_signal(sig)
        try:
            return await asyncio.wait_for(p.wait(), TIMEOUT)
        except TimeoutError:
            p.kill()
            return await p.wait()


async def spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        PY, *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


async def read_line_matching(proc: asyncio.subprocess.Process, pattern: str,
                             seen: list[str], timeout: float = TIMEOUT) -> str:
    """Read ``proc``'s output until a line matches ``pattern`` (lines kept in ``seen``)."""
    assert proc.stdout is not None
    rx = re.compile(pattern)
    for s in seen:
        if rx.search(s):
            return s

    async def loop() -> str:
        while True:
            line = await proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise EOFError(f"process ended before printing {pattern!r}; output: {seen}")
            s = line.decode().rstrip("\n")
            seen.append(s)
            if rx.search(s):
                return s

    return await asyncio.wait_for(loop(), timeout)


async def kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
    await asyncio.wait_for(proc.wait(), TIMEOUT)


def async_test(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run an async test function in a fresh event loop (bounded by a timeout)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 150))

    return wrapper
