"""A decoder layer's parts, in plain torch: what ``block.Block`` computes with and the weights it holds.

``build_layer`` makes the layer a model type's ``architectures`` entry describes, with the names
transformers gives its parts (so a layer's ``state_dict`` keys are the checkpoint's, less the
``model.layers.{i}.`` prefix), on the meta device: loading assigns each tensor read from the file
(``model.load_block``), so nothing is allocated twice. The parts compute only what the block does
not: the RMSNorms and the MLP's activation, each exactly as its transformers model computes it;
the block runs every projection through ``kernels.linear`` and applies attention and the rotary
itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional

from worker_agent.config import ModelConfig

# The MLP's activations, as transformers' ACT2FN computes each (config.ACTIVATIONS names them).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": functional.silu,
    "swish": functional.silu,
    "gelu": functional.gelu,
    "gelu_pytorch_tanh": lambda x: functional.gelu(x, approximate="tanh"),
    "relu": functional.relu,
}


class RMSNorm(nn.Module):
    """x / rms(x), computed in float32, times the weight: Llama's ``w * x`` with x cast back to its
    dtype first, or Gemma's ``x * (1 + w)`` in float32 then cast (``unit_offset``)."""

    def __init__(self, size: int, eps: float, *, unit_offset: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """The attention's projections (q/k/v/o, or Phi-3's fused qkv), and Qwen3's per-head norms."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        kind, hidden, d = config.kind, config.hidden_size, config.head_dim
        queries, keys = config.num_attention_heads * d, config.num_key_value_heads * d
        biased = {"config": config.attention_bias, "qkv": True, "none": False}[kind.attention_biases]
        if kind.fused_qkv:
            self.qkv_proj = nn.Linear(hidden, queries + 2 * keys, bias=biased)
        else:
            self.q_proj = nn.Linear(hidden, queries, bias=biased)
            self.k_proj = nn.Linear(hidden, keys, bias=biased)
            self.v_proj = nn.Linear(hidden, keys, bias=biased)
        self.o_proj = nn.Linear(queries, hidden, bias=biased and kind.attention_biases == "config")
        if kind.head_norms:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, unit_offset=kind.unit_offset_norms)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, unit_offset=kind.unit_offset_norms)


class MLP(nn.Module):
    """down(act(gate) * up): its projections (or Phi-3's fused gate_up) and the activation."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        kind, hidden, inner = config.kind, config.hidden_size, config.intermediate_size
        biased = kind.mlp_biases and config.mlp_bias
        if kind.fused_gate_up:
            self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=biased)
        else:
            self.gate_proj = nn.Linear(hidden, inner, bias=biased)
            self.up_proj = nn.Linear(hidden, inner, bias=biased)
        self.down_proj = nn.Linear(inner, hidden, bias=biased)
        self.act = ACTIVATIONS[config.hidden_act]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        kind = config.kind

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=kind.unit_offset_norms)

        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if kind.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()


def build_layer(config: ModelConfig) -> DecoderLayer:
    """A layer of ``config``'s type on the meta device, every tensor still to be assigned."""
    with torch.device("meta"):
        return DecoderLayer(config).eval()
