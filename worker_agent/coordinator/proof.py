"""What the coordinator takes on trust from no stage: the route's identity, and each session's receipts.

``check_route`` checks the stages' HELLOs: the model, and spans that tile the model's layers.
``prove_session`` closes a finished session everywhere and proves its work with the receipts.
``own_receipts`` takes what each stage answered CLOSE with and keeps the receipts that are their
signers' own; ``verify_session`` proves a session's work with them (``verify_job``) against the
route's assignments and the coordinator's own transcript, and returns them in route order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from worker_agent.coordinator.pipeline import AuditGap, CloseIncomplete, Pipeline
from worker_agent.errors import ReceiptError, StageError
from worker_agent.protocol.audit import AuditMaterial
from worker_agent.protocol.coverage import JobVerification, verify_job
from worker_agent.protocol.keys import node_id
from worker_agent.protocol.prefix import PrefixKey
from worker_agent.protocol.receipts import (
    BadSignature,
    MalformedReceipt,
    MissingReceipt,
    Receipt,
    SessionTranscript,
    StageAssignment,
)


@dataclass
class Proof:
    """What a closed session proved: its receipts (its signers' own, in route order once verified),
    the verification or why it failed and on whom, and its audit material."""

    receipts: list[Receipt] = field(default_factory=list)
    verification: JobVerification | None = None
    error: str = ""  # why the receipts failed verification (non-strict only)
    culprit: str | None = None  # the node that failure is unambiguously on, if any
    audits: list[AuditMaterial] = field(default_factory=list)
    audit_missing: list[AuditGap] = field(default_factory=list)


async def prove_session(
    pipeline: Pipeline,
    session: str,
    *,
    strict: bool,
    model: str,
    n_layers: int,
    keep: Mapping[str, tuple[PrefixKey, ...]] | None = None,
) -> Proof:
    """Close ``session`` on every stage (``keep``: the prefix keys its stages may keep its KV
    under), take its receipts and audit material, and verify them: a failure raises (``strict``),
    or is reported in the proof with its culprit."""
    proof, closed, replies, partial = Proof(), False, None, None
    try:
        try:
            replies = await pipeline.close_by_stage([session], keep)
            closed = True
        except StageError as exc:
            # Every token is out, and a stage's receipt did not come: its session was gone, or its
            # connection dropped or went silent before it answered CLOSE. The client has its
            # answer; the job cannot be verified, and the stage that owed the receipt is its
            # culprit (none when no stage answered: then the coordinator's own link is likelier).
            if strict:
                raise
            proof.error = f"{exc} (lost before it sent its receipt; {exc.code})"
            proof.culprit = pipeline.node_at(exc.stage) if exc.stage is not None else None
            partial = exc.replies if isinstance(exc, CloseIncomplete) else None
        proof.audits, proof.audit_missing = await pipeline.take_audits(session)
        if partial is not None:  # the receipts that did come are the others' proof of their part
            proof.receipts, _ = own_receipts(pipeline, session, partial)
        if replies is not None:
            proof.receipts, refused = own_receipts(pipeline, session, replies)
            try:
                if refused is not None:
                    raise refused
                proof.receipts, proof.verification = verify_session(
                    pipeline, session, proof.receipts, model=model, n_layers=n_layers
                )
            except ReceiptError as exc:
                if strict:
                    raise
                # The receipts that are their signers' own stay: they are the evidence that
                # decides the failure, and pay the stages whose work still verifies.
                proof.error, proof.culprit = f"{exc} ({exc.code})", exc.node
    finally:
        pipeline.forget(session)
        if not closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pipeline.close([session]), 5)
    return proof


def check_route(pipeline: Pipeline, infos: list[dict], *, model: str, n_layers: int) -> None:
    """The stages must serve this model and cover its layers in order, without gap or overlap.
    Without the control plane's assignments, the stages' own HELLOs become the route's."""
    position = 0
    for index, info in enumerate(infos):
        if info.get("model") != model:
            raise StageError(
                f"stage {index} serves {info.get('model')!r}, not {model!r}", code="wrong_model", stage=index
            )
        if info.get("layer_start") != position:
            raise StageError(
                f"stage {index} starts at layer {info.get('layer_start')}, expected {position}",
                code="bad_route",
                stage=index,
            )
        if node_id(bytes.fromhex(info["node_key"])) != info.get("node"):
            raise StageError(f"stage {index} reports a node id that is not its key's", code="bad_route", stage=index)
        position = info["layer_end"]
    if position != n_layers:
        raise StageError(f"the stages cover layers 0:{position} of {n_layers}", code="bad_route")
    if pipeline.assignments is None:  # no control plane: the stages' own HELLO is all there is to go by
        pipeline.assignments = [StageAssignment.from_json(info) for info in infos]


def own_receipts(
    pipeline: Pipeline, session: str, replies: list[tuple[dict, ...]]
) -> tuple[list[Receipt], ReceiptError | None]:
    """The stages' receipts for the session, in route order, and the first refusal: each stage's
    CLOSE reply must hold exactly its own receipt, readable and validly signed; anything else is
    that stage's doing (the ReceiptError names its node) and leaves its receipt out."""
    assignments = pipeline.assignments or []
    receipts: list[Receipt] = []
    refused: ReceiptError | None = None
    for index, reply in enumerate(replies):
        node = assignments[index].node if index < len(assignments) else None
        where = f"stage {index} (node {node})"
        try:
            try:
                decoded = [Receipt.from_dict(raw) for raw in reply]
            except ReceiptError as exc:
                raise MalformedReceipt(f"{where} sent an unreadable receipt: {exc}", node=node) from None
            if len(decoded) != 1 or (decoded[0].session, decoded[0].node) != (session, node):
                raise MissingReceipt(f"{where} did not send its own receipt for session {session!r}", node=node)
            try:
                decoded[0].verify_signature()
            except ReceiptError as exc:
                raise BadSignature(f"{where}: {exc}", node=node) from None
        except ReceiptError as exc:
            refused = refused or exc
            continue
        receipts.append(decoded[0])
    return receipts, refused


def verify_session(
    pipeline: Pipeline, session: str, receipts: list[Receipt], *, model: str, n_layers: int
) -> tuple[list[Receipt], JobVerification]:
    """The session's receipts in route order (stage 0 first), once they prove its work; raises a
    ReceiptError subclass otherwise. The control plane stores them in this order and its audits
    find a stage's receipt by position.

    A healed request is proven by its last session alone: the route it healed onto re-ran the
    prompt and every committed token, so that session's receipts cover every layer of every
    position exactly once, each by the node assigned it on the healed route. The session it
    left is not verified: its dead stage never signed for it."""
    transcript = pipeline.transcripts[session]
    assignments = pipeline.assignments or []
    verification = verify_job(
        job=pipeline.job,
        model=model,
        n_layers=n_layers,
        assignments=assignments,
        receipts=receipts,
        transcripts=[SessionTranscript(session, tuple(transcript.sent), tuple(transcript.received), transcript.start)],
    )
    # Verified: each assigned node signed exactly one receipt for this session.
    position = {assignment.node: index for index, assignment in enumerate(assignments)}
    return sorted(receipts, key=lambda receipt: position[receipt.node]), verification
