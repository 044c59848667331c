"""Make before break at the agent: re-placed onto another span, an agent keeps serving its old block
for the jobs in flight while it loads the new one, both on one data-plane port; a release stops new
jobs on the old block (after taking, for ``late_jobs_s``, the jobs routed to it just before the
release) and unloads it once its jobs end. With a layer cap too small for both, it drains the old
block first. Told to stop (SIGTERM), an agent first tells the control plane and takes jobs until it
answers, then takes no new job and closes once its jobs in flight end; told twice, at once.

The agent runs in the test's event loop with its control channel stood in for (the control plane's
messages are fed to it, its answers recorded); the data plane is real: stage servers and coordinators
on loopback sockets, tiny-llama split 0:3 | 3:6, greedy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator

import pytest
from nacl.signing import SigningKey

from tests.wire_client import raw_client
from worker_agent import model as models
from worker_agent.agent.control import DRAIN_TIMEOUT_S, EXPECTED_JOBS_S, Agent, JoinState
from worker_agent.block import Block
from worker_agent.coordinator.job import Coordinator, GenerationResult
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.errors import StageError
from worker_agent.protocol import control_protocol as protocol
from worker_agent.protocol import wire
from worker_agent.protocol.keys import generate_signing_key, node_id, public_key_bytes
from worker_agent.protocol.span import Span
from worker_agent.protocol.tickets import issue_ticket
from worker_agent.server import StageServer
from worker_agent.stage import Stage

pytestmark = pytest.mark.dataplane

MODEL = "tiny-llama"
PROMPT = "The quick brown fox"
MAX_TOKENS = 12
DEADLINE_S = 60.0
UNTIMED_DRAIN_S = 0.2  # a released block's wait for a job without a ticket, in the test that passes it


class RecordingChannel:
    """Stands in for the control channel's WebSocket: keeps what the agent sends."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def send(self, text: str) -> None:
        self.sent.append(json.loads(text))

    def answered(self, assignment: int) -> dict | None:
        return next((m for m in self.sent if m.get("assignment") == assignment), None)


async def until(condition, what: str, timeout: float = DEADLINE_S):
    """Poll ``condition`` on the event loop until it is truthy (returned), or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Swarm:
    """An agent under test, plain stage servers for the rest of the route, and the ticket issuer."""

    def __init__(
        self,
        max_layers: int | None,
        late_jobs_s: float,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        expected_jobs_s: float = EXPECTED_JOBS_S,
    ) -> None:
        self.issuer = generate_signing_key()
        key = generate_signing_key()
        self.node = node_id(public_key_bytes(key))
        self.port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}"
        state = JoinState("http://control.test", self.node, "ws://control.test/ws/agent/", 5.0)
        self.agent = Agent(
            key,
            state,
            host="127.0.0.1",
            port=self.port,
            advertise_url=self.url,
            max_layers=max_layers,
            late_jobs_s=late_jobs_s,
            drain_timeout_s=drain_timeout_s,
            expected_jobs_s=expected_jobs_s,
        )
        self.agent.trusted_key = public_key_bytes(self.issuer)
        self.channel = RecordingChannel()
        self.plain: dict[tuple[int, int], tuple[str, Stage]] = {}
        self.coordinator_keys: dict[str, SigningKey] = {}  # job -> its coordinator key

    def coordinator_key(self, job: str) -> SigningKey:
        return self.coordinator_keys.setdefault(job, SigningKey.generate())

    def ticket(self, job: str, node: str, span: tuple[int, int]) -> bytes:
        return issue_ticket(
            self.issuer,
            job=job,
            node=node,
            model=MODEL,
            layer_start=span[0],
            layer_end=span[1],
            coordinator_key=bytes(self.coordinator_key(job).verify_key),
        )

    def spec(self, job: str, span: tuple[int, int], *, on_agent: bool) -> StageSpec:
        if on_agent:
            return StageSpec(self.url, self.ticket(job, self.node, span))
        url, stage = self.plain[span]
        return StageSpec(url, self.ticket(job, stage.node, span))

    def coordinator(self, job: str, *, agent_spans: set[tuple[int, int]]) -> Coordinator:
        specs = [self.spec(job, span, on_agent=span in agent_spans) for span in ((0, 3), (3, 6))]
        return Coordinator(MODEL, specs, job=job, coordinator_key=self.coordinator_key(job))

    async def assign(self, assignment: int, span: tuple[int, int]) -> None:
        message = protocol.Assign(assignment=assignment, model=MODEL, layer_start=span[0], layer_end=span[1])
        await self.agent._on_message(self.channel, message)

    async def hello(self, job: str, span: tuple[int, int]) -> wire.Message:
        async with raw_client(self.url) as client:
            return await client.hello(job, self.ticket(job, self.node, span), key=self.coordinator_key(job))

    def spans_held(self) -> list[tuple[int, int]]:
        return [(b.stage.layer_start, b.stage.layer_end) for b in self.agent.blocks.values()]


@contextlib.asynccontextmanager
async def swarm(
    max_layers: int | None = None,
    late_jobs_s: float = 0.0,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
    expected_jobs_s: float = EXPECTED_JOBS_S,
) -> AsyncIterator[Swarm]:
    """The agent holding 0:3 as assignment 1 (ready), and plain stages for 0:3 and 3:6. A block it
    lets go takes late jobs for ``late_jobs_s`` (none by default: each test says what it needs), and
    waits ``drain_timeout_s`` for a job in flight without a ticket."""
    s = Swarm(max_layers, late_jobs_s, drain_timeout_s, expected_jobs_s)
    tasks = []
    for span in ((0, 3), (3, 6)):
        stage = Stage(
            Block(models.load_block(MODEL, *span)),
            model=MODEL,
            signing_key=generate_signing_key(),
            trusted_keys=[public_key_bytes(s.issuer)],
        )
        bound = asyncio.get_running_loop().create_future()
        tasks.append(asyncio.create_task(StageServer(stage).serve("127.0.0.1", 0, ready=bound.set_result)))
        s.plain[span] = (f"ws://127.0.0.1:{await asyncio.wait_for(bound, 30)}", stage)
    await s.assign(1, (0, 3))
    assert await until(lambda: s.channel.answered(1), "the first block to load") == {
        "type": "ready",
        "assignment": 1,
        "url": s.url,
    }
    try:
        yield s
    finally:
        s.agent.hurry.set()  # a block still taking late jobs lets them go
        await s.agent._stop_serving()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *s.agent._tasks, return_exceptions=True)


async def unbroken_run(s: Swarm) -> list[int]:
    """The reference: the same request on the plain stages alone."""
    async with s.coordinator("job-reference", agent_spans=set()) as coordinator:
        return (await coordinator.generate(coordinator.request(PROMPT, max_tokens=MAX_TOKENS))).token_ids


async def finish(stream) -> GenerationResult:
    async for event in stream:
        if isinstance(event, GenerationResult):
            return event
    raise AssertionError("the stream ended without a result")


def test_a_stream_on_the_old_block_runs_to_its_end_while_the_new_block_loads_and_serves():
    async def scenario() -> None:
        async with swarm() as s:
            reference = await unbroken_run(s)
            async with s.coordinator("job-old", agent_spans={(0, 3)}) as old:
                stream = old.stream(old.request(PROMPT, max_tokens=MAX_TOKENS))
                first = await anext(stream)  # the old block's session is open, mid-generation
                assert first.token_id is not None

                # Re-placed onto 3:6: the new block loads beside the old one, on the same port.
                await s.assign(2, (3, 6))
                assert await until(lambda: s.channel.answered(2), "the new block to be ready") == {
                    "type": "ready",
                    "assignment": 2,
                    "url": s.url,
                }
                assert s.spans_held() == [(0, 3), (3, 6)]
                assert s.agent.serving.assignment == 2
                async with raw_client(s.url) as client:
                    pong = await client.ping(7)
                assert (pong.info["layer_start"], pong.info["layer_end"]) == (3, 6)

                # New jobs are served on the new block, and (until released) on the old one too.
                async with s.coordinator("job-new", agent_spans={(3, 6)}) as new:
                    served = await new.generate(new.request(PROMPT, max_tokens=MAX_TOKENS))
                assert served.token_ids == reference
                assert len(served.receipts) == 2
                hello = await s.hello("job-probe", (0, 3))
                assert isinstance(hello, wire.Hello)
                assert (hello.info["layer_start"], hello.info["layer_end"]) == (0, 3)

                # Released: no new job on the old block, but it stays for the stream in flight.
                await s.agent._on_message(s.channel, protocol.Release(assignment=1, model=MODEL))
                refused = await s.hello("job-late", (0, 3))
                assert isinstance(refused, wire.Error)
                assert refused.code == "stage_draining"
                assert s.spans_held() == [(0, 3), (3, 6)]

                result = await finish(stream)
                assert result.token_ids == reference
                assert result.verification is not None
                assert result.verification.steps == result.steps
            # The job ended: the old block goes.
            await until(lambda: s.spans_held() == [(3, 6)], "the released block to unload")
            hello = await s.hello("job-after", (3, 6))
            assert isinstance(hello, wire.Hello)
            gone = await s.hello("job-gone", (0, 3))
            assert isinstance(gone, wire.Error)
            assert gone.code == "ticket_mismatch"
            assert [m["type"] for m in s.channel.sent] == ["ready", "ready"]

    asyncio.run(scenario())


def test_with_no_room_for_both_blocks_the_agent_drains_the_old_one_before_it_loads_the_new_one():
    async def scenario() -> None:
        async with swarm(max_layers=4) as s:
            reference = await unbroken_run(s)
            async with s.coordinator("job-old", agent_spans={(0, 3)}) as old:
                stream = old.stream(old.request(PROMPT, max_tokens=MAX_TOKENS))
                await anext(stream)

                await s.assign(2, (3, 6))  # 3 + 3 layers > the cap of 4
                # The old block takes no new job, and the new one waits for it to drain.
                await until(lambda: not s.agent.server.slots[Span(MODEL, 0, 3)].accepting, "the old block to retire")
                refused = await s.hello("job-late", (0, 3))
                assert isinstance(refused, wire.Error)
                assert refused.code == "stage_draining"
                assert s.channel.answered(2) is None
                assert s.spans_held() == [(0, 3)]

                result = await finish(stream)
                assert result.token_ids == reference
            assert await until(lambda: s.channel.answered(2), "the new block to be ready") == {
                "type": "ready",
                "assignment": 2,
                "url": s.url,
            }
            assert s.spans_held() == [(3, 6)]
            async with s.coordinator("job-new", agent_spans={(3, 6)}) as new:
                served = await new.generate(new.request(PROMPT, max_tokens=MAX_TOKENS))
            assert served.token_ids == reference
            # The control plane's release of the old block, once the new one was ready, changes nothing.
            await s.agent._on_message(s.channel, protocol.Release(assignment=1, model=MODEL))
            assert s.spans_held() == [(3, 6)]

    asyncio.run(scenario())


def test_an_assignment_sent_again_after_a_reconnect_is_answered_ready_without_a_reload():
    async def scenario() -> None:
        async with swarm() as s:
            stage = s.agent.blocks[1].stage

            await s.assign(1, (0, 3))

            await until(lambda: len(s.channel.sent) == 2, "the answer to the assignment sent again")
            assert s.channel.sent == [{"type": "ready", "assignment": 1, "url": s.url}] * 2
            assert s.agent.blocks[1].stage is stage
            assert s.agent.blocks[1].unloading is None

    asyncio.run(scenario())


def test_a_stopping_agent_takes_no_new_job_and_closes_only_once_its_jobs_in_flight_end():
    async def scenario() -> None:
        async with swarm() as s:
            reference = await unbroken_run(s)
            async with s.coordinator("job-in-flight", agent_spans={(0, 3)}) as old:
                stream = old.stream(old.request(PROMPT, max_tokens=MAX_TOKENS))
                await anext(stream)

                s.agent.stop()  # SIGTERM
                stopping = asyncio.create_task(s.agent.shut_down())
                await until(lambda: not s.agent.server.slots[Span(MODEL, 0, 3)].accepting, "the block to retire")
                refused = await s.hello("job-late", (0, 3))
                assert isinstance(refused, wire.Error)
                assert refused.code == "stage_draining"
                assert not stopping.done()

                result = await finish(stream)
                assert result.token_ids == reference
                assert result.verification is not None  # the stopping stage signed its receipt
            await asyncio.wait_for(stopping, DEADLINE_S)  # the job ended: the agent closes
            assert s.agent.server is None
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", s.port)

    asyncio.run(scenario())


def test_a_second_stop_closes_the_agent_at_once_with_jobs_in_flight():
    async def scenario() -> None:
        async with swarm() as s, s.coordinator("job-in-flight", agent_spans={(0, 3)}) as old:
            stream = old.stream(old.request(PROMPT, max_tokens=MAX_TOKENS))
            await anext(stream)
            s.agent.stop()
            stopping = asyncio.create_task(s.agent.shut_down())
            await until(lambda: not s.agent.server.slots[Span(MODEL, 0, 3)].accepting, "the block to retire")
            s.agent.stop()  # a second Ctrl-C
            await asyncio.wait_for(stopping, DEADLINE_S)
            assert s.agent.server is None
            with pytest.raises(StageError):  # the cut stage fails the request (no healer here)
                await finish(stream)

    asyncio.run(scenario())


def test_a_released_block_serves_its_job_in_flight_past_the_untimed_drain_bound_to_its_end():
    async def scenario() -> None:
        async with swarm(drain_timeout_s=UNTIMED_DRAIN_S) as s:
            reference = await unbroken_run(s)
            async with s.coordinator("job-in-flight", agent_spans={(0, 3)}) as old:
                stream = old.stream(old.request(PROMPT, max_tokens=MAX_TOKENS))
                first = await anext(stream)  # its session is open on the block, mid-generation
                assert first.token_id is not None

                await s.agent._on_message(s.channel, protocol.Release(assignment=1, model=MODEL))
                unloading = await until(lambda: s.agent.blocks[1].unloading, "the release to start draining")
                # Far past the bound for a job without a ticket, the block still waits for this one,
                # whose ticket runs for minutes: the job was routed here before the release.
                done, _ = await asyncio.wait({unloading}, timeout=10 * UNTIMED_DRAIN_S)
                assert not done
                assert s.spans_held() == [(0, 3)]

                result = await finish(stream)
                assert result.token_ids == reference
                assert result.verification is not None
            await until(lambda: s.spans_held() == [], "the released block to unload once its job ended")
            assert unloading.done()

    asyncio.run(scenario())


def test_a_released_block_still_takes_a_job_routed_to_it_just_before_the_release():
    async def scenario() -> None:
        async with swarm(late_jobs_s=DEADLINE_S) as s:
            # The control plane released the block (routing stopped) a moment before this job's
            # coordinator, routed there just before, says HELLO.
            await s.agent._on_message(s.channel, protocol.Release(assignment=1, model=MODEL))
            hello = await s.hello("job-routed-before-the-release", (0, 3))

            assert isinstance(hello, wire.Hello)
            assert (hello.info["layer_start"], hello.info["layer_end"]) == (0, 3)
            assert s.agent.blocks[1].unloading is not None

    asyncio.run(scenario())


def test_a_released_block_takes_the_jobs_its_release_names_however_late_and_no_other():
    async def scenario() -> None:
        async with swarm() as s:  # no window for late jobs: only the release's list lets a job in
            # Routed to the block before its release, this job's coordinator comes only afterwards.
            release = protocol.Release(assignment=1, model=MODEL, jobs=("job-routed-before",))
            await s.agent._on_message(s.channel, release)
            await until(lambda: not s.agent.server.slots[Span(MODEL, 0, 3)].accepting, "the block to retire")

            refused = await s.hello("job-routed-after", (0, 3))
            assert isinstance(refused, wire.Error)
            assert refused.code == "stage_draining"
            assert s.spans_held() == [(0, 3)]  # still waiting for the job it named
            assert not s.agent.blocks[1].unloading.done()

            hello = await s.hello("job-routed-before", (0, 3))
            assert isinstance(hello, wire.Hello)
            assert (hello.info["layer_start"], hello.info["layer_end"]) == (0, 3)

    asyncio.run(scenario())


def test_a_block_drained_for_the_cap_takes_the_jobs_its_successors_assignment_names():
    async def scenario() -> None:
        async with swarm(max_layers=4) as s:
            # The control plane moved this node from 0:3 to 3:6 (nothing new is routed to 0:3); a
            # job it routed to 0:3 just before comes after the assignment, which names it.
            move = protocol.Assign(
                assignment=2, model=MODEL, layer_start=3, layer_end=6, supersedes=1, jobs=("job-routed-before",)
            )
            loading = asyncio.create_task(s.agent._on_message(s.channel, move))  # 3 + 3 layers > the cap of 4
            await until(lambda: not s.agent.server.slots[Span(MODEL, 0, 3)].accepting, "the old block to retire")

            refused = await s.hello("job-routed-after", (0, 3))
            assert isinstance(refused, wire.Error)
            assert refused.code == "stage_draining"
            hello = await s.hello("job-routed-before", (0, 3))
            assert isinstance(hello, wire.Hello)
            assert s.channel.answered(2) is None  # the new block waits for the old one's jobs
            loading.cancel()

    asyncio.run(scenario())


def test_a_released_block_waits_for_a_named_job_only_so_long():
    async def scenario() -> None:
        async with swarm(expected_jobs_s=0.5) as s:
            release = protocol.Release(assignment=1, model=MODEL, jobs=("job-that-never-comes",))
            await s.agent._on_message(s.channel, release)
            await until(lambda: s.spans_held() == [], "the block to unload without the job that never came")
            assert s.agent.server is None

    asyncio.run(scenario())


def test_a_stopping_agent_tells_the_control_plane_first_and_takes_jobs_until_it_answers():
    async def scenario() -> None:
        async with swarm() as s:
            reference = await unbroken_run(s)
            s.agent.stop()  # SIGTERM
            beating = asyncio.create_task(s.agent._heartbeats(s.channel, DEADLINE_S))
            await until(lambda: any(m["type"] == "heartbeat" for m in s.channel.sent), "a heartbeat")
            beating.cancel()
            assert [m["load"]["state"] for m in s.channel.sent if m["type"] == "heartbeat"] == [protocol.LEAVING]

            leaving = asyncio.create_task(s.agent._announce_leaving(s.channel))
            leave = protocol.to_wire(protocol.Heartbeat(load=protocol.Load(state=protocol.LEAVING)))
            await until(lambda: s.channel.sent[-1] == leave, "the stop to be announced")
            # Until the control plane answers it may still route a job here: it is taken and served.
            async with s.coordinator("job-routed-before-the-answer", agent_spans={(0, 3)}) as late:
                stream = late.stream(late.request(PROMPT, max_tokens=MAX_TOKENS))
                await anext(stream)
                assert not leaving.done()

                await s.agent._on_message(s.channel, protocol.Drain())  # nothing new is routed here now
                await asyncio.wait_for(leaving, DEADLINE_S)
                stopping = asyncio.create_task(s.agent.shut_down())
                await until(lambda: not s.agent.server.slots[Span(MODEL, 0, 3)].accepting, "the block to retire")
                refused = await s.hello("job-after-the-answer", (0, 3))
                assert isinstance(refused, wire.Error)
                assert refused.code == "stage_draining"

                result = await finish(stream)
                assert result.token_ids == reference
            await asyncio.wait_for(stopping, DEADLINE_S)
            assert s.agent.server is None

    asyncio.run(scenario())
