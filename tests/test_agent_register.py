"""An agent joins: POST /api/v1/agents/register with its one-time token and proof of its key."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.nodes.joining import create_node
from marketplace.nodes.models import Node, NodeState
from marketplace.nodes.tickets import issuer_public_key
from tests.factories import GIB, db_snapshot, join_payload, public_hex
from worker_agent.protocol.control_protocol import join_signature
from worker_agent.protocol.keys import generate_signing_key, public_key_bytes

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures"]

REGISTER = "/api/v1/agents/register"


def refusal(code: str, message: str) -> dict:
    """The API's one error shape (``marketplace.api.errors``): these refusals are all 4xx invalid_request_error."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


INVALID_TOKEN = refusal("invalid_join_token", "the join token is not valid (unknown, used or expired)")


def invalid_report(message: str) -> dict:
    return refusal("invalid_report", message)


@pytest.fixture
def pending(provider, make_node):
    """A node its owner added, waiting for its agent: (node, join token)."""
    return make_node(provider, "gpu-1")


@pytest.fixture
def agent(client_for):
    """The agent's HTTP client: the join endpoint takes no user credentials."""
    return client_for(None)


def test_agent_joins_with_its_token_and_key(pending, agent, swarm_settings):
    node, token = pending
    key = generate_signing_key()
    before = timezone.now()

    response = agent.post(REGISTER, join_payload(token, key), format="json")

    after = timezone.now()
    assert response.status_code == 201
    expected_id = "node-" + hashlib.sha256(public_key_bytes(key)).hexdigest()[:16]
    assert response.json() == {
        "node": expected_id,
        "control_url": "ws://testserver/ws/agent/",
        "heartbeat_interval_s": 5.0,
        "ticket_key": issuer_public_key().hex(),  # pinned by the agent
    }
    node.refresh_from_db()
    assert node.node_id == expected_id
    assert node.public_key == public_hex(key)
    assert (node.device, node.device_name, node.memory_bytes) == ("cpu", "2 CPU threads", 8 * GIB)
    assert node.dtypes == ["float32", "bfloat16"]
    assert node.max_layers == 15
    assert node.max_positions == 4096
    assert node.compute_layer_tokens_per_s == 250.0
    assert node.data_url == "ws://10.0.0.7:9100"
    assert node.agent_version == "0.1.0"
    assert before <= node.joined_at <= after
    assert node.state == NodeState.PENDING
    assert node.connected is False
    assert (node.join_token_hash, node.join_token_expires_at) == (None, None)


@pytest.mark.parametrize(
    ("owner_cap", "agent_cap", "held"),
    [(10, None, 10), (10, 15, 10), (20, 15, 15), (None, None, None)],
    ids=["owner_only", "owner_lower", "agent_lower", "neither"],
)
def test_the_owners_layer_cap_holds_whatever_the_agent_reports(provider, agent, owner_cap, agent_cap, held):
    node, token = create_node(owner=provider, name="capped", max_layers=owner_cap)
    key = generate_signing_key()
    hardware = {"device": "cpu", "memory_bytes": 8 * GIB, "dtypes": ["float32"]}
    if agent_cap is not None:
        hardware["max_layers"] = agent_cap

    response = agent.post(REGISTER, join_payload(token, key, hardware=hardware), format="json")

    assert response.status_code == 201
    node.refresh_from_db()
    assert (node.layer_cap, node.max_layers) == (owner_cap, held)


def test_a_secure_request_gets_a_wss_control_url(pending, agent):
    _, token = pending

    response = agent.post(REGISTER, join_payload(token, generate_signing_key()), format="json", secure=True)

    assert response.status_code == 201
    assert response.json()["control_url"] == "wss://testserver/ws/agent/"


def test_an_uppercase_public_key_is_stored_in_lowercase(pending, agent):
    node, token = pending
    key = generate_signing_key()

    response = agent.post(REGISTER, join_payload(token, key, public_key=public_hex(key).upper()), format="json")

    assert response.status_code == 201
    node.refresh_from_db()
    assert node.public_key == public_hex(key)


def test_a_used_token_cannot_join_again(pending, agent):
    _, token = pending
    agent.post(REGISTER, join_payload(token, generate_signing_key()), format="json")
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, generate_signing_key()), format="json")

    assert response.status_code == 403
    assert response.json() == INVALID_TOKEN
    assert db_snapshot() == before


def test_an_expired_token_cannot_join(pending, agent):
    node, token = pending
    Node.objects.filter(pk=node.pk).update(join_token_expires_at=timezone.now() - timedelta(seconds=1))
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, generate_signing_key()), format="json")

    assert response.status_code == 403
    assert response.json() == INVALID_TOKEN
    assert db_snapshot() == before


def test_an_unknown_token_cannot_join(pending, agent):
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload("swj_" + "x" * 43, generate_signing_key()), format="json")

    assert response.status_code == 403
    assert response.json() == INVALID_TOKEN
    assert db_snapshot() == before


def test_a_token_without_the_prefix_cannot_join(pending, agent):
    _, token = pending
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token.removeprefix("swj_"), generate_signing_key()), format="json")

    assert response.status_code == 403
    assert response.json() == refusal("invalid_join_token", "the join token is not valid")
    assert db_snapshot() == before


def test_an_ejected_node_cannot_join_even_with_a_fresh_token(pending, agent):
    node, token = pending
    Node.objects.filter(pk=node.pk).update(state=NodeState.EJECTED)
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, generate_signing_key()), format="json")

    assert response.status_code == 403
    assert response.json() == refusal("node_not_allowed", "this node was ejected")
    assert db_snapshot() == before


def test_a_signature_by_another_key_is_refused(pending, agent):
    _, token = pending
    key, impostor = generate_signing_key(), generate_signing_key()
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, key, signature=join_signature(impostor, token)), format="json")

    assert response.status_code == 400
    assert response.json() == invalid_report("the signature does not verify with the node's key")
    assert db_snapshot() == before


def test_a_signature_over_another_token_is_refused(pending, provider, make_node, agent):
    _, token = pending
    _, other_token = make_node(provider, "gpu-2")
    key = generate_signing_key()
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, key, signature=join_signature(key, other_token)), format="json")

    assert response.status_code == 400
    assert response.json() == invalid_report("the signature does not verify with the node's key")
    assert db_snapshot() == before


def test_a_key_already_registered_cannot_join_a_second_node(pending, provider, make_node, agent):
    _, token = pending
    _, second_token = make_node(provider, "gpu-2")
    key = generate_signing_key()
    agent.post(REGISTER, join_payload(token, key), format="json")
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(second_token, key), format="json")

    assert response.status_code == 400
    assert response.json() == refusal("key_already_registered", "this key is already registered to another node")
    assert db_snapshot() == before
    second = Node.objects.get(name="gpu-2")
    assert second.join_token_hash == hashlib.sha256(second_token.encode()).hexdigest()


@pytest.mark.parametrize("data_url", ["http://10.0.0.7:9100", "10.0.0.7:9100", "javascript:alert(1)"])
def test_a_data_url_that_is_not_a_websocket_url_is_refused(data_url, pending, agent):
    _, token = pending
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, generate_signing_key(), data_url=data_url), format="json")

    assert response.status_code == 400
    assert response.json() == invalid_report("data_url must be a ws:// or wss:// URL")
    assert db_snapshot() == before


def test_a_data_url_longer_than_the_column_is_refused(pending, agent):
    _, token = pending
    before = db_snapshot()

    response = agent.post(
        REGISTER, join_payload(token, generate_signing_key(), data_url="ws://" + "h" * 251), format="json"
    )

    assert response.status_code == 400
    assert response.json() == {"data_url": ["Ensure this field has no more than 255 characters."]}
    assert db_snapshot() == before


@pytest.mark.parametrize(
    ("benchmark", "message"),
    [
        ({"layer_tokens_per_s": -5.0}, "layer_tokens_per_s must be a number >= 1e-09, got -5.0"),
        ({"layer_tokens_per_s": 0}, "layer_tokens_per_s must be a number >= 1e-09, got 0"),
        ({"layer_tokens_per_s": "NaN"}, "layer_tokens_per_s must be a number >= 1e-09, got 'NaN'"),
        ({"layer_tokens_per_s": "250"}, "layer_tokens_per_s must be a number >= 1e-09, got '250'"),
        ({"layer_tokens_per_s": True}, "layer_tokens_per_s must be a number >= 1e-09, got True"),
        ({}, "layer_tokens_per_s must be a number >= 1e-09, got None"),
    ],
)
def test_bad_benchmark_values_are_refused(benchmark, message, pending, agent):
    _, token = pending
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, generate_signing_key(), benchmark=benchmark), format="json")

    assert response.status_code == 400
    assert response.json() == invalid_report(message)
    assert db_snapshot() == before


def test_an_infinite_benchmark_is_refused(pending, agent):
    _, token = pending
    body = json.dumps(join_payload(token, generate_signing_key())).replace("250.0", "1e400")  # parses as inf
    before = db_snapshot()

    response = agent.generic("POST", REGISTER, body, content_type="application/json")

    assert response.status_code == 400
    assert response.json() == invalid_report("layer_tokens_per_s must be a number >= 1e-09, got inf")
    assert db_snapshot() == before


def test_a_nan_literal_is_refused_by_the_json_parser(pending, agent):
    _, token = pending
    body = json.dumps(join_payload(token, generate_signing_key())).replace("250.0", "NaN")
    before = db_snapshot()

    response = agent.generic("POST", REGISTER, body, content_type="application/json")

    assert response.status_code == 400
    assert response.json() == {"detail": "JSON parse error - Out of range float values are not JSON compliant: 'NaN'"}
    assert db_snapshot() == before


@pytest.mark.parametrize(
    ("hardware", "message"),
    [
        ({"memory_bytes": 0}, "memory_bytes must be a number >= 1, got 0"),
        ({"memory_bytes": -(1 << 30)}, f"memory_bytes must be a number >= 1, got {-(1 << 30)}"),
        ({"memory_bytes": "8GB"}, "memory_bytes must be a number >= 1, got '8GB'"),
        ({}, "memory_bytes must be a number >= 1, got None"),
        ({"memory_bytes": 1 << 30, "max_layers": 0}, "max_layers must be a number >= 1, got 0"),
        ({"memory_bytes": 1 << 30, "max_layers": "all"}, "max_layers must be a number >= 1, got 'all'"),
        ({"memory_bytes": 1 << 30, "max_positions": 0}, "max_positions must be a number >= 1, got 0"),
        ({"memory_bytes": 1 << 30, "max_positions": 4096.5}, "max_positions must be an integer, got 4096.5"),
        ({"memory_bytes": 1 << 30, "max_positions": 1 << 21}, "max_positions must be at most 1.04858e+06, got 2097152"),
    ],
)
def test_bad_hardware_values_are_refused(hardware, message, pending, agent):
    _, token = pending
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, generate_signing_key(), hardware=hardware), format="json")

    assert response.status_code == 400
    assert response.json() == invalid_report(message)
    assert db_snapshot() == before


@pytest.mark.parametrize("dtypes", [5, None, "float32"])
def test_dtypes_that_are_not_a_list_are_refused(dtypes, pending, agent):
    _, token = pending
    hardware = {"memory_bytes": 1 << 30, "dtypes": dtypes}
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, generate_signing_key(), hardware=hardware), format="json")

    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_report"
    assert db_snapshot() == before


@pytest.mark.parametrize(
    "hardware",
    [{"memory_bytes": 1e300}, {"memory_bytes": 1 << 70}, {"memory_bytes": 1 << 30, "max_layers": 1 << 40}],
)
def test_hardware_numbers_too_large_to_store_are_refused(hardware, pending, agent):
    _, token = pending
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, generate_signing_key(), hardware=hardware), format="json")

    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_report"
    assert db_snapshot() == before


@pytest.mark.parametrize(
    ("field", "value", "errors"),
    [
        ("public_key", "ab" * 31, {"public_key": ["This value does not match the required pattern."]}),
        ("signature", "zz" * 64, {"signature": ["This value does not match the required pattern."]}),
        ("hardware", ["cpu"], {"hardware": ['Expected a dictionary of items but got type "list".']}),
        ("benchmark", 250.0, {"benchmark": ['Expected a dictionary of items but got type "float".']}),
        ("token", "", {"token": ["This field may not be blank."]}),
    ],
)
def test_malformed_fields_are_refused_before_the_token_is_looked_at(field, value, errors, pending, agent):
    _, token = pending
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, generate_signing_key()) | {field: value}, format="json")

    assert response.status_code == 400
    assert response.json() == errors
    assert db_snapshot() == before


def test_a_public_key_the_signature_was_not_made_with_is_refused(pending, agent):
    _, token = pending
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, generate_signing_key(), public_key="ff" * 32), format="json")

    assert response.status_code == 400
    assert response.json() == invalid_report("the signature does not verify with the node's key")
    assert db_snapshot() == before
