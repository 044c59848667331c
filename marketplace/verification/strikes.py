"""Strikes: a failed check opens one (it withholds the node's pending pay); an admin upholds it (the
node's pending earnings are clawed back, past the threshold the node is ejected) or overturns it with
a reason; strikes left unreviewed past the review period are upheld."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from marketplace.accounts import notices
from marketplace.billing.display import nano_text
from marketplace.nodes.live import notify_admins
from marketplace.nodes.models import Node
from marketplace.payouts.services import claw_back, release_earnings
from marketplace.placement.lifecycle import eject_node
from marketplace.verification.errors import StrikeDecisionRefused
from marketplace.verification.models import Audit, CheckState, Strike, StrikeKind, StrikeState
from marketplace.verification.standing import refresh_reputation

log = logging.getLogger("swarm.verification")


def open_strike(node: Node, kind: str, *, challenge=None, audit=None, job=None, evidence: dict) -> Strike:
    """Open a strike: the node's pending pay is withheld, and it leaves routing at once, until
    every open strike on it is decided (``_review_state``)."""
    strike = Strike.objects.create(node=node, kind=kind, challenge=challenge, audit=audit, job=job, evidence=evidence)
    Node.objects.filter(pk=node.pk).update(under_review=True)
    log.warning("strike %s on node %s: %s", strike.pk, node.node_id, evidence.get("reason"))
    transaction.on_commit(lambda: refresh_reputation(node.pk))
    notify_admins("strike")
    notices.notify(
        node.owner_id,
        f"A strike on your node {node.name}",
        f"Your node {node.name} failed a check: {evidence.get('reason') or kind}.\n"
        "It is off routing and its pending pay is withheld until an admin decides the strike "
        f"(it is upheld on its own after {settings.SWARM_STRIKE_REVIEW_S / 3600:g} hours if nobody does). "
        "The evidence is on the node's page of your dashboard.",
    )
    return strike


@transaction.atomic
def uphold_strike(strike: Strike, *, by=None, reason: str = "") -> Strike:
    """Uphold an open strike: claw back the node's pending earnings, eject past the threshold."""
    if by is not None and not by.is_staff:
        raise StrikeDecisionRefused("only admins decide strikes")
    strike = Strike.objects.select_for_update().get(pk=strike.pk)
    if strike.state != StrikeState.OPEN:
        raise StrikeDecisionRefused(f"strike {strike.pk} is already {strike.state}")
    strike.state = StrikeState.UPHELD
    strike.decided_at = timezone.now()
    strike.decided_by = by
    strike.decision_reason = reason or ("upheld by an admin" if by else "upheld: not reviewed within the review period")
    strike.clawed_back = claw_back(strike.node, strike)
    strike.save()
    _review_state(strike.node_id)
    since = strike.decided_at - timedelta(days=settings.SWARM_STRIKE_PERIOD_DAYS)
    upheld = Strike.objects.filter(node=strike.node, state=StrikeState.UPHELD, decided_at__gte=since).count()
    if upheld >= settings.SWARM_STRIKES_TO_EJECT:
        eject_node(strike.node, reason=f"{upheld} upheld strikes within {settings.SWARM_STRIKE_PERIOD_DAYS:g} days")
    transaction.on_commit(lambda: refresh_reputation(strike.node_id))
    notify_admins("strike")
    _notify_decided(strike)
    return strike


@transaction.atomic
def overturn_strike(strike: Strike, *, by, reason: str) -> Strike:
    """An admin found a strike unjustified; the reason is required and kept."""
    if by is None or not by.is_staff:
        raise StrikeDecisionRefused("only admins decide strikes")
    if not reason or not reason.strip():
        raise StrikeDecisionRefused("overturning a strike needs a reason")
    strike = Strike.objects.select_for_update().get(pk=strike.pk)
    if strike.state != StrikeState.OPEN:
        raise StrikeDecisionRefused(f"strike {strike.pk} is already {strike.state}")
    strike.state = StrikeState.OVERTURNED
    strike.decided_at = timezone.now()
    strike.decided_by = by
    strike.decision_reason = reason.strip()
    strike.save()
    _review_state(strike.node_id)
    transaction.on_commit(lambda: refresh_reputation(strike.node_id))
    notify_admins("strike")
    _notify_decided(strike)
    return strike


def _notify_decided(strike: Strike) -> None:
    node = strike.node
    if strike.state == StrikeState.UPHELD:
        clawed = nano_text(strike.clawed_back)
        outcome = f"was upheld: {strike.decision_reason}. {clawed} of its pending pay was clawed back."
    else:
        outcome = f"was overturned: {strike.decision_reason}. Its withheld pay is released."
    subject = f"The strike on your node {node.name} was decided"
    notices.notify(node.owner_id, subject, f"The strike on {node.name} {outcome}")


def _review_state(node_pk: int) -> None:
    """A decided strike returns its node to routing once no other strike on it is open (an
    ejected node stays out by its state)."""
    open_ones = Strike.objects.filter(node_id=node_pk, state=StrikeState.OPEN)
    Node.objects.filter(pk=node_pk).update(under_review=open_ones.exists())


def uphold_overdue_strikes(now=None) -> list[int]:
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.SWARM_STRIKE_REVIEW_S)
    upheld = []
    for strike in Strike.objects.filter(state=StrikeState.OPEN, created_at__lte=cutoff):
        try:
            uphold_strike(strike)
            upheld.append(strike.pk)
        except StrikeDecisionRefused:  # decided meanwhile
            continue
    return upheld


def release_earnings_in_good_standing(now=None) -> int:
    """Earnings past their challenge window become available, except a node's with an open strike
    (withheld until the strike is decided) and a job's whose audits are not all passed
    (``withheld_earnings``). Returns how many were released."""
    withheld = Strike.objects.filter(state=StrikeState.OPEN).values("node_id")
    return release_earnings(now, withheld=withheld, unless=withheld_earnings())


def withheld_earnings():
    """What keeps an earning pending, as a condition on the earning's job and node: its job has an
    audit not yet passed or failed (pending, or one the verifier could not check), or its node
    failed an audit in that job (the strike decides what happens to it)."""
    unchecked = Audit.objects.filter(job_id=OuterRef("job_id"), state__in=[CheckState.PENDING, CheckState.ERROR])
    failed = Audit.objects.filter(job_id=OuterRef("job_id"), node_id=OuterRef("node_id"), state=CheckState.FAILED)
    return Exists(unchecked) | Exists(failed)


@transaction.atomic
def strike_false_capacity_claim(node_pk: int, challenge) -> Strike | None:
    """The node claims more than SWARM_SPEED_FALSE_CLAIM times the best speed it has proved (a
    passed challenge's timing, a lower bound): its claim is a lie placement already does not
    believe (``nodes.capacity``), and it gets a strike, once while one is open, with ``challenge``
    (the one just passed) as its evidence. Only once SWARM_SPEED_EVIDENCE_CHALLENGES challenges
    have passed: load on the node's machine only slows a challenge, so the best of several is the
    proof, and an honest node on a busy machine is not struck for one slow one (it is capped anyway)."""
    node = Node.objects.get(pk=node_pk)
    proven, claim = node.verified_layer_tokens_per_s, node.compute_layer_tokens_per_s
    if not proven or claim <= settings.SWARM_SPEED_FALSE_CLAIM * proven:
        return None
    if node.challenges.filter(state=CheckState.PASSED).count() < settings.SWARM_SPEED_EVIDENCE_CHALLENGES:
        return None
    if node.strikes.filter(kind=StrikeKind.CAPACITY, state=StrikeState.OPEN).exists():
        return None
    return open_strike(
        node,
        str(StrikeKind.CAPACITY),
        challenge=challenge,
        evidence={
            "kind": "capacity",
            "reason": f"claims {claim:.4g} layer-tokens/s, {claim / proven:.0f}x the {proven:.4g} it proved",
            "claimed_layer_tokens_per_s": claim,
            "proven_layer_tokens_per_s": proven,
        },
    )


@transaction.atomic
def strike_unverifiable_receipts(job, node_id: str, reason: str) -> Strike | None:
    """A node made a job's receipts fail verification, unambiguously (it sent no receipt of its own,
    an unreadable or badly signed one, or one contradicting what the coordinator sent it or
    received from it): the job pays nobody, and the node that caused it gets a strike."""
    node = Node.objects.filter(node_id=node_id).first()
    if node is None or node_id not in {stage["node"] for stage in job.route}:
        return None
    return open_strike(
        node,
        str(StrikeKind.RECEIPT),
        job=job,
        evidence={"kind": "receipt", "job": job.public_id, "reason": reason[:2000]},
    )


@transaction.atomic
def strike_misconduct(job, misconduct: list) -> list[Strike]:
    """Each breach of the protocol a node of the job's route proved against itself with its own
    signatures (``worker_agent.protocol.links.Misconduct``, checked by the job's coordinator): one strike
    per node and kind, with the signatures as evidence; whatever became of the job."""
    route = {stage["node"] for stage in job.route}
    strikes, seen = [], set()
    for breach in misconduct:
        node = Node.objects.filter(node_id=breach.node).first()
        if node is None or breach.node not in route or (breach.node, breach.code) in seen:
            continue
        seen.add((breach.node, breach.code))
        evidence = {
            "kind": breach.code,
            "job": job.public_id,
            "reason": breach.reason,
            "signatures": breach.evidence.hex(),
        }
        strikes.append(open_strike(node, str(StrikeKind.PROTOCOL), job=job, evidence=evidence))
    return strikes
