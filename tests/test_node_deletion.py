"""Deleting a node while jobs it served are running or unsettled: the node is soft-deleted (gone
from its owner's lists, never placed or routed, its agent shut out), the jobs settle, and its owner
is paid for the verified work it did."""

from __future__ import annotations

import pytest

from marketplace.billing import services as billing
from marketplace.billing.models import AccountKind
from marketplace.flows.settlement import reconcile_jobs
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.services import create_api_key, finish_job, mark_running
from marketplace.nodes import joining
from marketplace.nodes import services as nodes
from marketplace.nodes.errors import NodeNotAllowed
from marketplace.nodes.models import Node, NodeState
from marketplace.payouts.models import Earning
from marketplace.placement.models import Assignment, AssignmentState
from tests.factories import db_snapshot
from tests.job_fixtures import held_job
from worker_agent.protocol.control_protocol import CONTROL_CONTEXT
from worker_agent.protocol.receipts import ReceiptBuilder, digest

pytest_plugins = ["tests.factories"]
pytestmark = [pytest.mark.billing, pytest.mark.django_db]

MODEL = "tiny-llama"  # 6 layers
SPANS = [(0, 2), (2, 4), (4, 6)]
STEPS = 3


def node_url(node: Node) -> str:
    return f"/api/v1/nodes/{node.pk}/"


def boundary(session: str, step: int, k: int) -> bytes:
    """The hash of the activations between stage k-1 and stage k at one step (k=0: what the
    coordinator sent, k=3: what it received)."""
    return digest(f"{session}:{step}:{k}".encode())


@pytest.fixture
def pipeline(provider, second_provider, make_joined_node):
    """Three joined nodes: alice's gpu-1 and gpu-3, bob's gpu-2 in the middle."""
    return [
        make_joined_node(provider, "gpu-1"),
        make_joined_node(second_provider, "gpu-2"),
        make_joined_node(provider, "gpu-3"),
    ]


@pytest.fixture
def running_job(customer, pipeline):
    """A job admitted onto the pipeline (hold placed) and running."""
    billing.grant(customer, 1)
    api_key, _ = create_api_key(customer, "k")
    route = [
        {
            "node": joined.node.node_id,
            "node_key": joined.node.public_key,
            "url": joined.node.data_url,
            "layer_start": start,
            "layer_end": end,
        }
        for joined, (start, end) in zip(pipeline, SPANS, strict=True)
    ]
    job = held_job(
        customer, api_key, "chatcmpl-mid", model=MODEL, params={"max_tokens": 10}, prompt_tokens=20, route=route
    )
    assert mark_running(job.pk)
    return job


def finish_verified(job: Job, pipeline) -> None:
    """The coordinator ends the job with every stage's signed receipt and its own transcript."""
    receipts = []
    for k, (joined, (start, end)) in enumerate(zip(pipeline, SPANS, strict=True)):
        builder = ReceiptBuilder(
            job=job.public_id,
            session="s1",
            node=joined.node.node_id,
            node_key=bytes.fromhex(joined.node.public_key),
            model=MODEL,
            layer_start=start,
            layer_end=end,
        )
        for step in range(STEPS):
            builder.add_step(boundary("s1", step, k), boundary("s1", step, k + 1), 1)
        receipts.append(builder.sign(joined.key).to_json())
    transcript = {
        "session": "s1",
        "sent": [boundary("s1", step, 0).hex() for step in range(STEPS)],
        "received": [boundary("s1", step, 3).hex() for step in range(STEPS)],
    }
    assert finish_job(
        job.pk,
        state=JobState.SUCCEEDED,
        completion_tokens=STEPS,
        finish_reason="length",
        receipts=receipts,
        transcripts=[transcript],
        verified=True,
    )


def test_deleting_a_node_mid_job_settles_the_job_and_pays_its_owner(
    running_job, pipeline, provider, second_provider, client_for, customer
):
    deleted = pipeline[1].node

    response = client_for(second_provider).delete(node_url(deleted))
    finish_verified(running_job, pipeline)
    settled = reconcile_jobs()

    assert response.status_code == 204
    assert settled == ["chatcmpl-mid"]
    running_job.refresh_from_db()
    assert (running_job.verified, running_job.verification_error) == (True, "")
    charge = running_job.charged_amount
    assert charge > 0
    assert billing.account(AccountKind.CUSTOMER_HOLD, customer).balance == 0
    earnings = {e.node.name: (e.provider.username, e.layer_tokens) for e in Earning.objects.select_related("node")}
    assert earnings == {"gpu-1": ("alice", 6), "gpu-2": ("bob", 6), "gpu-3": ("alice", 6)}
    paid = sum(Earning.objects.values_list("amount", flat=True))
    assert paid == charge - charge * 2000 // 10_000
    bob_pending = billing.account(AccountKind.PROVIDER_PENDING, second_provider).balance
    assert bob_pending == Earning.objects.get(node=deleted).amount > 0
    assert billing.account(AccountKind.PROVIDER_PENDING, provider).balance == paid - bob_pending


def test_a_deleted_node_is_kept_hidden_from_its_owner_and_never_placed(
    running_job, pipeline, second_provider, client_for
):
    deleted = pipeline[1].node
    Assignment.objects.create(
        node=deleted,
        model=MODEL,
        layer_start=2,
        layer_end=4,
        state=AssignmentState.READY,
        generation=1,
        pipeline=0,
        position=1,
    )
    client = client_for(second_provider)

    client.delete(node_url(deleted))

    deleted.refresh_from_db()
    assert (deleted.state, deleted.connected, deleted.deleted_at is not None) == (NodeState.DELETED, False, True)
    assert deleted.node_id == running_job.route[1]["node"]  # kept for settlement
    assert not Assignment.objects.filter(node=deleted, state__in=[AssignmentState.ASSIGNED, AssignmentState.READY])
    assert client.get("/api/v1/nodes/").json()["results"] == []
    assert client.get(node_url(deleted)).status_code == 404
    assert client.delete(node_url(deleted)).status_code == 404


def test_a_deleted_nodes_agent_cannot_reconnect(pipeline, second_provider, client_for):
    deleted = pipeline[1]
    client_for(second_provider).delete(node_url(deleted.node))
    nonce = b"n" * 32
    signature = deleted.key.sign(CONTROL_CONTEXT + nonce + deleted.node.node_id.encode()).signature.hex()

    with pytest.raises(NodeNotAllowed) as refused:
        joining.authenticate(node_id=deleted.node.node_id, nonce=nonce, signature=signature)

    assert str(refused.value) == "this node was deleted by its owner"


def test_a_deleted_nodes_name_can_be_used_again(pipeline, second_provider, client_for):
    client = client_for(second_provider)
    client.delete(node_url(pipeline[1].node))

    response = client.post("/api/v1/nodes/", {"name": "gpu-2"}, format="json")

    assert response.status_code == 201
    assert list(Node.objects.filter(owner=second_provider).order_by("pk").values_list("name", "state")) == [
        ("gpu-2", "deleted"),
        ("gpu-2", "pending"),
    ]


def test_a_node_that_never_joined_is_removed(provider, make_node, client_for):
    node, _ = make_node(provider, "never-joined")

    response = client_for(provider).delete(node_url(node))

    assert response.status_code == 204
    assert not Node.objects.filter(pk=node.pk).exists()


def test_an_admin_cannot_eject_a_deleted_node(pipeline, second_provider, client_for, admin):
    deleted = pipeline[1].node
    client_for(second_provider).delete(node_url(deleted))
    before = db_snapshot()

    changed = nodes.mark_ejected(deleted, reason="late", by=admin)

    assert changed is False
    assert db_snapshot() == before
    assert Node.objects.get(pk=deleted.pk).ejected_at is None
