"""Progress of long work, for people at a terminal and for logs alike.

One helper for every long command (``stream copy``, ``pipeline run`` catching up, the
soaks and crash tests, the benchmarks)::

    p = Progress(sys.stderr, what="entries", verb="copied", total=10_000)
    for done in ...:
        p(done)                  # or p(done, total) when the total moves
    p.finish()

* **On a terminal** one line is rewritten in place: a bar, ``done/total what (NN%)``, the
  rate and the time left (ETA), and an optional note (``p(done, note="lag 300")``) --
  redrawn at most every ``redraw`` seconds, cut to the terminal's width.
* **Otherwise** (CI, a pipe, a log file) a plain line every ``interval`` seconds, only
  when something moved, and always the last one: ``copied 3,000/10,000 entries (30%),
  1,200/s, ETA 0:06``.

Without a total (``total=None``) the line has the count, the rate and the time spent.
A total that is an estimate (``p(done, total, estimated=True)``: an import's, from the
share of the file read) is said as one, rounded: ``imported 10,000 of about 21,000
entries (48%)``.
``rate=False`` leaves the rate out (a soak's progress is its clock).

Work that is not a count -- starting Spark, a micro-batch of unknown length -- shows in a
:class:`LiveLine`: the phases one line each as they end (``JVM up (4.1s)``), and a status
line that keeps moving while nothing else does (on a terminal a spinner and the seconds
of what is going on; otherwise a line every ``heartbeat`` seconds).  Library code reports
its phases to anything with ``begin``/``end`` (:class:`Phases`); :data:`NO_PHASES` says
nothing.  :class:`WallRate` is a rate over wall time that a burst cannot inflate;
:class:`Eta` the time left to work off a backlog, steady while a step of work runs.

Stdlib only: it imports nothing from the rest of the package, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO

__all__ = ["NO_PHASES", "Eta", "LiveLine", "Phases", "Progress", "WallRate", "hms"]


def hms(seconds: float) -> str:
    """``M:SS``, or ``H:MM:SS`` from an hour."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """The progress of one long piece of work (see the module docstring).

    ``out`` (default standard error) is where it goes; it is a terminal when
    ``out.isatty()`` says so (``tty`` overrides).  ``clock`` is for tests.  ``header`` is
    printed once, before the first progress.  ``quiet`` prints nothing.
    """

    BAR = 24

    def __init__(
        self,
        out: TextIO | Any = None,
        *,
        total: int | None = None,
        what: str = "items",
        verb: str = "done",
        interval: float = 2.0,
        redraw: float = 0.1,
        rate: bool = True,
        header: str | None = None,
        quiet: bool = False,
        tty: bool | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.out = sys.stderr if out is None else out
        self.total = total
        self.what = what
        self.verb = verb
        self.interval = interval
        self.redraw = redraw
        self.show_rate = rate
        self.header = header
        self.quiet = quiet
        self.tty = bool(getattr(self.out, "isatty", lambda: False)()) if tty is None else tty
        self.clock = clock or time.monotonic
        self.t0 = self.clock()
        self.done = 0
        self.note = ""
        self.estimated = False
        """Whether :attr:`total` is an estimate (said ``of about N``)."""
        self._last = -1.0
        self._last_text = ""
        self._width = 0
        self._finished = False

    # -- the text ------------------------------------------------------------------------

    def elapsed(self) -> float:
        return max(self.clock() - self.t0, 1e-9)

    def rate(self) -> float:
        """Items per second since the start."""
        return self.done / self.elapsed()

    def text(self) -> str:
        """The progress as words (without the bar): count, share, rate, ETA or time."""
        done, total = self.done, self.total
        elapsed = self.elapsed()
        rate = done / elapsed
        parts: list[str] = []
        if total is not None:
            final = done >= total
            frac = done / total if total else 1.0
            if self.estimated and not final:
                parts.append(f"{done:,} of about {_about(total):,} {self.what} "
                             f"({min(frac, 1.0):.0%})")
            else:
                parts.append(f"{done:,}/{total:,} {self.what} ({min(frac, 1.0):.0%})")
            if self.show_rate:
                parts.append(f"{rate:,.0f}/s")
            if final:
                parts.append(hms(elapsed))
            else:
                parts.append("ETA " + ("-" if rate <= 0 else hms((total - done) / rate)))
        else:
            parts.append(f"{done:,} {self.what}")
            if self.show_rate:
                parts.append(f"{rate:,.0f}/s")
            parts.append(hms(elapsed))
        text = ", ".join(parts)
        return f"{text} | {self.note}" if self.note else text

    def line(self) -> str:
        """What one update shows: on a terminal with a bar, otherwise with the verb."""
        if not self.tty:
            return f"{self.verb} {self.text()}"
        if self.total is None:
            return self.text()
        frac = self.done / self.total if self.total else 1.0
        filled = min(self.BAR, int(frac * self.BAR))
        return f"[{'#' * filled}{'.' * (self.BAR - filled)}] {self.text()}"

    # -- updates -------------------------------------------------------------------------

    def __call__(self, done: int, total: int | None = None, *, note: str | None = None,
                 estimated: bool = False) -> None:
        """``done`` items so far (of ``total``, if it is given or changed; ``estimated``:
        that total is an estimate)."""
        self.update(done, total, note=note, estimated=estimated)

    def update(self, done: int, total: int | None = None, *, note: str | None = None,
               estimated: bool = False) -> None:
        self.done = done
        if total is not None:
            self.total = total
            self.estimated = estimated
        if note is not None:
            self.note = note
        if self.quiet:
            return
        if self.header is not None:
            self.out.write(self.header + "\n")
            self.header = None
        now = self.clock()
        final = self.total is not None and done >= self.total
        if self.tty:
            if final or self._last < 0 or now - self._last >= self.redraw:
                self._last = now
                self._draw(final)
            return
        if final or self._last < 0 or now - self._last >= self.interval:
            if done == 0 and not final:
                self._last = now  # nothing to say yet
                return
            text = self.line()
            if text != self._last_text and not (self._finished and final):
                self._last = now
                self._last_text = text
                self.out.write(text + "\n")
                self.out.flush()
            if final:
                self._finished = True

    def advance(self, n: int = 1, *, note: str | None = None) -> None:
        """``n`` more items done."""
        self.update(self.done + n, note=note)

    def _draw(self, final: bool) -> None:
        text = self.line()
        cols = _columns(self.out)
        if len(text) > cols - 1:
            text = text[: max(0, cols - 2)] + "…"
        self.out.write("\r" + text + " " * max(0, self._width - len(text)))
        self._width = len(text)
        if final and not self._finished:
            self._finished = True
            self.out.write("\n")
        self.out.flush()

    def echo(self, text: str = "", file: TextIO | Any = None) -> None:
        """Print a line of other output (default: standard output) without garbling the
        bar: on a terminal the bar is cleared, the line printed, the bar drawn again."""
        f = sys.stdout if file is None else file
        if self.tty and self._width and not self.quiet and not self._finished:
            self.out.write("\r" + " " * self._width + "\r")
            self.out.flush()
            f.write(text + "\n")
            f.flush()
            self._width = 0
            self._draw(False)
            return
        f.write(text + "\n")
        f.flush()

    def finish(self, note: str | None = None) -> None:
        """The work ended (done or not): the last line is written (on a terminal the
        line is closed with a newline)."""
        if note is not None:
            self.note = note
        if self.quiet or self._finished:
            return
        self._finished = True
        if self.header is not None and self._last < 0:
            self.header = None
            return  # nothing was shown: nothing to close
        if self.tty:
            if self._width:
                self._draw(False)
                self.out.write("\n")
                self.out.flush()
            return
        text = self.line()
        if text != self._last_text:
            self.out.write(text + "\n")
            self.out.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


def _about(n: int) -> int:
    """``n`` to two significant digits (21,016 -> 21,000), as an estimate is said."""
    return n if n < 100 else round(n, 2 - len(str(n)))


def _columns(out: Any) -> int:
    try:
        return shutil.get_terminal_size((120, 24)).columns if hasattr(out, "fileno") else 120
    except (OSError, ValueError):
        return 120


# -- phases, and a line that keeps moving -----------------------------------------------------


class Phases(Protocol):
    """Where long set-up work says what it does: ``begin("launching the JVM")`` when a
    phase starts, ``end("JVM up")`` when it is over (the renderer adds how long it took)."""

    def begin(self, what: str) -> None: ...

    def end(self, done: str) -> None: ...


class _NoPhases:
    def begin(self, what: str) -> None:
        pass

    def end(self, done: str) -> None:
        pass


NO_PHASES: Phases = _NoPhases()
"""Phases that nobody is shown."""

SPINNER = "|/-\\"


class LiveLine:
    """The output of a command whose work takes long in steps of unknown length.

    * **Phases** (:class:`Phases`): on a terminal the current one is shown live
      (``PREFIXlaunching the JVM ... 3s``, a ticker thread keeps the seconds moving); when
      it ends, one line stays: ``PREFIXJVM up (4.1s)``.  Otherwise only the line that
      stays, and ``PREFIXlaunching the JVM ... 10s`` every ``heartbeat`` seconds of a
      long phase.
    * **A status line** (:meth:`status`): ``render(dt)`` gives its text ``dt`` seconds
      after it was set.  On a terminal it is rewritten in place, redrawn by the ticker
      while ``busy`` (with a spinner in front); otherwise it is printed when ``key``
      changes (``key`` leaves out what moves by itself, like seconds) -- at most one
      line every ``gap`` seconds: a change within the gap is printed when it is over (or
      at :meth:`close`), so a log gets a line per ``gap`` while the work moves and none
      while it does not -- and every ``heartbeat`` seconds while ``busy``.
    * :meth:`echo` prints a line without garbling the live one; :meth:`notice` does it
      from a signal handler (a raw write: no lock, no buffer).

    ``ticker=False`` starts no thread (tests call :meth:`tick`); ``clock`` is for tests.
    """

    def __init__(
        self,
        out: TextIO | Any = None,
        *,
        prefix: str = "",
        tty: bool | None = None,
        heartbeat: float = 10.0,
        gap: float = 0.0,
        tick: float = 0.25,
        quiet: bool = False,
        ticker: bool = True,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.out = sys.stdout if out is None else out
        self.prefix = prefix
        self.tty = bool(getattr(self.out, "isatty", lambda: False)()) if tty is None else tty
        self.heartbeat = heartbeat
        self.gap = gap
        self.tick_s = tick
        self.quiet = quiet
        self.clock = clock or time.monotonic
        self._ticker = ticker
        self._lock = threading.RLock()
        self._phase: tuple[str, float] | None = None
        self._render: Callable[[float], str] | None = None
        self._status_t = 0.0
        self._key: str | None = None
        self._busy = False
        self._width = 0
        self._spin = 0
        self._said = self.clock()  # the last line printed (heartbeats count from it)
        self._status_said = -math.inf  # the last status line printed (the gap counts from it)
        self._pending: str | None = None  # the key of a change not printed yet (the gap)
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    # -- phases ----------------------------------------------------------------------------

    def begin(self, what: str) -> None:
        with self._lock:
            self._phase = (what, self.clock())
            self._said = self.clock()
            if self.tty and not self.quiet:
                self._draw()
        self._start_ticker()

    def end(self, done: str) -> None:
        with self._lock:
            t0 = self._phase[1] if self._phase is not None else self.clock()
            self._phase = None
            self.echo(f"{self.prefix}{done} ({self.clock() - t0:.1f}s)", self.out)

    # -- the status line -------------------------------------------------------------------

    def status(self, render: Callable[[float], str], *, key: str | None = None,
               busy: bool = False) -> None:
        """Show ``render(0)`` now (see the class docstring for when it is redrawn)."""
        with self._lock:
            now = self.clock()
            self._render, self._status_t, self._busy = render, now, busy
            if self.quiet:
                return
            text = render(0.0)
            if self.tty:
                self._draw()
            else:
                k = key if key is not None else text
                if k == self._key:
                    self._pending = None  # back to what was printed: nothing to say
                elif now - self._status_said >= self.gap:
                    self._status_line(k, text)
                else:
                    self._pending = k  # printed when the gap is over
        if busy or self._pending is not None:
            self._start_ticker()

    # -- lines -----------------------------------------------------------------------------

    def echo(self, text: str = "", file: TextIO | Any = None) -> None:
        """Print a line that stays (default: on this line's output), the live line
        cleared first and drawn again after it on a terminal."""
        f = self.out if file is None else file
        with self._lock:
            if self.quiet and f is self.out:
                return
            if self.tty and self._width:
                self.out.write("\r" + " " * self._width + "\r")
                self._width = 0
                self.out.flush()
            f.write(text + "\n")
            f.flush()
            self._said = self.clock()
            if self.tty and not self.quiet:
                self._draw()

    def notice(self, text: str) -> None:
        """Print ``text`` at once from a signal handler: a raw write to the output's file
        descriptor (the handler may have interrupted a write of this very stream).  On a
        terminal the live line stays as it was (the moment of the notice) and is drawn
        again below."""
        data = ("\n" if self.tty and self._width else "") + text + "\n"
        self._width = 0
        try:
            fd = self.out.fileno()
        except (AttributeError, OSError, ValueError):
            fd = None
        if fd is None:
            self.out.write(data)
            return
        with contextlib.suppress(OSError):
            os.write(fd, data.encode(errors="replace"))

    def close(self) -> None:
        """The end: the ticker stops; on a terminal the live line is closed (it stays)."""
        self._closed.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(5.0)
        with self._lock:
            self._phase = None  # a phase that did not end is not kept
            self._busy = False
            if self._pending is not None and self._render is not None and not self.quiet:
                self._status_line(self._pending, self._text())  # the last change, always
            if self.tty and self._width and not self.quiet:
                if self._render is not None:
                    self._draw()
                    self.out.write("\n")
                else:
                    self.out.write("\r" + " " * self._width + "\r")
                self.out.flush()
                self._width = 0

    def __enter__(self) -> LiveLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- drawing ---------------------------------------------------------------------------

    def _text(self) -> str:
        now = self.clock()
        if self._phase is not None:
            what, t0 = self._phase
            return f"{self.prefix}{what} ... {int(now - t0)}s"
        if self._render is None:
            return ""
        text = self._render(now - self._status_t)
        if self._busy and self.tty:
            text = f"{SPINNER[self._spin % len(SPINNER)]} {text}"
        return text

    def _draw(self) -> None:
        text = self._text()
        if not text and not self._width:
            return
        cols = _columns(self.out)
        if len(text) > cols - 1:
            text = text[: max(0, cols - 2)] + "…"
        self.out.write("\r" + text + " " * max(0, self._width - len(text)))
        self._width = len(text)
        self.out.flush()

    def _line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()
        self._said = self.clock()

    def _status_line(self, key: str, text: str) -> None:
        self._key, self._pending = key, None
        self._line(text)
        self._status_said = self._said

    def tick(self) -> None:
        """What the ticker does every ``tick`` seconds (tests call it themselves)."""
        with self._lock:
            if self.quiet:
                return
            self._spin += 1
            if self.tty:
                if self._phase is not None or self._busy:
                    self._draw()
                return
            now = self.clock()
            if (self._pending is not None and self._render is not None and self._phase is None
                    and now - self._status_said >= self.gap):
                self._status_line(self._pending, self._text())
                return
            if now - self._said < self.heartbeat:
                return
            if self._phase is not None:
                self._line(self._text())
            elif self._busy and self._render is not None:
                key = self._pending if self._pending is not None else self._key
                self._status_line(key or "", self._text())

    def _start_ticker(self) -> None:
        if not self._ticker or self.quiet or self._thread is not None or self._closed.is_set():
            return
        self._thread = threading.Thread(target=self._run, name="live-line", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(self.tick_s):
            with contextlib.suppress(Exception):  # a closed or broken output: stop drawing
                self.tick()


class WallRate:
    """Items per second of wall time, for work that lands in bursts (a micro-batch of a
    minute commits all its messages at once).

    Feed it ``add(t, n, busy)``: the time, the running count and whether there is work.
    A *spell* of work starts with the first busy sample after an idle one; the rate is
    over the recent part of the current spell (or of the last one, once idle): from the
    count before the first increase of the last ``window`` seconds -- stretched back to
    the increase before it, so a burst is divided by the time its work took -- to now.
    A batch of 5,000 messages committed after 56 s is 89/s, not 5,000 per tick.
    """

    def __init__(self, window: float = 30.0) -> None:
        self.window = window
        self._marks: list[tuple[float, int]] = []  # the spell's start, then each increase
        self._last: tuple[float, int] | None = None
        self._idle = True

    def add(self, t: float, n: int, busy: bool) -> None:
        last = self._last
        busy = busy or (last is not None and n > last[1])  # work done between two samples
        if busy and self._idle:  # a new spell, from the sample before it
            self._marks = [last if last is not None else (t, n)]
            self._idle = False
        if self._marks and n > self._marks[-1][1]:
            self._marks.append((t, n))
            cut = t - self.window
            # Keep what a rate may start from: the increase before the window, and on.
            while len(self._marks) > 2 and self._marks[2][0] <= cut:
                self._marks.pop(0)
        self._last = (t, n)
        if not busy:
            self._idle = True

    def rate(self) -> float | None:
        """Items per second; None before a spell has two samples.  Once idle, the rate of
        the last spell up to its last increase (idle time after it does not count)."""
        if not self._marks or self._last is None:
            return None
        t, n = self._marks[-1] if self._idle else self._last
        cut = t - self.window
        incs = self._marks[1:]
        if not incs:
            t0, n0 = self._marks[0]
        else:
            j = next((k for k, (ti, _n) in enumerate(incs) if ti >= cut), len(incs) - 1)
            t0, n0 = self._marks[j]  # the mark before increase j (the spell's start for 0)
        if t <= t0:
            return None
        return (n - n0) / (t - t0)


class Eta:
    """The time left to work off a backlog, for work that commits in steps -- a Spark
    micro-batch of a minute, or the local engine's steps of milliseconds.

    Feed it ``update(t, done, left, busy, restarts)`` at every report: the time, the
    running count of work committed, the work left (the lag), whether there is work now,
    and a count of disruptions (tasks that failed and are retried, a restarted query).

    * It is estimated from the rate *between commits* of the current spell of work (a
      spell starts with the first busy report after an idle one): the first commit of a
      spell starts the measurement, so what came before it -- starting up, a query's
      first batch, idle time -- does not count.  Over the last ``window`` seconds of
      commits, stretched back to the commit before them.
    * Between two commits the estimate counts down, one second a second (a batch in
      flight does not make it climb); work that arrives meanwhile pushes it back at the
      same rate.  Once it has run out with work left (this batch is slower than the
      ones before), it is estimated again from the rate including the time since the
      last commit.
    * :meth:`left` is None -- estimating -- until a spell has two commits, and again
      after a disruption (``restarts`` moved), whose batch says nothing of the others.
    """

    def __init__(self, window: float = 30.0) -> None:
        self.window = window
        self._marks: list[tuple[float, int]] = []  # the spell's commits (as reported)
        self._done: int | None = None
        self._left = 0
        self._restarts = 0
        self._rate: float | None = None
        self._deadline: float | None = None

    def reset(self) -> None:
        """Start estimating anew (a restart: what was measured says nothing now)."""
        self._marks = []
        self._rate = None
        self._deadline = None

    def _rate_since(self, t: float, done: int) -> float | None:
        """``done`` at ``t`` over the commits of the last ``window`` seconds, from the one
        before them (and from the one before the last, at least)."""
        marks = self._marks
        keep = 2 if marks and marks[-1][1] >= done else 1  # between commits: two
        if len(marks) < keep:
            return None
        cut = t - self.window
        j = 0
        while j + keep < len(marks) and marks[j + 1][0] <= cut:
            j += 1
        del marks[:j]
        t0, n0 = marks[0]
        return (done - n0) / (t - t0) if t > t0 and done > n0 else None

    def update(self, t: float, done: int, left: int, busy: bool = True,
               restarts: int = 0) -> None:
        if restarts != self._restarts:
            self._restarts = restarts
            self.reset()
        prev, self._done = self._done, done
        before, self._left = self._left, left
        committed = prev is not None and done > prev
        if not busy and not committed:
            self.reset()  # idle: the spell is over (idle time never counts)
            return
        if committed:
            if self._marks:
                self._rate = self._rate_since(t, done)
            self._marks.append((t, done))
            self._deadline = None if self._rate is None else t + left / self._rate
            return
        if self._deadline is None or self._rate is None:
            return
        if left != before:  # arrivals (or retention) between commits: at the same rate
            self._deadline += (left - before) / self._rate
        if self._deadline <= t and left > 0:  # run out: slower than before
            r = self._rate_since(t, done)
            if r is not None:
                self._rate, self._deadline = r, t + left / r

    def left(self, t: float) -> float | None:
        """Seconds left at ``t`` (0 when nothing is left); None while estimating."""
        if self._left <= 0:
            return 0.0
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - t)
