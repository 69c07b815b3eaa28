"""Causal attention for a ragged batch over paged KV (decode, prefill and chunked prefill):
the torch reference, which is the engine's CPU path, and the argument checks every
implementation shares (the Triton kernel is in ``paged_attention.py``).

Layout of one call (tokens grouped by sequence, in order)::

    query             [num_tokens, num_heads, head_dim]
    query_start_loc   [0, q_len_0, q_len_0 + q_len_1, ...]           (num_seqs + 1)
    seq_lens          context length per sequence, new tokens included (num_seqs)
    block_tables      page ids per sequence, padded with 0             (num_seqs, max_blocks)

    sequence s:  |<------------- seq_lens[s] ------------->|
                 |  cached prefix  |  new tokens (q_len)   |
    query token j of s sits at position seq_lens[s] - q_len + j and sees keys 0..position.

The K/V of the new tokens are in the cache before the call (see kv_write). GQA: query
head h reads kv head ``h // (num_heads // num_kv_heads)``. Output rows past
``query_start_loc[-1]`` are left unspecified by the Triton kernel.
"""

import torch
import torch.nn.functional as F


def check_paged_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not query.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"query/k_cache/v_cache dtypes differ: {query.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    num_seqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"seq_lens must be [num_seqs] and query_start_loc [num_seqs + 1], "
            f"got {tuple(seq_lens.shape)} and {tuple(query_start_loc.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks], "
            f"got {tuple(block_tables.shape)}"
        )
    for name, t in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


class _Workspace:
    """Grow-only scratch tensors reused across calls, one per (name, dtype, device).

    Gathering pages allocates tens of MB per layer; fresh allocations of that size are
    page-faulted in every time, which costs more than the copy itself. The gathered
    pages are dead once the call returns, so their storage is reused. One engine thread
    calls the reference at a time (the engine is single-threaded by design).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # A buffer made under inference_mode cannot be written outside it (and vice versa
        # it would cost a version-counter check), so each mode keeps its own.
        key = (name, dtype, device, torch.is_inference_mode_enabled())
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]


_WORKSPACE = _Workspace()


def _gather_pages(
    cache: torch.Tensor, pages: torch.Tensor, ctx_len: int, name: str
) -> torch.Tensor:
    """cache [num_blocks, block_size, kv_heads, D], pages [..., n] -> [..., kv_heads, ctx, D]."""
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    flat_pages = pages.reshape(-1).long()
    numel = flat_pages.numel() * block_size * num_kv_heads * head_dim
    out = _WORKSPACE.get(name, numel, cache.dtype, cache.device)
    gathered = out.view(flat_pages.numel(), block_size, num_kv_heads, head_dim)
    torch.index_select(cache, 0, flat_pages, out=gathered)
    flat = gathered.view(*pages.shape[:-1], pages.shape[-1] * block_size, num_kv_heads, head_dim)
    return flat[..., :ctx_len, :, :].transpose(-3, -2)


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, new tokens included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query's dtype
    """Torch reference and CPU path, built on ``F.scaled_dot_product_attention``.

    Decode sequences (q_len == 1) go through one batched SDPA call, their keys padded to
    the longest of them and masked; prefill sequences (q_len > 1) get one call each over
    exactly their context, with ``is_causal`` when there is no cached prefix. So a
    prefill sequence, and a lone decode sequence, get the very SDPA call transformers
    makes for them and match it bit for bit. With several decode sequences the padding,
    and the CPU SDPA kernel's work split (it depends on batch size and thread count),
    change float rounding only (~1e-7 in float32).
    """
    check_paged_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if starts[0] != 0 or starts[-1] != query.shape[0]:
        raise ValueError(
            f"query_start_loc must run from 0 to num_tokens={query.shape[0]}, got {starts}"
        )
    max_ctx = block_tables.shape[1] * block_size
    out = torch.empty_like(query)
    decode_seqs: list[int] = []
    for s, seq_len in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if not 0 <= q_len <= seq_len <= max_ctx:
            raise ValueError(
                f"sequence {s}: need 0 <= q_len ({q_len}) <= seq_len ({seq_len}) <= "
                f"max_blocks * block_size ({max_ctx})"
            )
        if q_len == 1:
            decode_seqs.append(s)
        elif q_len > 1:
            _prefill_one_ref(
                out, query, k_cache, v_cache, block_tables[s], starts[s], q_len, seq_len, scale
            )
    for group in _decode_groups(decode_seqs, lens) if decode_seqs else ():
        _decode_group_ref(out, query, k_cache, v_cache, block_tables, group, starts, lens, scale)
    return out


def _prefill_one_ref(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,  # [max_blocks_per_seq]
    start: int,
    q_len: int,
    seq_len: int,
    scale: float,
) -> None:
    num_pages = -(-seq_len // k_cache.shape[1])
    k = _gather_pages(k_cache, pages[:num_pages], seq_len, "k").unsqueeze(0)  # [1, kv_heads, seq_len, D]
    v = _gather_pages(v_cache, pages[:num_pages], seq_len, "v").unsqueeze(0)
    q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, D]
    enable_gqa = q.shape[1] != k.shape[1]
    if seq_len == q_len:  # no cached prefix: plain causal, as transformers calls it
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
    else:  # query j sits at position seq_len - q_len + j
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        key_pos = torch.arange(seq_len, device=query.device)
        mask = key_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
    out[start : start + q_len] = o[0].transpose(0, 1)


# Decode sequences are attended in groups of similar context length, each padded only to
# its own longest member: decode attention on CPU is bound by the bytes of K/V gathered
# and read, and padding everything to the batch's longest context nearly doubles them for
# a uniform length mix. A group holds at least this many sequences (fewer calls).
_MIN_DECODE_GROUP = 8
_MAX_DECODE_GROUPS = 4


def _decode_groups(decode_seqs: list[int], lens: list[int]) -> list[list[int]]:
    """Split decode sequences, sorted by context length, into up to 4 contiguous groups."""
    ordered = sorted(decode_seqs, key=lambda s: lens[s])
    num_groups = max(1, min(_MAX_DECODE_GROUPS, len(ordered) // _MIN_DECODE_GROUP))
    size = -(-len(ordered) // num_groups)
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def _decode_group_ref(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    decode_seqs: list[int],
    starts: list[int],
    lens: list[int],
    scale: float,
) -> None:
    device = query.device
    dec_lens = [lens[s] for s in decode_seqs]
    ctx_len = max(dec_lens)
    num_pages = -(-ctx_len // k_cache.shape[1])
    seq_idx = torch.tensor(decode_seqs, device=device)
    tok_idx = torch.tensor([starts[s] for s in decode_seqs], device=device)
    pages = block_tables[seq_idx, :num_pages]  # [n, num_pages]
    k = _gather_pages(k_cache, pages, ctx_len, "k")  # [n, kv_heads, ctx_len, D]
    v = _gather_pages(v_cache, pages, ctx_len, "v")
    q = query[tok_idx].unsqueeze(2)  # [n, heads, 1, D]
    mask = None
    if min(dec_lens) != ctx_len:
        lens_t = torch.tensor(dec_lens, device=device)[:, None, None, None]
        mask = torch.arange(ctx_len, device=device) < lens_t  # [n, 1, 1, ctx_len]
    enable_gqa = q.shape[1] != k.shape[1]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    out[tok_idx] = o.squeeze(2)
