"""The body of an inference request (``/v1/chat/completions``, ``/v1/completions``), validated
into ``RequestParams``: every key either acts or is refused by name, with OpenAI's messages."""

from __future__ import annotations

import json
import re

from django.conf import settings

from marketplace.catalog.selectors import requested_model
from marketplace.jobs import tools
from marketplace.jobs.errors import InvalidRequest, ModelNotFound
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
from marketplace.nodes.models import Privacy, strictest

ROLES = {"system", "user", "assistant", "developer", "tool"}


# The request keys each endpoint acts on; every other key is refused by name, as OpenAI refuses
# an argument it does not recognise, so that nothing a client sends is silently ignored.
_COMMON_KEYS = frozenset(
    {"model", "n", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user"}
    | {"presence_penalty", "frequency_penalty", "logit_bias"}
    | {"top_k", "min_p", "repetition_penalty"}  # not OpenAI's: as vLLM and OpenRouter take them
    | {"speculation"}  # this API's own: False turns speculative decoding off (the same tokens)
    | {"provider"}  # routing, in the spirit of OpenRouter's: {"trusted_only": true} or {"trusted_ends": true}
)
PROVIDER_KEYS = {"trusted_only": str(Privacy.TRUSTED_ONLY), "trusted_ends": str(Privacy.TRUSTED_ENDS)}
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


def _provider(value: object) -> str:
    """The ``Privacy`` a request's "provider" object asks for: ``trusted_only`` (every stage on a
    node an admin marked trusted) or ``trusted_ends`` (the first and last stages), or neither."""
    if value is None:
        return str(Privacy.ANY)
    if not isinstance(value, dict):
        raise InvalidRequest("'provider' must be an object, e.g. {\"trusted_only\": true}.", param="provider")
    for key, flag in value.items():
        if key not in PROVIDER_KEYS:
            raise InvalidRequest(
                f"Unsupported parameter: provider.{key} is not supported; provider routing here takes "
                f"{' and '.join(PROVIDER_KEYS)}.",
                param=f"provider.{key}",
                code="unsupported_parameter",
            )
        if not isinstance(flag, bool):
            raise InvalidRequest(f"'provider.{key}' must be a boolean.", param=f"provider.{key}")
    return strictest(*(mode for key, mode in PROVIDER_KEYS.items() if value.get(key)))


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


def parse(body: dict, kind: str) -> tuple[str, RequestParams]:
    """The served model's key (``catalog.selectors.requested_model``: a catalog name becomes its
    model ref) and the parameters of a request body of ``kind`` ("chat" or "completion"); 400
    naming what is wrong. It reads the catalog: call it from a thread, not an event loop."""
    _check_keys(body, kind)
    requested = body.get("model")
    if not isinstance(requested, str) or not requested:
        raise InvalidRequest("'model' is required.", param="model")
    model = requested_model(requested)
    if model is None:
        raise ModelNotFound(f"The model '{requested}' does not exist.", param="model")
    n = body.get("n")
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= settings.SWARM_MAX_CHOICES:
        raise InvalidRequest(f"'n' must be an integer in [1, {settings.SWARM_MAX_CHOICES}].", param="n")
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
    if tool_choice != "none" and response_format is not None:
        raise InvalidRequest("Tool calls and 'response_format' cannot both shape the output.", param="tool_choice")
    parallel_tool_calls = body.get("parallel_tool_calls", True)
    if not isinstance(parallel_tool_calls, bool | None):
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
        parallel_tool_calls=parallel_tool_calls is not False,
        n=n,
        privacy=_provider(body.get("provider")),
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
