"""``dataspace stream ...`` end to end (real processes, a temporary data directory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from dataspace.cli import main
from dataspace.datadir import STREAMS_DB
from dataspace.streams import open_store
from dataspace.values import parse

LONG = 30.0


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DATASPACE_DATA_DIR", str(tmp_path))
    return tmp_path


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dataspace.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_append_ls_tail_info(data_dir, capsys):
    assert main(["stream", "append", "chat", '<Says "alice" "hi">', '<Says "bob" "yo">']) == 0
    assert "appended 2 to chat (indices 0..1)" in capsys.readouterr().out
    assert main(["stream", "ls"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["NAME", "ENTRIES", "INDICES"]
    assert "chat" in out and "0..1" in out
    assert main(["stream", "tail", "chat", "-n", "1"]) == 0
    assert capsys.readouterr().out == '1  <Says "bob" "yo">\n'
    assert main(["stream", "tail", "chat", "--from", "0", "--no-index"]) == 0
    assert capsys.readouterr().out == '<Says "alice" "hi">\n<Says "bob" "yo">\n'
    assert main(["stream", "info", "chat", "--check"]) == 0
    out = capsys.readouterr().out
    assert "entries     2" in out and "integrity   ok" in out


def test_append_from_stdin_multiline_values(data_dir):
    r = cli("stream", "append", "nums", "-", stdin="<n 1>\n<n\n 2> <n 3>\n\n")
    assert r.returncode == 0, r.stderr
    with open_store(data_dir) as s:
        assert [e.value for e in s.read("nums")] == [parse("<n 1>"), parse("<n 2>"), parse("<n 3>")]


def test_append_from_stdin_reports_the_line_of_the_input(data_dir):
    r = cli("stream", "append", "nums", "-", stdin="<n 1>\n\n<n\n 2 }\n")
    assert r.returncode == 1
    assert r.stderr.strip() == "dataspace stream: stdin line 4, column 4: unexpected '}'"


def test_named_tailer_resumes_between_runs(data_dir, capsys):
    main(["stream", "append", "q", "1", "2", "3"])
    capsys.readouterr()
    assert main(["stream", "tail", "q", "--tailer", "me", "--no-index"]) == 0
    assert capsys.readouterr().out == "1\n2\n3\n"
    main(["stream", "append", "q", "4"])
    capsys.readouterr()
    assert main(["stream", "tail", "q", "--tailer", "me", "--no-index"]) == 0
    assert capsys.readouterr().out == "4\n"
    assert main(["stream", "info", "q"]) == 0
    assert "me" in capsys.readouterr().out


def test_create_sets_retention(data_dir, capsys):
    main(["stream", "append", "logs", *[str(i) for i in range(10)]])
    assert main(["stream", "create", "logs", "--max-count", "3"]) == 0
    assert "3 entries, retention 3 entries (7 old entries removed)" in capsys.readouterr().out
    assert main(["stream", "create", "logs", "--max-age", "3d"]) == 0
    assert "retention 3 entries, 3d" in capsys.readouterr().out
    assert main(["stream", "create", "logs", "--keep-all"]) == 0
    assert "retention keep all" in capsys.readouterr().out


def test_errors_are_clear(data_dir, capsys):
    assert main(["stream", "ls"]) == 0
    assert "no streams yet" in capsys.readouterr().out
    assert main(["stream", "tail", "nope"]) == 1
    assert "no stream store" in capsys.readouterr().err
    main(["stream", "append", "other", "1"])
    capsys.readouterr()
    assert main(["stream", "tail", "nope"]) == 1
    assert "no stream named 'nope'" in capsys.readouterr().err
    assert main(["stream", "append", "x", "<unclosed"]) == 1
    assert "cannot parse" in capsys.readouterr().err
    assert main(["stream", "append", "bad name", "1"]) == 1
    assert "invalid stream name" in capsys.readouterr().err
    assert main(["stream", "create", "x", "--max-age", "forever"]) == 1
    assert "invalid duration" in capsys.readouterr().err
    (data_dir / STREAMS_DB).write_bytes(b"garbage" * 100)
    assert main(["stream", "ls"]) == 1
    assert "not an SQLite database" in capsys.readouterr().err


def test_help_has_examples():
    r = cli("stream", "--help")
    assert r.returncode == 0 and "examples:" in r.stdout
    for sub in ("ls", "info", "append", "tail", "create"):
        r = cli("stream", sub, "--help")
        assert r.returncode == 0 and "usage: dataspace stream" in r.stdout


def test_tail_follow_wakes_on_appends_from_other_processes(data_dir):
    main(["stream", "append", "live", "0"])
    proc = subprocess.Popen(
        # -X faulthandler: if it ever hangs, SIGABRT makes it print every thread's stack.
        [sys.executable, "-X", "faulthandler", "-m", "dataspace.cli", "stream", "tail", "live",
         "-f", "-n", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    got = threading.Condition()

    def reader():
        for line in proc.stdout:
            with got:
                lines.append(line.rstrip("\n"))
                got.notify_all()

    threading.Thread(target=reader, daemon=True).start()
    try:
        with got:
            assert got.wait_for(lambda: len(lines) >= 1, LONG), proc.stderr
        assert lines == ["0  0"]
        assert cli("stream", "append", "live", "1", "2").returncode == 0
        with got:
            assert got.wait_for(lambda: len(lines) >= 3, LONG)
        assert lines == ["0  0", "1  1", "2  2"]
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(LONG)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(LONG)
            pytest.fail(f"tail -f ignored SIGINT for {LONG} s; its threads:\n{proc.stderr.read()}")
        assert code == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("command", [["stream", "ls"], ["pipeline", "run"], ["pipeline", "route"],
                                     ["serve"], ["cap", "mint"], ["send"]])
def test_data_dir_help_names_every_default(command, capsys):
    """--data-dir's help lists the whole default chain, $XDG_DATA_HOME included."""
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "$DATASPACE_DATA_DIR, else $XDG_DATA_HOME/dataspace, else ~/.local/share/dataspace" in out


def test_append_reports_on_stdout_whatever_the_values_come_from(data_dir):
    r = cli("stream", "append", "nums", "-", stdin="<n 1>\n<n 2>\n")
    assert (r.returncode, r.stdout, r.stderr) == (0, "appended 2 to nums (indices 0..1)\n", "")
    r = cli("stream", "append", "nums", "3")
    assert (r.returncode, r.stdout, r.stderr) == (0, "appended 1 to nums (indices 2..2)\n", "")


def test_tail_follow_of_an_unknown_stream_says_so_and_waits_for_it(data_dir):
    """A typo (`tail chta -f`) once waited in silence; without -f it is an error."""
    main(["stream", "append", "chat", "0"])
    assert cli("stream", "tail", "chta").stderr.startswith("dataspace stream: no stream named 'chta'")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataspace.cli", "stream", "tail", "chta", "-f"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        got: list[str] = []
        t = threading.Thread(target=lambda: got.append(proc.stderr.readline()), daemon=True)
        t.start()
        t.join(LONG)
        assert got and got[0].startswith("dataspace stream: no stream named 'chta' yet; "
                                         "waiting for its first entry"), got
        # ...and it does follow the stream once it exists.
        assert cli("stream", "append", "chta", "7").returncode == 0
        line: list[str] = []
        t = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        t.start()
        t.join(LONG)
        assert line == ["0  7\n"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(LONG) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_reserved_names_cannot_be_written_but_can_be_read(data_dir, capsys):
    """`stream append __x 1` once made a stream that `stream ls` then hid."""
    from dataspace.streams import RecorderSpec

    for argv in (["stream", "append", "__x", "1"], ["stream", "create", "__x"]):
        assert main(argv) == 1
        assert capsys.readouterr().err == (
            "dataspace stream: stream name '__x': names starting with __ are reserved for the "
            "store's own streams (processor backing streams); choose another name\n")
    with pytest.raises(ValueError, match="reserved"):
        RecorderSpec("__chat", "<Says _ _>")
    with open_store(data_dir) as s:
        assert not s.has_stream("__x")
        s.append("__backing/g/p", 1)  # the store's own API writes them (engines do)
    assert main(["stream", "tail", "__backing/g/p"]) == 0
    assert capsys.readouterr().out == "0  1\n"
