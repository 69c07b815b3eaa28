"""splitserve engine: model runner over a paged KV cache, block manager, scheduler, sampler.

Kept light: importing a submodule (e.g. ``engine.block_pool``) must not import the model
or torch's CUDA stack. The public API lives in ``engine.engine`` and is re-exported lazily.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CompletionOutput", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]


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
    if name in ("RequestOutput", "CompletionOutput"):
        from engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
