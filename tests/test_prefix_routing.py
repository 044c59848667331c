"""KV locality: the control plane remembers which route served an account's prefixes (salted,
expiring) and routes a request extending one there while that route's cost is within
SWARM_PREFIX_ROUTE_MARGIN of the fastest."""

from __future__ import annotations

import pytest
from django.utils import timezone

from marketplace.jobs.prefixes import prefix_salt, remember_route, remembered_route
from marketplace.placement.models import Assignment, AssignmentState, PlacementState
from marketplace.placement.selectors import route_request

pytest_plugins = ["tests.factories", "tests.control_fixtures"]
pytestmark = [pytest.mark.control, pytest.mark.django_db]

MODEL = "tiny-llama"
TOKENS = list(range(1, 101))
ROUTE = [{"node": "node-a", "layer_start": 0, "layer_end": 3}, {"node": "node-b", "layer_start": 3, "layer_end": 6}]


def test_salts_are_per_account_and_off_with_prefix_reuse(settings):
    settings.SWARM_PREFIX_REUSE = True
    assert prefix_salt(1) == prefix_salt(1)
    assert prefix_salt(1) != prefix_salt(2)
    assert len(prefix_salt(1)) == 32

    settings.SWARM_PREFIX_REUSE = False
    assert prefix_salt(1) is None


def test_a_prompt_extending_a_remembered_one_finds_its_route_for_its_account_only(settings):
    settings.SWARM_PREFIX_REUSE = True
    remember_route(7, MODEL, TOKENS, ROUTE)

    assert remembered_route(7, MODEL, [*TOKENS, 500, 501]) == [("node-a", 0, 3), ("node-b", 3, 6)]
    assert remembered_route(8, MODEL, [*TOKENS, 500, 501]) is None
    assert remembered_route(7, MODEL, [0, *TOKENS]) is None  # another first block: another prefix


def test_a_route_is_remembered_for_the_ttl(settings):
    settings.SWARM_PREFIX_REUSE = True
    settings.SWARM_PREFIX_ROUTE_TTL_S = 0.0

    remember_route(9, MODEL, TOKENS, ROUTE)

    assert remembered_route(9, MODEL, [*TOKENS, 500]) is None


def _two_pipelines(provider, make_joined_node, measure_ring):
    """Two whole-model pipelines, one node each: ``fast`` and ``slow`` (a slower compute claim)."""
    PlacementState.objects.get_or_create(model=MODEL)
    fast = make_joined_node(provider, "gpu-fast", compute=400.0, max_layers=6).node
    slow = make_joined_node(provider, "gpu-slow", compute=250.0, max_layers=6).node
    measure_ring([fast, slow])
    for pipeline, node in enumerate((fast, slow)):
        Assignment.objects.create(
            node=node, model=MODEL, generation=1, pipeline=pipeline, position=0, layer_start=0, layer_end=6,
            state=AssignmentState.READY, data_url=f"ws://127.0.0.1:{9100 + pipeline}", ready_at=timezone.now(),
        )  # fmt: skip
    return fast, slow


def test_routing_prefers_the_remembered_route_within_the_margin_only(
    settings, swarm_settings, provider, make_joined_node, measure_ring
):
    settings.SWARM_MODELS = [MODEL]
    fast, slow = _two_pipelines(provider, make_joined_node, measure_ring)
    _, fastest, fast_cost = route_request(MODEL)
    settings.SWARM_PREFIX_ROUTE_MARGIN = 1e9
    _, held, slow_cost = route_request(MODEL, prefer=[(slow.node_id, 0, 6)])
    assert [s.node for s in fastest] == [fast.node_id]
    assert [s.node for s in held] == [slow.node_id]
    assert slow_cost > fast_cost

    settings.SWARM_PREFIX_ROUTE_MARGIN = 2 * (slow_cost / fast_cost - 1)
    assert [s.node for s in route_request(MODEL, prefer=[(slow.node_id, 0, 6)])[1]] == [slow.node_id]

    settings.SWARM_PREFIX_ROUTE_MARGIN = (slow_cost / fast_cost - 1) / 2
    assert [s.node for s in route_request(MODEL, prefer=[(slow.node_id, 0, 6)])[1]] == [fast.node_id]


def test_a_remembered_route_whose_node_is_busy_or_gone_is_not_taken(
    settings, swarm_settings, provider, make_joined_node, measure_ring
):
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_PREFIX_ROUTE_MARGIN = 1e9
    fast, slow = _two_pipelines(provider, make_joined_node, measure_ring)

    busy = route_request(MODEL, {slow.node_id: 10_000}, prefer=[(slow.node_id, 0, 6)])
    gone = route_request(MODEL, prefer=[("node-gone", 0, 6)])

    assert [s.node for s in busy[1]] == [fast.node_id]
    assert [s.node for s in gone[1]] == [fast.node_id]
