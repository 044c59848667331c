"""Schemathesis over ``/api/schema/``: every operation of the documented REST API (nodes, keys, agent
registration, credits, generation, billing) is called with cases generated from its schema,
valid and invalid alike, by an account that is both provider and customer and holds a node, a key
and credits; no case may get a server error. Generation is derandomized (the same cases on every
machine) and bounded per operation; ``bench/fuzz.py`` fuzzes the OpenAI-compatible routes, which
this schema does not describe."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from marketplace.billing.services import grant
from marketplace.jobs import services as jobs_services
from marketplace.nodes import joining

pytestmark = [pytest.mark.fuzz, pytest.mark.api]

USER, PASSWORD = "fuzzer", "a password nobody guesses 7"
EXAMPLES_PER_OPERATION = 40


def fuzz(operation, mode: GenerationMode, called: dict[str, int]) -> None:
    """Call ``operation`` with up to EXAMPLES_PER_OPERATION cases of ``mode``; fail on a 5xx."""
    label = f"{operation.method.upper()} {operation.path} ({mode.value})"

    @given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis_settings(
        max_examples=EXAMPLES_PER_OPERATION,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def call(case):
        called[label] = called.get(label, 0) + 1
        case.call_and_validate(auth=(USER, PASSWORD), checks=[not_a_server_error])

    call()


def test_no_operation_of_the_documented_api_answers_a_server_error(
    live_server, transactional_db, settings, django_user_model
):
    # Basic auth hashes the password on every request: a fast hasher keeps the run short.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    user = django_user_model.objects.create_user(
        USER, "fuzzer@example.test", PASSWORD, is_provider=True, is_customer=True
    )
    grant(user, 5)
    jobs_services.create_api_key(user, "fuzzed")
    joining.create_node(owner=user, name="fuzzed-gpu")
    schema = schemathesis.openapi.from_url(f"{live_server.url}/api/schema/", auth=(USER, PASSWORD))
    operations = [result.ok() for result in schema.get_all_operations()]
    called: dict[str, int] = {}

    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(operation, mode, called)

    # Every documented operation was exercised, not just loaded.
    assert len(operations) >= 10
    exercised = {label.rsplit(" (", 1)[0] for label, count in called.items() if count}
    assert exercised == {f"{operation.method.upper()} {operation.path}" for operation in operations}
    assert {"GET /api/v1/nodes/", "POST /api/v1/keys/", "POST /api/v1/agents/register"} <= exercised
