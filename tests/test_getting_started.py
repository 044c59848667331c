"""A new customer's getting-started checklist on the home page: each step ticked once done (credits
added, the playground tried, a key created, a first request sent with it), and the checklist gone
once all are."""

from __future__ import annotations

import pytest
from django.test import Client

from marketplace.billing import services as billing
from marketplace.jobs.services import create_api_key, create_playground_key
from tests.job_fixtures import held_job

pytestmark = [pytest.mark.web, pytest.mark.django_db]


def ticked(client: Client) -> dict[str, bool] | None:
    page = client.get("/").content.decode()
    if 'id="getting-started"' not in page:
        return None
    steps = {}
    for step in ("credits", "playground", "key", "request"):
        marker = f'data-step="{step}" data-done="'
        start = page.index(marker) + len(marker)
        steps[step] = page[start : page.index('"', start)] == "true"
    return steps


def test_each_step_is_ticked_once_done_and_the_list_goes_when_all_are(django_user_model):
    customer = django_user_model.objects.create_user("newbie", "n@example.test", "pw", is_customer=True)
    client = Client()
    client.force_login(customer)

    assert ticked(client) == {"credits": False, "playground": False, "key": False, "request": False}
    billing.grant(customer, 5)
    playground, _ = create_playground_key(customer)
    held_job(customer, playground, "chatcmpl-playground")
    assert ticked(client) == {"credits": True, "playground": True, "key": False, "request": False}
    own, _ = create_api_key(customer, "my-app")
    assert ticked(client) == {"credits": True, "playground": True, "key": True, "request": False}
    held_job(customer, own, "chatcmpl-first")

    assert ticked(client) is None


def test_a_provider_sees_no_customer_checklist(django_user_model):
    provider = django_user_model.objects.create_user("pat", "p@example.test", "pw", is_provider=True)
    client = Client()
    client.force_login(provider)

    assert ticked(client) is None
