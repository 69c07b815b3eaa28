"""Structured output through real processes (gateway, 1 prefill, 2 decode workers): the
constrained reply equals the in-process engine's over remote and local prefill, survives the
decode worker's death mid-stream (the survivor replays the delivered tokens through its
matcher), and hostile constraints are INVALID_ARGUMENT while the service keeps serving."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading

import grpc
import pytest
import regex

from engine import Engine, EngineConfig, SamplingParams
from engine.constraints import Constraint, ConstraintKind
from splitserve.client import make_request
from splitserve.cluster import Cluster
from splitserve_api.v1 import common_pb2
from tests.e2e.cluster_util import MODEL, code_prompts, stream, wait_all_free

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("structured_cluster")]

PATTERN = r"[0-9]{3}-[a-z]{2,6}( [0-9]{3}-[a-z]{2,6}){0,12}"
C = common_pb2.Constraint


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    with Cluster(MODEL, num_prefill=1, num_decode=2, log_dir=str(tmp_path_factory.mktemp("logs-structured")),
                 gateway_flags=["--local-prefill-max-tokens", "32"]) as c:
        yield c


def constrained(prompt: list[int], constraint: common_pb2.Constraint, max_tokens: int):  # noqa: ANN201
    request = make_request(prompt, max_tokens)
    request.constraint.CopyFrom(constraint)
    return request


def test_remote_and_local_prefill_equal_the_engine(cluster: Cluster) -> None:
    engine = Engine(EngineConfig(model=MODEL, dtype="float32", num_kv_blocks=256))
    prompts = code_prompts(engine.tokenizer, [8, 100])  # local, then remote prefill
    params = SamplingParams(temperature=0.0, max_tokens=40, constraint=Constraint(ConstraintKind.REGEX, PATTERN))
    expected = engine.generate(prompts, params)
    for prompt, want in zip(prompts, expected):
        got = stream(cluster.addresses["gateway"], constrained(prompt, C(regex=PATTERN), 40))
        assert got.error is None, got.details
        assert got.token_ids == want.token_ids
        finish = common_pb2.FINISH_REASON_STOP if want.finish_reason == "stop" else common_pb2.FINISH_REASON_LENGTH
        assert got.finish_reason == finish
        if got.finish_reason == common_pb2.FINISH_REASON_STOP:
            assert regex.fullmatch(PATTERN, got.text)
    wait_all_free(cluster.addresses["gateway"])


def test_decode_worker_killed_mid_stream_migrates_with_the_grammar(cluster: Cluster) -> None:
    """Six long constrained streams; decode-0 is killed once all streamed tokens: those it held
    continue on decode-1, whose matcher replays the delivered tokens; every reply equals the
    in-process engine's."""
    gw = cluster.addresses["gateway"]
    pattern = r"([0-9]{3}-[a-z]{2,6} ){1,300}"
    prompts = [list(range(50 + i, 90 + i)) for i in range(6)]
    engine = Engine(EngineConfig(model=MODEL, dtype="float32", num_kv_blocks=512))
    params = SamplingParams(temperature=0.0, max_tokens=400, constraint=Constraint(ConstraintKind.REGEX, pattern))
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    started = [threading.Event() for _ in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, gw, constrained(p, C(regex=pattern), 400), 90.0, e)
                   for p, e in zip(prompts, started)]
        assert all(e.wait(60) for e in started)
        cluster.kill("decode-0")
        results = [f.result() for f in futures]
    cluster.restart("decode-0")
    assert all(r.error is None for r in results), [(r.error, r.details) for r in results]
    assert [r.token_ids for r in results] == expected
    assert any(r.timings.migrations == 1 for r in results), "no stream was on the killed worker"
    for r in results:
        if r.finish_reason == common_pb2.FINISH_REASON_STOP:
            assert regex.fullmatch(pattern, r.text)


HOSTILE = [
    C(regex="(unclosed"),
    C(grammar="start: missing_rule"),
    C(json_schema=C.JsonSchema(schema='{"type": "object", "properties": ' * 100 + "{}" + "}" * 100)),
    C(json_schema=C.JsonSchema(schema=json.dumps({"enum": [f"value-{i}" for i in range(80_000)]}))),
    C(json_schema=C.JsonSchema(schema="[not json")),
    C(choice=C.Choice(choices=["x"] * 1000)),
]


def test_hostile_constraints_are_invalid_argument_and_serving_continues(cluster: Cluster) -> None:
    for constraint in HOSTILE:
        out = stream(cluster.addresses["gateway"], constrained([5, 6, 7], constraint, 8), timeout=30)
        assert out.error == grpc.StatusCode.INVALID_ARGUMENT, (constraint, out.error, out.details)
        assert out.details.startswith("constraint."), out.details
    ok = stream(cluster.addresses["gateway"], constrained([5, 6, 7], C(choice=C.Choice(choices=["ab", "cd"])), 8))
    assert ok.error is None and ok.text in ("ab", "cd")
    wait_all_free(cluster.addresses["gateway"])


def test_a_resumed_constrained_stream_continues_under_its_grammar(cluster: Cluster) -> None:
    """A client that lost its stream sends the tokens it has (``resume``): the gateway
    continues like a migration, the decode worker's matcher replays them, and the rest equals
    the unbroken stream's, still matching the pattern. Tokens the grammar forbids are never a
    ``stop``: the request ends aborted or with an error."""
    engine = Engine(EngineConfig(model=MODEL, dtype="float32", num_kv_blocks=256))
    (prompt,) = code_prompts(engine.tokenizer, [100])
    whole = stream(cluster.addresses["gateway"], constrained(prompt, C(regex=PATTERN), 40))
    assert whole.error is None and len(whole.token_ids) > 6, whole.details
    for cut in (1, 5, len(whole.token_ids) - 1):
        request = constrained(prompt, C(regex=PATTERN), 40)
        request.resume.token_ids.extend(whole.token_ids[:cut])
        rest = stream(cluster.addresses["gateway"], request)
        assert rest.error is None, rest.details
        assert whole.token_ids[:cut] + rest.token_ids == whole.token_ids
        assert rest.finish_reason == whole.finish_reason
        assert whole.text.endswith(rest.text) and len(rest.text) < len(whole.text)
    forbidden = engine.tokenizer.encode("xyz", add_special_tokens=False)  # no digit first: the pattern refuses it
    request = constrained(prompt, C(regex=PATTERN), 40)
    request.resume.token_ids.extend(forbidden)
    refused = stream(cluster.addresses["gateway"], request)
    assert refused.finish_reason != common_pb2.FINISH_REASON_STOP
    assert refused.error is not None or refused.finish_reason == common_pb2.FINISH_REASON_ABORT
    wait_all_free(cluster.addresses["gateway"])
