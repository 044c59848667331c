"""A seeded challenge run as an ordinary session of a job, over the data plane.

The control plane acts as the job's coordinator: it HELLOs the node's data plane with a ticket it
signed for a job id shaped like a real one (naming a coordinator key made for it, which the HELLO
proves, as every job's coordinator does), OPENs one session, sends the challenge input
(``challenge.challenge_input``) as a prefill FORWARD followed by single-token decode steps, as a
generating session does, CLOSEs it and checks the stage's signed receipt against exactly the bytes
sent and received. The node sees a job's session; nothing on the wire names it a challenge::

    run = await run_challenge_session(url, ticket, coordinator_key=key, job="chatcmpl-...", model="tiny-llama",
                                      assignment=StageAssignment(...), seed=7, tokens=8, timeout_s=30)
    run.output  # (tokens, hidden) float32: compare it with the trusted recompute

Any failure raises: ``StageError`` (unreachable, refused HELLO, an ERROR frame, a stall or the
deadline), ``ReceiptError`` (no receipt, a bad signature, hashes that do not match the traffic) or
``ChallengeError`` (a malformed output). A session past ``timeout_s`` is a ``StageError`` with
code ``DEADLINE``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass

import torch
from nacl.signing import SigningKey

from worker_agent import wire
from worker_agent.challenge import challenge_input, session_steps
from worker_agent.coordinator.pipeline import Pipeline, StageSpec
from worker_agent.coverage import verify_stage_session
from worker_agent.errors import ChallengeError, StageError
from worker_agent.receipts import Receipt, SessionTranscript, StageAssignment

WIRE_DTYPE = "f32"  # the dtype a job's coordinator sends (Pipeline's default)
DEADLINE = "challenge_deadline"  # the StageError code of a session that did not end in time


@dataclass(frozen=True)
class ChallengeRun:
    output: torch.Tensor  # (tokens, hidden) float32: every step's RESULT rows, in order
    elapsed_s: float  # from the first FORWARD sent to the last RESULT received, on this side's clock
    receipt: Receipt  # the stage's signed receipt for the session, verified against the traffic


async def run_challenge_session(
    url: str,
    ticket: bytes,
    *,
    coordinator_key: SigningKey,
    job: str,
    model: str,
    hidden_size: int,
    assignment: StageAssignment,
    seed: int,
    tokens: int,
    timeout_s: float,
    tls: ssl.SSLContext | None = None,
) -> ChallengeRun:
    """Run challenge (seed, tokens) through the stage at ``url`` as one session of ``job``, as the
    coordinator holding ``coordinator_key`` (the key ``ticket`` names); the whole exchange, from
    connecting to the receipt, must end within ``timeout_s``. With the swarm's client context
    ``tls`` a wss:// stage must show the certificate of the assigned node (``Pipeline``)."""
    inputs = challenge_input(seed, tokens, hidden_size)  # (tokens, hidden) float32
    pipeline = Pipeline(
        job,
        [StageSpec(url, ticket, node=assignment.node)],
        topology="star",
        dtype=WIRE_DTYPE,
        stall_timeout_s=timeout_s,
        model=model,
        hidden_size=hidden_size,
        coordinator_key=coordinator_key,
        tls=tls,
    )
    try:
        return await asyncio.wait_for(_exchange(pipeline, job, model, assignment, inputs), timeout_s)
    except TimeoutError:
        raise StageError(
            "the stage did not finish the session by the challenge's deadline", code=DEADLINE, stage=0
        ) from None
    finally:
        await pipeline.aclose()


async def _exchange(
    pipeline: Pipeline, job: str, model: str, assignment: StageAssignment, inputs: torch.Tensor
) -> ChallengeRun:
    await pipeline.connect()
    session = pipeline.new_session_id()
    await pipeline.open([session])
    rows: list[bytes] = []
    started = time.perf_counter()
    for start, count in session_steps(inputs.shape[0]):
        payload = wire.tensor_payload(inputs[start : start + count], WIRE_DTYPE)
        rows.append(await pipeline.forward(session, start, count, payload))
    elapsed = time.perf_counter() - started
    receipts = await pipeline.close([session])
    transcript = pipeline.transcripts[session]
    if len(receipts) != 1:
        raise StageError(f"the stage sent {len(receipts)} receipts for one session", code="bad_receipt", stage=0)
    receipt = Receipt.from_dict(receipts[0])
    verify_stage_session(
        job=job,
        model=model,
        assignment=assignment,
        receipt=receipt,
        transcript=SessionTranscript(session, tuple(transcript.sent), tuple(transcript.received)),
    )
    data = b"".join(rows)
    expected = inputs.numel() * wire.DTYPES[WIRE_DTYPE].itemsize
    if len(data) != expected:
        raise ChallengeError(f"the stage returned {len(data)} bytes, {expected} expected", code="challenge_malformed")
    output = torch.frombuffer(bytearray(data), dtype=wire.DTYPES[WIRE_DTYPE]).reshape(inputs.shape)
    return ChallengeRun(output.to(torch.float32), elapsed, receipt)  # (tokens, hidden)
