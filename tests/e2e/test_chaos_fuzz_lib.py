"""The chaos and fuzz libraries' pieces that need no cluster: plans, workloads and cases are
functions of the seed; golden comparison; wire mutations really break messages; the fuzz
covers every RPC the contracts define."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError

from tests.chaos.faults import PHASES
from tests.chaos.profile import LARGE, SMALL, ChaosProfile, fault_types
from tests.chaos.workload import Golden, corpus_token_ids, draw_spec
from tests.fuzz import cases as fuzz_cases
from tests.fuzz.methods import ALL, GATEWAY
from tests.fuzz.profile import LARGE as FUZZ_LARGE
from tests.fuzz.profile import SMALL as FUZZ_SMALL
from tests.fuzz.strategies import draw, generate_request
from tests.fuzz.wire import MUTATIONS, mutate
from engine.models.spec import load_tokenizer
from splitserve.client import make_request
from splitserve_api.v1 import common_pb2, decode_pb2, gateway_pb2, prefill_pb2

MODEL = str(Path(__file__).resolve().parents[2] / "models" / "target")


def test_every_fault_type_is_planned_once_and_plans_follow_the_seed() -> None:
    types = fault_types(SMALL)
    assert len(types) == 3 + 3 * len(PHASES)
    assert sorted(f.name for f in SMALL.plan(0)) == sorted(f.name for f in types)  # small: each once
    large = LARGE.plan(5)
    assert len(large) == LARGE.num_faults >= 40 and {f.name for f in types} <= {f.name for f in large}
    assert large == LARGE.plan(5) and large != LARGE.plan(6)
    with pytest.raises(ValueError, match="num_faults"):
        ChaosProfile("x", min_requests=1, baseline_requests=1, num_faults=3)


def test_workload_follows_the_seed_and_mixes_kinds() -> None:
    tokenizer = load_tokenizer(MODEL)
    corpus = corpus_token_ids(tokenizer)
    specs = [draw_spec(3, i, corpus, tokenizer, 32) for i in range(200)]
    assert specs == [draw_spec(3, i, corpus, tokenizer, 32) for i in range(200)]
    assert specs != [draw_spec(4, i, corpus, tokenizer, 32) for i in range(200)]
    assert {s.kind for s in specs} == {"greedy", "seeded", "stop", "logprobs", "text"}
    lengths = [len(s.prompt) for s in specs if not isinstance(s.prompt, str)]
    assert min(lengths) < 32 <= max(lengths)  # local and remote prefill both
    assert all(isinstance(s.to_proto(), gateway_pb2.GenerateRequest) for s in specs)


def test_golden_matching() -> None:
    plain = Golden((5, 6, 7), "abc", common_pb2.FINISH_REASON_LENGTH, None)
    assert plain.matches([5, 6, 7], "abc", common_pb2.FINISH_REASON_LENGTH)
    assert not plain.matches([5, 6], "abc", common_pb2.FINISH_REASON_LENGTH)
    assert not plain.matches([5, 6, 7], "abd", common_pb2.FINISH_REASON_LENGTH)
    assert not plain.matches([5, 6, 7], "abc", common_pb2.FINISH_REASON_STOP)
    stopped = Golden((5, 6, 7, 8), "ab", common_pb2.FINISH_REASON_STOP, 2)
    assert stopped.matches([5, 6], "ab", common_pb2.FINISH_REASON_STOP)
    assert stopped.matches([5, 6, 7], "ab", common_pb2.FINISH_REASON_STOP)  # the rest of its chunk
    assert not stopped.matches([5], "ab", common_pb2.FINISH_REASON_STOP)
    assert not stopped.matches([5, 9], "ab", common_pb2.FINISH_REASON_STOP)


@pytest.mark.parametrize("kind", ["field_zero", "overlong_varint", "bad_length", "deep_groups", "bad_utf8"])
def test_wire_mutations_do_not_parse(kind: str) -> None:
    data = make_request("hello", 4).SerializeToString()
    rng = random.Random(1)
    for _ in range(20):
        with pytest.raises(DecodeError):
            gateway_pb2.GenerateRequest.FromString(mutate(data, rng, kind))


def test_unknown_fields_parse_but_are_kept() -> None:
    """They parse (so the gateway's own check must reject them, naming the field number)."""
    out = gateway_pb2.GenerateRequest.FromString(mutate(b"", random.Random(2), "unknown_field"))
    assert len(unknown_fields.UnknownFieldSet(out)) == 1 and out.ByteSize() > 0
    assert set(MUTATIONS) >= {"truncated", "bitflip", "wrong_wire_type"}


def test_fuzz_covers_every_rpc_of_the_contracts() -> None:
    defined = {f"/{s.full_name}/{m.name}" for module in (gateway_pb2, decode_pb2, prefill_pb2)
               for s in module.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert defined == {m.path for m in ALL}
    for method in ALL:
        rpc = next(s.methods_by_name[method.path.rsplit("/", 1)[1]] for module in (gateway_pb2, decode_pb2, prefill_pb2)
                   for s in module.DESCRIPTOR.services_by_name.values() if s.full_name == method.path.split("/")[1])
        assert rpc.input_type.full_name == method.request_type.DESCRIPTOR.full_name
        assert rpc.server_streaming == method.streaming
        assert "UNKNOWN" not in method.documented and "INTERNAL" not in method.documented


def test_fuzz_cases_follow_the_seed_and_meet_the_counts() -> None:
    a = draw(generate_request(4096), 40, 9)
    assert [x.SerializeToString() for x in a] == [x.SerializeToString() for x in draw(generate_request(4096), 40, 9)]
    assert sum(1 for x in a if x.HasField("token_ids") or x.text) > 20  # mostly a prompt the gateway can run
    cases = fuzz_cases.structured(FUZZ_SMALL, 3, 4096, "127.0.0.1:1")
    again = fuzz_cases.structured(FUZZ_SMALL, 3, 4096, "127.0.0.1:1")
    assert [c[1] for c in cases] == [c[1] for c in again]
    assert {c[0].path for c in cases} >= {m.path for m in GATEWAY}
    assert 200 <= FUZZ_SMALL.num_cases <= 600 and FUZZ_LARGE.num_cases >= 5000
