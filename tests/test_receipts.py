import hashlib
import json
import random
from dataclasses import dataclass, replace

import msgpack
import pytest
from nacl.signing import SigningKey

from worker_agent.errors import ReceiptError
from worker_agent.protocol.coverage import JobVerification, verify_job
from worker_agent.protocol.keys import node_id
from worker_agent.protocol.links import sign_link
from worker_agent.protocol.receipts import (
    CHAIN_SEED,
    SIGNING_CONTEXT,
    BadSignature,
    BrokenLink,
    DuplicateReceipt,
    EndpointMismatch,
    ForeignSigner,
    MalformedReceipt,
    MissingReceipt,
    Receipt,
    ReceiptBuilder,
    SessionTranscript,
    SpanGap,
    SpanOverlap,
    StageAssignment,
    StepMismatch,
    digest,
)

pytestmark = pytest.mark.dataplane

JOB = "job-42"
MODEL = "smollm2-135m"
N_LAYERS = 12
SPANS = [(0, 4), (4, 9), (9, 12)]
# Token rows per step, per session: a prefill then decode steps.
SESSION_TOKENS = {"sess-a": [5, 1, 1], "sess-b": [7, 1]}
KEYS = [SigningKey(bytes([i + 1]) * 32) for i in range(len(SPANS))]
NODES = [node_id(bytes(key.verify_key)) for key in KEYS]
FOREIGN = SigningKey(b"\x99" * 32)


@dataclass
class Job:
    assignments: list[StageAssignment]
    receipts: list[Receipt]
    transcripts: list[SessionTranscript]
    # session -> per step, the hashes at the 4 pipeline boundaries: coordinator->s0->s1->s2->coordinator
    boundaries: dict[str, list[list[bytes]]]

    def receipt(self, session: str, stage: int) -> Receipt:
        return next(r for r in self.receipts if r.session == session and r.node == NODES[stage])

    def swap(self, old: Receipt, new: Receipt) -> list[Receipt]:
        return [new if r is old else r for r in self.receipts]


def sign_stage(
    stage: int,
    session: str,
    steps: list[tuple[bytes, bytes, int]],
    *,
    key: SigningKey | None = None,
    node: str | None = None,
    span: tuple[int, int] | None = None,
    job: str = JOB,
    model: str = MODEL,
    links: list[bytes] | None = None,
) -> Receipt:
    key = key or KEYS[stage]
    start, end = span or SPANS[stage]
    builder = ReceiptBuilder(
        job=job,
        session=session,
        node=node or NODES[stage],
        node_key=bytes(key.verify_key),
        model=model,
        layer_start=start,
        layer_end=end,
    )
    for index, (input_hash, output_hash, tokens) in enumerate(steps):
        builder.add_step(input_hash, output_hash, tokens, links[index] if links else b"")
    return builder.sign(key)


def new_builder() -> ReceiptBuilder:
    """Stage 0's builder for a session "s"."""
    return ReceiptBuilder(
        job=JOB,
        session="s",
        node=NODES[0],
        node_key=bytes(KEYS[0].verify_key),
        model=MODEL,
        layer_start=0,
        layer_end=4,
    )


def stage_steps(job: Job, session: str, stage: int) -> list[tuple[bytes, bytes, int]]:
    return [
        (bounds[stage], bounds[stage + 1], tokens)
        for bounds, tokens in zip(job.boundaries[session], SESSION_TOKENS[session], strict=True)
    ]


def make_job(spans: list[tuple[int, int]] = SPANS) -> Job:
    """A valid 3-stage job over 2 sessions, over random tensor bytes, signed by three real keys."""
    rng = random.Random(1234)
    boundaries = {
        session: [[digest(rng.randbytes(64 * tokens)) for _ in range(len(SPANS) + 1)] for tokens in per_step]
        for session, per_step in SESSION_TOKENS.items()
    }
    job = Job(
        assignments=[
            StageAssignment(node=NODES[k], node_key=bytes(KEYS[k].verify_key), layer_start=s, layer_end=e)
            for k, (s, e) in enumerate(spans)
        ],
        receipts=[],
        transcripts=[
            SessionTranscript(
                session=session,
                sent=tuple(bounds[0] for bounds in steps),
                received=tuple(bounds[-1] for bounds in steps),
            )
            for session, steps in boundaries.items()
        ],
        boundaries=boundaries,
    )
    job.receipts = [
        sign_stage(k, session, stage_steps(job, session, k), span=spans[k])
        for session in SESSION_TOKENS
        for k in range(len(SPANS))
    ]
    return job


def verify(job: Job, **overrides) -> JobVerification:
    args = {
        "job": JOB,
        "model": MODEL,
        "n_layers": N_LAYERS,
        "assignments": job.assignments,
        "receipts": job.receipts,
        "transcripts": job.transcripts,
        **overrides,
    }
    return verify_job(**args)


def refused(job: Job, error: type[ReceiptError], **overrides) -> ReceiptError:
    with pytest.raises(error) as err:
        verify(job, **overrides)
    return err.value


def flip(data: bytes, i: int = 0) -> bytes:
    return data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :]


# --- a valid job --------------------------------------------------------------------------------


def test_valid_job_verifies_with_exact_totals():
    result = verify(make_job())

    assert result == JobVerification(
        job=JOB,
        sessions=2,
        steps=5,
        tokens_by_node={NODES[0]: 15, NODES[1]: 15, NODES[2]: 15},
        layer_tokens_by_node={NODES[0]: 60, NODES[1]: 75, NODES[2]: 45},
    )


def test_valid_job_verifies_whatever_the_order_of_receipts_and_assignments():
    job = make_job()
    shuffled = list(reversed(job.receipts))

    result = verify(job, receipts=shuffled, assignments=list(reversed(job.assignments)))

    assert result.steps == 5
    assert result.tokens_by_node == {NODES[0]: 15, NODES[1]: 15, NODES[2]: 15}


def test_single_stage_job_over_all_layers_verifies():
    job = make_job()
    tokens = SESSION_TOKENS["sess-a"]
    bounds = job.boundaries["sess-a"]
    receipt = sign_stage(0, "sess-a", [(b[0], b[3], t) for b, t in zip(bounds, tokens, strict=True)], span=(0, 12))

    result = verify(
        job,
        assignments=[replace(job.assignments[0], layer_end=12)],
        receipts=[receipt],
        transcripts=[job.transcripts[0]],
    )

    assert result == JobVerification(
        job=JOB, sessions=1, steps=3, tokens_by_node={NODES[0]: 7}, layer_tokens_by_node={NODES[0]: 84}
    )


# --- forgeries ----------------------------------------------------------------------------------


def test_rejects_a_tampered_signature():
    job = make_job()
    victim = job.receipt("sess-a", 1)
    forged = replace(victim, signature=flip(victim.signature, 10))

    err = refused(job, BadSignature, receipts=job.swap(victim, forged))

    assert err.code == "receipt_bad_signature"
    assert str(err) == f"receipt of node {NODES[1]} for session 'sess-a': signature does not verify"


def test_rejects_a_receipt_signed_by_a_foreign_key():
    job = make_job()
    victim = job.receipt("sess-b", 1)
    forged = sign_stage(1, "sess-b", stage_steps(job, "sess-b", 1), key=FOREIGN)

    err = refused(job, ForeignSigner, receipts=job.swap(victim, forged))

    assert err.code == "receipt_foreign_signer"
    assert str(err) == (
        f"receipt of node {NODES[1]} for session 'sess-b' is signed by key "
        f"{bytes(FOREIGN.verify_key).hex()}, not the assigned key"
    )


def test_rejects_a_foreign_signature_over_the_assigned_nodes_key():
    job = make_job()
    victim = job.receipt("sess-b", 1)
    forged = replace(victim, signature=FOREIGN.sign(SIGNING_CONTEXT + victim.body_bytes()).signature)

    err = refused(job, BadSignature, receipts=job.swap(victim, forged))

    assert err.code == "receipt_bad_signature"


def test_rejects_a_receipt_claiming_another_assigned_node():
    job = make_job()
    victim = job.receipt("sess-a", 2)
    # Stage 1's key signs stage 2's work under stage 2's name.
    forged = sign_stage(2, "sess-a", stage_steps(job, "sess-a", 2), key=KEYS[1])

    err = refused(job, ForeignSigner, receipts=job.swap(victim, forged))

    assert err.code == "receipt_foreign_signer"
    assert f"receipt of node {NODES[2]} for session 'sess-a' is signed by key" in str(err)


def test_rejects_a_receipt_from_an_unassigned_node():
    job = make_job()
    victim = job.receipt("sess-a", 2)
    stranger = node_id(bytes(FOREIGN.verify_key))
    forged = sign_stage(2, "sess-a", stage_steps(job, "sess-a", 2), key=FOREIGN, node=stranger)

    err = refused(job, ForeignSigner, receipts=job.swap(victim, forged))

    assert str(err) == f"receipt of node {stranger} for session 'sess-a': the node is not assigned to this job"


def test_rejects_a_receipt_claiming_a_span_other_than_assigned():
    job = make_job()
    victim = job.receipt("sess-a", 1)
    forged = sign_stage(1, "sess-a", stage_steps(job, "sess-a", 1), span=(4, 12))

    err = refused(job, ForeignSigner, receipts=job.swap(victim, forged))

    assert str(err) == f"receipt of node {NODES[1]} for session 'sess-a' claims layers [4, 12), assigned [4, 9)"


def test_rejects_a_gap_in_the_spans():
    job = make_job(spans=[(0, 4), (5, 9), (9, 12)])

    err = refused(job, SpanGap)

    assert err.code == "receipt_span_gap"
    assert str(err) == "layers [4, 5) are assigned to no node"


def test_rejects_spans_that_stop_short_of_the_last_layer():
    job = make_job(spans=[(0, 4), (4, 9), (9, 11)])

    assert str(refused(job, SpanGap)) == "layers [11, 12) are assigned to no node"


def test_rejects_spans_that_do_not_start_at_layer_zero():
    job = make_job(spans=[(1, 4), (4, 9), (9, 12)])

    assert str(refused(job, SpanGap)) == "layers [0, 1) are assigned to no node"


def test_rejects_overlapping_spans():
    job = make_job(spans=[(0, 4), (3, 9), (9, 12)])

    err = refused(job, SpanOverlap)

    assert err.code == "receipt_span_overlap"
    assert str(err) == f"node {NODES[1]}'s span [3, 9) overlaps layers already covered up to 4"


def test_rejects_spans_past_the_last_layer():
    job = make_job(spans=[(0, 4), (4, 9), (9, 13)])

    assert str(refused(job, SpanOverlap)) == "spans cover layers up to 13, past the model's 12"


def test_rejects_unequal_step_counts():
    job = make_job()
    victim = job.receipt("sess-a", 2)
    forged = sign_stage(2, "sess-a", stage_steps(job, "sess-a", 2)[:2])

    err = refused(job, StepMismatch, receipts=job.swap(victim, forged))

    assert err.code == "receipt_step_mismatch"
    assert str(err) == f"session 'sess-a': stage 2 (node {NODES[2]}) reports 2 steps, the coordinator sent 3"
    assert err.node == NODES[2]


def test_rejects_unequal_token_counts():
    job = make_job()
    victim = job.receipt("sess-b", 1)
    steps = stage_steps(job, "sess-b", 1)
    inflated = [(i, o, t * 10) for i, o, t in steps]
    forged = sign_stage(1, "sess-b", inflated)

    err = refused(job, StepMismatch, receipts=job.swap(victim, forged))

    assert "stage 1" in str(err) and "80 tokens" in str(err) and "8 tokens" in str(err)


def test_rejects_a_broken_link_between_stage_0_and_stage_1():
    job = make_job()
    victim = job.receipt("sess-a", 1)
    steps = stage_steps(job, "sess-a", 1)
    wrong_input = digest(b"something stage 0 never sent")
    steps[1] = (wrong_input, steps[1][1], steps[1][2])
    forged = sign_stage(1, "sess-a", steps)

    err = refused(job, BrokenLink, receipts=job.swap(victim, forged))

    assert err.code == "receipt_broken_link"
    sent = job.boundaries["sess-a"][1][1]
    assert str(err) == (
        f"session 'sess-a' step 1: stage 0 (node {NODES[0]}) output {sent.hex()[:16]} "
        f"!= stage 1 (node {NODES[1]}) input {wrong_input.hex()[:16]}: "
        f"node {NODES[1]} holds no signature of stage 0 over its input"
    )
    # Stage 1 claims an input stage 0 never signed: the lie is its own.
    assert err.node == NODES[1]


def test_a_broken_link_is_the_upstream_stages_lie_when_the_downstream_holds_its_signature():
    # Stage 0 forwarded (and signed) the true bytes, but its receipt claims it sent other ones.
    job = make_job()
    session = "sess-a"
    truth = stage_steps(job, session, 1)
    links = [sign_link(KEYS[0], JOB, session, step, inp) for step, (inp, _, _) in enumerate(truth)]
    honest_successor = sign_stage(1, session, truth, links=links)
    lying = stage_steps(job, session, 0)
    claimed = digest(b"a copy with one float changed")
    lying[1] = (lying[1][0], claimed, lying[1][2])
    liar = sign_stage(0, session, lying)
    receipts = job.swap(job.receipt(session, 0), liar)
    receipts = [honest_successor if r is job.receipt(session, 1) else r for r in receipts]

    err = refused(job, BrokenLink, receipts=receipts)

    assert err.node == NODES[0]
    assert str(err).endswith(f"node {NODES[0]} signed that it sent what stage 1 received")


def test_a_link_signed_by_another_key_is_no_evidence():
    # The successor shows a signature, but by a key other than its predecessor's: its claim is its own.
    job = make_job()
    session = "sess-b"
    steps = stage_steps(job, session, 2)
    forged_input = digest(b"bytes stage 1 never sent")
    steps[0] = (forged_input, steps[0][1], steps[0][2])
    links = [sign_link(FOREIGN, JOB, session, step, inp) for step, (inp, _, _) in enumerate(steps)]
    framer = sign_stage(2, session, steps, links=links)

    err = refused(job, BrokenLink, receipts=job.swap(job.receipt(session, 2), framer))

    assert err.node == NODES[2]


def test_rejects_a_first_input_differing_from_what_the_coordinator_sent():
    job = make_job()
    victim = job.receipt("sess-b", 0)
    steps = stage_steps(job, "sess-b", 0)
    steps[0] = (digest(b"a prompt the coordinator never sent"), steps[0][1], steps[0][2])
    forged = sign_stage(0, "sess-b", steps)

    err = refused(job, EndpointMismatch, receipts=job.swap(victim, forged))

    assert err.code == "receipt_endpoint_mismatch"
    assert str(err) == (
        f"session 'sess-b' step 0: stage 0 (node {NODES[0]}) input differs from what the coordinator sent"
    )


def test_rejects_a_last_output_differing_from_what_the_coordinator_received():
    job = make_job()
    victim = job.receipt("sess-a", 2)
    steps = stage_steps(job, "sess-a", 2)
    steps[2] = (steps[2][0], digest(b"an output nobody received"), steps[2][2])
    forged = sign_stage(2, "sess-a", steps)

    err = refused(job, EndpointMismatch, receipts=job.swap(victim, forged))

    assert str(err) == (
        f"session 'sess-a' step 2: stage 2 (node {NODES[2]}) output differs from what the coordinator received"
    )


def test_rejects_a_transcript_with_a_different_number_of_steps():
    job = make_job()
    short = replace(job.transcripts[1], sent=job.transcripts[1].sent[:1])

    err = refused(job, EndpointMismatch, transcripts=[job.transcripts[0], short])

    assert str(err) == "session 'sess-b': the coordinator sent 1 and received 2 steps, the stages report 2"


def test_rejects_a_missing_receipt():
    job = make_job()
    victim = job.receipt("sess-b", 1)

    err = refused(job, MissingReceipt, receipts=[r for r in job.receipts if r is not victim])

    assert err.code == "receipt_missing"
    assert str(err) == f"session 'sess-b': no receipt from stage 1 (node {NODES[1]}, layers [4, 9))"


def test_rejects_receipts_for_a_session_without_a_transcript():
    job = make_job()

    err = refused(job, MissingReceipt, transcripts=job.transcripts[:1])

    assert str(err) == (
        f"receipt of node {NODES[0]} is for session 'sess-b', which the coordinator has no transcript of"
    )


def test_rejects_a_duplicate_receipt():
    job = make_job()
    copy = job.receipt("sess-a", 0)

    err = refused(job, DuplicateReceipt, receipts=[*job.receipts, copy])

    assert err.code == "receipt_duplicate"
    assert str(err) == f"session 'sess-a': node {NODES[0]} sent two receipts"


def test_rejects_a_duplicate_transcript():
    job = make_job()

    err = refused(job, DuplicateReceipt, transcripts=[*job.transcripts, job.transcripts[0]])

    assert str(err) == f"job {JOB!r} lists a session twice in its transcripts"


def test_rejects_a_tampered_hash_list_with_the_signature_reused():
    job = make_job()
    victim = job.receipt("sess-a", 1)
    hashes = list(victim.hashes)
    hashes[0] = (hashes[0][0], digest(b"other output"))
    forged = replace(victim, hashes=tuple(hashes))

    err = refused(job, BadSignature, receipts=job.swap(victim, forged))

    assert err.code == "receipt_bad_signature"


def test_rejects_a_signed_chain_head_that_does_not_match_the_hash_list():
    job = make_job()
    victim = job.receipt("sess-a", 1)
    unsigned = replace(victim, chain_head=digest(b"not the chain"))
    forged = replace(unsigned, signature=KEYS[1].sign(SIGNING_CONTEXT + unsigned.body_bytes()).signature)

    err = refused(job, BadSignature, receipts=job.swap(victim, forged))

    assert err.code == "receipt_bad_chain"
    assert str(err) == f"receipt of node {NODES[1]} for session 'sess-a': chain head does not match its hash list"


def test_rejects_a_receipt_for_another_job():
    job = make_job()
    victim = job.receipt("sess-a", 0)
    forged = sign_stage(0, "sess-a", stage_steps(job, "sess-a", 0), job="job-other")

    err = refused(job, ForeignSigner, receipts=job.swap(victim, forged))

    assert str(err) == f"receipt of node {NODES[0]} for session 'sess-a' is for job 'job-other', not {JOB!r}"


def test_rejects_a_receipt_for_another_model():
    job = make_job()
    victim = job.receipt("sess-a", 0)
    forged = sign_stage(0, "sess-a", stage_steps(job, "sess-a", 0), model="other-model")

    err = refused(job, ForeignSigner, receipts=job.swap(victim, forged))

    assert str(err) == f"receipt of node {NODES[0]} for session 'sess-a' is for model 'other-model', not {MODEL!r}"


def test_rejects_a_receipt_whose_steps_disagree_with_its_hash_list():
    job = make_job()
    victim = job.receipt("sess-a", 0)

    err = refused(job, MalformedReceipt, receipts=job.swap(victim, replace(victim, steps=4)))

    assert err.code == "receipt_malformed"
    assert str(err) == "receipt claims 4 steps but lists 3 hash pairs"


def test_rejects_a_receipt_that_is_not_a_receipt():
    job = make_job()

    err = refused(job, MalformedReceipt, receipts=[*job.receipts, job.receipts[0].to_dict()])

    assert str(err) == "expected a Receipt, got dict"


def test_rejects_a_directly_built_receipt_with_wrong_field_types():
    job = make_job()
    victim = job.receipt("sess-b", 2)
    forged = replace(victim, node_key=bytes(KEYS[2].verify_key).hex())

    err = refused(job, MalformedReceipt, receipts=job.swap(victim, forged))

    assert str(err) == "receipt node_key must be 32 bytes"


def test_rejects_a_receipt_with_a_count_too_large_to_encode():
    job = make_job()
    victim = job.receipt("sess-b", 2)

    err = refused(job, BadSignature, receipts=job.swap(victim, replace(victim, tokens=2**70)))

    assert err.code == "receipt_bad_signature"


# --- failing closed on empty input --------------------------------------------------------------


def test_rejects_no_receipts():
    err = refused(make_job(), MissingReceipt, receipts=[])

    assert str(err) == f"session 'sess-a': no receipt from stage 0 (node {NODES[0]}, layers [0, 4))"


def test_rejects_no_transcripts():
    err = refused(make_job(), MissingReceipt, transcripts=[])

    assert str(err) == f"job {JOB!r} has no session transcripts: nothing to verify"


def test_rejects_no_assignments():
    err = refused(make_job(), SpanGap, assignments=[])

    assert str(err) == "no stage assignments: layers [0, 12) are not covered"


def test_rejects_everything_empty():
    with pytest.raises(ReceiptError):
        verify_job(job=JOB, model=MODEL, n_layers=N_LAYERS, assignments=[], receipts=[], transcripts=[])


@pytest.mark.parametrize("n_layers", [0, -1, True, 12.0])
def test_rejects_a_bad_layer_count(n_layers):
    err = refused(make_job(), ReceiptError, n_layers=n_layers)

    assert err.code == "receipt_invalid"


def test_rejects_a_node_assigned_two_spans():
    job = make_job()
    twice = [*job.assignments[:2], replace(job.assignments[2], node=NODES[1])]

    err = refused(job, ReceiptError, assignments=twice)

    assert err.code == "receipt_invalid"


# --- the receipt itself -------------------------------------------------------------------------


def test_builder_chains_incrementally_and_counts_steps_and_tokens():
    key = KEYS[0]
    builder = new_builder()
    pairs = [(digest(b"in%d" % i), digest(b"out%d" % i)) for i in range(3)]
    for (h_in, h_out), tokens in zip(pairs, [4, 1, 1], strict=True):
        builder.add_step(h_in, h_out, tokens)

    receipt = builder.sign(key)

    head = hashlib.sha256(CHAIN_SEED + JOB.encode() + b"\0" + b"s").digest()
    for h_in, h_out in pairs:
        head = hashlib.sha256(head + h_in + h_out).digest()
    assert (builder.steps, builder.tokens) == (3, 6)
    assert (receipt.steps, receipt.tokens) == (3, 6)
    assert receipt.hashes == tuple(pairs)
    assert receipt.chain_head == head
    receipt.verify_signature()


def test_builder_with_no_steps_signs_the_chain_seed():
    key = KEYS[0]
    builder = new_builder()

    receipt = builder.sign(key)

    assert receipt.chain_head == hashlib.sha256(CHAIN_SEED + JOB.encode() + b"\0s").digest()
    assert (receipt.steps, receipt.tokens, receipt.hashes) == (0, 0, ())


def test_builder_refuses_to_sign_with_a_key_other_than_the_nodes():
    builder = new_builder()

    with pytest.raises(ForeignSigner):
        builder.sign(FOREIGN)


@pytest.mark.parametrize(
    "args",
    [
        (b"short", bytes(32), 1),
        (bytes(32), bytes(33), 1),
        (bytes(32), bytes(32), -1),
        (bytes(32), bytes(32), True),
    ],
    ids=["short-input", "long-output", "negative-tokens", "bool-tokens"],
)
def test_builder_rejects_malformed_steps(args):
    builder = new_builder()

    with pytest.raises(MalformedReceipt):
        builder.add_step(*args)

    assert (builder.steps, builder.tokens) == (0, 0)


@pytest.mark.parametrize(
    "overrides",
    [{"layer_start": 4, "layer_end": 4}, {"layer_start": -1}, {"node_key": b"short"}, {"job": None}],
    ids=repr,
)
def test_builder_rejects_a_malformed_identity(overrides):
    args = {
        "job": JOB,
        "session": "s",
        "node": NODES[0],
        "node_key": bytes(KEYS[0].verify_key),
        "model": MODEL,
        "layer_start": 0,
        "layer_end": 4,
        **overrides,
    }

    with pytest.raises(MalformedReceipt):
        ReceiptBuilder(**args)


def test_receipt_round_trips_through_to_dict_and_msgpack():
    receipt = make_job().receipt("sess-a", 1)

    wire = msgpack.packb(receipt.to_dict())
    back = Receipt.from_dict(msgpack.unpackb(wire))

    assert back == receipt
    back.verify_signature()


def test_to_dict_holds_the_body_and_the_signature():
    receipt = make_job().receipt("sess-b", 2)

    d = receipt.to_dict()

    assert sorted(d) == [
        "chain_head",
        "hashes",
        "job",
        "layer_end",
        "layer_start",
        "links",
        "model",
        "node",
        "node_key",
        "session",
        "sig",
        "steps",
        "tokens",
        "v",
    ]
    assert d["v"] == 2
    assert d["links"] == [b""] * receipt.steps
    assert d["sig"] == receipt.signature
    assert d["hashes"] == [list(pair) for pair in receipt.hashes]
    assert msgpack.unpackb(receipt.body_bytes()) == {k: v for k, v in d.items() if k != "sig"}
    assert list(msgpack.unpackb(receipt.body_bytes())) == sorted(k for k in d if k != "sig")


def test_to_json_is_json_with_hex_bytes():
    receipt = make_job().receipt("sess-b", 0)

    d = json.loads(json.dumps(receipt.to_json()))

    assert d["node_key"] == bytes(KEYS[0].verify_key).hex()
    assert d["sig"] == receipt.signature.hex()
    assert d["chain_head"] == receipt.chain_head.hex()
    assert d["hashes"] == [[h_in.hex(), h_out.hex()] for h_in, h_out in receipt.hashes]
    assert (d["steps"], d["tokens"], d["layer_start"], d["layer_end"]) == (2, 8, 0, 4)


def _valid_dict() -> dict:
    return make_job().receipt("sess-a", 0).to_dict()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("sig"),
        lambda d: d.update(extra=1),
        lambda d: d.update(v=1),
        lambda d: d.update(v=True),
        lambda d: d.update(job=b"job-42"),
        lambda d: d.update(session=None),
        lambda d: d.update(layer_start="0"),
        lambda d: d.update(layer_start=True),
        lambda d: d.update(steps=-1),
        lambda d: d.update(tokens=1.0),
        lambda d: d.update(layer_start=4, layer_end=4),
        lambda d: d.update(node_key=bytes(31)),
        lambda d: d.update(chain_head="00" * 32),
        lambda d: d.update(sig=bytes(65)),
        lambda d: d.update(hashes=b"not a list"),
        lambda d: d.update(hashes=[[bytes(32)]] * 3),
        lambda d: d.update(hashes=[[bytes(32), bytes(31)]] * 3),
        lambda d: d.update(hashes=[bytes(64)] * 3),
        lambda d: d.update(steps=2),
    ],
    ids=[
        "missing-sig",
        "extra-key",
        "version-1",
        "version-bool",
        "job-bytes",
        "session-none",
        "start-str",
        "start-bool",
        "steps-negative",
        "tokens-float",
        "empty-span",
        "short-key",
        "hex-head",
        "long-sig",
        "hashes-bytes",
        "hash-single",
        "hash-short",
        "hash-unpaired",
        "steps-mismatch",
    ],
)
def test_from_dict_rejects_a_malformed_dict(mutate):
    d = _valid_dict()
    mutate(d)

    with pytest.raises(MalformedReceipt) as err:
        Receipt.from_dict(d)

    assert err.value.code == "receipt_malformed"


@pytest.mark.parametrize("value", [None, [], "receipt", b"\x80"], ids=repr)
def test_from_dict_rejects_a_non_dict(value):
    with pytest.raises(MalformedReceipt):
        Receipt.from_dict(value)


def test_verify_signature_accepts_each_receipt_of_a_valid_job():
    for receipt in make_job().receipts:
        receipt.verify_signature()
