"""The layer block: runs ``layers[lo:hi]`` for one or many sessions in one pass.

One call takes work items, each (session, first position, hidden states of one or more
consecutive tokens), and returns each item's output hidden states. Every item runs in the same
pass whatever its token count (ragged batching): the items' rows are concatenated into one
(tokens, hidden) tensor, so each layer's norms, projections, rotary embedding and MLP run once
for the whole pass; only attention runs per item, over that item's own session. Each session's
new keys and values are written in place into its preallocated buffers (``kvcache.py``) at
``[start, start + count)``: nothing is padded or copied between steps, and a start below the
session's length overwrites what lay there (a truncation). A session appears at most once per
call, since its next step needs this one's keys; ``Stage.compute`` sends later steps in later
calls. At most ``max_batch`` items run per pass; more are split into several passes. Every
projection goes through ``kernels.linear``, whose product per weight shape and row count was
timed on this machine when the block was built (``kernels.py``).

The block computes the decoder layers of the model types in ``architectures.SUPPORTED_MODEL_TYPES``
(llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, granite) in plain torch, with no code of
transformers: the layers' parts (``layers.py``: norms, activations, projections) and the rotary
(``rotary.py``) compute each type's own numerics as its transformers model does (Gemma's
``x * (1 + w)`` RMSNorm in float32, its GELU-tanh, Phi-3's partial rotary, the scaled rotary
types), and the block combines them in the type's order:

    n = input_layernorm(x);  q, k, v = q_proj(n), k_proj(n), v_proj(n)   (or split qkv_proj(n))
    q, k = q_norm(q), k_norm(k)                       per head, where the layer has them (Qwen3)
    a = o_proj(attention(rope(q), rope(k), v))
    x = x + r * a;  x = x + r * mlp(post_attention_layernorm(x))                  (Llama order)
    x = x + post_attention_layernorm(a);                                     (Gemma 2's sandwich)
        x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
    mlp(m) = down_proj(act(gate_proj(m)) * up_proj(m))          (or gate, up split gate_up_proj(m))

with r = 1 but for Granite (its residual_multiplier; the product is skipped where r = 1).

Attention is grouped-query with the type's scale (head_dim ** -0.5; Gemma 2's
query_pre_attn_scalar ** -0.5, Granite's attention_multiplier), causal, with projection biases where
the checkpoint has them. A layer with a sliding window (Mistral's or Phi-3's
``config.sliding_window``, the sliding layers of Gemma 2 and Qwen) lets a query at position p see
keys at positions k with p - window < k <= p, as transformers' sliding mask does, at any sequence
length; the cache still holds every position, so truncation and re-prefill work the same on every
layer. Gemma 2's attention logits are soft-capped (c * tanh(s / c), before the mask) and its softmax
runs in float32, as its eager attention does; every other type goes through torch's fused
scaled-dot-product attention. Scaling the embeddings (Gemma, Granite) and the logits (Granite's
division, Gemma 2's soft-cap) is the coordinator's (``model.Head``).

What the block cannot compute never reaches it: ``model.load_config`` refuses a model type not in
the list, an activation it lacks or bidirectional attention, and ``model.load_block`` a rotary type
it lacks or a layer whose stored tensors differ from its type's (``ModelError``, code
``model_unsupported``), before reading a weight of that layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

from worker_agent.architectures import SUPPORTED_MODEL_TYPES
from worker_agent.config import ModelConfig, sliding_window
from worker_agent.errors import ModelError
from worker_agent.kernels import linear, tune_module
from worker_agent.kvcache import KVLayout, KVSession
from worker_agent.layers import MLP, Attention, DecoderLayer
from worker_agent.model import BlockWeights
from worker_agent.rotary import apply_rotary

__all__ = ["SUPPORTED_MODEL_TYPES", "Block", "WorkItem"]


@dataclass(frozen=True)
class WorkItem:
    session: KVSession
    start: int  # position of the first token in ``hidden``
    hidden: torch.Tensor  # (tokens, hidden)


@dataclass(frozen=True)
class _Span:
    """Where one item sits in a pass."""

    row: int  # the item's first row among the pass's concatenated rows
    start: int  # position of its first token in its session
    count: int  # its tokens

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.count)

    @property
    def end(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class _Keys:
    """The keys one item's queries attend to on layers of one window."""

    low: int  # the first key position any of its queries may see; keys [low, span.end) are read
    # (group * count, end - low), True where a query row may attend a key; None where every row sees
    # every key read (one token). Rows are ordered (head of the group, token), as ``_attend`` packs them.
    mask: torch.Tensor | None


class Block:
    """Layers ``[layer_start, layer_end)`` of a model, run over work items (see the module docstring)."""

    def __init__(self, weights: BlockWeights, *, max_batch: int = 32) -> None:
        config = weights.config
        kind = config.kind
        self.weights = weights
        self.max_batch = max_batch
        self.head_dim = config.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.group = self.heads // self.kv_heads  # query heads sharing one key/value head
        self.scaling = _scaling(config)
        self.head_norms = kind.head_norms
        self.fused_qkv = kind.fused_qkv
        self.fused_gate_up = kind.fused_gate_up
        self.sandwich_norms = kind.sandwich_norms
        # Granite's residual_multiplier on each sublayer's output; None: added as it is.
        self.residual_scale = config.residual_multiplier if kind.scaled_residuals else None
        self.softcap = config.attn_logit_softcapping if kind.softcapped_attention else None
        # Each layer's sliding window; None: it attends to every earlier position.
        self.windows = [sliding_window(config, weights.layer_start + local) for local in range(len(weights.layers))]
        self.layout = KVLayout(len(weights.layers), self.kv_heads, self.head_dim, weights.dtype, weights.device)
        for layer in weights.layers:  # once per weight shape in this process
            tune_module(layer)

    @property
    def hidden_size(self) -> int:
        return self.weights.config.hidden_size

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        """Outputs in the order of ``items``; each is (tokens, hidden) in the block's dtype.

        Raises ``ValueError`` when a session appears twice or an item starts past the positions
        its session holds (the stage refuses both before they get here)."""
        if len({id(item.session) for item in items}) != len(items):
            raise ValueError("a session appears twice in one call; its later step belongs in a later call")
        for item in items:
            if item.start > item.session.length:
                raise ValueError(
                    f"session {item.session.session!r} holds {item.session.length} positions; "
                    f"an item cannot start at {item.start}"
                )
        outputs: list[torch.Tensor] = []
        for first in range(0, len(items), self.max_batch):
            outputs += self._pass(items[first : first + self.max_batch])
        return outputs

    def _pass(self, items: list[WorkItem]) -> list[torch.Tensor]:
        device, dtype = self.weights.device, self.weights.dtype
        spans: list[_Span] = []
        row = 0
        for item in items:
            count = item.hidden.shape[0]
            # Positions from ``start`` on are about to be overwritten: should this pass fail, the
            # session holds what lies below ``start``, all of it still valid.
            item.session.truncate(item.start)
            item.session.reserve(item.start + count, self.layout)
            spans.append(_Span(row, item.start, count))
            row += count
        # What each item's queries see, once per distinct window of the block's layers.
        keys = {window: [self._keys(span, window) for span in spans] for window in set(self.windows)}
        hidden = torch.cat([item.hidden.to(device, dtype) for item in items])  # (tokens, hidden)
        positions = torch.cat([torch.arange(span.start, span.end, device=device) for span in spans])  # (tokens,)
        cos, sin = self.weights.rotary(positions, dtype)  # (tokens, rotary dims) each
        for index, layer in enumerate(self.weights.layers):
            visible = keys[self.windows[index]]
            hidden = self._layer(cast(DecoderLayer, layer), index, hidden, cos, sin, items, spans, visible)
        for item, span in zip(items, spans, strict=True):
            item.session.length = span.end
        return list(hidden.split([span.count for span in spans]))

    def _keys(self, span: _Span, window: int | None) -> _Keys:
        """Keys [low, end) and the mask over them: causal, and within ``window`` positions of the
        query where the layer has one (a query at p sees p - window < k <= p, transformers' rule)."""
        low = 0 if window is None else max(0, span.start - window + 1)
        if span.count == 1:
            return _Keys(low, None)
        device = self.weights.device
        keys = torch.arange(low, span.end, device=device)  # (end - low,)
        queries = (span.start + torch.arange(span.count, device=device)).unsqueeze(1)  # (count, 1)
        visible = keys <= queries  # (count, end - low)
        if window is not None:
            visible &= keys > queries - window
        return _Keys(low, visible.repeat(self.group, 1))  # (group * count, end - low)

    def _layer(
        self,
        layer: DecoderLayer,
        index: int,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        items: list[WorkItem],
        spans: list[_Span],
        visible: list[_Keys],
    ) -> torch.Tensor:
        """One decoder layer over the pass's rows. hidden: (tokens, hidden); cos, sin: (tokens, rotary dims)."""
        attention = layer.self_attn
        queries, keys, values = self._project_qkv(attention, layer.input_layernorm(hidden))
        if self.head_norms:
            queries, keys = attention.q_norm(queries), attention.k_norm(keys)
        queries, keys = apply_rotary(queries.transpose(0, 1), cos, sin), apply_rotary(keys.transpose(0, 1), cos, sin)
        values = values.transpose(0, 1)  # queries (heads, tokens, d); keys, values (kv_heads, tokens, d)

        mixed = hidden.new_empty(hidden.shape[0], self.heads * self.head_dim)  # (tokens, heads * d)
        for item, span, seen in zip(items, spans, visible, strict=True):
            cached_keys, cached_values = item.session.keys[index], item.session.values[index]
            cached_keys[:, span.start : span.end] = keys[:, span.rows]
            cached_values[:, span.start : span.end] = values[:, span.rows]
            out = self._attend(
                queries[:, span.rows], cached_keys[:, seen.low : span.end], cached_values[:, seen.low : span.end], seen
            )
            mixed[span.rows] = out.transpose(0, 1).reshape(span.count, -1)
        attended = _project(attention.o_proj, mixed)  # (tokens, hidden)
        if self.sandwich_norms:
            hidden = hidden + layer.post_attention_layernorm(attended)
            fed = self._mlp(layer.mlp, layer.pre_feedforward_layernorm(hidden))
            return hidden + layer.post_feedforward_layernorm(fed)
        hidden = hidden + self._residual(attended)
        return hidden + self._residual(self._mlp(layer.mlp, layer.post_attention_layernorm(hidden)))

    def _residual(self, out: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as it joins the residual stream."""
        return out if self.residual_scale is None else out * self.residual_scale

    def _project_qkv(
        self, attention: Attention, normed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (tokens, heads, d), keys and values (tokens, kv_heads, d) of the normed rows."""
        tokens, d = normed.shape[0], self.head_dim
        if self.fused_qkv:
            fused = _project(attention.qkv_proj, normed)  # (tokens, (heads + 2 * kv_heads) * d)
            queries, keys, values = fused.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        else:
            queries = _project(attention.q_proj, normed)
            keys = _project(attention.k_proj, normed)
            values = _project(attention.v_proj, normed)
        return (
            queries.reshape(tokens, self.heads, d),
            keys.reshape(tokens, self.kv_heads, d),
            values.reshape(tokens, self.kv_heads, d),
        )

    def _mlp(self, mlp: MLP, normed: torch.Tensor) -> torch.Tensor:
        """down(act(gate) * up) of the normed rows. (tokens, hidden)"""
        if self.fused_gate_up:
            gate, up = _project(mlp.gate_up_proj, normed).chunk(2, dim=-1)  # (tokens, inner) each
            return _project(mlp.down_proj, up * mlp.act(gate))
        return _project(mlp.down_proj, mlp.act(_project(mlp.gate_proj, normed)) * _project(mlp.up_proj, normed))

    def _attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: _Keys) -> torch.Tensor:
        """queries (heads, count, d); keys, values (kv_heads, keys, d) -> (heads, count, d).

        The query heads sharing a key/value head become rows against it, so the keys are never
        repeated per head; the mask is repeated for each head of the group."""
        count = queries.shape[1]
        packed = queries.reshape(1, self.kv_heads, self.group * count, self.head_dim)  # (1, kv_heads, group * count, d)
        if self.softcap is not None:
            out = _softcapped_attention(packed, keys[None], values[None], seen.mask, self.scaling, self.softcap)
        else:
            # 4-D, as torch's fused CPU kernel wants (3-D inputs take the slower unfused path).
            out = scaled_dot_product_attention(
                packed, keys[None], values[None], attn_mask=seen.mask, scale=self.scaling
            )
        # reshape, not view: CUDA's fused kernels may return the rows in a layout a view cannot cover.
        return out.reshape(self.heads, count, self.head_dim)


def _softcapped_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    cap: float,
) -> torch.Tensor:
    """Attention whose scores are squashed to (-cap, cap) before the mask, as Gemma 2's eager
    attention computes it (torch's fused kernel has no soft-cap): softmax in float32, then back to
    the inputs' dtype. queries (1, kv_heads, rows, d); keys, values (1, kv_heads, keys, d)."""
    scores = torch.matmul(queries, keys.transpose(2, 3)) * scaling  # (1, kv_heads, rows, keys)
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    return torch.matmul(weights, values)  # (1, kv_heads, rows, d)


def _project(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A projection of the pass's rows, by the product ``kernels`` chose for its shape and rows."""
    return linear(x, module.weight, module.bias)


def _scaling(config: ModelConfig) -> float:
    """What attention scores are multiplied by: the type's rule (``Architecture.scaling``)."""
    if config.kind.scaling == "attention_multiplier":
        return config.attention_multiplier
    scalar = config.query_pre_attn_scalar if config.kind.scaling == "query_pre_attn_scalar" else config.head_dim
    if not scalar:
        raise ModelError(f"{config.name}: config.json lacks query_pre_attn_scalar", code="model_unsupported")
    return scalar**-0.5
