"""The Triton kernel for paged attention over a ragged batch; the layout of a call and the
torch reference it must equal are in ``paged_attention_ref.py``. Output rows past
``query_start_loc[-1]`` are left unspecified.
"""

import torch

from splitserve_kernels._triton_compat import require_triton, tl, triton
from splitserve_kernels.kv_int8 import check_int8_cache
from splitserve_kernels.paged_attention_ref import check_paged_attention_args

# ----------------------------------------------------------------------------------------
# Triton kernel: one program per (query tile, kv head).
#
# A query tile is BLOCK_Q consecutive tokens of one sequence times the GROUP_PAD query
# heads sharing the kv head, so its BLOCK_M = BLOCK_Q * GROUP_PAD rows reuse each K/V
# tile they load (a decode token fills GROUP_PAD rows on its own). Keys are visited
# BLOCK_N positions at a time; each position's page comes from the block table, so
# BLOCK_N need not equal the block size. Softmax is online, in float32.
#
# Tile numbering without a host sync: sequence s owns tiles starting at
#   tile_start(s) = query_start_loc[s] // BLOCK_Q + s,
# which is increasing in s and leaves each sequence at least cdiv(q_len, BLOCK_Q) tiles;
# num_tokens // BLOCK_Q + num_seqs tiles cover every sequence, the spare ones exit.
# ----------------------------------------------------------------------------------------


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q: tl.constexpr):
    # Largest s with tile_start(s) <= tile_id (binary search over the increasing starts).
    lo = tl.zeros((), dtype=tl.int32)
    hi = tl.zeros((), dtype=tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mid_start = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if mid_start <= tile_id:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # KV_INT8: the caches' storage seen as float32 (kv_int8.py)
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_seq,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_seq(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    tile_in_seq = tile_id - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    prefix_len = seq_len - q_len

    # Rows: (token in tile, head in group); padded tokens and heads are masked out.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_tok = tile_in_seq * BLOCK_Q + offs_m // GROUP_PAD  # token index within the sequence
    head_in_group = offs_m % GROUP_PAD
    q_head = kv_head * QUERIES_PER_KV + head_in_group
    row_mask = (q_tok < q_len) & (head_in_group < QUERIES_PER_KV)
    q_pos = prefix_len + q_tok  # [BLOCK_M] position in the sequence
    q_rows = (q_start + q_tok).to(tl.int64) * stride_q_tok + q_head * stride_q_head
    q = tl.load(query_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # running max (finite: no inf - inf)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Keys beyond the tile's last query position are never seen by it.
    kv_end = tl.minimum(seq_len, prefix_len + (tile_in_seq + 1) * BLOCK_Q)
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        page = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_offs = (
            page * stride_cache_block
            + (offs_n % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        k = tl.load(
            k_cache_ptr + kv_offs[None, :] + offs_d[:, None], mask=n_mask[None, :], other=0.0
        )
        k = k.to(tl.float32)
        if KV_INT8:  # each row's scale sits right after its head_dim int8 values
            k_scale = tl.load(k_scale_ptr + (kv_offs + HEAD_DIM) // 4, mask=n_mask, other=0.0)
            k = k * k_scale[None, :]
        s = tl.dot(q, k, input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N]
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0
        )
        v = v.to(tl.float32)
        if KV_INT8:
            v_scale = tl.load(v_scale_ptr + (kv_offs + HEAD_DIM) // 4, mask=n_mask, other=0.0)
            v = v * v_scale[:, None]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    acc = acc / l_i[:, None]
    o_rows = (q_start + q_tok).to(tl.int64) * stride_o_tok + q_head * stride_o_head
    tl.store(
        out_ptr + o_rows[:, None] + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows on GPU


def _check_kernel_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    """What the kernel's pointer arithmetic assumes beyond the shared argument checks."""
    head_dim = query.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if query.stride(2) != 1:
        raise ValueError("query must have a unit stride along head_dim")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if block_tables.stride(1) != 1 or not (seq_lens.is_contiguous() and query_start_loc.is_contiguous()):
        raise ValueError("block_tables rows, seq_lens and query_start_loc must be contiguous")


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64, new tokens included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32/int64
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query's dtype
    """Triton version of :func:`paged_attention_ref`; no host sync, no value checks."""
    require_triton()
    check_paged_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    _check_kernel_layout(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    return _launch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, kv_int8=False)


def paged_attention_int8_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim + 4] int8 (kv_int8.py)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64, new tokens included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32/int64
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query's dtype
    """Triton version of :func:`splitserve_kernels.kv_int8.paged_attention_int8_ref`: each K/V tile is
    dequantized in registers as it is loaded."""
    require_triton()
    head_dim = query.shape[2]
    check_int8_cache(head_dim, k_cache, v_cache)
    # The shared checks, on the shape and dtype the dequantized cache would have.
    values = torch.empty((*k_cache.shape[:3], head_dim), dtype=query.dtype, device="meta")
    check_paged_attention_args(query, values, values, block_tables, seq_lens, query_start_loc)
    _check_kernel_layout(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    return _launch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, kv_int8=True)


def _launch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, kv_int8: bool) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    queries_per_kv = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(queries_per_kv)
    block_m = max(MIN_BLOCK_M, group_pad)
    block_q = block_m // group_pad
    block_n = triton.next_power_of_2(max(16, block_size))  # may span several pages
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    k_scale = k_cache.view(torch.float32) if kv_int8 else k_cache
    v_scale = v_cache.view(torch.float32) if kv_int8 else v_cache
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
        float(scale), num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, KV_INT8=kv_int8,
    )
    return out
