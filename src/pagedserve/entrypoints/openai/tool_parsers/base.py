"""What every tool-call parser offers, and the pieces the families share.

A parser reads a finished choice's text (`parse`: the content and the calls) and says where in a
growing text a tool call has begun or may still begin (`tool_start`: streaming sends the text
before it as content as it comes and holds the rest until the choice ends; see
`tool_calls.ToolStream`).

NOTE: the content `parse` returns, when there are calls, starts with ``text[:tool_start(text)]``
(the part that was already streamed); what it adds after that (text between or after the calls)
is sent with the calls at the end. Text that does not parse as calls is plain content, whole.
"""

from __future__ import annotations

import json
import re
from typing import Any

ParsedCall = tuple[str, str]  # (function name, arguments as JSON text)
Tools = list[dict[str, Any]] | None  # the request's tools, as `tool_calls.plan_tools` checked them


class ToolParser:
    """Base of the tool-call parsers (`--tool-call-parser`, vLLM's names)."""

    name = ""
    # False when the format's markers are special tokens of the model's tokenizer, which the
    # detokenizer would leave out: requests with tools then keep them (as vLLM's
    # `adjust_request` does).
    skip_special_tokens = True

    def parse(self, text: str, tools: Tools = None) -> tuple[str | None, list[ParsedCall]]:
        """(content or None, calls) of a finished choice's text; `tools` types the arguments of
        the formats that write them as text (XML-style parameters)."""
        raise NotImplementedError

    def tool_start(self, text: str) -> int | None:
        """The index in `text` from which a tool call has begun or may still begin (a prefix of
        a marker at the end), or None when none can."""
        raise NotImplementedError


# --- text ---------------------------------------------------------------------------------------

def prefix_at_end(text: str, marker: str) -> int | None:
    """The index from which the end of `text` is a (non-empty) prefix of `marker`, or None."""
    for k in range(min(len(marker), len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return None


def marker_start(text: str, markers: tuple[str, ...]) -> int | None:
    """The earliest index where one of `markers` occurs in `text`, or from which its end may
    still become one; None when neither."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    found += [i for i in (prefix_at_end(text, m) for m in markers) if i is not None]
    return min(found) if found else None


def leading_start(text: str, openers: tuple[str, ...]) -> int | None:
    """For formats whose calls are the whole output: 0 when `text` (after whitespace) starts with
    one of `openers` or may still become one; None once it cannot."""
    stripped = text.lstrip()
    if not stripped:
        return 0 if text else None
    for o in openers:
        if stripped.startswith(o) or o.startswith(stripped):
            return 0
    return None


def content_or_none(content: str) -> str | None:
    """vLLM's rule for the content next to calls: None when it is empty or blank."""
    return content if content.strip() else None


# --- JSON ---------------------------------------------------------------------------------------

def arguments_json(value: Any) -> str | None:
    """A call's arguments (a dict, or a JSON string holding one; absent: {}) as JSON text; None
    for anything else."""
    if value is None:
        value = {}
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_of(obj: Any, *arg_keys: str) -> ParsedCall | None:
    """``{"name": ..., <arguments under one of arg_keys>}`` as a call, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    value = next((obj[k] for k in arg_keys if k in obj), None)
    args = arguments_json(value)
    return None if args is None else (obj["name"], args)


def calls_of(obj: Any, *arg_keys: str) -> list[ParsedCall] | None:
    """A JSON list of calls (or one call object) as calls; None when any element is not one."""
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_of(o, *arg_keys) for o in items]
    return None if not calls or None in calls else calls


def json_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of `text` (after whitespace) and the index after it."""
    i = len(text) - len(text.lstrip())
    try:
        return json.JSONDecoder().raw_decode(text, i)
    except ValueError:
        return None


def loads(text: str) -> Any:
    """`json.loads`, None for text that is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


# --- parameters written as text (XML-style formats) --------------------------------------------

def parameter_schemas(tools: Tools, name: str) -> dict[str, Any]:
    """The `properties` of function `name`'s parameters schema among `tools` ({} when unknown)."""
    for tool in tools or ():
        fn = tool.get("function") or {}
        if fn.get("name") == name:
            return (fn.get("parameters") or {}).get("properties") or {}
    return {}


def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    types = [t] if isinstance(t, str) else list(t) if isinstance(t, list) else []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types += _schema_types(sub)
    if not types and isinstance(schema.get("enum"), list):
        names = {bool: "boolean", int: "integer", float: "number", type(None): "null"}
        types = sorted({names.get(type(v), "string") for v in schema["enum"]})
    return types


_ALIASES = {"int": "integer", "float": "number", "double": "number", "bool": "boolean",
            "dict": "object", "list": "array", "str": "string", "text": "string"}


def coerce(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type asks for (vLLM's order: null,
    integer, number, boolean, object, array, then string); the text itself when no type fits or
    the schema names none."""
    types = {_ALIASES.get(t.lower(), t.lower()) for t in _schema_types(schema)}
    text = value.strip()
    for t in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if t not in types:
            continue
        if t == "string":
            return value
        if t == "null" and text.lower() in ("null", "none"):
            return None
        if t == "integer" and re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        if t == "number":
            try:
                f = float(text)
            except ValueError:
                continue
            if f == f and f not in (float("inf"), float("-inf")):
                return int(f) if f.is_integer() else f
        if t == "boolean" and text.lower() in ("true", "false", "1", "0"):
            return text.lower() in ("true", "1")
        if t in ("object", "array"):
            parsed = loads(text)
            if isinstance(parsed, dict if t == "object" else list):
                return parsed
    return value


def typed_arguments(tools: Tools, name: str, params: dict[str, str]) -> str:
    """Text parameters of function `name` typed by its schema, as JSON text."""
    schemas = parameter_schemas(tools, name)
    return json.dumps({k: coerce(v, schemas.get(k)) for k, v in params.items()},
                      ensure_ascii=False)


def strip_one_newline(value: str) -> str:
    """One leading and one trailing newline removed (the templates' layout, not the value)."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


# --- shared families ----------------------------------------------------------------------------

class TaggedJsonToolParser(ToolParser):
    """Calls as JSON objects between START and END tags (the END of the last call may be cut by
    the end of the output); the text before the first call is the content (with KEEP_BETWEEN,
    text between and after calls is appended to it). Any block that is not a call makes the
    whole text content."""

    START = "<tool_call>"
    END = "</tool_call>"
    ARG_KEYS: tuple[str, ...] = ("arguments", "parameters")
    KEEP_BETWEEN = False

    def parse(self, text, tools=None):
        if self.START not in text:
            return text, []
        content, calls, i = text[: text.index(self.START)], [], text.index(self.START)
        while i >= 0:
            body_start = i + len(self.START)
            end = text.find(self.END, body_start)
            body = text[body_start: end if end >= 0 else len(text)]
            found = calls_of(loads(body.strip()), *self.ARG_KEYS)
            if found is None:
                return text, []
            calls += found
            if end < 0:
                break
            nxt = text.find(self.START, end)
            if self.KEEP_BETWEEN:
                content += text[end + len(self.END): nxt if nxt >= 0 else len(text)]
            i = nxt
        return content_or_none(content), calls

    def tool_start(self, text):
        return marker_start(text, (self.START,))


class MarkerJsonListToolParser(ToolParser):
    """Content, then a MARKER (one of MARKERS), then a JSON list of calls (or one call object),
    optionally closed by CLOSE; text after the list is dropped."""

    MARKERS: tuple[str, ...] = ()
    CLOSE = ""
    ARG_KEYS: tuple[str, ...] = ("arguments", "parameters")

    def split(self, text: str) -> tuple[int, int] | None:
        """(where the marker starts, where the calls' JSON starts), or None."""
        found = [(text.find(m), m) for m in self.MARKERS if m in text]
        if not found:
            return None
        i, m = min(found)
        return i, i + len(m)

    def parse(self, text, tools=None):
        where = self.split(text)
        if where is None:
            return text, []
        start, body = where
        rest = text[body:]
        if self.CLOSE and self.CLOSE in rest:
            rest = rest[: rest.index(self.CLOSE)]
        value = json_prefix(rest)
        calls = calls_of(value[0], *self.ARG_KEYS) if value else None
        if not calls:
            return text, []
        return content_or_none(text[:start]), calls

    def tool_start(self, text):
        return marker_start(text, self.MARKERS)


class SectionToolParser(ToolParser):
    """Content, then BEGIN, then the calls, each a match of CALL (searched from BEGIN on) that
    `call` turns into (name, arguments JSON); a match that is not a call (`call` gives None)
    makes the whole text content, and so does a BEGIN with no call after it."""

    BEGIN = ""
    CALL: re.Pattern[str]

    def call(self, match: re.Match[str], tools: Tools) -> ParsedCall | None:
        raise NotImplementedError

    def parse(self, text, tools=None):
        i = text.find(self.BEGIN)
        if i < 0:
            return text, []
        calls = []
        for m in self.CALL.finditer(text, i):
            found = self.call(m, tools)
            if found is None:
                return text, []
            calls.append(found)
        return (content_or_none(text[:i]), calls) if calls else (text, [])

    def tool_start(self, text):
        return marker_start(text, (self.BEGIN,))
