"""The benchmarks' progress: their measured steps with the time left, through the shared
helper (:mod:`dataspace.progress`) -- a bar on standard error at a terminal, plain lines
in a log -- while their figures go to standard output either way (:func:`say`)."""

from __future__ import annotations

import sys

from dataspace.progress import Progress

BAR: Progress | None = None


def start_steps(total: int) -> Progress:
    """Begin counting ``total`` steps (before it, :func:`say` just prints)."""
    global BAR
    BAR = Progress(sys.stderr, what="steps", verb="benchmark", rate=False, total=total)
    return BAR


def say(text: str = "") -> None:
    """A line of figures on standard output, without garbling the bar."""
    if BAR is not None:
        BAR.echo(text)
    else:
        print(text, flush=True)


def step(note: str) -> None:
    """One measured step done."""
    if BAR is not None:
        BAR.advance(note=note)


def skip(n: int) -> None:
    """``n`` steps that will not run (a store or a cluster that is not there)."""
    if BAR is not None and BAR.total is not None:
        BAR.update(BAR.done, BAR.total - n)


def finish() -> None:
    if BAR is not None:
        BAR.finish()
