"""`StructuredOutputsParams`: what a request's output must match (vLLM's names), checked when the
request is made.

Exactly one constraint is given: ``json`` (a JSON schema, as a dict or a JSON string),
``json_object`` (any JSON object), ``regex``, ``choice`` (one of a list of strings) or ``grammar``
(EBNF / GBNF, or Lark). Invalid ones raise ``ValueError`` naming the field and the problem
(xgrammar's parser message); the grammar itself is compiled against the tokenizer by the engine
(`structured_output.manager`).
"""

from __future__ import annotations

import json as _json
import re
from dataclasses import dataclass
from typing import Any

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
# xgrammar's messages start with "[hh:mm:ss] /path/to/file.cc:123: ".
_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error message without its log prefix (time, C++ file and line)."""
    text = str(exc).strip()
    return _LOG_PREFIX.sub("", text).strip() or type(exc).__name__


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string escapes, which xgrammar's
    EBNF string literals read the same way)."""
    return "root ::= " + " | ".join(_json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's `StructuredOutputsParams`).

    Attributes:
        json: a JSON schema (dict, or its JSON text); the output is a JSON value matching it.
        regex: the output matches this regular expression (whole output).
        choice: the output is exactly one of these strings.
        grammar: an EBNF (GBNF) grammar whose ``root`` rule the output matches; Lark is accepted.
        json_object: the output is a JSON object (any keys).
        disable_any_whitespace: JSON without free whitespace between tokens (compact).
        disable_additional_properties: with ``json``, objects without ``additionalProperties``
            allow no keys beyond ``properties``.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS
                 if getattr(self, name) is not None and getattr(self, name) is not False]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) if given else 'none'}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool")
        self._validate(given[0])

    @property
    def kind(self) -> str:
        """The constraint given: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(n for n in _CONSTRAINTS
                    if getattr(self, n) is not None and getattr(self, n) is not False)

    def schema_text(self) -> str:
        """The JSON schema as text (``json`` only)."""
        schema = self.json
        if not isinstance(schema, str):
            schema = _json.dumps(schema)
        if self.disable_additional_properties:
            schema = _json.dumps(_no_additional_properties(_json.loads(schema)))
        return schema

    def grammar_text(self) -> str:
        """The EBNF of ``choice`` or ``grammar`` (``grammar`` as given)."""
        return choice_grammar(self.choice) if self.choice is not None else self.grammar

    def cache_key(self) -> tuple:
        """What identifies the compiled grammar."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = self.schema_text()
        elif self.kind == "choice":
            value = tuple(value)
        return (self.kind, value, self.disable_any_whitespace)

    # ------------------------------------------------------------------ validation

    def _validate(self, kind: str) -> None:
        import xgrammar as xgr

        if kind == "json":
            if isinstance(self.json, str):
                try:
                    schema = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
            elif isinstance(self.json, dict):
                schema = self.json
            else:
                raise ValueError("structured_outputs.json must be a JSON schema (an object or "
                                 f"its JSON text), got {type(self.json).__name__}")
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object, got "
                                 f"{type(schema).__name__}")
            _check(lambda: xgr.Grammar.from_json_schema(self.schema_text()), "json",
                   "is not a supported JSON schema")
        elif kind == "json_object":
            if self.json_object is not True:
                raise ValueError("structured_outputs.json_object must be true")
        elif kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError("structured_outputs.regex must be a non-empty string")
            _check(lambda: xgr.Grammar.from_regex(self.regex), "regex",
                   "is not a valid regular expression")
        elif kind == "choice":
            choices = self.choice
            if (not isinstance(choices, (list, tuple)) or not choices
                    or not all(isinstance(c, str) for c in choices)):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if any(not c for c in choices):
                raise ValueError("structured_outputs.choice must not contain an empty string")
            self.choice = list(choices)
            _check(lambda: xgr.Grammar.from_ebnf(self.grammar_text()), "choice", "is invalid")
        else:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError("structured_outputs.grammar must be a non-empty string")
            try:
                xgr.Grammar.from_ebnf(self.grammar)
            except Exception as ebnf_error:  # noqa: BLE001 - xgrammar raises RuntimeError
                try:  # vLLM accepts Lark too
                    self.grammar = str(xgr.Grammar.from_lark(self.grammar))
                except Exception:  # noqa: BLE001
                    raise ValueError(
                        "structured_outputs.grammar is not a valid EBNF (or Lark) grammar: "
                        f"{xgrammar_message(ebnf_error)}") from None


def _check(build, name: str, what: str) -> None:
    try:
        build()
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types
        raise ValueError(f"structured_outputs.{name} {what}: {xgrammar_message(e)}") from None


def _no_additional_properties(schema: Any) -> Any:
    """`schema` with ``additionalProperties: false`` on every object that does not say."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema
