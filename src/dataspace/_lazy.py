"""Package attributes that load their submodule on first use (PEP 562).

A process that needs one part of the package -- a Spark Python worker reading a stream,
say, started afresh for every query -- should not pay for importing every other part.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], where: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__``: ``where`` maps an exported name to the
    submodule defining it; the first access imports that submodule and keeps the value
    in ``namespace`` (the package's ``globals()``), so later accesses cost nothing."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        mod = where.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{mod}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
