"""Spot-check use cases: challenges, live audits and strikes (reputation and check rates: standing.py).

- ``send_challenge`` pushes a seeded challenge to a node that serves a ready block;
  ``record_challenge_answer`` stores its answer and ``verify_challenge`` compares it per token
  with the trusted recompute. ``expire_challenges`` fails the unanswered ones past their deadline.
- ``choose_audit_stages`` picks, at admission, which stages of a job are audited (each node at its
  own rate; every session is tapped, so nodes cannot tell); ``record_audits`` stores the material
  the coordinator kept and ``verify_audit`` checks its hashes against the node's signed receipt
  and replays it on the trusted block.
- A failed check opens a ``Strike`` (it withholds the node's pending pay); ``uphold_strike`` claws
  back the node's pending earnings and ejects it past the threshold; ``overturn_strike`` needs a
  reason. ``review`` (periodic) expires challenges, upholds strikes left unreviewed past the review
  period and refreshes every node's reputation and check rates (``standing.py``).
"""

from __future__ import annotations

import logging
import random
import secrets
from datetime import timedelta

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node, NodeState
from marketplace.nodes.services import push
from marketplace.payouts.services import claw_back, release_earnings
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.placement.services import eject_node
from marketplace.verification.errors import InvalidAnswer, NotChallengeable, StrikeDecisionRefused
from marketplace.verification.models import Audit, Challenge, CheckState, Strike, StrikeKind, StrikeState
from marketplace.verification.receipts import job_receipts
from marketplace.verification.standing import refresh_reputation
from marketplace.verification.verifier import FALLBACK_DTYPE, trusted_block
from worker_agent import challenge as challenges
from worker_agent import control_protocol as protocol
from worker_agent.audit import AuditFailed, AuditMaterial
from worker_agent.audit import verify_audit as replay_audit
from worker_agent.errors import SwarmError

log = logging.getLogger("swarm.verification")

MAX_ANSWER_CHARS = 4 * 1024 * 1024  # base64 of the largest answer we ask for, with room
CHALLENGE_TASK = "marketplace.verification.tasks.verify_challenge"  # Celery task names, queue "verify"
AUDIT_TASK = "marketplace.verification.tasks.verify_audit"


def _thresholds() -> dict:
    return {"min_cosine": settings.SWARM_CHECK_MIN_COSINE, "max_rel_norm": settings.SWARM_CHECK_MAX_REL_NORM}


def _dispatch(task_name: str, pk: int) -> None:
    """Run a check after the current transaction commits: here (inline) or on the verify queue."""
    if settings.SWARM_VERIFIER == "inline" or current_app.conf.task_always_eager:
        fn = {"challenge": verify_challenge, "audit": verify_audit}[task_name]
        transaction.on_commit(lambda: fn(pk))
        return
    # Sent by name: tasks.py imports this module to run the checks.
    name = {"challenge": CHALLENGE_TASK, "audit": AUDIT_TASK}[task_name]
    transaction.on_commit(lambda: current_app.send_task(name, args=[pk], queue="verify"))


# --- challenges -----------------------------------------------------------------------------------


def _ready_assignment(node: Node) -> Assignment | None:
    return Assignment.objects.filter(node=node, state=AssignmentState.READY).order_by("-ready_at").first()


@transaction.atomic
def send_challenge(node: Node, *, tokens: int | None = None, seed: int | None = None) -> Challenge:
    """Push a seeded challenge to a node serving a ready block; raises NotChallengeable."""
    assignment = _ready_assignment(node)
    if assignment is None or not node.connected or node.state != NodeState.ACTIVE:
        raise NotChallengeable(f"node {node.node_id} serves no ready block to challenge")
    now = timezone.now()
    challenge = Challenge.objects.create(
        node=node,
        model=assignment.model,
        layer_start=assignment.layer_start,
        layer_end=assignment.layer_end,
        seed=secrets.randbits(63) if seed is None else seed,
        tokens=tokens or settings.SWARM_CHALLENGE_TOKENS,
        sent_at=now,
        deadline_at=now + timedelta(seconds=settings.SWARM_CHALLENGE_DEADLINE_S),
    )
    push(
        node.node_id,
        protocol.to_wire(
            protocol.Challenge(
                challenge=challenge.pk,
                seed=challenge.seed,
                tokens=challenge.tokens,
                model=challenge.model,
                layer_start=challenge.layer_start,
                layer_end=challenge.layer_end,
            )
        ),
    )
    notify_node_changed(node.pk)  # the provider's page lists the challenge as sent
    return challenge


def send_due_challenges(now=None, rng: random.Random | None = None) -> list[int]:
    """Challenge every serving node whose next challenge is due. The gap to the next one is drawn
    from an exponential distribution at the node's rate, so the schedule cannot be predicted."""
    now = now or timezone.now()
    rng = rng or random.SystemRandom()
    sent = []
    serving = Node.objects.filter(
        state=NodeState.ACTIVE, connected=True, assignments__state=AssignmentState.READY
    ).distinct()
    for node in serving:
        per_day = node.challenges_per_day or settings.SWARM_CHALLENGES_MIN_PER_DAY
        if per_day <= 0:
            continue
        # Memoryless: over one scheduling interval a node is due with probability rate x interval.
        if rng.random() >= per_day * settings.SWARM_TRUST_INTERVAL_S / 86400.0:
            continue
        try:
            sent.append(send_challenge(node).pk)
        except NotChallengeable:
            continue
    return sent


@transaction.atomic
def record_challenge_answer(node_pk: int, message: dict) -> Challenge:
    """Store a node's answer to its own open challenge; raises InvalidAnswer, changing nothing."""
    challenge_pk = message.get("challenge")
    if not isinstance(challenge_pk, int) or isinstance(challenge_pk, bool):
        raise InvalidAnswer("challenge_result needs the integer id of the challenge")
    challenge = Challenge.objects.select_for_update().filter(pk=challenge_pk, node_id=node_pk).first()
    if challenge is None:
        raise InvalidAnswer(f"challenge {challenge_pk} was not sent to this node")
    if challenge.state != CheckState.SENT:
        raise InvalidAnswer(f"challenge {challenge_pk} is already {challenge.state}")
    now = timezone.now()
    challenge.answered_at = now
    elapsed = message.get("elapsed_ms")
    numeric = isinstance(elapsed, int | float) and not isinstance(elapsed, bool)
    challenge.elapsed_ms = float(elapsed) if numeric else None
    if now > challenge.deadline_at:
        challenge.state, challenge.reason = CheckState.EXPIRED, "answered after the deadline"
        challenge.checked_at = now
        challenge.save()
        _open_strike(challenge.node, StrikeKind.CHALLENGE, challenge=challenge, evidence=_challenge_evidence(challenge))
        return challenge
    if "error" in message:
        # The node says it cannot compute it: no answer is a failed challenge.
        challenge.state = CheckState.FAILED
        challenge.reason = f"the node refused: {str(message.get('error'))[:500]} ({str(message.get('code'))[:64]})"
        challenge.checked_at = now
        challenge.save()
        _open_strike(challenge.node, StrikeKind.CHALLENGE, challenge=challenge, evidence=_challenge_evidence(challenge))
        return challenge
    output = message.get("output")
    if not isinstance(output, str) or len(output) > MAX_ANSWER_CHARS:
        raise InvalidAnswer("challenge_result needs the output as a base64 string")
    hidden = models_hidden_size(challenge.model)
    try:
        tensor = challenges.decode_output(output, challenge.tokens, hidden)
    except SwarmError as exc:
        challenge.state, challenge.reason, challenge.checked_at = CheckState.FAILED, f"malformed answer: {exc}", now
        challenge.save()
        _open_strike(challenge.node, StrikeKind.CHALLENGE, challenge=challenge, evidence=_challenge_evidence(challenge))
        return challenge
    challenge.output = tensor.numpy().astype("<f4").tobytes()
    challenge.state = CheckState.ANSWERED
    challenge.save()
    _dispatch("challenge", challenge.pk)
    return challenge


def models_hidden_size(model: str) -> int:
    # Imported here to keep torch out of the import of this module (the web process loads it lazily).
    from worker_agent import model as models

    return int(models.load_config(model).hidden_size)


def verify_challenge(challenge_pk: int) -> Challenge:
    """Compare a stored answer with the trusted recompute; a failure opens a strike."""
    import numpy as np
    import torch

    challenge = Challenge.objects.get(pk=challenge_pk)
    if challenge.state != CheckState.ANSWERED:
        return challenge
    try:
        block = trusted_block(challenge.model, challenge.layer_start, challenge.layer_end)
        reference = challenges.run_challenge(block, challenge.seed, challenge.tokens)
    except Exception as exc:  # the verifier's own failure is not the node's
        log.exception("cannot recompute challenge %s", challenge_pk)
        Challenge.objects.filter(pk=challenge_pk, state=CheckState.ANSWERED).update(
            state=CheckState.ERROR, reason=f"verifier failed: {exc}", checked_at=timezone.now()
        )
        return Challenge.objects.get(pk=challenge_pk)
    output = torch.from_numpy(np.frombuffer(bytes(challenge.output), dtype="<f4").copy()).reshape(reference.shape)
    comparison = challenges.compare(output, reference, **_thresholds())
    reference_dtype = "float32"
    if not comparison.passed:
        block = trusted_block(challenge.model, challenge.layer_start, challenge.layer_end, FALLBACK_DTYPE)
        fallback = challenges.compare(
            output, challenges.run_challenge(block, challenge.seed, challenge.tokens), **_thresholds()
        )
        if fallback.passed:
            comparison, reference_dtype = fallback, FALLBACK_DTYPE
    with transaction.atomic():
        challenge = Challenge.objects.select_for_update().get(pk=challenge_pk)
        if challenge.state != CheckState.ANSWERED:
            return challenge
        challenge.metrics = {**comparison.to_dict(), "reference": reference_dtype}
        challenge.checked_at = timezone.now()
        if comparison.passed:
            challenge.state = CheckState.PASSED
        else:
            challenge.state = CheckState.FAILED
            challenge.reason = "output disagrees with the trusted recompute: " + "; ".join(comparison.failures)
        challenge.save()
        notify_node_changed(challenge.node_id)
        if challenge.state == CheckState.FAILED:
            _open_strike(
                challenge.node, StrikeKind.CHALLENGE, challenge=challenge, evidence=_challenge_evidence(challenge)
            )
    return challenge


def expire_challenges(now=None) -> list[int]:
    """Unanswered challenges past their deadline fail: no answer within the deadline is a failure."""
    now = now or timezone.now()
    expired = []
    for pk in Challenge.objects.filter(state=CheckState.SENT, deadline_at__lt=now).values_list("pk", flat=True):
        with transaction.atomic():
            if Challenge.objects.filter(pk=pk, state=CheckState.SENT).update(
                state=CheckState.EXPIRED, reason="no answer within the deadline", checked_at=now
            ):
                challenge = Challenge.objects.select_related("node").get(pk=pk)
                _open_strike(
                    challenge.node, StrikeKind.CHALLENGE, challenge=challenge, evidence=_challenge_evidence(challenge)
                )
                expired.append(pk)
    return expired


def _challenge_evidence(challenge: Challenge) -> dict:
    return {
        "kind": "challenge",
        "challenge": challenge.pk,
        "seed": str(challenge.seed),
        "tokens": challenge.tokens,
        "model": challenge.model,
        "layers": [challenge.layer_start, challenge.layer_end],
        "state": challenge.state,
        "reason": challenge.reason,
        "sent_at": challenge.sent_at.isoformat(),
        "deadline_at": challenge.deadline_at.isoformat(),
        "answered_at": challenge.answered_at.isoformat() if challenge.answered_at else None,
        "elapsed_ms": challenge.elapsed_ms,
        **challenge.metrics,
    }


# --- live audits ----------------------------------------------------------------------------------


def choose_audit_stages(route: list[dict], rng: random.Random | None = None) -> list[int]:
    """The pipeline positions of a new job to audit: each stage's node at its own audit fraction."""
    rng = rng or random.SystemRandom()
    fractions = dict(
        Node.objects.filter(node_id__in=[s["node"] for s in route]).values_list("node_id", "audit_fraction")
    )
    chosen = []
    for index, stage in enumerate(route):
        fraction = fractions.get(stage["node"])
        if fraction is None:
            fraction = settings.SWARM_AUDIT_NEW_NODE_FRACTION
        if rng.random() < fraction:
            chosen.append(index)
    return chosen


@transaction.atomic
def record_audits(job, materials: list[AuditMaterial]) -> list[int]:
    """Store the material a job's coordinator kept and queue its replay."""
    nodes = {s["node"]: index for index, s in enumerate(job.route)}
    node_pks = dict(Node.objects.filter(node_id__in=list(nodes)).values_list("node_id", "pk"))
    created = []
    for material in materials:
        if material.node not in node_pks or nodes[material.node] != material.stage:
            log.warning("job %s: audit material for %s does not match the route", job.public_id, material.node)
            continue
        audit, new = Audit.objects.get_or_create(
            job=job,
            session=material.session,
            stage=material.stage,
            defaults={
                "node_id": node_pks[material.node],
                "model": job.model,
                "layer_start": material.layer_start,
                "layer_end": material.layer_end,
                "material": material.to_bytes(),
            },
        )
        if new:
            created.append(audit.pk)
            _dispatch("audit", audit.pk)
    return created


def verify_audit(audit_pk: int) -> Audit:
    """Check the material's hashes against the node's signed receipt, then replay it."""
    audit = Audit.objects.select_related("job", "node").get(pk=audit_pk)
    if audit.state != CheckState.PENDING:
        return audit
    try:
        material = AuditMaterial.from_bytes(bytes(audit.material))
        receipt = next(
            (r for r in job_receipts(audit.job) if r.session == material.session and r.node == material.node), None
        )
    except SwarmError as exc:
        return _finish_audit(audit_pk, CheckState.ERROR, f"stored material or receipts unreadable: {exc}", {})
    if receipt is None:
        return _finish_audit(audit_pk, CheckState.ERROR, "the job holds no receipt of this node for the session", {})
    try:
        block = trusted_block(audit.model, audit.layer_start, audit.layer_end)
    except Exception as exc:
        log.exception("cannot load the trusted block for audit %s", audit_pk)
        return _finish_audit(audit_pk, CheckState.ERROR, f"verifier failed: {exc}", {})
    reference_dtype = "float32"
    try:
        try:
            report = replay_audit(material, receipt, block, **_thresholds())
        except AuditFailed as exc:
            if exc.code != "audit_mismatch":
                raise
            fallback = trusted_block(audit.model, audit.layer_start, audit.layer_end, FALLBACK_DTYPE)
            try:
                report = replay_audit(material, receipt, fallback, **_thresholds())
            except AuditFailed:
                raise exc from None  # the float32 replay's evidence is the one on record
            reference_dtype = FALLBACK_DTYPE
    except AuditFailed as exc:  # the node's fault: its bytes disagree with what it signed, or with the replay
        report = exc.report
        metrics = _audit_metrics(report) if report is not None else {}
        return _finish_audit(audit_pk, CheckState.FAILED, f"{exc} ({exc.code})", {**metrics, "code": exc.code})
    except SwarmError as exc:  # malformed material, a wrong trusted block: the verifier's problem, no strike
        log.error("audit %s could not be checked: %s", audit_pk, exc)
        return _finish_audit(audit_pk, CheckState.ERROR, f"{exc} ({exc.code})", {"code": exc.code})
    return _finish_audit(audit_pk, CheckState.PASSED, "", {**_audit_metrics(report), "reference": reference_dtype})


def _audit_metrics(report) -> dict:
    """A replay's report in the same shape as a challenge's comparison (worst values, thresholds)."""
    found = report.to_dict()
    return {
        "passed": found["passed"],
        "min_cosine": found["worst_cosine"],
        "max_rel_norm": found["worst_rel_norm"],
        "required_cosine": found["min_cosine"],
        "allowed_rel_norm": found["max_rel_norm"],
        "steps": found["steps"],
        "tokens": found["tokens"],
        "first_failure": found["first_failure"],
        "cosine": found["cosine"],
        "rel_norm": found["rel_norm"],
    }


def _finish_audit(audit_pk: int, state: str, reason: str, metrics: dict) -> Audit:
    with transaction.atomic():
        audit = Audit.objects.select_for_update().select_related("node", "job").get(pk=audit_pk)
        if audit.state != CheckState.PENDING:
            return audit
        audit.state, audit.reason, audit.metrics, audit.checked_at = state, reason, metrics, timezone.now()
        audit.save()
        notify_node_changed(audit.node_id)
        if state == CheckState.FAILED:
            _open_strike(
                audit.node,
                StrikeKind.AUDIT,
                audit=audit,
                evidence={
                    "kind": "audit",
                    "audit": audit.pk,
                    "job": audit.job.public_id,
                    "session": audit.session,
                    "stage": audit.stage,
                    "model": audit.model,
                    "layers": [audit.layer_start, audit.layer_end],
                    "reason": reason,
                    "job_finished_at": audit.job.finished_at.isoformat() if audit.job.finished_at else None,
                    "checked_at": audit.checked_at.isoformat(),
                    **metrics,
                },
            )
    return audit


# --- strikes --------------------------------------------------------------------------------------


def _open_strike(node: Node, kind: str, *, challenge=None, audit=None, evidence: dict) -> Strike:
    strike = Strike.objects.create(node=node, kind=kind, challenge=challenge, audit=audit, evidence=evidence)
    log.warning("strike %s on node %s: %s", strike.pk, node.node_id, evidence.get("reason"))
    transaction.on_commit(lambda: refresh_reputation(node.pk))
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
    since = strike.decided_at - timedelta(days=settings.SWARM_STRIKE_PERIOD_DAYS)
    upheld = Strike.objects.filter(node=strike.node, state=StrikeState.UPHELD, decided_at__gte=since).count()
    if upheld >= settings.SWARM_STRIKES_TO_EJECT:
        eject_node(strike.node, reason=f"{upheld} upheld strikes within {settings.SWARM_STRIKE_PERIOD_DAYS:g} days")
    transaction.on_commit(lambda: refresh_reputation(strike.node_id))
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
    transaction.on_commit(lambda: refresh_reputation(strike.node_id))
    return strike


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


# --- periodic ---------------------------------------------------------------------------------------


def release_earnings_in_good_standing(now=None) -> int:
    """Earnings past their challenge window become available, except a node's with an open strike
    (withheld until the strike is decided). Returns how many were released."""
    withheld = Strike.objects.filter(state=StrikeState.OPEN).values("node_id")
    return release_earnings(now, withheld=withheld)


def review(now=None) -> dict:
    """Periodic: expire challenges, uphold strikes left unreviewed, refresh reputations."""
    now = now or timezone.now()
    expired = expire_challenges(now)
    upheld = uphold_overdue_strikes(now)
    refreshed = 0
    for pk in Node.objects.exclude(node_id__isnull=True).values_list("pk", flat=True):
        refresh_reputation(pk, now)
        refreshed += 1
    return {"expired": expired, "upheld": upheld, "refreshed": refreshed}
