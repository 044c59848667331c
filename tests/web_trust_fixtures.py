"""Trust and payouts set up for the dashboards' browser tests: a control plane whose own trust
schedule is switched off (only the test acts), people (pat provides GPUs, dave is an admin, carol
is the customer), nodes that serve without an agent (joined, active and holding every layer in the
database), challenges answered as an honest or a cheating agent would, and earnings moved through
the ledger as the payout services would move them.

Test modules load it with ``pytest_plugins = ["tests.browser", "tests.web_trust_fixtures"]`` and
import its helpers (``serving_node``, ``answer``, ``earning``, ``balance``, ``user``), which happens
before pytest loads it as a plugin, hence PYTEST_DONT_REWRITE.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from marketplace.billing.models import AccountKind, LedgerAccount
from marketplace.billing.services import account, transfer
from marketplace.jobs.models import Job, JobState
from marketplace.nodes.joining import create_node
from marketplace.nodes.models import Node, NodeState
from marketplace.payouts.models import Earning, EarningState
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.verification import challenges as challenge_checks
from marketplace.verification.models import Challenge, CheckState, Strike
from tests.browser import MODEL, PASSWORD
from tests.challenge_fixtures import material
from tests.factories import public_hex
from worker_agent import model as models
from worker_agent.protocol.keys import generate_signing_key

TOKENS = 4  # per challenge
PENDING_PAY = 123_456_789  # nano-dollars: $0.123456789


@pytest.fixture
def quiet_trust(settings):
    """Set before the server starts (its scheduler reads it once): no trust work of its own."""
    settings.SWARM_TRUST_INTERVAL_S = 24 * 3600.0


@pytest.fixture
def trust_server(quiet_trust, web_server, settings):
    settings.SWARM_HEARTBEAT_TIMEOUT_S = 3600.0  # no agent heartbeats: the node stays as the test sets it
    settings.SWARM_VERIFIER = "inline"
    settings.SWARM_STRIKES_TO_EJECT = 3
    return web_server


def user(username: str, **roles):
    return get_user_model().objects.create_user(username, f"{username}@example.test", PASSWORD, **roles)


def serving_node(owner, name: str) -> Node:
    """A node joined two days ago, active and connected, serving all of tiny-llama's layers."""
    node, _ = create_node(owner=owner, name=name)
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(
        node_id=f"node-{node.pk:016x}",
        public_key=public_hex(generate_signing_key()),
        state=NodeState.ACTIVE,
        connected=True,
        connected_since=now,
        joined_at=now - timedelta(days=2),
        online_s=2 * 86400 * 0.9,
        last_heartbeat_at=now,
        device="cpu",
        device_name="test CPU",
    )
    Assignment.objects.create(
        node=node, model=MODEL, generation=1, pipeline=0, position=0, layer_start=0,
        layer_end=models.n_layers(MODEL), state=AssignmentState.READY, ready_at=now,
    )  # fmt: skip
    node.refresh_from_db()
    return node


def answer(node: Node, seed: int, *, honest: bool) -> Challenge:
    """Challenge the node and store what the challenge's job kept of its part: honest outputs, or its
    inputs (the layers skipped). The verifier runs inline when the output is stored."""
    challenge = challenge_checks.open_challenge(node, tokens=TOKENS, seed=seed)
    skipped = None if honest else (lambda inputs, steps: inputs)
    output = material(
        node=node.node_id, model=MODEL, layer_start=0, layer_end=models.n_layers(MODEL), outputs=skipped, stage=0
    )
    challenge_checks.record_challenge_output(challenge.pk, output, elapsed_ms=41.5)
    return Challenge.objects.get(pk=challenge.pk)


def earning(node: Node, public_id: str, amount: int, state: str, *, days_ago: int = 0) -> Earning:
    """A node's share of a served job, moved through the ledger as the payout services would."""
    customer = get_user_model().objects.get(username="carol")
    job = Job.objects.create(
        public_id=public_id, kind="completion", customer=customer, model=MODEL, state=JobState.SUCCEEDED
    )
    created = timezone.now() - timedelta(days=days_ago)
    pending = EarningState.PENDING
    row = Earning.objects.create(
        node=node, provider=node.owner, job=job, amount=amount, layer_tokens=60, state=state,
        available_at=created + timedelta(days=1) if state == pending else created,
    )  # fmt: skip
    Earning.objects.filter(pk=row.pk).update(created_at=created)
    transfer(
        account(AccountKind.PLATFORM_REVENUE), account(AccountKind.PROVIDER_PENDING, node.owner), amount, kind="earning"
    )
    if state == EarningState.AVAILABLE:
        transfer(
            account(AccountKind.PROVIDER_PENDING, node.owner),
            account(AccountKind.PROVIDER_AVAILABLE, node.owner),
            amount,
            kind="earning_release",
        )
    row.refresh_from_db()
    return row


def balance(kind: str, owner) -> int:
    found = LedgerAccount.objects.filter(kind=kind, owner=owner).first()
    return found.balance if found else 0


@pytest.fixture
def people(trust_server):
    """pat provides GPUs, dave is an admin, carol is the customer whose requests pat served."""
    return user("pat", is_provider=True), user("dave", is_staff=True), user("carol", is_customer=True)


@pytest.fixture
def struck(people):
    """pat's node gpu-7: pending pay, one passed challenge and two failed ones (two open strikes).
    Built before the browser starts: the services' notices go out from this thread."""
    pat = people[0]
    node = serving_node(pat, "gpu-7")
    earning(node, "cmpl-pending-1", PENDING_PAY, EarningState.PENDING)
    passed = answer(node, 7, honest=True)
    first, second = answer(node, 1, honest=False), answer(node, 2, honest=False)
    assert (passed.state, first.state, second.state) == (CheckState.PASSED, CheckState.FAILED, CheckState.FAILED)
    return Node.objects.get(pk=node.pk), Strike.objects.get(challenge=first), Strike.objects.get(challenge=second)
