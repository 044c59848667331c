"""A job's stored receipts, read one at a time.

The runner stores a job's receipts as ``Receipt.to_json()`` maps, session after session in the
order of the job's transcripts, and within a session in route order (stage 0 first). An
unverified job keeps every receipt its stages sent that was their own (they are the evidence its
audits and verdicts rest on), so a stage may be missing. A check finds the receipt it needs by its
session and node, read off the stored map, and decodes only that one: an audit of one stage does
not parse the receipts of the others.
"""

from __future__ import annotations

from worker_agent.protocol.receipts import MalformedReceipt, MissingReceipt, Receipt


def session_receipt(job, session: str, stage: int, node: str) -> Receipt:
    """The receipt ``node`` signed as stage ``stage`` of ``session``; MissingReceipt when the job
    holds none there, MalformedReceipt when it is unreadable."""
    if not isinstance(job.receipts, list) or not isinstance(job.transcripts, list):
        raise MalformedReceipt("the job's stored receipts and transcripts must be lists")
    sessions = [t.get("session") if isinstance(t, dict) else None for t in job.transcripts]
    if session not in sessions or not 0 <= stage < len(job.route):
        raise MissingReceipt(f"job {job.public_id!r} has no stage {stage} in session {session!r}")
    span = (job.route[stage]["layer_start"], job.route[stage]["layer_end"])
    where = f"job {job.public_id!r}: node {node}'s receipt for stage {stage} of session {session!r}"
    for stored in job.receipts:
        if isinstance(stored, dict) and stored.get("session") == session and stored.get("node") == node:
            receipt = Receipt.from_json(stored)
            if (receipt.layer_start, receipt.layer_end) != span:
                raise MissingReceipt(f"{where} is for layers [{receipt.layer_start}, {receipt.layer_end}), not {span}")
            return receipt
    raise MissingReceipt(f"{where} is not stored")
