"""Who stalled a step, decided from what the coordinator saw itself, without sockets
(``worker_agent.coordinator.stalls``): the first stage with no output is relayed its predecessor's
output once, then blamed; stage 0 and star stages are blamed at once; a relayed stage's later
inputs are relayed as they come."""

from __future__ import annotations

import pytest

from worker_agent.coordinator.stalls import Blame, Relay, StallWatch
from worker_agent.protocol import wire

pytestmark = pytest.mark.dataplane

JOB = "job-1"
KEY = ("s0", 0)
ITEM = wire.Item("s0", 0, 0, 2, sig=b"\x07" * 64)
CHUNK = bytes(range(32))  # two f32 rows, 4 wide


def watch(*, ring: bool = True) -> StallWatch:
    stalls = StallWatch(JOB, 3, ring=ring)
    stalls.start(KEY, 100.0)
    return stalls


def relayed(stage: int, item: wire.Item = ITEM) -> Relay:
    return Relay(stage, wire.Forward(JOB, (item,), "f32", (2, 4), CHUNK))


def test_a_stage_whose_predecessor_put_its_output_out_is_relayed_it_once_then_blamed():
    stalls = watch()
    assert stalls.output(0, ITEM, "f32", CHUNK, now=101.0) is None

    first = stalls.stalled(KEY, now=111.0)
    moved = stalls.moved_at(KEY)
    second = stalls.stalled(KEY, now=121.0)

    assert first == relayed(1)  # the predecessor's signed item, as it was tapped
    assert moved == 111.0  # the relayed stage gets a whole stall timeout of its own
    assert second == Blame(1)


def test_stage_zero_had_its_input_from_the_coordinator_and_is_blamed_at_once():
    assert watch().stalled(KEY, now=110.0) == Blame(0)


def test_in_star_the_first_stage_without_output_is_blamed_at_once():
    stalls = watch(ring=False)
    stalls.output(0, ITEM, "f32", CHUNK, now=101.0)

    assert stalls.stalled(KEY, now=111.0) == Blame(1)


def test_a_relayed_stage_that_puts_out_its_part_moves_the_stall_on_to_the_next():
    stalls = watch()
    stalls.output(0, ITEM, "f32", CHUNK, now=101.0)
    stalls.stalled(KEY, now=111.0)
    stalls.output(1, ITEM, "f32", CHUNK, now=112.0)

    assert stalls.moved_at(KEY) == 112.0
    assert stalls.stalled(KEY, now=122.0) == relayed(2)  # stage 2 is relayed in turn, not blamed yet


def test_a_disputed_stage_is_relayed_each_later_output_of_its_predecessor_as_it_comes():
    stalls = watch()
    stalls.output(0, ITEM, "f32", CHUNK, now=101.0)
    stalls.stalled(KEY, now=111.0)
    later = wire.Item("s0", 1, 2, 2)
    stalls.start(("s0", 1), 112.0)

    assert stalls.output(0, later, "f32", CHUNK, now=113.0) == relayed(1, later)
    assert stalls.output(1, later, "f32", CHUNK, now=114.0) is None  # stage 2 is not disputed
    assert stalls.disputed == {1}


def test_an_output_for_a_step_no_longer_in_flight_or_behind_its_progress_changes_nothing():
    stalls = watch()
    stalls.output(1, ITEM, "f32", CHUNK, now=101.0)

    assert stalls.output(0, ITEM, "f32", CHUNK, now=102.0) is None
    assert stalls.moved_at(KEY) == 101.0
    stalls.end(KEY)
    assert stalls.output(2, ITEM, "f32", CHUNK, now=103.0) is None
