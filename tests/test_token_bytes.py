"""A token's ``bytes`` in the API's log-probabilities are the token's own bytes, as OpenAI gives
them: a byte-level BPE token holding part of a character has that part's bytes (its decoded text
alone is only a replacement character), so a client joining the bytes of a stream's tokens gets
the UTF-8 of the text."""

from __future__ import annotations

import pytest

from marketplace.flows.runner import token_bytes
from worker_agent import model as models

pytestmark = pytest.mark.api


@pytest.mark.parametrize("model", ["smollm2-135m", "tiny-llama"])
@pytest.mark.parametrize("text", ["Paris", " héllo wörld", "ok ✓ 😀 🐉", "<|im_end|>", "日本語のテキスト"])
def test_the_bytes_of_a_texts_tokens_join_into_its_utf8(model, text):
    tokenizer = models.load_tokenizer(model)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    assert b"".join(bytes(token_bytes(tokenizer, token)) for token in ids) == text.encode()


def test_a_token_holding_part_of_a_character_has_that_parts_bytes():
    tokenizer = models.load_tokenizer("smollm2-135m")
    ids = tokenizer(" 😀", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # the emoji's four bytes are split over tokens
    partial = [token for token in ids if "\ufffd" in tokenizer.decode([token])]
    assert partial, "some token decodes to a replacement character alone"
    for token in partial:
        assert bytes(token_bytes(tokenizer, token)) != "\ufffd".encode()
        assert bytes(token_bytes(tokenizer, token)) in " 😀".encode()
