"""Constraints on what a request may generate (structured output), checked without torch.

A ``Constraint`` says what the reply must match: a JSON schema (``json_schema``, with
``strict``), any JSON object (``json_object``), a regular expression (``regex``), a Lark
grammar (``grammar``, llguidance's dialect: Lark plus ``%json`` and ``%regex``) or one of a
list of strings (``choice``). ``grammar_of`` turns one into an llguidance grammar.

Limits are checked at construction, before anything compiles: the text's size, the JSON
schema's nesting depth, the number and size of choices. What only the library can judge
(an invalid regex, an unknown Lark rule, an unsupported schema keyword with ``strict``)
comes out of compiling (``engine/grammar.py``) as a ``ConstraintError`` with the library's
reason. This module imports neither torch nor llguidance's torch helpers: the gateway uses it.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

MAX_CONSTRAINT_BYTES = 64 * 1024  # schema / regex / grammar text, and all choices together
MAX_SCHEMA_DEPTH = 32  # nesting of JSON arrays and objects in a schema
MAX_CHOICES = 256
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class ConstraintError(ValueError):
    """A constraint that cannot be used; the message names the field and the reason."""


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"
    CHOICE = "choice"


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match (see the module docstring).

    ``text`` holds the schema (``JSON_SCHEMA``), the regex or the grammar; it is empty for
    ``JSON_OBJECT`` and ``CHOICE``. ``choices`` is used only by ``CHOICE``. ``strict`` (JSON
    schema only): a keyword the library does not implement is an error; without it, it is
    ignored. ``field_name`` is what error messages call the constraint.
    """

    kind: ConstraintKind
    text: str = ""
    strict: bool = False
    choices: tuple[str, ...] = ()
    field_name: str = field(default="constraint", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if not isinstance(self.kind, ConstraintKind):
            raise ConstraintError(f"{self.field_name}: kind must be a ConstraintKind, got {self.kind!r}")
        check = _CHECKS[self.kind]
        check(self)

    @property
    def key(self) -> str:
        """The compile cache's key: a hash of everything that shapes the grammar."""
        payload = json.dumps([self.kind.value, self.text, self.strict, list(self.choices)])
        return hashlib.sha256(payload.encode()).hexdigest()


def _check_size(text: str, name: str) -> None:
    if not isinstance(text, str):
        raise ConstraintError(f"{name} must be a string")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONSTRAINT_BYTES:
        raise ConstraintError(f"{name} is {size} bytes; the limit is {MAX_CONSTRAINT_BYTES}")


def json_depth(text: str) -> int:
    """Nesting depth of ``[``/``{`` outside strings, without parsing (so a deep document
    cannot exhaust the parser's recursion)."""
    depth = max_depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            max_depth = max(max_depth, depth)
        elif char in "]}":
            depth -= 1
    return max_depth


def _check_json_schema(c: Constraint) -> None:
    name = f"{c.field_name}.json_schema.schema"
    _check_size(c.text, name)
    depth = json_depth(c.text)
    if depth > MAX_SCHEMA_DEPTH:
        raise ConstraintError(f"{name} nests {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")
    try:
        schema: Any = json.loads(c.text)
    except ValueError as exc:
        raise ConstraintError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"{name} must be a JSON object (a JSON schema)")


def _check_text(c: Constraint) -> None:
    name = f"{c.field_name}.{c.kind.value}"
    _check_size(c.text, name)
    if not c.text:
        raise ConstraintError(f"{name} must not be empty")


def _check_choices(c: Constraint) -> None:
    name = f"{c.field_name}.choice"
    if not c.choices:
        raise ConstraintError(f"{name} must list at least one string")
    if len(c.choices) > MAX_CHOICES:
        raise ConstraintError(f"{name} lists {len(c.choices)} strings; the limit is {MAX_CHOICES}")
    if any(not isinstance(s, str) or not s for s in c.choices):
        raise ConstraintError(f"{name} must hold non-empty strings")
    _check_size("".join(c.choices), name)


def _check_nothing(c: Constraint) -> None:
    if c.text or c.choices:
        raise ConstraintError(f"{c.field_name}.json_object takes no text or choices")


_CHECKS = {
    ConstraintKind.JSON_SCHEMA: _check_json_schema,
    ConstraintKind.JSON_OBJECT: _check_nothing,
    ConstraintKind.REGEX: _check_text,
    ConstraintKind.GRAMMAR: _check_text,
    ConstraintKind.CHOICE: _check_choices,
}


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON form) for ``constraint``. JSON replies are compact
    (no free whitespace: a small model otherwise tends to pad with newlines until cut off)."""
    from llguidance import LLMatcher

    kind = constraint.kind
    if kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT):
        schema = constraint.text if kind is ConstraintKind.JSON_SCHEMA else JSON_OBJECT_SCHEMA
        options = {"whitespace_flexible": False, "lenient": not constraint.strict}
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ConstraintError(f"{constraint.field_name}.json_schema.schema: {exc}") from None
    if kind is ConstraintKind.REGEX:
        return LLMatcher.grammar_from_regex(constraint.text)
    if kind is ConstraintKind.GRAMMAR:
        return LLMatcher.grammar_from_lark(constraint.text)
    alternatives = " | ".join(json.dumps(s, ensure_ascii=False) for s in constraint.choices)
    return LLMatcher.grammar_from_lark(f"start: {alternatives}")
