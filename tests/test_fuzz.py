"""Bounded fuzz, in a form quick enough for ``make test``: 20,000 seeded hostile frames against a
real agent process and 1,000 control-channel messages against the consumer. ``bench/fuzz.py``
runs the full sizes (and the HTTP API) and reports.

Each input is answered or refused, never hangs (every window of inputs is closed by a sentinel
that must be answered), the agent still answers a PING at the end, and no process grows past
1.5x its starting RSS.
"""

from __future__ import annotations

import asyncio

import psutil
import pytest
from channels.testing import WebsocketCommunicator
from django.test import override_settings

from marketplace.asgi import router
from marketplace.nodes import joining
from tests.factories import join_payload
from tests.fuzzing import FrameStats, answers_ping, control_messages, fuzz_connection
from worker_agent.dev.local import LocalSwarm
from worker_agent.protocol.control_protocol import control_signature
from worker_agent.protocol.keys import generate_signing_key

pytestmark = pytest.mark.fuzz
pytest_plugins = ["tests.factories", "tests.control_fixtures"]

FRAMES = 20_000
MESSAGES = 1_000
SEED = 20260


@pytest.mark.dataplane
def test_twenty_thousand_fuzzed_frames_neither_crash_hang_nor_grow_an_agent():
    with LocalSwarm("tiny-llama", [(0, 6)], threads=1) as swarm:
        process = psutil.Process(swarm.agents[0].process.pid)
        before = process.memory_info().rss
        job = "fuzz-job"
        ticket = swarm.tickets(job)[0]

        async def run():
            results = await asyncio.gather(
                *(
                    fuzz_connection(
                        swarm.urls[0],
                        job=job,
                        ticket=ticket,
                        key=swarm.coordinator_key(job),
                        seed=SEED + i,
                        count=FRAMES // 4,
                        hello=i < 2,
                    )
                    for i in range(4)
                )
            )
            total = FrameStats()
            for stats in results:
                total.add(stats)
            return total, await answers_ping(swarm.urls[0])

        total, alive = asyncio.run(asyncio.wait_for(run(), 600))
        after = process.memory_info().rss

    assert (total.sent, total.hangs, alive) == (FRAMES, 0, True)
    assert total.answers > FRAMES // 2  # most frames are refused one by one, the rest answered
    assert after < 1.5 * before


@pytest.mark.control
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("fresh_channel_layer")
def test_a_thousand_fuzzed_control_messages_get_answers_and_never_a_crash(provider, make_node):
    """Every fuzzed message on an authenticated channel is read (the rate limit lifted): the
    channel answers or closes (a frame that is no message at all), within a bound each, and a
    new channel authenticates after every close."""
    key = generate_signing_key()
    node, token = make_node(provider, "gpu-1")
    node = joining.register_agent(**join_payload(token, key))
    messages = control_messages(SEED, [])

    async def channel():
        communicator = WebsocketCommunicator(router, "/ws/agent/")
        connected, _ = await communicator.connect(timeout=10)
        assert connected
        nonce = bytes.fromhex((await communicator.receive_json_from(timeout=10))["nonce"])
        signature = control_signature(key, nonce, node.node_id)
        await communicator.send_json_to({"type": "auth", "node": node.node_id, "signature": signature})
        assert (await communicator.receive_json_from(timeout=10))["type"] == "welcome"
        return communicator

    async def scenario():
        sent, closed = 0, 0
        communicator = await channel()
        while sent < MESSAGES:
            await communicator.send_to(text_data=next(messages) or " ")  # the test client sends no empty text
            sent += 1
            await communicator.send_json_to({"type": f"sentinel-{sent}"})
            while True:
                output = await communicator.receive_output(timeout=30)
                if output["type"] == "websocket.close":
                    closed += 1
                    await communicator.disconnect()
                    communicator = await channel()
                    break
                if f"sentinel-{sent}" in output.get("text", ""):
                    break
        await communicator.disconnect()
        return sent, closed

    with override_settings(SWARM_CONTROL_RATE_PER_S=100_000.0, SWARM_CONTROL_BURST=100_000):
        sent, closed = asyncio.run(asyncio.wait_for(scenario(), 600))

    assert sent == MESSAGES
    assert 0 < closed < MESSAGES  # a frame that is no JSON message closes the channel; a malformed message does not
