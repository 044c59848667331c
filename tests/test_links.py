"""Sender-signed links: a stage signs every item it puts out, and a ring successor takes an item
only with its predecessor's signature over exactly those bytes, keeping it in its receipt."""

from __future__ import annotations

import pytest
import torch

from worker_agent import model as models
from worker_agent.block import Block
from worker_agent.errors import WireError
from worker_agent.protocol import wire
from worker_agent.protocol.keys import generate_signing_key, public_key_bytes
from worker_agent.protocol.links import BadLink, sign_link, signed_by, verify_link
from worker_agent.protocol.receipts import digest
from worker_agent.stage import Stage

pytestmark = pytest.mark.dataplane

MODEL = "tiny-llama"
JOB = "job-links"
SENDER = generate_signing_key()
SENDER_KEY = public_key_bytes(SENDER)


def test_a_signature_verifies_only_for_its_key_job_session_step_and_bytes():
    item_hash = digest(b"hidden states")
    sig = sign_link(SENDER, JOB, "s0", 3, item_hash)

    verify_link(SENDER_KEY, sig, JOB, "s0", 3, item_hash)
    other = public_key_bytes(generate_signing_key())
    assert [
        signed_by(other, sig, JOB, "s0", 3, item_hash),
        signed_by(SENDER_KEY, sig, "job-other", "s0", 3, item_hash),
        signed_by(SENDER_KEY, sig, JOB, "s1", 3, item_hash),
        signed_by(SENDER_KEY, sig, JOB, "s0", 4, item_hash),
        signed_by(SENDER_KEY, sig, JOB, "s0", 3, digest(b"hidden stateS")),
    ] == [False] * 5


@pytest.mark.parametrize(
    ("sig", "key", "code", "message"),
    [
        (b"", SENDER_KEY, "link_bad_signature", "session 's0' step 0: the item carries no sender signature"),
        (bytes(63), SENDER_KEY, "link_bad_signature", "session 's0' step 0: the item carries no sender signature"),
        (
            bytes(64),
            b"",
            "link_malformed",
            "session 's0' step 0: no sender key to check the item's signature against",
        ),
        (
            bytes(64),
            SENDER_KEY,
            "link_bad_signature",
            f"session 's0' step 0: the item's signature is not its sender's (key {SENDER_KEY.hex()[:16]}) "
            "over these bytes",
        ),
    ],
    ids=["missing", "short", "no-key", "forged"],
)
def test_a_missing_or_forged_signature_is_refused_with_its_reason(sig, key, code, message):
    with pytest.raises(BadLink) as refused:
        verify_link(key, sig, JOB, "s0", 0, digest(b"x"))

    assert (refused.value.code, str(refused.value)) == (code, message)


@pytest.fixture(scope="module")
def stage() -> Stage:
    return Stage(Block(models.load_block(MODEL, 2, 4)), model=MODEL, signing_key=generate_signing_key())


def _forward(session: str, step: int, start: int, rows: torch.Tensor, *, sig: bytes = b"") -> wire.Forward:
    payload = wire.tensor_payload(rows, "f32")
    item = wire.Item(session, step, start, rows.shape[0], sig)
    return wire.Forward(JOB, (item,), "f32", tuple(rows.shape), payload)


def _signed(session: str, step: int, start: int, rows: torch.Tensor) -> wire.Forward:
    payload = wire.tensor_payload(rows, "f32")
    return _forward(session, step, start, rows, sig=sign_link(SENDER, JOB, session, step, digest(payload)))


def test_a_peer_item_signed_by_its_sender_is_computed_signed_onward_and_kept_in_the_receipt(stage):
    stage.open(JOB, ("kept",))
    rows = torch.randn(3, stage.block.hidden_size, generator=torch.Generator().manual_seed(7))
    forward = _signed("kept", 0, 0, rows)

    prepared = stage.prepare(forward, sender_key=SENDER_KEY)
    output = stage.finish(prepared, stage.compute([prepared])[0])
    (receipt,) = stage.close(JOB, ("kept",))

    (out_item,) = output.items
    assert signed_by(stage.node_key, out_item.sig, JOB, "kept", 0, digest(output.payload))
    assert receipt["links"] == [forward.items[0].sig]
    assert receipt["hashes"] == [[digest(forward.payload), digest(output.payload)]]


@pytest.mark.parametrize("tamper", ["unsigned", "other-bytes", "other-sender"])
def test_a_peer_item_without_its_senders_signature_is_refused_and_changes_nothing(stage, tamper):
    session = f"refused-{tamper}"
    stage.open(JOB, (session,))
    rows = torch.randn(2, stage.block.hidden_size, generator=torch.Generator().manual_seed(11))
    forward = {
        "unsigned": _forward(session, 0, 0, rows),
        "other-bytes": _forward(session, 0, 0, rows + 1, sig=_signed(session, 0, 0, rows).items[0].sig),
        "other-sender": _forward(
            session,
            0,
            0,
            rows,
            sig=sign_link(generate_signing_key(), JOB, session, 0, digest(_forward(session, 0, 0, rows).payload)),
        ),
    }[tamper]

    with pytest.raises(WireError) as refused:
        stage.prepare(forward, sender_key=SENDER_KEY)

    assert refused.value.code == "link_bad_signature"
    # Nothing moved: the same step, properly signed, is taken next.
    stage.prepare(_signed(session, 0, 0, rows), sender_key=SENDER_KEY)


def test_the_coordinators_items_need_no_signature_and_leave_the_link_empty(stage):
    stage.open(JOB, ("direct",))
    rows = torch.randn(1, stage.block.hidden_size, generator=torch.Generator().manual_seed(3))

    prepared = stage.prepare(_forward("direct", 0, 0, rows))
    stage.finish(prepared, stage.compute([prepared])[0])
    (receipt,) = stage.close(JOB, ("direct",))

    assert receipt["links"] == [b""]


def test_a_predecessors_signed_output_relayed_by_the_coordinator_keeps_its_signature_as_evidence(stage):
    # The coordinator hands a stage its predecessor's tapped output when the predecessor withheld it.
    stage.open(JOB, ("relayed",))
    rows = torch.randn(2, stage.block.hidden_size, generator=torch.Generator().manual_seed(5))
    relayed = _signed("relayed", 0, 0, rows)

    prepared = stage.prepare(relayed)
    stage.finish(prepared, stage.compute([prepared])[0])
    (receipt,) = stage.close(JOB, ("relayed",))

    assert receipt["links"] == [relayed.items[0].sig]
    assert signed_by(SENDER_KEY, receipt["links"][0], JOB, "relayed", 0, receipt["hashes"][0][0])
