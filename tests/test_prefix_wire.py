"""Prefix reuse on the wire: OPEN's offered keys and reused positions, CLOSE's keep keys; typed,
bounded and validated, each bad field refused with a precise code."""

from __future__ import annotations

import pytest

from tests.wire_client import raw_frame
from worker_agent.errors import WireError
from worker_agent.protocol import wire
from worker_agent.protocol.prefix import MAX_KEYS, PrefixKey, offer_keys

pytestmark = pytest.mark.dataplane

KEYS = offer_keys(b"s" * 32, "m", list(range(100)))  # positions 32, 64, 96


def _decode_code(header: dict) -> str:
    with pytest.raises(WireError) as err:
        wire.decode(raw_frame({"v": 1, "seq": 1, "job": "job-1", **header}))
    return err.value.code


def test_open_and_close_carry_prefix_keys_and_reused_positions():
    offer = wire.Open("job-1", ("s0", "s1"), prefixes=(KEYS, ()))
    answer = wire.Open("job-1", ("s0", "s1"), reused=(64, 0))
    close = wire.Close("job-1", ("s0",), keep=(KEYS[:2],))

    frames = [wire.decode(wire.encode(message, 7)).message for message in (offer, answer, close)]

    assert frames == [offer, answer, close]
    assert frames[0].prefixes[0][1] == PrefixKey(64, KEYS[1].key)


def test_frames_without_prefix_fields_read_as_before():
    plain = wire.decode(raw_frame({"v": 1, "type": "OPEN", "seq": 1, "job": "job-1", "sessions": ["s0"]})).message

    assert plain == wire.Open("job-1", ("s0",))
    assert (plain.prefixes, plain.reused) == ((), ())


def _keys(*pairs) -> list:
    return [[list(pair) for pair in pairs]]


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("prefixes", "keys", "malformed"),  # not a list
        ("prefixes", [[], []], "malformed"),  # two sessions' keys for one session
        ("prefixes", [["key"]], "malformed"),  # not [positions, key]
        ("prefixes", _keys((32, b"k" * 31)), "malformed"),  # a key of 31 bytes
        ("prefixes", _keys((0, b"k" * 32)), "malformed"),  # positions from 1
        ("prefixes", _keys((64, b"k" * 32), (32, b"j" * 32)), "malformed"),  # not increasing
        ("prefixes", _keys((True, b"k" * 32)), "malformed"),  # a bool is no position
        ("prefixes", [[[32 * (n + 1), b"k" * 32] for n in range(MAX_KEYS + 1)]], "too_large"),
        ("reused", [1, 2], "malformed"),  # two counts for one session
        ("reused", [-1], "malformed"),
        ("reused", ["32"], "malformed"),
    ],
)
def test_refuses_a_bad_open_prefix_field_with_its_code(field, value, code):
    assert _decode_code({"type": "OPEN", "sessions": ["s0"], field: value}) == code


@pytest.mark.parametrize(
    ("value", "code"),
    [
        ([[[32, b"k" * 33]]], "malformed"),
        ([[[32, b"k" * 32]], []], "malformed"),
        ([[[32 * (n + 1), b"k" * 32] for n in range(MAX_KEYS + 1)]], "too_large"),
    ],
)
def test_refuses_a_bad_close_keep_field_with_its_code(value, code):
    assert _decode_code({"type": "CLOSE", "sessions": ["s0"], "keep": value}) == code
