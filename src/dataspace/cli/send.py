"""``dataspace send VALUE``: send messages to a server's observers."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ..values import ParseError, Value, key, parse, stringify
from ._client import (
    CONNECTION_HELP,
    add_connection_args,
    open_dataspace,
    parse_value,
    stop_event,
    through_caveats,
    warn_dropped,
)
from ._json import to_json
from ._template import Template, TemplateError

PROG = "dataspace send"

BATCH = 1000
"""Messages per turn when many are sent at once (--count, a long stdin)."""
MAX_WARNINGS = 10
"""Messages the caveats drop that are named on stderr (the rest are counted)."""

EXAMPLES = """\
examples:
  dataspace send '<Says "alice" "hello">'
  dataspace send '<Tick 1>' '<Tick 2>'            several, in order, in one turn
  printf '<Tick %s>\\n' 1 2 3 | dataspace send -   a value per line from stdin
  dataspace send --count 100 '<Tick $n>'          <Tick 1> ... <Tick 100>
  dataspace send --count 5 --interval 1 '<Beat $n>'   one a second
  dataspace send - --lines                        each line sent as it is typed
  tail -f events.pr | dataspace send - --lines    ... or as it is written
  dataspace send -v '<Says "alice" "hello">'      say what the server has had
  dataspace send --json '<Tick 1>'                the same as JSON, for jq

A message reaches the observers present when it arrives and is then gone; the
command exits once the server has processed it (-v then prints `sent VALUE` for
each on stderr; --json prints {"text", "value", "sent"} on stdout for each, with
"n" under --count).  With a capability whose caveats drop a VALUE, the server
ignores it: the command says so and exits with status 1 (the rest is sent).

--count N sends the VALUEs (and the lines of -) N times, numbered from 1: the
symbol $n anywhere in a value (a field, an element, a dictionary's value) is the
number ($$n is the symbol $n itself); without --count, $n is just a symbol.  --interval pauses
between messages.  Ctrl-C stops: the command says how many of them went.

- reads standard input: all of it by default, then sends it in order (a line that
is not a value stops the command before anything is sent).  With --lines, each
line is sent as soon as it is read (a line that is not a value is reported and
skipped, and the exit status is then 1), until EOF (Ctrl-D) or Ctrl-C.

""" + CONNECTION_HELP


def register(sub: Any) -> None:
    p = sub.add_parser(
        "send",
        help="send messages to a server's observers",
        description="Send each VALUE (Preserves text) as a message to the server's dataspace.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("values", nargs="+", metavar="VALUE",
                   help="a value, e.g. '<Says \"alice\" \"hi\">', or - to read lines from stdin")
    p.add_argument("--count", type=int, metavar="N", default=None,
                   help="send the VALUEs N times; $n in a VALUE is the number, from 1")
    p.add_argument("--interval", type=float, metavar="SECONDS", default=0.0,
                   help="pause between messages (default 0)")
    p.add_argument("--lines", action="store_true",
                   help="with -: send each line of standard input as soon as it is read")
    p.add_argument("-v", "--verbose", dest="confirm", action="store_true",
                   help="print `sent VALUE` (stderr) for each value once the server has "
                   "processed it")
    p.add_argument("--json", action="store_true",
                   help="print {\"text\", \"value\", \"sent\"} (stdout) for each message once "
                   "the server has processed it")
    add_connection_args(p)
    p.set_defaults(func=run)


def _usage(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if args.count is not None and args.count < 1:
        return _usage(f"--count must be at least 1, not {args.count}")
    if not args.interval >= 0:
        return _usage(f"--interval must be 0 or more seconds, not {args.interval:g}")
    if args.lines:
        if "-" not in args.values:
            return _usage("--lines sends the lines of standard input: give - as a VALUE "
                          "(e.g. dataspace send - --lines)")
        if args.count is not None:
            return _usage("--count repeats the VALUEs given; with --lines each line is sent "
                          "once: drop one of them")
    vals: list[Any] = []  # values, templates (--count), and "-" for --lines
    for t in args.values:
        if t == "-":
            if args.lines:
                vals.append("-")
                continue
            if sys.stdin.isatty():
                print(f"{PROG}: reading values from the terminal, one per line; Ctrl-D sends "
                      "them (with --lines each is sent as it is typed)", file=sys.stderr,
                      flush=True)
            from_stdin = _read_stdin_values(sys.stdin.read())
            if from_stdin is None:
                return 2
            if args.count is not None:  # numbered too
                try:
                    from_stdin = [Template(v, {"n": 0}) for v in from_stdin]
                except TemplateError as e:
                    return _usage(f"standard input: {e}")
            vals += from_stdin
        elif args.count is not None:
            try:
                vals.append(Template(t, {"n": 0}))
            except TemplateError as e:
                hint = ("\n  values are Preserves text, e.g. '<Tick $n>' (quote it for your "
                        "shell)") if str(e).startswith("cannot read") else ""
                return _usage(f"{e}{hint}")
        else:
            v = parse_value(PROG, t)
            if v is None:
                return 2
            vals.append(v)
    return asyncio.run(Sender(args).run(vals))


def _read_stdin_values(text: str) -> list[Value] | None:
    """One value per (non-blank) line; an error names its line and column in the input."""
    vals = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            vals.append(parse(line))
        except ParseError as e:
            print(f"{PROG}: cannot read standard input, {_where(lineno, e)}: {e.reason}\n"
                  f"  one value per line, e.g. <Says \"alice\" \"hi\">", file=sys.stderr)
            return None
    return vals


def _where(lineno: int, e: ParseError) -> str:
    return f"line {lineno}" if e.column is None else f"line {lineno}, column {e.column}"


class Sender:
    """Sends, confirms (-v, --json) and counts."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ds: Any = None
        self.sent = 0
        self.dropped = 0
        self.failed = 0  # lines not read or not sent (--lines)
        self.stop = asyncio.Event()
        self.dropped_warned = 0
        self.rewrite_said = False

    async def run(self, vals: list[Any]) -> int:
        ds = self.ds = await open_dataspace(PROG, self.args)
        if ds is None:
            return 1
        self.stop = stop_event()
        try:
            if self.args.lines:
                await self._lines(vals)
            else:
                await self._all(vals)
        except (ConnectionError, TimeoutError) as e:
            print(f"{PROG}: {e}; the messages may not have been delivered", file=sys.stderr)
            return 1
        finally:
            await ds.close()
        total = self.sent + self.dropped
        if self.dropped:
            print(f"{PROG}: {self.dropped} of {total} message(s) dropped by the capability's "
                  "caveats", file=sys.stderr)
        if self.stop.is_set() and not self.args.lines:
            planned = self._planned(vals)
            print(f"{PROG}: interrupted: {self.sent} of {planned} message(s) sent",
                  file=sys.stderr)
            return 130
        return 1 if self.dropped or self.failed else 0

    def _planned(self, vals: list[Any]) -> int:
        return len(vals) * (self.args.count or 1)

    def _messages(self, vals: list[Any]) -> Iterator[tuple[int | None, Value]]:
        if self.args.count is None:
            for v in vals:
                yield None, v
            return
        for n in range(1, self.args.count + 1):
            for t in vals:
                yield n, t.fill((n,)) if isinstance(t, Template) else t

    # -- what to send --------------------------------------------------------------------

    def _admit(self, v: Value) -> bool:
        """Whether the capability's caveats let ``v`` through.  Said on stderr: each drop
        up to :data:`MAX_WARNINGS` (then only counted), the first rewrite."""
        out = through_caveats(self.ds, v)
        if out is None:
            if self.dropped_warned < MAX_WARNINGS:
                warn_dropped(PROG, self.ds, v, what="message")
            elif self.dropped_warned == MAX_WARNINGS:
                print(f"{PROG}: (more are dropped: counted, not shown)", file=sys.stderr)
            self.dropped_warned += 1
            return False
        if not self.rewrite_said and key(out) != key(v):
            warn_dropped(PROG, self.ds, v, what="message")
            self.rewrite_said = True
        return True

    async def _all(self, vals: list[Any]) -> None:
        """Every message in turns of :data:`BATCH` (one per turn with --interval), each
        turn confirmed once the server has it."""
        ds = self.ds
        batch: list[tuple[int | None, Value, bool]] = []
        interval = self.args.interval
        size = 1 if interval > 0 else BATCH
        first = True
        for n, v in self._messages(vals):
            if self.stop.is_set():
                break
            if interval > 0 and not first:
                await self._pause(interval)
                if self.stop.is_set():
                    break
            first = False
            batch.append((n, v, self._admit(v)))
            if len(batch) >= size:
                await self._flush(batch)
                batch = []
        if batch:
            await self._flush(batch)
        if ds.connected:
            await ds.sync()

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            pass

    async def _flush(self, batch: list[tuple[int | None, Value, bool]]) -> None:
        ds = self.ds
        if not ds.connected:
            why = f": {ds.lost}" if ds.lost else ""  # (the server's reason, if it gave one)
            raise ConnectionError(f"not connected to {ds.address}{why}")
        with ds.turn():
            for _n, v, ok in batch:
                if ok:
                    ds.send(v)
        await self._settle()
        for n, v, ok in batch:
            self._confirm(n, v, ok)

    async def _settle(self) -> None:
        """Wait until what was sent is processed by the server (a sync) when each message
        is to be confirmed, else until it is written (a drain)."""
        if self.args.confirm or self.args.json:
            await self.ds.sync()
        else:
            await self.ds.drain()

    def _confirm(self, n: int | None, v: Value, ok: bool) -> None:
        """Count a message sent (``ok``) or dropped by the caveats, and say so as asked."""
        if ok:
            self.sent += 1
        else:
            self.dropped += 1
        if self.args.json:
            obj: dict[str, Any] = {}
            if n is not None:
                obj["n"] = n
            obj["text"] = stringify(v)
            obj["value"] = to_json(v)
            obj["sent"] = ok
            if not ok:
                obj["reason"] = "dropped by the capability's caveats"
            print(json.dumps(obj, ensure_ascii=False), flush=True)
        elif self.args.confirm and ok:
            print(f"sent {stringify(v)}", file=sys.stderr, flush=True)

    # -- --lines -------------------------------------------------------------------------

    async def _lines(self, vals: list[Any]) -> None:
        ds = self.ds
        ds.on_disconnect.append(lambda: print(f"{PROG}: connection lost; reconnecting",
                                              file=sys.stderr, flush=True))
        ds.on_reconnect.append(lambda: print(f"{PROG}: reconnected", file=sys.stderr,
                                             flush=True))
        for v in vals:
            if isinstance(v, str):  # "-": standard input, line by line
                if not await self._stdin_lines():
                    return
            elif not self.stop.is_set():
                await self._one(v)

    async def _stdin_lines(self) -> bool:
        """Send each line of stdin as it is read: False if stopped (Ctrl-C) before EOF."""
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[str | None] = asyncio.Queue()

        def read() -> None:  # a thread: stdin may be a terminal, a pipe or a file
            try:
                for line in sys.stdin:
                    loop.call_soon_threadsafe(lines.put_nowait, line)
            except (OSError, ValueError, UnicodeDecodeError) as e:
                loop.call_soon_threadsafe(lines.put_nowait, f"\0{e}")
            loop.call_soon_threadsafe(lines.put_nowait, None)

        if sys.stdin.isatty():
            print(f"{PROG}: type one value per line, each is sent when you press Enter; "
                  "Ctrl-D or Ctrl-C ends", file=sys.stderr, flush=True)
        threading.Thread(target=read, name="stdin", daemon=True).start()
        stopper = asyncio.ensure_future(self.stop.wait())
        lineno = 0
        try:
            while True:
                getter = asyncio.ensure_future(lines.get())
                await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    return False
                line = getter.result()
                if line is None:
                    return True
                if line.startswith("\0"):
                    print(f"{PROG}: cannot read standard input: {line[1:]}", file=sys.stderr)
                    self.failed += 1
                    return True
                lineno += 1
                line = line.rstrip("\r\n")
                if not line.strip():
                    continue
                try:
                    v = parse(line)
                except ParseError as e:
                    col = "" if e.column is None else f" column {e.column}:"
                    print(f"{PROG}: line {lineno} not sent:{col} {e.reason} (one value per "
                          "line, e.g. <Says \"alice\" \"hi\">)", file=sys.stderr, flush=True)
                    self.failed += 1
                    continue
                await self._one(v, lineno)
        finally:
            stopper.cancel()

    async def _one(self, v: Value, lineno: int | None = None) -> None:
        """Send one message now (--lines), waiting a while for a lost connection."""
        ds = self.ds
        ok = self._admit(v)
        if ok and not ds.connected:
            try:
                await ds.wait_connected(timeout=10)
            except (TimeoutError, OSError, ConnectionError):
                what = f"line {lineno}" if lineno is not None else stringify(v)
                why = f" ({ds.lost})" if ds.lost else ""
                print(f"{PROG}: {what} not sent: not connected to the server{why}",
                      file=sys.stderr, flush=True)
                self.failed += 1
                return
        if ok:
            ds.send(v)
            await self._settle()
        self._confirm(None, v, ok)
