"""A coordinator job: one pipeline of stages, any number of concurrent generation sessions.

    key = SigningKey.generate()  # the job's coordinator key; each stage's ticket names its public half
    async with Coordinator("smollm2-135m", [StageSpec(url, ticket), ...], coordinator_key=key) as coordinator:
        result = await coordinator.generate(coordinator.request("Hello", chat=True))

``request`` tokenizes a text prompt; ``request_ids`` takes one tokenized already (the control
plane tokenizes at admission, once, and hands the coordinator the ids).

Each session opens a KV cache on every stage, is decoded by the job's engine together with the
job's other sessions (``engine.py``: the scheduler decides each step what every session sends,
plain steps or chunks of drafts verified in one pass with several in flight, and batches them;
``scheduler.py``, ``router.py``, ``session.py``), closes, and collects the stages' signed
receipts, which are verified (``proof.py``) against the stages' assigned spans and this
coordinator's own transcript before the result is reported. The coordinator itself connects,
heals and verifies.

With ``audit_stages`` (stage indices, chosen by the control plane) every session's result also
carries those stages' exact traffic as ``AuditMaterial``, for a trusted replay (``audit.py``);
the coordinator itself keeps none of it once the session ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import time
import uuid
from collections.abc import AsyncGenerator, Collection, Sequence

from nacl.signing import SigningKey

from worker_agent import model as models
from worker_agent.coordinator import prefix
from worker_agent.coordinator.engine import Engine, Run
from worker_agent.coordinator.grammar import Constraint
from worker_agent.coordinator.head import HeadRunner
from worker_agent.coordinator.heal import Healer, HealRecord, failure_at, get_ready
from worker_agent.coordinator.pipeline import STALL_TIMEOUT_S, Pipeline, StageSpec
from worker_agent.coordinator.proof import check_route, prove_session
from worker_agent.coordinator.result import GenerationResult
from worker_agent.coordinator.router import PLAIN, Router, RouteTiming
from worker_agent.coordinator.session import GenerationRequest, GenerationState, TokenEvent
from worker_agent.coordinator.speculation import SpeculationSettings
from worker_agent.errors import StageError
from worker_agent.protocol.links import Misconduct
from worker_agent.protocol.receipts import Receipt, StageAssignment
from worker_agent.protocol.transport import DirectLink, LinkFactory

log = logging.getLogger("swarm.coordinator")
MAX_HEALS = 2  # heals one request may go through before it fails
HEALED_CLOSE_S = 2.0  # how long closing a job waits for the connections of routes it healed away from


def encode_prompt(
    tokenizer, prompt: str | list[dict], *, chat: bool, tools: list[dict] | None = None
) -> tuple[int, ...]:
    """A prompt's token ids: a string, or with ``chat=True`` chat messages ([{role, content}], a
    string being one user message) put through the model's chat template, with the functions
    ``tools`` where the template renders them."""
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tuple(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)["input_ids"])
    return tuple(tokenizer(prompt)["input_ids"])


class Coordinator:
    def __init__(
        self,
        model: str,
        stages: list[StageSpec],
        *,
        job: str | None = None,
        topology: str = "ring",
        transport: LinkFactory = DirectLink,
        assignments: list[StageAssignment] | None = None,
        audit_stages: Collection[int] = (),
        healer: Healer | None = None,
        max_heals: int = MAX_HEALS,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        coordinator_key: SigningKey | None = None,
        speculation: SpeculationSettings | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.model = model
        self.tls = tls  # the swarm's client context for every route of the job (``Pipeline``'s ``tls``)
        self.speculation = speculation or SpeculationSettings()
        self._timing: RouteTiming | None = None  # the route's round trip and compute, shared by its sessions
        # The job's coordinator key: the stages' tickets name its public half, and every HELLO
        # (a heal's included) proves it. None only with agents that take no tickets.
        self.coordinator_key = coordinator_key
        self.model_id = models.model_name(model)
        self.job = job or f"job-{uuid.uuid4().hex[:16]}"
        self.topology = topology
        self.transport = transport  # makes the links of every route's stage connections, healed ones too
        self.stall_timeout_s = stall_timeout_s
        self._session_ids = itertools.count()  # shared by every route the job heals onto: ids never repeat
        self._peer_passes: dict[tuple[bytes, bytes], bytes] = {}  # likewise: a kept pair keeps its pass
        self.misconduct: list[Misconduct] = []  # breaches proven by their nodes' own signatures
        self.hidden_size = models.load_config(model).hidden_size  # the registry's, never a stage's word
        self.pipeline = self._pipeline(stages, audit_stages)
        self.pipeline.assignments = assignments
        self._assignments_from_hello = assignments is None
        self.healer = healer
        self.max_heals = max_heals
        self._heal_lock = asyncio.Lock()
        self._closing: set[asyncio.Task] = set()  # routes healed away from, closing in the background
        self._preparing: asyncio.Task | None = None  # the healer getting ready, once the route is up
        self.head = models.load_head(model)
        self.tokenizer = models.load_tokenizer(model)
        self.n_layers = models.n_layers(model)
        self.receipts: list[Receipt] = []
        self.engine = Engine(HeadRunner(self.head, self.pipeline.dtype))

    def _pipeline(self, stages: list[StageSpec], audit_stages: Collection[int]) -> Pipeline:
        return Pipeline(
            self.job,
            stages,
            topology=self.topology,
            transport=self.transport,
            audit_stages=audit_stages,
            stall_timeout_s=self.stall_timeout_s,
            session_ids=self._session_ids,
            model=self.model_id,
            hidden_size=self.hidden_size,
            coordinator_key=self.coordinator_key,
            tls=self.tls,
            peer_passes=self._peer_passes,
            misconduct=self.misconduct,
        )

    async def __aenter__(self) -> Coordinator:
        try:
            try:
                await self._connect()
            except StageError as exc:  # a stage of the route is gone already: heal before the first token
                if not self._can_heal(exc):
                    raise
                await self._heal(self.pipeline, exc)
        except BaseException:
            await self.aclose()
            raise
        if self.healer is not None:  # ready for a failure before one happens, not after
            self._preparing = asyncio.create_task(get_ready(self.healer, self.job))
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._preparing is not None:
            self._preparing.cancel()
        await self.engine.aclose()
        await self.pipeline.aclose()
        if self._closing:
            _, pending = await asyncio.wait(self._closing, timeout=HEALED_CLOSE_S)
            for task in pending:
                task.cancel()

    async def _connect(self) -> None:
        check_route(self.pipeline, await self.pipeline.connect(), model=self.model_id, n_layers=self.n_layers)

    def _can_heal(self, exc: StageError) -> bool:
        return self.healer is not None and exc.stage is not None

    async def _heal(self, failed: Pipeline, exc: StageError) -> None:
        """Replace ``failed`` (the current route, whose stage ``exc.stage`` failed) by a connected
        route from the healer; a no-op when another session healed it already. A replacement that
        fails to connect is healed in turn, up to ``max_heals`` times; raises a StageError when no
        replacement is available or the bound is reached."""
        async with self._heal_lock:
            if self.pipeline is not failed:
                return
            error, attempts = exc, 0
            while True:
                attempts += 1
                if attempts > self.max_heals or not self._can_heal(error):
                    raise error
                await self._replace(self.pipeline, error)
                try:
                    await self._connect()
                    return
                except StageError as again:
                    error = again

    async def _replace(self, failed: Pipeline, error: StageError) -> None:
        assert self.healer is not None and error.stage is not None
        healed = await self.healer.replace(failure_at(failed, error), [link.spec for link in failed.links])
        if healed is None:
            raise StageError(
                f"{error}; no replacement for stage {error.stage} is available", code=error.code, stage=error.stage
            )
        url = failed.links[error.stage].spec.url
        log.warning(
            "job %s: stage %d (%s) failed (%s); healed onto a new route", self.job, error.stage, url, error.code
        )
        if healed.assignments is None and not self._assignments_from_hello:
            # Fail closed: a route the control plane assigned is never swapped for the stages' own word.
            raise StageError(
                f"{error}; the healer named no assignments for its route", code=error.code, stage=error.stage
            )
        audit = healed.audit_stages
        if audit is None:
            audit = tuple(stage for stage in failed.audit_stages if stage < len(healed.stages))
        self.pipeline = self._pipeline(list(healed.stages), audit)
        # None without a control plane: taken again from the new route's HELLOs.
        self.pipeline.assignments = list(healed.assignments) if healed.assignments is not None else None
        task = asyncio.ensure_future(failed.aclose())  # its survivors drop the job's old sessions
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def request(self, prompt: str | list[dict], *, chat: bool = False, **options) -> GenerationRequest:
        """Tokenize a prompt (a string, or chat messages with ``chat=True``) into a request; ``options``
        as ``request_ids`` takes them."""
        return self.request_ids(encode_prompt(self.tokenizer, prompt, chat=chat), **options)

    def request_ids(self, prompt_ids: Sequence[int], **options) -> GenerationRequest:
        """A request for a prompt tokenized already (``encode_prompt`` with this model's tokenizer);
        ``options``: the fields of ``GenerationRequest`` (``max_tokens``, ``sampling``, ``stop``,
        ``speculate``, ``logprobs``, ``grammar``, ``prefix_salt``)."""
        return GenerationRequest.of(prompt_ids, self.tokenizer.eos_token_id, **options)

    async def stream(
        self, request: GenerationRequest, *, strict: bool = True
    ) -> AsyncGenerator[TokenEvent | GenerationResult, None]:
        """Yield each committed token as it comes, then the verified result. Receipts that fail
        verification raise (``strict``), or are reported in the result's ``verification_error``.

        A stage failure heals the route (``_heal``) and the session starts over on it, under a new
        id, from the prompt and every token committed so far (``GenerationState.rewind``)."""
        started = time.monotonic()
        constraint = None
        if request.grammar is not None:
            constraint = Constraint(request.grammar, self.tokenizer, self.head.lm_head.out_features)
        state = GenerationState(request, self.tokenizer, constraint=constraint)
        drafters = self.speculation.drafters(self.model) if request.speculate else {}
        router, heals = self._router(request, drafters), list[HealRecord]()
        run = Run(self.pipeline, self.pipeline.new_session_id(), state, router, drafters)
        try:
            while True:
                try:
                    # Prefix reuse: offered on the first route only (a healed one starts over from 0).
                    offered = None if heals else prefix.offer(request, run.session, self.model_id)
                    held = (await run.pipeline.open([run.session], offered))[run.session]
                    if held:
                        state.start_at(held)
                    self.engine.add(run)
                    async for event in run.events():
                        yield event
                    break
                except StageError as exc:
                    self.engine.drop(run)
                    run.pipeline.forget(run.session)
                    if not self._can_heal(exc):
                        raise
                    if len(heals) >= self.max_heals:
                        raise StageError(
                            f"{exc} (the request was healed {len(heals)} times already, the most allowed)",
                            code=exc.code,
                        ) from exc
                    heals.append(HealRecord.of(run.pipeline, exc, time.monotonic() - started))
                    await self._heal(run.pipeline, exc)
                    heals[-1].reconnected = time.monotonic() - started
                    # The new route holds nothing of this session: it starts over, under a new id.
                    run = Run(self.pipeline, self.pipeline.new_session_id(), state, router, drafters)
                    run.on_fold.append(lambda record=heals[-1]: record.resume(time.monotonic() - started))
                    state.rewind()
        finally:
            self.engine.drop(run)
            state.speculation = router.to_json()
        yield await self._finish(run, strict, heals=heals, elapsed=time.monotonic() - started)

    async def _finish(self, run: Run, strict: bool, **measured) -> GenerationResult:
        """Close the session everywhere, take its receipts and audit material, verify them."""
        keep = prefix.keep(run.state, run.session, self.model_id)  # what its stages may keep for a later turn
        proof = await prove_session(
            run.pipeline, run.session, strict=strict, model=self.model_id, n_layers=self.n_layers, keep=keep
        )
        self.receipts.extend(proof.receipts if proof.verification is not None else ())
        return GenerationResult.of(run.session, run.state, proof, **measured)

    def _router(self, request: GenerationRequest, drafters: dict) -> Router:
        """The session's router: plain decoding when speculation is off, else over its drafters,
        with the fixed (drafter, K, depth) of the coordinator's settings if any."""
        costs = {name: drafter.cost_s_per_token for name, drafter in drafters.items()}
        if not (self.speculation.enabled and request.speculate and costs):
            return Router({}, fixed=PLAIN)
        stages = len(self.pipeline.links)
        if self._timing is None or self._timing.stages != stages:
            self._timing = RouteTiming(stages=stages)
        stand_ins = [name for name, drafter in drafters.items() if drafter.only_without is not None]
        return Router(costs, fixed=self.speculation.fixed_plan(costs), timing=self._timing, stand_ins=stand_ins)

    @property
    def assignments(self) -> list[StageAssignment] | None:
        """The current route's assignments."""
        return self.pipeline.assignments

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        *_, result = [event async for event in self.stream(request)]
        assert isinstance(result, GenerationResult)
        return result
