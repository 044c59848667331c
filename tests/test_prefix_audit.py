"""Live audits of sessions that reused a kept prefix: the control plane's verifier rebuilds the
audited stage's cache from the reused prompt tokens with its trusted parts, so an honest stage
passes and one that reused a corrupted prefix fails the replay."""

from __future__ import annotations

import pytest
import torch

from marketplace.verification.verifier import reused_inputs, trusted_block, trusted_head
from worker_agent.block import WorkItem
from worker_agent.errors import AuditError
from worker_agent.kvcache import KVSession
from worker_agent.protocol.audit import AuditFailed, AuditMaterial, verify_audit
from worker_agent.protocol.keys import generate_signing_key
from worker_agent.protocol.prefix import BLOCK, keep_keys, offer_keys
from worker_agent.protocol.receipts import Receipt
from worker_agent.protocol.span import Span
from worker_agent.protocol.wire import Forward, Item, tensor_payload
from worker_agent.stage import Stage

pytestmark = pytest.mark.trust

MODEL = "tiny-llama"
SALT = b"s" * 32
TOKENS = list(range(5, 5 + BLOCK + 9))


def _inputs() -> torch.Tensor:
    """What a stage over layers 2:4 receives for TOKENS: layers 0:2 of their embeddings. (tokens, hidden)"""
    embedded = trusted_head(MODEL).embed_tokens(TOKENS)
    (rows,) = trusted_block(Span(MODEL, 0, 2)).forward([WorkItem(KVSession("job", "inputs"), 0, embedded)])
    return rows


def _step(stage: Stage, job: str, start: int, rows: torch.Tensor) -> bytes:
    forward = Forward(
        job, (Item("s0", 0, start, rows.shape[0]),), "f32", tuple(rows.shape), tensor_payload(rows, "f32")
    )
    prepared = stage.prepare(forward)
    (outputs,) = stage.compute([prepared])
    return stage.finish(prepared, outputs).payload


def _audited_second_turn(corrupt: bool) -> tuple[AuditMaterial, Receipt]:
    stage = Stage(trusted_block(Span(MODEL, 2, 4)), model=MODEL, signing_key=generate_signing_key())
    rows = _inputs()
    stage.open("job-a", ("s0",))
    _step(stage, "job-a", 0, rows)
    stage.close("job-a", ("s0",), (keep_keys(SALT, MODEL, TOKENS, len(TOKENS)),))
    if corrupt:  # a stage whose kept prefix is not what it computed
        for entry in stage.prefixes._entries.values():
            entry.values[0].mul_(0.5)
    (reused,) = stage.open("job-b", ("s0",), (offer_keys(SALT, MODEL, TOKENS),))
    sent = rows[reused:]
    output = _step(stage, "job-b", reused, sent)
    (raw,) = stage.close("job-b", ("s0",))
    material = AuditMaterial(
        job="job-b",
        session="s0",
        stage=1,
        node=stage.node,
        model=MODEL,
        layer_start=2,
        layer_end=4,
        dtype="f32",
        hidden_size=rows.shape[1],
        steps=((reused, sent.shape[0]),),
        inputs=(tensor_payload(sent, "f32"),),
        outputs=(output,),
        prefix=tuple(TOKENS[:reused]),
    )
    return AuditMaterial.from_bytes(material.to_bytes()), Receipt.from_dict(raw)


def test_an_honest_stage_that_reused_a_prefix_passes_its_audit():
    material, receipt = _audited_second_turn(corrupt=False)

    report = verify_audit(material, receipt, trusted_block(Span(MODEL, 2, 4)), prefix=reused_inputs(material))

    assert (receipt.reused, material.prefix) == (BLOCK, tuple(TOKENS[:BLOCK]))
    assert (report.passed, report.tokens) == (True, 9)


def test_a_stage_that_reused_a_corrupted_prefix_fails_its_audit():
    material, receipt = _audited_second_turn(corrupt=True)

    with pytest.raises(AuditFailed) as err:
        verify_audit(material, receipt, trusted_block(Span(MODEL, 2, 4)), prefix=reused_inputs(material))

    assert err.value.code == "audit_mismatch"


def test_material_that_reused_a_prefix_cannot_be_replayed_without_it():
    material, receipt = _audited_second_turn(corrupt=False)

    with pytest.raises(AuditError) as err:
        verify_audit(material, receipt, trusted_block(Span(MODEL, 2, 4)))

    assert "reused positions" in str(err.value)
