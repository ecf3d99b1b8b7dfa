"""A configuration file's errors as a new user meets them (issue 28, section 3): a file
written as JSON is told that keys are symbols, with the corrected form; a misspelt key
gets the likely one, as command-line options do."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dataspace.broker.config import ConfigError, parse_config


def error(text: str) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(text)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_json_key_is_shown_as_the_symbol_it_must_be():
    assert error('{"tcp": ["127.0.0.1:7411"], "http": "127.0.0.1:7480"}') == (
        'the setting "tcp" is a string: keys are symbols, written without quotes: '
        'tcp: ["127.0.0.1:7411"] (the file is Preserves text, not JSON)')
    assert error('{cluster: {"listen": "0.0.0.0:7422"}}') == (
        'the key "listen" in cluster is a string: keys are symbols, written without quotes: '
        'listen: "0.0.0.0:7422" (the file is Preserves text, not JSON)')
    assert error('{link: [{"address": "10.0.0.2:7411", "cap": "@peer.sturdyref"}]}') == (
        'the key "address" in a link is a string: keys are symbols, written without quotes: '
        'address: "10.0.0.2:7411" (the file is Preserves text, not JSON)')
    # JSON's booleans, once the keys are right.
    assert error('{tcp: ["127.0.0.1:7411"], http-open: true}') == (
        "http-open must be #t or #f, not true (Preserves writes true as #t)")
    # The corrected form works.
    assert parse_config('{tcp: ["127.0.0.1:7411"], http-open: #f}').tcp == ["127.0.0.1:7411"]


def test_a_misspelt_key_gets_the_likely_one():
    msg = error("{max-conections: 5}")
    assert msg.startswith("unknown setting max-conections (did you mean max-connections?); "
                          "the settings are: bind, cluster, ")
    assert error('{"tpc": []}').startswith(
        'unknown setting "tpc" (did you mean tcp? keys are symbols, written without quotes: '
        'tcp: ...); the settings are: ')
    assert error('{cluster: {lisen: "0.0.0.0:7422"}}') == (
        "unknown key lisen in cluster (did you mean listen?); it has: listen, routes, name, "
        "secret, advertise, ping, dead, max-members")
    assert error('{link: [{adress: "h:7411" cap: "@f"}]}') == (
        "unknown key adress in a link (did you mean address?); a link has address and cap, "
        "and may have tls-ca, tls-cert, tls-key, tls-server-name")
    # Nothing close: the list alone, as before.
    msg = error("{frobnicate: 1}")
    assert msg.startswith("unknown setting frobnicate; the settings are: bind, ") and "did you" not in msg


def test_serve_says_it_in_one_line(tmp_path):
    (tmp_path / "server.json").write_text('{\n  "tcp": ["127.0.0.1:0"],\n  "http-open": true\n}\n')
    r = subprocess.run([sys.executable, "-m", "dataspace.cli", "serve", "--config",
                        str(tmp_path / "server.json"), "--data-dir", str(tmp_path / "data")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr == (f'dataspace serve: {tmp_path / "server.json"}: the setting "tcp" is a '
                        'string: keys are symbols, written without quotes: tcp: ["127.0.0.1:0"] '
                        "(the file is Preserves text, not JSON)\n")
