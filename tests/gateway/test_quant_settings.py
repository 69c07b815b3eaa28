"""Quantization settings (and batch invariance) at the service edges: flags and SPLITSERVE_*
variables reach the engine config, registrations report them (GetInfo), and the KV channel
handshake refuses a peer whose KV dtype differs with FAILED_PRECONDITION naming the field."""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace

import grpc
import pytest

from decode_worker.kv_inbox import KVInbox
from engine.kv_layout import KVLayout
from gateway.registry import Registry
from plumbing import config as cfg
from plumbing.convert import kv_layout_from_proto, kv_layout_to_proto
from plumbing.rpc import ServiceError
from splitserve_api.v1 import common_pb2, gateway_pb2, kv_transfer_pb2

INT8 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="int8")


def _worker_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cfg.add_worker_flags(parser, "m.gguf")
    return parser.parse_args(argv)


def test_flags_and_variables_reach_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = cfg.engine_config(_worker_args(["--quantization", "int4", "--quant-group-size", "64",
                                             "--kv-cache-dtype", "int8"]))
    assert (engine.quantization, engine.quant_group_size, engine.kv_cache_dtype) == ("int4", 64, "int8")
    assert engine.quantization_name == "int4-g64"
    monkeypatch.setenv("SPLITSERVE_QUANTIZATION", "int8")
    monkeypatch.setenv("SPLITSERVE_KV_CACHE_DTYPE", "int8")
    engine = cfg.engine_config(_worker_args([]))
    assert (engine.quantization, engine.kv_cache_dtype, engine.quantization_name) == ("int8", "int8", "int8")


def test_bad_settings_are_refused_before_anything_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):  # argparse: invalid choice
        _worker_args(["--quantization", "int3"])
    monkeypatch.setenv("SPLITSERVE_QUANTIZATION", "int3")  # a variable is not checked by argparse
    with pytest.raises(ValueError, match="quantization must be one of"):
        cfg.engine_config(_worker_args([]))
    monkeypatch.delenv("SPLITSERVE_QUANTIZATION")
    with pytest.raises(ValueError, match="quant_group_size must be one of"):
        cfg.engine_config(_worker_args(["--quantization", "int4", "--quant-group-size", "48"]))


def test_int8_layout_travels_and_names_its_row_width() -> None:
    assert kv_layout_from_proto(kv_layout_to_proto(INT8)) == INT8
    assert INT8.row_width == 12 and INT8.packed_shape(3) == (2, 2, 3, 4, 2, 12)
    assert INT8.bytes_per_block == 2 * 2 * 4 * 2 * 12  # values and scales


def test_registrations_report_quantization_and_kv_layout_in_getinfo() -> None:
    async def run() -> None:
        load = common_pb2.WorkerLoad(kv_blocks_total=10, kv_blocks_free=10)
        infos = []
        for port, quant in ((1, "int4-g32"), (2, "")):  # one deployment each: one quantization per gateway
            one = Registry("m", heartbeat_period_ms=1000, heartbeat_miss_count=3)
            await one.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                role=common_pb2.WORKER_ROLE_DECODE, address=f"127.0.0.1:{port}", model="m", load=load,
                incarnation=port, quantization=quant, kv_layout=kv_layout_to_proto(INT8)), None)
            infos += one.info()
            await one.stop()
        assert [w.quantization for w in infos] == ["int4-g32", "none"]
        assert all(w.kv_layout.dtype == "int8" for w in infos)
        reg = Registry("m", heartbeat_period_ms=1000, heartbeat_miss_count=3)
        await reg.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
            role=common_pb2.WORKER_ROLE_DECODE, address="127.0.0.1:1", model="m", load=load,
            incarnation=1, quantization="int8", kv_layout=kv_layout_to_proto(INT8)), None)
        with pytest.raises(ValueError, match=r"quantization: worker runs 'none', the registered workers run \['int8'\]"):
            await reg.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                role=common_pb2.WORKER_ROLE_PREFILL, address="127.0.0.1:2", model="m", load=load,
                incarnation=2, kv_layout=kv_layout_to_proto(INT8)), None)
        assert [w.address for w in reg.info()] == ["127.0.0.1:1"]  # refused, nothing registered
        with pytest.raises(ValueError, match="quantization must be one of"):
            await reg.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                role=common_pb2.WORKER_ROLE_DECODE, address="127.0.0.1:3", model="m", load=load,
                incarnation=3, quantization="int2"), None)
        await reg.stop()

    asyncio.run(run())


def test_handshake_refuses_a_peer_with_another_kv_dtype() -> None:
    async def run() -> None:
        engine = SimpleNamespace(kv_layout=INT8)  # this decode worker: --kv-cache-dtype int8
        inbox = KVInbox(engine, None, "cpu", None, lambda fn: None, incarnation=5, max_timeout_s=2.0)  # type: ignore[arg-type]
        float32 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
        handshake = kv_transfer_pb2.KVChannelHandshake(
            transport=kv_transfer_pb2.TRANSPORT_KIND_GLOO, kv_layout=kv_layout_to_proto(float32),
            gloo=kv_transfer_pb2.GlooRendezvous(host="127.0.0.1", port=9), timeout_ms=10, prefill_incarnation=3)
        with pytest.raises(ServiceError) as info:
            await inbox.open_channel(handshake, caller="127.0.0.1")
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "dtype: local='int8' peer='float32'" in info.value.message

    asyncio.run(run())


def test_batch_invariant_reaches_the_engine_config_and_is_refused_with_quantization(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert cfg.engine_config(_worker_args([])).batch_invariant is False
    assert cfg.engine_config(_worker_args(["--batch-invariant"])).batch_invariant is True
    monkeypatch.setenv("SPLITSERVE_BATCH_INVARIANT", "1")
    assert cfg.engine_config(_worker_args([])).batch_invariant is True
    with pytest.raises(ValueError, match="batch_invariant needs quantization='none', got 'int8'"):
        cfg.engine_config(_worker_args(["--quantization", "int8"]))


def test_registrations_carry_batch_invariance_and_a_cluster_does_not_mix_it() -> None:
    async def run() -> None:
        load = common_pb2.WorkerLoad(kv_blocks_total=10, kv_blocks_free=10)
        reg = Registry("m", heartbeat_period_ms=1000, heartbeat_miss_count=3)

        def request(port: int, invariant: bool, role: int = common_pb2.WORKER_ROLE_DECODE) -> object:
            return gateway_pb2.RegisterWorkerRequest(role=role, address=f"127.0.0.1:{port}", model="m", load=load,
                                                     incarnation=port, batch_invariant=invariant)

        await reg.RegisterWorker(request(1, True), None)
        await reg.RegisterWorker(request(2, True, common_pb2.WORKER_ROLE_PREFILL), None)
        with pytest.raises(ValueError, match="batch_invariant: worker runs False, the registered workers run True"):
            await reg.RegisterWorker(request(3, False), None)
        assert sorted((w.address, w.batch_invariant) for w in reg.info()) == [("127.0.0.1:1", True), ("127.0.0.1:2", True)]
        with pytest.raises(ValueError, match="batch_invariant: worker runs False"):
            await reg.RegisterWorker(request(1, False), None)  # worker 1 restarted without the flag
        assert sorted((w.address, w.batch_invariant) for w in reg.info()) == [("127.0.0.1:1", True), ("127.0.0.1:2", True)]
        await reg.RegisterWorker(request(1, True), None)  # and with it: it replaces its old entry
        assert sorted(w.address for w in reg.info()) == ["127.0.0.1:1", "127.0.0.1:2"]
        await reg.stop()

    asyncio.run(run())
