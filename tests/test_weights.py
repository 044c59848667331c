"""What loading a block costs, measured: a fresh process that loads layers 2:4 of an 8-layer
sharded checkpoint grows by about those two layers' bytes, not by the shards around them; float16
and bfloat16 blocks hold half the bytes, int8 ones a quarter, and each computes what the float32
block does within its format's precision.

The checkpoint is a seeded random Llama, 8 layers of about 30 MB (float32), saved in shards of
about three layers each, so the block 2:4 straddles two shards: reading whole shards would page in
six layers, reading the whole model eight. The memory is measured in a fresh Python process, after
a warm-up load of a tiny checkpoint of the same architecture has imported and initialized
everything, so that the growth is the block's own: resident set size (RSS, which counts file pages
the process touched as well as its own memory) and its peak during the load.

Formats are compared with the float32 block by cosine and relative error per token, of the output
and of what the block adds to its input (the output minus the input: the residual stream carries
the input through unchanged, which would hide an error in the layers' own contribution). The
bounds sit above the formats' rounding (float16 keeps 11 significant bits, bfloat16 8, int8 weights
about 7 plus a scale per row) and far below what a wrong weight, layer or dtype produces.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from worker_agent import model as models
from worker_agent.block import Block, WorkItem
from worker_agent.errors import ModelError
from worker_agent.kvcache import KVSession

pytestmark = pytest.mark.dataplane

MB = 1 << 20
LAYERS = 8
SPAN = (2, 4)  # the block every test loads: layers 2 and 3, on both sides of a shard boundary
LAYER_PARAMETERS = 7_472_640  # hidden 768, 12 heads of 64 (4 for keys and values), MLP 2560
SLACK = 16 * MB  # what a process may grow by besides the block: allocator and interpreter noise

# Runs in a fresh interpreter: warm up on a tiny checkpoint, then load the block and report its
# resident set size (VmRSS) before and after, its peak during the load (VmHWM, reset just before:
# "5" to clear_refs), and the bytes its tensors hold.
MEASURE = """
import gc, json, sys
import torch
from worker_agent import model as models

def status(field):
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":"))

folder, warmup, start, end, dtype, quantize = sys.argv[1:7]
quantize = quantize or None
models.load_block(warmup, 0, 1, dtype=dtype, quantize=quantize)
torch.ones(1024, 1024).mul_(2)  # large enough to start torch's worker threads, as the block's loading will
gc.collect()
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")
weights = models.load_block(folder, int(start), int(end), dtype=dtype, quantize=quantize)
gc.collect()
after, peak = status("VmRSS"), status("VmHWM")
tensors = [t for layer in weights.layers for t in [*layer.parameters(), *layer.buffers()]]
held = sum(t.nbytes + (t.scales.nbytes if isinstance(t, models.Int8Weight) else 0) for t in tensors)
print(json.dumps({"before": before, "after": after, "peak": peak, "held": held}))
"""


def _llama(hidden: int, inner: int, heads: int, kv_heads: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=inner,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=True,
        initializer_range=0.05,
    )


def _save(folder: Path, config, max_shard_size: str | None = None) -> str:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if max_shard_size is None:
        model.save_pretrained(folder)
    else:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    return str(folder)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """8 layers of 7.47M parameters (29.9 MB in float32), in 3 shards of at most 100 MB."""
    return _save(tmp_path_factory.mktemp("sharded"), _llama(768, 2560, 12, 4), max_shard_size="100MB")


@pytest.fixture(scope="module")
def warmup(tmp_path_factory) -> str:
    """The same architecture, tiny: loading it imports and initializes what a load needs."""
    return _save(tmp_path_factory.mktemp("warmup"), _llama(64, 128, 4, 2))


def _stored_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the checkpoint's headers (nothing is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            keys = handle.keys()  # a safe_open handle is not iterable
            for key in keys:
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def _block_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    prefixes = tuple(f"model.layers.{index}." for index in range(*SPAN))
    return {key: shape for key, shape in _stored_shapes(folder).items() if key.startswith(prefixes)}


def _numel(shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel()


def _format_bytes(shapes: dict[str, tuple[int, ...]], dtype: str, quantize: str) -> int:
    """What tensors of ``shapes`` take in a format: int8 keeps each matrix as one byte per weight
    and a bfloat16 scale per row, and its norms in bfloat16."""
    size = models.DTYPES[dtype].itemsize
    if not quantize:
        return sum(_numel(shape) * size for shape in shapes.values())
    matrices = sum(_numel(shape) + shape[0] * size for shape in shapes.values() if len(shape) == 2)
    return matrices + sum(_numel(shape) * size for shape in shapes.values() if len(shape) != 2)


def _measure(checkpoint: str, warmup: str, dtype: str, quantize: str) -> dict[str, int]:
    """Load the block in a fresh process: its RSS before and after, its peak, and the bytes it holds."""
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, checkpoint, warmup, str(SPAN[0]), str(SPAN[1]), dtype, quantize],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- the checkpoint -----------------------------------------------------------------------


def test_the_checkpoint_is_sharded_so_that_the_block_straddles_two_shards(checkpoint):
    index = json.loads((Path(checkpoint) / "model.safetensors.index.json").read_text())["weight_map"]
    shards_of_block = {index[f"model.layers.{layer}.mlp.up_proj.weight"] for layer in range(*SPAN)}

    assert len(set(index.values())) == 3
    assert len(shards_of_block) == 2
    assert _format_bytes(_block_shapes(checkpoint), "float32", "") == 2 * LAYER_PARAMETERS * 4


# --- what a fresh process holds -----------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "quantize"),
    [("float32", ""), ("float16", ""), ("bfloat16", ""), ("bfloat16", "int8")],
    ids=["float32", "float16", "bfloat16", "int8"],
)
def test_a_fresh_process_loading_two_layers_grows_by_their_bytes_not_by_their_shards(
    checkpoint, warmup, dtype, quantize
):
    block_bytes = _format_bytes(_block_shapes(checkpoint), dtype, quantize)
    model_bytes = sum(file.stat().st_size for file in Path(checkpoint).glob("*.safetensors"))
    layer_file_bytes = LAYER_PARAMETERS * 4  # the file pages of the layer being read

    measured = _measure(checkpoint, warmup, dtype, quantize)
    growth, peak = measured["after"] - measured["before"], measured["peak"] - measured["before"]

    # The block holds exactly its format's bytes: 1/2 of float32 in 16 bits, about 1/4 in int8 ...
    assert measured["held"] == block_bytes
    # ... the process grew by that, give or take the allocator ...
    assert 0.8 * block_bytes <= growth <= 1.25 * block_bytes + SLACK, (growth / MB, block_bytes / MB)
    # ... and never held more than that and one layer's pages of the file at once: not the shards
    # (3 layers each), not the model.
    assert peak <= block_bytes + layer_file_bytes + SLACK, (peak / MB, block_bytes / MB)
    assert peak < model_bytes / 2


# --- what the formats compute -------------------------------------------------------------


FORMATS = {
    "float32": {},
    "float16": {"dtype": "float16"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantize": "int8"},
}
# Per token, against the float32 block: the least cosine and the largest relative error, of the
# output and of what the block adds to its input. Measured: float16 1 - 2e-6 and 2e-3, bfloat16
# 1 - 1.2e-4 and 1.6e-2, int8 1 - 7.3e-4 and 3.8e-2.
BOUNDS = {"float16": (1 - 2e-5, 1e-2), "bfloat16": (1 - 1e-3, 5e-2), "int8": (0.99, 0.1)}
# A 24-token prefill (int8: dequantized, more rows than INT8_PACK_ROWS), two decode steps and a
# 4-token chunk (int8: the int8 kernel).
STEPS = [(0, 24), (24, 1), (25, 1), (26, 4)]


@pytest.fixture(scope="module")
def hidden() -> torch.Tensor:
    """Hidden states of 30 made-up tokens. (tokens, hidden)"""
    return torch.randn(30, 768, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def outputs(checkpoint, hidden) -> dict[str, torch.Tensor]:
    """Each format's block over ``STEPS`` of ``hidden``, as float32. (tokens, hidden) each"""
    results = {}
    for name, options in FORMATS.items():
        block = Block(models.load_block(checkpoint, *SPAN, **options))
        session = KVSession("job-1", name)
        steps = [block.forward([WorkItem(session, start, hidden[start : start + n])])[0] for start, n in STEPS]
        assert {step.dtype for step in steps} == {block.weights.dtype}
        assert session.keys[0].dtype == block.weights.dtype
        results[name] = torch.cat(steps).float()
    return results


@pytest.mark.parametrize("name", ["float16", "bfloat16", "int8"])
def test_each_format_computes_what_the_float32_block_does_per_token(outputs, hidden, name):
    least_cosine, largest_error = BOUNDS[name]
    expected, actual = outputs["float32"], outputs[name]

    for what, want, got in [("output", expected, actual), ("added", expected - hidden, actual - hidden)]:
        cosine = torch.nn.functional.cosine_similarity(got, want, dim=1)  # (tokens,)
        error = (got - want).norm(dim=1) / want.norm(dim=1)  # (tokens,)
        assert cosine.min().item() >= least_cosine, (what, cosine.min().item())
        assert error.max().item() <= largest_error, (what, error.max().item())


def test_a_wrong_layer_is_far_outside_those_bounds(checkpoint, outputs, hidden):
    # Given the float32 block shifted by one layer (3:5 instead of 2:4)
    block = Block(models.load_block(checkpoint, SPAN[0] + 1, SPAN[1] + 1))
    session = KVSession("job-1", "shifted")
    shifted = torch.cat([block.forward([WorkItem(session, s, hidden[s : s + n])])[0] for s, n in STEPS])

    # Then what it adds to its input is nowhere near the right block's: the bounds above can fail
    added, expected = shifted - hidden, outputs["float32"] - hidden
    assert torch.nn.functional.cosine_similarity(added, expected, dim=1).max().item() < 0.9


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_block_holds_every_tensor_in_its_dtype(checkpoint, dtype):
    weights = models.load_block(checkpoint, *SPAN, dtype=dtype)

    assert {t.dtype for t in weights.layers.parameters()} == {models.DTYPES[dtype]}
    assert weights.dtype == models.DTYPES[dtype]


def test_an_int8_block_holds_int8_projections_with_a_scale_per_row_and_16_bit_norms(checkpoint):
    weights = models.load_block(checkpoint, *SPAN, dtype="bfloat16", quantize="int8")
    shapes = _block_shapes(checkpoint)

    assert weights.quantize == "int8"
    for local, layer in enumerate(weights.layers):
        prefix = f"model.layers.{SPAN[0] + local}."
        projections = {name: m for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        assert len(projections) == 7  # q, k, v, o, gate, up, down
        for name, module in projections.items():
            assert isinstance(module.weight, models.Int8Weight), name
            assert module.weight.dtype == torch.int8
            assert tuple(module.weight.shape) == shapes[f"{prefix}{name}.weight"]
            assert module.weight.scales.shape == (module.weight.shape[0],)
            assert module.weight.scales.dtype == torch.bfloat16
        assert {t.dtype for t in layer.parameters()} == {torch.bfloat16}  # the two norms


def test_an_int8_weight_is_its_float_weight_to_half_a_step_per_row():
    weight = torch.randn(300, 64, generator=torch.Generator().manual_seed(1))  # 300 rows: 4 chunks of 64 and 44
    weight[7] = 0.0  # a row of zeros quantizes to zeros, not to NaN

    quantized = models.Int8Weight.quantize(weight, torch.float32)

    step = weight.abs().amax(dim=1) / 127  # (rows,)
    torch.testing.assert_close(quantized.scales, step)
    assert ((quantized.dequantize() - weight).abs() <= step[:, None] / 2 + 1e-7).all()
    assert quantized.abs().amax(dim=1).tolist() == [0 if row == 7 else 127 for row in range(300)]


@pytest.mark.parametrize("rows", [1, 4, 16, 17, 40])
def test_linear_by_an_int8_weight_equals_the_product_by_its_dequantized_weight(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = models.Int8Weight.quantize(torch.randn(96, 64, generator=generator), torch.bfloat16)
    x = torch.randn(rows, 64, generator=generator).to(torch.bfloat16)
    bias = torch.randn(96, generator=generator).to(torch.bfloat16)

    actual = models.linear(x, weight, bias)

    expected = x.float() @ weight.dequantize().float().T + bias.float()
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


# --- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quantize": "int4", "dtype": "bfloat16"}, "unknown quantize 'int4': use one of int8, or none"),
        (
            {"quantize": "int8"},
            "int8 weights compute with bfloat16 activations: use dtype bfloat16, not float32",
        ),
        (
            {"quantize": "int8", "dtype": "bfloat16", "device": "cuda"},
            "int8 weights run on cpu only, not cuda: load cuda blocks in float16 or bfloat16",
        ),
    ],
)
def test_load_block_refuses_an_int8_block_it_cannot_run_naming_why(warmup, options, message):
    with pytest.raises(ModelError) as err:
        models.load_block(warmup, 0, 1, **options)

    assert str(err.value) == message
