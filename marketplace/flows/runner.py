"""Runs one job's coordinator and publishes its tokens as the job's events (``flows.events``).

In production this runs in a Celery worker of the job's coordinator region (``coord.<region>``,
threads pool: the model's embeddings and head are loaded once per process); in the embedded
default it runs as a task of the web process's event loop. Either way the HTTP view that admitted
the job reads its events and writes the response.

Events: ``job.token`` (text, token_id), then exactly one of ``job.done`` (finish_reason, usage) or
``job.error`` (code, message).

The other way, a ``job.cancel`` message on the channel layer's channel ``job.<public id>.cancel``
(``request_cancel``) stops the job between two tokens. A cancel sent before the runner listens
waits there for the layer's message expiry; it is not a process-local channel, so Celery's
threads can each listen from their own event loop. It is named by the job's public id, as its
events are: a primary key repeats once a database is recreated on the same Redis, and a cancel
left for an earlier job of that key would stop a new one at its first token.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from datetime import datetime

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.utils import timezone

from marketplace import logs
from marketplace.db import release_connections
from marketplace.flows import events as job_events
from marketplace.flows import progress as job_progress
from marketplace.flows.settlement import settle
from marketplace.jobs import services
from marketplace.jobs.coordinator_inputs import (
    JobGrant,
    coordinator_for,
    generation_request,
    healed_route,
    stage_specs,
)
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.params import RequestParams
from marketplace.jobs.prefixes import remember_route
from marketplace.nodes.authority import coordinator_tls, held_coordinator_tls
from marketplace.nodes.models import Node
from marketplace.nodes.reachability import relay_down
from marketplace.placement.healing import heal_wait_s
from marketplace.verification.audits import record_audits
from marketplace.verification.failures import GONE_CODES, alive_through, failure_code, record_failure
from marketplace.verification.strikes import strike_misconduct, strike_unverifiable_receipts
from worker_agent.coordinator.challenger import StepTimes
from worker_agent.coordinator.heal import HealedRoute, StageFailure
from worker_agent.coordinator.job import Coordinator, GenerationResult
from worker_agent.coordinator.session import TokenEvent
from worker_agent.cpu import MODEL_CPU
from worker_agent.errors import SwarmError
from worker_agent.protocol.receipts import SessionTranscript
from worker_agent.protocol.span import Span

log = logging.getLogger("swarm.jobs")
HEAL_POLL_S = 0.025  # how often a heal waiting for a route checks whether a block of its model came up
HEAL_RECHECK_S = 0.5  # and how often it looks for a route whatever happened
HEAL_LOAD_RETRY_S = 2.0  # how often it asks again for a node to load the failed span, while none is
RELAY_PROBE_S = 2.0  # a relay a failed stage was reached through must accept a connection within this
CANCEL_LISTENER_STOP_S = 1.0  # how long a job's end waits for its cancel listener to stop
_stray_listeners: set[asyncio.Task] = set()  # cancel listeners still stopping after their job ended


async def in_thread(fn, *args, **kwargs):
    """Run blocking ORM or cache work in a worker thread of its own: jobs do not queue behind
    one another (or behind the web requests) on a single database thread. The thread hands its
    database connection back when done, so idle pool threads hold none."""

    def call():
        try:
            return fn(*args, **kwargs)
        finally:
            release_connections()

    return await sync_to_async(call, thread_sensitive=False)()


def cancel_channel(public_id: str) -> str:
    return f"job.{public_id}.cancel"


async def request_cancel(layer, public_id: str) -> None:
    """Ask the coordinator of the job ``public_id`` to stop (the client went away); it records what was done."""
    await layer.send(cancel_channel(public_id), {"type": "job.cancel"})


async def _cancel_received(layer, public_id: str) -> bool:
    """True once a ``job.cancel`` arrives on the job's cancel channel; False if the layer fails
    (e.g. Redis went away), and the job then runs to its end."""
    try:
        while (await layer.receive(cancel_channel(public_id)))["type"] != "job.cancel":
            pass
    except Exception as exc:  # the channel layer's own error
        log.warning("job %s: no longer listening for a cancel: %r", public_id, exc)
        return False
    return True


async def _stop_listening(listener: asyncio.Task, job_id: str) -> None:
    """Stop a job's cancel listener without letting it hold the job's end: a receive blocked in
    the channel layer (a Redis connection pool busy reconnecting) may take its time to notice the
    cancellation, so it is waited on for CANCEL_LISTENER_STOP_S, then left to end on its own."""
    listener.cancel()
    done, _ = await asyncio.wait({listener}, timeout=CANCEL_LISTENER_STOP_S)
    if not done:
        log.warning(
            "job %s: its cancel listener did not stop in %gs; not waiting for it", job_id, CANCEL_LISTENER_STOP_S
        )
        _stray_listeners.add(listener)
        listener.add_done_callback(_stray_listeners.discard)


async def run_job(job_pk: int, brief: dict | None = None) -> str:
    """Run the job to its end and settle its hold; returns its final state. Every line logged
    meanwhile, here and in the coordinator, names the job and the request that admitted it.

    With the job's ``brief`` (``services.job_brief``, sent along by its launch) the coordinator
    opens its stages while the job is marked running, and sends them nothing before that mark is
    made; without one it reads the job's row first."""
    started: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    if brief is None:
        job, marked = await in_thread(services.start_job, job_pk)
        started.set_result(marked)
    else:
        job = services.job_from_brief(job_pk, brief)
        started = asyncio.ensure_future(in_thread(services.mark_running, job_pk))
    public_id, request_id = (job.public_id, job.request_id) if job is not None else (None, None)
    settled = asyncio.Event()  # set once a succeeded job is settled, before its audits are recorded
    with logs.bound(job_id=public_id, request_id=request_id):
        try:
            state = await _run(job_pk, job, started, settled)
        finally:
            await asyncio.gather(started, return_exceptions=True)  # never settled before it is marked
            if not settled.is_set():  # settling again would only read and lock its whole row to find it done
                await in_thread(settle, job_pk)
            MODEL_CPU.tell()  # the model's CPU of this job is on record by its end
        log.info("job ended: %s", state)
        return state


class _NotStarted(Exception):
    """The job was not queued when its coordinator came to mark it running: it ended before it
    started (cancelled, timed out), or another coordinator runs it."""


async def _run(job_pk: int, job: Job | None, started: asyncio.Future[bool], settled: asyncio.Event) -> str:
    layer = get_channel_layer()
    if job is None:
        job = await in_thread(Job.objects.get, pk=job_pk)  # raises DoesNotExist, as it always did
    if started.done() and not started.result():
        return job.state
    events = job_events.channel()
    delivered = Delivered()
    try:
        try:
            async with asyncio.timeout(settings.SWARM_JOB_TIMEOUT_S):
                result, cancelled, transcripts, step_outputs = await _generate(job, layer, events, delivered, started)
        except _NotStarted:
            return await in_thread(_state, job_pk)
        except Exception:
            if not await started:  # it failed before it was found not to be this coordinator's: not its to end
                return await in_thread(_state, job_pk)
            raise
    except TimeoutError:
        message = f"the job ran past {settings.SWARM_JOB_TIMEOUT_S:g}s"
        await _fail(job_pk, job.public_id, events, "timeout", message, delivered.tokens)
        return JobState.FAILED
    except (SwarmError, OSError, ValueError) as exc:
        log.warning("job %s failed after %d tokens: %s", job.public_id, delivered.tokens, exc)
        await _fail(job_pk, job.public_id, events, getattr(exc, "code", "stage_error"), str(exc), delivered.tokens)
        return JobState.FAILED
    if cancelled:
        await in_thread(
            services.finish_job,
            job_pk,
            state=JobState.CANCELLED,
            completion_tokens=delivered.tokens,
            error_code="client_disconnected",
            error_message="the client went away; partial work recorded",
        )
        return JobState.CANCELLED
    assert result is not None  # only a cancelled run ends without a result (``_stream``)
    decode = result.token_times[-1] - result.token_times[0] if len(result.token_times) > 1 else 0.0
    result_transcripts = [
        SessionTranscript(session, tuple(t.sent), tuple(t.received), t.start).to_json()
        for session, t in transcripts.items()
    ]
    await in_thread(
        services.finish_job,
        job_pk,
        state=JobState.SUCCEEDED,
        completion_tokens=result.completion_tokens,
        finish_reason=result.finish_reason,
        ttft_ms=1000 * result.ttft if result.ttft is not None else None,
        tokens_per_s=(len(result.token_times) - 1) / decode if decode > 0 else None,
        receipts=[r.to_json() for r in result.receipts],  # in route order: audits look theirs up by stage
        transcripts=result_transcripts,
        verified=result.verification is not None,
        verification_error=result.verification_error,
        drafted_tokens=result.drafted,
        accepted_tokens=result.accepted,
        step_outputs_s=step_outputs,
    )
    await events.publish(
        job.public_id,
        {
            "type": "job.done",
            "finish_reason": result.finish_reason,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "cached_tokens": result.cached_tokens,
        },
    )
    if not result.heals:  # a healed job's prefixes are held on a route the job's row no longer names
        await in_thread(remember_route, job.customer_id, job.model, [*job.prompt_ids, *result.token_ids], job.route)
    # Only once the client has its final event: replaying audits takes seconds to minutes, and
    # settlement does not wait for them either (a failed audit claws back through its strike).
    await in_thread(settle, job_pk)
    settled.set()
    if result.verification_culprit is not None:
        await _blame_receipts(job_pk, result.verification_culprit, result.verification_error)
    if result.audits or result.audit_missing:
        await in_thread(_record_audits, job_pk, result.audits, result.audit_missing)
    return JobState.SUCCEEDED


@dataclass
class Delivered:
    """What a running job has streamed to its client so far: what it is charged for, however it ends."""

    tokens: int = 0  # completion tokens published as the job's events


class JobHealer:
    """The control plane as a job's healer: the failed node is reported (routing stops using it at
    once) and the job moves onto a route around it (``services.heal_job``), with tickets signed
    here and the control plane's own assignments, never the stages' word.

    When no ready block holds the failed span, a node loads it for the job (``services.load_replacement``:
    a spare of another span, an idle node) while the job waits, up to ``services.heal_wait_s`` (by
    the span's bytes) and while the model is recovering; past that the job ends with what it
    delivered. A stage reached through a relay that is found down is the relay's failure, not its
    node's (``heal_job``'s ``relay_down``)."""

    def __init__(self, job: Job, grant: JobGrant) -> None:
        self.job = job
        self.grant = grant
        self.route = list(job.route)

    async def prepare(self) -> None:
        """Nothing to learn ahead: the control plane knows its nodes and their blocks."""

    async def replace(self, failure: StageFailure, route) -> HealedRoute | None:
        # The node is the one this control plane put at that position, whatever its HELLO said.
        node = self.route[failure.stage]["node"]
        reason = f"{failure.code}: {failure.message}"
        detected = timezone.now()
        relay = None
        if failure.code in GONE_CODES:
            relay = await relay_down(self.route[failure.stage]["url"], RELAY_PROBE_S)
        relay_address = relay.address if relay is not None else None
        healed = await in_thread(
            services.heal_job, self.job.pk, node, reason, relay_down=relay_address, detected_at=detected
        )
        if healed is None:
            stage = self.route[failure.stage]
            wait_s = heal_wait_s(Span(self.job.model, stage["layer_start"], stage["layer_end"]))
            healed = await self._wait(node, reason, detected, wait_s)
            if healed is None:
                return None
        self.route = healed
        audit_stages = await in_thread(lambda: Job.objects.only("audit_stages").get(pk=self.job.pk).audit_stages)
        return healed_route(await in_thread(stage_specs, self.job, healed, self.grant), healed, audit_stages)

    async def _wait(self, node: str, reason: str, detected: datetime, wait_s: float) -> list[dict] | None:
        """No route around ``node`` now (``heal_job`` set a node loading its span): wait up to
        ``wait_s`` for a route (one line in the log when the wait starts, one when it ends). A route
        is looked for again as soon as a block of the model reports ready (a cheap check, every
        HEAL_POLL_S), and every HEAL_RECHECK_S whatever happened (a suspicion cleared, a back-off
        ran out); a node is asked to load the span again every HEAL_LOAD_RETRY_S while none does."""
        started = time.monotonic()
        log.warning(
            "job %s: no ready block can replace %s; waiting up to %.0fs for one to load",
            self.job.public_id,
            node,
            wait_s,
        )
        next_check, next_load = started + HEAL_RECHECK_S, started + HEAL_LOAD_RETRY_S
        since = detected
        while True:
            now = time.monotonic()
            if now >= next_check:
                if now >= started + wait_s or not await in_thread(services.heal_may_wait, self.job.pk):
                    log.warning("job %s: no replacement of %s came in %.1fs", self.job.public_id, node, now - started)
                    return None
                if now >= next_load:  # again now and then: a node that can load it may have come up
                    await in_thread(services.load_replacement, self.job.pk, node)
                    next_load = now + HEAL_LOAD_RETRY_S
            await asyncio.sleep(HEAL_POLL_S)
            if time.monotonic() < next_check and not await in_thread(services.block_ready_since, self.job.model, since):
                continue
            since, next_check = timezone.now(), time.monotonic() + HEAL_RECHECK_S
            healed = await in_thread(services.heal_job, self.job.pk, node, reason, report=False, detected_at=detected)
            if healed is not None:
                log.info(
                    "job %s: a replacement of %s came in %.1fs", self.job.public_id, node, time.monotonic() - started
                )
                return healed


async def _generate(
    job: Job, layer, events, delivered: Delivered, started: asyncio.Future[bool]
) -> tuple[GenerationResult | None, bool, dict, tuple[tuple[float, ...], ...]]:
    """Publish the job's tokens as its events, counting them in ``delivered``; returns (result,
    cancelled, the coordinator's transcripts by session, when each stage put out each step of the
    result's session: ``StepTimes.outputs``). Its stages are opened while the job is
    marked running (``started``), and sent its prompt only once it is (else ``_NotStarted``)."""
    grant = JobGrant.new()
    specs = stage_specs(job, job.route, grant)  # three signatures: on the loop, not worth a thread's hop
    coordinator = coordinator_for(
        job,
        specs,
        grant,
        healer=JobHealer(job, grant),
        tls=held_coordinator_tls() or await in_thread(coordinator_tls),  # a thread only to make or renew it
    )
    # Its clock starts as the coordinator begins to connect, as a challenge's stand-in counts (``Pace``).
    steps = StepTimes(coordinator.pipeline)
    try:
        result, cancelled, transcripts = await _stream(job, coordinator, layer, events, delivered, started)
        # Its session's steps on the route it began on: none where a heal moved it onto another.
        outputs = steps.outputs(result.session) if result is not None else ()
        return result, cancelled, transcripts, outputs
    finally:
        # However the job ended: a breach its node signed against itself is a strike regardless.
        if coordinator.misconduct:
            await in_thread(_strike_misconduct, job.pk, list(coordinator.misconduct))


async def _stream(
    job: Job, coordinator: Coordinator, layer, events, delivered: Delivered, started: asyncio.Future[bool]
) -> tuple[GenerationResult | None, bool, dict]:
    params = RequestParams.from_json(job.params)
    progress = job_progress.book(in_thread)
    async with coordinator as coord:
        if not await started:
            raise _NotStarted
        log.info("job running: %s, %d prompt tokens, on %d stages", job.model, job.prompt_tokens, len(job.route))
        request = generation_request(coord, job, params)
        stream = coord.stream(request, strict=False)
        # Listens all along, so checking for a cancel between two tokens costs no round trip.
        cancel = asyncio.create_task(_cancel_received(layer, job.public_id))
        progress.start(job.pk)
        try:
            async for event in stream:
                if isinstance(event, GenerationResult):
                    return event, False, dict(coord.pipeline.transcripts)
                message = {"type": "job.token", "text": event.text, "token_id": event.token_id}
                if event.logprob is not None:
                    message |= logprob_fields(coord.tokenizer, event)
                await events.publish(job.public_id, message)
                if event.token_id is not None:
                    delivered.tokens += 1
                    progress.note(job.pk, delivered.tokens)
                if cancel.done() and cancel.result():
                    return None, True, {}
        finally:
            progress.stop(job.pk)
            await _stop_listening(cancel, job.public_id)
            await stream.aclose()  # closes the sessions on the stages when stopped early
    raise SwarmError("the coordinator ended without a result", code="no_result")


def public_failure(code: str, message: str) -> str:
    """What the customer reads about a failed job. The job's own record keeps ``message``, which
    may name nodes, their addresses and stage indexes: the providers' business, never a customer's."""
    if code == "timeout":
        return message  # the job's time limit, in seconds
    return f"a provider stage failed ({code}) and no route around it was available; nothing is charged for this request"


def logprob_fields(tokenizer, event: TokenEvent) -> dict:
    """A token event's log-probabilities for the API: the token's text, its bytes and its
    log-probability, and the likeliest tokens' ``[text, log-probability, bytes]``, most likely first."""
    assert event.token_id is not None  # only a token's event carries log-probabilities
    return {
        "token": tokenizer.decode([event.token_id]),
        "bytes": token_bytes(tokenizer, event.token_id),
        "logprob": event.logprob,
        "top_logprobs": [
            [tokenizer.decode([token]), logprob, token_bytes(tokenizer, token)] for token, logprob in event.top_logprobs
        ],
    }


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id: int) -> list[int]:
    """The token's own bytes, as OpenAI's ``bytes`` gives them: a byte-level BPE token that holds
    part of a character (an emoji split over two tokens) has the bytes of that part, where its
    decoded text has only a replacement character. Other tokenizers: the UTF-8 of its text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.decoder).__name__ == "ByteLevel":
        piece = tokenizer.convert_ids_to_tokens(token_id)
        decoder = _byte_level_decoder()
        if isinstance(piece, str) and all(char in decoder for char in piece):
            return [decoder[char] for char in piece]
    return list(tokenizer.decode([token_id]).encode())


async def _fail(job_pk: int, job_id: str, events, code: str, message: str, sent_tokens: int) -> None:
    await in_thread(
        services.finish_job,
        job_pk,
        state=JobState.FAILED,
        completion_tokens=sent_tokens,
        error_code=code,
        error_message=message,
    )
    try:
        await events.publish(job_id, {"type": "job.error", "code": code, "message": public_failure(code, message)})
    except OSError as exc:  # the events' Redis is down: the response sees the job's record end (stopped_answering)
        log.warning("job %s: its error event could not be sent: %s", job_id, exc)


def _state(job_pk: int) -> str:
    return Job.objects.only("state").get(pk=job_pk).state


def _record_audits(job_pk: int, materials: list, gaps: list) -> list[int]:
    return record_audits(Job.objects.get(pk=job_pk), materials, gaps)


DROPPED = "lost before it sent its receipt"  # how the coordinator words a receipt that never came


async def _blame_receipts(job_pk: int, node_id: str, reason: str) -> None:
    """The node the job's verification failed on. A receipt that lies, or one refused while the
    node was up, is its strike at once. A connection lost at CLOSE looks the same as a crash, so
    the node is given one heartbeat to show that its agent lived through it: only then is the drop
    deliberate and struck (an honest node that crashed is only counted and routed around)."""
    dropped_at = timezone.now() if DROPPED in reason else None
    if dropped_at is not None and failure_code(reason) in GONE_CODES:
        await asyncio.sleep(1.5 * settings.SWARM_HEARTBEAT_INTERVAL_S)
    await in_thread(_strike_receipts, job_pk, node_id, reason, dropped_at)


def _strike_misconduct(job_pk: int, misconduct: list) -> None:
    strike_misconduct(Job.objects.get(pk=job_pk), misconduct)


def _strike_receipts(job_pk: int, node_id: str, reason: str, dropped_at=None) -> None:
    """Strike the culprit of the job's verification (unless it dropped and did not live through it,
    see ``_blame_receipts``), and count the failure against it like a stall (routing backs off)."""
    job = Job.objects.get(pk=job_pk)
    node = Node.objects.filter(node_id=node_id).first()
    now = timezone.now()
    lived = (
        node is not None
        and alive_through(node, job, now)
        and (failure_code(reason) not in GONE_CODES or node.last_heartbeat_at > dropped_at)
    )
    if dropped_at is None or lived:
        strike_unverifiable_receipts(job, node_id, reason)
    record_failure(node_id, reason, job=job)
