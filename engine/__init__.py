"""splitserve engine: model runner over a paged KV cache, block manager, scheduler, sampler.

Kept light: importing a submodule (e.g. ``engine.block_pool``) must not import the model
or torch's CUDA stack. The public API lives in ``engine.engine`` and is re-exported lazily.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from engine.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from engine.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(name)
