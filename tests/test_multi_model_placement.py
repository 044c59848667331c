"""Several models served from one set of nodes: the nodes are shared among SWARM_MODELS (every
model first gets the nodes for one complete pipeline, the rest follow demand), each model is placed
over its own share, and a node moving from one model to another keeps serving its old model until
that model is servable without it.

smollm2-135m has 30 layers and tiny-llama 6; every node here holds 15 layers, so smollm2 needs two
nodes for a pipeline and tiny-llama one. Nodes differ in speed so that every choice is determined.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.jobs.demand import recent_demand, share_nodes_by_demand
from marketplace.jobs.models import Job
from marketplace.nodes.models import Node
from marketplace.placement import placing, readiness, rebalancing
from marketplace.placement.models import Assignment, AssignmentState, PlacementState
from marketplace.placement.selectors import servable_pipelines
from worker_agent.protocol import control_protocol as protocol

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures"]

SMOL, TINY = "smollm2-135m", "tiny-llama"
LIVE = (AssignmentState.ASSIGNED, AssignmentState.READY)


@pytest.fixture
def two_models(swarm_settings):
    swarm_settings.SWARM_MODELS = [SMOL, TINY]
    swarm_settings.SWARM_REBALANCE_MIN_INTERVAL_S = 60.0
    swarm_settings.SWARM_DEMAND_SHIFT = 0.25
    swarm_settings.SWARM_DEMAND_WINDOW_S = 600.0
    return swarm_settings


@pytest.fixture
def make_nodes(provider, make_joined_node, measure_ring, two_models):
    """Nodes named by the given names, each holding 15 layers, at the given speeds; every link near
    in the order given (so each pipeline's ring follows that order)."""

    def make(**speeds: float) -> dict:
        nodes = {
            name: make_joined_node(provider, name, compute=speed, max_layers=15).node for name, speed in speeds.items()
        }
        measure_ring(list(nodes.values()))
        return nodes

    return make


def holders() -> dict[str, list[str]]:
    """Model -> names of the nodes holding a live block of it."""
    held: dict[str, list[str]] = {SMOL: [], TINY: []}
    for model, name in (
        Assignment.objects.filter(state__in=LIVE).order_by("node__name").values_list("model", "node__name")
    ):
        held[model].append(name)
    return held


def shares() -> dict[str, list[str]]:
    """Model -> names of the nodes of its share."""
    states = {s.model: set(s.share) for s in PlacementState.objects.all()}
    return {
        model: sorted(n.name for n in Node.objects.all() if n.node_id in states.get(model, set()))
        for model in (SMOL, TINY)
    }


def report_ready() -> None:
    for a in Assignment.objects.filter(state=AssignmentState.ASSIGNED).order_by("pk"):
        readiness.assignment_ready(a.node_id, a.pk, f"ws://127.0.0.1:{9000 + a.node_id}")


def settle(capture, rounds: int = 4) -> None:
    """Run the sweep's placement and let every pushed block report ready, until nothing is dirty."""
    for _ in range(rounds):
        with capture(execute=True):
            placing.place_dirty_models()
            report_ready()
        if not PlacementState.objects.filter(dirty=True).exists():
            return
    raise AssertionError(f"still dirty after {rounds} sweeps: {list(PlacementState.objects.filter(dirty=True))}")


def sent(pushed, node) -> list[dict]:
    return [message for group, message in pushed.messages if group == f"node.{node.node_id}"]


def live_block(node, model: str) -> Assignment:
    return Assignment.objects.get(node=node, model=model, state__in=LIVE)


def test_with_no_demand_both_models_get_a_pipeline_and_the_rest_goes_by_layer_count(
    make_nodes, pushed, django_capture_on_commit_callbacks
):
    make_nodes(a=400.0, b=300.0, c=200.0, d=100.0)
    rebalancing.mark_dirty()

    settle(django_capture_on_commit_callbacks)

    # Floors: smollm2 the two fastest (a, b), tiny-llama the next (c). The last node goes where the
    # work is: with no demand each model weighs its layers, 30 against 6.
    assert shares() == {SMOL: ["a", "b", "d"], TINY: ["c"]}
    assert holders() == {SMOL: ["a", "b", "d"], TINY: ["c"]}
    assert [[s.layer_start, s.layer_end] for s in servable_pipelines(SMOL)[0]] == [[0, 15], [15, 26], [26, 30]]
    assert [[s.layer_start, s.layer_end] for s in servable_pipelines(TINY)[0]] == [[0, 6]]


def test_demand_for_one_model_gives_it_more_nodes_and_the_other_keeps_its_floor(
    make_nodes, pushed, django_capture_on_commit_callbacks
):
    nodes = make_nodes(a=500.0, b=400.0, c=300.0, d=200.0, e=100.0)
    rebalancing.mark_dirty()
    settle(django_capture_on_commit_callbacks)
    assert holders() == {SMOL: ["a", "b", "d", "e"], TINY: ["c"]}

    changed = rebalancing.share_by_demand({TINY: 50_000, SMOL: 0})
    settle(django_capture_on_commit_callbacks)

    assert changed == [SMOL, TINY]
    assert shares() == {SMOL: ["a", "b"], TINY: ["c", "d", "e"]}
    assert holders() == {SMOL: ["a", "b"], TINY: ["c", "d", "e"]}
    assert [[s.node for s in p] for p in servable_pipelines(SMOL)] == [[nodes["a"].node_id, nodes["b"].node_id]]
    assert len(servable_pipelines(TINY)) == 3  # one pipeline per node: tiny-llama fits on each


def test_a_moving_node_keeps_serving_its_old_model_until_that_model_is_servable_without_it(
    make_nodes, pushed, django_capture_on_commit_callbacks
):
    nodes = make_nodes(a=400.0, b=300.0, c=200.0, d=100.0)
    rebalancing.mark_dirty()
    settle(django_capture_on_commit_callbacks)
    old_b, old_d = live_block(nodes["b"], SMOL), live_block(nodes["d"], SMOL)
    pushed.events.clear()

    # Demand moves to tiny-llama: d leaves smollm2's three-stage pipeline; a and b must hold all of it.
    assert rebalancing.share_by_demand({TINY: 50_000, SMOL: 0}) == [SMOL, TINY]
    with django_capture_on_commit_callbacks(execute=True):
        placing.place_dirty_models()

    new_b = live_block(nodes["b"], SMOL)
    assert (new_b.layer_start, new_b.layer_end, new_b.state) == (15, 30, AssignmentState.ASSIGNED)
    assert new_b.supersedes_id == old_b.pk
    # d's block of smollm2 stays live and routable, as a spare: smollm2 has no pipeline without it yet.
    held = live_block(nodes["d"], SMOL)
    assert (held.pk, held.state, held.is_spare, held.layer_start, held.layer_end) == (
        old_d.pk,
        AssignmentState.READY,
        True,
        26,
        30,
    )
    assert sent(pushed, nodes["d"]) == []  # neither released nor given tiny-llama yet
    assert holders() == {SMOL: ["a", "b", "d"], TINY: ["c"]}
    assert servable_pipelines(SMOL) == []  # b is loading its new span

    with django_capture_on_commit_callbacks(execute=True):
        assert readiness.assignment_ready(nodes["b"].pk, new_b.pk, "ws://127.0.0.1:9902") is True

    # smollm2 is servable on a and b: d's block goes (the agent unloads it once its jobs end) ...
    assert [[s.node for s in p] for p in servable_pipelines(SMOL)] == [[nodes["a"].node_id, nodes["b"].node_id]]
    assert sent(pushed, nodes["d"]) == [{"type": "release", "assignment": old_d.pk, "model": SMOL}]
    assert PlacementState.objects.get(model=TINY).dirty is True
    pushed.events.clear()

    # ... and tiny-llama is placed with it at the next sweep.
    with django_capture_on_commit_callbacks(execute=True):
        placing.place_dirty_models()

    tiny_d = live_block(nodes["d"], TINY)
    assert sent(pushed, nodes["d"]) == [protocol.to_wire(tiny_d.as_message())]
    assert holders() == {SMOL: ["a", "b"], TINY: ["c", "d"]}


def test_a_moving_node_is_let_go_at_once_when_its_old_model_keeps_another_pipeline(
    make_nodes, pushed, django_capture_on_commit_callbacks
):
    nodes = make_nodes(a=500.0, b=400.0, c=300.0, d=200.0, e=100.0)
    start = timezone.now()
    rebalancing.share_by_demand({TINY: 50_000, SMOL: 0}, now=start)
    rebalancing.mark_dirty()
    settle(django_capture_on_commit_callbacks)
    assert holders() == {SMOL: ["b", "c"], TINY: ["a", "d", "e"]}  # tiny-llama: three one-node pipelines
    tiny_d, tiny_e = live_block(nodes["d"], TINY), live_block(nodes["e"], TINY)
    pushed.events.clear()

    assert rebalancing.share_by_demand({SMOL: 50_000, TINY: 0}, now=start + timedelta(seconds=61)) == [SMOL, TINY]
    with django_capture_on_commit_callbacks(execute=True):
        placing.place_dirty_models()

    # tiny-llama keeps its pipeline on a: d and e are released at once, and smollm2 will take them.
    assert Assignment.objects.get(pk=tiny_d.pk).state == AssignmentState.RELEASED
    assert sent(pushed, nodes["d"]) == [{"type": "release", "assignment": tiny_d.pk, "model": TINY}]
    assert sent(pushed, nodes["e"]) == [{"type": "release", "assignment": tiny_e.pk, "model": TINY}]
    assert [[s.node for s in p] for p in servable_pipelines(TINY)] == [[nodes["a"].node_id]]

    settle(django_capture_on_commit_callbacks)

    assert holders() == {SMOL: ["b", "c", "d", "e"], TINY: ["a"]}
    assert len(servable_pipelines(SMOL)) == 2


def test_with_too_few_nodes_for_every_floor_the_model_with_the_most_demand_is_served(
    make_nodes, pushed, django_capture_on_commit_callbacks
):
    nodes = make_nodes(a=400.0, b=300.0)  # smollm2 needs both: no node is left for tiny-llama
    start = timezone.now()
    rebalancing.mark_dirty()
    settle(django_capture_on_commit_callbacks)

    # No demand: the first model of SWARM_MODELS is served.
    assert holders() == {SMOL: ["a", "b"], TINY: []}
    assert PlacementState.objects.get(model=TINY).note == (
        "no active node of its share of the nodes can hold a layer of this model"
    )
    old_a, old_b = live_block(nodes["a"], SMOL), live_block(nodes["b"], SMOL)
    pushed.events.clear()

    rebalancing.share_by_demand({TINY: 1_000, SMOL: 0}, now=start)
    settle(django_capture_on_commit_callbacks)

    # Demand for tiny-llama only: it is served, and smollm2's blocks go (their jobs in flight end first).
    assert shares() == {SMOL: [], TINY: ["a", "b"]}
    assert holders() == {SMOL: [], TINY: ["a", "b"]}
    assert sent(pushed, nodes["a"])[0] == {"type": "release", "assignment": old_a.pk, "model": SMOL}
    assert sent(pushed, nodes["b"])[0] == {"type": "release", "assignment": old_b.pk, "model": SMOL}
    assert len(servable_pipelines(TINY)) == 2
    assert servable_pipelines(SMOL) == []


def test_demand_moves_nodes_only_past_the_threshold_and_at_most_once_per_interval(
    make_nodes, pushed, django_capture_on_commit_callbacks
):
    make_nodes(a=400.0, b=300.0, c=200.0, d=100.0)
    rebalancing.mark_dirty()
    settle(django_capture_on_commit_callbacks)
    start = timezone.now()
    assert shares() == {SMOL: ["a", "b", "d"], TINY: ["c"]}

    # As many tokens of each: the work (tokens x layers) is split as with no demand, 30 to 6.
    assert rebalancing.share_by_demand({SMOL: 1_000, TINY: 1_000}, now=start) == []
    assert list(PlacementState.objects.order_by("model").values_list("demand", "shared_at")) == [(0.0, None)] * 2

    # tiny-llama's fraction of the work moves from 1/6 to 0.22 (+31 %): past the threshold, but the
    # new split moves no node. The demand is kept as the reference for the next shift.
    assert rebalancing.share_by_demand({SMOL: 1_000, TINY: 1_400}, now=start) == []
    assert shares() == {SMOL: ["a", "b", "d"], TINY: ["c"]}
    assert dict(PlacementState.objects.values_list("model", "demand")) == {SMOL: 1_000.0, TINY: 1_400.0}

    # Within 25 % of that reference: nothing moves, whatever the split would be.
    assert rebalancing.share_by_demand({SMOL: 1_000, TINY: 1_700}, now=start) == []

    # Demand moves to tiny-llama: d follows it.
    assert rebalancing.share_by_demand({SMOL: 100, TINY: 50_000}, now=start) == [SMOL, TINY]
    assert shares() == {SMOL: ["a", "b"], TINY: ["c", "d"]}

    # Demand moving back within SWARM_REBALANCE_MIN_INTERVAL_S moves nothing; after it, it does.
    assert rebalancing.share_by_demand({SMOL: 50_000, TINY: 100}, now=start + timedelta(seconds=59)) == []
    assert shares() == {SMOL: ["a", "b"], TINY: ["c", "d"]}
    assert rebalancing.share_by_demand({SMOL: 50_000, TINY: 100}, now=start + timedelta(seconds=60)) == [SMOL, TINY]
    assert shares() == {SMOL: ["a", "b", "d"], TINY: ["c"]}


def test_demand_is_the_tokens_of_each_models_jobs_over_the_window(customer, two_models):
    now = timezone.now()

    def job(n: int, model: str, prompt: int, completion: int, age_s: float) -> None:
        created = Job.objects.create(
            public_id=f"chatcmpl-{n}",
            kind="chat",
            customer=customer,
            model=model,
            prompt_tokens=prompt,
            completion_tokens=completion,
        )
        Job.objects.filter(pk=created.pk).update(created_at=now - timedelta(seconds=age_s))

    job(1, TINY, 100, 20, age_s=10)
    job(2, TINY, 7, 3, age_s=599)
    job(3, TINY, 5_000, 5_000, age_s=601)  # outside the window
    job(4, SMOL, 40, 2, age_s=0)
    job(5, "tiny-llama-seed1", 999, 0, age_s=0)  # not a served model

    assert recent_demand(now) == {SMOL: 42, TINY: 130}


def test_the_sweep_shares_the_nodes_by_the_demand_of_its_jobs(customer, make_nodes):
    make_nodes(a=400.0, b=300.0, c=200.0, d=100.0)
    rebalancing.mark_dirty()
    placing.place_dirty_models()
    Job.objects.create(public_id="chatcmpl-1", kind="chat", customer=customer, model=TINY, prompt_tokens=9_000)

    assert share_nodes_by_demand() == [SMOL, TINY]

    assert shares() == {SMOL: ["a", "b"], TINY: ["c", "d"]}
    assert share_nodes_by_demand() == []  # within SWARM_REBALANCE_MIN_INTERVAL_S: the jobs are not even read


def test_one_model_served_takes_every_node(provider, make_joined_node, swarm_settings):
    swarm_settings.SWARM_MODELS = [TINY]
    for name in ("a", "b", "c"):
        make_joined_node(provider, name, max_layers=6)

    placed = placing.place_model(TINY)

    assert sorted(a.node.name for a in placed) == ["a", "b", "c"]
    assert PlacementState.objects.get(model=TINY).share == []  # nothing to share: no share kept


def test_a_model_added_to_a_running_swarm_takes_its_floor_from_the_first(
    make_nodes, two_models, pushed, django_capture_on_commit_callbacks
):
    two_models.SWARM_MODELS = [SMOL]
    make_nodes(a=400.0, b=300.0, c=200.0, d=100.0)
    rebalancing.mark_dirty()
    settle(django_capture_on_commit_callbacks)
    assert holders() == {SMOL: ["a", "b", "c", "d"], TINY: []}

    two_models.SWARM_MODELS = [SMOL, TINY]
    rebalancing.mark_dirty(TINY)
    settle(django_capture_on_commit_callbacks)

    assert holders() == {SMOL: ["a", "b", "d"], TINY: ["c"]}
    assert len(servable_pipelines(SMOL)) == 1
    assert len(servable_pipelines(TINY)) == 1


def test_a_share_recorded_for_the_nodes_a_model_already_holds_places_nothing_again(
    make_nodes, two_models, pushed, django_capture_on_commit_callbacks
):
    two_models.SWARM_MODELS = [SMOL]
    make_nodes(a=400.0, b=300.0)
    rebalancing.mark_dirty()
    settle(django_capture_on_commit_callbacks)
    generation = PlacementState.objects.get(model=SMOL).generation
    pushed.events.clear()

    two_models.SWARM_MODELS = [SMOL, TINY]  # too few nodes for tiny-llama's floor as well
    with django_capture_on_commit_callbacks(execute=True):
        placing.place_dirty_models()

    assert shares() == {SMOL: ["a", "b"], TINY: []}
    assert PlacementState.objects.get(model=SMOL).generation == generation
    assert pushed.messages == []
    assert holders() == {SMOL: ["a", "b"], TINY: []}


def test_a_third_model_added_to_two_sharing_the_nodes_gets_its_floor_at_the_next_sweep(
    make_nodes, two_models, pushed, django_capture_on_commit_callbacks
):
    third = "tiny-llama-seed1"  # tiny-llama's shape (6 layers): one node makes its pipeline
    make_nodes(a=400.0, b=300.0, c=200.0, d=100.0)
    rebalancing.mark_dirty()
    settle(django_capture_on_commit_callbacks)
    assert shares() == {SMOL: ["a", "b", "d"], TINY: ["c"]}

    two_models.SWARM_MODELS = [SMOL, TINY, third]  # no node joined or left
    rebalancing.mark_dirty(third)
    settle(django_capture_on_commit_callbacks)

    held = dict(Assignment.objects.filter(state__in=LIVE, model=third).values_list("node__name", "model"))
    assert held == {"d": third}  # smollm2 keeps its floor (a, b), tiny-llama its own (c)
    assert len(servable_pipelines(third)) == 1
    assert len(servable_pipelines(SMOL)) == 1 and len(servable_pipelines(TINY)) == 1
