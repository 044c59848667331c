"""The agent trusts only the ticket-signing key it pinned at join (``worker_agent.agent.control``).

The join's answer (over the join call's own HTTPS in production) names the control plane's
ticket key; the agent saves it in its join state, and a control channel whose Welcome names
another key is refused: the agent trusts no key from it and logs an error.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from worker_agent.agent import control
from worker_agent.agent.control import Agent, JoinError, JoinState, register
from worker_agent.errors import SwarmError
from worker_agent.protocol import control_protocol as protocol
from worker_agent.protocol.keys import generate_signing_key, node_id, public_key_bytes

PINNED = "ab" * 32
OTHER = "cd" * 32


class ScriptedChannel:
    """Stands in for the control channel's WebSocket: answers with the given messages, keeps what is sent."""

    def __init__(self, *replies: protocol.Message) -> None:
        self.replies = [protocol.encode(reply) for reply in replies]
        self.sent: list[protocol.Message] = []

    async def recv(self) -> str:
        return self.replies.pop(0)

    async def send(self, text: str) -> None:
        self.sent.append(protocol.decode(text))


def _agent(ticket_key: str) -> Agent:
    key = generate_signing_key()
    state = JoinState(
        "https://control.test", node_id(public_key_bytes(key)), "wss://control.test/ws/agent/", 5.0, ticket_key
    )
    return Agent(key, state, host="127.0.0.1", port=0, advertise_url="ws://127.0.0.1:7001")


def _welcome(agent: Agent, ticket_key: str) -> protocol.Welcome:
    return protocol.Welcome(node=agent.state.node, state="active", heartbeat_interval_s=5.0, ticket_key=ticket_key)


def test_the_agent_refuses_a_welcome_naming_another_ticket_key_than_the_pinned_one(caplog):
    agent = _agent(PINNED)
    channel = ScriptedChannel(protocol.Nonce(nonce=bytes(protocol.NONCE_BYTES)), _welcome(agent, OTHER))

    with caplog.at_level(logging.ERROR, logger="swarm.control"), pytest.raises(SwarmError) as refused:
        asyncio.run(agent._session(channel))

    assert refused.value.code == "ticket_key_mismatch"
    assert agent.trusted_key is None  # no ticket signed by the other key is ever accepted
    assert [type(message) for message in channel.sent] == [protocol.Auth]  # no heartbeat, no ready
    assert [record.getMessage() for record in caplog.records if record.levelno == logging.ERROR] == [
        f"the control channel names ticket key {OTHER}, not the {PINNED} pinned at join: refusing it"
    ]


def test_the_agent_trusts_the_pinned_key_when_the_welcome_names_it():
    agent = _agent(PINNED)

    assert agent._ticket_key(PINNED.upper()) == bytes.fromhex(PINNED)


def test_an_agent_joined_before_keys_were_pinned_trusts_the_welcome_and_says_so(caplog):
    agent = _agent("")

    with caplog.at_level(logging.WARNING, logger="swarm.control"):
        trusted = agent._ticket_key(OTHER)

    assert trusted == bytes.fromhex(OTHER)
    assert "no ticket key was pinned at join" in caplog.text


def _reply(key, **changes) -> dict:
    return {
        "node": node_id(public_key_bytes(key)),
        "control_url": "wss://control.test/ws/agent/",
        "heartbeat_interval_s": 5.0,
        "ticket_key": PINNED,
        **changes,
    }


def test_joining_pins_the_ticket_key_the_join_answer_names(monkeypatch, tmp_path):
    key = generate_signing_key()
    monkeypatch.setattr(control, "_post_json", lambda url, body: _reply(key))

    state = register("https://control.test/", "swj_token", key, hardware={}, compute=1.0, data_url="ws://a:7001")
    state.save(tmp_path / "join.json")

    assert state == JoinState(
        "https://control.test", node_id(public_key_bytes(key)), "wss://control.test/ws/agent/", 5.0, PINNED
    )
    assert JoinState.load(tmp_path / "join.json") == state


@pytest.mark.parametrize("ticket_key", [None, "", "zz" * 32, "ab" * 31, 7])
def test_a_join_answer_without_a_valid_ticket_key_fails_the_join(monkeypatch, ticket_key):
    key = generate_signing_key()
    monkeypatch.setattr(control, "_post_json", lambda url, body: _reply(key, ticket_key=ticket_key))

    with pytest.raises(JoinError) as failed:
        register("https://control.test", "swj_token", key, hardware={}, compute=1.0, data_url="ws://a:7001")

    assert str(failed.value) == f"the control plane's join answer names no valid ticket key: {ticket_key!r}"
