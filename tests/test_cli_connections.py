"""A server's connections on the command line: `dataspace clients` (as Redis's CLIENT
LIST and `nats server report connections` give them) over GET /api/connections, with
the fields it lacked (assertions held apart from subscriptions, TLS), on a real server
with a TLS listener (issue 28, section 5)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import trustme

from broker_support import async_test, running_server
from dataspace.client import connect
from dataspace.protocol.sturdy import attenuate
from dataspace.values import parse

HEADINGS = ["ID", "CLIENT", "ADDRESS", "AGE", "VIA", "ASSERT", "SUBS", "MSG IN", "MSG OUT",
            "B IN", "B OUT"]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run([sys.executable, "-m", "dataspace.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**e, **(env or {})})


def _pki(d: Path) -> tuple[Path, Path, Path]:
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    paths = d / "ca.crt", d / "server.crt", d / "server.key"
    ca.cert_pem.write_to_path(str(paths[0]))
    leaf.cert_chain_pems[0].write_to_path(str(paths[1]))
    leaf.private_key_pem.write_to_path(str(paths[2]))
    return paths


def _headings(line: str) -> list[str]:
    """The headings of the table's first line (two-word ones kept together)."""
    words = line.split()
    out: list[str] = []
    for w in words:
        if out and out[-1] in ("MSG", "B") and w in ("IN", "OUT"):
            out[-1] += " " + w
        else:
            out.append(w)
    return out


@async_test
async def test_connections_and_the_clients_command(tmp_path):
    from dataspace.web import start_http

    ca, cert, key = _pki(tmp_path)
    sock = tmp_path / "ds.sock"
    async with running_server(tmp_path, tls_cert=str(cert), tls_key=str(key),
                              unix=[str(sock)]) as server:
        tls_addr = next(str(a) for a in server.addresses if a.kind == "tls")
        http = await start_http("127.0.0.1", 0, store=None, publish=(), server=server)
        worker = await connect(tls_addr, server.sturdyref, tls_ca=str(ca),
                               name="billing worker with a rather long name")
        worker.assert_(parse('<Present "w">'))
        worker.assert_(parse('<Lease "job-1">'))
        worker.observe("<Job $id>", on_message=lambda *_: None)
        await worker.sync()
        quiet = await connect(f"unix:{sock}", server.sturdyref)  # gives no name
        for i in range(3):
            quiet.send(parse(f"<Job {i}>"))
        await quiet.sync()
        await worker.sync()
        http_args = ("--url", http.url, "--token", str(server.sturdyref))
        try:
            # The endpoint: assertions apart from subscriptions, and TLS.
            async with aiohttp.ClientSession() as s, s.get(
                    http.url + "api/connections",
                    headers={"Authorization": f"Bearer {server.sturdyref}"}) as resp:
                rows = {r["name"]: r for r in (await resp.json())["connections"]}
            w, q = rows["billing worker with a rather long name"], rows[None]
            assert (w["transport"], w["tls"]) == ("tls", True)
            assert w["tls_version"] in ("TLSv1.2", "TLSv1.3")
            assert (w["assertions"], w["observers"], w["assertions_in"]) == (2, 1, 3)
            assert (w["messages_out"], q["messages_in"]) == (3, 3)
            assert (q["transport"], q["tls"], q["tls_version"]) == ("unix", False, None)
            assert (q["assertions"], q["observers"]) == (0, 0)

            # The table at 80 columns: every column, nothing wider, long names cut.
            r = await asyncio.to_thread(run_cli, "clients", *http_args, env={"COLUMNS": "80"})
            assert r.returncode == 0, r.stderr
            lines = r.stdout.splitlines()
            assert _headings(lines[0]) == HEADINGS
            assert all(len(x) <= 80 for x in lines), lines
            assert len(lines) == 3
            by_id = sorted(lines[1:], key=lambda x: int(x.split()[0]))
            assert by_id == lines[1:]  # by id by default
            wl = next(x for x in lines[1:] if "billing" in x)
            assert "…" in wl and " tls " in wl
            cells = wl.split()
            assert cells[-6:-2] == ["2", "1", "0", "3"]  # ASSERT SUBS MSG IN, MSG OUT
            ql = next(x for x in lines[1:] if "billing" not in x)
            assert ql.split()[1] == "-" and " unix " in ql

            # Sorted: the busiest sender first; reversed.
            r = await asyncio.to_thread(run_cli, "clients", "--sort", "msgs-in", *http_args)
            assert r.stdout.splitlines()[1].split()[1] == "-"
            r = await asyncio.to_thread(run_cli, "connections", "--sort", "msgs-in", "-r",
                                        *http_args)
            assert "billing worker with a rather long name" in r.stdout.splitlines()[1]

            # A narrow terminal keeps ID and CLIENT and drops columns whole.
            r = await asyncio.to_thread(run_cli, "clients", *http_args, env={"COLUMNS": "40"})
            lines = r.stdout.splitlines()
            assert _headings(lines[0])[:2] == ["ID", "CLIENT"]
            assert all(len(x) <= 40 for x in lines), lines

            # --json: one object per line, the endpoint's rows.
            r = await asyncio.to_thread(run_cli, "clients", "--json", "--sort", "assertions",
                                        *http_args)
            objs = [json.loads(x) for x in r.stdout.splitlines()]
            assert [o["name"] for o in objs] == ["billing worker with a rather long name", None]
            assert objs[0]["tls"] is True and objs[1]["tls"] is False

            # A token that is not the administrator's is told what to give.
            other = attenuate(server.sturdyref, parse("<reject <_>>"))
            r = await asyncio.to_thread(run_cli, "clients", "--url", http.url, "--token",
                                        str(other))
            assert r.returncode == 1
            assert r.stderr == ("dataspace clients: this token sees only how many connections "
                                "there are (2): give the server's root sturdyref (--token "
                                "@root.sturdyref, or --data-dir DIR of the server)\n")
        finally:
            await worker.close()
            await quiet.close()
            await http.close()


def test_clients_table_fits_and_cuts():
    from dataspace.cli.clients import table

    rows = [{"id": 7, "name": "x" * 50, "peer": "[2001:db8::1]:40312", "age": 3725.0,
             "transport": "wss", "assertions": 1234, "observers": 5, "messages_in": 1_500_000,
             "messages_out": 12, "bytes_in": 3 * 1024 ** 3, "bytes_out": 0}]
    full = table(rows, None)
    assert full[1].split() == ["7", "x" * 50, "[2001:db8::1]:40312", "1h02m", "wss", "1.2k",
                               "5", "1.5M", "12", "3.0G", "0B"]
    for width in (80, 60, 30):
        lines = table(rows, width)
        assert all(len(x) <= width for x in lines), (width, lines)
        assert lines[1].split()[1].endswith("…")
