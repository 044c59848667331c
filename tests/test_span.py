"""``Span``: a stage's model and layers, the one value that keys and compares stages."""

from __future__ import annotations

import dataclasses

import pytest

from worker_agent.errors import ModelError
from worker_agent.protocol.span import Span

pytestmark = pytest.mark.dataplane


def test_a_span_counts_its_layers_and_prints_as_the_logs_name_a_stage():
    span = Span("smollm2-135m", 10, 20)

    assert span.layers == 10
    assert str(span) == "smollm2-135m layers 10:20"
    assert repr(span) == "Span(model='smollm2-135m', start=10, end=20)"


def test_spans_are_equal_by_value_and_key_a_dict():
    served = {Span("tiny-llama", 0, 3): "old block", Span("tiny-llama", 3, 6): "new block"}

    assert served[Span("tiny-llama", 3, 6)] == "new block"
    assert Span("tiny-llama", 0, 3) != Span("smollm2-135m", 0, 3)


def test_spans_order_by_model_then_start_then_end():
    spans = [Span("tiny-llama", 2, 4), Span("smollm2-135m", 20, 30), Span("tiny-llama", 0, 6), Span("tiny-llama", 0, 2)]

    assert sorted(spans) == [
        Span("smollm2-135m", 20, 30),
        Span("tiny-llama", 0, 2),
        Span("tiny-llama", 0, 6),
        Span("tiny-llama", 2, 4),
    ]


def test_a_span_cannot_be_changed():
    span = Span("tiny-llama", 0, 3)

    with pytest.raises(dataclasses.FrozenInstanceError):
        span.end = 6  # type: ignore[misc]
    assert span == Span("tiny-llama", 0, 3)


@pytest.mark.parametrize(
    ("start", "end"),
    [(3, 3), (4, 2), (-1, 2), (True, 2), (0, 2.0), ("0", 2)],
    ids=repr,
)
def test_a_span_refuses_bounds_that_are_not_integers_0_le_start_lt_end(start, end):
    with pytest.raises(ModelError) as err:
        Span("tiny-llama", start, end)

    assert err.value.code == "bad_span"
    assert str(err.value) == f"bad layer span {start!r}:{end!r} for tiny-llama: need integers 0 <= start < end"


@pytest.mark.parametrize("model", ["", None, 3], ids=repr)
def test_a_span_refuses_a_model_that_is_not_a_non_empty_name(model):
    with pytest.raises(ModelError) as err:
        Span(model, 0, 2)  # type: ignore[arg-type]

    assert err.value.code == "bad_span"
    assert str(err.value) == f"a span's model must be a non-empty string, got {model!r}"
