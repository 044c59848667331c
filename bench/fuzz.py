"""Bounded fuzz: hostile inputs from a seeded generator against a real stage server process, the
agent control channel and the HTTP API of a real control plane.

    .venv/bin/python bench/fuzz.py                      # 1,000,000 frames, 10,000 messages, 10,000 requests
    .venv/bin/python bench/fuzz.py --quick              # 20,000 / 1,000 / 1,000

Checks (reported, never asserted): 0 crashes (the agent still answers a PING and the control
plane ``/healthz`` at the end), 0 hangs (every window of frames or messages, and every request,
answered within ``--hang-s``), 0 server errors (5xx other than 503, which is the API's answer
when no pipeline can serve a valid request), and no process above 1.5x its starting RSS
(psutil, sampled every 0.2 s). Prints a table; writes ``bench/results/fuzz.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
from report import describe_machine, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fuzzing import (  # noqa: E402 - after the path is set
    ControlStats,
    FrameStats,
    answers_ping,
    fuzz_api,
    fuzz_connection,
    fuzz_control_channel,
)
from worker_agent.dev.local import LocalSwarm  # noqa: E402
from worker_agent.protocol.keys import load_signing_key  # noqa: E402

MODEL = "tiny-llama"
RSS_LIMIT = 1.5  # the most any process may grow to, as a multiple of its starting RSS


class RssWatch:
    """The largest RSS of a process, sampled in a thread until stopped."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        self.process = psutil.Process(pid)
        self.start_rss = self.peak_rss = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        ratio = self.peak_rss / self.start_rss
        return {"start_mib": self.start_rss / 2**20, "peak_mib": self.peak_rss / 2**20, "peak_ratio": ratio}


def data_plane(frames: int, connections: int, seed: int, hang_s: float) -> dict:
    """``frames`` fuzzed frames over ``connections`` connections to one agent process, half of
    them after a valid HELLO, half before any."""
    with LocalSwarm(MODEL, [(0, 6)], threads=1) as swarm:
        url, job = swarm.urls[0], "fuzz-job"
        ticket = swarm.tickets(job)[0]
        watch = RssWatch(swarm.agents[0].process.pid)
        started = time.monotonic()

        async def run() -> tuple[FrameStats, bool]:
            each = frames // connections
            results = await asyncio.gather(
                *(
                    fuzz_connection(
                        url,
                        job=job,
                        ticket=ticket,
                        key=swarm.coordinator_key(job),
                        seed=seed + i,
                        count=each,
                        hello=i % 2 == 0,
                        hang_s=hang_s,
                    )
                    for i in range(connections)
                )
            )
            total = FrameStats()
            for stats in results:
                total.add(stats)
            return total, await answers_ping(url, hang_s)

        total, alive = asyncio.run(run())
        elapsed = time.monotonic() - started
        memory = watch.stop()
        crashed = swarm.agents[0].process.poll() is not None or not alive
    return {
        "inputs": total.sent,
        "answers": total.answers,
        "closed_connections": total.closed,
        "hangs": total.hangs,
        "slowest_window_s": total.slowest_window_s,
        "crashes": int(crashed),
        "server_errors": 0,
        "seconds": elapsed,
        "per_s": total.sent / elapsed,
        "memory": memory,
    }


def serve_control_plane(port: int, setup_path: Path) -> None:
    """The child process: a fresh control plane (SQLite, in-memory channel layer) with a provider,
    a joined node, a second node and a customer's API key; writes them to ``setup_path``."""
    # Imported here: only the child process that serves the control plane sets Django up.
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    # Imported after django.setup(): models need the app registry.
    from django.contrib.auth import get_user_model

    from marketplace.billing.services import grant
    from marketplace.embedded import EmbeddedServer
    from marketplace.jobs.services import create_api_key
    from marketplace.nodes.joining import create_node, register_agent
    from worker_agent.protocol.control_protocol import join_signature
    from worker_agent.protocol.keys import generate_signing_key, public_key_bytes, write_key

    User = get_user_model()
    provider = User.objects.create(username="fuzz-provider", email="provider@fuzz.example", is_provider=True)
    customer = User.objects.create(username="fuzz-customer", email="customer@fuzz.example", is_customer=True)
    grant(customer, 5, memo="fuzz credits")
    _, api_key = create_api_key(customer, "fuzz")
    nodes = []
    for name in ("fuzz-gpu-1", "fuzz-gpu-2"):
        key = generate_signing_key()
        node, token = create_node(owner=provider, name=name)
        node = register_agent(
            token=token,
            public_key=public_key_bytes(key).hex(),
            signature=join_signature(key, token),
            hardware={"device": "cpu", "memory_bytes": 2**33, "max_layers": 6},
            benchmark={"layer_tokens_per_s": 100.0},
            data_url="ws://127.0.0.1:1",
        )
        key_path = setup_path.parent / f"{name}.key"
        write_key(key_path, key)
        nodes.append({"node": node.node_id, "key": str(key_path)})
    server = EmbeddedServer(port).start()
    setup_path.write_text(json.dumps({"api_key": api_key, "nodes": nodes, "url": server.url}))
    threading.Event().wait()


def control_plane(messages: int, requests: int, seed: int, hang_s: float) -> dict[str, dict]:
    with tempfile.TemporaryDirectory(prefix="bench-fuzz-") as tmp:
        workdir = Path(tmp)
        setup = workdir / "setup.json"
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("SWARM_", "DATABASE_URL", "REDIS_URL", "DJANGO_"))
        }
        env.update(
            DJANGO_SETTINGS_MODULE="marketplace.settings",
            SWARM_DATA_DIR=str(workdir / "data"),
            SWARM_MODELS=MODEL,
            SWARM_LOG_LEVEL="CRITICAL",
            # Read every fuzzed message: the rate limit itself has its own tests.
            SWARM_CONTROL_RATE_PER_S="100000",
            SWARM_CONTROL_BURST="100000",
            # A valid request for a model whose fuzzed nodes never load a block answers 503 at once,
            # not after waiting for capacity (the admission wait has its own tests).
            SWARM_ADMISSION_WAIT_S="0",
            PYTHONPATH=str(ROOT),
        )
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(setup)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 180
            while not setup.exists():
                if child.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the control plane did not start")
                time.sleep(0.2)
            info = json.loads(setup.read_text())
            base = info["url"]
            watch = RssWatch(child.pid)
            me, peer = info["nodes"]
            started = time.monotonic()
            control: ControlStats = asyncio.run(
                fuzz_control_channel(
                    base.replace("http", "ws", 1) + "/ws/agent/",
                    key=load_signing_key(Path(me["key"])),
                    node_id=me["node"],
                    peers=[peer["node"]],
                    seed=seed,
                    count=messages,
                    hang_s=hang_s,
                )
            )
            control_s = time.monotonic() - started
            started = time.monotonic()
            api = fuzz_api(base, api_key=info["api_key"], seed=seed, count=requests, timeout_s=hang_s)
            api_s = time.monotonic() - started
            memory = watch.stop()
            with urllib.request.urlopen(base + "/healthz", timeout=hang_s) as response:
                healthy = response.status == 200
            crashed = int(child.poll() is not None or not healthy)
        finally:
            child.terminate()
            child.wait(30)
    return {
        "control channel": {
            "inputs": control.sent,
            "answers": control.errors,
            "closed_connections": control.closed,
            "hangs": control.hangs,
            "slowest_window_s": control.slowest_window_s,
            "crashes": crashed,
            "server_errors": 0,
            "seconds": control_s,
            "per_s": control.sent / control_s,
            "memory": memory,
        },
        "HTTP API": {
            "inputs": api.sent,
            "answers": api.sent - api.hangs,
            "by_status": {str(k): v for k, v in sorted(api.by_status.items())},
            "closed_connections": 0,
            "hangs": api.hangs,
            "slowest_window_s": api.slowest_s,
            "crashes": crashed,
            "server_errors": len(api.server_errors),
            "server_error_samples": api.server_errors[:20],
            "seconds": api_s,
            "per_s": api.sent / api_s,
            "memory": memory,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=1_000_000)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--seed", type=int, default=20260)
    parser.add_argument("--hang-s", type=float, default=30.0)
    parser.add_argument("--quick", action="store_true", help="20,000 frames, 1,000 messages, 1,000 requests")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        port = int(os.environ.get("FUZZ_PORT", "0"))
        serve_control_plane(port, args.serve)
        return 0
    if args.quick:
        args.frames, args.messages, args.requests = 20_000, 1_000, 1_000
    rows = {"data plane": data_plane(args.frames, args.connections, args.seed, args.hang_s)}
    rows |= control_plane(args.messages, args.requests, args.seed, args.hang_s)
    header = f"{'target':<16}{'inputs':>10}{'per s':>8}{'crashes':>9}{'hangs':>7}{'5xx':>6}{'slowest s':>11}"
    header += f"{'RSS start MiB':>15}{'peak MiB':>10}{'peak/start':>12}"
    print(header)
    for name, row in rows.items():
        memory = row["memory"]
        print(
            f"{name:<16}{row['inputs']:>10}{row['per_s']:>8.0f}{row['crashes']:>9}{row['hangs']:>7}"
            f"{row['server_errors']:>6}{row['slowest_window_s']:>11.2f}{memory['start_mib']:>15.0f}"
            f"{memory['peak_mib']:>10.0f}{memory['peak_ratio']:>12.2f}"
        )
    print("HTTP API statuses:", rows["HTTP API"]["by_status"])
    for sample in rows["HTTP API"]["server_error_samples"]:
        print("5xx:", sample)
    ok = all(
        row["crashes"] == 0
        and row["hangs"] == 0
        and row["server_errors"] == 0
        and row["memory"]["peak_ratio"] <= RSS_LIMIT
        for row in rows.values()
    )
    print("PASS" if ok else "MISS", "(0 crashes, 0 hangs, 0 server errors, RSS <= 1.5x start)")
    write_json(
        ROOT / "bench" / "results" / "fuzz.json",
        {
            "machine": describe_machine(platform=platform.platform()),
            "conditions": {k: v for k, v in vars(args).items() if k != "serve"},
            "rows": rows,
            "pass": ok,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
