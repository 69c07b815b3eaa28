"""Structured output through the official ``openai`` client against ``splitserve up --http-port``.

    python -m bench.structured_output [--num 50] [--model PATH] [--out bench/results/structured_output.json]
                                      [--rounds plain speculative_ngram decode_killed]

On the default model (SmolLM2-135M-Instruct) it runs, for a plain cluster and one whose
decode worker speculates (``--speculative ngram``): ``--num`` chat requests, each with its own
``response_format`` ``json_schema`` (nested objects, arrays, enums, required fields); every
reply that finishes ``stop`` must parse and validate against its schema (``jsonschema``).
Then ``--num`` requests with two tools and ``tool_choice: "required"``: every reply must
carry ``tool_calls`` whose arguments validate against the function's parameters. Last, the
json_schema requests streamed through a 1 + 2 cluster whose decode workers are killed (-9)
and restarted in turn (``decode_killed``: streams migrate under their grammar). Prints and
writes one JSON report (with the load average); ``tests/e2e/test_structured_openai.py``
runs the same rounds on 8 prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from bench.report import write_json

ENUMS = [["red", "green", "blue"], ["small", "medium", "large"], ["open", "closed"], ["cat", "dog", "bird"]]
TOPICS = ["a fictional person", "a city", "a book", "a product", "a pet", "a recipe", "a planet", "a company"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Flights between two airports on a day",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string", "maxLength": 3, "minLength": 3},
            "destination": {"type": "string", "maxLength": 3, "minLength": 3},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["origin", "destination", "passengers"], "additionalProperties": False}}},
]
TOOL_PROMPTS = ["What's the weather in Paris?", "Find me a flight from JFK to LHR for two.",
                "Is it raining in Tokyo?", "Book flights SFO to SEA, 3 people.", "Weather in Berlin in fahrenheit?",
                "I need to fly from CDG to FCO alone.", "How hot is it in Cairo?", "Flights from ORD to DEN for 4."]


def make_schema(rng: random.Random) -> dict[str, Any]:
    """An object schema: a string, an integer with bounds, an enum, an array, a nested object;
    some required, no additional properties (short strings: a small model rambles)."""
    nested = {"type": "object", "additionalProperties": False,
              "properties": {"label": {"type": "string", "maxLength": 12},
                             "level": {"enum": rng.choice(ENUMS)}}, "required": ["label", "level"]}
    properties: dict[str, Any] = {
        "name": {"type": "string", "maxLength": 20},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "kind": {"enum": rng.choice(ENUMS)},
        "items": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": rng.randint(1, 3)},
        "detail": nested,
    }
    if rng.random() < 0.5:
        properties["flags"] = {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}
    names = list(properties)
    rng.shuffle(names)
    required = sorted(names[: rng.randint(2, len(names))])
    return {"type": "object", "properties": {n: properties[n] for n in names}, "required": required,
            "additionalProperties": False}


def _schema_reply(client: Any, model: str, i: int, schema: dict[str, Any], seed: int, max_tokens: int,
                  stream: bool) -> tuple[str | None, str]:
    """One json_schema request: its finish reason and its content (a stream's chunks joined)."""
    kwargs = dict(model=model, max_tokens=max_tokens, temperature=0.7, seed=seed + i,
                  messages=[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}],
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.finish_reason, choice.message.content or ""
    text, reason = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    return reason, "".join(text)


def json_schema_round(client: Any, model: str, num: int, seed: int = 0, max_tokens: int = 200,
                      stream: bool = False, concurrency: int = 1) -> dict[str, Any]:
    """``num`` requests with a json_schema response_format; counts and the failures."""
    import jsonschema
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(seed)
    schemas = [make_schema(rng) for _ in range(num)]
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda i: _schema_reply(client, model, i, schemas[i], seed, max_tokens, stream),
                                range(num)))
    counts = {"num": num, "stop": 0, "length": 0, "valid_of_stop": 0}
    failures = []
    for i, (reason, content) in enumerate(replies):
        counts[str(reason)] = counts.get(str(reason), 0) + 1
        if reason != "stop":
            continue
        try:
            jsonschema.validate(json.loads(content), schemas[i])
            counts["valid_of_stop"] += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append({"index": i, "content": content, "error": str(exc)[:200]})
    return {**counts, "failures": failures}


def tools_round(client: Any, model: str, num: int, seed: int = 0, max_tokens: int = 120) -> dict[str, Any]:
    """``num`` requests with two tools and tool_choice "required"; counts and the failures."""
    import jsonschema

    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    counts = {"num": num, "with_tool_calls": 0, "arguments_valid": 0}
    failures = []
    for i in range(num):
        reply = client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=0.7, seed=seed + i, tools=TOOLS,
            tool_choice="required", parallel_tool_calls=False,
            messages=[{"role": "user", "content": TOOL_PROMPTS[i % len(TOOL_PROMPTS)]}])
        choice = reply.choices[0]
        calls = choice.message.tool_calls or []
        if not calls or choice.finish_reason != "tool_calls":
            failures.append({"index": i, "finish_reason": choice.finish_reason, "content": choice.message.content})
            continue
        counts["with_tool_calls"] += 1
        try:
            for call in calls:
                jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
            counts["arguments_valid"] += 1
        except (ValueError, KeyError, jsonschema.ValidationError) as exc:
            failures.append({"index": i, "error": str(exc)[:200]})
    return {**counts, "failures": failures}


def run_cluster(model: str, num: int, decode_flags: list[str]) -> dict[str, Any]:
    import openai

    from splitserve.cluster import Cluster

    cluster = Cluster(model, num_prefill=1, num_decode=1, http_port=0, decode_flags=decode_flags)
    try:
        cluster.start(timeout_s=600)  # a shared machine may load the model slowly
        client = openai.OpenAI(base_url=f"http://{cluster.addresses['http']}/v1", api_key="none", timeout=600)
        served = client.models.list().data[0].id
        return {"json_schema": json_schema_round(client, served, num), "tools": tools_round(client, served, num)}
    finally:
        cluster.stop(grace_s=5)


def decode_kill_round(model: str, num: int, period_s: float = 3.0) -> dict[str, Any]:
    """The json_schema round streamed 4 at a time through the front of a 1 + 2 cluster whose
    decode workers are killed (-9) and restarted in turn, one every ``period_s`` after the last
    came back: streams hit by a kill migrate to the survivor, whose matcher replays the
    tokens already sent. Adds the kills and the gateway's migration count to the round's."""
    import socket
    import threading
    import urllib.request

    import openai

    from splitserve.cluster import Cluster

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        metrics_port = probe.getsockname()[1]
    cluster = Cluster(model, num_prefill=1, num_decode=2, http_port=0, metrics_port=metrics_port)
    kills: list[str] = []
    stop = threading.Event()

    def killer() -> None:
        while not stop.wait(period_s):
            name = f"decode-{len(kills) % 2}"
            cluster.kill(name)
            kills.append(name)
            cluster.restart(name, timeout_s=600)

    try:
        cluster.start(timeout_s=600)
        client = openai.OpenAI(base_url=f"http://{cluster.addresses['http']}/v1", api_key="none", timeout=600)
        served = client.models.list().data[0].id
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        result = json_schema_round(client, served, num, seed=1000, stream=True, concurrency=4)
        stop.set()
        thread.join()
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        migrations = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("splitserve_request_migrations_total"))
        return {**result, "decode_kills": len(kills), "migrations": int(migrations)}
    finally:
        stop.set()
        cluster.stop(grace_s=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=50)
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default="bench/results/structured_output.json")
    parser.add_argument("--rounds", nargs="+", default=["plain", "speculative_ngram", "decode_killed"],
                        choices=["plain", "speculative_ngram", "decode_killed"])
    args = parser.parse_args()
    from splitserve.default_model import ensure_default_model

    model = args.model or str(ensure_default_model(quiet=True))
    report: dict[str, Any] = {"model": model, "load_1min_before": open("/proc/loadavg").read().split()[0]}
    for name, flags in [("plain", []), ("speculative_ngram", ["--speculative", "ngram"])]:
        if name in args.rounds:
            report[name] = run_cluster(model, args.num, flags)
    if "decode_killed" in args.rounds:
        report["decode_killed"] = decode_kill_round(model, args.num)
    report["load_1min_after"] = open("/proc/loadavg").read().split()[0]
    sys.stdout.write(write_json(report, Path(args.out)).read_text())


if __name__ == "__main__":
    main()
