"""When a sequence ends: the one stop rule.

The scheduler applies it to every token it appends (``engine/scheduler.py``); the gateway
applies it to the tokens it already sent when a worker died before reporting the finish, or a
resumed stream already ended (``gateway/request.py``), and to the tokens a resume names
(``gateway/validation.py``). It imports nothing but ``SamplingParams``: the gateway runs it
without torch.
"""

from __future__ import annotations

from collections.abc import Collection

from engine.sampling_params import SamplingParams

STOP = "stop"  # a stop token id, or an end-of-sequence id unless ignore_eos
LENGTH = "length"  # max_tokens outputs, or max_model_len tokens in all


def finish_reason(params: SamplingParams, last_token_id: int, num_output_tokens: int, num_tokens: int,
                  max_model_len: int, eos_token_ids: Collection[int]) -> str | None:
    """Why a sequence ends right after producing ``last_token_id``, its
    ``num_output_tokens``-th output token (``num_tokens`` tokens in all, prompt included):
    ``STOP`` once ``params.min_tokens`` outputs are reached and the token is one of
    ``params.stop_token_ids`` or (unless ``params.ignore_eos``) of ``eos_token_ids``;
    ``LENGTH`` at ``params.max_tokens`` outputs or ``max_model_len`` tokens; None: it goes on.
    A stop token wins over the length when both hold."""
    if num_output_tokens >= params.min_tokens:
        if last_token_id in params.stop_token_ids:
            return STOP
        if not params.ignore_eos and last_token_id in eos_token_ids:
            return STOP
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return LENGTH
    return None
