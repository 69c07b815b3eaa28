"""A decode engine's reservation starts with the prefix-cache hits it already holds: only the
missing pages travel (packed from the prefill side's blocks after the hits, unpacked in
chunks), the output equals a single engine's, and every block is accounted for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Engine
from tests.engine.test_engine_disagg import GREEDY, PREFIX, assert_clean, drain, prefill
from tests.engine.test_engine_parity import make_engine
from tests.helpers.outputs import Completions


def admit_missing(b: Engine, rid: str, transfer, chunk_pages: int) -> tuple[list[int], int]:  # noqa: ANN001
    """Reserve with the prompt's ids, unpack only the pages after the hits (in chunks of
    ``chunk_pages``), admit. Returns (reserved ids, hit blocks)."""
    prompt = transfer.prompt_token_ids
    ids = b.handoff.reserve_kv(rid, len(prompt), prompt)
    assert ids is not None
    num_hits = b.handoff.reserved_num_cached_blocks(rid)
    missing = transfer.packed[:, :, num_hits:]
    for start in range(0, missing.shape[2], chunk_pages):
        b.handoff.unpack_kv(rid, missing[:, :, start:start + chunk_pages].contiguous(), first_page=start)
    b.check_integrity()
    b.handoff.admit_prefilled(rid, prompt, transfer.first_token_id, GREEDY)
    return ids, num_hits


def test_only_missing_pages_travel(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    first = PREFIX[:192] + [41, 42, 43]  # 12 full blocks: the shared prefix
    second = PREFIX[:192] + list(range(50, 90))  # 12 hits on B, then 2 full + 1 partial block
    expected = [o.token_ids for o in make_engine(path).generate([first, second], GREEDY)]
    a, b = make_engine(path), make_engine(path)
    done = Completions()
    shipped = prefill(a, {"f": first, "s": second}, GREEDY)
    _, hits_first = admit_missing(b, "f", shipped["f"], chunk_pages=5)
    done.expect("f", first, shipped["f"].first_token_id)
    assert hits_first == 0
    final = drain(b, done)
    ids, hits = admit_missing(b, "s", shipped["s"], chunk_pages=2)
    done.expect("s", second, shipped["s"].first_token_id)
    assert hits == 12 and len(ids) == 15
    assert b.stats.num_cached_prompt_tokens == 192
    assert b.stats.num_received_prompt_tokens == len(first) + len(second) - 192
    final.update(drain(b, done))
    assert final["f"].token_ids == expected[0] and final["s"].token_ids == expected[1]
    assert final["s"].num_cached_tokens == 192
    assert_clean(a, b)


def test_hits_are_never_written_and_freed_once(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    b = make_engine(path)
    prompt = PREFIX[:64] + [5, 6]
    b.generate([prompt], GREEDY)  # 4 full blocks published
    ids = b.handoff.reserve_kv("r", len(prompt), prompt)
    assert ids is not None and b.handoff.reserved_num_cached_blocks("r") == 4
    pages = b.kv_layout.packed_shape(1)
    with pytest.raises(ValueError, match="fresh blocks"):
        b.handoff.unpack_kv("r", torch.zeros(b.kv_layout.packed_shape(2)))  # only 1 fresh block
    with pytest.raises(ValueError, match="fresh blocks"):
        b.handoff.unpack_kv("r", torch.zeros(pages), first_page=1)
    before = b.handoff.pack_kv(ids[:4])
    b.handoff.unpack_kv("r", torch.ones(pages))
    assert torch.equal(b.handoff.pack_kv(ids[:4]), before)  # the hits are untouched
    b.check_integrity()
    assert b.handoff.free_reserved_kv("r") and not b.handoff.free_reserved_kv("r")
    b.check_integrity()
    assert b.num_free_blocks == b.kv.num_blocks  # the hits went back to the cache, unreferenced
    assert len(b.kv.pool.cached) == 4


def test_a_full_pool_counts_revived_hits(ckpt_dir: Callable[..., Path]) -> None:
    """Hits sitting unreferenced in the free queue are not free blocks once taken."""
    path = ckpt_dir("llama")
    b = make_engine(path, num_kv_blocks=8, max_model_len=120)
    prompt = PREFIX[:64] + [5]  # 5 blocks, 4 cacheable
    b.generate([prompt], GREEDY)
    assert b.handoff.reserve_kv("x", 64, PREFIX[:64]) is not None  # 3 hits (the last block is fresh) + 1
    assert b.handoff.reserved_num_cached_blocks("x") == 3
    assert b.handoff.reserve_kv("y", 80, [7] * 80) is None  # 5 fresh blocks: only 4 are free
    assert b.handoff.reserve_kv("z", 64, [7] * 64) is not None  # 4 fresh blocks (evicts the 4th cached one)
    b.check_integrity()
    assert b.handoff.free_reserved_kv("x") and b.handoff.free_reserved_kv("z")
    b.check_integrity()
