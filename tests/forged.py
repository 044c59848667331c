"""Signatures an honest node never makes, for hostile nodes in tests.

Ed25519 signing is deterministic (RFC 8032 derives the nonce from the key and the message), so an
honest signer gives one signature per message. Yet a verifier accepts any (R, S) that satisfies the
curve equation, so the key's holder can make as many valid signatures of one message as it likes by
choosing its nonce itself: ``another_signature`` does that, with the same arithmetic as libsodium.
"""

from __future__ import annotations

import hashlib
import os

import nacl.bindings as sodium
from nacl.signing import SigningKey


def another_signature(key: SigningKey, message: bytes) -> bytes:
    """A valid ed25519 signature of ``message`` by ``key`` other than the one ``key.sign`` makes."""
    digest = hashlib.sha512(bytes(key)).digest()
    clamped = bytearray(digest[:32])
    clamped[0] &= 248
    clamped[31] &= 127
    clamped[31] |= 64
    secret = sodium.crypto_core_ed25519_scalar_reduce(bytes(clamped) + bytes(32))
    public = bytes(key.verify_key)
    nonce = sodium.crypto_core_ed25519_scalar_reduce(os.urandom(64))  # random, not derived
    r_point = sodium.crypto_scalarmult_ed25519_base_noclamp(nonce)
    challenge = sodium.crypto_core_ed25519_scalar_reduce(hashlib.sha512(r_point + public + message).digest())
    s_scalar = sodium.crypto_core_ed25519_scalar_add(nonce, sodium.crypto_core_ed25519_scalar_mul(challenge, secret))
    return r_point + s_scalar
