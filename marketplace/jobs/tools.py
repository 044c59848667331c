"""Tool calling: a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, the
prompt that shows the functions to the model, the grammar its output must follow, and the calls
read back out of its text.

A call is JSON: ``{"name": <a function's name>, "arguments": <an object valid against that
function's parameters>}``, written bare, or inside the ``<tool_call>`` tags that Hermes-style chat
templates (Qwen2 and later, Hermes) teach their models. The output is constrained by a grammar
(``call_grammar``, llguidance's Lark syntax with the calls' JSON schemas inlined), so a call's
arguments always parse and validate:

- ``"required"``: the output is one call or, with ``parallel_tool_calls`` (the default),
  several, one per line (the same call written twice counts once).
- a named function: one call of it.
- ``"auto"`` (the default whenever tools are sent): the model answers either with calls, as
  above, or in words; it chooses. A model trained to call (its template renders tools) chooses by
  what it writes first: words never begin as a call does. Any other model is asked to decide
  first, in one word: its output opens with "Yes" (calls follow) or "No" (words follow), a
  question a small model answers far better than it would start a call of its own accord; the
  response leaves the word out (``DECISIONS``).

The response then carries ``tool_calls`` and finishes ``"tool_calls"``, or carries the text. A
model whose chat template renders tools gets them through its template (``tools=``), as it was
trained; any other model sees the functions in a system message listing them and the call's
shape (``instructions``). Earlier calls in the history are rendered as the model writes a call,
and their results as ``tool`` messages.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from marketplace.jobs.errors import InvalidRequest
from worker_agent.coordinator.grammar import JSON_DEFAULTS, LarkGrammar

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: str  # the JSON schema of the arguments, as JSON text

    def to_json(self) -> dict:
        return {"name": self.name, "description": self.description, "parameters": json.loads(self.parameters)}


def parse_tools(value: object) -> tuple[Tool, ...]:
    """A request's ``tools`` (None or [] for none); 400 naming what is wrong."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise InvalidRequest(f"'tools' must be an array of at most {MAX_TOOLS} tools.", param="tools")
    tools = []
    for index, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InvalidRequest(
                f'tools[{index}] must be {{"type": "function", "function": {{...}}}}.', param=f"tools.{index}"
            )
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidRequest(
                f"tools[{index}].function.name must be 1-64 letters, digits, '_' or '-'.",
                param=f"tools.{index}.function.name",
            )
        description = function.get("description") or ""
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(description, str) or not isinstance(parameters, dict):
            raise InvalidRequest(
                f"tools[{index}].function needs a string description and an object of parameters.",
                param=f"tools.{index}.function",
            )
        tools.append(Tool(name, description, json.dumps(parameters, sort_keys=True)))
    if len({tool.name for tool in tools}) != len(tools):
        raise InvalidRequest("'tools' names a function twice.", param="tools")
    return tuple(tools)


def parse_tool_choice(value: object, tools: tuple[Tool, ...]) -> str:
    """``"none"``, ``"auto"``, ``"required"`` or a function's name (the default: ``"auto"`` with
    tools, ``"none"`` without)."""
    if value is None:
        return "auto" if tools else "none"
    if value in ("none", "auto", "required"):
        choice = value
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        choice = value["function"].get("name")
        if choice not in {tool.name for tool in tools}:
            raise InvalidRequest(f"'tool_choice' names {choice!r}, which is not among 'tools'.", param="tool_choice")
    else:
        raise InvalidRequest(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
        )
    if choice != "none" and not tools:
        raise InvalidRequest("'tool_choice' needs 'tools'.", param="tool_choice")
    return choice


def declared_only(schema: object) -> object:
    """``schema`` with ``additionalProperties: false`` on every object that declares properties
    and says nothing of others: a call names only the arguments its function declares (any such
    call is valid against the function's own schema), and a model cannot wander off adding keys."""
    if isinstance(schema, list):
        return [declared_only(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        # A mapping of names to schemas is not a schema itself (a property may be named "properties").
        key: {name: declared_only(sub) for name, sub in value.items()}
        if key in SCHEMA_MAPS and isinstance(value, dict)
        else declared_only(value)
        for key, value in schema.items()
    }
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def chosen(tools: tuple[Tool, ...], choice: str) -> list[Tool]:
    """The functions a call may name: the one named, or any of them (``"required"``, ``"auto"``)."""
    return [tool for tool in tools if choice in ("required", "auto", tool.name)]


def call_schema(tools: tuple[Tool, ...], choice: str) -> dict:
    """The JSON schema of one call to the chosen function, or to any of them."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": declared_only(json.loads(tool.parameters))},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in chosen(tools, choice)
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


@dataclass(frozen=True)
class CallFormat:
    """How a model writes one call: the JSON between ``opening`` and ``closing``."""

    opening: str = ""
    closing: str = ""


BARE = CallFormat()
HERMES = CallFormat("<tool_call>\n", "\n</tool_call>")  # Qwen2 and later, Hermes


def call_format(tokenizer) -> CallFormat:
    """The call format the model's chat template teaches (bare JSON where it teaches none)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return HERMES if supports_tools(tokenizer) and HERMES.opening.strip() in template else BARE


# What a model asked to decide first (``decides``) opens its output with: calls follow, or words.
CALLS, WORDS = "Yes\n", "No\n"
DECISIONS = (CALLS, WORDS)


def decides(choice: str, tokenizer) -> bool:
    """Whether the model is asked to decide first between calls and words: under ``"auto"``, a
    model whose template renders no tools (so was not trained to choose a call itself)."""
    return choice == "auto" and not supports_tools(tokenizer)


def call_grammar(
    tools: tuple[Tool, ...], choice: str, parallel: bool, form: CallFormat, *, decide: bool = False
) -> LarkGrammar:
    """The grammar of the output: calls (one, or several on lines of their own when ``parallel``)
    and, with ``"auto"``, the alternative of words: opened by the decision when ``decide``, else
    text that does not begin as a call does."""
    schema = call_schema(tools, choice) | {"x-guidance": JSON_DEFAULTS}  # compact JSON, as response_format's
    call = " ".join(
        part for part in (_literal(form.opening), "%json " + json.dumps(schema), _literal(form.closing)) if part
    )
    several = parallel and choice in ("auto", "required")  # a named function is called once
    if decide:
        start = f"start: {_literal(CALLS)} calls | {_literal(WORDS)} TEXT"
    else:
        start = "start: calls | TEXT" if choice == "auto" else "start: calls"
    rules = [
        start,
        'calls: call ("\\n" call)*' if several else "calls: call",
        f"call: {call}",
    ]
    if decide:
        # Words after the decision's line: not a call, nor the decision said again ("No\nNo...").
        rules.append("TEXT: /([^\\n{NY]|N[^o\\n]|Y[^e\\n])(.|\\n)*/")
    elif choice == "auto":
        # Words begin with neither a call's first character nor a bare call's "{".
        firsts = "".join(sorted({"{", (form.opening or "{")[0]}))
        rules.append(f"TEXT: /[^{re.escape(firsts)}](.|\\n)*/")
    return LarkGrammar("\n".join(rules) + "\n")


def _literal(text: str) -> str:
    """A Lark string literal for ``text`` ("" for none)."""
    return json.dumps(text) if text else ""


def call_text(calls: list[dict]) -> str:
    """Earlier calls of an assistant message as a model writes calls, one JSON object a line."""
    texts = []
    for call in calls:
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = function["arguments"]
        texts.append(json.dumps({"name": function["name"], "arguments": arguments}))
    return "\n".join(texts)


def supports_tools(tokenizer) -> bool:
    """Whether the model's chat template renders tools (was trained to choose calls itself)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def instructions(tools: tuple[Tool, ...], choice: str) -> str:
    """A system message showing the functions to a model whose template cannot."""
    listed = [tool.to_json() for tool in chosen(tools, choice)]
    how = '{"name": <function name>, "arguments": <arguments>}'
    if choice == "auto":
        ask = (
            "Decide first: should you call one of these functions now? Begin your reply with Yes or No. "
            f"After Yes, write the call as a JSON object {how}. After No, answer the user in words; once a "
            "function's result is in the conversation, answer with it: say No."
        )
    else:
        ask = f"To call one, answer with only a JSON object: {how}."
    return "You can call these functions:\n" + "\n".join(json.dumps(tool) for tool in listed) + "\n" + ask


def template_tools(tools: tuple[Tool, ...], choice: str, tokenizer) -> list[dict] | None:
    """The functions to give the model's chat template (``tools=``, in OpenAI's shape, which the
    templates read), where it renders them; None where it cannot."""
    if choice == "none" or not supports_tools(tokenizer):
        return None
    return [{"type": "function", "function": tool.to_json()} for tool in chosen(tools, choice)]


def with_tools(messages: list[dict], tools: tuple[Tool, ...], choice: str, tokenizer) -> list[dict]:
    """The conversation to render for a model without tool support in its template: the
    functions listed in the (first) system message whenever it may call one."""
    if choice == "none" or supports_tools(tokenizer):
        return messages
    if decides(choice, tokenizer):  # its earlier calls as it wrote them: after its decision
        messages = [
            m | {"content": CALLS + m["content"]} if m["role"] == "assistant" and tool_calls_of(m["content"]) else m
            for m in messages
        ]
    note = instructions(tools, choice)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + note}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def decided(text: str) -> tuple[bool | None, str]:
    """An output that opens with its decision: (True: calls follow, False: words, None: not
    decided yet or not at all) and the text after the decision."""
    for decision, calls in ((CALLS, True), (WORDS, False)):
        if text.startswith(decision):
            return calls, text[len(decision) :]
    return None, text


def may_be_a_call(text: str) -> bool:
    """Whether an output beginning with ``text`` (not empty) may be calls rather than words: under
    ``"auto"``'s grammar, words never begin as a call does ("{" or "<tool_call>")."""
    return text[:1] in ("{", HERMES.opening[:1])


def tool_calls_of(text: str) -> list[dict] | None:
    """The calls in a constrained output, in OpenAI's ``tool_calls`` shape; None when the text
    is not whole calls (words under ``"auto"``, or cut by max_tokens)."""
    decoder = json.JSONDecoder()
    calls, rest = [], text.strip()
    while rest:
        wrapped = rest.startswith(HERMES.opening.strip())
        if wrapped:
            rest = rest[len(HERMES.opening.strip()) :].lstrip()
        try:
            call, end = decoder.raw_decode(rest)
        except ValueError:
            return None
        rest = rest[end:].lstrip()
        if wrapped:
            if not rest.startswith(HERMES.closing.strip()):
                return None
            rest = rest[len(HERMES.closing.strip()) :].lstrip()
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
            return None
        if call not in calls:  # the same call written twice is one call
            calls.append(call)
    if not calls:
        return None
    return [
        {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
        }
        for call in calls
    ]
