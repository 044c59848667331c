"""An agent checks its join token before its benchmark: POST /api/v1/agents/check-token answers
whether the token would join its node now, without using it up, and if not, why (unknown, used,
expired). Failed checks from one address are limited. A join posted again by the same key, its
first answer lost on the way, gets the same answer instead of "used"."""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone

from marketplace.nodes.joining import JOIN_CHECK_WINDOW_S, token_check_failures_key
from marketplace.nodes.models import Node, NodeState
from marketplace.nodes.services import mark_connected
from tests.factories import db_snapshot, drf_datetime, join_payload
from tests.live import wait_for
from worker_agent.protocol.keys import generate_signing_key

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures"]

CHECK = "/api/v1/agents/check-token"
REGISTER = "/api/v1/agents/register"
ADDRESS = "198.51.100.7"  # the agent's address, as the control plane sees it


def refusal(code: str, message: str, **extra) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code, **extra}}


UNKNOWN = refusal(
    "invalid_join_token",
    "the join token is not known here: mistyped, replaced by a newer one, or its node deleted",
    reason="unknown",
)
USED = refusal(
    "invalid_join_token",
    "the join token was used already: a node joined with it. Rotate the node's token for a new one; an agent "
    "that joined with it reconnects without a token",
    reason="used",
)


@pytest.fixture
def pending(provider, make_node, swarm_settings):
    """A node its owner added, waiting for its agent: (node, join token)."""
    return make_node(provider, "gpu-1")


@pytest.fixture
def agent(client_for):
    """The agent's HTTP client, from ADDRESS; no failed checks counted for it yet, and a test's
    checks all fall in one counting window (the next one starts a few seconds away at the soonest)."""
    wait_for(lambda: time.time() % JOIN_CHECK_WINDOW_S < JOIN_CHECK_WINDOW_S - 5, 10, "a fresh counting window")
    window = int(time.time() // JOIN_CHECK_WINDOW_S)
    cache.delete_many([token_check_failures_key(ADDRESS, w) for w in (window - 1, window, window + 1)])
    return client_for(None)


def check(agent, token: str):
    return agent.post(CHECK, {"token": token}, format="json", REMOTE_ADDR=ADDRESS)


def test_a_fresh_token_checks_valid_and_still_joins_afterwards(pending, agent):
    node, token = pending
    before = db_snapshot()

    response = check(agent, token)

    assert response.status_code == 200
    assert response.json() == {
        "valid": True,
        "node_name": "gpu-1",
        "expires_at": drf_datetime(node.join_token_expires_at),
    }
    assert db_snapshot() == before  # not used up
    assert agent.post(REGISTER, join_payload(token, generate_signing_key()), format="json").status_code == 201


def test_a_used_token_is_said_to_be_used(pending, agent):
    _, token = pending
    agent.post(REGISTER, join_payload(token, generate_signing_key()), format="json")
    before = db_snapshot()

    response = check(agent, token)

    assert response.status_code == 403
    assert response.json() == USED
    assert db_snapshot() == before


@pytest.mark.parametrize("token", ["swj_" + "x" * 43, "x" * 47, "swj_"])
def test_an_unknown_token_is_said_to_be_unknown(pending, agent, token):
    before = db_snapshot()

    response = check(agent, token)

    assert response.status_code == 403
    assert response.json() == UNKNOWN
    assert db_snapshot() == before


def test_a_replaced_or_deleted_nodes_token_is_unknown(pending, agent, provider, make_node):
    node, token = pending
    Node.objects.filter(pk=node.pk).update(join_token_hash=hashlib.sha256(b"swj_newer").hexdigest())
    second, second_token = make_node(provider, "gpu-2")
    agent.post(REGISTER, join_payload(second_token, generate_signing_key()), format="json")
    Node.objects.filter(pk=second.pk).update(state=NodeState.DELETED, deleted_at=timezone.now())

    assert check(agent, token).json() == UNKNOWN
    assert check(agent, second_token).json() == UNKNOWN


def test_an_expired_token_is_said_to_be_expired(pending, agent):
    node, token = pending
    expired = (timezone.now() - timedelta(seconds=1)).replace(microsecond=0)
    Node.objects.filter(pk=node.pk).update(join_token_expires_at=expired)

    response = check(agent, token)

    assert response.status_code == 403
    assert response.json() == refusal(
        "invalid_join_token",
        f"the join token expired at {expired.isoformat(timespec='seconds')}: rotate the node's token for a new one",
        reason="expired",
    )


def test_an_ejected_nodes_token_is_refused(pending, agent):
    node, token = pending
    Node.objects.filter(pk=node.pk).update(state=NodeState.EJECTED)

    response = check(agent, token)

    assert response.status_code == 403
    assert response.json() == refusal("node_not_allowed", "this node was ejected")


def test_failed_checks_past_the_limit_are_refused_until_the_window_ends(pending, agent, settings):
    _, token = pending
    settings.SWARM_JOIN_CHECK_FAILURES_PER_ADDRESS = 3
    for guess in ("swj_guess1", "swj_guess2"):
        assert check(agent, guess).status_code == 403
    assert check(agent, token).status_code == 200  # a valid check is not a failure, and counts none
    assert check(agent, "swj_guess3").status_code == 403

    refused = check(agent, token)

    assert refused.status_code == 429
    wait = int(refused["Retry-After"])
    assert 1 <= wait <= JOIN_CHECK_WINDOW_S
    assert refused.json() == {
        "error": {
            "message": f"Too many failed join token checks. Try again in {wait} seconds.",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    other = agent.post(CHECK, {"token": token}, format="json", REMOTE_ADDR="198.51.100.8")
    assert other.status_code == 200  # counted per address


def test_a_join_posted_again_by_the_same_key_gets_the_same_answer(pending, agent):
    node, token = pending
    key = generate_signing_key()
    first = agent.post(REGISTER, join_payload(token, key), format="json")

    again = agent.post(REGISTER, join_payload(token, key), format="json")

    assert (first.status_code, again.status_code) == (201, 201)
    assert again.json() == first.json()
    node.refresh_from_db()
    assert node.used_join_token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert node.join_token_hash is None


def test_a_used_token_posted_again_by_another_key_or_after_connecting_is_refused(pending, agent):
    node, token = pending
    key = generate_signing_key()
    agent.post(REGISTER, join_payload(token, key), format="json")
    other_key = agent.post(REGISTER, join_payload(token, generate_signing_key()), format="json")
    mark_connected(node.pk)
    before = db_snapshot()

    after_connecting = agent.post(REGISTER, join_payload(token, key), format="json")

    assert (other_key.status_code, after_connecting.status_code) == (403, 403)
    assert after_connecting.json()["error"]["code"] == "invalid_join_token"
    assert db_snapshot() == before


def test_a_join_posted_again_after_the_window_is_refused(pending, agent):
    node, token = pending
    key = generate_signing_key()
    agent.post(REGISTER, join_payload(token, key), format="json")
    Node.objects.filter(pk=node.pk).update(joined_at=timezone.now() - timedelta(minutes=11))

    response = agent.post(REGISTER, join_payload(token, key), format="json")

    assert response.status_code == 403
    assert response.json()["error"]["code"] == "invalid_join_token"
