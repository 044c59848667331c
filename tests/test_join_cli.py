"""``swarm-worker join`` as the machine's owner runs it, against a live control plane: the join
token comes by environment or file and never shows on the command line; a wrong token, an
unreachable control plane or a device torch cannot use fails in one line on stderr, with a non-zero
exit and before the speed benchmark (whose "measuring this machine" line never appears); a restart
reconnects as the node it joined as, without a token and without measuring again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
from django.test import Client
from django.utils import timezone

from marketplace.nodes.joining import create_node
from marketplace.nodes.models import Node
from tests.factories import join_payload
from tests.live import LiveServer, free_port, wait_for
from worker_agent.agent.joining import TOKEN_ENV
from worker_agent.dev.local import join_agent, stop_processes
from worker_agent.protocol.keys import generate_signing_key

pytestmark = [pytest.mark.control, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-llama"
BENCHMARK = "measuring this machine"  # the line printed as the benchmark starts
UNKNOWN = "the join token is not known here: mistyped, replaced by a newer one, or its node deleted"


@pytest.fixture
def control_plane(settings):
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_EMBEDDED_SCHEDULER = True
    settings.SWARM_HEARTBEAT_INTERVAL_S = 0.5
    settings.SWARM_HEARTBEAT_TIMEOUT_S = 30.0
    settings.SWARM_SWEEP_INTERVAL_S = 0.5
    settings.SWARM_SPARES_PER_PIPELINE = 0
    server = LiveServer().start()
    yield server
    server.stop()


@pytest.fixture
def provider(django_user_model):
    return django_user_model.objects.create_user(username="p", email="p@e.com", password="x", is_provider=True)


def run_join(control_plane: str, key, *args: str, token: str | None = None) -> subprocess.CompletedProcess:
    """``swarm-worker join`` run to its end (these runs all fail before serving anything)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(TOKEN_ENV, None)
    if token is not None:
        env[TOKEN_ENV] = token
    command = [
        sys.executable,
        "-m",
        "worker_agent.agent.cli",
        "join",
        "--control-plane",
        control_plane,
        "--key",
        str(key),
    ]
    return subprocess.run(
        [*command, "--model", MODEL, "--threads", "1", *args], capture_output=True, text=True, env=env, timeout=120
    )


def refused(message: str, code: str = "invalid_join_token") -> str:
    return f"error: the control plane refused the join token: {message} ({code})"


def assert_failed_before_the_benchmark(result: subprocess.CompletedProcess, rc: int, last_line: str) -> None:
    assert (result.returncode, result.stderr.splitlines()[-1]) == (rc, last_line), result.stderr
    assert BENCHMARK not in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""  # no JOINED line


def test_the_token_is_never_on_the_command_line_and_a_restart_reconnects_without_measuring(
    control_plane, provider, tmp_path
):
    node, token = create_node(owner=provider, name="gpu")
    log = tmp_path / "agent.log"
    agent = join_agent(control_plane.url, token, tmp_path / "n.key", log, model=MODEL)
    try:
        wait_for(lambda: agent.poll() is not None or "JOINED" in log.read_text(), 120, "the agent to join")
        assert agent.poll() is None, log.read_text()
        with open(f"/proc/{agent.pid}/cmdline", "rb") as handle:
            argv = handle.read().split(b"\0")
        assert b"join" in argv
        assert not any(token.encode() in arg for arg in argv)
        with open(f"/proc/{agent.pid}/environ", "rb") as handle:
            assert f"{TOKEN_ENV}={token}".encode() in handle.read().split(b"\0")
        assert BENCHMARK in log.read_text()
        node.refresh_from_db()
        assert node.join_token_hash is None  # the token was used
        stop_processes([agent])
        assert agent.returncode == 0

        # Started again, token and all (as a service restarts it): the token is used, the key's
        # node is known, so the agent reconnects as that node without measuring again.
        again = tmp_path / "again.log"
        agent = join_agent(control_plane.url, token, tmp_path / "n.key", again, model=MODEL)
        wait_for(lambda: agent.poll() is not None or "JOINED" in again.read_text(), 120, "the agent to reconnect")
        text = again.read_text()
        assert f"reconnecting as {node.node_id}, which this key joined as before" in text
        assert f"JOINED node={node.node_id}" in text
        assert BENCHMARK not in text
        wait_for(lambda: Node.objects.get(pk=node.pk).connected, 60, "the control channel")
    finally:
        stop_processes([agent])


def test_an_unknown_token_fails_in_one_line_before_the_benchmark(control_plane, tmp_path):
    result = run_join(control_plane.url, tmp_path / "n.key", token="swj_" + "x" * 43)

    assert_failed_before_the_benchmark(result, 1, refused(UNKNOWN))


def test_a_used_token_fails_in_one_line_before_the_benchmark(control_plane, provider, tmp_path):
    _, token = create_node(owner=provider, name="gpu")
    joined = Client().post("/api/v1/agents/register", join_payload(token, generate_signing_key()), "application/json")
    assert joined.status_code == 201

    result = run_join(control_plane.url, tmp_path / "n.key", token=token)

    assert_failed_before_the_benchmark(
        result,
        1,
        refused(
            "the join token was used already: a node joined with it. Rotate the node's token for a new one; an "
            "agent that joined with it reconnects without a token"
        ),
    )


def test_an_expired_token_fails_in_one_line_before_the_benchmark(control_plane, provider, tmp_path):
    node, token = create_node(owner=provider, name="gpu")
    expired = (timezone.now() - timedelta(minutes=1)).replace(microsecond=0)
    Node.objects.filter(pk=node.pk).update(join_token_expires_at=expired)

    result = run_join(control_plane.url, tmp_path / "n.key", token=token)

    assert_failed_before_the_benchmark(
        result,
        1,
        refused(
            f"the join token expired at {expired.isoformat(timespec='seconds')}: rotate the node's token for a new one"
        ),
    )


def test_the_token_file_is_read(control_plane, tmp_path):
    path = tmp_path / "token"
    path.write_text("swj_" + "y" * 43 + "\n")

    result = run_join(control_plane.url, tmp_path / "n.key", "--token-file", str(path), token="swj_ignored")

    assert_failed_before_the_benchmark(result, 1, refused(UNKNOWN))


def test_a_token_on_the_command_line_is_refused_before_anything_happens(tmp_path):
    result = run_join("http://127.0.0.1:1", tmp_path / "n.key", "--token", "swj_" + "z" * 43)

    assert_failed_before_the_benchmark(
        result,
        2,
        "error: --token would show the join token to every user of this machine (ps); give it in the "
        "SWARM_JOIN_TOKEN environment variable or in a file named by --token-file",
    )
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "n.key").exists()


def test_an_unreachable_control_plane_is_tried_again_then_fails_in_one_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    result = run_join(url, tmp_path / "n.key", "--join-tries", "3", token="swj_" + "x" * 43)

    lines = result.stderr.splitlines()
    assert (result.returncode, BENCHMARK in result.stderr, "Traceback" in result.stderr) == (1, False, False)
    refused_here = f"cannot reach the control plane at {url}/healthz: [Errno 111] Connection refused"
    assert [line.split("; trying again in ")[0] for line in lines[-3:-1]] == [refused_here] * 2
    assert [line.rsplit(" ", 3)[-3:] for line in lines[-3:-1]] == [["(2", "of", "3)"], ["(3", "of", "3)"]]
    assert lines[-1] == f"error: {refused_here} (gave up after 3 tries) (control_plane_unreachable)"


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch build has CUDA")
def test_cuda_on_a_cpu_build_of_torch_fails_in_one_line_before_anything_else(tmp_path):
    result = run_join("http://127.0.0.1:1", tmp_path / "n.key", "--device", "cuda", token="swj_" + "x" * 43)

    assert_failed_before_the_benchmark(
        result,
        2,
        f"error: --device cuda but this torch build has no CUDA (torch {torch.__version__}); install a CUDA "
        "build of torch or use --device cpu",
    )
    assert len(result.stderr.splitlines()) == 1  # before the control plane was asked


def test_an_unknown_device_fails_in_one_line(tmp_path):
    result = run_join("http://127.0.0.1:1", tmp_path / "n.key", "--device", "gpu0", token="swj_" + "x" * 43)

    assert_failed_before_the_benchmark(result, 2, "error: unknown --device 'gpu0': use cpu, cuda or cuda:N")


def test_a_key_that_never_joined_needs_a_token(control_plane, tmp_path):
    result = run_join(control_plane.url, tmp_path / "n.key")

    assert_failed_before_the_benchmark(
        result,
        2,
        f"error: this key has not joined {control_plane.url} yet: give the node's join token in the "
        f"{TOKEN_ENV} environment variable or with --token-file",
    )


def test_ctrl_c_while_the_control_plane_is_unreachable_stops_the_retries(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: "swj_" + "x" * 43}
    command = [
        sys.executable,
        "-m",
        "worker_agent.agent.cli",
        "join",
        "--control-plane",
        url,
        "--key",
        str(tmp_path / "k"),
    ]
    log = tmp_path / "join.log"
    with open(log, "w") as out:
        process = subprocess.Popen([*command, "--join-tries", "50"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: "trying again" in log.read_text(), 60, "the first retry")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 130
        assert "Traceback" not in log.read_text()
    finally:
        stop_processes([process])


def health(key) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker_agent.agent.cli", "health", "--key", str(key), "--max-age", "5"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_health_says_whether_the_agents_control_channel_is_up(control_plane, provider, tmp_path):
    _node, token = create_node(owner=provider, name="gpu")
    key = tmp_path / "n.key"
    before = health(key)
    assert before.returncode == 1 and "has not reached the control plane yet" in before.stderr
    agent = join_agent(control_plane.url, token, key, tmp_path / "agent.log", model=MODEL)
    try:
        wait_for(lambda: health(key).returncode == 0, 120, "the agent to report a heartbeat")
        assert health(key).stdout.strip() == "healthy"
    finally:
        stop_processes([agent])
    # Stopped: no heartbeat comes any more, and the status goes stale.
    wait_for(lambda: health(key).returncode == 1, 30, "the status to go stale")
    assert "the control channel was last up" in health(key).stderr
