"""The wire codec: every message type round-trips, every kind of bad frame is refused by code."""

from __future__ import annotations

import pytest
import torch

from tests.wire_client import forward_header, raw_frame
from worker_agent.errors import WireError
from worker_agent.protocol import wire

pytestmark = pytest.mark.dataplane

HIDDEN = 4


def _rows(rows: int, hidden: int = HIDDEN) -> torch.Tensor:
    """Distinct, exactly representable values in f32, f16 and bf16. (rows, hidden)"""
    return torch.arange(rows * hidden, dtype=torch.float32).view(rows, hidden) / 4 - 2


def _round_trip(message: wire.Message, seq: int = 7, **decode_args) -> wire.Frame:
    data = wire.encode(message, seq)
    frame = wire.decode(data, **decode_args)
    assert frame.size == len(data)
    return frame


def _refusal(data: bytes, **decode_args) -> WireError:
    with pytest.raises(WireError) as err:
        wire.decode(data, **decode_args)
    return err.value


def _forward_bytes(tensor: torch.Tensor, items: list[list], *, seq: int = 3, dtype: str = "f32") -> bytes:
    header = forward_header(seq, "job-1", items, rows=tensor.shape[0], hidden=tensor.shape[1], dtype=dtype)
    return raw_frame(header, wire.tensor_payload(tensor, dtype))


# --- round trips --------------------------------------------------------------------------


def test_hello_round_trips_every_field():
    hello = wire.Hello(
        job="job-1",
        role="coordinator",
        ticket=b"\x00ticket\xff",
        topology="ring",
        next_url="ws://10.0.0.2:7001",
        next_ticket=b"next\x01",
        info={"node": "n1", "layer_start": 0, "layer_end": 10},
    )

    frame = _round_trip(hello, seq=1)

    assert frame.seq == 1
    assert frame.message == hello


def test_hello_defaults_round_trip_as_nil_and_empty():
    frame = _round_trip(wire.Hello(job="job-1"))

    assert frame.message == wire.Hello(
        job="job-1", role="coordinator", ticket=None, topology="star", next_url=None, next_ticket=None, info={}
    )


def test_open_and_close_round_trip():
    receipts = ({"session": "s0", "steps": 3, "sig": b"\x01" * 64}, {"session": "s1", "steps": 0, "sig": b""})

    opened = _round_trip(wire.Open("job-1", ("s0", "s1")), seq=2)
    closed = _round_trip(wire.Close("job-1", ("s0", "s1"), receipts), seq=3)

    assert (opened.seq, opened.message) == (2, wire.Open("job-1", ("s0", "s1")))
    assert (closed.seq, closed.message) == (3, wire.Close("job-1", ("s0", "s1"), receipts))


def test_ping_pong_round_trip():
    ping = _round_trip(wire.Ping(nonce=42), seq=10)
    pong = _round_trip(wire.Pong(nonce=42, info={"sessions": 2, "model": "tiny-llama"}), seq=11)

    assert (ping.seq, ping.message) == (10, wire.Ping(42))
    assert (pong.seq, pong.message) == (11, wire.Pong(42, {"sessions": 2, "model": "tiny-llama"}))


def test_error_round_trips_with_and_without_optional_fields():
    full = wire.Error("unknown_session", "no such session", ref=9, job="job-1", session="s3", fatal=True)

    assert _round_trip(full).message == full
    assert _round_trip(wire.Error("malformed", "bad")).message == wire.Error(
        "malformed", "bad", ref=None, job=None, session=None, fatal=False
    )


def test_an_errors_evidence_round_trips_up_to_its_limit_and_no_further():
    proofs = wire.Error("peer_twice", "two proofs", job="job-1", evidence=bytes(range(128)))
    over = {"v": 1, "type": "ERROR", "seq": 1, "code": "peer_twice", "message": "m", "evidence": b"x" * 1025}
    wrong = {"v": 1, "type": "ERROR", "seq": 1, "code": "peer_twice", "message": "m", "evidence": "text"}

    assert _round_trip(proofs).message == proofs
    assert (_refusal(raw_frame(over, b"")).code, _refusal(raw_frame(over, b"")).message) == (
        "too_large",
        "an ERROR's evidence is at most 1024 bytes",
    )
    assert _refusal(raw_frame(wrong, b"")).code == "malformed"


def test_multi_item_forward_round_trips_with_exact_item_slices():
    tensor = _rows(6)
    payload = wire.tensor_payload(tensor, "f32")
    items = (wire.Item("s0", 0, 0, 3), wire.Item("s1", 4, 7, 1), wire.Item("s2", 1, 2, 2))
    forward = wire.Forward("job-1", items, "f32", (6, HIDDEN), payload)

    frame = _round_trip(forward, hidden_size=HIDDEN)

    assert frame.message == forward
    assert type(frame.message) is wire.Forward
    row = HIDDEN * 4
    assert frame.message.item_bytes() == [payload[: 3 * row], payload[3 * row : 4 * row], payload[4 * row :]]
    assert torch.equal(frame.message.tensor(), tensor)


def test_result_round_trips_as_result_not_forward():
    tensor = _rows(2)
    result = wire.Result("job-1", (wire.Item("s0", 5, 9, 2),), "f32", (2, HIDDEN), wire.tensor_payload(tensor, "f32"))

    frame = _round_trip(result)

    assert type(frame.message) is wire.Result
    assert frame.message == result
    assert torch.equal(frame.message.tensor(), tensor)


@pytest.mark.parametrize(
    ("dtype", "torch_dtype", "itemsize"),
    [("f32", torch.float32, 4), ("f16", torch.float16, 2), ("bf16", torch.bfloat16, 2)],
)
def test_tensor_payload_round_trips_in_each_dtype(dtype, torch_dtype, itemsize):
    tensor = _rows(3)
    payload = wire.tensor_payload(tensor, dtype)
    forward = wire.Forward("job-1", (wire.Item("s0", 0, 0, 3),), dtype, (3, HIDDEN), payload)

    decoded = _round_trip(forward).message.tensor()

    assert len(payload) == 3 * HIDDEN * itemsize
    assert decoded.dtype == torch_dtype
    assert torch.equal(decoded, tensor.to(torch_dtype))


# --- refusals -----------------------------------------------------------------------------


def test_refuses_bytes_that_are_not_msgpack():
    error = _refusal(b"\xc1\xc1\xc1")

    assert (error.code, error.message) == ("malformed", "header is not valid msgpack: FormatError")


def test_refuses_a_header_that_is_not_a_map():
    error = _refusal(raw_frame([1, "PING", 3]))  # type: ignore[arg-type]

    assert (error.code, error.message) == ("malformed", "header must be a msgpack map")


def test_refuses_a_text_frame():
    error = _refusal("hello")  # type: ignore[arg-type]

    assert (error.code, error.message) == ("malformed", "text frames are not accepted; send binary frames")


def test_refuses_version_2():
    error = _refusal(raw_frame({"v": 2, "type": "PING", "seq": 1, "nonce": 1}))

    assert (error.code, error.message) == ("bad_version", "unsupported protocol version 2 (this side speaks 1)")


def test_refuses_a_missing_version():
    assert _refusal(raw_frame({"type": "PING", "seq": 1, "nonce": 1})).code == "bad_version"


def test_refuses_an_unknown_type():
    error = _refusal(raw_frame({"v": 1, "type": "EXPLODE", "seq": 1}))

    assert (error.code, error.message) == ("unknown_type", "unknown frame type 'EXPLODE'")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"v": 1, "type": "PING", "nonce": 1}, "field 'seq' must be an integer, got None"),
        ({"v": 1, "type": "PING", "seq": "1", "nonce": 1}, "field 'seq' must be an integer, got '1'"),
        ({"v": 1, "type": "PING", "seq": -1, "nonce": 1}, "field 'seq' must be an integer, got -1"),
        ({"v": 1, "type": "PING", "seq": True, "nonce": 1}, "field 'seq' must be an integer, got True"),
        ({"v": 1, "type": "PING", "seq": 1}, "field 'nonce' must be an integer, got None"),
        ({"v": 1, "type": "OPEN", "seq": 1, "job": "j"}, "field 'sessions' must be a non-empty list of ids"),
        (
            {"v": 1, "type": "OPEN", "seq": 1, "job": "j", "sessions": []},
            "field 'sessions' must be a non-empty list of ids",
        ),
        ({"v": 1, "type": "OPEN", "seq": 1, "job": 5, "sessions": ["s"]}, "field 'job' must be a string, got int"),
        (
            {"v": 1, "type": "OPEN", "seq": 1, "job": "", "sessions": ["s"]},
            "field 'job' must be 1-128 printable characters",
        ),
        (
            {"v": 1, "type": "HELLO", "seq": 1, "job": "j", "role": "coordinator", "topology": "star", "ticket": "t"},
            "field 'ticket' must be bytes or nil, got str",
        ),
        (
            {"v": 1, "type": "HELLO", "seq": 1, "job": "j", "role": "coordinator", "topology": "mesh"},
            "topology must be 'ring' or 'star', got 'mesh'",
        ),
        (
            {"v": 1, "type": "HELLO", "seq": 1, "job": "j", "role": "admin", "topology": "star"},
            "role must be 'coordinator', 'peer' or 'stage', got 'admin'",
        ),
        (
            {"v": 1, "type": "ERROR", "seq": 1, "code": "x", "message": "m", "ref": True},
            "field 'ref' must be an integer",
        ),
        ({"v": 1, "type": "CLOSE", "seq": 1, "job": "j", "sessions": ["s"], "receipts": [1]}, "receipts must be maps"),
    ],
)
def test_refuses_missing_or_ill_typed_fields_as_malformed(header, message):
    error = _refusal(raw_frame(header))

    assert (error.code, error.message) == ("malformed", message)


@pytest.mark.parametrize(
    "items",
    [
        [["s0", 0, 0]],  # three fields
        [["s0", 0, 0, "1"]],  # count not an int
        [[7, 0, 0, 1]],  # session not a string
        [["s0", 0, 0, 0]],  # zero rows
        [["s0", -1, 0, 1]],  # negative step
        [["", 0, 0, 1]],  # empty session id
    ],
)
def test_refuses_ill_formed_forward_items_as_malformed(items):
    assert _refusal(_forward_bytes(_rows(1), items)).code == "malformed"


def test_refuses_a_forward_without_items():
    error = _refusal(_forward_bytes(_rows(1), []))

    assert (error.code, error.message) == ("malformed", "items must be a non-empty list")


def test_refuses_a_frame_over_max_frame_and_accepts_one_at_it():
    data = wire.encode(wire.Pong(1), 1)

    error = _refusal(data, max_frame=len(data) - 1)

    assert (error.code, error.message) == (
        "too_large",
        f"frame of {len(data)} bytes exceeds the limit of {len(data) - 1}",
    )
    assert wire.decode(data, max_frame=len(data)).message == wire.Pong(1)


def test_refuses_a_header_over_64_kib():
    data = raw_frame({"v": 1, "type": "PING", "seq": 1, "nonce": 1, "pad": "x" * 70_000})

    assert _refusal(data).code == "too_large"


def test_refuses_dtype_f64():
    header = forward_header(1, "job-1", [["s0", 0, 0, 1]], rows=1, hidden=HIDDEN, dtype="f64")
    data = raw_frame(header, _rows(1).double().numpy().tobytes())

    error = _refusal(data)

    assert (error.code, error.message) == ("bad_dtype", "dtype 'f64' is not one of ['bf16', 'f16', 'f32']")


def test_refuses_a_hidden_size_other_than_the_stages():
    data = _forward_bytes(_rows(2, hidden=8), [["s0", 0, 0, 2]])

    error = _refusal(data, hidden_size=HIDDEN)

    assert (error.code, error.message) == ("bad_shape", "hidden size 8 does not match this stage's 4")
    assert wire.decode(data, hidden_size=8).message.shape == (2, 8)


@pytest.mark.parametrize("shape", [[2], [0, HIDDEN], [2, HIDDEN, 1], [2.0, HIDDEN], "2x4", None])
def test_refuses_a_shape_that_is_not_two_positive_ints(shape):
    header = forward_header(1, "job-1", [["s0", 0, 0, 2]], rows=2, hidden=HIDDEN)
    header["shape"] = shape

    assert _refusal(raw_frame(header, wire.tensor_payload(_rows(2), "f32"))).code == "bad_shape"


@pytest.mark.parametrize("cut", [-1, -4, 4])
def test_refuses_a_payload_whose_length_does_not_match_the_shape(cut):
    good = wire.tensor_payload(_rows(2), "f32")
    payload = good[:cut] if cut < 0 else good + b"\x00" * cut
    header = forward_header(1, "job-1", [["s0", 0, 0, 2]], rows=2, hidden=HIDDEN)

    error = _refusal(raw_frame(header, payload))

    assert (error.code, error.message) == ("bad_shape", f"tensor has {len(payload)} bytes, shape [2, 4] f32 needs 32")


def test_refuses_items_whose_rows_do_not_sum_to_the_shape():
    data = _forward_bytes(_rows(3), [["s0", 0, 0, 1], ["s1", 0, 0, 1]])

    error = _refusal(data)

    assert (error.code, error.message) == ("bad_shape", "items cover 2 rows but shape says 3")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_refuses_non_finite_payloads(bad, dtype):
    tensor = _rows(2)
    tensor[1, 2] = bad

    error = _refusal(_forward_bytes(tensor, [["s0", 0, 0, 2]], dtype=dtype))

    assert (error.code, error.message) == ("non_finite", "tensor holds NaN or Inf")


def test_refuses_tensor_bytes_on_a_ping():
    data = wire.encode(wire.Ping(1), 1) + b"\x00\x00\x80\x3f"

    error = _refusal(data)

    assert (error.code, error.message) == ("malformed", "a PING's padding is zero bytes")


def test_a_padded_ping_is_read_before_a_hello_up_to_its_own_limit():
    """The uplink probe's PING, padded with zero bytes, passes the small limit of frames before a
    HELLO; one byte more padding, or any other frame of its size, does not."""
    probe = wire.encode(wire.Ping(7, pad=wire.MAX_PING_PAD), 3)
    assert len(probe) > wire.MAX_HELLO_FRAME

    assert wire.decode(probe, max_frame=wire.MAX_HELLO_FRAME).message == wire.Ping(7, pad=wire.MAX_PING_PAD)
    over = _refusal(wire.encode(wire.Ping(7, pad=wire.MAX_PING_PAD + 1), 3), max_frame=wire.MAX_HELLO_FRAME)
    assert over.code == "too_large"
    pong = wire.encode(wire.Pong(7), 3) + bytes(wire.MAX_PING_PAD)
    assert _refusal(pong, max_frame=wire.MAX_HELLO_FRAME).code == "too_large"


def test_refuses_the_same_session_twice_in_one_frame():
    error = _refusal(_forward_bytes(_rows(2), [["s0", 0, 0, 1], ["s0", 1, 1, 1]]))

    assert (error.code, error.message) == ("malformed", "a session appears twice in one frame")


# --- peek_seq -----------------------------------------------------------------------------


def test_peek_seq_reads_the_seq_of_a_frame_that_fails_later_checks():
    header = forward_header(41, "job-1", [["s0", 0, 0, 1]], rows=1, hidden=HIDDEN, dtype="f64")
    data = raw_frame(header, b"\x00" * 8 * HIDDEN)

    assert _refusal(data).code == "bad_dtype"
    assert wire.peek_seq(data) == 41


def test_peek_seq_reads_the_seq_of_a_version_2_frame():
    assert wire.peek_seq(raw_frame({"v": 2, "type": "PING", "seq": 5, "nonce": 1})) == 5


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1\xc1",  # not msgpack
        b"",  # nothing at all
        raw_frame([1, 2, 3]),  # type: ignore[arg-type]  # not a map
        raw_frame({"v": 1, "type": "PING"}),  # no seq
        raw_frame({"v": 1, "type": "PING", "seq": "9"}),  # seq not an int
        raw_frame({"v": 1, "type": "PING", "seq": 9})[:-1],  # cut short
    ],
)
def test_peek_seq_gives_none_when_no_seq_can_be_read(data):
    assert wire.peek_seq(data) is None


def test_peek_seq_gives_none_for_a_boolean_seq():
    """An ERROR's ``ref`` must be an integer or nil: a seq of ``true`` is not echoed back."""
    assert wire.peek_seq(raw_frame({"v": 1, "type": "PING", "seq": True})) is None


def test_a_header_with_a_container_over_the_limits_is_refused_as_too_large_without_unpacking_it():
    data = b"\xdd" + (2**32 - 1).to_bytes(4, "big") + b"\x90" * 10  # an array declaring 4 billion entries
    error = _refusal(data)
    assert (error.code, error.message) == (
        "too_large",
        "header is over the wire's limits: 4294967295 exceeds max_array_len(4096)",
    )


def test_a_forward_with_more_items_than_the_limit_is_refused_as_too_large():
    count = wire.MAX_ITEMS + 1
    items = [[f"s{i}", 0, 0, 1] for i in range(count)]
    error = _refusal(_forward_bytes(_rows(count), items))
    assert (error.code, error.message) == ("too_large", f"a frame carries at most {wire.MAX_ITEMS} items, got {count}")
