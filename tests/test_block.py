"""The layer block on tiny-llama, in-process: ragged batching, truncation, cache growth, partial
loading, and the architectures it accepts.

Outputs computed along different paths (one long prefill vs a shorter one, a batch vs one
session alone, the block vs Hugging Face's own layers over the whole sequence) are equal in
exact arithmetic but not bit for bit in float32. The seeded tiny-llama has hidden states of
magnitude ~100 (initializer_range 0.3), where one float32 ulp is ~8e-6, so an absolute 1e-5 is
below what six layers of float32 can hold. ``_assert_close`` therefore allows 1e-5 of the
output's largest magnitude (rtol=0): about one ulp at the top of the range, orders of magnitude
below what a masking, position or cache bug produces.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from worker_agent import model as models
from worker_agent.block import Block, WorkItem
from worker_agent.errors import ModelError
from worker_agent.kvcache import KVSession, SessionLimits, SessionStore

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
    """Hidden states of 200 made-up tokens. (tokens, hidden)"""
    return torch.randn(200, 64, generator=torch.Generator().manual_seed(0))


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


@cache
def _hugging_face(folder: str):
    """The block's checkpoint as transformers runs it: the reference the block is compared with."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def _reference(weights: models.BlockWeights, hidden: torch.Tensor) -> torch.Tensor:
    """Hugging Face's own decoder layers of the block's span over a whole sequence at once, causal,
    no cache. (tokens, hidden)"""
    model = _hugging_face(str(models.resolve_checkpoint(weights.model))).model
    states = hidden.unsqueeze(0)  # (1, tokens, hidden)
    positions = torch.arange(hidden.shape[0]).unsqueeze(0)  # (1, tokens)
    rotary = model.rotary_emb(states, positions)
    for layer in model.layers[weights.layer_start : weights.layer_end]:
        states = layer(states, attention_mask=None, position_ids=positions, position_embeddings=rotary)
    return states[0]


def _count_passes(monkeypatch) -> list[int]:
    """Record how many items every pass of the block runs."""
    sizes: list[int] = []
    original = Block._pass

    def spy(self, items):
        sizes.append(len(items))
        return original(self, items)

    monkeypatch.setattr(Block, "_pass", spy)
    return sizes


# --- one session against Hugging Face's layers --------------------------------------------


def test_a_prefill_and_decode_steps_equal_hugging_faces_layers_over_the_whole_sequence(block, store, inputs):
    kv = store.open("job-1", "s0")
    steps = [(0, 7), (7, 1), (8, 1), (9, 4)]

    outputs = [block.forward([WorkItem(kv, start, inputs[start : start + count])])[0] for start, count in steps]

    _assert_close(torch.cat(outputs), _reference(block.weights, inputs[:13]))
    assert kv.length == 13


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
    assert long.length == 8


def test_running_at_position_zero_of_a_used_session_equals_a_fresh_session(block, store, inputs):
    used, fresh = store.open("job-1", "used"), store.open("job-1", "fresh")
    block.forward([WorkItem(used, 0, inputs[:6])])

    (restarted,) = block.forward([WorkItem(used, 0, inputs[10:13])])
    (expected,) = block.forward([WorkItem(fresh, 0, inputs[10:13])])

    _assert_close(restarted, expected)
    assert used.length == 3


def test_a_truncated_then_rewritten_session_equals_the_rewritten_sequence_run_fresh(block, store, inputs):
    # Given a session that ran 10 tokens, then rewinds to position 6 with 3 other tokens
    kv = store.open("job-1", "s0")
    block.forward([WorkItem(kv, 0, inputs[:10])])
    kv.truncate(6)

    # When it runs them and one more step
    rewritten = block.forward([WorkItem(kv, 6, inputs[50:53])])[0]
    following = block.forward([WorkItem(kv, 9, inputs[53:54])])[0]

    # Then it computed exactly the rewritten sequence
    sequence = torch.cat([inputs[:6], inputs[50:54]])
    _assert_close(torch.cat([rewritten, following]), _reference(block.weights, sequence)[6:])
    assert kv.length == 10


def test_a_session_reusing_its_capacity_after_truncation_never_sees_the_stale_positions(block, store, inputs):
    # Given a session that held 40 positions, rewound to 5: positions 5..39 still lie in its buffers
    kv = store.open("job-1", "s0")
    block.forward([WorkItem(kv, 0, inputs[:40])])
    capacity = kv.capacity

    # When it runs 3 tokens at position 5, then two single-token steps
    outputs = [
        block.forward([WorkItem(kv, 5, inputs[100:103])])[0],
        block.forward([WorkItem(kv, 8, inputs[103:104])])[0],
        block.forward([WorkItem(kv, 9, inputs[104:105])])[0],
    ]

    # Then every output is that of the short sequence alone, in the same buffers
    sequence = torch.cat([inputs[:5], inputs[100:105]])
    _assert_close(torch.cat(outputs), _reference(block.weights, sequence)[5:])
    assert (kv.length, kv.capacity) == (10, capacity)


# --- cache growth -------------------------------------------------------------------------


def test_steps_across_the_capacity_boundaries_equal_one_pass_over_the_whole_sequence(block, store, inputs):
    # Given a session whose first step fills 62 of its 64 first positions
    kv = store.open("job-1", "s0")
    steps = [(0, 62), (62, 1), (63, 3), (66, 60), (126, 1), (127, 1), (128, 5)]
    outputs, capacities = [], []

    # When steps cross 64 (inside a 3-token step) and 128 (between single tokens)
    for start, count in steps:
        outputs.append(block.forward([WorkItem(kv, start, inputs[start : start + count])])[0])
        capacities.append(kv.capacity)

    # Then the buffers doubled twice, and the outputs are those of one pass over 133 tokens
    assert capacities == [64, 64, 128, 128, 128, 128, 256]
    _assert_close(torch.cat(outputs), _reference(block.weights, inputs[:133]))


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
    passes = _count_passes(monkeypatch)

    # When each set takes a step of `count` tokens: alone one by one, batched in one call
    expected = [block.forward([WorkItem(kv, kv.length, step)])[0] for kv, step in zip(alone, steps, strict=True)]
    actual = block.forward([WorkItem(kv, kv.length, step) for kv, step in zip(batched, steps, strict=True)])

    # Then the batch ran as one pass of 3 and every output matches
    assert passes == [1, 1, 1, 3]
    for got, want in zip(actual, expected, strict=True):
        _assert_close(got, want)
    assert [kv.length for kv in batched] == [length + count for length in lengths]


def test_a_ragged_batch_of_1_3_and_7_new_tokens_equals_each_session_alone(block, store, inputs, monkeypatch):
    # Given three sessions holding 11, 0 and 4 positions, twice (one set run alone, one batched)
    pasts, counts = [11, 0, 4], [1, 3, 7]
    alone = [store.open("job-1", f"alone{i}") for i in range(3)]
    batched = [store.open("job-1", f"batched{i}") for i in range(3)]
    for past, a, b in zip(pasts, alone, batched, strict=True):
        if past:
            block.forward([WorkItem(a, 0, inputs[:past])])
            block.forward([WorkItem(b, 0, inputs[:past])])
    steps = [inputs[30 + 10 * i : 30 + 10 * i + n] for i, n in enumerate(counts)]
    passes = _count_passes(monkeypatch)

    # When the batched set takes its steps of 1, 3 and 7 tokens in one call
    actual = block.forward([WorkItem(kv, past, x) for kv, past, x in zip(batched, pasts, steps, strict=True)])
    expected = [block.forward([WorkItem(kv, past, x)])[0] for kv, past, x in zip(alone, pasts, steps, strict=True)]

    # Then it ran as one pass, in order, each output equal to the session's alone
    assert passes == [3, 1, 1, 1]
    assert [out.shape[0] for out in actual] == counts
    for got, want in zip(actual, expected, strict=True):
        _assert_close(got, want)
    for got, past, x in zip(actual, pasts, steps, strict=True):
        _assert_close(got, _reference(block.weights, torch.cat([inputs[:past], x]))[past:])
    assert [kv.length for kv in batched] == [12, 3, 11]


def test_caches_written_by_a_batch_serve_the_next_step_like_caches_built_alone(block, store, inputs):
    alone = [store.open("job-1", f"alone{i}") for i in range(3)]
    batched = [store.open("job-1", f"batched{i}") for i in range(3)]
    for length, a, b in zip([1, 4, 7], alone, batched, strict=True):
        block.forward([WorkItem(a, 0, inputs[:length])])
        block.forward([WorkItem(b, 0, inputs[:length])])
    step = [inputs[20 + i : 21 + i] for i in range(3)]
    for kv, x in zip(alone, step, strict=True):
        block.forward([WorkItem(kv, kv.length, x)])
    block.forward([WorkItem(kv, kv.length, x) for kv, x in zip(batched, step, strict=True)])

    # The next step runs each session alone, on the caches the batch wrote.
    for a, b in zip(alone, batched, strict=True):
        (expected,) = block.forward([WorkItem(a, a.length, inputs[23:24])])
        (actual,) = block.forward([WorkItem(b, b.length, inputs[23:24])])
        _assert_close(actual, expected)


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


def test_max_batch_splits_a_call_into_passes_of_at_most_that_many_items(store, inputs, monkeypatch):
    small = Block(models.load_block(MODEL, 0, 2), max_batch=2)
    sessions = [store.open("job-1", f"s{i}") for i in range(5)]
    passes = _count_passes(monkeypatch)

    outputs = small.forward([WorkItem(kv, 0, inputs[i : i + 1 + i % 2]) for i, kv in enumerate(sessions)])

    assert passes == [2, 2, 1]
    assert [out.shape for out in outputs] == [torch.Size([1 + i % 2, 64]) for i in range(5)]
    assert [kv.length for kv in sessions] == [1, 2, 1, 2, 1]


def test_refuses_a_call_holding_a_session_twice_and_changes_nothing(block, store, inputs):
    kv = store.open("job-1", "s0")
    block.forward([WorkItem(kv, 0, inputs[:3])])

    with pytest.raises(ValueError, match="appears twice"):
        block.forward([WorkItem(kv, 3, inputs[3:4]), WorkItem(kv, 4, inputs[4:5])])

    assert kv.length == 3


def test_refuses_an_item_starting_past_the_positions_its_session_holds(block, store, inputs):
    kv = store.open("job-1", "s0")
    block.forward([WorkItem(kv, 0, inputs[:3])])

    with pytest.raises(ValueError, match="holds 3 positions; an item cannot start at 4"):
        block.forward([WorkItem(kv, 4, inputs[4:5])])

    assert kv.length == 3


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


# --- architectures ------------------------------------------------------------------------


def _checkpoint(folder, config) -> str:
    """A seeded random checkpoint of ``config`` in ``folder``, loadable by ``load_block``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def _small(config_cls, **extra):
    return config_cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
        **extra,
    )


def test_qwen3_layers_with_head_norms_and_biases_equal_hugging_faces_layers(tmp_path, inputs):
    from transformers import Qwen3Config

    checkpoint = _checkpoint(tmp_path / "qwen3", _small(Qwen3Config, head_dim=16, attention_bias=True))
    block = Block(models.load_block(checkpoint, 0, 2))
    sessions = [KVSession("job-1", f"s{i}") for i in range(2)]
    block.forward([WorkItem(sessions[0], 0, inputs[:5])])

    actual = block.forward([WorkItem(sessions[0], 5, inputs[5:7]), WorkItem(sessions[1], 0, inputs[40:44])])

    assert block.head_norms
    _assert_close(actual[0], _reference(block.weights, inputs[:7])[5:])
    _assert_close(actual[1], _reference(block.weights, inputs[40:44]))


def test_mistral_layers_without_a_sliding_window_equal_hugging_faces_layers(tmp_path, inputs):
    from transformers import MistralConfig

    checkpoint = _checkpoint(tmp_path / "mistral", _small(MistralConfig, sliding_window=None))
    block = Block(models.load_block(checkpoint, 0, 2))
    kv = KVSession("job-1", "s0")

    outputs = [block.forward([WorkItem(kv, start, inputs[start : start + n])])[0] for start, n in [(0, 6), (6, 1)]]

    _assert_close(torch.cat(outputs), _reference(block.weights, inputs[:7]))


def test_refuses_a_layer_holding_a_tensor_its_type_has_no_part_for(tmp_path):
    # Given tiny-llama with an extra norm's weight in layer 1 (a part of Gemma 2's layers, not Llama's)
    folder = models.resolve_checkpoint(MODEL)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.post_feedforward_layernorm.weight"] = torch.ones(64)
    odd = tmp_path / "odd-llama"
    odd.mkdir()
    save_file(tensors, odd / "model.safetensors", metadata={"format": "pt"})
    (odd / "config.json").write_text((folder / "config.json").read_text())

    # Then a block over it is refused before it could run half of that layer
    with pytest.raises(ModelError) as err:
        models.load_block(str(odd), 0, 2)

    assert err.value.code == "model_unsupported"
    assert str(err.value) == (
        "odd-llama layer 1 is not a llama layer the block computes: "
        "it lacks [] and has ['post_feedforward_layernorm.weight'] besides"
    )
