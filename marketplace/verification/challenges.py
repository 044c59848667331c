"""Challenges: jobs the verifier runs to check one node, which the node cannot tell from a customer's.

``send_challenge`` opens one for a node that serves a ready block (at random times,
``send_due_challenges``) and, once that commits, runs it (``run_challenge``: in a thread of this
process, or as a Celery task on the queue "verify"). The run is a real job
(``worker_agent.coordinator.challenger``): a request copying the model's recent real jobs, with a
prompt of the challenge's own (``traffic.py``), through a route laid out like the node's pipeline
(``challenge_route``), in which every span but the node's is served by a node the operator trusts or
by a stand-in stage the verifier runs on its trusted blocks. The coordinator keeps the node's exact
inputs and outputs, which its receipt signs; they are stored (``record_challenge_output``) and
``verify_challenge`` recomputes the node's span on the same inputs and compares per token (float32,
then bfloat16 before it fails). A node that cannot be reached, refuses, errs, stalls past the
deadline, or signs a receipt that does not match the traffic fails it (``fail_challenge``);
``expire_challenges`` fails those left without an outcome past their deadline. A failure opens a
strike. A failure of the verifier's own stages is an error, with no verdict on the node.
A memory challenge (``holding.py``) grades each session; a refusal for room is a capacity verdict."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import random
import secrets
import threading
from datetime import timedelta

from celery import current_app
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from nacl.signing import SigningKey

from marketplace.nodes.authority import coordinator_tls
from marketplace.nodes.live import notify_node_changed
from marketplace.nodes.models import Node, NodeState
from marketplace.nodes.tickets import issuer_key, issuer_public_key, job_ticket_expiry, ticket_for
from marketplace.placement.lifecycle import record_measured_speed
from marketplace.placement.models import LIVE_STATES, Assignment, AssignmentState
from marketplace.verification.claims import failed_to_hold, held_memory
from marketplace.verification.dispatch import CHALLENGE_RUN_TASK, CHALLENGE_TASK, thresholds, verify_after_commit
from marketplace.verification.errors import NotChallengeable
from marketplace.verification.holding import held_requests, memory_challenge, pack_materials, unpack_materials
from marketplace.verification.models import Challenge, CheckState, StrikeKind
from marketplace.verification.prompts import prompt_pool
from marketplace.verification.strikes import open_strike, strike_false_capacity_claim
from marketplace.verification.traffic import draw_request, recent_shapes
from marketplace.verification.verifier import FALLBACK_DTYPE, trusted_block
from worker_agent.coordinator.challenger import (
    DEADLINE,
    VERIFIER,
    ChallengeRequest,
    ChallengeRoute,
    HoldRefused,
    NodeFailed,
    StandIn,
    TrustedStage,
    run_challenge_job,
)
from worker_agent.coordinator.job import encode_prompt
from worker_agent.coordinator.speculation import SpeculationSettings
from worker_agent.errors import ChallengeError
from worker_agent.protocol import challenge as challenges
from worker_agent.protocol.audit import AuditMaterial
from worker_agent.protocol.keys import node_id, public_key_bytes
from worker_agent.protocol.receipts import StageAssignment
from worker_agent.protocol.span import Span

log = logging.getLogger("swarm.verification")


def _ready_assignment(node: Node) -> Assignment | None:
    return Assignment.objects.filter(node=node, state=AssignmentState.READY).order_by("-ready_at").first()


@transaction.atomic
def open_challenge(
    node: Node, *, tokens: int | None = None, seed: int | None = None, memory: bool = False
) -> Challenge:
    """A new challenge of the span a node serves, not run yet; raises NotChallengeable. ``tokens``:
    the completion tokens its request asks for (None: as many as the real job it copies);
    ``memory``: a memory challenge (see the module)."""
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
        **({"tokens": tokens or 0} | (memory_challenge(node, assignment) if memory else {})),
        sent_at=now,
        deadline_at=now + timedelta(seconds=settings.SWARM_CHALLENGE_DEADLINE_S),
    )


@transaction.atomic
def send_challenge(
    node: Node, *, tokens: int | None = None, seed: int | None = None, memory: bool = False
) -> Challenge:
    """Open a challenge for a node and run it once this commits; raises NotChallengeable."""
    challenge = open_challenge(node, tokens=tokens, seed=seed, memory=memory)
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
        memory = rng.random() < settings.SWARM_MEMORY_CHALLENGE_SHARE
        try:
            sent.append(send_challenge(node, memory=memory).pk)
        except NotChallengeable:
            continue
    return sent


def run_challenge(challenge_pk: int) -> Challenge:
    """Run an open challenge as a job through the node and the stages around it (trusted nodes' or
    the verifier's stand-ins), and record its outcome. Blocking (up to the challenge's deadline): call
    it from a worker thread or a Celery task, never from an event loop."""
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
        return _no_verdict(challenge_pk, "the node no longer serves the challenged span")
    try:
        route = challenge_route(challenge, assignment)
        tokenizer = models_tokenizer(challenge.model)
        drawn = draw_request(
            random.Random(challenge.seed),
            recent_shapes(challenge.model),
            prompt_pool(),
            lambda prompt, chat: encode_prompt(tokenizer, prompt, chat=chat),
            max_tokens=challenge.tokens or None,
        )
        request: ChallengeRequest | tuple[ChallengeRequest, ...] = drawn.request
        if challenge.positions:
            request, drawn = held_requests(challenge, tokenizer), dataclasses.replace(drawn, pace=None)
    except Exception as exc:  # the verifier's own failure is not the node's
        log.exception("challenge %s could not be prepared", challenge_pk)
        return _no_verdict(challenge_pk, f"verifier failed: {exc}")
    Challenge.objects.filter(pk=challenge_pk, tokens=0).update(tokens=drawn.request.max_tokens)
    # A key of its own for this job, as every job's coordinator has; its tickets expire as a job's do,
    # counted from when they are signed, just before the job connects (its stand-ins are up by then).
    coordinator_key = SigningKey.generate()
    expiry: list[float] = []

    def ticket(stage: StageAssignment) -> bytes:
        expiry[:] = expiry or [job_ticket_expiry()]
        return ticket_for(
            job=drawn.job,
            node=stage.node,
            span=Span(challenge.model, stage.layer_start, stage.layer_end),
            coordinator_key=bytes(coordinator_key.verify_key),
            expires_at=expiry[0],
        )

    left = max((challenge.deadline_at - timezone.now()).total_seconds(), 0.1)
    tls = coordinator_tls()
    try:
        run = asyncio.run(
            run_challenge_job(
                route,
                request,
                job=drawn.job,
                tickets=ticket,
                issuer_key=issuer_public_key(),
                coordinator_key=coordinator_key,
                timeout_s=left,
                host=settings.SWARM_CHALLENGE_HOST,
                tls=tls,
                peer_tls=tls,
                # As every job's coordinator speculates (jobs.coordinator_inputs.speculation_settings).
                speculation=SpeculationSettings(
                    enabled=settings.SWARM_SPECULATION == "auto", draft_model=settings.SWARM_DRAFT_MODEL
                ),
                stall_timeout_s=settings.SWARM_STALL_TIMEOUT_S,
                pace=drawn.pace,
            )
        )
    except HoldRefused as exc:
        return failed_to_hold(challenge_pk, exc.asked, f"{exc} ({exc.code})")
    except NodeFailed as exc:
        if exc.code == DEADLINE and challenge.positions:  # its length is the verifier's choice, its time the route's
            return _no_verdict(challenge_pk, f"the memory challenge outlasted its deadline: {exc}")
        return fail_challenge(challenge_pk, f"{exc} ({exc.code})", expired=exc.code == DEADLINE)
    except ChallengeError as exc:
        if exc.code != VERIFIER:
            raise
        log.warning("challenge %s: no verdict: %s", challenge_pk, exc)
        return _no_verdict(challenge_pk, str(exc))
    except Exception as exc:  # the verifier's own failure (a stand-in that would not start, a bug)
        log.exception("challenge %s: the job failed on the verifier's side", challenge_pk)
        return _no_verdict(challenge_pk, f"verifier failed: {type(exc).__name__}: {exc}")
    return record_challenge_output(challenge_pk, run.material, elapsed_ms=run.elapsed_s * 1e3, more=run.materials[1:])


def _no_verdict(challenge_pk: int, reason: str) -> Challenge:
    Challenge.objects.filter(pk=challenge_pk, state=CheckState.SENT).update(
        state=CheckState.ERROR, reason=reason[:1000], checked_at=timezone.now()
    )
    return Challenge.objects.get(pk=challenge_pk)


def stand_in_key(span: Span) -> SigningKey:
    """The node key of the verifier's stand-in for a span: the same one at every challenge (a stage
    of a real route is a node the swarm knows, not a new one each time), derived from the ticket key."""
    named = f"{span.model}\0{span.start}:{span.end}".encode()
    return SigningKey(hashlib.sha256(b"swarm-stand-in-v1\0" + bytes(issuer_key()) + named).digest())


def stand_in_node(span: Span) -> str:
    """The node id the verifier's stand-in for a span goes by."""
    return node_id(public_key_bytes(stand_in_key(span)))


def _stand_in(span: Span) -> StandIn:
    return StandIn(trusted_block(span), stand_in_key(span))


def _stage_assignment(node: Node, layer_start: int, layer_end: int) -> StageAssignment:
    # A node that holds an assignment has joined: it has an id and a public key.
    assert node.node_id is not None and node.public_key is not None
    return StageAssignment(node.node_id, bytes.fromhex(node.public_key), layer_start, layer_end)


def challenge_route(challenge: Challenge, assignment: Assignment) -> ChallengeRoute:
    """The route of a challenge's job: laid out like the node's own pipeline, the node on its span and
    on each other one a trusted node serving it (``SWARM_CHALLENGE_TRUSTED_NODES``), else a stand-in."""
    others = (
        Assignment.objects.filter(
            model=challenge.model, generation=assignment.generation, pipeline=assignment.pipeline, is_spare=False
        )
        .filter(state__in=LIVE_STATES)
        .exclude(pk=assignment.pk)
        .values_list("layer_start", "layer_end")
    )
    spans = route_spans((challenge.layer_start, challenge.layer_end), list(others), models_layers(challenge.model))
    trusted = {
        (held.layer_start, held.layer_end): TrustedStage(
            _stage_assignment(held.node, held.layer_start, held.layer_end),
            held.data_url,
        )
        for held in Assignment.objects.filter(
            model=challenge.model,
            state=AssignmentState.READY,
            node__node_id__in=settings.SWARM_CHALLENGE_TRUSTED_NODES,
            node__state=NodeState.ACTIVE,
            node__connected=True,
        )
        .exclude(node=challenge.node)
        .exclude(data_url="")
        .select_related("node")
    }
    node = challenge.node
    return ChallengeRoute(
        challenge.model,
        _stage_assignment(node, challenge.layer_start, challenge.layer_end),
        assignment.data_url,
        tuple(trusted.get((start, end)) or _stand_in(Span(challenge.model, start, end)) for start, end in spans),
    )


def route_spans(node: tuple[int, int], others: list[tuple[int, int]], n_layers: int) -> list[tuple[int, int]]:
    """The spans, other than the node's, of a route over ``n_layers`` laid out like the node's
    pipeline: each other stage's span that fits before or after the node without overlap, in layer
    order, and one span for each gap left."""
    spans: list[tuple[int, int]] = []
    for low, high in ((0, node[0]), (node[1], n_layers)):
        position = low
        for start, end in sorted(others):
            if start >= position and end <= high:
                if start > position:
                    spans.append((position, start))
                spans.append((start, end))
                position = end
        if position < high:
            spans.append((position, high))
    return spans


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
def record_challenge_output(
    challenge_pk: int, material: AuditMaterial, *, elapsed_ms: float, more: tuple[AuditMaterial, ...] = ()
) -> Challenge:
    """Store what the coordinator kept of the node's part of an open challenge's job (its inputs and
    outputs, step by step, checked against its receipt) and verify it once this commits; material
    of another node, model or span fails, and so does an answer past the deadline, with a strike.
    ``elapsed_ms``: the node's own share of the job's time; ``more``: a memory challenge's other
    sessions' material, one for each."""
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
    expected = (challenge.node.node_id, challenge.model, challenge.layer_start, challenge.layer_end)
    materials = (material, *more)
    found = {(one.node, one.model, one.layer_start, one.layer_end) for one in materials} - {expected}
    if found or len(materials) != challenge.sessions:
        challenge.state, challenge.checked_at = CheckState.FAILED, now
        of = f"of {min(found)}" if found else f"of {len(materials)} sessions"
        challenge.reason = f"malformed answer: the material is {of}, not {expected}"
        challenge.save()
        open_strike(challenge.node, StrikeKind.CHALLENGE, challenge=challenge, evidence=_challenge_evidence(challenge))
        return challenge
    challenge.output = material.to_bytes() if not more else pack_materials(materials)
    challenge.state = CheckState.ANSWERED
    challenge.save()
    verify_after_commit(CHALLENGE_TASK, verify_challenge, challenge.pk)
    return challenge


def models_hidden_size(model: str) -> int:
    # Imported here to keep torch out of the import of this module (the web process loads it lazily).
    from worker_agent import model as models

    return int(models.load_config(model).hidden_size)


def models_layers(model: str) -> int:
    from worker_agent import model as models  # torch stays out of this module's import (models_hidden_size)

    return models.n_layers(model)


def models_tokenizer(model: str):
    from worker_agent import model as models  # torch stays out of this module's import (models_hidden_size)

    return models.load_tokenizer(model)


def verify_challenge(challenge_pk: int) -> Challenge:
    """Recompute the node's span on the inputs it was sent and compare its outputs per token; a
    failure opens a strike."""
    challenge = Challenge.objects.get(pk=challenge_pk)
    if challenge.state != CheckState.ANSWERED:
        return challenge
    try:
        assert challenge.output is not None  # an answered challenge keeps the material it was answered with
        materials = unpack_materials(bytes(challenge.output), challenge.sessions)
        material = materials[0]
        for material in materials:  # the first that fails decides; all passed, the last's figures stand
            comparison, reference_dtype = _graded(challenge, material)
            if not comparison.passed:
                break
    except Exception as exc:  # the verifier's own failure is not the node's (its rows were checked as they came)
        log.exception("cannot recompute challenge %s", challenge_pk)
        Challenge.objects.filter(pk=challenge_pk, state=CheckState.ANSWERED).update(
            state=CheckState.ERROR, reason=f"verifier failed: {exc}", checked_at=timezone.now()
        )
        return Challenge.objects.get(pk=challenge_pk)
    with transaction.atomic():
        challenge = Challenge.objects.select_for_update().get(pk=challenge_pk)
        if challenge.state != CheckState.ANSWERED:
            return challenge
        challenge.metrics = {**comparison.to_dict(), "reference": reference_dtype}
        challenge.checked_at = timezone.now()
        if comparison.passed:
            challenge.state = CheckState.PASSED
            # Timed by the verifier, the node's share of each step of the job of the right answer: a
            # speed the node proved, not claimed.
            took = (challenge.elapsed_ms or 0.0) / 1000.0
            if took > 0:
                layers = challenge.layer_end - challenge.layer_start
                tokens = sum(one.tokens for one in materials)
                record_measured_speed(challenge.node_id, layers * tokens / took)
            if challenge.positions:
                proven = held_memory(challenge, sum(one.tokens for one in materials))
                challenge.metrics["proven_memory_bytes"] = proven
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


def _graded(challenge: Challenge, material: AuditMaterial) -> tuple[challenges.Comparison, str]:
    """One session's material replayed on the trusted block: in float32, then in bfloat16 before it fails."""
    block = trusted_block(challenge.span)
    comparison = challenges.grade(material, block, **thresholds())
    if comparison.passed:
        return comparison, "float32"
    block = trusted_block(challenge.span, FALLBACK_DTYPE)
    fallback = challenges.grade(material, block, **thresholds())
    return (fallback, FALLBACK_DTYPE) if fallback.passed else (comparison, "float32")


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
