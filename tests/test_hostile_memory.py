"""Memory is held, not claimed: a node that reports twice the memory it holds its KV caches in is
placed for twice the layers, cannot hold the budget they were placed with, and a memory challenge
clamps and strikes it; an honest node holds what it was placed for and passes.

Two stages of tiny-llama run as in-process StageServers speaking the real wire protocol, placed as
one pipeline (layers 0:3 and 3:6), each holding its caches in its own memory
(``worker_agent.kvcache.KVMemory``): the honest one in what its node reported, the liar in half
of it (``--cheat claim-memory:2``'s agent). Each is memory-challenged: a job of SWARM_KV_BUDGET_SESSIONS
sessions, each filled to SWARM_MEMORY_CHALLENGE_FRACTION of a session's positions, all held at once,
run through the other span's stand-in (``marketplace/verification/challenges.py``,
``marketplace/verification/claims.py``)."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async

from marketplace.nodes.models import Node
from marketplace.placement import memory
from marketplace.placement.shares import layer_cap, layer_footprint
from marketplace.verification import challenges as challenge_checks
from marketplace.verification.models import Challenge, CheckState, Strike, StrikeKind
from tests import stage_fixtures
from tests.stage_fixtures import stage_servers
from worker_agent.kvcache import KVMemory
from worker_agent.protocol.control_protocol import MEMORY_FRACTION
from worker_agent.protocol.keys import generate_signing_key
from worker_agent.stage import Stage

pytestmark = [pytest.mark.trust, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.factories"]

SPANS = [(0, 3), (3, 6)]
LIAR = 1
POSITIONS = 1024  # positions per session both nodes report holding
SESSIONS = 2  # SWARM_KV_BUDGET_SESSIONS


def holding_stage(memory_bytes: int) -> type[Stage]:
    """A stage holding its caches in ``memory_bytes`` of memory, its weights charged to it first."""

    class Holding(Stage):
        def __init__(self, *args, **kwargs) -> None:
            held = KVMemory.of(memory_bytes, MEMORY_FRACTION)
            super().__init__(*args, **kwargs, memory=held)
            held.charge(sum(t.numel() * t.element_size() for t in self.block.weights.layers.parameters()))

    return Holding


@pytest.fixture
def control_plane(settings, tmp_path):
    with stage_fixtures.in_memory_control_plane(
        settings,
        tmp_path,
        SWARM_AUDIT_NEW_NODE_FRACTION=0.0,
        SWARM_AUDIT_MIN_FRACTION=0.0,
        SWARM_VERIFIER="inline",
        SWARM_KV_BUDGET_SESSIONS=SESSIONS,
        SWARM_MEMORY_CHALLENGE_FRACTION=0.75,
        SWARM_MEMORY_CLAIM_TOLERANCE=1.5,
        SWARM_SPECULATION="off",
    ) as plane:
        yield plane


def _decided(challenge_pk: int) -> Challenge:
    challenge_checks.run_challenge(challenge_pk)
    return Challenge.objects.get(pk=challenge_pk)


def test_a_node_claiming_twice_its_memory_is_clamped_and_struck_and_an_honest_one_is_not(
    control_plane, provider, make_joined_node
):
    keys = [generate_signing_key() for _ in SPANS]
    honest, liar = (make_joined_node(provider, f"gpu-{i}", key=key).node for i, key in enumerate(keys))
    Node.objects.filter(pk__in=[honest.pk, liar.pk]).update(max_positions=POSITIONS, max_sessions=64)
    honest.refresh_from_db()
    layer = layer_footprint(honest, stage_fixtures.MODEL)
    # What both report: just what 3 layers and their KV budget (2 sessions x 1024 positions) need.
    claimed = memory.memory_holding(layer, 3, SESSIONS * POSITIONS)
    Node.objects.filter(pk__in=[honest.pk, liar.pk]).update(memory_bytes=claimed)
    honest.refresh_from_db()
    liar.refresh_from_db()
    assert layer_cap(liar, stage_fixtures.MODEL) == 3

    async def scenario() -> list[Challenge]:
        async with stage_servers(
            SPANS,
            keys=keys,
            stage_class=holding_stage(claimed),
            rogue=LIAR,
            rogue_class=holding_stage(claimed // 2),
        ) as route:
            await sync_to_async(stage_fixtures.place_route)([honest, liar], route)
            decided = []
            for node in (honest, liar):
                challenge = await sync_to_async(challenge_checks.open_challenge)(node, memory=True)
                decided.append(await sync_to_async(_decided)(challenge.pk))
            return decided

    passed, failed = asyncio.run(scenario())

    # The honest node held both sessions of 768 positions and passed; it proved the memory they need.
    assert (passed.state, passed.sessions, passed.positions) == (CheckState.PASSED, SESSIONS, 768)
    honest.refresh_from_db()
    # Each session's prompt (at most 764 tokens of pool text) and 3 of its 4 tokens (the last is not fed back).
    held = sum(one.tokens for one in challenge_checks.unpack_materials(bytes(passed.output), SESSIONS))
    assert SESSIONS * (768 - 8) <= held <= SESSIONS * 767
    assert (
        honest.verified_memory_bytes == memory.memory_holding(layer, 3, held) == passed.metrics["proven_memory_bytes"]
    )
    assert honest.memory_limit_bytes is None
    assert not Strike.objects.filter(node=honest).exists()

    # The liar holds 735 positions on its 3 layers: it refused the first session's prompt.
    assert failed.state == CheckState.FAILED
    assert "kv_memory_full" in failed.reason
    asked = failed.metrics["asked_positions"]
    assert 735 < asked <= 768
    liar.refresh_from_db()
    assert liar.memory_limit_bytes == memory.memory_holding(layer, 3, asked - 1)
    assert layer_cap(liar, stage_fixtures.MODEL) == 1  # placement now gives it what it can hold
    strike = Strike.objects.get(node=liar)
    assert strike.kind == StrikeKind.CAPACITY
    assert strike.evidence["kind"] == "memory"
    assert strike.evidence["claimed_memory_bytes"] == claimed
    assert strike.evidence["memory_limit_bytes"] == liar.memory_limit_bytes
    assert f"reports {claimed} bytes of memory" in strike.evidence["reason"]
