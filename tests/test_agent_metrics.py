"""An agent answers ``GET /metrics`` on its data-plane port: the bytes it received and sent, the ERROR
frames it sent by code, its batches, the layer-tokens it computed and the jobs and sessions open now.

Stage servers run in-process (tiny-llama, real sockets on loopback), each with a registry of its
own, and are scraped over plain HTTP like Prometheus does."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import pytest
from nacl.signing import SigningKey

from tests.scrape import samples, value
from tests.wire_client import raw_client
from worker_agent import model as models
from worker_agent.block import Block
from worker_agent.coordinator.job import Coordinator
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.protocol import wire
from worker_agent.protocol.keys import generate_signing_key, public_key_bytes
from worker_agent.protocol.tickets import issue_ticket
from worker_agent.server import StageServer
from worker_agent.stage import Stage

pytestmark = pytest.mark.dataplane

MODEL = "tiny-llama"
ISSUER = SigningKey(b"\x07" * 32)  # signs the tickets every stage here trusts
COORDINATOR_KEY = SigningKey(b"\x08" * 32)  # the jobs' coordinator key, named in their tickets
DEADLINE_S = 60.0


@contextlib.asynccontextmanager
async def serving(spans: list[tuple[int, int]]) -> AsyncIterator[list[tuple[StageServer, Stage, str]]]:
    """Stage servers over ``spans`` on free loopback ports: (server, stage, ws URL) each."""
    started, tasks = [], []
    for start, end in spans:
        stage = Stage(
            Block(models.load_block(MODEL, start, end)),
            model=MODEL,
            signing_key=generate_signing_key(),
            trusted_keys=[public_key_bytes(ISSUER)],
        )
        server = StageServer(stage)
        bound = asyncio.get_running_loop().create_future()
        tasks.append(asyncio.create_task(server.serve("127.0.0.1", 0, ready=bound.set_result)))
        started.append((server, stage, f"ws://127.0.0.1:{await asyncio.wait_for(bound, 30)}"))
    try:
        yield started
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def ticket(stage: Stage, job: str) -> bytes:
    return issue_ticket(
        ISSUER,
        job=job,
        node=stage.node,
        model=MODEL,
        layer_start=stage.layer_start,
        layer_end=stage.layer_end,
        coordinator_key=bytes(COORDINATOR_KEY.verify_key),
    )


async def scrape(ws_url: str, path: str = "/metrics") -> tuple[int, str, str]:
    """(status, content type, body) of a plain HTTP GET to the agent's data-plane port."""
    url = ws_url.replace("ws://", "http://") + path

    def get() -> tuple[int, str, str]:
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                return response.status, response.headers["Content-Type"], response.read().decode()
        except urllib.error.HTTPError as refused:
            return refused.code, refused.headers["Content-Type"], refused.read().decode()

    return await asyncio.to_thread(get)


async def until(condition, what: str):
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not (found := await condition()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {DEADLINE_S}s waiting for {what}")
        await asyncio.sleep(0.02)
    return found


def test_each_agent_counts_the_layer_tokens_and_batches_it_computed_for_a_generation():
    async def main():
        async with serving([(0, 2), (2, 6)]) as stages:
            specs = [StageSpec(url, ticket(stage, "job-metrics")) for _, stage, url in stages]
            async with Coordinator(
                MODEL, specs, job="job-metrics", topology="ring", coordinator_key=COORDINATOR_KEY
            ) as coordinator:
                result = await coordinator.generate(coordinator.request("Hello", max_tokens=5))

            async def ended():
                bodies = [(await scrape(url))[2] for _, _, url in stages]
                spans = [{"layer_start": str(s.layer_start), "layer_end": str(s.layer_end)} for _, s, _ in stages]
                open_now = [
                    value(body, "swarm_agent_sessions_open", model=MODEL, **span)
                    for body, span in zip(bodies, spans, strict=True)
                ]
                return bodies if open_now == [0, 0] else None

            return result, stages, await until(ended, "the job's sessions to close")

    result, stages, bodies = asyncio.run(main())

    assert len(result.receipts) == 2
    for (server, stage, _), body, receipt in zip(stages, bodies, result.receipts, strict=True):
        layers = stage.layer_end - stage.layer_start
        assert stage.tokens_served == receipt.tokens > 0
        assert value(body, "swarm_agent_layer_tokens_total", model=MODEL) == layers * stage.tokens_served
        assert value(body, "swarm_agent_batch_items_count") == server.batches_run > 0
        assert value(body, "swarm_agent_batch_items_sum") == stage.steps_served
        labels = {"model": MODEL, "layer_start": str(stage.layer_start), "layer_end": str(stage.layer_end)}
        assert value(body, "swarm_agent_jobs_open", **labels) == 0
        assert value(body, "swarm_agent_received_bytes_total") > 0
        assert value(body, "swarm_agent_sent_bytes_total") > 0


def test_an_agent_shows_the_sessions_open_now():
    async def main():
        async with serving([(0, 6)]) as stages:
            (_, stage, url) = stages[0]
            labels = {"model": MODEL, "layer_start": "0", "layer_end": "6"}
            async with raw_client(url) as client:
                hello = await client.hello("job-open", ticket(stage, "job-open"), key=COORDINATOR_KEY)
                await client.send(wire.Open("job-open", ("s1", "s2")))
                opened = await client.recv()
                during = (await scrape(url))[2]
                await client.send(wire.Close("job-open", ("s1",)))
                closed = await client.recv()
                after_one = (await scrape(url))[2]

            async def left():
                body = (await scrape(url))[2]
                return body if value(body, "swarm_agent_jobs_open", **labels) == 0 else None

            return hello, opened, closed, labels, during, after_one, await until(left, "the job to end")

    hello, opened, closed, labels, during, after_one, after_leaving = asyncio.run(main())

    assert (type(hello), type(opened), type(closed)) == (wire.Hello, wire.Open, wire.Close)
    assert (value(during, "swarm_agent_jobs_open", **labels), value(during, "swarm_agent_sessions_open", **labels)) == (
        1,
        2,
    )
    assert value(after_one, "swarm_agent_sessions_open", **labels) == 1
    assert value(after_leaving, "swarm_agent_sessions_open", **labels) == 0


def test_an_agent_counts_the_exact_bytes_in_and_out_and_its_errors_by_code():
    frame = wire.encode(wire.Open("job-x", ("s1",)), 1)  # before any HELLO: refused

    async def main():
        async with serving([(0, 6)]) as stages:
            url = stages[0][2]
            async with raw_client(url) as client:
                await client.send_raw(frame)
                reply = await asyncio.wait_for(client.ws.recv(), DEADLINE_S)
                status, content_type, body = await scrape(url)
            return reply, status, content_type, body

    reply, status, content_type, body = asyncio.run(main())

    error = wire.decode(reply).message
    assert (type(error), error.code) == (wire.Error, "ticket_missing")
    assert (status, content_type) == (200, "text/plain; version=0.0.4; charset=utf-8")
    assert value(body, "swarm_agent_received_bytes_total") == len(frame)
    assert value(body, "swarm_agent_sent_bytes_total") == len(reply)
    assert value(body, "swarm_agent_errors_sent_total", code="ticket_missing") == 1
    assert value(body, "swarm_agent_batch_items_count") == 0


def test_two_servers_in_one_process_keep_their_series_apart_and_other_paths_stay_websocket_only():
    async def main():
        async with serving([(0, 3), (3, 6)]) as stages:
            async with raw_client(stages[0][2]) as client:
                await client.send_raw(wire.encode(wire.Open("job-y", ("s1",)), 1))
                await client.recv()
            first, second = [(await scrape(url))[2] for _, _, url in stages]
            other = await scrape(stages[0][2], "/")
            return first, second, other

    first, second, (other_status, _, _) = asyncio.run(main())

    assert value(first, "swarm_agent_errors_sent_total", code="ticket_missing") == 1
    assert ("swarm_agent_errors_sent_total", frozenset({("code", "ticket_missing")})) not in samples(second)
    assert value(second, "swarm_agent_received_bytes_total") == 0
    assert other_status == 426
