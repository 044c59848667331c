"""A node's memory for the KV cache is measured by what its stage holds when asked: a stage that
refuses a session for its length (``session_too_long``) within the positions per session it
reported is clamped to less than that length (the limit admission holds requests to while the
node is routable) and, reported holding more than SWARM_MEMORY_CLAIM_TOLERANCE times it, struck
with the job as evidence (``marketplace/verification/claims.py``). The heal fixture's swarm; the
job runs on b."""

from __future__ import annotations

import pytest

from marketplace.jobs.models import Job, JobState
from marketplace.jobs.params import RequestParams
from marketplace.jobs.services import heal_job
from marketplace.nodes.models import Node
from marketplace.verification.models import Strike, StrikeKind
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
