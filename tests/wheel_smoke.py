"""The wheel as a user gets it: installed without extras into a fresh virtual environment,
then used as the broker alone (`make wheel-test`; CI runs it after `make test`).

    python tests/wheel_smoke.py [dist/dataspace-*.whl] [--keep]

Makes a virtual environment in a temporary directory, installs the wheel into it with pip
(no extras: no PySpark, PyArrow, pandas, NumPy or psycopg), and then, from outside the
source tree and through that environment's own ``dataspace`` and ``python``:

* the environment holds the broker only, and ``import dataspace`` loads the installed copy;
* ``dataspace --version`` says the core runs compiled, with no compiler on the PATH
  (unless ``DATASPACE_EXPECT_COMPILED=0``);
* every command's ``--help`` renders without importing an extra;
* ``dataspace serve`` on free loopback ports (TCP and HTTP: the inspector's page is in
  the wheel), ``assert`` / ``observe`` / ``send`` round trips through it;
* a local pipeline over an SQLite store (``stream append``, ``pipeline run --engine
  local``, ``stream read``);
* the missing extras: the Spark engine, the class-data warm-up, a ``postgresql://`` store
  (``stream ls``, ``serve``) each say so in one line with the command that installs it,
  exit status 2.

Each check prints ``ok`` or ``FAIL`` with what it ran and saw; the last line is
``smoke: N passed, M failed`` and the exit status is 1 when one failed.  Every process
and wait is bounded (about a minute in all after the install).
"""

from __future__ import annotations

import argparse
import glob
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRA_MODULES = ("pyspark", "pyarrow", "pandas", "numpy", "psycopg", "psycopg_pool")
TIMEOUT = 60.0  # seconds for any one command or wait
PG_URL = "postgresql://smoke@127.0.0.1:9/smoke"  # never reached: the extra is missing first
GRAPH = '''\
from dataspace.pipeline import Graph

graph = Graph("shout")
graph.source("words")


@graph.map("upper", "words", "shouts")
def upper(v):
    return v.upper()
'''
HELP_EVERY_COMMAND = """\
import argparse
from dataspace.cli import build_parser
n = 0
def walk(p):
    global n
    p.format_help(); n += 1
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sp in {id(s): s for s in a.choices.values()}.values():
                walk(sp)
walk(build_parser())
"""
"""Python that renders every command's and subcommand's --help, counting them in ``n``
(tests/test_extras.py runs it too, with the extras refused)."""


class Failed(AssertionError):
    """A check's failure: the message says what was run and what came back."""


class Env:
    """The fresh environment and the commands run in it."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.venv = base / "venv"
        self.bin = self.venv / "bin"
        self.python = str(self.bin / "python")
        self.work = base / "work"  # the commands' working directory: no source tree here
        self.work.mkdir()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("DATASPACE_", "PYTHON", "VIRTUAL_ENV", "PYSPARK", "SPARK_"))}
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env["HOME"] = str(base / "home")  # the default data directory, if one is used
        env["PYTHONUNBUFFERED"] = "1"
        self.env = env

    def run(self, *args: str, env: dict[str, str] | None = None,
            timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
        exe = str(self.bin / args[0]) if (self.bin / args[0]).exists() else args[0]
        try:
            return subprocess.run([exe, *args[1:]], cwd=self.work, env=env or self.env,
                                  capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise Failed(f"`{' '.join(args)}` did not finish in {timeout:g}s "
                         f"(stdout {e.stdout!r}, stderr {e.stderr!r})") from None

    def dataspace(self, *args: str, env: dict[str, str] | None = None
                  ) -> subprocess.CompletedProcess[str]:
        return self.run("dataspace", *args, env=env)

    def start(self, *args: str) -> Process:
        return Process([str(self.bin / args[0]), *args[1:]], cwd=self.work, env=self.env)


class Process:
    """A long-running command whose output lines are read as they come (bounded waits)."""

    def __init__(self, argv: list[str], *, cwd: Path, env: dict[str, str]) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self.seen: list[str] = []
        for name, stream in (("out", self.proc.stdout), ("err", self.proc.stderr)):
            threading.Thread(target=self._read, args=(name, stream), daemon=True).start()

    def _read(self, name: str, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.lines.put((name, line.rstrip("\n")))
        self.lines.put((name, None))

    def wait_for(self, pattern: str, timeout: float = TIMEOUT) -> re.Match[str]:
        """The first new line (either stream) matching ``pattern``."""
        deadline = time.monotonic() + timeout
        ended = 0
        while ended < 2:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                _, line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                ended += 1
                continue
            self.seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise Failed(f"`{' '.join(self.argv[-3:])}`: no line matching {pattern!r} in "
                     f"{timeout:g}s (exit {self.proc.poll()}); it said: {self.seen[-8:]}")

    def stop(self) -> int | None:
        """Ctrl-C, then a kill if it has not gone in 10 s; the exit status."""
        for sig in (signal.SIGINT, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(10)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        return self.proc.returncode


def expect(cond: bool, what: str, r: subprocess.CompletedProcess[str] | None = None) -> None:
    if not cond:
        if r is not None:
            what += (f"\n    command: {' '.join(map(str, r.args))}\n    exit {r.returncode}"
                     f"\n    stdout: {r.stdout[-1500:]!r}\n    stderr: {r.stderr[-1500:]!r}")
        raise Failed(what)


def expect_missing_extra(r: subprocess.CompletedProcess[str], prog: str, extra: str) -> None:
    """Exit status 2 and one line on stderr: ``PROG: ... pip install 'dataspace[EXTRA]'``."""
    lines = r.stderr.strip().splitlines()
    expect(r.returncode == 2, f"exit status 2 for a missing {extra} extra", r)
    expect(len(lines) == 1 and lines[0].startswith(f"{prog}: ")
           and f"pip install 'dataspace[{extra}]'" in lines[0],
           f"one line '{prog}: ... pip install 'dataspace[{extra}]'' on stderr", r)


# -- the checks ----------------------------------------------------------------------------


def check_broker_only(e: Env) -> str:
    code = ("import importlib.util, dataspace; "
            f"print(dataspace.__file__); print(*(m for m in {EXTRA_MODULES!r} "
            "if importlib.util.find_spec(m)))")
    r = e.run("python", "-c", code)
    expect(r.returncode == 0, "import dataspace", r)
    where, extras = [*r.stdout.splitlines(), "", ""][:2]
    expect(where.startswith(str(e.venv)), f"dataspace imported from the wheel's install "
           f"in {e.venv}, not {where}", r)
    expect(not extras.strip(), f"no extra installed (found: {extras})", r)
    return f"dataspace from the environment; none of {', '.join(EXTRA_MODULES)}"


def check_version(e: Env) -> str:
    # No compiler on the PATH: the wheel's compiled core runs as built.
    env = dict(e.env, PATH=str(e.bin))
    r = e.dataspace("--version", env=env)
    expect(r.returncode == 0 and r.stdout.startswith("dataspace "), "dataspace --version", r)
    line = " ".join(r.stdout.split())
    if os.environ.get("DATASPACE_EXPECT_COMPILED", "1") != "0":
        expect("(compiled: " in line, "the wheel's core runs compiled (set "
               "DATASPACE_EXPECT_COMPILED=0 where no C compiler built it)", r)
    return line


def check_help(e: Env) -> str:
    code = ("import sys\n" + HELP_EVERY_COMMAND
            + 'loaded = [m for m in sys.modules if m.split(".")[0] in sys.argv[1].split(",")]\n'
            "print(n, *loaded)\n")
    r = e.run("python", "-c", code, ",".join(EXTRA_MODULES))
    expect(r.returncode == 0, "every command's --help renders", r)
    n, *loaded = r.stdout.split()
    expect(not loaded, f"--help imports no extra (imported: {loaded})", r)
    r = e.dataspace("pipeline", "run", "--help")
    expect(r.returncode == 0 and "--engine" in r.stdout, "dataspace pipeline run --help", r)
    return f"{n} commands and subcommands"


def check_serve(e: Env) -> str:
    data = e.base / "server"
    serve = e.start("dataspace", "serve", "--tcp", "127.0.0.1:0", "--http", "127.0.0.1:0",
                    "--data-dir", str(data))
    held = observe = None
    try:
        addr = serve.wait_for(r"listening on (127\.0\.0\.1:\d+)").group(1)
        http = serve.wait_for(r"HTTP on (http://127\.0\.0\.1:\d+/)").group(1)
        with urllib.request.urlopen(http, timeout=TIMEOUT) as resp:  # the inspector's page
            page = resp.read().decode("utf-8", "replace")
        expect(resp.status == 200 and "<html" in page.lower(),
               f"the inspector's page at {http} (package data in the wheel)")
        client = ("--server", addr, "--data-dir", str(data))
        # The held assertion reaches the observer only once its subscription is in place
        # on the server: then the message sent after it reaches it too.
        observe = e.start("dataspace", "observe", "--count", "2", *client, "<Smoke $x>")
        held = e.start("dataspace", "assert", *client, '<Smoke "held">')
        observe.wait_for(r'^\+ <Smoke "held">')
        r = e.dataspace("send", *client, '<Smoke "sent">')
        expect(r.returncode == 0, "dataspace send", r)
        observe.wait_for(r'<Smoke "sent">')
        try:
            rc = observe.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            rc = None
        expect(rc == 0, f"observe --count 2 exits 0 after its two events (exit {rc})")
        r = e.dataspace("query", *client, "<Smoke $x>")
        expect(r.returncode == 0 and '<Smoke "held">' in r.stdout, "dataspace query", r)
    finally:
        for p in (observe, held):
            if p is not None:
                p.stop()
        rc = serve.stop()
    expect(rc == 0, f"serve stops cleanly on Ctrl-C (exit {rc}; it said {serve.seen[-5:]})")
    return f"serve on {addr} and {http}; assert, observe, send, query"


def check_local_pipeline(e: Env) -> str:
    data = str(e.base / "pipeline")
    (e.work / "shout.py").write_text(GRAPH, encoding="utf-8")
    r = e.dataspace("stream", "append", "--data-dir", data, "words", '"hi"', '"there"')
    expect(r.returncode == 0, "dataspace stream append", r)
    r = e.dataspace("pipeline", "run", "shout.py", "--engine", "local", "--until-idle",
                    "--data-dir", data)
    expect(r.returncode == 0 and "2 messages in, 2 out" in r.stdout,
           "pipeline run --engine local --until-idle", r)
    r = e.dataspace("stream", "read", "--data-dir", data, "shouts")
    expect(r.returncode == 0 and '"HI"' in r.stdout and '"THERE"' in r.stdout,
           "dataspace stream read shouts", r)
    return "2 messages through a map on SQLite"


def check_missing_spark(e: Env) -> str:
    data = str(e.base / "pipeline")  # the store check_local_pipeline made
    r = e.dataspace("pipeline", "run", "shout.py", "--data-dir", data)  # Spark: the default
    expect_missing_extra(r, "dataspace pipeline", "spark")
    expect("--engine local" in r.stderr, "the Spark engine's message names --engine local", r)
    said = r.stderr.strip()
    r = e.run("python", "-m", "dataspace.pipeline.spark.warmup")
    expect_missing_extra(r, "python -m dataspace.pipeline.spark.warmup", "spark")
    r = e.run("python", "-c", "import dataspace.pipeline.spark")
    expect(r.returncode == 0, "import dataspace.pipeline.spark (PySpark loads on use)", r)
    return said


def check_missing_postgres(e: Env) -> str:
    r = e.dataspace("stream", "ls", "--store", PG_URL)
    expect_missing_extra(r, "dataspace stream", "postgres")
    said = r.stderr.strip()
    r = e.dataspace("serve", "--store", PG_URL, "--tcp", "127.0.0.1:0", "--http", "127.0.0.1:0",
                    "--data-dir", str(e.base / "pg-serve"))
    expect_missing_extra(r, "dataspace serve", "postgres")
    r = e.dataspace("pipeline", "status", "shout.py", "--store", PG_URL)
    expect_missing_extra(r, "dataspace pipeline", "postgres")
    return said


CHECKS: list[tuple[str, Callable[[Env], str]]] = [
    ("the environment holds the broker only", check_broker_only),
    ("dataspace --version: compiled, no compiler on the PATH", check_version),
    ("every --help without the extras", check_help),
    ("serve, assert/observe/send/query, the HTTP port", check_serve),
    ("a local pipeline over SQLite", check_local_pipeline),
    ("the Spark extra missing: one line, exit 2", check_missing_spark),
    ("the PostgreSQL extra missing: one line, exit 2", check_missing_postgres),
]


def newest_wheel() -> str:
    found = sorted(glob.glob(str(ROOT / "dist" / "dataspace-*.whl")), key=os.path.getmtime)
    if not found:
        sys.exit("wheel smoke: no dist/dataspace-*.whl: build one with `make wheel`")
    return found[-1]


def install(base: Path, wheel: str) -> Env:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(base / "venv")], check=True,
                   timeout=300)
    e = Env(base)
    r = e.run("python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
              wheel, timeout=600)
    if r.returncode != 0:
        sys.exit(f"wheel smoke: pip install {wheel} failed (exit {r.returncode}):\n"
                 f"{r.stdout[-3000:]}{r.stderr[-3000:]}")
    print(f"wheel smoke: installed {os.path.basename(wheel)} (no extras) into a fresh "
          f"environment in {time.monotonic() - t0:.1f}s", flush=True)
    return e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", nargs="?", help="the wheel (default: the newest dist/dataspace-*.whl)")
    ap.add_argument("--keep", action="store_true", help="keep the environment (its path is printed)")
    args = ap.parse_args(argv)
    wheel = os.path.abspath(args.wheel or newest_wheel())
    base = Path(tempfile.mkdtemp(prefix="dataspace-wheel-smoke-"))
    passed = failed = 0
    try:
        e = install(base, wheel)
        for name, check in CHECKS:
            t0 = time.monotonic()
            try:
                said = check(e)
            except Failed as f:
                failed += 1
                print(f"FAIL {name} ({time.monotonic() - t0:.1f}s): {f}", flush=True)
            except Exception:
                failed += 1
                print(f"FAIL {name}: an error in the check itself\n{traceback.format_exc()}",
                      flush=True)
            else:
                passed += 1
                print(f"ok   {name} ({time.monotonic() - t0:.1f}s): {said}", flush=True)
    finally:
        if args.keep:
            print(f"wheel smoke: the environment is kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    print(f"smoke: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
