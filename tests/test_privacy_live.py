"""Trusted-only routing end to end: a live control plane, four ``swarm-worker join`` agents serving
tiny-llama three layers each, two of them marked trusted by an admin before they join. Placement
gives the trusted pair a pipeline of its own. A streamed request through the official OpenAI SDK
with ``"provider": {"trusted_only": true}`` runs only on the trusted nodes: its route and its
signed receipts name no other, while the untrusted pipeline stands ready and idle. Once a trust
mark is taken away, such a request is refused with 503 ``no_trusted_capacity``, and a request
without the requirement is still served."""

from __future__ import annotations

import openai
import pytest
from django.contrib.auth import get_user_model
from django.test.utils import override_settings

from marketplace.billing.services import grant
from marketplace.jobs import services as jobs_services
from marketplace.jobs.models import Job, JobState
from marketplace.nodes import joining
from marketplace.nodes.models import Node, NodeState, Privacy
from marketplace.nodes.tickets import issuer_key
from marketplace.placement.lifecycle import set_trusted
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.placement.selectors import servable_pipelines
from tests.live import LiveServer, wait_for
from worker_agent.dev.local import join_agent, stop_processes
from worker_agent.protocol.receipts import Receipt

pytestmark = [pytest.mark.trust, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-llama"
AGENTS = 4
CHAT = [{"role": "user", "content": "Say something private."}]


def placed_apart(agents, trusted: set[str]) -> list | None:
    """The two pipelines once every block is ready: the trusted pair's first; None before."""
    dead = [i for i, agent in enumerate(agents) if agent.poll() is not None]
    if dead:
        raise AssertionError(f"agent {dead[0]} exited with {agents[dead[0]].returncode}")
    if Assignment.objects.filter(state=AssignmentState.ASSIGNED).exists():
        return None
    pipelines = servable_pipelines(MODEL)
    if len(pipelines) != 2:
        return None
    return sorted(pipelines, key=lambda p: not {s.node for s in p} <= trusted)


def stream(client: openai.OpenAI, **extra) -> str:
    chunks = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0, stream=True, **extra
    )
    job_id = None
    for chunk in chunks:
        job_id = chunk.id
    return job_id


def test_a_trusted_only_request_runs_on_trusted_nodes_only_and_is_refused_when_none_is_ready(tmp_path):
    overrides = override_settings(
        SWARM_COORDINATOR_LAUNCH="inprocess",
        SWARM_VERIFIER="inline",
        SWARM_EMBEDDED_SCHEDULER=True,
        SWARM_SWEEP_INTERVAL_S=0.5,
        SWARM_HEARTBEAT_INTERVAL_S=1.0,
        SWARM_HEARTBEAT_TIMEOUT_S=60.0,  # generous: the machine may be busy with other work
        SWARM_MODELS=[MODEL],
        SWARM_SPARES_PER_PIPELINE=0,
        SWARM_COORDINATOR_REGIONS=["local"],
        SWARM_ADMISSION_WAIT_S=1.0,  # a refused trusted-only request waits this long for a route
        SWARM_TICKET_KEY_PATH=tmp_path / "ticket.key",
    )
    overrides.enable()
    issuer_key.cache_clear()
    agents, server = [], None
    try:
        users = get_user_model().objects
        provider = users.create_user("alice", "alice@example.test", None, is_provider=True)
        customer = users.create_user("carol", "carol@example.test", None, is_customer=True)
        admin = users.create_user("dave", "dave@example.test", None, is_staff=True)
        grant(customer, 10, memo="credits")
        _, key = jobs_services.create_api_key(customer, "carol's app")
        server = LiveServer().start()
        made = [joining.create_node(owner=provider, name=f"gpu-{i}") for i in range(AGENTS)]
        for node, _ in made[:2]:
            set_trusted(node, True, by=admin, reason="vetted hardware in a locked cage")
        agents = [
            join_agent(server.url, token, tmp_path / f"a{i}.key", tmp_path / f"a{i}.log", model=MODEL, max_layers=3)
            for i, (_, token) in enumerate(made)
        ]
        wait_for(
            lambda: Node.objects.filter(state=NodeState.ACTIVE, connected=True).count() == AGENTS, 180, "the agents"
        )
        trusted = set(Node.objects.filter(trusted_at__isnull=False).values_list("node_id", flat=True))
        untrusted = set(Node.objects.filter(trusted_at__isnull=True).values_list("node_id", flat=True))
        first, second = wait_for(lambda: placed_apart(agents, trusted), 240, "two pipelines, one trusted")
        assert {s.node for s in first} == trusted and {s.node for s in second} == untrusted

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)
        private = [stream(client, extra_body={"provider": {"trusted_only": True}}) for _ in range(3)]
        assert len(servable_pipelines(MODEL)) == 2  # the untrusted pipeline stood ready all along
        for job_id in private:
            job = wait_for(lambda job_id=job_id: Job.objects.filter(public_id=job_id, verified__isnull=False).first(),
                           60, "the job verified")  # fmt: skip
            assert (job.state, job.privacy, job.verified) == (JobState.SUCCEEDED, Privacy.TRUSTED_ONLY, True)
            assert {stage["node"] for stage in job.route} == trusted
            assert {Receipt.from_json(r).node for r in job.receipts} == trusted
        assert all(not {s["node"] for s in job.route} & untrusted for job in Job.objects.all())  # none went there

        set_trusted(Node.objects.get(node_id=sorted(trusted)[0]), False, by=admin, reason="moved to a new host")
        with pytest.raises(openai.APIStatusError) as refused:
            stream(client, extra_body={"provider": {"trusted_only": True}})
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "no_trusted_capacity"
        assert "was not sent to any other" in refused.value.body["message"]
        plain = Job.objects.get(public_id=stream(client))
        assert plain.privacy == Privacy.ANY
    finally:
        stop_processes(agents)
        if server is not None:
            server.stop()
        overrides.disable()
        issuer_key.cache_clear()
