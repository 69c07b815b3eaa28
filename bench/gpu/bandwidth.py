"""The ``bandwidth`` step: what this machine's memory moves, and how much of it the Triton
paged-attention kernel reads.

* ``copy``: a large device-to-device ``copy_``; bytes read + written over the time: the
  practical ceiling (on an H200 about 4.3 TB/s of its 4.8 nominal). The throughput step's
  roofline is this figure.
* ``attention``: one decode step's attention of the 8B shape (32 query / 8 KV heads of
  128, bfloat16) over ``attention_seqs`` sequences of ``attention_context`` tokens in 16-token
  pages: K/V bytes read over the kernel's time, against ``torch`` SDPA on the same K/V kept
  dense (each backend that runs; the fastest is the baseline), and the two outputs' largest
  difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.gpu.device import device_for, free_memory, mean_seconds
from bench.gpu.options import GpuCheckOptions
from splitserve_kernels.paged_attention import paged_attention_triton

BLOCK_SIZE = 16


def copy_bandwidth(num_bytes: int, device: torch.device, iters: int) -> dict:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = mean_seconds(lambda: dst.copy_(src), device, iters)
    return {"bytes": num_bytes, "seconds": seconds, "gb_per_s": 2 * num_bytes / seconds / 1e9}


def _paged_inputs(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, device: torch.device):
    """Dense K/V [batch, kv_heads, context, head_dim] and the same in shuffled 16-token pages."""
    gen = torch.Generator(device=device).manual_seed(0)
    dense = [torch.randn(batch, kv_heads, context, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
             for _ in range(2)]
    pages_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * pages_per_seq
    order = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = order.view(batch, pages_per_seq).to(torch.int32)
    caches = []
    for d in dense:
        padded = F.pad(d, (0, 0, 0, pages_per_seq * BLOCK_SIZE - context))
        pages = padded.view(batch, kv_heads, pages_per_seq, BLOCK_SIZE, head_dim).permute(0, 2, 3, 1, 4)
        cache = torch.empty(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
        cache[block_tables.flatten().long()] = pages.reshape(num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        caches.append(cache)
    query = torch.randn(batch, heads, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return query, dense, (query, caches[0], caches[1], block_tables, seq_lens, starts)


def _sdpa_backends() -> dict[str, object]:
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def attention_bandwidth(options: GpuCheckOptions, device: torch.device, iters: int) -> dict:
    from torch.nn.attention import sdpa_kernel

    shape, p = options.profile.attention_shape, options.profile
    batch, context = p.attention_seqs, p.attention_context
    query, (k, v), args = _paged_inputs(batch, context, shape.num_attention_heads, shape.num_key_value_heads,
                                        shape.head_dim, device)
    scale = shape.head_dim**-0.5
    kv_bytes = 2 * k.numel() * k.element_size()
    seconds = mean_seconds(lambda: paged_attention_triton(*args, scale), device, iters)
    ours = paged_attention_triton(*args, scale)
    q4 = query.unsqueeze(2)  # [batch, heads, 1, head_dim]
    baselines: dict[str, dict] = {}
    for name, backend in _sdpa_backends().items():
        try:
            with sdpa_kernel(backend):
                fn = lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)  # noqa: E731
                t = mean_seconds(fn, device, iters)
                diff = float((fn().squeeze(2).float() - ours.float()).abs().max())
            baselines[name] = {"seconds": t, "gb_per_s": kv_bytes / t / 1e9, "max_abs_diff_vs_triton": diff}
        except RuntimeError as exc:  # this backend does not take these inputs here
            baselines[name] = {"skipped": str(exc).splitlines()[0][:200]}
    timed = {n: b for n, b in baselines.items() if "seconds" in b}
    best = min(timed, key=lambda n: timed[n]["seconds"]) if timed else None
    return {"num_seqs": batch, "context": context, "heads": shape.num_attention_heads,
            "kv_heads": shape.num_key_value_heads, "head_dim": shape.head_dim, "block_size": BLOCK_SIZE,
            "dtype": "bfloat16", "kv_bytes": kv_bytes, "triton": {"seconds": seconds, "gb_per_s": kv_bytes / seconds / 1e9},
            "sdpa": baselines, "sdpa_best": best,
            "triton_vs_sdpa_best": (timed[best]["seconds"] / seconds) if best else None}


def bandwidth_step(options: GpuCheckOptions, deadline: float) -> dict:
    device = device_for(options)
    iters = 3 if options.dry_run else 20
    copy = copy_bandwidth(options.profile.copy_bytes, device, iters)
    free_memory(device)
    attention = attention_bandwidth(options, device, iters)
    attention["triton_vs_copy"] = attention["triton"]["gb_per_s"] / copy["gb_per_s"]
    free_memory(device)
    return {"device": str(device), "copy": copy, "attention": attention}
