"""Prefix keys: names for the KV of a token prefix that a stage may keep for a later request.

A stage never sees tokens, only hidden states, so it cannot tell that two requests share a
prefix; the coordinator, which holds the tokens, names each prefix by a key and the stage keeps
and finds KV by those keys alone (``worker_agent/prefixcache.py``).

The scheme: a token sequence is cut every ``BLOCK`` tokens; the key of its first ``i * BLOCK``
tokens is a hash chain over the blocks::

    key_0 = sha256(DOMAIN + len(salt) + salt + model)
    key_i = sha256(key_{i-1} + block_i's tokens as little-endian uint32)

so a key commits to the salt, the model and every token before its boundary, and keys of a
longer sequence extend those of its prefixes. The salt is per customer account (the control
plane derives it from a secret of its own and the account id and hands it to the coordinator with
the job): a prefix kept for one account has keys no other account can compute, so nobody learns
from a faster answer what someone else sent. Without a salt there are no keys and no reuse.

A message carries at most ``MAX_KEYS`` keys per session, the longest ones (``BLOCK * MAX_KEYS``
positions: past the registry models' context).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK = 32  # tokens between two key boundaries
MAX_KEYS = 64  # keys per session in one OPEN or CLOSE
KEY_BYTES = 32
MAX_SALT_BYTES = 64
DOMAIN = b"swarm-prefix-v1\0"


@dataclass(frozen=True)
class PrefixKey:
    """The key of a sequence's first ``positions`` tokens (a multiple of BLOCK, > 0)."""

    positions: int
    key: bytes  # KEY_BYTES of sha256


def _root(salt: bytes, model: str) -> bytes:
    if not 0 < len(salt) <= MAX_SALT_BYTES:
        raise ValueError(f"a prefix salt is 1-{MAX_SALT_BYTES} bytes, got {len(salt)}")
    return hashlib.sha256(DOMAIN + bytes([len(salt)]) + salt + model.encode()).digest()


def prefix_keys(salt: bytes, model: str, tokens: Sequence[int], *, up_to: int) -> tuple[PrefixKey, ...]:
    """The keys of ``tokens``' block boundaries at positions <= ``up_to``, shortest first, at most
    the MAX_KEYS longest of them."""
    key = _root(salt, model)
    keys = []
    limit = min(up_to, len(tokens))
    for end in range(BLOCK, limit + 1, BLOCK):
        key = hashlib.sha256(key + struct.pack(f"<{BLOCK}I", *tokens[end - BLOCK : end])).digest()
        keys.append(PrefixKey(end, key))
    return tuple(keys[-MAX_KEYS:])


def offer_keys(salt: bytes, model: str, prompt: Sequence[int]) -> tuple[PrefixKey, ...]:
    """The prefixes of ``prompt`` a stage may hold for a new session: each leaves at least one
    prompt token to compute (its logits are the first output token's)."""
    return prefix_keys(salt, model, prompt, up_to=len(prompt) - 1)


def keep_keys(salt: bytes, model: str, committed: Sequence[int], held: int) -> tuple[PrefixKey, ...]:
    """The prefixes of a finished session's ``committed`` tokens (prompt + generated) that its stages
    may keep: only within the ``held`` positions whose KV every stage computed from committed tokens."""
    return prefix_keys(salt, model, committed, up_to=held)
