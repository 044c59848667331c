"""A five-node swarm with a warm spare, for healing, failure reports and repair.

Test modules load this file with ``pytest_plugins = ["tests.factories", "tests.control_fixtures",
"tests.heal_fixtures"]``; it holds no assert, hence PYTEST_DONT_REWRITE (see tests/factories.py).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import NamedTuple

import pytest

from marketplace.nodes.models import Node
from marketplace.placement import placing, readiness
from marketplace.placement.models import Assignment, AssignmentState
from tests.factories import MODEL

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


class Swarm(NamedTuple):
    a: Node
    b: Node
    c: Node
    d: Node
    e: Node


def url_of(node: Node) -> str:
    return f"ws://127.0.0.1:{9000 + node.pk}"


def stage(node: Node, layer_start: int, layer_end: int) -> dict:
    """A route stage as ``Job.route`` stores it."""
    return {
        "node": node.node_id,
        "node_key": node.public_key,
        "url": url_of(node),
        "layer_start": layer_start,
        "layer_end": layer_end,
    }


def report_ready() -> None:
    for assignment in Assignment.objects.filter(state=AssignmentState.ASSIGNED).select_related("node"):
        readiness.assignment_ready(assignment.node_id, assignment.pk, url_of(assignment.node))


@pytest.fixture
def swarm(provider, make_joined_node, measure_ring, swarm_settings) -> Swarm:
    """Pipelines a[0:16] -> b[16:30] and c[0:16] -> d[16:30], and e, a fast node too small for
    [0:16), as the warm spare of [16:30); every block ready, every link near in the order a..e."""
    swarm_settings.SWARM_SPARES_PER_PIPELINE = 1
    swarm_settings.SWARM_MAX_HEALS = 2
    specs = (("a", 300.0, 16), ("b", 200.0, 16), ("c", 150.0, 16), ("d", 100.0, 16), ("e", 600.0, 15))
    nodes = [
        make_joined_node(provider, name, compute=compute, max_layers=cap, last_heartbeat_at=NOW).node
        for name, compute, cap in specs
    ]
    measure_ring(nodes)
    placing.place_model(MODEL)
    report_ready()
    for node in nodes:
        node.refresh_from_db()
    return Swarm(*nodes)


def layout() -> list[tuple[str, int, int, int, int, int, bool, str]]:
    """(node name, assignment pk, pipeline, position, layer_start, layer_end, is_spare, state) of each live block."""
    return list(
        Assignment.objects.filter(state__in=[AssignmentState.ASSIGNED, AssignmentState.READY])
        .order_by("is_spare", "pipeline", "position")
        .values_list("node__name", "pk", "pipeline", "position", "layer_start", "layer_end", "is_spare", "state")
    )
