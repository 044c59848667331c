"""Reading a job's stored route and receipts: the route becomes assignments through one function,
and an audit finds its stage's receipt by position (receipts are stored session after session, in
route order), decoding that receipt alone."""

from types import SimpleNamespace

import pytest
from nacl.signing import SigningKey

from marketplace.flows.settlement import reverify
from marketplace.jobs.route import route_assignments
from marketplace.verification.receipts import session_receipt
from worker_agent.errors import ReceiptError
from worker_agent.protocol.keys import node_id
from worker_agent.protocol.receipts import MalformedReceipt, MissingReceipt, ReceiptBuilder, StageAssignment, digest

pytestmark = pytest.mark.trust

KEYS = [SigningKey(bytes([i + 1]) * 32) for i in range(3)]
NODES = [node_id(bytes(key.verify_key)) for key in KEYS]
SPANS = [(0, 2), (2, 4), (4, 6)]
SESSIONS = ["s1", "s2"]


def route() -> list[dict]:
    return [
        {
            "node": node,
            "node_key": bytes(key.verify_key).hex(),
            "url": f"ws://stage{k}",
            "layer_start": s,
            "layer_end": e,
        }
        for k, (node, key, (s, e)) in enumerate(zip(NODES, KEYS, SPANS, strict=True))
    ]


def stored_receipt(session: str, stage: int) -> dict:
    builder = ReceiptBuilder(
        job="job-1",
        session=session,
        node=NODES[stage],
        node_key=bytes(KEYS[stage].verify_key),
        model="tiny-llama",
        layer_start=SPANS[stage][0],
        layer_end=SPANS[stage][1],
    )
    builder.add_step(digest(b"in"), digest(b"out"), 4)
    return builder.sign(KEYS[stage]).to_json()


def stored_job(receipts: list | None = None) -> SimpleNamespace:
    """A job record as the runner leaves it: two sessions, each's receipts in route order."""
    if receipts is None:
        receipts = [stored_receipt(session, stage) for session in SESSIONS for stage in range(3)]
    transcripts = [{"session": session, "sent": [], "received": []} for session in SESSIONS]
    return SimpleNamespace(public_id="job-1", route=route(), transcripts=transcripts, receipts=receipts)


def test_route_assignments_follow_the_route_in_order():
    assert route_assignments(route()) == [
        StageAssignment(node, bytes(key.verify_key), s, e) for node, key, (s, e) in zip(NODES, KEYS, SPANS, strict=True)
    ]


def test_a_malformed_route_stage_is_named_by_its_index():
    stages = route()
    stages[1]["node_key"] = "not hex"

    with pytest.raises(ReceiptError) as refused:
        route_assignments(stages)

    assert (refused.value.code, str(refused.value)) == (
        "receipt_invalid",
        f"route stage 1: stage {NODES[1]}'s node_key must be 64 hex digits (32 bytes)",
    )


@pytest.mark.parametrize("stored", [None, {}, "[]"], ids=repr)
def test_a_route_that_is_not_a_list_is_refused(stored):
    with pytest.raises(ReceiptError) as refused:
        route_assignments(stored)

    assert str(refused.value) == f"a job's route must be a list of stages, got {type(stored).__name__}"


@pytest.mark.parametrize(("session", "stage"), [("s1", 0), ("s1", 2), ("s2", 0), ("s2", 1)])
def test_an_audit_finds_its_receipt_by_session_and_stage(session, stage):
    receipt = session_receipt(stored_job(), session, stage, NODES[stage])

    assert (receipt.session, receipt.node, receipt.layer_start) == (session, NODES[stage], SPANS[stage][0])
    receipt.verify_signature()


def test_only_the_audited_stages_receipt_is_decoded():
    job = stored_job()
    wanted = 3 + 1  # session s2, stage 1
    job.receipts = [r if i == wanted else "not a receipt" for i, r in enumerate(job.receipts)]

    receipt = session_receipt(job, "s2", 1, NODES[1])

    assert (receipt.session, receipt.node) == ("s2", NODES[1])


def test_a_job_without_the_stages_receipt_holds_none_to_audit():
    with pytest.raises(MissingReceipt) as refused:
        session_receipt(stored_job(receipts=[]), "s1", 1, NODES[1])

    assert str(refused.value) == f"job 'job-1': node {NODES[1]}'s receipt for stage 1 of session 's1' is not stored"


def test_an_unverified_job_missing_one_stages_receipt_still_finds_the_others():
    # A stage that sent no receipt leaves a gap: the others' receipts are found where they are.
    job = stored_job()
    job.receipts = [r for r in job.receipts if not (r["session"] == "s1" and r["node"] == NODES[0])]

    receipt = session_receipt(job, "s1", 2, NODES[2])

    assert (receipt.session, receipt.node) == ("s1", NODES[2])


@pytest.mark.parametrize(("session", "stage"), [("s3", 0), ("s1", 3), ("s1", -1)])
def test_a_session_or_stage_the_job_does_not_have_holds_no_receipt(session, stage):
    with pytest.raises(MissingReceipt) as refused:
        session_receipt(stored_job(), session, stage, NODES[0])

    assert str(refused.value) == f"job 'job-1' has no stage {stage} in session {session!r}"


def test_a_receipt_of_another_node_at_the_stages_place_is_not_taken():
    # Node 2 did sign a receipt for session s1, but for its own span, not stage 1's.
    job = stored_job()

    with pytest.raises(MissingReceipt) as refused:
        session_receipt(job, "s1", 1, NODES[2])

    assert str(refused.value) == (
        f"job 'job-1': node {NODES[2]}'s receipt for stage 1 of session 's1' is for layers "
        f"[{SPANS[2][0]}, {SPANS[2][1]}), not ({SPANS[1][0]}, {SPANS[1][1]})"
    )


def test_an_unreadable_stored_receipt_is_refused_as_malformed():
    job = stored_job()
    job.receipts[1] = {**job.receipts[1], "sig": "00"}

    with pytest.raises(MalformedReceipt) as refused:
        session_receipt(job, "s1", 1, NODES[1])

    assert str(refused.value) == "receipt sig must be 128 hex digits (64 bytes)"


def verifiable_job() -> SimpleNamespace:
    """One session through the three stages whose receipts link up with the transcript."""
    boundaries = [digest(b"boundary %d" % k) for k in range(4)]  # coordinator -> s0 -> s1 -> s2 -> coordinator
    receipts = []
    for stage in range(3):
        builder = ReceiptBuilder(
            job="job-1",
            session="s1",
            node=NODES[stage],
            node_key=bytes(KEYS[stage].verify_key),
            model="tiny-llama",
            layer_start=SPANS[stage][0],
            layer_end=SPANS[stage][1],
        )
        builder.add_step(boundaries[stage], boundaries[stage + 1], 4)
        receipts.append(builder.sign(KEYS[stage]).to_json())
    transcripts = [{"session": "s1", "sent": [boundaries[0].hex()], "received": [boundaries[3].hex()]}]
    return SimpleNamespace(
        public_id="job-1", model="tiny-llama", route=route(), transcripts=transcripts, receipts=receipts
    )


def test_settlement_reverifies_a_stored_record_against_its_route():
    verification = reverify(verifiable_job())

    assert (verification.sessions, verification.steps) == (1, 1)
    assert verification.layer_tokens_by_node == dict.fromkeys(NODES, 8)


def test_settlement_refuses_a_record_whose_route_names_another_key():
    job = verifiable_job()
    job.route[2]["node_key"] = bytes(SigningKey(b"\x55" * 32).verify_key).hex()

    with pytest.raises(ReceiptError) as refused:
        reverify(job)

    assert refused.value.code == "receipt_foreign_signer"


@pytest.mark.parametrize("field", ["receipts", "transcripts"])
def test_settlement_refuses_stored_lists_that_are_not_lists(field):
    job = verifiable_job()
    setattr(job, field, {"0": "x"})

    with pytest.raises(MalformedReceipt) as refused:
        reverify(job)

    assert str(refused.value) == f"the job's stored {field} must be a list"
