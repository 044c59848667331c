"""The production topology under load: the `Procfile` (two web processes, two coordinator workers,
a verify worker, a periodic-work worker, beat) on PostgreSQL and Redis, with three joined agents.

    .venv/bin/python bench/load.py            # 200 concurrent streams, then 5 minutes at 20 req/s
    .venv/bin/python bench/load.py --quick    # 20 concurrent, then 20 s at 5 req/s
    .venv/bin/python bench/load.py --burst-only --concurrency 50 --max-tokens 64   # the CPU table alone

Needs DATABASE_URL (PostgreSQL: a fresh database is created on that server and dropped after) and
REDIS_URL (its database index ``--redis-db``, 14, is flushed first and after). The load model is
``tiny-llama`` (agents capped at 2 of its 6 layers: 0:2, 2:4, 4:6); ``--model smollm2-135m`` with
``--max-layers 10`` for a smaller run on the real model.

Parts, each with the official ``openai.AsyncOpenAI`` client, streamed chat completions with
``stream_options.include_usage``, greedy:

1. one request at a time (``--singles``), alternating with the same prompt on a Coordinator called
   directly on the same ready pipeline (bench/api.py's ``direct_stream``): TTFT overhead p50.
2. a burst: ``--concurrency`` requests at once; then the same load on directly called coordinators:
   tokens/s through the API against direct.
3. steady: ``--rate`` requests a second for ``--steady-s`` (open loop: each starts on its tick
   whether or not earlier ones ended).

For the burst, the CPU of every kind of process (web, coordinator workers, verify worker, worker,
beat, PostgreSQL, Redis; the agents and this client apart) from its start until its jobs are
settled and audited, per 1,000 streamed tokens, split into the model (embeddings, LM head,
sampling, drafting, audit replays: ``worker_agent.cpu``) and everything else (``cpu_meter.CpuMeter``).

Counted for 2 and 3: stalled streams (no finish reason or usage), 5xx, other errors; TTFT p50/p99;
admission (the job row's ``created_at`` minus the moment the request was sent, same clock) p50/p99.
Afterwards the ledger is checked exactly: each job charged the price of its tokens once, every hold
released, the customer's credits + holds + charges equal to the grant. Targets (reported, not
asserted): 0 stalled, 0 5xx, API tok/s >= 0.8x direct, TTFT overhead p50 < 20 ms at one request,
the control plane's non-model CPU at most 1 ms per streamed token.
The table goes to stdout, everything to ``bench/results/load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

from cpu_meter import CpuMeter, accounting, print_accounting, quiet
from report import machine_line, write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "load.json"
_spec = importlib.util.spec_from_file_location("bench_api", ROOT / "bench" / "api.py")
assert _spec is not None and _spec.loader is not None
bench_api = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_api)
percentile, prompt = bench_api.percentile, bench_api.prompt


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Topology:
    """A fresh database and Redis index, the Procfile's processes under honcho, three agents."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        base = urllib.parse.urlsplit(os.environ["DATABASE_URL"])
        self.admin_url = os.environ["DATABASE_URL"]
        self.database = f"swarm_load_{secrets.token_hex(4)}"
        redis = urllib.parse.urlsplit(os.environ["REDIS_URL"])
        self.redis_url = urllib.parse.urlunsplit(redis._replace(path=f"/{args.redis_db}"))
        self.port = free_port()
        self.env = {
            **os.environ,
            "DATABASE_URL": urllib.parse.urlunsplit(base._replace(path=f"/{self.database}")),
            "REDIS_URL": self.redis_url,
            "DJANGO_SECRET_KEY": secrets.token_hex(32),
            "DJANGO_SETTINGS_MODULE": "marketplace.settings",
            "SWARM_DATA_DIR": str(workdir / "data"),
            "SWARM_PORT": str(self.port),
            "SWARM_MODELS": args.model,
            "SWARM_SPARES_PER_PIPELINE": "0",
            "SWARM_REBALANCE_MIN_INTERVAL_S": "86400",  # a re-placement mid-run would reload blocks
            "SWARM_LOG_LEVEL": "WARNING",
            "PROMETHEUS_MULTIPROC_DIR": str(workdir / "prometheus"),
            "PYTHONUNBUFFERED": "1",
        }
        self.honcho: subprocess.Popen | None = None
        self.agents: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True) as connection:
            connection.execute(sql)

    def _flush_redis(self) -> None:
        import redis

        redis.Redis.from_url(self.redis_url).flushdb()

    def start(self) -> None:
        self._admin(f'CREATE DATABASE "{self.database}"')
        self._flush_redis()
        (self.workdir / "prometheus").mkdir(parents=True)
        os.environ.update(self.env)  # this process reads and writes the same database (accounts, ledger)
        subprocess.run(
            [sys.executable, "-m", "marketplace", "migrate", "--noinput", "-v", "0"], env=self.env, check=True
        )
        bin_dir = str(Path(sys.executable).parent)
        self.honcho = subprocess.Popen(
            [str(Path(bin_dir) / "honcho"), "start", "-f", str(ROOT / "Procfile")],
            cwd=ROOT,
            env={**self.env, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"},
            stdout=open(self.workdir / "honcho.log", "w"),  # noqa: SIM115 (open for the process's life)
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        import django

        django.setup()
        deadline = time.monotonic() + 180
        while not self._ready():
            if time.monotonic() > deadline or self.honcho.poll() is not None:
                raise RuntimeError(f"the topology did not become ready:\n{self.tail('honcho.log')}")
            time.sleep(1)

    def _ready(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=5) as answer:
                return answer.status == 200
        except OSError:
            return False

    def accounts(self) -> tuple[list[str], str, object]:
        from django.contrib.auth import get_user_model

        from marketplace.billing.models import ModelPrice
        from marketplace.billing.services import grant
        from marketplace.jobs.models import ApiKey
        from marketplace.jobs.services import create_api_key
        from marketplace.nodes.joining import create_node

        users = get_user_model().objects
        provider = users.create(username="load-provider", email="load-provider@example.com", is_provider=True)
        customer = users.create(username="load-customer", email="load-customer@example.com", is_customer=True)
        tokens = [create_node(owner=provider, name=f"load-node-{i}")[1] for i in range(3)]
        api_key, key = create_api_key(customer, "load")
        ApiKey.objects.filter(pk=api_key.pk).update(requests_per_minute=1_000_000, tokens_per_minute=1_000_000_000)
        from django.utils import timezone

        ModelPrice.objects.create(
            model=self.args.model,
            prompt_per_million=7_000_000_000,
            completion_per_million=13_000_000_000,
            effective_from=timezone.now(),
        )
        grant(customer, 10_000, memo="load credits")
        return tokens, key, customer

    def join(self, tokens: list[str]) -> list:
        from worker_agent.dev.local import join_agent

        for i, token in enumerate(tokens):
            self.agents.append(
                join_agent(
                    self.url,
                    token,
                    self.workdir / f"agent{i}.key",
                    self.workdir / f"agent{i}.log",
                    model=self.args.model,
                    max_layers=self.args.max_layers,
                )
            )
        from marketplace.nodes.models import LinkMeasurement
        from marketplace.placement.selectors import servable_pipelines

        # Ready, then probed (the measured links may reorder the ring once), then unchanged for 5 s:
        # a re-placement mid-run would reload blocks and send the direct runs to the wrong stages.
        deadline, stable_since, last = time.monotonic() + 600, None, None
        while time.monotonic() < deadline:
            if any(agent.poll() is not None for agent in self.agents):
                raise RuntimeError(f"an agent exited:\n{self.tail('agent0.log')}")
            pipelines = servable_pipelines(self.args.model)
            current = [(s.node, s.data_url, s.layer_start, s.layer_end) for s in pipelines[0]] if pipelines else None
            nodes = {stage[0] for stage in current or []}
            probed = set(
                LinkMeasurement.objects.filter(source__node_id__in=nodes).values_list("source__node_id", flat=True)
            )
            if current is None or current != last or probed != nodes:
                stable_since, last = time.monotonic(), current
            elif time.monotonic() - stable_since >= 5:
                return pipelines[0]
            time.sleep(0.5)
        raise RuntimeError("no servable, stable pipeline in 600 s")

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / name
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else "(none)"

    def stop(self) -> None:
        from worker_agent.dev.local import stop_processes

        stop_processes(self.agents)
        if self.honcho is not None and self.honcho.poll() is None:
            os.killpg(self.honcho.pid, signal.SIGINT)
            try:
                self.honcho.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.honcho.pid, signal.SIGKILL)
        from django.db import connections

        connections.close_all()
        self._flush_redis()
        self._admin(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')


async def one(client, index: int, max_tokens: int, model: str) -> dict:
    """One streamed request; its outcome whatever it is."""
    import openai

    try:
        run = await bench_api.api_stream(client, model, prompt(index), max_tokens)
        run["outcome"] = "ok" if run["finish_reason"] and run["usage"] else "stalled"
    except openai.APIStatusError as exc:
        run = {"outcome": "5xx" if exc.status_code >= 500 else f"{exc.status_code}", "error": str(exc)[:200]}
    except Exception as exc:  # a dropped connection, a timeout: counted, never hidden
        run = {"outcome": "error", "error": repr(exc)[:200]}
    return run


def client(url: str, key: str):
    import httpx2
    import openai

    return openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key=key,
        max_retries=0,
        timeout=600,
        http_client=httpx2.AsyncClient(limits=httpx2.Limits(max_connections=1000)),
    )


def admissions(runs: list[dict]) -> list[float]:
    from marketplace.jobs.models import Job

    created = {
        j.public_id: j.created_at.timestamp() for j in Job.objects.filter(public_id__in=[r.get("job") for r in runs])
    }
    return [created[r["job"]] - r["sent_at"] for r in runs if r.get("job") in created]


def summarize(runs: list[dict], wall_s: float) -> dict:
    ok = [r for r in runs if r["outcome"] == "ok"]
    outcomes: dict[str, int] = {}
    for r in runs:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    tokens = sum(r["usage"]["completion_tokens"] for r in ok)
    ttft = [1000 * r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    admit = [1000 * s for s in admissions(ok)]
    return {
        "requests": len(runs),
        "outcomes": outcomes,
        "errors": sorted({r["error"] for r in runs if "error" in r})[:5],
        "stalled": outcomes.get("stalled", 0),
        "5xx": outcomes.get("5xx", 0),
        "completion_tokens": tokens,
        "wall_s": round(wall_s, 2),
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s else None,
        "ttft_p50_ms": _r(percentile(ttft, 0.5)),
        "ttft_p99_ms": _r(percentile(ttft, 0.99)),
        "admission_p50_ms": _r(percentile(admit, 0.5)),
        "admission_p99_ms": _r(percentile(admit, 0.99)),
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


async def burst(url: str, key: str, args: argparse.Namespace, first: int) -> tuple[list[dict], float]:
    async with client(url, key) as c:
        started = time.perf_counter()
        runs = await asyncio.gather(*(one(c, first + i, args.max_tokens, args.model) for i in range(args.concurrency)))
        return list(runs), time.perf_counter() - started


def session_room(stages: list) -> int:
    """Sessions the pipeline carries at once: its stages' smallest room, as admission counts it."""
    from marketplace.nodes.models import Node
    from marketplace.placement.selectors import session_room as room

    return min(room(node) for node in Node.objects.filter(node_id__in=[s.node for s in stages]))


async def direct_burst(stages: list, args: argparse.Namespace) -> dict:
    """The burst's requests on Coordinators called directly in this process, at most as many at
    once as the pipeline holds sessions (the API's admission queues the rest the same way)."""
    room = await asyncio.to_thread(session_room, stages)
    slots = asyncio.Semaphore(room)

    async def direct(i: int) -> dict:
        async with slots:
            try:
                return await bench_api.direct_stream(args.model, stages, i, args.max_tokens, prompt(i))
            except Exception as exc:  # counted, as the API's failures are
                return {"completion_tokens": 0, "error": str(exc)[:200]}

    started = time.perf_counter()
    runs = await asyncio.gather(*(direct(i) for i in range(args.concurrency)))
    wall = time.perf_counter() - started
    tokens = sum(r["completion_tokens"] for r in runs)
    errors = sorted({r["error"] for r in runs if "error" in r})
    return {
        "at_once": room,
        "failed": sum(1 for r in runs if "error" in r),
        "errors": errors[:5],
        "requests": len(runs),
        "completion_tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
    }


async def steady(url: str, key: str, args: argparse.Namespace, first: int) -> tuple[list[dict], float]:
    async with client(url, key) as c:
        started = time.perf_counter()
        tasks = []
        for i in range(int(args.rate * args.steady_s)):
            await asyncio.sleep(max(0.0, started + i / args.rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(c, first + i, args.max_tokens, args.model)))
        runs = await asyncio.gather(*tasks)
        return list(runs), time.perf_counter() - started


async def singles(url: str, key: str, stages: list, args: argparse.Namespace) -> dict:
    api, direct = [], []
    async with client(url, key) as c:
        await one(c, 0, args.max_tokens, args.model)  # warm-up
        for i in range(args.singles):
            order = [True, False] if i % 2 == 0 else [False, True]
            for through_api in order:
                if through_api:
                    run = await one(c, 1000 + i, args.max_tokens, args.model)
                    if run["outcome"] == "ok":
                        api.append(1000 * run["ttft_s"])
                else:
                    run = await bench_api.direct_stream(args.model, stages, i, args.max_tokens, prompt(1000 + i))
                    direct.append(1000 * run["ttft_s"])
    api50, direct50 = percentile(api, 0.5), percentile(direct, 0.5)
    return {
        "n": args.singles,
        "api_ttft_p50_ms": _r(api50),
        "direct_ttft_p50_ms": _r(direct50),
        "overhead_p50_ms": _r(None if api50 is None or direct50 is None else api50 - direct50),
    }


def accounted_burst(topology: Topology, meter: CpuMeter, key: str, args: argparse.Namespace) -> tuple[dict, dict]:
    """The burst through the API, with the CPU every process spent on it (until its jobs are
    settled and audited) per streamed token."""
    quiet()
    before = meter.snapshot()
    summary = summarize(*asyncio.run(burst(topology.url, key, args, 2000)))
    quiet()
    after = meter.snapshot()
    return summary, accounting(before, after, max(1, summary["completion_tokens"]))


def ledger(customer, granted_nano: int) -> dict:
    """Each job charged its tokens' price once, every hold released, the money all accounted for."""
    from django.db.models import Sum

    from marketplace.billing.models import AccountKind, Transfer
    from marketplace.billing.services import account, cost
    from marketplace.jobs.models import Job

    deadline = time.monotonic() + 120
    while Job.objects.filter(settled_at__isnull=True).exists() and time.monotonic() < deadline:
        time.sleep(1)
    problems = []
    jobs = list(Job.objects.all())
    for job in jobs:
        prices = (job.price_prompt_per_million, job.price_completion_per_million)
        want = cost(job.prompt_tokens, job.completion_tokens, prices) if job.completion_tokens else 0
        charges = list(Transfer.objects.filter(job=job, kind="charge").values_list("amount", flat=True))
        if job.settled_at is None or sum(charges) != min(want, job.hold_amount) or len(charges) > 1:
            problems.append(f"{job.public_id}: charged {charges}, owed {want}, settled {job.settled_at is not None}")
    hold = account(AccountKind.CUSTOMER_HOLD, customer).balance
    credit = account(AccountKind.CUSTOMER_CREDIT, customer).balance
    charged = Transfer.objects.filter(job__in=jobs, kind="charge").aggregate(total=Sum("amount"))["total"] or 0
    if hold != 0:
        problems.append(f"{hold} nano-dollars still held")
    if credit + hold + charged != granted_nano:
        problems.append(f"credit {credit} + held {hold} + charged {charged} != granted {granted_nano}")
    return {"jobs": len(jobs), "charged_nano": charged, "exact": not problems, "problems": problems[:10]}


def targets(result: dict) -> dict[str, bool]:
    """The issue's targets. Every request must end well: a stream that stalled, a 5xx, and a job
    that failed mid-stream (an error event, or a dropped connection) all count against the first.
    The direct burst must itself have run whole for the tokens/s comparison to stand."""
    parts = ("burst", "steady")
    direct_whole = result["direct_burst"].get("failed", 0) == 0
    return {
        "0 stalled, 0 5xx, 0 failed": all(result[p]["outcomes"].keys() <= {"ok"} for p in parts),
        "API tok/s >= 0.8x direct (direct burst whole)": direct_whole
        and (result["api_vs_direct_tokens_per_s"] or 0) >= 0.8,
        "TTFT overhead p50 < 20 ms at 1 request": (result["single"]["overhead_p50_ms"] or 1e9) < 20.0,
        "ledger exact": result["ledger"]["exact"],
        "control plane non-model CPU <= 1 ms per streamed token (burst)": result["accounting"][
            "control_plane_other_ms_per_token"
        ]
        <= 1.0,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--max-layers", type=int, default=None, help="per agent (default: 2, or 10 for smollm2-135m)")
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--steady-s", type=float, default=300.0)
    parser.add_argument("--singles", type=int, default=20)
    parser.add_argument(
        "--singles-only", action="store_true", help="only part 1 (TTFT overhead at one request); prints, writes nothing"
    )
    parser.add_argument(
        "--burst-only",
        action="store_true",
        help="only part 2 (the burst through the API, then direct); prints, writes nothing",
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--redis-db", type=int, default=14)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.max_layers is None:
        args.max_layers = 10 if args.model == "smollm2-135m" else 2
    if args.quick:
        args.concurrency, args.rate, args.steady_s, args.singles = 20, 5.0, 20.0, 6
    return args


def main() -> int:
    args = parse_args()
    for name in ("DATABASE_URL", "REDIS_URL"):
        if not os.environ.get(name, "").startswith(("postgres", "redis")):
            print(f"error: set {name} (PostgreSQL and Redis: the production topology)", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        topology = Topology(args, Path(tmp))
        try:
            topology.start()
            tokens, key, customer = topology.accounts()
            from marketplace.billing.services import credits

            granted = credits(customer)
            stages = topology.join(tokens)
            meter = CpuMeter(topology)
            if args.burst_only:
                api, table = accounted_burst(topology, meter, key, args)
                direct = asyncio.run(direct_burst(stages, args))
                ratio = round(api["tokens_per_s"] / direct["tokens_per_s"], 3) if direct["tokens_per_s"] else None
                print(json.dumps({"burst": api, "direct_burst": direct, "api_vs_direct_tokens_per_s": ratio}))
                print_accounting(table)
                return 0
            result = {"single": asyncio.run(singles(topology.url, key, stages, args))}
            if args.singles_only:
                print(json.dumps(result["single"]))
                return 0
            result["burst"], result["accounting"] = accounted_burst(topology, meter, key, args)
            result["direct_burst"] = asyncio.run(direct_burst(stages, args))
            result["steady"] = summarize(*asyncio.run(steady(topology.url, key, args, 5000)))
            result["ledger"] = ledger(customer, granted)
        except BaseException:
            print(topology.tail("honcho.log"), file=sys.stderr)
            raise
        finally:
            topology.stop()
    api_tps, direct_tps = result["burst"]["tokens_per_s"], result["direct_burst"]["tokens_per_s"]
    result["api_vs_direct_tokens_per_s"] = round(api_tps / direct_tps, 3) if direct_tps else None
    result["targets"] = targets(result)
    result["conditions"] = {
        "args": {k: str(v) for k, v in vars(args).items() if k != "output"},
        "machine": machine_line(),
        "load_average_at_end": os.getloadavg(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json(args.output, result)
    header = ("part", "requests", "stalled", "5xx", "tok/s", "TTFT p50/p99 ms", "admit p50/p99 ms")
    print(f"{header[0]:<8} {header[1]:>8} {header[2]:>7} {header[3]:>4} {header[4]:>7} {header[5]:>17} {header[6]:>17}")
    for part in ("burst", "steady"):
        r = result[part]
        print(
            f"{part:<8} {r['requests']:>8} {r['stalled']:>7} {r['5xx']:>4} {r['tokens_per_s']:>7} "
            f"{r['ttft_p50_ms']!s:>8}/{r['ttft_p99_ms']!s:<8} {r['admission_p50_ms']!s:>8}/{r['admission_p99_ms']!s:<8}"
        )
    print(f"direct burst: {direct_tps} tok/s; API/direct {result['api_vs_direct_tokens_per_s']}")
    single = result["single"]
    print(
        f"one request: TTFT API {single['api_ttft_p50_ms']} ms, direct {single['direct_ttft_p50_ms']} ms, "
        f"overhead p50 {single['overhead_p50_ms']} ms"
    )
    print(f"ledger: {result['ledger']}")
    print_accounting(result["accounting"])
    for target, met in result["targets"].items():
        print(f"  {'PASS' if met else 'MISS'}  {target}")
    print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
