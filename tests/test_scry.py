"""Scry over real UDP on loopback: `dataspace serve --scry-udp ... --publish ...`, the
`dataspace scry` command and the Python API, through packet loss and a publisher restart."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import signal
import socket

from broker_support import PY, ServerProcess, async_test, kill, read_line_matching, spawn
from dataspace import scry
from dataspace.protocol.scry import GET, FixedPoll
from dataspace.streams import open_store
from dataspace.values import Record, encode

TIMEOUT = 30.0


async def publisher(tmp_path, *publish: str, port: int = 0,
                    more: tuple[str, ...] = ()) -> tuple[ServerProcess, str]:
    extra = ["--scry-udp", f"127.0.0.1:{port}", *more]
    for s in publish:
        extra += ["--publish", s]
    sp = await ServerProcess(tmp_path / "data", extra=tuple(extra)).start()
    line = next(s for s in sp.stderr_lines if "scry on udp://" in s)
    url = re.search(r"udp://127\.0\.0\.1:\d+/", line)
    assert url
    return sp, url.group(0)


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def append(data_dir, stream: str, *texts: str) -> None:
    p = await asyncio.create_subprocess_exec(
        PY, "-m", "dataspace.cli", "stream", "append", stream, *texts, "--data-dir", str(data_dir),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _out, err = await asyncio.wait_for(p.communicate(), TIMEOUT)
    assert p.returncode == 0, err


@async_test
async def test_follow_prints_each_entry_once_in_order_as_it_is_appended(tmp_path):
    sp, url = await publisher(tmp_path, "chat")
    try:
        await append(sp.data_dir, "chat", '"before"')
        follower = await spawn("-m", "dataspace.cli", "scry", "follow", url + "chat",
                               "--from", "start", "--count", "4")
        seen: list[str] = []
        try:
            await read_line_matching(follower, r'^0 "before"$', seen)
            await append(sp.data_dir, "chat", '<Says "alice" "hi">', '"x"')
            await append(sp.data_dir, "chat", "42")
            await asyncio.wait_for(follower.wait(), TIMEOUT)
            assert follower.stdout is not None
            seen += (await follower.stdout.read()).decode().splitlines()
        finally:
            await kill(follower)
        assert seen[0] == f"dataspace scry: following {url}chat from entry 0"  # (stderr)
        assert seen[1:] == ['0 "before"', '1 <Says "alice" "hi">', '2 "x"', "3 42"]
        assert follower.returncode == 0
    finally:
        await sp.stop()


@async_test
async def test_follow_from_next_prints_what_is_appended_as_the_readme_writes_it(tmp_path):
    """`dataspace scry follow udp://HOST:PORT/chat` with the default --from next
    (issue 20, item 2: it printed nothing, whatever was appended)."""
    sp, url = await publisher(tmp_path, "chat")
    try:
        await append(sp.data_dir, "chat", '"old"', '"older"')
        follower = await spawn("-m", "dataspace.cli", "scry", "follow", url + "chat")
        seen: list[str] = []
        try:
            # It says where it starts (stderr) once the publisher answered...
            await read_line_matching(follower, rf"^dataspace scry: following {url}chat from "
                                     r"entry 2$", seen)
            # ... and prints what is appended from then on, and nothing before.
            await append(sp.data_dir, "chat", '"new"')
            await append(sp.data_dir, "chat", '<Says "bob" "hello">')
            await read_line_matching(follower, r'^3 <Says "bob" "hello">$', seen)
        finally:
            await kill(follower)
        assert seen == [f"dataspace scry: following {url}chat from entry 2",
                        '2 "new"', '3 <Says "bob" "hello">']
        # The Python API the same way (start=None is "next").
        notes: list[str] = []
        heard = asyncio.Event()

        def notify(line: str) -> None:
            notes.append(line)
            heard.set()

        got: list[tuple[int, object]] = []

        async def read() -> None:
            async for e in scry.follow(url + "chat", notify=notify):
                got.append((e.index, e.value))
                if len(got) == 2:
                    return

        task = asyncio.ensure_future(read())
        await asyncio.wait_for(heard.wait(), TIMEOUT)
        assert notes == [f"following {url}chat from entry 4"]
        await append(sp.data_dir, "chat", "4", "5")
        await asyncio.wait_for(task, TIMEOUT)
        assert got == [(4, 4), (5, 5)]
    finally:
        await sp.stop()


@async_test
async def test_follow_says_when_nothing_answers_and_keeps_trying_or_gives_up(tmp_path):
    port = free_udp_port()
    url = f"udp://127.0.0.1:{port}/chat"
    # The command with --timeout: one line after 3 s, then it gives up (exit 1).
    follower = await spawn("-m", "dataspace.cli", "scry", "follow", url, "--timeout", "4")
    seen: list[str] = []
    try:
        line = await read_line_matching(follower, r"no answer", seen)
        assert line == (f"dataspace scry: no answer from {url} after 3 s (nothing listens on "
                        f"that port: is a server publishing 'chat' there? start one with: "
                        f"dataspace serve --scry-udp 127.0.0.1:{port} --publish chat); still "
                        "trying, giving up after 4 s")
        assert await asyncio.wait_for(follower.wait(), TIMEOUT) == 1
        assert follower.stdout is not None
        rest = (await follower.stdout.read()).decode().splitlines()
        assert len(rest) == 1 and rest[0].startswith(f"dataspace scry: no answer from {url} "
                                                     "for 4 s (") and "giving up" in rest[0]
    finally:
        await kill(follower)
    # The Python API without a timeout: says so once, keeps trying, and carries on when a
    # publisher appears there.
    notes: list[str] = []
    changed = asyncio.Event()

    def notify(line: str) -> None:
        notes.append(line)
        changed.set()

    got: list[object] = []

    async def read() -> None:
        async for e in scry.follow(url, start="start", notify=notify):
            got.append(e.value)
            return

    task = asyncio.ensure_future(read())
    sp = None
    try:
        await asyncio.wait_for(changed.wait(), TIMEOUT)
        assert len(notes) == 1 and notes[0].startswith(f"no answer from {url} after 3 s (")
        assert notes[0].endswith("; still trying")
        changed.clear()
        sp, _url = await publisher(tmp_path, "chat", port=port)
        await append(sp.data_dir, "chat", '"at last"')
        await asyncio.wait_for(task, TIMEOUT)
        assert got == ["at last"]
        assert notes[1].startswith(f"{url} answers again (after ")
        assert notes[2] == f"following {url} from entry 0"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if sp is not None:
            await sp.stop()


@async_test
async def test_get_waits_for_the_entry_and_unpublished_streams_are_refused(tmp_path):
    sp, url = await publisher(tmp_path, "chat")
    try:
        getter = await spawn("-m", "dataspace.cli", "scry", "get", url + "chat/1")
        seen: list[str] = []
        await append(sp.data_dir, "chat", '"a"', '"b"')
        await read_line_matching(getter, r'^1 "b"$', seen)
        await asyncio.wait_for(getter.wait(), TIMEOUT)
        assert getter.returncode == 0
        with open_store(sp.data_dir) as store:  # a stream that exists but is not published
            store.append("secret", "no")
        with contextlib.suppress(scry.ScryError):
            await scry.get(url + "secret/0", timeout=TIMEOUT)
            raise AssertionError("an unpublished stream was read")
        refused = await spawn("-m", "dataspace.cli", "scry", "get", url + "secret/0")
        out: list[str] = []
        await read_line_matching(refused, r"not published", out)
        assert await asyncio.wait_for(refused.wait(), TIMEOUT) == 1
    finally:
        await sp.stop()


@async_test
async def test_what_readers_make_the_publisher_hold_counts_in_the_memory_budget(tmp_path):
    """Premature requests are remembered (to be answered when the entry comes): 600 of
    them from 60 addresses make `serve --max-memory` count about 200 KB more as held for
    clients, and answering them gives it back."""
    import urllib.request

    sp, url = await publisher(tmp_path, "chat", more=(
        "--max-memory", "64MiB", "--http", "127.0.0.1:0", "--http-open"))
    line = next(s for s in sp.stderr_lines if "HTTP on http://" in s)
    http = re.search(r"http://127\.0\.0\.1:\d+/", line)
    assert http
    target = ("127.0.0.1", int(url.rstrip("/").rsplit(":", 1)[1]))

    def held() -> float:
        with urllib.request.urlopen(http.group(0) + "metrics", timeout=TIMEOUT) as r:
            text = r.read().decode()
        return next(float(x.split(" ")[1]) for x in text.splitlines()
                    if x.startswith("dataspace_memory_held_bytes"))

    async def held_beyond(limit: float, above: bool) -> float:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TIMEOUT
        while True:  # the budget's count of outside holders is refreshed now and then
            h = await asyncio.to_thread(held)
            if (h > limit) == above or loop.time() > deadline:
                return h
            await asyncio.sleep(0.2)  # polling a gauge, with a deadline

    socks = []
    try:
        before = await asyncio.to_thread(held)

        def ask(sock: socket.socket) -> None:
            sock.settimeout(TIMEOUT)
            for i in range(10):  # entries 0..9 of an empty stream: all premature
                sock.sendto(encode(Record(GET, ["chat", i, 0])), target)
                # One at a time, each acknowledged (<scry-wait ...>): a burst would
                # overflow the server's receive buffer, and UDP drops the rest.
                assert b"scry-wait" in sock.recv(2048)

        for _ in range(60):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            socks.append(sock)
            await asyncio.to_thread(ask, sock)
        grown = await held_beyond(before + 600 * 300, above=True)
        assert grown > before + 600 * 300, (before, grown)
        await append(sp.data_dir, "chat", *[f'"e{i}"' for i in range(10)])
        back = await held_beyond(before + 600 * 300, above=False)
        assert back < before + 600 * 300, (before, grown, back)
    finally:
        for sock in socks:
            sock.close()
        await sp.stop()


class LossyProxy:
    """A UDP proxy that drops a share of the datagrams each way (seeded)."""

    def __init__(self, target: tuple[str, int], loss: float, seed: int) -> None:
        self.target = target
        self.loss = loss
        self.rng = random.Random(seed)
        self.client: tuple[str, int] | None = None
        self.dropped = 0

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        proxy = self

        class Front(asyncio.DatagramProtocol):
            def connection_made(self, t):
                proxy.front = t

            def datagram_received(self, data, addr):
                proxy.client = addr
                proxy.forward(proxy.back, data, None)

        class Back(asyncio.DatagramProtocol):
            def connection_made(self, t):
                proxy.back = t

            def datagram_received(self, data, addr):
                if proxy.client is not None:
                    proxy.forward(proxy.front, data, proxy.client)

        await loop.create_datagram_endpoint(Back, remote_addr=self.target)
        await loop.create_datagram_endpoint(Front, local_addr=("127.0.0.1", 0))
        return self.front.get_extra_info("sockname")[1]

    def forward(self, t, data, addr) -> None:
        if self.rng.random() < self.loss:
            self.dropped += 1
            return
        t.sendto(data, addr) if addr else t.sendto(data)

    def close(self) -> None:
        self.front.close()
        self.back.close()


@async_test
async def test_the_python_api_follows_through_loss_and_a_publisher_restart(tmp_path):
    port = free_udp_port()  # the same after the restart
    sp, _url = await publisher(tmp_path, "feed", port=port)
    proxy = LossyProxy(("127.0.0.1", port), 0.3, seed=7)
    pport = await proxy.start()
    got: list[tuple[int, object]] = []
    done = asyncio.Event()
    half = asyncio.Event()

    async def reader() -> None:
        async for e in scry.follow(f"udp://127.0.0.1:{pport}/feed", start=0):
            got.append((e.index, e.value))
            if len(got) == 10:
                half.set()
            if len(got) == 20:
                done.set()
                return

    task = asyncio.ensure_future(reader())
    try:
        for i in range(10):
            await append(sp.data_dir, "feed", str(i))
        await asyncio.wait_for(half.wait(), TIMEOUT)
        # The publisher dies (kill -9) and comes back on the same port: the reader goes on.
        await sp.stop(signal.SIGKILL)
        await append(sp.data_dir, "feed", *[str(i) for i in range(10, 15)])
        await sp.start()
        for i in range(15, 20):
            await append(sp.data_dir, "feed", str(i))
        await asyncio.wait_for(done.wait(), 60)
        assert got == [(i, i) for i in range(20)]
        assert proxy.dropped > 0
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        proxy.close()
        await sp.stop()


def test_scry_urls_and_options_are_checked():
    assert scry.parse_url("udp://127.0.0.1:7413/chat") == ("127.0.0.1", 7413, "chat", None)
    assert scry.parse_url("udp://h:1/a/b/7", index=True) == ("h", 1, "a/b", 7)
    for bad in ("http://h:1/chat", "udp://h/chat", "udp://h:0/chat"):
        with contextlib.suppress(scry.ScryError):
            scry.parse_url(bad)
            raise AssertionError(bad)
    assert isinstance(scry.poll_model("fixed:1.5"), FixedPoll)
    with contextlib.suppress(scry.ScryError):
        scry.poll_model("sometimes")
        raise AssertionError("a bad poll schedule was accepted")
