"""write_kv: reference and Triton kernel (interpreted) against a plain per-token loop."""

import pytest
import torch

from splitserve_kernels.kv_write import write_kv_ref, write_kv_triton
from splitserve_kernels.testing import make_write_kv_case as make_case

IMPLS = {"ref": write_kv_ref, "triton": write_kv_triton}


def expected_caches(key, value, k_cache, v_cache, slots):
    k_want, v_want = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_want[slot // block_size, slot % block_size] = key[t]
            v_want[slot // block_size, slot % block_size] = value[t]
    return k_want, v_want


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (2, 32), (3, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_per_token_loop(impl, block_size, num_kv_heads, head_dim, dtype) -> None:
    key, value, k_cache, v_cache, slots = make_case(
        5, block_size, num_kv_heads, head_dim, dtype, seed=block_size
    )
    k_want, v_want = expected_caches(key, value, k_cache, v_cache, slots)
    IMPLS[impl](key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_write_kv_all_skipped_leaves_cache_untouched(impl) -> None:
    key, value, k_cache, v_cache, slots = make_case(3, 8, 2, 16, torch.float32, seed=1)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    IMPLS[impl](key, value, k_cache, v_cache, torch.full_like(slots, -1))
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_write_kv_strided_key_value_and_int32_slots(impl) -> None:
    # key and value as views into a fused [num_tokens, 2 * kv_heads, D] projection.
    key, value, k_cache, v_cache, slots = make_case(4, 16, 2, 16, torch.float32, seed=2)
    fused = torch.cat([key, value], dim=1)
    k_view, v_view = fused[:, :2], fused[:, 2:]
    assert not k_view.is_contiguous()
    k_want, v_want = expected_caches(key, value, k_cache, v_cache, slots)
    IMPLS[impl](k_view, v_view, k_cache, v_cache, slots.int())
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_write_kv_into_layer_views_of_the_engine_cache(impl) -> None:
    # The engine passes kv_cache[layer, 0] / kv_cache[layer, 1]; other layers stay intact.
    kv_cache = torch.randn(3, 2, 4, 8, 2, 16)
    before = kv_cache.clone()
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([0, 9, -1, 31, 17])
    IMPLS[impl](key, value, kv_cache[1, 0], kv_cache[1, 1], slots)
    k_want, v_want = expected_caches(key, value, before[1, 0], before[1, 1], slots)
    assert torch.equal(kv_cache[1, 0], k_want) and torch.equal(kv_cache[1, 1], v_want)
    assert torch.equal(kv_cache[0], before[0]) and torch.equal(kv_cache[2], before[2])


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_write_kv_no_tokens(impl) -> None:
    k_cache, v_cache = torch.zeros(2, 8, 1, 16), torch.zeros(2, 8, 1, 16)
    IMPLS[impl](
        torch.zeros(0, 1, 16),
        torch.zeros(0, 1, 16),
        k_cache,
        v_cache,
        torch.zeros(0, dtype=torch.int64),
    )
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_write_kv_bad_arguments(impl) -> None:
    k_cache, v_cache = torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)
    key = torch.zeros(3, 2, 16)
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_kv_heads"):
        IMPLS[impl](torch.zeros(3, 1, 16), torch.zeros(3, 1, 16), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="dtype"):
        IMPLS[impl](key.bfloat16(), key.bfloat16(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        IMPLS[impl](key, key, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        IMPLS[impl](key, key, k_cache, v_cache, slots.float())
