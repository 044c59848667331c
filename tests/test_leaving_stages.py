"""Routing never picks a leaving stage: a node whose agent said it is stopping, or that moved to
another model's share, gets no new request and no heal from the moment that is decided, not from
the moment its agent starts refusing (every such request would be refused and healed). The heal
fixture's swarm: pipelines a[0:16] -> b[16:30] and c[0:16] -> d[16:30], and e, the fastest node,
the warm spare of [16:30]."""

from __future__ import annotations

import pytest

from marketplace.jobs.models import Job, JobState
from marketplace.jobs.services import heal_job
from marketplace.nodes.models import Node
from marketplace.nodes.services import node_group
from marketplace.placement import lifecycle, readiness, selectors
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.placement.selectors import route_request
from tests.factories import MODEL
from tests.heal_fixtures import NOW, stage, url_of

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures", "tests.heal_fixtures"]


def admitted_route() -> list[str]:
    _, stages, _ = route_request(MODEL)
    return [s.node for s in stages]


def healed_route(customer, route: list[dict], failed: Node) -> list[str]:
    job = Job.objects.create(
        public_id=f"chatcmpl-{failed.name}",
        kind="chat",
        customer=customer,
        model=MODEL,
        state=JobState.RUNNING,
        route=route,
        coordinator_region="local",
        audit_stages=[1],
    )
    return [s["node"] for s in heal_job(job.pk, failed.node_id, "stage_lost: connection lost", now=NOW)]


def test_an_agent_that_says_it_is_stopping_gets_no_new_request_and_no_heal_from_that_moment(
    swarm, customer, pushed, django_capture_on_commit_callbacks
):
    a, b, c, d, e = swarm
    assert admitted_route() == [a.node_id, e.node_id]

    # SIGTERM: e's agent says so in a heartbeat, before it refuses any job.
    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.record_heartbeat(e.pk, {"state": "leaving"}, now=NOW)

    assert admitted_route() == [a.node_id, b.node_id]
    assert healed_route(customer, [stage(c, 0, 16), stage(d, 16, 30)], d) == [c.node_id, b.node_id]
    assert pushed.messages == [(node_group(e.node_id), {"type": "drain"})]  # the answer its agent waits for
    # Its block stays assigned to it, for a restarted agent to confirm.
    assert Assignment.objects.get(node=e, state=AssignmentState.READY).is_spare is True


def test_a_restarted_agent_is_routed_again_once_it_confirms_its_block(swarm, django_capture_on_commit_callbacks):
    a, _, _, _, e = swarm
    with django_capture_on_commit_callbacks(execute=True):
        lifecycle.record_heartbeat(e.pk, {"state": "leaving"}, now=NOW)
        lifecycle.node_connected(e.pk)  # the new process's control channel
    block = Assignment.objects.get(node=e, state__in=[AssignmentState.ASSIGNED, AssignmentState.READY])
    assert block.state == AssignmentState.ASSIGNED
    assert e.node_id not in admitted_route()

    readiness.assignment_ready(e.pk, block.pk, url_of(e))

    assert admitted_route() == [a.node_id, e.node_id]


def test_a_node_moving_to_another_model_is_routed_only_when_no_chain_avoids_it(swarm, customer, monkeypatch):
    a, b, c, d, e = swarm
    # Demand moved e to another model's share: its block here is held until this model can do without it.
    monkeypatch.setattr(selectors, "share_of", lambda model: {a.node_id, b.node_id, c.node_id, d.node_id})

    assert admitted_route() == [a.node_id, b.node_id]
    assert healed_route(customer, [stage(c, 0, 16), stage(d, 16, 30)], d) == [c.node_id, b.node_id]

    # With b reported failed too, nothing else holds [16:30]: the leaving block serves rather than none.
    lifecycle.report_node_failure(b.node_id, "stage_lost: connection lost", now=NOW)
    assert admitted_route() == [a.node_id, e.node_id]
