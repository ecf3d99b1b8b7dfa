"""The cluster recording crash test in the suite (issue 30 §3): members of a cluster
recording into one store are killed with kill -9 at random and restarted while clients
given every member's address send numbered messages with a sync after each batch; every
acknowledged message is in the stream exactly once, and presence events are recorded
once (dataspace.testing.cluster_record; `make soak-cluster-record` runs it long).
"""

from __future__ import annotations

import asyncio

import pytest

from dataspace.testing.cluster_record import run


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_kill_9_of_members_every_acknowledged_message_once_presence_once(tmp_path, backend,
                                                                        request):
    store = request.getfixturevalue("pg_url") if backend == "postgresql" else None
    kills = 3 if backend == "postgresql" else 2
    result = asyncio.run(asyncio.wait_for(
        run(kills, seed=30, base=tmp_path / "run", store=store), 240))
    assert result.problems == []
    assert result.kills == kills
    assert result.acknowledged > 0, result
