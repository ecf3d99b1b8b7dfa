"""The ``dataspace`` command line: help, the demo (the current main job) and errors."""

from __future__ import annotations

import subprocess
import sys

from dataspace.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataspace.cli", *args],
        capture_output=True, text=True, timeout=120,
    )


def test_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    assert "demo" in r.stdout and "examples:" in r.stdout


EVERY_HELP = """
import contextlib, io, sys
from dataspace.cli import COMMANDS, main
for name in COMMANDS:
    name = name.rstrip("_")  # assert_.py registers `assert` (a keyword in Python)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main([name, "--help"])
        except SystemExit as e:
            code = e.code
    ok = code in (0, None) and "usage: dataspace " + name in out.getvalue()
    print(name, "ok" if ok else f"FAILED ({code!r})")
"""


def test_every_command_has_help():
    """Each command's --help, in one fresh process (a command's imports are its own, made
    when it runs: one broken import fails its help, not the package's)."""
    from dataspace.cli import COMMANDS

    r = subprocess.run([sys.executable, "-c", EVERY_HELP], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    said = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert said == {n.rstrip("_"): "ok" for n in COMMANDS}, (said, r.stderr[-2000:])


def test_demo_shows_presence_messages_and_departures():
    r = run_cli("demo", "--users", "3", "--messages", "6")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for who in ("alice", "bob", "carol"):
        assert f"+ {who} is present" in out
        assert f"- {who} left" in out
        assert f"[late-alice] sees {who}" in out
    assert out.count("  [room]     ") >= 3 + 6 + 3  # joins, messages, departures
    assert "someone is listening to carol" in out
    assert out.rstrip().endswith("done: 0 assertion(s) left besides subscriptions")


def test_demo_rejects_bad_arguments(capsys):
    assert main(["demo", "--users", "0"]) == 2
    assert "--users must be >= 1" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "usage: dataspace" in capsys.readouterr().out


def _every_parser():
    """(name, parser) for the command, every command and every subcommand."""
    import argparse

    from dataspace.cli import build_parser

    todo = [("dataspace", build_parser())]
    while todo:
        name, parser = todo.pop()
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend((f"{name} {n}", p) for n, p in action.choices.items())


def test_every_help_fits_an_80_column_terminal(monkeypatch):
    """Descriptions written as one long line were cut by the terminal mid-word (the
    observe help's first paragraph was 292 columns wide): every line of every help,
    commands and subcommands alike, fits 80 columns, and the examples keep their layout.

    Fitting is not enough: the formatter wraps a row too wide for the terminal to fit
    it, so `stream --help` fitted with its examples' comments folded into a strip
    ("values from" / "stdin" on two lines).  So every line of an example -- a command,
    a line laid out in columns, or one indented under them (4 spaces or more: a
    continuation, a comment under its column) -- is written to fit 80 columns, and
    shows as written; only prose is refilled."""
    from dataspace.cli._parser import _is_row

    monkeypatch.setenv("COLUMNS", "80")
    names = []
    folded = []
    for name, parser in _every_parser():
        names.append(name)
        text = parser.format_help()
        wide = [line for line in text.splitlines() if len(line) > 80]
        assert not wide, (name, wide)
        shown = set(text.splitlines())
        for written in (parser.description or "", parser.epilog or ""):
            folded += [(name, row) for row in written.splitlines()
                       if row.strip() and (_is_row(row) or row.startswith("    "))
                       and (len(row) > 80 or row not in shown)]
    assert not folded, folded
    assert {"dataspace observe", "dataspace cap attenuate", "dataspace pipeline reset",
            "dataspace stream rm"} <= set(names)
    observe = dict(_every_parser())["dataspace observe"].format_help()
    # A paragraph is wrapped (its words intact); an example line stays as written.
    assert "Subscribe to PATTERN on a dataspace server and print every matching assertion" \
        in observe.replace("\n", " ")
    assert "  dataspace observe '<Says \"alice\" $text>'          alice's messages\n" in observe



def test_the_harnesses_help_fits_an_80_column_terminal():
    """The fault harnesses (`python -m dataspace.testing.X --help`) are read at the same
    terminals: cluster_record's example was one 103-column line."""
    import os

    env = {**os.environ, "COLUMNS": "80"}
    for name in ("broker_soak", "cluster_record", "group_crash", "pipeline_crash",
                 "record_crash", "spark_crash"):
        out = subprocess.run([sys.executable, "-m", f"dataspace.testing.{name}", "--help"],
                             capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0 and "usage:" in out.stdout, (name, out.stderr)
        wide = [line for line in out.stdout.splitlines() if len(line) > 80]
        assert not wide, (name, wide)

COUNTED_NOUNS = {
    "assertions", "attempts", "batches", "bytes", "clients", "connections", "consumers",
    "deliveries", "entries", "errors", "events", "files", "graphs", "groups", "jobs", "kills", "lines",
    "links", "matches", "members", "messages", "observers", "patterns", "processors",
    "replies", "requests", "routes", "rows", "streams", "subscriptions", "tailers", "times",
    "turns", "users", "values"}


def test_counts_in_messages_agree_with_their_nouns():
    """"server gone (connection refused, 1 attempts)": no f-string of the CLI puts a
    count straight before a plural noun (say it with plural(): 1 attempt, 2 attempts);
    constants (MAX_..., always many) are left alone.  Then a few of the lines seen."""
    import ast
    import re
    from pathlib import Path

    import dataspace.cli as cli_pkg
    import dataspace.testing as testing_pkg
    from dataspace.cli.info import format_summary
    from dataspace.cli.top import Reconnect

    found = []
    for f in [*sorted(Path(cli_pkg.__file__).parent.glob("*.py")),
              *sorted(Path(testing_pkg.__file__).parent.glob("*.py"))]:  # (and the harnesses)
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.JoinedStr):
                continue
            for a, b in zip(node.values, node.values[1:]):
                if isinstance(a, ast.FormattedValue) and isinstance(b, ast.Constant):
                    m = re.match(r" (?:of \S+ )?(?:[a-z]+ )?([a-z]+)\b", str(b.value))
                    said = ast.unparse(a.value)
                    if m and m.group(1) in COUNTED_NOUNS and not re.fullmatch(r"[A-Z_]+", said):
                        found.append(f"{f.name}:{node.lineno}: {{{said}}}{b.value[:20]}")
    assert not found, found
    r = Reconnect("connection refused", 0.0)
    r.failed("connection refused", 0.0)
    assert r.notice(0.0).startswith("server gone (connection refused, 1 attempt), ")
    r.failed("connection refused", 0.0)
    assert r.notice(0.0).startswith("server gone (connection refused, 2 attempts), ")
    text = "\n".join(format_summary({
        "turns": 1, "dataspaces": {"root": {"assertions": 1, "observers": 1}},
        "memory_budget": {"used": 1, "limit": 10, "refused": 1},
        "groups": [{"group": "g", "pattern": "_", "member_count": 1, "messages": 1,
                    "jobs": 1, "reassigned": 0}]}, "http://x"))
    for said in ("1 turn;", "(1 observer)", "1 assertion refused", "1 member, 1 message, 1 job,"):
        assert said in text, (said, text)


def test_a_misspelt_option_is_reported_by_its_command_with_a_guess(capsys):
    """`send --sever x` was reported by the top-level parser ("dataspace: error:", the
    usage of `dataspace`), with no hint of --server."""
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["send", "--sever", "127.0.0.1:7411", "<x>"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: dataspace send ")
    assert err.rstrip().splitlines()[-1] == (
        "dataspace send: error: unrecognized arguments: --sever (did you mean --server?)")
    with pytest.raises(SystemExit):
        main(["scry", "follow", "--form", "start", "udp://127.0.0.1:7413/chat"])
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == (
        "dataspace scry follow: error: unrecognized arguments: --form udp://127.0.0.1:7413/chat"
        " (did you mean --from?)")
    with pytest.raises(SystemExit):
        main(["info", "--zzzzz"])
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == (
        "dataspace info: error: unrecognized arguments: --zzzzz (see dataspace info --help)")


def test_an_option_named_as_other_servers_name_it_gets_ours(capsys):
    """`serve --listen HOST:PORT` (as many servers spell it) was answered 'did you mean
    --link?'; the options other brokers and clients use for an address point to ours."""
    import pytest

    for argv, given, guess in ((["serve", "--listen", "127.0.0.1:7411"], "--listen", "--tcp"),
                               (["serve", "--bind", "127.0.0.1"], "--bind", "--tcp"),
                               (["serve", "--port", "7411"], "--port", "--tcp"),
                               (["send", "--host", "h:7411", "<x>"], "--host", "--server"),
                               (["observe", "--url", "h:7411", "_"], "--url", "--server")):
        with pytest.raises(SystemExit):
            main(argv)
        last = capsys.readouterr().err.rstrip().splitlines()[-1]
        assert f"unrecognized arguments: {given} " in last and \
            last.endswith(f"(did you mean {guess}?)"), last


def test_a_misspelt_command_gets_the_likely_one(capsys):
    import pytest

    for argv, typo, guess in ((["obsrve", "_"], "obsrve", "observe"),
                              (["stream", "lss"], "lss", "ls"),
                              (["cap", "attenuat", "x"], "attenuat", "attenuate")):
        with pytest.raises(SystemExit):
            main(argv)
        last = capsys.readouterr().err.rstrip().splitlines()[-1]
        assert f"invalid choice: '{typo}': did you mean '{guess}'? (choose from" in last, last


_LOST_INTERRUPT = """
import sys, weakref
from dataspace import cli
if sys.argv[1] == "hook":
    sys.unraisablehook = cli.redeliver_interrupt  # as the console script's main() does
class A:
    pass
a = A()
def cb(_ref):
    raise KeyboardInterrupt  # a Ctrl-C landing in a weakref callback (the import system's)
r = weakref.ref(a, cb)
try:
    del a
    for _ in range(10_000_000):  # bounded: the interrupt lands at the next check
        pass
    print("lost")
except KeyboardInterrupt:
    print("delivered")
"""


def test_a_ctrl_c_python_could_only_drop_is_delivered_again():
    """A KeyboardInterrupt raised where Python can only print "Exception ignored" (once
    in CI: Ctrl-C inside the import system's lock callback, then the run went on) reaches
    the command's main thread instead; without the hook it is lost."""
    for mode, want in (("hook", "delivered"), ("none", "lost")):
        p = subprocess.run([sys.executable, "-c", _LOST_INTERRUPT, mode], capture_output=True,
                           text=True, timeout=60)
        assert p.stdout.strip() == want, (mode, p.stdout, p.stderr)
        assert ("Exception ignored" in p.stderr) == (mode == "none"), p.stderr
