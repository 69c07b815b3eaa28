"""splitserve_kernels.ops: the reference runs on CPU, the Triton kernels on CUDA; imports stay light."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import torch

from splitserve_kernels import native, ops

REPO_ROOT = Path(__file__).resolve().parents[2]
TRITON_LAUNCHERS = (
    "write_kv_triton",
    "paged_attention_triton",
    "pack_kv_triton",
    "unpack_kv_triton",
)


def run_all_ops(batch) -> dict[str, torch.Tensor]:
    """Every op once, on copies; returns what each produced."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    num_tokens, num_kv_heads, head_dim = batch.query.shape[0], k_cache.shape[2], k_cache.shape[3]
    key = torch.randn(
        num_tokens, num_kv_heads, head_dim, generator=torch.Generator().manual_seed(7)
    )
    slots = torch.arange(num_tokens, dtype=torch.int64)
    slots[0] = -1
    ops.write_kv(key, -key, k_cache, v_cache, slots)
    attn = ops.paged_attention(batch.query, k_cache, v_cache, *batch.args[3:], 0.25)
    kv_cache = torch.stack([k_cache, v_cache]).unsqueeze(0)  # [1 layer, 2, blocks, ...]
    buffer = ops.pack_kv(kv_cache, [2, 0])
    unpacked = torch.zeros_like(kv_cache)
    ops.unpack_kv(unpacked, buffer, [1, 3])
    return {
        "k_cache": k_cache,
        "v_cache": v_cache,
        "attn": attn,
        "buffer": buffer,
        "unpacked": unpacked,
    }


def test_use_triton_only_for_cuda() -> None:
    assert not ops.use_triton(torch.device("cpu"))
    assert ops.use_triton(torch.device("cuda")) == ops.HAS_TRITON


def check_cpu_results(batch, got: dict[str, torch.Tensor], exact: bool) -> None:
    attn = ops.paged_attention_ref(batch.query, got["k_cache"], got["v_cache"], *batch.args[3:], 0.25)
    if exact:
        assert torch.equal(got["attn"], attn)
    else:
        torch.testing.assert_close(got["attn"], attn, atol=1e-5, rtol=1e-5)
    kv_cache = torch.stack([got["k_cache"], got["v_cache"]]).unsqueeze(0)
    assert torch.equal(got["buffer"], kv_cache[:, :, [2, 0]])
    assert torch.equal(got["unpacked"][:, :, [1, 3]], got["buffer"])


def test_cpu_tensors_run_the_native_kernels(paged_batch, monkeypatch) -> None:
    if not native.native_kernels().available:
        pytest.skip(f"native kernels not built: {native.native_kernels().reason}")
    batch = paged_batch([1, 5], [9, 5], block_size=8, num_kv_heads=2, queries_per_kv=2, head_dim=16)
    for name in (*TRITON_LAUNCHERS, "paged_attention_ref", "write_kv_ref"):
        monkeypatch.setattr(
            ops, name, lambda *a, _n=name: pytest.fail(f"{_n} called for CPU tensors")
        )
    got = run_all_ops(batch)
    monkeypatch.undo()
    check_cpu_results(batch, got, exact=False)


def test_cpu_falls_back_to_the_reference_without_native_kernels(paged_batch, monkeypatch) -> None:
    # As on an install where the library did not build: the reference runs, and one
    # warning says so however many ops run.
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_library_path", lambda variant: None)
    monkeypatch.delenv(native.ISA_ENV, raising=False)  # the AVX2 test mode forces one
    for name in (*TRITON_LAUNCHERS, "paged_attention_native", "write_kv_native"):
        monkeypatch.setattr(
            ops, name, lambda *a, _n=name: pytest.fail(f"{_n} called without native kernels")
        )
    batch = paged_batch([1, 5], [9, 5], block_size=8, num_kv_heads=2, queries_per_kv=2, head_dim=16)
    with structlog.testing.capture_logs() as logs:
        got = run_all_ops(batch)
        run_all_ops(batch)
    assert not ops.use_native(torch.device("cpu"))
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and "reference" in warnings[0]["event"]
    assert "not built" in warnings[0]["reason"]
    check_cpu_results(batch, got, exact=True)


def test_triton_path_wiring_agrees_with_reference(paged_batch, monkeypatch) -> None:
    # Force the Triton branch (kernels interpreted on CPU) to check ops passes arguments
    # through in the right order: both branches must produce the same results.
    batch = paged_batch([1, 5], [9, 5], block_size=8, num_kv_heads=2, queries_per_kv=2, head_dim=16)
    expected = run_all_ops(batch)
    monkeypatch.setattr(ops, "use_triton", lambda device: True)
    got = run_all_ops(batch)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=1e-5, msg=name)


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("TRITON_INTERPRET", None)
    env.pop("SPLITSERVE_CPU_ISA", None)  # a forced variant logs its choice on the stdout compared here
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ops_work_without_triton() -> None:
    code = """
import sys
sys.modules["triton"] = None  # makes "import triton" raise ImportError
import torch
from splitserve_kernels import ops, kv_write
assert not ops.HAS_TRITON and not ops.use_triton(torch.device("cuda"))
k_cache, v_cache = torch.zeros(2, 8, 1, 16), torch.zeros(2, 8, 1, 16)
key = torch.ones(2, 1, 16)
ops.write_kv(key, key, k_cache, v_cache, torch.tensor([3, -1]))
assert k_cache[0, 3].eq(1).all() and k_cache.sum() == 16
i32 = torch.int32
out = ops.paged_attention(torch.ones(1, 1, 16), k_cache, v_cache, torch.zeros(1, 2, dtype=i32),
                          torch.tensor([4], dtype=i32), torch.tensor([0, 1], dtype=i32), 1.0)
assert out.shape == (1, 1, 16)
try:
    kv_write.write_kv_triton(key, key, k_cache, v_cache, torch.tensor([3, -1]))
except RuntimeError as e:
    assert "triton is not installed" in str(e)
else:
    raise AssertionError("write_kv_triton ran without triton")
print("ok")
"""
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_importing_kernels_package_is_light() -> None:
    result = _run_python(
        "import sys, kernels; print('triton' in sys.modules, 'torch' in sys.modules)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]
