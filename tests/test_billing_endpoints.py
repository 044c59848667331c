"""What customers see of their money: balance, transactions, usage (JSON and CSV), and the
OpenRouter-style `/api/v1/credits` and `/api/v1/generation` for a key."""

from __future__ import annotations

import pytest
from django.test import Client
from django.utils import timezone

from marketplace.billing import services
from marketplace.billing.models import ModelPrice
from marketplace.flows import settlement
from marketplace.jobs.models import JobState
from marketplace.jobs.services import create_api_key, finish_job
from tests.job_fixtures import held_job

pytestmark = [pytest.mark.billing, pytest.mark.django_db]

MODEL = "smollm2-135m"


@pytest.fixture
def customer(django_user_model):
    return django_user_model.objects.create_user(
        username="cust", email="c@example.com", password="pw", is_customer=True
    )


@pytest.fixture
def spent(customer):
    """A customer granted $2 who ran one job: 40 prompt + 7 completion tokens at $1/$3 per million."""
    ModelPrice.objects.create(
        model=MODEL,
        prompt_per_million=1_000_000_000,
        completion_per_million=3_000_000_000,
        effective_from=timezone.now(),
    )
    services.grant(customer, 2)
    api_key, key = create_api_key(customer, "main")
    job = held_job(customer, api_key, "chatcmpl-abc")
    # Cancelled by its customer after 7 tokens: charged for them without receipts to verify.
    finish_job(job.pk, state=JobState.CANCELLED, completion_tokens=7, finish_reason="stop")
    settlement.settle(job.pk)
    return key, job


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_balance_shows_available_credits_and_totals(customer, spent):
    response = signed_in(customer).get("/api/v1/billing/balance")

    assert response.status_code == 200
    assert response.json() == {
        "available": "1.999939000",
        "on_hold": "0.000000000",
        "total_credits": "2.000000000",
        "total_usage": "0.000061000",
    }


def test_transactions_list_the_customers_movements_newest_first(customer, spent):
    data = signed_in(customer).get("/api/v1/billing/transactions").json()["data"]

    assert [(t["kind"], t["account"], t["amount"], t["job"]) for t in data] == [
        ("release", "customer_credit", "0.000279000", "chatcmpl-abc"),
        ("charge", "customer_hold", "-0.000061000", "chatcmpl-abc"),
        ("hold", "customer_credit", "-0.000340000", "chatcmpl-abc"),
        ("grant", "customer_credit", "2.000000000", None),
    ]


def test_usage_groups_by_model_and_exports_csv(customer, spent):
    client = signed_in(customer)

    by_model = client.get("/api/v1/billing/usage?group=model").json()
    csv = client.get("/api/v1/billing/usage.csv?group=model")

    assert by_model == {
        "group": "model",
        "data": [{"model": MODEL, "requests": 1, "prompt_tokens": 40, "completion_tokens": 7, "cost": "0.000061000"}],
    }
    assert csv["Content-Type"] == "text/csv"
    assert csv.content.decode().splitlines() == [
        "model,requests,prompt_tokens,completion_tokens,cost_usd",
        f"{MODEL},1,40,7,0.000061000",
    ]


def test_usage_by_key_names_each_key(customer, spent):
    client = signed_in(customer)
    _, job = spent

    by_key = client.get("/api/v1/billing/usage?group=key").json()
    csv = client.get("/api/v1/billing/usage.csv?group=key")

    row = {"requests": 1, "prompt_tokens": 40, "completion_tokens": 7, "cost": "0.000061000"}
    assert by_key == {"group": "key", "data": [{"key": job.api_key.prefix, "key_name": "main", **row}]}
    assert csv.content.decode().splitlines() == [
        "key,key_name,requests,prompt_tokens,completion_tokens,cost_usd",
        f"{job.api_key.prefix},main,1,40,7,0.000061000",
    ]


def test_usage_refuses_an_unknown_grouping(customer, spent):
    response = signed_in(customer).get("/api/v1/billing/usage?group=week")

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "group"


def test_credits_and_generation_answer_for_the_calling_key(customer, spent):
    key, job = spent
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}")

    credits = client.get("/api/v1/credits").json()
    generation = client.get(f"/api/v1/generation?id={job.public_id}").json()["data"]

    assert credits == {"data": {"total_credits": 2.0, "total_usage": 0.000061}}
    assert (
        generation["id"],
        generation["model"],
        generation["tokens_prompt"],
        generation["tokens_completion"],
        generation["total_cost"],
        generation["state"],
    ) == ("chatcmpl-abc", MODEL, 40, 7, 0.000061, "cancelled")


def test_another_customers_generation_is_not_found(customer, spent, django_user_model):
    _, job = spent
    other = django_user_model.objects.create_user(username="o", email="o@example.com", password="pw", is_customer=True)
    _, other_key = create_api_key(other, "k")

    response = Client(HTTP_AUTHORIZATION=f"Bearer {other_key}").get(f"/api/v1/generation?id={job.public_id}")

    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_credits_need_a_valid_key(customer, spent):
    response = Client(HTTP_AUTHORIZATION="Bearer sk-sw-nope").get("/api/v1/credits")

    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_a_provider_only_user_cannot_read_billing(django_user_model):
    provider = django_user_model.objects.create_user(
        username="p", email="p@example.com", password="pw", is_provider=True
    )

    assert signed_in(provider).get("/api/v1/billing/balance").status_code == 403
