"""Products chosen by timing them where they run (worker_agent/kernels.py), on a clock the test
drives: each fake kernel advances it by the cost the test gives it for the shape, so every
verdict is exact on any machine, however busy."""

from __future__ import annotations

import itertools

import pytest
import torch

from worker_agent import kernels
from worker_agent.kernels import Family, Kernel, KernelTable

pytestmark = pytest.mark.dataplane


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_family(clock: FakeClock, standard_cost, fast_cost) -> Family:
    """A standard kernel and an alternative whose calls take cost(rows, out_features) seconds of
    the fake clock; both compute the true product, so the table's choice is the only difference."""

    def timed(cost):
        def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            clock.now += cost(x.shape[0], weight.shape[0])
            return torch.nn.functional.linear(x, weight, bias)

        return product

    return Family("fake", (Kernel("standard", timed(standard_cost)), Kernel("fast", timed(fast_cost))))


def test_picks_the_faster_kernel_per_shape_and_the_standard_one_elsewhere():
    clock = FakeClock()
    # The alternative takes half the time at 1-4 rows of the wide weight, twice the time elsewhere.
    family = fake_family(
        clock,
        standard_cost=lambda rows, out: 1e-3,
        fast_cost=lambda rows, out: 0.5e-3 if rows <= 4 and out == 64 else 2e-3,
    )
    table = KernelTable(clock=clock, log=lambda line: None)
    wide, narrow = torch.randn(64, 16), torch.randn(8, 16)

    table.tune(family, wide, max_rows=8)
    table.tune(family, narrow, max_rows=8)

    assert [table.kernel(family, wide, rows).name for rows in range(1, 10)] == [
        "fast", "fast", "fast", "fast", "standard", "standard", "standard", "standard", "standard"
    ]  # fmt: skip
    assert [table.kernel(family, narrow, rows).name for rows in range(1, 10)] == ["standard"] * 9
    recorded = {(c["weight"], c["rows"]): c["kernel"] for c in table.choices()}
    assert recorded == {
        **{("64x16", rows): "fast" if rows <= 4 else "standard" for rows in (1, 2, 3, 4, 6, 8)},
        **{("8x16", rows): "standard" for rows in (1, 2, 3, 4, 6, 8)},
    }


def test_keeps_the_standard_kernel_when_the_difference_is_within_noise():
    clock = FakeClock()
    # 5% faster on average, and slower in some rounds: not conclusive.
    jitter = itertools.cycle([0.90e-3, 1.02e-3, 0.93e-3, 0.99e-3, 0.96e-3])
    family = fake_family(clock, standard_cost=lambda rows, out: 1e-3, fast_cost=lambda rows, out: next(jitter))
    table = KernelTable(clock=clock, log=lambda line: None)
    weight = torch.randn(32, 16)

    table.tune(family, weight, max_rows=4)

    assert [table.kernel(family, weight, rows).name for rows in range(1, 5)] == ["standard"] * 4
    assert {c["kernel"] for c in table.choices()} == {"standard"}


def test_keeps_the_standard_kernel_when_the_faster_median_hides_slower_rounds():
    clock = FakeClock()
    # Its median is 30% lower, but it loses 3 of 7 rounds: a burst, not a kernel that is faster.
    costs = itertools.cycle([0.7e-3, 0.7e-3, 0.7e-3, 0.7e-3, 3e-3, 3e-3, 3e-3])
    family = fake_family(clock, standard_cost=lambda rows, out: 1e-3, fast_cost=lambda rows, out: next(costs))

    verdict = kernels.choose(
        family, lambda kernel: kernel.product(torch.zeros(1, 4), torch.zeros(4, 4), None), clock=clock
    )

    assert verdict.kernel.name == "standard"
    assert verdict.medians_s["fast"] == pytest.approx(0.7e-3)
    assert verdict.wins == {"fast": 4}


def test_row_counts_between_two_measured_ones_take_their_common_choice_or_the_standard_one():
    clock = FakeClock()
    # Faster at 1-12 rows, slower at 16: rows 13-15 lie between two verdicts that disagree.
    family = fake_family(
        clock, standard_cost=lambda rows, out: 1e-3, fast_cost=lambda rows, out: 0.5e-3 if rows <= 12 else 2e-3
    )
    table = KernelTable(clock=clock, log=lambda line: None)
    weight = torch.randn(32, 16)

    table.tune(family, weight, max_rows=16)

    assert [table.kernel(family, weight, rows).name for rows in (5, 7, 9, 11, 12, 13, 15, 16, 17)] == [
        "fast", "fast", "fast", "fast", "fast", "standard", "standard", "standard", "standard"
    ]  # fmt: skip


def test_every_kernel_of_the_real_families_computes_the_product():
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(4))
    for rows in (1, 2, 5):
        x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
        expected = x.double() @ weight.double().T + bias.double()
        for kernel in kernels.FLOAT.kernels:
            torch.testing.assert_close(kernel.product(x, weight, bias).double(), expected, rtol=1e-5, atol=1e-5)


def test_a_weight_on_another_device_than_the_cpu_takes_the_standard_product():
    table = KernelTable(log=lambda line: None)
    weight = torch.randn(8, 4, device="meta")

    table.tune(kernels.FLOAT, weight, max_rows=4)

    assert table.kernel(kernels.FLOAT, weight, 1) is kernels.FLOAT.standard
    assert table.choices() == []
