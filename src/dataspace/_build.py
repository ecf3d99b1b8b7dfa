"""Which build of the core runs here: compiled (mypyc) or pure Python.  One place for it.

The hot modules of the core (:data:`COMPILED_MODULES`) are compiled from their own Python
source where a C compiler is present (``setup.py``, when the package is installed); the
extension modules sit beside the ``.py`` files under the same names, and the import
system prefers them.  The ``.py`` files stay the source, the reference and the fallback:

* ``DATASPACE_PURE=1`` at install builds no extension; at run time it makes the process
  import the ``.py`` files even where the extensions exist.
* Extensions built for another platform or Python, ones that fail to load, and ones older
  than their source (a checkout edited since the last ``make setup``) are not used: pure
  Python runs, and a warning says why, once.
* Imported from a zip (Spark's ``addPyFile``: :func:`compiled_files` are what the zip
  needs), the package runs the compiled core when the zip holds one built for this
  platform and Python: its extension modules are extracted beside the zip (the import
  system cannot load them from inside it).  Otherwise it runs the source in the zip.
* :func:`load_pure` imports the pure source of a core module under another name
  (``dataspace._pure.…``) beside the compiled build: the differential tests run both in
  one process.

``dataspace --version`` says which build runs.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import zipimport
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

# The modules compiled into the core (setup.py reads this literal).  Listing a module here
# is all it takes to compile it: its source must then pass mypy (mypyc's type check).
COMPILED_MODULES: tuple[str, ...] = (
    "dataspace.values.model",
    "dataspace.values.binary",
    "dataspace.pattern",
    "dataspace.index",
    "dataspace.dataspace",
    "dataspace.protocol.wire",
    "dataspace.protocol.route",
    "dataspace.protocol.relay",
)

GROUP = "dataspace_core"
"""mypyc's name for the compiled group: its shared library is the top-level module
``dataspace_core__mypyc`` (mypyc sets each module's ``__file__`` relative to it)."""

INFO_FILE = "_core_build.json"
"""Written beside the package's ``__init__`` by the build: compiler, platform, sources."""

PURE_PREFIX = "dataspace._pure."
"""Where :func:`load_pure` imports the pure source of the core."""

# Modules the pure copies share with the running build rather than load again: the
# exception classes, so that ``except DecodeError`` works for both.
_SHARED = ("dataspace.values.errors",)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_log = logging.getLogger("dataspace")


@dataclass(frozen=True)
class Build:
    """The build running in this process."""

    compiled: bool
    compiler: str | None  # e.g. "mypyc 2.4.1"
    modules: tuple[str, ...]  # the compiled modules in use (empty when pure)
    reason: str  # why pure Python runs ("" when compiled)

    def describe(self) -> str:
        """One line: ``compiled: mypyc 2.4.1; modules: values, pattern`` or
        ``pure Python: why``."""
        if self.compiled:
            return f"compiled: {self.compiler}; modules: {', '.join(short_names(self.modules))}"
        return f"pure Python: {self.reason}" if self.reason else "pure Python"

    def as_dict(self) -> dict[str, object]:
        return {
            "compiled": self.compiled,
            "compiler": self.compiler,
            "modules": list(self.modules),
            "reason": self.reason,
            "describe": self.describe(),
        }


def short_names(modules: Sequence[str]) -> list[str]:
    """``dataspace.values.model`` -> ``values`` (one name per top-level part, in order)."""
    out: list[str] = []
    for m in modules:
        part = m.removeprefix("dataspace.").split(".")[0]
        if part not in out:
            out.append(part)
    return out


def source_path(module: str) -> str:
    """The ``.py`` file of a module of this package (it need not exist)."""
    rel = module.removeprefix("dataspace.").split(".")
    return os.path.join(_PACKAGE_DIR, *rel) + ".py"


def source_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def extension_suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def _extension_path(module: str) -> str:
    return source_path(module)[: -len(".py")] + extension_suffix()


def _group_lib() -> str:
    return GROUP + "__mypyc"


def _zip_loader() -> zipimport.zipimporter | None:
    """The zip importer when this package is imported from a zip archive."""
    loader = globals().get("__loader__")
    return loader if isinstance(loader, zipimport.zipimporter) else None


def compiled_files() -> list[tuple[str, str]]:
    """The files of the running compiled core, as ``(path, name in a zip of the package)``
    (the package's directory holding ``dataspace``): what a zip of the package must carry
    to run compiled elsewhere.  Empty when pure Python runs."""
    if not BUILD.compiled or _zip_loader() is not None:
        return []
    root = os.path.dirname(_PACKAGE_DIR)
    out = [(os.path.join(_PACKAGE_DIR, INFO_FILE), f"dataspace/{INFO_FILE}")]
    for m in BUILD.modules:
        path = _extension_path(m)
        out.append((path, os.path.relpath(path, root).replace(os.sep, "/")))
    spec = importlib.util.find_spec(_group_lib())
    if spec is None or not spec.origin:  # pragma: no cover - BUILD.compiled imported it
        return []
    out.append((spec.origin, os.path.basename(spec.origin)))
    return out


class _ExtensionFinder:
    """Finds the compiled core's extension modules in a directory of their own."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths = paths

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        where = self.paths.get(fullname)
        if where is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, where)
        return importlib.util.spec_from_file_location(fullname, where, loader=loader)


def _zip_member(z: zipimport.zipimporter, module: str, ext: str = ".py") -> bytes:
    """A file of the zip by its name in the zip (Spark puts the zip on the path by a
    relative name, so the absolute path of the file is not the key to ask for)."""
    return z.get_data(module.replace(".", "/") + ext)


def _extract_from_zip(z: zipimport.zipimporter, info_raw: bytes, mods: Sequence[str]) -> str:
    """Extract the compiled core from the zip beside it (once: the directory is named by
    the build record); return the directory."""
    archive = os.path.abspath(z.archive)
    suffix = extension_suffix()
    names = [_group_lib() + suffix] + [m.replace(".", "/") + suffix for m in mods]
    target = os.path.join(
        os.path.dirname(archive), "dataspace-core-" + hashlib.sha256(info_raw).hexdigest()[:16]
    )
    if not os.path.isdir(target):
        tmp = f"{target}.{os.getpid()}.tmp"
        for name in names:
            dest = os.path.join(tmp, *name.split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as f:
                f.write(z.get_data(name))
        try:
            os.rename(tmp, target)
        except OSError:  # another process extracted it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _pure_requested() -> bool:
    return os.environ.get("DATASPACE_PURE", "").strip() not in ("", "0")


class _SourceFinder:
    """Finds the ``.py`` source of the compiled modules, ahead of their extensions."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = frozenset(modules)

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


def _choose() -> Build:
    mods = COMPILED_MODULES
    if _pure_requested():
        return Build(False, None, (), "DATASPACE_PURE is set")
    z = _zip_loader()
    info_path = os.path.join(_PACKAGE_DIR, INFO_FILE)
    try:
        if z is not None:
            try:
                info_raw = _zip_member(z, "dataspace." + INFO_FILE[: -len(".json")], ".json")
            except OSError:
                # (zipimport reports a missing member as a bare OSError; the zip itself
                # was read, since this module came from it.)
                raise FileNotFoundError(INFO_FILE) from None
        else:
            with open(info_path, "rb") as f:
                info_raw = f.read()
        info = json.loads(info_raw)
    except FileNotFoundError:
        return Build(False, None, (), "no compiled core installed")
    except (OSError, ValueError) as e:
        return Build(False, None, (), f"unreadable {INFO_FILE}: {e}")
    if not info.get("compiled"):
        return Build(False, None, (), str(info.get("reason") or "built pure"))
    if info.get("ext_suffix") != extension_suffix():
        return Build(
            False, None, (), f"compiled core built for {info.get('ext_suffix')}, not this Python"
        )
    built = info.get("sources") or {}
    for m in mods:
        if m not in built:
            return Build(False, None, (), f"{m} is not in the compiled core; rebuild it")
        if z is not None:
            try:
                same = hashlib.sha256(_zip_member(z, m)).hexdigest() == built[m]
            except OSError:
                same = False
            if not same:
                return Build(False, None, (), f"the zip's {m} is not the one compiled")
            continue
        if not os.path.exists(_extension_path(m)):
            return Build(False, None, (), f"compiled {m} is missing")
        src = source_path(m)
        if os.path.exists(src) and source_digest(src) != built[m]:
            rel = os.path.relpath(src, os.path.dirname(_PACKAGE_DIR))
            return Build(
                False,
                None,
                (),
                f"{rel} changed since the core was compiled; rebuild with `make setup` "
                "(pip install -e .)",
            )
    finder = None
    if z is not None:
        try:
            where = _extract_from_zip(z, info_raw, mods)
        except OSError as e:
            return Build(False, None, (), f"cannot extract the compiled core from the zip: {e}")
        suffix = extension_suffix()
        paths = {m: os.path.join(where, *m.split(".")) + suffix for m in mods}
        paths[_group_lib()] = os.path.join(where, _group_lib() + suffix)
        finder = _ExtensionFinder(paths)
        sys.meta_path.insert(0, finder)
    try:
        importlib.import_module(_group_lib())
    except ImportError as e:
        if finder is not None:
            sys.meta_path.remove(finder)
        return Build(False, None, (), f"compiled core does not load: {e}")
    return Build(True, str(info.get("compiler")), mods, "")


def _select() -> Build:
    """Decide once per process, before any core module is imported."""
    b = _choose()
    if not b.compiled:
        if any(m in sys.modules for m in COMPILED_MODULES):  # pragma: no cover - misuse
            _log.warning("dataspace: core imported before its build was chosen")
        # (From a zip, only the source can be imported anyway.)
        if _zip_loader() is None and not any(isinstance(f, _SourceFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _SourceFinder(COMPILED_MODULES))
        quiet = ("DATASPACE_PURE", "no compiled core", "compiled core built for")
        if b.reason and not b.reason.startswith(quiet):
            _log.warning("dataspace: running the pure-Python core: %s", b.reason)
    return b


BUILD: Build = _select()
"""The build chosen for this process."""


def build_info() -> dict[str, object]:
    """What runs, as JSON-ready data (the server's summary, ``dataspace info``); the
    ``running`` list is checked against the modules actually imported."""
    d = BUILD.as_dict()
    d["running"] = [m for m in COMPILED_MODULES if is_compiled_module(sys.modules.get(m))]
    return d


def is_compiled_module(module: ModuleType | None) -> bool:
    """Whether ``module`` is an extension module (rather than Python source)."""
    f = getattr(module, "__file__", None) or ""
    return f.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


class _PureFinder:
    """Imports ``dataspace._pure.X`` from the source of ``dataspace.X``."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == PURE_PREFIX[:-1]:
            return importlib.machinery.ModuleSpec(fullname, _EmptyPackage(), is_package=True)
        if not fullname.startswith(PURE_PREFIX):
            return None
        real = "dataspace." + fullname[len(PURE_PREFIX) :]
        src = source_path(real)
        if os.path.exists(src):
            return importlib.util.spec_from_file_location(fullname, src)
        init = os.path.join(src[: -len(".py")], "__init__.py")
        if os.path.exists(init):
            return importlib.util.spec_from_file_location(
                fullname, init, submodule_search_locations=[os.path.dirname(init)]
            )
        return None


class _EmptyPackage:
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        m = ModuleType(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module: ModuleType) -> None:
        pass


def load_pure(module: str) -> ModuleType:
    """The pure-Python ``module`` (e.g. ``"dataspace.values.binary"``), imported from its
    source as ``dataspace._pure.…`` with pure copies of the core modules it imports; the
    running build is left as it is.  For the differential tests."""
    if not module.startswith("dataspace."):
        raise ValueError(f"not a module of dataspace: {module}")
    if not any(isinstance(f, _PureFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PureFinder())
    for shared in _SHARED:
        sys.modules.setdefault(
            PURE_PREFIX + shared.removeprefix("dataspace."), importlib.import_module(shared)
        )
    return importlib.import_module(PURE_PREFIX + module.removeprefix("dataspace."))
