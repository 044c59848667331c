"""Layer allocation: pipeline count, water-filling, spares, low reputation, rebalance trigger."""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest

from marketplace.placement.allocation import (
    NodeCapacity,
    Repair,
    SpareMove,
    Stage,
    carry_spares,
    choose_pipeline_count,
    layer_load_cv,
    needs_rebalance,
    per_layer_load,
    place,
    repair,
    span_needs,
    spans_for,
    spare_moves,
    warm_spares,
    water_fill,
)
from marketplace.placement.covering import lpt, lpt_used
from marketplace.placement.errors import PlacementError

pytestmark = pytest.mark.control


def brute_force_plan(caps: list[int], n_layers: int) -> tuple[int, int]:
    """(k, s*(k)) maximising k**2 / s*(k) over every subset and every grouping of it."""
    n = len(caps)

    @functools.cache
    def cover(subset: int) -> int:
        if not subset:
            return 0
        low = subset & -subset
        best = cover(subset ^ low)  # the lowest node sits out
        rest = subset ^ low
        group = rest
        while True:  # every group containing the lowest node
            members = group | low
            if sum(caps[i] for i in range(n) if members >> i & 1) >= n_layers:
                best = max(best, 1 + cover(subset ^ members))
            if not group:
                break
            group = (group - 1) & rest
        return best

    fewest: dict[int, int] = {}
    for subset in range(1, 1 << n):
        for k in range(1, cover(subset) + 1):
            fewest[k] = min(fewest.get(k, n + 1), subset.bit_count())
    return max(fewest.items(), key=lambda ks: (ks[0] ** 2 / ks[1], ks[0]))


def test_prefers_two_pipelines_of_three_stages_over_one_of_two():
    plan = choose_pipeline_count((40, 40, 20, 20, 10, 10), 70)

    assert plan.k == 2
    assert plan.pipelines == (("0", "2", "4"), ("1", "3", "5"))
    assert plan.stages_total == 6
    assert plan.score == 4 / 6
    assert plan.spares == ()
    assert plan.exact is True


def test_pipeline_count_matches_brute_force_on_small_random_instances():
    rng = random.Random(7)
    for _ in range(150):
        n_layers = rng.randint(1, 40)
        caps = [rng.randint(1, 40) for _ in range(rng.randint(1, 8))]
        if sum(caps) < n_layers:
            continue

        plan = choose_pipeline_count(caps, n_layers)

        assert (plan.k, plan.stages_total) == brute_force_plan(caps, n_layers)
        members = [node for pipeline in plan.pipelines for node in pipeline]
        assert len(members) == len(set(members)) == plan.stages_total
        assert sorted(members + list(plan.spares), key=int) == [str(i) for i in range(len(caps))]
        assert all(sum(caps[int(node)] for node in pipeline) >= n_layers for pipeline in plan.pipelines)


def test_pipeline_count_on_a_thousand_nodes_forms_valid_disjoint_pipelines():
    rng = random.Random(11)
    nodes = [NodeCapacity(f"n{i:04d}", rng.uniform(1, 100), rng.randint(4, 40)) for i in range(1000)]
    caps = {n.node: n.max_layers for n in nodes}

    plan = choose_pipeline_count(nodes, 80)

    assert plan.exact is False
    members = [node for pipeline in plan.pipelines for node in pipeline]
    assert len(members) == len(set(members)) == plan.stages_total
    assert set(members) | set(plan.spares) == set(caps)
    assert not set(members) & set(plan.spares)
    assert all(sum(caps[node] for node in pipeline) >= 80 for pipeline in plan.pipelines)
    assert plan.score == plan.k**2 / plan.stages_total
    assert (plan.k, plan.stages_total, len(plan.spares)) == (249, 833, 167)
    assert plan.pipelines[:2] == (("n0046", "n0228"), ("n0096", "n0373"))


def test_pipeline_count_when_most_nodes_hold_the_whole_model():
    # 2,000 nodes of 2..60 layers for a 32-layer model: 1,478 pipelines, 957 of them one node.
    rng = random.Random(3)
    nodes = [NodeCapacity(f"n{i:04d}", rng.uniform(1, 100), rng.randint(2, 60)) for i in range(2000)]

    plan = choose_pipeline_count(nodes, 32)

    assert (plan.exact, plan.k, plan.stages_total) == (False, 1478, 1999)
    assert sum(len(pipeline) == 1 for pipeline in plan.pipelines) == 957
    assert plan.pipelines[:2] == (("n0507",), ("n0630",))


def test_lpt_counted_by_deficit_takes_as_many_nodes_as_lpt_built_node_by_node():
    rng = random.Random(17)
    for _ in range(300):
        n_layers = rng.randint(1, 80)
        caps = sorted((min(rng.randint(1, 2 * n_layers), n_layers) for _ in range(rng.randint(1, 200))), reverse=True)
        runs = [(cap, len(list(same))) for cap, same in itertools.groupby(caps)]
        for k in {1, rng.randint(1, len(caps)), len(caps)}:
            built = lpt(caps, n_layers, k)
            assert lpt_used(runs, n_layers, k) == (None if built is None else sum(map(len, built)))


def test_pipeline_count_raises_when_all_memory_cannot_hold_the_model():
    with pytest.raises(PlacementError):
        choose_pipeline_count((30, 30), 61)


def test_water_fill_splits_in_proportion_to_compute_when_uncapped():
    nodes = [NodeCapacity(node, compute, 100) for node, compute in zip("abcd", (1.0, 2.0, 3.0, 4.0), strict=True)]

    assert water_fill(nodes, 20) == {"a": 2, "b": 4, "c": 6, "d": 8}


def test_water_fill_gives_the_remainder_to_the_smaller_node_id_on_a_tie():
    nodes = [NodeCapacity(node, 1.0, 100) for node in "cab"]

    assert water_fill(nodes, 10) == {"c": 3, "a": 4, "b": 3}


def test_water_fill_caps_a_saturated_node_and_shares_the_rest_in_proportion():
    nodes = [NodeCapacity("a", 3.0, 2), NodeCapacity("b", 1.0, 10), NodeCapacity("c", 2.0, 10)]

    assert water_fill(nodes, 8) == {"a": 2, "b": 2, "c": 4}


def test_water_fill_leaves_nodes_at_zero_when_there_are_more_nodes_than_layers():
    nodes = [NodeCapacity(node, 1.0, 4) for node in "edcba"]

    assert water_fill(nodes, 3) == {"e": 0, "d": 0, "c": 1, "b": 1, "a": 1}


def test_water_fill_conserves_layers_and_respects_caps_on_random_instances():
    rng = random.Random(3)
    for _ in range(300):
        nodes = [
            NodeCapacity(f"n{i}", rng.choice((0.5, 1.0, rng.uniform(0.1, 50))), rng.randint(1, 30))
            for i in range(rng.randint(1, 25))
        ]
        n_layers = rng.randint(1, sum(n.max_layers for n in nodes))

        layers = water_fill(nodes, n_layers)

        assert sum(layers.values()) == n_layers
        assert all(0 <= layers[n.node] <= n.max_layers for n in nodes)
        assert water_fill(nodes[::-1], n_layers) == layers


def test_water_fill_raises_when_caps_cannot_hold_the_model():
    with pytest.raises(PlacementError):
        water_fill([NodeCapacity("a", 1.0, 3), NodeCapacity("b", 5.0, 4)], 8)


def test_spans_follow_the_given_order_and_skip_empty_nodes():
    assert spans_for(["b", "z", "a"], {"a": 3, "b": 2, "z": 0}) == [Stage("b", 0, 2), Stage("a", 2, 5)]


def test_place_water_fills_each_pipeline_and_gives_spares_the_most_loaded_stage_they_hold():
    nodes = [
        NodeCapacity("a", 1.0, 8),
        NodeCapacity("b", 3.0, 8),
        NodeCapacity("c", 1.0, 2),
        NodeCapacity("d", 1.0, 5),
    ]

    placement = place(nodes, 12, spares_per_pipeline=2)

    assert placement.pipelines == ((Stage("b", 0, 8), Stage("a", 8, 12)),)
    assert placement.spares == (Stage("d", 8, 12), Stage("c", 8, 10))
    assert placement.plan.k == 1


def test_place_puts_leftover_nodes_on_the_serving_path_by_default():
    nodes = [
        NodeCapacity("a", 1.0, 8),
        NodeCapacity("b", 3.0, 8),
        NodeCapacity("c", 1.0, 2),
        NodeCapacity("d", 1.0, 5),
    ]

    placement = place(nodes, 12)

    assert placement.pipelines == ((Stage("b", 0, 6), Stage("a", 6, 8), Stage("d", 8, 10), Stage("c", 10, 12)),)
    assert placement.spares == ()


def test_place_caps_the_stages_of_a_pipeline():
    nodes = [NodeCapacity(name, 1.0, 2) for name in "abcde"]

    placement = place(nodes, 4, max_stages=2)

    assert placement.plan.k == 2
    assert [len(p) for p in placement.pipelines] == [2, 2]
    assert [s.node for s in placement.spares] == ["e"]
    assert placement.spares[0].layers == 2


def test_place_spreads_spares_over_stages_before_doubling_up():
    nodes = [
        NodeCapacity("a", 1.0, 8),
        NodeCapacity("b", 3.0, 8),
        NodeCapacity("p", 1.0, 8, reputation=0.1),
        NodeCapacity("q", 1.0, 8, reputation=0.2),
    ]

    placement = place(nodes, 12)

    assert placement.pipelines == ((Stage("b", 0, 8), Stage("a", 8, 12)),)
    # Equal loss rates: the longer span is the costlier loss, so the first spare takes it.
    assert placement.spares == (Stage("p", 0, 8), Stage("q", 8, 12))


def test_place_gives_a_spare_the_span_with_the_fewest_replicas_over_all_pipelines():
    # Two pipelines hold [0, 6) and [6, 12) each; [10, 12) is held once, by a lightly loaded stage.
    nodes = [NodeCapacity("x", 5.0, 10), NodeCapacity("y", 1.0, 10)]
    nodes += [NodeCapacity(name, 1.0, 10) for name in "abcd"] + [NodeCapacity("s", 1.0, 6)]

    placement = place(nodes, 12, spares_per_pipeline=1)

    assert placement.pipelines == (
        (Stage("x", 0, 10), Stage("a", 10, 12)),
        (Stage("b", 0, 6), Stage("c", 6, 12)),
        (Stage("d", 0, 6), Stage("y", 6, 12)),
    )
    assert placement.spares == (Stage("s", 10, 12),)


def test_a_span_needs_a_spare_by_its_holders_loss_rates_times_its_layers():
    stages = [Stage("a", 0, 6), Stage("b", 6, 12), Stage("c", 0, 6)]

    need = span_needs(stages, {"a": 0.5, "b": 0.25, "c": 0.125})

    assert need == {(0, 6): 6 * 0.625, (6, 12): 6 * 0.25}
    with pytest.raises(PlacementError, match="d: no loss rate"):
        span_needs([*stages, Stage("d", 12, 14)], {"a": 0.5, "b": 0.25, "c": 0.125})


def test_a_failing_holder_draws_the_spare_to_its_span_over_an_equally_held_span_of_a_reliable_one():
    # [0, 6) comes first in the stages' order (the most loaded): the old rule gave it the spare.
    stages = [Stage("reliable", 0, 6), Stage("failing", 6, 12)]

    spares = warm_spares([NodeCapacity("s", 1.0, 6)], stages, {"reliable": 0.01, "failing": 0.5})

    assert spares == (Stage("s", 6, 12),)


def test_a_longer_span_draws_the_spare_at_equal_loss_rates():
    stages = [Stage("a", 8, 12), Stage("b", 0, 8)]  # the short span first: the old rule gave it the spare

    spares = warm_spares([NodeCapacity("s", 1.0, 8), NodeCapacity("t", 1.0, 8)], stages, {"a": 0.1, "b": 0.1})

    assert spares == (Stage("s", 0, 8), Stage("t", 8, 12))


def test_fewer_replicas_come_before_a_greater_need():
    # Two pipelines hold [0, 6), one of them on a node failing every hour; [6, 12) is held once.
    stages = [Stage("flaky", 0, 6), Stage("a", 0, 6), Stage("b", 6, 12)]
    rates = {"flaky": 1.0, "a": 0.01, "b": 0.01}

    spares = warm_spares([NodeCapacity("s", 1.0, 6), NodeCapacity("t", 1.0, 6)], stages, rates)

    # t: [0, 6) now 2 against [6, 12)'s 2 (b and s): the greater need decides.
    assert spares == (Stage("s", 6, 12), Stage("t", 0, 6))


def test_place_gives_the_spare_the_span_of_the_node_likeliest_to_fail():
    nodes = [
        NodeCapacity("a", 1.0, 6, loss_rate=0.01),
        NodeCapacity("b", 1.0, 6, loss_rate=0.2),
        NodeCapacity("s", 1.0, 6, reputation=0.1),
    ]

    placement = place(nodes, 12, spares_per_pipeline=1)

    assert placement.pipelines == ((Stage("a", 0, 6), Stage("b", 6, 12)),)
    assert placement.spares == (Stage("s", 6, 12),)


def test_loss_rate_must_be_finite_and_not_negative():
    for rate in (-0.1, math.inf, math.nan):
        with pytest.raises(PlacementError, match="loss_rate must be finite and >= 0"):
            NodeCapacity("a", 1.0, 6, loss_rate=rate)


def test_a_spare_moves_from_a_span_held_three_times_onto_the_lone_span_of_the_greatest_need():
    stages = [Stage("a", 0, 15), Stage("c", 0, 15), Stage("e", 0, 10), Stage("f", 10, 20), Stage("g", 20, 30)]
    spares = [Stage("s", 0, 15)]  # [0, 15): a, c and s; the three spans of e, f and g: one stage each
    rates = {"a": 0.04, "c": 0.04, "e": 0.04, "f": 0.3, "g": 0.04}

    moves = spare_moves(stages, spares, {"s": 15}, rates)

    assert moves == [
        SpareMove(Stage("s", 0, 15), Stage("s", 10, 20)),  # f fails the most
        SpareMove(Stage("s", 0, 15), Stage("s", 0, 10)),  # then by span
        SpareMove(Stage("s", 0, 15), Stage("s", 20, 30)),
    ]


def test_spares_move_from_the_span_with_the_most_replicas_and_only_onto_spans_they_hold():
    stages = [Stage("a", 0, 15), Stage("c", 0, 15), Stage("b", 15, 30), Stage("d", 15, 30), Stage("e", 0, 20)]
    stages.append(Stage("f", 20, 30))
    spares = [Stage("s", 0, 15), Stage("t", 15, 30), Stage("u", 15, 30)]  # [15, 30) held 4 times
    rates = dict.fromkeys("abcdef", 0.04)

    moves = spare_moves(stages, spares, {"s": 20, "t": 10, "u": 20}, rates)

    # [0, 20) (need 20 * 0.04) before [20, 30); t is too small for [0, 20).
    assert moves == [
        SpareMove(Stage("u", 15, 30), Stage("u", 0, 20)),
        SpareMove(Stage("s", 0, 15), Stage("s", 0, 20)),
        SpareMove(Stage("t", 15, 30), Stage("t", 20, 30)),
        SpareMove(Stage("u", 15, 30), Stage("u", 20, 30)),
        SpareMove(Stage("s", 0, 15), Stage("s", 20, 30)),
    ]


def test_a_spare_of_a_span_held_once_besides_it_never_swaps_onto_another_lone_span():
    # Moving s would only make [0, 15) the lone span, and the next sweep would move it back.
    stages = [Stage("a", 0, 15), Stage("b", 15, 30)]

    assert spare_moves(stages, [Stage("s", 0, 15)], {"s": 15}, {"a": 0.01, "b": 1.0}) == []
    assert spare_moves(stages, [Stage("s", 0, 15), Stage("t", 0, 15)], {"s": 15, "t": 15}, {"a": 0.01, "b": 1.0}) == [
        SpareMove(Stage("s", 0, 15), Stage("s", 15, 30)),
        SpareMove(Stage("t", 0, 15), Stage("t", 15, 30)),
    ]


def test_spares_follow_the_stage_they_copy_when_the_ring_order_re_spans_a_pipeline():
    before = [(Stage("a", 0, 20), Stage("b", 20, 30))]
    after = [(Stage("b", 0, 10), Stage("a", 10, 30))]

    carried = carry_spares([Stage("s", 20, 30), Stage("t", 0, 20), Stage("u", 0, 5)], before, after)

    assert carried == (Stage("s", 0, 10), Stage("t", 10, 30), Stage("u", 10, 15))


def test_repair_puts_the_spare_holding_a_departed_span_in_its_place_and_moves_nobody():
    survivors = [[Stage("a", 0, 16)], [Stage("c", 0, 16), Stage("d", 16, 30)]]
    spares = [Stage("e", 16, 30), Stage("f", 0, 16)]

    repaired = repair(survivors, spares, 30)

    assert repaired == Repair(
        pipelines=((Stage("a", 0, 16), Stage("e", 16, 30)), (Stage("c", 0, 16), Stage("d", 16, 30))),
        promoted=(Stage("e", 16, 30),),
        spares=(Stage("f", 0, 16),),
    )


def test_repair_tiles_a_gap_of_two_departed_stages_with_two_spares_in_the_order_given():
    survivors = [[Stage("a", 0, 10)]]
    spares = [Stage("late", 10, 30), Stage("p", 10, 20), Stage("q", 20, 30)]

    repaired = repair(survivors, spares[1:] + spares[:1], 30)

    assert repaired.pipelines == ((Stage("a", 0, 10), Stage("p", 10, 20), Stage("q", 20, 30)),)
    assert repaired.spares == (Stage("late", 10, 30),)


def test_repair_gives_up_when_no_spare_holds_the_missing_span_or_nothing_is_left():
    assert repair([[Stage("a", 0, 16)]], [Stage("e", 15, 30), Stage("f", 16, 29)], 30) is None
    assert repair([[Stage("a", 0, 16)], [Stage("c", 0, 16)]], [Stage("e", 16, 30)], 30) is None  # one spare, two gaps
    assert repair([], [Stage("e", 0, 30)], 30) is None


def test_place_keeps_low_reputation_nodes_off_pipelines_when_trusted_ones_suffice():
    nodes = [
        NodeCapacity("big-but-doubtful", 100.0, 12, reputation=0.3),
        NodeCapacity("a", 1.0, 6),
        NodeCapacity("b", 1.0, 6),
    ]

    placement = place(nodes, 12)

    assert placement.pipelines == ((Stage("a", 0, 6), Stage("b", 6, 12)),)
    assert placement.spares == (Stage("big-but-doubtful", 0, 6),)


def test_place_admits_the_most_reputable_doubtful_nodes_only_as_needed():
    nodes = [
        NodeCapacity("a", 1.0, 5),
        NodeCapacity("x", 1.0, 5, reputation=0.4),
        NodeCapacity("y", 1.0, 10, reputation=0.1),
    ]

    placement = place(nodes, 10)

    assert placement.pipelines == ((Stage("a", 0, 5), Stage("x", 5, 10)),)
    assert placement.spares == (Stage("y", 0, 5),)


def test_place_raises_when_no_selection_of_nodes_holds_the_model():
    with pytest.raises(PlacementError):
        place([NodeCapacity("a", 1.0, 5), NodeCapacity("x", 1.0, 4, reputation=0.1)], 10)


def test_place_covers_every_layer_in_every_pipeline_on_a_large_instance():
    rng = random.Random(5)
    nodes = [NodeCapacity(f"n{i:03d}", rng.uniform(1, 100), rng.randint(2, 40), rng.uniform(0, 1)) for i in range(300)]
    caps = {n.node: n.max_layers for n in nodes}

    placement = place(nodes, 80)

    for pipeline in placement.pipelines:
        assert [s.layer_start for s in pipeline] == [0] + [s.layer_end for s in pipeline[:-1]]
        assert pipeline[-1].layer_end == 80
        assert all(s.layers <= caps[s.node] for s in pipeline)
    assert all(s.layers <= caps[s.node] for s in placement.spares)
    hosts = [s.node for s in placement.stages] + [s.node for s in placement.spares]
    assert sorted(hosts) == sorted(caps)


def test_cv_of_per_layer_load_is_population_std_over_mean():
    assert layer_load_cv([2.0, 2.0, 2.0, 2.0]) == 0.0
    assert layer_load_cv([1.0, 3.0]) == 0.5
    assert layer_load_cv([3.0, 5.0]) == 0.25
    assert layer_load_cv([1.0, 1.0, 1.0, 1.4]) == pytest.approx(math.sqrt(0.03) / 1.1, rel=1e-12)


def test_rebalance_only_strictly_above_the_threshold():
    assert needs_rebalance([1.0, 3.0]) is True
    assert needs_rebalance([3.0, 5.0]) is False
    assert needs_rebalance([3.0, 5.0], threshold=0.2) is True
    assert needs_rebalance([1.0, 1.0, 1.0, 1.4]) is False


def test_per_layer_load_is_zero_cv_for_a_proportional_split_and_counts_replicas():
    balanced = [Stage("a", 0, 2), Stage("b", 2, 6)]
    assert per_layer_load(balanced, 6, {"a": 2.0, "b": 4.0}) == [1.0] * 6

    slow_b = per_layer_load(balanced, 6, {"a": 2.0, "b": 2.0})
    assert slow_b == [1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert layer_load_cv(slow_b) == pytest.approx(math.sqrt(2) / 5, rel=1e-12)

    replicated = [*balanced, Stage("c", 0, 6)]
    assert per_layer_load(replicated, 6, {"a": 2.0, "b": 4.0, "c": 6.0}) == [0.5] * 6


def test_per_layer_load_raises_on_an_unhosted_layer():
    with pytest.raises(PlacementError):
        per_layer_load([Stage("a", 0, 2)], 3, {"a": 1.0})
