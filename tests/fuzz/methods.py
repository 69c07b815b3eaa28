"""The RPCs under fuzz: where each one lives, its request type, and the statuses it documents.

Documented (docs/architecture.md, "Status codes", and the proto comments): every method may
answer INVALID_ARGUMENT (a request that does not parse or names a bad field),
RESOURCE_EXHAUSTED (a message over gRPC's 4 MiB, a full queue or pool), DEADLINE_EXCEEDED
and CANCELLED (the caller's deadline), UNIMPLEMENTED (no such method); the rest per method
below. UNKNOWN and INTERNAL are never documented: they mean an unhandled exception.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message

from splitserve_api.v1 import common_pb2, decode_pb2, gateway_pb2, kv_transfer_pb2, prefill_pb2

COMMON = frozenset({"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED",
                    "UNIMPLEMENTED"})


@dataclass(frozen=True)
class Method:
    path: str  # "/splitserve.v1.Gateway/Generate"
    target: str  # "gateway" | "gateway-internal" | "prefill" | "decode": which server serves it
    request_type: type[Message]
    streaming: bool = False  # server streaming
    also: frozenset[str] = frozenset()  # documented besides COMMON

    @property
    def documented(self) -> frozenset[str]:
        return COMMON | self.also

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 2)[-2].rsplit(".", 1)[-1] + "." + self.path.rsplit("/", 1)[-1]


def _m(path: str, target: str, request_type: type[Message], streaming: bool = False, *also: str) -> Method:
    return Method(path, target, request_type, streaming, frozenset(also))


GATEWAY = [
    _m("/splitserve.v1.Gateway/Generate", "gateway", gateway_pb2.GenerateRequest, True, "UNAVAILABLE", "DATA_LOSS"),
    _m("/splitserve.v1.Gateway/GenerateUnary", "gateway", gateway_pb2.GenerateRequest, False, "UNAVAILABLE",
       "DATA_LOSS"),
    _m("/splitserve.v1.Gateway/GetInfo", "gateway", gateway_pb2.GetInfoRequest),
]
REGISTRY = [
    _m("/splitserve.v1.WorkerRegistry/RegisterWorker", "gateway-internal", gateway_pb2.RegisterWorkerRequest),
    _m("/splitserve.v1.WorkerRegistry/Heartbeat", "gateway-internal", gateway_pb2.HeartbeatRequest),
]
WORKERS = [
    _m("/splitserve.v1.DecodeWorker/Decode", "decode", decode_pb2.DecodeRequest, True, "UNAVAILABLE", "DATA_LOSS"),
    _m("/splitserve.v1.DecodeWorker/OpenKVChannel", "decode", kv_transfer_pb2.KVChannelHandshake, False,
       "FAILED_PRECONDITION", "UNAVAILABLE", "PERMISSION_DENIED"),  # PERMISSION_DENIED: not the caller's address
    _m("/splitserve.v1.DecodeWorker/AnnounceTransfer", "decode", kv_transfer_pb2.TransferHeader, False,
       "FAILED_PRECONDITION", "NOT_FOUND", "UNAVAILABLE"),
    _m("/splitserve.v1.DecodeWorker/RenewLease", "decode", kv_transfer_pb2.LeaseRenewal, False,
       "FAILED_PRECONDITION", "NOT_FOUND"),  # not this incarnation; no live reservation (or a wrong secret)
    _m("/splitserve.v1.DecodeWorker/GetStats", "decode", common_pb2.GetStatsRequest),
    _m("/splitserve.v1.PrefillWorker/Prefill", "prefill", prefill_pb2.PrefillRequest, False,
       "UNAVAILABLE", "ABORTED", "FAILED_PRECONDITION", "NOT_FOUND", "DATA_LOSS"),
    _m("/splitserve.v1.PrefillWorker/GetStats", "prefill", common_pb2.GetStatsRequest),
]
UNKNOWN_METHOD = _m("/splitserve.v1.Gateway/NoSuchMethod", "gateway", gateway_pb2.GetInfoRequest)
ALL = GATEWAY + REGISTRY + WORKERS
BY_NAME = {m.name: m for m in [*ALL, UNKNOWN_METHOD]}
