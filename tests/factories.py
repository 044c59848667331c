"""Personas and factories for the control plane's tests.

Personas: ``provider`` (alice) and ``second_provider`` (bob) own nodes, ``customer`` (carol) buys
inference, ``admin`` (dave) is staff, ``stranger`` (erin) holds no role. Nodes are added and
joined through the services, as a provider and an agent would do it; only the state a test starts
from (active, offline, last heard from at ...) is then written directly.

Test modules load this file with ``pytest_plugins = ["tests.factories"]`` and import its helpers,
which happens before pytest loads it as a plugin; it holds no assert, hence PYTEST_DONT_REWRITE
(which keeps pytest from warning that it cannot rewrite an already imported module).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from nacl.signing import SigningKey
from rest_framework.test import APIClient

from marketplace.nodes import joining
from marketplace.nodes.models import LinkMeasurement, Node, NodeState
from marketplace.placement.models import Assignment, PlacementState
from worker_agent.protocol.control_protocol import join_signature
from worker_agent.protocol.keys import generate_signing_key, public_key_bytes

PASSWORD = "correct-horse-battery-staple-42"
MODEL = "smollm2-135m"
GIB = 1 << 30


class JoinedNode(NamedTuple):
    node: Node
    key: SigningKey


def public_hex(key: SigningKey) -> str:
    return public_key_bytes(key).hex()


def join_payload(token: str, key: SigningKey, **overrides: Any) -> dict:
    """The body an agent posts to /api/v1/agents/register, signed by ``key`` over ``token``."""
    body = {
        "token": token,
        "public_key": public_hex(key),
        "signature": join_signature(key, token),
        "hardware": {
            "device": "cpu",
            "device_name": "2 CPU threads",
            "memory_bytes": 8 * GIB,
            "dtypes": ["float32", "bfloat16"],
            "max_layers": 15,
            "max_positions": 4096,
        },
        "benchmark": {"layer_tokens_per_s": 250.0},
        "data_url": "ws://10.0.0.7:9100",
        "agent_version": "0.1.0",
    }
    return body | overrides


def db_snapshot() -> dict[str, list[dict]]:
    """Every row the control plane keeps, to show that a refused request changed nothing."""
    return {
        "users": list(get_user_model().objects.order_by("pk").values()),
        "nodes": list(Node.objects.order_by("pk").values()),
        "assignments": list(Assignment.objects.order_by("pk").values()),
        "links": list(LinkMeasurement.objects.order_by("pk").values()),
        "placements": list(PlacementState.objects.order_by("pk").values()),
    }


def drf_datetime(value: datetime | None) -> str | None:
    """A datetime as the API renders it (ISO 8601, UTC as Z)."""
    return None if value is None else value.isoformat().replace("+00:00", "Z")


@pytest.fixture
def fast_password_hashing(settings):
    """Hash passwords with a cheap hasher: the production one costs most of a second per user."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def make_user(db, fast_password_hashing):
    def make(username: str, *, provider: bool = False, customer: bool = False, staff: bool = False):
        return get_user_model().objects.create_user(
            username=username,
            email=f"{username}@example.test",
            password=PASSWORD,
            is_provider=provider,
            is_customer=customer,
            is_staff=staff,
        )

    return make


@pytest.fixture
def provider(make_user):
    return make_user("alice", provider=True)


@pytest.fixture
def second_provider(make_user):
    return make_user("bob", provider=True)


@pytest.fixture
def customer(make_user):
    return make_user("carol", customer=True)


@pytest.fixture
def admin(make_user):
    return make_user("dave", staff=True)


@pytest.fixture
def stranger(make_user):
    return make_user("erin")


@pytest.fixture
def client_for():
    """An API client signed in (session) as the given user; None gives an anonymous client."""

    def make(user=None) -> APIClient:
        client = APIClient()
        if user is not None:
            client.force_login(user)
        return client

    return make


@pytest.fixture
def make_node():
    """A node added by its owner (pending, not joined); returns the node and its join token."""

    def make(owner, name: str = "gpu-1", region: str = "local") -> tuple[Node, str]:
        return joining.create_node(owner=owner, name=name, region=region)

    return make


@pytest.fixture
def make_joined_node(make_node):
    """A node whose agent joined with its own key, then set to the given state and measurements."""

    def make(
        owner,
        name: str = "gpu-1",
        *,
        key: SigningKey | None = None,
        compute: float = 250.0,
        max_layers: int | None = 15,
        memory_bytes: int = 8 * GIB,
        state: str = NodeState.ACTIVE,
        connected: bool = True,
        last_heartbeat_at: datetime | None = None,
        region: str = "local",
    ) -> JoinedNode:
        key = key or generate_signing_key()
        node, token = make_node(owner, name, region)
        hardware = {"device": "cpu", "device_name": "test", "memory_bytes": memory_bytes, "dtypes": ["float32"]}
        if max_layers is not None:
            hardware["max_layers"] = max_layers
        joining.register_agent(
            token=token,
            public_key=public_hex(key),
            signature=join_signature(key, token),
            hardware=hardware,
            benchmark={"layer_tokens_per_s": compute},
            data_url=f"ws://127.0.0.1:{9100 + node.pk}",
        )
        Node.objects.filter(pk=node.pk).update(
            state=state,
            connected=connected,
            last_heartbeat_at=last_heartbeat_at if last_heartbeat_at is not None else timezone.now(),
        )
        node.refresh_from_db()
        return JoinedNode(node, key)

    return make
