"""Helpers for tests that run real Spark queries in the session-wide SparkSession."""

from __future__ import annotations

from typing import Any

QUERY_TIMEOUT = 120.0


def run_query(q: Any, timeout: float = QUERY_TIMEOUT) -> None:
    """Wait for a streaming query with a finite trigger (availableNow, once) to finish.

    Fails if it is still running after ``timeout`` seconds; a failed query raises its
    StreamingQueryException.  Either way the query is stopped, so that it cannot keep
    running in the shared session and disturb the tests that follow.
    """
    try:
        assert q.awaitTermination(timeout), f"query did not finish within {timeout:g} s"
    finally:
        q.stop()
