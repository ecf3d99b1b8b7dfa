"""The package's layers (shared/DESIGN.md, the README's Layout): a lower layer never
imports a higher one, and the product imports none of the fault harnesses of
``dataspace.testing``.

Every ``import`` of every module counts, those inside functions (imported where called)
and under ``TYPE_CHECKING`` too: a late import is still a dependency."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import dataspace

ROOT = Path(dataspace.__file__).resolve().parent

# Lowest first; a module may import its own layer and the ones before it.
LAYERS: list[tuple[str, ...]] = [
    # The helpers every layer may use: they import nothing else of the package.
    ("_build", "_extras", "_interrupt", "_lazy", "_threads", "progress", "datadir"),
    ("values",),
    ("pattern",),
    ("index",),
    ("dataspace", "groups"),  # groups of observers live where observers do
    ("protocol",),
    ("net",),
    ("broker", "client", "scry"),  # the server, the remote API, the stream reader's API
    ("streams",),
    ("web",),
    ("pipeline",),
    ("cli", "__main__"),
    ("testing",),  # the fault harnesses: above everything, imported by nothing below
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ["dataspace", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "dataspace"


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, module imported) for every import of the package in ``path``."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            # ``from . import x`` imports the module x (when it is one)
            names = [f"{target}.{a.name}" for a in node.names]
            out += [(node.lineno, n if n in MODULES else target) for n in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return [(ln, t) for ln, t in out if t == "dataspace" or t.startswith("dataspace.")]


MODULES = _modules()


def test_every_module_has_a_layer():
    assert {_layer(m) for m in MODULES} - RANK.keys() == set()


def test_no_layer_imports_a_higher_one():
    wrong = []
    for module, path in MODULES.items():
        mine = RANK[_layer(module)]
        for line, target in _imports(module, path):
            if RANK[_layer(target)] > mine:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: {module} ({_layer(module)})"
                             f" imports {target} ({_layer(target)})")
    assert wrong == [], "\n".join(wrong)


def test_the_checker_sees_a_late_import_up_a_layer(tmp_path):
    """(The check above reads imports inside functions too.)"""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from ..cli import main\n    return main\n")
    assert _imports("dataspace.net.m", src) == [(2, "dataspace.cli")]


def test_importing_every_product_module_imports_no_harness():
    """Every module outside dataspace.testing, imported in a fresh interpreter (the
    Spark and PostgreSQL extras included): not one module of dataspace.testing loaded."""
    product = sorted(m for m in MODULES
                     if _layer(m) != "testing" and not m.endswith("__main__"))
    code = ("import importlib, sys\n"
            f"for m in {product!r}:\n"
            "    importlib.import_module(m)\n"
            "print(len({m for m in sys.modules if m.startswith('dataspace.')}))\n"
            "print(sorted(m for m in sys.modules if m.startswith('dataspace.testing')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    count, harnesses = r.stdout.splitlines()[-2:]
    assert int(count) >= len(product) - 1  # (dataspace itself is not 'dataspace.')
    assert harnesses == "[]"


def test_every_harness_runs_as_python_m():
    """The harnesses are programs: ``python -m dataspace.testing.NAME --help`` for each
    (the Makefile's soak targets run them so)."""
    harnesses = sorted(m for m in MODULES if _layer(m) == "testing"
                       and "__name__ == \"__main__\"" in MODULES[m].read_text(encoding="utf-8"))
    assert {"dataspace.testing.broker_soak", "dataspace.testing.pipeline_crash",
            "dataspace.testing.spark_crash", "dataspace.testing.record_crash"} <= set(harnesses)
    for m in harnesses:
        r = subprocess.run([sys.executable, "-m", m, "--help"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and r.stdout.startswith(f"usage: python -m {m}"), (m, r.stderr)
