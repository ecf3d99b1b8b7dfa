"""The extras (pyproject.toml) and what a command says when one is missing.

The suite runs with every extra installed, so the missing ones are simulated: each case
runs ``dataspace`` in a child process whose import system refuses the extras' modules (a
finder first on ``sys.meta_path`` raising ``ModuleNotFoundError``, as the import statement
reports a package that is not installed).  tests/wheel_smoke.py does the same against a
real install without extras (``make wheel-test``, CI).
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from dataspace._extras import EXTRAS, MissingExtra, install_command, missing, require
from wheel_smoke import HELP_EVERY_COMMAND

ROOT = Path(__file__).resolve().parent.parent
PG_URL = "postgresql://nobody@127.0.0.1:9/nothing"  # never dialled: the extra is missing first

# The child: block the named top-level modules, then run the command line given.
BLOCKED_RUN = textwrap.dedent("""\
    import sys

    BLOCKED = set(sys.argv[1].split(","))

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Refuse())
    if sys.argv[2] == "-c":
        exec(sys.argv[3])
    else:
        from dataspace.cli import main
        sys.exit(main(sys.argv[2:]))
""")

SPARK = ",".join(EXTRAS["spark"].modules)
POSTGRES = ",".join(EXTRAS["postgres"].modules)
ALL = f"{SPARK},{POSTGRES}"

GRAPH = textwrap.dedent("""\
    from dataspace.pipeline import Graph

    graph = Graph("shout")
    graph.source("words")
    graph.map("upper", "words", "shouts", lambda v: v.upper())
""")


def blocked(modules: str, *args: str, cwd: Path | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DATASPACE_SERVER"}
    return subprocess.run([sys.executable, "-c", BLOCKED_RUN, modules, *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def said_missing(r: subprocess.CompletedProcess[str], prog: str, extra: str) -> str:
    """Assert exit 2 and one line ``PROG: ... pip install 'dataspace[EXTRA]'`` on stderr
    (no traceback); the line."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"{prog}: "), lines
    assert lines[0].endswith(install_command(extra)) or f"{install_command(extra)} -- " in lines[0]
    return lines[0]


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """A data directory with an SQLite store holding stream ``words`` and the graph file."""
    from dataspace.streams import open_store
    from dataspace.values import parse

    with open_store(tmp_path / "data") as s:
        s.append_many("words", [parse('"hi"'), parse('"there"')])
    (tmp_path / "shout.py").write_text(GRAPH, encoding="utf-8")
    return tmp_path


# -- the message --------------------------------------------------------------------------


def test_message_names_the_extra_and_the_command_that_installs_it() -> None:
    e = MissingExtra("spark", EXTRAS["spark"].modules, "the Spark engine",
                     "or run in this process with --engine local")
    assert str(e) == ("the Spark engine needs PySpark, which is not installed: "
                      "pip install 'dataspace[spark]' -- or run in this process with "
                      "--engine local")
    assert isinstance(e, ImportError) and e.name == "pyspark"
    part = MissingExtra("spark", ("pyarrow", "pandas"), "the Spark connector")
    assert str(part) == ("the Spark connector needs pyarrow and pandas, which are not "
                         "installed: pip install 'dataspace[spark]'")
    one = MissingExtra("postgres", ("psycopg_pool",), "a PostgreSQL store")
    assert str(one) == ("a PostgreSQL store needs psycopg_pool, which is not installed: "
                        "pip install 'dataspace[postgres]'")
    back = pickle.loads(pickle.dumps(e))  # crosses processes (Spark's workers)
    assert type(back) is MissingExtra and str(back) == str(e)


def test_require_passes_where_installed_and_names_what_is_missing(monkeypatch) -> None:
    require("spark")  # the suite's environment has every extra
    require("postgres", "a PostgreSQL store")
    assert missing("postgres") == ()
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as `import pyarrow` would refuse it
    assert missing("spark") == ("pyarrow",)
    with pytest.raises(MissingExtra, match=r"^Spark needs pyarrow, which is not installed: "
                       r"pip install 'dataspace\[spark\]'$"):
        require("spark")
    with pytest.raises(ValueError, match="unknown extra 'sprak'; the extras are: spark, postgres"):
        require("sprak")


def test_the_extras_are_those_of_pyproject() -> None:
    """_extras.EXTRAS and pyproject.toml name the same modules; the base install has none
    of them; [all] is both and the test extra (make run / make test) pulls [all]."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]

    def name(req: str) -> str:
        return re.split(r"[\[<>=!~;, ]", req, maxsplit=1)[0].lower().replace("-", "_")

    for e in EXTRAS.values():
        assert sorted(name(r) for r in extras[e.name]) == sorted(e.modules), e.name
    base = {name(r) for r in project["dependencies"]}
    assert not base & {m for e in EXTRAS.values() for m in e.modules}
    assert extras["all"] == ["dataspace[spark,postgres]"]
    assert "dataspace[all]" in extras["test"]


# -- the commands, with the extras refused -------------------------------------------------


def test_import_and_every_help_need_no_extra() -> None:
    """``import dataspace``, the lazy Spark package and every command's --help load none of
    the extras' modules."""
    code = ("import dataspace, dataspace.pipeline.spark, dataspace.streams, dataspace.pipeline\n"
            + HELP_EVERY_COMMAND + "print(n)\n")
    r = blocked(ALL, "-c", code)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) > 30  # every command and subcommand


def test_pipeline_run_on_spark_without_the_spark_extra(store_dir: Path) -> None:
    r = blocked(SPARK, "pipeline", "run", "shout.py", "--data-dir", "data", cwd=store_dir)
    line = said_missing(r, "dataspace pipeline", "spark")
    assert "the Spark engine needs PySpark" in line and "--engine local" in line
    # Only pyarrow missing (a pyspark installed by hand): named as such.
    r = blocked("pyarrow", "pipeline", "run", "shout.py", "--data-dir", "data", cwd=store_dir)
    assert "needs pyarrow, which is not installed" in said_missing(r, "dataspace pipeline",
                                                                   "spark")


def test_local_pipeline_needs_no_extra(store_dir: Path) -> None:
    r = blocked(ALL, "pipeline", "run", "shout.py", "--engine", "local", "--until-idle",
                "--data-dir", "data", cwd=store_dir)
    assert r.returncode == 0, r.stderr
    assert "2 messages in, 2 out" in r.stdout


def test_pipeline_route_without_the_spark_extra(store_dir: Path) -> None:
    (store_dir / "patterns.txt").write_text("<X $a>\n", encoding="utf-8")
    r = blocked(SPARK, "pipeline", "route", "--patterns", "patterns.txt", "--values", "words",
                "--out", "out", "--data-dir", "data", cwd=store_dir)
    said_missing(r, "dataspace pipeline", "spark")


@pytest.mark.parametrize("args, prog", [
    (["stream", "ls", "--store", PG_URL], "dataspace stream"),
    (["stream", "append", "--store", PG_URL, "s", "1"], "dataspace stream"),
    (["pipeline", "status", "shout.py", "--store", PG_URL], "dataspace pipeline"),
    (["serve", "--store", PG_URL, "--tcp", "127.0.0.1:0", "--http", "127.0.0.1:0",
      "--data-dir", "serve"], "dataspace serve"),
], ids=["stream-ls", "stream-append", "pipeline-status", "serve"])
def test_a_postgresql_store_without_the_postgres_extra(store_dir: Path, args: list[str],
                                                      prog: str) -> None:
    r = blocked(POSTGRES, *args, cwd=store_dir)  # serve must refuse before it listens
    assert "a PostgreSQL store needs psycopg" in said_missing(r, prog, "postgres")


def test_library_imports_say_the_extra() -> None:
    """From Python: the engine, the connector's modules and open_store raise MissingExtra
    (an ImportError), not a bare "No module named 'pyspark'"."""
    code = textwrap.dedent("""\
        from dataspace._extras import MissingExtra
        from dataspace.pipeline.engine import get_engine
        from dataspace.streams import open_store
        for f in (lambda: get_engine("spark"),
                  lambda: __import__("dataspace.pipeline.spark.source"),
                  lambda: __import__("dataspace.pipeline.spark.engine"),
                  lambda: open_store(PG_URL)):
            try:
                f()
            except MissingExtra as e:
                print(e)
        get_engine("local")
    """).replace("PG_URL", repr(PG_URL))
    r = blocked(ALL, "-c", code)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4, lines
    assert lines[0].startswith("the Spark engine needs PySpark")
    assert lines[1].startswith("the Spark connector needs PySpark")
    assert lines[2].startswith("the Spark connector needs PySpark")
    assert lines[3].startswith("a PostgreSQL store needs psycopg")
