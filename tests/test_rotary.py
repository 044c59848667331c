"""The rotary embedding read from a config.json (``config.py``, ``rotary.py``) gives exactly the cos
and sin of transformers' own rotary embedding for every rotary type the block supports, over a
sequence of calls that grows past the model's length and falls back under it (where ``dynamic``
grows its theta and ``longrope`` switches to its long factors, then both go back), and from the
legacy ``rope_scaling``/``rope_theta`` keys as from transformers 5's ``rope_parameters``."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from worker_agent.config import parse_config
from worker_agent.errors import ModelError
from worker_agent.rotary import ROPE_TYPES, Rotary

pytestmark = pytest.mark.dataplane

HEAD_DIM = 16
# Each call's positions: a prefill, a decode step, a chunk far past max_position_embeddings (2048)
# and one back under the original 512.
CALLS = [(0, 16), (16, 1), (3000, 4), (20, 4)]
SCALED = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5},
}


def _llama(rope: dict) -> dict:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_parameters={"rope_theta": 10_000.0, **rope},
    )
    return json.loads(config.to_json_string())  # what save_pretrained writes into config.json


def _phi3_longrope() -> dict:
    dims = int(HEAD_DIM * 0.5) // 2
    config = Phi3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2048,
        original_max_position_embeddings=512,
        partial_rotary_factor=0.5,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(dims)],
            "long_factor": [2.0 + 0.5 * i for i in range(dims)],
        },
    )
    return json.loads(config.to_json_string())


def _assert_same_as_transformers(raw: dict, reference: torch.nn.Module) -> None:
    ours = Rotary(parse_config(raw, "tiny"), torch.device("cpu"))
    x = torch.zeros(1, dtype=torch.float32)
    for start, count in CALLS:
        positions = torch.arange(start, start + count)
        expected_cos, expected_sin = reference(x, positions.unsqueeze(0))
        cos, sin = ours(positions, torch.float32)
        assert torch.equal(cos, expected_cos[0]), (start, count)
        assert torch.equal(sin, expected_sin[0]), (start, count)


@pytest.mark.parametrize("kind", list(SCALED))
def test_each_rotary_type_gives_transformers_cos_and_sin_exactly(kind):
    raw = _llama(SCALED[kind])

    _assert_same_as_transformers(raw, LlamaRotaryEmbedding(LlamaConfig.from_dict(raw)))


def test_phi3s_partial_longrope_gives_transformers_cos_and_sin_exactly():
    raw = _phi3_longrope()

    _assert_same_as_transformers(raw, Phi3RotaryEmbedding(Phi3Config.from_dict(raw)))


def test_the_legacy_rope_scaling_and_rope_theta_keys_read_as_transformers_reads_them():
    raw = {key: value for key, value in _llama({}).items() if key != "rope_parameters"}
    raw |= {"rope_theta": 500_000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}

    assert parse_config(raw, "tiny").rope_parameters == {
        "rope_type": "linear",
        "type": "linear",
        "factor": 4.0,
        "rope_theta": 500_000.0,
    }
    _assert_same_as_transformers(raw, LlamaRotaryEmbedding(LlamaConfig.from_dict(raw)))


def test_every_supported_rotary_type_is_tested_here():
    assert set(ROPE_TYPES) == {*SCALED, "longrope"}


def test_refuses_a_rotary_type_it_does_not_compute_naming_the_supported_ones():
    raw = _llama({"rope_type": "mrope", "factor": 2.0})

    with pytest.raises(ModelError) as err:
        Rotary(parse_config(raw, "tiny"), torch.device("cpu"))

    assert err.value.code == "model_unsupported"
    assert str(err.value) == (
        "tiny: rotary type 'mrope' is not one the layer block computes; "
        "supported: default, linear, dynamic, yarn, longrope, llama3, proportional"
    )
