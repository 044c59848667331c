"""Rotary position embeddings: the cos/sin of each position, and rotating queries and keys by them.

Computed as transformers' rotary embedding and ``modeling_rope_utils`` compute them, operation for
operation, so a block's numerics are the model's own:

- inverse frequencies ``1 / theta^(2i / dim)`` over ``dim`` rotary dims (the head's, or for Phi-3's
  default and every scaled type ``partial_rotary_factor`` of it), changed by the config's
  ``rope_type``: ``linear`` (divided by ``factor``), ``dynamic`` (NTK: theta grows with the
  sequence past ``max_position_embeddings``), ``yarn``, ``longrope`` (``short_factor``, or
  ``long_factor`` past ``original_max_position_embeddings``), ``llama3`` and ``proportional``;
  any other type is refused (``ModelError``);
- ``cos``/``sin`` of ``position * inv_freq`` in float32, both halves the same (rotate-half
  layout), times the type's attention factor (yarn, longrope; 1 elsewhere), then cast to the
  activations' dtype;
- ``dynamic`` and ``longrope`` choose their frequencies per call from the largest position in it,
  and ``dynamic`` keeps what it grew to until a call falls back under the original length, as
  transformers' ``dynamic_rope_update`` does (shared by every session of a pass, as it is there).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from worker_agent.config import ModelConfig
from worker_agent.errors import ModelError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
SeqLen = int | torch.Tensor | None  # the sequence length a frequency set is for; None: at load


class Rotary:
    """The rotary embedding of one model: ``rotary(positions, dtype)`` -> (cos, sin)."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.config = config
        self.parameters = config.rope_parameters
        self.kind: str = self.parameters["rope_type"]
        if self.kind not in ROPE_TYPES:
            raise ModelError(
                f"{config.name}: rotary type {self.kind!r} is not one the layer block computes; "
                f"supported: {', '.join(ROPE_TYPES)}",
                code="model_unsupported",
            )
        self.device = device
        try:
            inv_freq, self.attention_factor = self._frequencies(None)
        except (KeyError, TypeError) as exc:
            raise ModelError(f"{config.name}: rotary parameters {self.parameters} lack {exc}") from exc
        self.inv_freq = self.original_inv_freq = inv_freq  # (dim / 2,)
        self.long_inv_freq: torch.Tensor | None = None
        self.original_max_seq_len = config.max_position_embeddings
        # The length dynamic's frequencies are for: a 0-dim tensor once grown, as transformers keeps it.
        self.max_seq_len_cached: int | torch.Tensor = self.original_max_seq_len

    @property
    def dims(self) -> int:
        """How many leading dims of each head rotate."""
        return 2 * self.inv_freq.shape[0]

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (tokens,) -> cos, sin (tokens, dims) in ``dtype``."""
        if self.kind == "dynamic":
            self._dynamic_update(positions)
        elif self.kind == "longrope":
            self._longrope_update(positions)
        freqs = positions[:, None].float() * self.inv_freq.float()  # (tokens, dims / 2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (tokens, dims)
        return (angles.cos() * self.attention_factor).to(dtype), (angles.sin() * self.attention_factor).to(dtype)

    def _dynamic_update(self, positions: torch.Tensor) -> None:
        seq_len = torch.max(positions) + 1
        if seq_len > self.max_seq_len_cached:  # grown past what the frequencies are for
            self.inv_freq, self.attention_factor = self._frequencies(seq_len)
            self.max_seq_len_cached = seq_len
        if seq_len < self.original_max_seq_len and self.max_seq_len_cached > self.original_max_seq_len:
            self.inv_freq = self.original_inv_freq
            self.max_seq_len_cached = self.original_max_seq_len

    def _longrope_update(self, positions: torch.Tensor) -> None:
        seq_len = torch.max(positions) + 1
        original = self.parameters["original_max_position_embeddings"]
        if self.long_inv_freq is None:
            self.long_inv_freq, _ = self._frequencies(original + 1)
        self.inv_freq = torch.where(seq_len > original, self.long_inv_freq, self.original_inv_freq)

    def _frequencies(self, seq_len: SeqLen) -> tuple[torch.Tensor, float]:
        """(inv_freq (dims / 2,) float32, attention factor) for sequences of ``seq_len``."""
        config, parameters, device = self.config, self.parameters, self.device
        base = parameters["rope_theta"]
        head_dim = config.head_dim
        if self.kind == "default":
            factor = parameters.get("partial_rotary_factor", 1.0) if config.kind.phi3_rotary else 1.0
            dim = int(head_dim * factor)
            return (1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).to(device), 1.0
        dim = int(head_dim * parameters.get("partial_rotary_factor", 1.0))
        if self.kind == "proportional":
            return _proportional(parameters, head_dim, device), 1.0
        if self.kind == "yarn":
            return _yarn(parameters, config, dim, device)
        if self.kind == "longrope":
            return _longrope(parameters, config, dim, device, seq_len)
        if self.kind == "dynamic":
            base = _dynamic_base(parameters, config, dim, seq_len)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
        inv_freq = 1.0 / (base**exponents)
        if self.kind == "linear":
            inv_freq /= parameters["factor"]
        elif self.kind == "llama3":
            inv_freq = _llama3(parameters, inv_freq)
        return inv_freq, 1.0


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (heads, tokens, head_dim) rotated by cos, sin (tokens, dims): its first ``dims`` dims, the
    rest passed through (Phi-3's partial rotary)."""
    dims = cos.shape[-1]
    if dims == x.shape[-1]:
        return (x * cos) + (_rotate_half(x) * sin)
    rotated, passed = x[..., :dims], x[..., dims:]
    return torch.cat([(rotated * cos) + (_rotate_half(rotated) * sin), passed], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _dynamic_base(parameters: dict[str, Any], config: ModelConfig, dim: int, seq_len: SeqLen) -> Any:
    """NTK-aware theta for ``seq_len`` (at least max_position_embeddings); a tensor when it is."""
    factor, longest = parameters["factor"], config.max_position_embeddings
    if seq_len is None:
        seq_len = longest
    elif isinstance(seq_len, torch.Tensor):
        seq_len = torch.maximum(seq_len, torch.tensor(longest, dtype=seq_len.dtype, device=seq_len.device))
    else:
        seq_len = max(seq_len, longest)
    return parameters["rope_theta"] * ((factor * seq_len / longest) - (factor - 1)) ** (dim / (dim - 2))


def _proportional(parameters: dict[str, Any], head_dim: int, device: torch.device) -> torch.Tensor:
    """Frequencies for ``partial_rotary_factor`` of the head's angle pairs, zero for the rest."""
    base, factor = parameters["rope_theta"], parameters.get("factor", 1.0)
    angles = int(parameters.get("partial_rotary_factor", 1.0) * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
    inv_freq = 1.0 / (base**exponents)
    unrotated = head_dim // 2 - angles
    if unrotated > 0:
        inv_freq = torch.cat((inv_freq, torch.zeros(unrotated, dtype=torch.float32, device=device)), dim=0)
    return inv_freq / factor


def _yarn(
    parameters: dict[str, Any], config: ModelConfig, dim: int, device: torch.device
) -> tuple[torch.Tensor, float]:
    base = parameters["rope_theta"]
    factor = parameters["factor"]
    attention_factor = parameters.get("attention_factor")
    mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
    original = parameters["original_max_position_embeddings"]
    if factor is None:
        factor = config.max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = parameters.get("beta_fast") or 32
    beta_slow = parameters.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # keeps the ramp finite
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(device=device, dtype=torch.float)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _longrope(
    parameters: dict[str, Any], config: ModelConfig, dim: int, device: torch.device, seq_len: SeqLen
) -> tuple[torch.Tensor, float]:
    base = parameters["rope_theta"]
    factor, attention_factor = parameters.get("factor"), parameters.get("attention_factor")
    original = parameters["original_max_position_embeddings"]
    if factor is None:
        factor = config.max_position_embeddings / original
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    scales = parameters["long_factor"] if seq_len and seq_len > original else parameters["short_factor"]
    ext_factors = torch.tensor(scales, dtype=torch.float32, device=device)
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (ext_factors * base**shape), attention_factor


def _llama3(parameters: dict[str, Any], inv_freq: torch.Tensor) -> torch.Tensor:
    factor = parameters["factor"]
    low_freq_factor, high_freq_factor = parameters["low_freq_factor"], parameters["high_freq_factor"]
    old_context = parameters["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)
