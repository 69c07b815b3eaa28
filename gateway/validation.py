"""Request validation at the gateway: every rejection names the field (INVALID_ARGUMENT).

Three steps: ``precheck`` (no tokenizer, cheap, on the event loop, byte caps included:
``gateway/prompt.py``), ``prompt_token_ids`` (tokenize or render the chat: the service runs
it on its tokenizer thread), ``finish`` (checks that need the prompt's length)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from google.protobuf import unknown_fields

from engine.chat import ChatTemplate
from engine.grammar import GrammarCompiler
from engine.sampling_params import SamplingParams
from engine.stopping import finish_reason
from engine.prompt_check import check_prompt
from gateway.prompt import MAX_BYTES_PER_TOKEN, check_prompt_size, prompt_field, prompt_token_ids
from plumbing.convert import constraint_to_proto, sampling_params_from_proto, sampling_params_to_proto
from splitserve_api.v1 import common_pb2, gateway_pb2


@dataclass(frozen=True)
class ValidatedRequest:
    """What validation produced, once: the workers get ``sampling``/``stopping``, the
    canonical form of ``params`` (stop strings stay at the gateway)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stop_strings: tuple[str, ...]
    sampling: common_pb2.SamplingParams
    stopping: common_pb2.StoppingCriteria
    resume_token_ids: tuple[int, ...] = ()  # GenerateRequest.resume: tokens the client has
    num_resumes: int = 0  # resume.num_previous_resumes + 1 when resumed, else 0
    constraint: common_pb2.Constraint | None = None  # structured output, caps checked


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_stop_strings: int
    max_stop_string_bytes: int
    bytes_per_token: int = MAX_BYTES_PER_TOKEN  # the text byte cap's factor (gateway/prompt.py)
    eos_token_ids: tuple[int, ...] = ()  # the model's (as the engine stops on them)

    @property
    def max_prompt_bytes(self) -> int:
        """Longest prompt text (or chat content) accepted, in UTF-8 bytes."""
        return self.max_model_len * self.bytes_per_token


def _is_repeated(descriptor: Any) -> bool:
    if hasattr(descriptor, "is_repeated"):  # protobuf >= 5.29 (``label`` is gone in 7)
        return bool(descriptor.is_repeated)
    return descriptor.label == descriptor.LABEL_REPEATED


def _reject_unknown_fields(message: Any, path: str) -> None:
    """Fields this server does not know are an error, not silently ignored."""
    unknown = unknown_fields.UnknownFieldSet(message)
    if len(unknown):
        numbers = sorted({f.field_number for f in unknown})
        raise ValueError(f"{path or 'request'}: unknown field number(s) {numbers}")
    for descriptor, value in message.ListFields():
        if descriptor.message_type is not None and not _is_repeated(descriptor):
            if not descriptor.message_type.GetOptions().map_entry:
                _reject_unknown_fields(value, f"{path}.{descriptor.name}".lstrip("."))


def precheck(request: gateway_pb2.GenerateRequest, limits: Limits) -> None:
    """Everything that needs no tokenizer (cheap: runs on the event loop)."""
    _reject_unknown_fields(request, "")
    check_prompt_size(request, limits.max_model_len, limits.max_prompt_bytes)
    if not request.HasField("stopping") or request.stopping.max_new_tokens < 1:
        raise ValueError("stopping.max_new_tokens must be >= 1")
    stops = tuple(request.stopping.stop_strings)
    if len(stops) > limits.max_stop_strings:
        raise ValueError(f"stopping.stop_strings: at most {limits.max_stop_strings}, got {len(stops)}")
    for s in stops:
        if not s or len(s.encode()) > limits.max_stop_string_bytes:
            raise ValueError(
                f"stopping.stop_strings: each must be 1..{limits.max_stop_string_bytes} bytes"
            )
    bad_stop = next((t for t in request.stopping.stop_token_ids if t >= limits.vocab_size), None)
    if bad_stop is not None:
        raise ValueError(f"stopping.stop_token_ids: {bad_stop} is outside the vocabulary")


def finish(request: gateway_pb2.GenerateRequest, prompt: list[int], limits: Limits,
           chat: ChatTemplate | None = None) -> ValidatedRequest:
    """The checks that need the prompt's token ids; what the workers get."""
    check_prompt(prompt, limits.vocab_size, limits.max_model_len, prompt_field(request),
                 max_new_tokens=request.stopping.max_new_tokens, max_new_tokens_field="stopping.max_new_tokens")
    params = sampling_params_from_proto(request.sampling, request.stopping, request.constraint)
    if request.WhichOneof("prompt") == "chat" and chat is not None and not params.ignore_eos:
        end_ids = tuple(t for t in chat.end_of_turn_ids if t not in params.stop_token_ids)
        params = replace(params, stop_token_ids=params.stop_token_ids + end_ids)
    sampling, stopping = sampling_params_to_proto(params)
    resumed = request.HasField("resume")
    return ValidatedRequest(prompt, params, tuple(request.stopping.stop_strings), sampling, stopping,
                            resume_token_ids=check_resume(request.resume, params, limits, len(prompt)) if resumed else (),
                            num_resumes=request.resume.num_previous_resumes + 1 if resumed else 0,
                            constraint=constraint_to_proto(params.constraint))


def check_resume(resume: gateway_pb2.Resume, params: SamplingParams, limits: Limits,
                 num_prompt_tokens: int) -> tuple[int, ...]:
    """``resume.token_ids`` if an unbroken stream of this request could have sent them:
    at most max_new_tokens, each in the vocabulary, none before the last ending the request
    (the engine's stop rule, ``engine/stopping.py``: a stop token once min_new_tokens are
    reached)."""
    ids = tuple(resume.token_ids)
    if len(ids) > params.max_tokens:
        raise ValueError(f"resume.token_ids: {len(ids)} tokens, more than stopping.max_new_tokens={params.max_tokens}")
    bad = next((i for i, t in enumerate(ids) if t >= limits.vocab_size), None)
    if bad is not None:
        raise ValueError(f"resume.token_ids[{bad}]: {ids[bad]} is outside the vocabulary (size {limits.vocab_size})")
    early = next((i for i, t in enumerate(ids[:-1]) if finish_reason(
        params, t, i + 1, num_prompt_tokens + i + 1, limits.max_model_len, limits.eos_token_ids) is not None), None)
    if early is not None:
        raise ValueError(f"resume.token_ids[{early}]: {ids[early]} is a stop token, which ends the request, "
                         "yet tokens follow it")
    return ids


def check_constraint_compiles(params: SamplingParams, grammars: GrammarCompiler | None) -> None:
    """Compile the request's constraint (ms; cached by the schema's hash) so that one that
    does not compile is INVALID_ARGUMENT here, with the library's reason, not a worker
    failure. Runs off the event loop."""
    if params.constraint is None:
        return
    if grammars is None:
        raise ValueError("constraint: this model has no tokenizer to compile grammars with")
    grammars.compile(params.constraint)


def validate(request: gateway_pb2.GenerateRequest, tokenizer: Any, limits: Limits,
             chat: ChatTemplate | None = None) -> ValidatedRequest:
    """Raise ``ValueError`` naming the offending field; return what the workers need.
    ``chat``: the model's chat template, for ``prompt.chat`` (None: the model has none).
    The service runs the same three steps with the middle one on its tokenizer thread."""
    precheck(request, limits)
    return finish(request, prompt_token_ids(request, tokenizer, chat), limits, chat)
