"""The control plane opens the data URL an agent reports before its block enters placement
(marketplace/nodes/reachability.py): reached, the block is ready; not reached, the agent is told
why and offered the relays, or the block fails with the reason when there are none. Agents here
speak the control channel from the test; their data planes are real servers on loopback."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from websockets.asyncio.server import serve

from marketplace.nodes.models import Node, Reachability
from marketplace.nodes.tickets import issuer_public_key
from marketplace.placement.models import AssignmentState
from marketplace.placement.placing import place_model
from marketplace.placement.selectors import servable_pipelines
from tests.factories import MODEL
from tests.test_control_channel import TIMEOUT_S, authenticated
from worker_agent.protocol.keys import public_key_bytes
from worker_agent.protocol.relay_pass import verify_relay_pass

pytestmark = [
    pytest.mark.control,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fresh_channel_layer"),
]
pytest_plugins = ["tests.factories", "tests.control_fixtures"]

LOOPBACK = "127.0.0.1"


@pytest.fixture
def checked(swarm_settings):
    swarm_settings.SWARM_REACHABILITY_CHECK = True
    swarm_settings.SWARM_REACHABILITY_TIMEOUT_S = 3.0
    return swarm_settings


def closed_port() -> int:
    """A port nothing listens on (bound, then let go)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


async def report(joined, assignment, url: str, *, data_plane: bool) -> dict:
    """Report the block ready at ``url`` (served by a real WebSocket server when ``data_plane``)
    and return the control plane's next message."""

    async def accept(connection) -> None:
        await connection.wait_closed()

    async def exchange() -> dict:
        channel, _ = await authenticated(joined.key, joined.node.node_id, client=LOOPBACK)
        await channel.send_json_to({"type": "ready", "assignment": assignment.pk, "url": url})
        answer = await channel.receive_json_from(timeout=TIMEOUT_S)
        await channel.disconnect()
        return answer

    if not data_plane:
        return await exchange()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    async with serve(accept, LOOPBACK, port):
        return await exchange()


def test_a_block_whose_data_url_answers_is_ready_and_the_node_reached_directly(provider, make_joined_node, checked):
    joined = make_joined_node(provider, max_layers=None)
    (assignment,) = place_model(MODEL)
    url = f"ws://{LOOPBACK}:{closed_port()}"

    answer = asyncio.run(report(joined, assignment, url, data_plane=True))

    assert answer["type"] == "probe"  # ready: its links are measured
    assignment.refresh_from_db()
    node = Node.objects.get(pk=joined.node.pk)
    assert (assignment.state, assignment.data_url) == (AssignmentState.READY, url)
    assert (node.reachability, node.reachability_detail, node.relay, node.data_url) == (
        Reachability.DIRECT,
        f"reached at {url}",
        "",
        url,
    )


def test_a_block_nobody_can_reach_never_enters_a_pipeline_and_its_node_says_why(provider, make_joined_node, checked):
    joined = make_joined_node(provider, max_layers=None)
    (assignment,) = place_model(MODEL)
    url = f"ws://{LOOPBACK}:{closed_port()}"
    why = f"{url} refused the connection (nothing listens there, or a NAT router answers for it)"

    answer = asyncio.run(report(joined, assignment, url, data_plane=False))

    reason = f"{why}; no relay is configured (SWARM_RELAYS) to serve it through"
    assert answer == {"type": "error", "code": "unreachable", "message": reason}
    assignment.refresh_from_db()
    node = Node.objects.get(pk=joined.node.pk)
    assert (assignment.state, assignment.error) == (AssignmentState.FAILED, f"unreachable: {reason}")
    assert (node.reachability, node.reachability_detail) == (Reachability.UNREACHABLE, why)
    assert servable_pipelines(MODEL) == []


def test_an_unreachable_node_is_offered_the_relays_with_a_pass_for_its_own_key(provider, make_joined_node, checked):
    checked.SWARM_RELAYS = ["near=relay-a.example:7700", "far=203.0.113.9:443"]
    joined = make_joined_node(provider, max_layers=None)
    (assignment,) = place_model(MODEL)
    url = f"ws://{LOOPBACK}:{closed_port()}"

    answer = asyncio.run(report(joined, assignment, url, data_plane=False))

    assert answer["type"] == "use_relay"
    assert answer["relays"] == [
        {"id": "near", "address": "relay-a.example:7700"},
        {"id": "far", "address": "203.0.113.9:443"},
    ]
    assert answer["reason"].startswith(f"{url} refused the connection")
    granted = verify_relay_pass(
        bytes.fromhex(answer["relay_pass"]), [issuer_public_key()], relay_id="near", now=time.time()
    )
    assert (granted.node, granted.node_key) == (joined.node.node_id, public_key_bytes(joined.key))
    assignment.refresh_from_db()
    assert assignment.state == AssignmentState.ASSIGNED  # waits for the agent to report it again through a relay
    assert Node.objects.get(pk=joined.node.pk).reachability == Reachability.UNREACHABLE


def test_a_block_reported_at_its_relay_url_is_reached_through_the_relay(provider, make_joined_node, checked):
    port = closed_port()
    checked.SWARM_RELAYS = [f"r1={LOOPBACK}:{port}"]
    joined = make_joined_node(provider, max_layers=None)
    (assignment,) = place_model(MODEL)
    url = f"ws://{LOOPBACK}:{port}/relay/{joined.node.node_id}"

    answer = asyncio.run(report(joined, assignment, url, data_plane=True))

    assert answer["type"] == "probe"
    assignment.refresh_from_db()
    node = Node.objects.get(pk=joined.node.pk)
    assert (assignment.state, assignment.data_url) == (AssignmentState.READY, url)
    assert (node.reachability, node.relay) == (Reachability.RELAYED, "r1")


def test_a_relay_url_naming_another_node_is_refused_without_a_connection(provider, make_joined_node, checked):
    checked.SWARM_RELAYS = [f"r1={LOOPBACK}:7700"]
    joined = make_joined_node(provider, max_layers=None)
    (assignment,) = place_model(MODEL)
    url = f"ws://{LOOPBACK}:7700/relay/node-0000000000000000"

    answer = asyncio.run(report(joined, assignment, url, data_plane=False))

    assert answer["type"] == "error"
    assert answer["code"] == "invalid_data_url"
    assignment.refresh_from_db()
    assert assignment.state == AssignmentState.FAILED
    assert Node.objects.get(pk=joined.node.pk).reachability == Reachability.UNCHECKED
