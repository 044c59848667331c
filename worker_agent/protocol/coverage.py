"""Verifying a job's receipts against its plan and the coordinator's transcripts: coverage and links.

``verify_job`` fails closed: every signature valid and by the node assigned that span; the spans
tile ``[0, n_layers)`` with no gap or overlap; every stage has the same steps; stage k's output
hash at step i equals stage k+1's input hash at step i; the first input and the last output match
what the coordinator sent and received. It raises a ``ReceiptError`` subclass naming the first
failure (session, stage, step); what a receipt is and how it is encoded lives in ``receipts.py``.

Every failure that is a node's names that node (``exc.node``), decided on evidence the node
signed, never on its neighbour's word:

- a broken link (stage k's output hash differs from stage k+1's input hash) in a ring: stage k+1's
  receipt keeps stage k's signature over the bytes it received (links.py). If that signature is
  stage k's over those bytes, stage k signed two different outputs for one step: its receipt lies.
  Otherwise stage k+1 claims an input it cannot prove: its receipt lies;
- a stage whose steps differ from what the coordinator sent, or whose first input or last output
  differs from the coordinator's transcript, is that stage's lie;
- a stage whose receipt says it reused another number of kept positions (prefix reuse) than the
  coordinator's transcript starts at is that stage's lie: every stage of a session began at the
  coordinator's first step, and the positions before it were computed (and paid) in the session
  the receipt names as their source.

``honest_work`` then says what the other nodes of a failed job did that still verifies, so they
are paid for it while the culprit is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker_agent.errors import ReceiptError
from worker_agent.protocol.links import signed_by
from worker_agent.protocol.receipts import (
    BrokenLink,
    DuplicateReceipt,
    EndpointMismatch,
    ForeignSigner,
    MalformedReceipt,
    MissingReceipt,
    PrefixMismatch,
    Receipt,
    SessionTranscript,
    SpanGap,
    SpanOverlap,
    StageAssignment,
    StepMismatch,
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class JobVerification:
    job: str
    sessions: int  # sessions verified
    steps: int  # steps summed over sessions
    tokens_by_node: dict[str, int]  # node id -> token rows it processed, summed over sessions
    layer_tokens_by_node: dict[str, int]  # node id -> token rows x layers in its span


def _span(start: int, end: int) -> str:
    return f"[{start}, {end})"


def _check_tiling(assignments: Sequence[StageAssignment], n_layers: int) -> list[StageAssignment]:
    """Return the assignments in pipeline order, raising unless they tile [0, n_layers) exactly.

    A plan that is malformed rather than gapped or overlapping (no layers, a node listed twice,
    an empty span) is the planner's fault, not a node's, so it raises the base ReceiptError.
    """
    if not _is_int(n_layers) or n_layers < 1:
        raise ReceiptError(f"n_layers must be a positive integer, got {n_layers!r}")
    if not assignments:
        raise SpanGap(f"no stage assignments: layers {_span(0, n_layers)} are not covered")
    nodes = [a.node for a in assignments]
    if len(set(nodes)) != len(nodes):
        raise ReceiptError(f"a node is assigned more than one span: {sorted(nodes)}")
    for a in assignments:
        if not (_is_int(a.layer_start) and _is_int(a.layer_end) and a.layer_start < a.layer_end):
            raise ReceiptError(f"node {a.node} is assigned an empty span {_span(a.layer_start, a.layer_end)}")
    stages = sorted(assignments, key=lambda a: a.layer_start)
    covered = 0
    for stage in stages:
        if stage.layer_start > covered:
            raise SpanGap(f"layers {_span(covered, stage.layer_start)} are assigned to no node")
        if stage.layer_start < covered:
            raise SpanOverlap(
                f"node {stage.node}'s span {_span(stage.layer_start, stage.layer_end)} overlaps layers "
                f"already covered up to {covered}"
            )
        covered = stage.layer_end
    if covered < n_layers:
        raise SpanGap(f"layers {_span(covered, n_layers)} are assigned to no node")
    if covered > n_layers:
        raise SpanOverlap(f"spans cover layers up to {covered}, past the model's {n_layers}")
    return stages


def _attribute(receipt: Receipt, job: str, model: str, by_node: dict[str, StageAssignment]) -> None:
    """Raise unless the receipt is validly signed by the node assigned to its span for this job."""
    if not isinstance(receipt, Receipt):
        raise MalformedReceipt(f"expected a Receipt, got {type(receipt).__name__}")
    receipt.verify_signature()
    where = f"receipt of node {receipt.node} for session {receipt.session!r}"
    if receipt.job != job:
        raise ForeignSigner(f"{where} is for job {receipt.job!r}, not {job!r}")
    if receipt.model != model:
        raise ForeignSigner(f"{where} is for model {receipt.model!r}, not {model!r}")
    assigned = by_node.get(receipt.node)
    if assigned is None:
        raise ForeignSigner(f"{where}: the node is not assigned to this job")
    if receipt.node_key != assigned.node_key:
        raise ForeignSigner(f"{where} is signed by key {receipt.node_key.hex()}, not the assigned key")
    if (receipt.layer_start, receipt.layer_end) != (assigned.layer_start, assigned.layer_end):
        raise ForeignSigner(
            f"{where} claims layers {_span(receipt.layer_start, receipt.layer_end)}, "
            f"assigned {_span(assigned.layer_start, assigned.layer_end)}"
        )


def link_culprit(upstream: Receipt, downstream: Receipt, step: int, *, ring: bool) -> str | None:
    """Who lies when ``upstream``'s output at ``step`` differs from ``downstream``'s input: the node
    whose signature the evidence holds against it. In a ring the downstream stage keeps the
    upstream's signature over what it received; without it (or with one that is not upstream's
    over those bytes) the downstream's claim is unproven and its own. Outside a ring (the
    coordinator relayed the bytes) the receipts alone cannot say: None."""
    if not ring:
        return None
    inp = downstream.hashes[step][0]
    link = downstream.links[step]
    if signed_by(upstream.node_key, link, downstream.job, downstream.session, step, inp):
        return upstream.node
    return downstream.node


def _check_session(transcript: SessionTranscript, chain: list[Receipt], *, ring: bool = True) -> None:
    """Check one session's receipts, in pipeline order, link up end to end."""
    session = transcript.session
    first = chain[0]
    if len(transcript.sent) != len(transcript.received):
        raise EndpointMismatch(
            f"session {session!r}: the coordinator sent {len(transcript.sent)} and received "
            f"{len(transcript.received)} steps, the stages report {first.steps}"
        )
    for k, receipt in enumerate(chain):
        if receipt.reused != transcript.start:
            raise PrefixMismatch(
                f"session {session!r}: stage {k} (node {receipt.node}) says it reused {receipt.reused} positions, "
                f"the coordinator's first step started at {transcript.start}",
                node=receipt.node,
            )
        # The coordinator's own count of the steps it sent is the truth each stage is held to.
        if receipt.steps != len(transcript.sent):
            raise StepMismatch(
                f"session {session!r}: stage {k} (node {receipt.node}) reports {receipt.steps} steps, "
                f"the coordinator sent {len(transcript.sent)}",
                node=receipt.node,
            )
    last = chain[-1]
    for k, receipt in enumerate(chain[1:], start=1):
        if receipt.tokens != first.tokens:
            raise StepMismatch(
                f"session {session!r}: stage {k} (node {receipt.node}) reports {receipt.tokens} tokens; "
                f"stage 0 (node {first.node}) {first.tokens} tokens"
            )
    for k in range(len(chain) - 1):
        upstream, downstream = chain[k], chain[k + 1]
        for i, ((_, out), (inp, _)) in enumerate(zip(upstream.hashes, downstream.hashes, strict=True)):
            if out != inp:
                culprit = link_culprit(upstream, downstream, i, ring=ring)
                verdict = {
                    upstream.node: f"node {upstream.node} signed that it sent what stage {k + 1} received",
                    downstream.node: f"node {downstream.node} holds no signature of stage {k} over its input",
                    None: "no link evidence (the coordinator relayed it)",
                }[culprit]
                raise BrokenLink(
                    f"session {session!r} step {i}: stage {k} (node {upstream.node}) output "
                    f"{out.hex()[:16]} != stage {k + 1} (node {downstream.node}) input {inp.hex()[:16]}: {verdict}",
                    node=culprit,
                )
    ends = zip(first.hashes, last.hashes, transcript.sent, transcript.received, strict=True)
    for i, ((inp, _), (_, out), sent, received) in enumerate(ends):
        if inp != sent:
            raise EndpointMismatch(
                f"session {session!r} step {i}: stage 0 (node {first.node}) input differs from what "
                "the coordinator sent",
                node=first.node,
            )
        if out != received:
            raise EndpointMismatch(
                f"session {session!r} step {i}: stage {len(chain) - 1} (node {last.node}) output differs "
                "from what the coordinator received",
                node=last.node,
            )


def verify_stage_session(
    *, job: str, model: str, assignment: StageAssignment, receipt: Receipt, transcript: SessionTranscript
) -> None:
    """Verify one stage's receipt for a session the coordinator ran through that stage alone (a
    seeded challenge): signed by the assigned node for its span, job and model, and its per-step
    input and output hashes exactly the bytes the coordinator sent and received. Raises a
    ``ReceiptError`` subclass naming the first failure."""
    _attribute(receipt, job, model, {assignment.node: assignment})
    if receipt.session != transcript.session:
        raise MissingReceipt(
            f"receipt of node {receipt.node} is for session {receipt.session!r}, not {transcript.session!r}"
        )
    _check_session(transcript, [receipt])


def verify_job(
    *,
    job: str,
    model: str,
    n_layers: int,
    assignments: Sequence[StageAssignment],
    receipts: Sequence[Receipt],
    transcripts: Sequence[SessionTranscript],
) -> JobVerification:
    """Verify every receipt of a job against its assignments and the coordinator's transcripts.

    Returns the verified totals, or raises a ``ReceiptError`` subclass naming the first failure
    (session, stage, step). Nothing is trusted that this function did not check.
    """
    stages = _check_tiling(assignments, n_layers)
    by_node = {stage.node: stage for stage in stages}
    if not transcripts:
        raise MissingReceipt(f"job {job!r} has no session transcripts: nothing to verify")
    sessions = {t.session for t in transcripts}
    if len(sessions) != len(transcripts):
        raise DuplicateReceipt(f"job {job!r} lists a session twice in its transcripts")

    found: dict[tuple[str, str], Receipt] = {}
    for receipt in receipts:
        _attribute(receipt, job, model, by_node)
        if receipt.session not in sessions:
            raise MissingReceipt(
                f"receipt of node {receipt.node} is for session {receipt.session!r}, "
                "which the coordinator has no transcript of"
            )
        if (receipt.session, receipt.node) in found:
            raise DuplicateReceipt(
                f"session {receipt.session!r}: node {receipt.node} sent two receipts", node=receipt.node
            )
        found[(receipt.session, receipt.node)] = receipt

    tokens_by_node = dict.fromkeys(by_node, 0)
    steps = 0
    for transcript in transcripts:
        chain = []
        for k, stage in enumerate(stages):
            stage_receipt = found.get((transcript.session, stage.node))
            if stage_receipt is None:
                raise MissingReceipt(
                    f"session {transcript.session!r}: no receipt from stage {k} (node {stage.node}, "
                    f"layers {_span(stage.layer_start, stage.layer_end)})",
                    node=stage.node,
                )
            chain.append(stage_receipt)
        _check_session(transcript, chain)
        steps += chain[0].steps
        for receipt in chain:
            tokens_by_node[receipt.node] += receipt.tokens

    return JobVerification(
        job=job,
        sessions=len(transcripts),
        steps=steps,
        tokens_by_node=tokens_by_node,
        layer_tokens_by_node={
            node: tokens * (by_node[node].layer_end - by_node[node].layer_start)
            for node, tokens in tokens_by_node.items()
        },
    )


def honest_work(
    *,
    job: str,
    model: str,
    n_layers: int,
    assignments: Sequence[StageAssignment],
    receipts: Sequence[Receipt],
    transcripts: Sequence[SessionTranscript],
    culprit: str,
) -> dict[str, int]:
    """Node id -> layer-tokens of a job that failed verification through ``culprit``'s doing, for
    every other node whose own receipts still prove its part: validly signed by the node assigned
    its span, one per session, with the steps the coordinator sent, and linked to each neighbour
    that is not the culprit (and to the coordinator's transcript at the ends). A link to the
    culprit is the culprit's to answer for. A node any of this fails for gets nothing."""
    try:
        stages = _check_tiling(assignments, n_layers)
    except ReceiptError:
        return {}
    by_node = {stage.node: stage for stage in stages}
    found: dict[tuple[str, str], Receipt] = {}
    for receipt in receipts:
        try:
            _attribute(receipt, job, model, by_node)
        except ReceiptError:
            continue
        found.setdefault((receipt.session, receipt.node), receipt)

    def proves(k: int, transcript: SessionTranscript) -> bool:
        own = found.get((transcript.session, stages[k].node))
        if own is None or own.steps != len(transcript.sent) or own.reused != transcript.start:
            return False
        inputs = [h_in for h_in, _ in own.hashes]
        outputs = [h_out for _, h_out in own.hashes]
        if k == 0 and inputs != list(transcript.sent):
            return False
        if k == len(stages) - 1 and outputs != list(transcript.received):
            return False
        for neighbour, mine, theirs in ((k - 1, inputs, 1), (k + 1, outputs, 0)):
            if not 0 <= neighbour < len(stages) or stages[neighbour].node == culprit:
                continue
            other = found.get((transcript.session, stages[neighbour].node))
            if other is None or [pair[theirs] for pair in other.hashes] != mine:
                return False
        return True

    paid = {}
    for k, stage in enumerate(stages):
        if stage.node == culprit or not transcripts or not all(proves(k, t) for t in transcripts):
            continue
        tokens = sum(found[(t.session, stage.node)].tokens for t in transcripts)
        paid[stage.node] = tokens * (stage.layer_end - stage.layer_start)
    return paid
