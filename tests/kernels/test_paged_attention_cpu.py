"""The native CPU kernels (kernels/csrc) against their torch references.

The grid of the issue, sampled so the suite stays fast: every block boundary of contexts
1-4096 for one configuration (decode, and chunked prefill crossing the boundaries), with
and without the key range split over threads; the coarse product GQA 1, 2, 3, 4, 8 x
head_dim 32, 64, 128 x block 16, 32, 128 with one mixed decode / prefill / chunked batch
each; then dtypes, strides, head_dims off the fast path, and the errors.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from splitserve_kernels.kv_write import write_kv_ref
from splitserve_kernels.native import native_kernels, paged_attention_native, write_kv_native
from splitserve_kernels.paged_attention_ref import paged_attention_ref

REPO_ROOT = Path(__file__).resolve().parents[2]
needs_native = pytest.mark.skipif(
    not native_kernels().available, reason=f"native kernels not built: {native_kernels().reason}"
)
F32_TOL = dict(atol=2e-5, rtol=2e-5)


@contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """More threads than one make the kernel split long key ranges (flash-decoding)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def shared_page_batch(q_lens: list[int], seq_lens: list[int], *, block_size: int, group: int,
                      head_dim: int, seed: int) -> tuple:
    """Sequences that all read one shuffled run of pages (a cache of max(seq_lens) tokens)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = -(-max(seq_lens) // block_size)
    k_cache = torch.randn(num_pages + 2, block_size, 1, head_dim, generator=gen)
    v_cache = torch.randn(num_pages + 2, block_size, 1, head_dim, generator=gen)
    pages = torch.randperm(num_pages + 2, generator=gen)[:num_pages].int()
    block_tables = pages.expand(len(seq_lens), -1).contiguous()
    query = torch.randn(sum(q_lens), group, head_dim, generator=gen)
    starts = list(itertools.accumulate(q_lens, initial=0))
    i32 = torch.int32
    return (query, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=i32),
            torch.tensor(starts, dtype=i32))


def boundary_contexts(block_size: int, max_len: int) -> list[int]:
    """1, 2 and every block boundary's neighbours: b * block_size - 1, + 0, + 1."""
    edges = {1, 2, max_len}
    for b in range(1, max_len // block_size + 1):
        edges.update({b * block_size - 1, b * block_size, b * block_size + 1})
    return sorted(n for n in edges if 1 <= n <= max_len)


# With one thread every tile is one work item; with 4 threads and 4 sequences per call each
# tile's share exceeds a quarter of a thread's, so once a call is big enough to run on
# several threads (contexts from ~2700 keys here, attention_plan.h) its tiles are split
# into key ranges that the combine pass merges.
SPLIT_CASES = [(1, 64), (4, 4)]  # (threads, sequences per call)


# (block_size, GQA group, head_dim): every block size of the grid, each with its own
# boundaries (~770, ~390 and ~100 contexts).
BOUNDARY_CASES = [(16, 3, 64), (32, 1, 128), (128, 8, 32)]


@needs_native
@pytest.mark.parametrize("threads,per_call", SPLIT_CASES)
@pytest.mark.parametrize("block_size,group,head_dim", BOUNDARY_CASES)
def test_decode_at_every_block_boundary_to_4096(threads, per_call, block_size, group,
                                                head_dim) -> None:
    contexts = boundary_contexts(block_size, 4096)
    with intra_op_threads(threads):
        for i in range(0, len(contexts), per_call):
            lens = contexts[i : i + per_call]
            args = shared_page_batch([1] * len(lens), lens, block_size=block_size, group=group,
                                     head_dim=head_dim, seed=i)
            torch.testing.assert_close(paged_attention_native(*args, 0.125),
                                       paged_attention_ref(*args, 0.125), **F32_TOL)


@needs_native
@pytest.mark.parametrize("threads,per_call", SPLIT_CASES)
def test_chunked_prefill_across_block_boundaries(threads, per_call) -> None:
    # Chunks of 1-40 tokens ending on, just before and just after block boundaries, to 4096.
    rng = random.Random(threads)
    seq_lens = [n for n in boundary_contexts(32, 4096) if n % 7 == 0 or n > 4000][:64]
    q_lens = [min(n, rng.choice([1, 2, 15, 16, 17, 40])) for n in seq_lens]
    with intra_op_threads(threads):
        for i in range(0, len(seq_lens), per_call):
            args = shared_page_batch(q_lens[i : i + per_call], seq_lens[i : i + per_call],
                                     block_size=32, group=2, head_dim=32, seed=i)
            torch.testing.assert_close(paged_attention_native(*args, 0.2),
                                       paged_attention_ref(*args, 0.2), **F32_TOL)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_items_over_every_kv_head(paged_batch, threads, head_dim) -> None:
    # Decode tiles run as one work item over all four KV heads (attention_plan.h: whole_decode),
    # beside ones whose 3000 and 8000 keys exceed a thread's share at 2 threads and are split
    # per head (at 1 thread every tile is one item: its scores for all 12 rows in scratch).
    seq_lens = [1, 15, 16, 17, 200, 3000, 8000]
    batch = paged_batch([1] * len(seq_lens), seq_lens, block_size=16, num_kv_heads=4, queries_per_kv=3,
                        head_dim=head_dim, seed=head_dim)
    query, k_cache, v_cache, *meta = batch.args
    scale = head_dim**-0.5
    with intra_op_threads(threads):
        got = paged_attention_native(query, k_cache, v_cache, *meta, scale)
        torch.testing.assert_close(got, paged_attention_ref(*batch.args, scale), **F32_TOL)
        # ... and the same bits from a head-major cache (the native CPU layout, kv_cache.py)
        k_hm, v_hm = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache))
        assert torch.equal(paged_attention_native(query, k_hm, v_hm, *meta, scale), got)


def mixed_lens(rng: random.Random, block_size: int) -> tuple[list[int], list[int]]:
    """Decodes, whole prefills, chunks with a cached prefix and an idle sequence."""
    seq_lens = [1, block_size, block_size + 1, rng.randint(2, 300), rng.randint(2, 300),
                rng.randint(300, 1500), rng.randint(2, 200), 3 * block_size - 1]
    q_lens = [1, block_size, 1, 1, seq_lens[4], 1, rng.randint(1, seq_lens[6]), 0]
    return q_lens, seq_lens


GRID = list(itertools.product([1, 2, 3, 4, 8], [32, 64, 128], [16, 32, 128]))


@needs_native
@pytest.mark.parametrize("group,head_dim,block_size", GRID)
def test_grid_mixed_batch(paged_batch, group, head_dim, block_size) -> None:
    rng = random.Random(hash((group, head_dim, block_size)))
    q_lens, seq_lens = mixed_lens(rng, block_size)
    batch = paged_batch(q_lens, seq_lens, block_size=block_size, num_kv_heads=2,
                        queries_per_kv=group, head_dim=head_dim, seed=group + head_dim)
    scale = head_dim**-0.5
    with intra_op_threads(2):
        torch.testing.assert_close(paged_attention_native(*batch.args, scale),
                                   paged_attention_ref(*batch.args, scale), **F32_TOL)


@needs_native
@pytest.mark.parametrize("head_dim,block_size", [(96, 64), (80, 8), (24, 16), (64, 8)])
def test_other_head_dims_and_block_sizes(paged_batch, head_dim, block_size) -> None:
    # 96 has its own fast path; 80 and 24 run the generic one; block size 8 is below a chunk
    # (with head_dim 64, the two-pass decode's part-chunk scores).
    q_lens, seq_lens = mixed_lens(random.Random(head_dim), block_size)
    batch = paged_batch(q_lens, seq_lens, block_size=block_size, num_kv_heads=3,
                        queries_per_kv=3, head_dim=head_dim)
    torch.testing.assert_close(paged_attention_native(*batch.args, 0.1),
                               paged_attention_ref(*batch.args, 0.1), **F32_TOL)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(paged_batch, dtype) -> None:
    # The kernel computes in float32: compare with the reference on the same values in float32.
    batch = paged_batch([1, 9, 1, 4], [40, 9, 17, 36], block_size=16, num_kv_heads=2,
                        queries_per_kv=3, head_dim=64, dtype=dtype)
    out = paged_attention_native(*batch.args, 0.125)
    assert out.dtype == dtype
    ref = paged_attention_ref(*(t.float() if t.is_floating_point() else t for t in batch.args), 0.125)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


@needs_native
def test_strided_cache_query_and_int64_metadata(paged_batch) -> None:
    # A head-major cache ([blocks, kv_heads, block_size, D] seen as the standard layout), a
    # query sliced out of a wider tensor and int64 metadata.
    batch = paged_batch([1, 7, 1], [20, 30, 5], block_size=16, num_kv_heads=2,
                        queries_per_kv=2, head_dim=32)
    q, kc, vc, bt, sl, qsl = batch.args
    k_head_major = kc.transpose(1, 2).contiguous().transpose(1, 2)
    v_head_major = vc.transpose(1, 2).contiguous().transpose(1, 2)
    wide = torch.cat([q, torch.randn_like(q)], dim=1)[:, : q.shape[1]]
    out = paged_attention_native(wide, k_head_major, v_head_major, bt.long(), sl.long(),
                                 qsl.long(), 0.3)
    torch.testing.assert_close(out, paged_attention_ref(*batch.args, 0.3), **F32_TOL)


@needs_native
def test_empty_batch_and_idle_sequences(paged_batch) -> None:
    batch = paged_batch([0, 1, 0], [4, 3, 9], block_size=8, num_kv_heads=1, queries_per_kv=2,
                        head_dim=32)
    torch.testing.assert_close(paged_attention_native(*batch.args, 1.0),
                               paged_attention_ref(*batch.args, 1.0), **F32_TOL)
    q, kc, vc, bt, sl, qsl = batch.args
    assert paged_attention_native(q[:0], kc, vc, bt[:0], sl[:0], qsl[:1], 1.0).shape == (0, 2, 32)


@needs_native
def test_bad_arguments_raise_value_error(paged_batch) -> None:
    batch = paged_batch([2, 1], [2, 9], block_size=8, num_kv_heads=2, queries_per_kv=1, head_dim=16)
    q, kc, vc, bt, sl, qsl = batch.args
    every_other = torch.zeros(*kc.shape[:3], 2 * kc.shape[3])[..., ::2]  # stride 2 on head_dim
    cases = [
        ("multiple of num_kv_heads", (q[:, :1].expand(-1, 3, -1), kc, vc, bt, sl, qsl)),
        ("query_start_loc", (q, kc, vc, bt, sl, qsl[:2])),
        ("num_tokens", (q, kc, vc, bt, sl, torch.tensor([0, 1, 2], dtype=torch.int32))),
        ("q_len", (q, kc, vc, bt, torch.tensor([1, 9], dtype=torch.int32), qsl)),
        ("max_blocks", (q, kc, vc, bt, torch.tensor([2, 99], dtype=torch.int32), qsl)),
        ("dtypes differ", (q.double(), kc, vc, bt, sl, qsl)),
        ("int32 or int64", (q, kc, vc, bt.float(), sl, qsl)),
        ("block id", (q, kc, vc, torch.full_like(bt, kc.shape[0]), sl, qsl)),
        ("unit stride", (q, every_other, every_other, bt, sl, qsl)),
    ]
    for message, args in cases:
        with pytest.raises(ValueError, match=message):
            paged_attention_native(*args, 1.0)


# --- write_kv ---------------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_matches_reference(slot_dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 40, 3, 64, generator=gen).unbind(0)
    slots = torch.randperm(5 * 16, generator=gen)[:40].to(slot_dtype)
    slots[[0, 7]] = -1  # not stored
    caches = [torch.randn(5, 16, 3, 64, generator=gen) for _ in range(2)]
    want = [c.clone() for c in caches]
    write_kv_ref(key, value, *want, slots)
    write_kv_native(key, value, *caches, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


@needs_native
def test_write_kv_into_strided_cache_and_errors() -> None:
    key = torch.randn(3, 2, 32)
    cache = torch.zeros(4, 2, 8, 32).transpose(1, 2)  # head-major storage, standard view
    other = torch.zeros(4, 8, 2, 32)
    write_kv_native(key, -key, cache, other, torch.tensor([0, 9, 31]))
    assert torch.equal(cache.reshape(-1, 2, 32)[[0, 9, 31]], key)
    assert torch.equal(other.view(-1, 2, 32)[[0, 9, 31]], -key)
    with pytest.raises(ValueError, match="past the cache"):
        write_kv_native(key, key, other.clone(), other.clone(), torch.tensor([0, 1, 32]))
    with pytest.raises(ValueError, match="share a dtype"):
        write_kv_native(key.double(), key, other, other, torch.tensor([0, 1, 2]))


# --- torch.library: the operators trace (fake tensors, schema, torch.compile's checks) ----


@needs_native
def test_operators_pass_torch_library_opcheck(paged_batch) -> None:
    batch = paged_batch([1, 5], [9, 5], block_size=8, num_kv_heads=2, queries_per_kv=2, head_dim=16)
    torch.library.opcheck(torch.ops.splitserve.paged_attention, (*batch.args, 0.25))
    key = torch.randn(6, 2, 16)
    torch.library.opcheck(torch.ops.splitserve.write_kv,
                          (key, key, batch.k_cache.clone(), batch.v_cache.clone(), torch.arange(6)))


# --- other CPU capabilities and the fallback ---------------------------------------------


AVX2_CHECK = """
import torch
from splitserve_kernels.native import native_kernels, paged_attention_native
from splitserve_kernels.paged_attention_ref import paged_attention_ref
assert torch.backends.cpu.get_cpu_capability() == "AVX2"
assert native_kernels().variant == "avx2", native_kernels()
g = torch.Generator().manual_seed(0)
kc, vc = torch.randn(2, 20, 16, 2, 64, generator=g).unbind(0)
q = torch.randn(12, 6, 64, generator=g)
bt = torch.randperm(20, generator=g)[:18].view(3, 6).int()
i32 = torch.int32
args = (q, kc, vc, bt, torch.tensor([90, 7, 40], dtype=i32), torch.tensor([0, 1, 8, 12], dtype=i32))
torch.testing.assert_close(paged_attention_native(*args, 0.125), paged_attention_ref(*args, 0.125),
                           atol=2e-5, rtol=2e-5)
print("ok")
"""


@needs_native
def test_avx2_library_on_an_avx2_capability() -> None:
    # ATen's capability override makes this process choose the AVX2 build, as an AVX2-only
    # CPU would.
    if native_kernels().variant != "avx512":
        pytest.skip("only an AVX-512 machine has both libraries to choose from")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("SPLITSERVE_CPU_ISA", None)  # the library is chosen from the capability alone here
    result = subprocess.run([sys.executable, "-c", AVX2_CHECK], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# -- batch_invariant (EngineConfig.batch_invariant: attention_plan.h, one_token_items) ------


def _rows(args: tuple, seqs: list[int]) -> tuple:
    """The sub-batch of ``args`` (a decode batch: one query row per sequence) with these sequences."""
    query, k_cache, v_cache, block_tables, seq_lens, _ = args
    pick = torch.tensor(seqs)
    return (query[pick], k_cache, v_cache, block_tables[pick], seq_lens[pick],
            torch.arange(len(seqs) + 1, dtype=torch.int32))


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_batch_invariant_decode_row_alone_and_in_a_busy_call(threads) -> None:
    # 6000 keys beside 24 sequences of 300: at 2 threads the call is big enough to split the
    # long tile's keys over items by default, alone it is not; with batch_invariant never.
    lens = [6000] + [300] * 24
    args = shared_page_batch([1] * len(lens), lens, block_size=16, group=3, head_dim=64, seed=7)
    with intra_op_threads(threads):
        busy = paged_attention_native(*args, 0.125, batch_invariant=True)
        alone = paged_attention_native(*_rows(args, [0]), 0.125, batch_invariant=True)
        torch.testing.assert_close(busy, paged_attention_ref(*args, 0.125), **F32_TOL)
    assert torch.equal(alone[0], busy[0])


@needs_native
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 1), (80, 2)])
def test_batch_invariant_prompt_rows_are_decode_rows(head_dim, group) -> None:
    # A chunk of 40 prompt tokens after 260 cached ones, in one call, gives each row the bits
    # that row gets as a decode row (its own call, the keys up to it): what makes a prefill of
    # prompt + sent tokens (a migration, a resumed stream, a preempted request) continue a
    # stream bit for bit.
    args = shared_page_batch([40], [300], block_size=16, group=group, head_dim=head_dim, seed=head_dim)
    query, k_cache, v_cache, block_tables, _, _ = args
    scale = head_dim**-0.5
    with intra_op_threads(2):
        chunk = paged_attention_native(*args, scale, batch_invariant=True)
        torch.testing.assert_close(chunk, paged_attention_ref(*args, scale), **F32_TOL)
        for t in range(40):
            one = paged_attention_native(query[t : t + 1], k_cache, v_cache, block_tables,
                                         torch.tensor([261 + t], dtype=torch.int32),
                                         torch.tensor([0, 1], dtype=torch.int32), scale, batch_invariant=True)
            assert torch.equal(one[0], chunk[t]), t


@needs_native
def test_batch_invariant_needs_the_native_kernel_and_float32_queries() -> None:
    from splitserve_kernels import ops

    args = shared_page_batch([1], [20], block_size=16, group=2, head_dim=32, seed=0)
    with pytest.raises(ValueError, match="batch_invariant needs the native kernel and float32 queries"):
        ops.paged_attention(args[0].bfloat16(), *args[1:], 0.2, batch_invariant=True)
