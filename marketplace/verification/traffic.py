"""What a challenge asks for: a request drawn like the model's recent real traffic.

A challenge is a job the verifier runs (``worker_agent/coordinator/challenger.py``), so the node
sees what a job shows it; what varies from one job to the next is the request, and of the request a
node sees the job id's shape, the prompt (as activations) and its length in tokens, the length of the
completion (decode steps) and how it is decoded (speculation, which depends on the sampling and the
text). So a challenge copies recent real jobs of the model, drawn at random (``recent_shapes``), one
for its prompt and another for its completion (a node that served both cannot match the pair):
its kind (a chat ``chatcmpl-<32 hex>`` or a completion ``cmpl-<32 hex>``, with the ``-<i>`` of a
further choice), its prompt and completion lengths, a chat's structure (each message's role and
length in words), its temperature and top_p, whether it speculates and how fast it went (for the
stand-ins' ``Pace``: its decoding rate, and when each stage of its route put out each of its first
steps, which the runner records of every job that succeeded, ``kept_step_outputs``). Only the
words are the challenge's own, from the prompt pool (``prompts.py``), cut to the real prompt's
length in tokens::

    drawn = draw_request(random.Random(seed), recent_shapes("smollm2-135m"), prompt_pool(), encoder)
    drawn.job, drawn.request.prompt_ids, drawn.request.max_tokens

``draw_request`` is pure: the randomness is the caller's, the tokenizer comes in as ``encode``.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from marketplace.payouts.models import Earning
from worker_agent.coordinator.challenger import ChallengeRequest, Pace
from worker_agent.coordinator.sampling import SamplingParams

Encode = Callable[[str | list[dict], bool], Sequence[int]]  # (prompt or messages, chat) -> token ids
RECENT_JOBS = 200  # the recent jobs of a model a challenge's shape is drawn from
MAX_TURNS = 16  # messages a chat of unknown structure may be given to reach its length
# Steps per stage a job keeps the output times of: ``Pace`` matches a stand-in's first output to the
# jobs' first outputs and each later one to the gaps between their outputs, so 64 steps give 63 gaps
# a job, over 12,000 a stage among RECENT_JOBS jobs, while a job's row grows by about 500 bytes a stage.
STEP_OUTPUTS_KEPT = 64
MAX_STAGES = 256  # stages of a route whose times are kept at most: more than any model has layers
_JOB_ID = re.compile(r"(?P<kind>[a-z]+)-[0-9a-f]{32}(?P<choice>-[0-9]+)?")


@dataclass(frozen=True)
class TrafficShape:
    """One real job, as much of it as a challenge copies."""

    job_id: str  # its public id: a challenge's id takes its kind and choice suffix, never its hex
    prompt_tokens: int  # tokens of its prompt (>= 1)
    completion_tokens: int  # tokens it generated (>= 1)
    temperature: float = 1.0  # its sampling temperature (0: greedy)
    top_p: float = 1.0
    speculation: bool = True  # whether it let the coordinator speculate
    tokens_per_s: float | None = None  # its decoding rate after the first token; None: not measured
    # Per stage of its route, in layer order, when it put out each step, in seconds from the job's
    # HELLOs (``StepTimes``): the next stage's inputs as they came; the runner keeps the first
    # STEP_OUTPUTS_KEPT of each (``kept_step_outputs``); () where not recorded (a job that ended before
    # the runner recorded them, or was healed onto another route).
    step_outputs_s: tuple[tuple[float, ...], ...] = ()
    # A chat's messages: (role, words of its content) each, in order; () for a completion or unknown.
    turns: tuple[tuple[str, int], ...] = ()

    @property
    def pace(self) -> Pace | None:
        """How fast it went, for a challenge's stand-ins to keep to; None where it was not measured."""
        return _pace((self,), self)

    @property
    def chat(self) -> bool:
        return self.job_id.startswith("chatcmpl-")


# Before a model has traffic of its own: chats of a sentence or two to a paragraph, answered in a
# few dozen tokens, greedy and sampled, as the demo and the API's examples send them.
DEFAULT_SHAPES: tuple[TrafficShape, ...] = tuple(
    TrafficShape(f"chatcmpl-{'0' * 32}", prompt, completion, temperature)
    for prompt in (24, 32, 48, 80, 160)
    for completion in (16, 32, 64)
    for temperature in (0.0, 1.0)
)


@dataclass(frozen=True)
class DrawnRequest:
    job: str  # the challenge's job id, shaped like the copied job's
    chat: bool  # whether the prompt went through the chat template
    request: ChallengeRequest
    pace: Pace | None  # the copied job's pace, for the stand-ins


def challenge_job_id(like: str) -> str:
    """A fresh job id of the same shape as the real job id ``like`` (its kind, its choice suffix)."""
    match = _JOB_ID.fullmatch(like)
    kind, choice = (match["kind"], match["choice"] or "") if match else ("chatcmpl", "")
    return f"{kind}-{uuid.uuid4().hex}{choice}"


def draw_request(
    rng: random.Random,
    shapes: Sequence[TrafficShape],
    pool: Sequence[str],
    encode: Encode,
    *,
    max_tokens: int | None = None,
) -> DrawnRequest:
    """A request copying ``shapes`` (``DEFAULT_SHAPES`` when empty): the kind and prompt of one, the
    completion, sampling and pace of another, with a prompt of texts from ``pool``; ``max_tokens``
    overrides the completion length."""
    # The prompt of one recent job, the completion of another: a challenge repeats no job's pair of
    # lengths, which a node that served both could match.
    shape, decoding = rng.choice(list(shapes) or DEFAULT_SHAPES), rng.choice(list(shapes) or DEFAULT_SHAPES)
    words = _Words(rng, pool)
    if shape.chat:
        turns = shape.turns or _turns_to_fit(words, shape.prompt_tokens, encode)
        ids = _chat_prompt(turns, words, shape.prompt_tokens, encode)
    else:
        text = words.take(shape.prompt_tokens).split()
        ids = _longest_fit(len(text), shape.prompt_tokens, lambda count: tuple(encode(" ".join(text[:count]), False)))
    request = ChallengeRequest(
        prompt_ids=ids,
        max_tokens=max_tokens or max(1, decoding.completion_tokens),
        sampling=SamplingParams(temperature=decoding.temperature, top_p=decoding.top_p),
        speculate=decoding.speculation,
    )
    return DrawnRequest(challenge_job_id(shape.job_id), shape.chat, request, _pace(shapes, decoding))


def _pace(shapes: Sequence[TrafficShape], decoding: TrafficShape) -> Pace | None:
    """The stand-ins' pace for a challenge among the recent jobs ``shapes`` copying ``decoding``'s
    completion: each stage's first outputs and the gaps between its outputs in all of them, and the
    copied job's mean pace; None where nothing was measured."""
    stages = max((len(shape.step_outputs_s) for shape in shapes), default=0)
    firsts: list[list[float]] = [[] for _ in range(stages)]
    gaps: list[list[float]] = [[] for _ in range(stages)]
    for shape in shapes:
        for stage, outputs in enumerate(shape.step_outputs_s):
            firsts[stage] += outputs[:1]
            gaps[stage] += [later - earlier for earlier, later in itertools.pairwise(outputs)]
    if not any(firsts) and not decoding.tokens_per_s:
        return None
    per_token_s = 1.0 / decoding.tokens_per_s if decoding.tokens_per_s else 0.0
    return Pace(per_token_s, firsts_s=tuple(map(tuple, firsts)), gaps_s=tuple(map(tuple, gaps)))


class _Words:
    """Words of the pool's texts, drawn at random, one text after another."""

    def __init__(self, rng: random.Random, pool: Sequence[str]) -> None:
        self.rng, self.pool = rng, pool

    def take(self, count: int) -> str:
        words: list[str] = []
        while len(words) < count:
            words += self.rng.choice(self.pool).split()
        return " ".join(words[: max(count, 1)])


def _turns_to_fit(words: _Words, target: int, encode: Encode) -> tuple[tuple[str, int], ...]:
    """Turns for a chat whose structure is not known: earlier exchanges of a question and an answer
    while a further question still fits after them, then the last question."""
    turns: list[tuple[str, int]] = []
    for _ in range(MAX_TURNS):
        longer = [*turns, ("user", words.rng.randint(5, 17)), ("assistant", words.rng.randint(8, 24))]
        if len(encode(_messages([*longer, ("user", 1)], words), True)) > target:
            break
        turns = longer
    return (*turns, ("user", target))


def _messages(turns: Sequence[tuple[str, int]], words: _Words) -> list[dict]:
    return [{"role": role, "content": words.take(count)} for role, count in turns]


def _chat_prompt(turns: Sequence[tuple[str, int]], words: _Words, target: int, encode: Encode) -> tuple[int, ...]:
    """A conversation of the given turns (role, words of its content), the pool's words in each, whose
    chat-templated prompt is as close to ``target`` tokens as words allow: the last message is cut to fit."""
    earlier = _messages(turns[:-1], words)
    role = turns[-1][0]
    last = words.take(max(target, turns[-1][1])).split()
    return _longest_fit(
        len(last),
        target,
        lambda count: tuple(encode([*earlier, {"role": role, "content": " ".join(last[:count])}], True)),
    )


def _longest_fit(words: int, target: int, encoded: Callable[[int], tuple[int, ...]]) -> tuple[int, ...]:
    """``encoded(count)`` for the most words (of ``words``, at least one: a prompt is never empty)
    whose tokens still fit in ``target``: a prompt ends at a word, as people's prompts do."""
    low, high = 1, words
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if len(encoded(middle)) <= target else (low, middle - 1)
    return encoded(low)


def kept_step_outputs(outputs: object) -> tuple[tuple[float, ...], ...]:
    """A job's step output times as they are stored with it and read back: per stage of its route, in
    layer order, when it put out each of its first STEP_OUTPUTS_KEPT steps, in seconds rounded to the
    millisecond. () unless ``outputs`` is that (1 to MAX_STAGES stages, each of at least one finite,
    non-negative, non-decreasing time in seconds): a partial or garbled record is no job's pace."""
    if not isinstance(outputs, list | tuple) or not 0 < len(outputs) <= MAX_STAGES:
        return ()
    kept = []
    for stage in outputs:
        if not isinstance(stage, list | tuple) or not stage:
            return ()
        times = stage[:STEP_OUTPUTS_KEPT]
        if not all(isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t) for t in times):
            return ()
        if times[0] < 0 or any(later < earlier for earlier, later in itertools.pairwise(times)):
            return ()
        kept.append(tuple(round(float(t), 3) for t in times))
    return tuple(kept)


def recent_shapes(model: str, limit: int = RECENT_JOBS) -> list[TrafficShape]:
    """The shapes of the model's most recent paid jobs (at most ``limit``), newest first."""
    rows = (
        Earning.objects.filter(job__model=model, job__prompt_tokens__gt=0, job__completion_tokens__gt=0)
        .order_by("-job_id")
        .values_list(
            "job_id",
            "job__public_id",
            "job__prompt_tokens",
            "job__completion_tokens",
            "job__params",
            "job__tokens_per_s",
            "job__step_outputs_s",
        )
    )
    shapes: dict[int, TrafficShape] = {}
    for job_pk, public_id, prompt_tokens, completion_tokens, params, tokens_per_s, outputs in rows[
        : limit * 4
    ].iterator():
        if job_pk in shapes:
            continue  # one earning per node of the job
        params = params if isinstance(params, dict) else {}
        shapes[job_pk] = TrafficShape(
            public_id,
            prompt_tokens,
            completion_tokens,
            temperature=_number(params.get("temperature"), 1.0, 0.0, 2.0),
            top_p=_number(params.get("top_p"), 1.0, 1e-6, 1.0),
            speculation=params.get("speculation") is not False,
            tokens_per_s=tokens_per_s or None,
            step_outputs_s=kept_step_outputs(outputs),
            turns=chat_turns(params.get("messages")),
        )
        if len(shapes) == limit:
            break
    return list(shapes.values())


def _number(value: object, default: float, low: float, high: float) -> float:
    """A stored sampling parameter within the sampler's bounds (the API validated it; this is defence)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return min(max(float(value), low), high)


def chat_turns(messages: object) -> tuple[tuple[str, int], ...]:
    """A stored chat's structure, (role, words of its content) per message; never its words."""
    if not isinstance(messages, list):
        return ()
    return tuple(
        (str(message.get("role")), len(str(message.get("content") or "").split()))
        for message in messages
        if isinstance(message, dict)
    )
