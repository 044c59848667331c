"""Bad frames against real agent processes: each gets the right ERROR while a live session goes on.

Every test keeps a generation going through a real ``Coordinator`` on the same agents: it
generates a few tokens, pauses while a second, raw connection sends the bad frame and reads the
answer, then finishes. The live session must end with exactly the tokens of an uninterrupted
run, with its receipts verified.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from nacl.signing import SigningKey
from websockets.exceptions import ConnectionClosed

from tests.forged import another_signature
from tests.wire_client import RawClient, forward_header, raw_client, raw_frame
from worker_agent import model as models
from worker_agent.block import Block, WorkItem
from worker_agent.coordinator.job import Coordinator, GenerationResult
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.coordinator.session import TokenEvent
from worker_agent.dev.local import LocalSwarm
from worker_agent.kvcache import SessionLimits, SessionStore
from worker_agent.protocol import wire
from worker_agent.protocol.links import PEER_CONTEXT, peer_proof, proves_second_connection
from worker_agent.protocol.tickets import issue_peer_pass, issue_ticket

pytestmark = pytest.mark.dataplane

MODEL = "tiny-llama"
HIDDEN = 64
PROMPT = "Once upon a time"
MAX_TOKENS = 8
TOKENS_BEFORE = 3  # tokens the live session generates before the bad frame
SCENARIO_TIMEOUT_S = 90.0
MAX_FRAME_MB = 1


@pytest.fixture(scope="module")
def small_frame_swarm():
    """One agent holding all of tiny-llama that refuses frames over 1 MiB."""
    with LocalSwarm(MODEL, [(0, 6)], threads=1, extra_args=["--max-frame-mb", str(MAX_FRAME_MB)]) as swarm:
        yield swarm


def _job(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


def _run(coro: Awaitable[Any]) -> Any:
    async def bounded():
        return await asyncio.wait_for(coro, SCENARIO_TIMEOUT_S)

    return asyncio.run(bounded())


async def _generate(swarm: LocalSwarm, between: Callable[[], Awaitable[Any]] | None = None, job: str | None = None):
    """A greedy generation on ``swarm``; ``between`` runs after TOKENS_BEFORE tokens."""
    job = job or _job("live")
    specs = [StageSpec(url, ticket) for url, ticket in zip(swarm.urls, swarm.tickets(job), strict=True)]
    outcome = None
    async with Coordinator(MODEL, specs, job=job, coordinator_key=swarm.coordinator_key(job)) as coordinator:
        stream = coordinator.stream(coordinator.request(PROMPT, max_tokens=MAX_TOKENS))
        for _ in range(TOKENS_BEFORE):
            assert isinstance(await anext(stream), TokenEvent)
        if between is not None:
            outcome = await between()
        result = None
        async for event in stream:
            result = event
    assert isinstance(result, GenerationResult)
    return result, outcome


@pytest.fixture(scope="module")
def tiny_reference(tiny_swarm) -> GenerationResult:
    result, _ = _run(_generate(tiny_swarm))
    assert len(result.token_ids) == MAX_TOKENS  # a stream long enough to be interrupted
    return result


@pytest.fixture(scope="module")
def small_reference(small_frame_swarm) -> GenerationResult:
    result, _ = _run(_generate(small_frame_swarm))
    return result


def _around_live_session(
    swarm: LocalSwarm, reference: GenerationResult, bad: Callable[[], Awaitable[Any]], *, job: str | None = None
) -> Any:
    """Run ``bad`` in the middle of a live session (of ``job``); check the session was not disturbed."""
    result, outcome = _run(_generate(swarm, bad, job))
    assert result.token_ids == reference.token_ids
    assert result.finish_reason == reference.finish_reason
    assert result.verification is not None
    assert len(result.receipts) == len(swarm.agents)
    return outcome


async def _authenticated(swarm: LocalSwarm, client: RawClient, job: str, agent: int = 0) -> None:
    reply = await client.hello(job, swarm.tickets(job)[agent], key=swarm.coordinator_key(job))
    assert isinstance(reply, wire.Hello)
    assert (reply.role, reply.info["node"]) == ("stage", swarm.agents[agent].node)


def unsigned(items: tuple[wire.Item, ...]) -> tuple[wire.Item, ...]:
    """A stage's output items without the signatures it puts on them (links.py), to compare positions."""
    return tuple(dataclasses.replace(item, sig=b"") for item in items)


def _hidden(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))  # (rows, hidden)


def _forward(job: str, items: list[wire.Item], hidden: torch.Tensor) -> wire.Forward:
    return wire.Forward(job, tuple(items), "f32", tuple(hidden.shape), wire.tensor_payload(hidden, "f32"))


def _nan_rows() -> torch.Tensor:
    hidden = _hidden(2)
    hidden[1, 7] = float("nan")
    return hidden


def _inf_rows() -> torch.Tensor:
    hidden = _hidden(2)
    hidden[0, 0] = float("inf")
    return hidden


# Frames the codec refuses: (frame built from the seq it is sent with, code, message, whether
# the agent can read the seq back for the ERROR's ref).
DECODE_REFUSALS = {
    "not_msgpack": (
        lambda seq: b"\xc1\xc1\xc1",
        "malformed",
        "header is not valid msgpack: FormatError",
        False,
    ),
    "text_frame": (
        lambda seq: "HELLO please",
        "malformed",
        "text frames are not accepted; send binary frames",
        False,
    ),
    "dtype_f64": (
        lambda seq: raw_frame(
            forward_header(seq, "j", [["s0", 0, 0, 2]], rows=2, hidden=HIDDEN, dtype="f64"),
            _hidden(2).double().numpy().tobytes(),
        ),
        "bad_dtype",
        "dtype 'f64' is not one of ['bf16', 'f16', 'f32']",
        True,
    ),
    "wrong_hidden_size": (
        lambda seq: raw_frame(
            forward_header(seq, "j", [["s0", 0, 0, 2]], rows=2, hidden=32),
            wire.tensor_payload(torch.zeros(2, 32), "f32"),
        ),
        "bad_shape",
        "hidden size 32 does not match this stage's 64",
        True,
    ),
    "payload_too_short": (
        lambda seq: raw_frame(
            forward_header(seq, "j", [["s0", 0, 0, 2]], rows=2, hidden=HIDDEN),
            wire.tensor_payload(_hidden(2), "f32")[:-4],
        ),
        "bad_shape",
        "tensor has 508 bytes, shape [2, 64] f32 needs 512",
        True,
    ),
    "nan_payload": (
        lambda seq: raw_frame(
            forward_header(seq, "j", [["s0", 0, 0, 2]], rows=2, hidden=HIDDEN), wire.tensor_payload(_nan_rows(), "f32")
        ),
        "non_finite",
        "tensor holds NaN or Inf",
        True,
    ),
    "inf_payload": (
        lambda seq: raw_frame(
            forward_header(seq, "j", [["s0", 0, 0, 2]], rows=2, hidden=HIDDEN), wire.tensor_payload(_inf_rows(), "f32")
        ),
        "non_finite",
        "tensor holds NaN or Inf",
        True,
    ),
    "unknown_type": (
        lambda seq: raw_frame({"v": 1, "type": "EXPLODE", "seq": seq, "job": "j"}),
        "unknown_type",
        "unknown frame type 'EXPLODE'",
        True,
    ),
    "version_2": (
        lambda seq: raw_frame({"v": 2, "type": "PING", "seq": seq, "nonce": 1}),
        "bad_version",
        "unsupported protocol version 2 (this side speaks 1)",
        True,
    ),
}


@pytest.mark.parametrize("case", list(DECODE_REFUSALS))
def test_a_refused_frame_gets_its_error_and_the_connection_and_the_live_session_go_on(tiny_swarm, tiny_reference, case):
    build, code, message, seq_readable = DECODE_REFUSALS[case]
    job = _job("raw")

    async def bad():
        async with raw_client(tiny_swarm.urls[0]) as client:
            await _authenticated(tiny_swarm, client, job)
            seq = client.next_seq()
            await client.send_raw(build(seq))
            error = await client.recv()
            pong = await client.ping(99)
            return seq, error, pong

    seq, error, pong = _around_live_session(tiny_swarm, tiny_reference, bad)

    assert error == wire.Error(code, message, ref=seq if seq_readable else None, job=None, session=None, fatal=False)
    assert (type(pong), pong.nonce) == (wire.Pong, 99)
    assert pong.info["sessions"] == 1  # the live session, and nothing the bad frame opened


def test_a_frame_over_the_agents_limit_is_refused_as_too_large(small_frame_swarm, small_reference):
    job = _job("raw")
    rows = 4097  # 4097 rows of 64 f32 = 1 MiB + 256 bytes of tensor alone

    async def bad():
        async with raw_client(small_frame_swarm.urls[0]) as client:
            await _authenticated(small_frame_swarm, client, job)
            seq = client.next_seq()
            data = raw_frame(
                forward_header(seq, job, [["s0", 0, 0, rows]], rows=rows, hidden=HIDDEN),
                b"\x00" * (rows * HIDDEN * 4),
            )
            await client.send_raw(data)
            error = await client.recv()
            pong = await client.ping(5)
            return seq, len(data), error, pong

    seq, size, error, pong = _around_live_session(small_frame_swarm, small_reference, bad)

    limit = MAX_FRAME_MB * 1024 * 1024
    assert size > limit
    assert error == wire.Error("too_large", f"frame of {size} bytes exceeds the limit of {limit}", ref=seq)
    assert (type(pong), pong.nonce, pong.info["sessions"]) == (wire.Pong, 5, 1)


def test_a_frame_over_twice_the_limit_closes_only_its_own_connection(small_frame_swarm, small_reference):
    job = _job("raw")

    async def bad():
        async with raw_client(small_frame_swarm.urls[0]) as client:
            await _authenticated(small_frame_swarm, client, job)
            await client.send_raw(wire.encode(wire.Ping(1), client.next_seq()) + b"\x00" * (2 * 1024 * 1024))
            with pytest.raises(ConnectionClosed) as closed:
                await client.recv()
            return closed.value

    closed = _around_live_session(small_frame_swarm, small_reference, bad)

    assert closed.rcvd is not None
    assert closed.rcvd.code == 1009  # message too big


def test_a_replayed_connection_seq_is_refused_and_the_next_seq_is_served(tiny_swarm, tiny_reference):
    job = _job("raw")

    async def bad():
        async with raw_client(tiny_swarm.urls[0]) as client:
            await _authenticated(tiny_swarm, client, job)  # seq 1
            await client.send(wire.Ping(11), seq=1)
            replayed = await client.recv()
            await client.send(wire.Ping(12), seq=5)
            ahead = await client.recv()
            await client.send(wire.Ping(13), seq=3)
            backwards = await client.recv()
            await client.send(wire.Ping(14), seq=6)
            after = await client.recv()
            return replayed, ahead, backwards, after

    replayed, ahead, backwards, after = _around_live_session(tiny_swarm, tiny_reference, bad)

    assert replayed == wire.Error("replayed_seq", "seq 1 is not above 1", ref=1)
    assert (type(ahead), ahead.nonce) == (wire.Pong, 12)  # gaps are allowed, only going back is not
    assert backwards == wire.Error("replayed_seq", "seq 3 is not above 5", ref=3)
    assert (type(after), after.nonce) == (wire.Pong, 14)


def test_a_replayed_session_step_is_refused_and_leaves_the_session_untouched(tiny_swarm, tiny_reference):
    job = _job("raw")
    prompt, nxt = _hidden(3, seed=1), _hidden(1, seed=2)

    async def bad():
        async with raw_client(tiny_swarm.urls[0]) as client:
            await _authenticated(tiny_swarm, client, job)
            await client.send(wire.Open(job, ("r", "clean")))
            assert await client.recv() == wire.Open(job, ("r", "clean"))
            await client.send(_forward(job, [wire.Item("r", 0, 0, 3)], prompt))
            assert isinstance(await client.recv(), wire.Result)
            replay_seq = await client.send(_forward(job, [wire.Item("r", 0, 0, 3)], prompt))
            replayed = await client.recv()
            gap_seq = await client.send(_forward(job, [wire.Item("r", 2, 3, 1)], nxt))
            gap = await client.recv()
            await client.send(_forward(job, [wire.Item("r", 1, 3, 1)], nxt))
            continued = await client.recv()
            await client.send(_forward(job, [wire.Item("clean", 0, 0, 3)], prompt))
            await client.recv()
            await client.send(_forward(job, [wire.Item("clean", 1, 3, 1)], nxt))
            clean = await client.recv()
            return replay_seq, replayed, gap_seq, gap, continued, clean

    replay_seq, replayed, gap_seq, gap, continued, clean = _around_live_session(tiny_swarm, tiny_reference, bad)

    assert replayed == wire.Error(
        "replayed_seq", "session 'r' expects step 1, got 0", ref=replay_seq, job=job, session="r"
    )
    assert gap == wire.Error("step_gap", "session 'r' expects step 1, got 2", ref=gap_seq, job=job, session="r")
    assert unsigned(continued.items) == (wire.Item("r", 1, 3, 1),)
    assert continued.payload == clean.payload  # byte for byte what an undisturbed session computes


def test_a_forward_before_hello_is_refused_and_hello_still_works_after(tiny_swarm, tiny_reference):
    job = _job("raw")

    async def bad():
        async with raw_client(tiny_swarm.urls[0]) as client:
            seq = await client.send(_forward(job, [wire.Item("s0", 0, 0, 1)], _hidden(1)))
            refused = await client.recv()
            hello = await client.hello(job, tiny_swarm.tickets(job)[0], key=tiny_swarm.coordinator_key(job))
            return seq, refused, hello

    seq, refused, hello = _around_live_session(tiny_swarm, tiny_reference, bad)

    assert refused == wire.Error(
        "ticket_missing", "send HELLO with a job ticket first", ref=seq, job=job, session="s0", fatal=False
    )
    assert (type(hello), hello.role, hello.job) == (wire.Hello, "stage", job)


def test_an_open_before_hello_is_refused(tiny_swarm, tiny_reference):
    job = _job("raw")

    async def bad():
        async with raw_client(tiny_swarm.urls[0]) as client:
            seq = await client.send(wire.Open(job, ("s0",)))
            refused = await client.recv()
            pong = await client.ping(3)
            return seq, refused, pong

    seq, refused, pong = _around_live_session(tiny_swarm, tiny_reference, bad)

    assert refused == wire.Error("ticket_missing", "send HELLO with a job ticket first", ref=seq, job=job, session="s0")
    assert (type(pong), pong.info["sessions"]) == (wire.Pong, 1)


async def _refused_hello(url: str, job: str, ticket: bytes | None, role: str = "coordinator"):
    """Send one HELLO; return its ERROR and the exception that closing the connection raised."""
    async with raw_client(url) as client:
        await client.send(wire.Hello(job=job, role=role, ticket=ticket))
        error = await client.recv()
        with pytest.raises(ConnectionClosed) as closed:
            await client.recv()
        return error, closed.value


def test_hello_without_a_ticket_is_refused_and_the_connection_closed(tiny_swarm, tiny_reference):
    job = _job("raw")

    error, closed = _around_live_session(
        tiny_swarm, tiny_reference, lambda: _refused_hello(tiny_swarm.urls[0], job, None)
    )

    assert error == wire.Error(
        "ticket_missing",
        "HELLO carries no job ticket and this agent is not --insecure-open",
        ref=1,
        job=job,
        fatal=True,
    )
    assert closed.rcvd is not None
    assert closed.rcvd.code == 1000


def test_hello_with_a_ticket_from_an_untrusted_issuer_is_refused(tiny_swarm, tiny_reference):
    job = _job("raw")
    stranger = SigningKey(b"\x07" * 32)
    agent = tiny_swarm.agents[0]
    ticket = issue_ticket(
        stranger,
        job=job,
        node=agent.node,
        model=MODEL,
        layer_start=agent.layer_start,
        layer_end=agent.layer_end,
        coordinator_key=bytes(tiny_swarm.coordinator_key(job).verify_key),
    )

    error, closed = _around_live_session(
        tiny_swarm, tiny_reference, lambda: _refused_hello(tiny_swarm.urls[0], job, ticket)
    )

    message = f"ticket is signed by an untrusted key {bytes(stranger.verify_key).hex()}"
    assert error == wire.Error("ticket_untrusted", message, ref=1, job=job, fatal=True)
    assert closed.rcvd is not None


def test_hello_with_an_expired_ticket_is_refused(tiny_swarm, tiny_reference):
    job = _job("raw")
    agent = tiny_swarm.agents[0]
    issued = time.time() - 120
    ticket = issue_ticket(
        tiny_swarm.issuer_key,
        job=job,
        node=agent.node,
        model=MODEL,
        layer_start=agent.layer_start,
        layer_end=agent.layer_end,
        coordinator_key=bytes(tiny_swarm.coordinator_key(job).verify_key),
        ttl_s=60,
        now=issued,
    )

    error, closed = _around_live_session(
        tiny_swarm, tiny_reference, lambda: _refused_hello(tiny_swarm.urls[0], job, ticket)
    )

    assert (error.code, error.ref, error.job, error.session, error.fatal) == ("ticket_expired", 1, job, None, True)
    assert error.message.startswith(f"ticket expired at {issued + 60:.3f}, now is ")
    assert closed.rcvd is not None


def _ticket(swarm: LocalSwarm, job: str, **changes) -> bytes:
    agent = swarm.agents[0]
    fields = {
        "job": job,
        "node": agent.node,
        "model": MODEL,
        "layer_start": agent.layer_start,
        "layer_end": agent.layer_end,
        "coordinator_key": bytes(swarm.coordinator_key(job).verify_key),
        **changes,
    }
    return issue_ticket(swarm.issuer_key, **fields)


@pytest.mark.parametrize("mismatch", ["other_node", "other_span", "other_job", "other_model"])
def test_hello_with_a_ticket_for_someone_else_is_refused_as_mismatch(tiny_swarm, tiny_reference, mismatch):
    job = _job("raw")
    agent = tiny_swarm.agents[0]
    ticket, message = {
        "other_node": (
            tiny_swarm.tickets(job)[1],
            f"ticket is for node {tiny_swarm.agents[1].node!r}, this agent is {agent.node!r}",
        ),
        "other_span": (
            _ticket(tiny_swarm, job, layer_end=3),
            "ticket is for layers [0, 3), this agent serves [0, 2)",
        ),
        "other_job": (
            _ticket(tiny_swarm, "another-job"),
            f"ticket is for job 'another-job', HELLO says {job!r}",
        ),
        "other_model": (
            _ticket(tiny_swarm, job, model="smollm2-135m"),
            "ticket is for model 'smollm2-135m', this agent is 'tiny-llama'",
        ),
    }[mismatch]

    error, closed = _around_live_session(
        tiny_swarm, tiny_reference, lambda: _refused_hello(tiny_swarm.urls[0], job, ticket)
    )

    assert error == wire.Error("ticket_mismatch", message, ref=1, job=job, fatal=True)
    assert closed.rcvd is not None


def test_a_forward_for_an_unknown_session_is_refused(tiny_swarm, tiny_reference):
    job = _job("raw")

    async def bad():
        async with raw_client(tiny_swarm.urls[0]) as client:
            await _authenticated(tiny_swarm, client, job)
            seq = await client.send(_forward(job, [wire.Item("ghost", 0, 0, 2)], _hidden(2)))
            error = await client.recv()
            pong = await client.ping(8)
            return seq, error, pong

    seq, error, pong = _around_live_session(tiny_swarm, tiny_reference, bad)

    assert error == wire.Error(
        "unknown_session", f"unknown session 'ghost' of job {job!r}", ref=seq, job=job, session="ghost"
    )
    assert (type(pong), pong.info["sessions"]) == (wire.Pong, 1)


def test_a_connection_cannot_reach_the_live_jobs_session(tiny_swarm, tiny_reference):
    job, live_job = _job("raw"), _job("live")

    async def bad():
        async with raw_client(tiny_swarm.urls[0]) as client:
            await _authenticated(tiny_swarm, client, job)
            # The live coordinator's first session is "s0"; this would be its next step.
            seq = await client.send(_forward(live_job, [wire.Item("s0", TOKENS_BEFORE, 0, 1)], _hidden(1)))
            return seq, await client.recv()

    seq, error = _around_live_session(tiny_swarm, tiny_reference, bad, job=live_job)

    assert error == wire.Error(
        "wrong_job",
        f"this connection is bound to job {job!r}, not {live_job!r}",
        ref=seq,
        job=live_job,
        session="s0",
    )


def test_a_peer_may_not_open_sessions_and_only_the_peer_hears_of_it(tiny_swarm, tiny_reference):
    job = _job("raw")

    async def bad():
        async with raw_client(tiny_swarm.urls[1]) as coordinator, raw_client(tiny_swarm.urls[1]) as peer:
            await _authenticated(tiny_swarm, coordinator, job, agent=1)
            peer_pass = issue_peer_pass(tiny_swarm.coordinator_key(job), tiny_swarm.tickets(job)[1])
            reply = await peer.hello(job, peer_pass, role="peer", topology="ring")
            assert (type(reply), reply.role) == (wire.Hello, "stage")
            seq = await peer.send(wire.Open(job, ("x",)))
            error = await peer.recv()  # a ring peer's bad frame is answered to the peer alone
            peer_pong = await peer.ping(1)
            coordinator_pong = await coordinator.ping(2)  # the first frame the coordinator gets
            return seq, error, peer_pong, coordinator_pong

    seq, error, peer_pong, coordinator_pong = _around_live_session(tiny_swarm, tiny_reference, bad)

    assert error == wire.Error(
        "not_allowed", "a peer stage may only send FORWARD, not Open", ref=seq, job=job, session="x"
    )
    assert (type(peer_pong), peer_pong.nonce) == (wire.Pong, 1)  # nothing was queued before it
    assert (type(coordinator_pong), coordinator_pong.nonce, coordinator_pong.info["sessions"]) == (wire.Pong, 2, 1)


def test_a_second_peer_connection_under_another_signature_is_refused_and_reported_with_its_proof(
    tiny_swarm, tiny_reference
):
    job = _job("raw")
    # The pass names its sender, as every pass the control plane's coordinators issue does.
    sender = SigningKey.generate()

    async def bad():
        peer_pass = issue_peer_pass(
            tiny_swarm.coordinator_key(job), tiny_swarm.tickets(job)[1], bytes(sender.verify_key)
        )
        first_proof = peer_proof(sender, peer_pass)
        second_proof = another_signature(sender, PEER_CONTEXT + hashlib.sha256(peer_pass).digest())
        async with raw_client(tiny_swarm.urls[1]) as coordinator, raw_client(tiny_swarm.urls[1]) as first:
            await _authenticated(tiny_swarm, coordinator, job, agent=1)
            unproven = await _hello_reply(tiny_swarm.urls[1], job, peer_pass, role="peer")
            accepted = await first.hello(job, peer_pass, role="peer", topology="ring", proof=first_proof)
            async with raw_client(tiny_swarm.urls[1]) as second_client:
                second = await second_client.hello(job, peer_pass, role="peer", topology="ring", proof=second_proof)
            report = await coordinator.recv()  # the stage hands the coordinator both proofs, to judge
            first_pong = await first.ping(1)  # the first connection stays
            return peer_pass, unproven, accepted, second, report, first_pong

    peer_pass, unproven, accepted, second, report, first_pong = _around_live_session(tiny_swarm, tiny_reference, bad)

    assert (type(unproven), unproven.code, unproven.fatal) == (wire.Error, "peer_unproven", True)
    assert (type(accepted), accepted.role) == (wire.Hello, "stage")
    message = f"job {job!r}'s ring peer opened a second connection under another signature of its pass"
    assert second == wire.Error("peer_twice", message, ref=1, job=job, fatal=True)  # the evidence is not its own
    assert (type(report), report.code, report.job, report.fatal) == (wire.Error, "peer_twice", job, False)
    assert proves_second_connection(bytes(sender.verify_key), peer_pass, report.evidence)
    assert (type(first_pong), first_pong.nonce) == (wire.Pong, 1)


def test_the_same_peer_proof_again_is_a_reconnect_that_replaces_the_first_connection(tiny_swarm, tiny_reference):
    job = _job("raw")
    sender = SigningKey.generate()

    async def reconnect():
        peer_pass = issue_peer_pass(
            tiny_swarm.coordinator_key(job), tiny_swarm.tickets(job)[1], bytes(sender.verify_key)
        )
        proof = peer_proof(sender, peer_pass)
        async with raw_client(tiny_swarm.urls[1]) as coordinator, raw_client(tiny_swarm.urls[1]) as first:
            await _authenticated(tiny_swarm, coordinator, job, agent=1)
            await first.hello(job, peer_pass, role="peer", topology="ring", proof=proof)
            async with raw_client(tiny_swarm.urls[1]) as again:
                accepted = await again.hello(job, peer_pass, role="peer", topology="ring", proof=proof)
                await asyncio.wait_for(first.ws.wait_closed(), 10)  # the stage dropped the old one
                pong = await again.ping(1)
                coordinator_pong = await coordinator.ping(2)  # nothing was reported
            return accepted, pong, coordinator_pong

    accepted, pong, coordinator_pong = _around_live_session(tiny_swarm, tiny_reference, reconnect)

    assert (type(accepted), accepted.role) == (wire.Hello, "stage")
    assert (type(pong), pong.nonce) == (wire.Pong, 1)
    assert (type(coordinator_pong), coordinator_pong.nonce) == (wire.Pong, 2)


def test_a_connection_stays_usable_after_a_refused_frame(tiny_swarm, tiny_reference):
    job = _job("raw")
    prompt = _hidden(4, seed=3)

    async def bad():
        async with raw_client(tiny_swarm.urls[0]) as client:
            await _authenticated(tiny_swarm, client, job)
            seq = client.next_seq()
            await client.send_raw(
                raw_frame(
                    forward_header(seq, job, [["s0", 0, 0, 4]], rows=4, hidden=HIDDEN, dtype="f64"),
                    prompt.double().numpy().tobytes(),
                )
            )
            refused = await client.recv()
            await client.send(wire.Open(job, ("s0",)))
            opened = await client.recv()
            await client.send(_forward(job, [wire.Item("s0", 0, 0, 4)], prompt))
            result = await client.recv()
            return refused, opened, result

    refused, opened, result = _around_live_session(tiny_swarm, tiny_reference, bad)

    assert refused.code == "bad_dtype"
    assert opened == wire.Open(job, ("s0",))
    assert type(result) is wire.Result
    assert (result.job, unsigned(result.items), result.dtype, result.shape) == (
        job,
        (wire.Item("s0", 0, 0, 4),),
        "f32",
        (4, HIDDEN),
    )
    agent = tiny_swarm.agents[0]
    block = Block(models.load_block(MODEL, agent.layer_start, agent.layer_end))
    (expected,) = block.forward([WorkItem(SessionStore(SessionLimits()).open(job, "s0"), 0, prompt)])
    torch.testing.assert_close(result.tensor(), expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_an_open_refused_for_one_of_its_sessions_leaves_the_others_openable(tiny_swarm, tiny_reference):
    job = _job("raw")

    async def bad():
        async with raw_client(tiny_swarm.urls[0]) as client:
            await _authenticated(tiny_swarm, client, job)
            await client.send(wire.Open(job, ("b",)))
            assert await client.recv() == wire.Open(job, ("b",))
            seq = await client.send(wire.Open(job, ("a", "b")))
            refused = await client.recv()
            await client.send(wire.Open(job, ("a",)))
            retried = await client.recv()
            return seq, refused, retried

    seq, refused, retried = _around_live_session(tiny_swarm, tiny_reference, bad)

    assert (refused.code, refused.ref, refused.job) == ("session_exists", seq, job)
    assert refused.message == f"session 'b' of job {job!r} is already open"
    assert retried == wire.Open(job, ("a",))  # the refused OPEN opened nothing and used up nothing


def test_a_close_refused_for_one_of_its_sessions_closes_none_of_them(tiny_swarm, tiny_reference):
    job = _job("raw")

    async def bad():
        async with raw_client(tiny_swarm.urls[0]) as client:
            await _authenticated(tiny_swarm, client, job)
            await client.send(wire.Open(job, ("a",)))
            await client.recv()
            await client.send(_forward(job, [wire.Item("a", 0, 0, 2)], _hidden(2)))
            assert isinstance(await client.recv(), wire.Result)
            seq = await client.send(wire.Close(job, ("a", "ghost")))
            refused = await client.recv()
            await client.send(wire.Close(job, ("a",)))
            closed = await client.recv()
            return seq, refused, closed

    seq, refused, closed = _around_live_session(tiny_swarm, tiny_reference, bad)

    assert (refused.code, refused.ref, refused.job, refused.message) == (
        "unknown_session",
        seq,
        job,
        f"unknown session 'ghost' of job {job!r}",
    )
    assert isinstance(closed, wire.Close), closed  # the receipt of "a" was not lost with the refused CLOSE
    assert [(r["session"], r["steps"], r["tokens"]) for r in closed.receipts] == [("a", 1, 2)]


def test_one_frame_with_a_new_session_and_a_running_one_is_served(tiny_swarm, tiny_reference):
    # A coordinator coalesces concurrent sessions' steps into one FORWARD: here a one-token
    # prompt of a new session next to a one-token decode step of a session with a cache.
    job = _job("raw")
    prompt, new_token, old_token = _hidden(3, seed=4), _hidden(1, seed=5), _hidden(1, seed=6)

    async def bad():
        async with raw_client(tiny_swarm.urls[0]) as client:
            await _authenticated(tiny_swarm, client, job)
            await client.send(wire.Open(job, ("old", "new")))
            await client.recv()
            await client.send(_forward(job, [wire.Item("old", 0, 0, 3)], prompt))
            assert isinstance(await client.recv(), wire.Result)
            items = [wire.Item("new", 0, 0, 1), wire.Item("old", 1, 3, 1)]
            await client.send(_forward(job, items, torch.cat([new_token, old_token])))
            return await client.recv()

    reply = _around_live_session(tiny_swarm, tiny_reference, bad)

    assert isinstance(reply, wire.Result), reply
    assert unsigned(reply.items) == (wire.Item("new", 0, 0, 1), wire.Item("old", 1, 3, 1))
    agent = tiny_swarm.agents[0]
    block = Block(models.load_block(MODEL, agent.layer_start, agent.layer_end))
    store = SessionStore(SessionLimits())
    new, old = store.open(job, "new"), store.open(job, "old")
    block.forward([WorkItem(old, 0, prompt)])
    expected = torch.cat(
        [block.forward([WorkItem(new, 0, new_token)])[0], block.forward([WorkItem(old, 3, old_token)])[0]]
    )
    torch.testing.assert_close(reply.tensor(), expected, rtol=0, atol=1e-5 * expected.abs().max().item())


# Tickets bound to the job: a ticket is not a bearer token, and a successor's pass only forwards


async def _hello_reply(url: str, job: str, ticket: bytes, *, role: str = "coordinator", key=None) -> wire.Message:
    async with raw_client(url) as client:
        return await client.hello(job, ticket, role=role, key=key)


def _ticket_for(swarm: LocalSwarm, job: str, agent: int, coordinator: SigningKey) -> bytes:
    stage = swarm.agents[agent]
    return issue_ticket(
        swarm.issuer_key,
        job=job,
        node=stage.node,
        model=MODEL,
        layer_start=stage.layer_start,
        layer_end=stage.layer_end,
        coordinator_key=bytes(coordinator.verify_key),
    )


def test_a_stolen_coordinator_ticket_without_the_coordinator_key_is_refused(tiny_swarm, tiny_reference):
    live_job = _job("live")
    thief = SigningKey(b"\x09" * 32)

    async def bad():
        stolen = tiny_swarm.tickets(live_job)[2]
        bare = await _hello_reply(tiny_swarm.urls[2], live_job, stolen)
        forged = await _hello_reply(tiny_swarm.urls[2], live_job, stolen, key=thief)
        return bare, forged

    bare, forged = _around_live_session(tiny_swarm, tiny_reference, bad, job=live_job)

    assert bare == wire.Error(
        "proof_missing",
        "HELLO as coordinator carries no proof of the job's coordinator key",
        ref=1,
        job=live_job,
        fatal=True,
    )
    assert forged == wire.Error(
        "proof_invalid",
        "coordinator proof is not signed by the coordinator key the ticket names",
        ref=1,
        job=live_job,
        fatal=True,
    )


def test_a_second_coordinator_with_another_key_cannot_take_over_a_live_job(tiny_swarm, tiny_reference):
    live_job = _job("live")
    usurper = SigningKey(b"\x0a" * 32)

    async def bad():
        # A ticket of its own for the live job (as a second issuance would be), proven with its own key,
        # to the last stage, whose outputs are the job's results.
        ticket = _ticket_for(tiny_swarm, live_job, 2, usurper)
        return await _hello_reply(tiny_swarm.urls[2], live_job, ticket, key=usurper)

    # The live session finishes with the reference tokens: its results kept going to its coordinator.
    refused_hello = _around_live_session(tiny_swarm, tiny_reference, bad, job=live_job)

    assert refused_hello == wire.Error(
        "job_taken", f"job {live_job!r} is live here under another coordinator key", ref=1, job=live_job, fatal=True
    )


def test_a_successor_pass_only_forwards_and_dies_with_its_job(tiny_swarm):
    job = _job("raw")
    key = tiny_swarm.coordinator_key(job)
    # What the coordinator handed stage 0 in HELLO for its ring successor, stage 1.
    successor_pass = issue_peer_pass(key, tiny_swarm.tickets(job)[1])

    async def scenario():
        async with raw_client(tiny_swarm.urls[1]) as coordinator:
            await _authenticated(tiny_swarm, coordinator, job, agent=1)
            as_coordinator = await _hello_reply(tiny_swarm.urls[1], job, successor_pass)
            async with raw_client(tiny_swarm.urls[1]) as peer:
                accepted = await peer.hello(job, successor_pass, role="peer", topology="ring")
                seq = await peer.send(wire.Open(job, ("mine",)))
                refused_open = await peer.recv()  # a ring peer's bad frame is answered to the peer alone
        # The coordinator has left: the job is over on the stage.
        await asyncio.sleep(0.5)
        after_peer = await _hello_reply(tiny_swarm.urls[1], job, successor_pass, role="peer")
        after_coordinator = await _hello_reply(tiny_swarm.urls[1], job, successor_pass)
        return as_coordinator, accepted, seq, refused_open, after_peer, after_coordinator

    as_coordinator, accepted, seq, refused_open, after_peer, after_coordinator = _run(scenario())

    untrusted = f"ticket is signed by an untrusted key {bytes(key.verify_key).hex()}"
    assert as_coordinator == wire.Error("ticket_untrusted", untrusted, ref=1, job=job, fatal=True)
    assert (type(accepted), accepted.role) == (wire.Hello, "stage")
    assert refused_open == wire.Error(
        "not_allowed", "a peer stage may only send FORWARD, not Open", ref=seq, job=job, session="mine"
    )
    assert after_peer == wire.Error(
        "unknown_job", f"no coordinator has opened job {job!r} here", ref=1, job=job, fatal=True
    )
    assert after_coordinator == wire.Error("ticket_untrusted", untrusted, ref=1, job=job, fatal=True)


def test_a_ticket_past_its_jobs_deadline_is_refused(tiny_swarm):
    job = _job("raw")
    key = tiny_swarm.coordinator_key(job)
    stage = tiny_swarm.agents[0]
    deadline = time.time() - 1  # the job's timeout (plus margin) has passed
    ticket = issue_ticket(
        tiny_swarm.issuer_key,
        job=job,
        node=stage.node,
        model=MODEL,
        layer_start=stage.layer_start,
        layer_end=stage.layer_end,
        coordinator_key=bytes(key.verify_key),
        expires_at=deadline,
    )

    error = _run(_hello_reply(tiny_swarm.urls[0], job, ticket, key=key))

    assert (error.code, error.job, error.fatal) == ("ticket_expired", job, True)
    assert error.message.startswith(f"ticket expired at {deadline:.3f}, now is ")
