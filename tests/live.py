"""A live control plane for tests: the real ASGI app (HTTP + Channels + lifespan) on uvicorn,
in a thread of the test process, so it shares the test database."""

from __future__ import annotations

import time

from marketplace.embedded import EmbeddedServer, free_port

__all__ = ["LiveServer", "free_port", "wait_for"]
LiveServer = EmbeddedServer


def wait_for(condition, timeout: float, what: str, interval: float = 0.25):
    """Poll ``condition`` until it returns something truthy (returned), or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
