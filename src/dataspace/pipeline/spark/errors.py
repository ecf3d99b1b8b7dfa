"""The connector's errors as one line, wherever Spark reports them.

The ``dataspace`` source and writer run in Python processes Spark starts; an error there
(a bad option, a stream that does not exist) comes back to the program as Spark's
exception whose message is the worker's whole traceback, wrapped in Spark's own text::

    [PYTHON_DATA_SOURCE_ERROR] Failed to create Python data source instance: Traceback
    (most recent call last): ... dataspace.pipeline.spark.source.OptionError: option
    mode: one of each, join, alts, not 'both'  SQLSTATE: 38000

:func:`install` makes PySpark give such an exception the one line that matters --
``option mode: one of each, join, alts, not 'both'`` -- as its message (the exception's
class is unchanged: ``except AnalysisException`` still catches it).  PySpark has no hook
for this: :func:`install` wraps the function it converts JVM errors with
(``pyspark.errors.exceptions.captured.convert_exception``); if a PySpark version lacks
it, nothing changes and messages stay long.  :func:`error_line` finds the line in any
text (the Spark engine reports a failed query with it).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

__all__ = ["damage_line", "error_line", "install"]

log = logging.getLogger(__name__)

# The last line of a Python traceback that names an exception class of this package:
# "dataspace.pipeline.spark.source.OptionError: option mode: ..."
_LINE = re.compile(r"^\s*dataspace\.[\w.]+\.\w+: (.+?)\s*$", re.M)

_lock = threading.Lock()
_installed = False


def error_line(text: str) -> str | None:
    """The message of the last ``dataspace`` exception named in ``text`` (a Spark error's
    message or traceback), or None if there is none."""
    found = _LINE.findall(text)
    return found[-1] if found else None


_DAMAGE = re.compile(r"^\s*dataspace\.streams\.base\.StoreCorrupt: (.+?)\s*$", re.M)


def damage_line(text: str) -> str | None:
    """The message of a :class:`~dataspace.streams.StoreCorrupt` named in ``text`` (a
    damaged store, found by a read in a task), or None."""
    found = _DAMAGE.findall(text)
    return found[-1] if found else None


def install() -> None:
    """From now on, Spark exceptions caused by an error of this package have that error's
    message as their whole message (see the module docstring).  Idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        try:
            from pyspark.errors.exceptions import captured
        except ImportError:  # pragma: no cover - PySpark moved it: messages stay long
            return
        original = getattr(captured, "convert_exception", None)
        if original is None:  # pragma: no cover
            log.debug("pyspark has no convert_exception; connector errors stay verbose")
            return

        def convert_exception(e: Any) -> Any:
            converted = original(e)
            try:
                desc = getattr(converted, "_desc", None)
                line = error_line(desc) if isinstance(desc, str) else None
                if line is not None:
                    converted._desc = line
                    converted._stackTrace = ""
                    if isinstance(converted, captured.PythonException):
                        # An error in a task (a partition's read): its str() is the
                        # worker's traceback, from the JVM error, unless that goes.
                        converted._origin = None
                    converted = converted.with_traceback(None)
            except Exception:  # never make an error worse than it was
                log.debug("cannot shorten a Spark error", exc_info=True)
            return converted

        captured.convert_exception = convert_exception
        _installed = True
