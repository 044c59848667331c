"""An agent serves one block at a time, so a second model is never placed on a node that holds a
live block of the first."""

from __future__ import annotations

import pytest

from marketplace.nodes.models import Node, NodeState
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.placement.services import place_model

pytestmark = [pytest.mark.control, pytest.mark.django_db]


def active_node(owner, name: str) -> Node:
    return Node.objects.create(
        owner=owner,
        name=name,
        state=NodeState.ACTIVE,
        connected=True,
        node_id=f"node-{name}",
        public_key=f"{len(name):064x}"[:60] + name[:4].ljust(4, "0"),
        memory_bytes=8 * 2**30,
        compute_layer_tokens_per_s=100.0,
        max_layers=6,
    )


def test_a_second_model_is_not_placed_on_nodes_serving_the_first(django_user_model, settings):
    settings.SWARM_SPARES_PER_PIPELINE = 0
    owner = django_user_model.objects.create_user(username="p", email="p@e.com", password="x", is_provider=True)
    for name in ("a", "b", "c"):
        active_node(owner, name)

    first = place_model("tiny-llama")
    second = place_model("smollm2-135m")

    assert sorted(a.node.node_id for a in first) == ["node-a", "node-b", "node-c"]
    assert second == []
    assert Assignment.objects.filter(model="smollm2-135m").count() == 0
    assert Assignment.objects.filter(model="tiny-llama", state=AssignmentState.ASSIGNED).count() == 3
