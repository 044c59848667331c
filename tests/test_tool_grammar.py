"""Constrained output without a swarm: the grammar each ``tool_choice`` gives the output (a call,
several, or under "auto" the model's choice between calls and words), the calls read back out of the
text in either format, the prompt of a model whose chat template renders tools, which must be the
template's own rendering of them, and JSON numbers that end as a double's digits do. The tokens
are smollm2-135m's; a Hermes-style template (as Qwen2 and later ship) stands in for a checkpoint
with a tool-aware one."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from marketplace.jobs import services, tools
from marketplace.jobs.params import ChatMessage, RequestParams
from worker_agent import model as models
from worker_agent.coordinator.grammar import MAX_NUMBER_DIGITS, Constraint, JsonGrammar

pytestmark = pytest.mark.api

MODEL = "smollm2-135m"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
TOOLS = tools.parse_tools(
    [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "The weather now.", "parameters": CITY},
        },
        {"type": "function", "function": {"name": "get_time", "description": "The local time.", "parameters": CITY}},
    ]
)
CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
SECOND = '{"name":"get_time","arguments":{"city":"Rome"}}'
# A Hermes-style chat template, as Qwen2.5 ships it (shortened): the tools in the system turn, calls
# in <tool_call> tags.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{%- endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call><|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return models.load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def hermes(tokenizer):
    copied = copy.deepcopy(tokenizer)
    copied.chat_template = HERMES_TEMPLATE
    return copied


def follows(grammar, tokenizer, text: str) -> bool:
    """Whether ``text``, as the model's tokens, is a whole output the grammar allows."""
    constraint = Constraint(grammar, tokenizer, len(tokenizer))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if constraint.valid_prefix(ids) != len(ids):
        return False
    for token in ids:
        constraint.consume(token)
    return bool(constraint.mask()[tokenizer.eos_token_id])


@pytest.mark.parametrize(
    ("choice", "parallel", "allowed", "refused"),
    [
        ("auto", True, [CALL, f"{CALL}\n{SECOND}", "It is sunny in Paris."], ['{"name":"nope","arguments":{}}']),
        ("auto", False, [CALL, "Words."], [f"{CALL}\n{SECOND}"]),
        ("required", True, [CALL, f"{CALL}\n{SECOND}"], ["It is sunny in Paris.", ""]),
        ("required", False, [SECOND], [f"{CALL}\n{SECOND}", "Words."]),
        ("get_time", True, [SECOND], [CALL, "Words.", f"{SECOND}\n{SECOND}"]),  # a named function: once
    ],
)
def test_the_grammar_allows_what_the_tool_choice_allows(tokenizer, choice, parallel, allowed, refused):
    grammar = tools.call_grammar(TOOLS, choice, parallel, tools.BARE)

    assert [text for text in allowed if not follows(grammar, tokenizer, text)] == []
    assert [text for text in refused if follows(grammar, tokenizer, text)] == []


def test_a_model_that_decides_first_opens_with_yes_before_calls_and_no_before_words(tokenizer):
    grammar = tools.call_grammar(TOOLS, "auto", True, tools.BARE, decide=True)

    allowed = [f"Yes\n{CALL}", f"Yes\n{CALL}\n{SECOND}", "No\nIt is sunny in Paris.", "No\nSunny {maybe}.", "No\nNice."]
    refused = [CALL, "It is sunny.", "Yes\nIt is sunny.", "No\n", "Yes\n", "Maybe\nWords.", f"No\n{CALL}", "No\nNo"]
    assert [text for text in allowed if not follows(grammar, tokenizer, text)] == []
    assert [text for text in refused if follows(grammar, tokenizer, text)] == []
    assert tools.decided(f"Yes\n{CALL}") == (True, CALL)
    assert tools.decided("No\nWords.") == (False, "Words.")
    assert tools.decided("Ye") == (None, "Ye")


def test_only_a_model_whose_template_renders_no_tools_is_asked_to_decide_first(tokenizer, hermes):
    assert tools.decides("auto", tokenizer)
    assert not tools.decides("auto", hermes)  # trained to choose: it writes a call or words itself
    assert not tools.decides("required", tokenizer)
    assert not tools.decides("get_weather", tokenizer)


def test_under_auto_words_never_begin_as_a_call(tokenizer):
    grammar = tools.call_grammar(TOOLS, "auto", True, tools.BARE)

    # A "{" begins a call: it must go on as one, arguments valid.
    assert not follows(grammar, tokenizer, '{"name":"get_weather","arguments":{"town":"Paris"}}')
    assert not follows(grammar, tokenizer, "{ not a call }")


def test_a_hermes_template_gets_calls_in_its_tags(hermes, tokenizer):
    assert tools.call_format(hermes) == tools.HERMES
    assert tools.call_format(tokenizer) == tools.BARE
    grammar = tools.call_grammar(TOOLS, "auto", True, tools.HERMES)

    tagged = f"<tool_call>\n{CALL}\n</tool_call>"
    assert follows(grammar, hermes, tagged)
    assert follows(grammar, hermes, f"{tagged}\n<tool_call>\n{SECOND}\n</tool_call>")
    assert follows(grammar, hermes, "Words.")
    assert not follows(grammar, hermes, CALL)  # the model's own format, not the bare one


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (CALL, ["get_weather"]),
        (f"{CALL}\n{SECOND}", ["get_weather", "get_time"]),
        (f"{CALL}\n{CALL}\n{SECOND}", ["get_weather", "get_time"]),  # the same call twice is one
        (f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{SECOND}\n</tool_call>", ["get_weather", "get_time"]),
        ("It is sunny.", None),
        (CALL[:-3], None),  # cut by max_tokens
        (f"<tool_call>\n{CALL}", None),  # its closing tag cut off
    ],
)
def test_calls_are_read_back_in_either_format(text, names):
    calls = tools.tool_calls_of(text)

    assert (None if calls is None else [call["function"]["name"] for call in calls]) == names
    if calls:
        assert all(call["id"].startswith("call_") and call["type"] == "function" for call in calls)
        assert json.loads(calls[0]["function"]["arguments"]) == json.loads(CALL)["arguments"]


def test_a_tool_aware_template_renders_the_tools_itself(hermes, monkeypatch):
    """The prompt of a checkpoint whose template renders tools is the template's own rendering of
    the functions offered (no listing of ours in a system message)."""
    monkeypatch.setattr(models, "load_tokenizer", lambda model: hermes)
    messages = (ChatMessage("system", "Be brief."), ChatMessage("user", "Weather in Paris?"))
    params = RequestParams(messages=messages, tools=TOOLS, tool_choice="auto")

    ids = services.tokenize_prompt(MODEL, params)

    offered = [{"type": "function", "function": tool.to_json()} for tool in TOOLS]
    expected = hermes.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], tools=offered, add_generation_prompt=True
    )["input_ids"]
    assert list(ids) == list(expected)
    text = hermes.decode(ids)
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert "You can call these functions" not in text


def test_a_template_without_tools_gets_them_listed_in_a_system_message(tokenizer):
    messages = (ChatMessage("user", "Weather in Paris?"),)
    params = RequestParams(messages=messages, tools=TOOLS, tool_choice="auto")

    text = tokenizer.decode(services.tokenize_prompt(MODEL, params))

    assert "You can call these functions:" in text
    assert "Begin your reply with Yes or No." in text  # under "auto": the decision comes first
    # An earlier call in the history reads as the model wrote it: after its decision.
    history = (*messages, ChatMessage("assistant", CALL), ChatMessage("tool", "Sunny."))
    text = tokenizer.decode(
        services.tokenize_prompt(MODEL, RequestParams(messages=history, tools=TOOLS, tool_choice="auto"))
    )
    assert f"assistant\nYes\n{CALL}" in text
    assert json.dumps(TOOLS[0].to_json()) in text and json.dumps(TOOLS[1].to_json()) in text
    none = tokenizer.decode(services.tokenize_prompt(MODEL, RequestParams(messages=messages, tools=TOOLS)))
    assert "You can call these functions" not in none  # tool_choice "none": not shown


@pytest.mark.parametrize("schema", [{"type": "number"}, {"type": "integer"}, {"type": "number", "minimum": 0}])
def test_a_model_that_would_write_digits_forever_ends_its_number_as_a_double_does(tokenizer, schema):
    """Logits that always prefer a digit (a small model stuck in a number): the grammar alone lets
    the digits run on; the bound ends the number at 17 significant digits and the object closes."""
    shape = {"type": "object", "properties": {"x": schema}, "required": ["x"], "additionalProperties": False}
    spec = JsonGrammar(json.dumps(shape))
    constraint = Constraint(spec, tokenizer, len(tokenizer))
    prefers = torch.zeros(len(tokenizer))
    for digit in "123456789":
        prefers[tokenizer.convert_tokens_to_ids(digit)] = 10.0 - int(digit) / 10
    prefers[tokenizer.convert_tokens_to_ids(".")] = 9.0
    written = []
    for _ in range(60):
        token = int(constraint.apply(prefers).argmax())
        if token == tokenizer.eos_token_id:
            break
        constraint.consume(token)
        written.append(token)

    text = tokenizer.decode(written)
    assert constraint.stopped or constraint.mask()[tokenizer.eos_token_id], text
    mantissa = re.match(r'\{"x":-?([0-9.]+)', text).group(1)
    assert sum(char.isdigit() for char in mantissa) == MAX_NUMBER_DIGITS, text
    assert isinstance(json.loads(text)["x"], int | float)


def test_digits_inside_a_string_are_not_bounded(tokenizer):
    spec = JsonGrammar(json.dumps({"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}))
    constraint = Constraint(spec, tokenizer, len(tokenizer))
    text = '{"id":"' + "1" * 40
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        assert constraint.mask()[token], text
        constraint.consume(token)
    assert constraint.mask()[tokenizer.convert_tokens_to_ids("1")]
