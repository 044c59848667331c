"""Speculative decoding on real agent processes: token-identical, verified, audited, healed.

``tiny_swarm`` (tiny-llama 0:2, 2:4, 4:6) and ``smollm2_swarm`` (smollm2-135m 0:10, 10:20, 20:30)
serve every request twice: plain decoding, then with speculation (a fixed plan, so each test
knows what it exercises, or the router's own choice). Greedy output must be token-identical, in
ring and star, with 1 and 4 streams; seeded sampling gives the same tokens too, as its draws
depend on the position only. Each speculative session's receipts verify (the chunks voided by a
rejection are computed, hashed and signed like any other step), and an audit replays its
truncating steps exactly. tiny-llama as its own draft model is always right (acceptance 1),
another seed's tiny-llama rarely is, and the output is the same either way.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from nacl.signing import SigningKey

from tests.test_audit import SPANS, in_process_stages, stage_tickets
from worker_agent import model as models
from worker_agent.block import Block
from worker_agent.coordinator.job import Coordinator, GenerationResult
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.coordinator.sampling import SamplingParams
from worker_agent.coordinator.speculation import SpeculationSettings
from worker_agent.protocol.audit import AuditFailed, verify_audit

pytestmark = pytest.mark.dataplane

REPEATING = "one two three four five one two three four five one two three four five one two"
NOVEL = "The quick brown fox jumps over"
PLAIN = SpeculationSettings(enabled=False)
NGRAM_PIPELINED = SpeculationSettings(drafter="ngram", k=4, depth=3)
SAME_DRAFT = SpeculationSettings(drafter="draft", draft_model="tiny-llama", k=4, depth=2)
OTHER_DRAFT = SpeculationSettings(drafter="draft", draft_model="tiny-llama-seed1", k=3, depth=2)


async def _generate(
    swarm, settings, prompts, *, topology="ring", max_tokens=32, chat=False, sampling=None, audit_stages=()
) -> list[GenerationResult]:
    job = f"job-spec-{uuid.uuid4().hex[:10]}"
    stages = [StageSpec(url, ticket) for url, ticket in zip(swarm.urls, swarm.tickets(job), strict=True)]
    async with Coordinator(
        swarm.model,
        stages,
        job=job,
        topology=topology,
        audit_stages=audit_stages,
        coordinator_key=swarm.coordinator_key(job),
        speculation=settings,
    ) as coordinator:
        requests = [coordinator.request(p, chat=chat, max_tokens=max_tokens, sampling=sampling) for p in prompts]
        return list(await asyncio.gather(*(coordinator.generate(r) for r in requests)))


def generate(swarm, settings, prompts, **kwargs) -> list[GenerationResult]:
    return asyncio.run(_generate(swarm, settings, prompts, **kwargs))


@pytest.mark.parametrize("topology", ["ring", "star"])
@pytest.mark.parametrize("settings", [NGRAM_PIPELINED, SAME_DRAFT, OTHER_DRAFT, SpeculationSettings()])
@pytest.mark.parametrize("streams", [1, 4])
def test_greedy_speculation_is_token_identical_to_plain_decoding(tiny_swarm, topology, settings, streams):
    prompts = [REPEATING, NOVEL, REPEATING + " one", NOVEL + " the"][:streams]
    plain = generate(tiny_swarm, PLAIN, prompts, topology=topology)

    speculative = generate(tiny_swarm, settings, prompts, topology=topology)

    for expected, result in zip(plain, speculative, strict=True):
        assert result.token_ids == expected.token_ids
        assert result.text == expected.text
        assert result.finish_reason == expected.finish_reason
        assert result.verification is not None  # every step signed, voided ones included


def test_a_draft_model_identical_to_the_target_is_always_accepted(tiny_swarm):
    (result,) = generate(tiny_swarm, SAME_DRAFT, [NOVEL], max_tokens=33)

    assert result.drafted >= 24
    assert result.accepted == result.drafted
    # 4 drafts + 1 token per chunk in flight at first, then 4 per chunk: far fewer steps than tokens.
    assert result.steps <= 10


def test_another_seeds_draft_model_is_rarely_accepted_and_changes_nothing(tiny_swarm):
    (plain,) = generate(tiny_swarm, PLAIN, [NOVEL], max_tokens=24)

    (result,) = generate(tiny_swarm, OTHER_DRAFT, [NOVEL], max_tokens=24)

    assert result.token_ids == plain.token_ids
    assert result.drafted > 0
    assert result.acceptance is not None and result.acceptance < 0.5


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(tiny_swarm):
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=77)
    (plain,) = generate(tiny_swarm, PLAIN, [REPEATING], sampling=sampling)

    results = [
        generate(tiny_swarm, settings, [REPEATING], sampling=sampling)[0]
        for settings in (
            NGRAM_PIPELINED,
            SAME_DRAFT,
        )
    ]

    for result in results:
        assert result.token_ids == plain.token_ids
    assert results[1].accepted > 0


def test_repeated_text_is_drafted_by_the_ngram_drafter_on_smollm2(smollm2_swarm):
    prompt = (
        "Copy this text exactly: Alice was beginning to get very tired of sitting by her sister on the bank, "
        "and of having nothing to do."
    )
    (plain,) = generate(smollm2_swarm, PLAIN, [prompt], chat=True, max_tokens=40)

    (result,) = generate(
        smollm2_swarm, SpeculationSettings(drafter="ngram", k=6, depth=2), [prompt], chat=True, max_tokens=40
    )

    assert result.token_ids == plain.token_ids
    assert result.accepted >= 12
    assert result.steps <= plain.steps / 2


@pytest.mark.parametrize("topology", ["ring", "star"])
def test_an_audit_replays_a_speculative_session_exactly(tiny_swarm, topology):
    (result,) = generate(tiny_swarm, OTHER_DRAFT, [NOVEL], topology=topology, max_tokens=16, audit_stages=(0, 1, 2))

    assert result.drafted > result.accepted  # rejections happened: later steps truncated earlier ones
    steps = result.audits[0].steps
    assert any(start < end for (_, end), (start, _) in zip([(s, s + n) for s, n in steps], steps[1:], strict=False))
    assert result.audit_missing == []
    for material in result.audits:
        receipt = next(r for r in result.receipts if r.node == material.node)
        block = Block(models.load_block("tiny-llama", material.layer_start, material.layer_end))
        assert verify_audit(material, receipt, block).passed


def test_an_audit_of_a_speculative_session_catches_a_node_that_skips_its_layers():
    job = "job-spec-lazy"
    key = SigningKey.generate()

    async def main():
        async with in_process_stages(SPANS, lazy=1) as (urls, stages, issuer):
            tickets = stage_tickets(issuer, job, stages, key)
            specs = [StageSpec(url, ticket) for url, ticket in zip(urls, tickets, strict=True)]
            async with Coordinator(
                "tiny-llama", specs, job=job, audit_stages=(0, 1, 2), coordinator_key=key, speculation=SAME_DRAFT
            ) as coordinator:
                return await coordinator.generate(coordinator.request(NOVEL, max_tokens=12))

    result = asyncio.run(main())

    assert result.verification is not None and result.drafted > 0  # receipts prove coverage, not correctness
    honest_first, lazy, honest_last = result.audits
    for material in (honest_first, honest_last):
        receipt = next(r for r in result.receipts if r.node == material.node)
        assert verify_audit(material, receipt, Block(models.load_block("tiny-llama", *SPANS[material.stage]))).passed
    with pytest.raises(AuditFailed) as caught:
        verify_audit(
            lazy, next(r for r in result.receipts if r.node == lazy.node), Block(models.load_block("tiny-llama", 2, 4))
        )
    assert caught.value.code == "audit_mismatch"
