"""The customer API for API keys: /api/v1/keys/ (create, list, retrieve, revoke)."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.api.errors import error_response
from marketplace.jobs import services
from marketplace.jobs.errors import ApiKeyNameTaken, AuthenticationFailed, InvalidRequest
from marketplace.jobs.models import ApiKey
from marketplace.web.services import ensure_playground_key
from tests.factories import drf_datetime

pytestmark = [pytest.mark.api, pytest.mark.django_db]
pytest_plugins = ["tests.factories"]

KEYS = "/api/v1/keys/"
NOT_FOUND = {"detail": "No ApiKey matches the given query."}
CUSTOMERS_ONLY = {"detail": "this endpoint is for customers"}


def key_url(api_key: ApiKey) -> str:
    return f"{KEYS}{api_key.pk}/"


def listed(api_key: ApiKey) -> dict:
    """The API's view of a key: its prefix and limits, never the key itself."""
    return {
        "id": api_key.pk,
        "name": api_key.name,
        "prefix": api_key.prefix,
        "requests_per_minute": api_key.requests_per_minute,
        "tokens_per_minute": api_key.tokens_per_minute,
        "privacy": api_key.privacy,
        "created_at": drf_datetime(api_key.created_at),
        "last_used_at": drf_datetime(api_key.last_used_at),
        "revoked_at": drf_datetime(api_key.revoked_at),
    }


def keys_snapshot() -> list[dict]:
    return list(ApiKey.objects.order_by("pk").values())


@pytest.fixture
def second_customer(make_user):
    return make_user("frank", customer=True)


def test_customer_creates_a_key_shown_once_and_stored_hashed(customer, client_for):
    response = client_for(customer).post(KEYS, {"name": "laptop"}, format="json")

    assert response.status_code == 201
    api_key = ApiKey.objects.get()
    key = response.json()["key"]
    assert key.startswith("sk-sw-")
    assert len(key) == 49  # the prefix and 32 random bytes, url-safe base64
    assert response.json() == listed(api_key) | {"key": key}
    assert (api_key.user, api_key.name, api_key.prefix) == (customer, "laptop", key[:14])
    assert (api_key.requests_per_minute, api_key.tokens_per_minute) == (60, 100_000)
    assert api_key.key_hash == hashlib.sha256(key.encode()).hexdigest()
    assert key not in {str(value) for value in ApiKey.objects.values().get().values()}
    assert api_key.last_used_at is None
    assert api_key.revoked_at is None


def test_a_created_key_authenticates_and_records_its_use(customer, client_for):
    key = client_for(customer).post(KEYS, {"name": "laptop"}, format="json").json()["key"]

    api_key = services.authenticate_key(f"Bearer {key}")

    assert api_key == ApiKey.objects.get()
    assert api_key.user == customer
    assert ApiKey.objects.get().last_used_at is not None


def test_customer_lists_own_keys_by_prefix_without_the_key(customer, second_customer, client_for):
    client = client_for(customer)
    first = client.post(KEYS, {"name": "laptop"}, format="json").json()
    second = client.post(KEYS, {"name": "ci server"}, format="json").json()
    services.create_api_key(second_customer, "not carol's")

    response = client.get(KEYS)

    assert response.status_code == 200
    newest, oldest = ApiKey.objects.get(pk=second["id"]), ApiKey.objects.get(pk=first["id"])
    assert response.json() == {"count": 2, "next": None, "previous": None, "results": [listed(newest), listed(oldest)]}
    assert all("key" not in row and "key_hash" not in row for row in response.json()["results"])
    assert client.get(key_url(oldest)).json() == listed(oldest)


def test_customer_revokes_a_key_which_then_stops_authenticating(customer, client_for):
    client = client_for(customer)
    key = client.post(KEYS, {"name": "laptop"}, format="json").json()["key"]
    api_key = ApiKey.objects.get()

    response = client.delete(key_url(api_key))

    assert response.status_code == 204
    api_key.refresh_from_db()
    assert api_key.revoked_at is not None
    assert not api_key.active
    with pytest.raises(AuthenticationFailed) as caught:
        services.authenticate_key(f"Bearer {key}")
    response = error_response(caught.value)
    assert response.status_code == 401
    assert json.loads(response.content) == {
        "error": {
            "message": "This API key was revoked.",
            "type": "authentication_error",
            "param": None,
            "code": "revoked_api_key",
        }
    }
    assert ApiKey.objects.get().last_used_at is None
    assert client.get(KEYS).json()["results"] == [listed(api_key)]  # still listed, with revoked_at


def test_revoking_a_revoked_key_keeps_its_first_revocation_time(customer, client_for):
    client = client_for(customer)
    client.post(KEYS, {"name": "laptop"}, format="json")
    api_key = ApiKey.objects.get()
    client.delete(key_url(api_key))
    first = keys_snapshot()

    response = client.delete(key_url(api_key))

    assert response.status_code == 204
    assert keys_snapshot() == first


def test_provider_only_user_cannot_create_or_list_keys(provider, client_for):
    client = client_for(provider)

    created = client.post(KEYS, {"name": "laptop"}, format="json")
    listing = client.get(KEYS)

    assert (created.status_code, created.json()) == (403, CUSTOMERS_ONLY)
    assert (listing.status_code, listing.json()) == (403, CUSTOMERS_ONLY)
    assert keys_snapshot() == []


def test_provider_only_user_cannot_be_given_a_key_by_the_service(provider):
    with pytest.raises(InvalidRequest) as caught:
        services.create_api_key(provider, "laptop")

    assert (caught.value.code, str(caught.value)) == ("not_a_customer", "only customers can create API keys")
    assert keys_snapshot() == []


def test_anonymous_client_cannot_create_keys(client_for):
    response = client_for(None).post(KEYS, {"name": "laptop"}, format="json")

    assert response.status_code == 403
    assert response.json() == {"detail": "Authentication credentials were not provided."}
    assert keys_snapshot() == []


def test_customer_cannot_see_another_customers_key(customer, second_customer, client_for):
    api_key, _ = services.create_api_key(second_customer, "frank's")

    detail = client_for(customer).get(key_url(api_key))
    listing = client_for(customer).get(KEYS)

    assert (detail.status_code, detail.json()) == (404, NOT_FOUND)
    assert listing.json() == {"count": 0, "next": None, "previous": None, "results": []}


def test_customer_cannot_revoke_another_customers_key(customer, second_customer, client_for):
    api_key, key = services.create_api_key(second_customer, "frank's")
    before = keys_snapshot()

    response = client_for(customer).delete(key_url(api_key))

    assert (response.status_code, response.json()) == (404, NOT_FOUND)
    assert keys_snapshot() == before
    assert services.authenticate_key(f"Bearer {key}") == api_key


@pytest.mark.parametrize("name", ["", "-dash-first", "x" * 101, "semi;colon"])
def test_a_key_needs_a_plain_name(customer, client_for, name):
    response = client_for(customer).post(KEYS, {"name": name}, format="json")

    assert response.status_code == 400
    assert list(response.json()) == ["name"]
    assert keys_snapshot() == []


def test_a_second_active_key_with_the_same_name_is_refused_and_changes_nothing(customer, client_for):
    client = client_for(customer)
    client.post(KEYS, {"name": "laptop"}, format="json")
    before = keys_snapshot()

    response = client.post(KEYS, {"name": "laptop"}, format="json")

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "You already have an active key with this name.",
            "type": "invalid_request_error",
            "param": "name",
            "code": "api_key_name_taken",
        }
    }
    assert keys_snapshot() == before


def test_a_revoked_keys_name_may_be_used_again(customer, client_for):
    client = client_for(customer)
    client.post(KEYS, {"name": "laptop"}, format="json")
    client.delete(key_url(ApiKey.objects.get()))

    response = client.post(KEYS, {"name": "laptop"}, format="json")

    assert response.status_code == 201
    keys = [(k.name, k.revoked_at is None) for k in ApiKey.objects.order_by("pk")]
    assert keys == [("laptop", False), ("laptop", True)]


def test_the_service_keeps_the_playground_keys_name_for_the_playground(customer):
    with pytest.raises(ApiKeyNameTaken) as caught:
        services.create_api_key(customer, services.PLAYGROUND_KEY_NAME)

    assert (caught.value.code, caught.value.param, str(caught.value)) == (
        "api_key_name_taken",
        "name",
        "This name is kept for the playground's own key.",
    )
    assert keys_snapshot() == []


def test_a_customer_at_the_key_limit_is_refused_until_one_is_revoked(customer, client_for, settings):
    settings.SWARM_API_KEYS_PER_ACCOUNT = 3
    client = client_for(customer)
    for name in ("a", "b", "c"):
        assert client.post(KEYS, {"name": name}, format="json").status_code == 201
    before = keys_snapshot()

    refused = client.post(KEYS, {"name": "d"}, format="json")
    unchanged = keys_snapshot()
    client.delete(key_url(ApiKey.objects.get(name="a")))
    after_revoking = client.post(KEYS, {"name": "d"}, format="json")

    assert refused.status_code == 400
    assert refused.json() == {
        "error": {
            "message": "You have 3 active API keys, the most an account may have: revoke one first.",
            "type": "invalid_request_error",
            "param": None,
            "code": "api_key_limit_reached",
        }
    }
    assert unchanged == before
    assert after_revoking.status_code == 201


def test_the_playground_key_does_not_count_against_the_key_limit(customer, settings):
    settings.SWARM_API_KEYS_PER_ACCOUNT = 1
    services.create_playground_key(customer)

    api_key, _ = services.create_api_key(customer, "only")

    assert sorted(ApiKey.objects.filter(user=customer).values_list("name", flat=True)) == [
        "Playground (dashboard)",
        "only",
    ]
    assert api_key.name == "only"


def test_each_playground_request_marks_its_key_used_as_the_api_marks_a_clients(customer):
    first = ensure_playground_key(customer)
    assert first.last_used_at is not None
    ApiKey.objects.filter(pk=first.pk).update(last_used_at=timezone.now() - timedelta(hours=2))

    again = ensure_playground_key(customer)

    assert again.pk == first.pk
    assert timezone.now() - ApiKey.objects.get(pk=first.pk).last_used_at < timedelta(minutes=1)
