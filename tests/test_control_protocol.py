"""The control channel's codec: every message survives a round trip with its wire field names,
and every malformed frame is refused with an exact code and message."""

from __future__ import annotations

import json

import pytest

from worker_agent.errors import SwarmError
from worker_agent.protocol import control_protocol as protocol
from worker_agent.protocol.control_protocol import ProtocolError
from worker_agent.protocol.keys import generate_signing_key

pytestmark = pytest.mark.dataplane

NONCE = bytes(range(32))
KEY_HEX = "ab" * 32

MESSAGES = [
    (protocol.Nonce(nonce=NONCE), {"type": "challenge", "nonce": NONCE.hex()}),
    (
        protocol.Auth(node="node-00ff", signature="cd" * 64),
        {"type": "auth", "node": "node-00ff", "signature": "cd" * 64},
    ),
    (
        protocol.Welcome(
            node="node-00ff",
            state="active",
            heartbeat_interval_s=5.0,
            ticket_key=KEY_HEX,
            assignments=(protocol.Assign(assignment=3, model="tiny-llama", layer_start=0, layer_end=6),),
        ),
        {
            "type": "welcome",
            "node": "node-00ff",
            "state": "active",
            "heartbeat_interval_s": 5.0,
            "ticket_key": KEY_HEX,
            "assignments": [
                {"type": "assign", "assignment": 3, "model": "tiny-llama", "layer_start": 0, "layer_end": 6}
            ],
        },
    ),
    (
        protocol.Welcome(
            node="node-00ff", state="active", heartbeat_interval_s=5.0, ticket_key=KEY_HEX, seen_address="10.201.0.101"
        ),
        {
            "type": "welcome",
            "node": "node-00ff",
            "state": "active",
            "heartbeat_interval_s": 5.0,
            "ticket_key": KEY_HEX,
            "assignments": [],
            "seen_address": "10.201.0.101",
        },
    ),
    (
        protocol.Error(code="unknown_type", message="unknown type 'sync'"),
        {
            "type": "error",
            "code": "unknown_type",
            "message": "unknown type 'sync'",
        },
    ),
    (
        protocol.Heartbeat(load=protocol.Load(sessions=2, tokens_served=40, layer_ms=0.5, model="m", state="serving")),
        {
            "type": "heartbeat",
            "load": {"sessions": 2, "tokens_served": 40, "layer_ms": 0.5, "model": "m", "state": "serving"},
        },
    ),
    (protocol.Heartbeat(), {"type": "heartbeat", "load": {}}),
    (
        protocol.Assign(assignment=7, model="smollm2-135m", layer_start=10, layer_end=20),
        {"type": "assign", "assignment": 7, "model": "smollm2-135m", "layer_start": 10, "layer_end": 20},
    ),
    (
        protocol.Assign(
            assignment=8, model="smollm2-135m", layer_start=0, layer_end=10, supersedes=7, jobs=("chatcmpl-1",)
        ),
        {
            "type": "assign",
            "assignment": 8,
            "model": "smollm2-135m",
            "layer_start": 0,
            "layer_end": 10,
            "supersedes": 7,
            "jobs": ["chatcmpl-1"],
        },
    ),
    (
        protocol.Release(assignment=7, model="smollm2-135m"),
        {"type": "release", "assignment": 7, "model": "smollm2-135m"},
    ),
    (
        protocol.Release(assignment=7, model="smollm2-135m", jobs=("chatcmpl-1", "cmpl-2")),
        {"type": "release", "assignment": 7, "model": "smollm2-135m", "jobs": ["chatcmpl-1", "cmpl-2"]},
    ),
    (protocol.Drain(), {"type": "drain"}),
    (protocol.Stop(reason="maintenance"), {"type": "stop", "reason": "maintenance"}),
    (
        protocol.Probe(
            model="tiny-llama",
            targets=(
                protocol.ProbeTarget(target="node-00ff", url="ws://10.0.0.7:9100"),
                protocol.ProbeTarget(target="region:local"),
            ),
        ),
        {
            "type": "probe",
            "model": "tiny-llama",
            "targets": [{"target": "node-00ff", "url": "ws://10.0.0.7:9100"}, {"target": "region:local", "url": None}],
        },
    ),
    (
        protocol.ProbeResult(
            results=(
                protocol.LinkResult(target="region:local", rtt_ms=4.0, uplink_mbps=900.0),
                protocol.LinkResult(target="node-00ff", rtt_ms=12.5),
            )
        ),
        {
            "type": "probe_result",
            "results": [
                {"target": "region:local", "rtt_ms": 4.0, "uplink_mbps": 900.0},
                {"target": "node-00ff", "rtt_ms": 12.5},
            ],
        },
    ),
    (
        protocol.Ready(assignment=7, url="ws://10.0.0.7:9100"),
        {"type": "ready", "assignment": 7, "url": "ws://10.0.0.7:9100"},
    ),
    (
        protocol.Failed(assignment=7, error="out of memory"),
        {"type": "failed", "assignment": 7, "error": "out of memory"},
    ),
    (
        protocol.UseRelay(
            reason="ws://10.0.0.7:9100 refused the connection",
            relay_pass="ab" * 100,
            relays=(protocol.RelayOffer(id="r1", address="relay.example:7700"),),
        ),
        {
            "type": "use_relay",
            "reason": "ws://10.0.0.7:9100 refused the connection",
            "relay_pass": "ab" * 100,
            "relays": [{"id": "r1", "address": "relay.example:7700"}],
        },
    ),
]


def _refusal(text: str) -> ProtocolError:
    with pytest.raises(ProtocolError) as refused:
        protocol.decode(text)
    return refused.value


def _frame(**fields) -> str:
    return json.dumps(fields)


@pytest.mark.parametrize(("message", "wire"), MESSAGES, ids=lambda value: type(value).__name__)
def test_every_message_round_trips_with_the_wire_field_names(message, wire):
    text = protocol.encode(message)

    assert json.loads(text) == wire
    assert protocol.decode(text) == message


def test_every_message_type_has_a_round_trip_case():
    assert {str(message.TYPE) for message, _ in MESSAGES} == {str(kind) for kind in protocol.MessageType}


def test_a_frame_with_the_current_version_decodes_like_one_without():
    assert protocol.decode(_frame(v=1, type="drain")) == protocol.Drain()


def test_unknown_fields_are_ignored_for_newer_peers():
    decoded = protocol.decode(_frame(type="heartbeat", load={"sessions": 1, "gossip": "x"}, extra=True))

    assert decoded == protocol.Heartbeat(load=protocol.Load(sessions=1))


def test_protocol_errors_belong_to_the_agents_error_hierarchy():
    assert issubclass(ProtocolError, SwarmError)


def test_an_oversized_frame_is_refused_before_parsing():
    text = "[" * (protocol.MAX_FRAME_CHARS + 1)  # would be a parse error, were it parsed

    error = _refusal(text)

    assert error.code == "frame_too_large"
    assert str(error) == f"a frame holds {protocol.MAX_FRAME_CHARS + 1} characters, over the limit of 8388608"


def test_encoding_a_message_over_the_frame_limit_is_refused(monkeypatch):
    monkeypatch.setattr(protocol, "MAX_FRAME_CHARS", 64)
    message = protocol.Failed(assignment=1, error="A" * 64)

    with pytest.raises(ProtocolError) as refused:
        protocol.encode(message)

    assert refused.value.code == "frame_too_large"
    assert refused.value.kind == "failed"


@pytest.mark.parametrize(
    ("text", "code", "message"),
    [
        ("not json", "bad_json", "a frame is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
        ('["auth"]', "not_a_message", "messages are JSON objects with a type"),
        ('{"node": "n"}', "not_a_message", "messages are JSON objects with a type"),
        ('{"type": 5}', "not_a_message", "messages are JSON objects with a type"),
        (
            '{"type": "drain", "v": 2}',
            "bad_version",
            "protocol version 2 is not spoken here (this side speaks 1)",
        ),
        (
            '{"type": "drain", "v": true}',
            "bad_version",
            "protocol version True is not spoken here (this side speaks 1)",
        ),
        ('{"type": "sync"}', "unknown_type", "unknown type 'sync'"),
    ],
)
def test_a_frame_that_is_not_a_message_of_this_protocol_is_refused(text, code, message):
    error = _refusal(text)

    assert (error.code, str(error)) == (code, message)


def test_an_unknown_type_names_the_type_it_claimed():
    assert _refusal(_frame(type="sync")).kind == "sync"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"type": "auth", "node": "n"}, "auth needs the field 'signature'"),
        ({"type": "assign", "assignment": 1, "model": "m", "layer_start": 0}, "assign needs the field 'layer_end'"),
        ({"type": "ready", "url": "ws://a:1"}, "ready needs the field 'assignment'"),
        ({"type": "release", "assignment": 1}, "release needs the field 'model'"),
        ({"type": "challenge", "challenge": 1, "seed": 1}, "challenge needs the field 'nonce'"),
        ({"type": "probe_result"}, "results must be a list of at most 1024 measurements"),
    ],
)
def test_a_missing_field_is_refused(fields, message):
    error = _refusal(json.dumps(fields))

    assert str(error) == message
    assert error.code == ("invalid_report" if fields["type"] == "probe_result" else "missing_field")
    assert error.kind == fields["type"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"type": "auth", "node": "n", "signature": 42},
            "signature must be a non-empty string of at most 256 characters, got 42",
        ),
        (
            {"type": "auth", "node": "", "signature": "ab"},
            "node must be a non-empty string of at most 256 characters, got ''",
        ),
        (
            {"type": "assign", "assignment": True, "model": "m", "layer_start": 0, "layer_end": 2},
            "assignment must be an integer in [1, 9223372036854775807], got True",
        ),
        (
            {"type": "assign", "assignment": "7", "model": "m", "layer_start": 0, "layer_end": 2},
            "assignment must be an integer in [1, 9223372036854775807], got '7'",
        ),
        (
            {"type": "assign", "assignment": 7, "model": "m", "layer_start": 4, "layer_end": 4},
            "layer_end must be an integer in [5, 100000], got 4",
        ),
        (
            {"type": "assign", "assignment": 7, "model": "m", "layer_start": -1, "layer_end": 4},
            "layer_start must be an integer in [0, 99999], got -1",
        ),
        ({"type": "stop", "reason": None}, "reason must be a string of at most 65536 characters, got None"),
        (
            {"type": "assign", "assignment": 8, "model": "m", "layer_start": 0, "layer_end": 2, "supersedes": 0},
            "supersedes must be an integer in [1, 9223372036854775807], got 0",
        ),
        (
            {"type": "release", "assignment": 7, "model": "m", "jobs": "chatcmpl-1"},
            "jobs must be a list of at most 1024 job ids, got 'chatcmpl-1'",
        ),
        (
            {"type": "release", "assignment": 7, "model": "m", "jobs": ["chatcmpl-1"] * 1025},
            "jobs must be a list of at most 1024 job ids, got ['chatcmpl-1', 'chatcmpl-1', 'chatcmpl-1', 'chatcmpl-1', "
            "'chatcmpl-1', 'chatc...",
        ),
        (
            {"type": "release", "assignment": 7, "model": "m", "jobs": ["", 5]},
            "a job id must be a non-empty string of at most 128 characters, got ''",
        ),
        (
            {"type": "release", "assignment": 7, "model": "m", "jobs": ["x" * 129]},
            "a job id must be a non-empty string of at most 128 characters, got '" + "x" * 76 + "...",
        ),
        ({"type": "probe", "model": "m", "targets": {}}, "targets must be a list of at most 1024 entries"),
        ({"type": "probe", "model": "m", "targets": ["node-1"]}, "a probe target must be an object, got 'node-1'"),
        ({"type": "challenge", "nonce": "00ff"}, "nonce must be 64 hex characters, got '00ff'"),
        (
            {"type": "welcome", "node": "n", "state": "active", "heartbeat_interval_s": 0, "ticket_key": KEY_HEX},
            "heartbeat_interval_s must be a number >= 0.001, got 0",
        ),
        (
            {"type": "welcome", "node": "n", "state": "active", "heartbeat_interval_s": 5, "ticket_key": "zz"},
            "ticket_key must be 64 hex characters, got 'zz'",
        ),
        (
            {
                "type": "welcome",
                "node": "n",
                "state": "active",
                "heartbeat_interval_s": 5,
                "ticket_key": KEY_HEX,
                "assignments": [{"type": "drain"}],
            },
            "assignments must hold Assign entries, got (Drain(),)",
        ),
        (
            {"type": "use_relay", "reason": "", "relay_pass": "ab", "relays": []},
            "relays must be a list of 1 to 16 relays",
        ),
        (
            {"type": "use_relay", "reason": "", "relay_pass": "zz", "relays": [{"id": "r", "address": "h:1"}]},
            "relay_pass must be hex",
        ),
        (
            {"type": "use_relay", "reason": "", "relay_pass": "ab", "relays": [{"id": "r", "address": "h:99999"}]},
            "address must be host:port, got 'h:99999'",
        ),
    ],
)
def test_a_field_of_the_wrong_type_or_range_is_refused(fields, message):
    error = _refusal(json.dumps(fields))

    assert (error.code, str(error)) == ("bad_field", message)
    assert error.kind == fields["type"]


@pytest.mark.parametrize(
    ("load", "message"),
    [
        ([1, 2], "load must be an object"),
        ({"sessions": -1}, "sessions must be a number >= 0.0, got -1"),
        ({"tokens_served": "many"}, "tokens_served must be a number >= 0.0, got 'many'"),
        ({"queue": None}, "queue must be a number >= 0.0, got None"),
        ({"layer_ms": 1e16}, "layer_ms must be at most 1e+15, got 1e+16"),
        ({"model": 5}, "model must be a string of at most 256 characters, got 5"),
    ],
)
def test_a_malformed_heartbeat_load_is_an_invalid_report(load, message):
    error = _refusal(_frame(type="heartbeat", load=load))

    assert (error.code, str(error)) == ("invalid_report", message)


@pytest.mark.parametrize(
    ("results", "message"),
    [
        ({"target": "x"}, "results must be a list of at most 1024 measurements"),
        ([{"target": "x", "rtt_ms": 1.0}] * 1025, "results must be a list of at most 1024 measurements"),
        ([{"rtt_ms": 1.0}], "each measurement needs a target"),
        ([{"target": "x"}], "rtt_ms must be a number >= 0.0, got None"),
        ([{"target": "x", "rtt_ms": 1.0, "uplink_mbps": -5}], "uplink_mbps must be a number >= 0.0, got -5"),
    ],
)
def test_malformed_probe_results_are_an_invalid_report(results, message):
    error = _refusal(_frame(type="probe_result", results=results))

    assert (error.code, str(error)) == ("invalid_report", message)


def test_building_an_invalid_message_is_refused_before_it_is_sent():
    with pytest.raises(ProtocolError) as refused:
        protocol.Assign(assignment=0, model="m", layer_start=0, layer_end=1)

    assert (refused.value.code, str(refused.value)) == (
        "bad_field",
        "assignment must be an integer in [1, 9223372036854775807], got 0",
    )


def test_a_long_value_is_shown_cut_short_in_the_message():
    error = _refusal(_frame(type="ready", assignment="9" * 200, url="ws://a:1"))

    assert str(error) == "assignment must be an integer in [1, 9223372036854775807], got '" + "9" * 76 + "..."


def test_error_cuts_a_long_message_to_the_limit():
    assert len(protocol.error("x", "m" * (protocol.MAX_TEXT_CHARS + 10)).message) == protocol.MAX_TEXT_CHARS


def test_the_handshake_signature_is_over_the_nonce_and_the_node_id():
    key = generate_signing_key()
    signature = bytes.fromhex(protocol.control_signature(key, NONCE, "node-00ff"))

    assert key.verify_key.verify(protocol.CONTROL_CONTEXT + NONCE + b"node-00ff", signature)


def test_the_join_signature_is_over_the_token_and_the_public_key():
    key = generate_signing_key()
    signature = bytes.fromhex(protocol.join_signature(key, "swj_token"))

    public = bytes(key.verify_key)
    assert key.verify_key.verify(protocol.JOIN_CONTEXT + b"swj_token\0" + public, signature)
