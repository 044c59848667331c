"""The OpenAI-compatible API against the coordinator called directly, and under concurrent load.

    .venv/bin/python bench/api.py            # the full run, about 2 minutes
    .venv/bin/python bench/api.py --quick    # a smoke run of the same code paths

Each part runs its own control plane, embedded as ``make demo`` runs it (SQLite in a temporary
``SWARM_DATA_DIR``, in-memory channel layer and cache, coordinators as tasks of the web process's
event loop, uvicorn in a thread) on a free port, with three ``swarm-worker join`` agents:

A. ``smollm2-135m``, agents capped at 10 layers (so 0:10, 10:20, 20:30). For ``--requests``
   prompts, one after the other, time to first token (TTFT) of a streamed chat completion through
   the API with the official ``openai`` client, and of the same prompt on the coordinator called
   directly on the same ready pipeline, a fresh ``Coordinator`` per request as a job runs it.
   The two alternate (API first for even prompts, direct first for odd ones), after a warm-up.
B. ``tiny-llama``, agents capped at 2 layers (0:2, 2:4, 4:6). ``--concurrency`` streamed chat
   completions started at once (``openai.AsyncOpenAI``, ``stream_options.include_usage``); each
   must end with a finish reason and usage whose prompt_tokens is the tokenizer's count of the
   prompt and whose completion_tokens is the job row's (and max_tokens when it stopped on length).
   Then the same load without the API (as many fresh coordinators at once, called directly), with
   the CPU time of this process by thread and of the agents during each run; and each prompt alone
   on the coordinator, whose text and token count its stream must have matched (greedy decoding).

Why two control planes: placement puts every model of ``SWARM_MODELS`` over all active nodes and
an agent serves one block at a time, so one control plane cannot serve both models from the same
agents; each part runs in a child process with ``SWARM_MODELS`` set to its one model.

What TTFT includes:

- API: from the call to ``chat.completions.create`` to the first chunk with non-empty
  ``delta.content``: the HTTP request, key check, prompt tokenization, rate limit, admission
  (route choice, job row, credit hold), the job's coordinator (tickets, connecting to the three stages, OPEN,
  prefill, first token), the channel layer, the SSE response, and the client's parsing.
- direct: from constructing ``Coordinator`` to the first ``TokenEvent`` with text: connecting to
  the three stages, OPEN, prefill, first token. The stages' tickets are signed before the clock.

Both clients run in this process, next to the web server's thread; the agents are processes.
Targets are reported, not asserted: API p50 TTFT - direct p50 TTFT < 20 ms; all concurrent
requests complete with correct usage. The table goes to stdout, everything else to
``bench/results/api.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from report import describe_machine, load_average, package_versions, write_json

ROOT = Path(__file__).resolve().parent.parent
# The web app is imported from the checkout, whatever the script's directory or the venv's install.
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "api.json"
PARTS = {
    "a": {"model": "smollm2-135m", "max_layers": 10},
    "b": {"model": "tiny-llama", "max_layers": 2},
}
TTFT_GOAL_MS = 20.0
TOPICS = ["the sky", "rivers", "bread", "the moon", "bicycles", "volcanoes", "libraries", "honey bees", "glass"]
TOPICS += ["winter", "trains", "coffee", "maps", "owls", "copper", "tides", "paper", "clocks", "salt", "bridges"]
# Environment variables the web app reads; each part's control plane gets only the ones set here,
# so that a DATABASE_URL or REDIS_URL in the caller's shell cannot make it anything but embedded.
CONTROL_PLANE_PREFIXES = ("SWARM_", "DJANGO_")
CONTROL_PLANE_NAMES = ("DATABASE_URL", "REDIS_URL")
KEPT = ("SWARM_MODEL_CACHE",)  # read by the agents and the coordinator, not by the web app


def prompt(index: int) -> str:
    topic = TOPICS[index % len(TOPICS)]
    return f"Write one short sentence about {topic}." + (f" (request {index})" if index >= len(TOPICS) else "")


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary_ms(seconds: list[float]) -> dict:
    ms = [1000 * s for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": _round(percentile(ms, 0.5)),
        "p90_ms": _round(percentile(ms, 0.9)),
        "min_ms": _round(min(ms) if ms else None),
        "max_ms": _round(max(ms) if ms else None),
        "mean_ms": _round(sum(ms) / len(ms) if ms else None),
    }


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


# --- one part: an embedded control plane and its agents, in a child process -------------------------


class ControlPlane:
    """The web app (uvicorn in a thread of this process) and three joined agents."""

    def __init__(self, model: str, max_layers: int, workdir: Path, threads: int) -> None:
        self.model, self.max_layers, self.workdir, self.threads = model, max_layers, workdir, threads
        self.server = None
        self.agents: list[subprocess.Popen] = []
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def accounts(self) -> tuple[list[str], str]:
        """A provider with three nodes (their join tokens) and a customer's API key, rate limits lifted
        and credits granted."""
        from django.contrib.auth import get_user_model

        from marketplace.billing.services import grant
        from marketplace.jobs.models import ApiKey
        from marketplace.jobs.services import create_api_key
        from marketplace.nodes.joining import create_node

        user_model = get_user_model()
        provider = user_model.objects.create(
            username="bench-provider", email="bench-provider@example.com", is_provider=True
        )
        customer = user_model.objects.create(
            username="bench-customer", email="bench-customer@example.com", is_customer=True
        )
        tokens = [create_node(owner=provider, name=f"bench-node-{i}")[1] for i in range(3)]
        api_key, key = create_api_key(customer, "bench")
        ApiKey.objects.filter(pk=api_key.pk).update(requests_per_minute=1_000_000, tokens_per_minute=1_000_000_000)
        grant(customer, 1000, memo="benchmark credits")
        return tokens, key

    def serve(self) -> None:
        from marketplace.embedded import EmbeddedServer

        self.server = EmbeddedServer().start()
        self.port = self.server.port

    def join(self, tokens: list[str]) -> None:
        from worker_agent.dev.local import join_agent

        for index, token in enumerate(tokens):
            self.agents.append(
                join_agent(
                    self.base_url,
                    token,
                    self.workdir / f"agent{index}.key",
                    self.workdir / f"agent{index}.log",
                    model=self.model,
                    max_layers=self.max_layers,
                    threads=self.threads,
                )
            )

    def wait_servable(self, timeout: float = 600, probes_timeout: float = 30) -> list:
        """The ready pipeline, once every stage is up and (for at most ``probes_timeout``) its nodes
        have reported their link measurements: probes follow readiness, and waiting for them keeps
        their traffic out of the timings."""
        from marketplace.nodes.models import LinkMeasurement
        from marketplace.placement.selectors import servable_pipelines

        deadline = time.monotonic() + timeout
        servable_at = None
        while time.monotonic() < deadline:
            dead = [i for i, agent in enumerate(self.agents) if agent.poll() is not None]
            if dead:
                raise RuntimeError(f"agent {dead[0]} exited:\n{self.log_tail(dead[0])}")
            pipelines = servable_pipelines(self.model)
            if pipelines:
                servable_at = servable_at or time.monotonic()
                nodes = {stage.node for stage in pipelines[0]}
                probed = set(
                    LinkMeasurement.objects.filter(source__node_id__in=nodes).values_list("source__node_id", flat=True)
                )
                if probed == nodes or time.monotonic() - servable_at > probes_timeout:
                    return pipelines[0]
            time.sleep(0.5)
        raise RuntimeError(f"{self.model} did not become servable in {timeout:.0f} s:\n{self.log_tail(0)}")

    def log_tail(self, index: int, lines: int = 20) -> str:
        path = self.workdir / f"agent{index}.log"
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else "(no log)"

    def stop(self) -> None:
        from worker_agent.dev.local import stop_processes

        stop_processes(self.agents)
        if self.server is not None:
            self.server.stop()


def setup_django() -> None:
    import logging

    import django
    from django.core.management import call_command

    django.setup()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    call_command("migrate", verbosity=0)


async def api_stream(client, model: str, text: str, max_tokens: int, **extra) -> dict:
    """One streamed chat completion: client-side TTFT and what came back (``extra``: more arguments)."""
    sent_at = time.time()  # the server's clock too (same machine): for the split by job row timestamps
    started = time.perf_counter()
    first = first_at = last = None
    deltas = 0
    finish = usage = job_id = None
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    parts = []
    async for chunk in stream:
        job_id = job_id or chunk.id
        if chunk.choices:
            choice = chunk.choices[0]
            if choice.delta.content:
                if first is None:
                    first, first_at = time.perf_counter(), time.time()
                last = time.perf_counter()
                deltas += 1
                parts.append(choice.delta.content)
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    ended = time.perf_counter()
    return {
        "job": job_id,
        "sent_at": sent_at,
        "first_at": first_at,
        "ttft_s": None if first is None else first - started,
        "decode_s": None if first is None else last - first,
        "total_s": ended - started,
        "content_deltas": deltas,
        "text": "".join(parts),
        "finish_reason": finish,
        "usage": usage,
    }


async def direct_stream(model: str, stages: list, index: int, max_tokens: int, text: str) -> dict:
    """The same request on a fresh Coordinator over the same stages, as a job's coordinator runs it."""
    from nacl.signing import SigningKey

    from marketplace.nodes.tickets import ticket_for
    from worker_agent.coordinator.job import Coordinator, GenerationResult
    from worker_agent.coordinator.pipeline import StageSpec
    from worker_agent.coordinator.sampling import SamplingParams
    from worker_agent.protocol.receipts import StageAssignment
    from worker_agent.protocol.span import Span

    job = f"bench-direct-{index}-{secrets.token_hex(4)}"
    key = SigningKey.generate()  # this job's coordinator key, as the runner makes one per job
    grant = {"coordinator_key": bytes(key.verify_key), "expires_at": time.time() + 600}
    specs = [
        StageSpec(
            s.data_url,
            ticket_for(job=job, node=s.node, span=Span(model, s.layer_start, s.layer_end), **grant),
        )
        for s in stages
    ]
    assignments = [StageAssignment(s.node, bytes.fromhex(s.node_key), s.layer_start, s.layer_end) for s in stages]
    started = time.perf_counter()
    first = None
    result = None
    async with Coordinator(
        model, specs, job=job, topology="ring", assignments=assignments, coordinator_key=key
    ) as coordinator:
        request = coordinator.request(
            text, chat=True, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0, top_p=1.0)
        )
        async for event in coordinator.stream(request, strict=False):
            if isinstance(event, GenerationResult):
                result = event
            elif event.text and first is None:
                first = time.perf_counter()
    ended = time.perf_counter()
    return {
        "ttft_s": None if first is None else first - started,
        "total_s": ended - started,
        "coordinator_ttft_s": result.ttft,
        "completion_tokens": result.completion_tokens,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "verified": result.verification is not None,
    }


def thread_group(name: str) -> str:
    """Threads by role: the clients (main), the web server's event loop (web), the coordinators'
    LM heads (head_N), Django's sync_to_async and other pools."""
    if name == "MainThread":
        return "main (clients; direct coordinators)"
    if name == "web":
        return "web (event loop: HTTP, jobs' coordinators, SSE)"
    if name.startswith("head"):
        return "head (embeddings, LM head)"
    if name == "cpu-meter":
        return "cpu-meter (this measurement)"
    return "other threads (ORM via sync_to_async, pools)"


class CpuMeter:
    """CPU seconds of this process by thread role, and of each agent, over a window. Threads come and
    go (each job's head thread ends with its coordinator; Django runs a request's ORM calls on a
    thread of its own), so every thread is sampled every ``interval`` seconds and counted up to its
    last sample; what ended threads used after it is 'unattributed'."""

    def __init__(self, agents: list[subprocess.Popen], interval: float = 0.05) -> None:
        import psutil

        self.me = psutil.Process()
        self.agents = [psutil.Process(a.pid) for a in agents]
        self.interval = interval
        self.seen: dict[int, tuple[str, float, float]] = {}  # thread id: (role, CPU at start, CPU last seen)
        self.stopped = threading.Event()
        self.measuring = False

    def _sample(self) -> None:
        names = {t.native_id: t.name for t in threading.enumerate()}
        for t in self.me.threads():
            spent = t.user_time + t.system_time
            # A thread that was there at the start counts from there; one born since, from zero.
            start = 0.0 if self.measuring else spent
            role, first, _ = self.seen.get(t.id, (thread_group(names.get(t.id, "?")), start, spent))
            self.seen[t.id] = (role, first, spent)

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            self._sample()

    def __enter__(self) -> CpuMeter:
        self._sample()
        self.start = sum(self.me.cpu_times()[:2]), [sum(a.cpu_times()[:2]) for a in self.agents]
        self.measuring = True
        self.thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stopped.set()
        self.thread.join()
        self._sample()
        self.process = sum(self.me.cpu_times()[:2]) - self.start[0]
        self.agent_seconds = [sum(a.cpu_times()[:2]) - s for a, s in zip(self.agents, self.start[1], strict=True)]

    def report(self, tokens: int) -> dict:
        groups: dict[str, float] = {}
        for role, first, last in self.seen.values():
            groups[role] = groups.get(role, 0.0) + last - first
        groups["unattributed"] = self.process - sum(groups.values())
        return {
            "control_plane_process_s": round(self.process, 3),
            "by_thread_s": {name: round(value, 3) for name, value in groups.items()},
            "agents_s": [round(value, 3) for value in self.agent_seconds],
            "ms_per_token": {
                "control_plane_process": round(1000 * self.process / tokens, 3) if tokens else None,
                "agents": round(1000 * sum(self.agent_seconds) / tokens, 3) if tokens else None,
            },
        }


def job_rows(ids: list[str]) -> dict[str, dict]:
    from marketplace.jobs.models import Job

    rows = Job.objects.filter(public_id__in=[i for i in ids if i])
    return {
        job.public_id: {
            "state": job.state,
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": job.completion_tokens,
            "finish_reason": job.finish_reason,
            "ttft_ms": job.ttft_ms,
            "verified": job.verified,
            "created_at": job.created_at.timestamp(),
            "started_at": job.started_at.timestamp() if job.started_at else None,
            "error": f"{job.error_code}: {job.error_message}" if job.error_code else "",
        }
        for job in rows
    }


def ttft_split(runs: list[dict], rows: dict[str, dict]) -> dict:
    """The API's TTFT split by the job row's timestamps (one clock: client and server share the machine)."""
    split = [(r, rows[r["job"]]) for r in runs if r.get("first_at") and rows.get(r["job"], {}).get("started_at")]
    return {
        "request_to_job_row": summary_ms([row["created_at"] - r["sent_at"] for r, row in split]),
        "job_row_to_running": summary_ms([row["started_at"] - row["created_at"] for r, row in split]),
        "running_to_first_content": summary_ms([r["first_at"] - row["started_at"] for r, row in split]),
    }


def chat_prompt_tokens(model: str, text: str) -> int:
    from worker_agent import model as models

    tokenizer = models.load_tokenizer(model)
    messages = [{"role": "user", "content": text}]
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def client(base_url: str, key: str):
    from openai import AsyncOpenAI

    # The client's default pool allows 1000 connections, so every concurrent stream gets its own.
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=600)


def part_a(plane: ControlPlane, key: str, stages: list, args: argparse.Namespace) -> dict:
    """Sequential requests, API and direct alternating, on the same pipeline."""
    model = plane.model

    async def run() -> tuple[list[dict], list[dict]]:
        api = client(plane.base_url, key)
        async with api:
            for i in range(args.warmup):  # pages every stage's weights in, opens the client's connection
                await api_stream(api, model, prompt(i), args.max_tokens_a)
                await direct_stream(model, stages, -1 - i, args.max_tokens_a, prompt(i))
            api_runs, direct_runs = [], []
            for i in range(args.requests):
                text = prompt(i)
                if i % 2 == 0:
                    api_runs.append(await api_stream(api, model, text, args.max_tokens_a))
                    direct_runs.append(await direct_stream(model, stages, i, args.max_tokens_a, text))
                else:
                    direct_runs.append(await direct_stream(model, stages, i, args.max_tokens_a, text))
                    api_runs.append(await api_stream(api, model, text, args.max_tokens_a))
                a, d = api_runs[-1], direct_runs[-1]
                print(
                    f"  A {i + 1:>3}/{args.requests}: ttft api {_ms(a['ttft_s'])} ms, direct {_ms(d['ttft_s'])} ms",
                    file=sys.stderr,
                    flush=True,
                )
            return api_runs, direct_runs

    api_runs, direct_runs = asyncio.run(run())
    grammar = grammar_cost(plane, key, args)
    rows = job_rows([r["job"] for r in api_runs])
    api_ttft = [r["ttft_s"] for r in api_runs if r["ttft_s"] is not None]
    direct_ttft = [r["ttft_s"] for r in direct_runs if r["ttft_s"] is not None]
    paired = [
        a["ttft_s"] - d["ttft_s"] for a, d in zip(api_runs, direct_runs, strict=True) if a["ttft_s"] and d["ttft_s"]
    ]
    job_ttft = [rows[r["job"]]["ttft_ms"] / 1000 for r in api_runs if rows.get(r["job"], {}).get("ttft_ms")]
    api = summary_ms(api_ttft)
    direct = summary_ms(direct_ttft)
    return {
        "model": model,
        "stages": [f"{s.node}[{s.layer_start}:{s.layer_end}]" for s in stages],
        "requests": args.requests,
        "warmup_requests_per_path": args.warmup,
        "max_tokens": args.max_tokens_a,
        "api_ttft": api,
        "direct_ttft": direct,
        "p50_difference_ms": _round(api["p50_ms"] - direct["p50_ms"]) if api["n"] and direct["n"] else None,
        "paired_difference": summary_ms(paired),
        "api_total": summary_ms([r["total_s"] for r in api_runs]),
        "direct_total": summary_ms([r["total_s"] for r in direct_runs]),
        "api_job_row_ttft": summary_ms(job_ttft),
        "direct_coordinator_ttft": summary_ms(
            [r["coordinator_ttft_s"] for r in direct_runs if r["coordinator_ttft_s"]]
        ),
        "api_split": ttft_split(api_runs, rows),
        "same_text": sum(a["text"] == d["text"] for a, d in zip(api_runs, direct_runs, strict=True)),
        "api_jobs_succeeded": sum(rows.get(r["job"], {}).get("state") == "succeeded" for r in api_runs),
        "grammar": grammar,
        "per_request": [
            {
                "prompt": prompt(i),
                "api_ttft_ms": _round(1000 * a["ttft_s"]) if a["ttft_s"] else None,
                "direct_ttft_ms": _round(1000 * d["ttft_s"]) if d["ttft_s"] else None,
                "api_total_ms": _round(1000 * a["total_s"]),
                "direct_total_ms": _round(1000 * d["total_s"]),
                "api_job_ttft_ms": _round(rows.get(a["job"], {}).get("ttft_ms")),
                "direct_coordinator_ttft_ms": _round(1000 * d["coordinator_ttft_s"])
                if d["coordinator_ttft_s"]
                else None,
                "api_usage": a["usage"],
                "direct_completion_tokens": d["completion_tokens"],
                "same_text": a["text"] == d["text"],
            }
            for i, (a, d) in enumerate(zip(api_runs, direct_runs, strict=True))
        ],
    }


# A schema with bounded strings and numbers: what an application asks for with response_format.
GRAMMAR_SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 2, "maxItems": 3},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["topic", "facts", "rating"],
    "additionalProperties": False,
}


def decode_rate(run: dict) -> float | None:
    """Tokens per second after the first: (completion tokens - 1) / (first content .. last content)."""
    tokens = (run["usage"] or {}).get("completion_tokens", 0)
    return (tokens - 1) / run["decode_s"] if tokens > 1 and run["decode_s"] else None


def grammar_cost(plane: ControlPlane, key: str, args: argparse.Namespace) -> dict:
    """Decode tokens/s of free chat against chat constrained to GRAMMAR_SCHEMA, alternating, plain
    decoding on both (speculation off: only the grammar's cost differs), --grammar-requests each."""
    model = plane.model
    plain = {"extra_body": {"speculation": False}}
    constrained = plain | {
        "response_format": {"type": "json_schema", "json_schema": {"name": "facts", "schema": GRAMMAR_SCHEMA}}
    }

    async def run() -> tuple[list[dict], list[dict]]:
        api = client(plane.base_url, key)
        async with api:
            free, json_runs = [], []
            for i in range(args.grammar_requests):
                text = f"Tell me about {TOPICS[i % len(TOPICS)]}."
                for kind in ("free", "json") if i % 2 == 0 else ("json", "free"):
                    if kind == "free":
                        free.append(await api_stream(api, model, text, args.max_tokens_grammar, **plain))
                    else:
                        asked = text + " Answer in JSON."
                        json_runs.append(await api_stream(api, model, asked, args.max_tokens_grammar, **constrained))
                print(f"  grammar {i + 1:>3}/{args.grammar_requests}", file=sys.stderr, flush=True)
            return free, json_runs

    free, json_runs = asyncio.run(run())
    free_rates = [r for r in map(decode_rate, free) if r]
    json_rates = [r for r in map(decode_rate, json_runs) if r]
    valid = 0
    for run_ in json_runs:
        try:
            data = json.loads(run_["text"])
        except ValueError:
            continue
        valid += isinstance(data, dict) and set(data) == {"topic", "facts", "rating"}
    free_mean = sum(free_rates) / len(free_rates) if free_rates else None
    json_mean = sum(json_rates) / len(json_rates) if json_rates else None
    return {
        "requests_per_path": args.grammar_requests,
        "max_tokens": args.max_tokens_grammar,
        "free_decode_tok_s": _round(free_mean, 2),
        "json_schema_decode_tok_s": _round(json_mean, 2),
        "ratio": _round(json_mean / free_mean, 3) if free_mean and json_mean else None,
        "json_valid": valid,
        "json_finish_reasons": [r["finish_reason"] for r in json_runs],
        "json_completion_tokens": [(r["usage"] or {}).get("completion_tokens") for r in json_runs],
    }


def check_request(run: dict, row: dict | None, want_prompt: int, max_tokens: int) -> list[str]:
    """What is wrong with one concurrent request's result; empty when it is right."""
    if run.get("error"):
        return [run["error"]]
    problems = []
    usage = run["usage"]
    if run["finish_reason"] not in ("stop", "length"):
        problems.append(f"finish_reason {run['finish_reason']!r}")
    if usage is None:
        return [*problems, "no usage chunk"]
    if usage["prompt_tokens"] != want_prompt:
        problems.append(f"prompt_tokens {usage['prompt_tokens']} != tokenizer's {want_prompt}")
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        problems.append("total_tokens != prompt + completion")
    if row is None:
        return [*problems, f"no job row {run['job']}"]
    if row["state"] != "succeeded":
        problems.append(f"job {row['state']} {row['error']}")
    if usage["completion_tokens"] != row["completion_tokens"]:
        problems.append(f"completion_tokens {usage['completion_tokens']} != job row's {row['completion_tokens']}")
    if row["prompt_tokens"] != usage["prompt_tokens"]:
        problems.append(f"job row prompt_tokens {row['prompt_tokens']} != usage's {usage['prompt_tokens']}")
    if run["finish_reason"] == "length" and usage["completion_tokens"] != max_tokens:
        problems.append(f"finish 'length' with {usage['completion_tokens']} tokens, max_tokens {max_tokens}")
    if run["finish_reason"] == "stop" and usage["completion_tokens"] > max_tokens:
        problems.append(f"{usage['completion_tokens']} tokens > max_tokens {max_tokens}")
    if run["content_deltas"] > usage["completion_tokens"]:
        problems.append(f"{run['content_deltas']} content deltas > {usage['completion_tokens']} tokens")
    return problems


def part_b(plane: ControlPlane, key: str, stages: list, args: argparse.Namespace) -> dict:
    """``concurrency`` streams started at once; each checked against its job row."""
    model = plane.model
    texts = [prompt(i) for i in range(args.concurrency)]
    want = [chat_prompt_tokens(model, text) for text in texts]

    async def one(api, text: str) -> dict:
        try:
            return await api_stream(api, model, text, args.max_tokens_b)
        except Exception as exc:  # a failed request is a result to report, not a reason to stop
            return {"error": f"{type(exc).__name__}: {exc}", "job": None}

    async def run() -> tuple[list[dict], list[dict], float, float, dict, list[dict], dict]:
        api = client(plane.base_url, key)
        async with api:
            lone = [await api_stream(api, model, prompt(i), args.max_tokens_b) for i in range(args.warmup)]
            with CpuMeter(plane.agents) as cpu_api:
                started = time.perf_counter()
                runs = await asyncio.gather(*(one(api, text) for text in texts))
                ended = time.perf_counter()
        # The same load without the API: one fresh coordinator per request, all at once, as the jobs run.
        with CpuMeter(plane.agents) as cpu_direct:
            direct_started = time.perf_counter()
            direct = await asyncio.gather(
                *(direct_stream(model, stages, i, args.max_tokens_b, text) for i, text in enumerate(texts))
            )
            direct_wall = time.perf_counter() - direct_started
        direct_tokens = sum(d["completion_tokens"] for d in direct)
        direct_load = {
            "wall_s": round(direct_wall, 3),
            "completion_tokens": direct_tokens,
            "aggregate_tok_s": round(direct_tokens / direct_wall, 1),
            "ttft": summary_ms([d["ttft_s"] for d in direct if d["ttft_s"] is not None]),
            "latency": summary_ms([d["total_s"] for d in direct]),
            "cpu": cpu_direct.report(direct_tokens),
        }
        # The same prompts one at a time on the coordinator called directly: what each stream should
        # have carried, found without the API and without concurrency (greedy, so the same tokens).
        alone = [await direct_stream(model, stages, i, args.max_tokens_b, text) for i, text in enumerate(texts)]
        api_tokens = sum(r["usage"]["completion_tokens"] for r in runs if r.get("usage"))
        return lone, list(runs), started, ended, direct_load, alone, cpu_api.report(api_tokens)

    lone, runs, started, ended, direct_load, alone, cpu = asyncio.run(run())
    rows = job_rows([r["job"] for r in runs])
    problems = [check_request(r, rows.get(r["job"]), want[i], args.max_tokens_b) for i, r in enumerate(runs)]
    completed = [r for r in runs if not r.get("error") and r["finish_reason"] is not None and r["usage"]]
    tokens = sum(r["usage"]["completion_tokens"] for r in completed)
    wall = ended - started
    return {
        "model": model,
        "stages": [f"{s.node}[{s.layer_start}:{s.layer_end}]" for s in stages],
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens_b,
        "completed": len(completed),
        "correct_usage": sum(not p for p in problems),
        "finish_reasons": {
            reason: sum(r.get("finish_reason") == reason for r in runs) for reason in ("stop", "length", None)
        },
        "wall_s": round(wall, 3),
        "completion_tokens": tokens,
        "aggregate_tok_s": round(tokens / wall, 1) if wall > 0 else None,
        "ttft": summary_ms([r["ttft_s"] for r in runs if r.get("ttft_s") is not None]),
        "latency": summary_ms([r["total_s"] for r in runs if r.get("total_s") is not None]),
        "ttft_split": ttft_split(runs, rows),
        "job_row_ttft": summary_ms([row["ttft_ms"] / 1000 for row in rows.values() if row["ttft_ms"] is not None]),
        "jobs_verified": sum(bool(row["verified"]) for row in rows.values()),
        "content_deltas": sum(r.get("content_deltas") or 0 for r in runs),
        "same_as_direct": sum(
            bool(r.get("usage"))
            and r["text"] == d["text"]
            and r["usage"]["completion_tokens"] == d["completion_tokens"]
            for r, d in zip(runs, alone, strict=True)
        ),
        "cpu": cpu,
        "direct_same_load": direct_load,
        "lone_request_ttft": summary_ms([r["ttft_s"] for r in lone if r["ttft_s"] is not None]),
        "lone_request_latency": summary_ms([r["total_s"] for r in lone]),
        "problems": {texts[i]: p for i, p in enumerate(problems) if p},
        "per_request": [
            {
                "ttft_ms": _round(1000 * r["ttft_s"]) if r.get("ttft_s") is not None else None,
                "latency_ms": _round(1000 * r["total_s"]) if r.get("total_s") is not None else None,
                "finish_reason": r.get("finish_reason"),
                "usage": r.get("usage"),
                "expected_prompt_tokens": want[i],
                "job_row_completion_tokens": rows.get(r["job"], {}).get("completion_tokens"),
                "content_deltas": r.get("content_deltas"),
                "direct_completion_tokens": alone[i]["completion_tokens"],
                "same_text_as_direct": r.get("text") == alone[i]["text"],
                "ok": not problems[i],
            }
            for i, r in enumerate(runs)
        ],
    }


def run_part(args: argparse.Namespace) -> int:
    """In a child process whose environment the parent prepared: one control plane, one part."""
    import torch

    torch.set_num_threads(args.threads)
    spec = PARTS[args.part]
    workdir = Path(os.environ["SWARM_DATA_DIR"]).parent
    setup_django()
    plane = ControlPlane(spec["model"], spec["max_layers"], workdir, args.threads)
    from worker_agent import model as models

    models.load_head(plane.model)  # cached for every coordinator of this process, as in the web app
    models.load_tokenizer(plane.model)
    try:
        tokens, key = plane.accounts()
        plane.serve()
        started = time.monotonic()
        plane.join(tokens)
        stages = plane.wait_servable()
        print(
            f"part {args.part.upper()}: {plane.model} servable in {time.monotonic() - started:.1f} s at "
            f"{plane.base_url}: " + " -> ".join(f"{s.node}[{s.layer_start}:{s.layer_end}]" for s in stages),
            file=sys.stderr,
            flush=True,
        )
        result = part_a(plane, key, stages, args) if args.part == "a" else part_b(plane, key, stages, args)
    finally:
        plane.stop()
    Path(args.part_output).write_text(json.dumps(result))
    return 0


def child_env(workdir: Path, model: str, threads: int) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if name in KEPT or not (name.startswith(CONTROL_PLANE_PREFIXES) or name in CONTROL_PLANE_NAMES)
    }
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "marketplace.settings",
            "SWARM_DATA_DIR": str(workdir / "data"),
            "SWARM_MODELS": model,
            "SWARM_HEARTBEAT_INTERVAL_S": "2",
            "SWARM_HEARTBEAT_TIMEOUT_S": "30",
            # Keeps the placement fixed while measuring: a re-placement mid-run would reload blocks.
            "SWARM_REBALANCE_MIN_INTERVAL_S": "86400",
            "SWARM_LOG_LEVEL": "WARNING",
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def spawn_part(part: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-api-{part}-") as tmp:
        workdir = Path(tmp)
        output = workdir / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--part-output", str(output)]
        command += [
            f"--requests={args.requests}",
            f"--concurrency={args.concurrency}",
            f"--max-tokens-a={args.max_tokens_a}",
            f"--max-tokens-b={args.max_tokens_b}",
            f"--warmup={args.warmup}",
            f"--grammar-requests={args.grammar_requests}",
            f"--max-tokens-grammar={args.max_tokens_grammar}",
            f"--threads={args.threads}",
        ]
        child = subprocess.Popen(command, env=child_env(workdir, PARTS[part]["model"], args.threads), cwd=ROOT)
        try:
            code = child.wait()
        finally:
            if child.poll() is None:
                child.terminate()
                child.wait(timeout=60)
        if code != 0 or not output.exists():
            raise SystemExit(f"part {part.upper()} failed (exit code {code})")
        return json.loads(output.read_text())


# --- output ---------------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def _f(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.1f}"


def print_summary(a: dict, b: dict, checks: list[dict]) -> None:
    print(
        f"\nA. time to first token, {a['model']} ({' -> '.join(a['stages'])}), {a['requests']} sequential "
        f"requests per path, max_tokens {a['max_tokens']}, greedy"
    )
    print(f"{'path':<34} {'n':>3} {'p50 ms':>8} {'p90 ms':>8} {'min ms':>8} {'max ms':>8}")
    for label, entry in (
        ("API (openai client, SSE)", a["api_ttft"]),
        ("coordinator direct", a["direct_ttft"]),
        ("API - direct, paired per prompt", a["paired_difference"]),
        ("  API job row ttft_ms (OPEN..1st)", a["api_job_row_ttft"]),
        ("  direct, OPEN..1st token", a["direct_coordinator_ttft"]),
        ("  API: request -> job row", a["api_split"]["request_to_job_row"]),
        ("  API: job row -> running", a["api_split"]["job_row_to_running"]),
        ("  API: running -> 1st content", a["api_split"]["running_to_first_content"]),
        ("API whole request", a["api_total"]),
        ("direct whole request", a["direct_total"]),
    ):
        print(
            f"{label:<34} {entry['n']:>3} {_f(entry['p50_ms'], 8)} {_f(entry['p90_ms'], 8)} "
            f"{_f(entry['min_ms'], 8)} {_f(entry['max_ms'], 8)}"
        )
    print(
        f"p50 difference (API p50 - direct p50): {a['p50_difference_ms']} ms; same greedy text on both paths in "
        f"{a['same_text']}/{a['requests']}; API jobs succeeded {a['api_jobs_succeeded']}/{a['requests']}"
    )

    g = a["grammar"]
    print(
        f"grammar: decode tok/s free {g['free_decode_tok_s']}, constrained to a JSON schema "
        f"{g['json_schema_decode_tok_s']} (ratio {g['ratio']}; {g['requests_per_path']} requests each, plain "
        f"decoding, max_tokens {g['max_tokens']}); JSON valid {g['json_valid']}/{g['requests_per_path']}"
    )
    print(
        f"\nB. {b['concurrency']} concurrent streams, {b['model']} ({' -> '.join(b['stages'])}), max_tokens "
        f"{b['max_tokens']}, greedy"
    )
    n = b["concurrency"]
    print(
        f"{'path':<22} {'completed':>9} {'usage ok':>8} {'wall s':>7} {'tokens':>6} {'agg tok/s':>9} "
        f"{'ttft p50':>8} {'ttft p90':>8} {'lat p50':>8} {'lat p90':>8}"
    )
    direct = b["direct_same_load"]
    for label, done, ok, entry in (
        ("API (openai client)", f"{b['completed']}/{n}", f"{b['correct_usage']}/{n}", b),
        (f"direct, {n} coordinators", "", "", direct),
    ):
        print(
            f"{label:<22} {done:>9} {ok:>8} {entry['wall_s']:>7.2f} {entry['completion_tokens']:>6} "
            f"{_f(entry['aggregate_tok_s'], 9)} {_f(entry['ttft']['p50_ms'], 8)} {_f(entry['ttft']['p90_ms'], 8)} "
            f"{_f(entry['latency']['p50_ms'], 8)} {_f(entry['latency']['p90_ms'], 8)}"
        )
    for label, entry in (("API", b["cpu"]), ("direct", direct["cpu"])):
        threads = ", ".join(f"{name.split(' (')[0]} {value:.2f}" for name, value in entry["by_thread_s"].items())
        print(
            f"CPU {label}: control-plane process {entry['control_plane_process_s']:.2f} s ({threads}), agents "
            f"{sum(entry['agents_s']):.2f} s; per token {entry['ms_per_token']['control_plane_process']} ms and "
            f"{entry['ms_per_token']['agents']} ms"
        )
    print(
        f"one request at a time through the API (the warm-up): ttft p50 {b['lone_request_ttft']['p50_ms']} ms, "
        f"latency p50 {b['lone_request_latency']['p50_ms']} ms"
    )
    reasons = ", ".join(f"{k}: {v}" for k, v in b["finish_reasons"].items() if v)
    print(
        f"finish reasons {reasons}; jobs verified {b['jobs_verified']}/{b['concurrency']}; {b['content_deltas']} "
        f"content deltas for {b['completion_tokens']} tokens; text and token count equal to the same prompt run "
        f"alone on the coordinator directly: {b['same_as_direct']}/{b['concurrency']}"
    )
    split = b["ttft_split"]
    print(
        "API TTFT split, p50 / p90 ms: "
        + "; ".join(
            f"{label} {split[key]['p50_ms']} / {split[key]['p90_ms']}"
            for label, key in (
                ("request -> job row", "request_to_job_row"),
                ("job row -> running", "job_row_to_running"),
                ("running -> 1st content", "running_to_first_content"),
            )
        )
    )
    for text, problems in b["problems"].items():
        print(f"  wrong: {text!r}: {'; '.join(problems)}")
    print(LEGEND)
    print()
    for check in checks:
        verdict = "n/a" if check["met"] is None else "PASS" if check["met"] else "MISS"
        print(f"target {check['target']}: {check['value']} (goal {check['relation']} {check['goal']}) {verdict}")


LEGEND = """\
ttft         API: create() called -> first chunk with content; direct: Coordinator() -> first TokenEvent with text
job row      the job's coordinator's own TTFT (its stream's start, after connecting, to the first token)
API: split   request sent -> job row created (HTTP, key, tokenization, rate limit, route) -> job running (credit
             hold, commit, coordinator task started) -> first content at the client (tickets, coordinator, SSE)
direct, N    the same prompts on N fresh coordinators at once, called directly (after the API's run)
agg tok/s    completion tokens of every completed request / (first request sent .. last stream ended)
usage ok     finish_reason set; usage.prompt_tokens = tokenizer's count; completion_tokens = job row's,
             = max_tokens when the finish is 'length'; content deltas <= completion_tokens"""


def definitions(legend: str) -> dict[str, str]:
    """The legend as a dict: a name in the first 12 columns, its text after; indented lines continue it."""
    entries: dict[str, str] = {}
    name = ""
    for line in legend.splitlines():
        if line[:12].strip():
            name = line[:12].strip()
            entries[name] = line[13:].strip()
        else:
            entries[name] += " " + line.strip()
    return entries


def targets(a: dict, b: dict) -> list[dict]:
    diff = a["p50_difference_ms"]
    ratio = a["grammar"]["ratio"]
    return [
        {
            "target": "decode tok/s constrained to a JSON schema / free (plain decoding)",
            "value": ratio,
            "relation": ">=",
            "goal": 0.8,
            "met": None if ratio is None else ratio >= 0.8,
        },
        {
            "target": "API p50 TTFT - direct coordinator p50 TTFT (ms)",
            "value": diff,
            "relation": "<",
            "goal": TTFT_GOAL_MS,
            "met": None if diff is None else diff < TTFT_GOAL_MS,
        },
        {
            "target": f"{b['concurrency']} concurrent streams complete with correct usage",
            "value": b["correct_usage"],
            "relation": "==",
            "goal": b["concurrency"],
            "met": b["correct_usage"] == b["concurrency"],
        },
    ]


def machine(threads: int) -> dict:
    return describe_machine(
        **package_versions("torch", "transformers", "django", "channels", "uvicorn", "openai"),
        torch_threads_per_agent_and_control_plane=threads,
        load_average_at_start=load_average(),
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20, help="part A: sequential requests per path (default 20)")
    parser.add_argument("--concurrency", type=int, default=50, help="part B: concurrent streams (default 50)")
    parser.add_argument("--max-tokens-a", type=int, default=8, help="part A: max_tokens per request (default 8)")
    parser.add_argument("--max-tokens-b", type=int, default=32, help="part B: max_tokens per request (default 32)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests per path before timing (default 2)")
    parser.add_argument(
        "--grammar-requests", type=int, default=6, help="part A: free and JSON-schema requests each (default 6)"
    )
    parser.add_argument("--max-tokens-grammar", type=int, default=64, help="part A: max_tokens of those (default 64)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of each agent and of the control plane (default 1)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 5 requests in A, 10 concurrent in B")
    parser.add_argument("--output", type=Path, default=RESULTS, help="default bench/results/api.json")
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--part-output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.concurrency, args.warmup, args.grammar_requests = 5, 10, 1, 2
    return args


def main() -> int:
    args = parse_args()
    # SIGTERM unwinds like Ctrl-C, so that every finally runs: the parent stops its child, the child
    # its agents and web server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.part:
        return run_part(args)
    started = time.monotonic()
    info = machine(args.threads)
    print(
        f"machine: {info['cpu']}, {info['cpu_count']} CPUs, torch {info['torch']}, "
        f"load average {info['load_average_at_start']}\n"
        f"each part: an embedded control plane (SQLite, in-memory channel layer, coordinators in the web "
        f"process) and three `swarm-worker join` agents, {args.threads} torch thread(s) each",
        flush=True,
    )
    a = spawn_part("a", args)
    b = spawn_part("b", args)
    checks = targets(a, b)
    print_summary(a, b, checks)
    elapsed = round(time.monotonic() - started, 1)
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report = {
        "benchmark": "api",
        "command": " ".join(["python", "bench/api.py", *sys.argv[1:]]),
        "machine": info,
        "conditions": {
            "control_plane": "embedded, one per part: SQLite, in-memory channel layer and cache, coordinators "
            "as tasks of the web process (uvicorn in a thread of the benchmark's child process)",
            "agents": "three `swarm-worker join` processes per part on loopback, ring topology, no WAN emulation",
            "why_two_control_planes": "placement places every model of SWARM_MODELS over all active nodes and an "
            "agent serves one block at a time, so each part has its own control plane with SWARM_MODELS=<its model>",
            "part_a": {
                "model": a["model"],
                "max_layers_per_agent": PARTS["a"]["max_layers"],
                "requests_per_path": args.requests,
                "order": "API then direct for even prompts, direct then API for odd ones, after the warm-up",
                "client": "openai.AsyncOpenAI, stream=True, temperature 0, in the benchmark's child process",
                "api_ttft": "create() called -> first chunk with non-empty delta.content: HTTP, key check, "
                "tokenization, rate limit, admission, the job's coordinator (tickets, connect, OPEN, prefill, "
                "first token), channel layer, SSE, client parsing",
                "direct_ttft": "Coordinator() constructed -> first TokenEvent with text: connect to the three "
                "stages, OPEN, prefill, first token (tickets signed before the clock)",
            },
            "part_b": {
                "model": b["model"],
                "max_layers_per_agent": PARTS["b"]["max_layers"],
                "concurrency": args.concurrency,
                "client": "one openai.AsyncOpenAI (its default pool: 1000 connections), stream_options.include_usage",
            },
            "definitions": definitions(LEGEND),
            "rate_limits": "the API key's limits are lifted (1e6 requests/min, 1e9 tokens/min); the customer is "
            "granted $1000 of credits",
            "environment": {
                k: v for k, v in child_env(Path("<tmp>"), "<model>", args.threads).items() if k.startswith("SWARM_")
            },
        },
        "part_a": a,
        "part_b": b,
        "targets": checks,
        "elapsed_s": elapsed,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.output, report)
    print(f"\nwrote {args.output} in {elapsed} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
