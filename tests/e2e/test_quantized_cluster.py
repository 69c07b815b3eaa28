"""End to end through real processes with quantization: int8 weights by flag and an int8 KV
cache by SPLITSERVE_KV_CACHE_DTYPE reach both workers, GetInfo reports them, and prompts
prefilled on the prefill worker (int8 pages and scales shipped over Gloo) decode to the
tokens of an in-process engine with the same settings."""

from __future__ import annotations

import grpc
import pytest

from engine import Engine, EngineConfig, SamplingParams
from splitserve.cluster import Cluster
from splitserve_api.v1 import gateway_pb2, gateway_pb2_grpc
from tests.e2e.cluster_util import MODEL, code_prompts, greedy_requests, stream_many, worker_stats

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_quant")]

LENGTHS = [40, 75, 130]  # all above --local-prefill-max-tokens: prefilled remotely
MAX_TOKENS = [12, 20, 16]


def test_quantized_workers_report_settings_and_match_the_in_process_engine(
    tmp_path, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    engine = Engine(EngineConfig(model=MODEL, num_threads=1, quantization="int8", kv_cache_dtype="int8"))
    prompts = code_prompts(engine.tokenizer, LENGTHS)
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS]
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    monkeypatch.setenv("SPLITSERVE_KV_CACHE_DTYPE", "int8")  # the workers read it at start
    with Cluster(MODEL, num_prefill=1, num_decode=1, log_dir=str(tmp_path),
                 gateway_flags=["--local-prefill-max-tokens", "16"],
                 worker_flags=["--quantization", "int8"]) as cluster:
        gateway = cluster.addresses["gateway"]
        with grpc.insecure_channel(gateway) as channel:
            info = gateway_pb2_grpc.GatewayStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=10)
        assert len(info.workers) == 2
        assert all(w.quantization == "int8" and w.kv_layout.dtype == "int8" for w in info.workers)
        results = stream_many(gateway, greedy_requests(prompts, MAX_TOKENS))
        # Every prompt's pages were shipped (int8 rows with their scales), none prefilled locally.
        received = worker_stats(gateway)[cluster.addresses["decode-0"]].num_received_prompt_tokens
    assert [r.error for r in results] == [None] * len(prompts)
    assert [r.token_ids for r in results] == expected
    assert received == sum(len(p) for p in prompts)
