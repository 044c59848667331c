"""How many layers of a model fit in a node's memory: weights in the node's dtype plus a KV budget.

A stage of ``m`` layers holds, per layer, the layer's weights and the KV cache of the sessions it
serves, so a node can take ``m`` layers while::

    m x (weight bytes + KV bytes) <= memory x MEMORY_FRACTION

- weight bytes: the layer's parameters times the bytes per parameter of the dtype the node serves
  in (:data:`DTYPES`; int8 is one byte plus a 16-bit scale per output row, as
  ``worker_agent.model.Int8Weight`` stores it);
- KV bytes, the budget one layer keeps for its sessions' caches:
  ``2 (K and V) x kv_heads x head_dim x bytes per element x positions x sessions``, with the cache
  in the activations' dtype (bfloat16 for int8 weights);
- ``MEMORY_FRACTION`` leaves the rest of the reported memory to activations, the runtime and the
  allocator's slack.

Pure functions over plain values; ``shares.layer_cap`` feeds them a node's report and the model's
config, ``bench/placement.py`` feeds them synthetic nodes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from marketplace.placement.errors import PlacementError
from worker_agent.protocol.control_protocol import MEMORY_FRACTION  # the agent holds its caches in that share too

MIB = 1 << 20


@dataclass(frozen=True)
class DtypeSize:
    """What one dtype costs in memory."""

    weight: int  # bytes per parameter (int8: the value alone; its scales are counted apart)
    kv: int  # bytes per cached key or value element, in the activations' dtype
    scaled: bool = False  # one 16-bit scale per output row of every projection


DTYPES: dict[str, DtypeSize] = {
    "float32": DtypeSize(weight=4, kv=4),
    "float16": DtypeSize(weight=2, kv=2),
    "bfloat16": DtypeSize(weight=2, kv=2),
    "int8": DtypeSize(weight=1, kv=2, scaled=True),
}
AGENT_DEFAULT_DTYPE = "float32"  # the agent's ``--dtype`` unless its owner chose another


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that decide its memory per layer."""

    layer_parameters: int  # parameters of one decoder layer
    hidden: int  # width of the residual stream: the input length of a projection row
    kv_heads: int  # key/value heads per layer
    head_dim: int  # width of one head

    def __post_init__(self) -> None:
        if min(self.layer_parameters, self.hidden, self.kv_heads, self.head_dim) < 1:
            raise PlacementError(f"a model's sizes must be >= 1, got {self}")


@dataclass(frozen=True)
class LayerFootprint:
    """What one layer of a model costs on one node."""

    dtype: str  # the dtype the node serves in
    weights: int  # bytes of one layer's parameters in that dtype
    kv: int  # bytes of one layer's KV budget
    positions: int  # positions per session the budget holds
    sessions: int  # sessions the budget holds

    @property
    def total(self) -> int:
        return self.weights + self.kv

    @property
    def position(self) -> int:
        """Bytes of KV cache one cached position costs this layer."""
        return self.kv // (self.positions * self.sessions)


def serving_dtype(reported: Sequence[str]) -> str:
    """The dtype a node serves in, from the dtypes it reported: the agent lists the dtypes its
    device runs with the one it serves in (its ``--dtype``) first
    (``worker_agent.agent.control.hardware_report``), so the first of a known size counts; float32 when
    none is known, which never gives a node more layers than it can hold."""
    return next((dtype for dtype in reported if dtype in DTYPES), AGENT_DEFAULT_DTYPE)


def footprint(shape: ModelShape, dtype: str, *, positions: int, sessions: int) -> LayerFootprint:
    """One layer of ``shape`` served in ``dtype`` with a KV budget of ``sessions`` sessions of
    ``positions`` positions each."""
    if dtype not in DTYPES:
        raise PlacementError(f"unknown dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if positions < 1 or sessions < 1:
        raise PlacementError(f"a KV budget needs positions and sessions >= 1, got {positions} and {sessions}")
    size = DTYPES[dtype]
    weights = shape.layer_parameters * size.weight
    if size.scaled:
        # One scale per output row, counted as one per ``hidden`` parameters (down_proj's rows are
        # longer: a slight over-count, on the safe side).
        weights += -(-shape.layer_parameters // shape.hidden) * 2
    kv = 2 * shape.kv_heads * shape.head_dim * size.kv * positions * sessions
    return LayerFootprint(dtype=dtype, weights=weights, kv=kv, positions=positions, sessions=sessions)


def layers_that_fit(memory_bytes: int, layer: LayerFootprint) -> int:
    """How many such layers ``memory_bytes`` hold (0 when not even one)."""
    return max(0, int(memory_bytes * MEMORY_FRACTION) // layer.total)


def memory_holding(layer: LayerFootprint, layers: int, positions: int) -> int:
    """The memory a node must report to hold ``layers`` such layers with ``positions`` positions
    cached over its sessions: their weights and caches, over MEMORY_FRACTION (rounded up)."""
    return math.ceil(layers * (layer.weights + layer.position * positions) / MEMORY_FRACTION)


def no_room(memory_bytes: int, layer: LayerFootprint) -> str:
    """Why ``memory_bytes`` hold no layer, with the figures that decide it."""
    return (
        f"its {memory_bytes / MIB:.0f} MiB of memory ({MEMORY_FRACTION:.0%} planned for blocks) hold no layer: "
        f"one needs {layer.weights / MIB:.1f} MiB of {layer.dtype} weights + {layer.kv / MIB:.1f} MiB of KV cache "
        f"({layer.sessions} sessions x {layer.positions} positions)"
    )
