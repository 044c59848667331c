"""Shared fixtures: local swarms of real agent processes on loopback."""

from __future__ import annotations

import pytest

from worker_agent.local import LocalSwarm, even_spans

SMOLLM2_SPANS = [(0, 10), (10, 20), (20, 30)]


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
