"""Per-session KV caches: limits, idle eviction with an injected clock, buffers and truncation."""

from __future__ import annotations

import pytest
import torch

from worker_agent.errors import SessionError
from worker_agent.kvcache import MIN_CAPACITY, KVLayout, KVMemory, KVSession, SessionLimits, SessionStore
from worker_agent.protocol.control_protocol import MEMORY_FRACTION

pytestmark = pytest.mark.dataplane


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _store(**limits) -> tuple[SessionStore, FakeClock]:
    clock = FakeClock()
    return SessionStore(SessionLimits(**limits), clock=clock), clock


def _code(call, *args) -> str:
    with pytest.raises(SessionError) as err:
        call(*args)
    return err.value.code


LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))


def _fill(kv: KVSession, positions: int) -> None:
    """Put ``positions`` distinct keys/values into every layer, as a forward pass would:
    position p of layer l holds p + l in its keys and -(p + l) in its values."""
    kv.reserve(positions, LAYOUT)
    for layer in range(LAYOUT.layers):
        keys = torch.arange(positions, dtype=torch.float32).view(1, positions, 1) + layer  # (1, positions, 1)
        kv.keys[layer][:, :positions] = keys
        kv.values[layer][:, :positions] = -keys
    kv.length = positions


def _held_keys(kv: KVSession, layer: int) -> list[float]:
    """The first key component of head 0 at every held position of a layer."""
    return kv.keys[layer][0, : kv.length, 0].tolist()


# --- limits -------------------------------------------------------------------------------


def test_refuses_a_session_over_max_sessions_and_changes_nothing():
    store, _ = _store(max_sessions=2)
    first, second = store.open("job-1", "s0"), store.open("job-1", "s1")

    code = _code(store.open, "job-1", "s2")

    assert code == "too_many_sessions"
    assert len(store) == 2
    assert (store.get("job-1", "s0"), store.get("job-1", "s1")) == (first, second)
    assert _code(store.get, "job-1", "s2") == "unknown_session"


def test_a_closed_session_frees_its_slot():
    store, _ = _store(max_sessions=1)
    store.open("job-1", "s0")
    store.close("job-1", "s0")

    kv = store.open("job-1", "s1")

    assert (len(store), kv.session) == (1, "s1")


def test_refuses_a_step_past_max_tokens_and_allows_one_up_to_it():
    store, _ = _store(max_tokens=8)
    kv = store.open("job-1", "s0")
    _fill(kv, 5)

    code = _code(store.check_room, kv, 5, 4)
    store.check_room(kv, 5, 3)

    assert code == "session_too_long"
    assert kv.length == 5


def test_refuses_a_step_that_leaves_a_gap_in_positions():
    store, _ = _store()
    kv = store.open("job-1", "s0")
    _fill(kv, 3)

    code = _code(store.check_room, kv, 4, 1)
    store.check_room(kv, 3, 1)
    store.check_room(kv, 1, 1)  # below the length: a truncation, allowed

    assert code == "position_gap"
    assert kv.length == 3


def test_refuses_opening_an_open_session_twice():
    store, _ = _store()
    kv = store.open("job-1", "s0")
    _fill(kv, 2)

    code = _code(store.open, "job-1", "s0")

    assert code == "session_exists"
    assert store.get("job-1", "s0") is kv
    assert kv.length == 2


def test_refuses_reopening_a_closed_session():
    store, _ = _store()
    store.open("job-1", "s0")
    store.close("job-1", "s0")

    code = _code(store.open, "job-1", "s0")

    assert code == "session_reused"
    assert len(store) == 0


def test_the_same_session_id_in_another_job_is_another_session():
    store, _ = _store()
    a = store.open("job-a", "s0")
    _fill(a, 4)

    b = store.open("job-b", "s0")

    assert b is not a
    assert (store.get("job-a", "s0").length, store.get("job-b", "s0").length) == (4, 0)


@pytest.mark.parametrize(
    "limits", [{"max_sessions": 0}, {"max_tokens": 0}, {"idle_timeout_s": 0}, {"idle_timeout_s": -1.0}]
)
def test_session_limits_must_be_positive(limits):
    with pytest.raises(ValueError):
        SessionLimits(**limits)


# --- idle eviction ------------------------------------------------------------------------


def test_an_idle_session_is_evicted_and_then_reported_as_evicted_not_unknown():
    store, clock = _store(idle_timeout_s=300)
    kv = store.open("job-1", "s0")
    clock.now += 300.5

    evicted = store.evict_idle()

    assert evicted == [kv]
    assert len(store) == 0
    with pytest.raises(SessionError) as err:
        store.get("job-1", "s0")
    assert err.value.code == "session_evicted"
    assert str(err.value) == "session 's0' of job 'job-1' was evicted after idling 300s"
    assert _code(store.get, "job-1", "never-opened") == "unknown_session"


def test_a_session_idle_exactly_the_timeout_is_kept():
    store, clock = _store(idle_timeout_s=300)
    store.open("job-1", "s0")
    clock.now += 300

    assert store.evict_idle() == []
    assert len(store) == 1


def test_using_a_session_resets_its_idle_timer():
    store, clock = _store(idle_timeout_s=300)
    used, unused = store.open("job-1", "used"), store.open("job-1", "unused")
    clock.now += 200
    store.get("job-1", "used")
    clock.now += 200

    evicted = store.evict_idle()

    assert evicted == [unused]
    assert store.get("job-1", "used") is used
    assert used.last_used == 1400.0


def test_opening_evicts_idle_sessions_before_applying_max_sessions():
    store, clock = _store(max_sessions=1, idle_timeout_s=60)
    store.open("job-1", "old")
    clock.now += 61

    new = store.open("job-1", "new")

    assert len(store) == 1
    assert store.get("job-1", "new") is new
    assert _code(store.get, "job-1", "old") == "session_evicted"


def test_a_closed_session_reads_as_closed():
    store, _ = _store()
    store.open("job-1", "s0")
    store.close("job-1", "s0")

    with pytest.raises(SessionError) as err:
        store.get("job-1", "s0")

    assert (err.value.code, str(err.value)) == ("session_evicted", "session 's0' of job 'job-1' was closed")


def test_close_job_closes_only_that_jobs_sessions():
    store, _ = _store()
    a0, a1 = store.open("job-a", "s0"), store.open("job-a", "s1")
    b0 = store.open("job-b", "s0")

    closed = store.close_job("job-a")

    assert closed == [a0, a1]
    assert len(store) == 1
    assert store.get("job-b", "s0") is b0
    assert _code(store.get, "job-a", "s1") == "session_evicted"


def test_the_oldest_evicted_ids_are_forgotten_past_the_memory_bound():
    store, _ = _store()
    store._FORGET_AFTER = 2
    for name in ("s0", "s1", "s2"):
        store.open("job-1", name)
        store.close("job-1", name)

    assert [_code(store.get, "job-1", name) for name in ("s0", "s1", "s2")] == [
        "unknown_session",
        "session_evicted",
        "session_evicted",
    ]


# --- buffers ------------------------------------------------------------------------------


def test_an_opened_session_holds_no_buffers_until_it_computes():
    store, _ = _store()

    sessions = [store.open("job-1", f"s{i}") for i in range(64)]

    assert [(kv.capacity, kv.keys, kv.values, kv.layout) for kv in sessions] == [(0, [], [], None)] * 64


def test_the_first_reservation_allocates_the_minimum_capacity_per_layer():
    kv = KVSession("job-1", "s0")

    kv.reserve(3, LAYOUT)

    assert kv.capacity == MIN_CAPACITY == 64
    assert [tuple(t.shape) for t in kv.keys + kv.values] == [(2, 64, 4)] * 4
    assert {(t.dtype, t.device.type) for t in kv.keys + kv.values} == {(torch.float32, "cpu")}
    assert (kv.length, kv.layout) == (0, LAYOUT)


def test_growing_doubles_the_capacity_and_keeps_the_held_positions():
    kv = KVSession("job-1", "s0")
    _fill(kv, 64)

    kv.reserve(65, LAYOUT)

    assert (kv.capacity, kv.length) == (128, 64)
    for layer in range(2):
        assert _held_keys(kv, layer) == [float(p + layer) for p in range(64)]
        assert kv.values[layer][1, :64, 3].tolist() == [-float(p + layer) for p in range(64)]


def test_a_reservation_within_the_capacity_keeps_the_same_buffers():
    kv = KVSession("job-1", "s0")
    _fill(kv, 10)
    buffers = kv.keys + kv.values

    kv.reserve(64, LAYOUT)

    assert all(new is old for new, old in zip(kv.keys + kv.values, buffers, strict=True))


def test_growing_never_passes_the_session_limit_nor_falls_short_of_the_request():
    capped, large = KVSession("job-1", "s0", max_tokens=100), KVSession("job-1", "s1")
    _fill(capped, 64)

    capped.reserve(65, LAYOUT)
    large.reserve(300, LAYOUT)

    assert (capped.capacity, large.capacity) == (100, 300)


def test_the_store_opens_sessions_bounded_by_its_position_limit():
    store, _ = _store(max_tokens=40)
    kv = store.open("job-1", "s0")

    kv.reserve(1, LAYOUT)

    assert (kv.max_tokens, kv.capacity) == (40, 40)


def test_refuses_a_reservation_for_another_layout_and_keeps_the_buffers():
    kv = KVSession("job-1", "s0")
    _fill(kv, 5)
    other = KVLayout(layers=2, kv_heads=2, head_dim=4, dtype=torch.bfloat16, device=torch.device("cpu"))

    with pytest.raises(ValueError):
        kv.reserve(80, other)

    assert (kv.layout, kv.capacity, kv.length) == (LAYOUT, 64, 5)
    assert _held_keys(kv, 1) == [1.0, 2.0, 3.0, 4.0, 5.0]


# --- truncation ---------------------------------------------------------------------------


@pytest.mark.parametrize("position", [5, 1])
def test_truncate_keeps_exactly_the_positions_below(position):
    kv = KVSession("job-1", "s0")
    _fill(kv, 8)

    kv.truncate(position)

    assert kv.length == position
    for layer in range(2):
        assert _held_keys(kv, layer) == [float(p + layer) for p in range(position)]


def test_truncate_keeps_the_buffers_for_later_steps_to_overwrite():
    kv = KVSession("job-1", "s0")
    _fill(kv, 8)
    buffers = kv.keys + kv.values

    kv.truncate(0)

    assert (kv.length, kv.capacity) == (0, 64)
    assert all(new is old for new, old in zip(kv.keys + kv.values, buffers, strict=True))


@pytest.mark.parametrize("position", [8, 9])
def test_truncate_at_or_past_the_length_changes_nothing(position):
    kv = KVSession("job-1", "s0")
    _fill(kv, 8)

    kv.truncate(position)

    assert kv.length == 8
    assert _held_keys(kv, 0) == [float(p) for p in range(8)]


# LAYOUT costs 2 (K, V) x 2 layers x 2 heads x 4 dims x 4 bytes = 128 bytes per position.
POSITION = 128


def test_a_session_grows_into_the_memory_it_is_granted_and_no_further():
    memory = KVMemory(1000 * POSITION)
    memory.charge(200 * POSITION)  # a block's weights
    store = SessionStore(SessionLimits(max_tokens=4096), memory=memory)
    kv = store.open("job", "s0")

    kv.reserve(500, LAYOUT)
    kv.reserve(501, LAYOUT)  # doubling wants 1000 positions; 800 are left: exactly 501 fit

    assert (kv.capacity, memory.caches, memory.free) == (501, 501 * POSITION, 299 * POSITION)
    assert _code(kv.reserve, 801, LAYOUT) == "kv_memory_full"
    assert kv.capacity == 501  # a refused growth keeps what the session held
    store.close("job", "s0")
    assert (memory.caches, memory.free) == (0, 800 * POSITION)


def test_a_step_the_memory_cannot_hold_is_refused_before_it_runs():
    memory = KVMemory(300 * POSITION)
    store = SessionStore(SessionLimits(), memory=memory)
    first, second = store.open("job", "s0"), store.open("job", "s1")
    first.reserve(200, LAYOUT)

    assert store.check_room(second, 0, 100, position_bytes=POSITION) == 100 * POSITION
    assert _code(lambda: store.check_room(second, 0, 101, position_bytes=POSITION)) == "kv_memory_full"
    store.evict_idle()
    assert memory.caches == 200 * POSITION  # only closing or evicting a session gives its memory back


def test_an_agent_holds_its_caches_in_the_planned_share_of_the_memory_it_reports():
    assert KVMemory.of(1000, MEMORY_FRACTION).budget == int(1000 * MEMORY_FRACTION) == 800
    with pytest.raises(ValueError):
        KVMemory(-1)
