"""Seeded challenges: ``send_challenge`` pushes one to a node that serves a ready block (at random
times, ``send_due_challenges``); ``record_challenge_answer`` stores its answer and ``verify_challenge``
compares it per token with the trusted recompute (float32, then bfloat16 before it fails);
``expire_challenges`` fails the unanswered ones past their deadline. A failure opens a strike."""

from __future__ import annotations

import logging
import random
import secrets
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node, NodeState
from marketplace.nodes.services import push, record_verified_speed
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.verification.dispatch import CHALLENGE_TASK, thresholds, verify_after_commit
from marketplace.verification.errors import InvalidAnswer, NotChallengeable
from marketplace.verification.models import Challenge, CheckState, StrikeKind
from marketplace.verification.strikes import open_strike
from marketplace.verification.verifier import FALLBACK_DTYPE, trusted_block
from worker_agent import challenge as challenges
from worker_agent import control_protocol as protocol
from worker_agent.errors import SwarmError

log = logging.getLogger("swarm.verification")

MAX_ANSWER_CHARS = 4 * 1024 * 1024  # base64 of the largest answer we ask for, with room


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
    challenge.elapsed_ms = float(elapsed) if numeric and elapsed is not None else None
    if now > challenge.deadline_at:
        challenge.state, challenge.reason = CheckState.EXPIRED, "answered after the deadline"
        challenge.checked_at = now
        challenge.save()
        open_strike(challenge.node, StrikeKind.CHALLENGE, challenge=challenge, evidence=_challenge_evidence(challenge))
        return challenge
    if "error" in message:
        # The node says it cannot compute it: no answer is a failed challenge.
        challenge.state = CheckState.FAILED
        challenge.reason = f"the node refused: {str(message.get('error'))[:500]} ({str(message.get('code'))[:64]})"
        challenge.checked_at = now
        challenge.save()
        open_strike(challenge.node, StrikeKind.CHALLENGE, challenge=challenge, evidence=_challenge_evidence(challenge))
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
        open_strike(challenge.node, StrikeKind.CHALLENGE, challenge=challenge, evidence=_challenge_evidence(challenge))
        return challenge
    challenge.output = tensor.numpy().astype("<f4").tobytes()
    challenge.state = CheckState.ANSWERED
    challenge.save()
    verify_after_commit(CHALLENGE_TASK, verify_challenge, challenge.pk)
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
    comparison = challenges.compare(output, reference, **thresholds())
    reference_dtype = "float32"
    if not comparison.passed:
        block = trusted_block(challenge.model, challenge.layer_start, challenge.layer_end, FALLBACK_DTYPE)
        fallback = challenges.compare(
            output, challenges.run_challenge(block, challenge.seed, challenge.tokens), **thresholds()
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
            # Timed here, from sending to the right answer: a speed the node proved, not claimed.
            took = (challenge.answered_at - challenge.sent_at).total_seconds() if challenge.answered_at else 0
            if took > 0:
                layers = challenge.layer_end - challenge.layer_start
                record_verified_speed(challenge.node_id, layers * challenge.tokens / took)
        else:
            challenge.state = CheckState.FAILED
            challenge.reason = "output disagrees with the trusted recompute: " + "; ".join(comparison.failures)
        challenge.save()
        notify_node_changed(challenge.node_id)
        if challenge.state == CheckState.FAILED:
            open_strike(
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
                open_strike(
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
