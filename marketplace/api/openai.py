"""The OpenAI-compatible inference API: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Async views: each request is authenticated by its bearer key, validated, rate limited, admitted
as a job on a ready route, and answered from the job's channel-layer group while its coordinator
runs (in-process or in a Celery worker of the job's region). Errors use OpenAI's JSON shape; an
error after streaming began arrives as a final SSE event carrying an ``error`` object. A client
that disconnects cancels its job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponseBase, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from marketplace import logs
from marketplace.api import admission, ratelimit, request_body
from marketplace.api.auth import api_key_required
from marketplace.api.errors import allow_method, error_response
from marketplace.api.parsers import loads_bounded
from marketplace.api.reply import EventStream, Reply, replayed
from marketplace.billing.selectors import per_token
from marketplace.billing.services import prices_for
from marketplace.catalog.selectors import served_models
from marketplace.db import releases_db, releasing
from marketplace.errors import DomainError
from marketplace.flows import events as job_events
from marketplace.flows import runner, tasks
from marketplace.jobs import idempotency, services
from marketplace.jobs.errors import InvalidRequest
from marketplace.jobs.models import ApiKey
from marketplace.jobs.params import RequestParams
from marketplace.placement.selectors import context_length, servable_pipelines
from worker_agent.checkpoints import is_ref, ref_name

if TYPE_CHECKING:
    from marketplace.logs import IdentifiedRequest

log = logging.getLogger("swarm.api")
# A retry waiting for an attempt of its Idempotency-Key in flight looks again at most this far apart.
KEY_POLL_MAX_S = 1.0


def _json_body(request: HttpRequest) -> dict:
    try:
        raw = request.body or b""
    except RequestDataTooBig:
        raise InvalidRequest(
            f"The request body is larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes.", code="request_too_large"
        ) from None
    try:
        body = loads_bounded(raw)
    except InvalidRequest as exc:
        raise InvalidRequest(str(exc)) from None  # OpenAI's shape for a malformed body: code null
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


# What every listed model answers through this API, as /v1/models reports it.
CAPABILITIES = {
    "chat_completions": True,
    "completions": True,
    "streaming": True,
    "embeddings": False,  # out of scope: the swarm serves generation only
    "tools": True,  # tool_choice "auto" (the default), "required" or a named function; parallel calls
    "structured_output": True,
    "logprobs": True,
}


ENDPOINTS = ("/v1/models", "/v1/chat/completions", "/v1/completions")
# OpenAI's endpoints that this server knows of and does not implement: the swarm serves generation.
UNSUPPORTED = frozenset(
    {"embeddings", "responses", "audio", "images", "moderations", "files", "uploads", "batches", "fine_tuning"}
    | {"assistants", "threads", "vector_stores", "realtime", "evals", "containers"}
)


@csrf_exempt
async def unknown_url(request: HttpRequest, exception: Exception | None = None, **_) -> JsonResponse:
    """Any other path under /v1, in OpenAI's shape: 501 for an endpoint of OpenAI's this server does
    not implement (``/v1/embeddings``, ``/v1/responses``), 404 for any other (a typo)."""
    served = ", ".join(ENDPOINTS)
    endpoint = request.path.removeprefix("/v1/").split("/", 1)[0]
    if request.path.startswith("/v1/") and endpoint in UNSUPPORTED:
        message = (
            f"{request.method} {request.path} is not implemented here: this server serves text generation only "
            f"({served})."
        )
        body = {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "unsupported_endpoint",
            }
        }
        return JsonResponse(body, status=501)
    message = f"Invalid URL ({request.method} {request.path}): this server answers {served}."
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "unknown_url"}}
    return JsonResponse(body, status=404)


def server_error(request: HttpRequest) -> JsonResponse:
    """An unhandled error under /v1: 500 in OpenAI's shape (the request id is in ``x-request-id``)."""
    message = "The server had an error while processing your request; retry it, or quote its x-request-id."
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return JsonResponse(body, status=500)


@csrf_exempt
@releases_db
@allow_method("GET")
@api_key_required
async def list_models(request: HttpRequest, api_key: ApiKey) -> JsonResponse:
    def listing() -> list[dict]:
        entries = []
        for model in served_models():
            if servable_pipelines(model):
                prompt, completion = prices_for(model)
                entries.append(
                    {
                        "id": ref_name(model),  # a catalog model by its name; its ref pins the weights
                        **({"snapshot": model} if is_ref(model) else {}),
                        "object": "model",
                        "created": 0,
                        "owned_by": "swarm",
                        "pricing": {"prompt": per_token(prompt), "completion": per_token(completion)},
                        "context_length": context_length(model),
                        "capabilities": CAPABILITIES,
                    }
                )
        return entries

    data = await sync_to_async(listing)()
    return JsonResponse({"object": "list", "data": data})


@csrf_exempt
@releases_db
@allow_method("POST")
@api_key_required
async def chat_completions(request: IdentifiedRequest, api_key: ApiKey) -> HttpResponseBase:
    return await _complete(request, api_key, "chat")


@csrf_exempt
@releases_db
@allow_method("POST")
@api_key_required
async def completions(request: IdentifiedRequest, api_key: ApiKey) -> HttpResponseBase:
    return await _complete(request, api_key, "completion")


async def _complete(request: IdentifiedRequest, api_key: ApiKey, kind: str) -> HttpResponseBase:
    try:
        body = _json_body(request)
    except DomainError as exc:
        return error_response(exc)
    return await complete_for_key(api_key, body, kind, request.request_id, request.headers.get("Idempotency-Key"))


async def complete_for_key(
    api_key: ApiKey, body: dict, kind: str, request_id: str, idempotency_key: str | None = None
) -> HttpResponseBase:
    """Validate a request ``body``, rate limit and admit it as a job of ``api_key`` (a job per
    choice), and answer it in OpenAI's shapes (SSE when streamed). The public API calls it with the
    bearer key; the dashboard's playground with the signed-in customer's playground key. With an
    ``idempotency_key`` (the request's Idempotency-Key header), a retry is answered, not run, again
    (``jobs.idempotency``)."""
    record = None
    parsed = None
    try:
        if idempotency_key is not None:
            parsed = await sync_to_async(request_body.parse)(body, kind)  # it reads the catalog
            record, replay = await _claim(api_key, idempotency.check_key(idempotency_key), body)
            if replay is not None:
                response = replayed(replay, parsed[1].stream, parsed[1].include_usage)
                response["x-request-id"], response["Idempotent-Replayed"] = request_id, "true"
                return response
        # The request's database connection (the key's lookup took it) is handed back in the same
        # thread: a request waiting its turn in admission's line holds none.
        model, params, prompt_ids, headers = await sync_to_async(releasing(_prepare))(api_key, body, kind, parsed)
        jobs = await admission.admit(
            api_key=api_key, kind=kind, model=model, params=params, prompt_ids=prompt_ids, request_id=request_id
        )
        # From here on the request's lines (its stream, its end) name its job too: choice 0's, the response's id.
        logs.bind(job_id=jobs[0].public_id)
        log.info("admitted %d job(s) for %s on key %s", len(jobs), model, api_key.prefix)
        if record is not None:
            await sync_to_async(releasing(idempotency.attach))(record, jobs[0])
    except DomainError as exc:
        if record is not None:
            await sync_to_async(idempotency.abandon)(record)
        return error_response(exc, request_id=request_id)
    # The rest of the response only waits on its jobs' events: no database connection is held
    # from here (admission's thread handed its back), so long streams cannot starve the jobs.
    events = job_events.channel()
    subscriptions = [events.subscribe(job.public_id) for job in jobs]  # each reads its job's events from the first
    for job in jobs:
        tasks.launch(job)
    answer = Reply(jobs, subscriptions, kind, model, get_channel_layer(), idempotent=record)
    if params.stream:
        response = EventStream(answer.sse(params.include_usage))
    else:
        try:
            response = JsonResponse(await answer.whole())
        except DomainError as exc:
            return error_response(exc, request_id=request_id)
    response["x-request-id"] = request_id
    for name, value in headers.items():
        response[name] = value
    return response


def _prepare(
    api_key: ApiKey, body: dict, kind: str, parsed: tuple[str, RequestParams] | None
) -> tuple[str, RequestParams, tuple[int, ...], dict]:
    """A request's work before admission, in one worker thread: its body parsed (unless
    ``parsed`` already: the served model's key, which reads the catalog, and the parameters), its
    prompt tokenized once (the count holds credits and rate limits, the ids go to the coordinator),
    its completion fitted to the context, and the key's rate limits checked (each choice is a
    request of its own for the limits as for the bill). Returns (model, fitted params, prompt ids,
    rate-limit headers)."""
    model, params = parsed if parsed is not None else request_body.parse(body, kind)
    params = services.with_tool_decision(model, params)  # before tokenizing: its grammar is checked there
    prompt_ids = services.tokenize_prompt(model, params)
    given = body.get("max_completion_tokens", body.get("max_tokens")) is not None
    params = services.fit_context(model, len(prompt_ids), params, max_tokens_given=given)
    headers = ratelimit.check(api_key, params.n * (len(prompt_ids) + params.max_tokens))
    return model, params, prompt_ids, headers


async def _claim(api_key: ApiKey, key: str, body: dict) -> tuple[int, dict | None]:
    """Claim the Idempotency-Key ``key`` for ``body``: (its record, the first attempt's answer to
    send again, or None to run the request). A first attempt still in flight is waited for, up to
    a job's timeout; past it, 409 ``idempotency_key_in_use``. The jobs of an attempt this one
    supersedes that still run (their web process is gone, nobody reads them) are stopped."""
    digest = idempotency.body_digest(body)
    deadline = time.monotonic() + settings.SWARM_JOB_TIMEOUT_S + idempotency.LOST_AFTER_S
    pause = admission.ADMISSION_POLL_S
    while True:
        claim = await sync_to_async(idempotency.claim)(api_key.user, key, digest)
        if not claim.wait:
            layer = get_channel_layer()
            for public_id in claim.superseded:
                await runner.request_cancel(layer, public_id)
            return claim.record, claim.replay
        if time.monotonic() >= deadline:
            raise InvalidRequest(
                "A request with this Idempotency-Key is still being answered; retry later.",
                code="idempotency_key_in_use",
            )
        # Doubling: the retries of a web host's streams all wait for its sign of life to expire at once.
        await asyncio.sleep(pause)
        pause = min(2 * pause, KEY_POLL_MAX_S)
