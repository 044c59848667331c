"""The agent control channel (ws/agent/): key-authenticated handshake, heartbeats, reports and
messages pushed from the control plane to the agent."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from marketplace.asgi import router
from marketplace.jobs.models import Job, JobState
from marketplace.nodes import joining, services
from marketplace.nodes.models import LinkMeasurement, Node, NodeState
from marketplace.nodes.tickets import issuer_public_key
from marketplace.placement.blocks import push_release
from marketplace.placement.models import Assignment, AssignmentState, PlacementState
from marketplace.placement.placing import place_model
from marketplace.placement.selectors import servable_pipelines
from tests.factories import GIB, MODEL, db_snapshot, join_payload
from worker_agent.protocol.control_protocol import control_signature
from worker_agent.protocol.keys import generate_signing_key

pytestmark = [
    pytest.mark.control,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fresh_channel_layer"),
]
pytest_plugins = ["tests.factories", "tests.control_fixtures"]

TIMEOUT_S = 10  # the consumer reaches the database through a thread; a loaded machine may be slow
CLOSE_UNAUTHORIZED = 4401
CLOSE_PROTOCOL = 4400


AGENT_ADDRESS = "10.0.0.7"  # where the test agents' control channels come from


async def open_channel(client: str = AGENT_ADDRESS) -> tuple[WebsocketCommunicator, bytes]:
    """Connect as an agent would (from ``client``); returns the channel and the server's challenge nonce."""
    channel = WebsocketCommunicator(router, "/ws/agent/")
    channel.scope["client"] = [client, 40000]
    connected, _ = await channel.connect(timeout=TIMEOUT_S)
    assert connected
    challenge = await channel.receive_json_from(timeout=TIMEOUT_S)
    assert set(challenge) == {"type", "nonce"}
    assert challenge["type"] == "challenge"
    nonce = bytes.fromhex(challenge["nonce"])
    assert len(nonce) == 32
    return channel, nonce


def auth_message(key, nonce: bytes, node_id: str) -> dict:
    return {"type": "auth", "node": node_id, "signature": control_signature(key, nonce, node_id)}


async def authenticated(key, node_id: str, client: str = AGENT_ADDRESS) -> tuple[WebsocketCommunicator, dict]:
    """A channel past the handshake; returns it and the welcome."""
    channel, nonce = await open_channel(client)
    await channel.send_json_to(auth_message(key, nonce, node_id))
    welcome = await channel.receive_json_from(timeout=TIMEOUT_S)
    assert welcome["type"] == "welcome", welcome
    return channel, welcome


async def refusal(channel: WebsocketCommunicator, timeout: float = TIMEOUT_S) -> tuple[dict, int]:
    """The error the server sends before it closes, and the close code."""
    error = await channel.receive_json_from(timeout=timeout)
    closed = await channel.receive_output(timeout=timeout)
    assert closed["type"] == "websocket.close"
    await channel.disconnect()
    return error, closed["code"]


async def settle(channel: WebsocketCommunicator) -> None:
    """Wait until the consumer has handled everything sent before: it answers messages in order,
    so the reply to an unknown type comes after every earlier message was processed."""
    await channel.send_json_to({"type": "sync"})
    assert await channel.receive_json_from(timeout=TIMEOUT_S) == {
        "type": "error",
        "code": "unknown_type",
        "message": "unknown type 'sync'",
    }


def fresh(node: Node) -> Node:
    return Node.objects.get(pk=node.pk)


@pytest.fixture
def pending_agent(provider, make_node):
    """A node whose agent registered its key but never connected: (node, key)."""
    key = generate_signing_key()
    node, token = make_node(provider, "gpu-1")
    joining.register_agent(**join_payload(token, key))
    node.refresh_from_db()
    return node, key


def test_a_valid_handshake_is_welcomed_and_the_node_becomes_active(pending_agent, swarm_settings):
    node, key = pending_agent
    before = timezone.now()

    async def scenario():
        channel, welcome = await authenticated(key, node.node_id)
        seen = await database_sync_to_async(fresh)(node)
        await channel.disconnect()
        return welcome, seen

    welcome, seen = asyncio.run(scenario())

    assert welcome == {
        "type": "welcome",
        "node": node.node_id,
        "state": "active",
        "heartbeat_interval_s": 5.0,
        "ticket_key": issuer_public_key().hex(),
        "assignments": [],
        "seen_address": AGENT_ADDRESS,  # what the agent advertises when it was given no address
    }
    assert re.fullmatch(r"[0-9a-f]{64}", welcome["ticket_key"])
    assert (seen.state, seen.connected) == (NodeState.ACTIVE, True)
    assert before <= seen.last_heartbeat_at <= timezone.now()
    assert list(PlacementState.objects.values_list("model", "dirty")) == [(MODEL, True)]


def test_the_welcome_lists_the_nodes_live_assignments(provider, make_joined_node, swarm_settings):
    joined = make_joined_node(provider, max_layers=None, memory_bytes=8 * GIB)
    (assignment,) = place_model(MODEL)
    Node.objects.filter(pk=joined.node.pk).update(connected=False)

    async def scenario():
        channel, welcome = await authenticated(joined.key, joined.node.node_id)
        await channel.disconnect()
        return welcome

    welcome = asyncio.run(scenario())

    assert welcome["assignments"] == [
        {"type": "assign", "assignment": assignment.pk, "model": MODEL, "layer_start": 0, "layer_end": 30}
    ]


def test_closing_the_channel_marks_the_node_disconnected_and_suspect_but_keeps_it_active(pending_agent):
    node, key = pending_agent

    async def scenario():
        channel, _ = await authenticated(key, node.node_id)
        await channel.disconnect()

    asyncio.run(scenario())

    # Active (its blocks stay until its heartbeats time out), but no request is routed to it meanwhile.
    assert (fresh(node).state, fresh(node).connected) == (NodeState.ACTIVE, False)
    assert fresh(node).suspected_at is not None
    assert fresh(node).suspicion == "its control channel closed"

    async def reconnect():
        channel, _ = await authenticated(key, node.node_id)
        back = await sync_to_async(fresh)(node)
        await channel.disconnect()
        return back

    back = asyncio.run(reconnect())
    assert back.connected is True
    assert back.suspected_at is None  # it came back: its agent is alive


def test_a_handshake_signed_by_another_key_is_refused(pending_agent):
    node, _ = pending_agent
    impostor = generate_signing_key()
    before = db_snapshot()

    async def scenario():
        channel, nonce = await open_channel()
        await channel.send_json_to(auth_message(impostor, nonce, node.node_id))
        return await refusal(channel)

    error, code = asyncio.run(scenario())

    assert code == CLOSE_UNAUTHORIZED
    assert error == {
        "type": "error",
        "code": "unauthorized",
        "message": "the signature does not verify with the node's key (invalid_handshake)",
    }
    assert db_snapshot() == before


def test_an_unknown_node_id_is_refused(pending_agent):
    _, key = pending_agent
    before = db_snapshot()

    async def scenario():
        channel, nonce = await open_channel()
        await channel.send_json_to(auth_message(key, nonce, "node-0000000000000000"))
        return await refusal(channel)

    error, code = asyncio.run(scenario())

    assert code == CLOSE_UNAUTHORIZED
    assert error == {"type": "error", "code": "unauthorized", "message": "unknown node (invalid_handshake)"}
    assert db_snapshot() == before


def test_a_handshake_replayed_on_another_connection_is_refused(pending_agent):
    node, key = pending_agent
    before = db_snapshot()

    async def scenario():
        first, first_nonce = await open_channel()
        second, _ = await open_channel()
        captured = auth_message(key, first_nonce, node.node_id)
        await second.send_json_to(captured)
        replayed = await refusal(second)
        unchanged = await database_sync_to_async(db_snapshot)()
        await first.send_json_to(captured)
        original = await first.receive_json_from(timeout=TIMEOUT_S)
        await first.disconnect()
        return replayed, unchanged, original

    (error, code), unchanged, original = asyncio.run(scenario())

    assert code == CLOSE_UNAUTHORIZED
    assert error == {
        "type": "error",
        "code": "unauthorized",
        "message": "the signature does not verify with the node's key (invalid_handshake)",
    }
    assert unchanged == before
    assert original["type"] == "welcome"  # the captured answer was valid, on its own connection


@pytest.mark.parametrize("signature", ["00" * 64, "not hex", "", 42])
def test_a_malformed_signature_is_refused(signature, pending_agent):
    node, _ = pending_agent
    before = db_snapshot()

    async def scenario():
        channel, _ = await open_channel()
        await channel.send_json_to({"type": "auth", "node": node.node_id, "signature": signature})
        return await refusal(channel)

    error, code = asyncio.run(scenario())

    assert code == CLOSE_UNAUTHORIZED
    assert error == {
        "type": "error",
        "code": "unauthorized",
        "message": "the signature does not verify with the node's key (invalid_handshake)",
    }
    assert db_snapshot() == before


@pytest.mark.usefixtures("pending_agent")
def test_a_message_before_the_handshake_is_refused():
    before = db_snapshot()

    async def scenario():
        channel, _ = await open_channel()
        await channel.send_json_to({"type": "heartbeat", "load": {"sessions": 1}})
        return await refusal(channel)

    error, code = asyncio.run(scenario())

    assert code == CLOSE_UNAUTHORIZED
    assert error == {"type": "error", "code": "unauthorized", "message": "authenticate first"}
    assert db_snapshot() == before


@pytest.mark.usefixtures("pending_agent")
def test_a_message_that_is_not_a_typed_object_closes_with_a_protocol_error():
    before = db_snapshot()

    async def scenario():
        channel, _ = await open_channel()
        await channel.send_json_to(["auth"])
        return await refusal(channel)

    error, code = asyncio.run(scenario())

    assert code == CLOSE_PROTOCOL
    assert error == {"type": "error", "code": "protocol", "message": "messages are JSON objects with a type"}
    assert db_snapshot() == before


def test_an_ejected_node_is_refused(pending_agent):
    node, key = pending_agent
    Node.objects.filter(pk=node.pk).update(state=NodeState.EJECTED)
    before = db_snapshot()

    async def scenario():
        channel, nonce = await open_channel()
        await channel.send_json_to(auth_message(key, nonce, node.node_id))
        return await refusal(channel)

    error, code = asyncio.run(scenario())

    assert code == CLOSE_UNAUTHORIZED
    assert error == {"type": "error", "code": "unauthorized", "message": "this node was ejected (node_not_allowed)"}
    assert db_snapshot() == before


def test_a_heartbeat_records_the_time_and_the_load(pending_agent):
    node, key = pending_agent
    load = {
        "sessions": 2,
        "tokens_served": 40,
        "uptime_s": 12.5,
        "queue": 0,
        "model": MODEL,
        "state": "serving",
        "gossip": "dropped",
    }

    async def scenario():
        channel, _ = await authenticated(key, node.node_id)
        sent_at = timezone.now()
        await channel.send_json_to({"type": "heartbeat", "load": load})
        await settle(channel)
        seen = await database_sync_to_async(fresh)(node)
        await channel.disconnect()
        return sent_at, seen

    sent_at, seen = asyncio.run(scenario())

    assert sent_at <= seen.last_heartbeat_at <= timezone.now()
    assert seen.load == {
        "sessions": 2.0,
        "tokens_served": 40.0,
        "uptime_s": 12.5,
        "queue": 0.0,
        "model": MODEL,
        "state": "serving",
    }


@pytest.mark.parametrize(
    ("load", "message"),
    [
        ({"sessions": -1}, "sessions must be a number >= 0.0, got -1"),
        ({"tokens_served": "many"}, "tokens_served must be a number >= 0.0, got 'many'"),
        ({"queue": None}, "queue must be a number >= 0.0, got None"),
        ([1, 2], "load must be an object"),
    ],
)
def test_an_invalid_heartbeat_gets_an_error_and_the_channel_stays_open(load, message, pending_agent):
    node, key = pending_agent

    async def scenario():
        channel, _ = await authenticated(key, node.node_id)
        await channel.send_json_to({"type": "heartbeat", "load": {"sessions": 1}})
        await settle(channel)
        await channel.send_json_to({"type": "heartbeat", "load": load})
        error = await channel.receive_json_from(timeout=TIMEOUT_S)
        after_error = await database_sync_to_async(fresh)(node)
        await channel.send_json_to({"type": "heartbeat", "load": {"sessions": 3}})
        await settle(channel)
        after_next = await database_sync_to_async(fresh)(node)
        await channel.disconnect()
        return error, after_error, after_next

    error, after_error, after_next = asyncio.run(scenario())

    assert error == {"type": "error", "code": "invalid_report", "message": message}
    assert after_error.load == {"sessions": 1.0}
    assert after_next.load == {"sessions": 3.0}


def test_a_ready_report_marks_the_assignment_ready_and_asks_for_link_probes(provider, make_joined_node, swarm_settings):
    joined = make_joined_node(provider, max_layers=None)
    (assignment,) = place_model(MODEL)

    async def scenario():
        channel, _ = await authenticated(joined.key, joined.node.node_id)
        await channel.send_json_to({"type": "ready", "assignment": assignment.pk, "url": "ws://10.0.0.7:9100"})
        probe = await channel.receive_json_from(timeout=TIMEOUT_S)
        await channel.disconnect()
        return probe

    probe = asyncio.run(scenario())

    assignment.refresh_from_db()
    assert (assignment.state, assignment.data_url) == (AssignmentState.READY, "ws://10.0.0.7:9100")
    # The model's only block is up: its node measures its link to the coordinator region.
    assert probe == {"type": "probe", "model": MODEL, "targets": [{"target": "region:local", "url": None}]}


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (
            "ws://10.0.0.99:9100",
            "data URL 'ws://10.0.0.99:9100' must point at the address this agent connects from (10.0.0.7) "
            "or a host allowed by SWARM_AGENT_URL_HOSTS",
        ),
        ("http://10.0.0.7:9100", "data URL 'http://10.0.0.7:9100' must use ws:// or wss://, not 'http'"),
        ("ws://10.0.0.7:80", "data URL 'ws://10.0.0.7:80' must name a port in 1024-65535, not 80"),
        ("ws://10.0.0.7", "data URL 'ws://10.0.0.7' must name a port in 1024-65535, not None"),
        (
            "ws://evil.example:9100",
            "data URL 'ws://evil.example:9100' must point at the address this agent connects from (10.0.0.7) "
            "or a host allowed by SWARM_AGENT_URL_HOSTS",
        ),
    ],
    ids=["other_host", "bad_scheme", "low_port", "no_port", "unlisted_name"],
)
def test_a_ready_report_with_a_url_the_control_plane_will_not_route_to_fails_the_assignment(
    provider, make_joined_node, swarm_settings, url, reason
):
    joined = make_joined_node(provider, max_layers=None)
    (assignment,) = place_model(MODEL)

    async def scenario():
        channel, _ = await authenticated(joined.key, joined.node.node_id)
        await channel.send_json_to({"type": "ready", "assignment": assignment.pk, "url": url})
        error = await channel.receive_json_from(timeout=TIMEOUT_S)
        await channel.disconnect()
        return error

    error = asyncio.run(scenario())

    assert error == {"type": "error", "code": "invalid_data_url", "message": reason}
    assignment.refresh_from_db()
    assert (assignment.state, assignment.data_url, assignment.error) == (
        AssignmentState.FAILED,
        "",
        f"invalid_data_url: {reason}",
    )
    assert servable_pipelines(MODEL) == []  # never routed to


def test_a_ready_report_may_name_a_host_the_operator_allowed(provider, make_joined_node, swarm_settings):
    swarm_settings.SWARM_AGENT_URL_HOSTS = ["agents.example.net"]
    joined = make_joined_node(provider, max_layers=None)
    (assignment,) = place_model(MODEL)

    async def scenario():
        channel, _ = await authenticated(joined.key, joined.node.node_id)
        await channel.send_json_to(
            {"type": "ready", "assignment": assignment.pk, "url": "wss://agents.example.net:8443/n1"}
        )
        probe = await channel.receive_json_from(timeout=TIMEOUT_S)
        await channel.disconnect()
        return probe

    probe = asyncio.run(scenario())

    assignment.refresh_from_db()
    assert (assignment.state, assignment.data_url) == (AssignmentState.READY, "wss://agents.example.net:8443/n1")
    assert probe["type"] == "probe"


def test_a_ready_report_for_another_nodes_assignment_changes_nothing(
    provider, second_provider, make_joined_node, swarm_settings
):
    owner = make_joined_node(provider, max_layers=None)
    (assignment,) = place_model(MODEL)
    other = make_joined_node(second_provider, "rogue", state=NodeState.PENDING, connected=False)
    before = db_snapshot()

    async def scenario():
        channel, _ = await authenticated(other.key, other.node.node_id)
        unchanged = await database_sync_to_async(lambda: list(Assignment.objects.order_by("pk").values()))()
        await channel.send_json_to({"type": "ready", "assignment": assignment.pk, "url": "ws://10.0.0.7:9100"})
        await settle(channel)
        await channel.disconnect()
        return unchanged

    unchanged = asyncio.run(scenario())

    assert unchanged == before["assignments"]
    assert list(Assignment.objects.order_by("pk").values()) == before["assignments"]
    assert Assignment.objects.get(pk=assignment.pk).node_id == owner.node.pk


def test_probe_results_are_stored_as_link_measurements(pending_agent, provider, make_joined_node):
    node, key = pending_agent
    peer = make_joined_node(provider, "gpu-2").node
    results = [
        {"target": "region:local", "rtt_ms": 4.0, "uplink_mbps": 900.0},
        {"target": peer.node_id, "rtt_ms": 12.5},
    ]

    async def scenario():
        channel, _ = await authenticated(key, node.node_id)
        await channel.send_json_to({"type": "probe_result", "results": results})
        await settle(channel)
        await channel.disconnect()

    asyncio.run(scenario())

    assert sorted(LinkMeasurement.objects.values_list("source_id", "target", "rtt_ms", "uplink_mbps")) == sorted(
        [(node.pk, peer.node_id, 12.5, None), (node.pk, "region:local", 4.0, 900.0)]
    )
    assert fresh(node).uplink_mbps == 900.0


def test_measurements_of_invented_targets_are_dropped_and_link_rows_stay_bounded(
    pending_agent, provider, make_joined_node
):
    """Given a node and one peer, when the node reports 30 probe results of 1,000 invented targets
    each (plus itself, an unconfigured region and its real peer), then only the peer's and the
    configured region's rows exist: at most nodes x (nodes + regions)."""
    node, key = pending_agent
    peer = make_joined_node(provider, "gpu-2").node
    real = [{"target": peer.node_id, "rtt_ms": 7.0}, {"target": "region:local", "rtt_ms": 3.0}]

    async def scenario():
        channel, _ = await authenticated(key, node.node_id)
        for round_ in range(30):
            invented = [{"target": f"node-{round_:04d}{i:012d}", "rtt_ms": 1.0} for i in range(1000)]
            invented += [{"target": node.node_id, "rtt_ms": 0.1}, {"target": "region:elsewhere", "rtt_ms": 0.1}]
            await channel.send_json_to({"type": "probe_result", "results": invented + real})
        await settle(channel)
        await channel.disconnect()

    with override_settings(SWARM_CONTROL_RATE_PER_S=1000.0):
        asyncio.run(scenario())

    assert sorted(LinkMeasurement.objects.values_list("source_id", "target", "rtt_ms")) == sorted(
        [(node.pk, peer.node_id, 7.0), (node.pk, "region:local", 3.0)]
    )


def test_a_flood_of_messages_is_rate_limited_then_closed(pending_agent):
    """Given a burst of 5 messages (the handshake takes one) refilled too slowly to matter, when
    the node sends 40 heartbeats at once, then 4 are read, the next 10 are refused with
    rate_limited, and the 11th refusal in a row closes the channel with 4429."""
    node, key = pending_agent
    heartbeat = {"type": "heartbeat", "load": {}}

    async def scenario():
        channel, _ = await authenticated(key, node.node_id)
        for _ in range(40):
            await channel.send_json_to(heartbeat)
        frames = []
        while True:
            output = await channel.receive_output(timeout=TIMEOUT_S)
            if output["type"] == "websocket.close":
                break
            frames.append(output["text"])
        await channel.disconnect()
        return [json.loads(frame) for frame in frames], output["code"]

    with override_settings(SWARM_CONTROL_RATE_PER_S=0.01, SWARM_CONTROL_BURST=5, SWARM_CONTROL_MAX_REFUSED=10):
        frames, code = asyncio.run(scenario())

    assert [frame["code"] for frame in frames] == ["rate_limited"] * 10 + ["protocol"]
    assert frames[0]["message"] == "over 0.01 messages per second: message not read"
    assert code == 4429
    assert fresh(node).last_heartbeat_at is not None


def push_on_commit(node_id: str, message: dict) -> None:
    with transaction.atomic():
        services.push(node_id, message)


def push_then_roll_back(node_id: str, message: dict) -> None:
    class Abandon(Exception):
        pass

    try:
        with transaction.atomic():
            services.push(node_id, message)
            raise Abandon
    except Abandon:
        pass


def test_a_message_pushed_on_commit_reaches_the_connected_agent(pending_agent):
    node, key = pending_agent
    message = {"type": "probe", "model": MODEL, "targets": [{"target": "region:local", "url": None}]}

    async def scenario():
        channel, _ = await authenticated(key, node.node_id)
        await database_sync_to_async(push_on_commit)(node.node_id, message)
        received = await channel.receive_json_from(timeout=TIMEOUT_S)
        await channel.disconnect()
        return received

    assert asyncio.run(scenario()) == message


def test_a_message_pushed_in_a_rolled_back_transaction_is_never_sent(pending_agent):
    node, key = pending_agent

    async def scenario():
        channel, _ = await authenticated(key, node.node_id)
        await database_sync_to_async(push_then_roll_back)(node.node_id, {"type": "drain"})
        nothing = await channel.receive_nothing(timeout=0.5)
        await channel.disconnect()
        return nothing

    assert asyncio.run(scenario()) is True


def test_a_group_send_to_the_nodes_group_reaches_its_agent_only(pending_agent, provider, make_joined_node):
    node, key = pending_agent
    other = make_joined_node(provider, "gpu-2", state=NodeState.PENDING, connected=False)
    message = {"type": "stop", "reason": "maintenance"}

    async def scenario():
        channel, _ = await authenticated(key, node.node_id)
        bystander, _ = await authenticated(other.key, other.node.node_id)
        await get_channel_layer().group_send(f"node.{node.node_id}", {"type": "control.push", "message": message})
        received = await channel.receive_json_from(timeout=TIMEOUT_S)
        # The bystander may hear unrelated control traffic (a placement); never this message.
        heard = []
        while not await bystander.receive_nothing(timeout=0.5):
            heard.append(await bystander.receive_json_from(timeout=TIMEOUT_S))
        nothing = message not in heard
        await channel.disconnect()
        await bystander.disconnect()
        return received, nothing

    received, nothing = asyncio.run(scenario())

    assert received == message
    assert nothing is True


@pytest.mark.parametrize("frame", [{"text_data": "not json"}, {"bytes_data": b"\x00\x01"}])
@pytest.mark.usefixtures("pending_agent")
def test_a_frame_that_is_not_json_text_closes_with_a_protocol_error(frame):
    before = db_snapshot()

    async def scenario():
        channel, _ = await open_channel()
        await channel.send_to(**frame)
        return await refusal(channel, timeout=2)  # no database involved: the answer is immediate

    error, code = asyncio.run(scenario())

    assert code == CLOSE_PROTOCOL
    assert (error["type"], error["code"]) == ("error", "protocol")
    assert db_snapshot() == before


def test_a_stale_channel_closing_leaves_a_reconnected_node_connected(pending_agent):
    node, key = pending_agent

    async def scenario():
        stale, _ = await authenticated(key, node.node_id)
        current, _ = await authenticated(key, node.node_id)
        await stale.disconnect()
        seen = await database_sync_to_async(fresh)(node)
        await current.disconnect()
        return seen

    seen = asyncio.run(scenario())

    assert (seen.state, seen.connected) == (NodeState.ACTIVE, True)


def test_a_release_names_the_jobs_still_open_on_the_block_as_it_is_sent(pending_agent, customer):
    """A job routed to the block before its release may reach the agent after it: the release names
    every such job still open (queued or running, on this node's span now), so the agent takes them
    and no other; ended jobs, other spans and other nodes are not named."""
    node, key = pending_agent
    block = Assignment.objects.create(
        node=node, model=MODEL, generation=1, pipeline=0, position=0, layer_start=0, layer_end=2,
        state=AssignmentState.READY,
    )  # fmt: skip

    def job(public_id: str, state: str, *, on: str = node.node_id, span: tuple[int, int] = (0, 2)) -> None:
        route = [{"node": on, "node_key": "00" * 32, "url": "ws://10.0.0.7:9100", "layer_start": span[0],
                  "layer_end": span[1]}]  # fmt: skip
        Job.objects.create(public_id=public_id, kind="chat", customer=customer, model=MODEL, state=state, route=route)

    job("chatcmpl-queued", JobState.QUEUED)
    job("chatcmpl-running", JobState.RUNNING)
    job("chatcmpl-ended", JobState.SUCCEEDED)
    job("chatcmpl-other-span", JobState.RUNNING, span=(2, 4))
    job("chatcmpl-other-node", JobState.RUNNING, on="node-elsewhere")

    def release() -> None:
        with transaction.atomic():
            push_release(block)

    async def scenario():
        channel, _ = await authenticated(key, node.node_id)
        await database_sync_to_async(release)()
        received = await channel.receive_json_from(timeout=TIMEOUT_S)
        await channel.disconnect()
        return received

    assert asyncio.run(scenario()) == {
        "type": "release",
        "assignment": block.pk,
        "model": MODEL,
        "jobs": ["chatcmpl-running", "chatcmpl-queued"],  # the newest first
    }


def test_an_assignment_that_supersedes_a_held_block_names_the_jobs_still_open_on_it(pending_agent, customer):
    """Under its layer cap the agent drains the superseded block to make room: the assignment names
    the jobs routed to that block before, as a release would."""
    node, key = pending_agent
    old = Assignment.objects.create(
        node=node, model=MODEL, generation=1, pipeline=0, position=0, layer_start=0, layer_end=2,
        state=AssignmentState.RELEASED, released_at=timezone.now(),
    )  # fmt: skip
    new = Assignment.objects.create(
        node=node, model=MODEL, generation=2, pipeline=0, position=1, layer_start=2, layer_end=4,
        state=AssignmentState.ASSIGNED, supersedes=old,
    )  # fmt: skip
    route = [
        {"node": node.node_id, "node_key": "00" * 32, "url": "ws://10.0.0.7:9100", "layer_start": 0, "layer_end": 2}
    ]
    Job.objects.create(public_id="chatcmpl-on-old", kind="chat", customer=customer, model=MODEL,
                       state=JobState.RUNNING, route=route)  # fmt: skip
    assign = {"type": "assign", "assignment": new.pk, "model": MODEL, "layer_start": 2, "layer_end": 4}

    async def scenario():
        channel, _ = await authenticated(key, node.node_id)
        await database_sync_to_async(push_on_commit)(node.node_id, assign)
        received = await channel.receive_json_from(timeout=TIMEOUT_S)
        await channel.disconnect()
        return received

    assert asyncio.run(scenario()) == {**assign, "supersedes": old.pk, "jobs": ["chatcmpl-on-old"]}
