"""The provider API for nodes: /api/v1/nodes/ (list, create, retrieve, destroy, drain, rotate-token)."""

from __future__ import annotations

import base64
import hashlib
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.nodes.models import Node, NodeState
from marketplace.placement.models import Assignment, AssignmentState, PlacementState
from marketplace.placement.placing import place_model
from tests.factories import MODEL, PASSWORD, db_snapshot, drf_datetime, join_payload
from worker_agent.protocol.keys import generate_signing_key

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures"]

NODES = "/api/v1/nodes/"
REGISTER = "/api/v1/agents/register"
NOT_FOUND = {"detail": "No Node matches the given query."}


def node_url(node: Node, action: str = "") -> str:
    return f"{NODES}{node.pk}/" + (f"{action}/" if action else "")


def pending_body(node: Node) -> dict:
    """The API's view of a node that its agent has not joined yet."""
    return {
        "id": node.pk,
        "name": node.name,
        "region": node.region,
        "state": "pending",
        "node_id": None,
        "public_key": None,
        "device": "",
        "device_name": "",
        "memory_bytes": 0,
        "dtypes": [],
        "max_layers": None,
        "compute_layer_tokens_per_s": 0.0,
        "uplink_mbps": None,
        "data_url": "",
        "reputation": 1.0,
        "connected": False,
        "last_heartbeat_at": None,
        "load": {},
        "joined_at": None,
        "created_at": drf_datetime(node.created_at),
        "layer_span": [],
    }


def test_provider_creates_a_node_and_sees_its_join_token_once(provider, client_for, swarm_settings):
    swarm_settings.SWARM_PUBLIC_URL = ""
    swarm_settings.SWARM_REQUIRE_DATA_TLS = False
    client = client_for(provider)
    before = timezone.now()

    response = client.post(NODES, {"name": "gpu-1", "region": "eu-west"}, format="json")

    after = timezone.now()
    assert response.status_code == 201
    node = Node.objects.get()
    body = response.json()
    token = body["join_token"]
    assert token.startswith("swj_")
    assert len(token) == 47
    assert body == pending_body(node) | {
        "join_token": token,
        "join_command": f"curl -fsSL http://testserver/install/agent.sh | SWARM_JOIN_TOKEN={token} sh",
    }
    assert (node.owner, node.name, node.region) == (provider, "gpu-1", "eu-west")
    assert node.join_token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert before + timedelta(seconds=3600) <= node.join_token_expires_at <= after + timedelta(seconds=3600)
    detail = client.get(node_url(node)).json()
    assert detail == pending_body(node)


def test_the_join_command_is_the_dashboards_install_command_at_the_public_url(provider, client_for, swarm_settings):
    swarm_settings.SWARM_PUBLIC_URL = "https://swarm.example.test"
    swarm_settings.SWARM_REQUIRE_DATA_TLS = True
    client = client_for(provider)

    created = client.post(NODES, {"name": "gpu-1"}, format="json").json()
    rotated = client.post(node_url(Node.objects.get(), "rotate-token")).json()

    # Verbatim on a machine with nothing but Python: the script installs the agent, then joins.
    script = "curl -fsSL https://swarm.example.test/install/agent.sh"
    assert [created["join_command"], rotated["join_command"]] == [
        f"{script} | SWARM_JOIN_TOKEN={created['join_token']} sh -s -- --tls auto",
        f"{script} | SWARM_JOIN_TOKEN={rotated['join_token']} sh -s -- --tls auto",
    ]


def test_region_defaults_to_local(provider, client_for):
    response = client_for(provider).post(NODES, {"name": "gpu-1"}, format="json")

    assert response.status_code == 201
    assert response.json()["region"] == "local"
    assert Node.objects.get().region == "local"


def test_list_shows_only_the_providers_own_nodes(provider, second_provider, make_node, client_for):
    first, _ = make_node(provider, "gpu-1")
    second, _ = make_node(provider, "gpu-2")
    make_node(second_provider, "gpu-1")

    response = client_for(provider).get(NODES)

    assert response.status_code == 200
    assert response.json() == {
        "count": 2,
        "next": None,
        "previous": None,
        "results": [pending_body(first), pending_body(second)],
    }


def test_list_shows_a_joined_nodes_hardware_and_live_layer_span(
    provider, make_joined_node, measure_ring, client_for, swarm_settings
):
    joined = make_joined_node(provider, "gpu-1", compute=250.0, max_layers=15)
    other = make_joined_node(provider, "gpu-2", compute=125.0, max_layers=15)
    measure_ring([joined.node, other.node])
    place_model(MODEL)

    response = client_for(provider).get(NODES)

    assert response.status_code == 200
    node = Node.objects.get(pk=joined.node.pk)
    assert response.json()["results"][0] == {
        "id": node.pk,
        "name": "gpu-1",
        "region": "local",
        "state": "active",
        "node_id": node.node_id,
        "public_key": node.public_key,
        "device": "cpu",
        "device_name": "test",
        "memory_bytes": 8 << 30,
        "dtypes": ["float32"],
        "max_layers": 15,
        "compute_layer_tokens_per_s": 250.0,
        "uplink_mbps": 1000.0,
        "data_url": f"ws://127.0.0.1:{9100 + node.pk}",
        "reputation": 1.0,
        "connected": True,
        "last_heartbeat_at": drf_datetime(node.last_heartbeat_at),
        "load": {},
        "joined_at": drf_datetime(node.joined_at),
        "created_at": drf_datetime(node.created_at),
        "layer_span": [{"model": MODEL, "layer_start": 0, "layer_end": 15, "state": "assigned", "spare": False}],
    }


@pytest.mark.parametrize(
    ("method", "action"),
    [("get", ""), ("post", "drain"), ("post", "rotate-token"), ("delete", "")],
)
def test_another_providers_node_answers_404_and_stays_unchanged(
    method, action, provider, second_provider, make_joined_node, client_for, swarm_settings
):
    node = make_joined_node(provider, "gpu-1").node
    make_joined_node(provider, "gpu-2", compute=125.0)
    place_model(MODEL)
    client = client_for(second_provider)
    before = db_snapshot()

    response = getattr(client, method)(node_url(node, action))

    assert response.status_code == 404
    assert response.json() == NOT_FOUND
    assert db_snapshot() == before


def test_a_customer_cannot_list_nodes(customer, provider, make_node, client_for):
    make_node(provider)

    response = client_for(customer).get(NODES)

    assert response.status_code == 403
    assert response.json() == {"detail": "this endpoint is for providers"}


def test_a_customer_cannot_create_a_node(customer, client_for):
    client = client_for(customer)
    before = db_snapshot()

    response = client.post(NODES, {"name": "gpu-1"}, format="json")

    assert response.status_code == 403
    assert response.json() == {"detail": "this endpoint is for providers"}
    assert db_snapshot() == before
    assert Node.objects.count() == 0


@pytest.mark.parametrize("persona", ["admin", "stranger"])
def test_users_without_the_provider_role_cannot_create_nodes(persona, request, client_for):
    client = client_for(request.getfixturevalue(persona))
    before = db_snapshot()

    response = client.post(NODES, {"name": "gpu-1"}, format="json")

    assert response.status_code == 403
    assert response.json() == {"detail": "this endpoint is for providers"}
    assert db_snapshot() == before


def test_anonymous_requests_are_refused(provider, make_node, client_for):
    node, _ = make_node(provider)
    client = client_for(None)
    before = db_snapshot()

    responses = [
        client.get(NODES),
        client.post(NODES, {"name": "gpu-2"}, format="json"),
        client.get(node_url(node)),
        client.post(node_url(node, "drain")),
        client.post(node_url(node, "rotate-token")),
        client.delete(node_url(node)),
    ]

    assert [r.status_code for r in responses] == [403] * 6
    assert {r.json()["detail"] for r in responses} == {"Authentication credentials were not provided."}
    assert db_snapshot() == before


def test_wrong_basic_auth_password_is_refused(provider, make_node, client_for):
    make_node(provider)
    client = client_for(None)
    client.credentials(HTTP_AUTHORIZATION="Basic " + base64.b64encode(b"alice:wrong-password").decode())
    before = db_snapshot()

    response = client.get(NODES)

    # Session authentication comes first, and it names no WWW-Authenticate scheme: DRF says 403.
    assert response.status_code == 403
    assert response.json() == {"detail": "Invalid username/password."}
    assert db_snapshot() == before


def test_basic_auth_with_the_right_password_lists_nodes(provider, make_node, client_for):
    node, _ = make_node(provider)
    client = client_for(None)
    client.credentials(HTTP_AUTHORIZATION="Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode())

    response = client.get(NODES)

    assert response.status_code == 200
    assert [n["id"] for n in response.json()["results"]] == [node.pk]


def test_duplicate_name_is_refused_with_a_field_error(provider, make_node, client_for):
    make_node(provider, "gpu-1")
    client = client_for(provider)
    before = db_snapshot()

    response = client.post(NODES, {"name": "gpu-1"}, format="json")

    assert response.status_code == 400
    assert response.json() == {"name": ["You already have a node with this name."]}
    assert db_snapshot() == before


def test_two_providers_may_use_the_same_node_name(provider, second_provider, make_node, client_for):
    make_node(provider, "gpu-1")

    response = client_for(second_provider).post(NODES, {"name": "gpu-1"}, format="json")

    assert response.status_code == 201
    assert sorted(Node.objects.values_list("owner__username", "name")) == [("alice", "gpu-1"), ("bob", "gpu-1")]


@pytest.mark.parametrize(
    ("payload", "errors"),
    [
        ({}, {"name": ["This field is required."]}),
        ({"name": ""}, {"name": ["This field may not be blank."]}),
        ({"name": "-gpu"}, {"name": ["This value does not match the required pattern."]}),
        ({"name": "gpu/1"}, {"name": ["This value does not match the required pattern."]}),
        (
            {"name": "g" * 101},
            {
                "name": [
                    "Ensure this field has no more than 100 characters.",
                    "This value does not match the required pattern.",
                ]
            },
        ),
        ({"name": "gpu-1", "region": "EU West"}, {"region": ["This value does not match the required pattern."]}),
        ({"name": "gpu-1", "region": ""}, {"region": ["This field may not be blank."]}),
        ({"name": "gpu-1", "region": "r" * 65}, {"region": ["This value does not match the required pattern."]}),
    ],
)
def test_bad_name_or_region_is_refused_with_a_field_error(payload, errors, provider, client_for):
    client = client_for(provider)
    before = db_snapshot()

    response = client.post(NODES, payload, format="json")

    assert response.status_code == 400
    assert response.json() == errors
    assert db_snapshot() == before


def test_drain_moves_an_active_node_to_draining_and_tells_its_agent(
    provider, make_joined_node, client_for, pushed, swarm_settings, django_capture_on_commit_callbacks
):
    node = make_joined_node(provider).node

    with django_capture_on_commit_callbacks(execute=True):
        response = client_for(provider).post(node_url(node, "drain"))

    assert response.status_code == 200
    assert response.json()["state"] == "draining"
    assert Node.objects.get(pk=node.pk).state == NodeState.DRAINING
    assert pushed.messages == [(f"node.{node.node_id}", {"type": "drain"})]
    assert list(PlacementState.objects.values_list("model", "dirty")) == [(MODEL, True)]


def test_draining_an_offline_node_changes_nothing(
    provider, make_joined_node, client_for, pushed, django_capture_on_commit_callbacks
):
    node = make_joined_node(provider, state=NodeState.OFFLINE, connected=False).node
    client = client_for(provider)
    before = db_snapshot()

    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(node_url(node, "drain"))

    assert response.status_code == 200
    assert response.json()["state"] == "offline"
    assert db_snapshot() == before
    assert pushed.messages == []


def test_delete_hides_the_node_and_releases_its_assignments(
    provider, make_joined_node, measure_ring, client_for, pushed, swarm_settings, django_capture_on_commit_callbacks
):
    doomed = make_joined_node(provider, "gpu-1", compute=250.0).node
    kept = make_joined_node(provider, "gpu-2", compute=125.0).node
    measure_ring([doomed, kept])
    place_model(MODEL)
    kept_assignment = Assignment.objects.get(node=kept)

    with django_capture_on_commit_callbacks(execute=True):
        response = client_for(provider).delete(node_url(doomed))

    assert response.status_code == 204
    assert Node.objects.get(pk=doomed.pk).state == NodeState.DELETED  # kept: jobs it served still settle
    assert [n["id"] for n in client_for(provider).get("/api/v1/nodes/").json()["results"]] == [kept.pk]
    assert list(Assignment.objects.exclude(node=doomed).values_list("pk", "state", "layer_start", "layer_end")) == [
        (kept_assignment.pk, AssignmentState.ASSIGNED, 15, 30)
    ]
    assert not Assignment.objects.filter(node_id=doomed.pk, state__in=["assigned", "ready"]).exists()
    assert pushed.messages == [
        (f"node.{doomed.node_id}", {"type": "stop", "reason": "the node was deleted by its owner"})
    ]
    assert list(PlacementState.objects.values_list("model", "dirty")) == [(MODEL, True)]


def test_rotate_token_invalidates_the_old_token_and_the_new_one_joins(provider, make_node, client_for, settings):
    settings.SWARM_PUBLIC_URL = ""
    settings.SWARM_REQUIRE_DATA_TLS = False
    node, old_token = make_node(provider)
    key = generate_signing_key()
    client = client_for(provider)

    rotated = client.post(node_url(node, "rotate-token"))
    refused = client_for(None).post(REGISTER, join_payload(old_token, key), format="json")
    state_after_refusal = db_snapshot()
    joined = client_for(None).post(REGISTER, join_payload(rotated.json()["join_token"], key), format="json")

    assert rotated.status_code == 200
    new_token = rotated.json()["join_token"]
    assert rotated.json() == {
        "join_token": new_token,
        "join_command": f"curl -fsSL http://testserver/install/agent.sh | SWARM_JOIN_TOKEN={new_token} sh",
    }
    assert new_token.startswith("swj_")
    assert new_token != old_token
    assert refused.status_code == 403
    assert refused.json() == {
        "error": {
            "message": "the join token is not valid (unknown, used or expired)",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_join_token",
        }
    }
    assert state_after_refusal["nodes"][0]["join_token_hash"] == hashlib.sha256(new_token.encode()).hexdigest()
    assert state_after_refusal["nodes"][0]["node_id"] is None
    assert joined.status_code == 201
    node.refresh_from_db()
    assert joined.json()["node"] == node.node_id
    assert node.join_token_hash is None
