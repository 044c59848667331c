"""An agent's data-plane port. Started without --port, an agent picks a free port at start and
binds it only when its first block is served; if another process takes that port meanwhile, the
agent serves on a new free port and its Ready carries the new URL (it used to fail every assignment
the control plane sent, which re-placed the block onto it forever). A port the owner chose
(--port or --advertise-url) is never swapped behind their back: that assignment fails, saying why.

The agent runs in the test's event loop with its control channel stood in for; the data plane is
real (a stage server on loopback, tiny-llama 0:3)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tests.test_make_before_break import RecordingChannel, until
from tests.wire_client import raw_client
from worker_agent.agent.control import Agent, JoinState
from worker_agent.protocol import control_protocol as protocol
from worker_agent.protocol.keys import generate_signing_key, node_id, public_key_bytes

pytestmark = pytest.mark.dataplane


def taken_port() -> socket.socket:
    """A listening socket holding a port, as another process would."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def agent_on(port: int, *, port_chosen: bool) -> Agent:
    key = generate_signing_key()
    state = JoinState("http://control.test", node_id(public_key_bytes(key)), "ws://control.test/ws/agent/", 5.0)
    # A port picked at start comes with no --advertise-url: the agent advertises where it serves.
    advertise_url = f"ws://127.0.0.1:{port}" if port_chosen else None
    return Agent(key, state, host="127.0.0.1", port=port, advertise_url=advertise_url, port_chosen=port_chosen)


async def assign(agent: Agent, channel: RecordingChannel) -> dict:
    message = protocol.Assign(assignment=1, model="tiny-llama", layer_start=0, layer_end=3)
    await agent._on_message(channel, message)
    return await until(lambda: channel.answered(1), "the agent to answer the assignment")


def test_a_port_picked_at_start_and_taken_since_is_replaced_and_the_new_url_reported():
    async def scenario() -> None:
        with taken_port() as other:
            taken = other.getsockname()[1]
            agent, channel = agent_on(taken, port_chosen=False), RecordingChannel()
            try:
                answer = await assign(agent, channel)
                assert answer["type"] == "ready", answer
                assert answer["url"] != f"ws://127.0.0.1:{taken}"
                assert answer["url"] == agent.data_url == f"ws://127.0.0.1:{agent.port}"
                async with raw_client(answer["url"]) as client:  # served there, for real
                    pong = await client.ping(3)
                assert (pong.info["layer_start"], pong.info["layer_end"]) == (0, 3)
            finally:
                await agent._stop_serving()
                await asyncio.gather(*agent._tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_a_port_the_owner_chose_is_not_swapped_the_assignment_fails_saying_why():
    async def scenario() -> None:
        with taken_port() as other:
            taken = other.getsockname()[1]
            agent, channel = agent_on(taken, port_chosen=True), RecordingChannel()
            try:
                answer = await assign(agent, channel)
                assert answer["type"] == protocol.Failed.TYPE, answer
                assert f"cannot serve on port {taken}" in answer["error"]
                assert agent.advertise_url == f"ws://127.0.0.1:{taken}" and agent.server is None
            finally:
                await agent._stop_serving()
                await asyncio.gather(*agent._tasks, return_exceptions=True)

    asyncio.run(scenario())
