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
import re
import time
import uuid

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from marketplace.api import ratelimit
from marketplace.api.auth import api_key_required
from marketplace.api.errors import allow_method, error_body, error_response
from marketplace.api.parsers import loads_bounded
from marketplace.billing.selectors import per_token
from marketplace.billing.services import prices_for
from marketplace.db import release_connections
from marketplace.errors import DomainError
from marketplace.jobs import runner, services, tasks, tools
from marketplace.jobs.errors import InvalidRequest, JobFailed, ModelNotFound, NoCapacity
from marketplace.jobs.models import ApiKey, Job
from marketplace.jobs.params import (
    DEFAULT_MAX_TOKENS,
    MAX_COMPLETION_LOGPROBS,
    MAX_STOP,
    MAX_TOP_LOGPROBS,
    MIN_P_RANGE,
    PENALTY_RANGE,
    REPETITION_RANGE,
    SEED_RANGE,
    TEMPERATURE_RANGE,
    TOP_P_RANGE,
    ChatMessage,
    RequestParams,
    check_number,
)
from marketplace.placement.selectors import context_length, recovering, servable_pipelines

log = logging.getLogger("swarm.api")
ROLES = {"system", "user", "assistant", "developer", "tool"}
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


# The request keys each endpoint acts on; every other key is refused by name, as OpenAI refuses
# an argument it does not recognise, so that nothing a client sends is silently ignored.
_COMMON_KEYS = frozenset(
    {"model", "n", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user"}
    | {"presence_penalty", "frequency_penalty", "logit_bias"}
    | {"top_k", "min_p", "repetition_penalty"}  # not OpenAI's: as vLLM and OpenRouter take them
    | {"speculation"}  # this API's own: False turns speculative decoding off (the same tokens)
)
REQUEST_KEYS = {
    "chat": _COMMON_KEYS
    | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format"}
    | {"tools", "tool_choice", "parallel_tool_calls"},
    "completion": _COMMON_KEYS | {"prompt", "logprobs"},
}
# Keys of OpenAI's API that this one does not implement (yet): accepted only with the value that
# asks for nothing (None always counts as absent), otherwise refused as unsupported by name.
NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {
    "response_format": ({"type": "text"},),  # a text completion's: JSON output is a chat completion's
    "tools": ([],),  # a text completion's
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),
    "functions": ([],),
    "function_call": ("none",),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "metadata": ({},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "verbosity": (),
    "prompt_cache_key": (),
    "safety_identifier": (),
}
MESSAGE_KEYS = {  # the keys a message of each role may carry
    "assistant": frozenset({"role", "content", "tool_calls"}),
    "tool": frozenset({"role", "content", "tool_call_id"}),
}
PLAIN_MESSAGE_KEYS = frozenset({"role", "content"})
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


def _check_keys(body: dict, kind: str) -> None:
    """Refuse (400) a key this endpoint does not know, and one it knows but does not implement
    unless its value asks for nothing; a key set to null counts as absent."""
    for key, value in body.items():
        if key in REQUEST_KEYS[kind] or value is None:
            continue
        if key not in NEUTRAL_VALUES:
            raise InvalidRequest(f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
        if not any(type(value) is type(neutral) and value == neutral for neutral in NEUTRAL_VALUES[key]):
            raise InvalidRequest(
                f"Unsupported parameter: '{key}' is not supported by this API yet.",
                param=key,
                code="unsupported_parameter",
            )


def _number(body: dict, name: str, default: float, bounds: tuple[float, float], *, low_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    check_number(name, value, bounds, low_open=low_open)
    return float(value)


def _messages(body: dict) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array.", param="messages")
    clean = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or message["role"] not in ROLES:
            raise InvalidRequest(f"messages[{index}] needs a role of {sorted(ROLES)}.", param=f"messages.{index}.role")
        allowed = MESSAGE_KEYS.get(message["role"], PLAIN_MESSAGE_KEYS)
        for key, value in message.items():
            if key not in allowed and value is not None:
                raise InvalidRequest(
                    f"Unsupported parameter: messages[{index}].{key} is not supported by this API yet.",
                    param=f"messages.{index}.{key}",
                    code="unsupported_parameter",
                )
        content = message.get("content")
        if message["role"] == "assistant" and message.get("tool_calls") is not None:
            content = (content or "") + _calls_text(index, message["tool_calls"])
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise InvalidRequest(f"messages[{index}] needs a 'tool_call_id'.", param=f"messages.{index}.tool_call_id")
        if isinstance(content, list):  # content parts: only text is supported
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise InvalidRequest(
                    f"messages[{index}].content supports text parts only.", param=f"messages.{index}.content"
                )
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{index}].content must be a string.", param=f"messages.{index}.content")
        role = "system" if message["role"] == "developer" else message["role"]
        clean.append(ChatMessage(role, content))
    return tuple(clean)


def _calls_text(index: int, calls: object) -> str:
    """An assistant message's earlier ``tool_calls``, as the model writes a call."""
    if not isinstance(calls, list) or not all(
        isinstance(c, dict)
        and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments"), str)
        for c in calls
    ):
        raise InvalidRequest(
            f"messages[{index}].tool_calls must be calls with a function name and JSON arguments.",
            param=f"messages.{index}.tool_calls",
        )
    return tools.call_text(calls)


def _params(body: dict, kind: str) -> tuple[str, RequestParams]:
    _check_keys(body, kind)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required.", param="model")
    if model not in settings.SWARM_MODELS:
        raise ModelNotFound(f"The model '{model}' does not exist.", param="model")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise InvalidRequest("Only n=1 is supported.", param="n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not (1 <= max_tokens <= settings.SWARM_MAX_TOKENS_LIMIT)
    ):
        raise InvalidRequest(f"'{name}' must be an integer in [1, {settings.SWARM_MAX_TOKENS_LIMIT}].", param=name)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop)
    ):
        raise InvalidRequest(f"'stop' must be a string or up to {MAX_STOP} non-empty strings.", param="stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidRequest("'seed' must be an integer.", param="seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise InvalidRequest(f"'seed' must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}].", param="seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean.", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string.", param="user")
    speculation = body.get("speculation", True)
    if not isinstance(speculation, bool):
        raise InvalidRequest("'speculation' must be a boolean.", param="speculation")
    temperature = _number(body, "temperature", 1.0, TEMPERATURE_RANGE)
    top_p = _number(body, "top_p", 1.0, TOP_P_RANGE, low_open=True)
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise InvalidRequest("'top_k' must be an integer.", param="top_k")
    logit_bias = body.get("logit_bias") or {}
    if not isinstance(logit_bias, dict):
        raise InvalidRequest("'logit_bias' must be an object mapping token ids to biases.", param="logit_bias")
    for key in logit_bias:
        if not (key.isascii() and key.isdigit() and len(key) <= 9):
            raise InvalidRequest(f"'logit_bias' keys must be token ids, got {key!r}.", param="logit_bias")
    logprobs = _logprobs(body, kind)
    response_format = _response_format(body.get("response_format")) if kind == "chat" else None
    functions = tools.parse_tools(body.get("tools")) if kind == "chat" else ()
    tool_choice = tools.parse_tool_choice(body.get("tool_choice"), functions)
    if tool_choice == "auto":
        raise InvalidRequest(
            "Unsupported parameter: tool_choice 'auto' (the model choosing whether to call a tool) is not supported "
            "by this API yet; use 'required', a named function, or 'none'.",
            param="tool_choice",
            code="unsupported_parameter",
        )
    if tool_choice != "none" and response_format is not None:
        raise InvalidRequest(
            "A required tool call and 'response_format' cannot both shape the output.", param="tool_choice"
        )
    if not isinstance(body.get("parallel_tool_calls", True), bool | None):
        raise InvalidRequest("'parallel_tool_calls' must be a boolean.", param="parallel_tool_calls")
    messages, prompt = None, None
    if kind == "chat":
        messages = _messages(body)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequest("'prompt' must be a non-empty string.", param="prompt")
    params = RequestParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=tuple(stop or ()),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        user=user,
        messages=messages,
        prompt=prompt,
        speculation=speculation,
        top_k=top_k or 0,
        min_p=_number(body, "min_p", 0.0, MIN_P_RANGE),
        presence_penalty=_number(body, "presence_penalty", 0.0, PENALTY_RANGE),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, PENALTY_RANGE),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, REPETITION_RANGE, low_open=True),
        logit_bias=tuple((int(key), bias) for key, bias in logit_bias.items()),
        logprobs=logprobs,
        response_format=response_format,
        tools=functions,
        tool_choice=tool_choice,
    )
    return model, params


SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _response_format(value: object) -> tuple[str, str | None] | None:
    """A chat request's ``response_format``: None for text, ("json_object", None), or
    ("json_schema", the schema's JSON text). The schema is compiled at admission (a schema the
    grammar compiler refuses answers 400 there)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(
            '\'response_format\' must be {"type": "text" | "json_object" | "json_schema", ...}.',
            param="response_format",
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return kind, None
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not SCHEMA_NAME.fullmatch(spec["name"]):
        raise InvalidRequest(
            "'response_format.json_schema' needs a 'name' of 1-64 letters, digits, '_' or '-'.",
            param="response_format.json_schema.name",
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise InvalidRequest(
            "'response_format.json_schema.schema' must be a JSON schema object.",
            param="response_format.json_schema.schema",
        )
    if not isinstance(spec.get("strict", False), bool | None):
        raise InvalidRequest(
            "'response_format.json_schema.strict' must be a boolean.", param="response_format.json_schema.strict"
        )
    return kind, json.dumps(schema, sort_keys=True)


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per token the request wants log-probabilities of (None: none): a
    chat's ``logprobs`` (bool) and ``top_logprobs`` (0-20), a text completion's ``logprobs`` (0-5)."""
    if kind == "chat":
        wanted, top = body.get("logprobs"), body.get("top_logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise InvalidRequest("'logprobs' must be a boolean.", param="logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise InvalidRequest(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}].", param="top_logprobs")
        if top is not None and not wanted:
            raise InvalidRequest("'top_logprobs' needs 'logprobs' set to true.", param="top_logprobs")
        return (top or 0) if wanted else None
    wanted = body.get("logprobs")
    if wanted is not None and (
        isinstance(wanted, bool) or not isinstance(wanted, int) or not 0 <= wanted <= MAX_COMPLETION_LOGPROBS
    ):
        raise InvalidRequest(f"'logprobs' must be an integer in [0, {MAX_COMPLETION_LOGPROBS}].", param="logprobs")
    return wanted


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
        model, params = _params(body, kind)
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
            message = {"role": "assistant", "content": content, "refusal": None}
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
        self, delta_text: str | None, finish: str | None, *, first: bool = False, tokens: list[dict] = ()
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
