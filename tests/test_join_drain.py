"""Ctrl-C on a joined agent mid-stream: the request in flight streams to its end, then the agent
exits, within its drain deadline.

A Ctrl-C in a terminal signals every process of the foreground group: the agent and whatever
started it (a shell script, ``make demo``, a supervisor), which then typically stops the agent
itself with a SIGTERM of its own. The agent used to count that SIGTERM as a second stop signal
("stop now") and cut the request it was draining. Here the agent runs under such a supervisor, in a
process group of their own, and the whole group gets the SIGINT, as from a terminal.

One agent holds all of tiny-llama (one stage); its outgoing frames are delayed (an emulated WAN
link, 100 ms round trips) so that a stream lasts seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from openai import APIError, OpenAI

from marketplace.jobs.services import create_api_key
from marketplace.nodes.joining import create_node
from marketplace.placement.selectors import servable_pipelines
from tests.live import LiveServer, wait_for
from worker_agent.agent.joining import TOKEN_ENV
from worker_agent.dev.local import join_agent, stop_processes

pytestmark = [pytest.mark.control, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-llama"
MAX_TOKENS = 40
DRAINING = "stopping: 1 job(s) in flight may finish first"
CUT = "stopping with 1 job(s) still open"

# Starts the agent as marketplace/demo.py does, and on Ctrl-C stops it as the demo does (SIGTERM,
# then waits); prints the agent's exit status.
SUPERVISOR = textwrap.dedent(
    """
    import os, sys
    from worker_agent.dev.local import join_agent, stop_processes
    url, key, log = sys.argv[1:]
    agent = join_agent(url, os.environ["SWARM_JOIN_TOKEN"], key, log, model="tiny-llama", wan="rtt=100ms")
    try:
        agent.wait()
    except KeyboardInterrupt:
        stop_processes([agent], timeout_s=60)
    print(agent.returncode, flush=True)
    """
)


@pytest.fixture
def control_plane(settings):
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_COORDINATOR_LAUNCH = "inprocess"
    settings.SWARM_EMBEDDED_SCHEDULER = True
    settings.SWARM_HEARTBEAT_INTERVAL_S = 0.5
    settings.SWARM_HEARTBEAT_TIMEOUT_S = 30.0
    settings.SWARM_SWEEP_INTERVAL_S = 0.5
    settings.SWARM_SPARES_PER_PIPELINE = 0
    settings.SWARM_DEFAULT_PRICES = (0, 0)  # this is about stopping, not credits
    server = LiveServer().start()
    yield server
    server.stop()


@pytest.fixture
def accounts(django_user_model):
    """A node's join token and a customer's API key."""
    provider = django_user_model.objects.create_user(username="p", email="p@e.com", password="x", is_provider=True)
    customer = django_user_model.objects.create_user(username="c", email="c@e.com", password="x", is_customer=True)
    return create_node(owner=provider, name="gpu")[1], create_api_key(customer, "k")[1]


def start_stream(url: str, key: str, max_tokens: int):
    """A streamed completion, once its first chunk arrived (the job is in flight on the agent)."""
    client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    stream = client.completions.create(
        model=MODEL,
        prompt="Hello there",
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = iter(stream)
    assert next(chunks).choices[0].text is not None
    return chunks


def test_ctrl_c_in_a_terminal_lets_the_stream_in_flight_finish_then_the_agent_exits(control_plane, accounts, tmp_path):
    token, key = accounts
    log = tmp_path / "agent.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: token}
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, control_plane.url, str(tmp_path / "n.key"), str(log)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        wait_for(lambda: supervisor.poll() is None and servable_pipelines(MODEL), 180, "a servable pipeline")
        chunks = start_stream(control_plane.url, key, MAX_TOKENS)

        os.killpg(supervisor.pid, signal.SIGINT)  # Ctrl-C
        rest = list(chunks)

        assert rest[-1].usage.completion_tokens == MAX_TOKENS
        assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
        out, _ = supervisor.communicate(timeout=90)
        assert out.strip() == "0", log.read_text()[-3000:]  # the agent exited by itself, cleanly
        text = log.read_text()
        assert DRAINING in text  # the stop came while the job was in flight
        assert "after the first stop signal: the same stop" in text  # the supervisor's SIGTERM
        assert CUT not in text
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
            supervisor.wait()


def test_a_stream_longer_than_the_drain_deadline_is_cut_at_it_and_the_agent_exits(control_plane, accounts, tmp_path):
    token, key = accounts
    log = tmp_path / "agent.log"
    drain_s = 2.0
    agent = join_agent(
        control_plane.url, token, tmp_path / "n.key", log, model=MODEL, wan="rtt=100ms", drain_timeout_s=drain_s
    )
    try:
        wait_for(lambda: agent.poll() is None and servable_pipelines(MODEL), 180, "a servable pipeline")
        chunks = start_stream(control_plane.url, key, 400)  # about 40 s at 100 ms a token

        agent.send_signal(signal.SIGINT)

        assert agent.wait(timeout=drain_s + 20) == 0  # the deadline, plus closing the port
        text = log.read_text()
        assert DRAINING in text
        assert CUT in text
        with pytest.raises(APIError):  # one agent, no stand-in: the cut request fails
            list(chunks)
    finally:
        stop_processes([agent])
