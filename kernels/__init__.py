"""Triton kernels for paged KV, each beside the pure-torch reference that is the CPU path.

Call them through :mod:`kernels.ops`, which runs the Triton kernel for CUDA tensors (when
Triton is installed) and the reference otherwise:

* ``write_kv(key, value, k_cache, v_cache, slot_mapping)``: store new tokens' K/V in their
  slots (``block_id * block_size + offset``; ``-1`` skips a token). kernels/kv_write.py
* ``paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)``:
  causal attention for a ragged batch of decode, prefill and chunked-prefill sequences
  over paged KV, with GQA. kernels/paged_attention.py (Triton), kernels/paged_attention_ref.py
  (the reference and the argument checks both share)
* ``pack_kv(kv_cache, block_ids)`` / ``unpack_kv(kv_cache, buffer, block_ids)``: gather a
  sequence's pages of every layer into one contiguous buffer for a KV transfer, and
  scatter it into other block ids. kernels/kv_pack.py
* An int8 cache (``--kv-cache-dtype int8``) takes the same calls: ``write_kv`` quantizes,
  ``paged_attention`` dequantizes inside the call; rows are ``head_dim`` int8 values then
  their float32 scale. kernels/kv_int8.py (format, references, Triton write), the Triton
  attention's ``KV_INT8`` path in kernels/paged_attention.py

Weight-only quantized matmuls (called by engine/quant/linear.py, not through ``ops``):
kernels/quant_matmul.py (int8/int4 formats, quantizing, torch references, the CPU path on
torch's packed kernels) and kernels/quant_matmul_triton.py (the Triton dequant-matmuls).

Cache layout, shared by the engine: ``kv_cache`` is
``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``, contiguous; a
layer's ``kv_cache[layer, 0]`` / ``kv_cache[layer, 1]`` are the ``k_cache`` / ``v_cache``.

Tests (tests/kernels) check each kernel against its reference on CPU under
``TRITON_INTERPRET=1``, check the references against plain dense math, and compile every
kernel for sm_90 ahead of time. Importing this package imports neither torch nor Triton.
"""
