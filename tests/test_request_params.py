"""A job's request parameters: one frozen type, stored as the JSON the API has always written."""

from __future__ import annotations

import pytest

from marketplace.jobs.coordinator_inputs import sampling_params
from marketplace.jobs.errors import InvalidRequest
from marketplace.jobs.params import ChatMessage, RequestParams
from worker_agent.coordinator.sampling import SamplingParams

pytestmark = [pytest.mark.api]

CHAT_JSON = {
    "max_tokens": 12,
    "temperature": 0.5,
    "top_p": 0.9,
    "seed": 1234,
    "stop": ["\n\n", "END"],
    "stream": True,
    "include_usage": True,
    "user": "end-user-7",
    "speculation": True,
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
}
COMPLETION_JSON = {
    "max_tokens": 5,
    "temperature": 0.0,
    "top_p": 1.0,
    "seed": None,
    "stop": [],
    "stream": False,
    "include_usage": False,
    "user": None,
    "speculation": False,
    "prompt": "Hello there",
}


def test_a_chat_request_reads_back_from_its_json_and_writes_the_same_json():
    params = RequestParams.from_json(CHAT_JSON)

    assert params == RequestParams(
        max_tokens=12,
        temperature=0.5,
        top_p=0.9,
        seed=1234,
        stop=("\n\n", "END"),
        stream=True,
        include_usage=True,
        user="end-user-7",
        messages=(ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")),
    )
    assert params.chat is True
    assert params.to_json() == CHAT_JSON
    assert list(params.to_json()) == list(CHAT_JSON)  # the keys in the order the API wrote them


def test_a_completion_request_reads_back_from_its_json_and_writes_the_same_json():
    params = RequestParams.from_json(COMPLETION_JSON)

    assert params.chat is False
    assert (params.prompt, params.messages, params.stop, params.speculation) == ("Hello there", None, (), False)
    assert params.to_json() == COMPLETION_JSON


ADJUSTMENTS = {
    "top_k": 40,
    "min_p": 0.05,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.25,
    "repetition_penalty": 1.2,
}


def test_the_logits_adjustments_are_stored_when_set_and_read_back():
    bias = ((42, 5.0), (7, -100))
    params = RequestParams(prompt="Hi", logit_bias=bias, **ADJUSTMENTS)

    stored = params.to_json()

    assert {key: stored[key] for key in ADJUSTMENTS} == ADJUSTMENTS
    assert stored["logit_bias"] == {"42": 5.0, "7": -100}
    assert RequestParams.from_json(stored) == params
    assert sampling_params(params) == SamplingParams(temperature=1.0, logit_bias=bias, **ADJUSTMENTS)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"presence_penalty": 2.5}, "'presence_penalty' must be in [-2, 2], got 2.5."),
        ({"frequency_penalty": "high"}, "'frequency_penalty' must be a number."),
        ({"repetition_penalty": 0}, "'repetition_penalty' must be in (0, 2], got 0."),
        ({"min_p": 1.5}, "'min_p' must be in [0, 1], got 1.5."),
        ({"top_k": -1}, "'top_k' must be an integer in [0, 1048576]."),
        ({"logit_bias": ((5, 101.0),)}, "'logit_bias.5' must be in [-100, 100], got 101.0."),
        ({"logit_bias": ((5, 1.0), (5, 2.0))}, "'logit_bias' may bias at most 300 distinct tokens."),
    ],
)
def test_adjustments_out_of_range_are_refused(overrides, message):
    with pytest.raises(InvalidRequest) as refused:
        RequestParams(prompt="Hi", **overrides)

    assert str(refused.value) == message


def test_keys_a_row_lacks_take_the_defaults():
    params = RequestParams.from_json({"prompt": "Hi"})

    assert params == RequestParams(prompt="Hi")
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (256, 1.0, 1.0, None)
    assert (params.stop, params.stream, params.include_usage, params.user) == ((), False, False, None)
    assert params.speculation is True


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ("a", "b", "c", "d", "e")}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": None}, "messages"),
        ({"messages": (ChatMessage("user", "Hi"),)}, "messages"),
        ({"speculation": "off"}, "speculation"),
    ],
)
def test_refuses_a_bad_value_naming_its_parameter(changes, param):
    fields = {"prompt": "Hi", **changes}

    with pytest.raises(InvalidRequest) as refused:
        RequestParams(**fields)

    assert refused.value.param == param


def test_an_empty_conversation_is_refused():
    with pytest.raises(InvalidRequest) as refused:
        RequestParams(messages=())

    assert (refused.value.param, str(refused.value)) == ("messages", "'messages' must be a non-empty array.")


def test_the_parameters_are_frozen():
    params = RequestParams(prompt="Hi")

    with pytest.raises(AttributeError):
        params.max_tokens = 3  # type: ignore[misc]


def test_maps_to_the_coordinators_sampling_settings():
    params = RequestParams.from_json(CHAT_JSON)

    assert sampling_params(params) == SamplingParams(temperature=0.5, top_p=0.9, top_k=0, seed=1234)
