"""The OpenAI-compatible API end to end, through the official ``openai`` client: /v1/models,
/v1/chat/completions and /v1/completions (plain and streamed), its errors, and the job each
request leaves behind. A live control plane serves smollm2-135m over three joined agents
(layers 0:10, 10:20, 20:30); answers are compared with single-process greedy ``generate``."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from datetime import timedelta

import httpx2
import openai
import pytest
import torch
from django.db import connection
from django.utils import timezone
from openai import OpenAI
from transformers import LogitsProcessor, LogitsProcessorList

from marketplace.api import ratelimit
from marketplace.billing.models import Transfer
from marketplace.flows import runner
from marketplace.jobs import services as jobs_services
from marketplace.jobs.models import ApiKey, Job, JobState
from marketplace.nodes.models import Node
from marketplace.placement.models import AssignmentState
from marketplace.placement.selectors import route_request
from tests.api_fixtures import (
    MODEL,
    forget_rate_counts,
    greedy_chat,
    greedy_text,
    module_db,
    reference_model,
    wait_for,
)
from worker_agent import model as models
from worker_agent.coordinator.heal import probe_stage

# The module's tests share one live swarm, whose rows must outlive each test: instead of
# django_db(transaction=True), which flushes after every test, the database is the module's.
pytestmark = [pytest.mark.api]
pytest_plugins = ["tests.api_fixtures"]
db = module_db

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_MAX_TOKENS = 16
PROMPT = "The capital of France is"
TEXT_MAX_TOKENS = 8
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
REQUEST_ID = re.compile(r"req_[0-9a-f]{32}")


@pytest.fixture
def client(live_swarm) -> OpenAI:
    return openai_client(live_swarm, live_swarm.key)


def openai_client(swarm, key: str) -> OpenAI:
    return OpenAI(base_url=f"{swarm.url}/v1", api_key=key, max_retries=0, timeout=180)


def chat_prompt_tokens(messages: list[dict]) -> int:
    tokenizer = models.load_tokenizer(MODEL)
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def text_prompt_tokens(prompt: str) -> int:
    return len(models.load_tokenizer(MODEL)(prompt)["input_ids"])


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def jobs_snapshot() -> list[dict]:
    """Every job, once the earlier ones have finished settling (a job settles just after its
    response is sent, so a snapshot taken sooner could see that settlement as a change)."""
    wait_for(lambda: not Job.objects.filter(settled_at__isnull=True).exists(), 30, "earlier jobs to settle")
    return list(Job.objects.order_by("pk").values())


def keys_snapshot() -> list[dict]:
    return list(ApiKey.objects.order_by("pk").values())


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def assert_job_recorded(
    swarm, public_id: str, usage: dict, finish_reason: str, kind: str, *, at_eos: bool | None = None
) -> None:
    """The job of a finished request: succeeded on the pipeline, metered as billed, verified.
    ``at_eos``: the generation stopped at an EOS token (the default for finish_reason "stop")."""
    job = Job.objects.get(public_id=public_id)
    assert job.state == JobState.SUCCEEDED
    assert (job.kind, job.model, job.customer, job.api_key) == (kind, MODEL, swarm.customer, swarm.api_key)
    assert job.finish_reason == finish_reason
    assert job.route == swarm.route
    assert job.coordinator_region == "local"
    assert (job.prompt_tokens, job.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert job.ttft_ms > 0
    assert job.started_at is not None
    assert job.finished_at >= job.started_at
    assert (job.error_code, job.error_message) == ("", "")
    # Plain decoding: one forward pass per committed token, plus the one that produced the EOS when
    # it stopped there. Speculation verifies drafts too: fewer passes when they are accepted, and
    # more positions (rejected drafts are computed and signed all the same).
    at_eos = finish_reason == "stop" if at_eos is None else at_eos
    steps = job.completion_tokens + (1 if at_eos else 0)
    # The prompt in the first pass, then one token a pass; less the prompt positions the stages held
    # already from an earlier request of the customer's (prefix reuse), the same at every stage.
    reused = {r.get("reused", 0) for r in job.receipts}
    assert len(reused) == 1
    rows = job.prompt_tokens - reused.pop() + steps - 1
    assert [
        (r["job"], r["model"], r["node"], r["node_key"], r["layer_start"], r["layer_end"]) for r in job.receipts
    ] == [(public_id, MODEL, s["node"], s["node_key"], s["layer_start"], s["layer_end"]) for s in swarm.route]
    signed = {(r["steps"], r["tokens"]) for r in job.receipts}
    assert len(signed) == 1  # every stage signed the same steps
    ((signed_steps, signed_rows),) = signed
    if job.drafted_tokens == 0:
        assert (signed_steps, signed_rows) == (steps, rows)
    else:
        # Every position plain decoding computes is computed, and so is each draft checked.
        assert job.accepted_tokens <= job.drafted_tokens
        assert signed_rows >= rows and signed_steps >= 1
    assert job.verified is True
    assert job.verification_error == ""


def stage_sessions(url: str) -> int:
    return asyncio.run(probe_stage(url))["sessions"]


def test_models_lists_the_servable_model(client):
    listed = client.models.list()

    assert [model.id for model in listed.data] == [MODEL]
    assert [(m.object, m.created, m.owned_by) for m in listed.data] == [("model", 0, "swarm")]


def test_models_report_the_context_length_and_capabilities(client):
    (entry,) = client.models.list().data

    listed = entry.model_dump()
    # The agents hold 4096 positions per session, fewer than the model's own 8192.
    assert models.load_config(MODEL).max_position_embeddings == 8192
    assert listed["context_length"] == 4096
    assert listed["capabilities"]["embeddings"] is False
    assert listed["capabilities"]["chat_completions"] is True


@pytest.fixture
def short_context():
    """Every node of the swarm says it holds fewer positions per session than it does: the
    STORY prompt's tokens and 10 more."""
    before = dict(Node.objects.values_list("pk", "max_positions"))
    limit = chat_prompt_tokens(STORY) + 10
    Node.objects.update(max_positions=limit)
    yield limit
    for pk, value in before.items():
        Node.objects.filter(pk=pk).update(max_positions=value)


def test_a_request_over_the_context_length_is_refused_400_before_any_job_or_hold(client, short_context):
    prompt_tokens = chat_prompt_tokens(STORY)
    before, transfers = jobs_snapshot(), Transfer.objects.count()

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=11)

    assert refused.value.response.json() == error_body(
        f"This model's maximum context length is {short_context} tokens. However, you requested "
        f"{prompt_tokens + 11} tokens ({prompt_tokens} in the messages, 11 in the completion). Please reduce "
        "the length of the messages or completion.",
        "invalid_request_error",
        "messages",
        "context_length_exceeded",
    )
    assert jobs_snapshot() == before
    assert Transfer.objects.count() == transfers  # no hold was placed


def test_a_request_naming_no_max_tokens_gets_the_room_its_prompt_leaves(client, short_context):
    response = client.chat.completions.create(model=MODEL, messages=STORY)

    assert response.usage.prompt_tokens + response.usage.completion_tokens == short_context
    assert response.choices[0].finish_reason == "length"
    job = Job.objects.get(public_id=response.id)
    assert job.params["max_tokens"] == 10


def test_a_request_at_the_context_length_runs(client, short_context):
    response = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=10)

    assert response.usage.completion_tokens == 10


def test_models_leaves_out_a_configured_model_without_a_ready_pipeline(client, settings):
    settings.SWARM_MODELS = [MODEL, "tiny-llama"]

    listed = client.models.list()

    assert [model.id for model in listed.data] == [MODEL]


def test_chat_completion_matches_single_process_greedy_generate(live_swarm, client):
    reference = greedy_chat(CHAT, CHAT_MAX_TOKENS)

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=CHAT_MAX_TOKENS, temperature=0
    )

    completion = raw.parse()
    assert REQUEST_ID.fullmatch(raw.headers["x-request-id"])
    assert raw.headers["x-ratelimit-limit-requests"] == "1000"
    assert completion.object == "chat.completion"
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", completion.id)
    assert completion.model == MODEL
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert (choice.index, choice.message.role, choice.finish_reason) == (0, "assistant", reference.finish_reason)
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content == reference.text
    assert reference.text.startswith("The capital of France is Paris")
    usage = usage_of(chat_prompt_tokens(CHAT), len(reference.token_ids))
    assert completion.usage.model_dump(include=set(usage)) == usage
    assert usage["prompt_tokens"] == reference.prompt_tokens
    assert_job_recorded(live_swarm, completion.id, usage, reference.finish_reason, "chat")


def test_a_second_turn_reports_the_prompt_tokens_its_stages_held_as_cached(live_swarm, client):
    # A prompt no other test sends: its first 32-token block (the template's system text and this
    # question) is kept only by this test's first turn.
    first_turn = [{"role": "user", "content": "Tell me about a grey cat who finds a red hat in the rain."}]
    first = client.chat.completions.create(model=MODEL, messages=first_turn, max_tokens=CHAT_MAX_TOKENS, temperature=0)
    second_turn = [
        *first_turn,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "What did the cat do next?"},
    ]

    second = client.chat.completions.create(model=MODEL, messages=second_turn, max_tokens=4, temperature=0)

    assert first.usage.prompt_tokens_details is None
    # The first turn's prompt is 45 tokens: its first block of 32 (prefix.BLOCK) is the longest kept
    # boundary the second prompt shares for sure, and the answer's 16 tokens end before the next one.
    assert chat_prompt_tokens(first_turn) == 45
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    assert second.usage.prompt_tokens == chat_prompt_tokens(second_turn)  # charged as before
    job = Job.objects.get(public_id=second.id)
    assert [r["reused"] for r in job.receipts] == [32, 32, 32]
    assert {r["reused_from"]["job"] for r in job.receipts} == {first.id}
    assert job.verified is True


def test_speculation_turned_off_per_request_changes_no_token(live_swarm, client):
    messages = [
        {
            "role": "user",
            "content": "Copy this text exactly: Alice was beginning to get very tired of sitting by her sister on "
            "the bank, and of having nothing to do.",
        }
    ]
    reference = greedy_chat(messages, 32)

    default = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, temperature=0, extra_body={"speculation": False}
    )

    assert default.choices[0].message.content == plain.choices[0].message.content == reference.text
    speculated, unspeculated = (Job.objects.get(public_id=c.id) for c in (default, plain))
    assert unspeculated.params["speculation"] is False and unspeculated.drafted_tokens == 0
    assert speculated.params["speculation"] is True and speculated.accepted_tokens > 0
    assert speculated.completion_tokens == unspeculated.completion_tokens == len(reference.token_ids)


def test_text_completion_matches_single_process_greedy_generate(live_swarm, client):
    reference = greedy_text(PROMPT, TEXT_MAX_TOKENS)

    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=TEXT_MAX_TOKENS, temperature=0
    )

    completion = raw.parse()
    assert REQUEST_ID.fullmatch(raw.headers["x-request-id"])
    assert completion.object == "text_completion"
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", completion.id)
    assert completion.model == MODEL
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert (choice.index, choice.finish_reason) == (0, reference.finish_reason)
    assert choice.finish_reason in ("stop", "length")
    assert choice.text == reference.text
    assert choice.text != ""
    usage = usage_of(text_prompt_tokens(PROMPT), len(reference.token_ids))
    assert completion.usage.model_dump(include=set(usage)) == usage
    assert_job_recorded(live_swarm, completion.id, usage, reference.finish_reason, "completion")


def test_streamed_chat_deltas_add_up_to_the_greedy_text_then_usage(live_swarm, client):
    reference = greedy_chat(CHAT, CHAT_MAX_TOKENS)

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=CHAT_MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(raw.parse())

    assert REQUEST_ID.fullmatch(raw.headers["x-request-id"])
    assert raw.headers["content-type"].startswith("text/event-stream")
    first, *deltas, last_choice, usage_chunk = chunks
    assert {chunk.id for chunk in chunks} == {first.id}
    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
    assert {chunk.model for chunk in chunks} == {MODEL}
    assert (first.choices[0].delta.role, first.choices[0].delta.content, first.choices[0].finish_reason) == (
        "assistant",
        "",
        None,
    )
    assert all(d.choices[0].delta.content and d.choices[0].finish_reason is None for d in deltas)
    assert "".join(d.choices[0].delta.content for d in deltas) == reference.text
    assert last_choice.choices[0].finish_reason == reference.finish_reason
    assert last_choice.choices[0].delta.content is None
    assert usage_chunk.choices == []
    usage = usage_of(chat_prompt_tokens(CHAT), len(reference.token_ids))
    assert usage_chunk.usage.model_dump(include=set(usage)) == usage
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert_job_recorded(live_swarm, first.id, usage, reference.finish_reason, "chat")


def test_streamed_text_completion_adds_up_to_the_greedy_text_without_usage(live_swarm, client):
    reference = greedy_text(PROMPT, TEXT_MAX_TOKENS)

    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TEXT_MAX_TOKENS, temperature=0, stream=True)
    )

    *deltas, last = chunks
    assert {chunk.id for chunk in chunks} == {last.id}
    assert {chunk.object for chunk in chunks} == {"text_completion"}
    assert all(d.choices[0].text and d.choices[0].finish_reason is None for d in deltas)
    assert "".join(d.choices[0].text for d in deltas) == reference.text
    assert (last.choices[0].text, last.choices[0].finish_reason) == ("", reference.finish_reason)
    assert all(chunk.usage is None for chunk in chunks)
    usage = usage_of(text_prompt_tokens(PROMPT), len(reference.token_ids))
    assert_job_recorded(live_swarm, last.id, usage, reference.finish_reason, "completion")


def test_chat_completion_ends_before_a_stop_string(live_swarm, client):
    reference = greedy_chat(CHAT, CHAT_MAX_TOKENS)
    # the completion counts every token generated until the stop string appeared
    tokenizer = models.load_tokenizer(MODEL)
    needed = next(
        k
        for k in range(1, len(reference.token_ids) + 1)
        if "Paris" in tokenizer.decode(reference.token_ids[:k], skip_special_tokens=True)
    )

    completion = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=CHAT_MAX_TOKENS, temperature=0, stop=["Paris"]
    )

    assert completion.choices[0].message.content == "The capital of France is "
    assert completion.choices[0].finish_reason == "stop"
    usage = usage_of(chat_prompt_tokens(CHAT), needed)
    assert completion.usage.model_dump(include=set(usage)) == usage
    assert_job_recorded(live_swarm, completion.id, usage, "stop", "chat", at_eos=False)


def test_seeded_sampling_gives_the_same_completion_twice(live_swarm, client):
    def sample():
        return client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=TEXT_MAX_TOKENS, temperature=1.0, seed=1234
        )

    first, second = sample(), sample()

    assert first.choices[0].text == second.choices[0].text
    assert first.usage == second.usage
    assert first.id != second.id
    assert Job.objects.get(public_id=first.id).params["seed"] == 1234


PENALTY_TOKENS = 24


class OpenAIPenalties(LogitsProcessor):
    """The reference's own statement of the adjustments, applied to HF generate's logits:
    OpenAI's presence and frequency penalties over the tokens generated so far, then nothing else
    (HF's own ``repetition_penalty`` runs first, as the API's does)."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for token, count in Counter(input_ids[0, self.prompt_length :].tolist()).items():
            scores[0, token] -= count * self.frequency + self.presence
        return scores


def penalized_reference(messages: list[dict], max_tokens: int, *, presence: float, frequency: float, repetition: float):
    ids = models.load_tokenizer(MODEL).apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    with torch.no_grad():
        out = reference_model().generate(
            torch.tensor([ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            repetition_penalty=repetition,
            logits_processor=LogitsProcessorList([OpenAIPenalties(len(ids), presence, frequency)]),
        )
    return models.load_tokenizer(MODEL).decode(out[0, len(ids) :], skip_special_tokens=True)


@pytest.mark.parametrize("speculation", [True, False], ids=["speculating", "plain"])
def test_penalties_give_what_an_in_process_reference_applying_them_gives(client, speculation):
    penalties = {"presence": 0.8, "frequency": 0.6, "repetition": 1.3}

    response = client.chat.completions.create(
        model=MODEL,
        messages=STORY,
        max_tokens=PENALTY_TOKENS,
        temperature=0,
        presence_penalty=penalties["presence"],
        frequency_penalty=penalties["frequency"],
        extra_body={"repetition_penalty": penalties["repetition"], "speculation": speculation},
    )

    assert response.choices[0].message.content == penalized_reference(STORY, PENALTY_TOKENS, **penalties)
    assert response.choices[0].message.content != greedy_chat(STORY, PENALTY_TOKENS).text  # they changed it
    job = Job.objects.get(public_id=response.id)
    assert (job.params["presence_penalty"], job.params["repetition_penalty"]) == (0.8, 1.3)


def test_logit_bias_forces_and_bans_tokens(client):
    tokenizer = models.load_tokenizer(MODEL)
    (forced,) = tokenizer(" banana")["input_ids"]
    plain_first = greedy_chat(CHAT, 4).token_ids[0]

    forcing = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logit_bias={str(forced): 100}
    )
    banning = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=1, temperature=0, logit_bias={str(plain_first): -100}
    )

    assert forcing.choices[0].message.content == tokenizer.decode([forced] * 4)
    assert banning.choices[0].message.content != tokenizer.decode([plain_first])
    assert banning.usage.completion_tokens == 1


def test_a_logit_bias_past_the_vocabulary_is_refused(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, logit_bias={"49152": 5})

    assert refused.value.response.json()["error"]["message"] == (
        "'logit_bias' names token 49152; smollm2-135m's vocabulary has tokens 0 to 49151."
    )


LOGPROB_TOKENS = 6


def reference_logprobs(prompt_ids: list[int], tokens: tuple[int, ...]) -> torch.Tensor:
    """log-softmax of the reference model's logits at the positions that predicted ``tokens``."""
    with torch.no_grad():
        logits = reference_model()(torch.tensor([[*prompt_ids, *tokens]])).logits[0]
    return torch.log_softmax(logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(tokens)].float(), dim=-1)


def test_chat_logprobs_are_the_log_softmax_of_the_models_logits(client):
    tokenizer = models.load_tokenizer(MODEL)
    prompt_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    reference = greedy_chat(CHAT, LOGPROB_TOKENS)

    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=LOGPROB_TOKENS, temperature=0, logprobs=True, top_logprobs=3
    )

    content = response.choices[0].logprobs.content
    expected = reference_logprobs(prompt_ids, reference.token_ids)
    assert [entry.token for entry in content] == [tokenizer.decode([t]) for t in reference.token_ids]
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for row, (entry, token) in enumerate(zip(content, reference.token_ids, strict=True)):
        assert entry.logprob == pytest.approx(float(expected[row, token]), abs=1e-3)
        assert entry.bytes == list(entry.token.encode())
        top = torch.topk(expected[row], 3)
        assert [alt.token for alt in entry.top_logprobs] == [tokenizer.decode([t]) for t in top.indices.tolist()]
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-3)


def test_streamed_chat_logprobs_add_up_to_the_whole_responses(client):
    whole = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=LOGPROB_TOKENS, temperature=0, logprobs=True, top_logprobs=2
    )

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=LOGPROB_TOKENS,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )

    streamed = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 3)) for e in streamed] == [
        (e.token, round(e.logprob, 3)) for e in whole.choices[0].logprobs.content
    ]
    assert len(streamed) == whole.usage.completion_tokens


def test_text_completion_logprobs_have_the_legacy_shape(client):
    tokenizer = models.load_tokenizer(MODEL)
    reference = greedy_text(PROMPT, TEXT_MAX_TOKENS)
    prompt_ids = tokenizer(PROMPT)["input_ids"]

    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=TEXT_MAX_TOKENS, temperature=0, logprobs=2
    )

    logprobs = response.choices[0].logprobs
    expected = reference_logprobs(prompt_ids, reference.token_ids)
    texts = [tokenizer.decode([t]) for t in reference.token_ids]
    assert logprobs.tokens == texts
    assert logprobs.token_logprobs == pytest.approx(
        [float(expected[row, t]) for row, t in enumerate(reference.token_ids)], abs=1e-3
    )
    assert [len(alternatives) for alternatives in logprobs.top_logprobs] == [2] * len(texts)
    assert logprobs.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]


def test_logprobs_are_not_sent_unless_asked_for(client):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)

    assert response.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"top_logprobs": 2}, "'top_logprobs' needs 'logprobs' set to true."),
        ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be an integer in [0, 20]."),
        ({"logprobs": 1}, "'logprobs' must be a boolean."),
    ],
)
def test_bad_logprobs_arguments_are_refused(client, arguments, message):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body=arguments)

    assert refused.value.response.json()["error"]["message"] == message


def test_no_error_response_shows_a_nodes_address_id_or_key(live_swarm, client, settings):
    """Every refusal a customer can provoke, read as text: none names where or who serves."""
    settings.SWARM_MAX_TOKENS_LIMIT = 2048
    nodes = list(Node.objects.values_list("node_id", "public_key", "data_url"))
    secrets_of_nodes = [value for row in nodes for value in row if value]
    requests = [
        {"model": MODEL, "messages": CHAT, "max_tokens": 0},
        {"model": "no-such-model", "messages": CHAT},
        {"model": MODEL, "messages": CHAT, "max_tokens": 4, "frobnicate": 1},
        {"model": MODEL, "messages": CHAT, "max_tokens": 4, "tools": [{"type": "function"}]},
        {"model": MODEL, "messages": CHAT, "max_tokens": 4, "logit_bias": {"99999999": 1}},
        {"model": MODEL, "messages": STORY * 400, "max_tokens": 2048},  # past the context length
        {"model": MODEL, "messages": CHAT, "max_tokens": 4, "response_format": {"type": "json_schema"}},
    ]
    bodies = []
    for body in requests:
        response = httpx2.post(
            f"{live_swarm.url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {live_swarm.key}"},
            timeout=60,
        )
        assert 400 <= response.status_code < 500, response.text
        bodies.append(response.text)
    # A failed job's last event as the API relays it (runner.public_failure), for every stage error code.
    for code in ("stage_lost", "stage_stalled", "stage_timeout", "next_unreachable", "ticket_untrusted"):
        message = f"stage 0 ({nodes[0][2]}) failed: {nodes[0][0]} key {nodes[0][1]}"
        bodies.append(runner.public_failure(code, message))

    for text in bodies:
        assert "ws://" not in text and "wss://" not in text and "127.0.0.1" not in text
        assert not any(value in text for value in secrets_of_nodes), text


def test_stream_ends_with_the_usage_event_then_done_on_the_wire(live_swarm):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {live_swarm.key}"}

    with httpx2.Client(base_url=live_swarm.url, timeout=180) as http:
        response = http.post("/v1/completions", json=body, headers=headers)

    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-cache"
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in response.text.split("\n\n") if line)
    assert events[-1] == "[DONE]"
    usage_event = json.loads(events[-2])
    reference = greedy_text(PROMPT, 3)
    assert usage_event["choices"] == []
    assert usage_event["usage"] == usage_of(text_prompt_tokens(PROMPT), len(reference.token_ids))
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == reference.finish_reason


@pytest.mark.parametrize(
    ("overrides", "message", "param"),
    [
        ({"n": 9}, "'n' must be an integer in [1, 8].", "n"),
        ({"max_tokens": 0}, "'max_tokens' must be an integer in [1, 2048].", "max_tokens"),
        ({"temperature": 3}, "'temperature' must be in [0, 2], got 3.", "temperature"),
        ({"messages": []}, "'messages' must be a non-empty array.", "messages"),
        ({"extra_body": {"speculation": "off"}}, "'speculation' must be a boolean.", "speculation"),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            "messages[0] needs a role of ['assistant', 'developer', 'system', 'tool', 'user'].",
            "messages.0.role",
        ),
    ],
    ids=["n", "max_tokens", "temperature", "empty-messages", "speculation", "bad-role"],
)
def test_invalid_chat_request_is_refused_400_in_openai_shape(client, settings, overrides, message, param):
    settings.SWARM_MAX_TOKENS_LIMIT = 2048
    before = jobs_snapshot()

    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**({"model": MODEL, "messages": CHAT, "max_tokens": 4} | overrides))

    exc = caught.value
    assert exc.status_code == 400
    assert exc.response.json() == error_body(message, "invalid_request_error", param, None)
    assert (exc.type, exc.param, exc.code) == ("invalid_request_error", param, None)
    assert REQUEST_ID.fullmatch(exc.response.headers["x-request-id"])
    assert jobs_snapshot() == before


def test_a_body_that_is_not_json_is_refused_400(live_swarm):
    before = jobs_snapshot()

    response = httpx2.post(
        f"{live_swarm.url}/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {live_swarm.key}", "Content-Type": "application/json"},
        timeout=60,
    )

    assert response.status_code == 400
    assert response.json() == error_body("The request body is not valid JSON.", "invalid_request_error", None, None)
    assert jobs_snapshot() == before


def test_a_wrong_key_is_refused_401(live_swarm):
    before = (jobs_snapshot(), keys_snapshot())
    stranger = openai_client(live_swarm, "sk-sw-not-a-real-key")

    with pytest.raises(openai.AuthenticationError) as caught:
        stranger.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)

    exc = caught.value
    assert exc.status_code == 401
    assert exc.response.json() == error_body(
        "Incorrect API key provided: sk-sw-not-***.", "authentication_error", None, "invalid_api_key"
    )
    assert (jobs_snapshot(), keys_snapshot()) == before


def test_a_wrong_key_cannot_list_models(live_swarm):
    with pytest.raises(openai.AuthenticationError) as caught:
        openai_client(live_swarm, "sk-sw-not-a-real-key").models.list()

    assert caught.value.response.json() == error_body(
        "Incorrect API key provided: sk-sw-not-***.", "authentication_error", None, "invalid_api_key"
    )


def test_a_request_without_a_key_is_refused_401(live_swarm):
    response = httpx2.post(
        f"{live_swarm.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, timeout=60
    )

    assert response.status_code == 401
    assert response.json() == error_body(
        "You didn't provide an API key: send 'Authorization: Bearer <key>'.",
        "authentication_error",
        None,
        "invalid_api_key",
    )


def test_a_revoked_key_is_refused_401(live_swarm):
    api_key, key = jobs_services.create_api_key(live_swarm.customer, "old laptop")
    jobs_services.revoke_api_key(api_key)
    before = (jobs_snapshot(), keys_snapshot())

    with pytest.raises(openai.AuthenticationError) as caught:
        openai_client(live_swarm, key).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)

    exc = caught.value
    assert exc.status_code == 401
    assert exc.response.json() == error_body(
        "This API key was revoked.", "authentication_error", None, "revoked_api_key"
    )
    assert (jobs_snapshot(), keys_snapshot()) == before


def test_an_unknown_model_is_refused_404(client):
    before = jobs_snapshot()

    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4)

    exc = caught.value
    assert exc.status_code == 404
    assert exc.response.json() == error_body(
        "The model 'gpt-4o' does not exist.", "invalid_request_error", "model", "model_not_found"
    )
    assert jobs_snapshot() == before


def test_a_configured_model_without_a_ready_pipeline_is_refused_503(client, settings):
    settings.SWARM_MODELS = [MODEL, "tiny-llama"]
    before = jobs_snapshot()

    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=4)

    exc = caught.value
    assert exc.status_code == 503
    assert exc.response.json() == error_body(
        "No capacity for model 'tiny-llama' right now: no complete pipeline is ready.",
        "service_unavailable",
        None,
        "no_capacity",
    )
    assert jobs_snapshot() == before


def test_a_model_no_node_serves_is_refused_at_once_without_waiting_for_capacity(client, settings):
    settings.SWARM_MODELS = [MODEL, "tiny-llama"]
    settings.SWARM_ADMISSION_WAIT_S = 600.0  # a wait would outlast the client's timeout

    with pytest.raises(openai.InternalServerError) as caught:
        client.with_options(timeout=60).chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=4)

    assert caught.value.status_code == 503


def test_a_request_arriving_while_every_stage_is_reported_failed_waits_for_the_swarm_to_recover(
    client, live_swarm, settings
):
    # Every node of the pipeline reported failed (as coordinators do when stages die): nothing is
    # routable until their heartbeats clear the reports. The reports are dated 2 s ahead, so they
    # hold at least 3 s (a heartbeat clears a report older than the 1 s heartbeat interval).
    settings.SWARM_ADMISSION_WAIT_S = 60.0
    until = timezone.now() + timedelta(seconds=2)
    serving = Node.objects.filter(assignments__state=AssignmentState.READY).distinct()
    assert serving.update(suspected_at=until, suspicion="reported failed by a test") == 3
    assert route_request(MODEL) is None
    before = Job.objects.count()

    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)

    assert reply.usage.completion_tokens == 2
    assert Job.objects.count() == before + 1
    job = Job.objects.get(public_id=reply.id)
    assert job.state == JobState.SUCCEEDED
    assert job.created_at >= until  # admitted once the reports were cleared, not refused 503 before
    assert not Node.objects.filter(suspected_at__isnull=False).exists()


def one_request_per_minute_key(swarm) -> tuple[ApiKey, OpenAI]:
    """A fresh key allowed one request a minute, used early in a window so both requests share it."""
    # Active key names are unique per customer, and the swarm (with its customer) outlives one test.
    api_key, key = jobs_services.create_api_key(swarm.customer, f"one a minute #{ApiKey.objects.count()}")
    ApiKey.objects.filter(pk=api_key.pk).update(requests_per_minute=1)
    api_key.refresh_from_db()
    forget_rate_counts(api_key)
    if time.time() % ratelimit.WINDOW_S > ratelimit.WINDOW_S - 20:
        time.sleep(ratelimit.WINDOW_S - time.time() % ratelimit.WINDOW_S + 0.5)
    return api_key, openai_client(swarm, key)


def test_a_key_over_its_requests_per_minute_is_refused_429_with_retry_after(live_swarm):
    api_key, limited = one_request_per_minute_key(live_swarm)
    first = limited.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0)
    cost = chat_prompt_tokens(CHAT) + 1
    assert first.headers["x-ratelimit-limit-requests"] == "1"
    assert first.headers["x-ratelimit-remaining-requests"] == "0"
    assert first.headers["x-ratelimit-remaining-tokens"] == str(100_000 - cost)
    before = jobs_snapshot()

    with pytest.raises(openai.RateLimitError) as caught:
        limited.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0)

    exc = caught.value
    assert exc.status_code == 429
    headers = exc.response.headers
    retry_after = int(headers["retry-after"])
    assert 1 <= retry_after <= ratelimit.WINDOW_S
    assert exc.response.json() == error_body(
        f"Rate limit reached for requests per minute (limit 1); retry in {retry_after}s.",
        "rate_limit_error",
        None,
        "rate_limit_exceeded",
    )
    assert headers["x-ratelimit-limit-requests"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == f"{retry_after}s"
    assert headers["x-ratelimit-limit-tokens"] == "100000"
    assert headers["x-ratelimit-reset-tokens"] == f"{retry_after}s"
    assert REQUEST_ID.fullmatch(headers["x-request-id"])
    assert jobs_snapshot() == before
    assert Job.objects.filter(api_key=api_key).count() == 1


def test_a_refused_request_is_not_reported_as_spending_the_keys_tokens(live_swarm):
    _, limited = one_request_per_minute_key(live_swarm)
    limited.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0)
    cost = chat_prompt_tokens(CHAT) + 1

    with pytest.raises(openai.RateLimitError) as caught:
        limited.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0)

    # The refused request is not counted, so the tokens left are those after the first request.
    assert caught.value.response.headers["x-ratelimit-remaining-tokens"] == str(100_000 - cost)


def test_a_client_leaving_before_a_whole_response_cancels_its_job(live_swarm):
    body = {
        "model": MODEL,
        "messages": STORY,
        "max_tokens": 200,
        "temperature": 0,
    }
    earlier = set(Job.objects.values_list("pk", flat=True))

    with pytest.raises(httpx2.ReadTimeout):
        httpx2.post(
            f"{live_swarm.url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {live_swarm.key}"},
            timeout=httpx2.Timeout(60, read=3),  # gives up long before 200 tokens can be ready
        )

    job = wait_for(
        lambda: Job.objects.exclude(pk__in=earlier).filter(finished_at__isnull=False).first(),
        180,
        "the abandoned job to end",
    )
    assert job.state == JobState.CANCELLED
    assert (job.error_code, job.finish_reason) == ("client_disconnected", "")
    assert 1 <= job.completion_tokens < 200


def abandon_stream(swarm, events: int = 3) -> list[dict]:
    """Start a long streamed chat completion, read its first ``events`` SSE events, hang up."""
    body = {"model": MODEL, "messages": STORY, "max_tokens": 200, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {swarm.key}"}
    read = []
    with (
        httpx2.Client(base_url=swarm.url, timeout=180) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                read.append(json.loads(line.removeprefix("data: ")))
            if len(read) == events:
                break
    return read


def test_a_client_leaving_mid_stream_cancels_its_job_and_frees_the_stages(live_swarm):
    events = abandon_stream(live_swarm)  # the role chunk and two tokens, then hang up

    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(event["choices"][0]["delta"]["content"] for event in events[1:])
    job = wait_for(
        lambda: Job.objects.filter(public_id=events[0]["id"], state=JobState.CANCELLED).first(),
        120,
        "the job to be cancelled",
    )
    assert 2 <= job.completion_tokens < 200
    assert (job.error_code, job.error_message) == ("client_disconnected", "the client went away; partial work recorded")
    assert (job.finish_reason, job.verified, job.receipts) == ("", None, [])
    assert job.route == live_swarm.route
    assert job.finished_at is not None
    for stage in live_swarm.route:
        wait_for(lambda url=stage["url"]: stage_sessions(url) == 0, 60, f"the sessions on {stage['url']} to close")


def checked_out_connections() -> int:
    stats = connection.pool.get_stats()
    return stats["pool_size"] - stats["pool_available"]


def test_abandoned_streams_give_their_database_connections_back(live_swarm):
    if getattr(connection, "pool", None) is None:
        pytest.skip("only PostgreSQL runs with a connection pool (SWARM_DB_POOL_SIZE) that can run dry")
    connection.ensure_connection()
    baseline = checked_out_connections()  # this test's own, and any a periodic sweep holds now

    for _ in range(3):
        job_id = abandon_stream(live_swarm)[0]["id"]
        wait_for(
            lambda job_id=job_id: Job.objects.filter(public_id=job_id, state=JobState.CANCELLED).exists(),
            120,
            "the abandoned job to be cancelled",
        )

    # A web process has SWARM_DB_POOL_SIZE connections: if each abandoned stream kept one, the
    # API could not reach its database any more after that many disconnects.
    deadline = time.monotonic() + 30
    while checked_out_connections() > baseline and time.monotonic() < deadline:
        time.sleep(0.5)
    assert checked_out_connections() <= baseline
