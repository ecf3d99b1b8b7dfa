"""TLS under attack (issue 29, part 3), on loopback against a real `dataspace serve`:
200 connections to the TLS port that never start a handshake, 100 that finish it and
send nothing, and 200 that finish it on the HTTPS port and send no request.  The idle
HTTPS connections are closed after the first-request deadline (the server's
--handshake-timeout, short here; 30 s by default: within the issue's 35 s), what the
server holds stays bounded meanwhile, and once the attack ends its RSS is back within
40 MB of where it started within 30 s (within 15 MB, in fact).
"""

from __future__ import annotations

import asyncio
import ssl
import time

from broker_support import async_test
from dataspace.testing.broker_soak import ServerUnderTest, TLSFlood
from test_tls import pki  # noqa: F401  (the fixture)

MIB = 1 << 20


async def rss_mib(server: ServerUnderTest) -> float:
    mem = server.memory_kib()
    assert mem is not None, "the server is gone"
    return mem[0] / 1024


@async_test
async def test_tls_attack_memory_comes_back_and_idle_https_connections_are_closed(
        tmp_path, pki):  # noqa: F811
    server = ServerUnderTest(tmp_path / "data", [
        "--http", "127.0.0.1:0", "--tls-cert", str(pki.cert), "--tls-key", str(pki.key),
        "--handshake-timeout", "2"], verbose=False)
    await asyncio.to_thread(server.start, 30.0)
    try:
        for _ in range(100):  # its start-up lines are read by a thread: the last one
            lines = server.lines()
            if any("Ctrl-C stops" in line for line in lines):
                break
            await asyncio.sleep(0.1)
        tls = next(line.split("listening on tls://")[1].split()[0] for line in lines
                   if "listening on tls://" in line)
        https = next(line.split("HTTP on https://")[1].split("/")[0] for line in lines
                     if "HTTP on https://" in line)
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        # A few of each first, so that what any first connection makes (caches, imported
        # modules) is in the baseline.
        warm = TLSFlood(tls, https, ctx, bare=4, idle=4, https=4)
        warm.start()
        await asyncio.sleep(1.0)  # (pacing: the warm-up's connections are made)
        await warm.stop()
        await asyncio.sleep(2.0)  # (pacing: what they held is let go)
        baseline = await rss_mib(server)

        flood = TLSFlood(tls, https, ctx, bare=200, idle=100, https=200)
        flood.start()
        try:
            t0 = time.monotonic()
            peak = baseline
            # Every idle HTTPS connection is closed by the server (here after 2 s), each
            # within 35 s of being made; sample the server meanwhile.
            while (flood.closed_by_server["https"] < 200
                   and time.monotonic() - t0 < 40.0):
                peak = max(peak, await rss_mib(server))
                await asyncio.sleep(0.25)  # (sampling)
            assert flood.closed_by_server["https"] >= 200, flood.summary()
            assert max(flood.lifetimes["https"]) <= 35.0, flood.summary()
        finally:
            await flood.stop()
        ended = time.monotonic()
        # What the attack made the server hold stays bounded (asyncio's own TLS buffers,
        # 256 KiB a connection, came to 150 MB here) ...
        assert peak - baseline < 100, (baseline, peak)
        # ... and goes back within 30 s of its end: within the 40 MB of where it
        # started, and in fact to within 15 MB (what closed connections held is given
        # back to the system, measured: within a megabyte, in 1-3 s).
        now = await rss_mib(server)
        while now - baseline >= 15 and time.monotonic() - ended < 30.0:
            await asyncio.sleep(0.5)  # (sampling)
            now = await rss_mib(server)
        assert now - baseline < 15, (baseline, peak, now, time.monotonic() - ended)
        assert server.alive()
    finally:
        await asyncio.to_thread(server.stop, 20.0)
