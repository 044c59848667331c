"""The model-free drafters: prompt lookup over the committed tokens, and which one a round offers."""

from __future__ import annotations

import pytest

from worker_agent.coordinator.drafters import NGRAM_MAX_N, NgramDrafter, ngram_drafters
from worker_agent.coordinator.engine import ready_drafters
from worker_agent.coordinator.session import GenerationRequest, GenerationState
from worker_agent.model import load_tokenizer

pytestmark = pytest.mark.dataplane


def _state(prompt_ids: list[int], max_tokens: int = 16) -> GenerationState:
    return GenerationState(
        GenerationRequest(prompt_ids=prompt_ids, max_tokens=max_tokens), load_tokenizer("tiny-llama")
    )


def _drafter(tokens: list[int], **kwargs) -> NgramDrafter:
    drafter = NgramDrafter(**kwargs)
    drafter.observe(tokens)
    return drafter


def test_the_longest_suffix_match_proposes_what_followed_it():
    # "1 2 3" was followed by 4 once and "2 3" by 9 later: the longer match wins.
    drafter = _drafter([1, 2, 3, 4, 5, 7, 2, 3, 9, 8])

    assert drafter.propose([0, 1, 2, 3], 3) == [4, 5, 7]
    assert drafter.propose([0, 2, 3], 3) == [9, 8]  # the latest occurrence of "2 3"; the text ends after 8


def test_a_match_shorter_than_min_n_proposes_nothing():
    drafter = _drafter([1, 2, 3, 4])

    assert not drafter.ready([9, 3])  # "3" alone matches, but min_n is 2
    assert drafter.propose([9, 3], 4) == []
    assert drafter.ready([2, 3])
    assert drafter.propose([2, 3], 4) == [4]


def test_matches_up_to_max_n_tell_apart_repeats_of_a_phrase():
    # The phrase 1..7 recurs followed by 50 and then by 60; an 8-token suffix (0 then the phrase) picks
    # its own occurrence, where a 4-token one would take the latest.
    phrase = [1, 2, 3, 4, 5, 6, 7]
    drafter = _drafter([0, *phrase, 50, 9, *phrase, 60])

    assert NGRAM_MAX_N >= 8
    assert drafter.propose([0, *phrase], 1) == [50]
    assert drafter.propose([9, *phrase], 1) == [60]


def test_the_index_grows_with_committed_tokens_only():
    drafter = _drafter([5, 6, 7])
    assert drafter.propose([5, 6], 2) == [7]

    drafter.observe([5, 6, 7, 8, 5, 6])  # a longer commit: only the new tokens are indexed

    assert drafter.propose([8, 5, 6], 4) == [7, 8, 5, 6]
    assert drafter.propose([8, 5, 6], 0) == []


def test_ngram1_stands_in_only_where_ngram_has_no_match():
    # The context ends "1 7": neither "1 7" nor "7" was ever continued; nothing is ready.
    assert ready_drafters(ngram_drafters(), _state([1, 2, 3, 4, 1, 7])) == []
    # "3" was followed by 9, "9 3" never: only the one-token match.
    assert ready_drafters(ngram_drafters(), _state([1, 2, 3, 9, 3])) == ["ngram1"]
    # "1 2" was followed by 3: ngram has a match, and ngram1 stands aside.
    assert ready_drafters(ngram_drafters(), _state([1, 2, 3, 1, 2])) == ["ngram"]


def test_no_drafter_is_offered_without_room_for_drafts():
    assert ready_drafters(ngram_drafters(), _state([1, 2, 3, 1, 2], max_tokens=1)) == []


def test_while_chunks_fly_only_the_chains_own_drafter_is_offered():
    state = _state([1, 2, 3, 9, 3])
    state.next_chunk([])  # the prompt is in flight

    assert ready_drafters(ngram_drafters(), state, "ngram1") == ["ngram1"]
    assert ready_drafters(ngram_drafters(), state, "ngram") == []
