"""Wake-ups: readers sleep until the store changes, in this process or another one.

Design
------
A :class:`Notifier` keeps a *generation* counter per store file and process.  A reader
takes the generation, checks the store for what it wants and, if it is not there yet,
waits for the generation to change (with a timeout).  Two things bump the generation:

* **this process** committing a write transaction (the store calls :meth:`Notifier.bump`
  right after ``COMMIT``), which wakes local readers at once;
* **another process** committing: after ``COMMIT`` returns, the writing store overwrites
  one byte of a small side file, ``streams.sqlite3-notify`` (one ``pwrite(2)``).  On
  Linux the notifier watches the store's directory with *inotify* (through ``ctypes``; no
  dependency) and bumps the generation on every event naming that file.  One daemon
  thread per store file and process blocks in ``select(2)`` on the inotify descriptor --
  no timeout, no polling.

Why a side file and not the write-ahead log itself: SQLite writes a commit's frames to
the WAL with ``write(2)`` but publishes the commit afterwards, in shared memory (the
wal-index), which makes no inotify event.  A reader woken by the WAL write can look
before the commit is visible and then sleep through it.  The side file is written only
once the commit is visible.  A writer killed after its commit but before the signal is
covered too: when a process dies the kernel closes its descriptors, which reports
``IN_CLOSE_WRITE`` on the WAL, and the notifier bumps on that event as well.

The directory (not the files) is watched so that files being deleted and re-created
(SQLite removes the WAL when the last connection closes) cannot silently end the watch.
The watch is established *before* the first generation is handed out, so a commit that
becomes visible after a reader took the generation always produces an event: no lost
wake-ups.  Spurious wake-ups (another stream, our own signal) only cost one more check.
Writers must use this package's store (a foreign program writing the SQLite file directly
wakes readers only when it closes the file).

Waiting: blocking readers wait on a :class:`threading.Condition`; asyncio readers await
a future the watcher thread resolves with ``loop.call_soon_threadsafe``.

Where inotify is unavailable (not Linux, or the per-user inotify limit is reached) the
notifier falls back to checking the two files' size and modification time every
``FALLBACK_INTERVAL`` seconds and logs a warning once: wake-ups across processes then
lag by up to that interval (same-process wake-ups stay immediate).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import select
import struct
import sys
import threading
from pathlib import Path

from .._threads import start_daemon

__all__ = ["FALLBACK_INTERVAL", "Generation", "Notifier", "get_notifier", "inotify_available"]

log = logging.getLogger(__name__)

FALLBACK_INTERVAL = 0.25

_IN_MODIFY = 0x00000002
_IN_CLOSE_WRITE = 0x00000008
_IN_MOVED_TO = 0x00000080
_IN_CREATE = 0x00000100
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")

_libc: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.inotify_init1.argtypes = [ctypes.c_int]
        _libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        _libc = None


def inotify_available() -> bool:
    """Whether cross-process wake-ups use inotify here (else the polling fallback)."""
    return _libc is not None


class Generation:
    """A generation counter with waiters: blocking ones on a :class:`threading.Condition`,
    asyncio ones on futures resolved with ``call_soon_threadsafe``.  A backend's notifier
    subclasses it and calls :meth:`bump` when its store may have changed (the inotify
    :class:`Notifier` here; LISTEN/NOTIFY in :mod:`.postgres`).  :meth:`_start` starts
    the watch, before the first generation is handed out."""

    def __init__(self) -> None:
        self._gen = 0
        self._cond = threading.Condition()
        self._async: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._started = False
        self._closed = False
        self.refs = 0

    def _start(self) -> None:
        """Start watching for changes (once)."""
        self._started = True

    def generation(self) -> int:
        """The current generation (starts the watch on first use)."""
        if not self._started:
            self._start()
        return self._gen

    def bump(self) -> None:
        """Something changed: wake every waiter."""
        with self._cond:
            self._gen += 1
            self._cond.notify_all()
            waiters, self._async = self._async, []
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # loop closed
                loop.call_soon_threadsafe(_resolve, fut)

    def wait(self, generation: int, timeout: float | None) -> int:
        """Block until the generation differs from ``generation`` (or ``timeout``)."""
        if not self._started:
            self._start()
        with self._cond:
            if self._gen == generation:
                self._cond.wait_for(lambda: self._gen != generation or self._closed, timeout)
            return self._gen

    async def wait_async(self, generation: int, timeout: float | None) -> int:
        """:meth:`wait` for asyncio (never blocks the event loop)."""
        if not self._started:
            self._start()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if self._gen != generation or self._closed:
                return self._gen
            self._async.append((loop, fut))
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            if not fut.done():
                fut.cancel()
            with self._cond:
                self._async = [w for w in self._async if w[1] is not fut]
        return self._gen


class Notifier(Generation):
    """The generation counter of one store file in this process (see module docstring)."""

    def __init__(self, db_path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(db_path)
        self._signal_name = (self.path.name + "-notify").encode()
        self._wal_name = (self.path.name + "-wal").encode()
        self._signal_fd = -1
        self._thread: threading.Thread | None = None
        self._fd = -1
        self._pipe: tuple[int, int] | None = None
        self.mode = "none"

    def signal(self) -> None:
        """Tell other processes that a commit is visible (one ``pwrite`` to the side
        file), and wake this process's waiters."""
        fd = self._signal_fd
        if fd < 0:
            try:
                fd = self._signal_fd = os.open(
                    self.path.with_name(self.path.name + "-notify"),
                    os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600,
                )
            except OSError as e:
                log.warning("cannot open the wake-up file of %s (%s)", self.path, e.strerror)
                self._signal_fd = -2
        if fd >= 0:
            try:
                os.pwrite(fd, b"\0", 0)
            except OSError as e:  # pragma: no cover - disk trouble
                log.warning("cannot signal other processes (%s)", e.strerror)
        self.bump()

    # -- the watcher ------------------------------------------------------------------

    def _start(self) -> None:
        with self._cond:
            if self._started:
                return
            self._started = True
            target = self._watch_inotify if self._open_inotify() else self._watch_fallback
            self._pipe = os.pipe()
            self._thread = start_daemon(target, f"streams-wakeup:{self.path.name}")

    def _open_inotify(self) -> bool:
        if _libc is None:
            self.mode = "poll"
            log.warning(
                "no inotify on this platform: readers of %s in other processes are woken by "
                "polling every %.2f s", self.path, FALLBACK_INTERVAL,
            )
            return False
        fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            self.mode = "poll"
            log.warning(
                "inotify_init1 failed (%s; raise fs.inotify.max_user_instances?): readers of "
                "%s in other processes are woken by polling every %.2f s",
                os.strerror(err), self.path, FALLBACK_INTERVAL,
            )
            return False
        mask = _IN_MODIFY | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE
        directory = os.fsencode(str(self.path.parent.resolve()))
        wd = _libc.inotify_add_watch(fd, directory, mask)
        if wd < 0:
            err = ctypes.get_errno()
            os.close(fd)
            self.mode = "poll"
            log.warning(
                "inotify_add_watch(%s) failed (%s; raise fs.inotify.max_user_watches?): "
                "polling every %.2f s instead", self.path.parent, os.strerror(err),
                FALLBACK_INTERVAL,
            )
            return False
        self._fd = fd
        self.mode = "inotify"
        return True

    def _watch_inotify(self) -> None:
        assert self._pipe is not None
        rpipe = self._pipe[0]
        fd = self._fd
        signal_name = self._signal_name
        wal_name = self._wal_name
        try:
            while not self._closed:
                try:
                    ready, _, _ = select.select([fd, rpipe], [], [])
                except InterruptedError:  # pragma: no cover - PEP 475 retries already
                    continue
                if rpipe in ready:
                    return
                try:
                    buf = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                except OSError as e:  # pragma: no cover - descriptor trouble
                    if e.errno == errno.EINTR:
                        continue
                    log.warning("inotify read failed (%s): switching to polling", e)
                    self._watch_fallback()
                    return
                hit = False
                lost = False
                off = 0
                while off + 16 <= len(buf):
                    _wd, mask, _cookie, ln = _EVENT.unpack_from(buf, off)
                    name = buf[off + 16 : off + 16 + ln].rstrip(b"\0")
                    off += 16 + ln
                    if (
                        name == signal_name
                        or mask & _IN_Q_OVERFLOW
                        or (mask & _IN_CLOSE_WRITE and name == wal_name)
                    ):
                        hit = True
                    if mask & _IN_IGNORED:
                        lost = True
                if hit or lost:
                    self.bump()
                if lost:
                    log.warning("the directory of %s is no longer watched: polling", self.path)
                    self._watch_fallback()
                    return
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _stat(self) -> tuple[tuple[int, int], ...]:
        out = []
        for p in (self.path.with_name(self.path.name + "-notify"),
                  self.path.with_name(self.path.name + "-wal")):
            try:
                st = os.stat(p)
                out.append((st.st_size, st.st_mtime_ns))
            except OSError:
                out.append((-1, -1))
        return tuple(out)

    def _watch_fallback(self) -> None:
        assert self._pipe is not None
        rpipe = self._pipe[0]
        last = self._stat()
        while not self._closed:
            ready, _, _ = select.select([rpipe], [], [], FALLBACK_INTERVAL)
            if ready:
                return
            now = self._stat()
            if now != last:
                last = now
                self.bump()

    def close(self) -> None:
        """Stop the watcher thread and wake every waiter."""
        if self._closed:
            return
        self._closed = True
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                os.write(self._pipe[1], b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._signal_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._signal_fd)
            self._signal_fd = -1
        if self._pipe is not None:
            for p in self._pipe:
                with contextlib.suppress(OSError):
                    os.close(p)
            self._pipe = None
        self.bump()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


_registry: dict[tuple[int, str], Notifier] = {}
_registry_lock = threading.Lock()


def get_notifier(db_path: str | os.PathLike[str]) -> Notifier:
    """The process-wide notifier of a store file (shared by every store object on it)."""
    key = (os.getpid(), os.path.realpath(db_path))
    with _registry_lock:
        n = _registry.get(key)
        if n is None or n._closed:
            n = _registry[key] = Notifier(key[1])
        n.refs += 1
        return n


def release_notifier(n: Notifier) -> None:
    """Drop one reference; the last one stops the watcher."""
    with _registry_lock:
        n.refs -= 1
        if n.refs > 0:
            return
        key = (os.getpid(), str(n.path))
        if _registry.get(key) is n:
            del _registry[key]
    n.close()
