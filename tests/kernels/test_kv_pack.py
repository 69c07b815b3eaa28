"""pack_kv / unpack_kv: reference and Triton kernel (interpreted), exact copies."""

import pytest
import torch

from splitserve_kernels import kv_pack
from splitserve_kernels.kv_pack import pack_kv_ref, pack_kv_triton, unpack_kv_ref, unpack_kv_triton
from splitserve_kernels.testing import make_kv_cache

PACK = {"ref": pack_kv_ref, "triton": pack_kv_triton}
UNPACK = {"ref": unpack_kv_ref, "triton": unpack_kv_triton}


@pytest.mark.parametrize("impl", sorted(PACK))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_gathers_pages_in_order(impl, block_size, dtype) -> None:
    kv_cache = make_kv_cache(2, 7, block_size, 2, 16, dtype, seed=block_size)
    block_ids = torch.tensor([5, 0, 3], dtype=torch.int32)
    buffer = PACK[impl](kv_cache, block_ids)
    assert (
        buffer.shape == (2, 2, 3, block_size, 2, 16)
        and buffer.dtype == dtype
        and buffer.is_contiguous()
    )
    for i, block_id in enumerate(block_ids.tolist()):
        assert torch.equal(buffer[:, :, i], kv_cache[:, :, block_id])


@pytest.mark.parametrize("impl", sorted(PACK))
def test_pack_then_unpack_into_other_blocks(impl) -> None:
    # A transfer: pack blocks [4, 1, 6] of the sender, unpack into [2, 7, 0] of the receiver.
    sender = make_kv_cache(3, 8, 16, 2, 16, seed=1)
    receiver = make_kv_cache(3, 8, 16, 2, 16, seed=2)
    receiver_before = receiver.clone()
    src_ids, dst_ids = [4, 1, 6], [2, 7, 0]
    buffer = PACK[impl](sender, torch.tensor(src_ids))
    UNPACK[impl](receiver, buffer, torch.tensor(dst_ids))
    for src, dst in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(receiver[:, :, dst], sender[:, :, src])
    untouched = [b for b in range(8) if b not in dst_ids]
    assert torch.equal(receiver[:, :, untouched], receiver_before[:, :, untouched])


@pytest.mark.parametrize("impl", sorted(PACK))
def test_pages_larger_than_one_program(impl) -> None:
    # 16 * 3 * 48 = 2304 elements a page: two programs per page, the second masked.
    page_numel = 16 * 3 * 48
    assert page_numel > kv_pack.MAX_COPY_BLOCK and page_numel % kv_pack.MAX_COPY_BLOCK
    kv_cache = make_kv_cache(2, 5, 16, 3, 48, seed=3)
    buffer = PACK[impl](kv_cache, [3, 1])
    assert torch.equal(buffer, kv_cache[:, :, [3, 1]])
    target = torch.zeros_like(kv_cache)
    UNPACK[impl](target, buffer, [0, 4])
    assert torch.equal(target[:, :, 0], kv_cache[:, :, 3]) and torch.equal(
        target[:, :, 4], kv_cache[:, :, 1]
    )
    assert not target[:, :, 1:4].any()


def test_triton_matches_reference_bitwise() -> None:
    kv_cache = make_kv_cache(2, 9, 8, 4, 32, torch.bfloat16, seed=4)
    ids = [8, 2, 5, 0]
    buffer = pack_kv_triton(kv_cache, ids)
    assert torch.equal(buffer, pack_kv_ref(kv_cache, ids))
    a, b = torch.zeros_like(kv_cache), torch.zeros_like(kv_cache)
    unpack_kv_ref(a, buffer, [1, 3, 6, 7])
    unpack_kv_triton(b, buffer, [1, 3, 6, 7])
    assert torch.equal(a, b)


@pytest.mark.parametrize("impl", sorted(PACK))
def test_no_blocks(impl) -> None:
    kv_cache = make_kv_cache(1, 3, 8, 1, 16)
    before = kv_cache.clone()
    buffer = PACK[impl](kv_cache, [])
    assert buffer.shape == (1, 2, 0, 8, 1, 16)
    UNPACK[impl](kv_cache, buffer, [])
    assert torch.equal(kv_cache, before)


@pytest.mark.parametrize("impl", sorted(PACK))
def test_bad_arguments(impl) -> None:
    kv_cache = make_kv_cache(1, 3, 8, 1, 16)
    with pytest.raises(ValueError, match="kv_cache"):
        PACK[impl](kv_cache[:, 0], [0])
    with pytest.raises(ValueError, match="block_ids"):
        PACK[impl](kv_cache, torch.tensor([[0]]))
    buffer = PACK["ref"](kv_cache, [0, 1])
    with pytest.raises(ValueError, match="buffer"):
        UNPACK[impl](kv_cache, buffer, [2])
    with pytest.raises(ValueError, match="buffer"):
        UNPACK[impl](kv_cache, buffer.bfloat16(), [0, 2])


@pytest.mark.parametrize("impl", sorted(PACK))
def test_pack_into_a_reused_buffer(impl) -> None:
    kv_cache = make_kv_cache(2, 9, 16, 2, 16, seed=4)
    out = torch.full((2, 2, 3, 16, 2, 16), 7.0)
    for ids in ([8, 2, 5], [0, 1, 4]):  # the same staging buffer, twice
        assert PACK[impl](kv_cache, ids, out) is out
        assert torch.equal(out, kv_cache[:, :, ids])
    with pytest.raises(ValueError, match="buffer must be"):
        PACK[impl](kv_cache, [1, 2], out)  # 2 pages into a 3-page buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])  # int8: rows of 32 values and a 4-byte scale
def test_cpu_head_major_cache_travels_in_the_standard_layout(dtype: torch.dtype) -> None:
    # The CPU cache is a head-major view (kernels/splitserve_kernels/kv_cache.py); what pack produces and unpack
    # takes is the contiguous standard layout, so a CPU worker and a CUDA worker (or two CPU
    # workers) exchange the same bytes.
    from splitserve_kernels.kv_cache import new_kv_cache

    row = 32 if dtype == torch.float32 else 36
    standard = make_kv_cache(2, 6, 16, 3, row, seed=4)
    if dtype == torch.int8:
        standard = (standard * 40).clamp(-127, 127).to(torch.int8)
    head_major = new_kv_cache(2, 6, 16, 3, row, dtype, torch.device("cpu"))
    assert head_major.shape == standard.shape and not head_major.is_contiguous()
    row_bytes = row * head_major.element_size()
    assert head_major[0, 0, 0, :, 0].data_ptr() + 16 * row_bytes == head_major[0, 0, 0, :, 1].data_ptr()
    head_major.copy_(standard)
    buffer = pack_kv_ref(head_major, [5, 2])
    assert buffer.is_contiguous() and torch.equal(buffer, pack_kv_ref(standard, [5, 2]))
    receiver = new_kv_cache(2, 6, 16, 3, row, dtype, torch.device("cpu"))
    unpack_kv_ref(receiver, buffer, [0, 4])
    assert torch.equal(receiver[:, :, [0, 4]], standard[:, :, [5, 2]])
    assert int(receiver[:, :, [1, 2, 3, 5]].abs().sum()) == 0


def test_the_cpu_cache_is_zeroed_and_asks_for_huge_pages() -> None:
    from pathlib import Path

    from splitserve_kernels.kv_cache import advise_huge_pages, new_kv_cache

    cache = new_kv_cache(2, 300, 16, 3, 64, torch.float32, torch.device("cpu"))  # ~29 MB
    assert int(cache.abs().sum()) == 0
    assert not advise_huge_pages(torch.empty(1000))  # under 2 MiB: nothing to advise
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.is_file() and "[never]" not in thp.read_text():
        assert advise_huge_pages(torch.empty(3 << 20))  # Linux took the advice
