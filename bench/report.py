"""What every benchmark's report says of the machine it ran on, and how the report is written.

Each script beside this one imports it (a script's own folder is first on its path): its JSON
report in ``bench/results/`` names the CPU, the count of CPUs and the Python it ran on
(``describe_machine``, or ``machine_line`` where a report keeps the machine as one line), with what
else that benchmark depends on, and is written by ``write_json``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (where there is none, the platform's word)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, to two decimals."""
    return [round(x, 2) for x in os.getloadavg()]


def package_versions(*packages: str) -> dict[str, str | None]:
    """Each installed package's version (None where it is not installed)."""
    versions: dict[str, str | None] = {}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def describe_machine(**extra: object) -> dict:
    """The machine a report ran on: its CPU, how many, the Python, then ``extra`` (the versions and
    settings that benchmark depends on)."""
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "python": platform.python_version(), **extra}


def machine_line() -> str:
    """``describe_machine``'s first three in one line: ``<cpu>, <n> CPUs, Python <version>``."""
    return f"{cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def write_json(path: Path, report: dict) -> None:
    """Write ``report`` to ``path`` (its folder made where missing) as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
