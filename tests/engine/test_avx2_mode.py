"""The tests that depend on the CPU's instruction sets, re-run as on an AVX2-only CPU.

The AVX2 test mode limits every path to AVX2 on a machine with AVX-512: ATen's kernels
(``ATEN_CPU_CAPABILITY=avx2``, which makes kernels/splitserve_kernels/native.py load our AVX2 library too) and
oneDNN's (``ONEDNN_MAX_CPU_ISA=AVX2``: no bfloat16 path, the AVX2-only CPU's case). These
variables act when torch starts, so the mode is a pytest run of its own: ``make test-avx2`` runs the affected suites
in it; here, in the ordinary suite, the bfloat16 and kernel-choice tests run in it too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve_kernels.native import native_kernels

REPO_ROOT = Path(__file__).resolve().parents[2]
AVX2_MODE = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
TESTS = [
    "tests/kernels/test_isa.py",
    "tests/engine/test_linear.py",
    "tests/engine/test_engine_behaviour.py::test_bfloat16_runs_and_mostly_agrees",
]


@pytest.mark.slow
def test_bfloat16_and_the_kernel_choice_pass_as_on_an_avx2_only_cpu() -> None:
    env = {**os.environ, **AVX2_MODE, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("SPLITSERVE_CPU_ISA", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *TESTS],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    if native_kernels().available:  # the mode's own check ran, not skipped
        assert "not in the AVX2 test mode" not in result.stdout, result.stdout[-2000:]
