"""A node's memory for the KV cache is measured by what its stage holds when asked: a stage that
refuses a session for its length (``session_too_long``) within the positions per session it
reported is clamped to less than that length (the limit admission holds requests to while the
node is routable) and, reported holding more than SWARM_MEMORY_CLAIM_TOLERANCE times it, struck
with the job as evidence (``marketplace/verification/claims.py``). A refused memory challenge
clamps the node's memory to what the positions it was sent, and its other open sessions, need, and
strikes past the same tolerance. The heal fixture's swarm; the job runs on b."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.utils import timezone

from marketplace.jobs.models import Job, JobState
from marketplace.jobs.params import RequestParams
from marketplace.jobs.services import heal_job
from marketplace.nodes.capacity import credible_memory
from marketplace.nodes.models import Node
from marketplace.placement import memory
from marketplace.placement.shares import layer_footprint
from marketplace.verification.claims import failed_to_hold
from marketplace.verification.models import Challenge, CheckState, Strike, StrikeKind
from tests.factories import MODEL
from tests.heal_fixtures import NOW, stage

pytestmark = [pytest.mark.trust, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures", "tests.heal_fixtures"]

REFUSAL = "session_too_long: stage 1 (ws://b): session 's0' would reach 1100 positions (limit 512)"


def refused(customer, swarm, reported: int) -> tuple[Node, Job]:
    """b reported ``reported`` positions per session, then refused a job of a 100-token prompt and
    1000 max tokens (at most 1100 positions) for its length."""
    Node.objects.filter(pk=swarm.b.pk).update(max_positions=reported)
    job = Job.objects.create(
        public_id="chatcmpl-long",
        kind="completion",
        customer=customer,
        model=MODEL,
        state=JobState.RUNNING,
        route=[stage(swarm.a, 0, 16), stage(swarm.b, 16, 30)],
        coordinator_region="local",
        audit_stages=[1],
        prompt_tokens=100,
        params=RequestParams(max_tokens=1000, prompt="x").to_json(),
    )
    heal_job(job.pk, swarm.b.node_id, REFUSAL, now=NOW)
    return Node.objects.get(pk=swarm.b.pk), job


def test_a_node_claiming_twice_the_positions_it_holds_is_clamped_and_struck(swarm, customer):
    b, job = refused(customer, swarm, reported=4096)

    assert b.max_positions == 1099
    strike = Strike.objects.get(node=b)
    assert (strike.kind, strike.job_id) == (StrikeKind.CAPACITY, job.pk)
    assert strike.evidence == {
        "kind": "memory",
        "reason": "reports holding 4096 positions per session, but refused a session of at most 1100",
        "claimed_positions": 4096,
        "refused_at_most": 1100,
        "job": "chatcmpl-long",
    }


def test_a_claim_within_the_tolerance_is_clamped_but_not_struck(swarm, customer):
    b, _ = refused(customer, swarm, reported=1600)

    assert b.max_positions == 1099
    assert Strike.objects.filter(kind=StrikeKind.CAPACITY).count() == 0


def test_a_refusal_past_what_the_node_reported_changes_nothing(swarm, customer):
    b, _ = refused(customer, swarm, reported=1024)

    assert b.max_positions == 1024
    assert Strike.objects.filter(kind=StrikeKind.CAPACITY).count() == 0


LAYER = memory.LayerFootprint(dtype="float32", weights=1000, kv=2 * 100 * 10, positions=100, sessions=2)


def test_a_node_holding_positions_needs_its_weights_and_their_caches_over_the_planned_share():
    assert LAYER.position == 10
    assert memory.memory_holding(LAYER, 3, 50) == 5625  # 3 x (1000 + 10 x 50) / 0.8
    assert memory.layers_that_fit(memory.memory_holding(LAYER, 3, 200), LAYER) == 3


def test_placement_believes_a_report_up_to_what_the_node_failed_to_hold():
    assert credible_memory(SimpleNamespace(memory_bytes=8000, memory_limit_bytes=None)) == 8000
    assert credible_memory(SimpleNamespace(memory_bytes=8000, memory_limit_bytes=4500)) == 4500
    assert credible_memory(SimpleNamespace(memory_bytes=3000, memory_limit_bytes=4500)) == 3000


def memory_challenge(node: Node, *, open_sessions: int = 0) -> Challenge:
    now = timezone.now()
    return Challenge.objects.create(
        node=node, model=MODEL, layer_start=16, layer_end=30, seed=1, tokens=4, sessions=8, positions=1536,
        metrics={"open_sessions": open_sessions}, sent_at=now, deadline_at=now,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("open_sessions", "struck"),
    [(0, True), (4, False)],  # 4 other sessions of 2048 positions: its refusal may be theirs
)
def test_a_refused_memory_challenge_clamps_and_strikes_only_past_the_tolerance(swarm, open_sessions, struck):
    b = swarm.b
    Node.objects.filter(pk=b.pk).update(max_positions=2048)
    b.refresh_from_db()
    layer = layer_footprint(b, MODEL)
    placed = memory.memory_holding(layer, 14, layer.positions * layer.sessions)
    Node.objects.filter(pk=b.pk).update(memory_bytes=placed)
    challenge = memory_challenge(b, open_sessions=open_sessions)

    failed = failed_to_hold(challenge.pk, 4000, "kv_memory_full")

    b.refresh_from_db()
    limit = memory.memory_holding(layer, 14, 3999 + open_sessions * 2048)
    assert (failed.state, b.memory_limit_bytes, failed.metrics["memory_limit_bytes"]) == (
        CheckState.FAILED,
        limit,
        limit,
    )
    assert Strike.objects.filter(node=b, kind=StrikeKind.CAPACITY).exists() is struck
    assert not Strike.objects.filter(kind=StrikeKind.CHALLENGE).exists()
    assert failed_to_hold(challenge.pk, 10, "again") == failed  # decided once
