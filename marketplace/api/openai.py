"""The OpenAI-compatible inference API: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Async views: each request is authenticated by its bearer key, validated, rate limited, admitted
as a job on a ready route, and answered from the job's channel-layer group while its coordinator
runs (in-process or in a Celery worker of the job's region). Errors use OpenAI's JSON shape; an
error after streaming began arrives as a final SSE event carrying an ``error`` object. A client
that disconnects cancels its job.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from marketplace.api import ratelimit, request_body
from marketplace.api.auth import api_key_required
from marketplace.api.errors import allow_method, error_body, error_response
from marketplace.api.parsers import loads_bounded
from marketplace.billing.selectors import per_token
from marketplace.billing.services import prices_for
from marketplace.db import release_connections
from marketplace.errors import DomainError
from marketplace.jobs import runner, services, tasks, tools
from marketplace.jobs.errors import InvalidRequest, JobFailed, NoCapacity
from marketplace.jobs.models import ApiKey, Job
from marketplace.placement.selectors import context_length, recovering, servable_pipelines

log = logging.getLogger("swarm.api")
# While a job is silent, its record is checked this often for signs of life; the response gives up
# only when the job stopped making progress (jobs.services.stopped_answering), never on a clock of its own.
PROGRESS_CHECK_S = 5.0


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
    "tools": True,  # tool_choice "required" or a named function; "auto" is refused
    "structured_output": True,
    "logprobs": True,
}


def releases_db(view):
    """Async views run their ORM calls in a thread of the request's; Django's end-of-request
    cleanup runs elsewhere and would leave that thread's connection checked out of the pool, so
    close it here, on every way out."""

    @functools.wraps(view)
    async def wrapped(request, *args, **kwargs):
        try:
            return await view(request, *args, **kwargs)
        finally:
            await sync_to_async(release_connections)()

    return wrapped


def stamps_request_id(view):
    """Name each request ``req_<hex>`` (``request.request_id``) and send the name back in the
    x-request-id header of every answer, refusals included, so a client can quote it."""

    @functools.wraps(view)
    async def wrapped(request, *args, **kwargs):
        request.request_id = f"req_{uuid.uuid4().hex}"
        response = await view(request, *args, **kwargs)
        response["x-request-id"] = request.request_id
        return response

    return wrapped


@csrf_exempt
@releases_db
@stamps_request_id
@allow_method("GET")
@api_key_required
async def list_models(request: HttpRequest, api_key: ApiKey) -> JsonResponse:
    def listing() -> list[dict]:
        entries = []
        for model in settings.SWARM_MODELS:
            if servable_pipelines(model):
                prompt, completion = prices_for(model)
                entries.append(
                    {
                        "id": model,
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
@stamps_request_id
@allow_method("POST")
@api_key_required
async def chat_completions(request: HttpRequest, api_key: ApiKey) -> HttpResponse:
    return await _complete(request, api_key, "chat")


@csrf_exempt
@releases_db
@stamps_request_id
@allow_method("POST")
@api_key_required
async def completions(request: HttpRequest, api_key: ApiKey) -> HttpResponse:
    return await _complete(request, api_key, "completion")


async def _complete(request: HttpRequest, api_key: ApiKey, kind: str) -> HttpResponse:
    try:
        body = _json_body(request)
    except DomainError as exc:
        return error_response(exc)
    return await complete_for_key(api_key, body, kind, request.request_id)


async def complete_for_key(api_key: ApiKey, body: dict, kind: str, request_id: str) -> HttpResponse:
    """Validate a request ``body``, rate limit and admit it as a job of ``api_key``, and answer it
    in OpenAI's shapes (SSE when streamed). The public API calls it with the bearer key; the
    dashboard's playground with the signed-in customer's playground key."""
    try:
        model, params = request_body.parse(body, kind)
        # Tokenized once, here: the count holds credits and rate limits, the ids go to the coordinator.
        prompt_ids = await sync_to_async(services.tokenize_prompt)(model, params)
        given = body.get("max_completion_tokens", body.get("max_tokens")) is not None
        params = await sync_to_async(services.fit_context)(model, len(prompt_ids), params, max_tokens_given=given)
        headers = await sync_to_async(ratelimit.check)(api_key, len(prompt_ids) + params.max_tokens)
        job = await _admit(api_key=api_key, kind=kind, model=model, params=params, prompt_ids=prompt_ids)
    except DomainError as exc:
        return error_response(exc, request_id=request_id)
    # The rest of the response only waits on the channel layer: hand this request's database
    # connection back now, not when a long stream ends, so streams cannot starve the jobs.
    await sync_to_async(release_connections)()
    layer = get_channel_layer()
    channel = await layer.new_channel()
    await layer.group_add(runner.group_name(job.pk), channel)  # subscribe before the coordinator starts
    tasks.launch(job)
    reply = _Reply(job, kind, model, job.prompt_tokens, layer, channel)
    if params.stream:
        response = StreamingHttpResponse(reply.sse(params.include_usage), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
    else:
        try:
            answer = await reply.whole()
        except DomainError as exc:
            return error_response(exc, request_id=request_id)
        except asyncio.CancelledError:  # the client went away before the whole response
            await asyncio.shield(runner.request_cancel(layer, job.pk))
            raise
        response = JsonResponse(answer)
    response["x-request-id"] = request_id
    for name, value in headers.items():
        response[name] = value
    return response


ADMISSION_POLL_S = 0.25  # how often a request waiting for capacity asks again


async def _admit(**job) -> Job:
    """Admit the job; when its model has no ready route but is recovering (a node died and its
    span is being healed, re-placed or reloaded), wait up to SWARM_ADMISSION_WAIT_S for one before
    answering 503: churn in the swarm is normal and a client should not see it."""
    deadline = time.monotonic() + settings.SWARM_ADMISSION_WAIT_S
    while True:
        try:
            return await sync_to_async(services.admit_job)(**job)
        except NoCapacity:
            if time.monotonic() >= deadline or not await sync_to_async(recovering)(job["model"]):
                raise
        await asyncio.sleep(ADMISSION_POLL_S)


class _Reply:
    """Reads a job's events from its group and shapes them as OpenAI responses."""

    def __init__(self, job, kind: str, model: str, prompt_tokens: int, layer, channel: str) -> None:
        self.job, self.kind, self.model = job, kind, model
        self.prompt_tokens = prompt_tokens
        self.logprobs = job.params.get("logprobs")  # alternatives per token, or None: no log-probabilities
        self.calls_tool = job.params.get("tool_choice", "none") != "none"  # the output is one function call
        self._offset = 0  # a text completion's characters so far, for its logprobs' text_offset
        self.layer, self.channel = layer, channel
        self.created = int(time.time())

    async def events(self):
        try:
            while True:
                try:
                    async with asyncio.timeout(PROGRESS_CHECK_S):
                        event = await self.layer.receive(self.channel)
                except TimeoutError:
                    reason = await sync_to_async(services.stopped_answering)(self.job.pk)
                    await sync_to_async(release_connections)()
                    if reason is None:
                        continue
                    log.warning("job %s: %s", self.job.public_id, reason)
                    yield {"type": "job.error", "code": "timeout", "message": reason}
                    return
                except Exception as exc:  # the channel layer's own (e.g. Redis) error
                    log.warning("job %s: no event: %r", self.job.public_id, exc)
                    yield {"type": "job.error", "code": "timeout", "message": "the job stopped answering"}
                    return
                yield event
                if event["type"] in ("job.done", "job.error"):
                    return
        finally:
            await self.layer.group_discard(runner.group_name(self.job.pk), self.channel)

    def _usage(self, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def _logprobs(self, tokens: list[dict]) -> dict | None:
        """The ``logprobs`` object of a choice or chunk for the token events ``tokens``, in the
        endpoint's shape; None when the request asked for none."""
        if self.logprobs is None:
            return None
        if self.kind == "chat":

            def entry(text: str, logprob: float) -> dict:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            content = [
                entry(t["token"], t["logprob"]) | {"top_logprobs": [entry(a, b) for a, b in t["top_logprobs"]]}
                for t in tokens
            ]
            return {"content": content, "refusal": None}
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t["token"])
        return {
            "tokens": [t["token"] for t in tokens],
            "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [dict(t["top_logprobs"]) for t in tokens],
            "text_offset": offsets,
        }

    async def whole(self) -> dict:
        text, finish, completion, tokens = [], "stop", 0, []
        async for event in self.events():
            if event["type"] == "job.token":
                text.append(event["text"])
                if "logprob" in event:
                    tokens.append(event)
            elif event["type"] == "job.done":
                finish, completion = event["finish_reason"], event["completion_tokens"]
            else:
                raise _job_error(event)
        content = "".join(text)
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
            calls = tools.tool_calls_of(content) if self.calls_tool and finish == "stop" else None
            if calls:
                message, finish = (
                    {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls},
                    "tool_calls",
                )
            choice = {"index": 0, "message": message, "logprobs": self._logprobs(tokens), "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "logprobs": self._logprobs(tokens), "finish_reason": finish}
            obj = "text_completion"
        return {
            "id": self.job.public_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(completion),
            "system_fingerprint": None,
        }

    def _chunk(
        self, delta_text: str | None, finish: str | None, *, first: bool = False, tokens: Sequence[dict] = ()
    ) -> dict:
        logprobs = self._logprobs(list(tokens)) if tokens else None
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({"content": delta_text} if delta_text else {})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta_text or "", "logprobs": logprobs, "finish_reason": finish}
            obj = "text_completion"
        return {
            "id": self.job.public_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "system_fingerprint": None,
        }

    async def sse(self, include_usage: bool):
        ended = False
        try:
            if self.kind == "chat":
                yield _sse(self._chunk(None, None, first=True))
            tokens: list[dict] = []  # token events whose log-probabilities no chunk carried yet
            held: list[str] = []  # a call's text, sent as tool_calls once whole
            async for event in self.events():
                if event["type"] == "job.token":
                    if "logprob" in event:
                        tokens.append(event)
                    if event["text"] and self.calls_tool:
                        held.append(event["text"])
                    elif event["text"]:
                        yield _sse(self._chunk(event["text"], None, tokens=tokens))
                        tokens = []
                elif event["type"] == "job.done":
                    ended = True
                    finish = event["finish_reason"]
                    calls = tools.tool_calls_of("".join(held)) if held and finish == "stop" else None
                    if calls:
                        chunk = self._chunk(None, None, tokens=tokens)
                        chunk["choices"][0]["delta"] = {"tool_calls": [{"index": 0, **calls[0]}]}
                        yield _sse(chunk)
                        finish, tokens = "tool_calls", []
                    elif held:  # cut short: the text as it is
                        yield _sse(self._chunk("".join(held), None, tokens=tokens))
                        tokens = []
                    yield _sse(self._chunk(None, finish, tokens=tokens))
                    if include_usage:
                        usage = {
                            **self._chunk(None, None),
                            "choices": [],
                            "usage": self._usage(event["completion_tokens"]),
                        }
                        yield _sse(usage)
                else:
                    ended = True
                    yield _sse(error_body(_job_error(event)))
            yield b"data: [DONE]\n\n"
        finally:
            if not ended:  # the client went away mid-stream: stop the job, keep what was done
                await runner.request_cancel(self.layer, self.job.pk)


def _job_error(event: dict) -> JobFailed:
    return JobFailed(f"The job failed: {event.get('message')}", code=event.get("code", "job_failed"))


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
