"""Seeded challenges, run over the data plane as ordinary sessions of a job.

``send_challenge`` opens one for a node that serves a ready block (at random times,
``send_due_challenges``) and, once that commits, runs it (``run_challenge``: in a thread of this
process, or as a Celery task on the queue "verify"): the control plane acts as a job's coordinator,
with a ticket it signs for a job id shaped like a customer's, and sends the challenge input through
the node's data plane as one session (``worker_agent.coordinator.challenger``). The output is
stored (``record_challenge_output``) and ``verify_challenge`` compares it per token with the
trusted recompute (float32, then bfloat16 before it fails). A node that cannot be reached, refuses,
errs, stalls past the deadline, or signs a receipt that does not match the traffic fails it
(``fail_challenge``); ``expire_challenges`` fails those left without an outcome past their deadline.
A failure opens a strike."""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import threading
import time
import uuid
from datetime import timedelta

from celery import current_app
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from nacl.signing import SigningKey

from marketplace.nodes.authority import coordinator_tls
from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node, NodeState
from marketplace.nodes.services import record_verified_speed
from marketplace.nodes.tickets import TICKET_MARGIN_S, ticket_for
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.verification.dispatch import CHALLENGE_RUN_TASK, CHALLENGE_TASK, thresholds, verify_after_commit
from marketplace.verification.errors import NotChallengeable
from marketplace.verification.models import Challenge, CheckState, StrikeKind
from marketplace.verification.strikes import open_strike, strike_false_capacity_claim
from marketplace.verification.verifier import FALLBACK_DTYPE, trusted_block
from worker_agent import challenge as challenges
from worker_agent.coordinator.challenger import DEADLINE, run_challenge_session
from worker_agent.errors import SwarmError
from worker_agent.receipts import StageAssignment

log = logging.getLogger("swarm.verification")


def _ready_assignment(node: Node) -> Assignment | None:
    return Assignment.objects.filter(node=node, state=AssignmentState.READY).order_by("-ready_at").first()


@transaction.atomic
def open_challenge(node: Node, *, tokens: int | None = None, seed: int | None = None) -> Challenge:
    """A new challenge of the span a node serves, not run yet; raises NotChallengeable."""
    assignment = _ready_assignment(node)
    if assignment is None or not node.connected or node.state != NodeState.ACTIVE:
        raise NotChallengeable(f"node {node.node_id} serves no ready block to challenge")
    now = timezone.now()
    return Challenge.objects.create(
        node=node,
        model=assignment.model,
        layer_start=assignment.layer_start,
        layer_end=assignment.layer_end,
        seed=secrets.randbits(63) if seed is None else seed,
        tokens=tokens or settings.SWARM_CHALLENGE_TOKENS,
        sent_at=now,
        deadline_at=now + timedelta(seconds=settings.SWARM_CHALLENGE_DEADLINE_S),
    )


@transaction.atomic
def send_challenge(node: Node, *, tokens: int | None = None, seed: int | None = None) -> Challenge:
    """Open a challenge for a node and run it once this commits; raises NotChallengeable."""
    challenge = open_challenge(node, tokens=tokens, seed=seed)
    pk = challenge.pk
    if settings.SWARM_VERIFIER == "inline" or current_app.conf.task_always_eager:
        # Its own thread: the exchange waits on the node's network for up to the deadline.
        transaction.on_commit(lambda: threading.Thread(target=_run_in_thread, args=(pk,), daemon=True).start())
    else:
        transaction.on_commit(lambda: current_app.send_task(CHALLENGE_RUN_TASK, args=[pk], queue="verify"))
    notify_node_changed(node.pk)  # the provider's page lists the challenge as sent
    return challenge


def _run_in_thread(challenge_pk: int) -> None:
    try:
        run_challenge(challenge_pk)
    except Exception:
        log.exception("challenge %s could not be run", challenge_pk)
    finally:
        connection.close()  # this thread's own connection: it ends with the thread


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


def challenge_job_id() -> str:
    """A job id for a challenge's session, of the same shape as a customer's chat completion's."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def run_challenge(challenge_pk: int) -> Challenge:
    """Run an open challenge through the node's data plane as one session of a ticketed job and
    record its outcome. Blocking (up to the challenge's deadline): call it from a worker thread or
    a Celery task, never from an event loop."""
    challenge = Challenge.objects.select_related("node").get(pk=challenge_pk)
    if challenge.state != CheckState.SENT:
        return challenge
    node = challenge.node
    assignment = (
        Assignment.objects.filter(
            node=node,
            model=challenge.model,
            layer_start=challenge.layer_start,
            layer_end=challenge.layer_end,
            state=AssignmentState.READY,
        )
        .order_by("-ready_at")
        .first()
    )
    if assignment is None or not assignment.data_url or not node.public_key:
        # Placement moved the block away meanwhile: no verdict on the node either way.
        Challenge.objects.filter(pk=challenge_pk, state=CheckState.SENT).update(
            state=CheckState.ERROR, reason="the node no longer serves the challenged span", checked_at=timezone.now()
        )
        return Challenge.objects.get(pk=challenge_pk)
    job = challenge_job_id()
    left = (challenge.deadline_at - timezone.now()).total_seconds()
    # A key of its own for this session, as every job's coordinator has; the ticket dies with the deadline.
    coordinator_key = SigningKey.generate()
    ticket = ticket_for(
        job=job,
        node=node.node_id,
        model=challenge.model,
        layer_start=challenge.layer_start,
        layer_end=challenge.layer_end,
        coordinator_key=bytes(coordinator_key.verify_key),
        expires_at=time.time() + max(left, 0.1) + TICKET_MARGIN_S,
    )
    try:
        run = asyncio.run(
            run_challenge_session(
                assignment.data_url,
                ticket,
                coordinator_key=coordinator_key,
                job=job,
                model=challenge.model,
                hidden_size=models_hidden_size(challenge.model),
                assignment=StageAssignment(
                    node.node_id, bytes.fromhex(node.public_key), challenge.layer_start, challenge.layer_end
                ),
                seed=challenge.seed,
                tokens=challenge.tokens,
                timeout_s=max(left, 0.1),
                tls=coordinator_tls(),
            )
        )
    except SwarmError as exc:
        return fail_challenge(challenge_pk, f"{exc} ({exc.code})", expired=exc.code == DEADLINE)
    except Exception as exc:  # whatever else the node's answer broke is the node's fault: fail closed
        log.exception("challenge %s: the session failed", challenge_pk)
        return fail_challenge(challenge_pk, f"the session failed: {type(exc).__name__}: {exc}")
    return record_challenge_output(challenge_pk, run.output, elapsed_ms=run.elapsed_s * 1000.0)


@transaction.atomic
def fail_challenge(challenge_pk: int, reason: str, *, expired: bool = False) -> Challenge:
    """A challenge the node did not answer right (unreachable, refused, an error, a bad receipt):
    failed, or expired when its session did not end by the deadline, with a strike. One already
    decided is left as it is."""
    challenge = Challenge.objects.select_for_update().select_related("node").get(pk=challenge_pk)
    if challenge.state != CheckState.SENT:
        return challenge
    now = timezone.now()
    challenge.state = CheckState.EXPIRED if expired else CheckState.FAILED
    challenge.reason = ("no answer within the deadline: " if expired else "") + reason[:1000]
    challenge.answered_at = None
    challenge.checked_at = now
    challenge.save()
    open_strike(challenge.node, StrikeKind.CHALLENGE, challenge=challenge, evidence=_challenge_evidence(challenge))
    notify_node_changed(challenge.node_id)
    return challenge


@transaction.atomic
def record_challenge_output(challenge_pk: int, output, *, elapsed_ms: float) -> Challenge:
    """Store the output a node's data plane returned for an open challenge, (tokens, hidden)
    float32, and verify it once this commits; past the deadline it fails, with a strike."""
    challenge = Challenge.objects.select_for_update().select_related("node").get(pk=challenge_pk)
    if challenge.state != CheckState.SENT:
        return challenge
    now = timezone.now()
    challenge.answered_at = now
    challenge.elapsed_ms = float(elapsed_ms)
    if now > challenge.deadline_at:
        challenge.state, challenge.reason = CheckState.EXPIRED, "answered after the deadline"
        challenge.checked_at = now
        challenge.save()
        open_strike(challenge.node, StrikeKind.CHALLENGE, challenge=challenge, evidence=_challenge_evidence(challenge))
        return challenge
    hidden = models_hidden_size(challenge.model)
    if tuple(output.shape) != (challenge.tokens, hidden):
        challenge.state, challenge.checked_at = CheckState.FAILED, now
        challenge.reason = f"malformed answer: shape {tuple(output.shape)}, not ({challenge.tokens}, {hidden})"
        challenge.save()
        open_strike(challenge.node, StrikeKind.CHALLENGE, challenge=challenge, evidence=_challenge_evidence(challenge))
        return challenge
    challenge.output = output.detach().to("cpu").float().contiguous().numpy().astype("<f4").tobytes()
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
            # Timed here, from the first FORWARD to the last RESULT of the right answer: a speed the
            # node proved, not claimed.
            took = (challenge.elapsed_ms or 0.0) / 1000.0
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
        else:
            strike_false_capacity_claim(challenge.node_id, challenge)
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
