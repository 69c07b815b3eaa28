"""The ``kernels`` step: each Triton kernel against its torch reference, both on the same
device (CUDA; in a dry run the CPU with the kernels interpreted), on the kernel tests'
cases (kernels/splitserve_kernels/testing.py) plus, on the device, model-sized ones.

Every check records the largest absolute difference, the tolerance (the kernel tests'
own: ``torch.testing.assert_close`` with that ``atol`` / ``rtol``; 0 for copies) and
whether it passed.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from functools import partial

import torch

from bench.gpu.device import device_for
from bench.gpu.options import GpuCheckOptions
from splitserve_kernels import kv_int8
from splitserve_kernels import quant_matmul as qm
from splitserve_kernels.kv_pack import pack_kv_ref, pack_kv_triton, unpack_kv_ref, unpack_kv_triton
from splitserve_kernels.kv_write import write_kv_ref, write_kv_triton
from splitserve_kernels.paged_attention import paged_attention_int8_triton, paged_attention_triton
from splitserve_kernels.paged_attention_ref import paged_attention_ref
from splitserve_kernels.quant_matmul_triton import int4_matmul_triton, int8_matmul_triton
from splitserve_kernels.testing import make_kv_cache, make_paged_batch, make_write_kv_case

F32 = (1e-5, 1e-5)  # (atol, rtol) of the kernel tests
BF16_VS_F32 = (1e-6, 2**-7)  # one bf16 ulp: the kernel upcasts, only its final cast rounds
EXACT = (0.0, 0.0)
# (q_lens, seq_lens) of tests/kernels/test_paged_attention.py and test_kv_int8.py
ATTENTION_BATCHES = {
    "decode": ([1, 1, 1, 1, 1], [1, 16, 33, 32, 7]),
    "prefill": ([1, 16, 5, 32], [1, 16, 5, 32]),
    "chunked": ([7, 16, 3], [23, 48, 40]),
    "mixed": ([1, 9, 1, 4, 17, 1], [31, 9, 64, 36, 17, 8]),
}
LONG_BATCH = ([1, 1, 300, 1], [4000, 1700, 2100, 64])  # device only: model-length contexts
MATMUL_INT8 = [(48, 64, 1), (96, 128, 17), (960, 576, 1)]
MATMUL_INT4 = [(48, 64, 1, 32), (96, 128, 17, 64), (576, 576, 1, 32), (40, 256, 3, 128)]
MATMUL_DEVICE = [(4096, 4096, 1), (14336, 4096, 64)]  # the 8B model's projections


def compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float], **case: object) -> dict:
    """One check's record: largest |got - want| and whether ``assert_close`` with ``tol`` holds."""
    atol, rtol = tol
    diff = (got.double() - want.double()).abs()
    max_err = float(diff.max()) if diff.numel() else 0.0
    passed = got.shape == want.shape and got.dtype == want.dtype and bool(
        (diff <= atol + rtol * want.double().abs()).all())
    return {"name": name, **case, "max_abs_err": max_err, "atol": atol, "rtol": rtol, "passed": passed}


def _attention(device: torch.device, head_dim: int, batches: dict) -> list[dict]:
    out = []
    for label, (q_lens, seq_lens) in batches.items():
        for dtype in (torch.float32, torch.bfloat16):
            batch = make_paged_batch(q_lens, seq_lens, block_size=16, num_kv_heads=2, queries_per_kv=4,
                                     head_dim=head_dim, dtype=dtype, seed=len(label)).to(device)
            scale = head_dim**-0.5
            got = paged_attention_triton(*batch.args, scale)
            f32_args = [t.float() if t.is_floating_point() else t for t in batch.args]
            want = paged_attention_ref(*f32_args, scale)
            tol = F32 if dtype == torch.float32 else BF16_VS_F32
            out.append(compare(f"paged_attention/{label}", got.float(), want, tol, dtype=str(dtype)[6:],
                               head_dim=head_dim, seq_lens=seq_lens, q_lens=q_lens))
    return out


def _int8_kv(device: torch.device, head_dim: int, batches: dict) -> list[dict]:
    out = []
    for label, (q_lens, seq_lens) in batches.items():
        batch = make_paged_batch(q_lens, seq_lens, block_size=16, num_kv_heads=2, queries_per_kv=4,
                                 head_dim=head_dim, seed=7).to(device)
        k8, v8 = kv_int8.quantize_kv(batch.k_cache), kv_int8.quantize_kv(batch.v_cache)
        k_deq, v_deq = kv_int8.dequantize_kv(k8, torch.float32), kv_int8.dequantize_kv(v8, torch.float32)
        meta = (batch.block_tables, batch.seq_lens, batch.query_start_loc, head_dim**-0.5)
        got = paged_attention_int8_triton(batch.query, k8, v8, *meta)
        want = paged_attention_ref(batch.query, k_deq, v_deq, *meta)
        out.append(compare(f"int8_kv_attention/{label}", got, want, F32, head_dim=head_dim, seq_lens=seq_lens))
    key, value, _, _, slots = make_write_kv_case(6, 16, 2, head_dim, torch.float32, seed=3)
    caches = {impl: [torch.zeros(6, 16, 2, head_dim + 4, dtype=torch.int8, device=device) for _ in range(2)]
              for impl in ("ref", "triton")}
    args = (key.to(device) * 3, value.to(device) * 3)
    kv_int8.write_kv_int8_ref(*args, *caches["ref"], slots.to(device))
    kv_int8.write_kv_int8_triton(*args, *caches["triton"], slots.to(device))
    for part, (got, want) in zip(("k", "v"), zip(caches["triton"], caches["ref"], strict=True), strict=True):
        out.append(compare(f"int8_kv_write/{part}_values", got[..., :head_dim], want[..., :head_dim], EXACT))
        out.append(compare(f"int8_kv_write/{part}_scales", kv_int8.kv_scales(got), kv_int8.kv_scales(want), EXACT))
    return out


def _write_and_pack(device: torch.device, head_dim: int) -> list[dict]:
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        key, value, k_cache, v_cache, slots = (t.to(device) for t in make_write_kv_case(
            5, 16, 2, head_dim, dtype, seed=16))
        want = [k_cache.clone(), v_cache.clone()]
        write_kv_ref(key, value, *want, slots)
        write_kv_triton(key, value, k_cache, v_cache, slots)
        out.append(compare("write_kv/k", k_cache, want[0], EXACT, dtype=str(dtype)[6:]))
        out.append(compare("write_kv/v", v_cache, want[1], EXACT, dtype=str(dtype)[6:]))
        kv_cache = make_kv_cache(3, 9, 16, 2, head_dim, dtype, seed=4).to(device)
        ids = torch.tensor([8, 2, 5, 0], device=device)
        buffer = pack_kv_triton(kv_cache, ids)
        out.append(compare("pack_kv", buffer, pack_kv_ref(kv_cache, ids), EXACT, dtype=str(dtype)[6:]))
        targets = [torch.zeros_like(kv_cache), torch.zeros_like(kv_cache)]
        unpack_kv_triton(targets[0], buffer, [1, 3, 6, 7])
        unpack_kv_ref(targets[1], buffer, [1, 3, 6, 7])
        out.append(compare("unpack_kv", targets[0], targets[1], EXACT, dtype=str(dtype)[6:]))
    return out


def _matmuls(device: torch.device, extra: list[tuple[int, int, int]]) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    for n, k, m in MATMUL_INT8 + extra:
        w, x = draw(n, k, scale=0.05), draw(m, k)
        q, scales = qm.quantize_int8(w)
        tol = F32 if k <= 1536 else (1e-4, 1e-4)  # longer sums: float32 rounding grows with k
        out.append(compare("int8_matmul", int8_matmul_triton(x, q, scales), qm.int8_matmul_ref(x, q, scales),
                           tol, n=n, k=k, m=m))
    for n, k, m, group in MATMUL_INT4 + [(n, k, m, 128) for n, k, m in extra]:
        w, x = draw(n, k, scale=0.05), draw(m, k)
        packed, scales, zeros = qm.quantize_int4(w, group)
        tol = F32 if k <= 1536 else (1e-4, 1e-4)
        out.append(compare("int4_matmul", int4_matmul_triton(x, packed, scales, zeros, group),
                           qm.int4_matmul_ref(x, packed, scales, zeros, group), tol, n=n, k=k, m=m, group_size=group))
    return out


def _guarded(label: str, part: Callable[[], list[dict]]) -> list[dict]:
    """A part's checks, or one failed record with the error (a kernel that does not compile
    or faults here must not hide the other parts' figures)."""
    try:
        return part()
    except Exception as exc:  # recorded as a failed check
        return [{"name": label, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                 "max_abs_err": None, "atol": None, "rtol": None, "passed": False}]


def kernels_step(options: GpuCheckOptions, deadline: float) -> dict:
    """Every check; ``all_passed`` only when each ran and passed."""
    device = device_for(options)
    head_dim = options.profile.kernel_head_dim
    batches = dict(ATTENTION_BATCHES)
    if not options.dry_run:
        batches["long"] = LONG_BATCH
    parts: dict[str, Callable[[], list[dict]]] = {}
    for label, lens in batches.items():  # one part per batch: a fault in one keeps the others
        parts[f"paged_attention/{label}"] = partial(_attention, device, head_dim, {label: lens})
    parts["int8_kv"] = partial(_int8_kv, device, head_dim, batches)
    parts["write_kv_and_pack"] = partial(_write_and_pack, device, head_dim)
    parts["matmuls"] = partial(_matmuls, device, [] if options.dry_run else MATMUL_DEVICE)
    checks: list[dict] = []
    for label, part in parts.items():
        checks += _guarded(label, part)
    failed = [c["name"] for c in checks if not c["passed"]]
    return {"device": str(device), "num_checks": len(checks), "num_passed": len(checks) - len(failed),
            "all_passed": not failed, "failed": failed, "checks": checks}
