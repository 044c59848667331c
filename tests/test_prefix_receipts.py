"""Receipts of sessions that reused kept positions: each stage signs how many and from where,
``verify_job`` holds every stage to the coordinator's first position and blames the one that
differs, and reused positions are paid to nobody twice (a receipt's tokens are what it computed)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.test_receipts import JOB, KEYS, MODEL, N_LAYERS, NODES, SPANS, Job, make_job, refused, stage_steps, verify
from worker_agent.errors import ReceiptError
from worker_agent.protocol.coverage import honest_work
from worker_agent.protocol.receipts import (
    MalformedReceipt,
    PrefixMismatch,
    Receipt,
    ReceiptBuilder,
    ReusedFrom,
    SessionTranscript,
)

pytestmark = pytest.mark.dataplane

SOURCE = ReusedFrom("job-earlier", "s3", bytes(range(32)))


def _signed(job: Job, session: str, stage: int, reused: int) -> Receipt:
    start, end = SPANS[stage]
    builder = ReceiptBuilder(
        job=JOB,
        session=session,
        node=NODES[stage],
        node_key=bytes(KEYS[stage].verify_key),
        model=MODEL,
        layer_start=start,
        layer_end=end,
    )
    builder.reuse(reused, SOURCE if reused else None)
    for input_hash, output_hash, tokens in stage_steps(job, session, stage):
        builder.add_step(input_hash, output_hash, tokens)
    return builder.sign(KEYS[stage])


def _reused_job(claims: tuple[int, int, int] = (64, 64, 64), start: int = 64) -> Job:
    """make_job's job, whose session "sess-a" began on ``start`` kept positions; stage k claims ``claims[k]``."""
    job = make_job()
    kept = [r for r in job.receipts if r.session != "sess-a"]
    job.receipts = kept + [_signed(job, "sess-a", k, claims[k]) for k in range(len(SPANS))]
    job.transcripts = [replace(t, start=start) if t.session == "sess-a" else t for t in job.transcripts]
    return job


def test_a_session_every_stage_reused_alike_verifies_and_pays_only_computed_tokens():
    plain = verify(make_job())

    verified = verify(_reused_job())

    assert verified.tokens_by_node == plain.tokens_by_node
    assert verified.layer_tokens_by_node == plain.layer_tokens_by_node


def test_blames_the_stage_claiming_another_reused_count():
    err = refused(_reused_job(claims=(64, 32, 64)), PrefixMismatch)

    assert (err.code, err.node) == ("receipt_prefix_mismatch", NODES[1])
    assert "stage 1" in str(err) and "reused 32 positions" in str(err)


def test_blames_a_stage_claiming_reuse_the_coordinator_never_started_past():
    err = refused(_reused_job(claims=(0, 0, 64), start=0), PrefixMismatch)

    assert err.node == NODES[2]


def test_honest_work_pays_the_stages_that_agree_with_the_coordinator_and_not_the_liar():
    job = _reused_job(claims=(64, 32, 64))
    paid = honest_work(
        job=JOB,
        model=MODEL,
        n_layers=N_LAYERS,
        assignments=job.assignments,
        receipts=job.receipts,
        transcripts=job.transcripts,
        culprit=NODES[1],
    )

    assert sorted(paid) == [NODES[0], NODES[2]]


def test_a_reusing_receipt_round_trips_both_encodings_and_a_forged_source_fails_its_signature():
    receipt = _signed(make_job(), "sess-a", 0, 64)

    assert Receipt.from_dict(receipt.to_dict()) == receipt
    assert Receipt.from_json(receipt.to_json()) == receipt
    assert receipt.to_json()["reused_from"] == {
        "job": "job-earlier",
        "session": "s3",
        "chain_head": bytes(range(32)).hex(),
    }
    forged = replace(receipt, reused_from=ReusedFrom("job-other", "s3", bytes(range(32))))
    with pytest.raises(ReceiptError) as err:
        forged.verify_signature()
    assert err.value.code == "receipt_bad_signature"


def test_a_receipt_that_reused_nothing_keeps_its_old_form():
    receipt = _signed(make_job(), "sess-a", 0, 0)

    assert "reused" not in receipt.to_dict() and "reused_from" not in receipt.to_json()


@pytest.mark.parametrize(
    "change",
    [
        {"reused": -1},
        {"reused": "64"},
        {"reused_from": {"job": "j", "session": "s"}},
        {"reused_from": {"job": "j", "session": "s", "chain_head": b"x"}},
    ],
)
def test_refuses_a_malformed_reuse_field(change):
    wire_form = {**_signed(make_job(), "sess-a", 0, 64).to_dict(), **change}

    with pytest.raises(MalformedReceipt):
        Receipt.from_dict(wire_form)


def test_a_transcript_keeps_its_start_in_its_stored_form():
    transcript = SessionTranscript("s", (bytes(32),), (bytes(32),), start=96)

    assert SessionTranscript.from_json(transcript.to_json()) == transcript
    assert "start" not in replace(transcript, start=0).to_json()
