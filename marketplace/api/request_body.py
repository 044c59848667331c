"""The body of an inference request (``/v1/chat/completions``, ``/v1/completions``), validated
into ``RequestParams``: every key either acts or is refused by name, with OpenAI's messages.

A body is checked in this order: its keys (one this endpoint does not know, or knows but does not
implement, is refused by name); the model it names (404 when the catalog serves none of that
name); its values, by the request types (``inference_schema``), whose first error is answered in
the API's words (``_refusal``: the message, the ``param`` path and the code, from the field's type
and bounds); then what the types cannot say: the rules across fields, the tools (``jobs.tools``)."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from django.conf import settings
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from marketplace.api.inference_schema import (
    REQUEST_TYPES,
    ROLES,
    SETTING_MAXIMA,
    AssistantMessage,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    Sampling,
)
from marketplace.catalog.selectors import requested_model
from marketplace.jobs import tools
from marketplace.jobs.errors import InvalidRequest, ModelNotFound
from marketplace.jobs.params import MAX_LOGIT_BIAS, MAX_STOP, ChatMessage, RequestParams
from marketplace.nodes.models import Privacy, strictest
from worker_agent.coordinator.sampling import BIAS_RANGE

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


PROVIDER_KEYS = {"trusted_only": str(Privacy.TRUSTED_ONLY), "trusted_ends": str(Privacy.TRUSTED_ENDS)}
UNVALIDATED = ("tools", "tool_choice")  # checked by ``jobs.tools``, which compiles their schemas


def parse(body: dict, kind: str) -> tuple[str, RequestParams]:
    """The served model's key (``catalog.selectors.requested_model``: a catalog name becomes its
    model ref) and the parameters of a request body of ``kind`` ("chat" or "completion"); 400
    naming what is wrong. It reads the catalog: call it from a thread, not an event loop."""
    _check_keys(body, kind)
    given = {key: value for key, value in body.items() if value is not None and key in REQUEST_KEYS[kind]}
    if kind == "chat" and isinstance(given.get("messages"), list):  # a message's null keys are absent too
        given["messages"] = [
            {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in given["messages"]
        ]
    model = None
    requested = given.get("model")
    if isinstance(requested, str) and requested:
        model = requested_model(requested)
        if model is None:
            raise ModelNotFound(f"The model '{requested}' does not exist.", param="model")
    request_type = REQUEST_TYPES[kind]
    try:
        request = request_type.model_validate({k: v for k, v in given.items() if k not in UNVALIDATED})
    except ValidationError as exc:
        raise _refusal(exc.errors()[0], request_type) from None
    assert model is not None  # the type requires a non-empty model name
    if isinstance(request, ChatCompletionRequest):
        return model, _chat_params(request, given)
    assert isinstance(request, CompletionRequest)
    prompt = request.prompt if isinstance(request.prompt, str) else request.prompt[0]
    return model, _params(request, prompt=prompt, logprobs=request.logprobs)


def _chat_params(request: ChatCompletionRequest, given: dict) -> RequestParams:
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs' set to true.", param="top_logprobs")
    response_format = _response_format(request.response_format)
    functions = tools.parse_tools(given.get("tools"))
    tool_choice = tools.parse_tool_choice(given.get("tool_choice"), functions)
    if tool_choice != "none" and response_format is not None:
        raise InvalidRequest("Tool calls and 'response_format' cannot both shape the output.", param="tool_choice")
    messages = []
    for message in request.messages:
        content = message.content
        if isinstance(content, list):  # content parts: text only
            content = "".join(part.text for part in content)
        if isinstance(message, AssistantMessage) and message.tool_calls is not None:
            calls = [call.model_dump(exclude_none=True) for call in message.tool_calls]
            content = (content or "") + tools.call_text(calls)
        role = "system" if message.role == "developer" else message.role
        messages.append(ChatMessage(role, content or ""))
    return _params(
        request,
        max_tokens=request.max_completion_tokens or request.max_tokens,
        messages=tuple(messages),
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        response_format=response_format,
        tools=functions,
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
    )


# What both endpoints take under the name and in the form ``RequestParams`` keeps it (temperature,
# seed, n, ...): passed on as they are; the other parameters are converted in ``_params``.
AS_THEY_ARE = frozenset(field.name for field in dataclasses.fields(RequestParams)) & set(Sampling.model_fields) - {
    "stop",
    "logit_bias",
}


def _params(request: ChatCompletionRequest | CompletionRequest, **fields: Any) -> RequestParams:
    """``RequestParams`` from what both endpoints take, with the endpoint's own ``fields``."""
    stop = request.stop
    provider = request.provider
    return RequestParams(
        **{name: getattr(request, name) for name in AS_THEY_ARE} | fields,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        include_usage=request.stream_options is not None and request.stream_options.include_usage,
        logit_bias=tuple((int(key), bias) for key, bias in (request.logit_bias or {}).items()),
        privacy=strictest(*(mode for key, mode in PROVIDER_KEYS.items() if provider and getattr(provider, key))),
    )


def _response_format(value: ResponseFormat | None) -> tuple[str, str | None] | None:
    """A chat request's ``response_format``: None for text, ("json_object", None), or
    ("json_schema", the schema's JSON text). The schema is compiled at admission (a schema the
    grammar compiler refuses answers 400 there)."""
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return value.type, None
    if value.json_schema is None:
        raise InvalidRequest(NAMED_SCHEMA, param="response_format.json_schema.name")
    return value.type, json.dumps(value.json_schema.schema_, sort_keys=True)


# The API's words for a value the request types refuse, where a field's type and bounds do not say
# it (``_refusal`` says the rest): by the refused field, or its path's first parts.
NAMED_SCHEMA = "'response_format.json_schema' needs a 'name' of 1-64 letters, digits, '_' or '-'."
MESSAGES: dict[tuple[str | int, ...], str] = {
    ("model",): "'model' is required.",
    ("stop",): f"'stop' must be a string or up to {MAX_STOP} non-empty strings.",
    ("stream_options",): "'stream_options' must be an object.",
    ("logit_bias",): "'logit_bias' must be an object mapping token ids to biases.",
    ("provider",): "'provider' must be an object, e.g. {\"trusted_only\": true}.",
    ("messages",): "'messages' must be a non-empty array.",
    ("prompt",): "'prompt' must be a non-empty string.",
    ("response_format",): '\'response_format\' must be {"type": "text" | "json_object" | "json_schema", ...}.',
    ("response_format", "json_schema"): NAMED_SCHEMA,
    ("response_format", "json_schema", "name"): NAMED_SCHEMA,
    ("response_format", "json_schema", "schema"): "'response_format.json_schema.schema' must be a JSON schema object.",
    ("response_format", "json_schema", "strict"): "'response_format.json_schema.strict' must be a boolean.",
    ("response_format", "json_schema", "description"): "'response_format.json_schema.description' must be a string.",
    ("stream_options", "include_usage"): "'stream_options.include_usage' must be a boolean.",
}


def _refusal(error: ErrorDetails, request_type: type[BaseModel]) -> InvalidRequest:
    """The API's 400 for a request type's first ``error``: its message, the ``param`` path of the
    refused value (dotted, ``messages.0.content``) and, for a key no type names, its code. A field
    of one plain type is refused in words its type and bounds give; the others in ``MESSAGES``."""
    loc = tuple(str(part) if not isinstance(part, int) else part for part in error["loc"])
    field = str(loc[0])
    if field == "messages" and len(loc) > 1:
        return _message_refusal(int(loc[1]), loc[2:], error)
    if field == "logit_bias" and len(loc) > 1:
        if loc[-1] == "[key]":
            return InvalidRequest(f"'logit_bias' keys must be token ids, got {loc[1]!r}.", param="logit_bias")
        return _number_refusal(f"logit_bias.{loc[1]}", error, BIAS_RANGE, low_open=False)
    if field == "logit_bias" and error["type"] == "too_long":
        return InvalidRequest(f"'logit_bias' may bias at most {MAX_LOGIT_BIAS} distinct tokens.", param="logit_bias")
    if field == "provider" and len(loc) > 1:
        if error["type"] == "extra_forbidden":
            return InvalidRequest(
                f"Unsupported parameter: provider.{loc[1]} is not supported; provider routing here takes "
                f"{' and '.join(PROVIDER_KEYS)}.",
                param=f"provider.{loc[1]}",
                code="unsupported_parameter",
            )
        return InvalidRequest(f"'provider.{loc[1]}' must be a boolean.", param=f"provider.{loc[1]}")
    for length in range(min(len(loc), 3), 0, -1):
        if loc[:length] in MESSAGES:
            text = MESSAGES[loc[:length]]
            param = "response_format.json_schema.name" if text == NAMED_SCHEMA else ".".join(map(str, loc[:length]))
            return InvalidRequest(text, param=param)
    name = ".".join(map(str, loc))
    info = request_type.model_fields[field]
    kind = _plain(info.annotation)
    low, high, low_open = _bounds(field, info.metadata)
    if kind is float:
        return _number_refusal(name, error, (low, high), low_open=low_open)
    if kind is int:
        return InvalidRequest(f"'{name}' must be an integer in [{low}, {high}].", param=name)
    return InvalidRequest(f"'{name}' must be a {'boolean' if kind is bool else 'string'}.", param=name)


def _message_refusal(index: int, rest: tuple, error: ErrorDetails) -> InvalidRequest:
    """A refused message, in the API's words: its role, a key its role does not carry, its content,
    its calls or the call it answers (``rest``: the error's path inside the message, the role first)."""
    where = f"messages[{index}]"
    if not rest or error["type"] in ("union_tag_invalid", "union_tag_not_found"):
        return InvalidRequest(f"{where} needs a role of {sorted(ROLES)}.", param=f"messages.{index}.role")
    key = str(rest[1]) if len(rest) > 1 else "content"  # no key: the message as a whole (no content)
    if error["type"] == "extra_forbidden":
        return InvalidRequest(
            f"Unsupported parameter: {where}.{key} is not supported by this API yet.",
            param=f"messages.{index}.{key}",
            code="unsupported_parameter",
        )
    if key == "tool_calls":
        return InvalidRequest(
            f"{where}.tool_calls must be calls with a function name and JSON arguments.",
            param=f"messages.{index}.tool_calls",
        )
    if key == "tool_call_id":
        return InvalidRequest(f"{where} needs a 'tool_call_id'.", param=f"messages.{index}.tool_call_id")
    if isinstance(error["input"], list) or (len(rest) > 2 and rest[2] != "str"):  # a list of parts, not all text
        return InvalidRequest(f"{where}.content supports text parts only.", param=f"messages.{index}.content")
    return InvalidRequest(f"{where}.content must be a string.", param=f"messages.{index}.content")


def _number_refusal(name: str, error: ErrorDetails, bounds: tuple, *, low_open: bool) -> InvalidRequest:
    """A refused number: not one ("must be a number"), or out of ``bounds`` ("(" for an open low end)."""
    if error["type"] in ("float_type", "finite_number"):
        return InvalidRequest(f"'{name}' must be a number.", param=name)
    low, high = bounds
    bracket = "(" if low_open else "["
    return InvalidRequest(f"'{name}' must be in {bracket}{low:g}, {high:g}], got {error['input']}.", param=name)


def _bounds(field: str, metadata: list) -> tuple[Any, Any, bool]:
    """A field's (low, high, whether the low end is open), from its constraints and, for the bounds
    that are settings, the setting."""
    low = high = None
    low_open = False
    for constraint in metadata:  # annotated_types' Ge, Gt and Le, as Pydantic keeps a Field's bounds
        if hasattr(constraint, "ge"):
            low = constraint.ge
        elif hasattr(constraint, "gt"):
            low, low_open = constraint.gt, True
        elif hasattr(constraint, "le"):
            high = constraint.le
    if field in SETTING_MAXIMA:
        high = getattr(settings, SETTING_MAXIMA[field])
    return low, high, low_open


def _plain(annotation: object) -> object:
    """``int`` of ``int | None``; the annotation itself otherwise."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        options = [option for option in typing.get_args(annotation) if option is not type(None)]
        return options[0] if len(options) == 1 else annotation
    return annotation
