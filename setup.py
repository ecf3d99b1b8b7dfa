"""The compiled core of dataspace: its one build step (the rest is in pyproject.toml).

The hot modules listed in ``src/dataspace/_build.py`` (``COMPILED_MODULES``) are compiled
from their Python source by mypyc into extension modules installed beside the ``.py``
files (in the source tree for an editable install).  Where that cannot be done -- no C
compiler or Python headers, mypyc missing, the source failing mypyc's type check, the C
compiler failing -- the package installs as pure Python and says so in one line (see
``pip install -v``; ``dataspace --version`` says which build runs).  ``DATASPACE_PURE=1``
builds pure Python on purpose.

The build writes ``dataspace/_core_build.json`` (compiler, platform, a digest of each
compiled source) so that ``dataspace._build`` uses extensions only when they match the
source and the interpreter.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import hashlib
import io
import json
import os
import shutil
import sys
import sysconfig

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "src")
PACKAGE = os.path.join(SRC, "dataspace")
INFO_FILE = "_core_build.json"
GROUP = "dataspace_core"  # the shared library: dataspace_core__mypyc, top level (mypyc puts
# each module's __file__ relative to it)


def notice(message: str) -> None:
    """The one line a user sees about the build (stderr: pip shows it with -v)."""
    sys.stderr.write(f"dataspace: {message}\n")
    sys.stderr.flush()


def compiled_modules() -> list[str]:
    """COMPILED_MODULES from src/dataspace/_build.py, read without importing the package."""
    with open(os.path.join(PACKAGE, "_build.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if isinstance(target, ast.Name) and target.id == "COMPILED_MODULES":
            return list(ast.literal_eval(node.value))  # type: ignore[attr-defined]
    raise RuntimeError("COMPILED_MODULES not found in src/dataspace/_build.py")


def source_file(module: str) -> str:
    return os.path.join(SRC, *module.split(".")) + ".py"


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def ext_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def inplace_artefacts(modules: list[str]) -> list[str]:
    """Extension files a previous build left in the source tree (editable installs)."""
    found = [os.path.join(PACKAGE, INFO_FILE)]
    for m in modules:
        found += glob.glob(source_file(m)[: -len(".py")] + ".*.so")
        found += glob.glob(source_file(m)[: -len(".py")] + ".*.pyd")
    found += glob.glob(os.path.join(SRC, GROUP + "__mypyc.*"))
    return [f for f in found if os.path.exists(f)]


def remove_inplace_artefacts(modules: list[str]) -> None:
    for f in inplace_artefacts(modules):
        with contextlib.suppress(OSError):
            os.remove(f)


def why_no_compiler() -> str | None:
    """Why C extensions cannot be built here, or None (checked before mypyc's slow part)."""
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.exists(os.path.join(include, "Python.h")):
        return f"no Python headers ({include}/Python.h)"
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc})"
    return None


def mypyc_extensions(modules: list[str]) -> tuple[list[object], str]:
    """mypyc's extensions for ``modules`` (type check and C generation happen here), or
    ``([], why)``.  mypyc's own output is kept back: the notice says it in one line."""
    try:
        import mypy.version
        from mypyc.build import mypycify
    except ImportError as e:
        return [], f"mypyc is not available ({e})"
    out = io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(HERE)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exts = mypycify(
                [os.path.relpath(source_file(m), HERE) for m in modules]
                + ["--follow-imports=silent", "--ignore-missing-imports"],
                opt_level="3",
                debug_level="0",
                group_name=GROUP,
                target_dir=os.path.join("build", "mypyc"),
            )
    except (SystemExit, Exception) as e:  # mypyc reports type errors by exiting
        first = next((ln for ln in out.getvalue().splitlines() if "error" in ln), "")
        return [], f"mypyc failed ({first or e!r})"
    finally:
        os.chdir(cwd)
    return list(exts), f"mypyc {mypy.version.__version__}"


class BuildCore(build_ext):
    """build_ext that falls back to pure Python on any failure, and records the build."""

    compiler_name = ""
    modules: list[str] = []

    def run(self) -> None:
        if self.inplace or getattr(self, "editable_mode", False):
            remove_inplace_artefacts(self.modules)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                super().run()
        except Exception as e:  # compiler or linker errors: install pure Python
            lines = [ln for ln in out.getvalue().splitlines() if "error" in ln.lower()]
            msg = str(e)
            why = lines[0].strip() if lines else f"{type(e).__name__}: {'...' * (len(msg) > 100)}{msg[-100:]}"
            notice(f"the C build of the core failed, installing pure Python ({why[:200]})")
            for f in self.get_outputs():
                with contextlib.suppress(OSError):
                    os.remove(f)
            remove_inplace_artefacts(self.modules)
            self.write_info({"compiled": False, "reason": f"C build failed: {why[:200]}"})
            return
        self.write_info(
            {
                "compiled": True,
                "compiler": self.compiler_name,
                "ext_suffix": ext_suffix(),
                "python": sys.version.split()[0],
                "platform": sysconfig.get_platform(),
                "sources": {m: digest(source_file(m)) for m in self.modules},
            }
        )
        notice(f"compiled core built ({self.compiler_name}: {', '.join(self.modules)})")

    def write_info(self, info: dict[str, object]) -> None:
        targets = [os.path.join(self.build_lib, "dataspace")]
        if self.inplace or getattr(self, "editable_mode", False):
            targets.append(PACKAGE)
        for d in targets:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, INFO_FILE), "w", encoding="utf-8") as f:
                json.dump(info, f, indent=1, sort_keys=True)
                f.write("\n")


# The commands that build (PEP 517 runs this file for metadata too: no compiling then).
BUILDING = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


def main() -> None:
    modules = compiled_modules()
    exts: list[object] = []
    if not BUILDING.intersection(sys.argv[1:]):
        pass
    elif os.environ.get("DATASPACE_PURE", "").strip() not in ("", "0"):
        notice("DATASPACE_PURE is set: installing the pure-Python core")
    elif (why := why_no_compiler()) is not None:
        notice(f"{why}: installing the pure-Python core")
    else:
        exts, compiler = mypyc_extensions(modules)
        if exts:
            BuildCore.compiler_name = compiler
        else:
            notice(f"{compiler}: installing the pure-Python core")
    if not exts and BUILDING.intersection(sys.argv[1:]):
        # No build_ext runs: clear what an earlier compiled build left in the source tree
        # (the package then finds no compiled core and imports its source).
        remove_inplace_artefacts(modules)
    BuildCore.modules = modules
    setup(ext_modules=exts, cmdclass={"build_ext": BuildCore})


main()
