"""Churn: stages killed and frozen mid-request, and a control plane serving through a churning swarm.

    .venv/bin/python bench/churn.py                   # the full run (``make bench``), about 30 minutes
    .venv/bin/python bench/churn.py --quick           # a smoke run of the same code paths, about 10 minutes
    .venv/bin/python bench/churn.py --only nospare    # one part alone (trials, nospare or soak)

In one run, on real agent processes on loopback:

1. **Kill**: ``--kill-tiny`` requests on ``tiny-llama`` (6 layers: stages 0:2, 2:4, 4:6) and
   ``--kill-smollm2`` on ``smollm2-135m`` (30 layers: 0:10, 10:20, 20:30), each with one stage of
   its route SIGKILLed right after the client received token t. A seeded ``random.Random`` draws
   the route position and t in [1, n - 1] (n: the tokens the unbroken run of that prompt gives,
   ``--max-tokens`` at most). The coordinator (this process) heals onto warm spares
   (``SpareHealer``, ``LocalSwarm`` agents holding each span); every killed agent is replaced by a
   freshly started one for the same span, which becomes a spare for later trials.
2. **Freeze**: the same with SIGSTOP (``--freeze-tiny``, ``--freeze-smollm2`` trials) and a short
   stall timeout (``--stall-s``); the frozen agent gets SIGCONT after the request, then is retired
   (its sessions are gone) and a fresh spare takes its place.
3. **Soak**: an embedded control plane (SQLite in a temporary directory, in-memory channel layer,
   coordinators as tasks of the web process, uvicorn in a thread; in a child process whose
   environment names only these settings), ``tiny-llama`` on ``swarm-worker join`` agents capped
   at 2 layers, ``SWARM_SPARES_PER_PIPELINE=1``. ``--soak-streams`` streamed chat completions through
   the API (official ``openai`` client) are kept running for ``--soak-s`` seconds, each finished
   one replaced by a new one, while a seeded churn loop kills an agent (SIGKILL) and joins a new
   node, restarts one (SIGTERM, then the same key rejoins), freezes one (SIGSTOP for a few seconds,
   then SIGCONT) or joins one more, waiting for the swarm to be whole again before the next event.
4. **No-spare heals**: the control plane heals a span that no warm spare holds by having a spare of
   another span (or an idle node) load it while the job waits (``jobs.services.load_replacement``).
   For each of ``--nospare-models`` (``tiny-llama`` capped at 2 layers, ``smollm2-135m`` at 10, so
   three spans each) and ``--nospare-topologies`` (``SWARM_TOPOLOGY`` ring and star), an embedded
   control plane as the soak's, in a child process of its own, with five ``swarm-worker join``
   agents and ``SWARM_SPARES_PER_PIPELINE=2``: three stages and two warm spares of two spans, so one
   span has none. Each agent holds its outgoing data-plane frames back for ``--nospare-rtt-ms`` (an
   emulated round trip), so that a failure lands mid-stream. ``--nospare-kills`` then
   ``--nospare-freezes`` streamed greedy completions through the API (``openai`` client; a chat
   model's prompt put through its chat template), each with the one node holding the span that no
   other node holds SIGKILLed (or SIGSTOPped, and SIGCONTed once the request is over) right after
   the client received chunk t, drawn by a seeded ``random.Random`` in [2, n - 2] (n: the chunks of
   the unbroken run of the prompt). After a kill a fresh node joins. Before each trial the placement settles
   (``nospare_settled``): every killed node swept offline (its departure re-places the model: not
   during a trial), five ready blocks on five nodes in good standing (a frozen node is backed off
   for ``SWARM_FAILURE_BACKOFF_S``, 30 s), one span held by one block only: three stages and two
   spares of two spans, or the same with a stage's place left to a spare of its span, which a heal
   that had an idle pipeline member load the failed span leaves until a node comes or goes.

Per kill/freeze trial: completed (a result, no error), token-identical to the unbroken run of the
same prompt, the pause (time of the first token after the failure - time of the last token
before it, from the result's ``token_times``) and the re-prefill time: time to first token of a
request whose prompt is the prompt + the t tokens committed before the failure, run afterwards on
the route the request healed onto (the pass the heal re-ran). Reported: completed %, identical %,
pause and re-prefill p50/p95, and the check pause p95 <= stall timeout + 2 x re-prefill p95 (the
stall timeout in effect for the trial's one-token step; twice that for a frozen ring stage past the
first, which the coordinator first hands its predecessor's output and waits for again). A kill is
seen as a lost connection long before its stall timeout, so every row also checks the heal's own
time, with no allowance: (pause - detection) p95 <= 2 x re-prefill p95, detection being the time
from the last token to the coordinator seeing the failure (for a kill, mostly the OS closing the
dead process's sockets).

No-spare trial: completed (the job succeeded and the stream ended with a finish reason),
token-identical (the text equals the unbroken run's), the pause (the longest gap between two chunks
from the last chunk before the signal on), the detection (the heal's ``detected_at``, when the
coordinator reported the failure, - that last chunk), the load (the heal's replacement block of the
span: ``ready_at`` - ``created_at`` of its ``Assignment``; 0 where the replacement held the span
already) and the re-prefill (time to first token, through the API, of the prompt followed by the
text streamed before the failure: an over-estimate of the pass the heal re-ran, as it includes
admission). Reported per model, topology and fault: completed %, identical %, each of the four
p50/p95, and the check pause p95 <= detection p95 + load p95 + 2 x re-prefill p95. A freeze is found
by its unanswered PING (``pipeline.FREEZE_SUSPECT_S`` without progress, then ``FREEZE_PROBE_S``),
not by the stall timeout, so its detection is seconds where a kill's is milliseconds.

Soak: requests completed / failed (each failure's error text kept), heals (sum of
``len(Job.heals)``), heals caused by routing to a stage being released (the stage refused the job
because its block is being let go: its agent is stopping, or the control plane released the block;
the heal's reason starts with one of ``LEAVING_CODES``; routing must never pick such a stage, so
this is 0), re-placements (``PlacementState.generation`` delta) and the ledger to the
nano-dollar: every job's charge = ``cost(prompt_tokens, completion_tokens, prices)``, its
completion_tokens = the usage its stream reported (and content chunks <= it), hold = charge +
release, verified jobs' earnings + platform fee = charge, and every ledger account's balance =
its credits - its debits, all balances summing to zero.

Why tiny-llama in the soak: on a 2-core machine, 50 concurrent streams plus agents starting and
stopping leave no room for a real model; the soak is about the control plane's healing, routing
and money under churn, which tiny-llama exercises the same way.

A benchmark measures and prints; it asserts nothing. The table goes to stdout, everything else to
``bench/results/churn.json``. Every process the benchmark starts is stopped by its id, on Ctrl-C
too.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's packages, whatever the venv's editable install points at

from api import machine, percentile, setup_django  # noqa: E402 - the sibling benchmark's helpers
from report import write_json  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "churn.json"
MODELS = {
    "tiny-llama": {"spans": [(0, 2), (2, 4), (4, 6)], "chat": False},
    "smollm2-135m": {"spans": [(0, 10), (10, 20), (20, 30)], "chat": True},
}
PROMPTS = {
    "tiny-llama": [
        "The swarm keeps serving while its nodes come and go",
        "A volunteer network of machines, each holding a few layers",
        "Tokens flow through the ring of stages one after another",
        "When a stage dies the coordinator asks for a spare",
        "Every receipt is signed by the node that did the work",
    ],
    "smollm2-135m": [
        "Write a long, detailed essay about the history of the Roman Empire.",
        "Explain in detail how a steam engine works, step by step.",
        "Describe the water cycle in detail for a school textbook chapter.",
        "Write a long story about a lighthouse keeper and a storm.",
        "Give a detailed guide to planting and caring for a vegetable garden.",
    ],
}
SOAK_MODEL = "tiny-llama"
SOAK_MAX_LAYERS = 2
TOPICS = ["the sky", "rivers", "bread", "the moon", "bicycles", "volcanoes", "libraries", "honey bees", "glass"]
# Non-round prices (nano-dollars per million tokens), so that a rounding slip shows in the ledger check.
PRICE_PROMPT_PER_MILLION = 123_456_789
PRICE_COMPLETION_PER_MILLION = 987_654_321
QUICK = {
    "kill_tiny": 6,
    "kill_smollm2": 2,
    "freeze_tiny": 3,
    "freeze_smollm2": 1,
    "nospare_kills": 1,
    "nospare_freezes": 1,
    "soak_s": 30.0,
    "soak_streams": 10,
}
PARTS = ("trials", "nospare", "soak")  # --only's choices
FAILURE_BACKOFF_S = 1.0  # a soak client waits this long after a failed request before its next one
# A stage's refusal codes that say its block is being let go (``worker_agent.protocol.connection``): a heal
# with one of them was caused by routing a job to a leaving stage.
LEAVING_CODES = ("stage_draining", "not_serving")
# No-spare trials: five agents, each capped so that its model splits into three spans (three stages)
# and two warm spares (SWARM_SPARES_PER_PIPELINE=2) of two spans, so one span has none.
NOSPARE_CAPS = {"tiny-llama": 2, "smollm2-135m": 10}  # layers an agent may hold
NOSPARE_AGENTS = 5
NOSPARE_SPARES = 2
NOSPARE_HEARTBEAT_TIMEOUT_S = 20.0  # a frozen node is healed around long before it is swept offline
NOSPARE_STALL_S = 10.0  # SWARM_STALL_TIMEOUT_S: a freeze is found by its unanswered PING long before
NOSPARE_START_S = 600.0  # the most the first trial waits for the agents to start and settle
NOSPARE_SETTLE_S = 300.0  # the most a later trial waits for the placement to settle again
CHILD_FLAGS = ("--soak-child", "--nospare-child")  # a child's part: not passed on to the child's own args


def summary(values: list[float]) -> dict:
    ms = [1000 * v for v in values]
    return {
        "n": len(ms),
        "p50_ms": _round(percentile(ms, 0.5)),
        "p95_ms": _round(percentile(ms, 0.95)),
        "max_ms": _round(max(ms) if ms else None),
    }


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


# --- kill and freeze trials on LocalSwarm agents (this process is the coordinator) -----------------


class Spares:
    """One model's agents: the current route (one per span, in order), the warm spares, and fresh
    agents started for the spans whose agents were killed or retired."""

    def __init__(self, model: str, spans: list[tuple[int, int]], per_span: int, threads: int, workdir: Path) -> None:
        from worker_agent.dev.local import LocalSwarm

        self.model, self.spans, self.per_span = model, spans, per_span
        self.local = LocalSwarm(model, spans * (1 + per_span), threads=threads, workdir=workdir)
        self.route: list = []
        self.spares: list = []
        self.started_s: list[float] = []  # wall time of each batch of agent starts

    def start(self) -> Spares:
        started = time.monotonic()
        self.local.start()
        self.started_s.append(time.monotonic() - started)
        self.route = list(self.local.agents[: len(self.spans)])
        self.spares = list(self.local.agents[len(self.spans) :])
        return self

    def refill(self) -> None:
        """Start fresh spares (together) until every span has ``per_span`` of them again."""
        wanted = [span for span in self.spans for _ in range(self.per_span - self._count(span))]
        if wanted:
            started = time.monotonic()
            self.spares += self.local.add(wanted)
            self.started_s.append(time.monotonic() - started)

    def short(self) -> bool:
        return any(self._count(span) == 0 for span in self.spans)

    def _count(self, span: tuple[int, int]) -> int:
        return sum((a.layer_start, a.layer_end) == span for a in self.spares)

    def specs(self, job: str) -> list:
        from worker_agent.coordinator.pipeline import StageSpec

        return [StageSpec(agent.url, self.local.ticket(job, agent)) for agent in self.route]

    def healer(self, job: str):
        from worker_agent.coordinator.heal import SpareHealer

        return SpareHealer([a.url for a in self.spares], ticket=lambda info: self.local.ticket(job, info))

    def settle(self, victim, receipts: list) -> None:
        """After a trial: the route is the nodes that signed the request's receipts (the healed
        route); agents of the old route still alive and no longer on it go back to the spares, and
        the victim leaves both lists. Without receipts (the request failed) a spare takes the
        victim's place."""
        by_node = {a.node: a for a in self.route + self.spares}
        route = [by_node[r.node] for r in receipts] if receipts else list(self.route)
        if victim in route:
            if self.short():
                self.refill()
            span = (victim.layer_start, victim.layer_end)
            route[route.index(victim)] = next(
                a for a in self.spares if (a.layer_start, a.layer_end) == span and a not in route
            )
        left = [a for a in self.route if a not in route and a is not victim]
        self.spares = [a for a in self.spares if a not in route and a is not victim] + left
        self.route = route

    def stop(self) -> None:
        for agent in self.local.agents:  # a frozen agent must run again to exit on SIGTERM
            if agent.process.poll() is None:
                agent.process.send_signal(signal.SIGCONT)
        self.local.stop()


async def _stream(coordinator, request, on_token=None):
    """The request's result; ``on_token(count)`` runs after each token the client receives."""
    from worker_agent.coordinator.job import GenerationResult

    result, count = None, 0
    async for event in coordinator.stream(request, strict=False):
        if isinstance(event, GenerationResult):
            result = event
        elif event.token_id is not None:
            count += 1
            if on_token is not None:
                on_token(count)
    return result


async def unbroken(swarm: Spares, ids: list[int], max_tokens: int):
    """A request on the current route, nothing failing, no healer."""
    from worker_agent.coordinator.job import Coordinator
    from worker_agent.coordinator.sampling import SamplingParams

    job = f"churn-ref-{uuid.uuid4().hex[:8]}"
    async with Coordinator(
        swarm.model, swarm.specs(job), job=job, coordinator_key=swarm.local.coordinator_key(job)
    ) as coordinator:
        request = coordinator.request_ids(ids, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))
        return await _stream(coordinator, request)


async def broken(swarm: Spares, ids: list[int], max_tokens: int, victim, at: int, *, freeze: bool, stall_s: float):
    """The request with ``victim`` SIGKILLed (or SIGSTOPped) right after token ``at`` reached the
    client; returns (result or None, error text, whether the failure was injected)."""
    from worker_agent.coordinator.job import Coordinator
    from worker_agent.coordinator.sampling import SamplingParams

    injected = []

    def on_token(count: int) -> None:
        if count != at:
            return
        if freeze:
            victim.process.send_signal(signal.SIGSTOP)
        else:
            victim.process.kill()  # reaped after the request: waiting here would stall the coordinator's loop
        injected.append(count)

    job = f"churn-{'freeze' if freeze else 'kill'}-{uuid.uuid4().hex[:8]}"
    try:
        async with Coordinator(
            swarm.model,
            swarm.specs(job),
            job=job,
            healer=swarm.healer(job),
            stall_timeout_s=stall_s,
            coordinator_key=swarm.local.coordinator_key(job),
        ) as coordinator:
            request = coordinator.request_ids(ids, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))
            return await _stream(coordinator, request, on_token), "", bool(injected)
    except Exception as exc:  # a failed request is a result to report
        return None, f"{type(exc).__name__}: {exc}", bool(injected)


def trial(swarm: Spares, rng: random.Random, ids: list[int], reference: list[int], args, *, freeze: bool) -> dict:
    max_tokens = args.max_tokens
    position = rng.randrange(len(swarm.spans))
    at = rng.randint(1, max(1, min(max_tokens, len(reference)) - 1))
    victim = swarm.route[position]
    stall_s = args.stall_s if freeze else args.kill_stall_s
    try:
        result, error, injected = asyncio.run(
            broken(swarm, ids, max_tokens, victim, at, freeze=freeze, stall_s=stall_s)
        )
    finally:
        if freeze:  # the frozen agent runs again, then is retired: its sessions are gone
            victim.process.send_signal(signal.SIGCONT)
            victim.process.terminate()
            try:
                victim.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                victim.process.kill()
                victim.process.wait()
    if injected and not freeze:
        victim.process.wait()  # reaped now that the request is over
    swarm.settle(victim, result.receipts if result is not None else [])
    times = result.token_times if result is not None else []
    pause = times[at] - times[at - 1] if injected and len(times) > at else None
    # The pass the heal re-ran: the prompt and the tokens committed before the failure, on the healed route.
    prefill = asyncio.run(unbroken(swarm, ids + reference[:at], 1))
    return {
        "position": position,
        "token": at,
        "victim": victim.node,
        "injected": injected,
        "completed": result is not None and not error,
        "identical": result is not None and result.token_ids == reference,
        "error": error,
        "verified": result is not None and result.verification is not None,
        "verification_error": result.verification_error if result is not None else "",
        "heals": [heal.to_json() for heal in result.heals] if result is not None else [],
        "blamed_victim": bool(result and result.heals and result.heals[0].stage == position),
        "pause_s": _round(pause, 4),
        "prefill_tokens": len(ids) + at,
        "re_prefill_s": _round(prefill.ttft, 4) if prefill is not None else None,
        "tokens": len(result.token_ids) if result is not None else 0,
    }


def run_trials(model: str, kills: int, freezes: int, args, workdir: Path) -> dict:
    """Kill trials then freeze trials on one model's swarm."""
    from worker_agent import model as models
    from worker_agent.coordinator.job import encode_prompt

    spec = MODELS[model]
    rng = random.Random(f"{args.seed}-{model}")
    tokenizer = models.load_tokenizer(model)
    models.load_head(model)  # loaded once, before any clock
    prompts = [list(encode_prompt(tokenizer, text, chat=spec["chat"])) for text in PROMPTS[model]]
    swarm = Spares(model, spec["spans"], args.spares_per_span, args.threads, workdir / model)
    out: dict = {"model": model, "spans": spec["spans"], "prompts": PROMPTS[model]}
    try:
        swarm.start()
        print(f"{model}: {len(swarm.local.agents)} agents ready in {swarm.started_s[0]:.1f} s", file=sys.stderr)
        references = [asyncio.run(unbroken(swarm, ids, args.max_tokens)).token_ids for ids in prompts]
        for kind, count in (("kill", kills), ("freeze", freezes)):
            trials = []
            for index in range(count):
                if swarm.short():
                    swarm.refill()
                p = index % len(prompts)
                record = {"prompt": p, **trial(swarm, rng, prompts[p], references[p], args, freeze=kind == "freeze")}
                trials.append(record)
                heal = record["heals"][0] if record["heals"] else {}
                print(
                    f"  {model} {kind} {index + 1:>3}/{count}: stage {record['position']} at token {record['token']}: "
                    f"{'ok' if record['completed'] else 'FAILED'}, "
                    f"{'identical' if record['identical'] else 'DIFFERENT'}, {heal.get('code', 'no heal')}, "
                    f"pause {_ms(record['pause_s'])} ms, re-prefill {_ms(record['re_prefill_s'])} ms"
                    + (f" ({record['error']})" if record["error"] else ""),
                    file=sys.stderr,
                    flush=True,
                )
            out[kind] = trials
        out["reference_tokens"] = [len(r) for r in references]
        out["agent_start_batches_s"] = [round(s, 2) for s in swarm.started_s]
        out["agents_started"] = len(swarm.local.agents)
    finally:
        swarm.stop()
    return out


def _first_heals(trials: list[dict]) -> list[tuple[dict, dict]]:
    return [(t, t["heals"][0]) for t in trials if t["heals"] and t["pause_s"] is not None]


def _after_detect_check(trials: list[dict], prefill_p95_ms: float | None) -> dict:
    after = summary([h["resumed_s"] - h["detected_s"] for _, h in _first_heals(trials) if h["resumed_s"]])
    bound = None if prefill_p95_ms is None else round(2 * prefill_p95_ms, 1)
    return {
        "formula": "(pause - detection) p95 <= 2 x re-prefill p95",
        "after_detect_p95_ms": after["p95_ms"],
        "bound_ms": bound,
        "met": None if bound is None or after["p95_ms"] is None else after["p95_ms"] <= bound,
    }


def trial_summary(trials: list[dict], stall_s: float, *, relayed: bool = False) -> dict:
    """The rows' figures and check. ``relayed``: a stall of a ring stage past the first is blamed only
    after the coordinator has handed that stage its predecessor's tapped output itself and waited a
    second stall timeout (``coordinator/stalls.py``), so such a trial's stall timeout in effect is two."""
    n = len(trials)
    pauses = [t["pause_s"] for t in trials if t["pause_s"] is not None]
    prefills = [t["re_prefill_s"] for t in trials if t["re_prefill_s"] is not None]
    pause, prefill = summary(pauses), summary(prefills)
    if relayed and any(t.get("position", 0) > 0 for t in trials):
        stall_s *= 2
    bound = None if prefill["p95_ms"] is None else round(1000 * stall_s + 2 * prefill["p95_ms"], 1)
    codes: dict[str, int] = {}
    for t in trials:
        for heal in t["heals"]:
            codes[heal["code"]] = codes.get(heal["code"], 0) + 1
    return {
        "trials": n,
        "injected": sum(t["injected"] for t in trials),
        "completed": sum(t["completed"] for t in trials),
        "identical": sum(t["identical"] for t in trials),
        "verified": sum(t["verified"] for t in trials),
        "completed_pct": _round(100 * sum(t["completed"] for t in trials) / n) if n else None,
        "identical_pct": _round(100 * sum(t["identical"] for t in trials) / n) if n else None,
        "heal_codes": codes,
        "blamed_victim": sum(t["blamed_victim"] for t in trials),
        "pause": pause,
        "re_prefill": prefill,
        "heal_overhead": summary(
            [t["pause_s"] - t["re_prefill_s"] for t in trials if t["pause_s"] and t["re_prefill_s"]]
        ),
        # Where a heal's time goes (ms, p50/p95): from the last token before the failure to its
        # detection; from detection to the healed route connected (a replacement found, every stage
        # HELLOed); from then to its first result (OPEN and the re-prefill).
        "heal_phases": {
            "detect": summary(
                [t["pause_s"] - (h["resumed_s"] - h["detected_s"]) for t, h in _first_heals(trials) if h["resumed_s"]]
            ),
            "reconnect": summary(
                [h["reconnected_s"] - h["detected_s"] for _, h in _first_heals(trials) if h["reconnected_s"]]
            ),
            "resume": summary(
                [
                    h["resumed_s"] - h["reconnected_s"]
                    for _, h in _first_heals(trials)
                    if h["resumed_s"] and h["reconnected_s"]
                ]
            ),
        },
        "stall_term_s": round(stall_s, 4),
        # The part of a pause this code controls: from the failure's detection to the first token on
        # the healed route (reconnect + resume), held to 2 x re-prefill with no allowance at all.
        "after_detect_check": _after_detect_check(trials, prefill["p95_ms"]),
        "check": {
            "formula": "pause p95 <= stall timeout + 2 x re-prefill p95",
            "pause_p95_ms": pause["p95_ms"],
            "bound_ms": bound,
            "met": None if bound is None or pause["p95_ms"] is None else pause["p95_ms"] <= bound,
        },
        "failures": [t["error"] for t in trials if t["error"]],
    }


# --- soak: an embedded control plane, joined agents, API load and churn (in a child process) -------


@dataclass
class Joined:
    """One ``swarm-worker join`` agent of the soak."""

    name: str
    key: Path
    node_pk: int
    process: subprocess.Popen
    log: Path


class EmbeddedPlane:
    """An embedded control plane in this process and its ``swarm-worker join`` agents of ``model``,
    each capped at ``max_layers`` layers, its outgoing data-plane frames held back as ``wan`` says:
    the soak's, and the no-spare trials'."""

    def __init__(
        self,
        workdir: Path,
        threads: int,
        seed: int,
        *,
        model: str = SOAK_MODEL,
        max_layers: int = SOAK_MAX_LAYERS,
        wan: str = "",
    ) -> None:
        self.workdir, self.threads = workdir, threads
        self.model, self.max_layers, self.wan = model, max_layers, wan
        self.rng = random.Random(f"{seed}-soak")
        self.server = None
        self.agents: list[Joined] = []  # running ones
        self.gone: list[int] = []  # the nodes (pks) of agents killed for good
        self.every: list[subprocess.Popen] = []  # every process started, for the cleanup
        self.events: list[dict] = []
        self.started = 0
        self.stopping = threading.Event()
        self.churn_thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return self.server.url

    def accounts(self) -> str:
        """A provider, a customer with lifted rate limits and credits, non-zero prices; the API key."""
        from django.contrib.auth import get_user_model
        from django.utils import timezone

        from marketplace.billing.models import ModelPrice
        from marketplace.billing.services import grant
        from marketplace.jobs.models import ApiKey
        from marketplace.jobs.services import create_api_key

        users = get_user_model()
        self.provider = users.objects.create(username="churn-provider", email="p@example.com", is_provider=True)
        self.customer = users.objects.create(username="churn-customer", email="c@example.com", is_customer=True)
        api_key, key = create_api_key(self.customer, "churn")
        ApiKey.objects.filter(pk=api_key.pk).update(requests_per_minute=1_000_000, tokens_per_minute=1_000_000_000)
        grant(self.customer, 1000, memo="benchmark credits")
        ModelPrice.objects.create(
            model=self.model,
            prompt_per_million=PRICE_PROMPT_PER_MILLION,
            completion_per_million=PRICE_COMPLETION_PER_MILLION,
            effective_from=timezone.now() - timezone.timedelta(minutes=1),
        )
        return key

    def serve(self) -> None:
        from marketplace.embedded import EmbeddedServer

        self.server = EmbeddedServer().start()

    def join(self, again: Joined | None = None) -> Joined:
        """A new node (its own key and join token), or ``again``'s node reconnecting with its key."""
        from marketplace.nodes.joining import create_node
        from worker_agent.dev.local import join_agent

        index = self.started
        self.started += 1
        if again is None:
            name = f"churn-node-{index}"
            node, token = create_node(owner=self.provider, name=name)
            key, node_pk = self.workdir / f"{name}.key", node.pk
        else:
            name, key, node_pk, token = again.name, again.key, again.node_pk, ""
        log = self.workdir / f"agent{index}.log"
        process = join_agent(
            self.base_url,
            token,
            key,
            log,
            model=self.model,
            max_layers=self.max_layers,
            threads=self.threads,
            wan=self.wan,
        )
        self.every.append(process)
        agent = Joined(name, key, node_pk, process, log)
        self.agents.append(agent)
        return agent

    def whole(self, node_pk: int | None = None, gone: int | None = None) -> bool:
        """Servable, every live assignment loaded, the node ``node_pk`` (if any) connected and the
        node ``gone`` (if any) offline."""
        from marketplace.nodes.models import Node, NodeState
        from marketplace.placement.models import Assignment, AssignmentState
        from marketplace.placement.selectors import servable_pipelines

        if node_pk is not None and not Node.objects.filter(pk=node_pk, state=NodeState.ACTIVE, connected=True).exists():
            return False
        if gone is not None and Node.objects.filter(pk=gone).exclude(state=NodeState.OFFLINE).exists():
            return False
        loading = Assignment.objects.filter(model=self.model, state=AssignmentState.ASSIGNED).exists()
        return not loading and bool(servable_pipelines(self.model))

    def wait_whole(self, node_pk: int | None = None, gone: int | None = None, timeout: float = 180.0) -> float | None:
        """Seconds until the swarm is whole again; None past the timeout."""
        started = time.monotonic()
        while time.monotonic() - started < timeout and not self.stopping.is_set():
            for agent in self.agents:
                if agent.process.poll() is not None:
                    raise RuntimeError(f"{agent.name} exited:\n{log_tail(agent.log)}")
            if self.whole(node_pk, gone):
                return time.monotonic() - started
            time.sleep(0.25)
        return None

    def churn(
        self, started: float, deadline: float, interval: tuple[float, float], freeze_s: tuple[float, float], cap: int
    ) -> None:
        """Until the deadline: wait, then one churn event, then wait for the swarm to be whole (a killed
        node also gone offline, so that no two are missing at once)."""
        from django.db import close_old_connections

        try:
            while not self.stopping.wait(self.rng.uniform(*interval)) and time.monotonic() < deadline:
                actions = ["kill", "restart", "freeze"] + (["join"] if len(self.agents) < cap else [])
                action = self.rng.choice(actions)
                victim = self.rng.choice(self.agents)
                event = {"at_s": round(time.monotonic() - started, 1), "action": action}
                if action == "kill":
                    victim.process.kill()
                    victim.process.wait()
                    self.agents.remove(victim)
                    event["victim"] = victim.name
                    fresh = self.join()
                    event["new"] = fresh.name
                    event["whole_after_s"] = _round(self.wait_whole(fresh.node_pk, gone=victim.node_pk), 1)
                elif action == "restart":
                    victim.process.terminate()
                    try:
                        victim.process.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        victim.process.kill()
                        victim.process.wait()
                    self.agents.remove(victim)
                    event["victim"] = victim.name
                    self.join(victim)
                    event["whole_after_s"] = _round(self.wait_whole(victim.node_pk), 1)
                elif action == "freeze":
                    seconds = self.rng.uniform(*freeze_s)
                    victim.process.send_signal(signal.SIGSTOP)
                    self.stopping.wait(seconds)
                    victim.process.send_signal(signal.SIGCONT)
                    event.update(victim=victim.name, frozen_s=round(seconds, 1))
                    event["whole_after_s"] = _round(self.wait_whole(), 1)
                else:
                    fresh = self.join()
                    event["new"] = fresh.name
                    event["whole_after_s"] = _round(self.wait_whole(fresh.node_pk), 1)
                self.events.append(event)
                print(f"  churn: {event}", file=sys.stderr, flush=True)
        except Exception as exc:  # recorded; the load goes on without churn
            self.events.append({"action": "error", "error": f"{type(exc).__name__}: {exc}"})
            print(f"  churn stopped: {exc}", file=sys.stderr, flush=True)
        finally:
            close_old_connections()

    def stop(self) -> None:
        from worker_agent.dev.local import stop_processes

        self.stopping.set()  # the churn loop starts nothing more (also on Ctrl-C, mid-event)
        if self.churn_thread is not None:
            self.churn_thread.join(timeout=60)
        for process in self.every:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
        stop_processes(self.every)
        if self.server is not None:
            self.server.stop()


def log_tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else "(no log)"


async def soak_stream(api, text: str, max_tokens: int) -> dict:
    """One streamed chat completion: its job id, content chunks, finish reason, usage or error."""
    record = {"job": None, "content_chunks": 0, "finish_reason": None, "usage": None, "error": ""}
    started = time.monotonic()
    try:
        stream = await api.chat.completions.create(
            model=SOAK_MODEL,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            record["job"] = record["job"] or chunk.id
            if chunk.choices:
                if chunk.choices[0].delta.content:
                    record["content_chunks"] += 1
                record["finish_reason"] = chunk.choices[0].finish_reason or record["finish_reason"]
            if chunk.usage is not None:
                record["usage"] = chunk.usage.model_dump()
    except Exception as exc:  # a failed request is a result to report
        record["error"] = f"{type(exc).__name__}: {exc}"
    if not record["error"] and (record["finish_reason"] is None or record["usage"] is None):
        record["error"] = "the stream ended without a finish reason and usage"
    record["latency_s"] = round(time.monotonic() - started, 3)
    return record


async def soak_load(plane: EmbeddedPlane, key: str, args) -> list[dict]:
    from openai import AsyncOpenAI

    started = time.monotonic()
    deadline = started + args.soak_s
    churn = threading.Thread(
        target=plane.churn,
        args=(
            started,
            deadline,
            (args.churn_min_s, args.churn_max_s),
            (2.0, args.soak_freeze_max_s),
            args.soak_max_agents,
        ),
        name="churn",
        daemon=True,
    )
    plane.churn_thread = churn
    records: list[dict] = []
    counter = iter(range(1_000_000))

    async def worker(api) -> None:
        while time.monotonic() < deadline:
            i = next(counter)
            text = f"Write one short sentence about {TOPICS[i % len(TOPICS)]}. (request {i})"
            record = {"started_s": round(time.monotonic() - started, 2)}
            record.update(await soak_stream(api, text, args.soak_max_tokens))
            records.append(record)
            if record["error"]:  # a client backs off after a failure rather than spin on a quick refusal
                await asyncio.sleep(FAILURE_BACKOFF_S)

    api = AsyncOpenAI(base_url=f"{plane.base_url}/v1", api_key=key, max_retries=0, timeout=600)
    async with api:
        churn.start()
        try:
            await asyncio.gather(*(worker(api) for _ in range(args.soak_streams)))
        finally:
            plane.stopping.set()
            await asyncio.to_thread(churn.join)
    return records


def ledger_check(records: list[dict]) -> dict:
    """Every job's money against its tokens and the client's stream; the ledger's accounts against
    their transfers."""
    from django.conf import settings
    from django.db.models import Sum

    from marketplace.billing.models import LedgerAccount, Transfer
    from marketplace.billing.services import cost
    from marketplace.jobs.models import Job, JobState
    from marketplace.payouts.models import Earning

    by_job = {r["job"]: r for r in records if r["job"]}
    problems: list[str] = []
    jobs = list(Job.objects.all())
    for job in jobs:
        prices = (job.price_prompt_per_million, job.price_completion_per_million)
        if prices != (PRICE_PROMPT_PER_MILLION, PRICE_COMPLETION_PER_MILLION):
            problems.append(f"{job.public_id}: prices {prices}")
        # Only verified work is charged (a job its client cancelled pays for what it was sent).
        billable = job.verified is True or job.state == JobState.CANCELLED
        want = cost(job.prompt_tokens, job.completion_tokens, prices) if job.completion_tokens and billable else 0
        if job.settled_at is None:
            problems.append(f"{job.public_id}: not settled ({job.state})")
        if job.charged_amount != want:
            problems.append(f"{job.public_id}: charged {job.charged_amount} != cost {want}")
        moved = {
            row["kind"]: row["total"]
            for row in Transfer.objects.filter(job=job).values("kind").annotate(total=Sum("amount"))
        }
        if (
            moved.get("hold", 0) != job.hold_amount
            or moved.get("charge", 0) + moved.get("release", 0) != job.hold_amount
        ):
            problems.append(f"{job.public_id}: hold {job.hold_amount}, transfers {moved}")
        if moved.get("charge", 0) != job.charged_amount:
            problems.append(f"{job.public_id}: charge transfer {moved.get('charge', 0)} != {job.charged_amount}")
        if job.verified and job.charged_amount:
            earned = Earning.objects.filter(job=job).aggregate(total=Sum("amount"))["total"] or 0
            fee = job.charged_amount * settings.SWARM_PLATFORM_FEE_BPS // 10_000
            if earned + fee != job.charged_amount:
                problems.append(f"{job.public_id}: earnings {earned} + fee {fee} != charge {job.charged_amount}")
        record = by_job.get(job.public_id)
        if record is None:
            problems.append(f"{job.public_id}: no client stream carried its id")
            continue
        usage = record["usage"]
        if usage is not None and usage["completion_tokens"] != job.completion_tokens:
            problems.append(f"{job.public_id}: usage {usage['completion_tokens']} != job {job.completion_tokens}")
        if record["content_chunks"] > job.completion_tokens:
            problems.append(f"{job.public_id}: {record['content_chunks']} content chunks > {job.completion_tokens}")
    accounts_off = []
    for account in LedgerAccount.objects.all():
        credits = Transfer.objects.filter(credit=account).aggregate(total=Sum("amount"))["total"] or 0
        debits = Transfer.objects.filter(debit=account).aggregate(total=Sum("amount"))["total"] or 0
        if account.balance != credits - debits:
            accounts_off.append(f"{account}: balance {account.balance} != credits {credits} - debits {debits}")
    total = LedgerAccount.objects.aggregate(total=Sum("balance"))["total"] or 0
    holds = LedgerAccount.objects.filter(kind="customer_hold").aggregate(total=Sum("balance"))["total"] or 0
    return {
        "jobs": len(jobs),
        "jobs_ok": len(jobs) - len({p.split(":")[0] for p in problems}),
        "charged_nano_usd": sum(job.charged_amount for job in jobs),
        "usage_equals_content_chunks": sum(
            1 for r in records if r["usage"] and r["usage"]["completion_tokens"] == r["content_chunks"]
        ),
        "streams_without_job_id": sum(1 for r in records if not r["job"]),
        "accounts_balanced": not accounts_off,
        "balances_sum": total,
        "open_holds": holds,
        "transfers": Transfer.objects.count(),
        "problems": problems + accounts_off,
    }


def count_by(values: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def placement_now(model: str = SOAK_MODEL) -> list[str]:
    """The model's live assignments: node[span] by pipeline and position, spares last."""
    from marketplace.placement.models import LIVE_STATES, Assignment

    live = Assignment.objects.filter(model=model, state__in=LIVE_STATES).select_related("node")
    return [
        f"{'spare' if a.is_spare else f'p{a.pipeline}.{a.position}'} {a.node.name}[{a.layer_start}:{a.layer_end}] "
        f"{a.state}"
        for a in sorted(live, key=lambda a: (a.is_spare, a.pipeline, a.position))
    ]


def soak_child(args) -> int:
    """In a child process whose environment the parent prepared: the soak, written to --part-output."""
    import torch

    torch.set_num_threads(args.threads)
    workdir = Path(os.environ["SWARM_DATA_DIR"]).parent
    setup_django()
    from marketplace.jobs.models import Job, JobState
    from marketplace.nodes.models import Node
    from marketplace.placement.models import PlacementState
    from marketplace.verification.models import Audit, Challenge, Strike
    from worker_agent import model as models

    models.load_head(SOAK_MODEL)  # cached for every coordinator of this process, as in the web app
    models.load_tokenizer(SOAK_MODEL)
    plane = EmbeddedPlane(workdir, args.threads, args.seed)
    try:
        key = plane.accounts()
        plane.serve()
        started = time.monotonic()
        for _ in range(args.soak_agents):
            plane.join()
        ready_s = plane.wait_whole(timeout=600)
        if ready_s is None:
            raise SystemExit(f"the soak's swarm was not servable in 600 s:\n{log_tail(plane.agents[0].log)}")
        print(f"soak: {args.soak_agents} agents servable in {time.monotonic() - started:.1f} s", file=sys.stderr)
        generation = PlacementState.objects.get(model=SOAK_MODEL).generation
        placement = placement_now()
        load_started = time.monotonic()
        records = asyncio.run(soak_load(plane, key, args))
        load_s = time.monotonic() - load_started
        settle_deadline = time.monotonic() + 60
        while time.monotonic() < settle_deadline and Job.objects.filter(settled_at__isnull=True).exists():
            time.sleep(0.5)
        jobs = list(Job.objects.all())
        failures = [r for r in records if r["error"]]
        failed_rows = {j.public_id: f"{j.error_code}: {j.error_message}" for j in jobs if j.state == JobState.FAILED}
        heals_of = {j.public_id: [{k: h[k] for k in ("at", "failed_node", "reason")} for h in j.heals] for j in jobs}
        result = {
            "agents_at_start": args.soak_agents,
            "agents_started": plane.started,
            "wall_s": round(load_s, 1),
            "requests": len(records),
            "completed": len(records) - len(failures),
            "failed": len(failures),
            "failures": [
                {
                    "job": r["job"],
                    "started_s": r["started_s"],
                    "error": r["error"],
                    "job_error": failed_rows.get(r["job"], ""),
                    "job_heals": heals_of.get(r["job"], []),
                }
                for r in failures
            ],
            "failures_by_error": count_by([r["error"][:100] for r in failures]),
            "job_states": {state: sum(j.state == state for j in jobs) for state in JobState.values},
            "heals": sum(len(j.heals) for j in jobs),
            "healed_jobs": sum(bool(j.heals) for j in jobs),
            "heal_reasons": count_by([h["reason"][:100] for j in jobs for h in j.heals]),
            "heals_to_leaving_stages": sum(h["reason"].startswith(LEAVING_CODES) for j in jobs for h in j.heals),
            # Every agent of the soak is honest: each strike, failure count or refund is a false one.
            "strikes_on_honest_nodes": Strike.objects.count(),
            "strikes_by_kind": count_by(list(Strike.objects.values_list("kind", flat=True))),
            "strike_reasons": [
                f"{node}: {evidence.get('reason', '')}"[:300]
                for node, evidence in Strike.objects.values_list("node__node_id", "evidence")
            ],
            "failures_counted_on_honest_nodes": sum(Node.objects.values_list("failures_total", flat=True)),
            "audits": count_by(list(Audit.objects.values_list("state", flat=True))),
            "challenges": count_by(list(Challenge.objects.values_list("state", flat=True))),
            "unverified_jobs": sum(j.state == JobState.SUCCEEDED and not j.verified for j in jobs),
            "placement_at_start": placement,
            "placement_at_end": placement_now(),
            "re_placements": PlacementState.objects.get(model=SOAK_MODEL).generation - generation,
            "completion_tokens": sum(r["usage"]["completion_tokens"] for r in records if r["usage"]),
            "latency": summary([r["latency_s"] for r in records if not r["error"]]),
            "churn_events": plane.events,
            "ledger": ledger_check(records),
        }
    finally:
        plane.stop()
    Path(args.part_output).write_text(json.dumps(result))
    return 0


# --- no-spare heals: a span without a spare, loaded by a spare of another span (in a child process) -


def nospare_blocks(model: str) -> list:
    """The model's live blocks, oldest first."""
    from marketplace.placement.models import LIVE_STATES, Assignment

    return list(Assignment.objects.filter(model=model, state__in=LIVE_STATES).select_related("node").order_by("pk"))


def nospare_settled(model: str, gone: Collection[int]) -> list | None:
    """The model's live blocks once a trial may start; None before. Every node killed before
    (``gone``: their pks) is swept offline, which re-places the model, so that no re-placement
    comes during the trial; five ready blocks, one per node, each node active, connected and in good
    standing (not reported failed, under no review, not backed off: a frozen node is for
    SWARM_FAILURE_BACKOFF_S), so that the heal may pick any node the placement has; and one span
    held by one block only, the span without a spare. That is the placement's three stages and two
    spares of two spans, or the same with a stage's place left to a spare of its span: a heal that
    had an idle pipeline member load the span leaves that until a node comes or goes."""
    from django.utils import timezone

    from marketplace.nodes.models import Node, NodeState
    from marketplace.placement.models import AssignmentState

    if Node.objects.filter(pk__in=gone).exclude(state=NodeState.OFFLINE).exists():
        return None
    blocks = nospare_blocks(model)
    now = timezone.now()
    up = all(
        a.state == AssignmentState.READY
        and a.node.connected
        and a.node.state == NodeState.ACTIVE
        and a.node.suspected_at is None
        and not a.node.under_review
        and (a.node.routing_backoff_until is None or a.node.routing_backoff_until <= now)
        for a in blocks
    )
    holders = sorted(Counter((a.layer_start, a.layer_end) for a in blocks).values())
    whole = len({a.node_id for a in blocks}) == len(blocks) == NOSPARE_AGENTS
    return blocks if up and whole and holders == [1, 2, 2] else None


def nospare_settle(plane: EmbeddedPlane, gone: Collection[int], timeout: float) -> tuple[list | None, float]:
    """Wait for ``nospare_settled``: its blocks (None past the timeout) and the seconds waited."""
    started = time.monotonic()
    while True:
        for agent in plane.agents:
            if agent.process.poll() is not None:
                raise RuntimeError(f"{agent.name} exited:\n{log_tail(agent.log)}")
        blocks = nospare_settled(plane.model, gone)
        if blocks is not None or time.monotonic() - started > timeout:
            return blocks, time.monotonic() - started
        time.sleep(0.25)


def api_stream(client, model: str, prompt: str, max_tokens: int, on_chunk=None) -> dict:
    """A streamed greedy completion through the API: its text, each text chunk's arrival (epoch
    seconds: the clock the control plane stamps a heal's ``detected_at`` with), its job id and finish
    reason. ``on_chunk(count, text)`` runs after each text chunk, ``text`` being all of it so far."""
    chunks = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    streamed = {"text": "", "times": [], "job": "", "finish_reason": None}
    for chunk in chunks:
        streamed["job"] = streamed["job"] or chunk.id
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        streamed["finish_reason"] = choice.finish_reason or streamed["finish_reason"]
        if choice.text:
            streamed["text"] += choice.text
            streamed["times"].append(time.time())
            if on_chunk is not None:
                on_chunk(len(streamed["times"]), streamed["text"])
    return streamed


def completion_prompt(model: str, text: str) -> str:
    """``text`` as a completion's prompt: for a chat model, put through its chat template as text (the
    completions API tokenizes it to the ids the chat API would), so that an instruct model answers
    rather than stops, and the prompt plus the text streamed is the re-prefill's prompt exactly."""
    from worker_agent import model as models

    if not MODELS[model]["chat"]:
        return text
    messages = [{"role": "user", "content": text}]
    return models.load_tokenizer(model).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def settled_job(public_id: str, timeout: float = 30.0):
    """The job once it is settled (its verification done), or as it is after ``timeout``; None if
    there is no such job."""
    from marketplace.jobs.models import Job

    deadline = time.monotonic() + timeout
    job = Job.objects.filter(public_id=public_id).first()
    while job is not None and job.settled_at is None and time.monotonic() < deadline:
        time.sleep(0.25)
        job.refresh_from_db()
    return job


def nospare_trial(
    plane: EmbeddedPlane, client, prompt: str, reference: dict, max_tokens: int, at: int, *, freeze: bool
) -> dict:
    """One request with the node of the one block of a span that no other block holds SIGKILLed (or
    SIGSTOPped, and SIGCONTed once the request is over) right after chunk ``at`` reached the client;
    its figures (pause, detection, load, re-prefill: see the module's docstring)."""
    from marketplace.jobs.models import JobState
    from marketplace.nodes.models import Node
    from marketplace.placement.models import Assignment

    blocks = nospare_blocks(plane.model)
    holders = Counter((a.layer_start, a.layer_end) for a in blocks)
    victim = next((a for a in blocks if holders[(a.layer_start, a.layer_end)] == 1), None)
    stages = sum(not a.is_spare for a in blocks)
    record: dict = {"token": at, "reference_chunks": len(reference["times"]), "injected": False, "error": ""}
    record["placement_before"] = f"{stages} stages + {len(blocks) - stages} spares"
    if victim is None:
        return {**record, "completed": False, "identical": False, "error": "every span has a spare"}
    if len(reference["times"]) < 4:  # no chunk t in [2, n - 2] to fail after
        error = f"the unbroken run streamed {len(reference['times'])} chunks"
        return {**record, "completed": False, "identical": False, "error": error}
    agent = next(a for a in plane.agents if a.node_pk == victim.node_id)
    span = (victim.layer_start, victim.layer_end)
    held_before = {a.node.node_id: (a.layer_start, a.layer_end) for a in blocks}
    record.update(victim=victim.node.node_id, span=list(span), victim_was_spare=victim.is_spare)
    signalled: dict = {}

    def on_chunk(count: int, text: str) -> None:
        if count == at:
            signalled.update(at=time.time(), text=text)
            agent.process.send_signal(signal.SIGSTOP if freeze else signal.SIGKILL)

    streamed = None
    try:
        streamed = api_stream(client, plane.model, prompt, max_tokens, on_chunk)
    except Exception as exc:  # a failed request is a result to report
        record["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if freeze and signalled:
            agent.process.send_signal(signal.SIGCONT)
    if signalled and not freeze:
        agent.process.wait()  # reaped now that the request is over
        plane.agents.remove(agent)
        plane.gone.append(agent.node_pk)
    record["injected"] = bool(signalled)
    job = settled_job(streamed["job"]) if streamed is not None and streamed["job"] else None
    record["completed"] = bool(job and job.state == JobState.SUCCEEDED and streamed["finish_reason"])
    record["identical"] = streamed is not None and streamed["text"] == reference["text"]
    record["job_state"] = job.state if job is not None else None
    record["verified"] = bool(job and job.verified)
    record["heals"] = (
        [{k: h.get(k) for k in ("failed_node", "reason", "detected_at", "at")} for h in job.heals] if job else []
    )
    if not record["completed"]:  # where the request ran, and the placement it left, for the failure's reader
        names = dict(Node.objects.values_list("node_id", "name"))
        route = job.route if job is not None else []
        record["route"] = [f"{names.get(s['node'])}[{s['layer_start']}:{s['layer_end']}]" for s in route]
        record["blocks_before"] = [f"{a.node.name}[{a.layer_start}:{a.layer_end}]" for a in blocks]
        record["placement_after"] = placement_now(plane.model)
    if not (signalled and streamed and job and job.heals and len(streamed["times"]) > at):
        return record
    replacement = next((s["node"] for s in job.route if (s["layer_start"], s["layer_end"]) == span), None)
    record.update(replacement=replacement, replacement_held=held_before.get(replacement))
    times = streamed["times"][at - 1 :]  # from the last chunk before the signal
    record["pause_s"] = _round(max(b - a for a, b in itertools.pairwise(times)), 4)
    detected = datetime.fromisoformat(job.heals[0]["detected_at"]).timestamp()
    record["detection_s"] = _round(detected - times[0], 4)
    # From the report to the route around it: the control plane's part of the heal, the load included.
    record["to_route_s"] = _round(datetime.fromisoformat(job.heals[0]["at"]).timestamp() - detected, 4)
    # A replacement that held the span already was ready: nothing was loaded for this heal.
    record["loaded_for_heal"] = replacement is not None and held_before.get(replacement) != span
    if record["loaded_for_heal"]:
        loaded = Assignment.objects.filter(
            model=plane.model, node__node_id=replacement, layer_start=span[0], layer_end=span[1]
        ).latest("pk")
        record["load_s"] = _round((loaded.ready_at - loaded.created_at).total_seconds(), 4) if loaded.ready_at else None
    else:
        record["load_s"] = 0.0
    # The pass the heal re-ran: the prompt and the text streamed before the failure, through the API.
    started = time.time()
    first = api_stream(client, plane.model, prompt + signalled["text"], 1)
    record["re_prefill_s"] = _round(first["times"][0] - started, 4) if first["times"] else None
    return record


def nospare_child(args) -> int:
    """In a child process whose environment the parent prepared (the model and topology among its
    settings): the no-spare trials, written to --part-output."""
    import torch

    torch.set_num_threads(args.threads)
    workdir = Path(os.environ["SWARM_DATA_DIR"]).parent
    setup_django()
    from django.conf import settings
    from openai import OpenAI

    from worker_agent import model as models

    model, topology = settings.SWARM_MODELS[0], settings.SWARM_TOPOLOGY
    models.load_head(model)  # cached for every coordinator of this process, as in the web app
    models.load_tokenizer(model)
    prompts = [completion_prompt(model, text) for text in PROMPTS[model]]
    rng = random.Random(f"{args.seed}-nospare-{model}-{topology}")
    wan = f"rtt={args.nospare_rtt_ms:g}ms" if args.nospare_rtt_ms else ""
    plane = EmbeddedPlane(workdir, args.threads, args.seed, model=model, max_layers=NOSPARE_CAPS[model], wan=wan)
    out: dict = {"model": model, "topology": topology, "max_layers": NOSPARE_CAPS[model], "prompts": PROMPTS[model]}
    out.update(kill=[], freeze=[])
    try:
        key = plane.accounts()
        plane.serve()
        client = OpenAI(base_url=f"{plane.base_url}/v1", api_key=key, max_retries=0, timeout=300)
        references: dict[int, dict] = {}
        counts = {"kill": args.nospare_kills, "freeze": args.nospare_freezes}
        trials = [(kind, number) for kind, count in counts.items() for number in range(count)]
        for index, (kind, number) in enumerate(trials):
            while len(plane.agents) < NOSPARE_AGENTS:  # a killed node's place goes to a fresh one
                plane.join()
            blocks, waited = nospare_settle(plane, plane.gone, NOSPARE_SETTLE_S if index else NOSPARE_START_S)
            if index == 0:
                if blocks is None:
                    raise SystemExit(
                        f"{model}: no settled placement in {waited:.0f} s:\n{log_tail(plane.agents[0].log)}"
                    )
                print(f"{model} {topology}: {NOSPARE_AGENTS} agents settled in {waited:.1f} s", file=sys.stderr)
                out["ready_s"] = round(waited, 1)
                out["placement_at_start"] = placement_now(model)
            p = index % len(prompts)
            if p not in references:  # the unbroken run, on the settled placement
                references[p] = api_stream(client, model, prompts[p], args.max_tokens)
            reference = references[p]
            at = rng.randint(2, max(2, len(reference["times"]) - 2))
            # The first wait is for the agents' start, not for a heal's aftermath.
            record = {
                "prompt": p,
                "settled_before": blocks is not None,
                "settle_before_s": round(waited, 1) if index else None,
            }
            record.update(
                nospare_trial(plane, client, prompts[p], reference, args.max_tokens, at, freeze=kind == "freeze")
            )
            out[kind].append(record)
            print(
                f"  {model} {topology} {kind} {number + 1}/{counts[kind]}: "
                f"span {record.get('span')} at chunk {at}: {'ok' if record['completed'] else 'FAILED'}, "
                f"{'identical' if record['identical'] else 'DIFFERENT'}, pause {_ms(record.get('pause_s'))} ms, "
                f"detection {_ms(record.get('detection_s'))} ms, load {_ms(record.get('load_s'))} ms, "
                f"re-prefill {_ms(record.get('re_prefill_s'))} ms"
                + (f" ({record['error']})" if record["error"] else ""),
                file=sys.stderr,
                flush=True,
            )
        out["reference_chunks"] = {p: len(r["times"]) for p, r in references.items()}
        out["placement_at_end"] = placement_now(model)
        out["agents_started"] = plane.started
    finally:
        plane.stop()
    Path(args.part_output).write_text(json.dumps(out))
    return 0


def nospare_env(workdir: Path, args, model: str, topology: str) -> dict[str, str]:
    return plane_env(
        workdir,
        args,
        {
            "SWARM_MODELS": model,
            "SWARM_TOPOLOGY": topology,
            "SWARM_SPARES_PER_PIPELINE": str(NOSPARE_SPARES),
            "SWARM_SWEEP_INTERVAL_S": "0.5",
            "SWARM_HEARTBEAT_INTERVAL_S": "0.5",
            "SWARM_HEARTBEAT_TIMEOUT_S": str(NOSPARE_HEARTBEAT_TIMEOUT_S),
            "SWARM_STALL_TIMEOUT_S": str(NOSPARE_STALL_S),
        },
    )


def run_nospare(args) -> dict:
    """The no-spare trials of each model in each topology, a child process each (the topology is a
    setting, read once by the control plane), with their summaries."""
    results: dict[str, dict] = {}
    for model in args.nospare_models:
        for topology in args.nospare_topologies:
            part = spawn_child(
                "--nospare-child",
                lambda workdir, model=model, topology=topology: nospare_env(workdir, args, model, topology),
                f"the no-spare trials of {model} in {topology}",
            )
            for kind in ("kill", "freeze"):
                part[f"{kind}_summary"] = nospare_summary(part.get(kind, []))
            results.setdefault(model, {})[topology] = part
    return results


def nospare_summary(trials: list[dict]) -> dict:
    n = len(trials)
    figures = {
        name: summary([t[f"{name}_s"] for t in trials if t.get(f"{name}_s") is not None])
        for name in ("pause", "detection", "load", "re_prefill", "to_route")
    }
    p95 = {name: figure["p95_ms"] for name, figure in figures.items()}
    parts = [p95["detection"], p95["load"], p95["re_prefill"]]
    bound = None if None in parts else round(p95["detection"] + p95["load"] + 2 * p95["re_prefill"], 1)
    return {
        "trials": n,
        "injected": sum(t["injected"] for t in trials),
        "completed": sum(t["completed"] for t in trials),
        "identical": sum(t["identical"] for t in trials),
        "verified": sum(t.get("verified", False) for t in trials),
        "completed_pct": _round(100 * sum(t["completed"] for t in trials) / n) if n else None,
        "identical_pct": _round(100 * sum(t["identical"] for t in trials) / n) if n else None,
        "loaded_for_heal": sum(t.get("loaded_for_heal", False) for t in trials),
        "settled_before": sum(t["settled_before"] for t in trials),
        "placement_before": count_by([t["placement_before"] for t in trials]),
        "settle_before": summary([t["settle_before_s"] for t in trials if t["settle_before_s"] is not None]),
        **figures,
        "check": {
            "formula": "pause p95 <= detection p95 + load p95 + 2 x re-prefill p95",
            "pause_p95_ms": p95["pause"],
            "bound_ms": bound,
            "met": None if bound is None or p95["pause"] is None else p95["pause"] <= bound,
        },
        "failures": [t["error"] for t in trials if t["error"]],
    }


def plane_env(workdir: Path, args, plane_settings: dict[str, str]) -> dict[str, str]:
    """A child's environment: the caller's, without any control-plane setting, plus an embedded
    control plane's (coordinators in process, data in ``workdir``) and ``plane_settings``."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name == "SWARM_MODEL_CACHE"
        or not (name.startswith(("SWARM_", "DJANGO_")) or name in ("DATABASE_URL", "REDIS_URL"))
    }
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "marketplace.settings",
            "SWARM_DATA_DIR": str(workdir / "data"),
            "SWARM_COORDINATOR_LAUNCH": "inprocess",
            "SWARM_LOG_LEVEL": "WARNING",
            "OMP_NUM_THREADS": str(args.threads),
            "PYTHONUNBUFFERED": "1",
            **plane_settings,
        }
    )
    return env


def soak_env(workdir: Path, args) -> dict[str, str]:
    return plane_env(
        workdir,
        args,
        {
            "SWARM_MODELS": SOAK_MODEL,
            "SWARM_SPARES_PER_PIPELINE": "1",
            "SWARM_HEARTBEAT_INTERVAL_S": "1",
            "SWARM_HEARTBEAT_TIMEOUT_S": str(args.soak_heartbeat_timeout_s),
            "SWARM_STALL_TIMEOUT_S": str(args.soak_stall_s),
        },
    )


def spawn_child(flag: str, env_of, what: str) -> dict:
    """Run this script again as a child (``flag`` says which part) in a temporary directory, with the
    environment ``env_of(workdir)``; its result, or an error naming ``what`` failed."""
    with tempfile.TemporaryDirectory(prefix="bench-churn-child-") as tmp:
        workdir = Path(tmp)
        output = workdir / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), flag, "--part-output", str(output)]
        command += [a for a in sys.argv[1:] if a not in CHILD_FLAGS]
        child = subprocess.Popen(command, env=env_of(workdir), cwd=ROOT)
        try:
            code = child.wait()
        finally:
            if child.poll() is None:
                child.terminate()
                child.wait(timeout=90)
        if code != 0 or not output.exists():
            return {"error": f"{what}'s process failed (exit code {code})"}
        return json.loads(output.read_text())


def spawn_soak(args) -> dict:
    return spawn_child("--soak-child", lambda workdir: soak_env(workdir, args), "the soak")


# --- output -----------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def _v(value) -> str:
    return "-" if value is None else str(value)


def print_table(info: dict, args, parts: dict, nospare: dict, soak: dict | None) -> None:
    print(
        f"\nmachine: {info['cpu']}, {info['cpu_count']} CPUs, {args.threads} torch thread(s) per agent and "
        f"coordinator, torch {info['torch']}, load average at start {info['load_average_at_start']}"
    )
    if parts:
        print_trials(args, parts)
    if nospare:
        print_nospare(args, nospare)
    if soak is not None:
        print_soak(args, soak)


def print_trials(args, parts: dict) -> None:
    print(
        f"kill/freeze: ring topology, greedy, max_tokens {args.max_tokens}, {args.spares_per_span} warm spare(s) "
        f"per span (SpareHealer), stall timeout {args.stall_s} s for freezes, seed {args.seed}"
    )
    print(
        f"{'model':<13} {'fault':<7} {'n':>4} {'done %':>6} {'ident %':>7} {'pause p50':>9} {'pause p95':>9} "
        f"{'prefill p50':>11} {'prefill p95':>11} {'bound ms':>8} {'check':>5} {'healing p95':>11} {'2x prefill':>10} "
        f"{'check':>5}"
    )
    for model, part in parts.items():
        for kind in ("kill", "freeze"):
            s = part.get(f"{kind}_summary")
            if not s or not s["trials"]:
                continue
            check = s["check"]
            verdict = "n/a" if check["met"] is None else "PASS" if check["met"] else "MISS"
            tight = s["after_detect_check"]
            tight_verdict = "n/a" if tight["met"] is None else "PASS" if tight["met"] else "MISS"
            print(
                f"{model:<13} {kind:<7} {s['trials']:>4} {_v(s['completed_pct']):>6} {_v(s['identical_pct']):>7} "
                f"{_v(s['pause']['p50_ms']):>9} {_v(s['pause']['p95_ms']):>9} {_v(s['re_prefill']['p50_ms']):>11} "
                f"{_v(s['re_prefill']['p95_ms']):>11} {_v(check['bound_ms']):>8} {verdict:>5} "
                f"{_v(tight['after_detect_p95_ms']):>11} {_v(tight['bound_ms']):>10} {tight_verdict:>5}"
            )
    print(
        "check: pause p95 <= stall timeout in effect + 2 x re-prefill p95 (bound ms; the stall timeout of a "
        "one-token step: --kill-stall-s or --stall-s, +20 ms, twice for a frozen ring stage past the first); "
        "second check: the heal's own time (pause - "
        "detection: reconnect + resume) p95 <= 2 x re-prefill p95, no allowance"
    )
    for model, part in parts.items():
        for kind in ("kill", "freeze"):
            s = part.get(f"{kind}_summary")
            if s and s["trials"]:
                print(
                    f"  {model} {kind}: heal codes {s['heal_codes']}, blamed the victim {s['blamed_victim']}/"
                    f"{s['trials']}, verified {s['verified']}/{s['trials']}, pause - re-prefill p50 "
                    f"{s['heal_overhead']['p50_ms']} ms p95 {s['heal_overhead']['p95_ms']} ms"
                )
                phases = s["heal_phases"]
                print(
                    "    heal phases p50/p95 ms: "
                    + ", ".join(f"{name} {phases[name]['p50_ms']}/{phases[name]['p95_ms']}" for name in phases)
                )
                for failure in s["failures"]:
                    print(f"    failed: {failure}")


def print_nospare(args, nospare: dict) -> None:
    print(
        f"\nno-spare heals: embedded control plane, {NOSPARE_AGENTS} joined agents per model (3 stages + "
        f"{NOSPARE_SPARES} warm spares of 2 spans, SWARM_SPARES_PER_PIPELINE={NOSPARE_SPARES}), the node of the "
        f"span without a spare signalled after chunk t in [2, n - 2], greedy, max_tokens {args.max_tokens}, "
        f"emulated round trip {args.nospare_rtt_ms:g} ms, seed {args.seed}"
    )
    print(
        f"{'model':<13} {'topology':<8} {'fault':<7} {'n':>3} {'done %':>6} {'ident %':>7} {'pause p50/p95':>15} "
        f"{'detect p50/p95':>15} {'load p50/p95':>15} {'prefill p50/p95':>15} {'bound ms':>8} {'check':>5}"
    )

    def pair(figure: dict) -> str:
        return f"{_v(figure['p50_ms'])}/{_v(figure['p95_ms'])}"

    for model, by_topology in nospare.items():
        for topology, part in by_topology.items():
            if "error" in part:
                print(f"{model:<13} {topology:<8} {part['error']}")
                continue
            for kind in ("kill", "freeze"):
                s = part[f"{kind}_summary"]
                if not s["trials"]:
                    continue
                check = s["check"]
                verdict = "n/a" if check["met"] is None else "PASS" if check["met"] else "MISS"
                print(
                    f"{model:<13} {topology:<8} {kind:<7} {s['trials']:>3} {_v(s['completed_pct']):>6} "
                    f"{_v(s['identical_pct']):>7} {pair(s['pause']):>15} {pair(s['detection']):>15} "
                    f"{pair(s['load']):>15} {pair(s['re_prefill']):>15} {_v(check['bound_ms']):>8} {verdict:>5}"
                )
    print(
        "check: pause p95 <= detection p95 + load p95 + 2 x re-prefill p95 (bound ms); detection: the last chunk "
        "before the signal to the coordinator's report; load: the block loaded for the heal, assigned to ready"
    )
    for model, by_topology in nospare.items():
        for topology, part in by_topology.items():
            for kind in ("kill", "freeze"):
                s = part.get(f"{kind}_summary")
                if not s or not s["trials"]:
                    continue
                settle = s["settle_before"]
                print(
                    f"  {model} {topology} {kind}: verified {s['verified']}/{s['trials']}, span loaded for the heal "
                    f"{s['loaded_for_heal']}/{s['trials']}, settled before the trial {s['settled_before']}/"
                    f"{s['trials']} (p50 {_v(settle['p50_ms'])} ms, max {_v(settle['max_ms'])} ms), placement before "
                    f"{s['placement_before']}; detection to the new route p50/p95 {_v(s['to_route']['p50_ms'])}/"
                    f"{_v(s['to_route']['p95_ms'])} ms"
                )
                for failure in s["failures"]:
                    print(f"    failed: {failure}")


def print_soak(args, soak: dict) -> None:
    if "error" in soak:
        print(f"\nsoak: {soak['error']}")
        return
    ledger = soak["ledger"]
    actions: dict[str, int] = {}
    for event in soak["churn_events"]:
        actions[event["action"]] = actions.get(event["action"], 0) + 1
    print(
        f"\nsoak: {SOAK_MODEL}, embedded control plane, {args.soak_streams} concurrent streamed chat completions "
        f"(openai.AsyncOpenAI) for {args.soak_s} s, max_tokens {args.soak_max_tokens}, SWARM_SPARES_PER_PIPELINE=1, "
        f"stall timeout {args.soak_stall_s} s, heartbeat timeout {args.soak_heartbeat_timeout_s} s"
    )
    print(
        f"{'requests':>8} {'completed':>9} {'failed':>6} {'heals':>5} {'to leaving':>10} {'healed jobs':>11} "
        f"{'re-placements':>13} {'churn events':>12} {'ledger ok':>9} {'balanced':>8}"
    )
    print(
        f"{soak['requests']:>8} {soak['completed']:>9} {soak['failed']:>6} {soak['heals']:>5} "
        f"{soak['heals_to_leaving_stages']:>10} {soak['healed_jobs']:>11} {soak['re_placements']:>13} "
        f"{len(soak['churn_events']):>12} "
        f"{ledger['jobs_ok']}/{ledger['jobs']:>4} {'yes' if ledger['accounts_balanced'] else 'NO':>8}"
    )
    print(
        f"churn: {actions}; agents started {soak['agents_started']}; completion tokens {soak['completion_tokens']}; "
        f"latency p50 {soak['latency']['p50_ms']} ms p95 {soak['latency']['p95_ms']} ms; ledger: "
        f"{ledger['transfers']} transfers, balances sum {ledger['balances_sum']}, open holds {ledger['open_holds']}, "
        f"charged {ledger['charged_nano_usd']} nano-USD; usage = content chunks in "
        f"{ledger['usage_equals_content_chunks']}/{soak['requests']} streams"
    )
    print(
        f"honest nodes: {soak['strikes_on_honest_nodes']} strikes {soak['strikes_by_kind']}, "
        f"{soak['failures_counted_on_honest_nodes']} failures counted; audits {soak['audits']}; "
        f"challenges {soak['challenges']}; {soak['unverified_jobs']} succeeded jobs unverified"
    )
    for failure in soak["failures"][:20]:
        print(f"  failed: {failure}")
    for problem in ledger["problems"][:20]:
        print(f"  ledger: {problem}")


def names(allowed: Iterable[str]) -> Callable[[str], list[str]]:
    """An argument type: a comma-separated list of ``allowed`` names."""

    def parse(text: str) -> list[str]:
        chosen = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in allowed]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"choose among {', '.join(allowed)}")
        return chosen

    return parse


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--kill-tiny", type=int, default=100, help="kill trials on tiny-llama (default 100)")
    add("--kill-smollm2", type=int, default=10, help="kill trials on smollm2-135m (default 10)")
    add("--freeze-tiny", type=int, default=20, help="freeze trials on tiny-llama (default 20)")
    add("--freeze-smollm2", type=int, default=3, help="freeze trials on smollm2-135m (default 3)")
    add("--max-tokens", type=int, default=16, help="tokens per kill/freeze request (default 16)")
    add("--stall-s", type=float, default=2.0, help="the coordinator's stall timeout in freeze trials (default 2)")
    add("--kill-stall-s", type=float, default=10.0, help="its stall timeout in kill trials (default 10)")
    add("--spares-per-span", type=int, default=2, help="warm spares per span in kill/freeze trials (default 2)")
    add("--soak-s", type=float, default=180.0, help="soak duration in seconds (default 180)")
    add("--soak-streams", type=int, default=50, help="concurrent streams in the soak (default 50)")
    add("--soak-max-tokens", type=int, default=32, help="max_tokens of each soak request (default 32)")
    add("--soak-agents", type=int, default=8, help="agents joined before the soak (default 8)")
    add("--soak-max-agents", type=int, default=10, help="joins stop adding agents at this many (default 10)")
    add("--soak-stall-s", type=float, default=3.0, help="SWARM_STALL_TIMEOUT_S in the soak (default 3)")
    add("--soak-heartbeat-timeout-s", type=float, default=10.0, help="SWARM_HEARTBEAT_TIMEOUT_S (default 10)")
    add("--soak-freeze-max-s", type=float, default=6.0, help="soak freezes last 2 s to this (default 6)")
    add("--churn-min-s", type=float, default=3.0, help="least wait between churn events (default 3)")
    add("--churn-max-s", type=float, default=8.0, help="most wait between churn events (default 8)")
    add("--seed", type=int, default=20240601, help="seeds every random choice (default 20240601)")
    add("--threads", type=int, default=1, help="torch threads of each agent and coordinator (default 1)")
    add("--nospare-kills", type=int, default=3, help="no-spare kill trials per model and topology (default 3)")
    add("--nospare-freezes", type=int, default=3, help="no-spare freeze trials per model and topology (default 3)")
    add(
        "--nospare-models",
        type=names(NOSPARE_CAPS),
        default=list(NOSPARE_CAPS),
        help="models of the no-spare trials (default tiny-llama,smollm2-135m)",
    )
    add(
        "--nospare-topologies",
        type=names(("ring", "star")),
        default=["ring", "star"],
        help="SWARM_TOPOLOGY of the no-spare trials, a control plane each (default ring,star)",
    )
    add("--nospare-rtt-ms", type=float, default=30.0, help="no-spare agents' emulated round trip (default 30)")
    add("--skip-soak", action="store_true", help="kill and freeze trials only")
    add("--only", choices=PARTS, help="run this part alone: trials (kill/freeze on spares), nospare or soak")
    add("--quick", action="store_true", help="smoke run: a few trials per part, a 30 s soak with 10 streams")
    add("--output", type=Path, default=RESULTS, help="default bench/results/churn.json")
    add("--soak-child", action="store_true", help=argparse.SUPPRESS)
    add("--nospare-child", action="store_true", help=argparse.SUPPRESS)
    add("--part-output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:  # smaller counts, where the command line left the defaults
        for name, value in QUICK.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    return args


def main() -> int:
    args = parse_args()
    # SIGTERM unwinds like Ctrl-C, so that every finally runs and stops the processes it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.soak_child:
        return soak_child(args)
    if args.nospare_child:
        return nospare_child(args)
    import torch

    torch.set_num_threads(args.threads)
    started = time.monotonic()
    info = machine(args.threads)
    print(
        f"machine: {info['cpu']}, {info['cpu_count']} CPUs, torch {info['torch']}, load average "
        f"{info['load_average_at_start']}",
        file=sys.stderr,
        flush=True,
    )
    parts: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-churn-") as tmp:
        for model, kills, freezes in (
            ("tiny-llama", args.kill_tiny, args.freeze_tiny),
            ("smollm2-135m", args.kill_smollm2, args.freeze_smollm2),
        ):
            if kills + freezes == 0 or args.only not in (None, "trials"):
                continue
            part = run_trials(model, kills, freezes, args, Path(tmp))
            # The stall timeout in effect for a one-token decode step: the setting plus the
            # coordinator's allowance per token row of the step (pipeline.STALL_PER_ROW_S).
            from worker_agent.coordinator.pipeline import STALL_PER_ROW_S

            part["kill_summary"] = trial_summary(part.get("kill", []), args.kill_stall_s + STALL_PER_ROW_S)
            part["freeze_summary"] = trial_summary(part.get("freeze", []), args.stall_s + STALL_PER_ROW_S, relayed=True)
            parts[model] = part
    trials_s = round(time.monotonic() - started, 1)
    nospare = run_nospare(args) if args.only in (None, "nospare") else {}
    nospare_s = round(time.monotonic() - started - trials_s, 1)
    soak = None
    if args.only in (None, "soak"):
        soak = {"error": "skipped (--skip-soak)"} if args.skip_soak else spawn_soak(args)
    print_table(info, args, parts, nospare, soak)
    elapsed = round(time.monotonic() - started, 1)
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report = {
        "benchmark": "churn",
        "command": " ".join(["python", "bench/churn.py", *sys.argv[1:]]),
        "machine": info,
        "settings": {k: v for k, v in vars(args).items() if k not in ("part_output", "output")},
        "conditions": {
            "trials": "LocalSwarm `swarm-worker serve` agents on loopback, ring topology, greedy; the coordinator "
            "in the benchmark's process with a SpareHealer over the warm spares; a killed or retired agent is "
            "replaced by a fresh agent for its span, started (together with others) before a trial that would "
            "find a span without a spare, never during one",
            "pause": "token_times[t] - token_times[t-1]: the first token after the failure - the last before it",
            "re_prefill": "time to first token (OPEN, one pass, first token; connecting not counted) of a request "
            "whose prompt is the prompt + the t committed tokens, on the healed route after the trial",
            "check": "pause p95 <= stall timeout + 2 x re-prefill p95, the stall timeout in effect for a "
            "one-token step (--kill-stall-s or --stall-s, + pipeline.STALL_PER_ROW_S; twice that for a frozen "
            "ring stage past the first, which is first handed its predecessor's output); a kill is seen as a lost "
            "connection long before its stall timeout, so its rows also carry after_detect_check: "
            "(pause - detection) p95 <= 2 x re-prefill p95, the heal's own time with no allowance",
            "soak": "embedded control plane (SQLite, in-memory channel layer, coordinators in the web process) in "
            "a child process; `swarm-worker join` agents capped at 2 layers; churn events one at a time, each "
            "followed by a wait until the model is servable with every live assignment loaded",
            "soak_model_why": "tiny-llama: a 2-core machine cannot run 50 concurrent streams of a real model while "
            "agents start and stop; the soak tests the control plane's healing, routing and money under churn",
            "default_counts": "kill 100 tiny-llama + 10 smollm2-135m; freeze 20 + 3 (each freeze waits the stall "
            "timeout, up to twice, and retires an agent whose replacement costs seconds of CPU, so 100 + 10 freezes "
            "would not fit a ~15 minute run on 2 cores)",
            "soak_client_backoff_s": FAILURE_BACKOFF_S,
            "nospare": "embedded control plane (SQLite, coordinators in the web process, the periodic sweep every "
            "0.5 s) in a child process per model and topology; five `swarm-worker join` agents capped so that the "
            "model splits into three spans, SWARM_SPARES_PER_PIPELINE=2: three stages and two warm spares of two "
            "spans; each agent's outgoing data-plane frames held back for the emulated round trip; the node of the "
            "block whose span no other block holds is SIGKILLed (then a fresh node joins) or SIGSTOPped (SIGCONT "
            "once the request is over) right after the client received chunk t; the next trial waits until every "
            "killed node is offline and five ready blocks on nodes in good standing hold one span once and the two "
            "others twice (placement_before: as placed, 3 stages + 2 spares, or 2 + 3 where a heal took an idle "
            "pipeline member and nothing re-placed the model since)",
            "nospare_pause": "the longest gap between two chunks from the last chunk before the signal on",
            "nospare_detection": "the heal's detected_at (the coordinator reported the failure) - the last chunk "
            "before the signal",
            "nospare_load": "the block of the failed span on the heal's replacement node: ready_at - created_at; 0 "
            "where the replacement held the span already",
            "nospare_re_prefill": "time to first token, through the API, of the prompt followed by the text "
            "streamed before the failure (admission and connecting included: an over-estimate of the pass the "
            "heal re-ran)",
            "nospare_check": "pause p95 <= detection p95 + load p95 + 2 x re-prefill p95",
            "nospare_to_route": "the heal's at (the new route) - its detected_at: the control plane's part of the "
            "heal, the load included",
        },
        "parts": parts,
        "trials_s": trials_s,
        "nospare": nospare,
        "nospare_s": nospare_s,
        "soak": soak,
        "elapsed_s": elapsed,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.output, report)
    print(f"\nwrote {args.output} in {elapsed} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
