"""The control plane's trusted verifier: its own copies of the model's blocks, on this machine.

Challenge answers and audit material are recomputed here in float32 and compared per token. An
answer that misses the thresholds against float32 is compared once more against the same block
run in bfloat16 (``FALLBACK_DTYPE``), the precision GPU nodes serve in: rounding in bfloat16 can
move one token of an honest answer past the thresholds (about one challenge in 5,000, and the
first token of some real prompts), while a node that skips, fakes or swaps its layers is far from
both references. Blocks are loaded once per process and kept (a few spans per model); the lock
keeps two threads from loading the same span twice.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from worker_agent import model as models
from worker_agent.block import Block
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
