"""Which native library serves (kernels/splitserve_kernels/native.py): ``SPLITSERVE_CPU_ISA``, the torch version a
library was built against, and the rule that an install on a machine with a compiler has them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import torch

from splitserve_kernels import native
from splitserve_kernels.native import build_mismatch, built_against, choose_variants, native_kernels

REPO_ROOT = Path(__file__).resolve().parents[2]
ALLOW_REFERENCE = "SPLITSERVE_ALLOW_REFERENCE_KERNELS"


def test_native_library_present_where_a_compiler_is() -> None:
    # The fast path is the product: an install that could have built it and did not (an
    # isolated build without torch, a failed compile) fails here, unless the references are
    # allowed explicitly.
    if os.environ.get(ALLOW_REFERENCE) == "1":
        pytest.skip(f"{ALLOW_REFERENCE}=1")
    if os.environ.get(native.ISA_ENV) == "reference":
        pytest.skip(f"{native.ISA_ENV}=reference")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) on this machine: the install could not build them")
    assert native_kernels().available, (
        f"{native_kernels().reason}; {compiler} is here, so the install should have built them "
        f"(set {ALLOW_REFERENCE}=1 to run on the references)")


def test_auto_tries_the_best_library_the_cpu_runs_first() -> None:
    assert choose_variants("auto", "AVX512") == ("avx512", "avx2", "default")
    assert choose_variants("auto", "AVX2") == ("avx2", "default")
    assert choose_variants("auto", "DEFAULT") == ("default",)


def test_a_forced_variant_is_the_only_one_tried() -> None:
    assert choose_variants("avx2", "AVX512") == ("avx2",)
    assert choose_variants("avx512", "AVX512") == ("avx512",)
    assert choose_variants("reference", "AVX512") == ()


def test_a_variant_the_cpu_cannot_run_is_refused() -> None:
    with pytest.raises(ValueError, match="SPLITSERVE_CPU_ISA=avx512: this CPU runs AVX2"):
        choose_variants("avx512", "AVX2")
    with pytest.raises(ValueError, match="SPLITSERVE_CPU_ISA='sse4': expected one of auto, avx512, avx2, reference"):
        choose_variants("sse4", "AVX512")


def test_a_library_built_against_another_torch_minor_is_refused() -> None:
    reason = build_mismatch("2.12.1", "2.13.0+cpu")
    assert reason is not None
    assert "built against torch 2.12.1, this process runs torch 2.13.0+cpu" in reason
    assert "pip install --no-build-isolation ." in reason and "torch==2.12.1" in reason
    assert build_mismatch("2.13.0+cpu", "2.13.1") is None  # same minor: loading decides
    assert build_mismatch(None, "2.13.0") is None  # no record (an older build)


def test_built_against_reads_the_record_beside_the_library(tmp_path: Path) -> None:
    library = tmp_path / "_native_avx2.cpython-311-x86_64-linux-gnu.so"
    library.write_bytes(b"")
    assert built_against(str(library)) is None
    (tmp_path / "_native_avx2.torch").write_text("2.13.0+cpu\n")
    assert built_against(str(library)) == "2.13.0+cpu"


def test_a_mismatched_library_is_not_loaded_and_says_why(tmp_path: Path, monkeypatch) -> None:
    library = tmp_path / "_native_avx2.so"
    library.write_bytes(b"not a library")
    (tmp_path / "_native_avx2.torch").write_text("2.4.0\n")
    monkeypatch.setattr(native, "_library_path", lambda variant: str(library))
    monkeypatch.setattr(torch.ops, "load_library", lambda path: pytest.fail("loaded a mismatched library"))
    loaded = native._load("auto")
    assert not loaded.available
    assert f"built against torch 2.4.0, this process runs torch {torch.__version__}" in loaded.reason


def test_a_forced_variant_that_cannot_load_is_an_error_not_a_fallback(monkeypatch) -> None:
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_library_path", lambda variant: None)
    monkeypatch.setenv(native.ISA_ENV, "avx2")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with pytest.raises(ValueError, match="SPLITSERVE_CPU_ISA=avx2: CPU capability AVX2; avx2: not built"):
        native_kernels()


def test_reference_is_logged_as_a_choice_not_a_warning(monkeypatch) -> None:
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setenv(native.ISA_ENV, "reference")
    with structlog.testing.capture_logs() as logs:
        assert native_kernels().variant is None
    assert [(e["log_level"], e["event"], e["requested"]) for e in logs] == [("info", "native CPU kernels", "reference")]


FORCED_CHECK = """
import torch
from splitserve_kernels import ops
from splitserve_kernels.elementwise import rms_norm_ref
from splitserve_kernels.native import native_kernels
x, w = torch.randn(4, 64), torch.randn(64)
torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
print("variant", native_kernels().variant)
"""


def test_splitserve_cpu_isa_avx2_loads_the_avx2_library_and_logs_it() -> None:
    # In a process of its own: a process loads one library, once.
    if native_kernels().variant != "avx512":
        pytest.skip("only an AVX-512 machine has a choice to force")
    env = {**os.environ, native.ISA_ENV: "avx2", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", FORCED_CHECK], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "variant avx2" in result.stdout
    assert "native CPU kernels" in result.stdout and "requested=avx2" in result.stdout


def test_the_avx2_test_mode_restricts_every_path() -> None:
    # Only meaningful in that mode (`make test-avx2`, tests/engine/test_avx2_mode.py): the
    # native kernels, ATen's kernels and oneDNN all limited to AVX2, as on an AVX2-only CPU.
    if os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        pytest.skip("not in the AVX2 test mode (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)")
    from engine.models.linear import onednn_has_bf16

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    if os.environ.get(ALLOW_REFERENCE) != "1":
        assert native_kernels().variant == "avx2", native_kernels().reason
    assert os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2" and not onednn_has_bf16()
