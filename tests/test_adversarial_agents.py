"""Adversarial agents, as real processes, against the live control plane.

Three providers each join one `swarm-worker join` agent serving tiny-llama (capped at 2 of its 6
layers, so the model is placed as one 3-stage pipeline); mallory's agent runs a test-only cheat mode.
Customers' jobs go through the OpenAI-compatible API with every stage audited (a new node's audit
fraction is set to 1 here), and the test sends seeded challenges, which reach the agents over their
data plane as sessions of a ticketed job, like any customer's. Each cheater must be caught, struck,
its pending pay clawed back when a strike is upheld, and ejected at the threshold, while the honest
nodes get no strike and keep their pay.

The point of the design: a node that lies about its output still passes the receipt coverage check
(its job is recorded verified and paid pending), and it is the audit that catches it, whatever the
lie (garbage, its input passed on, another model's weights).
"""

from __future__ import annotations

import time

import openai
import pytest
from django.contrib.auth import get_user_model

from marketplace.billing.models import Transfer
from marketplace.nodes.models import Node, NodeState
from marketplace.payouts.models import Earning, EarningState
from marketplace.verification import strikes
from marketplace.verification.models import Audit, CheckState, Strike, StrikeKind, StrikeState
from tests.live import wait_for
from tests.trust_fixtures import PROVIDERS, STRIKES_TO_EJECT, Swarm

pytest_plugins = ["tests.trust_fixtures"]
pytestmark = [pytest.mark.trust, pytest.mark.django_db(transaction=True)]

CHALLENGES = 30  # of the honest bfloat16 agents, 10 each


def uphold_all_open(swarm: Swarm, admin) -> list[Strike]:
    upheld = []
    for strike in Strike.objects.filter(node=swarm.cheater, state=StrikeState.OPEN).order_by("pk"):
        if swarm.cheater.state == NodeState.EJECTED:
            break
        upheld.append(strikes.uphold_strike(strike, by=admin, reason="evidence reviewed"))
    return upheld


@pytest.mark.parametrize("cheat", ["garbage", "identity", "other-weights"])
def test_cheater_is_caught_struck_clawed_back_and_ejected(make_swarm, cheat):
    swarm = make_swarm(cheat=cheat)
    admin = get_user_model().objects.create_user("dave", "dave@example.test", None, is_staff=True)

    # Live traffic: the cheater's receipts still prove coverage, so its job is verified and paid
    # pending, but the audit of its stage fails: the customer is refunded, and the cheater leaves
    # routing at once (its pipeline is the only one, so the next request finds no capacity).
    job = swarm.run_job("Tell me about bees")
    # Receipts: every signature valid, spans tile the model, links and endpoints match.
    assert job.verified is True, job.verification_error
    assert job.verification_error == ""
    assert Earning.objects.filter(job=job, node=swarm.cheater).get().amount > 0
    assert len(job.audit_stages) == 3
    # The audit replays the cheater's signed inputs on the trusted block and sees the lie.
    cheater_audits = Audit.objects.filter(node=swarm.cheater)
    assert [a.state for a in cheater_audits] == [CheckState.FAILED]
    (audit,) = cheater_audits
    assert audit.metrics["code"] == "audit_mismatch"
    assert audit.metrics["min_cosine"] < 0.99
    audit_strike = Strike.objects.get(audit=audit)
    assert (audit_strike.kind, audit_strike.state, audit_strike.evidence["job"]) == (
        StrikeKind.AUDIT,
        StrikeState.OPEN,
        job.public_id,
    )
    assert all(a.state == CheckState.PASSED for a in Audit.objects.exclude(node=swarm.cheater))
    assert Transfer.objects.get(job=job, kind="refund").amount == job.charged_amount > 0
    pending_before = swarm.pending("mallory")
    assert pending_before == sum(e.amount for e in Earning.objects.filter(node=swarm.cheater))
    assert pending_before > 0
    assert Node.objects.get(pk=swarm.cheater.pk).under_review is True
    with pytest.raises(openai.APIStatusError) as refused:
        swarm.client.completions.create(model=swarm.model, prompt="More bees", max_tokens=4, temperature=0)
    assert refused.value.status_code == 503

    # Challenges reach it all the same: the cheater fails each one; an honest node passes.
    for _ in range(3):
        assert swarm.challenge(swarm.cheater).state == CheckState.FAILED
    assert swarm.challenge(swarm.honest[0]).state == CheckState.PASSED

    strikes = Strike.objects.filter(node=swarm.cheater)
    assert sorted(s.kind for s in strikes) == [StrikeKind.AUDIT] + [StrikeKind.CHALLENGE] * 3
    assert all(s.evidence["min_cosine"] < 0.99 for s in strikes)
    assert Strike.objects.exclude(node=swarm.cheater).count() == 0

    # Upholding: the first claws back all its pending pay; the third ejects it.
    first, *rest = uphold_all_open(swarm, admin)
    assert first.clawed_back == pending_before
    assert swarm.pending("mallory") == 0
    assert set(Earning.objects.filter(node=swarm.cheater).values_list("state", flat=True)) == {EarningState.CLAWED_BACK}
    assert len(rest) == STRIKES_TO_EJECT - 1
    cheater = swarm.cheater
    assert cheater.state == NodeState.EJECTED
    assert cheater.ejection_reason.startswith(f"{STRIKES_TO_EJECT} upheld strikes")
    mallory_agent = swarm.agents[PROVIDERS.index("mallory")]
    wait_for(lambda: mallory_agent.poll() is not None, 60, "the ejected agent to stop")

    # The honest providers keep their pending pay and have no strike.
    for name in ("alice", "bob"):
        assert swarm.pending(name) == sum(
            e.amount for e in Earning.objects.filter(provider=swarm.users[name], state=EarningState.PENDING)
        )
        assert swarm.pending(name) > 0


def test_node_cheating_only_on_live_sessions_is_caught_by_a_challenge(make_swarm):
    # Honest whenever its block runs outside a session (where control-channel challenges once ran),
    # garbage on every data-plane session: a challenge is such a session, so it fails.
    swarm = make_swarm(cheat="selective:1.0")

    challenge = swarm.challenge(swarm.cheater)

    assert challenge.state == CheckState.FAILED
    assert challenge.reason.startswith("output disagrees with the trusted recompute: cosine ")
    assert challenge.metrics["min_cosine"] < 0.99
    strike = Strike.objects.get(node=swarm.cheater)
    assert (strike.kind, strike.state, strike.challenge_id) == (StrikeKind.CHALLENGE, StrikeState.OPEN, challenge.pk)
    assert swarm.cheater.verified_layer_tokens_per_s is None  # a wrong answer proves no speed

    # The honest nodes pass theirs over the same path and prove a speed.
    for node in swarm.honest:
        assert swarm.challenge(node).state == CheckState.PASSED
    assert all(node.verified_layer_tokens_per_s > 0 for node in swarm.honest)
    assert Strike.objects.exclude(node=swarm.cheater).count() == 0

    # Struck, it leaves routing at once: its pipeline is the only one, so no customer request reaches it.
    assert Node.objects.get(pk=swarm.cheater.pk).under_review is True
    with pytest.raises(openai.APIStatusError) as refused:
        swarm.client.completions.create(model=swarm.model, prompt="Count to ten", max_tokens=4, temperature=0)
    assert refused.value.status_code == 503


def test_honest_bfloat16_agents_get_no_strike_over_30_challenges_or_their_audits(make_swarm):
    # Each challenge is a job of a real prompt: some 30 to 170 rows of each node's span graded, where
    # the one-stage challenges of 8 rows this once ran 200 of took 1,600 in all.
    swarm = make_swarm(cheat=None, dtype="bfloat16", model="smollm2-135m", max_layers=10)
    nodes = list(Node.objects.filter(pk__in=[n.pk for n in swarm.nodes.values()]))

    started = time.monotonic()
    decided = [swarm.challenge(nodes[i % 3], seed=i) for i in range(CHALLENGES)]

    assert [c.state for c in decided] == [CheckState.PASSED] * CHALLENGES
    # Against the float32 reference itself, not the bfloat16 fallback.
    assert {c.metrics["reference"] for c in decided} == {"float32"}
    assert Strike.objects.count() == 0

    # Live audits of real text: every stage of every job replayed, no strike.
    jobs = [swarm.run_job(prompt) for prompt in ("What is the capital of France?", "Name three rivers.")]
    audits = Audit.objects.filter(job__in=jobs)
    assert audits.count() == 6
    assert {a.state for a in audits} == {CheckState.PASSED}
    assert Strike.objects.count() == 0
    worst = min(c.metrics["min_cosine"] for c in decided)
    worst_norm = max(c.metrics["max_rel_norm"] for c in decided)
    print(
        f"{CHALLENGES} bf16 challenges in {time.monotonic() - started:.1f}s; worst token cosine {worst:.6f}, "
        f"worst relative norm difference {worst_norm:.6f}"
    )
