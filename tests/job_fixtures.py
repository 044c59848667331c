"""A priced model, a customer with $1 of credits, and running jobs holding their worst case: the
money of a job's end, read from the ledger.

Test modules define their ``customer`` fixture with ``funded_customer`` and import ``running_job``.
It is no plugin: a ``customer`` fixture registered for the whole session would stand in for
``tests.factories``' in every module after the first that loaded it. It holds no assert, hence
PYTEST_DONT_REWRITE (see tests/factories.py).
"""

from __future__ import annotations

from django.utils import timezone

from marketplace.billing import services
from marketplace.billing.models import ModelPrice
from marketplace.flows import settlement
from marketplace.jobs.models import Job
from marketplace.jobs.services import create_api_key, mark_running

MODEL = "smollm2-135m"
# A running job's hold: 40 prompt tokens at $1 per million and 100 max tokens at $3 per million.
HOLD = 40_000 + 300_000


def funded_customer(django_user_model, settings):
    """A customer with $1 of credits, ``MODEL`` priced, and a 60 s stale-job limit."""
    settings.SWARM_JOB_STALE_S = 60
    ModelPrice.objects.create(
        model=MODEL,
        prompt_per_million=1_000_000_000,
        completion_per_million=3_000_000_000,
        effective_from=timezone.now(),
    )
    user = django_user_model.objects.create_user(username="c", email="c@example.com", password="x", is_customer=True)
    services.grant(user, 1)
    return user


def held_job(customer, api_key, public_id: str, **fields) -> Job:
    """A queued job of ``customer`` under ``api_key`` with its hold placed: by default ``MODEL``,
    40 prompt tokens and at most 100 more (holding HOLD); ``fields`` set others (a model, a route)."""
    defaults = {"kind": "chat", "model": MODEL, "params": {"max_tokens": 100}, "prompt_tokens": 40}
    job = Job.objects.create(public_id=public_id, customer=customer, api_key=api_key, **(defaults | fields))
    settlement.place_hold(job)
    return job


def running_job(customer, public_id: str) -> Job:
    """A job of ``customer`` (under a key of its own) holding HOLD, marked running."""
    api_key, _ = create_api_key(customer, public_id)
    job = held_job(customer, api_key, public_id)
    mark_running(job.pk)
    return job
