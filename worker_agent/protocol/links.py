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

A peer connection is the sender's too: a pass is a bearer token the coordinator hands the sender,
so the sender signs the pass (``peer_proof``) in its peer HELLO, and the successor admits it only
under that signature. Ed25519 signing is deterministic: an honest sender's proof is the same on
every connection it opens with one pass (a reconnect replaces the connection it had). Two
different valid proofs over one pass can only come from a sender that signed one of them outside
the protocol to hold two connections at once: the successor refuses the second and hands both to
the job's coordinator (``peer_twice``), which checks them itself (``proves_second_connection``)
and reports the sender; the successor cannot make up either signature.

Errors (trust code fails closed: it raises, never returns False)::

    ReceiptError (errors.py)
    └── BadLink   code link_bad_signature: a missing or wrong signature; link_malformed: not 64 bytes;
                  peer_unproven: a peer HELLO whose proof is not the sender's signature over its pass
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from nacl.exceptions import CryptoError
from nacl.signing import SigningKey, VerifyKey

from worker_agent.errors import ReceiptError

LINK_CONTEXT = b"swarm-link-v1\0"
PEER_CONTEXT = b"swarm-peer-hello-v1\0"
SIG_BYTES = 64
KEY_BYTES = 32
_STEP = struct.Struct(">Q")


@dataclass(frozen=True)
class Misconduct:
    """A node's breach of the protocol, proven by its own signatures: reported with the job, and a
    strike whatever became of the job."""

    node: str  # the node that signed the evidence against itself
    code: str  # what it did: "peer_twice"
    reason: str  # for people, and the strike's evidence
    evidence: bytes  # the signatures that prove it


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


def peer_proof(key: SigningKey, peer_pass: bytes) -> bytes:
    """The sender's 64-byte signature over the pass it opens a peer connection with (the same bytes
    on every connection: ed25519 signing is deterministic)."""
    return key.sign(PEER_CONTEXT + hashlib.sha256(peer_pass).digest()).signature


def check_peer_proof(sender_key: bytes, peer_pass: bytes, proof: bytes | None) -> None:
    """Raise ``BadLink`` (``peer_unproven``) unless ``proof`` is ``sender_key``'s signature over the pass."""
    if not isinstance(proof, bytes) or len(proof) != SIG_BYTES:
        raise BadLink("the peer HELLO carries no proof of the sender key its pass names", code="peer_unproven")
    try:
        VerifyKey(sender_key).verify(PEER_CONTEXT + hashlib.sha256(peer_pass).digest(), proof)
    except (CryptoError, ValueError, TypeError):
        raise BadLink(
            f"the peer HELLO's proof is not the signature of its pass's sender (key {sender_key.hex()[:16]})",
            code="peer_unproven",
        ) from None


def second_connection_evidence(first: bytes, second: bytes) -> bytes:
    """What a successor hands the coordinator when one pass came with two different proofs."""
    return first + second


def proves_second_connection(sender_key: bytes, peer_pass: bytes, evidence: bytes | None) -> bool:
    """Whether ``evidence`` holds two different valid proofs by ``sender_key`` over ``peer_pass``:
    the sender signed outside the protocol to open a second connection (a verdict helper: evidence
    that does not hold is nothing, not an error)."""
    if not isinstance(evidence, bytes) or len(evidence) != 2 * SIG_BYTES:
        return False
    first, second = evidence[:SIG_BYTES], evidence[SIG_BYTES:]
    if first == second:
        return False
    try:
        check_peer_proof(sender_key, peer_pass, first)
        check_peer_proof(sender_key, peer_pass, second)
    except BadLink:
        return False
    return True
