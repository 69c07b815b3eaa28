"""The int8 KV cache: its row format, the quantizing write (reference and Triton) and
attention over it (reference and Triton, interpreted) against attention over the
dequantized cache."""

import pytest
import torch

from splitserve_kernels import kv_int8, ops
from splitserve_kernels.paged_attention import paged_attention_int8_triton
from splitserve_kernels.paged_attention_ref import paged_attention_ref


def _rows(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_row_format_round_trip() -> None:
    x = _rows((5, 3, 16))
    x[2, 1] = 0.0  # an all-zero row: scale 0, values 0
    rows = kv_int8.quantize_kv(x)
    assert rows.shape == (5, 3, 20) and rows.dtype == torch.int8
    scales = kv_int8.kv_scales(rows)
    torch.testing.assert_close(scales, x.abs().amax(-1) / 127, rtol=0, atol=0)
    assert float(scales[2, 1]) == 0.0 and int(rows[2, 1, :16].abs().sum()) == 0
    err = (kv_int8.dequantize_kv(rows, torch.float32) - x).abs()
    assert bool((err <= scales[..., None] / 2 + 1e-6).all())
    assert int(rows[..., :16].abs().max()) == 127  # each row's largest value maps to +-127


def _non_finite_rows() -> torch.Tensor:
    x = _rows((4, 2, 16), 5)
    x[0, 1, 3], x[1, 0, 0], x[2, 1, 15] = float("nan"), float("inf"), float("-inf")
    return x


def _check_non_finite_stored(rows: torch.Tensor, x: torch.Tensor) -> None:
    # A row with a NaN or an infinity is zeros under a NaN scale: it reads back NaN, all of
    # it, never as numbers; the finite rows are stored as ever.
    bad = ~torch.isfinite(x).all(-1)
    assert int(bad.sum()) == 3
    assert bool(kv_int8.kv_scales(rows)[bad].isnan().all()) and int(rows[bad][:, :16].abs().sum()) == 0
    assert bool(kv_int8.dequantize_kv(rows, torch.float32)[bad].isnan().all())
    assert torch.equal(rows[~bad], kv_int8.quantize_kv(x[~bad]))


def test_a_row_that_is_not_finite_reads_back_as_nan() -> None:
    x = _non_finite_rows()
    _check_non_finite_stored(kv_int8.quantize_kv(x), x)
    k_cache, v_cache = (_int8_cache(2, 8, 2, 16, False) for _ in range(2))
    slots = torch.arange(4)
    ops.write_kv(x, x, k_cache, v_cache, slots)  # the native write where it serves
    _check_non_finite_stored(k_cache[0, :4], x)
    kv_int8.write_kv_int8_triton(x, x, k_cache, v_cache, slots + 8)
    _check_non_finite_stored(k_cache[1, :4], x)


def test_head_dim_must_be_a_multiple_of_4() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        kv_int8.row_width(18)


def _int8_cache(num_blocks: int, block_size: int, heads: int, head_dim: int, head_major: bool) -> torch.Tensor:
    if head_major:  # storage [blocks, heads, block_size, row], seen token-major (the CPU layout of #12)
        return torch.zeros(num_blocks, heads, block_size, head_dim + 4, dtype=torch.int8).transpose(1, 2)
    return torch.zeros(num_blocks, block_size, heads, head_dim + 4, dtype=torch.int8)


@pytest.mark.parametrize("head_major", [False, True])
def test_write_stores_quantized_rows_at_their_slots(head_major: bool) -> None:
    key, value = _rows((4, 2, 16), 1), _rows((4, 2, 16), 2)
    k_cache, v_cache = (_int8_cache(6, 8, 2, 16, head_major) for _ in range(2))
    slots = torch.tensor([17, 3, -1, 40])
    ops.write_kv(key, value, k_cache, v_cache, slots)
    for tok, slot in ((0, 17), (1, 3), (3, 40)):
        assert torch.equal(k_cache[slot // 8, slot % 8], kv_int8.quantize_kv(key[tok]))
        assert torch.equal(v_cache[slot // 8, slot % 8], kv_int8.quantize_kv(value[tok]))
    assert int(k_cache.abs().sum(-1).count_nonzero()) == 3 * 2  # nothing else written


def test_triton_write_matches_reference() -> None:
    key, value = _rows((5, 2, 16), 3), _rows((5, 2, 16), 4)
    slots = torch.tensor([0, 9, -1, 31, 12])
    want = [_int8_cache(4, 8, 2, 16, False) for _ in range(2)]
    got = [_int8_cache(4, 8, 2, 16, False) for _ in range(2)]
    kv_int8.write_kv_int8_ref(key, value, *want, slots)
    kv_int8.write_kv_int8_triton(key, value, *got, slots)
    for g, w in zip(got, want):
        assert torch.equal(g[..., :16], w[..., :16])
        torch.testing.assert_close(kv_int8.kv_scales(g), kv_int8.kv_scales(w), rtol=0, atol=0)


def _quantized(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's caches in int8, and those int8 caches dequantized (the reference's input)."""
    k8, v8 = kv_int8.quantize_kv(batch.k_cache), kv_int8.quantize_kv(batch.v_cache)
    return k8, v8, kv_int8.dequantize_kv(k8, torch.float32), kv_int8.dequantize_kv(v8, torch.float32)


BATCHES = {
    "decode": ([1, 1, 1], [9, 33, 16]),
    "prefill": ([7, 16], [7, 16]),
    "mixed_chunked": ([1, 5, 1, 12], [20, 37, 3, 30]),
}


@pytest.mark.parametrize("name", sorted(BATCHES))
@pytest.mark.parametrize("queries_per_kv", [1, 3])
def test_reference_equals_attention_over_the_dequantized_cache(paged_batch, name: str, queries_per_kv: int) -> None:
    q_lens, seq_lens = BATCHES[name]
    batch = paged_batch(q_lens, seq_lens, block_size=8, num_kv_heads=2, queries_per_kv=queries_per_kv, head_dim=16)
    k8, v8, k_deq, v_deq = _quantized(batch)
    meta = (batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.25)
    got = ops.paged_attention(batch.query, k8, v8, *meta)
    torch.testing.assert_close(got, paged_attention_ref(batch.query, k_deq, v_deq, *meta), rtol=1e-5, atol=1e-5)
    # ... and int8 KV stays near attention over the unquantized cache.
    exact = paged_attention_ref(batch.query, batch.k_cache, batch.v_cache, *meta)
    assert float((got - exact).abs().max()) < 0.05


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` [blocks, block_size, heads, row] copied into head-major storage (the CPU layout,
    kv_cache.py), seen in the same order."""
    return torch.empty_like(cache.transpose(1, 2).contiguous()).transpose(1, 2).copy_(cache)


@pytest.mark.parametrize("name", sorted(BATCHES))
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the decode path compiled for its head_dim
def test_either_cache_layout_gives_the_same_bits(paged_batch, name: str, head_dim: int) -> None:
    q_lens, seq_lens = BATCHES[name]
    batch = paged_batch(q_lens, seq_lens, block_size=16, num_kv_heads=3, queries_per_kv=3, head_dim=head_dim)
    k8, v8, k_deq, v_deq = _quantized(batch)
    meta = (batch.block_tables, batch.seq_lens, batch.query_start_loc, head_dim**-0.5)
    token_major = ops.paged_attention(batch.query, k8, v8, *meta)
    k_hm, v_hm = _head_major(k8), _head_major(v8)
    assert not k_hm.is_contiguous() and torch.equal(k_hm, k8)
    assert torch.equal(ops.paged_attention(batch.query, k_hm, v_hm, *meta), token_major)
    want = paged_attention_ref(batch.query, k_deq, v_deq, *meta)
    torch.testing.assert_close(token_major, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(BATCHES))
@pytest.mark.parametrize(("block_size", "queries_per_kv"), [(8, 1), (16, 4)])
def test_triton_matches_the_dequantized_reference(paged_batch, name: str, block_size: int, queries_per_kv: int) -> None:
    q_lens, seq_lens = BATCHES[name]
    batch = paged_batch(q_lens, seq_lens, block_size=block_size, num_kv_heads=2,
                        queries_per_kv=queries_per_kv, head_dim=16)
    k8, v8, k_deq, v_deq = _quantized(batch)
    meta = (batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.25)
    got = paged_attention_int8_triton(batch.query, k8, v8, *meta)
    torch.testing.assert_close(got, paged_attention_ref(batch.query, k_deq, v_deq, *meta), rtol=1e-5, atol=1e-5)


def test_bad_int8_caches_raise_value_error(paged_batch) -> None:
    batch = paged_batch([1], [5], block_size=8, num_kv_heads=2, queries_per_kv=1, head_dim=16)
    k8, v8, _, _ = _quantized(batch)
    meta = (batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.25)
    with pytest.raises(ValueError, match="head_dim \\+ 4"):
        ops.paged_attention(batch.query, k8[..., :16].contiguous(), v8[..., :16].contiguous(), *meta)
    with pytest.raises(ValueError, match="head_dim \\+ 4"):
        paged_attention_int8_triton(batch.query[..., :8].contiguous(), k8, v8, *meta)
