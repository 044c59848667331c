"""Sender-signed links: every output a stage sends is signed by that stage, item by item.

A receipt is one node's word about what it received and sent. When two neighbours' receipts
disagree (stage k says it sent ``A``, stage k+1 says it received ``B``), words alone cannot say
who lies. So each stage signs every item it puts out (a FORWARD to its ring successor, the tap
of it to the coordinator, or its RESULT) with its node key, over::

    LINK_CONTEXT + job + 0x00 + session + 0x00 + step (u64 big-endian) + sha256(item bytes)

and the receiving stage checks that signature against the sender key its peer pass names before
it accepts the item, and keeps it in its receipt next to the input hash (``Receipt.links``).
Then a disagreement decides itself (``coverage.verify_job``): if stage k+1 holds stage k's own
signature over ``B``, stage k signed two different outputs for one step and its receipt lies;
if it does not, stage k+1 claims an input it cannot prove and its receipt lies.

The same signature travels with a tap, so a tap is evidence too: a tap validly signed by stage k
that differs from what stage k+1 received under k's signature is k equivocating, and a tap that
does not verify is refused as k's forgery.

Errors (trust code fails closed: it raises, never returns False)::

    ReceiptError (errors.py)
    └── BadLink   code link_bad_signature: a missing or wrong signature; link_malformed: not 64 bytes
"""

from __future__ import annotations

import struct

from nacl.exceptions import CryptoError
from nacl.signing import SigningKey, VerifyKey

from worker_agent.errors import ReceiptError

LINK_CONTEXT = b"swarm-link-v1\0"
SIG_BYTES = 64
KEY_BYTES = 32
_STEP = struct.Struct(">Q")


class BadLink(ReceiptError):
    """An item's sender signature is missing, malformed, or not the named sender's."""

    code = "link_bad_signature"


def link_message(job: str, session: str, step: int, item_hash: bytes) -> bytes:
    """The bytes a sender signs for one item: which step of which session, and what its bytes hash
    to (the same sha256 a receipt lists, so a receipt's step can be checked against it)."""
    return LINK_CONTEXT + job.encode() + b"\0" + session.encode() + b"\0" + _STEP.pack(step) + item_hash


def sign_link(key: SigningKey, job: str, session: str, step: int, item_hash: bytes) -> bytes:
    """The sender's 64-byte signature over one item."""
    return key.sign(link_message(job, session, step, item_hash)).signature


def verify_link(sender_key: bytes, sig: bytes, job: str, session: str, step: int, item_hash: bytes) -> None:
    """Raise ``BadLink`` unless ``sig`` is ``sender_key``'s signature over this item."""
    where = f"session {session!r} step {step}"
    if not isinstance(sig, bytes) or len(sig) != SIG_BYTES:
        raise BadLink(f"{where}: the item carries no sender signature", code="link_bad_signature")
    if not isinstance(sender_key, bytes) or len(sender_key) != KEY_BYTES:
        raise BadLink(f"{where}: no sender key to check the item's signature against", code="link_malformed")
    try:
        VerifyKey(sender_key).verify(link_message(job, session, step, item_hash), sig)
    except (CryptoError, ValueError):
        raise BadLink(
            f"{where}: the item's signature is not its sender's (key {sender_key.hex()[:16]}) over these bytes"
        ) from None


def signed_by(sender_key: bytes, sig: bytes, job: str, session: str, step: int, item_hash: bytes) -> bool:
    """Whether ``sig`` is ``sender_key``'s over the item: a verdict helper for code that weighs
    evidence (a missing or bad signature is evidence against whoever owed it, not an error)."""
    try:
        verify_link(sender_key, sig, job, session, step, item_hash)
    except BadLink:
        return False
    return True
