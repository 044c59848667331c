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
calls. At most ``max_batch`` items run per pass; more are split into several passes. A pass of
a few rows (decode steps, short speculative chunks) multiplies by each weight through
``model.linear``, which on CPU reads the weight at about twice the bandwidth of ``nn.Linear``.

The maths is that of a Llama decoder layer, computed with the loaded layer's own submodules:
``x + o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))`` with
``n = input_layernorm(x)``, then ``x + down_proj(act(gate_proj(m)) * up_proj(m))`` with
``m = post_attention_layernorm(x)``, with grouped-query
attention, projection biases where the checkpoint has them, per-head q/k norms where the layer
has them (Qwen3), and whatever rope scaling the model's rotary module implements. Building a
``Block`` over anything else raises ``ModelError`` (code ``model_unsupported``) naming what it
lacks: a model type other than llama, mistral, qwen2 and qwen3 (other Llama-like types add
multipliers, extra norms, fused projections or post-norms), a layer whose submodules differ from
those above, or sliding-window attention in effect (a Mistral config with ``sliding_window``
set, Qwen's sliding layers). There is no fallback to Hugging Face's own layer forward.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

from worker_agent.errors import ModelError
from worker_agent.kvcache import KVLayout, KVSession
from worker_agent.model import BlockWeights, linear, model_name

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_LAYER_PARTS = frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"})
_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
_HEAD_NORMS = frozenset({"q_norm", "k_norm"})
_MLP_PARTS = frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"})


@dataclass(frozen=True)
class WorkItem:
    session: KVSession
    start: int  # position of the first token in ``hidden``
    hidden: torch.Tensor  # (tokens, hidden)


@dataclass(frozen=True)
class _Span:
    """Where one item sits in a pass, and what its queries may see."""

    row: int  # the item's first row among the pass's concatenated rows
    start: int  # position of its first token in its session
    count: int  # its tokens
    # (group * count, start + count), True where a query row may attend a key; None for one token,
    # which attends every key. Rows are ordered (head of the group, token), as ``_attend`` packs them.
    mask: torch.Tensor | None

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.count)

    @property
    def end(self) -> int:
        return self.start + self.count


class Block:
    """Layers ``[layer_start, layer_end)`` of a model, run over work items (see the module docstring)."""

    def __init__(self, weights: BlockWeights, *, max_batch: int = 32) -> None:
        attention = _check_supported(weights)
        self.weights = weights
        self.max_batch = max_batch
        self.head_dim = int(attention.head_dim)
        self.heads = attention.q_proj.out_features // self.head_dim
        self.kv_heads = attention.k_proj.out_features // self.head_dim
        self.group = self.heads // self.kv_heads  # query heads sharing one key/value head
        self.scaling = float(attention.scaling)
        self.head_norms = hasattr(attention, "q_norm")
        self.layout = KVLayout(len(weights.layers), self.kv_heads, self.head_dim, weights.dtype, weights.device)
        # The model's own rotary maths (Llama's rotate-half for every supported type).
        self._rotate: Callable = sys.modules[type(attention).__module__].apply_rotary_pos_emb

    @property
    def hidden_size(self) -> int:
        return int(self.weights.config.hidden_size)

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
            spans.append(_Span(row, item.start, count, self._mask(item.start, count)))
            row += count
        hidden = torch.cat([item.hidden.to(device, dtype) for item in items])  # (tokens, hidden)
        positions = torch.cat([torch.arange(span.start, span.end, device=device) for span in spans])  # (tokens,)
        cos, sin = self.weights.rotary(hidden, positions.unsqueeze(0))  # (1, tokens, head_dim) each
        for index, layer in enumerate(self.weights.layers):
            hidden = self._layer(layer, index, hidden, cos[0], sin[0], items, spans)
        for item, span in zip(items, spans, strict=True):
            item.session.length = span.end
        return list(hidden.split([span.count for span in spans]))

    def _mask(self, start: int, count: int) -> torch.Tensor | None:
        if count == 1:
            return None
        device = self.weights.device
        keys = torch.arange(start + count, device=device)
        causal = keys <= (start + torch.arange(count, device=device)).unsqueeze(1)  # (count, start + count)
        return causal.repeat(self.group, 1)  # (group * count, start + count)

    def _layer(
        self,
        layer: nn.Module,
        index: int,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        items: list[WorkItem],
        spans: list[_Span],
    ) -> torch.Tensor:
        """One decoder layer over the pass's rows. hidden: (tokens, hidden); cos, sin: (tokens, head_dim)."""
        attention = layer.self_attn
        tokens = hidden.shape[0]
        normed = layer.input_layernorm(hidden)
        queries = _project(attention.q_proj, normed).view(tokens, self.heads, self.head_dim)
        keys = _project(attention.k_proj, normed).view(tokens, self.kv_heads, self.head_dim)
        values = _project(attention.v_proj, normed).view(tokens, self.kv_heads, self.head_dim)
        if self.head_norms:
            queries, keys = attention.q_norm(queries), attention.k_norm(keys)
        queries, keys = self._rotate(queries.transpose(0, 1), keys.transpose(0, 1), cos, sin, unsqueeze_dim=0)
        values = values.transpose(0, 1)  # queries (heads, tokens, d); keys, values (kv_heads, tokens, d)

        mixed = hidden.new_empty(tokens, self.heads * self.head_dim)  # (tokens, heads * d)
        for item, span in zip(items, spans, strict=True):
            cached_keys, cached_values = item.session.keys[index], item.session.values[index]
            cached_keys[:, span.start : span.end] = keys[:, span.rows]
            cached_values[:, span.start : span.end] = values[:, span.rows]
            out = self._attend(queries[:, span.rows], cached_keys[:, : span.end], cached_values[:, : span.end], span)
            mixed[span.rows] = out.transpose(0, 1).reshape(span.count, -1)
        hidden = hidden + _project(attention.o_proj, mixed)
        mlp, normed = layer.mlp, layer.post_attention_layernorm(hidden)
        gated = mlp.act_fn(_project(mlp.gate_proj, normed)) * _project(mlp.up_proj, normed)
        return hidden + _project(mlp.down_proj, gated)

    def _attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, span: _Span) -> torch.Tensor:
        """queries (heads, count, d); keys, values (kv_heads, end, d) -> (heads, count, d).

        The query heads sharing a key/value head become rows against it, so the keys are never
        repeated per head; the mask is the causal one repeated for each head of the group."""
        rows = self.group * span.count
        packed = queries.reshape(1, self.kv_heads, rows, self.head_dim)  # (1, kv_heads, group * count, d)
        # 4-D, as torch's fused CPU kernel wants (3-D inputs take the slower unfused path).
        out = scaled_dot_product_attention(packed, keys[None], values[None], attn_mask=span.mask, scale=self.scaling)
        return out.view(self.heads, span.count, self.head_dim)


def _project(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A projection of the pass's rows, by ``model.linear`` (a few rows take the faster CPU form)."""
    return linear(x, module.weight, module.bias)


def _check_supported(weights: BlockWeights) -> nn.Module:
    """The first layer's attention module, once every layer is one ``Block`` computes exactly."""
    config, name = weights.config, model_name(weights.model)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"{name}: the layer block computes Llama-style decoder layers "
            f"({', '.join(SUPPORTED_MODEL_TYPES)}), not model type {model_type!r}",
            code="model_unsupported",
        )
    for local, layer in enumerate(weights.layers):
        where = f"{name} layer {weights.layer_start + local}"
        parts = {part for part, _ in layer.named_children()}
        if parts != _LAYER_PARTS:
            raise ModelError(
                f"{where} has parts {sorted(parts)}; the layer block computes exactly {sorted(_LAYER_PARTS)}",
                code="model_unsupported",
            )
        attention = layer.self_attn
        attention_parts = {part for part, _ in attention.named_children()}
        if attention_parts not in (_PROJECTIONS, _PROJECTIONS | _HEAD_NORMS):
            raise ModelError(
                f"{where} has attention parts {sorted(attention_parts)}; the layer block computes "
                f"{sorted(_PROJECTIONS)}, optionally with {sorted(_HEAD_NORMS)}",
                code="model_unsupported",
            )
        mlp_parts = {part for part, _ in layer.mlp.named_children()}
        if mlp_parts != _MLP_PARTS:
            raise ModelError(
                f"{where} has MLP parts {sorted(mlp_parts)}; the layer block computes exactly {sorted(_MLP_PARTS)}",
                code="model_unsupported",
            )
        # Mistral reads its window from the config; Qwen sets it per layer (None on full-attention layers).
        window = getattr(attention, "sliding_window", getattr(config, "sliding_window", None))
        if window is not None:
            raise ModelError(
                f"{where} uses sliding-window attention (window {window}), which the layer block does not implement",
                code="model_unsupported",
            )
    return weights.layers[0].self_attn
