"""``dataspace stream export`` / ``import``: round trips, ranges, bad input, pipes, progress."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest

from dataspace.cli import main
from dataspace.streams import open_store
from dataspace.streams.transfer import BadInput, Input, text_values
from dataspace.values import decode_prefix, parse
from dataspace.values.text import parse_many

VALUES = ['<Says "alice" "hi">', '<Says "bob" "yo">', "42", '"two\\nlines"', "#[AAEC]",
          '{a: [1 2.5 #t] b: #{x y}}', "<entry 1 2>",  # an entry-looking plain value
          '<dataspace-stream-export 1 {}>']  # ...and a header-looking one


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DATASPACE_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "dataspace.cli", *args], input=stdin,
                          capture_output=True, timeout=120)


def _fill(url: str, n: int | None = None) -> None:
    with open_store(url) as s:
        if n is None:
            with s.transaction() as tx:
                for i, v in enumerate(VALUES):
                    tx.append("chat", parse(v), meta=parse(f"<m {i}>") if i % 3 == 0 else None)
        else:
            s.append_many("nums", [parse(f'<n {i} "payload"> ') for i in range(n)])


def _entries(url: str, name: str) -> list[tuple[int, bytes, bytes | None]]:
    with open_store(url) as s:
        return [(e.index, e.data, e.meta_data) for e in s.iter_entries(name)]


@pytest.mark.parametrize("fmt", ["text", "binary"])
def test_round_trip_keeps_values_metadata_and_with_keep_indices_the_indices(
        fmt, data_dir, tmp_path, capsys):
    _fill(str(data_dir))
    out = tmp_path / f"chat.{fmt}"
    assert main(["stream", "export", "chat", str(out), "--format", fmt]) == 0
    err = capsys.readouterr().err
    assert err.endswith(f"dataspace stream: exported 8 entries of chat (indices 0..7) to {out}\n")
    assert not (tmp_path / f"chat.{fmt}.part").exists()
    raw = out.read_bytes()
    if fmt == "text":
        lines = raw.decode().splitlines()
        assert lines[0] == '<dataspace-stream-export 1 {stream: "chat"}>'
        assert lines[1] == '<entry 0 <Says "alice" "hi"> <m 0>>'
        assert lines[7] == "<entry 6 <entry 1 2> <m 6>>"
        assert len(lines) == 9
    else:
        assert raw[0] == 0xB4 and decode_prefix(raw)[0] == parse(
            '<dataspace-stream-export 1 {stream: "chat"}>')

    other = str(tmp_path / "other")
    assert main(["stream", "import", "copy", str(out), "--store", other]) == 0
    assert capsys.readouterr().out == "imported 8 entries to copy (indices 0..7)\n"
    assert _entries(other, "copy") == _entries(str(data_dir), "chat")

    # Appending again puts them after; --keep-indices puts them at their own indices.
    with open_store(other) as s:
        s.append("kept", 0)
    assert main(["stream", "import", "kept", str(out), "--store", other, "--keep-indices"]) == 1
    assert "index 0 is below the next index of 'kept' (1)" in capsys.readouterr().err
    assert main(["stream", "export", "chat", str(out), "--format", fmt, "--from", "3"]) == 0
    # A stream's entries have no gaps (reads check it): 1..2 would be missing.
    assert main(["stream", "import", "kept", str(out), "--store", other, "--keep-indices"]) == 1
    assert "index 3 would leave indices 1..2 of 'kept' missing" in capsys.readouterr().err
    assert main(["stream", "export", "chat", str(out), "--format", fmt, "--from", "1"]) == 0
    assert main(["stream", "import", "kept", str(out), "--store", other, "--keep-indices"]) == 0
    assert capsys.readouterr().out == "imported 7 entries to kept (indices 1..7)\n"
    assert _entries(other, "kept")[1:] == _entries(str(data_dir), "chat")[1:]


def test_from_and_to_are_included_and_clipped_to_the_stream(data_dir, tmp_path, capsys):
    _fill(str(data_dir), 10)
    out = tmp_path / "part.pr"
    assert main(["stream", "export", "nums", str(out), "--from", "3", "--to", "5"]) == 0
    assert [v.fields[0] for v in parse_many(out.read_text())[1:]] == [3, 4, 5]
    assert main(["stream", "export", "nums", str(out), "--from", "8", "--to", "99"]) == 0
    assert [v.fields[0] for v in parse_many(out.read_text())[1:]] == [8, 9]
    assert main(["stream", "export", "nums", str(out), "--from", "20"]) == 0
    assert parse_many(out.read_text()) == [parse('<dataspace-stream-export 1 {stream: "nums"}>')]
    assert "exported 0 entries of nums to" in capsys.readouterr().err
    assert main(["stream", "import", "empty", str(out)]) == 0  # an empty export: an empty stream
    assert capsys.readouterr().out == "imported 0 entries to empty\n"
    with open_store(str(data_dir)) as s:
        assert s.stream_info("empty").count == 0
    assert main(["stream", "export", "nums", "--from", "5", "--to", "4"]) == 2
    assert main(["stream", "export", "nope", str(out)]) == 1
    assert capsys.readouterr().err.endswith("no stream named 'nope' (dataspace stream ls lists them)\n")


def test_plain_values_import_like_append_and_entry_records_only_after_a_header(data_dir, tmp_path, capsys):
    f = tmp_path / "plain.pr"
    f.write_text("# a comment\n<n 1>\n<n\n 2> <entry 5 6>\n\n")
    assert main(["stream", "import", "p", str(f)]) == 0
    with open_store(str(data_dir)) as s:
        assert [e.value for e in s.read("p")] == [parse("<n 1>"), parse("<n 2>"), parse("<entry 5 6>")]
    assert main(["stream", "import", "p", str(f), "--keep-indices"]) == 1
    assert "--keep-indices needs an export" in capsys.readouterr().err


@pytest.mark.parametrize("batch, imported", [(10, "imported 20 entries to nums (indices 0..19) "
                                               "before it, nothing from {f} line 21 on"),
                                              (100, "nothing was imported")])
def test_bad_input_names_its_line_and_nothing_of_its_batch_is_written(
        batch, imported, data_dir, tmp_path, capsys):
    f = tmp_path / "in.pr"
    f.write_text("".join(f"<n {i}>\n" for i in range(22)) + "<n\n 22 }\n<n 23>\n")
    assert main(["stream", "import", "nums", str(f), "--batch-size", str(batch), "-q"]) == 1
    err = capsys.readouterr().err
    assert err == (f"dataspace stream: import: {f} line 24, column 5: unexpected '}}'; "
                   + imported.format(f=f) + "\n")
    with open_store(str(data_dir)) as s:
        n = 20 if batch == 10 else 0
        assert [e.value for e in s.read("nums")] == [parse(f"<n {i}>") for i in range(n)]
        assert s.has_stream("nums") == bool(n)  # nothing imported: not even an empty stream


@pytest.mark.parametrize("text, message", [
    (b'<dataspace-stream-export 1 {stream: "a"}>\n<entry 0 1>\n2\n',
     "stdin line 3: expected <entry INDEX VALUE> or <entry INDEX VALUE META> after the export "
     "header, found 2"),
    (b'<dataspace-stream-export 1 {}>\n<entry -1 1>\n', "stdin line 2: an entry's index is"),
    (b'<dataspace-stream-export 9 {}>\n', "stdin line 1: export format version 9; this version"),
    (b"1\n<dataspace-stream-export 1 {}>\n", "stdin line 2: an export header after the first"),
    (b"1\n\xff\n", "stdin line 2, column 1: not UTF-8 text"),
    (b"1\n<n 2\n", "stdin ends inside a value (from line 2): '<n 2'"),
    (b"\xb0\x01\x01\xb4\xb3\x01a\x99", "stdin byte 7: invalid tag 0x99"),
    (b"\xb0\x01\x01\xb4\xb3\x01a", "stdin byte 3: the input ends inside a value (4 bytes of it)"),
])
def test_bad_input_is_one_line_with_the_place(text, message, data_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text)))
    assert main(["stream", "import", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dataspace stream: import: {message}") and err.count("\n") == 1, err


def test_pipes_stdout_holds_only_the_export_and_stdin_takes_it(data_dir, tmp_path):
    _fill(str(data_dir))
    exp = subprocess.Popen([sys.executable, "-m", "dataspace.cli", "stream", "export", "chat",
                            "--format", "binary"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    other = str(tmp_path / "other")
    imp = subprocess.run([sys.executable, "-m", "dataspace.cli", "stream", "import", "chat", "-",
                          "--store", other], stdin=exp.stdout, capture_output=True, timeout=120)
    exp.stdout.close()
    assert exp.wait(120) == 0 and imp.returncode == 0, imp.stderr
    assert imp.stdout == b"imported 8 entries to chat (indices 0..7)\n"
    assert _entries(other, "chat") == _entries(str(data_dir), "chat")
    assert exp.stderr.read().decode().endswith("exported 8 entries of chat (indices 0..7) to "
                                               "standard output\n")
    r = cli("stream", "export", "chat", "-", "--to", "1")
    assert r.stdout.decode().splitlines() == [
        '<dataspace-stream-export 1 {stream: "chat"}>',
        '<entry 0 <Says "alice" "hi"> <m 0>>', '<entry 1 <Says "bob" "yo">>']


def test_progress_lines_on_stderr_when_not_a_terminal(data_dir, tmp_path):
    _fill(str(data_dir), 30_000)
    out = tmp_path / "nums.pr"
    r = cli("stream", "export", "nums", str(out), "--interval", "0.001")
    assert r.returncode == 0 and r.stdout == b""
    lines = r.stderr.decode().splitlines()
    assert len(lines) >= 3, lines  # a line per chunk read, the last, the summary
    assert all(x.startswith("exported ") and "/30,000 entries (" in x for x in lines[:-1])
    assert lines[-2].startswith("exported 30,000/30,000 entries (100%), ")
    assert "\r" not in r.stderr.decode()

    r = cli("stream", "import", "again", str(out), "--interval", "0.001", "--batch-size", "5000")
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"imported 30,000 entries to again (indices 0..29999)\n"
    lines = r.stderr.decode().splitlines()
    assert len(lines) >= 3 and lines[-1].startswith("imported 30,000/30,000 entries (100%)")
    # the total is estimated from the share of the file read, and said as an estimate
    # (it was "imported 10,000/21,016 entries" for 19,999)
    for x in lines[:-1]:
        assert x.startswith("imported ") and " of about " in x and "ETA" in x, lines
        about = x.split(" of about ")[1].split()[0].replace(",", "")
        assert len(about.rstrip("0")) <= 2, lines  # rounded, as an estimate is
    r = cli("stream", "import", "quiet", str(out), "-q")
    assert r.returncode == 0 and r.stderr == b""


def test_postgresql_round_trip(data_dir, tmp_path, pg_url, pg_server):
    _fill(str(data_dir))
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    assert main(["stream", "export", "chat", str(a), "--format", "binary"]) == 0
    r = cli("stream", "import", "chat", str(a), "--keep-indices", "--store", pg_url)
    assert r.returncode == 0 and pg_server.password not in (r.stdout + r.stderr).decode()
    assert main(["stream", "export", "chat", str(b), "--format", "binary", "--store", pg_url]) == 0
    assert a.read_bytes() == b.read_bytes()
    assert _entries(pg_url, "chat") == _entries(str(data_dir), "chat")


def test_an_export_file_is_written_whole_or_not_at_all(data_dir, tmp_path, capsys):
    with open_store(str(data_dir)) as s:
        s.append("bad", 1)
        with s.transaction() as tx:
            tx.append_encoded("bad", [b"\xb4\xb3"])  # damaged: does not decode
    out = tmp_path / "bad.pr"
    assert main(["stream", "export", "bad", str(out)]) == 1
    assert "entry 1 of 'bad' does not decode" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "bad.pr.part").exists()
    assert main(["stream", "export", "bad", str(tmp_path / "no" / "dir.pr")]) == 1
    assert capsys.readouterr().err == (f"dataspace stream: export: cannot write "
                                       f"{tmp_path / 'no' / 'dir.pr'}: No such file or directory\n")


def test_a_value_spanning_many_lines_is_read_in_linear_time():
    lines = ["[\n"] + ["1\n"] * 200_000 + ["]\n", "2\n"]
    t0 = time.monotonic()
    got = [v for chunk in text_values(iter(lines)) for v in chunk]
    assert time.monotonic() - t0 < 4.0  # parsed again at each line: minutes
    assert [line for line, _v in got] == [1, 200_003] and len(got[0][1]) == 200_000
    with pytest.raises(BadInput, match="stdin ends inside a value"):
        list(Input(io.BytesIO(b"[1\n2\n"), "text"))


def test_help_has_examples():
    for sub in ("export", "import"):
        r = cli("stream", sub, "--help")
        assert r.returncode == 0 and b"examples:" in r.stdout
    assert b"dataspace stream export chat chat.pr" in cli("stream", "--help").stdout
