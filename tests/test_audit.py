"""Live audits: the coordinator keeps a session's per-stage traffic, and a trusted replay checks it.

Honest jobs run on real agent processes (``tiny_swarm``: tiny-llama split 0:2, 2:4, 4:6) in ring
and star topology; the material they yield must match the stages' receipts and replay exactly on
trusted blocks. Tampered material, a receipt for other traffic, and outputs that the trusted
block does not compute are refused, each with its own code. A node that skips its layers but
signs what it sends passes receipt verification and still fails its audit (in-process stages).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import subprocess
import sys
from functools import cache

import msgpack
import pytest
import torch
from nacl.signing import SigningKey

from worker_agent import model as models
from worker_agent.block import Block, WorkItem
from worker_agent.coordinator.job import Coordinator, GenerationResult
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.errors import AuditError
from worker_agent.kvcache import KVSession
from worker_agent.protocol.audit import (
    AuditFailed,
    AuditMaterial,
    check_hashes,
    per_token_metrics,
    replay,
    verify_audit,
)
from worker_agent.protocol.keys import generate_signing_key, node_id, public_key_bytes
from worker_agent.protocol.receipts import BadSignature, Receipt, ReceiptBuilder, digest
from worker_agent.protocol.tickets import issue_ticket
from worker_agent.protocol.wire import tensor_payload
from worker_agent.server import StageServer
from worker_agent.stage import Stage

pytestmark = pytest.mark.trust

MODEL = "tiny-llama"
SPANS = [(0, 2), (2, 4), (4, 6)]
HIDDEN = 64
PROMPT = "Once upon a time"
OTHER_PROMPT = "The quick brown fox jumps over"
MAX_TOKENS = 6


@cache
def trusted_block(start: int, end: int) -> Block:
    return Block(models.load_block(MODEL, start, end))


async def _generate(urls, tickets, job, *, key, topology="ring", audit_stages=(), prompts=(PROMPT,)):
    specs = [StageSpec(url, ticket) for url, ticket in zip(urls, tickets, strict=True)]
    async with Coordinator(
        MODEL, specs, job=job, topology=topology, audit_stages=audit_stages, coordinator_key=key
    ) as coordinator:
        results = [await coordinator.generate(coordinator.request(p, max_tokens=MAX_TOKENS)) for p in prompts]
        # Nothing of a session stays behind in the coordinator once it is over.
        assert coordinator.pipeline._captures == {}
        return results


def generate(swarm, job, **kwargs) -> GenerationResult:
    (result,) = asyncio.run(_generate(swarm.urls, swarm.tickets(job), job, key=swarm.coordinator_key(job), **kwargs))
    return result


@pytest.fixture(scope="module")
def plain(tiny_swarm) -> GenerationResult:
    """The same request without audits."""
    return generate(tiny_swarm, "audit-plain")


@pytest.fixture(scope="module")
def sessions(tiny_swarm) -> list[GenerationResult]:
    """An honest ring job of two sessions (two prompts) that keeps every stage's traffic."""
    job = "audit-ring"
    results = asyncio.run(
        _generate(
            tiny_swarm.urls,
            tiny_swarm.tickets(job),
            job,
            key=tiny_swarm.coordinator_key(job),
            audit_stages=(0, 1, 2),
            prompts=(PROMPT, OTHER_PROMPT),
        )
    )
    assert all(len(result.audits[0].steps) >= 4 for result in results)  # room to tamper with step 3
    return results


@pytest.fixture(scope="module")
def audited(sessions) -> GenerationResult:
    return sessions[0]


def receipt_of(result: GenerationResult, material: AuditMaterial) -> Receipt:
    return next(r for r in result.receipts if r.node == material.node)


# --- honest jobs on real agents ------------------------------------------------------------------


@pytest.mark.parametrize("topology", ["ring", "star"])
def test_an_honest_job_yields_material_for_every_audited_stage_that_verifies(tiny_swarm, plain, topology):
    result = generate(tiny_swarm, f"audit-honest-{topology}", topology=topology, audit_stages=(0, 1, 2))

    assert result.token_ids == plain.token_ids
    assert result.verification is not None
    assert result.audit_missing == []
    assert [m.stage for m in result.audits] == [0, 1, 2]
    assert [(m.layer_start, m.layer_end) for m in result.audits] == SPANS
    assert [m.node for m in result.audits] == [agent.node for agent in tiny_swarm.agents]
    steps = result.receipts[0].steps
    for material in result.audits:
        assert (material.job, material.session, material.model) == (f"audit-honest-{topology}", result.session, MODEL)
        assert (material.dtype, material.hidden_size) == ("f32", HIDDEN)
        assert len(material.steps) == steps
        assert material.steps[0] == (0, result.prompt_tokens)
        assert material.steps[1:] == tuple((result.prompt_tokens + i, 1) for i in range(steps - 1))
        report = verify_audit(material, receipt_of(result, material), trusted_block(*SPANS[material.stage]))
        assert report.passed
        assert (report.steps, report.tokens) == (steps, result.prompt_tokens + steps - 1)
        assert len(report.cosine) == len(report.rel_norm) == report.tokens
        # A lone session replays as the stage ran it, up to float32 summation order (the agent
        # and this process run different thread counts).
        assert min(report.cosine) > 1 - 1e-6
        assert max(report.rel_norm) < 1e-4
    for upstream, downstream in zip(result.audits, result.audits[1:], strict=False):
        assert upstream.outputs == downstream.inputs


def test_a_job_without_audits_keeps_no_material(plain):
    assert (plain.audits, plain.audit_missing) == ([], [])
    assert plain.verification is not None


def test_only_the_audited_stages_are_kept(tiny_swarm, plain):
    result = generate(tiny_swarm, "audit-middle", audit_stages=(1,))

    assert result.token_ids == plain.token_ids
    assert [m.stage for m in result.audits] == [1]
    (material,) = result.audits
    assert verify_audit(material, receipt_of(result, material), trusted_block(2, 4)).passed


def test_a_stage_whose_taps_do_not_arrive_is_reported_missing_and_owes_both_gaps(tiny_swarm, plain):
    job = "audit-no-taps"

    async def main():
        specs = [StageSpec(url, ticket) for url, ticket in zip(tiny_swarm.urls, tiny_swarm.tickets(job), strict=True)]
        key = tiny_swarm.coordinator_key(job)
        async with Coordinator(MODEL, specs, job=job, audit_stages=(0, 1, 2), coordinator_key=key) as coordinator:
            pipeline = coordinator.pipeline
            on_result = pipeline.on_result
            # As if stage 0 never sent its taps: its output reaches stage 1 only.
            pipeline.on_result = lambda index, result: None if index == 0 else on_result(index, result)
            return await coordinator.generate(coordinator.request(PROMPT, max_tokens=MAX_TOKENS))

    result = asyncio.run(main())

    assert result.token_ids == plain.token_ids
    assert result.verification is not None
    # Stage 0's tap is both its own outputs and stage 1's inputs: both gaps are stage 0's to answer for.
    assert [(gap.stage, gap.owed_by) for gap in result.audit_missing] == [(0, 0), (1, 0)]
    assert all(gap.session == result.session for gap in result.audit_missing)
    assert [m.stage for m in result.audits] == [2]


def test_an_audit_stage_outside_the_pipeline_is_refused(tiny_swarm):
    with pytest.raises(ValueError, match=r"audit stage 3 is not a stage index in 0\.\.2"):
        generate(tiny_swarm, "audit-out-of-range", audit_stages=(3,))


def test_the_cli_replays_the_audited_stages(tiny_swarm, plain):
    command = [
        sys.executable,
        "-m",
        "worker_agent.coordinator.cli",
        "generate",
        "--model",
        MODEL,
        "--stages",
        ",".join(tiny_swarm.urls),
        "--ticket-key",
        str(tiny_swarm.workdir / "issuer.key"),
        "--prompt",
        PROMPT,
        "--max-tokens",
        str(MAX_TOKENS),
        "--threads",
        "1",
        "--audit-stage",
        "0",
        "--audit-stage",
        "2",
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(done.stdout)["results"]
    assert result["token_ids"] == plain.token_ids
    assert [(a["stage"], a["verdict"]) for a in result["audits"]] == [(0, "passed"), (2, "passed")]
    for audit in result["audits"]:
        assert audit["replay"]["passed"] is True
        assert audit["replay"]["first_failure"] is None
        assert audit["replay"]["tokens"] == audit["tokens"] == len(audit["replay"]["cosine"])
        assert audit["replay"]["worst_cosine"] == 1.0


# --- tampered material and foreign receipts --------------------------------------------------------


def flip_first_byte(chunk: bytes) -> bytes:
    return bytes([chunk[0] ^ 0x01]) + chunk[1:]  # the lowest mantissa bit: still a finite float


def test_a_flipped_output_byte_is_refused(audited):
    material = audited.audits[1]
    outputs = (*material.outputs[:2], flip_first_byte(material.outputs[2]), *material.outputs[3:])
    tampered = dataclasses.replace(material, outputs=outputs)

    with pytest.raises(AuditFailed) as caught:
        check_hashes(tampered, receipt_of(audited, material))

    assert caught.value.code == "audit_hash_mismatch"
    assert str(caught.value) == (
        f"stage 1 (node {material.node}) of session {material.session!r} step 2: "
        "the recorded output is not what the node signed"
    )


def test_reordered_steps_are_refused(audited):
    material = audited.audits[0]

    def swap(values):
        return (values[0], values[2], values[1], *values[3:])

    reordered = dataclasses.replace(
        material, steps=swap(material.steps), inputs=swap(material.inputs), outputs=swap(material.outputs)
    )

    with pytest.raises(AuditFailed) as caught:
        check_hashes(reordered, receipt_of(audited, material))

    assert caught.value.code == "audit_hash_mismatch"
    assert "step 1: the recorded input is not what the node signed" in str(caught.value)


def test_material_of_another_session_is_refused(sessions):
    first, second = sessions
    material = first.audits[1]
    other_receipt = receipt_of(second, second.audits[1])

    with pytest.raises(AuditFailed) as caught:
        check_hashes(material, other_receipt)
    assert caught.value.code == "audit_hash_mismatch"
    assert f"the receipt's session is {second.session!r}, the material's {first.session!r}" in str(caught.value)

    relabelled = dataclasses.replace(material, session=second.session)
    with pytest.raises(AuditFailed) as caught:
        check_hashes(relabelled, other_receipt)
    assert caught.value.code == "audit_hash_mismatch"
    assert str(caught.value).startswith(f"stage 1 (node {material.node}) of session {second.session!r}")


def test_a_receipt_for_another_span_or_node_is_refused(audited):
    material = audited.audits[1]
    receipt = receipt_of(audited, material)

    with pytest.raises(AuditFailed) as caught:
        check_hashes(dataclasses.replace(material, layer_start=3), receipt)
    assert caught.value.code == "audit_hash_mismatch"
    assert "the receipt's layer_start is 2, the material's 3" in str(caught.value)

    with pytest.raises(AuditFailed) as caught:
        check_hashes(material, receipt_of(audited, audited.audits[2]))
    assert caught.value.code == "audit_hash_mismatch"
    assert "the receipt's node is" in str(caught.value)


def test_a_receipt_whose_signature_does_not_verify_is_refused(audited):
    material = audited.audits[0]
    forged = dataclasses.replace(receipt_of(audited, material), signature=bytes(64))

    with pytest.raises(BadSignature):
        check_hashes(material, forged)


def test_fewer_steps_than_the_receipt_signs_are_refused(audited):
    material = audited.audits[2]
    short = dataclasses.replace(
        material, steps=material.steps[:-1], inputs=material.inputs[:-1], outputs=material.outputs[:-1]
    )

    with pytest.raises(AuditFailed) as caught:
        check_hashes(short, receipt_of(audited, material))

    assert caught.value.code == "audit_hash_mismatch"
    assert f"the receipt signs {len(material.steps)} steps" in str(caught.value)


# --- replays that do not match ---------------------------------------------------------------------


def resigned(material: AuditMaterial, key: SigningKey) -> tuple[AuditMaterial, Receipt]:
    """The material as a node holding ``key`` would have signed it: a receipt over its exact bytes."""
    node_key = public_key_bytes(key)
    builder = ReceiptBuilder(
        job=material.job,
        session=material.session,
        node=node_id(node_key),
        node_key=node_key,
        model=material.model,
        layer_start=material.layer_start,
        layer_end=material.layer_end,
    )
    for (_, count), sent_in, sent_out in zip(material.steps, material.inputs, material.outputs, strict=True):
        builder.add_step(digest(sent_in), digest(sent_out), count)
    return dataclasses.replace(material, node=node_id(node_key)), builder.sign(key)


def test_signed_outputs_that_the_trusted_block_does_not_compute_fail_the_replay(audited):
    material = audited.audits[1]
    negated = material.tensor(material.outputs[3], 1).neg()
    outputs = (*material.outputs[:3], tensor_payload(negated, "f32"), *material.outputs[4:])
    lying, receipt = resigned(dataclasses.replace(material, outputs=outputs), SigningKey(b"\x07" * 32))

    with pytest.raises(AuditFailed) as caught:
        verify_audit(lying, receipt, trusted_block(2, 4))

    assert caught.value.code == "audit_mismatch"
    report = caught.value.report
    assert not report.passed
    assert report.first_failure == (3, 0)
    failing = material.steps[0][1] + 2  # the prompt's rows, then decode steps 1 and 2
    assert report.cosine[failing] == pytest.approx(-1.0)
    assert report.rel_norm[failing] < 1e-4  # same norm, opposite direction
    assert min(report.cosine[:failing] + report.cosine[failing + 1 :]) > 1 - 1e-6
    assert "step 3 token 0 has cosine -1.000000 (min 0.99)" in str(caught.value)
    summary = report.to_dict()
    assert summary["passed"] is False
    assert summary["first_failure"] == {"step": 3, "token": 0}
    assert summary["worst_cosine"] == -1.0
    assert len(summary["cosine"]) == report.tokens


def test_material_replayed_on_the_layers_of_another_span_fails():
    material, receipt = resigned(honest_material(span=(2, 4)), SigningKey(b"\x08" * 32))
    other_span = dataclasses.replace(material, layer_start=4, layer_end=6)
    other_receipt = resigned(other_span, SigningKey(b"\x08" * 32))[1]

    with pytest.raises(AuditFailed) as caught:
        verify_audit(other_span, other_receipt, trusted_block(4, 6))

    assert caught.value.code == "audit_mismatch"
    assert max(caught.value.report.cosine) < 0.99
    assert verify_audit(material, receipt, trusted_block(2, 4)).passed


def test_a_trusted_block_of_another_span_cannot_replay(audited):
    material = audited.audits[1]

    with pytest.raises(AuditError) as caught:
        replay(material, trusted_block(4, 6))

    assert caught.value.code == "audit_wrong_block"
    assert not isinstance(caught.value, AuditFailed)  # the verifier's mistake, not the node's


def test_thresholds_must_be_sensible(audited):
    with pytest.raises(ValueError, match="max_rel_norm must be a positive number"):
        replay(audited.audits[0], trusted_block(0, 2), max_rel_norm=0)


class SkippingStage(Stage):
    """Sends its input on unchanged instead of running its layers, and signs what it sends."""

    def compute(self, batch):
        for prepared in batch:
            for work in prepared.work:
                work.session.length = work.start + work.hidden.shape[0]  # positions it claims to hold
        return [[work.hidden.clone() for work in prepared.work] for prepared in batch]


def stage_tickets(issuer, job: str, stages: list[Stage], key: SigningKey) -> list[bytes]:
    """Tickets for in-process stages, naming ``key`` as the job's coordinator key."""
    return [
        issue_ticket(
            issuer,
            job=job,
            node=s.node,
            model=MODEL,
            layer_start=s.layer_start,
            layer_end=s.layer_end,
            coordinator_key=bytes(key.verify_key),
        )
        for s in stages
    ]


@contextlib.asynccontextmanager
async def in_process_stages(spans, *, lazy: int):
    issuer = generate_signing_key()
    tasks, urls, stages = [], [], []
    for index, (start, end) in enumerate(spans):
        cls = SkippingStage if index == lazy else Stage
        block = Block(models.load_block(MODEL, start, end))
        stage = cls(block, model=MODEL, signing_key=generate_signing_key(), trusted_keys=[public_key_bytes(issuer)])
        bound = asyncio.get_running_loop().create_future()
        tasks.append(asyncio.create_task(StageServer(stage).serve("127.0.0.1", 0, ready=bound.set_result)))
        urls.append(f"ws://127.0.0.1:{await asyncio.wait_for(bound, 30)}")
        stages.append(stage)
    try:
        yield urls, stages, issuer
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_a_node_that_skips_its_layers_passes_receipts_and_fails_its_audit():
    job = "audit-lazy"
    key = SigningKey.generate()

    async def main():
        async with in_process_stages(SPANS, lazy=1) as (urls, stages, issuer):
            tickets = stage_tickets(issuer, job, stages, key)
            return await _generate(urls, tickets, job, key=key, audit_stages=(0, 1, 2))

    (result,) = asyncio.run(main())

    assert result.verification is not None  # receipts prove coverage, not correctness
    honest_first, lazy, honest_last = result.audits
    assert lazy.inputs == lazy.outputs
    for material in (honest_first, honest_last):
        assert verify_audit(material, receipt_of(result, material), trusted_block(*SPANS[material.stage])).passed
    with pytest.raises(AuditFailed) as caught:
        verify_audit(lazy, receipt_of(result, lazy), trusted_block(2, 4))
    assert caught.value.code == "audit_mismatch"
    assert caught.value.report.first_failure == (0, 0)
    assert max(caught.value.report.cosine) < 0.99


# --- the material's own format ---------------------------------------------------------------------


def honest_material(span=(0, 2), steps=((0, 3), (3, 1), (4, 1))) -> AuditMaterial:
    """Material as an honest stage of ``span`` produces it, for seeded random inputs."""
    seeds = [torch.Generator().manual_seed(i) for i in range(len(steps))]
    inputs = [torch.randn(count, HIDDEN, generator=seed) for (_, count), seed in zip(steps, seeds, strict=True)]
    block = trusted_block(*span)
    kv = KVSession("job-x", "s0")
    outputs = [block.forward([WorkItem(kv, start, x)])[0] for (start, _), x in zip(steps, inputs, strict=True)]
    return AuditMaterial(
        job="job-x",
        session="s0",
        stage=0,
        node="node-a",
        model=MODEL,
        layer_start=span[0],
        layer_end=span[1],
        dtype="f32",
        hidden_size=HIDDEN,
        steps=tuple(steps),
        inputs=tuple(tensor_payload(x, "f32") for x in inputs),
        outputs=tuple(tensor_payload(y, "f32") for y in outputs),
    )


class CountingBlock(Block):
    """A trusted block that counts its passes."""

    def __init__(self, span: tuple[int, int]) -> None:
        super().__init__(models.load_block(MODEL, *span))
        self.passes = 0

    def forward(self, items):
        self.passes += 1
        return super().forward(items)


def test_a_session_replays_in_one_pass_unless_a_step_computed_positions_again():
    """Steps that follow one another replay as one causal pass (each position sees the same inputs
    as in the stage's steps); a step that computed a position again (a rejected draft's) makes the
    replay go step by step, on the cache as the stage held it, and both pass for an honest stage."""
    contiguous = honest_material(steps=((0, 3), (3, 1), (4, 1), (5, 1)))
    block = CountingBlock((0, 2))
    report = replay(contiguous, block)
    assert (report.passed, block.passes, report.tokens) == (True, 1, 6)
    assert min(report.cosine) > 1 - 1e-5 and max(report.rel_norm) < 1e-4

    rolled_back = honest_material(steps=((0, 3), (3, 2), (4, 1), (5, 1)))  # position 4 computed twice
    block = CountingBlock((0, 2))
    report = replay(rolled_back, block)
    assert (report.passed, block.passes, report.tokens) == (True, 4, 7)
    assert min(report.cosine) > 1 - 1e-5

    # The same rows as one pass would not stand for the stage's: the second input at 4 replaced the first.
    merged = dataclasses.replace(rolled_back, steps=((0, 3), (3, 2), (5, 1), (6, 1)))
    assert not replay(merged, CountingBlock((0, 2))).passed


def test_material_round_trips_through_bytes(audited):
    for material in audited.audits:
        data = material.to_bytes()

        assert AuditMaterial.from_bytes(data) == material
        assert AuditMaterial.from_bytes(data).to_bytes() == data


def body_of(material: AuditMaterial) -> dict:
    return msgpack.unpackb(material.to_bytes(), raw=False)


def packed(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def malformed_cases():
    nan_row = tensor_payload(torch.full((1, HIDDEN), float("nan")), "f32")
    return [
        ("not msgpack", lambda body: b"\xc1", "audit material is not valid msgpack"),
        ("trailing bytes", lambda body: packed(body) + b"\x00", "audit material is not valid msgpack"),
        ("a list", lambda body: packed([body]), "audit material must be a map with exactly the keys"),
        ("a missing key", lambda body: packed({k: v for k, v in body.items() if k != "node"}), "exactly the keys"),
        ("an extra key", lambda body: packed({**body, "extra": 1}), "exactly the keys"),
        ("another version", lambda body: packed({**body, "v": 2}), "version 2 is not supported"),
        ("a bool version", lambda body: packed({**body, "v": True}), "version True is not supported"),
        ("a str stage", lambda body: packed({**body, "stage": "0"}), "stage must be a non-negative integer"),
        ("a bool span", lambda body: packed({**body, "layer_start": False}), "layer_start must be a non-negative"),
        ("an empty span", lambda body: packed({**body, "layer_end": 0}), "span [0, 0) is empty"),
        ("an empty job", lambda body: packed({**body, "job": ""}), "job must be a non-empty string"),
        ("bytes for a string", lambda body: packed({**body, "node": b"n"}), "node must be a non-empty string"),
        ("an unknown dtype", lambda body: packed({**body, "dtype": "f64"}), "dtype 'f64' is not one of"),
        (
            "no steps",
            lambda body: packed({**body, "steps": [], "inputs": [], "outputs": []}),
            "non-empty tuple of steps",
        ),
        ("steps as a map", lambda body: packed({**body, "steps": {}}), "steps must be a list"),
        ("a step of three", lambda body: packed({**body, "steps": [[0, 3, 0], *body["steps"][1:]]}), "each audit step"),
        ("a zero count", lambda body: packed({**body, "steps": [[0, 0], *body["steps"][1:]]}), "each audit step"),
        ("an input short", lambda body: packed({**body, "inputs": body["inputs"][:-1]}), "inputs must be a tuple of 3"),
        ("a str output", lambda body: packed({**body, "outputs": ["x", *body["outputs"][1:]]}), "outputs[0] must be"),
        (
            "a truncated output",
            lambda body: packed({**body, "outputs": [body["outputs"][0][:-4], *body["outputs"][1:]]}),
            "outputs[0] has 764 bytes; 3 rows of 64 f32 need 768",
        ),
        (
            "a NaN input",
            lambda body: packed({**body, "inputs": [*body["inputs"][:2], nan_row]}),
            "inputs[2] holds NaN or Inf",
        ),
    ]


@pytest.mark.parametrize(("case", "mangle", "message"), malformed_cases(), ids=[c[0] for c in malformed_cases()])
def test_malformed_material_is_refused(case, mangle, message):
    data = mangle(body_of(honest_material()))

    with pytest.raises(AuditError) as caught:
        AuditMaterial.from_bytes(data)

    assert caught.value.code == "audit_malformed"
    assert message in str(caught.value)


def test_material_that_is_not_bytes_is_refused():
    with pytest.raises(AuditError, match="audit material must be bytes, got str"):
        AuditMaterial.from_bytes("not bytes")


def test_a_step_past_the_cached_positions_is_refused():
    material = honest_material()
    gapped = dataclasses.replace(material, steps=((0, 3), (5, 1), (6, 1)))

    with pytest.raises(AuditError, match="audit step 1 starts at position 5, past the 3 held"):
        replay(gapped, trusted_block(0, 2))


def test_per_token_metrics():
    reference = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    output = torch.tensor([[6.0, 8.0], [0.0, 2.0], [0.0, 0.0], [0.0, 0.0]])

    cosines, rel_norms = per_token_metrics(output, reference)

    assert cosines == (1.0, 0.0, 1.0, 0.0)
    assert rel_norms == (1.0, 1.0, 0.0, 1.0)
    assert per_token_metrics(reference, output) == ((1.0, 0.0, 1.0, 0.0), (0.5, 0.5, 0.0, math.inf))
    with pytest.raises(ValueError, match=r"got \(4, 2\) and \(2, 4\)"):
        per_token_metrics(output, reference.T)
    with pytest.raises(ValueError, match=r"got \(8,\) and \(8,\)"):
        per_token_metrics(output.flatten(), reference.flatten())
