"""A package index for hosts with no route to a public registry: the netlab's hosts install the agent
from it as an air-gapped site would (the control plane's SWARM_AGENT_PIP_INDEX).

    simple = build_wheelhouse(tmp_path / "index")   # tmp_path/index/simple/<project>/<file>.whl
    cloud.popen([sys.executable, "-m", "http.server", "8080", "--directory", str(simple.parent)])
    # then: pip install --index-url http://10.201.0.10:8080/simple/ --trusted-host 10.201.0.10:8080 ...

It holds every wheel the install script (marketplace/install/templates/install/agent.sh) asks an
index for: its pip pin (PIP_SPEC), torch and the rest of the agent's ``[worker]`` extra as
pyproject.toml pins them, with all their dependencies, for this machine's Python and platform (the
netlab's hosts run it). The agent's and the models' own wheels come from the control plane, not
from here. Nothing is built (all are wheels), so setuptools is there only because torch requires it.

The wheels are fetched once with ``pip download --only-binary=:all:`` from pip's configured indexes
into ``.data/netlab-wheelhouse/<hash of the requirements and the interpreter>/``; a later call only
links them into the layout. A plain ``python -m http.server`` serving the folder above ``simple``
is a valid PEP 503 index: its directory listings are the project pages, and each project's folder
has its normalized name (lower case, runs of ``-_.`` as one ``-``), the name pip asks for.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE_ROOT = ROOT / ".data" / "netlab-wheelhouse"
INSTALL_SCRIPT = ROOT / "marketplace" / "install" / "templates" / "install" / "agent.sh"
DOWNLOAD_TIMEOUT_S = 1800.0  # torch alone is a few hundred MB


def agent_requirements() -> list[str]:
    """What the install script asks an index for: its pip pin, then the [worker] extra (torch included)."""
    pip_spec = re.search(r"^PIP_SPEC=(\S+)$", INSTALL_SCRIPT.read_text(), re.M)
    if pip_spec is None:
        raise RuntimeError(f"{INSTALL_SCRIPT} sets no PIP_SPEC")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [pip_spec.group(1), *project["optional-dependencies"]["worker"]]


def normalized(project: str) -> str:
    """PEP 503's name for a project's page."""
    return re.sub(r"[-_.]+", "-", project).lower()


def _cache_key(requirements: list[str]) -> str:
    # The resolution depends on the interpreter and the platform as much as on the pins.
    interpreter = f"{sys.implementation.name}{sys.version_info.major}.{sys.version_info.minor} {sys.platform}"
    text = "\n".join([interpreter, *sorted(requirements)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def download(requirements: list[str], cache_root: Path = CACHE_ROOT) -> Path:
    """The folder holding the wheels of ``requirements`` and their dependencies, downloaded on the
    first call only. A download goes to a temporary folder renamed into place once complete, so an
    interrupted one is never taken for the cache, and two runs at once both end with the same."""
    folder = cache_root / _cache_key(requirements)
    if folder.is_dir():
        return folder
    cache_root.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", suffix=".partial", dir=cache_root))
    try:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
        command += ["--only-binary=:all:", "--dest", str(partial), *requirements]
        # Its output is captured: a mirror's warnings are noise in a test's output, unless it fails.
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
        if done.returncode != 0:
            raise RuntimeError(f"pip download failed ({done.returncode}):\n{done.stderr[-5000:]}")
        try:
            partial.rename(folder)
        except OSError:
            if not folder.is_dir():  # not another run's complete download: a real failure
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, target)


def build_wheelhouse(target: Path) -> Path:
    """Fill ``target/simple/<normalized project>/`` with the agent install's wheels and return
    ``target/simple``, the index's root (serve ``target``: the URL ends in ``/simple/``)."""
    wheels = download(agent_requirements())
    simple = target / "simple"
    for wheel in sorted(wheels.glob("*.whl")):
        # A wheel's file name starts with its project's name, with runs of -_. written as one _.
        project = simple / normalized(wheel.name.split("-", 1)[0])
        project.mkdir(parents=True, exist_ok=True)
        if not (project / wheel.name).exists():
            _link(wheel, project / wheel.name)
    return simple
