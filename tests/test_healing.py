"""Mid-request healing on real agent processes: a stage SIGKILLed or SIGSTOPped mid-stream is
replaced by a warm spare holding its span, the prompt and committed tokens are re-prefilled on the
healed route, and the output goes on exactly as an unbroken run's; its receipts verify against
the healed route. Without a spare the request ends with a clear error.

One swarm of tiny-llama agents serves the module: three on the route and three spares per span.
Every trial kills or freezes one agent of the current route; the spare that replaces it becomes
part of the route for the next trial.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid

import pytest

from worker_agent.coordinator.heal import SpareHealer
from worker_agent.coordinator.job import Coordinator, GenerationResult
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.coordinator.sampling import SamplingParams
from worker_agent.coordinator.speculation import SpeculationSettings
from worker_agent.dev.local import LocalSwarm, even_spans
from worker_agent.errors import StageError

pytestmark = pytest.mark.dataplane

MODEL = "tiny-llama"
SPANS = even_spans(6, 3)
PROMPT = "The swarm keeps serving while its nodes come and go"
MAX_TOKENS = 16
STALL_S = 1.5


class Swarm:
    """The module's agents: the current route (one per span, in order) and the unused spares."""

    def __init__(self, local: LocalSwarm) -> None:
        self.local = local
        self.route = list(local.agents[: len(SPANS)])
        self.spares = list(local.agents[len(SPANS) :])

    def specs(self, job: str) -> list[StageSpec]:
        return [StageSpec(agent.url, self.local.ticket(job, agent)) for agent in self.route]

    def healer(self, job: str, spans: list[int] | None = None) -> SpareHealer:
        """A healer offering the unused spares (of the given route positions' spans only, if any)."""
        wanted = None if spans is None else {SPANS[i] for i in spans}
        urls = [a.url for a in self.spares if wanted is None or (a.layer_start, a.layer_end) in wanted]
        return SpareHealer(urls, ticket=lambda info: self.local.ticket(job, info))

    def coordinator(
        self,
        job: str,
        healer: SpareHealer,
        topology: str = "ring",
        speculation: SpeculationSettings | None = None,
        stall_timeout_s: float = STALL_S,
    ) -> Coordinator:
        """A coordinator for ``job`` on the current route, healing with ``healer``."""
        return Coordinator(
            MODEL,
            self.specs(job),
            job=job,
            topology=topology,
            healer=healer,
            stall_timeout_s=stall_timeout_s,
            coordinator_key=self.local.coordinator_key(job),
            speculation=speculation,
        )

    def replaced(self, position: int, result: GenerationResult) -> None:
        """Bring the route up to date after a heal at ``position``: the spare whose node signed the
        receipt for that span is now the route's."""
        node = next(r.node for r in result.receipts if (r.layer_start, r.layer_end) == SPANS[position])
        spare = next(a for a in self.spares if a.node == node)
        self.spares.remove(spare)
        self.route[position] = spare


@pytest.fixture(scope="module")
def swarm():
    # The route, then three spares per span, and seven more for the middle span: the known-spare test
    # uses three, the speculative heals two, the frozen stages found by their PING two.
    spans = SPANS * 4 + [SPANS[1]] * 7
    with LocalSwarm(MODEL, spans, threads=1) as local:
        yield Swarm(local)


async def _run(coordinator: Coordinator, request, on_token=None) -> GenerationResult:
    result, count = None, 0
    async for event in coordinator.stream(request):
        if isinstance(event, GenerationResult):
            result = event
        elif event.token_id is not None:
            count += 1
            if on_token is not None:
                on_token(count)
    assert result is not None
    return result


def reference(swarm: Swarm, sampling: SamplingParams | None = None) -> list[int]:
    """The tokens of an unbroken run on the current route."""

    async def main():
        job = f"job-reference-{uuid.uuid4().hex[:8]}"
        async with Coordinator(
            MODEL, swarm.specs(job), job=job, coordinator_key=swarm.local.coordinator_key(job)
        ) as coordinator:
            request = coordinator.request(PROMPT, max_tokens=MAX_TOKENS, sampling=sampling)
            return (await _run(coordinator, request)).token_ids

    return asyncio.run(main())


def broken_run(
    swarm: Swarm,
    job: str,
    *,
    topology: str,
    victims: dict[int, int],
    freeze: bool = False,
    sampling=None,
    speculation: SpeculationSettings | None = None,
    stall_timeout_s: float = STALL_S,
) -> GenerationResult:
    """Generate with the agent at route position p SIGKILLed (or SIGSTOPped, resumed afterwards)
    right after the client received token t, for each {t: p} in ``victims``."""
    frozen = []

    def on_token(count: int) -> None:
        position = victims.get(count)
        if position is None:
            return
        process = swarm.route[position].process
        if freeze:
            process.send_signal(signal.SIGSTOP)
            frozen.append(process)
        else:
            process.kill()
            process.wait()

    async def main():
        async with swarm.coordinator(job, swarm.healer(job), topology, speculation, stall_timeout_s) as coordinator:
            request = coordinator.request(PROMPT, max_tokens=MAX_TOKENS, sampling=sampling)
            return await _run(coordinator, request, on_token)

    try:
        return asyncio.run(main())
    finally:
        for process in frozen:
            process.send_signal(signal.SIGCONT)


def _check_healed(swarm: Swarm, result: GenerationResult, expected: list[int], positions: list[int]) -> None:
    assert result.token_ids == expected
    assert result.finish_reason == "length"
    assert [heal.stage for heal in result.heals] == positions
    assert all(heal.resumed is not None and heal.resumed > heal.detected for heal in result.heals)
    # Verified against the healed route: every span signed once, by the spares that took over.
    assert result.verification is not None and result.verification.sessions == 1
    assert [(r.layer_start, r.layer_end) for r in result.receipts] == SPANS
    dead = {heal.node for heal in result.heals}
    assert not dead & {r.node for r in result.receipts}
    # The healed session's first step re-ran the prompt and every token committed before the heal.
    assert all(r.tokens == result.prompt_tokens + len(expected) - 1 for r in result.receipts)


@pytest.mark.parametrize(("topology", "position"), [("ring", 0), ("ring", 1), ("ring", 2), ("star", 2)])
def test_a_killed_stage_is_healed_at_every_position(swarm, topology, position):
    expected = reference(swarm)

    result = broken_run(swarm, f"job-kill-{topology}-{position}", topology=topology, victims={5: position})

    _check_healed(swarm, result, expected, [position])
    assert result.heals[0].code in {"stage_lost", "next_unreachable"}
    swarm.replaced(position, result)


def test_a_frozen_stage_is_healed_after_the_stall_timeout(swarm):
    expected = reference(swarm)

    result = broken_run(swarm, "job-freeze", topology="ring", victims={4: 0}, freeze=True)

    _check_healed(swarm, result, expected, [0])
    assert result.heals[0].code == "stage_stalled"
    pause = result.heals[0].resumed - result.token_times[3]
    assert pause >= STALL_S  # it waited the stall timeout, no less; how long past it is not asserted
    swarm.replaced(0, result)


@pytest.mark.parametrize("topology", ["ring", "star"])
def test_a_frozen_stage_is_found_by_its_unanswered_ping_long_before_a_long_stall_timeout(swarm, topology):
    expected = reference(swarm)
    long_stall_s = 120.0

    result = broken_run(
        swarm, f"job-frozen-{topology}", topology=topology, victims={4: 1}, freeze=True, stall_timeout_s=long_stall_s
    )

    _check_healed(swarm, result, expected, [1])
    assert result.heals[0].code == "stage_stalled"
    assert "did not answer PING" in result.heals[0].message  # found by its silence, not by the timeout
    assert result.heals[0].detected - result.token_times[3] < long_stall_s / 2
    swarm.replaced(1, result)


def test_seeded_sampling_goes_on_from_the_same_generator_state(swarm):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    expected = reference(swarm, sampling)

    result = broken_run(swarm, "job-seeded", topology="ring", victims={6: 2}, sampling=sampling)

    _check_healed(swarm, result, expected, [2])
    swarm.replaced(2, result)


@pytest.mark.parametrize("topology", ["ring", "star"])
def test_a_speculating_request_heals_and_goes_on_token_identical(swarm, topology):
    expected = reference(swarm)
    # tiny-llama drafting for itself: every chunk is accepted, so chunks are in flight at the kill.
    speculation = SpeculationSettings(drafter="draft", draft_model=MODEL, k=3, depth=2)

    result = broken_run(swarm, f"job-spec-kill-{topology}", topology=topology, victims={6: 1}, speculation=speculation)

    assert result.token_ids == expected
    assert [heal.stage for heal in result.heals] == [1]
    assert result.drafted > 0 and result.accepted == result.drafted
    assert result.verification is not None and result.verification.sessions == 1
    assert [(r.layer_start, r.layer_end) for r in result.receipts] == SPANS
    assert not {heal.node for heal in result.heals} & {r.node for r in result.receipts}
    swarm.replaced(1, result)


def test_two_failures_in_one_request(swarm):
    expected = reference(swarm)

    result = broken_run(swarm, "job-twice", topology="ring", victims={3: 0, 9: 1})

    _check_healed(swarm, result, expected, [0, 1])
    swarm.replaced(0, result)
    swarm.replaced(1, result)


def test_without_a_spare_the_request_ends_with_a_clear_error(swarm):
    job = "job-no-spare"
    position = 1  # the healer offers no spare at all
    seen = []

    async def main():
        async with swarm.coordinator(job, swarm.healer(job, spans=[])) as coordinator:
            request = coordinator.request(PROMPT, max_tokens=MAX_TOKENS)
            await _run(coordinator, request, lambda count: seen.append(count) or (count == 4 and kill()))

    def kill():
        swarm.route[position].process.kill()
        swarm.route[position].process.wait()

    with pytest.raises(StageError) as raised:
        asyncio.run(main())
    assert raised.value.code in {"stage_lost", "next_unreachable"}
    assert f"no replacement for stage {position}" in str(raised.value)
    assert seen == [1, 2, 3, 4]  # what was delivered before the failure stays delivered


def test_the_cli_heals_onto_a_spare(swarm):
    """``swarm-coordinator generate --spare URL`` heals the same way (the agent is killed before
    the run, unless an earlier test left it dead: its connection is refused, and the spare takes
    its span before the first token)."""
    position = 1
    spare = next(a for a in swarm.spares if (a.layer_start, a.layer_end) == SPANS[position])
    victim = swarm.route[position]
    victim.process.kill()
    victim.process.wait()
    route = [a.url for a in swarm.route]
    command = [
        sys.executable,
        "-m",
        "worker_agent.coordinator.cli",
        "generate",
        "--model",
        MODEL,
        "--stages",
        ",".join(route),
        "--spare",
        spare.url,
        "--ticket-key",
        str(swarm.local.workdir / "issuer.key"),
        "--prompt",
        PROMPT,
        "--max-tokens",
        str(MAX_TOKENS),
        "--threads",
        "1",
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(done.stdout)["results"]
    assert result["verified"] is True
    assert spare.node in {r["node"] for r in result["receipts"]}
    assert victim.node not in {r["node"] for r in result["receipts"]}
    swarm.spares.remove(spare)
    swarm.route[position] = spare
    assert result["token_ids"] == reference(swarm)


def test_known_spares_that_died_since_cost_one_attempt_and_the_next_live_one_takes_the_place(swarm):
    """The healer learns its spares' identities once the route is up, so a heal waits no PING
    round. A known spare that died meanwhile fails the healed route's connect; the healer then
    asks the others again instead of trying what it knew of them one by one (a second dead one
    would use up the request's heals), and a live one takes the place in the same heal."""
    position = 1
    expected = reference(swarm)
    job = "job-known-spares-died"
    healer = swarm.healer(job, spans=[position])
    *stale, fresh = [a for a in swarm.spares if a.url in healer.unused][:3]
    victim = swarm.route[position]

    def kill(agent) -> None:
        agent.process.kill()
        agent.process.wait()

    async def main():
        async with swarm.coordinator(job, healer) as coordinator:
            async with asyncio.timeout(30):
                while not {a.url for a in (*stale, fresh)} <= set(healer.known):
                    await asyncio.sleep(0.01)
            for agent in stale:  # known, then gone
                kill(agent)
            request = coordinator.request(PROMPT, max_tokens=MAX_TOKENS)
            return await _run(coordinator, request, lambda count: count == 5 and kill(victim))

    result = asyncio.run(main())

    _check_healed(swarm, result, expected, [position])
    # The first stale spare was taken on what was known of it (a PING at heal time would have
    # skipped it); the second was found dead when the others were asked again.
    assert stale[0].url in healer.given and stale[1].url not in healer.given and fresh.url in healer.given
    assert fresh.node in {r.node for r in result.receipts}
    assert not {a.node for a in stale} & {r.node for r in result.receipts}
    for agent in stale:
        swarm.spares.remove(agent)
    swarm.replaced(position, result)


def test_a_stage_told_to_stop_mid_stream_lets_the_request_finish_then_exits(swarm):
    # Restarting an agent (SIGTERM, as systemd or Ctrl-C does) cuts no request: the stage takes no
    # new job, the ones in flight finish on it, then it exits.
    for position, agent in enumerate(swarm.route):  # earlier trials may have left a dead agent on it
        if agent.process.poll() is not None:
            spare = next(a for a in swarm.spares if (a.layer_start, a.layer_end) == SPANS[position])
            swarm.spares.remove(spare)
            swarm.route[position] = spare
    expected = reference(swarm)
    position = 1
    stopping = swarm.route[position]
    job = "job-stopped-gracefully"

    async def main():
        # No spare: a cut request could not heal.
        async with swarm.coordinator(job, swarm.healer(job, spans=[])) as coordinator:
            request = coordinator.request(PROMPT, max_tokens=MAX_TOKENS)
            return await _run(
                coordinator, request, lambda count: count == 3 and stopping.process.send_signal(signal.SIGTERM)
            )

    result = asyncio.run(main())

    assert result.token_ids == expected
    assert result.heals == []
    assert result.verification is not None  # every stage's receipt, the stopping one's too
    assert stopping.node in {receipt.node for receipt in result.receipts}
    assert stopping.process.wait(timeout=60) == 0  # and then it exited by itself
