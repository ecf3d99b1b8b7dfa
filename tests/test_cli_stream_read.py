"""``dataspace stream read``, ``--json`` on the stream commands, and what ``tail``, ``read``
and ``export`` do with a damaged entry (issue 28 §4, §5): every intact entry comes out,
each damaged one is named on standard error, and the exit status is 1 -- a damaged entry is
never printed, and never stops the entries after it from coming out."""

from __future__ import annotations

import json
import sqlite3

import pytest

from dataspace.cli import main
from dataspace.streams import open_store
from dataspace.values import Record, Symbol, encode, parse
from store_damage import Raw

SAYS = Symbol("Says")


def says(i: int) -> Record:
    return Record(SAYS, [f"user-{i % 3}", f"m{i}"])


def line(i: int) -> str:
    return f'{i}  <Says "user-{i % 3}" "m{i}">'


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


@pytest.fixture
def chat(store_url) -> str:
    """``chat``: 30 entries, every fifth with metadata; a tailer ``me`` at 12."""
    with open_store(store_url) as s, s.transaction() as tx:
        tx.append_encoded("chat", [encode(says(i)) for i in range(30)],
                          [encode(parse(f"{{n: {i}}}")) if i % 5 == 0 else None for i in range(30)])
        tx.set_position("chat", "me", 12)
    return store_url


# -- stream read -----------------------------------------------------------------------------------


def test_read_prints_from_an_index_as_tail_does(chat, capsys):
    where = ["--store", chat]
    code, out, err = run(capsys, "stream", "read", "chat", *where)
    assert code == 0 and out.splitlines() == [line(i) for i in range(10)] and not err
    code, out, _ = run(capsys, "stream", "read", "chat", "--from", "25", "--count", "3", *where)
    assert code == 0 and out.splitlines() == [line(i) for i in range(25, 28)]
    code, out, _ = run(capsys, "stream", "read", "chat", "--from", "27", "-n", "100", *where)
    assert out.splitlines() == [line(i) for i in range(27, 30)]  # to the end, no error
    code, out, _ = run(capsys, "stream", "read", "chat", "--from", "10", "-n", "1", "--meta",
                       "--no-index", *where)
    assert out == '<Says "user-1" "m10">  meta {n: 10}\n'
    code, out, _ = run(capsys, "stream", "read", "chat", "--from", "9", "-n", "2", "--json", *where)
    rows = [json.loads(x) for x in out.splitlines()]
    # As send, scry and observe --json give values (for jq): `text` the Preserves text,
    # `value` (and `meta`) mapped to JSON; `meta_text` the metadata's text.
    assert [(r["index"], r["text"], r["value"], r["meta"], r["meta_text"]) for r in rows] == [
        (9, '<Says "user-0" "m9">', {"@record": "Says", "@fields": ["user-0", "m9"]}, None,
         None),
        (10, '<Says "user-1" "m10">', {"@record": "Says", "@fields": ["user-1", "m10"]},
         {"n": 10}, "{n: 10}")]
    assert all(set(r) == {"index", "time", "text", "value", "meta", "meta_text"}
               and r["time"] > 1e9 for r in rows)
    code, out, _ = run(capsys, "stream", "tail", "chat", "-n", "1", "--json", *where)
    assert json.loads(out)["value"] == {"@record": "Says", "@fields": ["user-2", "m29"]}, out


def test_read_says_where_the_stream_starts_and_ends(chat, capsys):
    where = ["--store", chat]
    code, _out, err = run(capsys, "stream", "read", "chta", *where)
    assert code == 1 and err == ("dataspace stream: no stream named 'chta' (dataspace stream ls "
                                 "lists them)\n")
    code, _out, err = run(capsys, "stream", "read", "chat", "--from", "30", *where)
    assert code == 1 and err == (
        "dataspace stream: index 30 is beyond the end of 'chat': its entries are 0..29 and its "
        "next append gets index 30 (`dataspace stream tail chat -f` waits for new ones)\n")
    with open_store(chat) as s:
        s.create_stream("chat", max_count=10)
        s.apply_retention()
        s.create_stream("empty")
    code, _out, err = run(capsys, "stream", "read", "chat", "--from", "3", *where)
    assert code == 1 and err == (
        "dataspace stream: entries below index 20 of 'chat' are no longer stored (retention "
        "removed them): the stream starts at index 20 now (dataspace stream read chat --from "
        "20)\n")
    code, out, _ = run(capsys, "stream", "read", "chat", "-n", "2", *where)
    assert code == 0 and out.splitlines() == [line(20), line(21)]  # from the first stored
    code, _out, err = run(capsys, "stream", "read", "empty", *where)
    assert code == 1 and "holds no entries yet" in err
    for bad in (["--from", "-1"], ["--count", "0"], ["--from", "x"]):
        with pytest.raises(SystemExit) as e:
            main(["stream", "read", "chat", *bad, *where])
        assert e.value.code == 2
        assert "error: argument" in capsys.readouterr().err


def test_read_is_a_command_with_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["stream", "read", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--from INDEX" in out and "examples:" in out
    assert "dataspace stream read chat --from 100 -n 20" in out
    assert max(len(x) for x in out.splitlines()) <= 92


# -- --json on ls and info --------------------------------------------------------------------------


def test_ls_and_info_json(chat, capsys):
    where = ["--store", chat]
    code, out, _ = run(capsys, "stream", "ls", "--json", *where)
    got = json.loads(out)
    assert code == 0 and isinstance(got, list) and [s["name"] for s in got] == ["chat"]
    s = got[0]
    assert {k: s[k] for k in ("length", "first", "last", "next", "max_count", "max_age",
                              "internal")} == {"length": 30, "first": 0, "last": 29, "next": 30,
                                               "max_count": None, "max_age": None,
                                               "internal": False}
    assert [(t["name"], t["position"], t["lag"]) for t in s["tailers"]] == [("me", 12, 18)]
    code, out, _ = run(capsys, "stream", "info", "chat", "--json", "--check", *where)
    info = json.loads(out)
    assert code == 0 and info["name"] == "chat" and info["store"]
    assert {k: info[k] for k in s if k not in ("created", "last_time")} == {
        k: s[k] for k in s if k not in ("created", "last_time")}
    assert info["integrity"] == {"ok": True, "streams": 1, "entries": 30, "tailers": 1,
                                 "groups": 0, "pending": 0, "unsealed": 0, "problems": []}
    with open_store(chat) as st:
        st.create_stream("empty")
    code, out, _ = run(capsys, "stream", "ls", "--json", *where)
    empty = next(x for x in json.loads(out) if x["name"] == "empty")
    assert (empty["length"], empty["first"], empty["last"], empty["next"]) == (0, None, None, 0)


def test_info_json_with_check_of_a_damaged_store(chat, capsys):
    raw = Raw(chat)
    raw.flip("chat", 17)
    raw.close()
    code, out, _ = run(capsys, "stream", "info", "chat", "--json", "--check", "--store", chat)
    info = json.loads(out)
    assert code == 1 and info["integrity"]["ok"] is False
    assert info["integrity"]["problems"] == [
        "stream 'chat': 1 entry does not match its checksum (the first: 17)"]


# -- --check speaks in plurals that agree (issue 28 §4) -----------------------------------------


def test_check_output_grammar(tmp_path, capsys):
    d = tmp_path / "data"
    with open_store(d) as s:
        s.append_many("one", range(20))
    code, out, _ = run(capsys, "stream", "info", "one", "--check", "--data-dir", str(d))
    assert "integrity   ok (20 entries in 1 stream read and verified)" in out
    c = sqlite3.connect(d / "streams.sqlite3")
    c.execute("UPDATE entries SET idx = 25 WHERE idx = 19")
    c.commit()
    c.close()
    code, out, _ = run(capsys, "stream", "info", "one", "--check", "--data-dir", str(d))
    assert code == 1
    assert "integrity   PROBLEMS (20 entries in 1 stream read and verified):" in out
    assert "  stream 'one': 1 of its 20 entries is missing (the first: 19)" in out
    assert ("  stream 'one': 1 entry out of place: twice, or outside its indices 0..19 "
            "(the first: 25)") in out
    assert "indices indices" not in out and " 1 streams" not in out and "1 entries" not in out


# -- a damaged entry: tail, read and export (issue 28 §4) ------------------------------------------


@pytest.fixture
def damaged(chat) -> str:
    """``chat`` with entry 25 damaged (a flipped bit in its value): among the last 10."""
    raw = Raw(chat)
    raw.flip("chat", 25)
    raw.close()
    return chat


def test_tail_prints_every_intact_entry_and_names_the_damaged_one(damaged, capsys):
    """The issue: one damaged entry among the last 10 made `tail` print nothing, exit 1."""
    code, out, err = run(capsys, "stream", "tail", "chat", "--store", damaged)
    assert code == 1
    assert out.splitlines() == [line(i) for i in range(20, 30) if i != 25]
    lines = err.splitlines()
    assert lines[0].startswith("dataspace stream: stream 'chat' in ") and \
        "is damaged: entry 25 does not match its checksum" in lines[0]
    assert lines[1] == ("dataspace stream: stream 'chat': entry 25 is damaged: it does not "
                        "match its checksum (its value, metadata or index changed); left out")
    assert lines[-1] == ("dataspace stream: 'chat' is damaged: 9 intact entries printed, the "
                         "damage named above left out")
    # read, and tail from an index, the same; before the damaged entry: nothing to say.
    code, out, err = run(capsys, "stream", "read", "chat", "--from", "23", "-n", "4", "--store",
                         damaged)
    assert code == 1 and out.splitlines() == [line(23), line(24), line(26)]
    code, out, err = run(capsys, "stream", "read", "chat", "--from", "20", "-n", "5", "--store",
                         damaged)
    assert code == 0 and not err and len(out.splitlines()) == 5
    # A named tailer is not moved by the read that met the damage (nor past it).
    code, out, err = run(capsys, "stream", "tail", "chat", "--tailer", "me", "--store", damaged)
    assert code == 1 and out.splitlines() == [line(i) for i in range(12, 30) if i != 25]
    with open_store(damaged) as s:
        assert s.position("chat", "me") == 12


def test_tail_follow_stops_at_damage(damaged, capsys):
    code, out, _err = run(capsys, "stream", "tail", "chat", "-f", "--from", "24", "--store", damaged)
    assert code == 1 and out.splitlines() == [line(i) for i in range(24, 30) if i != 25]


def test_export_stops_at_damage_unless_asked_to_skip_it(damaged, capsys, tmp_path):
    for fmt in ("text", "binary"):
        out = tmp_path / f"chat.{fmt}"
        code, _o, err = run(capsys, "stream", "export", "chat", str(out), "--format", fmt, "-q",
                            "--store", damaged)
        assert code == 1 and not out.exists() and "is damaged: entry 25 " in err, err
        code, _o, err = run(capsys, "stream", "export", "chat", str(out), "--format", fmt, "-q",
                            "--skip-damaged", "--store", damaged)
        assert code == 1 and out.exists(), err
        assert ("dataspace stream: stream 'chat': entry 25 is damaged: it does not match its "
                "checksum (its value, metadata or index changed); left out") in err.splitlines()
        assert err.splitlines()[-1] == (
            f"dataspace stream: exported the 29 intact entries of chat (indices 0..29) to {out}; "
            "the damage named above was left out (the export's header says salvaged: #t)")
        # What it holds is every intact entry, at its own index; imported, it reads back.
        code, _o, err = run(capsys, "stream", "import", "back", str(out), "--keep-indices",
                            "--store", str(tmp_path / f"back-{fmt}"))
        assert code == 1 and "index 26 after index 24" in err  # the gap is plain to see
    text = (tmp_path / "chat.text").read_text().splitlines()
    assert text[0] == '<dataspace-stream-export 1 {salvaged: #t stream: "chat"}>'
    assert [x.split(" ")[1] for x in text[1:]] == [str(i) for i in range(30) if i != 25]
