"""`--json` on the commands that report, for jq: one object per line where output
streams (issue 28, section 5).  `observe`, `query`, `request` are in test_cli_clients.py,
`reply` in test_cli_reply.py, `send` in test_cli_send.py, `clients` in
test_cli_connections.py, `cap` in test_cli_cap.py; here `scry get` / `scry follow`."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

from broker_support import ServerProcess, async_test


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dataspace.cli", *args], capture_output=True,
                          text=True, timeout=60)


@async_test
async def test_scry_json(tmp_path):
    data = tmp_path / "data"
    sp = await ServerProcess(data, extra=("--scry-udp", "127.0.0.1:0", "--publish",
                                          "chat")).start()
    try:
        line = next(s for s in sp.stderr_lines if "scry on udp://" in s)
        m = re.search(r"udp://127\.0\.0\.1:\d+/", line)
        assert m
        url = m.group(0) + "chat"
        r = await asyncio.to_thread(run_cli, "stream", "append", "chat", '<Says "ann" "hi">',
                                    "#x\"0102\"", "--data-dir", str(data))
        assert r.returncode == 0, r.stderr
        r = await asyncio.to_thread(run_cli, "scry", "follow", url, "--from", "start",
                                    "--count", "2", "--json")
        assert r.returncode == 0, r.stderr
        assert [json.loads(x) for x in r.stdout.splitlines()] == [
            {"index": 0, "text": '<Says "ann" "hi">',
             "value": {"@record": "Says", "@fields": ["ann", "hi"]}},
            {"index": 1, "text": '#x"0102"', "value": {"@bytes": "AQI="}}]
        r = await asyncio.to_thread(run_cli, "scry", "get", url + "/1", "--json")
        assert json.loads(r.stdout) == {"index": 1, "text": '#x"0102"',
                                        "value": {"@bytes": "AQI="}}
    finally:
        await sp.stop()
