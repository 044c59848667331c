"""Make before break, end to end: a re-placement that moves agents' blocks while 20 streaming chat
completions are in flight fails none of them, and heals none: each job keeps its route to the end,
its agents serving their old blocks beside the new ones until the control plane releases them.

A live control plane (uvicorn in a thread, the test database) places ``tiny-llama`` (6 layers) over
three ``swarm-worker join`` agents capped at 2 layers; each agent delays its outgoing data-plane
frames (an emulated 30 ms round trip) so that streams last seconds. A fourth agent joins before the
streams start, but placement runs only when this test calls it (no periodic scheduler here): once
every stream has its first token, the model is placed again. Which plan a placement finds depends
on the speeds and round trips the agents measured, so the plan is given here: the same three
nodes with their spans rotated, so that every block moves (each agent, capped at 2 layers, drains
its old block and loads the new one). The re-placement margin is set so that any plan pays.
"""

from __future__ import annotations

import asyncio

import pytest
from django.db import close_old_connections
from django.test.utils import override_settings
from openai import AsyncOpenAI

from marketplace.billing.services import cost
from marketplace.jobs.models import Job, JobState
from marketplace.nodes.models import Node, NodeState
from marketplace.nodes.tickets import issuer_key
from marketplace.placement import placing, rebalancing
from marketplace.placement.allocation import Placement, Stage
from marketplace.placement.models import Assignment, AssignmentState, PlacementState
from marketplace.placement.placing import place_dirty_models
from marketplace.placement.selectors import servable_pipelines
from tests.api_fixtures import provider_and_customer, stop_agents
from tests.live import LiveServer, wait_for
from worker_agent.dev.local import join_agent

pytestmark = [pytest.mark.control, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-llama"
STREAMS = 20
MAX_TOKENS = 80
PRICES = (11_000, 17_000)  # nano-dollars per million prompt / completion tokens
MESSAGES = [{"role": "user", "content": "Count the ways a swarm can keep serving."}]


def join(server, token: str, tmp_path, index: int):
    return join_agent(
        server.url,
        token,
        tmp_path / f"agent{index}.key",
        tmp_path / f"agent{index}.log",
        model=MODEL,
        max_layers=2,
        wan="rtt=30ms",
    )


def spans() -> dict[str, tuple[int, int]]:
    """Each node's live block (the latest if it holds two), by node id."""
    live = Assignment.objects.filter(model=MODEL, state__in=[AssignmentState.ASSIGNED, AssignmentState.READY])
    return {a.node.node_id: (a.layer_start, a.layer_end) for a in live.select_related("node").order_by("pk")}


def rotated_plan(before: dict[str, tuple[int, int]]):
    """A plan that keeps the three serving nodes and rotates their spans: each takes the next one's."""
    serving = sorted(before, key=lambda node: before[node])
    spans_in_order = [before[node] for node in serving]
    stages = tuple(Stage(node, *spans_in_order[(i + 1) % len(serving)]) for i, node in enumerate(serving))
    stages = tuple(sorted(stages, key=lambda stage: stage.layer_start))

    def place(capacities, trusted, n_layers, **_):
        return Placement(n_layers=n_layers, plan=None, pipelines=(stages,), spares=())

    return place


def test_a_replacement_during_twenty_streams_fails_none(tmp_path, monkeypatch):
    overrides = override_settings(
        SWARM_COORDINATOR_LAUNCH="inprocess",
        SWARM_EMBEDDED_SCHEDULER=False,  # placement runs when this test says
        SWARM_HEARTBEAT_INTERVAL_S=1.0,
        SWARM_HEARTBEAT_TIMEOUT_S=120.0,
        SWARM_MODELS=[MODEL],
        SWARM_SPARES_PER_PIPELINE=0,
        SWARM_COORDINATOR_REGIONS=["local"],
        SWARM_DEFAULT_PRICES=PRICES,
        SWARM_TICKET_KEY_PATH=tmp_path / "ticket.key",
        # Any plan pays: the fourth node's joining re-places the model (it would otherwise only
        # warm a spare, and nothing that serves would move).
        SWARM_REPLACE_MARGIN=-1.0,
    )
    overrides.enable()
    issuer_key.cache_clear()
    agents = []
    server = LiveServer().start()
    try:
        tokens, key = provider_and_customer(4)
        agents = [join(server, token, tmp_path, i) for i, token in enumerate(tokens[:3])]
        wait_for(lambda: Node.objects.filter(state=NodeState.ACTIVE, connected=True).count() == 3, 180, "3 agents")
        place_dirty_models()
        wait_for(lambda: servable_pipelines(MODEL), 120, "a servable pipeline")
        agents.append(join(server, tokens[3], tmp_path, 3))
        wait_for(lambda: Node.objects.filter(state=NodeState.ACTIVE, connected=True).count() == 4, 180, "the 4th")
        before, generation = spans(), PlacementState.objects.get(model=MODEL).generation
        # Both the placement and its check that a fresh plan pays (``rebalancing.replacement_pays``) plan so.
        monkeypatch.setattr(placing, "place_with_trusted", rotated_plan(before))
        monkeypatch.setattr(rebalancing, "place_with_trusted", rotated_plan(before))
        monkeypatch.setattr(placing, "order_pipelines", lambda model, pipelines: (list(pipelines), ["local"]))

        async def stream(client, started: list[asyncio.Event], index: int) -> dict:
            chunks = await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, finish, usage, job_id, received = "", None, None, None, 0
            async for chunk in chunks:
                job_id = chunk.id
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        text += choice.delta.content
                        received += 1
                        started[index].set()
                    finish = choice.finish_reason or finish
            return {"text": text, "finish": finish, "usage": usage, "id": job_id, "chunks": received}

        def replace() -> None:
            """Place the model again (in a thread: the ORM). The fourth node's joining marked it dirty."""
            try:
                place_dirty_models()
            finally:
                close_old_connections()

        async def main():
            client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)
            started = [asyncio.Event() for _ in range(STREAMS)]
            tasks = [asyncio.create_task(stream(client, started, i)) for i in range(STREAMS)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 240)
            await asyncio.to_thread(replace)
            open_then = sum(not task.done() for task in tasks)
            results = await asyncio.gather(*tasks)
            await client.close()
            return results, open_then

        results, open_then = asyncio.run(main())
    finally:
        stop_agents(agents)
        server.stop()
        overrides.disable()
        issuer_key.cache_clear()

    after = spans()
    assert PlacementState.objects.get(model=MODEL).generation > generation
    assert all(after[node] != span for node, span in before.items())  # every serving block moved
    assert open_then > 0  # the re-placement happened while streams were in flight
    assert {r["finish"] for r in results} <= {"stop", "length"}
    assert len({r["text"] for r in results}) == 1  # greedy: every stream the same, none cut short
    for result in results:
        job = Job.objects.get(public_id=result["id"])
        assert job.state == JobState.SUCCEEDED, job.error_message
        assert job.heals == []  # kept its route to the end: nothing had to be healed
        assert job.completion_tokens == result["usage"].completion_tokens
        assert job.charged_amount == cost(job.prompt_tokens, job.completion_tokens, PRICES)
        assert job.verified is True, job.verification_error
