"""The model types the layer block computes, and how each one's decoder layer differs from Llama's.

``ARCHITECTURES`` is the one list of supported model types (``SUPPORTED_MODEL_TYPES`` is its
keys, in order): ``config.read_config`` refuses any other type, so ``model.load_block`` and
``model.load_head`` do before reading a weight, and a catalog can show the list without importing
torch. Each entry says what a layer of that type holds beside Llama's (``layers.py`` builds exactly
that, and loading checks the checkpoint's tensors against it, so a checkpoint with an extra norm or
a fused projection the entry does not name is refused, never run half-computed), the numbers from
its config that the block and the coordinator's head apply, which layers slide, and the defaults of
its transformers config class for what a config.json may leave out.

How the block reads the parts (see ``block.py`` for the maths):

- ``fused_qkv``: one ``qkv_proj`` instead of ``q_proj``/``k_proj``/``v_proj``, whose rows are
  queries, then keys, then values (Phi-3); ``fused_gate_up``: one ``gate_up_proj``, gate rows then
  up rows.
- ``head_norms``: ``q_norm``/``k_norm``, an RMSNorm over each head's queries and keys before the
  rotary (Qwen3).
- ``sandwich_norms``: Gemma 2's ``pre_feedforward_layernorm``/``post_feedforward_layernorm``; its
  ``post_attention_layernorm`` then normalizes the attention output before the residual add, not
  the residual stream before the MLP.
- ``unit_offset_norms``: every RMSNorm computes ``x * (1 + w)`` in float32 (Gemma), not Llama's
  ``w * x`` with x cast back to its dtype first.

Which layers slide (``windows``) is the type's rule, as its transformers model applies it:
``"config"``: every layer, with ``config.sliding_window`` when that is set (Mistral, Phi-3);
``"layer_types"``: the layers ``config.layer_types`` names ``"sliding_attention"`` (Gemma 2, Qwen);
``"none"``: no layer (Llama, Gemma, Granite).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from worker_agent.errors import ModelError


@dataclass(frozen=True)
class Architecture:
    fused_qkv: bool = False  # one qkv_proj (Phi-3)
    fused_gate_up: bool = False  # one gate_up_proj (Phi-3)
    head_norms: bool = False  # q_norm and k_norm (Qwen3)
    sandwich_norms: bool = False  # pre_ and post_feedforward_layernorm (Gemma 2)
    unit_offset_norms: bool = False  # x * (1 + w) in float32 (Gemma)
    # Which projections have biases: "config": all four attention ones where config.attention_bias
    # says so; "qkv": queries, keys and values always, the output never (Qwen2); "none".
    attention_biases: Literal["config", "qkv", "none"] = "config"
    mlp_biases: bool = False  # the MLP's, where config.mlp_bias says so (Llama, Granite)
    activation_key: str = "hidden_act"  # the config key naming the MLP's activation
    # The attention scale: head_dim ** -0.5, query_pre_attn_scalar ** -0.5 (Gemma 2), or
    # config.attention_multiplier (Granite).
    scaling: Literal["head_dim", "query_pre_attn_scalar", "attention_multiplier"] = "head_dim"
    # Attention scores squashed to (-c, c) by c * tanh(s / c), c = config.attn_logit_softcapping,
    # with the softmax in float32 (Gemma 2's eager attention).
    softcapped_attention: bool = False
    # The default rotary rotates only partial_rotary_factor of each head's dims, and the scaled
    # rotary types take original_max_position_embeddings from the config's own field (Phi-3).
    phi3_rotary: bool = False
    windows: Literal["none", "config", "layer_types"] = "none"  # which layers slide (see the module docstring)
    # Each sublayer's output times config.residual_multiplier before its residual add (Granite).
    scaled_residuals: bool = False
    # The token embeddings times sqrt(hidden_size) rounded to their dtype (Gemma), or times
    # config.embedding_multiplier (Granite).
    embedding_scale: Literal["none", "sqrt_hidden", "multiplier"] = "none"
    # The logits divided by config.logits_scaling (Granite).
    scaled_logits: bool = False
    # The logits squashed to (-c, c) by c * tanh(logits / c), c = config.final_logit_softcapping (Gemma 2).
    softcapped_logits: bool = False
    # What transformers' config class of the type gives a key that config.json leaves out.
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


def _defaults(base: Mapping[str, Any] | None = None, **values: Any) -> Mapping[str, Any]:
    """``base``'s defaults with ``values`` over them."""
    return MappingProxyType({**(base or {}), **values})


_LLAMA = Architecture(
    mlp_biases=True,
    defaults=_defaults(hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=2048, tie_word_embeddings=False),
)
_QWEN = replace(
    _LLAMA,
    mlp_biases=False,
    windows="layer_types",
    defaults=_defaults(
        _LLAMA.defaults,
        max_position_embeddings=32768,
        num_key_value_heads=32,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
    ),
)
_GEMMA = replace(
    _LLAMA,
    mlp_biases=False,
    unit_offset_norms=True,
    embedding_scale="sqrt_hidden",
    defaults=_defaults(
        hidden_act="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        num_key_value_heads=16,
        head_dim=256,
    ),
)

ARCHITECTURES: dict[str, Architecture] = {
    "llama": _LLAMA,
    "mistral": replace(
        _LLAMA,
        mlp_biases=False,
        attention_biases="none",
        windows="config",
        defaults=_defaults(_LLAMA.defaults, max_position_embeddings=131072, num_key_value_heads=8, sliding_window=4096),
    ),
    "qwen2": replace(_QWEN, attention_biases="qkv"),
    "qwen3": replace(_QWEN, head_norms=True, defaults=_defaults(_QWEN.defaults, head_dim=128)),
    "gemma": _GEMMA,
    "gemma2": replace(
        _GEMMA,
        sandwich_norms=True,
        activation_key="hidden_activation",
        scaling="query_pre_attn_scalar",
        softcapped_attention=True,
        windows="layer_types",
        softcapped_logits=True,
        defaults=_defaults(
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            num_key_value_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
        ),
    ),
    "phi3": replace(
        _LLAMA,
        fused_qkv=True,
        fused_gate_up=True,
        mlp_biases=False,
        attention_biases="none",
        phi3_rotary=True,
        windows="config",
        defaults=_defaults(
            _LLAMA.defaults,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            partial_rotary_factor=1.0,
        ),
    ),
    "granite": replace(
        _LLAMA,
        scaling="attention_multiplier",
        scaled_residuals=True,
        embedding_scale="multiplier",
        scaled_logits=True,
        defaults=_defaults(
            _LLAMA.defaults,
            embedding_multiplier=1.0,
            logits_scaling=1.0,
            residual_multiplier=1.0,
            attention_multiplier=1.0,
        ),
    ),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(ARCHITECTURES)


def architecture(model_type: str | None, model: str) -> Architecture:
    """The entry of ``model_type``; ``ModelError`` (code ``model_unsupported``) naming every
    supported type when there is none. ``model`` names the model in the message."""
    if model_type not in ARCHITECTURES:
        raise ModelError(
            f"{model}: model type {model_type!r} is not one the layer block computes; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
            code="model_unsupported",
        )
    return ARCHITECTURES[model_type]
