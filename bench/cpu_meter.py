"""The CPU each kind of process of bench/load.py's topology spends, and the model's share of it.

``CpuMeter(topology).snapshot()`` before and after a part of the run, ``accounting`` of the two
per streamed token (the control plane's non-model CPU per token is the figure its target is
about), ``print_accounting`` for the table. ``quiet`` waits until every job is settled and audited:
the work a stream leaves behind is its cost too.
"""

from __future__ import annotations

import contextlib
import time
import urllib.parse
from pathlib import Path

# The processes whose CPU is the control plane's: the Procfile's, the database and the broker.
CONTROL_PLANE = ("web", "coordinator", "verifier", "worker", "beat", "postgres", "redis")
KINDS = (*CONTROL_PLANE, "relay", "agents", "client")


def process_kind(cmdline: list[str]) -> str | None:
    """A Procfile process's kind from its command line (``marketplace.metrics.process_kind``'s)."""
    from marketplace.metrics import process_kind as kind_of

    if not cmdline:
        return None
    program = Path(cmdline[0]).name
    if program.startswith("python") and len(cmdline) > 1:  # an interpreter running a console script
        cmdline = cmdline[1:]
        program = Path(cmdline[0]).name
    if program == "swarm-relay":
        return "relay"
    if program in ("uvicorn", "daphne", "celery"):
        return kind_of(cmdline)
    return None


class CpuMeter:
    """CPU seconds (user + system) of each kind of process, and the model's share of them.

    Processes are found afresh at each snapshot: honcho's descendants by command line (or their
    nearest ancestor's), the PostgreSQL and Redis servers listening on DATABASE_URL's and REDIS_URL's
    ports (PostgreSQL's backends with them; the postmaster's reaped children count through its
    children's times: the server is this bench's alone while it runs), the agents, and this
    process (the client). The model's share is what the processes counted in
    ``swarm_model_cpu_seconds`` (``worker_agent.cpu``), read from the Prometheus multiprocess files."""

    def __init__(self, topology) -> None:
        """``topology``: bench/load.py's ``Topology``, started."""
        self.topology = topology

    def snapshot(self) -> dict:
        import psutil

        totals = dict.fromkeys(KINDS, 0.0)

        def add(kind: str, process: psutil.Process, children: bool = False) -> None:
            try:
                times = process.cpu_times()
            except psutil.Error:
                return
            totals[kind] += times.user + times.system
            if children:
                totals[kind] += times.children_user + times.children_system

        assert self.topology.honcho is not None
        # A process's kind, or its nearest ancestor's: uvicorn's workers are spawned interpreters.
        found: dict[int, tuple[int, str | None]] = {}  # pid -> (parent pid, kind by its own command line)
        for process in psutil.Process(self.topology.honcho.pid).children(recursive=True):
            try:
                found[process.pid] = (process.ppid(), process_kind(process.cmdline()))
            except psutil.Error:
                continue

        def kind_of(pid: int) -> str | None:
            while pid in found:
                parent, kind = found[pid]
                if kind is not None:
                    return kind
                pid = parent
            return None

        for pid in found:
            kind = kind_of(pid)
            if kind is not None:
                with contextlib.suppress(psutil.Error):
                    add(kind, psutil.Process(pid))
        for kind, url in (("postgres", self.topology.env["DATABASE_URL"]), ("redis", self.topology.redis_url)):
            server = self._listening(urllib.parse.urlsplit(url).port or {"postgres": 5432, "redis": 6379}[kind])
            if server is not None:  # PostgreSQL's backends are its children; the reaped ones count in its times
                for process in [server, *server.children(recursive=True)]:
                    add(kind, process, children=process is server)
        for agent in self.topology.agents:
            try:
                for process in [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]:
                    add("agents", process)
            except psutil.Error:
                continue
        add("client", psutil.Process())
        return {"cpu_s": totals, "model_s": self.model_seconds()}

    @staticmethod
    def _listening(port: int):
        """The process listening on ``port`` in this network namespace (other namespaces' servers,
        e.g. a lab's own PostgreSQL, are not this topology's), or None."""
        import psutil

        for connection in psutil.net_connections(kind="tcp"):
            if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port and connection.pid:
                with contextlib.suppress(psutil.Error):
                    return psutil.Process(connection.pid)
        return None

    def model_seconds(self) -> dict[str, dict[str, float]]:
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.topology.workdir / "prometheus"))
        found: dict[str, dict[str, float]] = {}
        for metric in registry.collect():
            if metric.name != "swarm_model_cpu_seconds":
                continue
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    kind = found.setdefault(sample.labels["process"], {})
                    kind[sample.labels["part"]] = kind.get(sample.labels["part"], 0.0) + sample.value
        return found


def quiet(timeout_s: float = 180.0) -> None:
    """Until every job is settled and every audit replayed: the work a stream leaves behind is its cost too."""
    from marketplace.jobs.models import Job
    from marketplace.verification.models import Audit, CheckState

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            not Job.objects.filter(settled_at__isnull=True).exists()
            and not Audit.objects.filter(state=CheckState.PENDING).exists()
        ):
            return
        time.sleep(0.5)


def accounting(before: dict, after: dict, tokens: int) -> dict:
    """CPU per 1,000 streamed tokens for each kind of process, split into the model and the rest,
    and the control plane's non-model CPU per streamed token (the issue's figure)."""
    rows = {}
    for kind in KINDS:
        cpu = after["cpu_s"][kind] - before["cpu_s"][kind]
        model = sum(after["model_s"].get(kind, {}).values()) - sum(before["model_s"].get(kind, {}).values())
        parts = {
            part: round(1000 * (seconds - before["model_s"].get(kind, {}).get(part, 0.0)) / tokens, 4)
            for part, seconds in after["model_s"].get(kind, {}).items()
        }
        rows[kind] = {
            "cpu_s_per_1k_tokens": round(1000 * cpu / tokens, 4),
            "model_s_per_1k_tokens": round(1000 * model / tokens, 4),
            "other_s_per_1k_tokens": round(1000 * (cpu - model) / tokens, 4),
            "model_parts_s_per_1k_tokens": parts,
        }
    other = sum(rows[kind]["other_s_per_1k_tokens"] for kind in CONTROL_PLANE)
    return {
        "tokens": tokens,
        "per_kind": rows,
        "control_plane_other_ms_per_token": round(other, 4),  # s per 1k tokens = ms per token
        "control_plane_total_ms_per_token": round(sum(rows[k]["cpu_s_per_1k_tokens"] for k in CONTROL_PLANE), 4),
    }


def print_accounting(table: dict) -> None:
    print(f"\nCPU per 1,000 streamed tokens ({table['tokens']} tokens), seconds:")
    print(f"{'process':<12} {'all':>8} {'model':>8} {'other':>8}  model parts")
    for kind, row in table["per_kind"].items():
        parts = ", ".join(f"{part} {value:.3f}" for part, value in row["model_parts_s_per_1k_tokens"].items() if value)
        print(
            f"{kind:<12} {row['cpu_s_per_1k_tokens']:>8.3f} {row['model_s_per_1k_tokens']:>8.3f} "
            f"{row['other_s_per_1k_tokens']:>8.3f}  {parts}"
        )
    print(
        f"control plane ({', '.join(CONTROL_PLANE)}): {table['control_plane_other_ms_per_token']:.3f} ms of "
        f"non-model CPU per streamed token ({table['control_plane_total_ms_per_token']:.3f} ms in all)"
    )
