"""Sharing nodes among models (``placement.sharing``, pure): floors first, the rest by work, stable
under small changes, and demand shifts measured against the demand the last split was made for."""

from __future__ import annotations

import pytest

from marketplace.placement.errors import PlacementError
from marketplace.placement.sharing import ModelDemand, NodeOffer, demand_moved, share, work

pytestmark = pytest.mark.control

BIG = ModelDemand("big", 30)
SMALL = ModelDemand("small", 6)


def node(name: str, speed: float, layers: int = 15, current: str | None = None, **caps: int) -> NodeOffer:
    return NodeOffer(name, speed, {"big": caps.get("big", layers), "small": caps.get("small", layers)}, current)


def by_model(given: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, model in sorted(given.items()):
        out.setdefault(model, []).append(name)
    return out


def test_with_no_demand_each_model_weighs_its_layers():
    assert work([BIG, SMALL]) == {"big": 30.0, "small": 6.0}
    assert work([ModelDemand("big", 30, 10), ModelDemand("small", 6, 100)]) == {"big": 300.0, "small": 600.0}
    assert work([ModelDemand("big", 30, 10), SMALL]) == {"big": 300.0, "small": 0.0}


def test_every_model_gets_a_floor_then_the_rest_follows_the_work():
    nodes = [node(n, s) for n, s in (("a", 400), ("b", 300), ("c", 200), ("d", 100), ("e", 100))]

    assert by_model(share([BIG, SMALL], nodes)) == {"big": ["a", "b", "d", "e"], "small": ["c"]}
    asked = [ModelDemand("big", 30, 0), ModelDemand("small", 6, 1_000)]
    assert by_model(share(asked, nodes)) == {"big": ["b", "c"], "small": ["a", "d", "e"]}


def test_a_node_stays_with_its_model_while_half_of_it_fits_under_the_models_target():
    # Equal work: targets of half the speed each (1050). big's floor is a; b (400) keeps it under;
    # c (200) would take big 100 past the target, more than half of c: it goes to small.
    nodes = [node("a", 600, 30, "big"), node("b", 400, 30, "big"), node("c", 200, 30, "big"), node("d", 900, 30)]
    asked = [ModelDemand("big", 30, 10), ModelDemand("small", 30, 10)]

    assert by_model(share(asked, nodes)) == {"big": ["a", "b"], "small": ["c", "d"]}
    nodes[3] = node("d", 1200, 30)  # targets of 1200: c fits under big's, half of it at least
    assert by_model(share(asked, nodes)) == {"big": ["a", "b", "c"], "small": ["d"]}


def test_too_few_nodes_for_every_floor_serve_models_by_demand_then_in_the_order_given():
    nodes = [node("a", 400), node("b", 300)]

    assert by_model(share([BIG, SMALL], nodes)) == {"big": ["a", "b"]}
    assert by_model(share([SMALL, BIG], nodes)) == {"small": ["a", "b"]}
    asked = [BIG, ModelDemand("small", 6, 1)]
    assert by_model(share(asked, nodes)) == {"small": ["a", "b"]}


def test_a_model_that_cannot_be_covered_leaves_its_nodes_to_the_others():
    nodes = [node("a", 400, big=10), node("b", 300, big=10)]  # 20 of big's 30 layers

    assert by_model(share([BIG, SMALL], nodes)) == {"small": ["a", "b"]}


def test_floors_keep_a_models_own_nodes_unless_that_leaves_another_model_without_one():
    # big holds a and b; c alone also holds big whole. Keeping a and b costs nothing.
    nodes = [node("a", 100, 15, "big"), node("b", 100, 15, "big"), node("c", 500, 30), node("d", 50, 6)]
    assert by_model(share([BIG, SMALL], nodes))["big"][:2] == ["a", "b"]

    # Only a can hold small: big keeping a would leave small without a floor, so big takes b + c.
    nodes = [node("a", 100, 15, "big"), node("b", 100, 15, "big", small=0), node("c", 500, 15, small=0)]
    assert by_model(share([BIG, SMALL], nodes)) == {"big": ["b", "c"], "small": ["a"]}


def test_a_node_that_holds_no_layer_of_any_served_model_is_left_out():
    nodes = [node("a", 400, 30), node("b", 300, 30), node("z", 900, 0)]

    assert sorted(share([BIG, SMALL], nodes)) == ["a", "b"]


def test_demand_moved_measures_each_models_fraction_of_the_work_against_what_it_was():
    before = {"big": 30.0, "small": 6.0}  # small: 1/6 of the work

    assert demand_moved(before, {"big": 3000.0, "small": 600.0}, 0.25) is False  # the same mix
    assert demand_moved(before, {"big": 30.0, "small": 7.6}, 0.25) is False  # small: 0.202, +21 %
    assert demand_moved(before, {"big": 30.0, "small": 8.4}, 0.25) is True  # small: 0.219, +31 %
    assert demand_moved({"big": 1.0, "small": 0.0}, {"big": 1.0, "small": 0.01}, 0.25) is True
    assert demand_moved({"big": 0.0, "small": 0.0}, {"big": 0.0, "small": 0.0}, 0.25) is False


def test_bad_inputs_are_refused():
    with pytest.raises(PlacementError, match="speed must be finite and > 0"):
        NodeOffer("a", 0.0)
    with pytest.raises(PlacementError, match="demand must be finite and >= 0"):
        ModelDemand("big", 30, -1)
    with pytest.raises(PlacementError, match="a model is listed twice"):
        share([BIG, BIG], [node("a", 1)])
    with pytest.raises(PlacementError, match="duplicate node ids"):
        share([BIG], [node("a", 1), node("a", 2)])
