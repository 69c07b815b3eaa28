"""Structured-output constraints at the gateway: proto <-> engine conversion, caps before
compiling, and a constraint that does not compile named with the library's reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.constraints import Constraint, ConstraintKind
from engine.grammar import GrammarCompiler
from gateway.validation import Limits, check_constraint_compiles, validate
from plumbing.convert import constraint_from_proto, constraint_to_proto
from splitserve.client import make_request
from splitserve_api.v1 import common_pb2

MODEL = Path(__file__).resolve().parents[2] / "models" / "target"
LIMITS = Limits(vocab_size=4096, max_model_len=512, max_stop_strings=8, max_stop_string_bytes=256,
                eos_token_ids=(2,))
C = common_pb2.Constraint


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return AutoTokenizer.from_pretrained(str(MODEL))


@pytest.fixture(scope="module")
def grammars(tokenizer) -> GrammarCompiler:  # noqa: ANN001
    return GrammarCompiler(tokenizer, LIMITS.vocab_size, LIMITS.eos_token_ids)


def constrained(constraint: common_pb2.Constraint):  # noqa: ANN201
    request = make_request([5, 6, 7], 8)
    request.constraint.CopyFrom(constraint)
    return request


ROUND_TRIP = [
    (C(json_schema=C.JsonSchema(schema='{"type": "object"}', strict=True)),
     Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object"}', strict=True)),
    (C(json_object=C.JsonObject()), Constraint(ConstraintKind.JSON_OBJECT)),
    (C(regex="[0-9]+"), Constraint(ConstraintKind.REGEX, "[0-9]+")),
    (C(grammar='start: "a" | "b"'), Constraint(ConstraintKind.GRAMMAR, 'start: "a" | "b"')),
    (C(choice=C.Choice(choices=["x", "y"])), Constraint(ConstraintKind.CHOICE, choices=("x", "y"))),
]


@pytest.mark.parametrize("message,engine_form", ROUND_TRIP, ids=[e.kind.value for _, e in ROUND_TRIP])
def test_conversion_round_trips(message: common_pb2.Constraint, engine_form: Constraint) -> None:
    assert constraint_from_proto(message) == engine_form
    assert constraint_to_proto(engine_form) == message
    assert constraint_from_proto(C()) is None


def test_validated_request_carries_the_constraint(tokenizer, grammars: GrammarCompiler) -> None:  # noqa: ANN001
    validated = validate(constrained(C(regex="[a-z]{3}")), tokenizer, LIMITS)
    assert validated.constraint == C(regex="[a-z]{3}")
    assert validated.params.constraint == Constraint(ConstraintKind.REGEX, "[a-z]{3}")
    check_constraint_compiles(validated.params, grammars)
    assert validate(make_request([5, 6], 4), tokenizer, LIMITS).params.constraint is None


HOSTILE = [
    ("invalid regex", C(regex="(ab"), "constraint.regex does not compile"),
    ("unknown grammar rule", C(grammar="start: nope"), "constraint.grammar does not compile"),
    ("unknown schema type", C(json_schema=C.JsonSchema(schema='{"type": "frob"}')), "constraint.json_schema.schema"),
    ("deep nesting", C(json_schema=C.JsonSchema(schema='{"items":' * 200 + "{}" + "}" * 200)), "nests 201 levels"),
    ("1 MB schema", C(json_schema=C.JsonSchema(
        schema=json.dumps({"enum": ["v" * 100] * 10_000}))), "the limit is 65536"),
    ("huge enum", C(choice=C.Choice(choices=[str(i) for i in range(100_000)])), "limit is 256"),
    ("schema not JSON", C(json_schema=C.JsonSchema(schema="{")), "not valid JSON"),
    ("empty regex", C(regex=""), "constraint.regex must not be empty"),
    ("empty choice", C(choice=C.Choice(choices=["a", ""])), "non-empty strings"),
    ("min_new_tokens", None, "stopping.min_new_tokens cannot be combined"),
]


@pytest.mark.parametrize("message,reason", [(m, r) for _, m, r in HOSTILE], ids=[n for n, _, _ in HOSTILE])
def test_hostile_constraints_are_value_errors_naming_the_field(
        tokenizer, grammars: GrammarCompiler, message: common_pb2.Constraint | None, reason: str) -> None:  # noqa: ANN001
    request = constrained(message or C(regex="a+"))
    if message is None:
        request.stopping.min_new_tokens = 2
    with pytest.raises(ValueError, match=reason):
        validated = validate(request, tokenizer, LIMITS)
        check_constraint_compiles(validated.params, grammars)


def test_recursive_ref_compiles_or_fails_cleanly(grammars: GrammarCompiler) -> None:
    schema = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
              "$ref": "#/$defs/node"}
    state = grammars.compile(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)))
    assert state.num_valid([]) == 0 and not state.is_stopped


def test_compile_cache_hits_by_schema(grammars: GrammarCompiler) -> None:
    before = (grammars.stats.num_compiles, grammars.stats.num_cache_hits)
    for _ in range(3):
        grammars.compile(Constraint(ConstraintKind.REGEX, "[0-9]{2}-cache"))
    assert (grammars.stats.num_compiles, grammars.stats.num_cache_hits) == (before[0] + 1, before[1] + 2)
