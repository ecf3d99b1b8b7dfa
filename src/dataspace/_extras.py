"""The optional parts of the install (pyproject.toml's extras) and the one message for a
missing one.

``pip install dataspace`` is the broker, the clients, TLS, the HTTP port and inspector,
streams on SQLite, the local pipeline engine and the CLI.  Two parts need libraries that
most users of the broker do not want (about 700 MB for Spark):

* ``dataspace[spark]`` -- the Spark engine, the Spark connector and ``pipeline route``:
  PySpark, PyArrow, pandas, NumPy;
* ``dataspace[postgres]`` -- the PostgreSQL stream store: psycopg and its pool;
* ``dataspace[all]`` -- both.

Those libraries are imported only where they are used, so ``import dataspace`` and every
command's ``--help`` work without them.  The code that is about to use one calls
:func:`require` first: where the extra is not installed it raises :class:`MissingExtra`,
an ``ImportError`` whose message is the one line to show (what needs it, and the command
that installs it); the ``dataspace`` command prints it as ``dataspace COMMAND: MESSAGE``
and exits with status 2.

>>> require("spark", "the Spark engine")            # doctest: +SKIP
MissingExtra: the Spark engine needs PySpark, which is not installed: pip install 'dataspace[spark]'
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

__all__ = ["EXTRAS", "Extra", "MissingExtra", "install_command", "missing", "require"]


@dataclass(frozen=True)
class Extra:
    """One extra of the package: its name in ``pip install 'dataspace[NAME]'``, the
    top-level modules it brings (what :func:`require` looks for), and the name a user
    knows it by (said when all of them are missing)."""

    name: str
    modules: tuple[str, ...]
    label: str
    what: str  # what it is for, in a message with no more specific subject


EXTRAS: dict[str, Extra] = {
    "spark": Extra("spark", ("pyspark", "pyarrow", "pandas", "numpy"), "PySpark",
                   "Spark"),
    "postgres": Extra("postgres", ("psycopg", "psycopg_pool"), "psycopg",
                      "a PostgreSQL store"),
}
"""The extras by name.  Each module here comes from a requirement of that extra in
pyproject.toml (``tests/test_extras.py`` holds the two together)."""


class MissingExtra(ImportError):
    """An optional part of the install is missing; ``str()`` is the one line to show."""

    def __init__(self, extra: str, missing: tuple[str, ...], what: str, hint: str = "") -> None:
        self.extra = extra
        self.missing = missing
        self.what = what
        self.hint = hint
        super().__init__(self._message(), name=missing[0] if missing else None)

    def _message(self) -> str:
        e = EXTRAS[self.extra]
        if not self.missing or set(self.missing) == set(e.modules):
            needs = e.label
        else:
            needs = _and(list(self.missing))
        verb = "is" if needs == e.label or len(self.missing) == 1 else "are"
        line = (f"{self.what} needs {needs}, which {verb} not installed: "
                f"{install_command(self.extra)}")
        return f"{line} -- {self.hint}" if self.hint else line

    def __str__(self) -> str:
        return self._message()

    def __reduce__(self) -> tuple[object, ...]:  # pickled across processes (Spark)
        return (type(self), (self.extra, self.missing, self.what, self.hint))


def install_command(extra: str) -> str:
    """The command that installs ``extra`` (quoted for any shell)."""
    return f"pip install 'dataspace[{extra}]'"


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _importable(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (cheap: no PySpark start-up).
    A finder that refuses it (``ImportError``) or ``sys.modules[module] = None`` count as
    missing, as the import statement would treat them."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing(extra: str) -> tuple[str, ...]:
    """The modules of ``extra`` that cannot be imported here (empty: it is installed)."""
    try:
        e = EXTRAS[extra]
    except KeyError:
        raise ValueError(f"unknown extra {extra!r}; the extras are: {', '.join(EXTRAS)}") from None
    return tuple(m for m in e.modules if not _importable(m))


def require(extra: str, what: str | None = None, *, hint: str = "") -> None:
    """Raise :class:`MissingExtra` unless every module of ``extra`` can be imported.
    ``what`` is the subject of the message ("the Spark engine", "a PostgreSQL store");
    ``hint`` another way out, said after the install command ("or run in this process
    with --engine local")."""
    gone = missing(extra)
    if gone:
        # from None: raised where an import just failed, that ImportError says no more
        raise MissingExtra(extra, gone, what or EXTRAS[extra].what, hint) from None
