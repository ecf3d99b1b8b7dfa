"""``dataspace reply PATTERN --with TEMPLATE``: answer requests from the command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

from ..pattern import Pattern, PatternError, instantiate, parse_pattern
from ..values import ParseError, Value, parse, stringify
from ._client import (
    CONNECTION_HELP,
    add_connection_args,
    check_subscription,
    open_dataspace,
    stop_event,
    through_caveats,
)
from ._json import to_json
from ._template import Template, TemplateError, as_text_arg, capture_slots
from .observe import _embedded_text

PROG = "dataspace reply"

MAX_QUEUED = 1000
"""Requests waiting for --command, at most (more are dropped, and counted)."""
MAX_OUTPUT = 1 << 20
"""Bytes of a --command's output read, at most (more: no reply)."""

EXAMPLES = """\
examples:
  dataspace reply '<Ask "time" $id>' --with '<Answer $id "12:00">'
  dataspace reply '<Time $id>' --command date --with '<Answer $id $stdout>'
  dataspace reply '<Add $a $b>' \\
      --command 'echo "<Sum $((DATASPACE_a + DATASPACE_b))>"'
  dataspace reply '<Ping $from>' --with '<Pong $from "here">' --count 1
  dataspace request '<Ask "time" 7>' --reply '<Answer 7 $t>'    a requester

A responder (like `nats reply`): each message matching PATTERN is a request,
answered with a message -- the reply -- made from it, until Ctrl-C (or --count N
requests).  If the server goes away the command reconnects (saying so on stderr)
and answers again once it is back.

--with TEMPLATE: the reply is TEMPLATE, a value in which $NAME is filled with the
capture of that name in PATTERN, and $1, $2 ... with the captures by position
($$x is the symbol $x).  The requester's --reply pattern must match the reply:
put the request's id in both.

--command CMD: run CMD with the shell for each request, one at a time, in order.
It reads the request (Preserves text, one line) on stdin; its environment has
DATASPACE_REQUEST (the same text) and each capture as DATASPACE_1, DATASPACE_2
... and, when named, as DATASPACE_NAME (a string as its characters, any other
value as Preserves text).  Without --with, what it prints is the reply: a value
per line (several lines, several replies; nothing, no reply).  With --with,
$stdout in TEMPLATE is what it printed, as a string (trailing newlines dropped).
A command that fails (exit status not 0) or runs longer than --command-timeout
sends no reply; the command says so on stderr.

output: a line per request, `REQUEST -> REPLY` (REQUEST is PATTERN filled with
the captures: a _ of PATTERN stays _); --quiet: nothing; --json: an object per
line, {"time", "request", "values", "replies"} (request: its text; values: the
captures in JSON, as `observe --json` gives them; replies: the replies' texts;
and "error", why there is none, when the command failed).

""" + CONNECTION_HELP


def register(sub: Any) -> None:
    p = sub.add_parser(
        "reply",
        help="answer requests: reply to each message matching a pattern",
        description="Observe PATTERN and answer each matching message (a request) with a "
        "reply made from its captures (--with TEMPLATE) or printed by a shell command run "
        "for it (--command CMD), until Ctrl-C; the responder side of `dataspace request`.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("pattern", metavar="PATTERN",
                   help="the requests to answer, e.g. '<Ask \"time\" $id>'")
    p.add_argument("--with", dest="template", metavar="TEMPLATE",
                   help="the reply, with $NAME / $1 for the request's captures, e.g. "
                   "'<Answer $id \"12:00\">'")
    p.add_argument("--command", metavar="CMD",
                   help="a shell command run per request: its output is the reply (or "
                   "$stdout in --with)")
    p.add_argument("--command-timeout", type=float, metavar="SECONDS", default=10.0,
                   help="how long --command may run for one request (default 10)")
    p.add_argument("--count", type=int, metavar="N", default=None,
                   help="exit after N requests, answered or not (default: run until Ctrl-C)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true",
                     help="one JSON object per request: {\"time\", \"request\", \"values\", "
                     "\"replies\"}")
    out.add_argument("-q", "--quiet", action="store_true",
                     help="print nothing per request")
    add_connection_args(p)
    p.set_defaults(func=run)


def _usage(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        pattern = parse_pattern(args.pattern)
    except PatternError as e:
        return _usage(f"{e}\n  e.g. dataspace reply '<Ask \"time\" $id>' --with "
                      "'<Answer $id \"12:00\">'")
    if args.template is None and args.command is None:
        return _usage("say how to answer: --with TEMPLATE (e.g. --with '<Answer $id "
                      "\"12:00\">') or --command CMD (its output is the reply)")
    if args.count is not None and args.count < 1:
        return _usage(f"--count must be at least 1, not {args.count} (leave it out to answer "
                      "until Ctrl-C)")
    if not args.command_timeout > 0:
        return _usage(f"--command-timeout must be more than 0 seconds, not "
                      f"{args.command_timeout:g}")
    template = None
    if args.template is not None:
        slots = capture_slots(pattern.binding_names())
        if args.command is not None:
            if "stdout" in slots:
                return _usage("PATTERN names a capture $stdout, which --with would take for "
                              "the command's output: rename the capture")
            slots["stdout"] = len(pattern.binding_names())
        try:
            template = Template(args.template, slots, what="--with")
        except TemplateError as e:
            return _usage(str(e))
    return asyncio.run(Responder(args, pattern, template).run())


class Responder:
    """The command's state: the subscription, the queue of requests for --command, and
    what it has answered."""

    def __init__(self, args: argparse.Namespace, pattern: Pattern,
                 template: Template | None) -> None:
        self.args = args
        self.pattern = pattern
        self.template = template
        self.names = pattern.binding_names()
        self.handled = 0
        self.answered = 0
        self.failed = 0
        self.queue_dropped = 0
        self.caveat_dropped = 0
        self.not_connected = 0
        self.stop = asyncio.Event()
        self.queue: asyncio.Queue[tuple[Value, ...]] = asyncio.Queue(MAX_QUEUED)
        self.ds: Any = None

    async def run(self) -> int:
        ds = self.ds = await open_dataspace(PROG, self.args)
        if ds is None:
            return 1
        if not check_subscription(PROG, ds, self.pattern):
            await ds.close()
            return 1
        self.stop = stop_event()
        worker = None
        if self.args.command is not None:
            worker = asyncio.ensure_future(self._work())
        ds.observe(self.pattern, on_message=self._request)
        ds.on_disconnect.append(lambda: _say("connection lost; reconnecting"))
        ds.on_reconnect.append(lambda: _say("reconnected; answering again"))
        try:
            await ds.sync()
        except (ConnectionError, TimeoutError) as e:
            _say(str(e))
        else:
            _say(f"answering {self.pattern}; Ctrl-C stops")
        ended = asyncio.ensure_future(ds.wait_closed())
        waiter = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({ended, waiter}, return_when=asyncio.FIRST_COMPLETED)
        ended.cancel()
        waiter.cancel()
        if worker is not None:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        if ds.connected:
            with contextlib.suppress(ConnectionError, TimeoutError):
                await ds.sync(timeout=5)  # the last replies reach the server
        await ds.close()
        self._summary()
        if ds.error is not None:
            _say(str(ds.error))
            return 1
        return 0

    def _summary(self) -> None:
        if self.queue_dropped:
            _say(f"{self.queue_dropped} request(s) dropped unanswered: more than {MAX_QUEUED} "
                 "were waiting for the command")
        if self.caveat_dropped:
            _say(f"{self.caveat_dropped} repl(ies) dropped by the capability's caveats")

    # -- requests ------------------------------------------------------------------------

    def _request(self, *caps: Value) -> None:
        if self.stop.is_set():
            return
        if self.args.command is None:
            assert self.template is not None
            self._answer(caps, [self.template.fill(caps)])
            return
        try:
            self.queue.put_nowait(caps)
        except asyncio.QueueFull:
            if not self.queue_dropped:
                _say(f"more than {MAX_QUEUED} requests wait for the command: dropping "
                     "requests unanswered until it catches up")
            self.queue_dropped += 1

    async def _work(self) -> None:
        while True:
            caps = await self.queue.get()
            replies = await self._run_command(caps)
            if self.stop.is_set():
                return
            if replies is not None:
                self._answer(caps, replies)
            else:
                self._handled()

    def _request_text(self, caps: tuple[Value, ...]) -> str:
        return stringify(instantiate(self.pattern, caps), embedded=_embedded_text)

    def _answer(self, caps: tuple[Value, ...], replies: list[Value]) -> None:
        ds = self.ds
        sent: list[Value] = []
        for r in replies:
            if through_caveats(ds, r) is None:
                if not self.caveat_dropped:
                    _say(f"the capability's caveats drop the reply {_short(r)}: the server "
                         "will ignore it (see `dataspace cap show` for the caveats)")
                self.caveat_dropped += 1
                continue
            if not ds.connected:
                self.not_connected += 1
                _say(f"not connected: the reply {_short(r)} is not sent")
                continue
            ds.send(r)
            sent.append(r)
        self._print(caps, sent)
        self.answered += 1
        self._handled()

    def _handled(self) -> None:
        self.handled += 1
        if self.args.count is not None and self.handled >= self.args.count:
            self.stop.set()

    def _print(self, caps: tuple[Value, ...], sent: list[Value],
               error: str | None = None) -> None:
        if self.args.quiet:
            return
        request = self._request_text(caps)
        texts = [stringify(r, embedded=_embedded_text) for r in sent]
        if self.args.json:
            obj: dict[str, Any] = {"time": round(time.time(), 6), "request": request,
                                   "values": [to_json(c, _embedded_text) for c in caps],
                                   "replies": texts}
            if error is not None:
                obj["error"] = error
            line = json.dumps(obj, ensure_ascii=False)
        else:
            line = f"{request} -> {', '.join(texts) if texts else '(no reply)'}"
        try:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            self.stop.set()

    # -- --command -----------------------------------------------------------------------

    def _env(self, caps: tuple[Value, ...], request: str) -> dict[str, str]:
        env = dict(os.environ)
        env["DATASPACE_REQUEST"] = request
        for i, c in enumerate(caps, 1):
            env[f"DATASPACE_{i}"] = as_text_arg(c)
        for name, c in zip(self.names, caps):
            if name and name.isidentifier() and name.isascii():
                env[f"DATASPACE_{name}"] = as_text_arg(c)
        return env

    async def _run_command(self, caps: tuple[Value, ...]) -> list[Value] | None:
        """Run --command for one request: the replies it makes, or None (said why)."""
        request = self._request_text(caps)
        timeout = self.args.command_timeout
        try:
            proc = await asyncio.create_subprocess_shell(
                self.args.command, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env=self._env(caps, request),
                start_new_session=True)  # Ctrl-C is ours: we end the command
        except OSError as e:
            return self._fail(caps, request, f"cannot run the command: {e}")
        try:
            out = await asyncio.wait_for(_communicate(proc, (request + "\n").encode()), timeout)
        except TimeoutError:
            _kill(proc)
            await proc.wait()
            return self._fail(caps, request, f"the command ran longer than {timeout:g} s "
                              "(--command-timeout) and was stopped")
        except BaseException:
            _kill(proc)
            with contextlib.suppress(asyncio.CancelledError, ProcessLookupError):
                await asyncio.shield(proc.wait())
            raise
        if out is None:
            _kill(proc)
            await proc.wait()
            return self._fail(caps, request,
                              f"the command printed more than {MAX_OUTPUT:,} bytes")
        if proc.returncode != 0:
            status = (f"was killed by signal {-proc.returncode}" if proc.returncode < 0
                      else f"exited with status {proc.returncode}")
            return self._fail(caps, request, f"the command {status}")
        try:
            text = out.decode("utf-8")
        except UnicodeDecodeError:
            return self._fail(caps, request, "the command's output is not UTF-8 text")
        if self.template is not None:
            return [self.template.fill((*caps, text.rstrip("\n")))]
        replies = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                replies.append(parse(line))
            except ParseError as e:
                return self._fail(caps, request,
                                  f"line {n} of the command's output is not a value ({e}); "
                                  "print Preserves text such as <Answer 7 \"x\">, or use "
                                  "--with '<Answer $1 $stdout>' to send it as a string")
        if not replies:
            return self._fail(caps, request, "the command printed nothing")
        return replies

    def _fail(self, caps: tuple[Value, ...], request: str, why: str) -> None:
        """Say why ``request`` gets no reply (stderr; with --json an object on stdout
        too, with ``error``)."""
        self.failed += 1
        _say(f"{_cut(request)}: {why}; no reply sent")
        if self.args.json:
            self._print(caps, [], error=why)
        return None


async def _communicate(proc: asyncio.subprocess.Process, data: bytes) -> bytes | None:
    """Write ``data`` to the process's stdin while reading its stdout to the end (None
    when it prints more than :data:`MAX_OUTPUT` bytes); then wait for it to exit."""
    assert proc.stdin is not None and proc.stdout is not None

    async def feed() -> None:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(data)
            await proc.stdin.drain()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.close()

    writer = asyncio.ensure_future(feed())
    chunks: list[bytes] = []
    size = 0
    try:
        while True:
            chunk = await proc.stdout.read(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_OUTPUT:
                return None
            chunks.append(chunk)
        await proc.wait()
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
    return b"".join(chunks)


def _kill(proc: asyncio.subprocess.Process) -> None:
    """End the command and whatever it started (its own session: a process group)."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _say(line: str) -> None:
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def _cut(text: str, n: int = 120) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _short(v: Value) -> str:
    return _cut(stringify(v, embedded=_embedded_text))
