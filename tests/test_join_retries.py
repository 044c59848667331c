"""The agent's side of joining, without a control plane: where the join token comes from, the
jittered backoff (a seeded ``random.Random`` stands in for chance), which answers are tried again
(no answer, 5xx, 429) and which are final (another 4xx), the control channel's reconnect waits, the
device check, and how stop signals that arrive together count as one stop.

HTTP answers come from a real server on loopback that plays a script of replies; waits between
tries are recorded, not slept."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from tests.test_make_before_break import until
from worker_agent.agent.cli import StopSignals
from worker_agent.agent.control import Agent, JoinState
from worker_agent.agent.joining import (
    TOKEN_ENV,
    JoinError,
    Refused,
    Retry,
    Unreachable,
    backoff_delay,
    preflight,
    read_token,
    request_json,
    retrying,
)
from worker_agent.devices import device_problem
from worker_agent.protocol.keys import generate_signing_key, node_id, public_key_bytes

pytestmark = pytest.mark.dataplane


# --- backoff ---------------------------------------------------------------------------------------


def test_backoff_draws_each_wait_uniformly_below_the_doubling_bound_and_the_cap():
    rng = random.Random(7)
    draws = [[backoff_delay(attempt, rng) for _ in range(200)] for attempt in range(8)]

    bounds = [1, 2, 4, 8, 16, 30, 30, 30]  # min(cap 30 s, 1 s * 2**attempt)
    for attempt, (waits, bound) in enumerate(zip(draws, bounds, strict=True)):
        assert all(0 <= wait <= bound for wait in waits), attempt
        # Full jitter spreads the waits over the whole range, not near its top.
        assert min(waits) < 0.1 * bound and max(waits) > 0.9 * bound, attempt


def test_backoff_is_the_seeded_generators_own_draw():
    rng = random.Random(3)
    assert [backoff_delay(attempt, rng) for attempt in range(6)] == list(_draws(3, [1, 2, 4, 8, 16, 30]))


def _draws(seed: int, bounds: list[float]) -> Iterator[float]:
    """What full jitter draws from ``random.Random(seed)`` for these successive bounds."""
    rng = random.Random(seed)
    for bound in bounds:
        yield rng.uniform(0, bound)


def test_agents_seeded_differently_do_not_retry_in_step():
    first, second = random.Random(1), random.Random(2)
    waits = [(backoff_delay(a, first), backoff_delay(a, second)) for a in range(6)]
    assert all(mine != theirs for mine, theirs in waits)


def test_a_huge_attempt_count_waits_up_to_the_cap():
    assert 0 <= backoff_delay(10_000, random.Random(0)) <= 30


# --- the join token --------------------------------------------------------------------------------


def test_the_token_comes_from_the_environment_stripped():
    assert read_token(None, {TOKEN_ENV: "  swj_abc\n"}) == "swj_abc"
    assert read_token(None, {TOKEN_ENV: ""}) is None
    assert read_token(None, {}) is None


def test_a_token_file_wins_over_the_environment(tmp_path):
    path = tmp_path / "token"
    path.write_text("swj_from_file\n")
    assert read_token(str(path), {TOKEN_ENV: "swj_from_env"}) == "swj_from_file"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read the join token file {path}: No such file or directory"),
        ("\n", "the join token file {path} must hold the token alone"),
        ("swj_a\nswj_b\n", "the join token file {path} must hold the token alone"),
    ],
)
def test_a_token_file_that_is_missing_empty_or_holds_more_is_refused(tmp_path, content, message):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(JoinError) as refused:
        read_token(str(path), {TOKEN_ENV: "swj_from_env"})
    assert (str(refused.value), refused.value.code) == (message.format(path=path), "token_file")


# --- answers tried again, and answers that are final ---------------------------------------------


class ScriptedServer:
    """An HTTP server on loopback answering each request with the next (status, headers, body) of
    its script; it records the paths asked."""

    def __init__(self, script: list[tuple[int, dict, object]]) -> None:
        self.script = list(script)
        self.asked: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                owner.asked.append(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                status, headers, body = owner.script.pop(0)
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.shutdown()
        self.server.server_close()


def refusal(code: str, message: str, **extra) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code, **extra}}


OK = (200, {}, {"status": "ok"})
VALID = (200, {}, {"valid": True, "node_name": "gpu-1", "expires_at": "2030-01-01T00:00:00Z"})


def test_server_errors_are_tried_again_after_jittered_waits_until_an_answer():
    waits: list[float] = []
    lines: list[str] = []
    with ScriptedServer([(503, {}, b"busy"), (502, {}, b"bad gateway"), OK, VALID]) as server:
        answer = preflight(
            server.url, "swj_t", Retry(tries=5), rng=random.Random(11), sleep=waits.append, say=lines.append
        )

    assert answer == VALID[2]
    assert server.asked == ["/healthz"] * 3 + ["/api/v1/agents/check-token"]
    assert waits == list(_draws(11, [1, 2]))
    assert lines == [
        f"the control plane at {server.url}/healthz answered 503 Service Unavailable; trying again in "
        f"{waits[0]:.1f}s (2 of 5)",
        f"the control plane at {server.url}/healthz answered 502 Bad Gateway; trying again in {waits[1]:.1f}s (3 of 5)",
    ]


def test_a_429_is_tried_again_no_sooner_than_it_says():
    waits: list[float] = []
    with ScriptedServer(
        [OK, (429, {"Retry-After": "7"}, refusal("rate_limit_exceeded", "slow down")), VALID]
    ) as server:
        preflight(server.url, "swj_t", Retry(tries=3), rng=random.Random(0), sleep=waits.append, say=lambda _: None)

    assert waits == [7.0]  # above the draw from [0, 1]


def test_a_refused_token_is_final_and_names_the_reason():
    refused_token = refusal("invalid_join_token", "the join token was used already", reason="used")
    with ScriptedServer([OK, (403, {}, refused_token)]) as server, pytest.raises(Refused) as refused:
        preflight(server.url, "swj_t", Retry(tries=5), rng=random.Random(0), sleep=pytest.fail, say=pytest.fail)

    assert server.asked == ["/healthz", "/api/v1/agents/check-token"]  # asked once: not tried again
    assert str(refused.value) == "the control plane refused the join token: the join token was used already"
    assert (refused.value.code, refused.value.reason, refused.value.status) == ("invalid_join_token", "used", 403)


def test_no_answer_is_tried_the_given_number_of_times_then_fails_in_one_line():
    with ScriptedServer([]) as server:
        url = server.url  # closed below: nothing listens there any more
    waits: list[float] = []
    lines: list[str] = []

    with pytest.raises(Unreachable) as failed:
        preflight(url, "swj_t", Retry(tries=3), rng=random.Random(5), sleep=waits.append, say=lines.append)

    message = str(failed.value)
    assert message.startswith(f"cannot reach the control plane at {url}/healthz: ")
    assert message.endswith(" (gave up after 3 tries)")
    assert "\n" not in message
    assert failed.value.code == "control_plane_unreachable"
    assert waits == list(_draws(5, [1, 2]))
    assert len(lines) == 2


def test_a_url_that_is_not_a_control_plane_is_said_so():
    with ScriptedServer([(404, {}, b"<html>no</html>")]) as server, pytest.raises(JoinError) as failed:
        preflight(server.url, "swj_t", Retry(tries=3), rng=random.Random(0), sleep=pytest.fail, say=pytest.fail)
    assert str(failed.value) == f"{server.url} does not look like a swarm control plane: GET /healthz answered 404"
    with ScriptedServer([(200, {}, b"<html>hello</html>")]) as server, pytest.raises(JoinError) as failed:
        request_json(server.url + "/healthz", what="the health check")
    assert str(failed.value) == f"{server.url}/healthz did not answer with JSON: is it a swarm control plane?"


def test_a_control_plane_without_the_check_lets_the_join_check_the_token():
    lines: list[str] = []
    with ScriptedServer([OK, (404, {}, b"<html>Not Found</html>")]) as server:
        answer = preflight(server.url, "swj_t", Retry(), rng=random.Random(0), sleep=pytest.fail, say=lines.append)

    assert answer == {}
    assert lines == ["this control plane cannot check a join token before the join: it is checked at the join"]


def test_a_call_that_fails_otherwise_is_not_tried_again():
    calls = []

    def call():
        calls.append(1)
        raise JoinError("the control plane registered node 'x', not this key's")

    with pytest.raises(JoinError):
        retrying(call, Retry(tries=5), rng=random.Random(0), sleep=pytest.fail, say=pytest.fail)
    assert calls == [1]


# --- the control channel's reconnects --------------------------------------------------------------


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_control_channel_reconnects_after_waits_drawn_from_the_agents_generator():
    with ScriptedServer([]) as server:
        closed = server.url.replace("http://", "ws://") + "/ws/agent/"  # refuses connections at once
    key = generate_signing_key()
    state = JoinState("http://control.test", node_id(public_key_bytes(key)), closed, 5.0)
    agent = Agent(key, state, host="127.0.0.1", port=0, advertise_url="ws://127.0.0.1:1", rng=random.Random(9))
    lines = Lines()
    logging.getLogger("swarm.agent").addHandler(lines)

    def reconnects() -> list[str] | None:
        found = [line for line in lines.lines if "reconnecting in" in line]
        return found[:3] if len(found) >= 3 else None

    async def scenario() -> list[str]:
        running = asyncio.create_task(agent.run())
        losses = await until(reconnects, "three reconnects")
        agent.stop()
        await asyncio.wait_for(running, 30)
        return losses

    try:
        losses = asyncio.run(scenario())
    finally:
        logging.getLogger("swarm.agent").removeHandler(lines)
    expected = [f"{wait:.1f}s" for wait in _draws(9, [1, 2, 4])]
    assert [line.rsplit(" ", 1)[1] for line in losses] == expected


# --- the device ------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch build has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_on_a_cpu_build_of_torch_is_one_line_naming_the_build(device):
    assert device_problem(device) == (
        f"error: --device {device} but this torch build has no CUDA (torch {torch.__version__}); "
        "install a CUDA build of torch or use --device cpu"
    )


@pytest.mark.parametrize(
    ("device", "problem"),
    [
        ("cpu", None),
        ("gpu", "error: unknown --device 'gpu': use cpu, cuda or cuda:N"),
        ("cuda:x", "error: unknown --device 'cuda:x': use cpu, cuda or cuda:N"),
        ("meta", "error: --device meta: the agent runs on cpu, cuda, mps, not meta"),
    ],
)
def test_devices_torch_cannot_run_on_are_named(device, problem):
    assert device_problem(device) == problem


# --- stop signals ----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_signal_right_after_the_first_is_the_same_stop_and_a_later_one_stops_at_once(capsys):
    stops: list[float] = []
    clock = Clock()
    signals = StopSignals(lambda: stops.append(clock.now), clock=clock, window_s=2.0)

    signals("SIGINT")  # Ctrl-C reaches the agent ...
    clock.now += 0.3
    signals("SIGTERM")  # ... and the program that started it, which then stops the agent too
    assert stops == [100.0]
    assert capsys.readouterr().err == (
        "SIGTERM 0.3s after the first stop signal: the same stop (signal again after 2s to stop at once)\n"
    )

    clock.now += 2.0
    signals("SIGINT")  # the owner, again: stop now
    assert stops == [100.0, 102.3]
