"""Tool calling: a chat request's ``tools`` and ``tool_choice``, the prompt that shows them to the
model, the grammar its call must follow, and the call read back out of its text.

A call is JSON: ``{"name": <a function's name>, "arguments": <an object valid against that
function's parameters>}``. With ``tool_choice`` ``"required"`` or a named function the model's
output is constrained to that JSON (the structured-output grammar, ``grammar.py``), so the
arguments always parse and validate; the response then carries ``tool_calls`` and finishes
``"tool_calls"``. One call per response: a model may call again after seeing the result.

``"auto"`` would let the model decide whether to call, in the call format its own chat template
teaches; this API does not read model-specific call formats yet, so ``"auto"`` answers 400 rather
than pretend (no registry model's template renders tools: smollm2's does not). The model sees
the functions in a system message listing them and the call's shape, and earlier calls and their
results in the history are rendered as that same JSON and as ``tool`` messages.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from marketplace.jobs.errors import InvalidRequest

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


def call_schema(tools: tuple[Tool, ...], choice: str) -> dict:
    """The JSON schema of one call to the chosen function, or to any of them (``"required"``)."""
    chosen = [tool for tool in tools if choice in ("required", tool.name)]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": declared_only(json.loads(tool.parameters))},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in chosen
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def call_text(calls: list[dict]) -> str:
    """Earlier calls of an assistant message as the model writes a call (one JSON object each)."""
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
    listed = [tool.to_json() for tool in tools if choice in ("required", tool.name)]
    return (
        "You can call these functions:\n"
        + "\n".join(json.dumps(tool) for tool in listed)
        + '\nTo call one, answer with only a JSON object: {"name": <function name>, "arguments": <arguments>}.'
    )


def with_tools(messages: list[dict], tools: tuple[Tool, ...], choice: str, tokenizer) -> list[dict]:
    """The conversation to render for a model without tool support in its template: the
    functions listed in the (first) system message when a call is required."""
    if choice in ("none", "auto") or supports_tools(tokenizer):
        return messages
    note = instructions(tools, choice)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + note}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def tool_calls_of(text: str) -> list[dict] | None:
    """The call in a constrained output, in OpenAI's ``tool_calls`` shape; None when the text is
    not a whole call (cut by max_tokens)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    return [
        {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
        }
    ]
