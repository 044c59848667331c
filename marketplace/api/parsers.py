"""JSON request bodies read with bounds: a body nested deeper than MAX_JSON_DEPTH is refused as a
bad request, never parsed into a structure that code walking it recursively would choke on.

``loads_bounded`` serves the views that read their body themselves (the inference API, the
playground); ``BoundedJSONParser`` is the REST API's JSON parser (settings ``DEFAULT_PARSER_CLASSES``).
"""

from __future__ import annotations

import io
import json

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from marketplace.jobs.errors import InvalidRequest

MAX_JSON_DEPTH = 32  # arrays and objects inside one another; OpenAI's bodies need 4
TOO_DEEP = f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels."


def depth(value: object) -> int:
    """How deeply arrays and objects nest in ``value`` (a scalar: 0), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level > MAX_JSON_DEPTH:
            break
        stack.extend((child, level + 1) for child in children)
    return deepest


def loads_bounded(raw: bytes | str) -> object:
    """Parse a JSON body; ``InvalidRequest`` (code invalid_json) when it is not JSON or nests
    deeper than MAX_JSON_DEPTH."""
    try:
        value = json.loads(raw)
    except RecursionError:
        value = None
        nested_too_deep = True
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("The request body is not valid JSON.", code="invalid_json") from None
    else:
        nested_too_deep = depth(value) > MAX_JSON_DEPTH
    if nested_too_deep:
        raise InvalidRequest(TOO_DEEP, code="invalid_json")
    return value


class BoundedJSONParser(JSONParser):
    """DRF's JSON parser (strict: NaN and Infinity refused), also refusing (400) a body over
    SWARM_MAX_REQUEST_BYTES or nested deeper than MAX_JSON_DEPTH."""

    def parse(self, stream, media_type=None, parser_context=None):
        raw = stream.read(settings.SWARM_MAX_REQUEST_BYTES + 1) if stream is not None else b""
        if len(raw) > settings.SWARM_MAX_REQUEST_BYTES:
            raise ParseError(f"The request body is larger than {settings.SWARM_MAX_REQUEST_BYTES} bytes.")
        try:
            value = super().parse(io.BytesIO(raw), media_type, parser_context)
        except RecursionError:
            value, too_deep = None, True
        else:
            too_deep = depth(value) > MAX_JSON_DEPTH
        if too_deep:
            raise ParseError(TOO_DEEP)
        return value
