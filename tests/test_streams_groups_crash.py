"""The consumer group crash test, bounded (issue 32): worker processes killed with kill -9
at random while entries are appended -- every entry acknowledged; with acknowledgements in
the results' transaction each result exactly once; every redelivery after a crash or the
idle timeout.  The long run is `make soak-groups` (python -m dataspace.testing.group_crash)."""

from __future__ import annotations

from typing import Any

import pytest

from dataspace.testing.group_crash import run


@pytest.mark.parametrize("mode", ["tx", "plain"])
def test_consumers_killed_at_random_lose_nothing_and_write_each_result_once(
        store_url: str, mode: str, tmp_path: Any) -> None:
    r = run(store_url, 5, consumers=3, mode=mode, idle=1.0, seed=11, base=tmp_path / "logs")
    assert r.problems == []
    assert r.kills == 5 and r.appended > 0 and r.deliveries >= r.appended
    assert r.redeliveries == r.after_crash + r.after_timeout
