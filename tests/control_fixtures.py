"""Fixtures for what the control plane sends to agents and how it is configured in tests.

Test modules load this file with ``pytest_plugins = ["tests.factories", "tests.control_fixtures"]``.
"""

from __future__ import annotations

import pytest

from marketplace.nodes import services
from marketplace.nodes.models import Node
from tests.factories import MODEL

NEAR_MS = 2.0
FAR_MS = 50.0


class SpyChannelLayer:
    """Stands in for the channel layer: records each group_send instead of delivering it."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    async def group_send(self, group: str, event: dict) -> None:
        self.events.append((group, event))

    @property
    def messages(self) -> list[tuple[str, dict]]:
        """(group, message) of every control.push sent so far."""
        assert all(event["type"] == "control.push" for _, event in self.events)
        return [(group, event["message"]) for group, event in self.events]


@pytest.fixture
def pushed(monkeypatch) -> SpyChannelLayer:
    """Control messages pushed to agents once their transaction commits (run the commit hooks
    with ``django_capture_on_commit_callbacks(execute=True)``)."""
    spy = SpyChannelLayer()
    monkeypatch.setattr("marketplace.nodes.services.get_channel_layer", lambda: spy)
    return spy


@pytest.fixture
def swarm_settings(settings):
    """The swarm's settings pinned to known values, whatever the environment says."""
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_HEARTBEAT_INTERVAL_S = 5.0
    settings.SWARM_HEARTBEAT_TIMEOUT_S = 20.0
    settings.SWARM_JOIN_TOKEN_TTL_S = 3600
    settings.SWARM_SPARES_PER_PIPELINE = 0
    settings.SWARM_COORDINATOR_REGIONS = ["local"]
    settings.SWARM_REGION_PROBE_URLS = {}
    # These agents are the test itself, with no data plane to open: the reports are taken as they come
    # (tests/test_reachability.py opens real ones).
    settings.SWARM_REACHABILITY_CHECK = False
    settings.SWARM_RELAYS = []
    return settings


@pytest.fixture
def measure_ring():
    """Record the links each node measured so that the given order is the cheapest ring.

    Every node is near the coordinator region and near the nodes after it in ``nodes``, far from
    those before it: the only ring with no far hop visits the nodes in the given order.
    """

    def measure(nodes: list[Node], region: str = "local") -> None:
        for i, node in enumerate(nodes):
            results = [{"target": f"region:{region}", "rtt_ms": NEAR_MS, "uplink_mbps": 1000.0}]
            results += [
                {"target": other.node_id, "rtt_ms": NEAR_MS if j > i else FAR_MS, "uplink_mbps": 1000.0}
                for j, other in enumerate(nodes)
                if j != i
            ]
            services.record_links(node.pk, results)

    return measure
