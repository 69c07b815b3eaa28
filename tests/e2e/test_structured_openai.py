"""The official ``openai`` client against ``splitserve up --http-port`` on the default model
(SmolLM2-135M-Instruct, speculating with n-gram lookup): json_schema replies that finish
``stop`` validate, tool_choice "required" always yields valid tool calls (also streamed),
the guided_* extensions hold, and hostile schemas are OpenAI-shaped 400s, never a 500.
(``python -m bench.structured_output`` runs the 50-prompt version, with and without
speculation.)"""

from __future__ import annotations

import json

import openai
import pytest

from bench.structured_output import TOOLS, json_schema_round, tools_round
from splitserve.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("structured_openai")]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> openai.OpenAI:
    from splitserve.default_model import ensure_default_model

    cluster = Cluster(str(ensure_default_model(quiet=True)), num_prefill=1, num_decode=1, http_port=0,
                      decode_flags=["--speculative", "ngram"],
                      log_dir=str(tmp_path_factory.mktemp("logs-structured-openai")))
    try:
        cluster.start(timeout_s=600)  # the GGUF model loads slowly on a loaded machine
        yield openai.OpenAI(base_url=f"http://{cluster.addresses['http']}/v1", api_key="none", timeout=300,
                            max_retries=0)
    finally:
        cluster.stop(grace_s=5)


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_json_schema_replies_that_stop_validate(client: openai.OpenAI) -> None:
    report = json_schema_round(client, model_of(client), 8)
    assert report["failures"] == [] and report["valid_of_stop"] == report["stop"]
    assert report["stop"] >= 1  # the round is not vacuous


def test_required_tool_choice_always_calls_with_valid_arguments(client: openai.OpenAI) -> None:
    report = tools_round(client, model_of(client), 8)
    assert report["failures"] == []
    assert report["with_tool_calls"] == report["arguments_valid"] == 8


def test_streamed_named_tool_call(client: openai.OpenAI) -> None:
    # Seeded, as tools_round's requests: unseeded at temperature 1 the arguments sometimes
    # ran past max_tokens (finish "length", correctly not "tool_calls"), so the test was a draw.
    stream = client.chat.completions.create(
        model=model_of(client), max_tokens=120, temperature=0.7, seed=0, tools=TOOLS, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "Weather in Oslo?"}])
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
    assert set(json.loads(calls[0]["arguments"])) == {"city", "unit"}


def test_guided_extensions(client: openai.OpenAI) -> None:
    model = model_of(client)
    choice = client.chat.completions.create(model=model, max_tokens=10, messages=[{"role": "user", "content": "Pick"}],
                                            extra_body={"guided_choice": ["alpha", "beta"]})
    assert choice.choices[0].message.content in ("alpha", "beta")
    number = client.completions.create(model=model, prompt="The year is", max_tokens=10,
                                       extra_body={"guided_regex": "[12][0-9]{3}"})
    assert number.choices[0].finish_reason == "stop" and len(number.choices[0].text) == 4
    obj = client.completions.create(model=model, prompt="A JSON object:", max_tokens=60,
                                    extra_body={"response_format": {"type": "json_object"}})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)


HOSTILE = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": json.loads(
        '{"type": "object", "properties": {"a": ' * 60 + '{}' + "}}" * 60)}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "enum": ["x" * 100 + str(i) for i in range(10_000)]}}}},  # ~1 MB
    {"response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nope"},
                                                                  "strict": True}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/missing"}}}}}},
    {"guided_regex": "(unclosed[a-"},
    {"guided_grammar": "start: undefined_rule"},
    {"guided_choice": ["x"] * 5000},
    {"response_format": {"type": "yaml"}},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                  "function": {"name": "g"}}},
]


@pytest.mark.parametrize("extra", HOSTILE, ids=[f"hostile{i}" for i in range(len(HOSTILE))])
def test_hostile_constraints_are_openai_400s(client: openai.OpenAI, extra: dict) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_of(client), max_tokens=8, extra_body=extra,
                                       messages=[{"role": "user", "content": "hi"}])
    error = info.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error" and error["message"]
