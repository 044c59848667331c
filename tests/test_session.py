"""GenerationState with SmolLM2's real tokenizer and hand-made logits (one-hot at chosen ids)."""

from __future__ import annotations

import pytest
import torch

from worker_agent.coordinator.session import GenerationRequest, GenerationState, TokenEvent
from worker_agent.model import load_tokenizer

pytestmark = pytest.mark.dataplane

VOCAB = 49152
EOS = 2  # <|im_end|>
PROMPT = (19556, 28, 253)  # "Hello, a"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def _one_hot(token_id: int) -> torch.Tensor:
    logits = torch.zeros(VOCAB)
    logits[token_id] = 1.0
    return logits  # (vocab,)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def _step(state: GenerationState, token: int) -> list[TokenEvent]:
    """One plain step: the chain's unsent tokens go out, and the pipeline's logits pick ``token``."""
    made = state.next_chunk()
    assert made is not None
    chunk, _ = made
    assert state.rows_needed(chunk) == 1  # plain decoding needs the last row's logits only
    return state.fold(chunk, _one_hot(token).unsqueeze(0)).events


def _run(state: GenerationState, token_ids: list[int]) -> list[TokenEvent]:
    events = []
    for token in token_ids:
        assert not state.done
        events += _step(state, token)
    return events


def _state(tokenizer, **request) -> GenerationState:
    request = {"prompt_ids": PROMPT, "max_tokens": 64, "eos_ids": frozenset([EOS]), **request}
    return GenerationState(GenerationRequest(**request), tokenizer, clock=lambda: 0.0)


def test_the_tokenizer_splits_the_texts_used_here_as_expected(tokenizer):
    # The other tests rely on these splits; if the tokenizer changed, they would mislead.
    assert _ids(tokenizer, "Once upon a time. The end of it") == [6403, 1980, 253, 655, 30, 378, 1112, 282, 357]
    assert _ids(tokenizer, "Once upon a time. The cat sat") == [6403, 1980, 253, 655, 30, 378, 2644, 2643]
    assert _ids(tokenizer, "Hi 🦙!") == [26843, 15107, 116, 243, 17]  # "Hi", " 🦙" over three tokens, "!"
    assert tokenizer.eos_token_id == EOS


def test_stops_on_eos_with_finish_reason_stop(tokenizer):
    state = _state(tokenizer)
    tokens = _ids(tokenizer, "Once upon a time")

    events = _run(state, [*tokens, EOS])

    assert state.done
    assert state.finish_reason == "stop"
    assert state.generated == tokens  # the EOS itself is not part of the output
    assert state.text == "Once upon a time"
    assert [e.token_id for e in events] == tokens  # EOS releases no held text here: no event
    assert [e.text for e in events] == ["Once", " upon", " a", " time"]
    assert state.next_chunk() is None  # nothing more to send


def test_eos_as_the_first_token_gives_empty_text(tokenizer):
    state = _state(tokenizer)

    events = _run(state, [EOS])

    assert (state.finish_reason, state.generated, state.text) == ("stop", [], "")
    assert events == []


def test_stops_at_max_tokens_with_finish_reason_length(tokenizer):
    state = _state(tokenizer, max_tokens=3)

    events = _run(state, _ids(tokenizer, "Once upon a")[:3])

    assert state.done
    assert state.finish_reason == "length"
    assert state.generated == [6403, 1980, 253]
    assert state.text == "Once upon a"
    assert "".join(e.text for e in events) == "Once upon a"


def test_cuts_the_text_at_a_stop_string_and_never_streams_any_of_it(tokenizer):
    # Given the stop string "The end", which spans two tokens
    state = _state(tokenizer, stop=("The end",))

    # When the model writes "Once upon a time. The end ..."
    events = _run(state, _ids(tokenizer, "Once upon a time. The end")[:7])

    # Then the text ends before "The end", " The" was held back when it came, nothing after it is streamed
    assert state.finish_reason == "stop"
    assert state.text == "Once upon a time. "
    assert [e.text for e in events] == ["Once", " upon", " a", " time", ".", " ", ""]
    assert "".join(e.text for e in events) == state.text
    assert state.generated == [6403, 1980, 253, 655, 30, 378, 1112]


def test_a_held_back_stop_prefix_is_released_when_the_stop_string_does_not_follow(tokenizer):
    state = _state(tokenizer, stop=("The end",))

    events = _run(state, [*_ids(tokenizer, "Once upon a time. The cat sat"), EOS])

    assert state.finish_reason == "stop"
    assert [e.text for e in events] == ["Once", " upon", " a", " time", ".", " ", "The cat", " sat"]
    assert "".join(e.text for e in events) == state.text == "Once upon a time. The cat sat"


def test_a_held_back_stop_prefix_is_released_at_max_tokens(tokenizer):
    state = _state(tokenizer, stop=("The end",), max_tokens=6)

    events = _run(state, _ids(tokenizer, "Once upon a time. The")[:6])

    assert state.finish_reason == "length"
    assert "".join(e.text for e in events) == state.text == "Once upon a time. The"


def test_the_first_of_several_stop_strings_cuts_the_text(tokenizer):
    state = _state(tokenizer, stop=("cat", "upon"))

    events = _run(state, _ids(tokenizer, "Once upon a time")[:2])

    assert (state.finish_reason, state.text) == ("stop", "Once ")
    assert "".join(e.text for e in events) == "Once "


def test_a_character_split_over_tokens_is_streamed_only_once_complete(tokenizer):
    state = _state(tokenizer)

    events = _run(state, [*_ids(tokenizer, "Hi 🦙!"), EOS])

    assert [e.text for e in events] == ["Hi", " ", "", "🦙", "!"]
    assert "".join(e.text for e in events) == state.text == "Hi 🦙!"


def test_positions_advance_by_the_pending_tokens(tokenizer):
    state = _state(tokenizer)

    sent = []
    for token in _ids(tokenizer, "Once upon a"):
        chunk, tokens = state.next_chunk()
        sent.append((tokens, chunk.start))
        state.fold(chunk, _one_hot(token).unsqueeze(0))

    assert sent == [(list(PROMPT), 0), ([6403], 3), ([1980], 4)]
    assert (state.position, state.steps) == (5, 3)
    assert state.chain == [253]  # the last committed token, sent with the next step at position 5


def test_token_times_come_from_the_injected_clock(tokenizer):
    ticks = iter([10.0, 10.5, 11.25])
    request = GenerationRequest(PROMPT, max_tokens=2, eos_ids=frozenset([EOS]))
    state = GenerationState(request, tokenizer, clock=lambda: next(ticks))

    events = _run(state, [6403, 1980])

    assert [e.at for e in events] == [0.5, 1.25]
    assert state.token_times == [0.5, 1.25]


@pytest.mark.parametrize(
    "request_args",
    [
        {"prompt_ids": ()},
        {"prompt_ids": PROMPT, "max_tokens": 0},
        {"prompt_ids": PROMPT, "stop": ("ok", "")},
    ],
)
def test_refuses_a_bad_request(request_args):
    with pytest.raises(ValueError):
        GenerationRequest(**request_args)


def test_eos_releases_text_held_back_for_a_stop_string(tokenizer):
    state = _state(tokenizer, stop=("The end",))

    events = _run(state, [*_ids(tokenizer, "Once upon a time. The"), EOS])

    assert state.finish_reason == "stop"
    assert (events[-1].token_id, events[-1].text) == (None, "The")
    assert "".join(e.text for e in events) == state.text == "Once upon a time. The"


# --- speculation: chains of drafts, verified in order ------------------------------------------------


def _rows(*tokens: int) -> torch.Tensor:
    """Logits rows that make the target's choices ``tokens``, one per row. (rows, vocab)"""
    return torch.stack([_one_hot(token) for token in tokens])


def test_accepted_drafts_commit_with_the_bonus_token(tokenizer):
    state = _state(tokenizer)
    once, upon, a, time = _ids(tokenizer, "Once upon a time")

    chunk, tokens = state.next_chunk([once, upon, a])
    assert (tokens, chunk.start, state.rows_needed(chunk)) == ([*PROMPT, once, upon, a], 0, 4)
    fold = state.fold(chunk, _rows(once, upon, a, time))  # the prompt's last row, then one per draft

    assert (fold.drafted, fold.accepted) == (3, 3)
    assert [e.token_id for e in fold.events] == [once, upon, a, time]
    assert state.generated == [once, upon, a, time]
    assert (state.chain, state.position) == ([time], len(PROMPT) + 3)  # the bonus goes out next


def test_a_rejection_commits_the_target_token_and_voids_the_chunks_built_on_the_draft(tokenizer):
    state = _state(tokenizer)
    once, upon, a, time = _ids(tokenizer, "Once upon a time")
    the = _ids(tokenizer, " the")[0]
    first, _ = state.next_chunk([once, the])  # "the" is wrong: the target says "upon"
    second, tokens = state.next_chunk([a, time])  # in flight before the first came back
    assert (tokens, second.start) == ([a, time], len(PROMPT) + 2)

    fold = state.fold(first, _rows(once, upon, a))

    assert (fold.drafted, fold.accepted) == (2, 1)
    assert state.generated == [once, upon]
    assert second.void and state.in_flight == 0
    assert state.fold(second, None).events == []  # its result is awaited, then ignored
    third, tokens = state.next_chunk()
    assert (tokens, third.start) == ([upon], len(PROMPT) + 1)  # overwrites the rejected draft's position


def test_drafts_never_run_past_the_token_budget(tokenizer):
    state = _state(tokenizer, max_tokens=3)

    chunk, tokens = state.next_chunk([11, 12, 13, 14, 15])

    assert tokens == [*PROMPT, 11, 12]  # two drafts, and the bonus makes three tokens
    state.fold(chunk, _rows(11, 12, 13))
    assert (state.generated, state.finish_reason) == ([11, 12, 13], "length")


def test_an_eos_among_the_drafts_ends_the_stream_and_voids_the_rest(tokenizer):
    state = _state(tokenizer)
    once = _ids(tokenizer, "Once")[0]
    first, _ = state.next_chunk([once, EOS])
    second, _ = state.next_chunk([7])

    state.fold(first, _rows(once, EOS, 7))

    assert (state.finish_reason, state.generated, state.text) == ("stop", [once], "Once")
    assert second.void
    assert state.next_chunk([5]) is None
