"""What the harnesses share: their lines of output, a free loopback port, a cluster's
secret and a member's root key, a server they run in a subprocess and kill, and the
exactly-once check of acknowledged messages.  The tests and benchmarks use them too."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ..cli._voice import plural

__all__ = ["CrashResult", "ServerProcess", "free_port", "once_problems", "report", "say",
           "write_root_key", "write_secret"]

K = TypeVar("K")


def say(text: str) -> None:
    """One line of a harness's own output on standard output, flushed at once: the
    command's report, or a child's line its parent reads (not logging)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_secret(path: Path) -> Path:
    """A new cluster secret in the file ``path`` (mode 600), as ``dataspace cluster
    secret`` makes one; returns ``path``."""
    from ..broker.cluster import make_secret

    path.write_text(make_secret())
    path.chmod(0o600)
    return path


def write_root_key(data_dir: Path, key: bytes) -> None:
    """Give the data directory ``data_dir`` (made if need be) the root key ``key``, unless
    it has one: the members of a cluster share one, so that one sturdyref opens each."""
    from ..datadir import ROOT_KEY

    data_dir.mkdir(parents=True, exist_ok=True)
    k = data_dir / ROOT_KEY
    if not k.exists():
        k.write_bytes(key)
        k.chmod(0o600)


class ServerProcess:
    """A server in an asyncio subprocess (``proc``, set by the subclass's ``start``):
    killed with SIGKILL, or stopped with SIGTERM and then SIGKILL."""

    proc: asyncio.subprocess.Process | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def kill(self) -> None:
        p = self.proc
        if p is not None and p.returncode is None:
            p.send_signal(signal.SIGKILL)
            await p.wait()

    async def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, and SIGKILL if it has not ended ``timeout`` seconds later."""
        p = self.proc
        if p is not None and p.returncode is None:
            p.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(p.wait(), timeout)
            except TimeoutError:
                p.kill()
                await p.wait()


@dataclass
class CrashResult:
    """What a run of kills did and found."""

    kills: int = 0
    acknowledged: int = 0
    recorded: int = 0
    problems: list[str] = field(default_factory=list)


def report(result: CrashResult, kills: int, passed: str, *, seed: int, base: Path,
           keep: bool) -> int:
    """Say a run's end -- its first problems, then ``PASSED: {passed}`` or where its data
    was kept -- and give the exit status; the data goes after a pass unless ``keep``."""
    ok = not result.problems and result.kills == kills
    for p in result.problems[:10]:
        say(f"PROBLEM: {p}")
    if ok:
        say(f"PASSED: {passed}")
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    else:
        say(f"FAILED after {plural(result.kills, 'kill')} (seed {seed}; data kept in {base})")
    return 0 if ok else 1


def once_problems(when: str, acked: Iterable[K], counts: Counter[K]) -> list[str]:
    """What breaks "every acknowledged message recorded exactly once": ``acked`` the
    acknowledged messages' keys, ``counts`` how many times each key is in the stream (a
    key in it twice is a problem even if it was not acknowledged)."""
    missing = [k for k in acked if counts[k] == 0]
    twice = sorted(k for k, c in counts.items() if c > 1)  # type: ignore[type-var]
    out = []
    if missing:
        out.append(f"{when}: {plural(len(missing), 'acknowledged message')} missing, "
                   f"e.g. {missing[:5]}")
    if twice:
        out.append(f"{when}: recorded more than once: {twice[:5]}")
    return out
