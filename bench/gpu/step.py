"""One step of the GPU check, in its own process (``bench.gpu.runner`` starts it):

    python -m bench.gpu.step NAME OPTIONS_JSON RESULT_JSON DEADLINE_S

Writes ``{"figures": ...}``, or ``{"error", "traceback"}`` when the step raised, to
RESULT_JSON. ``TRITON_INTERPRET`` comes from the parent's environment (dry runs).
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from bench.gpu.options import GpuCheckOptions


def _steps() -> dict[str, Callable[[GpuCheckOptions, float], dict]]:
    from bench.gpu.bandwidth import bandwidth_step
    from bench.gpu.device import build_step
    from bench.gpu.handoff import handoff_step
    from bench.gpu.kernel_checks import kernels_step
    from bench.gpu.parity import parity_step
    from bench.gpu.throughput import throughput_step

    return {"build": build_step, "kernels": kernels_step, "bandwidth": bandwidth_step, "parity": parity_step,
            "handoff": handoff_step, "throughput": throughput_step}


def _plain(value: object) -> object:
    """JSON-safe: non-finite floats become None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def main(argv: list[str]) -> int:
    name, options_path, result_path, deadline_s = argv
    options = GpuCheckOptions.from_dict(json.loads(Path(options_path).read_text()))
    deadline = time.monotonic() + float(deadline_s)
    try:
        result: dict = {"figures": _steps()[name](options, deadline)}
    except Exception as exc:  # the parent records it; the other steps still run
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(result_path).write_text(json.dumps(_plain(result), indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
