"""End to end (issue 30 §5): clients with every member's address send numbered messages
with syncs through a three-member cluster recording into PostgreSQL, while a Spark
pipeline on the standalone cluster (tests/spark_cluster.py) reads the recorded stream
into another; a member is killed with kill -9 (and restarted) and the Spark worker with
its executor is killed mid-run.  Counted at the end: every acknowledged message is in the
recorded stream once, and the pipeline's output holds each recorded message exactly once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter

from dataspace.protocol.sturdy import SturdyRef
from dataspace.streams import open_store
from dataspace.testing.cluster_record import Sender, chat_counts, read_stream, start_cluster
from dataspace.values import parse

TIMEOUT = 300.0
GRAPH = """\
from dataspace.pipeline import Graph

graph = Graph("seen")
graph.source("chat")
graph.map("copy", "chat", "seen", lambda v: v)
"""


def _count(url: str, stream: str) -> int:
    with open_store(url, create=False) as s:
        return s.next_index(stream) if s.has_stream(stream) else 0


def test_clients_through_the_cluster_into_a_spark_pipeline_exactly_once(
        spark_cluster, pg_url, tmp_path, spark_jvm_archive):
    base = tmp_path / "members"
    ms = start_cluster(base, 3, pg_url, specs=("chat:<Says $who $n>",))
    graph = tmp_path / "seen.py"
    graph.write_text(GRAPH)
    pipe: subprocess.Popen[bytes] | None = None
    log = tmp_path / "pipeline.log"
    workers = spark_cluster.workers_started

    async def main() -> list[Sender]:
        nonlocal pipe
        for m in ms:
            await m.start()
        cap = SturdyRef.from_value(parse((ms[0].dir / "root.sturdyref").read_text()))
        addrs = [m.address for m in ms]
        stop = asyncio.Event()
        # Some input before the pipeline starts, the rest while it runs.
        first = Sender("c0", addrs, cap, batch=5, limit=300)
        await first.run(stop)
        senders = [first] + [Sender(f"c{k}", addrs[k:] + addrs[:k], cap, batch=5, limit=1500)
                             for k in range(1, 3)]
        tasks: list[asyncio.Future[None]] = []
        try:
            with open(log, "wb") as out:
                pipe = subprocess.Popen(
                    [sys.executable, "-m", "dataspace.cli", "pipeline", "run", str(graph),
                     "--store", pg_url, "--data-dir", str(tmp_path / "pipe"), "--master",
                     spark_cluster.master_url, *spark_cluster.conf_args(), "--batch", "200",
                     "--interval", "0.5"],
                    stdout=out, stderr=subprocess.STDOUT, env=spark_cluster.driver_env(),
                    cwd=tmp_path, start_new_session=True)

            async def until(pred, what: str, timeout: float = TIMEOUT) -> None:
                end = time.monotonic() + timeout
                while not pred():
                    assert pipe is not None and pipe.poll() is None, log.read_text()[-3000:]
                    assert time.monotonic() < end, f"timed out: {what}\n{log.read_text()[-3000:]}"
                    await asyncio.sleep(0.2)

            # The pipeline is running on the cluster: its output moves.
            await until(lambda: _count(pg_url, "seen") > 0, "the pipeline's first output")
            tasks = [asyncio.ensure_future(s.run(stop)) for s in senders[1:]]
            await until(lambda: sum(len(s.acked) for s in senders) > 600, "messages sent")
            await ms[1].kill()  # kill -9 of a member: its clients fail over
            await ms[1].start()
            # The worker with its executor, while input keeps coming.
            spark_cluster.kill_worker()
            await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in senders:
                await s.close()
        # Everything recorded reaches the output.
        await until(lambda: _count(pg_url, "seen") >= _count(pg_url, "chat"),
                    "the output catching up")
        return senders

    async def run() -> list[Sender]:
        try:
            return await asyncio.wait_for(main(), 2 * TIMEOUT)
        finally:
            if pipe is not None and pipe.poll() is None:
                os.killpg(pipe.pid, signal.SIGTERM)
                try:
                    pipe.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(pipe.pid, signal.SIGKILL)
                    pipe.wait(10)
            for m in ms:
                await m.stop()

    senders = asyncio.run(run())
    chat = read_stream(pg_url, "chat")
    counts = chat_counts(chat)
    acked = [(s.name, i) for s in senders for i in s.acked]
    assert acked and all(counts[k] == 1 for k in acked), "acknowledged messages missing"
    assert max(counts.values()) == 1, "recorded twice"
    seen = Counter(str(e.value) for e in read_stream(pg_url, "seen"))
    assert seen == Counter(str(e.value) for e in chat), (len(seen), len(chat))
    assert spark_cluster.workers_started > workers  # (the worker was killed and replaced)
