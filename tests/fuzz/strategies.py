"""Hypothesis strategies for hostile protobuf messages, and a reproducible way to draw them.

* ``message_of(cls)``: any message of a type, built from its descriptor, so fields added
  later are fuzzed too: each field present or not; integers at their type's edges (0, 2^31,
  2^32 - 1, 2^64 - 1, negatives); floats with NaN, infinities, subnormals; strings with
  control characters, right-to-left marks, astral-plane characters, 100 KB; enum values
  outside the enum; repeated fields empty, small or 20,000 long; nested three deep.
* ``generate_request()``: a gateway request that is often valid (token ids inside the
  vocabulary, a few new tokens), so cases get past validation into routing and the engine,
  with one or more fields pushed out of range, huge or odd prompts, unicode, many stop strings.

``draw(strategy, n, seed)`` runs hypothesis's generation phase only (no shrinking, no database)
under ``@seed``: the same seed draws the same cases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from splitserve_api.v1 import common_pb2, gateway_pb2

U32_EDGES = [0, 1, 2, 8, 255, 256, 65535, 2**31 - 1, 2**31, 2**32 - 1]
U64_EDGES = [*U32_EDGES, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1]
I32_EDGES = [0, 1, -1, 2**31 - 1, -(2**31)]
I64_EDGES = [*I32_EDGES, 2**63 - 1, -(2**63)]
HOSTILE_STRINGS = ["", " ", "\x00", "\x00" * 64, "\u202e\u2066evil", "🙂" * 300, "\U0010ffff", "a" * 257,
                   "%s%n%x", "\r\n\r\n", "127.0.0.1:1", "localhost:0", "[::1]:65535", "x" * 100_000,
                   "ÿ" * 1000, "\ufeff", "\u0301" * 500]


def _ints(lo: int, hi: int, edges: list[int]) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([e for e in edges if lo <= e <= hi]), st.integers(lo, hi), st.integers(0, 16))


_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FD.TYPE_UINT32: _ints(0, 2**32 - 1, U32_EDGES),
    FD.TYPE_FIXED32: _ints(0, 2**32 - 1, U32_EDGES),
    FD.TYPE_UINT64: _ints(0, 2**64 - 1, U64_EDGES),
    FD.TYPE_FIXED64: _ints(0, 2**64 - 1, U64_EDGES),
    FD.TYPE_INT32: _ints(-(2**31), 2**31 - 1, I32_EDGES),
    FD.TYPE_SINT32: _ints(-(2**31), 2**31 - 1, I32_EDGES),
    FD.TYPE_SFIXED32: _ints(-(2**31), 2**31 - 1, I32_EDGES),
    FD.TYPE_INT64: _ints(-(2**63), 2**63 - 1, I64_EDGES),
    FD.TYPE_SINT64: _ints(-(2**63), 2**63 - 1, I64_EDGES),
    FD.TYPE_SFIXED64: _ints(-(2**63), 2**63 - 1, I64_EDGES),
    FD.TYPE_FLOAT: st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, 1.0, 1e-45, 3.4e38, -1.0])),
    FD.TYPE_DOUBLE: st.floats(),
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_STRING: st.one_of(st.text(max_size=40), st.sampled_from(HOSTILE_STRINGS)),
    FD.TYPE_BYTES: st.one_of(st.binary(max_size=200), st.sampled_from([b"", b"\x00" * 128, b"\xff" * 4096])),
}


def _value(field: FD, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FD.TYPE_MESSAGE:
        return message_of(message_factory.GetMessageClass(field.message_type), depth + 1)
    if field.type == FD.TYPE_ENUM:
        top = max(v.number for v in field.enum_type.values)
        return st.integers(-2, top + 3)  # values outside the enum too
    return _SCALARS[field.type]


def _is_repeated(field: FD) -> bool:
    return bool(getattr(field, "is_repeated", False)) or getattr(field, "label", 0) == FD.LABEL_REPEATED


def _fill(draw: Callable[[st.SearchStrategy[Any]], Any], msg: Message, field: FD, depth: int) -> None:
    value = _value(field, depth)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key = _value(field.message_type.fields_by_name["key"], depth)
        val = _value(field.message_type.fields_by_name["value"], depth)
        for k, v in draw(st.dictionaries(key, val, max_size=6)).items():
            if field.message_type.fields_by_name["value"].type == FD.TYPE_MESSAGE:
                getattr(msg, field.name)[k].CopyFrom(v)
            else:
                getattr(msg, field.name)[k] = v
    elif _is_repeated(field):
        container = getattr(msg, field.name)
        if field.type == FD.TYPE_MESSAGE:
            for item in draw(st.lists(value, max_size=4)):
                container.add().CopyFrom(item)
        elif draw(st.integers(0, 9)) == 0:  # now and then a very long one
            container.extend([draw(value)] * draw(st.integers(1000, 20_000)))
        else:
            container.extend(draw(st.lists(value, max_size=8)))
    elif field.type == FD.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(draw(value))
    else:
        setattr(msg, field.name, draw(value))


def message_of(cls: type[Message], depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of type ``cls`` (fields present or not, values at the edges)."""

    @st.composite
    def build(draw: Callable[[st.SearchStrategy[Any]], Any]) -> Message:
        msg = cls()
        if depth > 2:
            return msg
        for field in cls.DESCRIPTOR.fields:
            if draw(st.booleans()):
                _fill(draw, msg, field, depth)
        return msg

    return build()


_ODD_FLOATS = st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, -1.0, 1e-45, 1.0000001, 3.4e38]))


def _perturbations(vocab_size: int) -> dict[str, Callable[[gateway_pb2.GenerateRequest, Any], None]]:
    """One way each to push a field of a valid request out of range, or to make it odd."""
    def ids(r: gateway_pb2.GenerateRequest, values: list[int]) -> None:
        r.token_ids.ids[:] = values

    big = st.integers(vocab_size, 2**32 - 1)
    return {
        "ids_outside_vocab": lambda r, d: ids(r, d(st.lists(st.one_of(big, st.integers(0, vocab_size - 1)), min_size=1,
                                                            max_size=20).filter(lambda v: max(v) >= vocab_size))),
        "ids_empty": lambda r, d: ids(r, []),
        "ids_huge": lambda r, d: ids(r, [d(st.integers(0, vocab_size - 1))] * d(st.integers(500, 300_000))),
        "text_odd": lambda r, d: setattr(r, "text", d(st.one_of(st.text(max_size=300), st.sampled_from(HOSTILE_STRINGS)))),
        "text_huge": lambda r, d: setattr(r, "text", d(st.sampled_from(["word ", "🙂", "\x00", "ab"])) * d(st.integers(2_000, 400_000))),
        "chat": lambda r, d: [r.chat.messages.add(role=role, content=c) for role, c in
                              d(st.lists(st.tuples(st.integers(-1, 5), st.text(max_size=60)), max_size=4))],
        "no_prompt": lambda r, d: r.ClearField("token_ids"),
        "temperature": lambda r, d: setattr(r.sampling, "temperature", d(_ODD_FLOATS)),
        "top_p": lambda r, d: setattr(r.sampling, "top_p", d(_ODD_FLOATS)),
        "min_p": lambda r, d: setattr(r.sampling, "min_p", d(_ODD_FLOATS)),
        "repetition_penalty": lambda r, d: setattr(r.sampling, "repetition_penalty", d(_ODD_FLOATS)),
        "top_k": lambda r, d: setattr(r.sampling, "top_k", d(_ints(0, 2**32 - 1, U32_EDGES))),
        "seed": lambda r, d: setattr(r.sampling, "seed", d(_ints(0, 2**64 - 1, U64_EDGES))),
        "logprobs": lambda r, d: setattr(r.sampling, "logprobs", d(_ints(0, 2**32 - 1, [0, 20, 21]))),
        "num_speculative_tokens": lambda r, d: setattr(r.sampling, "num_speculative_tokens", d(_ints(0, 2**32 - 1, [16, 17]))),
        "max_new_tokens": lambda r, d: setattr(r.stopping, "max_new_tokens", d(_ints(0, 2**32 - 1, [0, 511, 512]))),
        "min_new_tokens": lambda r, d: setattr(r.stopping, "min_new_tokens", d(_ints(0, 2**32 - 1, [7, 8]))),
        "no_stopping": lambda r, d: r.ClearField("stopping"),
        "stop_strings_many": lambda r, d: r.stopping.stop_strings.extend([d(st.text(min_size=1, max_size=4))] * d(st.integers(9, 500))),
        "stop_strings_odd": lambda r, d: r.stopping.stop_strings.extend(d(st.lists(st.one_of(
            st.text(max_size=12), st.sampled_from(HOSTILE_STRINGS)), min_size=1, max_size=8))),
        "stop_token_ids": lambda r, d: r.stopping.stop_token_ids.extend(d(st.lists(_ints(0, 2**32 - 1, [vocab_size - 1, vocab_size]), max_size=200))),
        "ignore_eos": lambda r, d: setattr(r.stopping, "ignore_eos", True),
    }


def generate_request(vocab_size: int) -> st.SearchStrategy[gateway_pb2.GenerateRequest]:
    """A valid gateway request (token ids or text, a few new tokens, sane sampling) with
    zero (about a third of the time), one or two of its fields made hostile."""
    perturbations = _perturbations(vocab_size)

    @st.composite
    def build(draw: Callable[[st.SearchStrategy[Any]], Any]) -> gateway_pb2.GenerateRequest:
        r = gateway_pb2.GenerateRequest()
        if draw(st.booleans()):
            r.token_ids.ids.extend(draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=60)))
        else:
            r.text = draw(st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=200))
        r.sampling.temperature = draw(st.sampled_from([0.0, 0.0, 0.7, 1.0]))
        if r.sampling.temperature:
            r.sampling.seed = draw(st.integers(0, 2**64 - 1))
        r.stopping.max_new_tokens = draw(st.integers(1, 6))
        num = draw(st.sampled_from([0, 1, 1, 2]))
        for name in draw(st.lists(st.sampled_from(sorted(perturbations)), min_size=num, max_size=num, unique=True)):
            perturbations[name](r, draw)
        return r

    return build()


def draw(strategy: st.SearchStrategy[Any], n: int, seed_value: int) -> list[Any]:
    """``n`` examples of ``strategy`` (fewer if hypothesis runs out), the same for the same seed."""
    out: list[Any] = []

    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed(seed_value)
    @given(strategy)
    def collect(example: Any) -> None:
        out.append(example)

    collect()
    return out[:n]
