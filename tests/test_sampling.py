"""Token sampling: greedy, seeded randomness, top-k and top-p on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from worker_agent.coordinator.sampling import History, Sampler, SamplingParams, adjust, probabilities

pytestmark = pytest.mark.dataplane


def _logits_of(probs: list[float]) -> torch.Tensor:
    """Logits whose softmax at temperature 1 is ``probs``."""
    return torch.tensor([math.log(p) for p in probs])


def _random_logits(seed: int, vocab: int = 1000) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(params: SamplingParams, logits: torch.Tensor, n: int = 50) -> list[int]:
    sampler = Sampler(params)
    return [sampler.sample(logits) for _ in range(n)]


def test_greedy_takes_the_argmax():
    logits = torch.tensor([0.1, 2.5, -1.0, 2.4, 0.0])

    assert Sampler(SamplingParams()).sample(logits) == 1


def test_greedy_takes_the_first_of_tied_maxima():
    assert Sampler(SamplingParams()).sample(torch.tensor([0.0, 3.0, 3.0, 1.0])) == 1


def test_greedy_ignores_the_seed():
    logits = _random_logits(0)
    expected = int(torch.argmax(logits))

    assert [Sampler(SamplingParams(seed=seed)).sample(logits) for seed in (1, 2, 3)] == [expected] * 3


def test_seeded_sampling_is_reproducible():
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = _random_logits(1)

    draws_a, draws_b = _draws(params, logits), _draws(params, logits)

    assert draws_a == draws_b
    assert len(set(draws_a)) > 1  # it really samples, rather than always returning one token


def test_another_seed_gives_another_stream():
    logits = _random_logits(1)

    draws_1 = _draws(SamplingParams(temperature=1.0, seed=1), logits)
    draws_2 = _draws(SamplingParams(temperature=1.0, seed=2), logits)

    assert draws_1 != draws_2


@pytest.mark.parametrize("seed", range(5))
def test_top_k_1_equals_greedy(seed):
    logits = _random_logits(seed)
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=1, seed=seed))

    assert [sampler.sample(logits) for _ in range(10)] == [int(torch.argmax(logits))] * 10


def test_top_k_keeps_the_k_most_likely_tokens_renormalized():
    logits = _logits_of([0.1, 0.4, 0.2, 0.3])

    probs = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))

    assert torch.equal(probs == 0, torch.tensor([True, False, True, False]))
    torch.testing.assert_close(probs, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.3, [0.5]),  # the most likely token alone already reaches 0.3
        (0.6, [0.5, 0.3]),  # 0.5 falls short of 0.6, so the second token is needed
        (0.7, [0.5, 0.3]),
        (0.9, [0.5, 0.3, 0.15]),
        (1.0, [0.5, 0.3, 0.15, 0.05]),
    ],
)
def test_top_p_keeps_the_smallest_nucleus_reaching_p(top_p, kept):
    # Given four tokens with probabilities 0.15, 0.5, 0.05, 0.3 (deliberately out of order)
    probs_in = [0.15, 0.5, 0.05, 0.3]

    # When top-p filters them
    probs = probabilities(_logits_of(probs_in), SamplingParams(temperature=1.0, top_p=top_p))

    # Then exactly the smallest set reaching top_p survives, renormalized, in vocabulary order
    expected = torch.tensor([p / sum(kept) if p in kept else 0.0 for p in probs_in])
    assert torch.equal(probs == 0, expected == 0)
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-6)


def test_temperature_sharpens_the_distribution():
    logits = torch.tensor([1.0, 0.0])

    probs = probabilities(logits, SamplingParams(temperature=0.5))

    torch.testing.assert_close(probs, torch.softmax(torch.tensor([2.0, 0.0]), -1), rtol=0, atol=1e-7)


def test_sampling_never_draws_a_token_top_p_removed():
    logits = _logits_of([0.15, 0.5, 0.05, 0.3])
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=0))

    draws = {sampler.sample(logits) for _ in range(200)}

    assert draws == {1, 3}


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": -0.1},
        {"temperature": 100.5},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": float("nan")},
        {"top_k": -1},
    ],
)
def test_refuses_bad_parameters(params):
    with pytest.raises(ValueError):
        SamplingParams(**params)


def test_accepts_the_edges_of_the_ranges():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=100.0, top_p=1.0, top_k=0)]

    assert [p.greedy for p in params] == [True, False]


def test_logit_bias_adds_to_the_named_tokens():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    params = SamplingParams(logit_bias=((0, 10.0), (3, -100.0)))

    assert adjust(logits, params, None).tolist() == [11.0, 2.0, 3.0, -96.0]
    assert Sampler(params).sample(logits) == 0


def test_presence_and_frequency_penalties_follow_openais_formula():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # The output so far holds token 1 once and token 4 three times; the prompt's tokens do not count.
    history = History.of(prompt=[0, 2], output=[4, 1, 4, 4])

    adjusted = adjust(logits, params, history)

    assert adjusted.tolist() == [1.0, 2.0 - 0.25 - 0.5, 3.0, 4.0, 5.0 - 3 * 0.25 - 0.5]


def test_repetition_penalty_shrinks_every_seen_tokens_logit_toward_zero():
    logits = torch.tensor([2.0, -2.0, 3.0, -1.0])
    params = SamplingParams(repetition_penalty=2.0)
    history = History.of(prompt=[0], output=[1])  # the prompt's tokens count as well

    assert adjust(logits, params, history).tolist() == [1.0, -4.0, 3.0, -1.0]


def test_nothing_set_leaves_the_logits_as_they_are():
    logits = torch.tensor([1.0, 2.0])

    assert adjust(logits, SamplingParams(), History.of([0], [1])) is logits


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))

    probs = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.25))  # keeps p >= 0.125

    assert probs[3] == 0.0
    assert torch.allclose(probs[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)


@pytest.mark.parametrize(
    "params",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": float("nan")},
        {"repetition_penalty": 0.0},
        {"min_p": -0.1},
        {"logit_bias": ((1, 101.0),)},
        {"logit_bias": ((1, 1.0), (1, 2.0))},
        {"logit_bias": ((-1, 1.0),)},
    ],
)
def test_adjustments_out_of_range_are_refused(params):
    with pytest.raises(ValueError):
        SamplingParams(**params)
