"""The command's argument parser: help that fits the terminal, typos answered with a guess.

Every parser of the command is a :class:`Parser` (argparse gives subparsers the class of
their parent), so these hold for every command and subcommand:

* the description and epilog keep the line breaks they were written with while they fit
  the terminal; a paragraph wider than it (written as one line, or for a wider
  terminal) is refilled to it, and a wide example row wraps its comment under its own
  column, rather than the terminal cutting words anywhere;
* an option the command does not have is reported by that command (``dataspace send:
  error: unrecognized arguments: --sever (did you mean --server?)``), with its usage,
  not by the top-level parser with the top-level usage;
* a misspelt command or subcommand gets the likely intended one (``did you mean
  'observe'?``).
"""

from __future__ import annotations

import argparse
import difflib
import re
import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["HelpFormatter", "Parser"]


_GAP = re.compile(r"\S( {3,})\S")
"""Three spaces or more inside a line: a column layout (an example and what it does)."""

_COMMAND = ("dataspace ", "$ ", "printf ", ".venv/", "python ")


def _is_row(line: str) -> bool:
    """A line laid out as written (an example, a table row), not prose to refill."""
    body = line.strip()
    return bool(_GAP.search(body)) or body.startswith(_COMMAND)


def _wrap_row(line: str, width: int, fits: int) -> list[str]:
    """A row wider than the terminal: what follows its last column gap (the comment) is
    wrapped under that column; a row without one hangs under its own start."""
    lead = line[: len(line) - len(line.lstrip())]
    gaps = list(_GAP.finditer(line, len(lead)))
    if gaps and gaps[-1].end(1) <= fits - 24:
        column = gaps[-1].end(1)
        return textwrap.wrap(line[column:], width, initial_indent=line[:column],
                             subsequent_indent=" " * column, break_long_words=False,
                             break_on_hyphens=False) or [line]
    return textwrap.wrap(line.strip(), width, initial_indent=lead,
                         subsequent_indent=lead + "    ", break_long_words=False,
                         break_on_hyphens=False) or [line]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written while they fit the terminal; a paragraph
    wider than it is refilled, and a wide example row wraps its comment under itself."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        # argparse's width is the terminal's less 2: text that fits the terminal stays.
        fits = width + 2 - len(indent)
        lines = text.splitlines()
        out: list[str] = []
        i = 0
        while i < len(lines):
            line = lines[i]
            if not line.strip() or _is_row(line):
                out.extend([line] if len(line) <= fits else _wrap_row(line, width, fits))
                i += 1
                continue
            # A paragraph: prose lines of one indentation.
            lead = line[: len(line) - len(line.lstrip())]
            j = i + 1
            while (j < len(lines) and lines[j].strip() and not _is_row(lines[j])
                   and lines[j][: len(lines[j]) - len(lines[j].lstrip())] == lead):
                j += 1
            para = lines[i:j]
            if all(len(x) <= fits for x in para):
                out.extend(para)
            else:
                out.extend(textwrap.wrap(" ".join(x.strip() for x in para), width,
                                         initial_indent=lead, subsequent_indent=lead,
                                         break_long_words=False, break_on_hyphens=False))
            i = j
        return "\n".join(indent + x for x in out)


# Options other servers and clients call by these names (nats-server --addr/--port,
# redis-server --bind/--port, many tools' --listen/--host/--url): the first of ours that
# the command has is the guess, before any spelling match ('--listen' is not a misspelt
# '--link').
_SYNONYMS: dict[str, tuple[str, ...]] = {
    "--listen": ("--tcp",),
    "--bind": ("--tcp",),
    "--addr": ("--tcp", "--server"),
    "--address": ("--tcp", "--server"),
    "--port": ("--tcp", "--server"),
    "--host": ("--server", "--tcp"),
    "--url": ("--server",),
    "--connect": ("--server",),
}


def _guess(word: str, choices: Sequence[str]) -> str | None:
    for synonym in _SYNONYMS.get(word, ()):
        if synonym in choices:
            return synonym
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


class Parser(argparse.ArgumentParser):
    """An argument parser whose help fits the terminal and whose errors guess typos."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("formatter_class") in (None, argparse.HelpFormatter,
                                             argparse.RawDescriptionHelpFormatter):
            kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            # Said by the (sub)command that was given them, with its usage (argparse
            # passes a subcommand's leftovers up to the top-level parser, which said
            # "dataspace: error" with the usage of `dataspace` itself).  The command
            # never asks for leftovers: they are always an error.
            self.error(self._unrecognized(extras))
        return parsed, extras

    def _unrecognized(self, extras: list[str]) -> str:
        options = [s for a in self._actions for s in a.option_strings]
        guesses = []
        for extra in extras:
            if extra.startswith("-") and len(extra) > 2:
                given = extra.split("=", 1)[0]
                guess = _guess(given, options)
                if guess is not None:
                    guesses.append((given, guess))
        if len(guesses) == 1:
            hint = f"did you mean {guesses[0][1]}?"
        elif guesses:
            hint = "did you mean " + ", ".join(f"{g} for {e}" for e, g in guesses) + "?"
        else:
            hint = f"see {self.prog} --help"
        return f"unrecognized arguments: {' '.join(extras)} ({hint})"

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            if action.choices is None or not isinstance(value, str):
                raise
            guess = _guess(value, [str(c) for c in action.choices])
            if guess is None:
                raise
            message = e.message.replace(" (choose from", f": did you mean {guess!r}? (choose from", 1)
            raise argparse.ArgumentError(action, message) from None
