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
``rate=False`` leaves the rate out (a soak's progress is its clock).  Stdlib only: it
imports nothing from the rest of the package, so every layer may use it.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["Progress", "hms"]


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

    def __call__(self, done: int, total: int | None = None, *, note: str | None = None) -> None:
        """``done`` items so far (of ``total``, if it is given or changed)."""
        self.update(done, total, note=note)

    def update(self, done: int, total: int | None = None, *, note: str | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
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


def _columns(out: Any) -> int:
    try:
        return shutil.get_terminal_size((120, 24)).columns if hasattr(out, "fileno") else 120
    except (OSError, ValueError):
        return 120
