"""``make demo`` for hosts on other networks: DEMO_HOST is the address its web app listens on and the
control plane's public address, which the dashboard's join commands name.

Each case imports ``marketplace.demo`` in a fresh interpreter (it sets the environment the settings
read when it is imported) and reads the settings it leads to; nothing is started.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.control

READ_SETTINGS = (
    "import marketplace.demo as demo; from django.conf import settings; "
    "print(demo.HOST, settings.SWARM_PUBLIC_URL, ','.join(settings.ALLOWED_HOSTS))"
)


def import_demo(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("DEMO_", "SWARM_", "DJANGO_"))}
    return subprocess.run(
        [sys.executable, "-c", READ_SETTINGS],
        env=inherited | {"DEMO_DIR": str(tmp_path)} | env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_demo_names_the_address_it_listens_on_as_the_public_url(tmp_path):
    done = import_demo(tmp_path, DEMO_HOST="10.201.0.10", DEMO_PORT="8123")

    assert (done.returncode, done.stdout) == (
        0,
        "10.201.0.10 http://10.201.0.10:8123 10.201.0.10,127.0.0.1,localhost,[::1]\n",
    )


def test_the_demo_stays_on_loopback_by_default(tmp_path):
    done = import_demo(tmp_path)

    assert (done.returncode, done.stdout) == (0, "127.0.0.1 http://127.0.0.1:8000 127.0.0.1,localhost,[::1]\n")


def test_an_explicit_public_url_wins_over_the_demo_host(tmp_path):
    done = import_demo(tmp_path, DEMO_HOST="10.201.0.10", SWARM_PUBLIC_URL="https://swarm.example.test")

    assert (done.returncode, done.stdout) == (
        0,
        "10.201.0.10 https://swarm.example.test 10.201.0.10,127.0.0.1,localhost,[::1]\n",
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "::1", "10.0.0.5:80"])
def test_the_demo_refuses_a_host_no_one_can_connect_to_by_its_url(tmp_path, host):
    done = import_demo(tmp_path, DEMO_HOST=host)

    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == f"DEMO_HOST must be an IPv4 address or a host name of this machine, not {host!r}\n"
