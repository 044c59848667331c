"""End to end: the control plane places three joined agents (each capped at 15 layers) over
smollm2-135m's 30 layers: two serve a two-stage pipeline and the third keeps a warm spare block.
They load their blocks and report ready, a generation runs through the placed pipeline with
tickets the control plane signed, and killing a serving agent re-places the model onto the two
survivors."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import time
import urllib.request

import pytest
from nacl.signing import SigningKey

from marketplace.nodes.models import LinkMeasurement, Node, NodeState
from marketplace.nodes.tickets import ticket_for
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.placement.selectors import route_request, servable_pipelines
from tests.live import LiveServer, wait_for
from worker_agent.coordinator.job import Coordinator
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.dev.local import join_agent, stop_processes
from worker_agent.protocol.span import Span

pytestmark = [pytest.mark.control, pytest.mark.django_db(transaction=True)]

MODEL = "smollm2-135m"


@pytest.fixture
def control_plane(settings):
    settings.SWARM_HEARTBEAT_INTERVAL_S = 0.5
    settings.SWARM_HEARTBEAT_TIMEOUT_S = 4.0
    settings.SWARM_SWEEP_INTERVAL_S = 0.5
    settings.SWARM_EMBEDDED_SCHEDULER = True
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_PUBLIC_URL = ""  # the join command names the address the API was reached at
    server = LiveServer().start()
    yield server
    server.stop()


def api(server, method: str, path: str, user: str, password: str, body: dict | None = None) -> dict:
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    request = urllib.request.Request(
        server.url + path,
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Basic {auth}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def generate_through(pipeline, job: str) -> list[int]:
    key = SigningKey.generate()  # the job's coordinator key, as the runner makes one per job
    grant = {"coordinator_key": bytes(key.verify_key), "expires_at": time.time() + 600}
    specs = [
        StageSpec(
            stage.data_url,
            ticket_for(job=job, node=stage.node, span=Span(MODEL, stage.layer_start, stage.layer_end), **grant),
        )
        for stage in pipeline
    ]

    async def run():
        async with Coordinator(MODEL, specs, job=job, coordinator_key=key) as coordinator:
            result = await coordinator.generate(
                coordinator.request("What is the capital of France?", chat=True, max_tokens=12)
            )
            return result

    return asyncio.run(run())


def spans(pipeline) -> list[tuple[int, int]]:
    return [(stage.layer_start, stage.layer_end) for stage in pipeline]


def test_joined_agents_are_placed_served_and_replaced_when_one_dies(control_plane, django_user_model, tmp_path):
    django_user_model.objects.create_user(
        username="prov", email="p@example.com", password="pw-123456", is_provider=True
    )
    created = [
        api(control_plane, "POST", "/api/v1/nodes/", "prov", "pw-123456", {"name": f"gpu-{i}"}) for i in range(3)
    ]
    assert [n["state"] for n in created] == ["pending"] * 3
    assert [n["join_command"] for n in created] == [
        f"curl -fsSL {control_plane.url}/install/agent.sh | SWARM_JOIN_TOKEN={n['join_token']} sh" for n in created
    ]

    agents = [
        join_agent(
            control_plane.url,
            n["join_token"],
            tmp_path / f"n{i}.key",
            tmp_path / f"agent{i}.log",
            model=MODEL,
            max_layers=15,
        )
        for i, n in enumerate(created)
    ]
    try:
        wait_for(
            lambda: servable_pipelines(MODEL) and Assignment.objects.filter(state=AssignmentState.READY).count() == 3,
            240,
            "a ready pipeline and a ready spare",
        )
        (pipeline,) = servable_pipelines(MODEL)
        assert spans(pipeline) == [(0, 15), (15, 30)]  # two nodes capped at 15 layers cover the 30
        (spare,) = Assignment.objects.filter(is_spare=True, state=AssignmentState.READY).select_related("node")
        assert spare.node.node_id not in {stage.node for stage in pipeline}
        assert spare.layer_end - spare.layer_start == 15
        assert Node.objects.filter(state=NodeState.ACTIVE, connected=True).count() == 3
        listed = api(control_plane, "GET", "/api/v1/nodes/", "prov", "pw-123456")["results"]
        assert sorted((s["state"], s["spare"]) for n in listed for s in n["layer_span"]) == [
            ("ready", False),
            ("ready", False),
            ("ready", True),
        ]

        # Each placed agent (the spare too) measured its links to the two others and to the region.
        links = wait_for(
            lambda: LinkMeasurement.objects.count() == 9 and list(LinkMeasurement.objects.all()),
            60,
            "the agents' link measurements",
        )
        assert sorted(link.target.startswith("region:") for link in links) == [False] * 6 + [True] * 3
        assert all(link.rtt_ms > 0 for link in links)
        assert all(link.uplink_mbps > 0 for link in links if not link.target.startswith("region:"))
        # Each probe was a frame its peer reads before a HELLO: no agent refused one.
        refusals = [line for i in range(3) for line in (tmp_path / f"agent{i}.log").read_text().splitlines()
                    if "too_large" in line or "unauthenticated" in line]  # fmt: skip
        assert refusals == []
        region, chosen, cost_ms = route_request(MODEL)
        assert region == "local"
        # The fastest chain of ready blocks, the warm spare's included: its spans tile the model.
        assert [(s.layer_start, s.layer_end) for s in chosen] == [(0, 15), (15, 30)]
        assert {s.node for s in chosen} <= {s.node for s in pipeline} | {spare.node.node_id}
        assert cost_ms > 0

        result = generate_through(pipeline, "job-e2e-1")
        assert result.text.startswith("The capital of France is Paris")
        assert result.verification is not None

        victim = next(i for i, n in enumerate(created) if Node.objects.get(pk=n["id"]).node_id == pipeline[0].node)
        agents[victim].send_signal(signal.SIGKILL)
        agents[victim].wait(timeout=10)

        wait_for(
            lambda: Node.objects.get(pk=created[victim]["id"]).state == NodeState.OFFLINE,
            30,
            "the killed node to go offline",
        )
        victim_node = Node.objects.get(pk=created[victim]["id"])
        assert not victim_node.assignments.filter(state__in=[AssignmentState.ASSIGNED, AssignmentState.READY])
        survivors = wait_for(
            lambda: [p for p in servable_pipelines(MODEL) if len(p) == 2],
            240,
            "a ready two-stage pipeline on the survivors",
        )
        (pipeline,) = survivors
        assert spans(pipeline) == [(0, 15), (15, 30)]
        assert victim_node.node_id not in {stage.node for stage in pipeline}

        result = generate_through(pipeline, "job-e2e-2")
        assert result.text.startswith("The capital of France is Paris")
    finally:
        stop_processes(agents)
