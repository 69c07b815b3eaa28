"""The engine's one view of a hand-off on the decode side (issue #23): a reserved sequence is a
``Request`` with status WAITING_FOR_REMOTE_KVS that owns its blocks; admission makes it
WAITING in the ``prefilled`` queue and the next step RUNNING; freeing it on any failure gives
every block back; the load counts its blocks as in transfer, and nothing else does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Engine
from engine.request import RequestStatus
from tests.engine.test_engine_disagg import GREEDY, PREFIX, assert_clean, drain, prefill
from tests.engine.test_engine_parity import make_engine
from tests.helpers.outputs import Completions

W = RequestStatus.WAITING_FOR_REMOTE_KVS


def _status(b: Engine, rid: str) -> RequestStatus | None:
    request = b.scheduler.requests.get(rid)
    return request.status if request is not None else None


def test_a_reserved_request_waits_for_remote_kvs_until_admission_runs_it(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    prompt = list(range(3, 40))  # 37 tokens: 3 blocks
    expected = make_engine(path).generate([prompt], GREEDY)[0].token_ids
    a, b = make_engine(path), make_engine(path, num_kv_blocks=16)
    transfer = prefill(a, {"r": prompt}, GREEDY)["r"]
    ids = b.handoff.reserve_kv("r", len(prompt), prompt)
    assert ids is not None and len(ids) == 3
    request = b.scheduler.requests["r"]
    assert request.status is W and request.prompt_token_ids == prompt and request.num_output_tokens == 0
    assert b.kv.block_ids("r") == ids and b.num_free_blocks == 13
    assert not (b.scheduler.waiting or b.scheduler.running or b.scheduler.prefilled)
    assert not b.has_unfinished_requests() and b.step() == []  # it waits on the transfer, not on a step
    load = b.load()
    assert (load.num_blocks_in_transfer, load.num_waiting, load.num_running) == (3, 0, 0)
    b.check_integrity()
    b.handoff.unpack_kv("r", transfer.packed)
    b.handoff.admit_prefilled("r", prompt, transfer.first_token_id, GREEDY)
    assert b.scheduler.requests["r"] is request  # the same request, one status
    assert request.status is RequestStatus.WAITING and list(b.scheduler.prefilled) == [request]
    assert request.num_computed_tokens == len(prompt) and request.output_token_ids == [transfer.first_token_id]
    assert b.load().num_blocks_in_transfer == 0
    b.check_integrity()
    done = Completions()
    done.expect("r", prompt, transfer.first_token_id)
    done.feed(b.step())
    assert request.status is RequestStatus.RUNNING and b.scheduler.running == [request]
    assert drain(b, done)["r"].token_ids == expected
    assert request.status is RequestStatus.FINISHED_LENGTH and "r" not in b.scheduler.requests
    assert_clean(a, b)


@pytest.mark.parametrize("end", ["free_reserved_kv", "abort"])
def test_freeing_a_waiting_request_gives_back_every_block(ckpt_dir: Callable[..., Path], end: str) -> None:
    """Expiry, a cancelled stream, a failed receive and a refused admission all free through
    ``free_reserved_kv`` (``abort`` from a stream's end): hits go back to the cache
    unreferenced, fresh blocks to the free queue, once."""
    path = ckpt_dir("llama")
    b = make_engine(path, num_kv_blocks=16)
    prompt = PREFIX[:64] + [5, 6]
    b.generate([prompt], GREEDY)  # 4 full blocks published
    ids = b.handoff.reserve_kv("r", len(prompt), prompt)
    assert ids is not None and len(ids) == 5 and b.handoff.reserved_num_cached_blocks("r") == 4
    b.handoff.unpack_kv("r", torch.ones(b.kv_layout.packed_shape(1)))  # a page landed, then it failed
    request = b.scheduler.requests["r"]
    assert b.load().num_blocks_in_transfer == 5 and b.num_free_blocks == 11
    assert b.handoff.free_reserved_kv("r") if end == "free_reserved_kv" else b.abort("r")
    assert request.status is RequestStatus.FINISHED_ABORTED and "r" not in b.scheduler.requests
    assert not b.handoff.free_reserved_kv("r") and not b.abort("r")  # once
    assert b.num_free_blocks == 16 and b.load().num_blocks_in_transfer == 0
    assert len(b.kv.pool.cached) == 4  # the hits stay published, unreferenced
    with pytest.raises(ValueError, match="request_id"):
        b.handoff.unpack_kv("r", torch.ones(b.kv_layout.packed_shape(1)))  # no page lands after the free
    assert_clean(b)


def test_a_refused_admission_leaves_the_request_waiting_and_its_blocks_reserved(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    a, b = make_engine(path), make_engine(path, num_kv_blocks=16)
    prompt = list(range(3, 40))
    transfer = prefill(a, {"r": prompt}, GREEDY)["r"]
    ids = b.handoff.reserve_kv("r", len(prompt), prompt)
    assert ids is not None
    b.handoff.unpack_kv("r", transfer.packed)
    with pytest.raises(ValueError, match="prompt_token_ids differ"):
        b.handoff.admit_prefilled("r", [4] + prompt[1:], transfer.first_token_id, GREEDY)  # not the reserved prompt
    assert _status(b, "r") is W and b.kv.block_ids("r") == ids and b.load().num_blocks_in_transfer == 3
    assert b.handoff.free_reserved_kv("r")
    assert_clean(a, b)


def test_two_waiting_requests_sharing_hits_count_each_block_once(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    b = make_engine(path, num_kv_blocks=16)
    b.generate([PREFIX[:64] + [5]], GREEDY)  # 4 full blocks published
    assert b.handoff.reserve_kv("x", 66, PREFIX[:64] + [7, 8]) is not None  # 4 hits + 1 fresh
    assert b.handoff.reserve_kv("y", 70, PREFIX[:64] + [9] * 6) is not None  # the same 4 hits + 1 fresh
    assert [_status(b, rid) for rid in ("x", "y")] == [W, W]
    assert b.load().num_blocks_in_transfer == 6 and b.num_free_blocks == 10
    b.check_integrity()
    assert b.handoff.free_reserved_kv("x") and b.load().num_blocks_in_transfer == 5
    assert b.handoff.free_reserved_kv("y") and b.load().num_blocks_in_transfer == 0
    assert_clean(b)
