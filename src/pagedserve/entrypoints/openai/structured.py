"""A request's structured-output constraint, from whichever field gives it: OpenAI's
`response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` object, or vLLM's
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields. Each problem is
a 400 naming the field."""

from __future__ import annotations

import re
from typing import Any

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.structured_output import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _make(param: str, name: str | None = None, **kwargs: Any) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kwargs); errors name `name` (the field as the client wrote it)
    instead of "structured_outputs.<kind>"."""
    try:
        return StructuredOutputsParams(**kwargs)
    except TypeError as e:  # an unknown key in a structured_outputs object
        raise APIError(f"{param}: {e}", 400, param) from None
    except ValueError as e:
        message = str(e)
        if name is not None:
            message = re.sub(r"^structured_outputs\.\w+", name, message)
        raise APIError(message, 400, param) from None


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict):
        raise APIError("response_format must be an object with a 'type'", 400, "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _make("response_format", "response_format", json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise APIError("response_format: json_schema.schema is required for type "
                           "'json_schema'", 400, "response_format")
        return _make("response_format", "response_format.json_schema.schema", json=schema)
    raise APIError(f"response_format: type must be 'text', 'json_object' or 'json_schema', got "
                   f"{kind!r}", 400, "response_format")


def structured_outputs_of(data: dict[str, Any]) -> StructuredOutputsParams | None:
    """The constraint a request's fields (`data`: its known and extra fields) ask for, or None.
    At most one of the fields may be given."""
    found: list[tuple[str, StructuredOutputsParams | None]] = []
    if data.get("response_format") is not None:
        found.append(("response_format", _from_response_format(data["response_format"])))
    so = data.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise APIError("structured_outputs must be an object", 400, "structured_outputs")
        found.append(("structured_outputs", _make("structured_outputs", **so)))
    if data.get("guided_whitespace_pattern") is not None:
        raise APIError("guided_whitespace_pattern is not supported (xgrammar takes no "
                       "whitespace pattern)", 400, "guided_whitespace_pattern")
    for field, kind in GUIDED_FIELDS.items():
        if data.get(field) is not None:
            found.append((field, _make(field, field, **{kind: data[field]})))
    found = [(name, so) for name, so in found if so is not None]
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(f"give one structured-output constraint, got {names}", 400, found[1][0])
    return found[0][1] if found else None
