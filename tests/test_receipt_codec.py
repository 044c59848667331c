"""The stored (JSON) form of receipts, transcripts and stage assignments: one codec each, in
``worker_agent/protocol/receipts.py``. A round trip gives back the signed receipt; every malformed field is
refused with its code and a message naming it; oversized input is refused before it is decoded."""

import json

import pytest
from nacl.signing import SigningKey

from worker_agent.errors import ReceiptError
from worker_agent.protocol.keys import node_id
from worker_agent.protocol.receipts import (
    MAX_ID_CHARS,
    MAX_JSON_CHARS,
    MAX_STEPS,
    MalformedReceipt,
    Receipt,
    ReceiptBuilder,
    ReceiptTooLarge,
    SessionTranscript,
    StageAssignment,
    digest,
)

pytestmark = pytest.mark.dataplane

KEY = SigningKey(b"\x07" * 32)
NODE = node_id(bytes(KEY.verify_key))


def signed_receipt(steps: int = 3) -> Receipt:
    builder = ReceiptBuilder(
        job="job-7",
        session="s1",
        node=NODE,
        node_key=bytes(KEY.verify_key),
        model="tiny-llama",
        layer_start=2,
        layer_end=4,
    )
    for i in range(steps):
        builder.add_step(digest(b"in%d" % i), digest(b"out%d" % i), 5 if i == 0 else 1)
    return builder.sign(KEY)


def test_a_receipt_round_trips_through_its_json_text():
    receipt = signed_receipt()

    back = Receipt.from_json(json.dumps(receipt.to_json()))

    assert back == receipt
    back.verify_signature()


def test_a_receipt_round_trips_through_its_json_object_and_bytes():
    receipt = signed_receipt()

    assert Receipt.from_json(receipt.to_json()) == receipt
    assert Receipt.from_json(json.dumps(receipt.to_json()).encode()) == receipt


def test_the_json_form_is_the_wire_form_with_hex_bytes():
    receipt = signed_receipt(steps=1)

    stored = receipt.to_json()

    assert stored == {
        **receipt.to_dict(),
        "node_key": bytes(KEY.verify_key).hex(),
        "hashes": [[digest(b"in0").hex(), digest(b"out0").hex()]],
        "links": [""],
        "chain_head": receipt.chain_head.hex(),
        "sig": receipt.signature.hex(),
    }


HEX32 = "ab" * 32


@pytest.mark.parametrize(
    ("mutate", "code", "message"),
    [
        (lambda d: d.pop("sig"), "receipt_malformed", "a receipt must be a map with exactly the keys"),
        (lambda d: d.update(extra=1), "receipt_malformed", "a receipt must be a map with exactly the keys"),
        (lambda d: d.update(v=1), "receipt_malformed", "receipt version 1 is not supported (expected 2)"),
        (lambda d: d.update(job=7), "receipt_malformed", "receipt job must be a string"),
        (lambda d: d.update(session=None), "receipt_malformed", "receipt session must be a string"),
        (lambda d: d.update(node=["n"]), "receipt_malformed", "receipt node must be a string"),
        (lambda d: d.update(model=b"m".hex().encode()), "receipt_malformed", "receipt model must be a string"),
        (
            lambda d: d.update(layer_start="2"),
            "receipt_malformed",
            "receipt layer_start must be a non-negative integer, got '2'",
        ),
        (
            lambda d: d.update(layer_end=True),
            "receipt_malformed",
            "receipt layer_end must be a non-negative integer, got True",
        ),
        (lambda d: d.update(steps=-1), "receipt_malformed", "receipt steps must be a non-negative integer, got -1"),
        (lambda d: d.update(tokens=7.0), "receipt_malformed", "receipt tokens must be a non-negative integer, got 7.0"),
        (lambda d: d.update(layer_end=2), "receipt_malformed", "receipt span [2, 2) is empty"),
        (
            lambda d: d.update(node_key="00" * 31),
            "receipt_malformed",
            "receipt node_key must be 64 hex digits (32 bytes)",
        ),
        (
            lambda d: d.update(node_key="zz" * 32),
            "receipt_malformed",
            "receipt node_key must be 64 hex digits (32 bytes)",
        ),
        (
            lambda d: d.update(chain_head=bytes(32)),
            "receipt_malformed",
            "receipt chain_head must be 64 hex digits (32 bytes)",
        ),
        (
            lambda d: d.update(sig="00 " * 42 + "00"),
            "receipt_malformed",
            "receipt sig must be 128 hex digits (64 bytes)",
        ),
        (
            lambda d: d.update(hashes="ab" * 64),
            "receipt_malformed",
            "receipt hashes must be a list of (input hash, output hash) pairs",
        ),
        (
            lambda d: d["hashes"].__setitem__(1, [HEX32]),
            "receipt_malformed",
            "receipt hashes[1] must be an (input hash, output hash) pair",
        ),
        (
            lambda d: d["hashes"].__setitem__(2, [HEX32, "ab" * 31]),
            "receipt_malformed",
            "receipt hashes[2][1] must be 64 hex digits (32 bytes)",
        ),
        (lambda d: d.update(steps=2), "receipt_malformed", "receipt claims 2 steps but lists 3 hash pairs"),
        (lambda d: d.update(links="ab"), "receipt_malformed", "receipt links must be a list of signatures"),
        (lambda d: d["links"].__setitem__(0, 7), "receipt_malformed", "receipt links[0] must be hex digits"),
        (
            lambda d: d["links"].__setitem__(1, "ab" * 63),
            "receipt_malformed",
            "receipt links[1] must be 128 hex digits (64 bytes)",
        ),
        (lambda d: d["links"].pop(), "receipt_malformed", "receipt links must list one entry per step"),
        (
            lambda d: d.update(node="n" * (MAX_ID_CHARS + 1)),
            "receipt_too_large",
            f"receipt node of {MAX_ID_CHARS + 1} characters exceeds {MAX_ID_CHARS}",
        ),
    ],
    ids=[
        "missing-sig",
        "extra-key",
        "version-1",
        "job-int",
        "session-none",
        "node-list",
        "model-bytes",
        "start-str",
        "end-bool",
        "steps-negative",
        "tokens-float",
        "empty-span",
        "short-key",
        "key-not-hex",
        "head-bytes",
        "sig-with-spaces",
        "hashes-str",
        "hash-unpaired",
        "hash-short",
        "steps-mismatch",
        "links-str",
        "link-int",
        "link-short",
        "links-one-short",
        "node-too-long",
    ],
)
def test_from_json_refuses_each_malformed_field_with_its_code(mutate, code, message):
    stored = signed_receipt().to_json()
    mutate(stored)

    with pytest.raises(MalformedReceipt) as refused:
        Receipt.from_json(stored)

    assert refused.value.code == code
    assert str(refused.value).startswith(message), str(refused.value)


@pytest.mark.parametrize("data", [None, [], 42, "[1, 2]", "not json", b"\xff"], ids=repr)
def test_from_json_refuses_what_is_not_a_receipt_object(data):
    with pytest.raises(MalformedReceipt) as refused:
        Receipt.from_json(data)

    assert refused.value.code == "receipt_malformed"


def test_from_json_refuses_oversized_text_before_parsing_it(monkeypatch):
    def parse(_):
        raise AssertionError("oversized text was parsed")

    monkeypatch.setattr(json, "loads", parse)
    text = " " * (MAX_JSON_CHARS + 1)

    with pytest.raises(ReceiptTooLarge) as refused:
        Receipt.from_json(text)

    assert refused.value.code == "receipt_too_large"
    assert str(refused.value) == f"a receipt's JSON of {MAX_JSON_CHARS + 1} characters exceeds {MAX_JSON_CHARS}"


def test_from_json_refuses_too_many_hash_pairs_before_decoding_any():
    stored = signed_receipt().to_json()
    # Not even pairs: decoding any of them would fail with another message.
    stored["hashes"] = [None] * (MAX_STEPS + 1)

    with pytest.raises(ReceiptTooLarge) as refused:
        Receipt.from_json(stored)

    assert refused.value.code == "receipt_too_large"
    assert str(refused.value) == f"receipt hashes lists {MAX_STEPS + 1} entries, more than {MAX_STEPS}"


def test_the_wire_form_is_bounded_by_the_same_checks():
    wire = signed_receipt().to_dict()
    wire["hashes"] = [None] * (MAX_STEPS + 1)

    with pytest.raises(ReceiptTooLarge):
        Receipt.from_dict(wire)


def test_a_json_text_at_the_bound_is_parsed():
    text = json.dumps(signed_receipt().to_json())
    padded = text + " " * (MAX_JSON_CHARS - len(text))

    assert Receipt.from_json(padded) == signed_receipt()


def test_a_transcript_round_trips_through_json():
    transcript = SessionTranscript("s1", (digest(b"a"), digest(b"b")), (digest(b"c"), digest(b"d")))

    assert SessionTranscript.from_json(json.dumps(transcript.to_json())) == transcript
    assert transcript.to_json() == {
        "session": "s1",
        "sent": [digest(b"a").hex(), digest(b"b").hex()],
        "received": [digest(b"c").hex(), digest(b"d").hex()],
    }


@pytest.mark.parametrize(
    ("stored", "code", "message"),
    [
        ({"session": "s1", "sent": []}, "receipt_malformed", "a transcript must be a map with exactly the keys"),
        ({"session": 1, "sent": [], "received": []}, "receipt_malformed", "transcript session must be a string"),
        ({"session": "s1", "sent": "", "received": []}, "receipt_malformed", "transcript sent must be a list"),
        (
            {"session": "s1", "sent": [], "received": [HEX32, "ab"]},
            "receipt_malformed",
            "transcript received[1] must be 64 hex digits (32 bytes)",
        ),
        (
            {"session": "s1", "sent": [None] * (MAX_STEPS + 1), "received": []},
            "receipt_too_large",
            f"transcript sent lists {MAX_STEPS + 1} entries, more than {MAX_STEPS}",
        ),
    ],
    ids=["missing-received", "session-int", "sent-str", "hash-short", "too-many"],
)
def test_a_malformed_transcript_is_refused_with_its_code(stored, code, message):
    with pytest.raises(MalformedReceipt) as refused:
        SessionTranscript.from_json(stored)

    assert refused.value.code == code
    assert str(refused.value).startswith(message), str(refused.value)


def test_a_stage_assignment_reads_its_four_fields_and_ignores_the_rest():
    stage = {"node": NODE, "node_key": bytes(KEY.verify_key).hex(), "url": "ws://x", "layer_start": 2, "layer_end": 4}

    assert StageAssignment.from_json(stage) == StageAssignment(NODE, bytes(KEY.verify_key), 2, 4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"node": ""}, "a stage assignment's node must be 1-1024 characters, got ''"),
        ({"node_key": "00"}, f"stage {NODE}'s node_key must be 64 hex digits (32 bytes)"),
        ({"layer_start": -1}, f"stage {NODE}'s layer_start must be a non-negative integer, got -1"),
        ({"layer_end": "4"}, f"stage {NODE}'s layer_end must be a non-negative integer, got '4'"),
    ],
    ids=["empty-node", "short-key", "negative-start", "str-end"],
)
def test_a_malformed_stage_assignment_is_the_planners_fault(overrides, message):
    stage = {"node": NODE, "node_key": HEX32, "layer_start": 2, "layer_end": 4, **overrides}

    with pytest.raises(ReceiptError) as refused:
        StageAssignment.from_json(stage)

    assert type(refused.value) is ReceiptError
    assert (refused.value.code, str(refused.value)) == ("receipt_invalid", message)
