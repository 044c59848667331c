"""A heal from any spare, end to end: the stage whose span no warm spare holds is SIGKILLed, then
another is SIGSTOPped, mid-stream, and each request completes with the unbroken run's text.

A live control plane (uvicorn in a thread, the test database, coordinators in process, the periodic
sweep on) places ``smollm2-135m`` (30 layers) over five ``swarm-worker join`` agents capped at 10
layers: one pipeline of three stages (0:10, 10:20, 20:30) and two warm spares, each of another span,
so one span has no spare. Each agent delays its outgoing data-plane frames (an emulated 30 ms round trip) so
that a stream lasts seconds. In ring and in star (``SWARM_TOPOLOGY``):

1. **Kill.** The node serving the span without a spare is SIGKILLed after the fifth token. The
   control plane has a spare of another span load the dead span (make before break: it keeps its
   old block until the new one is ready) and hands it to the waiting coordinator, which re-prefills
   and goes on. Once the dead node is swept offline, the placement is repaired with that block.
2. **Freeze.** Of the spans without a spare then, the serving node is SIGSTOPped after the fifth
   token: the coordinator finds it frozen by its unanswered PING (``pipeline.FREEZE_PROBE_S``), well
   before the stall timeout, and the remaining spare loads its span.

Each request: the text equals the unbroken run's; the job succeeded with its receipts verified on
the healed route; its heal names the failed node, and the replacement is a node that held another
span before. The pause the client saw (the longest gap between two chunks after the signal) is at
most: detection (the last chunk before the failure to the coordinator's report, ``detected_at`` on
the heal) + the span's load (the new block's assignment to its ready report) + 2 x the re-prefill
(measured afterwards as the time to first token of the prompt followed by the text streamed before
the failure, through the same API: an over-estimate, since it includes admission), plus a fixed 1.5 s for
a machine loaded by the rest of the suite; the benchmark checks the bound with no allowance.
"""

from __future__ import annotations

import itertools
import signal
import time
from datetime import datetime

import pytest
from django.test.utils import override_settings
from openai import OpenAI

from marketplace.jobs.models import Job, JobState
from marketplace.nodes.models import Node, NodeState
from marketplace.nodes.tickets import issuer_key
from marketplace.placement.models import Assignment, AssignmentState
from tests.api_fixtures import provider_and_customer, stop_agents
from tests.live import LiveServer, wait_for
from worker_agent.dev.local import join_agent

pytestmark = [pytest.mark.control, pytest.mark.django_db(transaction=True)]

MODEL = "smollm2-135m"
AGENTS = 5
PROMPT = (
    "The lighthouse keeper climbed the spiral stairs as the storm rolled in from the sea, counting the steps "
    "as he always did, and thinking of the ships that would need the light tonight. Once upon a time,"
)
MAX_TOKENS = 40
AT_TOKEN = 5  # the failure comes right after this many chunks reached the client
STALL_TIMEOUT_S = 10.0
LOADED_ALLOWANCE_S = 1.5  # seen needed once: a freeze healed 0.29 s past the bound with the whole suite beside it


def live() -> list[Assignment]:
    return list(
        Assignment.objects.filter(model=MODEL, state__in=[AssignmentState.ASSIGNED, AssignmentState.READY])
        .select_related("node")
        .order_by("pk")
    )


def settled(serving: int, spares: int):
    """The live blocks once the pipeline has ``serving`` ready stages and ``spares`` ready spares."""
    blocks = live()
    ready = [a for a in blocks if a.state == AssignmentState.READY]
    spare_flags = [a.is_spare for a in ready]
    if len(blocks) == len(ready) and (spare_flags.count(False), spare_flags.count(True)) == (serving, spares):
        return blocks
    return None


def unspared(blocks: list[Assignment]) -> Assignment:
    """The first pipeline stage whose span no spare holds."""
    spare_spans = {a.span for a in blocks if a.is_spare}
    return next(a for a in blocks if not a.is_spare and a.span not in spare_spans)


def stream(client: OpenAI, prompt: str, max_tokens: int, on_chunk=None) -> tuple[str, list[float], str]:
    """A streamed greedy completion: its text, each chunk's arrival time, its job id."""
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    text, times, job = "", [], ""
    for chunk in chunks:
        job = chunk.id
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
            times.append(time.time())
            if on_chunk is not None:
                on_chunk(len(times), text)
    return text, times, job


def time_to_first_token(client: OpenAI, prompt: str) -> float:
    started = time.time()
    _, times, _ = stream(client, prompt, 1)
    return times[0] - started


def trial(client: OpenAI, agents: dict[str, object], reference: str, sig: signal.Signals) -> dict:
    """One request with the unspared span's node signalled after AT_TOKEN chunks; its figures."""
    blocks = live()
    victim = unspared(blocks)
    holders_before = {a.node.node_id: a.span for a in blocks}
    process = agents[victim.node.node_id]
    signalled: dict[str, object] = {}

    def on_chunk(count: int, text: str) -> None:
        if count == AT_TOKEN:
            signalled["at"], signalled["text"] = time.time(), text
            process.send_signal(sig)

    text, times, public_id = stream(client, PROMPT, MAX_TOKENS, on_chunk)
    if sig == signal.SIGSTOP:
        process.send_signal(signal.SIGCONT)
    job = Job.objects.get(public_id=public_id)
    assert text == reference
    assert (job.state, job.verified) == (JobState.SUCCEEDED, True)  # receipts verified on the healed route
    assert len(job.heals) == 1, job.heals
    heal = job.heals[0]
    assert heal["failed_node"] == victim.node.node_id
    (replacement,) = [
        s for s in job.route if (s["layer_start"], s["layer_end"]) == (victim.layer_start, victim.layer_end)
    ]
    assert replacement["node"] != victim.node.node_id
    assert holders_before[replacement["node"]] != victim.span  # it held another span before: loaded for this heal
    loaded = Assignment.objects.filter(
        node__node_id=replacement["node"], layer_start=victim.layer_start, layer_end=victim.layer_end
    ).latest("pk")
    assert loaded.supersedes_id is None and loaded.ready_at is not None  # its old block was let go once it was ready

    last_before = max(t for t in times if t <= signalled["at"] + 1e-3)
    pause = max(b - a for a, b in itertools.pairwise(times) if b > signalled["at"])
    detection = datetime.fromisoformat(heal["detected_at"]).timestamp() - last_before
    load = (loaded.ready_at - loaded.created_at).total_seconds()
    reprefill = time_to_first_token(client, PROMPT + signalled["text"])
    figures = {"pause": pause, "detection": detection, "load": load, "reprefill": reprefill}
    # The bound the benchmark holds to with no allowance (bench/churn.py --only nospare); a test shares a
    # loaded machine with the rest of the suite, so the control plane's own steps get LOADED_ALLOWANCE_S.
    assert pause <= detection + load + 2 * reprefill + LOADED_ALLOWANCE_S, figures
    return figures


@pytest.mark.parametrize("topology", ["ring", "star"])
def test_a_span_without_a_spare_heals_from_a_spare_of_another_span_after_a_kill_and_a_freeze(topology, tmp_path):
    overrides = override_settings(
        SWARM_COORDINATOR_LAUNCH="inprocess",
        SWARM_EMBEDDED_SCHEDULER=True,
        SWARM_SWEEP_INTERVAL_S=0.5,
        SWARM_HEARTBEAT_INTERVAL_S=0.5,
        SWARM_HEARTBEAT_TIMEOUT_S=20.0,  # a frozen node is healed around long before it is swept offline
        SWARM_MODELS=[MODEL],
        SWARM_SPARES_PER_PIPELINE=2,
        SWARM_COORDINATOR_REGIONS=["local"],
        SWARM_DEFAULT_PRICES=(0, 0),  # this is about healing, not credits
        SWARM_TICKET_KEY_PATH=tmp_path / "ticket.key",
        SWARM_TOPOLOGY=topology,
        SWARM_STALL_TIMEOUT_S=STALL_TIMEOUT_S,
    )
    overrides.enable()
    issuer_key.cache_clear()
    processes = []
    server = LiveServer().start()
    try:
        tokens, key = provider_and_customer(AGENTS)
        for i, token in enumerate(tokens):
            log = tmp_path / f"agent{i}.log"
            processes.append(
                join_agent(server.url, token, tmp_path / f"a{i}.key", log, model=MODEL, max_layers=10, wan="rtt=30ms")
            )
        wait_for(lambda: Node.objects.filter(state=NodeState.ACTIVE, connected=True).count() == AGENTS, 240, "agents")
        blocks = wait_for(lambda: settled(3, 2), 240, "three stages and two spares ready")
        by_node = {}
        for process, i in zip(processes, range(AGENTS), strict=True):
            node_id = Node.objects.get(name=f"gpu-{i}").node_id
            by_node[node_id] = process
        assert len({a.span for a in blocks if a.is_spare}) == 2  # the two spares hold two spans

        client = OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)
        reference, _, _ = stream(client, PROMPT, MAX_TOKENS)

        killed = trial(client, by_node, reference, signal.SIGKILL)
        # The dead node is swept offline; the block loaded for the heal takes its place in the pipeline.
        wait_for(lambda: settled(3, 1), 120, "the pipeline repaired with the block loaded for the heal")

        frozen = trial(client, by_node, reference, signal.SIGSTOP)
        assert frozen["detection"] < STALL_TIMEOUT_S, frozen  # a frozen stage is found by its silence, not the timeout
        print(f"{topology}: kill {killed}; freeze {frozen}")
    finally:
        server.stop()
        stop_agents(processes)
        overrides.disable()
        issuer_key.cache_clear()
