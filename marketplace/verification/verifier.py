"""The control plane's trusted verifier: its own copies of the model's blocks, on this machine.

Challenge answers and audit material are recomputed here in float32 and compared per token. An
answer that misses the thresholds against float32 is compared once more against the same block
run in bfloat16 (``FALLBACK_DTYPE``), the precision GPU nodes serve in: rounding in bfloat16 can
move one token of an honest answer past the thresholds (about one challenge in 5,000, and the
first token of some real prompts), while a node that skips, fakes or swaps its layers is far from
both references. Blocks are loaded once per process and kept (a few spans per model); the lock
keeps two threads from loading the same span twice.

A session that reused a kept prefix is replayed on the cache its stage began with, rebuilt here
(``reused_inputs``): the model's trusted embeddings and the trusted layers before the stage turn
the reused prompt tokens into what the stage received for them.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict

import torch

from worker_agent import model as models
from worker_agent.block import Block
from worker_agent.model import Head
from worker_agent.protocol.audit import AuditMaterial, prefix_inputs
from worker_agent.protocol.span import Span

MAX_BLOCKS = 8
FALLBACK_DTYPE = "bfloat16"

_blocks: OrderedDict[tuple[Span, str], Block] = OrderedDict()
_lock = threading.Lock()


def trusted_block(span: Span, dtype: str = "float32") -> Block:
    key = (span, dtype)
    with _lock:
        block = _blocks.get(key)
        if block is None:
            block = Block(models.load_block(span.model, span.start, span.end, dtype=dtype, device="cpu"))
            _blocks[key] = block
            while len(_blocks) > MAX_BLOCKS:
                _blocks.popitem(last=False)
        _blocks.move_to_end(key)
        return block


@functools.cache
def trusted_head(model: str) -> Head:
    """The model's embeddings (and head), loaded once per process."""
    return models.load_head(model, dtype="float32", device="cpu")


def reused_inputs(material: AuditMaterial) -> torch.Tensor | None:
    """The audited stage's inputs for the positions its session reused (``audit.prefix_inputs``);
    None when it reused none."""
    if not material.prefix:
        return None
    before = trusted_block(Span(material.model, 0, material.layer_start)) if material.layer_start else None
    return prefix_inputs(material, trusted_head(material.model), before)
