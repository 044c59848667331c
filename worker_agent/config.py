"""A checkpoint's ``config.json``, read into the numbers the layer block and the head compute with.

An agent serving a block never imports transformers: this module reads the file itself. What a
config.json leaves out takes the value transformers' config class of that model type gives it
(``architectures.Architecture.defaults``), and the values transformers derives at load are derived
here the same way:

- ``head_dim``: the file's, else its type's default, else ``hidden_size // num_attention_heads``;
  ``num_key_value_heads`` likewise, else ``num_attention_heads``;
- Qwen's ``sliding_window`` counts only with ``use_sliding_window``; its ``layer_types``, when the
  file has none, slide from layer ``max_window_layers`` on (where there is a window); Gemma 2's
  alternate, sliding first;
- Gemma's legacy ``hidden_act: "gelu"`` means the tanh approximation;
- the rotary parameters (``rotary.RopeParameters``): ``rope_parameters`` (transformers 5), else the
  legacy ``rope_scaling`` with ``rope_theta`` beside it; ``rope_type`` (or the legacy ``type``)
  defaults to ``"default"``; ``partial_rotary_factor`` beside them moves in; the scaled types
  (llama3, yarn, longrope) take ``original_max_position_embeddings`` from ``max_position_embeddings``
  where they lack it, and Phi-3 from its own top-level field, which wins (its "su" and "yarn" mean
  longrope).

A config missing a number the block needs, or naming what the block does not compute (a model type,
an activation, a rotary type, bidirectional attention), is refused with ``ModelError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker_agent.architectures import Architecture, architecture
from worker_agent.errors import ModelError

ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")  # as transformers' ACT2FN computes them
SCALED_ROPE = ("llama3", "yarn", "longrope")  # the rotary types that read original_max_position_embeddings


@dataclass(frozen=True)
class ModelConfig:
    """The numbers of a decoder-only model; each named as in its config.json."""

    name: str  # the model's name in messages (``model.model_name``)
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str  # one of ACTIVATIONS
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on the attention projections, where the type reads this
    mlp_bias: bool  # biases on the MLP projections, where the type reads this
    rope_parameters: dict[str, Any]  # standardized: rope_type, rope_theta, and that type's own
    sliding_window: int | None  # positions a sliding layer sees; None: no layer slides
    layer_types: tuple[str, ...] | None  # per layer "full_attention" or "sliding_attention" (Gemma 2, Qwen)
    query_pre_attn_scalar: float | None  # Gemma 2: attention scores scale by its -1/2 power
    attn_logit_softcapping: float | None  # Gemma 2: attention scores squashed to (-c, c)
    final_logit_softcapping: float | None  # Gemma 2: logits squashed to (-c, c)
    embedding_multiplier: float  # Granite; 1 elsewhere
    residual_multiplier: float  # Granite
    attention_multiplier: float  # Granite: its attention scale
    logits_scaling: float  # Granite: the logits' divisor
    initializer_range: float  # the standard deviation of its untrained weights (a cheat's impostor)

    @property
    def kind(self) -> Architecture:
        return architecture(self.model_type, self.name)


def read_config(folder: Path, name: str) -> ModelConfig:
    """The config of the checkpoint in ``folder``; ``name`` names the model in errors."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{name}: cannot read config.json: {exc}") from exc
    return parse_config(raw, name)


def parse_config(raw: dict[str, Any], name: str) -> ModelConfig:
    model_type = raw.get("model_type")
    kind = architecture(model_type, name)
    values = {**kind.defaults, **{key: value for key, value in raw.items() if value is not None or key in NULLABLE}}

    def need(key: str) -> Any:
        if values.get(key) is None:
            raise ModelError(f"{name}: config.json lacks {key}", code="model_unsupported")
        return values[key]

    hidden, heads, layers = int(need("hidden_size")), int(need("num_attention_heads")), int(need("num_hidden_layers"))
    activation = values.get(kind.activation_key, "silu")
    if model_type == "gemma" and activation == "gelu":
        activation = "gelu_pytorch_tanh"
    if activation not in ACTIVATIONS:
        raise ModelError(
            f"{name}: activation {activation!r} is not one the layer block computes; "
            f"supported: {', '.join(ACTIVATIONS)}",
            code="model_unsupported",
        )
    if values.get("use_bidirectional_attention"):
        raise ModelError(
            f"{name}: its layers attend bidirectionally; the layer block computes causal attention only",
            code="model_unsupported",
        )
    window = values.get("sliding_window")
    if kind.windows == "layer_types" and "use_sliding_window" in kind.defaults and not values["use_sliding_window"]:
        window = None
    return ModelConfig(
        name=name,
        model_type=str(model_type),
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(values.get("num_key_value_heads") or heads),
        head_dim=int(values.get("head_dim") or hidden // heads),
        hidden_act=activation,
        rms_norm_eps=float(values.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(need("max_position_embeddings")),
        tie_word_embeddings=bool(values.get("tie_word_embeddings", False)),
        attention_bias=bool(values.get("attention_bias", False)),
        mlp_bias=bool(values.get("mlp_bias", False)),
        rope_parameters=_rope_parameters(raw, values, kind, name),
        sliding_window=None if window is None else int(window),
        layer_types=_layer_types(values, kind, window, layers),
        query_pre_attn_scalar=_optional_float(values.get("query_pre_attn_scalar")),
        attn_logit_softcapping=_optional_float(values.get("attn_logit_softcapping")),
        final_logit_softcapping=_optional_float(values.get("final_logit_softcapping")),
        embedding_multiplier=float(values.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(values.get("residual_multiplier", 1.0)),
        attention_multiplier=float(values.get("attention_multiplier", 1.0)),
        logits_scaling=float(values.get("logits_scaling", 1.0)),
        initializer_range=float(values.get("initializer_range", 0.02)),
    )


# Keys whose null in a config.json means "none" (no window, no soft-cap), not "the type's default".
NULLABLE = frozenset({"sliding_window", "attn_logit_softcapping", "final_logit_softcapping"})


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _layer_types(values: dict[str, Any], kind: Architecture, window: Any, layers: int) -> tuple[str, ...] | None:
    if values.get("layer_types") is not None:
        return tuple(values["layer_types"])
    if kind.windows != "layer_types":
        return None
    if "max_window_layers" in kind.defaults:  # Qwen
        first = int(values["max_window_layers"])
        return tuple(
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)
        )
    return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers))  # Gemma 2


def _rope_parameters(raw: dict[str, Any], values: dict[str, Any], kind: Architecture, name: str) -> dict[str, Any]:
    """transformers' standardized ``rope_parameters`` of the config (see the module docstring)."""
    parameters = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    if any(isinstance(value, dict) for value in parameters.values()):
        raise ModelError(f"{name}: rotary parameters per layer type are not supported", code="model_unsupported")
    parameters.setdefault("rope_theta", raw.get("rope_theta", 10_000.0))
    partial = raw.get("partial_rotary_factor", kind.defaults.get("partial_rotary_factor"))
    if partial is not None:
        parameters.setdefault("partial_rotary_factor", partial)
    parameters.setdefault("rope_type", parameters.get("type", "default"))
    if kind.phi3_rotary and parameters["rope_type"] in ("su", "yarn"):
        parameters["rope_type"] = "longrope"
    if parameters["rope_type"] in SCALED_ROPE:
        if kind.phi3_rotary:
            parameters["original_max_position_embeddings"] = values["original_max_position_embeddings"]
        else:
            parameters.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
    return parameters


def sliding_window(config: ModelConfig, layer: int) -> int | None:
    """The sliding window of layer ``layer`` (its index in the whole model), None where it attends
    to every earlier position. By the model's index, never a loaded layer's own attribute: a
    block builds its layers with local indices, so layer 2 of a block starting at 2 would read
    the type of layer 0."""
    kind, window = config.kind, config.sliding_window
    if kind.windows == "none" or window is None:
        return None
    if kind.windows == "config":
        return int(window)
    layer_type = (config.layer_types or ())[layer]
    if layer_type not in ("full_attention", "sliding_attention"):
        raise ModelError(
            f"layer {layer} has attention type {layer_type!r}; the layer block computes "
            "'full_attention' and 'sliding_attention' layers",
            code="model_unsupported",
        )
    return int(window) if layer_type == "sliding_attention" else None
