"""The products a weight is multiplied by, chosen by timing them on the machine that runs them.

A decode step multiplies each weight by one to a few rows. On a CPU that is memory-bound, and
how fast the BLAS reads the weight depends on the form of the call and on the CPU itself: the
narrow form ``weight @ x.T`` read smollm2's weights up to 2.5x faster than ``F.linear`` on an AMD
EPYC at 1-4 rows, and 2.2-3.9x slower on an Intel Xeon (bench/README.md). No rule by vendor, and
no figure measured on another machine, holds on the next one. So:

- each kind of weight has a standard product and alternatives (``FLOAT``: ``F.linear``, or the
  narrow form; ``INT8``: ``F.linear`` by the dequantized weight, or PyTorch's int8 weight-only
  kernel, which reads a quarter of the bytes but costs more with every row);
- ``KernelTable.tune`` times every candidate once, at load, for a weight's shape and each row
  count of ``ROW_GRID`` up to a limit (``SLOW_ROW_GRID`` for a weight as slow as an LM head), in
  interleaved rounds (a burst of load elsewhere hits every candidate alike), and logs what it chose;
- an alternative is kept for a shape only when it is conclusively faster: its median time at
  least ``MARGIN`` under the standard's and faster in at least ``WINS`` of the rounds; anything
  else, including a tie within noise, keeps the standard product;
- a row count between two measured ones takes their choice when both agree, the standard
  product otherwise; row counts past the grid, weights never tuned, and every device but the CPU
  (where cuBLAS picks its own kernels) take the standard product.

The forms sum in different orders, so their results agree to float rounding, not bit for bit;
every comparison across processes in this project is tolerance-based (audits by cosine and norm,
greedy parity by tokens). ``TABLE`` is the process's table, filled by ``model.load_block`` (through
``Block``) and ``model.load_head``.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

QUANTIZE_ROWS = 64  # rows of a weight quantized at a time (float32 temporaries of 64 x in)
ROW_GRID = (1, 2, 3, 4, 6, 8, 12, 16)  # row counts timed; past 16 rows the standard products win
SLOW_ROW_GRID = (1, 2, 4, 8, 16)  # those of a weight whose one-row product takes over SLOW_CALL_S (an LM head)
ROUNDS = 7  # interleaved rounds per shape; 5 where one call takes over SLOW_CALL_S
SLOW_CALL_S = 0.002  # a layer's one-row products take well under this on a CPU, an LM head's well over
SAMPLE_S = 0.0005  # a round's sample repeats a fast call until it lasts about this long
MARGIN = 0.10  # an alternative's median must be this fraction under the standard's
WINS = 2 / 3  # ... and it must be the faster one in this share of the rounds

Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
Key = tuple  # (family name, out features, in features, weight dtype, rows)


def _key(family: Family, weight: torch.Tensor, rows: int) -> Key:
    return (family.name, weight.shape[0], weight.shape[1], weight.dtype, rows)


class Int8Weight(torch.Tensor):
    """A projection's weight stored as int8 (out, in) with one scale per output row (``scales``).

    ``weight ~= int8 * scales[:, None]``: symmetric per-row quantization, each row's scale its
    largest magnitude / 127 (the int8 weight-only scheme of gpt-fast and torchao). ``linear``
    multiplies by it; every other operation sees a plain int8 tensor (``__torch_function__`` is
    disabled), so a quantized layer runs only through ``linear`` (the ``Block``), never through
    Hugging Face's ``nn.Linear.forward``."""

    scales: torch.Tensor  # (out,), in the activations' dtype

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def quantize(weight: torch.Tensor, scale_dtype: torch.dtype) -> Int8Weight:
        """``weight`` (out, in), any float dtype (a view of the file, say), quantized in float32.

        A few rows at a time: the float32 temporaries stay small, so the process does not keep
        freed weight-sized blocks in its allocator (measured: quantizing whole weights left a
        process holding 7x the int8 block it loaded)."""
        values = torch.empty(weight.shape, dtype=torch.int8)  # (out, in)
        scales = torch.empty(weight.shape[0], dtype=torch.float32)  # (out,)
        for first in range(0, weight.shape[0], QUANTIZE_ROWS):
            rows = weight[first : first + QUANTIZE_ROWS].detach().float()  # (chunk, in)
            low, high = torch.aminmax(rows, dim=1)
            scale = torch.maximum(-low, high).clamp(min=torch.finfo(torch.float32).tiny) / 127  # (chunk,)
            values[first : first + QUANTIZE_ROWS] = torch.div(rows, scale[:, None]).round_().clamp_(-127, 127)
            scales[first : first + QUANTIZE_ROWS] = scale
        quantized = torch.Tensor._make_subclass(Int8Weight, values)
        quantized.scales = scales.to(scale_dtype)
        return quantized

    def dequantize(self) -> torch.Tensor:
        """(out, in) in the scales' dtype."""
        return self.as_subclass(torch.Tensor).to(self.scales.dtype) * self.scales[:, None]


@dataclass(frozen=True)
class Kernel:
    name: str
    product: Product  # (x (rows, in), weight (out, in), bias (out,) or None) -> (rows, out)


@dataclass(frozen=True)
class Family:
    """The products for one kind of weight; ``kernels[0]`` is the standard one."""

    name: str
    kernels: tuple[Kernel, ...]

    @property
    def standard(self) -> Kernel:
        return self.kernels[0]


@dataclass(frozen=True)
class Verdict:
    kernel: Kernel  # the one kept
    medians_s: dict[str, float]  # each candidate's median seconds per call
    wins: dict[str, int]  # rounds in which each alternative beat the standard product


def _standard(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _narrow(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``weight @ x.T``: the weight as the BLAS's left-hand side, a few rows as a narrow right-hand
    side. One row is paired with a copy of itself: a one-column right-hand side goes to the
    matrix-vector routine, the very call this form is an alternative to."""
    rows = x.shape[0]
    right = torch.cat([x, x]) if rows == 1 else x  # (max(rows, 2), in)
    out = (weight @ right.T)[:, :rows].T.contiguous()  # (rows, out)
    return out if bias is None else out + bias


def _dequantized(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight.dequantize(), bias)  # type: ignore[attr-defined]


def _int8_pack(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch._weight_int8pack_mm(x.contiguous(), weight, weight.scales)  # type: ignore[attr-defined]
    return out if bias is None else out + bias


FLOAT = Family("float", (Kernel("standard", _standard), Kernel("narrow", _narrow)))
INT8 = Family("int8", (Kernel("dequantized", _dequantized), Kernel("int8_pack", _int8_pack)))


def choose(
    family: Family, call: Callable[[Kernel], object], *, clock: Callable[[], float] = time.perf_counter
) -> Verdict:
    """Time every kernel of ``family`` through ``call(kernel)`` (one product on the shape's inputs)
    and keep the standard one unless an alternative is conclusively faster (module docstring)."""
    kernels = family.kernels
    # Warm-up (first-call allocations, the weight into cache); the standard's call, timed, sizes the rounds.
    started = clock()
    call(family.standard)
    one_call = max(clock() - started, 1e-9)
    for kernel in kernels[1:]:
        call(kernel)
    repeats = max(1, min(50, int(SAMPLE_S / one_call)))
    rounds = ROUNDS if one_call < SLOW_CALL_S else 5
    samples: dict[str, list[float]] = {kernel.name: [] for kernel in kernels}
    for round_ in range(rounds):
        # Each round starts with another kernel, so none always runs first after a pause.
        for kernel in kernels[round_ % len(kernels) :] + kernels[: round_ % len(kernels)]:
            started = clock()
            for _ in range(repeats):
                call(kernel)
            samples[kernel.name].append((clock() - started) / repeats)
    standard = samples[family.standard.name]
    medians = {name: statistics.median(times) for name, times in samples.items()}
    wins = {
        kernel.name: sum(t < s for t, s in zip(samples[kernel.name], standard, strict=True)) for kernel in kernels[1:]
    }
    conclusive = [
        kernel
        for kernel in kernels[1:]
        if medians[kernel.name] <= (1 - MARGIN) * medians[family.standard.name] and wins[kernel.name] >= WINS * rounds
    ]
    best = min(conclusive, key=lambda kernel: medians[kernel.name], default=family.standard)
    return Verdict(best, medians, wins)


class KernelTable:
    """Which product each (family, weight shape, dtype, rows) takes in this process."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, log: Callable[[str], None] | None = None):
        self._clock = clock
        self._log = log or _log
        self._chosen: dict[Key, Kernel] = {}
        self._verdicts: dict[Key, Verdict] = {}
        self._tuned: set[Key] = set()  # (family, out, in, dtype, limit) already done

    def kernel(self, family: Family, weight: torch.Tensor, rows: int) -> Kernel:
        if weight.device.type != "cpu":
            return family.standard
        return self._chosen.get(_key(family, weight, rows), family.standard)

    def tune(
        self,
        family: Family,
        weight: torch.Tensor,
        *,
        max_rows: int,
        inputs: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """Time ``family``'s kernels for ``weight`` at each grid row count up to ``max_rows`` (once
        per shape and process). ``inputs(rows)`` makes the x of a call; by default, random rows in
        the dtype the weight is multiplied in."""
        in_features = weight.shape[1]
        done = _key(family, weight, max_rows)
        if weight.device.type != "cpu" or done in self._tuned:
            return
        self._tuned.add(done)
        dtype = weight.scales.dtype if isinstance(weight, Int8Weight) else weight.dtype
        make = inputs or (lambda rows: torch.randn(rows, in_features).to(dtype))
        grid: list[int] = []
        with torch.inference_mode():
            for rows in (r for r in ROW_GRID if r <= max_rows):
                if grid and rows not in self._grid_of(family, weight):
                    continue
                x = make(rows)

                def call(kernel: Kernel, x: torch.Tensor = x) -> torch.Tensor:
                    return kernel.product(x, weight, None)

                verdict = choose(family, call, clock=self._clock)
                self._verdicts[_key(family, weight, rows)] = verdict
                grid.append(rows)
        for rows in range(1, (grid[-1] if grid else 0) + 1):
            below = max(r for r in grid if r <= rows)
            above = min(r for r in grid if r >= rows)
            kept = {self._verdicts[_key(family, weight, r)].kernel for r in (below, above)}
            chosen = kept.pop() if len(kept) == 1 else family.standard
            key = _key(family, weight, rows)
            if chosen is family.standard:
                self._chosen.pop(key, None)
            else:
                self._chosen[key] = chosen
        self._log(self._describe(family, weight, grid))

    def _grid_of(self, family: Family, weight: torch.Tensor) -> tuple[int, ...]:
        """The row counts to time for ``weight``: fewer where one row's product is slow (an LM head),
        so a coordinator starts in under a second more, not several."""
        first = self._verdicts[_key(family, weight, ROW_GRID[0])]
        return SLOW_ROW_GRID if first.medians_s[family.standard.name] >= SLOW_CALL_S else ROW_GRID

    def _describe(self, family: Family, weight: torch.Tensor, grid: list[int]) -> str:
        out_features, in_features = weight.shape
        parts = []
        for rows in grid:
            verdict = self._verdicts[_key(family, weight, rows)]
            times = "/".join(f"{verdict.medians_s[k.name] * 1e6:.0f}" for k in family.kernels)
            parts.append(f"{rows}:{verdict.kernel.name} ({times} us)")
        names = "/".join(kernel.name for kernel in family.kernels)
        return f"{out_features}x{in_features} {str(weight.dtype).removeprefix('torch.')} [{names}] " + ", ".join(parts)

    def choices(self) -> list[dict]:
        """Every measured shape: the kernel kept and each candidate's median, for a benchmark's record."""
        return [
            {
                "family": family,
                "weight": f"{out_features}x{in_features}",
                "dtype": str(dtype).removeprefix("torch."),
                "rows": rows,
                "kernel": verdict.kernel.name,
                "median_us": {name: round(seconds * 1e6, 1) for name, seconds in verdict.medians_s.items()},
            }
            for (family, out_features, in_features, dtype, rows), verdict in sorted(
                self._verdicts.items(), key=lambda item: (*item[0][:3], str(item[0][3]), item[0][4])
            )
        ]


def _log(message: str) -> None:
    print(f"[kernels] {message}", file=sys.stderr, flush=True)


TABLE = KernelTable()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x (..., in), by the product ``TABLE`` chose for the shape."""
    family = INT8 if isinstance(weight, Int8Weight) else FLOAT
    flat = x.reshape(-1, x.shape[-1])  # (rows, in)
    out = TABLE.kernel(family, weight, flat.shape[0]).product(flat, weight, bias)  # (rows, out)
    return out.view(*x.shape[:-1], out.shape[-1])


def tune_module(module: torch.nn.Module, *, max_rows: int = ROW_GRID[-1]) -> None:
    """Tune every projection of a module (a layer block, the LM head) in ``TABLE``."""
    for child in module.modules():
        weight = getattr(child, "weight", None)
        if isinstance(weight, torch.Tensor) and (isinstance(child, torch.nn.Linear) or isinstance(weight, Int8Weight)):
            family = INT8 if isinstance(weight, Int8Weight) else FLOAT
            TABLE.tune(family, weight, max_rows=max_rows)
