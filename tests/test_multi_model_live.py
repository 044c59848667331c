"""One control plane serves two models from one set of joined agents, and capacity follows demand
make before break: a node moves from smollm2-135m to tiny-llama while a smollm2 stream runs through
it, and the stream ends as an unbroken run would have.

A live control plane (uvicorn in a thread, the test database) serves SWARM_MODELS = smollm2-135m,
tiny-llama over four ``swarm-worker join`` agents capped at 15 layers: smollm2's 30 layers need two
of them, tiny-llama's 6 one. Earlier traffic (smollm2 job rows, written as demand) weighs the split
towards smollm2: it gets three nodes, one three-stage pipeline, and tiny-llama keeps its floor of
one. The periodic sweeps (``periodic.embedded_scheduler``, the real table) start once the four
agents are up, so that the first placement sees all of them rather than each join in turn.

Then tiny-llama's demand jumps (job rows again) while a greedy smollm2 stream is in flight. The
sweep shares the nodes again: tiny-llama takes one of smollm2's three. That node keeps its
smollm2 block until smollm2 is servable on the two nodes left: those two, each capped at 15
layers, drain their old blocks (the stream's jobs end first) before loading the new ones, and once
they are ready the moving node is let go and loads tiny-llama.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.contrib.auth import get_user_model
from django.test.utils import override_settings
from openai import OpenAI

from marketplace.jobs import services as jobs_services
from marketplace.jobs.models import ApiKey, Job, JobState
from marketplace.nodes import joining
from marketplace.nodes.models import Node, NodeState
from marketplace.nodes.tickets import issuer_key
from marketplace.periodic import embedded_scheduler
from marketplace.placement.models import Assignment, AssignmentState, PlacementState
from marketplace.placement.selectors import servable_pipelines
from tests.api_fixtures import greedy_chat
from tests.live import LiveServer, wait_for
from worker_agent.dev.local import join_agent, stop_processes

pytestmark = [pytest.mark.control, pytest.mark.django_db(transaction=True)]

SMOL, TINY = "smollm2-135m", "tiny-llama"
AGENTS = 4
LIVE = (AssignmentState.ASSIGNED, AssignmentState.READY)
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a story about a robot who learns to paint."}]
STORY_TOKENS = 64


class Sweeps:
    """The embedded scheduler on an event loop of its own, started and stopped by the test."""

    def __init__(self, tick_s: float) -> None:
        self.tick_s = tick_s
        self.loop = asyncio.new_event_loop()
        self.stop: asyncio.Event | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sweeps", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self.stop = asyncio.Event()
            self.started.set()
            await embedded_scheduler(self.tick_s, self.stop)

        self.loop.run_until_complete(main())

    def start(self) -> Sweeps:
        self.thread.start()
        self.started.wait(10)
        return self

    def close(self) -> None:
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(60)


def shares() -> dict[str, set[str]]:
    return {state.model: set(state.share) for state in PlacementState.objects.filter(model__in=[SMOL, TINY])}


def holders() -> dict[str, set[str]]:
    held: dict[str, set[str]] = {SMOL: set(), TINY: set()}
    for model, node in Assignment.objects.filter(state__in=LIVE).values_list("model", "node__node_id"):
        held[model].add(node)
    return held


def settled(agents) -> dict[str, set[str]] | None:
    """Who holds what, once both models are servable, every live block is ready and each model's
    blocks are on its own share; None before that."""
    dead = [i for i, agent in enumerate(agents) if agent.poll() is not None]
    if dead:
        raise AssertionError(f"agent {dead[0]} exited with {agents[dead[0]].returncode}")
    if not (servable_pipelines(SMOL) and servable_pipelines(TINY)):
        return None
    if Assignment.objects.filter(state=AssignmentState.ASSIGNED).exists():
        return None
    held = holders()
    return held if held == shares() else None


def moved_to_tiny(agents) -> dict[str, set[str]] | None:
    held = settled(agents)
    return held if held is not None and len(held[TINY]) == 2 else None


def stream(client: OpenAI, model: str, messages: list[dict], max_tokens: int, started=None) -> dict:
    chunks = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    text, finish, job_id = "", None, None
    for chunk in chunks:
        job_id = chunk.id
        for choice in chunk.choices:
            if choice.delta.content:
                text += choice.delta.content
                if started is not None:
                    started.set()
            finish = choice.finish_reason or finish
    return {"id": job_id, "text": text, "finish": finish}


def test_capacity_moves_to_the_model_in_demand_while_a_stream_runs_through_the_moving_node(tmp_path):
    overrides = override_settings(
        SWARM_COORDINATOR_LAUNCH="inprocess",
        SWARM_EMBEDDED_SCHEDULER=False,  # started below, once every agent is up
        SWARM_SWEEP_INTERVAL_S=0.5,
        SWARM_HEARTBEAT_INTERVAL_S=1.0,
        SWARM_HEARTBEAT_TIMEOUT_S=60.0,  # generous: the machine may be busy with other work
        SWARM_MODELS=[SMOL, TINY],
        SWARM_SPARES_PER_PIPELINE=0,
        SWARM_COORDINATOR_REGIONS=["local"],
        SWARM_DEFAULT_PRICES=(0, 0),  # tokens are free here: this test is about capacity
        SWARM_TICKET_KEY_PATH=tmp_path / "ticket.key",
        SWARM_REBALANCE_MIN_INTERVAL_S=0.0,  # demand may move nodes at any sweep, past SWARM_DEMAND_SHIFT
        SWARM_REBALANCE_CV=1e9,  # no re-placement for uneven speeds: only demand moves blocks here
    )
    overrides.enable()
    issuer_key.cache_clear()
    agents, sweeps, server = [], None, None
    pool = ThreadPoolExecutor(2)
    try:
        reference = pool.submit(lambda: (greedy_chat(CAPITAL, 16), greedy_chat(STORY, STORY_TOKENS)))
        users = get_user_model().objects
        provider = users.create_user("alice", "alice@example.test", None, is_provider=True)
        customer = users.create_user("carol", "carol@example.test", None, is_customer=True)
        api_key, key = jobs_services.create_api_key(customer, "carol's app")
        ApiKey.objects.filter(pk=api_key.pk).update(requests_per_minute=1000, tokens_per_minute=1_000_000)

        def demand(model: str, tokens: int) -> None:
            """Traffic of the demand window, as the job rows it left."""
            Job.objects.create(
                public_id=f"earlier-{model}-{Job.objects.count()}",
                kind="chat",
                customer=customer,
                model=model,
                prompt_tokens=tokens,
                state=JobState.SUCCEEDED,
            )

        demand(SMOL, 20_000)
        server = LiveServer().start()
        tokens = [joining.create_node(owner=provider, name=f"gpu-{i}")[1] for i in range(AGENTS)]
        agents = [
            join_agent(server.url, token, tmp_path / f"a{i}.key", tmp_path / f"a{i}.log", model=TINY, max_layers=15)
            for i, token in enumerate(tokens)
        ]
        wait_for(
            lambda: Node.objects.filter(state=NodeState.ACTIVE, connected=True).count() == AGENTS, 180, "the agents"
        )
        # Each agent timed itself at join, on a machine the other agents (and other tests) load: one
        # measuring itself far faster than the rest gets a longer block and the split changes. This
        # test is about demand moving capacity, not speed: the four nodes claim one speed.
        Node.objects.update(compute_layer_tokens_per_s=1000.0)
        sweeps = Sweeps(0.5).start()
        before = wait_for(lambda: settled(agents), 240, "both models placed")
        assert [len(before[SMOL]), len(before[TINY])] == [3, 1]
        (pipeline,) = servable_pipelines(SMOL)
        assert len(pipeline) == 3

        client = OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)
        assert sorted(m.id for m in client.models.list()) == [SMOL, TINY]
        capital, story = reference.result(timeout=300)
        assert stream(client, SMOL, CAPITAL, 16)["text"] == capital.text
        tiny = stream(client, TINY, CAPITAL, 8)
        assert Job.objects.get(public_id=tiny["id"]).state == JobState.SUCCEEDED

        # A smollm2 stream through all three of its nodes; once it has its first token, tiny-llama's
        # demand jumps.
        started = threading.Event()
        in_flight = pool.submit(stream, client, SMOL, STORY, STORY_TOKENS, started)
        assert started.wait(120), "the smollm2 stream never started"
        demand(TINY, 1_000_000)
        after = wait_for(lambda: moved_to_tiny(agents), 240, "a node to move to tiny-llama")
        result = in_flight.result(timeout=300)
        again = stream(client, TINY, CAPITAL, 8)
        assert sorted(m.id for m in client.models.list()) == [SMOL, TINY]
    finally:
        if sweeps is not None:
            sweeps.close()
        pool.shutdown(wait=False, cancel_futures=True)
        stop_processes(agents)
        if server is not None:
            server.stop()
        overrides.disable()
        issuer_key.cache_clear()

    (moved,) = after[TINY] - before[TINY]
    assert moved in before[SMOL]
    assert after[SMOL] == before[SMOL] - {moved}  # smollm2 keeps its floor: two nodes, one pipeline
    # The stream ran through the moving node, and ended as an unbroken greedy run, with no heal.
    job = Job.objects.get(public_id=result["id"])
    assert moved in {stage["node"] for stage in job.route}
    assert (result["text"], result["finish"]) == (story.text, story.finish_reason)
    assert job.state == JobState.SUCCEEDED, job.error_message
    assert job.heals == []
    # The nodes were shared again while it ran ...
    shared_at = PlacementState.objects.get(model=TINY).shared_at
    assert job.started_at < shared_at < job.finished_at
    # ... and the moving node's smollm2 block was let go only once smollm2 was servable without it.
    old = Assignment.objects.filter(node__node_id=moved, model=SMOL).latest("pk")
    assert old.state == AssignmentState.RELEASED
    assert old.released_at >= max(
        a.ready_at for a in Assignment.objects.filter(model=SMOL, state=AssignmentState.READY)
    )
    assert Assignment.objects.get(node__node_id=moved, model=TINY).state == AssignmentState.READY
    assert Job.objects.get(public_id=again["id"]).state == JobState.SUCCEEDED
