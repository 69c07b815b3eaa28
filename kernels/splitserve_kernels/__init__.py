"""Kernels for paged KV: Triton kernels (CUDA), native C++ kernels (CPU), torch references.

Call them through :mod:`splitserve_kernels.ops`. On CUDA (Triton installed) the Triton kernels run; on
the CPU the native kernels (kernels/csrc, a torch C++ extension built at install) run, and
where that library was not built or does not load, one warning is logged and the torch
references serve. The references are also the tests' oracle.

* ``write_kv(key, value, k_cache, v_cache, slot_mapping)``: store new tokens' K/V in their
  slots (``block_id * block_size + offset``; ``-1`` skips a token). kv_write.py,
  kernels/csrc/write_kv.cpp
* ``paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)``:
  causal attention for a ragged batch of decode, prefill and chunked-prefill sequences
  over paged KV, with GQA. paged_attention.py (Triton), paged_attention_ref.py
  (the reference and the argument checks both share); on CPU kernels/csrc/paged_attention.cpp
  reads K/V in place through the block table (no gather), vectorised with ATen's
  ``at::vec::Vectorized`` and built once per CPU capability (AVX-512, AVX2; default, which
  is NEON on Arm), in parallel over (query tile x KV head) items with long key ranges split
  over threads and merged (flash-decoding).
* ``rms_norm``, ``add_rms_norm_``, ``rotary_``, ``silu_mul``: a decoder layer's elementwise
  parts, each one pass on CPU. elementwise.py, kernels/csrc/elementwise.cpp
* ``pack_kv(kv_cache, block_ids)`` / ``unpack_kv(kv_cache, buffer, block_ids)``: gather a
  sequence's pages of every layer into one contiguous buffer for a KV transfer, and
  scatter it into other block ids. kv_pack.py
* An int8 cache (``--kv-cache-dtype int8``) takes the same calls: ``write_kv`` quantizes,
  ``paged_attention`` dequantizes inside the call; rows are ``head_dim`` int8 values then
  their float32 scale. kv_int8.py (format, references, Triton write), the Triton
  attention's ``KV_INT8`` path in paged_attention.py

Weight-only quantized matmuls (called by engine/quant/linear.py, not through ``ops``):
quant_matmul.py (int8/int4 formats, quantizing, torch references, the CPU path on
torch's packed kernels) and quant_matmul_triton.py (the Triton dequant-matmuls).

The native operators are registered with ``torch.library`` (``torch.ops.splitserve.*``,
with fake implementations) so they trace under ``torch.compile``; native.py loads
them. kernels/csrc/threads.cpp pins the intra-op threads (used by the engine).

Cache layout (kv_cache.py): ``kv_cache`` is
``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``; a layer's
``kv_cache[layer, 0]`` / ``kv_cache[layer, 1]`` are the ``k_cache`` / ``v_cache``. On CUDA
(and on CPU without the native library) it is contiguous; on CPU with the native kernels it
is a view of head-major storage (``[..., num_kv_heads, block_size, head_dim]`` per block),
and every op reads it through its strides. What
travels between workers is always ``pack_kv``'s contiguous buffer in the logical order.

Tests (tests/kernels) check each Triton kernel against its reference on CPU under
``TRITON_INTERPRET=1`` and compile it for sm_90 ahead of time, check the native kernels
against the references (a sampled grid of GQA ratios, head dims, block sizes, contexts to
4096 and mixed batches; the AVX2 build too), and the references against dense math.
Importing this package imports neither torch nor Triton.
"""
