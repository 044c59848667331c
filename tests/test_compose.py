"""The Docker Compose deployment, as Debian's ``docker-compose`` renders it (``docker-compose
config``: the file is valid and its variables interpolate): every service restarts and has a
healthcheck, the secrets and origins reach the control plane and never an agent, no agent sees
the control plane's volume (its ticket-signing key), join tokens travel by environment, and a
missing DJANGO_SECRET_KEY is a clear error."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.control

ROOT = Path(__file__).resolve().parent.parent
AGENTS = ("agent1", "agent2", "agent3")
SECRETS = ("DJANGO_SECRET_KEY", "STRIPE_SECRET_KEY", "STRIPE_WEBHOOK_SECRET", "DATABASE_URL")
ENV = {
    "DJANGO_SECRET_KEY": "k" * 40,
    "STRIPE_SECRET_KEY": "sk_test_compose",
    "STRIPE_WEBHOOK_SECRET": "whsec_compose",
    "DJANGO_CSRF_TRUSTED_ORIGINS": "https://swarm.example",
    "TOKEN_1": "swj_one",
}


def config(env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ENV and not k.startswith("TOKEN_")}
    return subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def rendered() -> dict:
    result = config(ENV)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_every_service_restarts_and_has_a_healthcheck(rendered):
    for name, service in rendered["services"].items():
        assert service.get("restart") == "unless-stopped", name
        assert service.get("healthcheck", {}).get("test"), name


def test_the_control_plane_gets_its_secrets_and_origins(rendered):
    env = rendered["services"]["web"]["environment"]
    assert env["STRIPE_SECRET_KEY"] == "sk_test_compose"
    assert env["STRIPE_WEBHOOK_SECRET"] == "whsec_compose"
    assert env["DJANGO_CSRF_TRUSTED_ORIGINS"] == "https://swarm.example"
    assert "--timeout-graceful-shutdown" in rendered["services"]["web"]["command"]


def test_agents_see_neither_the_control_planes_volume_nor_its_secrets(rendered):
    for name in AGENTS:
        service = rendered["services"][name]
        volumes = [v.split(":")[0] if isinstance(v, str) else v["source"] for v in service.get("volumes", [])]
        assert "data" not in volumes, name
        assert not set(SECRETS) & set(service.get("environment", {})), name
        command = service["command"] if isinstance(service["command"], str) else " ".join(service["command"])
        assert "--token" not in command, name  # argv is visible in ps: the token comes by environment
    assert rendered["services"]["agent1"]["environment"]["SWARM_JOIN_TOKEN"] == "swj_one"


def test_a_missing_secret_key_is_a_clear_error():
    result = config({k: v for k, v in ENV.items() if k != "DJANGO_SECRET_KEY"})
    assert result.returncode != 0
    assert "set DJANGO_SECRET_KEY" in result.stderr


def test_the_example_env_file_names_every_variable_and_renders_once_the_secret_is_set(tmp_path):
    """``.env.example`` holds every variable the file reads, and with its secret filled in (the
    only value it leaves empty that the file requires) the deployment renders from it alone."""
    example = (ROOT / ".env.example").read_text()
    named = set(re.findall(r"^([A-Z_0-9]+)=", example, flags=re.M))
    read = set(re.findall(r"\$\{([A-Z_0-9]+)", (ROOT / "docker-compose.yml").read_text()))
    assert read == named
    env_file = tmp_path / ".env"
    env_file.write_text(example.replace("DJANGO_SECRET_KEY=\n", f"DJANGO_SECRET_KEY={'s' * 48}\n"))
    clean = {k: v for k, v in os.environ.items() if k not in named}

    result = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "--env-file", str(env_file), "config"],
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    web = yaml.safe_load(result.stdout)["services"]["web"]["environment"]
    assert web["DJANGO_SECRET_KEY"] == "s" * 48
    assert web["DJANGO_ALLOWED_HOSTS"] == "localhost,127.0.0.1,web"
