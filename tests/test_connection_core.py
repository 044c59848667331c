"""The per-connection rules of the data plane, driven without sockets (``worker_agent.protocol.connection``).

Each test feeds frames (decoded, or raw bytes) to one ``Connection`` at a fixed time and asserts the
exact action it returns: the refusal's code, message, ref, job, session and whether it closes.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from nacl.signing import SigningKey

from tests.forged import another_signature
from worker_agent.errors import SessionError
from worker_agent.protocol import wire
from worker_agent.protocol.connection import (
    AcceptHello,
    ActionKind,
    Admission,
    Binding,
    CloseSessions,
    Connection,
    Dispatch,
    Limits,
    OpenSessions,
    PeerRecord,
    Refuse,
    ReplyPong,
    Role,
    State,
    refused,
)
from worker_agent.protocol.keys import node_id
from worker_agent.protocol.links import PEER_CONTEXT, peer_proof, proves_second_connection
from worker_agent.protocol.span import Span
from worker_agent.protocol.tickets import ProofNonces, issue_peer_pass, issue_ticket, open_peer_pass, prove_coordinator

pytestmark = pytest.mark.dataplane

NOW = 1_700_000_000.0  # unix seconds every frame is fed at
HIDDEN = 8
ISSUER = SigningKey(b"\x01" * 32)
COORDINATOR = SigningKey(b"\x04" * 32)  # the job's coordinator key, which its tickets name
COORDINATOR_PUB = bytes(COORDINATOR.verify_key)
NODE_KEY = SigningKey(b"\x02" * 32)
NODE = node_id(bytes(NODE_KEY.verify_key))
OTHER_NODE = node_id(bytes(SigningKey(b"\x03" * 32).verify_key))
MODEL = "tiny-llama"
SPAN = (2, 4)
JOB = "job-1"
ADMISSION = Admission(node=NODE, span=Span(MODEL, *SPAN), trusted_keys=frozenset({bytes(ISSUER.verify_key)}))
LIMITS = Limits(max_frame=4096, hidden_size=HIDDEN)


def _ticket(job: str = JOB, *, signer: SigningKey = ISSUER, ttl_s: float = 600, **changes) -> bytes:
    fields = {
        "node": NODE,
        "model": MODEL,
        "layer_start": SPAN[0],
        "layer_end": SPAN[1],
        "coordinator_key": COORDINATOR_PUB,
        **changes,
    }
    return issue_ticket(signer, job=job, ttl_s=ttl_s, now=NOW, **fields)


def _connection(*, admission: Admission = ADMISSION, coordinated_jobs: dict[str, bytes] | None = None) -> Connection:
    return Connection(admission, LIMITS, coordinated_jobs=coordinated_jobs)


def _feed(connection: Connection, message: wire.Message, seq: int, *, now: float = NOW):
    return connection.receive_frame(wire.Frame(seq, message, size=0), now=now)


def _hello(
    job: str = JOB,
    *,
    ticket: bytes | None = None,
    role: str = "coordinator",
    key: SigningKey = COORDINATOR,
    **fields,
) -> wire.Hello:
    """A HELLO as the job's coordinator does it (the ticket and a fresh proof of ``key``), or as
    its ring peer (a pass ``key`` signed for this stage)."""
    if role == "peer":
        ticket = issue_peer_pass(key, _ticket(job, coordinator_key=bytes(key.verify_key))) if ticket is None else ticket
        return wire.Hello(job=job, role=role, ticket=ticket, **fields)
    ticket = _ticket(job) if ticket is None else ticket
    fields.setdefault("proof", prove_coordinator(key, ticket, now=NOW))
    return wire.Hello(job=job, role=role, ticket=ticket, **fields)


def _bound(role: str = "coordinator") -> Connection:
    connection = _connection(coordinated_jobs={JOB: COORDINATOR_PUB})
    assert isinstance(_feed(connection, _hello(role=role), 1), AcceptHello)
    return connection


def _forward(job: str = JOB, session: str = "s0", step: int = 0) -> wire.Forward:
    hidden = torch.ones(2, HIDDEN)  # (rows, hidden)
    return wire.Forward(job, (wire.Item(session, step, 0, 2),), "f32", (2, HIDDEN), wire.tensor_payload(hidden, "f32"))


def test_a_valid_hello_binds_the_connection_to_the_tickets_job_node_model_and_span():
    connection = _connection()
    hello = _hello(topology="ring", next_url="ws://next", next_ticket=b"t")

    action = _feed(connection, hello, 1)

    binding = Binding(
        JOB, Role.COORDINATOR, NODE, Span(MODEL, 2, 4), expires_at=NOW + 600, coordinator_key=COORDINATOR_PUB
    )
    assert action == AcceptHello(hello, binding)
    assert action.kind is ActionKind.ACCEPT_HELLO
    assert (connection.state, connection.binding, connection.role) == (State.BOUND, binding, Role.COORDINATOR)


def test_an_insecure_open_stage_binds_a_hello_without_a_ticket_to_its_own_identity():
    connection = _connection(admission=Admission(NODE, Span(MODEL, 2, 4), frozenset(), insecure_open=True))
    hello = wire.Hello(job=JOB, ticket=None)

    action = _feed(connection, hello, 1)

    assert action == AcceptHello(hello, Binding(JOB, Role.COORDINATOR, NODE, Span(MODEL, 2, 4), expires_at=None))


def test_ping_is_answered_before_hello():
    connection = _connection()

    action = _feed(connection, wire.Ping(7), 1)

    assert action == ReplyPong(7)
    assert action.kind is ActionKind.PONG
    assert (connection.state, connection.binding) == (State.AWAITING_HELLO, None)


@pytest.mark.parametrize(
    ("message", "session"),
    [(_forward(), "s0"), (wire.Open(JOB, ("a", "b")), "a"), (wire.Close(JOB, ("c",)), "c")],
    ids=["forward", "open", "close"],
)
def test_a_frame_before_hello_is_refused_and_the_connection_stays_usable(message, session):
    connection = _connection()

    action = _feed(connection, message, 1)

    assert action == Refuse("ticket_missing", "send HELLO with a job ticket first", ref=1, job=JOB, session=session)
    assert action.kind is ActionKind.REFUSE
    assert action.close is False
    assert isinstance(_feed(connection, _hello(), 2), AcceptHello)


def test_hello_without_a_ticket_is_refused_and_closes_the_connection():
    connection = _connection()

    action = _feed(connection, wire.Hello(job=JOB, ticket=None), 3)

    assert action == Refuse(
        "ticket_missing",
        "HELLO carries no job ticket and this agent is not --insecure-open",
        ref=3,
        job=JOB,
        close=True,
    )
    assert action.to_wire() == wire.Error(
        "ticket_missing",
        "HELLO carries no job ticket and this agent is not --insecure-open",
        ref=3,
        job=JOB,
        fatal=True,
    )
    assert (connection.state, connection.binding) == (State.CLOSED, None)


def test_a_closed_connection_takes_no_more_frames():
    connection = _connection()
    _feed(connection, wire.Hello(job=JOB, ticket=None), 1)

    with pytest.raises(RuntimeError, match="feed it no more frames"):
        _feed(connection, wire.Ping(1), 2)


def test_hello_with_a_ticket_from_an_untrusted_issuer_is_refused_and_closes():
    stranger = SigningKey(b"\x07" * 32)
    connection = _connection()

    action = _feed(connection, _hello(ticket=_ticket(signer=stranger)), 1)

    message = f"ticket is signed by an untrusted key {bytes(stranger.verify_key).hex()}"
    assert action == Refuse("ticket_untrusted", message, ref=1, job=JOB, close=True)


def test_hello_with_a_ticket_whose_issuer_key_was_altered_is_refused_as_untrusted():
    forged = _ticket()[:-1] + bytes([_ticket()[-1] ^ 1])  # one bit of the issuer key, the envelope's last field
    connection = _connection()

    action = _feed(connection, _hello(ticket=forged), 1)

    assert (action.code, action.ref, action.job, action.close) == ("ticket_untrusted", 1, JOB, True)


def test_hello_with_a_bad_signature_is_refused_as_invalid():
    ticket = bytearray(_ticket())
    body_byte = ticket.index(b"tiny-llama")  # inside the signed body
    ticket[body_byte] ^= 1
    connection = _connection()

    action = _feed(connection, _hello(ticket=bytes(ticket)), 1)

    assert action == Refuse("ticket_invalid", "ticket signature does not verify", ref=1, job=JOB, close=True)


def test_hello_with_a_ticket_that_expired_at_the_time_fed_is_refused():
    connection = _connection()

    action = _feed(connection, _hello(ticket=_ticket(ttl_s=60)), 1, now=NOW + 61)

    message = f"ticket expired at {NOW + 60:.3f}, now is {NOW + 61:.3f}"
    assert action == Refuse("ticket_expired", message, ref=1, job=JOB, close=True)


@pytest.mark.parametrize(
    ("ticket", "message"),
    [
        (_ticket(node=OTHER_NODE), f"ticket is for node {OTHER_NODE!r}, this agent is {NODE!r}"),
        (_ticket(model="smollm2-135m"), "ticket is for model 'smollm2-135m', this agent is 'tiny-llama'"),
        (_ticket(layer_end=5), "ticket is for layers [2, 5), this agent serves [2, 4)"),
        (_ticket("another-job"), f"ticket is for job 'another-job', HELLO says {JOB!r}"),
    ],
    ids=["other_node", "other_model", "other_span", "other_job"],
)
def test_hello_with_a_ticket_for_someone_else_is_refused_as_mismatch(ticket, message):
    connection = _connection()

    action = _feed(connection, _hello(ticket=ticket), 1)

    assert action == Refuse("ticket_mismatch", message, ref=1, job=JOB, close=True)
    assert connection.binding is None


def test_a_second_hello_is_refused_and_closes_the_connection():
    connection = _bound()

    action = _feed(connection, _hello(), 2)

    assert action == Refuse("hello_twice", "this connection already said HELLO", ref=2, job=JOB, close=True)
    assert connection.state is State.CLOSED


def test_hello_as_a_stage_is_refused():
    connection = _connection()

    action = _feed(connection, _hello(role="stage"), 1)

    assert action == Refuse("not_allowed", "a stage does not accept HELLO as 'stage'", ref=1, job=JOB, close=True)


def test_a_peer_hello_for_a_job_without_a_coordinator_here_is_refused():
    connection = _connection(coordinated_jobs={"other-job": COORDINATOR_PUB})

    action = _feed(connection, _hello(role="peer"), 1)

    assert action == Refuse("unknown_job", f"no coordinator has opened job {JOB!r} here", ref=1, job=JOB, close=True)


def test_a_peer_hello_for_a_coordinated_job_binds_the_peer_role():
    connection = _bound(role="peer")

    binding = connection.binding
    assert binding is not None and binding.peer is not None
    assert binding == Binding(
        JOB,
        Role.PEER,
        NODE,
        Span(MODEL, 2, 4),
        expires_at=NOW + 600,
        coordinator_key=COORDINATOR_PUB,
        peer=binding.peer,
    )
    assert binding.peer.proof == b""  # the pass names no sender: nobody to prove


SENDER = SigningKey(b"\x05" * 32)
SENDER_PUB = bytes(SENDER.verify_key)
SUCCESSOR_TICKET = _ticket(coordinator_key=COORDINATOR_PUB)


def _peer_admission(bound: PeerRecord | None) -> Admission:
    """This stage with the job's coordinator here and, if ``bound``, a peer admitted for the job."""
    return dataclasses.replace(ADMISSION, jobs={JOB: COORDINATOR_PUB}, peers={JOB: bound} if bound else {})


def _record(peer_pass: bytes, proof: bytes) -> PeerRecord:
    return PeerRecord(open_peer_pass(peer_pass, now=NOW).order, hashlib.sha256(peer_pass).digest(), proof)


def _peer_hello(peer_pass: bytes, proof: bytes | None) -> wire.Hello:
    return wire.Hello(job=JOB, role="peer", ticket=peer_pass, topology="ring", proof=proof)


def test_a_pass_naming_a_sender_admits_only_that_senders_signature_over_it():
    peer_pass = issue_peer_pass(COORDINATOR, SUCCESSOR_TICKET, SENDER_PUB)
    other_pass = issue_peer_pass(COORDINATOR, SUCCESSOR_TICKET, SENDER_PUB)

    unproven = _feed(_connection(admission=_peer_admission(None)), _peer_hello(peer_pass, None), 1)
    strangers = _feed(
        _connection(admission=_peer_admission(None)), _peer_hello(peer_pass, peer_proof(STRANGER, peer_pass)), 1
    )
    other = _feed(
        _connection(admission=_peer_admission(None)), _peer_hello(peer_pass, peer_proof(SENDER, other_pass)), 1
    )
    proven = _feed(
        _connection(admission=_peer_admission(None)), _peer_hello(peer_pass, peer_proof(SENDER, peer_pass)), 1
    )

    assert (unproven.code, unproven.close) == ("peer_unproven", True)
    assert unproven.message == "the peer HELLO carries no proof of the sender key its pass names"
    assert (strangers.code, other.code) == ("peer_unproven", "peer_unproven")
    assert isinstance(proven, AcceptHello)
    assert proven.binding.peer == _record(peer_pass, peer_proof(SENDER, peer_pass))


def test_the_same_pass_and_proof_again_is_the_sender_reconnecting():
    peer_pass = issue_peer_pass(COORDINATOR, SUCCESSOR_TICKET, SENDER_PUB)
    proof = peer_proof(SENDER, peer_pass)

    again = _feed(_connection(admission=_peer_admission(_record(peer_pass, proof))), _peer_hello(peer_pass, proof), 1)

    assert isinstance(again, AcceptHello)  # the server drops the old connection: it may be half dead


def test_the_same_pass_under_another_signature_is_refused_with_both_as_evidence():
    peer_pass = issue_peer_pass(COORDINATOR, SUCCESSOR_TICKET, SENDER_PUB)
    first = peer_proof(SENDER, peer_pass)
    second = another_signature(SENDER, PEER_CONTEXT + hashlib.sha256(peer_pass).digest())

    action = _feed(_connection(admission=_peer_admission(_record(peer_pass, first))), _peer_hello(peer_pass, second), 1)

    assert action == Refuse(
        "peer_twice",
        f"job {JOB!r}'s ring peer opened a second connection under another signature of its pass",
        ref=1,
        job=JOB,
        close=True,
        evidence=first + second,
    )
    assert proves_second_connection(SENDER_PUB, peer_pass, action.evidence)
    # The successor cannot make such evidence up: the same proof twice, or a proof over another pass, is none.
    assert not proves_second_connection(SENDER_PUB, peer_pass, first + first)
    assert not proves_second_connection(
        SENDER_PUB, issue_peer_pass(COORDINATOR, SUCCESSOR_TICKET, SENDER_PUB), first + second
    )


def test_a_newer_pass_takes_the_peer_place_and_an_older_one_never_again():
    healed_away = SigningKey(b"\x07" * 32)
    old_pass = issue_peer_pass(COORDINATOR, SUCCESSOR_TICKET, bytes(healed_away.verify_key))
    new_pass = issue_peer_pass(COORDINATOR, SUCCESSOR_TICKET, SENDER_PUB)
    old_record, new_record = (
        _record(old_pass, peer_proof(healed_away, old_pass)),
        _record(new_pass, peer_proof(SENDER, new_pass)),
    )

    newer = _feed(
        _connection(admission=_peer_admission(old_record)), _peer_hello(new_pass, peer_proof(SENDER, new_pass)), 1
    )
    stale = _feed(
        _connection(admission=_peer_admission(new_record)), _peer_hello(old_pass, peer_proof(healed_away, old_pass)), 1
    )

    assert isinstance(newer, AcceptHello)
    assert newer.binding.sender_key == SENDER_PUB
    assert stale == Refuse(
        "peer_stale",
        f"job {JOB!r}'s route was healed onto a newer pass than this one: its sender is no longer the ring peer",
        ref=1,
        job=JOB,
        close=True,
    )


def test_a_coordinator_may_open_forward_and_close_its_jobs_sessions():
    connection = _bound()
    forward = _forward()

    opened = _feed(connection, wire.Open(JOB, ("s0", "s1")), 2)
    dispatched = _feed(connection, forward, 3)
    closed = _feed(connection, wire.Close(JOB, ("s0",)), 4)

    assert opened == OpenSessions(2, JOB, ("s0", "s1"))
    assert dispatched == Dispatch(3, forward)
    assert closed == CloseSessions(4, JOB, ("s0",))
    assert [opened.kind, dispatched.kind, closed.kind] == [ActionKind.OPEN, ActionKind.FORWARD, ActionKind.CLOSE]


def test_a_peer_may_forward_but_not_open_or_close():
    connection = _bound(role="peer")
    forward = _forward()

    dispatched = _feed(connection, forward, 2)
    opened = _feed(connection, wire.Open(JOB, ("x",)), 3)
    closed = _feed(connection, wire.Close(JOB, ("y",)), 4)

    assert dispatched == Dispatch(2, forward)
    assert opened == Refuse("not_allowed", "a peer stage may only send FORWARD, not Open", ref=3, job=JOB, session="x")
    assert closed == Refuse("not_allowed", "a peer stage may only send FORWARD, not Close", ref=4, job=JOB, session="y")


def test_a_result_sent_to_a_stage_is_refused():
    connection = _bound()
    forward = _forward()
    result = wire.Result(forward.job, forward.items, forward.dtype, forward.shape, forward.payload)

    action = _feed(connection, result, 2)

    assert action == Refuse("not_allowed", "a stage does not accept Result frames", ref=2, job=JOB, session="s0")


def test_a_pong_sent_to_a_stage_is_refused():
    connection = _bound()

    action = _feed(connection, wire.Pong(1), 2)

    assert action == Refuse("not_allowed", "a stage does not accept Pong frames", ref=2)


@pytest.mark.parametrize(
    "message",
    [_forward("live-job"), wire.Open("live-job", ("s0",)), wire.Close("live-job", ("s0",))],
    ids=["forward", "open", "close"],
)
def test_a_frame_for_another_job_is_refused_and_the_connection_stays_bound(message):
    connection = _bound()

    action = _feed(connection, message, 2)

    assert action == Refuse(
        "wrong_job", f"this connection is bound to job {JOB!r}, not 'live-job'", ref=2, job="live-job", session="s0"
    )
    assert action.close is False
    assert _feed(connection, wire.Ping(1), 3) == ReplyPong(1)


def test_a_replayed_seq_is_refused_without_moving_the_guard_and_gaps_are_allowed():
    connection = _bound()  # the HELLO was seq 1

    replayed = _feed(connection, wire.Ping(11), 1)
    ahead = _feed(connection, wire.Ping(12), 5)
    backwards = _feed(connection, wire.Ping(13), 3)
    same = _feed(connection, wire.Ping(14), 5)
    after = _feed(connection, wire.Ping(15), 6)

    assert replayed == Refuse("replayed_seq", "seq 1 is not above 1", ref=1)
    assert ahead == ReplyPong(12)
    assert backwards == Refuse("replayed_seq", "seq 3 is not above 5", ref=3)
    assert same == Refuse("replayed_seq", "seq 5 is not above 5", ref=5)
    assert after == ReplyPong(15)
    assert connection.last_seq == 6


def test_a_refused_frame_still_uses_up_its_seq():
    connection = _bound()
    _feed(connection, wire.Open("live-job", ("s0",)), 2)

    action = _feed(connection, wire.Open(JOB, ("s0",)), 2)

    assert action == Refuse("replayed_seq", "seq 2 is not above 2", ref=2)


def test_a_replayed_hello_is_refused_as_a_replay_not_as_a_second_hello():
    connection = _bound()

    action = _feed(connection, _hello(), 1)

    assert action == Refuse("replayed_seq", "seq 1 is not above 1", ref=1)
    assert connection.state is State.BOUND


def test_raw_frames_are_decoded_within_the_connections_limits():
    connection = _bound()

    ping = connection.receive_data(wire.encode(wire.Ping(4), 2), now=NOW)
    text = connection.receive_data("HELLO please", now=NOW)
    too_big = wire.encode(wire.Pong(5), 3) + b"\x00" * 4096
    oversize = connection.receive_data(too_big, now=NOW)
    # A link probe's PING, padded with zeros past the limit, is the one frame read over it.
    probe = connection.receive_data(wire.encode(wire.Ping(6, pad=4096), 4), now=NOW)

    assert ping == ReplyPong(4)
    assert probe == ReplyPong(6)
    assert text == Refuse("malformed", "text frames are not accepted; send binary frames", ref=None)
    assert oversize == Refuse("too_large", f"frame of {len(too_big)} bytes exceeds the limit of 4096", ref=3)


def test_a_forward_of_another_hidden_size_is_refused_and_does_not_use_up_its_seq():
    connection = _bound()
    wide = torch.ones(1, HIDDEN * 2)  # (rows, hidden * 2)
    frame = wire.encode(
        wire.Forward(JOB, (wire.Item("s0", 0, 0, 1),), "f32", (1, HIDDEN * 2), wire.tensor_payload(wide, "f32")), 2
    )

    refused_frame = connection.receive_data(frame, now=NOW)
    retried = connection.receive_data(wire.encode(_forward(), 2), now=NOW)

    assert refused_frame == Refuse("bad_shape", f"hidden size {HIDDEN * 2} does not match this stage's {HIDDEN}", ref=2)
    assert retried == Dispatch(2, _forward())


def test_a_frame_the_stage_turns_down_is_refused_with_its_first_session_and_keeps_the_connection():
    forward = _forward(session="r", step=0)
    error = SessionError("session 'r' expects step 1, got 0", code="replayed_seq")

    assert refused(Dispatch(7, forward), error) == Refuse(
        "replayed_seq", "session 'r' expects step 1, got 0", ref=7, job=JOB, session="r", close=False
    )
    assert refused(OpenSessions(8, JOB, ("a", "b")), SessionError("full", code="too_many_sessions")) == Refuse(
        "too_many_sessions", "full", ref=8, job=JOB, session="a"
    )
    assert refused(CloseSessions(9, JOB, ("g",)), SessionError("gone", code="unknown_session")) == Refuse(
        "unknown_session", "gone", ref=9, job=JOB, session="g"
    )


# Several stages behind one port: a block being replaced and its successor

NEW_SPAN = (4, 6)
NEW = Admission(NODE, Span(MODEL, *NEW_SPAN), frozenset({bytes(ISSUER.verify_key)}), jobs={})


def _old(*, accepting: bool = True, jobs: dict[str, bytes] | None = None) -> Admission:
    return Admission(NODE, Span(MODEL, *SPAN), ADMISSION.trusted_keys, accepting=accepting, jobs=jobs or {})


def test_the_ticket_names_which_of_several_stages_a_hello_binds_to():
    for span, expected in ((SPAN, (2, 4)), (NEW_SPAN, (4, 6))):
        connection = Connection([NEW, _old()], LIMITS)
        hello = _hello(ticket=_ticket(layer_start=span[0], layer_end=span[1]))

        action = _feed(connection, hello, 1)

        binding = Binding(JOB, Role.COORDINATOR, NODE, Span(MODEL, *expected), NOW + 600, COORDINATOR_PUB)
        assert action == AcceptHello(hello, binding)
        assert connection.binding.span == Span(MODEL, *expected)


def test_a_ticket_for_a_span_no_stage_serves_is_refused_against_the_primary_stage():
    connection = Connection([NEW, _old()], LIMITS)

    action = _feed(connection, wire.Hello(job=JOB, ticket=_ticket(layer_start=0, layer_end=2)), 1)

    assert action == Refuse(
        "ticket_mismatch", "ticket is for layers [0, 2), this agent serves [4, 6)", ref=1, job=JOB, close=True
    )


def test_a_stage_being_released_refuses_a_new_job_and_admits_the_jobs_open_on_it():
    refused_hello = _feed(Connection([NEW, _old(accepting=False)], LIMITS), _hello(), 1)
    open_job = Connection([NEW, _old(accepting=False, jobs={JOB: COORDINATOR_PUB})], LIMITS)
    peer = _feed(open_job, _hello(role="peer"), 1)
    reconnect = _feed(Connection([NEW, _old(accepting=False, jobs={JOB: COORDINATOR_PUB})], LIMITS), _hello(), 1)

    assert refused_hello == Refuse(
        "stage_draining",
        "tiny-llama layers [2, 4) is being released here and takes no new job",
        ref=1,
        job=JOB,
        close=True,
    )
    assert isinstance(peer, AcceptHello)
    assert peer.binding.role is Role.PEER
    assert isinstance(reconnect, AcceptHello)


def test_a_ring_peer_must_join_a_job_open_on_the_stage_its_ticket_names():
    action = _feed(Connection([NEW, _old(jobs={"other": COORDINATOR_PUB})], LIMITS), _hello(role="peer"), 1)

    assert action == Refuse("unknown_job", f"no coordinator has opened job {JOB!r} here", ref=1, job=JOB, close=True)


def test_without_tickets_a_hello_binds_to_the_primary_stage():
    stages = [Admission(NODE, Span(MODEL, 4, 6), frozenset(), insecure_open=True), _old()]

    action = _feed(Connection(stages, LIMITS), wire.Hello(job=JOB, ticket=None), 1)

    assert action.binding == Binding(JOB, Role.COORDINATOR, NODE, Span(MODEL, 4, 6), expires_at=None)


def test_an_agent_serving_no_block_refuses_every_hello():
    action = _feed(Connection([], LIMITS), _hello(), 1)

    assert action == Refuse("not_serving", "this agent serves no block now", ref=1, job=JOB, close=True)


# Tickets bound to the job: who may be the coordinator, and what the ring predecessor may do

STRANGER = SigningKey(b"\x06" * 32)


def test_a_stolen_coordinator_ticket_without_the_coordinator_key_is_refused():
    ticket = _ticket()

    no_proof = _feed(_connection(), wire.Hello(job=JOB, ticket=ticket), 1)
    wrong_key = _feed(_connection(), _hello(ticket=ticket, proof=prove_coordinator(STRANGER, ticket, now=NOW)), 1)

    assert no_proof == Refuse(
        "proof_missing",
        "HELLO as coordinator carries no proof of the job's coordinator key",
        ref=1,
        job=JOB,
        close=True,
    )
    assert wrong_key == Refuse(
        "proof_invalid",
        "coordinator proof is not signed by the coordinator key the ticket names",
        ref=1,
        job=JOB,
        close=True,
    )


def test_a_coordinator_proof_is_good_for_one_hello_on_the_stage():
    nonces = ProofNonces()
    hello = _hello()

    first = Connection(ADMISSION, LIMITS, nonces=nonces)
    replay = Connection(ADMISSION, LIMITS, nonces=nonces)

    assert isinstance(_feed(first, hello, 1), AcceptHello)
    assert _feed(replay, hello, 1) == Refuse(
        "proof_replayed", "this coordinator proof was used before", ref=1, job=JOB, close=True
    )


def test_a_reused_successor_pass_cannot_say_hello_as_coordinator():
    peer_pass = issue_peer_pass(COORDINATOR, _ticket())

    action = _feed(_connection(coordinated_jobs={JOB: COORDINATOR_PUB}), wire.Hello(job=JOB, ticket=peer_pass), 1)

    assert action == Refuse(
        "ticket_untrusted", f"ticket is signed by an untrusted key {COORDINATOR_PUB.hex()}", ref=1, job=JOB, close=True
    )


def test_a_successor_pass_is_refused_once_its_job_has_ended_here():
    action = _feed(_connection(coordinated_jobs={}), _hello(role="peer"), 1)

    assert action == Refuse("unknown_job", f"no coordinator has opened job {JOB!r} here", ref=1, job=JOB, close=True)


def test_a_peer_pass_signed_by_another_coordinator_key_is_refused():
    action = _feed(_connection(coordinated_jobs={JOB: COORDINATOR_PUB}), _hello(role="peer", key=STRANGER), 1)

    assert action == Refuse(
        "ticket_untrusted", f"the peer pass is not signed by job {JOB!r}'s coordinator", ref=1, job=JOB, close=True
    )


def test_a_ticket_is_not_a_peer_pass():
    action = _feed(_connection(coordinated_jobs={JOB: COORDINATOR_PUB}), _hello(role="peer", ticket=_ticket()), 1)

    assert (action.code, action.close) == ("ticket_invalid", True)


def test_a_second_coordinator_with_another_key_for_a_live_job_is_refused():
    other = SigningKey(b"\x08" * 32)
    ticket = _ticket(coordinator_key=bytes(other.verify_key))
    connection = _connection(coordinated_jobs={JOB: COORDINATOR_PUB})

    action = _feed(connection, _hello(ticket=ticket, key=other), 1)

    assert action == Refuse(
        "job_taken", f"job {JOB!r} is live here under another coordinator key", ref=1, job=JOB, close=True
    )
    assert connection.binding is None


def test_the_jobs_coordinator_reconnecting_with_the_same_key_is_admitted():
    connection = _connection(coordinated_jobs={JOB: COORDINATOR_PUB})

    action = _feed(connection, _hello(), 1)

    assert isinstance(action, AcceptHello)
    assert action.binding.coordinator_key == COORDINATOR_PUB


def test_a_bound_connection_is_closed_once_its_ticket_expires():
    connection = _connection(coordinated_jobs={JOB: COORDINATOR_PUB})
    assert isinstance(_feed(connection, _hello(ticket=_ticket(ttl_s=60)), 1), AcceptHello)

    before = _feed(connection, wire.Open(JOB, ("s0",)), 2, now=NOW + 59)
    after = _feed(connection, wire.Open(JOB, ("s1",)), 3, now=NOW + 60)

    assert before == OpenSessions(2, JOB, ("s0",))
    assert after == Refuse(
        "ticket_expired",
        f"the ticket this connection was admitted with expired at {NOW + 60:.3f}",
        ref=3,
        job=JOB,
        close=True,
    )
    assert connection.state is State.CLOSED
