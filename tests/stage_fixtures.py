"""In-process stage servers (tiny-llama) trusting the control plane's ticket key, and admitting a job
onto them through the jobs service: for tests that run ``runner.run_job`` in the test's own process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence

from django.utils import timezone

from marketplace.flows import admission
from marketplace.flows import events as job_events
from marketplace.jobs import services
from marketplace.jobs.models import Job
from marketplace.jobs.params import RequestParams
from marketplace.nodes.tickets import issuer_key, issuer_public_key
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.placement.selectors import PipelineStage
from worker_agent import model as models
from worker_agent.block import Block
from worker_agent.protocol.keys import generate_signing_key
from worker_agent.server import StageServer
from worker_agent.stage import Stage

MODEL = "tiny-llama"


@contextlib.contextmanager
def in_memory_control_plane(settings, tmp_path, **overrides) -> Iterator:
    """The control plane these in-process jobs run against: the in-memory channel layer (whatever
    REDIS_URL says), a ticket key of the test's own, a 120 s job timeout, then ``overrides``
    (setting name -> value)."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.SWARM_TICKET_KEY_PATH = tmp_path / "ticket.key"
    settings.SWARM_JOB_TIMEOUT_S = 120.0
    for name, value in overrides.items():
        setattr(settings, name, value)
    issuer_key.cache_clear()
    try:
        yield settings
    finally:
        issuer_key.cache_clear()


@contextlib.asynccontextmanager
async def stage_servers(
    spans: Sequence[tuple[int, int]],
    *,
    stage_class=Stage,
    rogue: int | None = None,
    rogue_class: type[Stage] | None = None,
    trusted: bytes | None = None,
    keys: Sequence | None = None,
    server_class: type[StageServer] = StageServer,
    rogue_server: type[StageServer] | None = None,
) -> AsyncIterator[list[PipelineStage]]:
    """Stages over ``spans`` (the one at index ``rogue`` of ``rogue_class``, served by
    ``rogue_server``) trusting ``trusted``
    (default: the control plane's ticket key), signing with ``keys`` (default: new ones); yields
    the route."""
    trusted = trusted if trusted is not None else issuer_public_key()
    tasks, route = [], []
    for index, (start, end) in enumerate(spans):
        cls = rogue_class if index == rogue and rogue_class is not None else stage_class
        stage = cls(
            Block(models.load_block(MODEL, start, end)),
            model=MODEL,
            signing_key=keys[index] if keys is not None else generate_signing_key(),
            trusted_keys=[trusted],
        )
        bound = asyncio.get_running_loop().create_future()
        server = rogue_server if index == rogue and rogue_server is not None else server_class
        tasks.append(asyncio.create_task(server(stage).serve("127.0.0.1", 0, ready=bound.set_result)))
        port = await asyncio.wait_for(bound, 30)
        route.append(PipelineStage(stage.node, stage.node_key.hex(), f"ws://127.0.0.1:{port}", start, end, "local"))
    try:
        yield route
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def admit(api_key, route: list[PipelineStage], params: RequestParams, monkeypatch) -> Job:
    """Admit a completion job for ``params`` onto ``route`` (placement's routing is bypassed)."""
    monkeypatch.setattr(admission, "route_request", lambda model, busy=None, **_: ("local", route, 1.0))
    return admission.admit_job(
        api_key=api_key,
        kind="completion",
        model=MODEL,
        params=params,
        prompt_ids=services.tokenize_prompt(MODEL, params),
    )


def place_route(nodes, route: Sequence[PipelineStage]) -> None:
    """The nodes as one pipeline over the route's spans, ready at its URLs (placement is bypassed)."""
    for position, (node, stage) in enumerate(zip(nodes, route, strict=True)):
        Assignment.objects.create(
            node=node, model=MODEL, generation=1, pipeline=0, position=position,
            layer_start=stage.layer_start, layer_end=stage.layer_end, state=AssignmentState.READY,
            data_url=stage.data_url, ready_at=timezone.now(),
        )  # fmt: skip


async def events_until_final(job_id: str, timeout_s: float = 60.0) -> list[dict]:
    """The job's events (``flows.events``) from its first up to its last (done or error), each
    awaited at most ``timeout_s``: a job's events are kept from its first, so this may start
    before, during or after its run."""
    subscription = job_events.channel().subscribe(job_id)
    try:
        events: list[dict] = []
        while not events or events[-1]["type"] not in job_events.ENDINGS:
            events.append(await asyncio.wait_for(subscription.get(), timeout_s))
        return events
    finally:
        subscription.close()
