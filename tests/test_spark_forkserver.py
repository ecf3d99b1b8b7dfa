"""The fork server that starts Spark's per-query Python process from preloaded imports
(dataspace.pipeline.spark.forkserver): a launcher forks through it for its modules and
execs the interpreter for everything else, passes arguments, environment, working
directory, standard streams, exit status and signals, and never leaves a child behind."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dataspace.pipeline.spark import forkserver
from dataspace.pipeline.spark.forkserver import ForkServer

PROBE = textwrap.dedent("""
    import json, os, signal, sys, time
    line = sys.stdin.readline().strip()
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(),
                      "value": os.environ.get("PROBE_VALUE"), "name": __name__,
                      "stdin": line, "argv0": sys.argv[0], "args": sys.argv[1:],
                      "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}),
          flush=True)
    if os.environ.get("PROBE_SLEEP"):
        time.sleep(float(os.environ["PROBE_SLEEP"]))
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
""")


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    """Whether process ``pid`` ends within ``timeout`` (waits on a pidfd, no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        r, _, _ = select.select([fd], [], [], timeout)
        return bool(r)
    finally:
        os.close(fd)


@pytest.fixture
def server(tmp_path, monkeypatch):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "probe_forked.py").write_text(PROBE)
    (tmp_path / "mods" / "probe_execd.py").write_text(PROBE)
    # (an existing PYTHONPATH kept: the server must run the dataspace under test)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "mods"),
                                                      *filter(None, [os.environ.get("PYTHONPATH")])]))
    fs = ForkServer(sys.executable, modules=("probe_forked",), preload=("json",))
    assert fs.ready(60), "the fork server never listened"
    yield fs
    fs.stop()


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as PySpark starts the JVM, which starts workers


def _run(fs: ForkServer, module: str, cwd: Path, ignore_sigint: bool = False,
         args: tuple[str, ...] = (), **env: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {"PYTHONHASHSEED": "0", **env}  # as Spark starts its workers
    r = subprocess.run([fs.launcher, "-m", module, *args], input="hello\n", capture_output=True,
                       text=True, timeout=60, cwd=cwd, env={**os.environ, **env},
                       preexec_fn=_ignore_sigint if ignore_sigint else None)
    assert r.stdout, r.stderr
    return r, json.loads(r.stdout.splitlines()[0])


def test_its_modules_are_forked_by_the_server_with_the_launchers_process_state(server, tmp_path):
    assert server.proc is not None
    r, got = _run(server, "probe_forked", tmp_path, PROBE_VALUE="v1", PROBE_EXIT="3")
    assert got["ppid"] == server.proc.pid  # a child of the server, not a fresh interpreter
    assert got["cwd"] == str(tmp_path) and got["value"] == "v1" and got["stdin"] == "hello"
    assert got["name"] == "__main__" and got["argv0"].endswith("probe_forked.py")
    assert got["args"] == [] and r.returncode == 3
    # Arguments after the module (pyspark.daemon's worker module) reach it as sys.argv[1:].
    r, got = _run(server, "probe_forked", tmp_path, args=("pyspark.worker", "x y"))
    assert got["ppid"] == server.proc.pid and got["args"] == ["pyspark.worker", "x y"]
    assert got["argv0"].endswith("probe_forked.py") and r.returncode == 0
    assert "RuntimeWarning" not in r.stderr


def test_other_modules_and_a_switched_off_server_exec_the_interpreter(server, tmp_path, monkeypatch):
    r, got = _run(server, "probe_execd", tmp_path, args=("a",), PROBE_EXIT="4")
    assert got["ppid"] == os.getpid() and r.returncode == 4  # the launcher became python
    assert got["args"] == ["a"]
    r, got = _run(server, "probe_forked", tmp_path, DATASPACE_SPARK_FORKSERVER="0")
    assert got["ppid"] == os.getpid() and r.returncode == 0
    r, got = _run(server, "probe_forked", tmp_path, PYTHONHASHSEED="12345")  # not the server's
    assert got["ppid"] == os.getpid()


def test_without_a_server_the_launcher_still_runs_the_module(server, tmp_path):
    launcher = Path(tmp_path / "launcher")
    launcher.write_bytes(Path(server.launcher).read_bytes())
    launcher.chmod(0o700)
    server.stop()
    assert not server.dir.exists()
    r = subprocess.run([str(launcher), "-m", "probe_forked"], input="x\n", capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout)["ppid"] == os.getpid()


@pytest.mark.parametrize("how", ["terminate", "kill"])
def test_stopping_the_launcher_stops_the_child(server, tmp_path, how):
    """SIGTERM (how Spark stops a worker) is passed on to the child; after a SIGKILL,
    which the launcher cannot pass on, the server kills the child itself."""
    with subprocess.Popen([server.launcher, "-m", "probe_forked"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                          env={**os.environ, "PROBE_SLEEP": "60", "PYTHONHASHSEED": "0"}) as p:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("x\n")
        p.stdin.flush()
        got = json.loads(p.stdout.readline())
        assert server.proc is not None and got["ppid"] == server.proc.pid
        getattr(p, how)()
        assert p.wait(30) == (-signal.SIGTERM if how == "terminate" else -signal.SIGKILL)
    assert _wait_gone(got["pid"])


def test_ctrl_c_at_the_terminal_is_the_drivers_alone(server, tmp_path):
    """Spark's processes ignore SIGINT (PySpark starts the JVM so): a forked child
    inherits the launcher's ignored signals, and the server, in a process group of its
    own, neither gets the terminal's Ctrl-C nor dies of a SIGINT."""
    assert server.proc is not None
    assert os.getpgid(server.proc.pid) != os.getpgid(0)
    _r, got = _run(server, "probe_forked", tmp_path, ignore_sigint=True)
    assert got["ppid"] == server.proc.pid and got["sigint_ignored"] is True
    _r, got = _run(server, "probe_forked", tmp_path)
    assert got["ppid"] == server.proc.pid and got["sigint_ignored"] is False
    os.kill(server.proc.pid, signal.SIGINT)
    _r, got = _run(server, "probe_forked", tmp_path)
    assert got["ppid"] == server.proc.pid and server.proc.poll() is None


def test_the_server_goes_with_its_parent_and_leaves_nothing(server, tmp_path):
    assert server.proc is not None and server.proc.stdin is not None
    server.proc.stdin.close()  # as when the driver dies
    assert server.proc.wait(30) == 0
    assert not server.dir.exists()


def test_directories_of_dead_drivers_are_removed(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    base = tmp_path / f"dataspace-spark-{os.getuid()}"
    base.mkdir()
    orphan, alive = base / f"fork-{dead}-x", base / f"fork-{os.getppid()}-x"
    for d in (orphan, alive):
        d.mkdir()
    fs = ForkServer(sys.executable, preload=())
    try:
        assert not orphan.exists() and alive.exists() and fs.dir.parent == base
    finally:
        fs.stop()


def test_launcher_needs_a_plain_interpreter_path():
    assert forkserver.enabled("/usr/bin/python3")
    assert not forkserver.enabled("/opt/my python/bin/python3")


def test_sparks_python_processes_are_forked_by_the_sessions_server(spark, tmp_path):
    """The session's fork server serves Spark's per-query source process (forked while a
    streaming query over the connector runs, gone when it stops) and the daemons its
    tasks' Python workers fork from: their launchers wait for the server's children
    instead of becoming the interpreter."""
    from dataspace.pipeline.spark import session
    from dataspace.streams import open_store

    fs = session._fork
    assert fs is not None and fs.proc is not None, "the test session has no fork server"
    with open_store(tmp_path) as store, store.transaction() as tx:
        tx.append_encoded("s", [b"\xb1\x01a"])
    q = (spark.readStream.format("dataspace").option("store", str(tmp_path)).option("stream", "s")
         .load().writeStream.format("noop").option("checkpointLocation", str(tmp_path / "ck"))
         .start())
    try:
        q.processAllAvailable()
        waiting = _launchers(fs.launcher)
        kids = [k for k in _pids() if _ppid(Path(f"/proc/{k}")) == fs.proc.pid]
        assert kids, "no process forked by the fork server while the query runs"
        runners = [k for k, m in waiting.items() if m == "pyspark.sql.streaming.python_streaming_source_runner"]
        assert runners, f"the query's source process was not forked: {waiting}"
        assert "pyspark.daemon pyspark.worker" in waiting.values(), \
            f"the read tasks' daemon was not forked: {waiting}"
    finally:
        q.stop()
    assert all(_wait_gone(k) for k in runners)


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _launchers(launcher: str) -> dict[int, str]:
    """The launchers waiting for a child of the server (one that execs the interpreter
    takes its command line): pid -> the module and its arguments."""
    out = {}
    for pid in _pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if launcher in args and "-m" in args:
            out[pid] = " ".join(args[args.index("-m") + 1:])
    return out


def _ppid(p: Path) -> int | None:
    try:
        stat = (p / "stat").read_bytes()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[1])


PATH_PROBE = textwrap.dedent("""
    import copy, json, os, sys, sysconfig
    import usermod
    cwd = os.getcwd()
    stdlib = sysconfig.get_paths()["stdlib"]
    print(json.dumps({"ppid": os.getppid(), "copy": copy.__file__, "usermod": usermod.__file__,
                      "deepcopy": hasattr(copy, "deepcopy"), "cwd_at": sys.path.index(cwd),
                      "stdlib_at": sys.path.index(stdlib), "args": sys.argv[1:]}), flush=True)
""")


@pytest.fixture
def shadowing_cwd(tmp_path):
    """A working directory holding a copy.py (named like the standard library's copy) and
    a module of the user's own."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "copy.py").write_text("raise ImportError('the copy.py of the working directory')\n")
    (cwd / "usermod.py").write_text("VALUE = 1\n")
    (tmp_path / "mods").mkdir(exist_ok=True)
    (tmp_path / "mods" / "path_forked.py").write_text(PATH_PROBE)
    (tmp_path / "mods" / "path_execd.py").write_text(PATH_PROBE)
    return cwd


@pytest.mark.parametrize("module", ["path_forked", "path_execd", "path_forked/off"])
def test_the_working_directory_comes_last_on_sys_path(tmp_path, shadowing_cwd, monkeypatch, module):
    """A module started through the launcher -- forked by the server, exec'd, or with the
    server switched off -- finds the standard library's copy, not the working directory's
    copy.py (python -m puts the working directory first), and still imports the user's
    module there: the working directory is on sys.path, after the standard library."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "mods"),
                                                      *filter(None, [os.environ.get("PYTHONPATH")])]))
    module, _, off = module.partition("/")
    fs = ForkServer(sys.executable, modules=("path_forked",), preload=("json",), serve=not off)
    try:
        assert off or fs.ready(60), "the fork server never listened"
        server = fs.proc.pid if fs.proc is not None else None
        r = subprocess.run([fs.launcher, "-m", module, "a b"], capture_output=True, text=True,
                           timeout=60, cwd=shadowing_cwd, env={**os.environ, "PYTHONHASHSEED": "0"})
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
    finally:
        fs.stop()
    forked = module == "path_forked" and not off
    assert got["ppid"] == (server if forked else os.getpid())
    assert got["deepcopy"] and not got["copy"].startswith(str(shadowing_cwd))
    assert got["usermod"] == str(shadowing_cwd / "usermod.py")
    assert got["stdlib_at"] < got["cwd_at"]
    assert got["args"] == ["a b"]
