"""The OpenAI-compatible inference API's request types: the bodies of ``/v1/chat/completions`` and
``/v1/completions`` as Pydantic models, which both validate a request (``request_body.parse``) and
document it in the OpenAPI schema (``/api/schema/``, shown at ``/api/docs/``) beside the REST API
that drf-spectacular documents from its views.

Every bound is taken from the constants the rest of the product uses (``jobs.params``,
``coordinator.sampling``); the two that are settings (``n`` up to SWARM_MAX_CHOICES, the
completion's tokens up to SWARM_MAX_TOKENS_LIMIT) are read when a request is validated. Types are
strict, as OpenAI's are: a boolean is not a number, a number is not a string. Keys a type does not
name are refused (``extra="forbid"``), except inside the objects whose other keys OpenAI's clients
send and this API has always let pass (``stream_options``, a response format, a text part, a tool
call). What the types cannot say (the catalog's models, the tools' JSON schemas, rules across
fields) ``request_body`` checks after them. ``add_inference_api`` is drf-spectacular's
postprocessing hook that adds the three operations, their error answers and the bearer key.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.json_schema import models_json_schema
from pydantic_core import PydanticCustomError

from marketplace.jobs import tools
from marketplace.jobs.params import (
    DEFAULT_MAX_TOKENS,
    MAX_COMPLETION_LOGPROBS,
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    MIN_P_RANGE,
    PENALTY_RANGE,
    REPETITION_RANGE,
    SEED_RANGE,
    TEMPERATURE_RANGE,
    TOP_P_RANGE,
)
from worker_agent.coordinator.sampling import BIAS_RANGE

# A key not named here is refused by name (``request_body.REQUEST_KEYS``); no value is coerced.
Strict = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
Lenient = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # other keys pass, unread
ROLES = ("system", "developer", "user", "assistant", "tool")
# The bounds that are settings, read at each validation: field -> the setting holding its maximum.
SETTING_MAXIMA = {
    "n": "SWARM_MAX_CHOICES",
    "max_tokens": "SWARM_MAX_TOKENS_LIMIT",
    "max_completion_tokens": "SWARM_MAX_TOKENS_LIMIT",
}


class StreamOptions(BaseModel):
    model_config = Lenient
    include_usage: bool = Field(False, description="A last chunk carries the usage.")


class Provider(BaseModel):
    """Routing by the nodes' trust (this API's, in the spirit of OpenRouter's)."""

    model_config = Strict
    trusted_only: bool = Field(False, description="Every stage on a node an admin marked trusted.")
    trusted_ends: bool = Field(False, description="The first and last stages (which see the text) on trusted nodes.")


class Sampling(BaseModel):
    """What both endpoints take."""

    model_config = Strict
    model: str = Field(min_length=1, description="A model id of GET /v1/models.")
    n: int = Field(1, ge=1, description="Choices to generate (at most SWARM_MAX_CHOICES).")
    max_tokens: int = Field(
        DEFAULT_MAX_TOKENS, ge=1, description="Completion tokens at most (at most SWARM_MAX_TOKENS_LIMIT)."
    )
    temperature: float = Field(1.0, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1], description="0: greedy.")
    top_p: float = Field(1.0, gt=TOP_P_RANGE[0], le=TOP_P_RANGE[1])
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="0: off (as vLLM takes it).")
    min_p: float = Field(0.0, ge=MIN_P_RANGE[0], le=MIN_P_RANGE[1], description="0: off (as vLLM takes it).")
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1], description="Seeded sampling replays.")
    stop: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)]
        | None
    ) = Field(None, description="The text ends before the first of these.")
    stream: bool = Field(False, description="Server-sent events, ended by `data: [DONE]`.")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="An end user's id, kept with the job.")
    presence_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    repetition_penalty: float = Field(
        1.0, gt=REPETITION_RANGE[0], le=REPETITION_RANGE[1], description="Hugging Face's, over prompt and output."
    )
    logit_bias: (
        dict[
            Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=BIAS_RANGE[0], le=BIAS_RANGE[1])]
        ]
        | None
    ) = Field(None, max_length=MAX_LOGIT_BIAS, description="Token id (as a string) to a bias added to its logit.")
    speculation: bool = Field(
        True, description="This API's own: false turns speculative decoding off (the same tokens)."
    )
    provider: Provider | None = None

    @field_validator(*SETTING_MAXIMA, check_fields=False)
    @classmethod
    def _at_most_the_setting(cls, value: int, info: ValidationInfo) -> int:
        assert info.field_name is not None
        if value > getattr(settings, SETTING_MAXIMA[info.field_name]):
            raise PydanticCustomError("less_than_equal", "over the setting's maximum")
        return value


class TextPart(BaseModel):
    model_config = Lenient
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = Lenient
    name: str
    arguments: str = Field(description="The arguments, as JSON text.")


class ToolCall(BaseModel):
    model_config = Lenient
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


Content = str | list[TextPart]


class PlainMessage(BaseModel):
    model_config = Strict
    role: Literal["system", "developer", "user"]
    content: Content


class AssistantMessage(BaseModel):
    model_config = Strict
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="Its earlier calls.")

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        if self.content is None and self.tool_calls is None:
            raise PydanticCustomError("missing_content", "an assistant message needs content or tool_calls")
        return self


class ToolMessage(BaseModel):
    model_config = Strict
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(description="The call it answers.")


Message = Annotated[PlainMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class Function(BaseModel):
    model_config = Strict
    name: str = Field(pattern=tools.NAME.pattern)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict, description="A JSON schema of the arguments.")


class Tool(BaseModel):
    model_config = Strict
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    model_config = Strict
    name: str


class NamedToolChoice(BaseModel):
    model_config = Strict
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = Lenient
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(
        default_factory=dict, alias="schema", description="The JSON schema the output follows."
    )
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    model_config = Lenient
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(Sampling):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="The same as max_tokens; wins over it.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Needs logprobs true.")
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=tools.MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='Default: "auto" with tools, "none" without.'
    )
    parallel_tool_calls: bool = Field(True, description="Several calls in one response, one a line.")


class CompletionRequest(Sampling):
    """POST /v1/completions."""

    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
    ) = Field(description="One prompt.")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS, description="Alternatives per token.")


REQUEST_TYPES: dict[str, type[BaseModel]] = {"chat": ChatCompletionRequest, "completion": CompletionRequest}

ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}}
ERRORS = {
    "400": ("Invalid request: `param` names what, `code` why (e.g. `context_length_exceeded`).", {}),
    "401": ("No key, a wrong or revoked key (`invalid_api_key`).", {}),
    "402": ("Not enough credits for the request's hold (`insufficient_quota`): add credits.", {}),
    "404": ("An unknown model (`model_not_found`) or path (`unknown_url`).", {}),
    "429": ("Over the key's requests or tokens per minute (`rate_limit_exceeded`).", RETRY_AFTER),
    "503": ("No capacity for the model now (`no_capacity`, `overloaded`, `no_trusted_capacity`).", RETRY_AFTER),
}
STREAM = "With `stream: true`: `text/event-stream` of chunk objects, then `data: [DONE]`."


def _errors() -> dict:
    return {
        status: {
            "description": text,
            "headers": headers,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}},
        }
        for status, (text, headers) in ERRORS.items()
    }


def _operation(kind: str, summary: str, answer: str) -> dict:
    name = REQUEST_TYPES[kind].__name__
    return {
        "operationId": f"v1_{kind}",
        "summary": summary,
        "tags": ["inference (OpenAI-compatible)"],
        "security": [{"ApiKeyBearer": []}],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        },
        "responses": {
            "200": {
                "description": f"{answer} {STREAM}",
                "content": {
                    "application/json": {"schema": {"type": "object"}},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
            **_errors(),
        },
    }


def inference_paths() -> tuple[dict, dict]:
    """The ``/v1`` operations and the component schemas they refer to."""
    _, definitions = models_json_schema(
        [(model, "validation") for model in REQUEST_TYPES.values()], ref_template="#/components/schemas/{model}"
    )
    components = dict(definitions.get("$defs", {}))
    chat = components[ChatCompletionRequest.__name__]
    chat["properties"]["n"]["maximum"] = settings.SWARM_MAX_CHOICES
    components[CompletionRequest.__name__]["properties"]["n"]["maximum"] = settings.SWARM_MAX_CHOICES
    components["OpenAIError"] = ERROR
    paths = {
        "/v1/models": {
            "get": {
                "operationId": "v1_models",
                "summary": "The models servable now, with their context length and capabilities.",
                "tags": ["inference (OpenAI-compatible)"],
                "security": [{"ApiKeyBearer": []}],
                "responses": {"200": {"description": "A list of models."}, "401": _errors()["401"]},
            }
        },
        "/v1/chat/completions": {"post": _operation("chat", "A chat completion.", "A chat.completion object.")},
        "/v1/completions": {"post": _operation("completion", "A text completion.", "A text_completion object.")},
    }
    return paths, components


def add_inference_api(result: dict, generator: Any, request: Any, public: bool) -> dict:
    """drf-spectacular's postprocessing hook: the schema with the ``/v1`` API in it."""
    paths, components = inference_paths()
    result.setdefault("paths", {}).update(paths)
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(components)
    result["components"].setdefault("securitySchemes", {})["ApiKeyBearer"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "An API key from the dashboard (`sk-...`), as OpenAI's clients send it.",
    }
    return result
