"""A job's stored receipts, read one at a time.

The runner stores a job's receipts as ``Receipt.to_json()`` maps, session after session in the
order of the job's transcripts, and within a session in route order (stage 0 first). So the
receipt a check needs sits at a known index and is the only one decoded: an audit of one stage
does not parse the receipts of the others.
"""

from __future__ import annotations

from worker_agent.receipts import MalformedReceipt, MissingReceipt, Receipt


def session_receipt(job, session: str, stage: int, node: str) -> Receipt:
    """The receipt ``node`` signed as stage ``stage`` of ``session``; MissingReceipt when the job
    holds none there (an unverified job stores no receipts), MalformedReceipt when it is unreadable."""
    if not isinstance(job.receipts, list) or not isinstance(job.transcripts, list):
        raise MalformedReceipt("the job's stored receipts and transcripts must be lists")
    sessions = [t.get("session") if isinstance(t, dict) else None for t in job.transcripts]
    if session not in sessions or not 0 <= stage < len(job.route):
        raise MissingReceipt(f"job {job.public_id!r} has no stage {stage} in session {session!r}")
    index = sessions.index(session) * len(job.route) + stage
    if index >= len(job.receipts):
        raise MissingReceipt(f"job {job.public_id!r} stores no receipt for stage {stage} of session {session!r}")
    receipt = Receipt.from_json(job.receipts[index])
    if (receipt.session, receipt.node) != (session, node):
        raise MissingReceipt(
            f"job {job.public_id!r}: the receipt stored for stage {stage} of session {session!r} is node "
            f"{receipt.node}'s for session {receipt.session!r}, not node {node}'s"
        )
    return receipt
