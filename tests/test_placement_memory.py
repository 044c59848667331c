"""Placement by memory: a node takes the layers whose weights, in the dtype it serves in, plus a KV
budget fit in the memory it reported (``placement.memory``); its owner's cap still caps.

One layer of smollm2-135m has 3,540,096 parameters (14,160,384 bytes in float32) and caches
2 x 3 KV heads x 64 values per position (1,536 bytes in float32); 80 % of a node's memory is
planned for blocks.
"""

from __future__ import annotations

import logging

import pytest

from marketplace.nodes.models import Node
from marketplace.placement import placing, rebalancing
from marketplace.placement.memory import ModelShape, footprint, layers_that_fit, serving_dtype
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.placement.shares import layer_cap
from tests.factories import GIB, MODEL

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures"]

MIB = 1 << 20
TINY = "tiny-llama"
WEIGHTS_F32 = 14_160_384  # bytes of one smollm2-135m layer in float32
KV_F32 = 1_536  # bytes of one layer's keys and values for one position, float32
PLANNED = int(GIB * 0.8)  # what a node of 1 GiB plans for blocks


@pytest.fixture
def placement_settings(swarm_settings):
    swarm_settings.SWARM_KV_BUDGET_SESSIONS = 8
    return swarm_settings


@pytest.fixture
def make_reported_node(provider, make_joined_node, placement_settings):
    """A node that joined reporting the given memory, dtypes and session limits."""

    def make(
        name: str,
        *,
        memory_bytes: int = GIB,
        dtypes: tuple[str, ...] = ("float32", "bfloat16"),
        max_positions: int | None = 4096,
        max_sessions: int | None = 64,
        max_layers: int | None = None,
    ) -> Node:
        node = make_joined_node(provider, name, max_layers=max_layers, memory_bytes=memory_bytes).node
        Node.objects.filter(pk=node.pk).update(
            dtypes=list(dtypes), max_positions=max_positions, max_sessions=max_sessions
        )
        node.refresh_from_db()
        return node

    return make


def live_layers() -> dict[str, int]:
    """Node name -> layers of the live block it holds."""
    return {
        a.node.name: a.layer_end - a.layer_start
        for a in Assignment.objects.filter(state=AssignmentState.ASSIGNED).select_related("node")
    }


def test_a_node_holds_twice_the_layers_in_bfloat16_as_in_float32(make_reported_node):
    in_f32 = make_reported_node("f32", dtypes=("float32", "bfloat16"))
    in_bf16 = make_reported_node("bf16", dtypes=("bfloat16",))
    in_f16 = make_reported_node("f16", dtypes=("float16", "float32"))

    per_layer_f32 = WEIGHTS_F32 + KV_F32 * 4096 * 8  # 64,492,032
    assert layer_cap(in_f32, MODEL) == PLANNED // per_layer_f32 == 13
    assert layer_cap(in_bf16, MODEL) == PLANNED // (per_layer_f32 // 2) == 26
    assert layer_cap(in_f16, MODEL) == 26  # the first dtype it reports is the one it serves in


def test_placement_gives_a_half_precision_node_the_layers_its_memory_holds(make_reported_node, measure_ring):
    # Equal speeds: a proportional split would be 15 + 15, but the float32 node holds only 13.
    f32 = make_reported_node("f32", dtypes=("float32",))
    bf16 = make_reported_node("bf16", dtypes=("bfloat16",))
    measure_ring([f32, bf16])

    placing.place_model(MODEL)

    assert live_layers() == {"f32": 13, "bf16": 17}


def test_the_kv_budget_takes_memory_from_the_layers(make_reported_node, placement_settings):
    node = make_reported_node("n", max_positions=4096, max_sessions=64)
    assert layer_cap(node, MODEL) == PLANNED // (WEIGHTS_F32 + KV_F32 * 4096 * 8) == 13

    placement_settings.SWARM_KV_BUDGET_SESSIONS = 1
    assert layer_cap(node, MODEL) == PLANNED // (WEIGHTS_F32 + KV_F32 * 4096) == 42

    placement_settings.SWARM_KV_BUDGET_SESSIONS = 8
    shorter = make_reported_node("short", max_positions=512)
    assert layer_cap(shorter, MODEL) == PLANNED // (WEIGHTS_F32 + KV_F32 * 512 * 8) == 42
    few_sessions = make_reported_node("few", max_sessions=2)  # holds 2 sessions at once: budgets 2
    assert layer_cap(few_sessions, MODEL) == PLANNED // (WEIGHTS_F32 + KV_F32 * 4096 * 2) == 32
    # No limit reported: the model's own 8,192 positions.
    unbounded = make_reported_node("unbounded", max_positions=None, max_sessions=None)
    assert layer_cap(unbounded, MODEL) == PLANNED // (WEIGHTS_F32 + KV_F32 * 8192 * 8) == 7


def test_the_owners_cap_still_caps(make_reported_node):
    assert layer_cap(make_reported_node("capped", max_layers=5), MODEL) == 5
    assert layer_cap(make_reported_node("over", max_layers=50), MODEL) == 13


def test_a_node_too_small_for_one_layer_is_left_out_with_its_reason(make_reported_node, measure_ring, caplog):
    big = make_reported_node("big", memory_bytes=4 * GIB)
    small = make_reported_node("small", memory_bytes=64 * MIB)
    measure_ring([big, small])

    with caplog.at_level(logging.WARNING, logger="swarm.placement"):
        placing.place_model(MODEL)

    assert live_layers() == {"big": 30}
    assert [r.getMessage() for r in caplog.records if "left out" in r.getMessage()] == [
        f"{small.node_id}: left out of {MODEL} placements: its 64 MiB of memory (80% planned for blocks) hold no "
        "layer: one needs 13.5 MiB of float32 weights + 48.0 MiB of KV cache (8 sessions x 4096 positions)"
    ]


def test_with_several_models_a_node_too_small_for_all_of_them_is_left_out_with_its_reason(
    make_reported_node, measure_ring, placement_settings, caplog
):
    placement_settings.SWARM_MODELS = [MODEL, TINY]
    a = make_reported_node("a", memory_bytes=4 * GIB)
    b = make_reported_node("b", memory_bytes=4 * GIB)
    crumb = make_reported_node("crumb", memory_bytes=2 * MIB)
    measure_ring([a, b, crumb])

    with caplog.at_level(logging.WARNING, logger="swarm.placement"):
        rebalancing.mark_dirty()
        placing.place_dirty_models()

    assert Assignment.objects.filter(node=crumb).count() == 0
    reasons = {r.getMessage() for r in caplog.records if "left out" in r.getMessage()}
    assert reasons == {
        f"{crumb.node_id}: left out of {MODEL} placements: its 2 MiB of memory (80% planned for blocks) hold no "
        "layer: one needs 13.5 MiB of float32 weights + 48.0 MiB of KV cache (8 sessions x 4096 positions)",
        # tiny-llama: 36,992 parameters a layer; 2 x 2 KV heads x 16 values a position, 2,048 positions.
        f"{crumb.node_id}: left out of {TINY} placements: its 2 MiB of memory (80% planned for blocks) hold no "
        "layer: one needs 0.1 MiB of float32 weights + 4.0 MiB of KV cache (8 sessions x 2048 positions)",
    }


def test_int8_weights_count_one_byte_a_parameter_and_their_scales():
    shape = ModelShape(layer_parameters=3_540_096, hidden=576, kv_heads=3, head_dim=64)
    layer = footprint(shape, serving_dtype(["int8", "bfloat16"]), positions=4096, sessions=8)

    # 3,540,096 int8 values + a 2-byte scale per 576 parameters (6,146 of them); the cache holds
    # bfloat16 activations: 2 x 3 x 64 x 2 bytes x 4,096 x 8.
    assert (layer.dtype, layer.weights, layer.kv) == ("int8", 3_540_096 + 6_146 * 2, 25_165_824)
    assert layers_that_fit(GIB, layer) == PLANNED // (3_552_388 + 25_165_824) == 29


def test_a_node_that_reports_no_known_dtype_is_planned_in_the_agents_default():
    assert serving_dtype([]) == "float32"
    assert serving_dtype(["float8_e4m3", "bfloat16"]) == "bfloat16"
    assert serving_dtype(["float8_e4m3"]) == "float32"


def test_an_agent_reports_the_dtype_it_serves_in_first_and_is_sized_by_it():
    from worker_agent.agent.control import hardware_report

    report = hardware_report("cpu", None, "bfloat16")

    assert report["dtypes"][0] == "bfloat16" and "float32" in report["dtypes"]
    assert serving_dtype(report["dtypes"]) == "bfloat16"
    assert serving_dtype(hardware_report("cpu", None)["dtypes"]) == "float32"
