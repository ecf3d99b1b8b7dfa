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


def test_tail_of_a_stream_that_lost_its_first_entries_warns_of_nothing(data_dir):
    """`stream tail` once started at next - N even below the first stored index, and the
    tailer logged a warning that entries were removed before being read."""
    main(["stream", "append", "logs", *[str(i) for i in range(6)]])
    main(["stream", "create", "logs", "--max-count", "3"])
    r = cli("stream", "tail", "logs")
    assert (r.returncode, r.stdout, r.stderr) == (0, "3  3\n4  4\n5  5\n", "")


def test_errors_are_clear(data_dir, capsys):
    assert main(["stream", "tail", "nope"]) == 1
    assert "no stream store" in capsys.readouterr().err
    open_store(data_dir).close()  # a store without streams
    assert main(["stream", "ls"]) == 0
    assert "no streams yet" in capsys.readouterr().out
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


def test_tail_follow_wakes_on_appends_from_other_processes(store_url):
    """On SQLite through inotify, on PostgreSQL through LISTEN/NOTIFY."""
    at = ["--store", store_url]
    main(["stream", "append", "live", "0", *at])
    proc = subprocess.Popen(
        # -X faulthandler: if it ever hangs, SIGABRT makes it print every thread's stack.
        [sys.executable, "-X", "faulthandler", "-m", "dataspace.cli", "stream", "tail", "live",
         "-f", "-n", "1", *at],
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
        assert cli("stream", "append", "live", "1", "2", *at).returncode == 0
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


# -- --store URL and stream copy ----------------------------------------------------------------


def test_every_stream_command_takes_a_store_url(store_url, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DATASPACE_DATA_DIR", str(tmp_path / "unused"))
    at = ["--store", store_url]
    assert main(["stream", "ls", *at]) == 1  # no store there yet (a reading command makes none)
    assert "no stream store" in capsys.readouterr().err
    assert main(["stream", "append", "chat", "1", "2", *at]) == 0
    assert main(["stream", "create", "chat", "--max-count", "5", *at]) == 0
    assert main(["stream", "tail", "chat", "--tailer", "me", *at]) == 0
    assert main(["stream", "info", "chat", "--check", *at]) == 0
    out = capsys.readouterr().out
    assert "chat: 2 entries, retention 5 entries" in out and "0  1\n1  2\n" in out
    assert "integrity   ok" in out and "me " in out
    store_line = next(ln for ln in out.splitlines() if ln.startswith("store "))
    assert "***" in store_line if store_url.startswith("postgresql:") else store_url in store_line
    assert main(["stream", "ls", *at]) == 0
    assert "chat  2" in capsys.readouterr().out
    assert not (tmp_path / "unused").exists()  # --store wins over the data directory


def test_store_url_errors_are_one_line_and_never_show_the_password(pg_server, capsys):
    bad = pg_server.url("postgres", password="wrong-pw")
    assert main(["stream", "ls", "--store", bad]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "password authentication failed" in err
    assert "wrong-pw" not in err and "***" in err
    assert main(["stream", "ls", "--store", "mysql://u:pw@h/db"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dataspace stream: mysql://u:***@h/db: not a stream store URL")


def _fill(url: str) -> None:
    """A store with what a move must keep: retention that removed a prefix (indices from 3),
    metadata, append times, interleaved commits across streams, tailers, an empty stream
    with a next index, a processor's backing stream."""
    with open_store(url) as s:
        s.create_stream("log", max_count=4)
        for i in range(7):
            with s.transaction() as tx:
                tx.append("log", i, meta=parse(f"<m {i}>"))
                if i % 2:
                    tx.append("chat", parse(f'<Says "u" "{i}">'))
        s.append("__backing/g/p", parse("<attempt-nil #[AA==]>"))
        s.set_position("log", "reader", 5)
        s.set_position("chat", "me", 1)
        s.create_stream("empty")
        with s.transaction() as tx:
            tx.advance("empty", 12)


def _contents(url: str) -> dict:
    with open_store(url) as s:
        out = {}
        order = []
        for info in s.streams(include_internal=True):
            entries = list(s.iter_entries(info.name))
            out[info.name] = (info.first, info.next, info.max_count,
                              [(e.index, e.time_ns, e.data, e.meta_data) for e in entries],
                              sorted((t.name, t.position) for t in info.tailers))
            order += [(e.seq, info.name, e.index) for e in entries]
        out["commit order"] = [(n, i) for _q, n, i in sorted(order)]
        return out


def test_copy_moves_streams_from_sqlite_to_postgresql_and_back(tmp_path, pg_url, pg_server):
    src = str(tmp_path / "a")
    back = str(tmp_path / "b")
    _fill(src)
    want = _contents(src)
    assert want["log"][0] == 3 and want["empty"][:2] == (None, 12)

    r = cli("stream", "copy", src, pg_url)
    assert r.returncode == 0, r.stderr
    assert pg_server.password not in r.stdout + r.stderr and "***" in r.stdout
    lines = r.stdout.splitlines()
    assert lines[-2].startswith("copied 8/8 entries (100%)")  # not a terminal: plain lines
    assert lines[-1] == "dataspace stream: copied 4 streams, 8 entries, 2 tailers"
    assert _contents(pg_url) == want

    r = cli("stream", "copy", pg_url, back)
    assert r.returncode == 0, r.stderr
    assert _contents(back) == want

    # A non-empty destination is refused, and replaced only when told.
    r = cli("stream", "copy", src, pg_url)
    assert r.returncode == 1 and "already has data in" in r.stderr and "--replace" in r.stderr
    assert r.stderr.count("\n") == 1 and pg_server.password not in r.stderr
    with open_store(src) as s:
        s.append("chat", "new")
    r = cli("stream", "copy", src, pg_url, "--replace", "--streams", "chat")
    assert r.returncode == 0, r.stderr
    assert "copied 1 stream, 4 entries, 1 tailer (replaced chat)" in r.stdout
    with open_store(pg_url) as s:
        assert [e.value for e in s.read("chat")][-1] == "new"
        assert s.next_index("log") == 7  # the other streams are as they were
    r = cli("stream", "copy", src, pg_url, "--streams", "nope")
    assert r.returncode == 1 and "no stream named 'nope'" in r.stderr


def test_copy_progress_is_a_bar_on_a_terminal_and_periodic_lines_otherwise():
    from dataspace.cli.stream import CopyProgress

    class Out:
        def __init__(self, tty):
            self.text = ""
            self.tty = tty

        def isatty(self):
            return self.tty

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    now = [0.0]
    plain = Out(False)
    p = CopyProgress(plain, interval=2.0, clock=lambda: now[0])
    for t, done in [(0, 0), (1, 1000), (2.5, 3000), (3, 4000), (5, 8000), (6, 10000)]:
        now[0] = t
        p(done, 10000)
    assert plain.text.splitlines() == [
        "copied 3,000/10,000 entries (30%), 1,200/s, ETA 0:06",
        "copied 8,000/10,000 entries (80%), 1,600/s, ETA 0:01",
        "copied 10,000/10,000 entries (100%), 1,667/s, 0:06",
    ]
    now[0] = 0.0
    tty = Out(True)
    p = CopyProgress(tty, clock=lambda: now[0])
    now[0] = 2.0
    p(5000, 10000)
    now[0] = 4.0
    p(10000, 10000)
    assert tty.text.startswith("\r[############............] 5,000/10,000 entries (50%), 2,500/s, ETA 0:02")
    assert tty.text.endswith("\n") and tty.text.rstrip().endswith("(100%), 2,500/s, 0:04")
    assert "\r[########################] 10,000/10,000" in tty.text


# -- reading commands make no store; stream rm ------------------------------------------------


@pytest.mark.parametrize("argv", [["ls"], ["ls", "--all"], ["tail", "chat"], ["tail", "chat", "-f"],
                                  ["info", "chat"], ["export", "chat"], ["rm", "chat"]])
def test_reading_commands_do_not_create_a_store_where_a_typo_points(tmp_path, argv):
    """`stream ls --data-dir <typo>` said "no streams yet" and `tail -f` made a store."""
    typo = tmp_path / "dta"
    r = cli("stream", *argv, "--data-dir", str(typo))
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.startswith("dataspace stream: ") and r.stderr.count("\n") == 1
    assert r.stderr.endswith(f"no stream store at {typo} (the data directory does not exist); "
                             "check --data-dir, or create one with `dataspace stream create "
                             "NAME`\n")
    assert not typo.exists()


def test_rm_removes_streams_with_entries_and_tailers(data_dir, capsys):
    main(["stream", "append", "a", "1", "2"])
    main(["stream", "append", "b", "3"])
    main(["stream", "tail", "a", "--tailer", "me"])
    capsys.readouterr()
    assert main(["stream", "rm", "a", "b"]) == 0
    assert capsys.readouterr() == ("removed a (2 entries, 1 tailer)\nremoved b (1 entry, 0 tailers)\n", "")
    assert main(["stream", "tail", "a"]) == 1
    assert "no stream named 'a'" in capsys.readouterr().err
    main(["stream", "append", "a", "9"])  # the name is free: indices from 0 again
    capsys.readouterr()
    assert main(["stream", "tail", "a"]) == 0
    assert capsys.readouterr().out == "0  9\n"


def test_rm_refuses_all_or_nothing(data_dir, capsys):
    main(["stream", "append", "a", "1"])
    with open_store(data_dir) as s:
        s.append("__backing/g/p", 1)
    capsys.readouterr()
    assert main(["stream", "rm", "a", "nope", "__backing/g/p"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "dataspace stream rm: no stream named 'nope' (dataspace stream ls lists them)",
        "dataspace stream rm: '__backing/g/p' is one of the store's own streams (a processor's "
        "backing stream); remove it with --force, or reset its graph (dataspace pipeline reset "
        "GRAPH.py)",
        "dataspace stream rm: nothing removed"]
    with open_store(data_dir) as s:
        assert s.has_stream("a") and s.has_stream("__backing/g/p")
    assert main(["stream", "rm", "__backing/g/p", "--force"]) == 0
    assert capsys.readouterr().out == "removed __backing/g/p (1 entry, 0 tailers)\n"


def test_rm_refuses_a_stream_a_graph_reads_unless_forced(data_dir, capsys, tmp_path):
    (tmp_path / "g.py").write_text(
        "from dataspace.pipeline import Graph\ngraph = Graph('shout')\ngraph.source('chat')\n"
        "graph.map('upper', 'chat', 'loud', lambda v: v)\n")
    main(["stream", "append", "chat", "1", "2"])
    main(["stream", "append", "notes", "1"])
    assert main(["pipeline", "run", str(tmp_path / "g.py"), "--engine", "local",
                 "--until-idle", "-q"]) == 0
    main(["stream", "tail", "notes", "--tailer", "shout/mine"])  # a user's tailer: not a graph
    capsys.readouterr()
    assert main(["stream", "rm", "chat"]) == 1
    assert capsys.readouterr().err.splitlines()[0] == (
        "dataspace stream rm: stream 'chat' is read by graph shout (shout/upper); it would go "
        "on from its old position in a new stream of that name: reset it first (dataspace "
        "pipeline reset GRAPH.py), or remove anyway with --force")
    with open_store(data_dir) as s, s.lock("graph:shout"):  # the graph is running
        assert main(["stream", "rm", "chat", "--force"]) == 1
        assert "read by the running graph shout (pid" in capsys.readouterr().err
    assert main(["stream", "rm", "notes"]) == 0
    assert main(["stream", "rm", "chat", "--force"]) == 0
    out, err = capsys.readouterr()
    assert out == "removed notes (1 entry, 1 tailer)\nremoved chat (2 entries, 1 tailer)\n"
    assert "chat was read by shout/upper; reset its graph" in err
    # After a reset the graph holds no position in the stream: rm asks nothing.
    main(["stream", "append", "chat", "3"])
    assert main(["pipeline", "reset", str(tmp_path / "g.py"), "--keep-outputs"]) == 0
    assert main(["pipeline", "run", str(tmp_path / "g.py"), "--engine", "local",
                 "--until-idle", "-q"]) == 0
    with open_store(data_dir) as s:
        assert [e.value for e in s.read("loud")] == [1, 2, 3]


def test_rm_help_has_examples():
    r = cli("stream", "rm", "--help")
    assert r.returncode == 0 and "examples:" in r.stdout and "--force" in r.stdout
