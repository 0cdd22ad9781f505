"""Waiting in tests for what another process or thread brings about, always bounded."""

from __future__ import annotations

import time


def wait_for(condition, timeout: float, what: str, interval: float = 0.3):
    """`condition()`'s first true value, polled every `interval` s; the test fails, naming
    `what`, after `timeout` s."""
    import pytest

    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:.0f} s for {what}")
        time.sleep(interval)
    return value
