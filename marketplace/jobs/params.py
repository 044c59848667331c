"""A job's request parameters: one frozen type, built once by the API from the validated request.

Stored on the job as JSON (``Job.params``) under the keys the API has always written, and read
back into the same type by the runner, so every reader sees one set of meanings and defaults
instead of picking keys out of a dict. Rows written before a key existed read its default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from marketplace.jobs.errors import InvalidRequest

MAX_STOP = 4  # stop strings a request may give, as OpenAI allows
TEMPERATURE_RANGE = (0.0, 2.0)  # [low, high], as OpenAI allows
TOP_P_RANGE = (0.0, 1.0)  # (low, high]: a top_p of 0 would keep no token
DEFAULT_MAX_TOKENS = 256  # completion tokens when the request names no limit
SEED_RANGE = (-(2**63), 2**63 - 1)  # a signed 64-bit integer, as OpenAI's API takes it


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
        )


def check_number(name: str, value: object, bounds: tuple[float, float], *, low_open: bool) -> None:
    """Refuse (``InvalidRequest``) anything but a finite number within ``bounds`` (low end open if ``low_open``)."""
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"'{name}' must be a number.", param=name)
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise InvalidRequest(f"'{name}' must be in {bracket}{low:g}, {high:g}], got {value}.", param=name)
