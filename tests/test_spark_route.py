"""Routing at Spark scale: values matched against patterns with the skeleton index built
once per worker; checked against ``dataspace.pattern.match`` on every (pattern, value)
pair of random tables."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from dataspace.cli import main
from dataspace.pattern import DISCARD, Arr, Bind, Dict, Lit, Rec, match, parse_pattern
from dataspace.streams import open_store
from dataspace.values import Dictionary, Record, Sequence, Symbol, encode, key, stringify

pytest.importorskip("pyspark")

from dataspace.pipeline.spark.route import RouteError, load_patterns, parse_patterns, route

ATOMS = [1, 1.0, True, 0, "x", "y", Symbol("s"), b"x", -7, "long text"]
LABELS = [Symbol("a"), Symbol("b"), Symbol("Says")]
KEYS = ["k", "l", 1]


def rand_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 2 or r < 0.35:
        return rng.choice(ATOMS)
    if r < 0.75:
        return Record(rng.choice(LABELS), [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))])
    if r < 0.9:
        return Sequence(rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3)))
    d = {}
    for k in rng.sample(KEYS, rng.randint(0, 3)):
        d[key(k)] = (k, rand_value(rng, depth + 1))
    return Dictionary(d.values())


def rand_pattern(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 2 or r < 0.3:
        return rng.choice([DISCARD, Bind(), Lit(rng.choice(ATOMS))])
    if r < 0.4:
        return Bind(rand_pattern(rng, depth + 1))
    if r < 0.8:
        return Rec(rng.choice(LABELS), {i: rand_pattern(rng, depth + 1)
                                         for i in rng.sample(range(3), rng.randint(0, 2))})
    if r < 0.9:
        return Arr({i: rand_pattern(rng, depth + 1) for i in rng.sample(range(3), rng.randint(0, 2))})
    return Dict([(k, rand_pattern(rng, depth + 1)) for k in rng.sample(KEYS, rng.randint(0, 2))])


def brute(patterns, values):
    want = Counter()
    for i, v in enumerate(values):
        for pid, text in patterns:
            caps = match(parse_pattern(text), v)
            if caps is not None:
                want[(pid, i, tuple(encode(c) for c in caps))] += 1
    return want


def got_of(df):
    return Counter((r["pattern"], r["index"], tuple(bytes(c) for c in r["captures"]))
                   for r in df.collect())


def test_routing_agrees_with_match_on_random_tables(spark, tmp_path):
    rng = random.Random(5)
    values = [rand_value(rng) for _ in range(400)]
    pats = [rand_pattern(rng) for _ in range(80)]
    pats += [Rec(Symbol("a"), {0: Bind()})] * 2 + [DISCARD]  # duplicates and match-all
    patterns = [(f"p{n}", str(p)) for n, p in enumerate(pats)]
    with open_store(tmp_path) as s:
        s.append_many("vals", values)
    df = route(spark, patterns, "vals", data_dir=tmp_path)
    assert df.columns == ["pattern", "index", "captures", "captures_text"]
    rows = df.collect()
    want = brute(patterns, values)
    assert sum(want.values()) > 400  # (the match-all pattern alone gives 400)
    assert Counter((r["pattern"], r["index"], tuple(bytes(c) for c in r["captures"]))
                   for r in rows) == want
    for r in rows[:50]:
        assert r["captures_text"] == [stringify(parse_caps) for parse_caps in
                                      match(parse_pattern(dict(patterns)[r["pattern"]]), values[r["index"]])]
    # a DataFrame of values with a text column; patterns as a DataFrame
    vdf = spark.createDataFrame([(i, stringify(v)) for i, v in enumerate(values[:50])],
                                "index long, text string")
    pdf = spark.createDataFrame(patterns[:20], "id string, pattern string")
    assert got_of(route(spark, pdf, vdf)) == brute(patterns[:20], values[:50])


def test_pattern_files(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text('<Says "alice" $text>\n\n; a comment\nbob\t<Says "bob" _>\n[1 $]\n')
    assert load_patterns(f) == [("0", '<Says "alice" $text>'), ("bob", '<Says "bob" _>'),
                                ("2", "[1 $]")]
    with pytest.raises(RouteError, match=r"p\.txt:2: not a pattern"):
        parse_patterns(["<a>", "<unclosed"], "p.txt")
    with pytest.raises(RouteError, match="used twice"):
        parse_patterns(["x\t<a>", "x\t<b>"])


def test_route_command_on_a_stream_and_on_a_dataset(spark, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DATASPACE_DATA_DIR", str(tmp_path / "data"))
    main(["stream", "append", "chat", '<Says "alice" "hi">', '<Says "bob" "yo">', "<Present 1>"])
    (tmp_path / "p.txt").write_text('<Says $who _>\npresent\t<Present $>\n')
    capsys.readouterr()
    out = tmp_path / "m.parquet"
    assert main(["pipeline", "route", "--patterns", str(tmp_path / "p.txt"), "--values", "chat",
                 "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "3 values, 3 matches" in said
    # Each job is said as it ends (the command was once silent for 27 s).
    assert re.search(r"\ndataspace pipeline route: 3 values to match \(\d+\.\ds\)\n", said), said
    assert re.search(r"\ndataspace pipeline route: 3 matches written to .*m\.parquet \(\d+\.\ds\)\n",
                     said), said
    got = sorted((r["pattern"], r["index"], r["captures_text"]) for r in spark.read.parquet(str(out)).collect())
    assert got == [("0", 0, ['"alice"']), ("0", 1, ['"bob"']), ("present", 2, ["1"])]
    # a JSON dataset of Preserves text, JSON output
    data = tmp_path / "vals.json"
    data.write_text('{"index": 10, "text": "<Says \\"eve\\" 1>"}\n{"index": 11, "text": "<Other>"}\n')
    out2 = tmp_path / "m.json"
    assert main(["pipeline", "route", "--patterns", str(tmp_path / "p.txt"), "--values", str(data),
                 "--out", str(out2)]) == 0
    rows = spark.read.json(str(out2)).collect()
    assert [(r["pattern"], r["index"], r["captures_text"]) for r in rows] == [("0", 10, ['"eve"'])]
    assert main(["pipeline", "route", "--patterns", str(tmp_path / "p.txt"), "--values", "nope",
                 "--out", str(out2)]) == 2
    assert "nor a stream of that name" in capsys.readouterr().err


def test_route_checks_its_inputs_before_starting_spark(tmp_path, capsys, monkeypatch):
    """A typo in --values once cost a Spark start (12 s) before the error.  With no Java
    at all, the error is still about the input: nothing needed Spark yet."""
    monkeypatch.setenv("DATASPACE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-java-here"))
    main(["stream", "append", "chat", '<Says "alice" "hi">'])
    (tmp_path / "p.txt").write_text("<Says $who _>\n")
    capsys.readouterr()
    argv = ["pipeline", "route", "--patterns", str(tmp_path / "p.txt"), "--out", str(tmp_path / "m")]
    assert main([*argv, "--values", "chta"]) == 2
    assert capsys.readouterr().err == (
        f"dataspace pipeline: chta: no such file or directory, nor a stream of that name in "
        f"{tmp_path / 'data' / 'streams.sqlite3'} (dataspace stream ls lists them)\n")
    assert main([*argv, "--values", "chat"]) == 1  # good inputs: now Java is missing
    assert "Java 17 or newer is needed for Spark" in capsys.readouterr().err


def test_route_command_reads_a_store_by_url(spark, pg_url, tmp_path, capsys):
    """--store URL: the stream comes from that store (here PostgreSQL, which a cluster's
    executors read themselves); a missing stream is named with the password masked."""
    from dataspace.pipeline.spark._store import split_password

    with open_store(pg_url) as s:
        s.append_many("chat", [Record(Symbol("Says"), ["alice", "hi"]), Record(Symbol("Present"), [1])])
    (tmp_path / "p.txt").write_text("<Says $who _>\n")
    out = tmp_path / "m.parquet"
    argv = ["pipeline", "route", "--patterns", str(tmp_path / "p.txt"), "--store", pg_url,
            "--out", str(out)]
    assert main([*argv, "--values", "chat"]) == 0
    assert "2 values, 1 match" in capsys.readouterr().out
    assert [r["captures_text"] for r in spark.read.parquet(str(out)).collect()] == [['"alice"']]
    assert main([*argv, "--values", "chta"]) == 2
    err = capsys.readouterr().err
    assert "nor a stream of that name in postgresql://" in err
    assert split_password(pg_url)[1] not in err
