"""The production topology across hosts, with a web host and a coordinator host killed mid-run.

    .venv/bin/python bench/scaleout.py            # as root: 200 streams of 32 tokens, about 5 minutes on 2 cores
    .venv/bin/python bench/scaleout.py --quick    # 40 streams of 16 tokens

On ``tests/netlab``'s namespace network, with hosts of its own added (root only; each host a network
namespace with a hostname of its own, every process of it started through ``Host.popen``):

    host              runs
    pg                PostgreSQL: a fresh cluster (initdb in a temporary folder, as postgres)
    redis             redis-server: channel layer, cache and Celery broker
    ops               migrations, the keys and accounts (``scaleout_host.py setup``), then the
                      Procfile's verifier, worker and beat
    web1, web2        the Procfile's web (uvicorn --workers 2): one DJANGO_SECRET_KEY, the same
                      ticket and CA keys (ops's data folder, copied), trusting lb's X-Forwarded-For
    lb                HAProxy: HTTP round robin to web1 and web2, health check GET /readyz, each
                      response naming its server (X-Served-By), long timeouts for streams and the
                      agents' WebSockets, a connection refused redispatched to the other server
    coord1, coord2    the Procfile's coordinator1 and coordinator2 (celery -Q coord.local)
    agent1..agent3    tiny-llama agents capped at 2 of its 6 layers, joined through lb
    client            the customer: ``scaleout_host.py client``

After ``--warmup`` streams one at a time, the client starts ``--streams`` streamed chat completions
at once (the openai client, ``stream_options.include_usage``, greedy), each with an Idempotency-Key
of its own. Once ``--kill-when`` streams receive tokens, every process of web1 and of coord1 is
SIGKILLed (their process groups). A failed attempt (a dropped connection, an error event, a 5xx,
409 or 429) is retried with the same key through lb until it completes (at most 8 attempts).

Each stream is put on the hosts that served its first attempt (``stream_row``): lb's X-Served-By
(or lb's log) for the web, the job's ``coordinator_process`` (or the coordinators' logs) for the
coordinator. Reported: outcomes (completed first time, on retry, failed), streams on surviving
hosts that saw any disruption, 5xx by web host (the client's and lb's log), how long the retries
took, and the ledger checked exactly with its Idempotency-Keys (``scaleout_host.ledger``). Done when
(reported, not asserted; tests/test_netlab_scaleout.py asserts the same at a small scale): streams
on surviving hosts unaffected; every stream on a killed host completes or ends with a retry-safe
error whose retry completes, no key charged twice; the ledger exact; 0 5xx from surviving hosts.
The table goes to stdout, everything but the per-stream rows to ``bench/results/scaleout.json``.
Where the lab cannot be built (``missing_reason``: not root, no ``ip``, ``iptables``, HAProxy,
redis-server or PostgreSQL's server programs) it says why and exits 0 without results.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # the checkout's packages and tests.netlab, whatever the venv points at
sys.path.insert(0, str(BENCH))  # this folder's modules, also when a test imports this file

from report import load_average, machine_line, write_json  # noqa: E402 - after the path is set
from scaleout_report import KILLED, analyse, print_table  # noqa: E402

from tests.live import wait_for  # noqa: E402
from tests.netlab import Netlab, NetlabUnavailable, missing_netlab_reason  # noqa: E402
from tests.netlab.network import WAN, tool_path  # noqa: E402
from worker_agent.dev.local import join_command, join_env  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "scaleout.json"
HOST_SCRIPT = BENCH / "scaleout_host.py"
MODEL = "tiny-llama"
MAX_LAYERS = 2
HOSTS = {
    "lb": "10.201.0.40",
    "web1": "10.201.0.41",
    "web2": "10.201.0.42",
    "coord1": "10.201.0.51",
    "coord2": "10.201.0.52",
    "pg": "10.201.0.61",
    "redis": "10.201.0.62",
    "ops": "10.201.0.63",
    "agent1": "10.201.0.71",
    "agent2": "10.201.0.72",
    "agent3": "10.201.0.73",
}
WEBS = ("web1", "web2")
COORDINATORS = {"coord1": "coordinator1", "coord2": "coordinator2"}  # host -> its Procfile process
OPS = ("verifier", "worker", "beat")
AGENTS = ("agent1", "agent2", "agent3")
PORT = 8000
TASK_STARTED = re.compile(r" job=(\S+) task marketplace\.jobs\.tasks\.run_job\[\S+\] started")
START_TIMEOUT_S = 600.0  # a dozen processes importing torch, three agents loading and probing, on 2 cores
COMMAND_TIMEOUT_S = 600.0


# --- the topology -----------------------------------------------------------------------------


def postgres_programs() -> Path | None:
    """The folder of PostgreSQL's server programs: pg_config's, else the newest Debian keeps."""
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        folder = Path(subprocess.run([pg_config, "--bindir"], capture_output=True, text=True).stdout.strip())
        if (folder / "initdb").exists():
            return folder
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda path: path.parent.parent.name)
    return found[-1].parent if found else None


def missing_reason() -> str | None:
    """Why this machine cannot build the lab and its servers, or None when it has what it takes."""
    reason = missing_netlab_reason()
    if reason is not None:
        return reason
    for program, package in (("haproxy", "haproxy"), ("redis-server", "redis-server"), ("setpriv", "util-linux")):
        if tool_path(program) is None:
            return f"the scale-out lab needs {program} (apt-get install {package})"
    if postgres_programs() is None:
        return "the scale-out lab needs PostgreSQL's server programs (apt-get install postgresql)"
    return None


def procfile() -> dict[str, str]:
    """The Procfile's processes: name -> command, in the shell syntax honcho runs."""
    entries = {}
    for line in (ROOT / "Procfile").read_text().splitlines():
        name, colon, command = line.partition(":")
        if colon and name.isidentifier():
            entries[name] = command.strip()
    return entries


def haproxy_config(stats_socket: Path) -> str:
    lb, (web1, web2) = HOSTS["lb"], (HOSTS[name] for name in WEBS)
    return f"""global
    log stdout format raw local0
    maxconn 4000
    stats socket {stats_socket} mode 600 level admin

defaults
    mode http
    log global
    log-format "srv=%s status=%ST term=%tsc key=%{{+Q}}[capture.req.hdr(0)] rid=%{{+Q}}[capture.res.hdr(0)] path=%HP"
    option forwardfor
    # A connection refused (a web host gone, not yet marked down) goes to the other server; a
    # request once sent is never sent again (retry-on's default: connection failures only).
    retries 3
    option redispatch 1
    timeout connect 5s
    timeout client 15m
    timeout server 15m
    timeout tunnel 1h
    timeout http-request 30s
    timeout queue 60s
    timeout check 10s

frontend api
    bind {lb}:{PORT}
    capture request header Idempotency-Key len 128
    capture response header x-request-id len 64
    default_backend web

backend web
    balance roundrobin
    option httpchk
    http-check send meth GET uri /readyz ver HTTP/1.1 hdr Host {lb}
    http-check expect status 200
    http-response set-header X-Served-By %[srv_name]
    default-server check inter 2s fall 3 rise 2
    server web1 {web1}:{PORT}
    server web2 {web2}:{PORT}
"""


class ScaleOut:
    """The hosts above on ``lab``, started by ``start`` and stopped with the lab (``lab.close``)."""

    def __init__(self, lab: Netlab, workdir: Path, process_alive_s: float | None) -> None:
        self.lab, self.workdir = lab, workdir
        self.processes: dict[str, list[subprocess.Popen]] = collections.defaultdict(list)
        self.pgdata = Path(tempfile.mkdtemp(prefix="scaleout-pg-"))  # postgres must reach it: not in workdir
        self.stats_socket = workdir / "haproxy.sock"
        self.url = f"http://{HOSTS['lb']}:{PORT}"
        self.accounts: dict = {}
        self.env = self._control_plane_env(process_alive_s)

    def _control_plane_env(self, process_alive_s: float | None) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("SWARM_", "DJANGO_", "DATABASE_", "REDIS_"))}
        env = keep | {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{keep.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "DJANGO_SETTINGS_MODULE": "marketplace.settings",
            "DJANGO_SECRET_KEY": secrets.token_hex(32),
            "DJANGO_ALLOWED_HOSTS": ",".join(HOSTS[name] for name in ("lb", *WEBS)),
            "DATABASE_URL": f"postgres://postgres@{HOSTS['pg']}:5432/postgres",
            "REDIS_URL": f"redis://{HOSTS['redis']}:6379/0",
            "SWARM_PUBLIC_URL": self.url,
            "SWARM_PORT": str(PORT),
            "SWARM_MODELS": MODEL,
            "SWARM_SPARES_PER_PIPELINE": "0",
            "SWARM_REBALANCE_MIN_INTERVAL_S": "86400",  # a re-placement mid-run would reload blocks
            "SWARM_LOG_LEVEL": "WARNING",
            # uvicorn takes the client's address from lb's X-Forwarded-For: an agent's data URL must
            # name the address the control plane sees it at.
            "FORWARDED_ALLOW_IPS": HOSTS["lb"],
        }
        if process_alive_s is not None:
            env["SWARM_PROCESS_ALIVE_S"] = str(process_alive_s)
        return env

    def host_env(self, host: str) -> dict[str, str]:
        return self.env | {"SWARM_DATA_DIR": str(self.workdir / f"data-{host}"), "SWARM_HOST": HOSTS[host]}

    def spawn(self, host: str, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``argv`` on ``host`` under the host's own hostname (what Celery's %h and the
        processes' liveness ids name), logging to ``<name>.log``."""
        named = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *argv]
        with (self.workdir / f"{name}.log").open("w") as log:
            process = self.lab.hosts[host].popen(named, env or self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.processes[host].append(process)
        return process

    def run_on(self, host: str, argv: list[str], env: dict[str, str] | None = None) -> str:
        done = self.lab.hosts[host].run(argv, env or self.env, timeout_s=COMMAND_TIMEOUT_S, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[:4]} on {host} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return done.stdout

    def ops_script(self, *args: str) -> str:
        return self.run_on("ops", [sys.executable, str(HOST_SCRIPT), *args], self.host_env("ops"))

    def start(self) -> None:
        self._start_postgres()
        self._start_redis()
        ops_env = self.host_env("ops")
        self.run_on("ops", [sys.executable, "-m", "marketplace", "migrate", "--noinput", "-v", "0"], ops_env)
        self.ops_script("setup", "--out", str(self.workdir / "accounts.json"))
        self.accounts = json.loads((self.workdir / "accounts.json").read_text())
        commands = procfile()
        for host in (*WEBS, *COORDINATORS):
            # The ticket key (agents trust it) and the CA: one for the control plane, on every host.
            shutil.copytree(self.workdir / "data-ops", self.workdir / f"data-{host}")
        for host in WEBS:
            self.spawn(host, host, ["sh", "-c", f"exec {commands['web']}"], self.host_env(host))
        for host, role in COORDINATORS.items():
            # At INFO each task's start names its job: what a job its coordinator never marked
            # running (killed first) is put on.
            env = self.host_env(host) | {"SWARM_LOG_LEVEL": "INFO"}
            self.spawn(host, host, ["sh", "-c", f"exec {commands[role]}"], env)
        for role in OPS:
            self.spawn("ops", role, ["sh", "-c", f"exec {commands[role]}"], ops_env)
        (self.workdir / "haproxy.cfg").write_text(haproxy_config(self.stats_socket))
        self.spawn("lb", "haproxy", [str(tool_path("haproxy")), "-db", "-f", str(self.workdir / "haproxy.cfg")])
        both_up = {name: "UP" for name in WEBS}
        wait_for(lambda: self.lb_status() == both_up, START_TIMEOUT_S, "both web hosts up behind the load balancer")
        for i, host in enumerate(AGENTS):
            argv = join_command(self.url, self.workdir / f"{host}.key", model=MODEL, max_layers=MAX_LAYERS)
            self.spawn(host, host, argv, join_env(self.accounts["tokens"][i]) | self.agent_env())
        self.ops_script("ready", "--timeout", str(START_TIMEOUT_S))

    def agent_env(self) -> dict[str, str]:
        return {k: v for k, v in self.env.items() if k in ("PATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")}

    def _start_postgres(self) -> None:
        """A fresh cluster of the postgres user's, trusting the public network (no password: the
        lab's hosts only reach it), listening on pg's address."""
        programs = postgres_programs()
        assert programs is not None  # missing_reason says so first
        shutil.chown(self.pgdata, "postgres", "postgres")
        as_postgres = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
        cluster = self.pgdata / "cluster"
        initdb = [str(programs / "initdb"), "-D", str(cluster), "-U", "postgres", "--auth=trust", "--no-sync"]
        self.run_on("pg", [*as_postgres, *initdb])
        with (cluster / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {WAN} trust\n")
        settings = {"listen_addresses": HOSTS["pg"], "unix_socket_directories": str(self.pgdata)}
        settings["max_connections"] = "400"  # a pool per web and worker process
        options = [f"--{name}={value}" for name, value in settings.items()]
        self.spawn("pg", "postgres", [*as_postgres, str(programs / "postgres"), "-D", str(cluster), *options])
        ready = [str(programs / "pg_isready"), "-q", "-U", "postgres", "-h", HOSTS["pg"]]
        wait_for(lambda: self.lab.hosts["ops"].run(ready).returncode == 0, 60, "PostgreSQL on pg")

    def _start_redis(self) -> None:
        (self.workdir / "redis").mkdir()
        argv = ["redis-server", "--bind", HOSTS["redis"], "--port", "6379", "--save", "", "--appendonly", "no"]
        self.spawn("redis", "redis", [*argv, "--protected-mode", "no", "--dir", str(self.workdir / "redis")])
        ping = ["redis-cli", "-h", HOSTS["redis"], "ping"]
        wait_for(lambda: self.lab.hosts["ops"].run(ping).stdout.strip() == "PONG", 60, "Redis on redis")

    def lb_status(self) -> dict[str, str]:
        """Each web server's state as HAProxy sees it (UP, DOWN, ...), from its stats socket."""
        try:
            with socket.socket(socket.AF_UNIX) as stats:
                stats.connect(str(self.stats_socket))
                stats.sendall(b"show stat\n")
                answer = b"".join(iter(lambda: stats.recv(65536), b"")).decode()
        except OSError:
            return {}
        lines = answer.splitlines()
        if not lines or not lines[0].startswith("# "):
            return {}
        columns = lines[0][2:].split(",")
        rows = [dict(zip(columns, line.split(","), strict=False)) for line in lines[1:] if line]
        return {
            row["svname"]: row["status"].split()[0] for row in rows if row["pxname"] == "web" and row["svname"] in WEBS
        }

    def kill(self, host: str) -> float:
        """SIGKILL every process started on ``host`` (each one's process group); when it was done."""
        for process in self.processes[host]:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        killed_at = time.time()
        for process in self.processes[host]:
            process.wait(30)
        return killed_at

    def lb_log(self) -> list[dict]:
        """lb's log: one entry per API request, in the order they ended."""
        entries = []
        for line in (self.workdir / "haproxy.log").read_text(errors="replace").splitlines():
            if line.startswith("srv="):
                entry = dict(field.split("=", 1) for field in shlex.split(line))
                if entry.get("path", "").startswith("/v1/"):
                    entries.append(entry)
        return entries

    def jobs_taken(self) -> dict[str, str]:
        """Each job whose task a coordinator host started (its log says so): job id -> host."""
        taken = {}
        for host in COORDINATORS:
            for line in (self.workdir / f"{host}.log").read_text(errors="replace").splitlines():
                found = TASK_STARTED.search(line)
                if found:
                    taken.setdefault(found.group(1), host)
        return taken

    def tail(self, name: str, chars: int = 3000) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

    def close(self) -> None:
        shutil.rmtree(self.pgdata, ignore_errors=True)


# --- the run ----------------------------------------------------------------------------------


def run(options: argparse.Namespace, workdir: Path) -> dict:
    """Build the lab and the topology, run the streams with the kills, and gather every figure."""
    lab = Netlab.start(extra_hosts=HOSTS)
    topology = ScaleOut(lab, workdir, options.process_alive_s)
    try:
        topology.start()
        return streams_with_kills(topology, options)
    except BaseException:
        for name in ("web1", "web2", "coord1", "coord2", "worker", "haproxy", "agent1", "client"):
            print(f"--- {name}.log\n{topology.tail(name)}", file=sys.stderr)
        raise
    finally:
        lab.close()
        topology.close()


def streams_with_kills(topology: ScaleOut, options: argparse.Namespace) -> dict:
    out, progress = topology.workdir / "client.json", topology.workdir / "progress.json"
    argv = [sys.executable, str(HOST_SCRIPT), "client", "--url", topology.url, "--api-key"]
    argv += [topology.accounts["api_key"], "--run", f"scaleout-{secrets.token_hex(3)}", "--streams"]
    argv += [str(options.streams), "--warmup", str(options.warmup), "--max-tokens", str(options.max_tokens)]
    client = topology.spawn("client", "client", [*argv, "--out", str(out), "--progress", str(progress)])

    def flowing() -> int:
        try:
            return json.loads(progress.read_text())["flowing"]
        except (OSError, ValueError):
            return 0

    wanted = f"{options.kill_when} streams receiving tokens"
    wait_for(lambda: flowing() >= options.kill_when or client.poll() is not None, COMMAND_TIMEOUT_S, wanted)
    in_flight = flowing()
    kills = {host: topology.kill(host) for host in KILLED}
    marked_down = None
    while client.poll() is None:
        if marked_down is None and topology.lb_status().get("web1") == "DOWN":
            marked_down = time.time()
        time.sleep(0.5)
    if client.returncode != 0:
        raise RuntimeError(f"the client failed ({client.returncode}):\n{topology.tail('client')}")
    result = json.loads(out.read_text())
    log = topology.lb_log()
    keys = collections.defaultdict(list)
    for stream in result["warmup"] + result["streams"]:
        keys[stream["key"]] += [a["request_id"] for a in stream["attempts"] if a["request_id"]]
    for entry in log:
        if entry["key"] in keys and entry["rid"] not in ("", "-"):
            keys[entry["key"]].append(entry["rid"])
    (topology.workdir / "keys.json").write_text(json.dumps(keys))
    accounts = topology.accounts
    report = ["report", "--customer", str(accounts["customer"]), "--granted", str(accounts["granted_nano"])]
    checked = json.loads(topology.ops_script(*report, "--keys", str(topology.workdir / "keys.json")))
    (topology.workdir / "report.json").write_text(json.dumps(checked))
    return analyse(result, checked, log, topology.jobs_taken(), kills, in_flight, marked_down)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2, help="streams one at a time before the burst")
    parser.add_argument("--quick", action="store_true", help="40 streams of 16 tokens")
    parser.add_argument(
        "--kill-when", type=int, default=None, help="kill once this many streams receive tokens (default: a third)"
    )
    parser.add_argument("--process-alive-s", type=float, default=None, help="SWARM_PROCESS_ALIVE_S (default: its own)")
    parser.add_argument("--keep", type=Path, default=None, help="keep every log in this folder")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.max_tokens = 40, 16
    if args.kill_when is None:
        args.kill_when = max(1, min(args.streams, 64) // 3)
    return args


def main() -> int:
    args = parse_args()
    reason = missing_reason()
    if reason is not None:
        print(f"bench/scaleout.py: {reason}; nothing measured")
        return 0
    # SIGTERM ends a run as Ctrl-C does: the lab's own handler removes the lab first, then this one
    # unwinds, and the PostgreSQL cluster's folder and the work folder go too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with tempfile.TemporaryDirectory(prefix="bench-scaleout-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            result = run(args, workdir)
        except NetlabUnavailable as exc:
            print(f"bench/scaleout.py: {exc}; nothing measured")
            return 0
    result["conditions"] = {
        "machine": machine_line(),
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("output", "keep")},
        "hosts": HOSTS,
        "killed": list(KILLED),
        "load_average_at_end": load_average(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json(args.output, {k: v for k, v in result.items() if k != "streams"})
    print_table(result)
    print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
