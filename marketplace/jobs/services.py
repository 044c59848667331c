"""API keys and a job's own lifecycle: tokenize, fit the context, start, record tokens, heal, finish.

Every state change is a conditional UPDATE on the job's current state, so a job ends exactly
once even when its coordinator, a client disconnect and a timeout race. Admitting a job (its route
and hold) and settling it are flows across the apps (``marketplace.flows.admission``,
``marketplace.flows.settlement``), which call these.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
from collections.abc import Sequence
from datetime import datetime

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import Case, IntegerField, Q, Value, When
from django.utils import timezone

from marketplace import metrics
from marketplace.jobs import liveness, tools
from marketplace.jobs.coordinator_inputs import json_grammar
from marketplace.jobs.errors import (
    ApiKeyLimitReached,
    ApiKeyNameTaken,
    AuthenticationFailed,
    InvalidRequest,
)
from marketplace.jobs.models import FINAL_STATES, ApiKey, Job, JobState
from marketplace.jobs.params import RequestParams
from marketplace.jobs.route import route_of
from marketplace.jobs.selectors import jobs_in_flight
from marketplace.nodes.models import Node, NodeState, Privacy
from marketplace.placement import healing
from marketplace.placement.allocation import Stage
from marketplace.placement.lifecycle import relay_lost, report_node_failure
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.placement.selectors import context_length, hold_routes, recovering, route_around
from marketplace.verification.audits import choose_audit_stages
from marketplace.verification.claims import refused_positions
from marketplace.verification.failures import record_failure
from marketplace.verification.traffic import kept_step_outputs
from worker_agent import model as models
from worker_agent.coordinator import grammar
from worker_agent.coordinator.job import encode_prompt
from worker_agent.protocol.span import Span

log = logging.getLogger("swarm.jobs")

KEY_PREFIX = "sk-sw-"
PLAYGROUND_KEY_NAME = "Playground (dashboard)"  # kept for the key the dashboard's playground uses
LAST_USED_RESOLUTION_S = 60  # how precisely a key's last_used_at is kept
COORDINATOR_LOST = "coordinator_lost"  # the error code of a job ended by ``settlement.reconcile_jobs``
# Why a response gives up on a job whose coordinator stopped (its process is gone, or the job was
# ended as ``COORDINATOR_LOST``): what its client reads.
COORDINATOR_GONE = (
    "the job's coordinator stopped: the job failed and is not charged; retry the request (with the same "
    "Idempotency-Key, it is charged once)"
)
# A stage's refusal of a session longer than it holds (``worker_agent.kvcache``): a heal with it
# measures the positions the node holds against those it reported (``verification.claims``).
SESSION_TOO_LONG = "session_too_long"
FINAL_EVENT_GRACE_S = 30.0  # how long after a job ended its response still waits for the final event


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@transaction.atomic
def create_api_key(user, name: str, privacy: str = Privacy.ANY) -> tuple[ApiKey, str]:
    """A new key for a customer; the plaintext is returned once and never stored. ``privacy``:
    which nodes every request of the key may be routed through (``set_key_privacy``).

    Refused (``ApiKeyNameTaken``) when the customer has an active key of that name, or the name
    is the playground's; a revoked key's name may be used again. Refused (``ApiKeyLimitReached``)
    when the customer already has SWARM_API_KEYS_PER_ACCOUNT active keys (the playground's own
    key is not counted).
    """
    if name == PLAYGROUND_KEY_NAME:
        raise ApiKeyNameTaken("This name is kept for the playground's own key.", param="name")
    api_key, key = _create_key(user, name, limited=True)
    if privacy != Privacy.ANY:
        set_key_privacy(api_key, privacy)
    return api_key, key


def set_key_privacy(api_key: ApiKey, privacy: str) -> ApiKey:
    """Route every later request of ``api_key`` only through nodes ``privacy`` allows (a request
    may ask for more, never for less: the stricter applies). Jobs in flight keep their routes."""
    if privacy not in Privacy.values:
        raise InvalidRequest(f"'privacy' must be one of {Privacy.values}, got {privacy!r}.", param="privacy")
    ApiKey.objects.filter(pk=api_key.pk).update(privacy=privacy)
    api_key.refresh_from_db()
    return api_key


@transaction.atomic
def create_playground_key(user) -> tuple[ApiKey, str]:
    """The customer's key for the dashboard's playground, under the name no other key may take."""
    return _create_key(user, PLAYGROUND_KEY_NAME, limited=False)


def _create_key(user, name: str, *, limited: bool) -> tuple[ApiKey, str]:
    if not user.is_customer:
        raise InvalidRequest("only customers can create API keys", code="not_a_customer")
    # Lock the customer's row so two requests creating the same name at once cannot both pass the check.
    get_user_model().objects.select_for_update().filter(pk=user.pk).first()
    active = ApiKey.objects.filter(user=user, revoked_at__isnull=True)
    if active.filter(name=name).exists():
        raise ApiKeyNameTaken("You already have an active key with this name.", param="name")
    limit = settings.SWARM_API_KEYS_PER_ACCOUNT
    if limited and active.exclude(name=PLAYGROUND_KEY_NAME).count() >= limit:
        raise ApiKeyLimitReached(f"You have {limit} active API keys, the most an account may have: revoke one first.")
    secret = secrets.token_urlsafe(32)
    key = f"{KEY_PREFIX}{secret}"
    api_key = ApiKey.objects.create(user=user, name=name, prefix=key[: len(KEY_PREFIX) + 8], key_hash=_hash(key))
    return api_key, key


def revoke_api_key(api_key: ApiKey) -> ApiKey:
    ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    api_key.refresh_from_db()
    return api_key


def authenticate_key(header: str | None) -> ApiKey:
    """The active key of an ``Authorization: Bearer <key>`` header; raises AuthenticationFailed."""
    if not header or not header.startswith("Bearer "):
        raise AuthenticationFailed("You didn't provide an API key: send 'Authorization: Bearer <key>'.")
    key = header.removeprefix("Bearer ").strip()
    api_key = ApiKey.objects.select_related("user").filter(key_hash=_hash(key)).first()
    if api_key is None or not key.startswith(KEY_PREFIX):
        raise AuthenticationFailed(f"Incorrect API key provided: {key[:10]}***.")
    if api_key.revoked_at is not None:
        raise AuthenticationFailed("This API key was revoked.", code="revoked_api_key")
    if not api_key.user.is_active:
        raise AuthenticationFailed("This account is disabled.", code="account_disabled")
    mark_used(api_key)
    return api_key


def mark_used(api_key: ApiKey) -> None:
    """Record that ``api_key`` was used now: by a client, or by the playground on its owner's behalf."""
    now = timezone.now()
    if api_key.last_used_at is None or (now - api_key.last_used_at).total_seconds() > LAST_USED_RESOLUTION_S:
        ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)  # at most one write a minute per key
        api_key.last_used_at = now


def tokenize_prompt(model: str, params: RequestParams) -> tuple[int, ...]:
    """The request's prompt as the model's token ids, exactly as its coordinator would tokenize it.

    A prompt over SWARM_MAX_PROMPT_BYTES is refused (``context_length_exceeded``) before the
    tokenizer sees it: tokenizing megabytes costs seconds and hundreds of megabytes of memory. A
    ``logit_bias`` naming a token past the model's vocabulary is refused too (400)."""
    size, limit = params.prompt_bytes(), settings.SWARM_MAX_PROMPT_BYTES
    if size > limit:
        raise InvalidRequest(
            f"The prompt is {size} bytes of text; this server accepts at most {limit}. Shorten the "
            + ("messages." if params.chat else "prompt."),
            param="messages" if params.chat else "prompt",
            code="context_length_exceeded",
        )
    vocab = models.load_config(model).vocab_size
    for token, _ in params.logit_bias:
        if token >= vocab:
            raise InvalidRequest(
                f"'logit_bias' names token {token}; {model}'s vocabulary has tokens 0 to {vocab - 1}.",
                param="logit_bias",
            )
    tokenizer = models.load_tokenizer(model)
    spec = json_grammar(params, tokenizer)
    if spec is not None:
        param = "tools" if params.calls_tool else "response_format"
        try:
            grammar.check(spec, tokenizer, vocab)
        except grammar.GrammarError as exc:
            raise InvalidRequest(f"'{param}': {exc}.", param=param) from None
    if not params.chat:
        assert params.prompt is not None  # a request without messages has a prompt (RequestParams checks)
        return encode_prompt(tokenizer, params.prompt, chat=False)
    messages = tools.with_tools(params.chat_messages(), params.tools, params.tool_choice, tokenizer)
    return encode_prompt(
        tokenizer, messages, chat=True, tools=tools.template_tools(params.tools, params.tool_choice, tokenizer)
    )


def with_tool_decision(model: str, params: RequestParams) -> RequestParams:
    """``params``, marked ``tool_decides`` where the model is asked to decide first between calls
    and words (``tools.decides``): its grammar opens with the decision and its response leaves it out."""
    decide = params.chat and tools.decides(params.tool_choice, models.load_tokenizer(model))
    return dataclasses.replace(params, tool_decides=decide) if decide != params.tool_decides else params


def fit_context(model: str, prompt_tokens: int, params: RequestParams, *, max_tokens_given: bool) -> RequestParams:
    """The request within ``model``'s context length (``placement.selectors.context_length``).

    A request that named its max tokens is refused (``context_length_exceeded``) when prompt and
    max tokens together pass the limit, as OpenAI refuses it, before any job or hold exists; one
    that named none has the default cut to the room its prompt leaves. While no stage of the
    model is routable the request passes unchanged (admission then answers or waits)."""
    limit = context_length(model)
    if limit is None or prompt_tokens + params.max_tokens <= limit:
        return params
    room = limit - prompt_tokens
    if not max_tokens_given and room >= 1:
        return dataclasses.replace(params, max_tokens=room)
    where = "messages" if params.chat else "prompt"
    raise InvalidRequest(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_tokens + params.max_tokens} tokens ({prompt_tokens} in the {where}, {params.max_tokens} in the "
        f"completion). Please reduce the length of the {where} or completion.",
        param=where,
        code="context_length_exceeded",
    )


@transaction.atomic
def heal_job(
    job_pk: int,
    failed_node: str,
    reason: str,
    now: datetime | None = None,
    *,
    report: bool = True,
    relay_down: str | None = None,
    detected_at: datetime | None = None,
) -> list[dict] | None:
    """A running job's coordinator saw ``failed_node``'s stage die or stall: report the node
    (``report_node_failure``: no request is routed to it any more), count the failure against it
    (``verification.failures.record_failure``: routing backs off, repeated ones are a strike) and
    move the job onto a route that avoids every node it reported; returns the new route
    (``Job.route``'s shape), or None.

    The new route keeps the job's surviving stages where it can, so that only the failed span
    changes (a warm spare or another pipeline's stage holding exactly that span takes it), else it
    is the fastest full chain (``placement.selectors.route_around``). When no route avoids every
    node the job saw fail, one that has proved alive since (its heartbeats cleared the report: it
    was slow or briefly frozen) may take its span again. It becomes ``Job.route``,
    which settlement verifies the receipts against, and ``Job.heals`` records it (when, which node,
    why, the route before). Audited positions stay when the route keeps its length, else they are
    drawn again for the new route. A heal is a sign of life for the job's staleness watch.

    Refused (None, the job unchanged): the job is not running, ``failed_node`` is not on its route,
    it was healed SWARM_MAX_HEALS times already (the node is still reported: the failure is real),
    or no route avoids the failed nodes (likewise; ``heal_may_wait`` says whether one may come);
    then a node is set loading the failed span for the job at once (``load_replacement``).
    ``report=False`` asks again without reporting the node again (a healer waiting for a route).

    ``relay_down``: the address of the relay the failed stage was reached through, which the
    job's coordinator found down itself (a connection to it refused or unanswered). The relay is the
    culprit, not the node: nothing is counted against the node, and every block served through that
    relay is off routing until its agent reports it through another (``lifecycle.relay_lost``).
    ``detected_at``: when the coordinator saw the failure, kept on the heal beside when its route came."""
    now = now or timezone.now()
    job = Job.objects.select_for_update().filter(pk=job_pk).first()
    if job is None or job.state != JobState.RUNNING or failed_node not in {s["node"] for s in job.route}:
        return None
    # From here to the commit no block of the model is released, and every release decided before
    # is read: the new route never takes a stage being released (``hold_routes``). Taken before a
    # relay's blocks are locked (``relay_lost``), in the order every placement takes its locks: a
    # heal that locked them first deadlocked with a block reported through another relay.
    hold_routes(job.model)
    if report and relay_down is not None:
        relay_lost(relay_down, reason)
    elif report:
        report_node_failure(failed_node, reason, now=now)
        record_failure(failed_node, reason, job=job, now=now)
        if str(reason).startswith(f"{SESSION_TOO_LONG}:"):  # it holds fewer positions than it reported
            reached = job.prompt_tokens + RequestParams.from_json(job.params).max_tokens
            refused_positions(failed_node, reached, job=job)
    if len(job.heals) >= settings.SWARM_MAX_HEALS:
        log.warning("job %s: %s failed, but it was healed %d times already", job.public_id, failed_node, len(job.heals))
        return None
    avoid = {heal["failed_node"] for heal in job.heals} | {failed_node}
    current = [Stage(s["node"], s["layer_start"], s["layer_end"]) for s in job.route]
    stages = route_around(job.model, current, avoid, job.coordinator_region, job.privacy)
    if stages is None:
        # No route without every node this job saw fail: one that has since proved alive (it
        # heartbeats after the report: it was slow or briefly frozen, not dead) may serve it again.
        still_failed = {
            node_id
            for node_id in Node.objects.filter(node_id__in=avoid)
            .filter(Q(suspected_at__isnull=False) | ~Q(state=NodeState.ACTIVE))
            .values_list("node_id", flat=True)
            if node_id is not None  # always: filtered by node id
        }
        if still_failed != avoid:
            stages = route_around(job.model, current, still_failed, job.coordinator_region, job.privacy)
    if stages is None:
        if report:  # once: a healer waiting for a route asks again without a word each time
            log.info("job %s: %s failed and no route avoids %s", job.public_id, failed_node, ", ".join(sorted(avoid)))
            _load_replacement(job, failed_node)  # at once, in this transaction: the wait is the load's
        return None
    route = route_of(stages)
    heal = {"at": now.isoformat(), "failed_node": failed_node, "reason": str(reason)[:500], "route_before": job.route}
    if detected_at is not None:
        heal["detected_at"] = detected_at.isoformat()
    job.audit_stages = job.audit_stages if len(route) == len(job.route) else choose_audit_stages(route)
    job.heals = [*job.heals, heal]
    job.route = route
    job.progress_at = now
    job.save(update_fields=["route", "heals", "audit_stages", "progress_at"])
    log.info(
        "job %s healed around %s: %s",
        job.public_id,
        failed_node,
        " -> ".join(f"{s['node']}[{s['layer_start']}:{s['layer_end']}]" for s in route),
    )
    return route


def failed_span(job: Job, failed_node: str) -> Span | None:
    """The span ``failed_node`` serves on ``job``'s route; None when it is not on it."""
    stage = next((s for s in job.route if s["node"] == failed_node), None)
    return Span(job.model, stage["layer_start"], stage["layer_end"]) if stage is not None else None


@transaction.atomic
def load_replacement(job_pk: int, failed_node: str) -> bool:
    """A heal of ``failed_node``'s stage found no route: have a node load its span for it
    (``placement.healing.load_for_heal``: a spare of another span, an idle node, a member of an idle
    pipeline). True when a block of the span is loading for it (started now or before)."""
    job = Job.objects.filter(pk=job_pk, state=JobState.RUNNING).first()
    if job is None or not hold_routes(job.model):
        return False
    return _load_replacement(job, failed_node)


def _load_replacement(job: Job, failed_node: str) -> bool:
    """``load_replacement`` for a running job whose model's placement row the caller holds."""
    span = failed_span(job, failed_node)
    if span is None:
        return False
    route = [s["node"] for s in job.route]
    at = route.index(failed_node)
    neighbours = (route[at - 1] if at > 0 else None, route[at + 1] if at + 1 < len(route) else None)
    avoid = {heal["failed_node"] for heal in job.heals} | {failed_node}
    loading = healing.load_for_heal(
        span, route=route, neighbours=neighbours, avoid=avoid, open_jobs=jobs_in_flight(), privacy=job.privacy
    )
    return loading is not None


def block_ready_since(model: str, since: datetime) -> bool:
    """Whether a block of ``model`` reported ready after ``since``: a heal waiting for a route looks
    again then (one indexed query, cheap enough to ask often)."""
    return Assignment.objects.filter(model=model, state=AssignmentState.READY, ready_at__gt=since).exists()


def heal_may_wait(job_pk: int, now: datetime | None = None) -> bool:
    """Whether a job that found no route around its failed stage may wait for one: it is still
    running, may still be healed, and its model is recovering (``placement.selectors.recovering``:
    a node holds or is loading a block of it). Waiting is a sign of life for the staleness watch."""
    job = Job.objects.only("state", "model", "heals").filter(pk=job_pk).first()
    if job is None or job.state != JobState.RUNNING or len(job.heals) >= settings.SWARM_MAX_HEALS:
        return False
    if not recovering(job.model):
        return False
    Job.objects.filter(pk=job_pk, state=JobState.RUNNING).update(progress_at=now or timezone.now())
    return True


def mark_running(job_pk: int) -> bool:
    """Mark a queued job running, in its coordinator's process, and stamp it with that process
    (``liveness``): once the process is gone, the job ends at once. False when it was not queued."""
    return bool(
        Job.objects.filter(pk=job_pk, state=JobState.QUEUED).update(
            state=JobState.RUNNING, started_at=timezone.now(), coordinator_process=liveness.this_process()
        )
    )


# What a job's coordinator reads of its row: sent along with its launch (``job_brief``), so that it
# opens its stages while the job is marked running rather than after reading the row back.
BRIEF_FIELDS = ("public_id", "request_id", "model", "prompt_tokens", "route", "params", "prompt_ids", "audit_stages")


def job_brief(job: Job) -> dict:
    """The fields of an admitted job that its coordinator needs, as JSON (a Celery argument)."""
    return {name: getattr(job, name) for name in BRIEF_FIELDS}


def job_from_brief(job_pk: int, brief: dict) -> Job:
    """The job a brief describes, as an unsaved, read-only instance: only its brief's fields are set."""
    missing = set(BRIEF_FIELDS) - brief.keys()
    if missing:
        raise ValueError(f"a job brief lacks {sorted(missing)}")
    return Job(pk=job_pk, **{name: brief[name] for name in BRIEF_FIELDS})


def start_job(job_pk: int) -> tuple[Job | None, bool]:
    """A coordinator's first step, in one worker thread: mark the job running (True when this call
    did: it was queued, and no other coordinator took it) and read its row."""
    started = mark_running(job_pk)
    return Job.objects.filter(pk=job_pk).first(), started


def finish_job(
    job_pk: int,
    *,
    state: str,
    completion_tokens: int,
    finish_reason: str = "",
    ttft_ms=None,
    tokens_per_s=None,
    receipts=None,
    transcripts=None,
    verified=None,
    verification_error: str = "",
    error_code: str = "",
    error_message: str = "",
    drafted_tokens: int = 0,
    accepted_tokens: int = 0,
    step_outputs_s: Sequence[Sequence[float]] = (),
) -> bool:
    """End a job once (conditional on it not having ended); False if it had already ended.
    ``step_outputs_s``: when each stage of its route put out each step of its session (``StepTimes``),
    kept for a succeeded job only, as ``kept_step_outputs`` keeps them (nothing where malformed)."""
    assert state in FINAL_STATES
    kept = kept_step_outputs(step_outputs_s) if state == JobState.SUCCEEDED else ()
    updated = (
        Job.objects.filter(pk=job_pk)
        .exclude(state__in=FINAL_STATES)
        .update(
            state=state,
            completion_tokens=completion_tokens,
            finish_reason=finish_reason,
            ttft_ms=ttft_ms,
            tokens_per_s=tokens_per_s,
            receipts=receipts or [],
            transcripts=transcripts or [],
            verified=verified,
            verification_error=verification_error[:2000],
            drafted_tokens=drafted_tokens,
            accepted_tokens=accepted_tokens,
            step_outputs_s=[list(stage) for stage in kept],
            error_code=error_code,
            error_message=error_message[:2000],
            finished_at=timezone.now(),
        )
    )
    if updated:
        job = Job.objects.filter(pk=job_pk).values("model", "prompt_tokens").get()
        # Counted once the end is committed: a rolled-back end did not happen.
        transaction.on_commit(
            lambda: metrics.job_finished(
                job["model"],
                state,
                prompt_tokens=job["prompt_tokens"],
                completion_tokens=completion_tokens,
                ttft_ms=ttft_ms,
                tokens_per_s=tokens_per_s,
                drafted_tokens=drafted_tokens,
                accepted_tokens=accepted_tokens,
            )
        )
    return bool(updated)


def record_progress(delivered: dict[int, int]) -> None:
    """Tokens delivered so far by running jobs (job pk -> completion tokens), in one statement for
    all of a coordinator process's jobs, so that a lost coordinator's jobs can be settled."""
    if not delivered:
        return
    tokens = Case(*(When(pk=pk, then=Value(count)) for pk, count in delivered.items()), output_field=IntegerField())
    Job.objects.filter(pk__in=delivered, state=JobState.RUNNING).update(
        completion_tokens=tokens, progress_at=timezone.now()
    )


def stopped_answering(job_pk: int, now=None) -> str | None:
    """Why a response waiting on this job should give up, or None while the job is alive: it ended
    FINAL_EVENT_GRACE_S ago or more without its final event reaching the response (the event is
    sent right after the record is final, so a response that looks in between must wait for it),
    or it showed no sign of life (admission, start, a token) for SWARM_JOB_STALE_S, or its
    coordinator's process is gone (``liveness``), the rules by which
    ``flows.settlement.reconcile_jobs`` declares a coordinator lost."""
    now = now or timezone.now()
    job = Job.objects.only(
        "state", "created_at", "started_at", "progress_at", "finished_at", "error_code", "coordinator_process"
    ).get(pk=job_pk)
    if job.state in FINAL_STATES:
        if job.error_code == COORDINATOR_LOST:  # ended by ``flows.settlement.reconcile_jobs``: no event is on the way
            return COORDINATOR_GONE
        if job.finished_at is not None and (now - job.finished_at).total_seconds() < FINAL_EVENT_GRACE_S:
            return None
        return f"the job ended ({job.state}) but its last event did not arrive"
    if liveness.gone(job.coordinator_process):
        return COORDINATOR_GONE
    silent = (now - (job.progress_at or job.started_at or job.created_at)).total_seconds()
    if silent > settings.SWARM_JOB_STALE_S:
        return f"the job made no progress for {silent:.0f}s"
    return None
