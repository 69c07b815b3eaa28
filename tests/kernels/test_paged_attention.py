"""paged_attention: the torch reference against plain dense attention, the Triton kernel
(interpreted, on CPU) against the reference, and the reference against the exact SDPA
calls transformers makes."""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from splitserve_kernels import paged_attention as pa
from splitserve_kernels.paged_attention import paged_attention_triton
from splitserve_kernels.paged_attention_ref import paged_attention_ref

F32_TOL = dict(atol=1e-5, rtol=1e-5)


def dense_causal_attention(batch, scale: float) -> torch.Tensor:
    """Per sequence, per head, in float64: softmax(q k^T * scale + causal mask) v."""
    outs = []
    num_heads = batch.query.shape[1]
    for s, q_len in enumerate(batch.q_lens):
        start = int(batch.query_start_loc[s])
        seq_len = int(batch.seq_lens[s])
        q = batch.query[start : start + q_len].double()  # [q_len, H, D]
        k = batch.dense_k[s].double()  # [seq_len, KH, D]
        v = batch.dense_v[s].double()
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs).to(batch.query.dtype)


# (q_lens, seq_lens): decode only, prefill only, chunked prefill, and mixes; lengths 1,
# exact multiples of 8/16/32, one past and one short of a multiple.
BATCHES = {
    "decode": ([1, 1, 1, 1, 1], [1, 16, 33, 32, 7]),
    "prefill": ([1, 16, 5, 32], [1, 16, 5, 32]),
    "chunked": ([7, 16, 3], [23, 48, 40]),
    "mixed": ([1, 9, 1, 4, 17, 1], [31, 9, 64, 36, 17, 8]),
    "idle_seq": ([2, 0, 1], [2, 5, 3]),  # a sequence with no new tokens this step
}


def random_batch_lens(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    q_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 6)):
        kind = rng.choice(["decode", "prefill", "chunked"])
        seq_len = rng.choice([1, 8, 16, 32, rng.randint(1, 70)])
        q_len = {"decode": 1, "prefill": seq_len, "chunked": rng.randint(1, seq_len)}[kind]
        q_lens.append(q_len)
        seq_lens.append(seq_len)
    return q_lens, seq_lens


def test_kernel_is_interpreted() -> None:
    # Guards the conftest: without the interpreter these tests would not run the kernels.
    assert type(pa._paged_attention_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("name", sorted(BATCHES))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("queries_per_kv", [1, 4])
def test_reference_matches_dense_attention(paged_batch, name, block_size, queries_per_kv) -> None:
    q_lens, seq_lens = BATCHES[name]
    batch = paged_batch(
        q_lens,
        seq_lens,
        block_size=block_size,
        num_kv_heads=2,
        queries_per_kv=queries_per_kv,
        head_dim=32,
    )
    scale = 1 / math.sqrt(32)
    out = paged_attention_ref(*batch.args, scale)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    torch.testing.assert_close(out, dense_causal_attention(batch, scale), **F32_TOL)


@pytest.mark.parametrize("name", sorted(BATCHES))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("queries_per_kv", [1, 2, 4])
def test_triton_matches_reference_f32(paged_batch, name, block_size, queries_per_kv) -> None:
    q_lens, seq_lens = BATCHES[name]
    batch = paged_batch(
        q_lens,
        seq_lens,
        block_size=block_size,
        num_kv_heads=2,
        queries_per_kv=queries_per_kv,
        head_dim=16,
    )
    scale = 0.25
    out = paged_attention_triton(*batch.args, scale)
    assert out.shape == batch.query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, paged_attention_ref(*batch.args, scale), **F32_TOL)


@pytest.mark.parametrize("seed", range(6))
def test_triton_matches_reference_random_batches(paged_batch, seed) -> None:
    rng = random.Random(1000 + seed)
    q_lens, seq_lens = random_batch_lens(seed)
    batch = paged_batch(
        q_lens,
        seq_lens,
        block_size=rng.choice([8, 16, 32]),
        num_kv_heads=rng.choice([1, 2]),
        queries_per_kv=rng.choice([1, 2, 4]),
        head_dim=rng.choice([16, 32]),
        seed=seed,
    )
    scale = rng.uniform(0.05, 0.5)
    expected = dense_causal_attention(batch, scale)
    torch.testing.assert_close(paged_attention_ref(*batch.args, scale), expected, **F32_TOL)
    torch.testing.assert_close(paged_attention_triton(*batch.args, scale), expected, **F32_TOL)


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("queries_per_kv", [1, 4])
def test_triton_bf16(paged_batch, block_size, queries_per_kv) -> None:
    # The kernel upcasts bf16 to float32, so it must agree with float32 attention of the
    # same (bf16-valued) inputs to within the final cast to bf16: one bf16 ulp (<= 2**-7
    # relative), as the interpreter truncates float32 -> bf16 where a GPU rounds to nearest.
    q_lens, seq_lens = BATCHES["mixed"]
    batch = paged_batch(
        q_lens,
        seq_lens,
        block_size=block_size,
        num_kv_heads=2,
        queries_per_kv=queries_per_kv,
        head_dim=16,
        dtype=torch.bfloat16,
    )
    out = paged_attention_triton(*batch.args, 0.25)
    assert out.dtype == torch.bfloat16
    f32_args = [t.float() if t.is_floating_point() else t for t in batch.args]
    expected = paged_attention_ref(*f32_args, 0.25)
    torch.testing.assert_close(out.float(), expected, atol=1e-6, rtol=2**-7)
    # The bf16 reference (SDPA in bf16) rounds intermediates; it stays within a few ulps.
    torch.testing.assert_close(paged_attention_ref(*batch.args, 0.25), out, atol=2e-2, rtol=2e-2)


def test_triton_many_sequences_and_larger_head_dim(paged_batch) -> None:
    # 40 decode sequences exercise the tile -> sequence binary search; head_dim 64.
    seq_lens = [(7 * s) % 19 + 1 for s in range(40)]
    batch = paged_batch(
        [1] * 40, seq_lens, block_size=8, num_kv_heads=1, queries_per_kv=2, head_dim=64
    )
    torch.testing.assert_close(
        paged_attention_triton(*batch.args, 0.125),
        paged_attention_ref(*batch.args, 0.125),
        **F32_TOL,
    )


def test_triton_strided_query_and_int64_metadata(paged_batch) -> None:
    # query as a slice of a fused qkv projection; metadata as int64.
    batch = paged_batch(
        [1, 6], [12, 20], block_size=16, num_kv_heads=2, queries_per_kv=2, head_dim=16
    )
    qkv = torch.randn(batch.query.shape[0], 8, 16)
    qkv[:, :4] = batch.query
    query = qkv[:, :4]
    assert not query.is_contiguous()
    args = (
        query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables.long(),
        batch.seq_lens.long(),
        batch.query_start_loc.long(),
    )
    expected = paged_attention_ref(*batch.args, 0.3)
    torch.testing.assert_close(paged_attention_triton(*args, 0.3), expected, **F32_TOL)
    torch.testing.assert_close(paged_attention_ref(*args, 0.3), expected, atol=0, rtol=0)


def test_empty_batch(paged_batch) -> None:
    batch = paged_batch([1], [3], block_size=8, num_kv_heads=1, queries_per_kv=1, head_dim=16)
    args = (
        batch.query[:0],
        batch.k_cache,
        batch.v_cache,
        batch.block_tables[:0],
        batch.seq_lens[:0],
        batch.query_start_loc[:1],
    )
    assert paged_attention_ref(*args, 1.0).shape == (0, 1, 16)
    assert paged_attention_triton(*args, 1.0).shape == (0, 1, 16)


# --- the reference computes exactly what transformers' SDPA attention computes ----------


def test_reference_prefill_is_bitwise_transformers_sdpa(paged_batch) -> None:
    # transformers (no padding, no cache): SDPA(q, k, v, is_causal=True, enable_gqa=True)
    # on [1, heads, len, D] tensors.
    batch = paged_batch([37], [37], block_size=16, num_kv_heads=2, queries_per_kv=4, head_dim=32)
    q = batch.query.transpose(0, 1).unsqueeze(0)
    k = batch.dense_k[0].transpose(0, 1).unsqueeze(0).contiguous()
    v = batch.dense_v[0].transpose(0, 1).unsqueeze(0).contiguous()
    hf = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=32**-0.5, enable_gqa=True)
    out = paged_attention_ref(*batch.args, 32**-0.5)
    assert torch.equal(out, hf[0].transpose(0, 1))


def test_reference_lone_decode_is_bitwise_transformers_sdpa(paged_batch) -> None:
    # One decode sequence (here beside a prefill) gets transformers' decode call:
    # SDPA(q [1, H, 1, D], k [1, KH, len, D]) without mask. The prefill is bitwise too.
    batch = paged_batch(
        [1, 12], [45, 12], block_size=8, num_kv_heads=2, queries_per_kv=2, head_dim=32
    )
    out = paged_attention_ref(*batch.args, 32**-0.5)
    for s, (start, end) in enumerate([(0, 1), (1, 13)]):
        q = batch.query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        k = batch.dense_k[s].transpose(0, 1).unsqueeze(0).contiguous()  # [1, KH, len, D]
        v = batch.dense_v[s].transpose(0, 1).unsqueeze(0).contiguous()
        hf = F.scaled_dot_product_attention(
            q, k, v, is_causal=end - start > 1, scale=32**-0.5, enable_gqa=True
        )
        assert torch.equal(out[start:end], hf[0].transpose(0, 1))


def test_reference_decode_batch_close_to_unpadded_calls(paged_batch) -> None:
    # Several decode sequences share one padded, masked call: rounding-level differences only.
    batch = paged_batch(
        [1, 1, 1], [45, 3, 17], block_size=8, num_kv_heads=2, queries_per_kv=2, head_dim=32
    )
    out = paged_attention_ref(*batch.args, 32**-0.5)
    for s in range(3):
        q = batch.query[s : s + 1].unsqueeze(2)
        k = batch.dense_k[s].transpose(0, 1).unsqueeze(0).contiguous()
        v = batch.dense_v[s].transpose(0, 1).unsqueeze(0).contiguous()
        hf = F.scaled_dot_product_attention(q, k, v, scale=32**-0.5, enable_gqa=True)
        torch.testing.assert_close(out[s], hf[0, :, 0], atol=1e-6, rtol=0)


# --- argument checks -------------------------------------------------------------------


def test_bad_arguments_raise_value_error(paged_batch) -> None:
    batch = paged_batch([2, 1], [2, 9], block_size=8, num_kv_heads=2, queries_per_kv=1, head_dim=16)
    q, kc, vc, bt, sl, qsl = batch.args
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_ref(q[:, :1].expand(-1, 3, -1), kc, vc, bt, sl, qsl, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_ref(q, kc, vc, bt, sl, qsl[:2], 1.0)
    with pytest.raises(ValueError, match="num_tokens"):
        paged_attention_ref(q, kc, vc, bt, sl, torch.tensor([0, 1, 2], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="q_len"):
        paged_attention_ref(q, kc, vc, bt, torch.tensor([1, 9], dtype=torch.int32), qsl, 1.0)
    with pytest.raises(ValueError, match="dtypes"):
        paged_attention_triton(q.double(), kc, vc, bt, sl, qsl, 1.0)
    odd = torch.zeros(q.shape[0], 2, 24)
    odd_cache = torch.zeros(*kc.shape[:3], 24)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention_triton(odd, odd_cache, odd_cache, bt, sl, qsl, 1.0)
