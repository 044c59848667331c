"""The layer block: runs ``layers[lo:hi]`` for one or many sessions at once.

One call takes a batch of work items, each (session, first position, hidden states of one
or more consecutive tokens), and returns each item's output hidden states. Items of the same
length are run as one batch (continuous batching of concurrent sessions): their caches are
gathered into a left-padded batch cache, the padding is masked out, and each session's new
keys and values are scattered back into its own cache afterwards. A lone item runs directly
on its session's cache, exactly as single-process ``generate`` would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from worker_agent.kvcache import KVSession
from worker_agent.model import BlockWeights


@dataclass(frozen=True)
class WorkItem:
    session: KVSession
    start: int  # position of the first token in ``hidden``
    hidden: torch.Tensor  # (tokens, hidden)


class Block:
    def __init__(self, weights: BlockWeights, *, max_batch: int = 32) -> None:
        self.weights = weights
        self.max_batch = max_batch

    @property
    def hidden_size(self) -> int:
        return int(self.weights.config.hidden_size)

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        """Outputs in the order of ``items``; each is (tokens, hidden) in the block's dtype."""
        outputs: list[torch.Tensor | None] = [None] * len(items)
        groups: dict[int, list[int]] = {}
        for index, item in enumerate(items):
            item.session.truncate(item.start)
            groups.setdefault(item.hidden.shape[0], []).append(index)
        for indices in groups.values():
            for chunk_start in range(0, len(indices), self.max_batch):
                chunk = indices[chunk_start : chunk_start + self.max_batch]
                results = self._run([items[i] for i in chunk])
                for index, result in zip(chunk, results, strict=True):
                    outputs[index] = result
        return outputs  # type: ignore[return-value]

    def _run(self, items: list[WorkItem]) -> list[torch.Tensor]:
        if len(items) == 1:
            return [self._run_one(items[0])]
        return self._run_batch(items)

    def _layers(self, hidden, mask, positions, cache) -> torch.Tensor:
        rotary = self.weights.rotary(hidden, positions)
        for layer in self.weights.layers:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=rotary,
            )
        return hidden

    def _run_one(self, item: WorkItem) -> torch.Tensor:
        kv = item.session
        count = item.hidden.shape[0]
        hidden = item.hidden.to(self.weights.device, self.weights.dtype).unsqueeze(0)  # (1, tokens, hidden)
        positions = torch.arange(item.start, item.start + count, device=self.weights.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.weights.config,
            inputs_embeds=hidden,
            attention_mask=None,
            past_key_values=kv.cache,
            position_ids=positions,
        )
        out = self._layers(hidden, mask, positions, kv.cache)
        kv.length = item.start + count
        return out[0]

    @staticmethod
    def _past(kv: KVSession, layer_index: int, like: KVSession) -> tuple[torch.Tensor, torch.Tensor]:
        """A session's cached keys and values of one layer; empty ones shaped like ``like``'s."""
        if kv.length:
            layer = kv.cache.layers[layer_index]
            return layer.keys, layer.values
        template = like.cache.layers[layer_index].keys
        empty = template.new_zeros((1, template.shape[1], 0, template.shape[3]))  # (1, kv_heads, 0, d)
        return empty, empty

    def _run_batch(self, items: list[WorkItem]) -> list[torch.Tensor]:
        device, dtype = self.weights.device, self.weights.dtype
        count = items[0].hidden.shape[0]
        lengths = [item.session.length for item in items]
        longest = max(lengths)
        hidden = torch.stack([item.hidden for item in items]).to(device, dtype)  # (batch, tokens, hidden)
        offsets = torch.arange(count, device=device)
        positions = torch.stack([item.start + offsets for item in items])  # (batch, tokens)

        # Left-pad every session's past to the longest one; padding is masked out below.
        cache = DynamicCache()
        if longest:
            like = next(item.session for item in items if item.session.length)
            for layer_index in range(len(self.weights.layers)):
                keys, values = [], []
                for item in items:
                    past_keys, past_values = self._past(item.session, layer_index, like)
                    pad = longest - item.session.length
                    keys.append(torch.nn.functional.pad(past_keys, (0, 0, pad, 0)))  # (1, kv_heads, longest, d)
                    values.append(torch.nn.functional.pad(past_values, (0, 0, pad, 0)))
                cache.update(torch.cat(keys), torch.cat(values), layer_index)

        # mask[b, 0, i, j]: query i of item b may attend key j (its own past and causal present).
        key_index = torch.arange(longest + count, device=device)
        pads = torch.tensor([longest - length for length in lengths], device=device)
        not_padding = key_index.unsqueeze(0) >= pads.unsqueeze(1)  # (batch, keys)
        causal = key_index.unsqueeze(0) <= (longest + offsets).unsqueeze(1)  # (tokens, keys)
        mask = (not_padding.unsqueeze(1) & causal.unsqueeze(0)).unsqueeze(1)  # (batch, 1, tokens, keys)

        out = self._layers(hidden, mask, positions, cache)

        for row, item in enumerate(items):
            kv = item.session
            for layer_index in range(len(self.weights.layers)):
                layer = cache.layers[layer_index]
                kv.cache.update(
                    layer.keys[row : row + 1, :, longest:, :].clone(),
                    layer.values[row : row + 1, :, longest:, :].clone(),
                    layer_index,
                )
            kv.length = item.start + count
        return [out[row] for row in range(len(items))]
