"""The coordinator checks its route before it starts and the receipts before it reports success.

Stages run in-process here (real StageServers on loopback sockets), so one of them can be made
to misbehave: send bytes other than the ones it signed for."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
from nacl.signing import SigningKey

from tests.test_audit import stage_tickets
from worker_agent import model as models
from worker_agent.block import Block
from worker_agent.coordinator.job import Coordinator
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.errors import StageError
from worker_agent.protocol.keys import generate_signing_key, public_key_bytes
from worker_agent.protocol.receipts import BrokenLink
from worker_agent.server import StageServer
from worker_agent.stage import Output, Stage

pytestmark = pytest.mark.dataplane

MODEL = "tiny-llama"


class TamperingStage(Stage):
    """Signs a receipt for its real output, then sends something else."""

    def finish(self, prepared, outputs) -> Output:
        output = super().finish(prepared, outputs)
        flipped = bytes([output.payload[0] ^ 0x01]) + output.payload[1:]
        return dataclasses.replace(output, payload=flipped)


@contextlib.asynccontextmanager
async def stages(spans, *, rogue: int | None = None):
    """Start in-process stage servers; yield (urls, stage objects, issuer key)."""
    issuer = generate_signing_key()
    servers, tasks, urls = [], [], []
    for index, (start, end) in enumerate(spans):
        cls = TamperingStage if index == rogue else Stage
        stage = cls(
            Block(models.load_block(MODEL, start, end)),
            model=MODEL,
            signing_key=generate_signing_key(),
            trusted_keys=[public_key_bytes(issuer)],
        )
        server = StageServer(stage)
        bound = asyncio.get_running_loop().create_future()
        tasks.append(asyncio.create_task(server.serve("127.0.0.1", 0, ready=bound.set_result)))
        urls.append(f"ws://127.0.0.1:{await asyncio.wait_for(bound, 30)}")
        servers.append(stage)
    try:
        yield urls, servers, issuer
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


COORDINATOR_KEY = SigningKey(b"\x05" * 32)  # the job's coordinator key, which every ticket names


def specs_for(urls, servers, issuer, job):
    tickets = stage_tickets(issuer, job, servers, COORDINATOR_KEY)
    return [StageSpec(url, ticket) for url, ticket in zip(urls, tickets, strict=True)]


async def generate(spans, *, rogue=None, topology="ring"):
    async with stages(spans, rogue=rogue) as (urls, servers, issuer):
        specs = specs_for(urls, servers, issuer, "job-verify")
        async with Coordinator(
            MODEL, specs, job="job-verify", topology=topology, coordinator_key=COORDINATOR_KEY
        ) as coordinator:
            return await coordinator.generate(coordinator.request("Hello", max_tokens=5))


def test_honest_stages_verify():
    result = asyncio.run(generate([(0, 2), (2, 4), (4, 6)]))

    assert result.verification is not None
    assert result.verification.steps == 5
    assert len(result.receipts) == 3


@pytest.mark.parametrize("topology", ["ring", "star"])
def test_a_middle_stage_sending_other_bytes_than_it_signed_fails_verification(topology):
    with pytest.raises(BrokenLink) as caught:
        asyncio.run(generate([(0, 2), (2, 4), (4, 6)], rogue=0, topology=topology))

    assert caught.value.code == "receipt_broken_link"


def test_a_last_stage_returning_other_bytes_than_it_signed_is_refused_at_once():
    # Its answer carries its signature over other bytes than it holds: the coordinator sees it.
    with pytest.raises(StageError) as caught:
        asyncio.run(generate([(0, 2), (2, 4), (4, 6)], rogue=2))

    assert (caught.value.code, caught.value.stage) == ("stage_bad_output", 2)
    assert str(caught.value) == "stage 2 answered with bytes its own signature does not cover"


def test_a_route_with_a_gap_is_refused_before_any_work():
    with pytest.raises(StageError) as caught:
        asyncio.run(generate([(0, 2), (3, 6)]))

    assert caught.value.code == "bad_route"
    assert "stage 1 starts at layer 3, expected 2" in str(caught.value)


def test_a_route_that_stops_short_is_refused():
    with pytest.raises(StageError) as caught:
        asyncio.run(generate([(0, 2), (2, 4)]))

    assert caught.value.code == "bad_route"
    assert "the stages cover layers 0:4 of 6" in str(caught.value)
