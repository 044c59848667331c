"""The layer block on tiny-llama, in-process: truncation, batching, partial loading.

Outputs computed along different paths (one long prefill vs a shorter one, a padded batch vs
one session alone) are equal in exact arithmetic but not bit for bit in float32. The seeded
tiny-llama has hidden states of magnitude ~100 (initializer_range 0.3), where one float32 ulp
is ~8e-6, so an absolute 1e-5 is below what six layers of float32 can hold. ``_assert_close``
therefore allows 1e-5 of the output's largest magnitude (rtol=0): about one ulp at the
top of the range, orders of magnitude below what a masking or cache bug produces.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from worker_agent import model as models
from worker_agent.block import Block, WorkItem
from worker_agent.errors import ModelError
from worker_agent.kvcache import SessionLimits, SessionStore

pytestmark = pytest.mark.dataplane

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def block() -> Block:
    return Block(models.load_block(MODEL, 0, 6))


@pytest.fixture
def store() -> SessionStore:
    return SessionStore(SessionLimits())


@pytest.fixture(scope="module")
def inputs() -> torch.Tensor:
    """Hidden states of 24 made-up tokens. (tokens, hidden)"""
    return torch.randn(24, 64, generator=torch.Generator().manual_seed(0))


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def _count_batched_runs(monkeypatch) -> list[int]:
    """Record the batch size of every padded-batch run the block makes."""
    sizes: list[int] = []
    original = Block._run_batch

    def spy(self, items):
        sizes.append(len(items))
        return original(self, items)

    monkeypatch.setattr(Block, "_run_batch", spy)
    return sizes


# --- truncation ---------------------------------------------------------------------------


def test_running_below_the_session_length_equals_a_fresh_session_fed_the_same_prefix(block, store, inputs):
    # Given a session that holds 8 positions and another that holds only the first 5
    long, short = store.open("job-1", "long"), store.open("job-1", "short")
    block.forward([WorkItem(long, 0, inputs[:8])])
    block.forward([WorkItem(short, 0, inputs[:5])])

    # When both run the same 3 new tokens at position 5
    (after_truncation,) = block.forward([WorkItem(long, 5, inputs[10:13])])
    (fresh,) = block.forward([WorkItem(short, 5, inputs[10:13])])

    # Then the truncated session computes what the fresh one does, and holds 8 positions again
    _assert_close(after_truncation, fresh)
    assert (long.length, long.cache.get_seq_length()) == (8, 8)


def test_running_at_position_zero_of_a_used_session_equals_a_fresh_session(block, store, inputs):
    used, fresh = store.open("job-1", "used"), store.open("job-1", "fresh")
    block.forward([WorkItem(used, 0, inputs[:6])])

    (restarted,) = block.forward([WorkItem(used, 0, inputs[10:13])])
    (expected,) = block.forward([WorkItem(fresh, 0, inputs[10:13])])

    _assert_close(restarted, expected)
    assert (used.length, used.cache.get_seq_length()) == (3, 3)


# --- batching -----------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 3])
def test_a_batch_of_three_sessions_with_different_cache_lengths_equals_each_alone(
    block, store, inputs, monkeypatch, count
):
    # Given three sessions holding 2, 5 and 9 positions, twice (one set run alone, one batched)
    lengths = [2, 5, 9]
    alone = [store.open("job-1", f"alone{i}") for i in range(3)]
    batched = [store.open("job-1", f"batched{i}") for i in range(3)]
    for length, a, b in zip(lengths, alone, batched, strict=True):
        block.forward([WorkItem(a, 0, inputs[:length])])
        block.forward([WorkItem(b, 0, inputs[:length])])
    steps = [inputs[12 + 3 * i : 12 + 3 * i + count] for i in range(3)]
    runs = _count_batched_runs(monkeypatch)

    # When each set takes a step of `count` tokens: alone one by one, batched in one call
    expected = [block.forward([WorkItem(kv, kv.length, step)])[0] for kv, step in zip(alone, steps, strict=True)]
    actual = block.forward([WorkItem(kv, kv.length, step) for kv, step in zip(batched, steps, strict=True)])

    # Then the batch ran as one padded batch of 3 and every output matches
    assert runs == [3]
    for got, want in zip(actual, expected, strict=True):
        _assert_close(got, want)
    assert [kv.length for kv in batched] == [length + count for length in lengths]
    assert [kv.cache.get_seq_length() for kv in batched] == [length + count for length in lengths]


def test_caches_written_back_by_a_batch_serve_the_next_step_like_caches_built_alone(block, store, inputs):
    alone = [store.open("job-1", f"alone{i}") for i in range(3)]
    batched = [store.open("job-1", f"batched{i}") for i in range(3)]
    for length, a, b in zip([1, 4, 7], alone, batched, strict=True):
        block.forward([WorkItem(a, 0, inputs[:length])])
        block.forward([WorkItem(b, 0, inputs[:length])])
    step = [inputs[20 + i : 21 + i] for i in range(3)]
    for kv, x in zip(alone, step, strict=True):
        block.forward([WorkItem(kv, kv.length, x)])
    block.forward([WorkItem(kv, kv.length, x) for kv, x in zip(batched, step, strict=True)])

    # The next step runs each session alone, on the caches the batch wrote back.
    for a, b in zip(alone, batched, strict=True):
        (expected,) = block.forward([WorkItem(a, a.length, inputs[23:24])])
        (actual,) = block.forward([WorkItem(b, b.length, inputs[23:24])])
        _assert_close(actual, expected)


def test_items_of_different_lengths_run_in_separate_groups_and_keep_their_order(block, store, inputs, monkeypatch):
    sessions = [store.open("job-1", f"s{i}") for i in range(4)]
    for kv in sessions:
        block.forward([WorkItem(kv, 0, inputs[:3])])
    twins = [store.open("job-1", f"t{i}") for i in range(4)]
    for kv in twins:
        block.forward([WorkItem(kv, 0, inputs[:3])])
    counts = [1, 2, 1, 2]
    steps = [inputs[10 + i : 10 + i + n] for i, n in enumerate(counts)]
    runs = _count_batched_runs(monkeypatch)

    actual = block.forward([WorkItem(kv, 3, x) for kv, x in zip(sessions, steps, strict=True)])

    assert runs == [2, 2]
    assert [out.shape[0] for out in actual] == counts
    for got, kv, x in zip(actual, twins, steps, strict=True):
        _assert_close(got, block.forward([WorkItem(kv, 3, x)])[0])


def test_a_new_session_batched_with_a_session_that_has_a_cache_equals_each_alone(block, store, inputs):
    # A one-token prompt arrives in the same pass as another session's one-token decode step.
    new, old = store.open("job-1", "new"), store.open("job-1", "old")
    new_alone, old_alone = store.open("job-1", "new-alone"), store.open("job-1", "old-alone")
    block.forward([WorkItem(old, 0, inputs[:4])])
    block.forward([WorkItem(old_alone, 0, inputs[:4])])

    actual = block.forward([WorkItem(new, 0, inputs[10:11]), WorkItem(old, 4, inputs[11:12])])

    _assert_close(actual[0], block.forward([WorkItem(new_alone, 0, inputs[10:11])])[0])
    _assert_close(actual[1], block.forward([WorkItem(old_alone, 4, inputs[11:12])])[0])
    assert (new.length, old.length) == (1, 5)


def test_max_batch_splits_a_large_group_into_chunks(store, inputs, monkeypatch):
    small = Block(models.load_block(MODEL, 0, 2), max_batch=2)
    sessions = [store.open("job-1", f"s{i}") for i in range(5)]
    runs = _count_batched_runs(monkeypatch)

    outputs = small.forward([WorkItem(kv, 0, inputs[i : i + 2]) for i, kv in enumerate(sessions)])

    assert runs == [2, 2]  # the fifth item runs alone, on the direct path
    assert [out.shape for out in outputs] == [torch.Size([2, 64])] * 5
    assert [kv.length for kv in sessions] == [2] * 5


# --- partial loading ----------------------------------------------------------------------


def test_a_block_holding_layers_2_to_4_holds_exactly_those_two_layers():
    config = models.load_config(MODEL)
    hidden, inner = config.hidden_size, config.intermediate_size
    kv_width = config.num_key_value_heads * (hidden // config.num_attention_heads)
    attention = hidden * hidden * 2 + hidden * kv_width * 2  # q, o; k, v (no biases)
    mlp = 3 * hidden * inner  # gate, up, down
    per_layer = attention + mlp + 2 * hidden  # and two RMSNorm weights

    weights = models.load_block(MODEL, 2, 4)

    assert per_layer == 36_992
    assert sum(p.numel() for p in weights.layers.parameters()) == 2 * per_layer
    assert (weights.layer_start, weights.layer_end, len(weights.layers)) == (2, 4, 2)
    assert [layer.self_attn.layer_idx for layer in weights.layers] == [0, 1]  # local cache indices
    folder = models.resolve_checkpoint(MODEL)
    with safe_open(folder / "model.safetensors", framework="pt") as checkpoint:
        for local, layer in enumerate(weights.layers):
            for key, value in layer.state_dict().items():
                assert torch.equal(value, checkpoint.get_tensor(f"model.layers.{2 + local}.{key}")), key


@pytest.mark.parametrize(
    ("start", "end"),
    [(4, 9), (3, 3), (4, 2), (-1, 2), (0, 7)],
)
def test_load_block_refuses_a_bad_span_naming_it(start, end):
    with pytest.raises(ModelError) as err:
        models.load_block(MODEL, start, end)

    assert str(err.value) == f"bad layer span {start}:{end} for tiny-llama: need 0 <= start < end <= 6"
