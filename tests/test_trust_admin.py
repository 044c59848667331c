"""Admin actions on trust in the Django admin: uphold (claws back pending pay, ejects at the
threshold), overturn (only with a reason), eject and reinstate nodes, approve payout batches; and
every one of them denied to non-staff, with nothing changed."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from marketplace.billing.models import AccountKind, LedgerAccount, Transfer
from marketplace.billing.services import account, transfer
from marketplace.jobs.models import Job
from marketplace.nodes.models import Node, NodeState
from marketplace.payouts import services as payout_services
from marketplace.payouts.models import BatchState, ConnectAccount, Earning, EarningState, PayoutBatch
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.verification import challenges as challenge_checks
from marketplace.verification import strikes
from marketplace.verification.errors import StrikeDecisionRefused
from marketplace.verification.models import Strike, StrikeState
from tests.challenge_fixtures import material
from tests.stripe_fake import deliver

pytest_plugins = ["tests.factories", "tests.stripe_fake"]
pytestmark = [pytest.mark.trust, pytest.mark.django_db]

EARNED = 123_456_789


@pytest.fixture
def superuser(django_user_model):
    return django_user_model.objects.create_superuser("root", "root@example.test", "pw-root-123")


@pytest.fixture
def struck(settings, provider, customer, make_joined_node, django_capture_on_commit_callbacks):
    """A serving node with pending pay and `n` open strikes (failed challenges)."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.SWARM_VERIFIER = "inline"
    settings.SWARM_STRIKES_TO_EJECT = 2
    node = make_joined_node(provider, "gpu-1").node
    Assignment.objects.create(
        node=node, model="tiny-llama", generation=1, pipeline=0, position=0, layer_start=0, layer_end=2,
        state=AssignmentState.READY, ready_at=timezone.now(),
    )  # fmt: skip
    job = Job.objects.create(public_id="cmpl-x", kind="completion", customer=customer, model="tiny-llama")
    Earning.objects.create(
        node=node, provider=provider, job=job, amount=EARNED, layer_tokens=10,
        available_at=timezone.now() + timedelta(days=1),
    )  # fmt: skip
    transfer(
        account(AccountKind.PLATFORM_REVENUE), account(AccountKind.PROVIDER_PENDING, provider), EARNED, kind="earning"
    )

    def strike() -> Strike:
        challenge = challenge_checks.open_challenge(node, tokens=2, seed=3)
        skipped = material(  # its inputs: skipped its layers
            node=node.node_id, model="tiny-llama", layer_start=0, layer_end=2, outputs=lambda inputs, steps: inputs
        )
        with django_capture_on_commit_callbacks(execute=True):
            challenge_checks.record_challenge_output(challenge.pk, skipped, elapsed_ms=3.5)
        return Strike.objects.get(challenge=challenge)

    return node, strike


def act(client: Client, url: str, action: str, pks: list[int], **extra) -> object:
    return client.post(url, {"action": action, "_selected_action": [str(pk) for pk in pks], **extra}, follow=True)


def snapshot() -> dict:
    return {
        "strikes": list(Strike.objects.order_by("pk").values()),
        "nodes": list(Node.objects.order_by("pk").values()),
        "earnings": list(Earning.objects.order_by("pk").values()),
        "transfers": list(Transfer.objects.order_by("pk").values()),
        "batches": list(PayoutBatch.objects.order_by("pk").values()),
    }


def test_uphold_in_the_admin_claws_back_and_the_threshold_ejects(struck, superuser, provider):
    node, strike = struck
    first, second = strike(), strike()
    client = Client()
    client.force_login(superuser)

    response = act(client, "/admin/verification/strike/", "uphold", [first.pk], apply="1", reason="clear evidence")

    assert response.status_code == 200
    first.refresh_from_db()
    assert (first.state, first.decided_by, first.decision_reason, first.clawed_back) == (
        StrikeState.UPHELD,
        superuser,
        "clear evidence",
        EARNED,
    )
    assert LedgerAccount.objects.get(kind=AccountKind.PROVIDER_PENDING, owner=provider).balance == 0
    assert Earning.objects.get().state == EarningState.CLAWED_BACK
    node.refresh_from_db()
    assert node.state == NodeState.ACTIVE

    act(client, "/admin/verification/strike/", "uphold", [second.pk], apply="1", reason="again")

    node.refresh_from_db()
    assert node.state == NodeState.EJECTED
    assert node.ejection_reason == "2 upheld strikes within 30 days"
    assert Assignment.objects.get(node=node).state == AssignmentState.RELEASED


def test_overturn_needs_a_reason(struck, superuser):
    _, strike = struck
    open_strike = strike()
    client = Client()
    client.force_login(superuser)

    response = act(client, "/admin/verification/strike/", "overturn", [open_strike.pk], apply="1", reason="  ")

    assert b"This field is required." in response.content
    open_strike.refresh_from_db()
    assert open_strike.state == StrikeState.OPEN

    act(client, "/admin/verification/strike/", "overturn", [open_strike.pk], apply="1", reason="verifier bug #12")

    open_strike.refresh_from_db()
    assert (open_strike.state, open_strike.decision_reason, open_strike.clawed_back) == (
        StrikeState.OVERTURNED,
        "verifier bug #12",
        0,
    )


def test_overturn_service_refuses_without_reason_or_staff(struck, superuser, provider):
    _, strike = struck
    open_strike = strike()

    with pytest.raises(StrikeDecisionRefused, match="needs a reason"):
        strikes.overturn_strike(open_strike, by=superuser, reason="")
    with pytest.raises(StrikeDecisionRefused, match="only admins"):
        strikes.overturn_strike(open_strike, by=provider, reason="mine")
    open_strike.refresh_from_db()
    assert open_strike.state == StrikeState.OPEN


def test_eject_and_reinstate_in_the_admin(struck, superuser):
    node, _ = struck
    client = Client()
    client.force_login(superuser)

    act(client, "/admin/nodes/node/", "eject", [node.pk], apply="1", reason="hardware fraud report")
    node.refresh_from_db()
    assert (node.state, node.ejection_reason) == (NodeState.EJECTED, "hardware fraud report")

    act(client, "/admin/nodes/node/", "reinstate", [node.pk])
    node.refresh_from_db()
    assert (node.state, node.ejection_reason, node.ejected_at) == (NodeState.OFFLINE, "", None)


def test_strikes_left_unreviewed_are_upheld_after_the_review_period(struck, settings):
    _, strike = struck
    open_strike = strike()
    settings.SWARM_STRIKE_REVIEW_S = 3600

    assert strikes.uphold_overdue_strikes(open_strike.created_at + timedelta(seconds=3599)) == []
    assert strikes.uphold_overdue_strikes(open_strike.created_at + timedelta(seconds=3601)) == [open_strike.pk]
    open_strike.refresh_from_db()
    assert open_strike.state == StrikeState.UPHELD
    assert open_strike.decision_reason == "upheld: not reviewed within the review period"


def test_open_strike_withholds_pending_pay_past_the_window(struck, provider):
    _, strike = struck
    strike()
    assert strikes.release_earnings_in_good_standing(now=timezone.now() + timedelta(days=2)) == 0
    assert Earning.objects.get().state == EarningState.PENDING


@pytest.mark.parametrize("persona", ["customer", "provider", "stranger", "anonymous"])
def test_admin_actions_are_denied_to_non_staff_and_change_nothing(struck, persona, request, provider):
    node, strike = struck
    open_strike = strike()
    batch = PayoutBatch.objects.create(state=BatchState.BUILT)
    client = Client()
    if persona != "anonymous":
        client.force_login(request.getfixturevalue(persona))
    before = snapshot()

    responses = [
        client.post("/admin/verification/strike/", {"action": "uphold", "_selected_action": [open_strike.pk],
                                                    "apply": "1", "reason": "x"}),
        client.post("/admin/verification/strike/", {"action": "overturn", "_selected_action": [open_strike.pk],
                                                    "apply": "1", "reason": "x"}),
        client.post("/admin/nodes/node/", {"action": "eject", "_selected_action": [node.pk], "apply": "1",
                                           "reason": "x"}),
        client.post("/admin/nodes/node/", {"action": "reinstate", "_selected_action": [node.pk]}),
        client.post("/admin/payouts/payoutbatch/", {"action": "approve", "_selected_action": [batch.pk]}),
    ]  # fmt: skip

    for response in responses:
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/")
    assert snapshot() == before


def test_connect_account_updated_webhook_makes_the_account_payout_ready(provider, fake_stripe):
    url = payout_services.start_onboarding(provider, origin="https://swarm.example")
    connect = ConnectAccount.objects.get(provider=provider)
    assert url.startswith(f"https://connect.stripe.com/setup/e/{connect.stripe_account_id}/")
    assert connect.payouts_enabled is False

    onboarded = fake_stripe.complete_onboarding(connect.stripe_account_id)
    response = deliver(fake_stripe.event("account.updated", onboarded))

    assert response.status_code == 200
    connect.refresh_from_db()
    assert (connect.payouts_enabled, connect.details_submitted) == (True, True)
    assert deliver(fake_stripe.event("account.updated", {**onboarded, "id": "acct_unknown"})).status_code == 200
    assert ConnectAccount.objects.count() == 1
