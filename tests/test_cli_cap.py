"""``dataspace cap``: mint, attenuate, check and show, run as real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from dataspace.protocol.sturdy import SturdyRef, mint, signature, validate
from dataspace.values import parse


def cap(*args: str, data_dir=None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # Never look at the real data directory of whoever runs the tests.
    env["DATASPACE_DATA_DIR"] = str(data_dir or os.path.join(tempfile.gettempdir(), "dataspace-test-absent"))
    return subprocess.run(
        [sys.executable, "-m", "dataspace.cli", "cap", *args],
        capture_output=True, text=True, timeout=60, env=env, input=stdin,
    )


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "root.key").write_bytes(bytes(range(32)))
    return d


def test_help_has_examples():
    for sub in ((), ("mint",), ("attenuate",), ("check",), ("show",)):
        r = cap(*sub, "--help")
        assert r.returncode == 0, r.stderr
        assert "examples:" in r.stdout
    r = cap()
    assert r.returncode == 2 and "choose a subcommand" in r.stderr


def test_mint_with_the_data_dir_key(data_dir, tmp_path):
    r = cap("mint", data_dir=data_dir)
    assert r.returncode == 0, r.stderr
    ref = SturdyRef.parse(r.stdout)
    assert ref == mint("root", bytes(range(32)))  # the server's default root oid
    # The server writes its root ref; mint then reproduces it, whatever the root oid is.
    server_root = mint(parse('<space "main">'), bytes(range(32)))
    (data_dir / "root.sturdyref").write_text(f"{server_root}\n")
    r = cap("mint", data_dir=data_dir)
    assert SturdyRef.parse(r.stdout) == server_root
    # --data-dir, --oid, --key-hex and --key-file choose the key and the object.
    r = cap("mint", "--data-dir", str(data_dir), "--oid", '<space "chat">')
    assert SturdyRef.parse(r.stdout) == mint(parse('<space "chat">'), bytes(range(32)))
    r = cap("mint", "--key-hex", "", "--oid", '"syndicate"', data_dir=tmp_path / "none")
    assert r.stdout.strip() == '<ref {oid: "syndicate" sig: #x"69ca300c1dbfa08fba692102dd82311a"}>'
    (tmp_path / "k").write_bytes(b"secret")
    r = cap("mint", "--key-file", str(tmp_path / "k"), "--oid", "1")
    assert SturdyRef.parse(r.stdout) == mint(1, b"secret")
    # A damaged root.sturdyref is reported, not silently replaced by another oid.
    (data_dir / "root.sturdyref").write_text("<ref {oid: 1}>")
    r = cap("mint", data_dir=data_dir)
    assert r.returncode == 2 and "pass --oid" in r.stderr


def test_clear_error_when_there_is_no_key(tmp_path):
    r = cap("mint", data_dir=tmp_path / "empty")
    assert r.returncode == 2
    assert "root.key does not exist" in r.stderr
    assert "dataspace serve" in r.stderr and "--key-hex" in r.stderr
    assert r.stdout == ""
    assert not (tmp_path / "empty" / "root.key").exists()  # never created by cap
    r = cap("check", '<ref {oid: 1 sig: #x"00000000000000000000000000000000"}>',
            "--data-dir", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_bad_keys_and_values(data_dir, tmp_path):
    r = cap("mint", "--key-hex", "xyz", "--oid", "1")
    assert r.returncode == 2 and "hexadecimal" in r.stderr
    r = cap("mint", "--key-file", str(tmp_path / "missing"), "--oid", "1")
    assert r.returncode == 2 and "does not exist" in r.stderr
    (data_dir / "root.key").write_bytes(b"short")
    r = cap("mint", data_dir=data_dir)
    assert r.returncode == 2 and "expected 32" in r.stderr
    r = cap("mint", "--key-hex", "00", "--oid", "<unclosed")
    assert r.returncode == 2 and "--oid is not valid Preserves text" in r.stderr


def test_attenuate_then_check(data_dir, tmp_path):
    root = cap("mint", data_dir=data_dir).stdout
    (tmp_path / "root.pr").write_text(root)
    r = cap("attenuate", f"@{tmp_path / 'root.pr'}",
            "--only", '<rec Says [<lit "alice"> String]>',
            "--only", "<rec Observe [<_> <_>]>",
            "--reject", "<rec Secret [<_>]>")
    assert r.returncode == 0, r.stderr
    ref = SturdyRef.parse(r.stdout)
    assert validate(ref, bytes(range(32)))
    assert ref.caveats == (
        parse('<or [<rewrite <bind <rec Says [<lit "alice"> String]>> <ref 0>> '
              '<rewrite <bind <rec Observe [<_> <_>]>> <ref 0>>]>'),
        parse("<reject <rec Secret [<_>]>>"),
    )
    a = ref.attenuation()
    assert a.apply(parse('<Says "alice" "hi">')) is not None
    assert a.apply(parse('<Says "bob" "hi">')) is None
    (tmp_path / "ref.pr").write_text(r.stdout)

    ok = cap("check", f"@{tmp_path / 'ref.pr'}", data_dir=data_dir)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("valid") and "caveats: 2" in ok.stdout
    bad = cap("check", f"@{tmp_path / 'ref.pr'}", "--key-hex", "00" * 32)
    assert bad.returncode == 1 and bad.stdout.startswith("INVALID")
    # A tampered ref (a caveat dropped) fails with the right key.
    stripped = SturdyRef(ref.oid, ref.sig, ref.caveats[:1])
    r = cap("check", str(stripped), data_dir=data_dir)
    assert r.returncode == 1 and "does not match" in r.stdout

    # One --only is a single rewrite; positional caveats come first; stdin works.
    r = cap("attenuate", "-", "<reject <rec Spam [<_>]>>", "--only", "<rec Present [String]>",
            stdin=root)
    assert r.returncode == 0, r.stderr
    assert SturdyRef.parse(r.stdout).caveats == (
        parse("<reject <rec Spam [<_>]>>"),
        parse("<rewrite <bind <rec Present [String]>> <ref 0>>"),
    )

    shown = cap("show", f"@{tmp_path / 'ref.pr'}")
    assert shown.returncode == 0
    assert 'oid: "root"' in shown.stdout and "<reject <rec Secret [<_>]>>" in shown.stdout


def test_attenuate_errors_teach(data_dir, tmp_path):
    root = cap("mint", data_dir=data_dir).stdout.strip()
    r = cap("attenuate", root)
    assert r.returncode == 2 and "nothing to add" in r.stderr
    r = cap("attenuate", root, "--only", "<rec Says [<String>]>")
    assert r.returncode == 2 and "write String instead of <String>" in r.stderr
    r = cap("attenuate", root, "<rewrite <bind <_>> <ref 1>>")
    assert r.returncode == 2 and "only 1 binding" in r.stderr
    r = cap("attenuate", root, "<future-caveat>")
    assert r.returncode == 2 and "reject everything" in r.stderr
    r = cap("attenuate", root, "<future-caveat>", "--allow-unknown")
    assert r.returncode == 0 and SturdyRef.parse(r.stdout).attenuation().apply(1) is None
    (tmp_path / "root.pr").write_text(root)
    r = cap("attenuate", str(tmp_path / "root.pr"), "--reject", "<_>")
    assert r.returncode == 2 and f"write @{tmp_path / 'root.pr'}" in r.stderr
    r = cap("attenuate", "@" + str(tmp_path / "nope.pr"), "--reject", "<_>")
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = cap("show", '<ref "syndicate" [] #x"69ca300c1dbfa08fba692102dd82311a">')
    assert r.returncode == 2 and "old" in r.stderr


def test_check_reports_unknown_and_invalid_caveats(data_dir):
    key = bytes(range(32))
    unknown = SturdyRef("syndicate", signature(key, "syndicate", [parse("<future>")]),
                        (parse("<future>"),))
    r = cap("check", str(unknown), data_dir=data_dir)
    assert r.returncode == 0 and "rejects everything" in r.stdout
    # Signed correctly but invalid (made without our checks): the server would refuse it.
    bad_caveat = parse("<rewrite <_> <ref 0>>")
    invalid = SturdyRef("syndicate", signature(key, "syndicate", [bad_caveat]), (bad_caveat,))
    r = cap("check", str(invalid), data_dir=data_dir)
    assert r.returncode == 1 and "caveat 1 is invalid" in r.stdout


def test_only_accepts_the_concise_pattern_syntax(tmp_path):
    from dataspace.protocol.sturdy import Attenuation, SturdyRef
    from dataspace.values import parse

    key = "00" * 32
    minted = cap("mint", "--key-hex", key, data_dir=tmp_path)
    assert minted.returncode == 0, minted.stderr
    r = cap("attenuate", minted.stdout.strip(), "--only", '<Says "alice" _>', data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    att = Attenuation(SturdyRef.parse(r.stdout.strip()).caveats)
    assert att.apply(parse('<Says "alice" "hi">')) == parse('<Says "alice" "hi">')
    assert att.apply(parse('<Says "bob" "hi">')) is None
    assert att.apply(parse('<Says "alice" "hi" "extra">')) is None  # the arity written
    bad = cap("attenuate", minted.stdout.strip(), "--only", "<_ 1>", data_dir=tmp_path)
    assert bad.returncode == 2 and "not a pattern of the attenuation language" in bad.stderr
    bad = cap("attenuate", minted.stdout.strip(), "--only", "<$x 1 2>", data_dir=tmp_path)
    assert bad.returncode == 2 and "concise syntax" in bad.stderr


def test_show_and_check_json(data_dir):
    """`cap show --json` / `cap check --json`: one object a script reads with jq (issue 28)."""
    import json

    key = bytes(range(32))
    root = mint("root", key)
    att = cap("attenuate", str(root), "--only", '<Says "alice" _>', "--reject", "<Secret _>",
              data_dir=data_dir).stdout.strip()
    r = cap("show", att, "--json", data_dir=data_dir)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(r.stdout.splitlines()) == 1
    assert doc == {
        "oid": "root", "oid_text": '"root"', "sig": SturdyRef.parse(att).sig.hex(),
        "caveats": [
            {"text": '<rewrite <bind <rec Says [<lit "alice"> <_>]>> <ref 0>>',
             "kind": "rewrite", "problem": None},
            {"text": "<reject <rec Secret [<_>]>>", "kind": "reject", "problem": None}]}
    r = cap("check", att, "--json", data_dir=data_dir)
    assert r.returncode == 0
    assert json.loads(r.stdout) == {**doc, "valid": True, "signature_valid": True,
                                    "problems": []}
    # A symbol oid, an unknown caveat, a wrong key: said in the fields, status 1.
    odd = SturdyRef(parse("chat"), signature(key, parse("chat"), [parse("<future>")]),
                    (parse("<future>"),))
    r = cap("check", str(odd), "--json", "--key-hex", "00", data_dir=data_dir)
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert (doc["oid"], doc["oid_text"]) == ({"@symbol": "chat"}, "chat")
    assert (doc["valid"], doc["signature_valid"]) == (False, False)
    assert doc["caveats"][0]["kind"] == "unknown"
    assert doc["caveats"][0]["problem"].startswith("unknown kind: it rejects everything")
