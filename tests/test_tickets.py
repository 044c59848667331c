import random

import msgpack
import pytest
from nacl.signing import SigningKey

from worker_agent.errors import TicketError
from worker_agent.protocol.span import Span
from worker_agent.protocol.tickets import (
    MAX_TICKET_BYTES,
    PEER_PASS_CONTEXT,
    PROOF_WINDOW_S,
    SIGNING_CONTEXT,
    PeerPass,
    ProofNonces,
    Ticket,
    check_coordinator_proof,
    issue_peer_pass,
    issue_ticket,
    open_peer_pass,
    prove_coordinator,
    read_ticket,
    verify_ticket,
)

pytestmark = pytest.mark.dataplane

NOW = 1_700_000_000.0
ISSUER = SigningKey(b"\x01" * 32)
STRANGER = SigningKey(b"\x02" * 32)
TRUSTED = [bytes(ISSUER.verify_key)]
COORDINATOR = SigningKey(b"\x03" * 32)  # the job's coordinator key, which its tickets name
COORDINATOR_PUB = bytes(COORDINATOR.verify_key)
AGENT = {"node": "node-aaaa", "model": "smollm2-135m", "layer_start": 0, "layer_end": 15}


def _issue(**overrides) -> bytes:
    fields = {"job": "job-1", **AGENT, "coordinator_key": COORDINATOR_PUB, "ttl_s": 600, "now": NOW, **overrides}
    signing_key = fields.pop("signing_key", ISSUER)
    return issue_ticket(signing_key, **fields)


def _verify(blob, *, trusted=TRUSTED, now=NOW + 1, **agent) -> Ticket:
    stage = {**AGENT, **agent}
    span = Span(stage["model"], stage["layer_start"], stage["layer_end"])
    return verify_ticket(blob, trusted, node=stage["node"], span=span, now=now)


def _signed_envelope(body_fields: dict, key: SigningKey = ISSUER) -> bytes:
    """A correctly signed ticket around an arbitrary body, to reach the checks after the signature."""
    body = msgpack.packb(body_fields)
    sig = key.sign(SIGNING_CONTEXT + body).signature
    return msgpack.packb({"body": body, "sig": sig, "key": bytes(key.verify_key)})


def _valid_body(**overrides) -> dict:
    return {"v": 2, "job": "job-1", **AGENT, "coordinator_key": COORDINATOR_PUB, "expires_at": NOW + 600, **overrides}


def _code(blob, **kwargs) -> str:
    with pytest.raises(TicketError) as err:
        _verify(blob, **kwargs)
    return err.value.code


def test_valid_ticket_round_trips():
    ticket = _verify(_issue())

    assert ticket == Ticket(
        job="job-1",
        node="node-aaaa",
        model="smollm2-135m",
        layer_start=0,
        layer_end=15,
        expires_at=NOW + 600,
        coordinator_key=COORDINATOR_PUB,
        issuer_key=bytes(ISSUER.verify_key),
    )


def test_issued_ticket_has_the_documented_wire_form():
    outer = msgpack.unpackb(_issue())

    assert sorted(outer) == ["body", "key", "sig"]
    assert outer["key"] == bytes(ISSUER.verify_key)
    assert len(outer["sig"]) == 64
    assert list(msgpack.unpackb(outer["body"])) == [
        "coordinator_key",
        "expires_at",
        "job",
        "layer_end",
        "layer_start",
        "model",
        "node",
        "v",
    ]
    assert msgpack.unpackb(outer["body"])["v"] == 2
    ISSUER.verify_key.verify(SIGNING_CONTEXT + outer["body"], outer["sig"])


def test_ticket_is_accepted_from_any_of_several_trusted_keys():
    ticket = _verify(_issue(signing_key=STRANGER), trusted={bytes(ISSUER.verify_key), bytes(STRANGER.verify_key)})

    assert ticket.issuer_key == bytes(STRANGER.verify_key)


def test_ticket_signed_by_an_untrusted_key_is_refused():
    with pytest.raises(TicketError) as err:
        _verify(_issue(signing_key=STRANGER))

    assert err.value.code == "ticket_untrusted"
    assert str(err.value) == f"ticket is signed by an untrusted key {bytes(STRANGER.verify_key).hex()}"


def test_no_trusted_keys_refuses_every_ticket():
    assert _code(_issue(), trusted=[]) == "ticket_untrusted"


def test_ticket_is_refused_at_and_after_its_expiry():
    blob = _issue(ttl_s=60)

    assert _verify(blob, now=NOW + 59.999).expires_at == NOW + 60
    with pytest.raises(TicketError) as err:
        _verify(blob, now=NOW + 60)
    assert err.value.code == "ticket_expired"
    assert str(err.value) == f"ticket expired at {NOW + 60:.3f}, now is {NOW + 60:.3f}"
    assert _code(blob, now=NOW + 3600) == "ticket_expired"


def test_ticket_for_another_node_is_refused_naming_both():
    with pytest.raises(TicketError) as err:
        _verify(_issue(node="node-bbbb"))

    assert err.value.code == "ticket_mismatch"
    assert str(err.value) == "ticket is for node 'node-bbbb', this agent is 'node-aaaa'"


def test_ticket_for_another_model_is_refused_naming_both():
    with pytest.raises(TicketError) as err:
        _verify(_issue(model="llama-3-8b"))

    assert err.value.code == "ticket_mismatch"
    assert str(err.value) == "ticket is for model 'llama-3-8b', this agent is 'smollm2-135m'"


@pytest.mark.parametrize("span", [(0, 14), (1, 15), (15, 30)])
def test_ticket_for_another_span_is_refused_naming_both(span):
    with pytest.raises(TicketError) as err:
        _verify(_issue(layer_start=span[0], layer_end=span[1]))

    assert err.value.code == "ticket_mismatch"
    assert str(err.value) == f"ticket is for layers [{span[0]}, {span[1]}), this agent serves [0, 15)"


def test_ticket_with_a_flipped_signature_bit_is_invalid():
    outer = msgpack.unpackb(_issue())
    outer["sig"] = bytes([outer["sig"][0] ^ 1]) + outer["sig"][1:]

    with pytest.raises(TicketError) as err:
        _verify(msgpack.packb(outer))

    assert err.value.code == "ticket_invalid"
    assert str(err.value) == "ticket signature does not verify"


def test_ticket_with_an_edited_body_and_the_old_signature_is_invalid():
    outer = msgpack.unpackb(_issue(node="node-bbbb"))
    outer["body"] = msgpack.packb(_valid_body())

    assert _code(msgpack.packb(outer)) == "ticket_invalid"


def test_receipt_style_signature_over_the_body_is_not_a_ticket_signature():
    body = msgpack.packb(_valid_body())
    sig = ISSUER.sign(body).signature  # no ticket context prefix
    blob = msgpack.packb({"body": body, "sig": sig, "key": bytes(ISSUER.verify_key)})

    assert _code(blob) == "ticket_invalid"


@pytest.mark.parametrize("version", [0, 1, 3, "2", True, None])
def test_ticket_with_an_unsupported_version_is_invalid(version):
    with pytest.raises(TicketError) as err:
        _verify(_signed_envelope(_valid_body(v=version)))

    assert err.value.code == "ticket_invalid"
    assert str(err.value) == f"ticket version {version!r} is not supported (expected 2)"


@pytest.mark.parametrize(
    "overrides",
    [
        {"job": 1},
        {"node": b"node-aaaa"},
        {"model": None},
        {"layer_start": "0"},
        {"layer_end": 15.0},
        {"layer_start": False},
        {"expires_at": "later"},
        {"expires_at": float("inf")},
        {"expires_at": float("nan")},
        {"coordinator_key": bytes(31)},
        {"coordinator_key": COORDINATOR_PUB.hex()},
        {"extra": 1},
    ],
    ids=repr,
)
def test_signed_ticket_with_a_malformed_body_is_invalid(overrides):
    assert _code(_signed_envelope(_valid_body(**overrides))) == "ticket_invalid"


def test_signed_ticket_missing_a_body_field_is_invalid():
    body = _valid_body()
    del body["expires_at"]

    assert _code(_signed_envelope(body)) == "ticket_invalid"


def test_signed_ticket_whose_body_is_not_msgpack_is_invalid():
    body = b"\xc1 not msgpack"
    blob = msgpack.packb(
        {"body": body, "sig": ISSUER.sign(SIGNING_CONTEXT + body).signature, "key": bytes(ISSUER.verify_key)}
    )

    with pytest.raises(TicketError) as err:
        _verify(blob)

    assert err.value.code == "ticket_invalid"
    assert str(err.value).startswith("ticket body is not valid msgpack: ")


@pytest.mark.parametrize(
    "outer",
    [
        [],
        {"body": b"", "sig": bytes(64)},
        {"body": b"", "sig": bytes(64), "key": bytes(32), "extra": 0},
        {"body": "text", "sig": bytes(64), "key": bytes(32)},
        {"body": b"", "sig": bytes(63), "key": bytes(32)},
        {"body": b"", "sig": bytes(64), "key": bytes(31)},
        {"body": b"", "sig": bytes(64), "key": "00" * 32},
        {b"body": b"", b"sig": bytes(64), b"key": bytes(32)},
    ],
    ids=repr,
)
def test_ticket_with_a_malformed_envelope_is_invalid(outer):
    assert _code(msgpack.packb(outer)) == "ticket_invalid"


@pytest.mark.parametrize("blob", [None, "a string", 12, [b"x"], {"body": b""}], ids=repr)
def test_non_bytes_ticket_is_invalid(blob):
    with pytest.raises(TicketError) as err:
        _verify(blob)

    assert err.value.code == "ticket_invalid"
    assert str(err.value) == f"ticket must be bytes, got {type(blob).__name__}"


def test_ticket_as_bytearray_or_memoryview_is_accepted():
    blob = _issue()

    assert _verify(bytearray(blob)) == _verify(blob)
    assert _verify(memoryview(blob)) == _verify(blob)


def test_ticket_larger_than_four_kib_is_invalid_before_parsing():
    blob = _issue(job="j" * 5000)

    with pytest.raises(TicketError) as err:
        _verify(blob)

    assert err.value.code == "ticket_invalid"
    assert str(err.value) == f"ticket is {len(blob)} bytes, more than the {MAX_TICKET_BYTES} allowed"


def test_huge_garbage_is_invalid():
    assert _code(b"\xff" * 10_000_000) == "ticket_invalid"


def test_empty_and_non_msgpack_bytes_are_invalid():
    assert _code(b"") == "ticket_invalid"
    assert _code(b"\xc1") == "ticket_invalid"
    assert _code(b"\x93\x01\x02") == "ticket_invalid"  # truncated array
    assert _code(msgpack.packb({"a": 1}) + b"\x00") == "ticket_invalid"  # trailing bytes


def test_deeply_nested_msgpack_is_invalid():
    assert _code(b"\x91" * 4000 + b"\xc0") == "ticket_invalid"


def test_every_truncation_of_a_valid_ticket_is_invalid():
    blob = _issue()

    codes = {_code(blob[:cut]) for cut in range(len(blob))}

    assert codes == {"ticket_invalid"}


def test_every_single_byte_flip_of_a_valid_ticket_is_refused():
    blob = _issue()

    for i in range(len(blob)):
        flipped = blob[:i] + bytes([blob[i] ^ 0x40]) + blob[i + 1 :]
        with pytest.raises(TicketError):
            _verify(flipped)


def test_random_bytes_only_ever_raise_ticket_error():
    rng = random.Random(20240501)

    codes = set()
    for _ in range(3000):
        blob = rng.randbytes(rng.randrange(0, 300))
        with pytest.raises(TicketError) as err:
            _verify(blob)
        codes.add(err.value.code)

    assert codes == {"ticket_invalid"}


def test_random_msgpack_maps_with_the_right_keys_only_ever_raise_ticket_error():
    rng = random.Random(7)
    values = [None, True, 0, -1, 2**63, 1.5, "", "x", b"", bytes(32), bytes(64), [], {}, {"v": 1}]

    for _ in range(500):
        outer = {name: rng.choice(values) for name in ("body", "sig", "key")}
        with pytest.raises(TicketError):
            _verify(msgpack.packb(outer))


@pytest.mark.parametrize(
    "overrides",
    [
        {"job": ""},
        {"node": 3},
        {"layer_start": 5, "layer_end": 5},
        {"layer_start": -1},
        {"ttl_s": 0},
        {"coordinator_key": b"short"},
        {"expires_at": float("inf")},
    ],
    ids=repr,
)
def test_issue_ticket_refuses_bad_arguments(overrides):
    with pytest.raises(TicketError) as err:
        _issue(**overrides)

    assert err.value.code == "ticket_invalid"


def test_a_ticket_expires_at_the_deadline_it_was_given():
    blob = _issue(expires_at=NOW + 90)

    assert _verify(blob, now=NOW + 89).expires_at == NOW + 90
    assert _code(blob, now=NOW + 90) == "ticket_expired"


# Coordinator proofs: a ticket is not a bearer token.


def _check_proof(proof, blob, *, now=NOW + 1, nonces=None) -> None:
    check_coordinator_proof(proof, blob, read_ticket(blob), now=now, nonces=nonces or ProofNonces())


def _proof_code(proof, blob, **kwargs) -> str:
    with pytest.raises(TicketError) as err:
        _check_proof(proof, blob, **kwargs)
    return err.value.code


def test_a_proof_by_the_coordinator_key_the_ticket_names_is_accepted_once():
    blob = _issue()
    proof = prove_coordinator(COORDINATOR, blob, now=NOW)
    nonces = ProofNonces()

    _check_proof(proof, blob, nonces=nonces)
    with pytest.raises(TicketError) as err:
        _check_proof(proof, blob, nonces=nonces)

    assert err.value.code == "proof_replayed"
    assert str(err.value) == "this coordinator proof was used before"


def test_a_stolen_ticket_without_the_coordinator_key_is_refused():
    blob = _issue()

    assert _proof_code(None, blob) == "proof_missing"
    assert _proof_code(prove_coordinator(STRANGER, blob, now=NOW), blob) == "proof_invalid"
    assert _proof_code(prove_coordinator(ISSUER, blob, now=NOW), blob) == "proof_invalid"


def test_a_proof_for_one_stages_ticket_is_refused_with_another_stages_ticket():
    mine, theirs = _issue(), _issue(node="node-bbbb")

    assert _proof_code(prove_coordinator(COORDINATOR, theirs, now=NOW), mine) == "proof_invalid"


@pytest.mark.parametrize("skew", [-PROOF_WINDOW_S - 1, PROOF_WINDOW_S + 1])
def test_a_proof_dated_outside_the_window_is_refused(skew):
    blob = _issue()

    assert _proof_code(prove_coordinator(COORDINATOR, blob, now=NOW + skew), blob, now=NOW) == "proof_stale"


@pytest.mark.parametrize(
    "proof",
    [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"at": NOW, "nonce": b"x", "sig": bytes(64)}), bytes(300)],
    ids=repr,
)
def test_a_malformed_proof_is_refused(proof):
    assert _proof_code(proof, _issue()) in {"proof_invalid", "ticket_invalid"}


# Peer passes: what the previous ring stage holds.


def test_a_peer_pass_names_the_successor_and_expires_with_its_ticket():
    successor = _issue(node="node-bbbb", layer_start=15, layer_end=30, ttl_s=120)

    grant = open_peer_pass(issue_peer_pass(COORDINATOR, successor), now=NOW + 1)
    later = open_peer_pass(issue_peer_pass(COORDINATOR, successor), now=NOW + 1)

    assert grant == PeerPass(
        job="job-1",
        node="node-bbbb",
        model="smollm2-135m",
        layer_start=15,
        layer_end=30,
        expires_at=NOW + 120,
        coordinator_key=COORDINATOR_PUB,
        order=grant.order,
    )
    assert later.order > grant.order > 0  # a pass issued later is newer: a successor admits it over this one
    with pytest.raises(TicketError) as err:
        open_peer_pass(issue_peer_pass(COORDINATOR, successor), now=NOW + 120)
    assert err.value.code == "ticket_expired"


def test_a_coordinator_signs_no_peer_pass_for_a_ticket_naming_another_coordinator():
    with pytest.raises(TicketError) as err:
        issue_peer_pass(STRANGER, _issue())

    assert err.value.code == "ticket_invalid"


def test_a_ticket_is_not_a_peer_pass_and_a_peer_pass_is_not_a_ticket():
    ticket = _issue()
    peer_pass = issue_peer_pass(COORDINATOR, ticket)

    with pytest.raises(TicketError):
        open_peer_pass(ticket, now=NOW + 1)
    assert _code(peer_pass, trusted=[COORDINATOR_PUB]) == "ticket_invalid"


def test_a_peer_pass_with_an_edited_body_is_refused():
    outer = msgpack.unpackb(issue_peer_pass(COORDINATOR, _issue()))
    body = msgpack.unpackb(outer["body"])
    body["node"] = "node-cccc"
    outer["body"] = msgpack.packb(dict(sorted(body.items())))

    with pytest.raises(TicketError) as err:
        open_peer_pass(msgpack.packb(outer), now=NOW + 1)
    assert str(err.value) == "peer pass signature does not verify"
    assert PEER_PASS_CONTEXT != SIGNING_CONTEXT


@pytest.mark.parametrize(
    "overrides",
    [{"model": ""}, {"layer_start": 5, "layer_end": 5}, {"layer_start": 15, "layer_end": 0}, {"layer_start": -1}],
    ids=repr,
)
def test_a_signed_ticket_naming_no_stage_is_invalid(overrides):
    with pytest.raises(TicketError) as err:
        _verify(_signed_envelope(_valid_body(**overrides)))

    assert err.value.code == "ticket_invalid"
    assert str(err.value) == "ticket must name a model and a span 0 <= layer_start < layer_end"


def test_a_peer_pass_naming_no_stage_is_invalid_whoever_signed_it():
    # A pass is opened before anyone checks who signed it: its span must parse as one on its own.
    outer = msgpack.unpackb(issue_peer_pass(COORDINATOR, _issue()))
    body = {**msgpack.unpackb(outer["body"]), "layer_start": 15, "layer_end": 15}
    packed = msgpack.packb(dict(sorted(body.items())))
    outer |= {"body": packed, "sig": COORDINATOR.sign(PEER_PASS_CONTEXT + packed).signature}

    with pytest.raises(TicketError) as err:
        open_peer_pass(msgpack.packb(outer), now=NOW + 1)

    assert err.value.code == "ticket_invalid"
    assert str(err.value) == "peer pass must name a model and a span 0 <= layer_start < layer_end"


def test_a_ticket_and_its_peer_pass_name_the_stage_as_a_span():
    ticket = _issue(layer_start=15, layer_end=30)

    assert _verify(ticket, layer_start=15, layer_end=30).span == Span("smollm2-135m", 15, 30)
    assert open_peer_pass(issue_peer_pass(COORDINATOR, ticket), now=NOW + 1).span == Span("smollm2-135m", 15, 30)
