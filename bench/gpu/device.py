"""The device a step runs on, timing on it, and the ``build`` step.

The ``build`` step builds nothing, on purpose: the C++ extension (kernels/csrc) is the CPU
path's kernels only. On CUDA every op runs its Triton kernel (``splitserve_kernels.ops.use_triton``),
compiled by Triton on first use, so nothing has to be built against the device's torch.
The step records what the run sees: versions, the GPU, and which kernels serve.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from bench.gpu.options import GpuCheckOptions


def device_for(options: GpuCheckOptions) -> torch.device:
    return torch.device("cpu" if options.dry_run else "cuda")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mean_seconds(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Mean wall time of ``fn`` over ``iters`` back-to-back calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _gpu_description(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"device": "cpu (dry run)"}
    props = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"device": props.name, "capability": f"sm_{props.major}{props.minor}",
            "multiprocessors": props.multi_processor_count, "memory_gib": round(total / 2**30, 1),
            "free_memory_gib": round(free / 2**30, 1), "cuda_runtime": torch.version.cuda,
            "device_count": torch.cuda.device_count()}


def build_step(options: GpuCheckOptions, deadline: float) -> dict:
    """Nothing to build (module docstring); what serves each op on this device."""
    from splitserve_kernels import ops
    from splitserve_kernels._triton_compat import HAS_TRITON
    from splitserve_kernels.native import native_kernels

    device = device_for(options)
    triton_version = None
    if HAS_TRITON:
        import triton

        triton_version = triton.__version__
    return {
        "gpu": _gpu_description(device),
        "torch_version": torch.__version__,
        "triton_version": triton_version,
        "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "ops_run_triton_on_this_device": ops.use_triton(device),
        "native_extension": {
            "built": False,
            "reason": "kernels/csrc is the CPU path only; on CUDA splitserve_kernels.ops runs the Triton "
                      "kernels, which Triton compiles on first use",
            "loads_here": native_kernels().available,
        },
    }
