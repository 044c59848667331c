"""Cheat modes, for tests only: an agent that misbehaves on purpose, so tests can prove it is caught.

A cheat replaces what the layer block computes on data-plane sessions (``Stage.compute``, which is
where challenges run too: a challenge is a job). The product has no switch for it: a cheating stage
is built here, by substitution, as a ``CheatingStage`` whose block (``CheatingBlock``) runs the
honest layers through the cheat, served by a ``CheatingServer``::

    stage = CheatingStage(block, cheat=Cheat.parse("garbage"), model=..., signing_key=...)
    server = CheatingServer(stage)

    garbage             seeded random noise of the right shape and dtype (finite)
    identity            the input hidden states, unchanged: the layers never run
    other-weights       the same architecture and span, but seeded random weights
    selective:FRACTION  garbage for that fraction of sessions (0 < FRACTION <= 1), a whole session
                        cheated or none of it
    ring-only           garbage in the sessions of ring jobs, honest in star ones (which is what
                        challenges were until they became jobs)
    with-successor      garbage in the sessions of jobs that give it a ring successor, honest where
                        its outputs go straight back to the coordinator
    claim-memory:FACTOR honest outputs, but the agent reports FACTOR (> 1) times the memory it holds
                        its caches in (``kvcache.KVMemory``): placed for more than it has, it
                        refuses the sessions past what it holds

The last two learn each job's route from its coordinator's HELLO (``saw_hello``, called by
``CheatingServer``), as a node that tried to tell challenges from jobs by their route would.

An agent process cheats only when started through the dev entry point
``python -m worker_agent.dev.agent --cheat MODE serve|join ...``, which is refused unless the
environment sets ``SWARM_ALLOW_CHEAT=1``; an agent with a cheat logs a loud warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from collections.abc import Mapping

import torch
from torch import nn

from worker_agent.block import Block, WorkItem
from worker_agent.errors import SwarmError
from worker_agent.layers import build_layer
from worker_agent.model import BlockWeights
from worker_agent.protocol.connection import AcceptHello, Role
from worker_agent.rotary import Rotary
from worker_agent.server import Conn, StageServer, StageSlot
from worker_agent.stage import Stage

ALLOW_ENV = "SWARM_ALLOW_CHEAT"
MODES = ("garbage", "identity", "other-weights", "selective", "ring-only", "with-successor", "claim-memory")
IMPOSTOR_SEED = 1  # the impostor's weights: fixed, so a failure reproduces
MAX_ROUTES = 4096  # jobs whose route a cheat remembers; the oldest are forgotten first
MAX_CLAIM_FACTOR = 1000.0  # claim-memory's factor at most


class Cheat:
    def __init__(self, mode: str, fraction: float = 1.0, *, factor: float = 1.0) -> None:
        if mode not in MODES:
            raise SwarmError(f"unknown cheat mode {mode!r}: use one of {', '.join(MODES)}", code="cheat_invalid")
        if not 0.0 < fraction <= 1.0:
            raise SwarmError(f"a cheat's fraction must be in (0, 1], got {fraction}", code="cheat_invalid")
        if mode != "selective" and fraction != 1.0:
            raise SwarmError(f"only selective takes a fraction, not {mode}", code="cheat_invalid")
        if (mode == "claim-memory") != (factor != 1.0) or not 1.0 <= factor <= MAX_CLAIM_FACTOR:
            raise SwarmError(
                f"claim-memory takes a factor in (1, {MAX_CLAIM_FACTOR:g}], and only it: got {mode} with {factor}",
                code="cheat_invalid",
            )
        self.mode = mode
        self.fraction = fraction
        self.factor = factor  # claim-memory: the reported memory over the memory held
        self._impostor: tuple[tuple, Block] | None = None  # (span key, the span with other weights)
        self._lock = threading.Lock()  # the impostor is built on the compute thread, read on any
        self._routes: dict[str, tuple[str, bool]] = {}  # job -> (topology, has a ring successor)

    @classmethod
    def parse(cls, text: str) -> Cheat:
        """``garbage``, ``identity``, ``other-weights``, ``selective:FRACTION``, ``ring-only``,
        ``with-successor`` or ``claim-memory:FACTOR``."""
        mode, _, fraction = text.partition(":")
        if mode == "claim-memory":
            try:
                return cls(mode, factor=float(fraction))
            except ValueError:
                raise SwarmError(
                    f"claim-memory needs a factor > 1, e.g. claim-memory:2, got {text!r}", code="cheat_invalid"
                ) from None
        if mode == "selective":
            try:
                return cls(mode, float(fraction))
            except ValueError:
                raise SwarmError(
                    f"selective needs a fraction in (0, 1], e.g. selective:0.5, got {text!r}", code="cheat_invalid"
                ) from None
        if fraction:
            raise SwarmError(f"cheat mode {mode!r} takes no argument, got {text!r}", code="cheat_invalid")
        return cls(mode)

    def __str__(self) -> str:
        if self.mode == "claim-memory":
            return f"claim-memory:{self.factor:g}"
        return f"selective:{self.fraction:g}" if self.mode == "selective" else self.mode

    def reported_memory(self, held: int) -> int:
        """The memory this agent reports at join when it holds ``held`` bytes."""
        return int(held * self.factor)

    def reported_hardware(self, hardware: dict) -> dict:
        """The agent's hardware report as this cheat sends it (``Parts.reported``): claim-memory
        multiplies its memory; every other mode reports it as it is."""
        if self.mode == "claim-memory":
            return {**hardware, "memory_bytes": self.reported_memory(int(hardware["memory_bytes"]))}
        return hardware

    def __repr__(self) -> str:
        return f"Cheat({str(self)!r})"

    def saw_hello(self, job: str, topology: str, next_url: str | None) -> None:
        """A coordinator opened ``job`` here: its topology and whether it named a ring successor."""
        self._routes.pop(job, None)
        self._routes[job] = (topology, topology == "ring" and bool(next_url))
        while len(self._routes) > MAX_ROUTES:
            self._routes.pop(next(iter(self._routes)))

    def cheats_on(self, job: str, session: str) -> bool:
        """Whether this session's outputs are faked. Selective decides per (job, session) by a
        hash, so one session is cheated at every step or at none."""
        match self.mode:
            case "selective":
                draw = int.from_bytes(_hash(job, session)[:8], "big") / 2**64  # uniform in [0, 1)
                return draw < self.fraction
            case "ring-only":
                return self._routes.get(job, ("", False))[0] == "ring"
            case "with-successor":
                return self._routes.get(job, ("", False))[1]
            case "claim-memory":
                return False  # its lie is its report, not its outputs
        return True

    def forward(self, block: Block, items: list[WorkItem]) -> list[torch.Tensor]:
        """What this cheating node returns instead of ``block.forward(items)``."""
        if self.mode == "other-weights":
            return self.impostor(block).forward(items)
        honest = [i for i, item in enumerate(items) if not self.cheats_on(item.session.job, item.session.session)]
        outputs: list[torch.Tensor | None] = [None] * len(items)
        if honest:
            for index, output in zip(honest, block.forward([items[i] for i in honest]), strict=True):
                outputs[index] = output
        for index, item in enumerate(items):
            if outputs[index] is None:
                outputs[index] = self._fake(block, item)
                # A faked session never runs the layers, so its cache stays empty; only the
                # position count advances, which is all the stage's order checks look at.
                item.session.length = item.start + item.hidden.shape[0]
        return outputs  # type: ignore[return-value]

    def _fake(self, block: Block, item: WorkItem) -> torch.Tensor:
        weights = block.weights
        if self.mode == "identity":
            return item.hidden.to(weights.device, weights.dtype).clone()  # (tokens, hidden)
        kv = item.session
        seed = int.from_bytes(_hash(kv.job, kv.session, str(item.start))[:8], "big") >> 1
        noise = torch.randn(item.hidden.shape, generator=torch.Generator().manual_seed(seed))  # (tokens, hidden)
        return noise.to(weights.device, weights.dtype)

    def impostor(self, block: Block) -> Block:
        """The block's span with other weights, built on first use."""
        weights = block.weights
        key = (weights.model, weights.layer_start, weights.layer_end, weights.dtype, weights.device)
        with self._lock:
            # One at a time: an agent reassigned to another span drops the old impostor.
            if self._impostor is None or self._impostor[0] != key:
                self._impostor = (key, Block(impostor_weights(weights), max_batch=block.max_batch))
            return self._impostor[1]


def impostor_weights(weights: BlockWeights, *, seed: int = IMPOSTOR_SEED) -> BlockWeights:
    """Layers of the same type, config and span as ``weights``, initialized the way a model is
    before training (normal(0, initializer_range) matrices, unit norms) from a fixed seed."""
    config = weights.config
    generator = torch.Generator().manual_seed(seed)
    layers = nn.ModuleList()
    with torch.no_grad():
        for _ in range(len(weights.layers)):
            layer = build_layer(config).to_empty(device="cpu")
            for name, parameter in layer.named_parameters():
                if parameter.dim() >= 2:
                    parameter.normal_(0.0, config.initializer_range, generator=generator)
                elif name.endswith("bias"):
                    parameter.zero_()
                else:
                    parameter.fill_(1.0)  # norm gains
            layers.append(layer.to(weights.device, weights.dtype))
    return dataclasses.replace(weights, layers=layers, rotary=Rotary(config, weights.device), quantize=None)


class CheatingBlock(Block):
    """``honest``'s layers as a node with ``cheat`` runs them."""

    def __init__(self, honest: Block, cheat: Cheat) -> None:
        super().__init__(honest.weights, max_batch=honest.max_batch)
        self.honest = honest
        self.cheat = cheat

    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        return self.cheat.forward(self.honest, items)


class CheatingStage(Stage):
    """A ``Stage`` whose block cheats: everything else (tickets, sessions, receipts) is the stage's own,
    so its receipts sign the cheated outputs as an honest stage signs its true ones."""

    def __init__(self, block: Block, *, cheat: Cheat, **kwargs) -> None:
        super().__init__(CheatingBlock(block, cheat), **kwargs)
        self.cheat = cheat


class CheatingServer(StageServer):
    """A ``StageServer`` that tells each cheating stage the route a coordinator's HELLO gave its job,
    before the HELLO is answered (the route cheats pick their jobs by it)."""

    async def _accept(self, conn: Conn, slot: StageSlot, action: AcceptHello) -> None:
        stage, hello = slot.stage, action.hello
        if isinstance(stage, CheatingStage) and action.binding.role is Role.COORDINATOR:
            stage.cheat.saw_hello(hello.job, hello.topology, hello.next_url)
        await super()._accept(conn, slot, action)


def cheat_from_option(text: str | None, environ: Mapping[str, str] | None = None) -> Cheat | None:
    """The cheat a ``--cheat`` option asks for; refused unless SWARM_ALLOW_CHEAT=1."""
    if text is None:
        return None
    environ = os.environ if environ is None else environ
    if environ.get(ALLOW_ENV) != "1":
        raise SwarmError(
            f"--cheat makes this agent return wrong results on purpose and exists for tests only; "
            f"it is refused unless {ALLOW_ENV}=1 is set",
            code="cheat_refused",
        )
    return Cheat.parse(text)


def warning_banner(cheat: Cheat) -> str:
    return (
        "!" * 78 + f"\nWARNING: --cheat {cheat}: this agent returns WRONG RESULTS on purpose (tests only).\n"
        "Its challenges and audits are meant to fail, and its node to be struck.\n" + "!" * 78
    )


def _hash(*parts: str) -> bytes:
    return hashlib.sha256("\0".join(parts).encode()).digest()
