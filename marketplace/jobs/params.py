"""A job's request parameters: one frozen type, built once by the API from the validated request.

Stored on the job as JSON (``Job.params``) under the keys the API has always written, and read
back into the same type by the runner, so every reader sees one set of meanings and defaults
instead of picking keys out of a dict. Rows written before a key existed read its default.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from marketplace.jobs.errors import InvalidRequest
from marketplace.jobs.tools import Tool
from marketplace.nodes.models import Privacy

# The coordinator's own bounds: a request the API admits is one the coordinator takes.
from worker_agent.coordinator.sampling import BIAS_RANGE, PENALTY_RANGE, REPETITION_RANGE
from worker_agent.coordinator.session import MAX_TOP_LOGPROBS

MAX_STOP = 4  # stop strings a request may give, as OpenAI allows
TEMPERATURE_RANGE = (0.0, 2.0)  # [low, high], as OpenAI allows
TOP_P_RANGE = (0.0, 1.0)  # (low, high]: a top_p of 0 would keep no token
DEFAULT_MAX_TOKENS = 256  # completion tokens when the request names no limit
SEED_RANGE = (-(2**63), 2**63 - 1)  # a signed 64-bit integer, as OpenAI's API takes it
MIN_P_RANGE = (0.0, 1.0)
MAX_LOGIT_BIAS = 300  # tokens one request may bias
MAX_TOP_K = 1 << 20
MAX_COMPLETION_LOGPROBS = 5  # the same for a text completion's ``logprobs``


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user" or "assistant" ("developer" arrives as "system")
    content: str  # the message's text, content parts already joined


@dataclass(frozen=True)
class RequestParams:
    max_tokens: int = DEFAULT_MAX_TOKENS  # most completion tokens to generate (tokens, >= 1)
    temperature: float = 1.0  # sampling temperature, 0 = greedy (unitless, in TEMPERATURE_RANGE)
    top_p: float = 1.0  # nucleus sampling: smallest token set whose probability reaches it (in TOP_P_RANGE)
    seed: int | None = None  # fixes the sampling's random stream; None draws a fresh one
    stop: tuple[str, ...] = ()  # the text ends before the first of these (non-empty strings, at most MAX_STOP)
    stream: bool = False  # answer as server-sent events, token by token
    include_usage: bool = False  # streamed answers end with a usage chunk (stream_options.include_usage)
    user: str | None = None  # the customer's own end-user id, kept as given
    messages: tuple[ChatMessage, ...] | None = None  # a chat request's conversation, in order
    prompt: str | None = None  # a completion request's prompt text
    speculation: bool = True  # speculative decoding where it pays; False: plain decoding (same tokens)
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely (in MIN_P_RANGE)
    presence_penalty: float = 0.0  # OpenAI's, in PENALTY_RANGE
    frequency_penalty: float = 0.0  # OpenAI's, in PENALTY_RANGE
    repetition_penalty: float = 1.0  # Hugging Face's, over prompt and output (in REPETITION_RANGE, low open)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in BIAS_RANGE), ids distinct
    logprobs: int | None = None  # None: none; k: each token's log-probability and its k likeliest alternatives
    # The output must be JSON: ("json_object", None), or ("json_schema", the schema's JSON text).
    response_format: tuple[str, str | None] | None = None
    tools: tuple[Tool, ...] = ()  # functions the model may be asked to call (tools.py)
    tool_choice: str = "none"  # "none", "auto", "required" or a function's name (tools.py)
    parallel_tool_calls: bool = True  # a response may hold several calls
    # Under "auto" for a model whose template renders no tools: its output opens with its decision,
    # "Yes" (calls follow) or "No" (words follow), which the response leaves out (tools.py).
    tool_decides: bool = False
    # Choices the request asked for (>= 1): each runs as a job of its own, and this is stored on each.
    n: int = 1
    # Which nodes may see it (a ``Privacy`` value, from the request's "provider" object); its API
    # key's setting applies too, the stricter of the two.
    privacy: str = str(Privacy.ANY)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"'max_tokens' must be an integer >= 1, got {self.max_tokens!r}.", param="max_tokens")
        check_number("temperature", self.temperature, TEMPERATURE_RANGE, low_open=False)
        check_number("top_p", self.top_p, TOP_P_RANGE, low_open=True)
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]
        ):
            raise InvalidRequest(f"'seed' must be a 64-bit integer, got {self.seed!r}.", param="seed")
        if len(self.stop) > MAX_STOP or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest(f"'stop' must be up to {MAX_STOP} non-empty strings.", param="stop")
        if (self.messages is None) == (self.prompt is None):
            raise InvalidRequest("A request has either 'messages' or a 'prompt'.", param="messages")
        if self.messages is not None and not self.messages:
            raise InvalidRequest("'messages' must be a non-empty array.", param="messages")
        if self.prompt is not None and not self.prompt:
            raise InvalidRequest("'prompt' must be a non-empty string.", param="prompt")
        if not isinstance(self.speculation, bool):
            raise InvalidRequest("'speculation' must be a boolean.", param="speculation")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequest(f"'top_k' must be an integer in [0, {MAX_TOP_K}].", param="top_k")
        check_number("min_p", self.min_p, MIN_P_RANGE, low_open=False)
        check_number("presence_penalty", self.presence_penalty, PENALTY_RANGE, low_open=False)
        check_number("frequency_penalty", self.frequency_penalty, PENALTY_RANGE, low_open=False)
        check_number("repetition_penalty", self.repetition_penalty, REPETITION_RANGE, low_open=True)
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidRequest(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}].", param="top_logprobs")
        if self.response_format is not None and self.response_format[0] not in ("json_object", "json_schema"):
            raise InvalidRequest(
                "'response_format.type' must be text, json_object or json_schema.", param="response_format"
            )
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise InvalidRequest(f"'n' must be an integer >= 1, got {self.n!r}.", param="n")
        if self.privacy not in Privacy.values:
            raise InvalidRequest(f"'privacy' must be one of {Privacy.values}, got {self.privacy!r}.", param="provider")
        ids = [token for token, _ in self.logit_bias]
        if len(ids) > MAX_LOGIT_BIAS or len(set(ids)) != len(ids):
            raise InvalidRequest(f"'logit_bias' may bias at most {MAX_LOGIT_BIAS} distinct tokens.", param="logit_bias")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequest(f"'logit_bias' keys must be token ids, got {token!r}.", param="logit_bias")
            check_number(f"logit_bias.{token}", bias, BIAS_RANGE, low_open=False)

    def for_choice(self, index: int) -> RequestParams:
        """The parameters of choice ``index`` (0-based) of ``n``: the same, but a given seed moves
        by the index (wrapping within 64 bits), so that seeded choices differ and each replays."""
        if self.seed is None or index == 0:
            return self
        low, high = SEED_RANGE
        return replace(self, seed=(self.seed - low + index) % (high - low + 1) + low)

    @property
    def calls_tool(self) -> bool:
        """The output is, or may be, calls of functions (``tool_choice`` other than "none")."""
        return self.tool_choice != "none"

    @property
    def chat(self) -> bool:
        return self.messages is not None

    def prompt_bytes(self) -> int:
        """The prompt's text in UTF-8 bytes: a completion's prompt, or every message's content."""
        if self.messages is not None:
            return sum(len(m.content.encode()) for m in self.messages)
        return len((self.prompt or "").encode())

    def chat_messages(self) -> list[dict]:
        """The conversation in the shape chat templates take: [{role, content}]."""
        return [{"role": m.role, "content": m.content} for m in self.messages or ()]

    def to_json(self) -> dict:
        """The JSON stored as ``Job.params``: the keys and values the API has always written."""
        data: dict[str, object] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop),
            "stream": self.stream,
            "include_usage": self.include_usage,
            "user": self.user,
            "speculation": self.speculation,
        }
        # The logits' adjustments, written only when set: a request without them stores what it always did.
        adjustments = {
            "top_k": (self.top_k, 0),
            "min_p": (self.min_p, 0.0),
            "presence_penalty": (self.presence_penalty, 0.0),
            "frequency_penalty": (self.frequency_penalty, 0.0),
            "repetition_penalty": (self.repetition_penalty, 1.0),
        }
        data |= {key: value for key, (value, default) in adjustments.items() if value != default}
        if self.n != 1:
            data["n"] = self.n
        if self.privacy != Privacy.ANY:
            data["privacy"] = self.privacy
        if self.logit_bias:
            data["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}
        if self.logprobs is not None:
            data["logprobs"] = self.logprobs
        if self.response_format is not None:
            kind, schema = self.response_format
            data["response_format"] = {"type": kind} | ({} if schema is None else {"schema": json.loads(schema)})
        if self.tools:
            data["tools"] = [tool.to_json() for tool in self.tools]
            data["tool_choice"] = self.tool_choice
            data["parallel_tool_calls"] = self.parallel_tool_calls
            if self.tool_decides:
                data["tool_decides"] = True
        if self.messages is not None:
            data["messages"] = self.chat_messages()
        else:
            data["prompt"] = self.prompt
        return data

    @classmethod
    def from_json(cls, data: dict) -> RequestParams:
        """Read ``Job.params`` back; a key the row lacks takes the field's default."""
        messages = data.get("messages")
        return cls(
            max_tokens=data.get("max_tokens", DEFAULT_MAX_TOKENS),
            temperature=data.get("temperature", 1.0),
            top_p=data.get("top_p", 1.0),
            seed=data.get("seed"),
            stop=tuple(data.get("stop") or ()),
            stream=data.get("stream", False),
            include_usage=data.get("include_usage", False),
            user=data.get("user"),
            messages=None if messages is None else tuple(ChatMessage(m["role"], m["content"]) for m in messages),
            prompt=data.get("prompt"),
            speculation=data.get("speculation", True),
            privacy=data.get("privacy", Privacy.ANY),
            top_k=data.get("top_k", 0),
            min_p=data.get("min_p", 0.0),
            presence_penalty=data.get("presence_penalty", 0.0),
            frequency_penalty=data.get("frequency_penalty", 0.0),
            repetition_penalty=data.get("repetition_penalty", 1.0),
            logit_bias=tuple((int(token), bias) for token, bias in (data.get("logit_bias") or {}).items()),
            logprobs=data.get("logprobs"),
            response_format=_response_format(data.get("response_format")),
            tools=tuple(
                Tool(t["name"], t["description"], json.dumps(t["parameters"], sort_keys=True))
                for t in data.get("tools") or ()
            ),
            tool_choice=data.get("tool_choice", "none"),
            parallel_tool_calls=data.get("parallel_tool_calls", True),
            tool_decides=data.get("tool_decides", False),
            n=data.get("n", 1),
        )


def _response_format(stored: dict | None) -> tuple[str, str | None] | None:
    if stored is None:
        return None
    schema = stored.get("schema")
    return stored["type"], None if schema is None else json.dumps(schema, sort_keys=True)


def check_number(name: str, value: object, bounds: tuple[float, float], *, low_open: bool) -> None:
    """Refuse (``InvalidRequest``) anything but a finite number within ``bounds`` (low end open if ``low_open``)."""
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"'{name}' must be a number.", param=name)
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise InvalidRequest(f"'{name}' must be in {bracket}{low:g}, {high:g}], got {value}.", param=name)
