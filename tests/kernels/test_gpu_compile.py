"""Compile every kernel for an H100/H200 (sm_90) without a GPU.

The interpreter is lenient where the GPU compiler is not (tl.dot shapes, loop-carried
types, early returns), so each kernel is also compiled ahead of time to a cubin, in a
subprocess without TRITON_INTERPRET. Argument types follow the naming convention: a
``*_ptr`` is a pointer, UPPER_CASE is a constexpr, ``scale`` is float32, the rest int32.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

COMPILE_SCRIPT = r"""
import shutil, sys, warnings
warnings.simplefilter("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

if "nvidia" not in triton.backends.backends:
    print("SKIP: triton has no nvidia backend"); sys.exit(0)

from splitserve_kernels.kv_int8 import _write_kv_int8_kernel
from splitserve_kernels.kv_pack import _copy_pages_kernel
from splitserve_kernels.kv_write import _write_kv_kernel
from splitserve_kernels.paged_attention import _paged_attention_kernel
from splitserve_kernels.quant_matmul_triton import _int4_matmul_kernel, _int8_matmul_kernel

INDEX_PTRS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
              "slot_mapping_ptr": "*i64", "block_ids_ptr": "*i64"}

def compile_for_sm90(kernel, dtype, constexprs, ptr_types=None):
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = (ptr_types or {}).get(name) or INDEX_PTRS.get(name, "*" + dtype)
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], kernel.__name__

# (dtype, QUERIES_PER_KV, GROUP_PAD, BLOCK_Q, BLOCK_N, BLOCK_SIZE, HEAD_DIM); BLOCK_M is 16.
attention = [
    ("fp32", 1, 1, 16, 16, 16, 64),
    ("bf16", 4, 4, 4, 16, 8, 128),
    ("bf16", 6, 8, 2, 32, 32, 128),
]
for dtype, per_kv, group_pad, block_q, block_n, block_size, head_dim in attention:
    constexprs = dict(QUERIES_PER_KV=per_kv, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=16,
                      BLOCK_N=block_n, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, KV_INT8=False)
    compile_for_sm90(_paged_attention_kernel, dtype, constexprs)
    # num_seqs == 1 arrives as a constexpr when Triton specializes on the value 1.
    compile_for_sm90(_paged_attention_kernel, dtype, dict(constexprs, num_seqs=1))
    # The int8 KV cache: int8 pages, their scales read through a float32 view.
    int8_kv = {"k_cache_ptr": "*i8", "v_cache_ptr": "*i8", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    compile_for_sm90(_paged_attention_kernel, dtype, dict(constexprs, KV_INT8=True), int8_kv)
for dtype in ("fp32", "bf16"):
    write = dict(NUM_KV_HEADS=3, HEAD_DIM=128, BLOCK_H=4, BLOCK_D=128)
    compile_for_sm90(_write_kv_kernel, dtype, write)
    for gather in (True, False):
        copy = dict(PAGE_NUMEL=4096, BLOCK=2048, GATHER=gather)
        compile_for_sm90(_copy_pages_kernel, dtype, copy)
    compile_for_sm90(_write_kv_int8_kernel, dtype, dict(NUM_KV_HEADS=3, HEAD_DIM=128, BLOCK_H=4),
                     {"cache_ptr": "*i8", "cache_f32_ptr": "*fp32"})
    tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32)
    compile_for_sm90(_int8_matmul_kernel, dtype, tiles, {"w_ptr": "*i8", "scales_ptr": "*fp32"})
    compile_for_sm90(_int4_matmul_kernel, dtype, dict(tiles, GROUP_SIZE=32),
                     {"packed_ptr": "*u8", "scales_ptr": "*fp32", "zeros_ptr": "*fp32"})
print("ok")
"""


def test_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    if result.stdout.startswith("SKIP"):
        pytest.skip(result.stdout.strip())
    assert result.stdout.strip() == "ok"
