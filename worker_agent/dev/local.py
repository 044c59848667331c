"""A local swarm: agents as real ``swarm-worker serve`` processes on loopback.

Used by the data-plane demo, the benchmarks and the tests; also handy for trying a split by hand::

    with LocalSwarm("smollm2-135m", spans=[(0, 10), (10, 20), (20, 30)]) as swarm:
        print(swarm.urls)          # ws://127.0.0.1:PORT for each stage, in layer order
        swarm.tickets("job-1")     # tickets signed by the swarm's own issuer key, naming
        swarm.coordinator_key("job-1")  # the job's coordinator key, to hand to the Coordinator

Each agent gets its own node key and trusts the swarm's issuer key; ports are picked by the
OS and read back from each agent's READY line. An agent with a WAN or a cheat runs through the dev
entry point (``python -m worker_agent.dev.agent``), any other as the product's ``swarm-worker``.
"""

from __future__ import annotations

import itertools
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nacl.signing import SigningKey

from worker_agent.agent.joining import TOKEN_ENV
from worker_agent.protocol.keys import generate_signing_key, load_signing_key, node_id, public_key_bytes, write_key
from worker_agent.protocol.tickets import ticket_for_stage

ALLOW_CHEAT_ENV = "SWARM_ALLOW_CHEAT"  # cheat.ALLOW_ENV, named here to keep torch out of this import
_READY = re.compile(r"^READY (ws://\S+) node=(\S+) model=(\S+) layers=(\d+):(\d+)")


@dataclass
class Agent:
    url: str
    node: str
    model: str
    layer_start: int
    layer_end: int
    process: subprocess.Popen
    log_path: Path


def even_spans(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """Split ``n_layers`` into ``stages`` contiguous spans, sizes differing by at most one."""
    bounds = [round(i * n_layers / stages) for i in range(stages + 1)]
    return list(itertools.pairwise(bounds))


class LocalSwarm:
    def __init__(
        self,
        model: str,
        spans: list[tuple[int, int]],
        *,
        threads: int = 1,
        wan: str = "",
        cheat: str | None = None,
        extra_args: list[str] | None = None,
        workdir: str | Path | None = None,
        startup_timeout_s: float = 180.0,
    ) -> None:
        self.model = model
        self.spans = spans
        self.threads = threads
        self.wan = wan
        self.cheat = cheat  # tests only: every agent of the swarm runs this cheat mode (cheat.py)
        self.extra_args = extra_args or []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if workdir:
            self.workdir = Path(workdir)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="swarm-")
            self.workdir = Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout_s = startup_timeout_s
        self.agents: list[Agent] = []
        self._started = 0  # agents started so far: names the next one's key and log
        issuer = self.workdir / "issuer.key"
        if not issuer.exists():
            write_key(issuer, generate_signing_key())
        self.issuer_key = load_signing_key(issuer)
        self.issuer_pub = self.workdir / "issuer.key.pub"
        self._coordinator_keys: dict[str, SigningKey] = {}  # job -> its coordinator key

    @property
    def urls(self) -> list[str]:
        return [agent.url for agent in self.agents]

    def coordinator_key(self, job: str) -> SigningKey:
        """The coordinator key of ``job`` (made on first use): the one its tickets name."""
        return self._coordinator_keys.setdefault(job, SigningKey.generate())

    def tickets(self, job: str, ttl_s: float = 600) -> list[bytes]:
        return [self.ticket(job, a, ttl_s) for a in self.agents]

    def ticket(self, job: str, agent: Agent | dict, ttl_s: float = 600) -> bytes:
        """A ticket for one agent, given as an ``Agent`` or as its PING info (node, model, span),
        naming the job's coordinator key."""
        identity = agent if isinstance(agent, dict) else vars(agent)
        coordinator = bytes(self.coordinator_key(job).verify_key)
        return ticket_for_stage(self.issuer_key, job, identity, coordinator_key=coordinator, ttl_s=ttl_s)

    def node_keys(self) -> list[bytes]:
        return [public_key_bytes(load_signing_key(self.workdir / f"node{i}.key")) for i in range(len(self.spans))]

    def start(self) -> LocalSwarm:
        self.agents = []
        self.add(self.spans)
        return self

    def add(self, spans: list[tuple[int, int]]) -> list[Agent]:
        """Start one more agent per span (together), each with a node key of its own; returns
        them once all are ready, and they join ``agents`` (after the ones there already)."""
        pending = []
        for index, (start, end) in enumerate(spans, start=self._started):
            key = self.workdir / f"node{index}.key"
            if not key.exists():
                write_key(key, generate_signing_key())
            log_path = self.workdir / f"agent{index}.log"
            command = [
                *agent_command(wan=self.wan, cheat=self.cheat),
                "serve",
                "--model",
                self.model,
                "--layers",
                f"{start}:{end}",
                "--port",
                "0",
                "--key",
                str(key),
                "--trust-key",
                str(self.issuer_pub),
                "--threads",
                str(self.threads),
                *self.extra_args,
            ]
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            if self.cheat is not None:
                env[ALLOW_CHEAT_ENV] = "1"
            log = open(log_path, "w")  # noqa: SIM115 - the child process owns it
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            pending.append((process, log_path, key))
        self._started += len(spans)
        try:
            added = [self._wait_ready(process, log_path) for process, log_path, _ in pending]
        except BaseException:
            for process, _, _ in pending:
                process.kill()
            raise
        self.agents.extend(added)  # stopped with the swarm, even when a check below fails
        for agent, (_, _, key) in zip(added, pending, strict=True):
            expected = node_id(public_key_bytes(load_signing_key(key)))
            if agent.node != expected:
                raise RuntimeError(f"agent {agent.url} reports node {agent.node}, its key says {expected}")
        return added

    def _wait_ready(self, process: subprocess.Popen, log_path: Path) -> Agent:
        assert process.stdout is not None
        deadline = time.monotonic() + self.startup_timeout_s
        selector = selectors.DefaultSelector()
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"agent exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
            if selector.select(timeout=0.5):
                line = process.stdout.readline()
                match = _READY.match(line)
                if match:
                    url, node, model, start, end = match.groups()
                    return Agent(url, node, model, int(start), int(end), process, log_path)
        raise RuntimeError(f"agent not ready after {self.startup_timeout_s}s:\n{log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        for agent in self.agents:
            if agent.process.poll() is None:
                agent.process.send_signal(signal.SIGTERM)
        for agent in self.agents:
            try:
                agent.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                agent.process.kill()
                agent.process.wait()
            if agent.process.stdout is not None:
                agent.process.stdout.close()
        self.agents = []
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def join_agent(
    control_plane: str, token: str | None, key_path: str | Path, log_path: str | Path, **options: Any
) -> subprocess.Popen:
    """Start ``swarm-worker join`` (``join_command``, given ``options``) as a process that logs to
    ``log_path``, with ``token`` in its environment (``join_env``: never on its command line; None:
    reconnect as the key's node)."""
    env = join_env(token, cheat=options.get("cheat"))
    log = open(log_path, "w")  # noqa: SIM115 - the child process owns it
    return subprocess.Popen(
        join_command(control_plane, key_path, **options), stdout=log, stderr=subprocess.STDOUT, env=env
    )


def join_command(
    control_plane: str,
    key_path: str | Path,
    *,
    model: str,
    max_layers: int | None = None,
    threads: int = 1,
    dtype: str = "float32",
    cheat: str | None = None,
    wan: str = "",
    drain_timeout_s: float | None = None,
    extra_args: list[str] | None = None,
) -> list[str]:
    """The command line of an agent joining ``control_plane`` with the node key at ``key_path``.
    ``cheat`` (tests only) is a mode of ``worker_agent.dev.cheat`` that the agent then runs with;
    ``wan`` emulates a WAN on its outgoing data-plane frames (e.g. ``"rtt=50ms"``)."""
    command = [
        *agent_command(wan=wan, cheat=cheat),
        "join",
        "--control-plane",
        control_plane,
        "--key",
        str(key_path),
        "--model",
        model,
        "--threads",
        str(threads),
        "--dtype",
        dtype,
    ]
    if max_layers is not None:
        command += ["--max-layers", str(max_layers)]
    if drain_timeout_s is not None:
        command += ["--drain-timeout", str(drain_timeout_s)]
    return command + (extra_args or [])


def join_env(token: str | None, *, cheat: str | None = None) -> dict[str, str]:
    """This process's environment for a joining agent: its join ``token`` (None: it reconnects as
    its key's node), and the permission a ``cheat`` needs."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(TOKEN_ENV, None)
    if token is not None:
        env[TOKEN_ENV] = token
    if cheat is not None:
        env[ALLOW_CHEAT_ENV] = "1"
    return env


def agent_command(*, wan: str = "", cheat: str | None = None) -> list[str]:
    """The command line that starts an agent, up to its subcommand: the product's ``swarm-worker``,
    or the dev entry point that runs it with a WAN or a cheat substituted in."""
    if not wan and cheat is None:
        return [sys.executable, "-m", "worker_agent.agent.cli"]
    command = [sys.executable, "-m", "worker_agent.dev.agent"]
    if wan:
        command += ["--wan", wan]
    if cheat is not None:
        command += ["--cheat", cheat]
    return command


def stop_processes(processes: list[subprocess.Popen], timeout_s: float = 15.0) -> None:
    """SIGTERM every process still running, then wait for each (killing a laggard)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
