"""A job's stored receipts and transcripts, verified again by the control plane itself.

The coordinator verifies receipts before it reports success; the control plane does not take its
word for it: before anyone is paid, ``verify_job_record`` re-runs ``worker_agent.receipts.verify_job``
on what the job stored, against the stages the control plane assigned (the job's route).
"""

from __future__ import annotations

from worker_agent import model as models
from worker_agent.errors import ReceiptError
from worker_agent.receipts import (
    JobVerification,
    MalformedReceipt,
    Receipt,
    SessionTranscript,
    StageAssignment,
    verify_job,
)

_HEX_FIELDS = ("node_key", "chain_head", "sig")


def _unhex(value, what: str) -> bytes:
    if not isinstance(value, str):
        raise MalformedReceipt(f"{what} must be a hex string")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise MalformedReceipt(f"{what} is not valid hex") from None


def receipt_from_json(data: object) -> Receipt:
    """Parse ``Receipt.to_json_dict()`` output; raises MalformedReceipt."""
    if not isinstance(data, dict):
        raise MalformedReceipt("a stored receipt must be an object")
    raw = dict(data)
    for name in _HEX_FIELDS:
        raw[name] = _unhex(raw.get(name), f"receipt {name}")
    hashes = raw.get("hashes")
    if not isinstance(hashes, list):
        raise MalformedReceipt("receipt hashes must be a list")
    raw["hashes"] = [[_unhex(h, "receipt hash") for h in pair] if isinstance(pair, list) else pair for pair in hashes]
    return Receipt.from_dict(raw)


def job_receipts(job) -> list[Receipt]:
    return [receipt_from_json(r) for r in job.receipts]


def job_transcripts(job) -> list[SessionTranscript]:
    transcripts = []
    for t in job.transcripts:
        if not isinstance(t, dict) or not isinstance(t.get("session"), str):
            raise MalformedReceipt("a stored transcript must be an object with a session")
        transcripts.append(
            SessionTranscript(
                t["session"],
                tuple(_unhex(h, "transcript hash") for h in t.get("sent", [])),
                tuple(_unhex(h, "transcript hash") for h in t.get("received", [])),
            )
        )
    return transcripts


def job_assignments(job) -> list[StageAssignment]:
    return [
        StageAssignment(s["node"], bytes.fromhex(s["node_key"]), s["layer_start"], s["layer_end"]) for s in job.route
    ]


def verify_job_record(job) -> JobVerification:
    """Raises a ReceiptError naming the first failure, unless the job's receipts prove its work."""
    try:
        return verify_job(
            job=job.public_id,
            model=models.model_name(job.model),
            n_layers=models.n_layers(job.model),
            assignments=job_assignments(job),
            receipts=job_receipts(job),
            transcripts=job_transcripts(job),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ReceiptError(f"the job's stored route or receipts are malformed: {exc}") from None
