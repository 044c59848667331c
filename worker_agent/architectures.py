"""The model types the layer block computes, and what each one's decoder layer is made of.

``ARCHITECTURES`` is the one list of supported model types (``SUPPORTED_MODEL_TYPES`` is its
keys, in order): ``model.load_block`` and ``model.load_head`` refuse any other type before
reading a weight, ``block.Block`` checks every layer it is given against its type's entry here,
and a catalog can show the list without importing torch. Each entry names the submodules a
decoder layer of that type holds (checked exactly, so a checkpoint with an extra norm or a
fused projection the entry does not name is refused, never run half-computed), the numbers
from its config that the block and the coordinator's head apply, and which layers slide.

How the block reads the parts (see ``block.py`` for the maths):

- ``qkv_proj`` instead of ``q_proj``/``k_proj``/``v_proj``: one fused projection whose rows are
  queries, then keys, then values (Phi-3); ``gate_up_proj``: gate rows, then up rows.
- ``q_norm``/``k_norm``: an RMSNorm over each head's queries and keys before the rotary (Qwen3).
- ``pre_feedforward_layernorm``/``post_feedforward_layernorm``: Gemma 2's sandwich norms; its
  ``post_attention_layernorm`` then normalizes the attention output before the residual add,
  not the residual stream before the MLP.
- ``resid_attn_dropout``/``resid_mlp_dropout``: dropouts, the identity at inference (Phi-3).

Which layers slide (``windows``) is the type's rule, as its transformers model applies it:
``"config"``: every layer, with ``config.sliding_window`` when that is set (Mistral, Phi-3);
``"layer_types"``: the layers ``config.layer_types`` names ``"sliding_attention"`` (Gemma 2, Qwen);
``"none"``: no layer (Llama, Gemma, Granite).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from worker_agent.errors import ModelError


@dataclass(frozen=True)
class Architecture:
    layer_parts: frozenset[str]  # the decoder layer's child modules
    attention_parts: frozenset[str]  # its ``self_attn``'s
    mlp_parts: frozenset[str]  # its ``mlp``'s
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


_LLAMA = Architecture(
    layer_parts=frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}),
    attention_parts=frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}),
    mlp_parts=frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"}),
)

ARCHITECTURES: dict[str, Architecture] = {
    "llama": _LLAMA,
    "mistral": replace(_LLAMA, windows="config"),
    "qwen2": replace(_LLAMA, windows="layer_types"),
    "qwen3": replace(_LLAMA, attention_parts=_LLAMA.attention_parts | {"q_norm", "k_norm"}, windows="layer_types"),
    "gemma": replace(_LLAMA, embedding_scale="sqrt_hidden"),
    "gemma2": replace(
        _LLAMA,
        layer_parts=_LLAMA.layer_parts | {"pre_feedforward_layernorm", "post_feedforward_layernorm"},
        windows="layer_types",
        embedding_scale="sqrt_hidden",
        softcapped_logits=True,
    ),
    "phi3": Architecture(
        layer_parts=_LLAMA.layer_parts | {"resid_attn_dropout", "resid_mlp_dropout"},
        attention_parts=frozenset({"qkv_proj", "o_proj"}),
        mlp_parts=frozenset({"gate_up_proj", "down_proj", "activation_fn"}),
        windows="config",
    ),
    # Its attention_multiplier is the attention layer's own ``scaling``, which the block reads.
    "granite": replace(_LLAMA, scaled_residuals=True, embedding_scale="multiplier", scaled_logits=True),
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


def sliding_window(kind: Architecture, config, layer: int) -> int | None:
    """The sliding window of layer ``layer`` (its index in the whole model), None where it attends
    to every earlier position. By the model's index, never a loaded layer's own attribute: a
    block builds its layers with local indices, so layer 2 of a block starting at 2 would read
    the type of layer 0."""
    window = getattr(config, "sliding_window", None)
    if kind.windows == "none" or window is None:
        return None
    if kind.windows == "config":
        return int(window)
    layer_type = config.layer_types[layer]
    if layer_type not in ("full_attention", "sliding_attention"):
        raise ModelError(
            f"layer {layer} has attention type {layer_type!r}; the layer block computes "
            "'full_attention' and 'sliding_attention' layers",
            code="model_unsupported",
        )
    return int(window) if layer_type == "sliding_attention" else None
