"""An assignment of a catalog model on the control channel: its ref, content hash and manifest URL
travel together, checked on both sides; a registry model's assignment is as it always was."""

from __future__ import annotations

import json

import pytest

from worker_agent import checkpoints
from worker_agent.protocol import control_protocol as protocol
from worker_agent.protocol.control_protocol import ProtocolError

pytestmark = pytest.mark.dataplane

DIGEST = "3f" * 32
REF = f"llama-untied@{DIGEST[:16]}"
SOURCE = f"install/models/{REF}/manifest.json"


def test_a_catalog_assignment_carries_its_content_hash_and_manifest_both_ways():
    message = protocol.Assign(assignment=4, model=REF, layer_start=0, layer_end=2, content_hash=DIGEST, source=SOURCE)

    text = protocol.encode(message)

    assert json.loads(text) == {
        "type": "assign",
        "assignment": 4,
        "model": REF,
        "layer_start": 0,
        "layer_end": 2,
        "content_hash": DIGEST,
        "source": SOURCE,
    }
    assert protocol.decode(text) == message


def test_a_registry_assignment_has_neither_field_on_the_wire():
    text = protocol.encode(protocol.Assign(assignment=4, model="tiny-llama", layer_start=0, layer_end=6))

    assert json.loads(text) == {
        "type": "assign",
        "assignment": 4,
        "model": "tiny-llama",
        "layer_start": 0,
        "layer_end": 6,
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"content_hash": DIGEST}, "content_hash and source come together, or not at all"),
        ({"source": SOURCE}, "content_hash and source come together, or not at all"),
        (
            {"content_hash": "00" * 32, "source": SOURCE},
            f"a catalog model's content_hash must be 64 lowercase hex digits that model '{REF}' names "
            f"(name@<its first 16>), got '{'00' * 32}'",
        ),
        (
            {"content_hash": DIGEST.upper(), "source": SOURCE},
            f"a catalog model's content_hash must be 64 lowercase hex digits that model '{REF}' names "
            f"(name@<its first 16>), got '{DIGEST.upper()}'",
        ),
        (
            {"content_hash": DIGEST, "source": ""},
            "source must be a non-empty string of at most 2048 characters, got ''",
        ),
    ],
)
def test_refuses_an_assignment_whose_hash_and_source_do_not_fit_its_ref(fields, message):
    frame = json.dumps({"type": "assign", "assignment": 4, "model": REF, "layer_start": 0, "layer_end": 2, **fields})

    with pytest.raises(ProtocolError) as caught:
        protocol.decode(frame)

    assert (caught.value.code, caught.value.message, caught.value.kind) == ("bad_field", message, "assign")


def test_a_registry_id_cannot_claim_a_content_hash():
    with pytest.raises(ProtocolError) as caught:
        protocol.Assign(
            assignment=4, model="tiny-llama", layer_start=0, layer_end=6, content_hash=DIGEST, source=SOURCE
        )

    assert caught.value.message == (
        "a catalog model's content_hash must be 64 lowercase hex digits that model 'tiny-llama' names "
        f"(name@<its first 16>), got '{DIGEST}'"
    )


@pytest.mark.parametrize(
    ("model", "name", "is_ref"),
    [
        (REF, "llama-untied", True),
        ("tiny-llama", "tiny-llama", False),
        ("/models/llama@3f3f3f3f3f3f3f3f", "/models/llama@3f3f3f3f3f3f3f3f", False),  # a path is never a ref
        ("Llama@3f3f3f3f3f3f3f3f", "Llama@3f3f3f3f3f3f3f3f", False),
    ],
)
def test_a_ref_is_a_catalog_name_and_sixteen_hex_digits(model, name, is_ref):
    assert (checkpoints.ref_name(model), checkpoints.is_ref(model)) == (name, is_ref)
