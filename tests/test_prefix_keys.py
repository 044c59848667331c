"""Prefix keys (protocol/prefix.py): a hash chain over fixed blocks, salted per account, bounded."""

from __future__ import annotations

import hashlib
import struct

import pytest

from worker_agent.protocol.prefix import BLOCK, DOMAIN, MAX_KEYS, keep_keys, offer_keys, prefix_keys

pytestmark = pytest.mark.dataplane

SALT = b"a" * 32
TOKENS = list(range(100, 100 + 4 * BLOCK + 5))


def test_keys_sit_at_every_block_boundary_and_chain_the_blocks():
    keys = prefix_keys(SALT, "smollm2-135m", TOKENS, up_to=len(TOKENS))

    assert [key.positions for key in keys] == [32, 64, 96, 128]
    root = hashlib.sha256(DOMAIN + bytes([32]) + SALT + b"smollm2-135m").digest()
    first = hashlib.sha256(root + struct.pack("<32I", *TOKENS[:32])).digest()
    assert keys[0].key == first
    assert keys[1].key == hashlib.sha256(first + struct.pack("<32I", *TOKENS[32:64])).digest()


def test_a_longer_sequence_shares_the_keys_of_its_prefix():
    short = prefix_keys(SALT, "m", TOKENS[:70], up_to=70)
    long = prefix_keys(SALT, "m", TOKENS, up_to=len(TOKENS))

    assert long[: len(short)] == short


def test_one_different_token_changes_its_block_key_and_every_later_one():
    changed = TOKENS.copy()
    changed[40] += 1

    before = prefix_keys(SALT, "m", TOKENS, up_to=len(TOKENS))
    after = prefix_keys(SALT, "m", changed, up_to=len(changed))

    assert before[0] == after[0]
    assert [a.key != b.key for a, b in zip(before[1:], after[1:], strict=True)] == [True, True, True]


def test_salts_isolate_accounts_and_models():
    mine = prefix_keys(SALT, "m", TOKENS, up_to=len(TOKENS))
    theirs = prefix_keys(b"b" * 32, "m", TOKENS, up_to=len(TOKENS))
    other_model = prefix_keys(SALT, "n", TOKENS, up_to=len(TOKENS))

    assert {key.key for key in mine} & {key.key for key in theirs} == set()
    assert {key.key for key in mine} & {key.key for key in other_model} == set()


def test_an_offer_leaves_at_least_one_prompt_token_to_compute():
    assert [key.positions for key in offer_keys(SALT, "m", TOKENS[:64])] == [32]
    assert [key.positions for key in offer_keys(SALT, "m", TOKENS[:65])] == [32, 64]
    assert offer_keys(SALT, "m", TOKENS[:32]) == ()


def test_keep_keys_stop_at_the_positions_the_stages_hold():
    assert [key.positions for key in keep_keys(SALT, "m", TOKENS, 95)] == [32, 64]
    assert [key.positions for key in keep_keys(SALT, "m", TOKENS, 96)] == [32, 64, 96]


def test_a_message_carries_only_the_longest_keys():
    keys = prefix_keys(SALT, "m", list(range(BLOCK * (MAX_KEYS + 3))), up_to=BLOCK * (MAX_KEYS + 3))

    assert len(keys) == MAX_KEYS
    assert keys[0].positions == 4 * BLOCK
    assert keys[-1].positions == (MAX_KEYS + 3) * BLOCK


def test_refuses_an_empty_or_oversized_salt():
    with pytest.raises(ValueError):
        prefix_keys(b"", "m", TOKENS, up_to=64)
    with pytest.raises(ValueError):
        prefix_keys(b"x" * 65, "m", TOKENS, up_to=64)
