"""What each install form costs: a fresh virtual environment's size and ``pip install``'s
time, from the wheel, for the broker alone and each extra.

    .venv/bin/python benchmarks/bench_install.py                  # make bench-install
    .venv/bin/python benchmarks/bench_install.py --wheel dist/dataspace-0.1.0-*.whl
    .venv/bin/python benchmarks/bench_install.py --forms base,postgres --no-cache

For each form -- ``dataspace`` (the broker, clients, TLS, the HTTP port, SQLite streams,
the local engine, the CLI), ``dataspace[postgres]``, ``dataspace[spark]``,
``dataspace[all]`` -- in a temporary directory: ``python -m venv`` (not timed), then
``pip install WHEEL[EXTRA]`` timed, then the environment's size on disk (as ``du``
counts it: blocks, each file once) and what the install added to the empty environment
(which is pip and, on Python 3.11, setuptools), and the number of distributions in it.
Last, ``dataspace --version`` in the broker's environment, as a check that what was
measured runs.

The wheel is ``--wheel``, else the newest ``dist/dataspace-*.whl``, else one built here
(``pip wheel --no-deps``: about a minute, compiling the core).  pip's cache is used as a
user's would be after a first install (``--no-cache`` downloads everything again: the
time then depends on the network).  Target for the broker alone: under 60 MB and 30 s.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMS = {"base": "", "postgres": "[postgres]", "spark": "[spark]", "all": "[all]"}
TARGET_MB, TARGET_S = 60.0, 30.0
MB = 1e6


def disk_usage(path: Path) -> int:
    """Bytes on disk under ``path`` as ``du`` counts them (blocks; hard links once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for d, dirs, files in os.walk(path):
        for name in dirs + files:
            st = os.lstat(os.path.join(d, name))
            key = (st.st_dev, st.st_ino)
            if key not in seen:
                seen.add(key)
                total += st.st_blocks * 512
    return total + os.lstat(path).st_blocks * 512


def wheel_path(given: str | None, tmp: Path) -> str:
    if given:
        found = glob.glob(given)
        if len(found) != 1:
            sys.exit(f"bench_install: --wheel {given} names {len(found)} files, not one")
        return os.path.abspath(found[0])
    found = sorted(glob.glob(str(ROOT / "dist" / "dataspace-*.whl")), key=os.path.getmtime)
    if found:
        return found[-1]
    print("no dist/dataspace-*.whl: building one (pip wheel --no-deps, compiling the core) ...",
          flush=True)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w",
                    str(tmp / "dist"), str(ROOT)], check=True, timeout=1800)
    print(f"built in {time.monotonic() - t0:.0f}s", flush=True)
    return glob.glob(str(tmp / "dist" / "dataspace-*.whl"))[0]


def measure(form: str, wheel: str, tmp: Path, cache: bool) -> dict[str, float]:
    venv = tmp / f"venv-{form}"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    empty = disk_usage(venv)
    py = str(venv / "bin" / "python")
    cmd = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           f"{wheel}{FORMS[form]}"]
    if not cache:
        cmd.insert(4, "--no-cache-dir")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    t0 = time.monotonic()
    r = subprocess.run(cmd, timeout=3600, env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True)
    took = time.monotonic() - t0
    if r.returncode != 0:  # pip's own notes are kept back unless it failed
        sys.exit(f"bench_install: {' '.join(cmd[1:])} failed (exit {r.returncode}):\n"
                 f"{r.stdout[-3000:]}{r.stderr[-3000:]}")
    total = disk_usage(venv)
    dists = len(glob.glob(str(venv / "lib" / "python*" / "site-packages" / "*.dist-info")))
    return {"seconds": took, "total": total, "empty": empty, "added": total - empty,
            "dists": dists}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", help="the wheel (default: the newest dist/dataspace-*.whl, "
                    "else one built here)")
    ap.add_argument("--forms", default=",".join(FORMS),
                    help=f"which forms, comma-separated (default {','.join(FORMS)})")
    ap.add_argument("--no-cache", action="store_true",
                    help="pip --no-cache-dir: download every package again")
    ap.add_argument("--keep", action="store_true", help="keep the environments")
    args = ap.parse_args()
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        ap.error(f"unknown form {unknown[0]!r}; the forms are: {', '.join(FORMS)}")
    tmp = Path(tempfile.mkdtemp(prefix="dataspace-bench-install-"))
    rows: dict[str, dict[str, float]] = {}
    try:
        wheel = wheel_path(args.wheel, tmp)
        print(f"wheel: {os.path.basename(wheel)} ({os.path.getsize(wheel) / MB:.1f} MB); "
              f"Python {sys.version.split()[0]}; pip's cache "
              f"{'not used' if args.no_cache else 'used'}", flush=True)
        for form in forms:
            rows[form] = r = measure(form, wheel, tmp, cache=not args.no_cache)
            print(f"  {form}: {r['seconds']:.1f}s, {r['total'] / MB:.0f} MB", flush=True)
        if "base" in rows:
            v = subprocess.run([str(tmp / "venv-base" / "bin" / "dataspace"), "--version"],
                               capture_output=True, text=True, timeout=60)
            print(f"the broker's environment runs: {' '.join(v.stdout.split())}")
    finally:
        if args.keep:
            print(f"environments kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("| form | pip install | environment | added by the install | distributions |")
    print("| --- | --- | --- | --- | --- |")
    for form, r in rows.items():
        name = f"`dataspace{FORMS[form]}`"
        print(f"| {name} | {r['seconds']:.1f} s | {r['total'] / MB:.0f} MB | "
              f"{r['added'] / MB:.0f} MB | {r['dists']:.0f} |")
    if rows:
        empty = next(iter(rows.values()))["empty"]
        print(f"\n(an empty environment -- pip, setuptools -- is {empty / MB:.0f} MB)")
    if "base" in rows:
        b = rows["base"]

        def verdict(x: float, target: float) -> str:
            return "under" if x < target else "NOT under"

        print(f"the broker alone (targets {TARGET_MB:.0f} MB and {TARGET_S:.0f} s): "
              f"installed in {b['seconds']:.1f} s ({verdict(b['seconds'], TARGET_S)}); "
              f"the environment {b['total'] / MB:.0f} MB "
              f"({verdict(b['total'] / MB, TARGET_MB)}), of which the install "
              f"{b['added'] / MB:.0f} MB ({verdict(b['added'] / MB, TARGET_MB)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
