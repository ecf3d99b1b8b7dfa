"""The documentation's examples, run as written: docs/streams.md, docs/pipelines.md,
docs/spark.md (local mode), the README's "Streams and pipelines" section and
docs/broker.md's "Command-line tools".

Each document runs top to bottom in a fresh temporary directory (its working directory,
with the data directory ``data`` in it as ``$DATASPACE_DATA_DIR``), so a document's
examples build on each other as a reader's would:

* ``console`` blocks: each ``$ COMMAND`` runs in bash under a pseudo-terminal (stdout and
  stderr together, progress lines rendered as a terminal shows them) and its output is
  compared with the lines shown under it.  In the expected text ``...`` stands for any
  text (within a line or across lines); times, rates (``N msg/s``, ``N rows/s``, ``(N.Ns)``)
  and hashes (``#x"..."``) match any value, and runs of spaces any run of spaces.  A
  ``^C`` line presses Ctrl-C once the output above it has appeared (the command must then
  end by itself with the output below it).  A command shown without output must exit 0.
* ``sh`` blocks: each line is a command that must exit 0 (nothing is shown to compare).
* ``python`` blocks run in one namespace per document, in this process; ``>>>`` blocks
  are doctests (their printed values are compared, ``...`` as above).  ``DATA_DIR`` and
  ``data_dir`` (the data directory) and ``CKPT`` (a checkpoint directory) are defined, and
  the paths ``/tmp/demo`` and ``/tmp/shop`` stand for directories of the test's own.

An HTML comment right before a block says what the harness does with it instead:

* ``<!-- docs-test: skip: WHY -->`` -- not run (a server in the foreground, a command
  that runs for minutes ...); the reason is required;
* ``<!-- docs-test: file NAME -->`` -- the block is the file NAME (written, not run);
* ``<!-- docs-test: env K=V ... -->`` -- extra environment for the block's commands;
* ``<!-- docs-test: until-idle -->`` -- ``pipeline run`` commands get ``--until-idle``;
* ``<!-- docs-test: skip line N: WHY -->`` -- the block's N-th command is not run;
* ``<!-- docs-test: setup NAME -->`` (anywhere) -- the data a document assumes from
  another: ``orders`` (docs/pipelines.md's orders.py and its first appends), ``chat``
  (the README's chat message); or ``broker``: a ``dataspace serve`` (free loopback
  ports for its TCP and HTTP listeners, the document's data directory) for the commands
  after it, which find it through ``$DATASPACE_SERVER`` and ``$DATASPACE_HTTP``;
* ``<!-- docs-test: background -->`` -- each line of the ``sh`` block (a trailing ``&``
  dropped) runs in the background, as in another terminal, once it has printed its
  first line; it is stopped when the document ends.

Spark runs as the documents say: commands start their own JVM (local[*]); Python blocks
use the test run's shared session.
"""

from __future__ import annotations

import doctest
import fcntl
import logging
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
COMMAND_TIMEOUT = 180.0  # a Spark command starts its own JVM on a shared 2-core machine
BIN = os.path.dirname(sys.executable)
_TMP = re.compile(r"/tmp/(demo|shop)\b")  # the documents' own directories


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    text: str
    directives: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


_FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.S | re.M)
_DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->", re.S)


def blocks(doc: str, section: str | None = None, text: str | None = None) -> list[Block]:
    """The fenced blocks of ``doc`` (of one ``## section`` only, if given), each with the
    ``docs-test`` directives written since the block before it."""
    whole = text = (ROOT / doc).read_text() if text is None else text
    offset = 0
    if section is not None:
        start = text.index(f"\n## {section}\n")
        end = text.find("\n## ", start + 1)
        offset = start
        text = text[start:end if end != -1 else len(text)]
    out = []
    last = 0
    for m in _FENCE.finditer(text):
        directives = _DIRECTIVE.findall(text[last:m.start()])
        line = whole[:offset + m.start()].count("\n") + 1
        out.append(Block(doc, line, m.group(1), m.group(2), directives))
        last = m.end()
    trailing = _DIRECTIVE.findall(text[last:])
    if trailing:
        out.append(Block(doc, 0, "", "", trailing))
    return out


# -- comparing output -------------------------------------------------------------------------

_TOKENS = re.compile(
    r"(?P<ellipsis>\.\.\.)"
    r"|(?P<time>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:\.\d+)?)"
    r"|(?P<rate>[\d,.]+(?= (?:msg|rows)/s))"
    r"|(?P<seconds>\(\d+(?:\.\d+)?s\))"
    r'|(?P<hash>#x"[0-9a-f]+")'
    r"|(?P<spaces> {2,})"
)
_PATTERNS = {
    "ellipsis": r".*?",
    "time": r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:\.\d+)?",
    "rate": r"[\d,.]+",
    "seconds": r"\(\d+(?:\.\d+)?s\)",
    "hash": r'#x"[0-9a-f]+"',
    "spaces": r" +",
}


def pattern(expected: str) -> re.Pattern[str]:
    """The regular expression for an expected output (see the module docstring)."""
    out, pos = [], 0
    for m in _TOKENS.finditer(expected):
        out.append(re.escape(expected[pos:m.start()]))
        out.append(_PATTERNS[m.lastgroup or ""])
        pos = m.end()
    out.append(re.escape(expected[pos:]))
    return re.compile("".join(out), re.S)


def render(raw: str) -> str:
    """What a terminal shows for ``raw``: a carriage return rewrites its line."""
    lines = [x.rsplit("\r", 1)[-1].rstrip() for x in raw.replace("\r\n", "\n").split("\n")]
    return "\n".join(lines).strip("\n")


def _norm(text: str) -> str:
    return "\n".join(x.rstrip() for x in text.splitlines()).strip("\n")


# -- running commands ----------------------------------------------------------------------


class Terminal:
    """One command in bash under a pseudo-terminal of its own, in a new session: what a
    user at a terminal would see.  (No preexec_fn to make it the controlling terminal:
    that is unsafe in a process with threads, Spark's among them; Ctrl-C is sent to the
    session's process group as the terminal would.)"""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 400, 0, 0))
        self.master = master
        self.proc = subprocess.Popen(
            ["bash", "-c", command], cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave,
            start_new_session=True, close_fds=True)
        os.close(slave)
        self.raw = ""
        self.cond = threading.Condition()
        self.eof = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every process holding the terminal has ended
                data = b""
            with self.cond:
                if not data:
                    self.eof = True
                    self.cond.notify_all()
                    return
                buf += data
                self.raw = buf.decode("utf-8", errors="replace")
                self.cond.notify_all()

    def shown(self) -> str:
        with self.cond:
            return render(self.raw)

    def wait_for(self, expected: re.Pattern[str], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(
                lambda: bool(expected.fullmatch(render(self.raw))) or self.eof, timeout) and \
                bool(expected.fullmatch(render(self.raw)))

    def interrupt(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)  # what Ctrl-C at the terminal sends

    def finish(self, timeout: float) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        with self.cond:
            self.cond.wait_for(lambda: self.eof, timeout)
        return code, self.shown()

    def kill(self) -> None:
        """Whatever is left of the command goes (its whole session), and the terminal."""
        if self.proc.poll() is None:  # still ours: its group cannot have been reused
            with _suppress():
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(COMMAND_TIMEOUT)
        self.reader.join(10.0)
        if self.master >= 0:
            os.close(self.master)
            self.master = -1


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)  # type: ignore[arg-type]


@dataclass
class Command:
    text: str
    expected: str  # the lines shown under it
    block: Block


def commands(b: Block) -> list[Command]:
    """The ``$ `` commands of a console block with the output shown under each."""
    out: list[Command] = []
    for line in b.text.splitlines():
        if line.startswith("$ "):
            out.append(Command(line[2:], "", b))
        elif out:
            out[-1].expected += line + "\n"
    return out


# -- the documents -------------------------------------------------------------------------


class Reader:
    """Runs one document's blocks in order (see the module docstring)."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.work = tmp / "work"
        self.data = self.work / "data"
        self.tmp = tmp
        self.work.mkdir()
        monkeypatch.chdir(self.work)
        monkeypatch.setenv("DATASPACE_DATA_DIR", str(self.data))
        self.env = {**os.environ, "DATASPACE_DATA_DIR": str(self.data),
                    "PATH": BIN + os.pathsep + os.environ.get("PATH", ""),
                    "PYTHONUNBUFFERED": "1", "TERM": "dumb"}
        self.ns: dict[str, object] = {
            "__name__": "__docs__", "DATA_DIR": str(self.data), "data_dir": str(self.data),
            "CKPT": str(tmp / "checkpoint"),
        }
        self.ran = 0
        self.timeout = COMMAND_TIMEOUT
        self.background: list[Background] = []

    def close(self) -> None:
        """Stop what runs in the background (a server last)."""
        for bg in reversed(self.background):
            bg.stop()
        self.background.clear()

    def start(self, line: str, env: dict[str, str], ready: str = "") -> Background:
        """``line`` in the background, once it has printed a line (containing
        ``ready``)."""
        bg = Background(self.paths(line), self.work, {**self.env, **env})
        self.background.append(bg)
        if not bg.wait_for(ready, self.timeout):
            raise AssertionError(f"`{line}` in the background printed no line"
                                 f"{' with ' + repr(ready) if ready else ''}:\n{bg.output()}")
        return bg

    def paths(self, text: str) -> str:
        return _TMP.sub(lambda m: str(self.tmp / m.group(1)), text)

    def run(self, bs: list[Block]) -> None:
        for b in bs:
            env: dict[str, str] = {}
            skip = until_idle = background = False
            skip_lines: set[int] = set()
            for d in b.directives:
                word, _, rest = d.partition(" ")
                line_skip = re.fullmatch(r"skip line (\d+):\s*(.*)", d, re.S)
                if d.startswith("skip:"):
                    assert d[5:].strip(), f"{b.where}: a skip needs a reason"
                    skip = True
                elif line_skip:
                    assert line_skip.group(2), f"{b.where}: a skip needs a reason"
                    skip_lines.add(int(line_skip.group(1)))
                elif word == "file":
                    (self.work / rest.strip()).write_text(b.text)
                    skip = True
                elif word == "env":
                    env.update(kv.split("=", 1) for kv in rest.split())
                elif word == "until-idle":
                    until_idle = True
                elif word == "background":
                    background = True
                elif word == "setup":
                    SETUPS[rest.strip()](self)
                else:
                    raise AssertionError(f"{b.where}: unknown docs-test directive {d!r}")
            if skip or not b.text:
                continue
            t0 = time.monotonic()
            if b.lang == "console":
                for c in commands(b):
                    self.console(c, env)
            elif b.lang == "sh":
                lines = [x.split("  #", 1)[0].strip() for x in b.text.splitlines()]
                lines = [x for x in lines if x and not x.startswith("#")]
                for n, line in enumerate(lines, 1):
                    if n in skip_lines:
                        continue
                    if until_idle and line.startswith("dataspace pipeline run"):
                        line += " --until-idle"
                    if background:
                        self.start(line.removesuffix("&").strip(), env)
                    else:
                        self.command(line, b, env)
            elif b.lang == "python":
                self.python(b)
            else:
                continue
            self.ran += 1
            log.info("%s: %s block in %.1fs", b.where, b.lang, time.monotonic() - t0)

    def command(self, line: str, b: Block, env: dict[str, str]) -> str:
        t = Terminal(self.paths(line), self.work, {**self.env, **env})
        try:
            code, shown = t.finish(self.timeout)
        finally:
            t.kill()
        assert code == 0, f"{b.where}: `{line}` exited with {code}:\n{shown}"
        return shown

    def console(self, c: Command, env: dict[str, str]) -> None:
        expected = _norm(c.expected)
        if not expected:
            self.command(c.text, c.block, env)
            return
        before, ctrl_c, after = expected.partition("\n^C")
        t = Terminal(self.paths(c.text), self.work, {**self.env, **env})
        try:
            if ctrl_c:
                if not t.wait_for(pattern(before), self.timeout):
                    pytest.fail(f"{c.block.where}: `{c.text}` did not show, before Ctrl-C:\n"
                                f"{before}\n--- it showed:\n{t.shown()}")
                t.interrupt()
                expected = before + after
            code, shown = t.finish(self.timeout)
        finally:
            t.kill()
        if not pattern(expected).fullmatch(shown):
            pytest.fail(f"{c.block.where}: `{c.text}` (exit {code}) showed:\n{shown}\n"
                        f"--- the documentation says:\n{expected}")
        if ctrl_c:
            assert code == 0, f"{c.block.where}: `{c.text}` exited with {code} after Ctrl-C"

    def python(self, b: Block) -> None:
        code = self.paths(b.text)
        if ">>> " in code:
            test = doctest.DocTestParser().get_doctest(code, self.ns, b.where, b.doc, b.line - 1)
            test.globs = self.ns  # one namespace for the document
            out: list[str] = []
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            runner.run(test, out=out.append, clear_globs=False)
            assert not runner.failures, "".join(out)
        else:
            exec(compile(code, b.where, "exec"), self.ns)


class Background:
    """A command running beside the document's commands (its output collected)."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            ["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.ended = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.ended = True
            self.cond.notify_all()

    def wait_for(self, text: str, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(
                lambda: any(text in x for x in self.lines) or self.ended, timeout) and \
                any(text in x for x in self.lines)

    def output(self) -> str:
        with self.cond:
            return "\n".join(self.lines)

    def stop(self) -> None:
        """SIGINT, as Ctrl-C in its terminal; SIGKILL if that does not end it."""
        if self.proc.poll() is None:
            with _suppress():
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with _suppress():
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(COMMAND_TIMEOUT)
        self.reader.join(10.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _setup_broker(r: Reader) -> None:
    srv = r.start("dataspace serve --tcp 127.0.0.1:0 --http 127.0.0.1:0", {},
                  ready="Ctrl-C stops the server")
    out = srv.output()
    tcp = re.search(r"listening on (127\.0\.0\.1:\d+)", out)
    http = re.search(r"HTTP on (http://127\.0\.0\.1:\d+/)", out)
    assert tcp and http, out
    r.env["DATASPACE_SERVER"] = tcp.group(1)
    r.env["DATASPACE_HTTP"] = http.group(1)


def _setup_orders(r: Reader) -> None:
    graph = next(b for b in blocks("docs/pipelines.md") if "file orders.py" in b.directives)
    (r.work / "orders.py").write_text(graph.text)
    appends = [c for b in blocks("docs/pipelines.md") if b.lang == "console"
               for c in commands(b) if c.text.startswith("dataspace stream append")][:2]
    assert len(appends) == 2
    for c in appends:
        r.command(c.text, c.block, {})


def _setup_chat(r: Reader) -> None:
    r.command("""dataspace stream append chat '<Says "alice" "hi">' '<Says "bob" "yo">'""",
              Block("setup", 0, "sh", ""), {})


SETUPS = {"orders": _setup_orders, "chat": _setup_chat, "broker": _setup_broker}


def _run(doc: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, section: str | None = None) -> None:
    r = Reader(tmp_path, monkeypatch)
    try:
        r.run(blocks(doc, section))
    finally:
        r.close()
    assert r.ran, f"{doc}: no example ran"


def test_streams_md(tmp_path, monkeypatch):
    _run("docs/streams.md", tmp_path, monkeypatch)


@pytest.mark.timeout(900)  # a Spark command with its own JVM
def test_pipelines_md(spark_jvm_archive, tmp_path, monkeypatch):
    _run("docs/pipelines.md", tmp_path, monkeypatch)


@pytest.mark.timeout(900)  # two Spark commands with their own JVMs, Spark queries in this one
def test_spark_md(spark, tmp_path, monkeypatch):
    _run("docs/spark.md", tmp_path, monkeypatch)


def test_readme_streams_and_pipelines(tmp_path, monkeypatch):
    _run("README.md", tmp_path, monkeypatch, section="Streams and pipelines")


def test_broker_md_command_line_tools(tmp_path, monkeypatch):
    _run("docs/broker.md", tmp_path, monkeypatch, section="Command-line tools")


# -- the harness itself ----------------------------------------------------------------------


def test_expected_output_patterns():
    p = pattern("store .../streams.sqlite3)\nchat  2  2026-11-21 10:06:16  | 7 msg/s (16.2s)")
    assert p.fullmatch("store /tmp/x/y/streams.sqlite3)\nchat   2  2024-01-02 03:04:05  "
                       "| 1,234 msg/s (3.0s)")
    assert not p.fullmatch("store /x/streams.sqlite3)\nchat  3  2026-11-21 10:06:16  | 7 msg/s (1s)")
    assert render("a\r\nprogress 1\rprogress 22   \rprogress 3  \r\nend\r\n") == "a\nprogress 3\nend"


def test_every_skip_says_why():
    for doc in ("docs/streams.md", "docs/pipelines.md", "docs/spark.md", "README.md",
                "docs/broker.md"):
        for b in blocks(doc):
            for d in b.directives:
                if d.startswith("skip"):
                    why = re.fullmatch(r"skip(?: line \d+)?:\s*(.{10,})", d, re.S)
                    assert why, f"{b.where}: {d!r}"


def test_a_wrong_example_fails(tmp_path, monkeypatch):
    """The harness does compare: a wrong output, a wrong value, a wrong exit fail it."""
    r = Reader(tmp_path, monkeypatch)
    r.timeout = 3.0
    for wrong in (
        "```console\n$ dataspace stream append chat 1 2\nappended 3 to chat (indices 0..1)\n```\n",
        "```console\n$ dataspace stream tail chat -f\n0  1\n1  7\n^C\n```\n",
        "```console\n$ dataspace stream tail nothing-here\n```\n",
        "```python\n>>> 1 + 1\n3\n```\n",
    ):
        with pytest.raises((pytest.fail.Exception, AssertionError)):
            r.run(blocks("test.md", text=wrong))
    right = "```console\n$ dataspace stream tail chat -f\n0  1\n1  2\n^C\n```\n"
    r.run(blocks("test.md", text=right))
