"""Prefix reuse end to end: three `swarm-worker serve` processes of smollm2-135m keep the KV of a
finished request, and a second request whose prompt extends the first's prompt and answer computes
only the rest: the same greedy tokens as a run without reuse, fewer positions in every stage's
receipt, receipts that verify, and audit material a trusted verifier replays on the rebuilt prefix."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from worker_agent import model as models
from worker_agent.block import Block
from worker_agent.coordinator.job import Coordinator, GenerationResult
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.protocol.audit import AuditMaterial, prefix_inputs, verify_audit
from worker_agent.protocol.prefix import BLOCK

pytestmark = pytest.mark.dataplane

MODEL = "smollm2-135m"
MAX_TOKENS = 16
FIRST = "Name three colours of the rainbow."
FOLLOW_UP = "Now name three more."


def _run(swarm, ids: list[int], salt: bytes | None, *, audit_stages: tuple[int, ...] = ()) -> GenerationResult:
    async def main() -> GenerationResult:
        job = f"job-prefix-{uuid.uuid4().hex[:8]}"
        specs = [StageSpec(url, ticket) for url, ticket in zip(swarm.urls, swarm.tickets(job), strict=True)]
        async with Coordinator(
            MODEL, specs, job=job, coordinator_key=swarm.coordinator_key(job), audit_stages=audit_stages
        ) as coordinator:
            request = coordinator.request_ids(ids, max_tokens=MAX_TOKENS, speculate=False, prefix_salt=salt)
            return await coordinator.generate(request)

    return asyncio.run(main())


def _next_turn(text: str) -> list[int]:
    """The tokens a chat's next user turn adds after the assistant's answer."""
    turn = f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return list(models.load_tokenizer(MODEL)(turn)["input_ids"])


def _chat(text: str) -> list[int]:
    tokenizer = models.load_tokenizer(MODEL)
    return list(
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
    )


def test_a_second_turn_reuses_the_first_turns_kv_with_identical_output_and_verified_receipts(smollm2_swarm):
    salt = os.urandom(32)
    first_ids = _chat(FIRST)
    first = _run(smollm2_swarm, first_ids, salt)
    second_ids = first_ids + first.token_ids + _next_turn(FOLLOW_UP)
    # The stages hold every committed position the answer's last step computed.
    held = len(first_ids) + len(first.token_ids) - (first.finish_reason == "length")
    expected_reuse = held // BLOCK * BLOCK

    reused = _run(smollm2_swarm, second_ids, salt, audit_stages=(1,))
    plain = _run(smollm2_swarm, second_ids, None)

    assert first.cached_tokens == 0
    assert expected_reuse > 0
    assert reused.cached_tokens == expected_reuse
    assert reused.token_ids == plain.token_ids
    assert reused.verification is not None and plain.verification is not None
    steps = len(reused.receipts[0].hashes)
    assert [r.reused for r in reused.receipts] == [expected_reuse] * 3
    assert [r.tokens for r in reused.receipts] == [len(second_ids) - expected_reuse + steps - 1] * 3
    assert [r.tokens for r in plain.receipts] == [len(second_ids) + steps - 1] * 3
    assert {(r.reused_from.job, r.reused_from.session) for r in reused.receipts} == {
        (first.receipts[0].job, first.session)
    }
    assert [r.reused_from.chain_head for r in reused.receipts] == [r.chain_head for r in first.receipts]
    assert sum(reused.verification.tokens_by_node.values()) == sum(plain.verification.tokens_by_node.values()) - 3 * (
        expected_reuse
    )
    # The audited middle stage's material carries the reused tokens; the verifier rebuilds its cache.
    (material,) = reused.audits
    material = AuditMaterial.from_bytes(material.to_bytes())
    assert material.prefix == tuple(second_ids[:expected_reuse])
    before = Block(models.load_block(MODEL, 0, material.layer_start))
    block = Block(models.load_block(MODEL, material.layer_start, material.layer_end))
    prefix = prefix_inputs(material, models.load_head(MODEL), before)
    report = verify_audit(material, reused.receipts[1], block, upstream=reused.receipts[0], prefix=prefix)
    assert report.passed


def test_another_accounts_salt_reuses_nothing(smollm2_swarm):
    first_ids = _chat(FIRST)
    first = _run(smollm2_swarm, first_ids, os.urandom(32))

    other = _run(smollm2_swarm, first_ids + first.token_ids + _next_turn(FOLLOW_UP), os.urandom(32))

    assert other.cached_tokens == 0
    assert [r.reused for r in other.receipts] == [0, 0, 0]
