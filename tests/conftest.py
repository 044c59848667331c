"""Shared fixtures: local swarms of real agent processes on loopback."""

from __future__ import annotations

import pytest
from channels.layers import channel_layers

from worker_agent.local import LocalSwarm, even_spans

SMOLLM2_SPANS = [(0, 10), (10, 20), (20, 30)]


@pytest.fixture
def fresh_channel_layer():
    """A channel layer of this test's own, for tests that drive the ASGI app in an event loop of
    their own (``asyncio.run``): a Redis layer made in an earlier test's loop keeps a receive lock
    bound to that loop, and a consumer in the next loop fails on it."""
    channel_layers.backends = {}
    yield
    channel_layers.backends = {}


@pytest.fixture(scope="session")
def smollm2_swarm():
    """Three `swarm-worker serve` processes holding layers 0:10, 10:20, 20:30 of smollm2-135m."""
    with LocalSwarm("smollm2-135m", SMOLLM2_SPANS, threads=1) as swarm:
        yield swarm


@pytest.fixture(scope="session")
def tiny_swarm():
    """Three agents serving the seeded random tiny-llama (6 layers), for fast protocol tests."""
    with LocalSwarm("tiny-llama", even_spans(6, 3), threads=1) as swarm:
        yield swarm


def pytest_report_header(config) -> str | None:
    """Say up front when the browser tests of the dashboards cannot run here."""
    from tests.browser import missing_browser_reason

    return missing_browser_reason()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Repeat it at the end, where nobody misses it: skipped web tests are untested dashboards."""
    from tests.browser import missing_browser_reason

    reason = missing_browser_reason()
    if reason:
        terminalreporter.write_sep("!", "WEB DASHBOARD TESTS SKIPPED", red=True, bold=True)
        terminalreporter.write_line(reason, red=True, bold=True)
