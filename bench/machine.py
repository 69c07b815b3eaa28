"""Where and on what a benchmark ran: the machine, the load average around each measurement,
the code's commit and version. Every benchmark records these the same way.

The CPUs may be shared with other jobs: the 1-minute load average before and after each
measured system says how far to trust its figure.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path


def load_average() -> float | None:
    """The 1-minute load average, or None where the platform has none."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


@contextmanager
def load_window() -> Iterator[dict[str, float | None]]:
    """``{"before": ..., "after": ...}`` 1-minute load averages around the ``with`` block
    (``after`` is filled in when the block ends, also when it raises)."""
    window: dict[str, float | None] = {"before": load_average()}
    try:
        yield window
    finally:
        window["after"] = load_average()


def machine_description(num_threads: int) -> dict:
    """Platform, CPUs, library versions, the thread count the systems get, the load now."""
    import torch
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_version": torch.__version__,
        "torch_num_threads": num_threads,
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "transformers_version": transformers.__version__,
        "load_average_1m": load_average(),
    }


def git_commit() -> str | None:
    """The commit of the checkout this package runs from; None when it runs from an installed
    wheel (even one installed into a venv inside some checkout)."""
    package_dir = Path(__file__).resolve().parent
    try:
        result = subprocess.run(["git", "-C", str(package_dir), "rev-parse", "--show-toplevel", "HEAD"],
                                capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    toplevel, commit = result.stdout.split()
    return commit if Path(toplevel).resolve() == package_dir.parent else None


def package_version() -> str | None:
    """The installed ``splitserve`` distribution's version (None when not installed)."""
    try:
        return metadata.version("splitserve")
    except metadata.PackageNotFoundError:
        return None
