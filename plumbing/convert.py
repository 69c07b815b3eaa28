"""Protobuf ⇄ plain dataclasses, in one place (the engine never imports ``_pb2`` modules)."""

from __future__ import annotations

import math
import re

from engine.constraints import Constraint, ConstraintKind
from engine.kv_events import KVEventBatch
from engine.kv_layout import KVLayout
from engine.sampling_params import SamplingParams
from splitserve_api.v1 import common_pb2, gateway_pb2

# Engine field name -> the request field a client set, for error messages.
_FIELD_NAMES = {
    "max_tokens": "stopping.max_new_tokens",
    "min_tokens": "stopping.min_new_tokens",
    "stop_token_ids": "stopping.stop_token_ids",
    "temperature": "sampling.temperature",
    "top_k": "sampling.top_k",
    "top_p": "sampling.top_p",
    "min_p": "sampling.min_p",
    "repetition_penalty": "sampling.repetition_penalty",
    "seed": "sampling.seed",
    "logprobs": "sampling.logprobs",
    "num_speculative_tokens": "sampling.num_speculative_tokens",
}
_FIELD_RE = re.compile(r"^(" + "|".join(_FIELD_NAMES) + r")\b")

FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop": common_pb2.FINISH_REASON_STOP,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def _finite(value: float, name: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def sampling_params_from_proto(
    sampling: common_pb2.SamplingParams,
    stopping: common_pb2.StoppingCriteria,
    constraint: common_pb2.Constraint | None = None,
) -> SamplingParams:
    """Build engine ``SamplingParams``; ``ValueError`` names the proto field."""
    try:
        return SamplingParams(
            constraint=constraint_from_proto(constraint),
            temperature=_finite(sampling.temperature, "temperature") if sampling.HasField("temperature") else 1.0,
            top_p=_finite(sampling.top_p, "top_p") if sampling.HasField("top_p") else 1.0,
            top_k=int(sampling.top_k) if sampling.top_k > 0 else -1,
            min_p=_finite(sampling.min_p, "min_p") if sampling.HasField("min_p") else 0.0,
            repetition_penalty=_finite(sampling.repetition_penalty, "repetition_penalty")
            if sampling.HasField("repetition_penalty")
            else 1.0,
            seed=int(sampling.seed) if sampling.HasField("seed") else None,
            logprobs=int(sampling.logprobs) if sampling.HasField("logprobs") else None,
            num_speculative_tokens=int(sampling.num_speculative_tokens)
            if sampling.HasField("num_speculative_tokens")
            else None,
            max_tokens=int(stopping.max_new_tokens),
            min_tokens=int(stopping.min_new_tokens),
            stop_token_ids=tuple(int(t) for t in stopping.stop_token_ids),
            ignore_eos=bool(stopping.ignore_eos),
        )
    except ValueError as exc:
        raise ValueError(_FIELD_RE.sub(lambda m: _FIELD_NAMES[m.group(1)], str(exc))) from None


def sampling_params_to_proto(
    params: SamplingParams,
) -> tuple[common_pb2.SamplingParams, common_pb2.StoppingCriteria]:
    """The canonical protos of validated params (what the gateway forwards to workers);
    ``sampling_params_from_proto`` of them gives ``params`` back exactly."""
    sampling = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
        min_p=params.min_p, repetition_penalty=params.repetition_penalty,
    )
    if params.seed is not None:
        sampling.seed = params.seed
    if params.logprobs is not None:
        sampling.logprobs = params.logprobs
    if params.num_speculative_tokens is not None:
        sampling.num_speculative_tokens = params.num_speculative_tokens
    stopping = common_pb2.StoppingCriteria(
        max_new_tokens=params.max_tokens, min_new_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
    )
    return sampling, stopping


def token_logprob(
    token_id: int, logprob: float | None, top: dict[int, float] | None = None
) -> common_pb2.TokenLogprob:
    msg = common_pb2.TokenLogprob(token_id=token_id, logprob=logprob if logprob is not None else 0.0)
    if top:
        msg.top_logprobs.update({int(k): float(v) for k, v in top.items()})
    return msg


def kv_layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
    )


def kv_layout_from_proto(msg: common_pb2.KVLayout) -> KVLayout:
    """``ValueError`` (naming the field) when the peer sent an impossible layout."""
    return KVLayout(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.block_size, msg.dtype)


def kv_events_to_proto(batch: KVEventBatch) -> gateway_pb2.KVEvents:
    """A batch of the engine's KV events as the heartbeat's ``kv_events``."""
    return gateway_pb2.KVEvents(seq=batch.seq, reset=batch.reset, stored=batch.stored, removed=batch.removed)


def constraint_from_proto(msg: common_pb2.Constraint | None) -> Constraint | None:
    """The engine's ``Constraint`` (caps checked: ``ConstraintError`` names the field), or
    None when no kind is set."""
    kind = None if msg is None else msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        return Constraint(ConstraintKind.JSON_SCHEMA, msg.json_schema.schema, strict=msg.json_schema.strict)
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind == "choice":
        return Constraint(ConstraintKind.CHOICE, choices=tuple(msg.choice.choices))
    return Constraint(ConstraintKind(kind), getattr(msg, kind))


def constraint_to_proto(constraint: Constraint | None) -> common_pb2.Constraint | None:
    if constraint is None:
        return None
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        schema = common_pb2.Constraint.JsonSchema(schema=constraint.text, strict=constraint.strict)
        return common_pb2.Constraint(json_schema=schema)
    if kind is ConstraintKind.JSON_OBJECT:
        return common_pb2.Constraint(json_object=common_pb2.Constraint.JsonObject())
    if kind is ConstraintKind.CHOICE:
        return common_pb2.Constraint(choice=common_pb2.Constraint.Choice(choices=list(constraint.choices)))
    return common_pb2.Constraint(**{kind.value: constraint.text})
