"""Disaggregated serving through two in-process engines, no transport: a prefill engine (A)
holds, packs and releases a prompt's KV pages; a decode engine (B) reserves blocks, unpacks
the pages and admits the sequence. Outputs equal a single engine's (greedy, speculative,
seeded), and every block is accounted for at every hand-off."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from engine import CompletionOutput, Engine, EngineConfig, SamplingParams
from engine.kv_layout import KVLayout
from engine.request import RequestStatus
from engine.spec_decode.config import SpeculativeConfig
from tests.conftest import mixed_prompts
from tests.engine.test_default_model_engine import MODELS, heldout_prompts
from tests.engine.test_engine_parity import make_engine
from tests.engine.test_spec_decode import repetitive_prompts
from tests.helpers.outputs import Completions

BS = 16
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def num_blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BS)


@dataclass
class Transfer:
    """What the prefill worker ships for one request."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    packed: torch.Tensor
    first_logprob: float | None = None
    first_top_logprobs: dict[int, float] | None = None


def ship(a: Engine, out: CompletionOutput) -> Transfer:
    """Prefill worker, once its request finished: pack the held prompt pages, release them."""
    ids = a.handoff.held_block_ids(out.request_id)
    assert len(ids) == num_blocks_for(len(out.prompt_token_ids))
    packed = a.handoff.pack_kv(ids)
    assert packed.shape == a.kv_layout.packed_shape(len(ids)) and packed.is_contiguous()
    assert a.handoff.release_kv(out.request_id)
    assert not a.handoff.release_kv(out.request_id)
    return Transfer(
        out.request_id,
        out.prompt_token_ids,
        out.token_ids[0],
        packed,
        out.logprobs[0] if out.logprobs else None,
        out.top_logprobs[0] if out.top_logprobs else None,
    )


def prefill(a: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, Transfer]:
    """Run prompts on the prefill engine to their first token; ship each."""
    done = Completions()
    for rid, prompt in prompts.items():
        a.add_request(prompt, params.for_prefill(), rid, hold_kv=True)
        done.expect(rid, prompt)
    transfers = {}
    while a.has_unfinished_requests():
        for out in done.feed(a.step()):
            transfers[out.request_id] = ship(a, out)
    return transfers


def admit(b: Engine, t: Transfer, params: SamplingParams, done: Completions | None = None) -> list[int]:
    """Decode worker: reserve, receive the pages, admit. Returns the reserved block ids."""
    ids = try_admit(b, t, params, done)
    assert ids is not None
    return ids


def try_admit(b: Engine, t: Transfer, params: SamplingParams, done: Completions | None = None,
              num_prior_draws: int = 0) -> list[int] | None:
    """``admit``, or None (and no change) when B cannot reserve the blocks now. ``done``
    then expects the request's outputs, starting with its first token."""
    ids = b.handoff.reserve_kv(t.request_id, len(t.prompt_token_ids), t.prompt_token_ids)
    if ids is None:
        return None
    assert len(ids) == t.packed.shape[2]
    k = b.handoff.reserved_num_cached_blocks(t.request_id)  # B's own prefix-cache hits: no pages
    b.handoff.unpack_kv(t.request_id, t.packed[:, :, k:].contiguous())
    assert torch.equal(b.handoff.pack_kv(ids[k:]), t.packed[:, :, k:])  # the pages landed intact in other block ids
    b.handoff.admit_prefilled(t.request_id, t.prompt_token_ids, t.first_token_id, params,
                      first_logprob=t.first_logprob, first_top_logprobs=t.first_top_logprobs,
                      num_prior_draws=num_prior_draws)
    if done is not None:
        done.expect(t.request_id, t.prompt_token_ids, t.first_token_id, t.first_logprob, t.first_top_logprobs)
    return ids


def run_split(
    a: Engine,
    b: Engine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    local_every: int = 0,
    num_prior_draws: int = 0,
) -> list[CompletionOutput]:
    """Serve prompts across A -> B with both engines stepping in turn. A prefills every
    prompt except each ``local_every``-th (all queued at once); B admits one shipped request
    per step (staggered) and adds a local prompt with ``add_request`` every other step.
    Checks streaming: B's ``new_token_ids`` of a shipped request add up to its tokens after
    the first. Returns B's final outputs in prompt order. ``num_prior_draws``: every prompt
    continues a migrated request (its last tokens were generated earlier)."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    rids = [f"r{i}" for i in range(len(prompts))]
    is_local = [local_every > 0 and i % local_every == local_every - 1 for i in range(len(prompts))]
    by_id = dict(zip(rids, params_list))
    on_a, on_b = Completions(), Completions()
    for i, rid in enumerate(rids):
        if not is_local[i]:
            a.add_request(prompts[i], params_list[i].for_prefill(), rid, hold_kv=True,
                          num_prior_draws=num_prior_draws)
            on_a.expect(rid, prompts[i])
    ready: list[Transfer] = []
    local = [i for i in range(len(prompts)) if is_local[i]]
    streamed: dict[str, list[int]] = {rid: [] for rid in rids}
    final: dict[str, CompletionOutput] = {}
    step = 0
    while len(final) < len(prompts):
        ready += [ship(a, out) for out in on_a.feed(a.step())]
        if ready and try_admit(b, ready[0], by_id[ready[0].request_id], on_b, num_prior_draws) is not None:
            ready.pop(0)  # else B's pool is full now: retry next step
        if local and step % 2 == 0:
            i = local.pop(0)
            b.add_request(prompts[i], params_list[i], rids[i], num_prior_draws=num_prior_draws)
            on_b.expect(rids[i], prompts[i])
        outs = b.step()
        for out in outs:
            streamed[out.request_id] += out.new_token_ids
        final.update({out.request_id: out for out in on_b.feed(outs)})
        step += 1
        assert step < 5000, "the split run does not terminate"
    for rid, local_request in zip(rids, is_local):
        token_ids = final[rid].token_ids
        assert streamed[rid] == (token_ids if local_request else token_ids[1:])
    return [final[rid] for rid in rids]


def drain(engine: Engine, done: Completions | None = None) -> dict[str, CompletionOutput]:
    """Step until nothing is left; each finished request's whole output (admitted ones
    start with their first token when ``done`` was given to ``admit``)."""
    done = done or Completions()
    final: dict[str, CompletionOutput] = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            return final
        final.update({o.request_id: o for o in done.feed(engine.step())})
    raise AssertionError("the engine does not drain")


def assert_clean(*engines: Engine) -> None:
    for engine in engines:
        engine.check_integrity()
        assert engine.num_free_blocks == engine.kv.num_blocks
        assert not engine.kv.held and not engine.kv.req_to_blocks and not engine.scheduler.requests


# -- parity ------------------------------------------------------------------------------
def test_split_greedy_matches_single_engine(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    prompts = mixed_prompts(24, 512, seed=41) + [list(range(3, 3 + 48)), [7]]  # 1, 16, 32, 48, 300, ...
    expected = [o.token_ids for o in make_engine(path).generate(prompts, GREEDY)]
    a = make_engine(path, max_num_batched_tokens=256)
    b = make_engine(path, max_num_batched_tokens=48)  # local prompts are prefilled in chunks
    outs = run_split(a, b, prompts, GREEDY, local_every=4)
    assert [o.token_ids for o in outs] == expected
    num_shipped = sum(1 for i in range(len(prompts)) if i % 4 != 3)
    assert b.stats.num_received_prompt_tokens == sum(len(p) for i, p in enumerate(prompts) if i % 4 != 3)
    assert a.stats.num_decode_tokens == 0 and num_shipped == 20
    assert all(o.finish_reason == "length" for o in outs)
    assert_clean(a, b)


def test_split_greedy_with_ngram_speculation_on_decode(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    prompts = repetitive_prompts(10, seed=3) + mixed_prompts(6, 512, seed=5, max_len=200)
    params = replace(GREEDY, max_tokens=24)
    expected = [o.token_ids for o in make_engine(path).generate(prompts, params)]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_batch_size=32)
    a = make_engine(path)
    b = make_engine(path, speculative=spec, max_num_batched_tokens=64)
    outs = run_split(a, b, prompts, params, local_every=5)
    assert [o.token_ids for o in outs] == expected
    assert b.spec_stats.num_accepted_tokens > 0
    assert sum(o.num_accepted_tokens for i, o in enumerate(outs) if i % 5 != 4) > 0  # shipped ones speculated
    assert_clean(a, b)


def test_split_greedy_with_draft_model_on_bundled_pair() -> None:
    longer = heldout_prompts(4, 120)
    prompts = longer + [longer[0][:1], longer[1][:16], longer[2][:47]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    target = str(MODELS / "target")
    expected = [o.token_ids for o in Engine(EngineConfig(model=target, num_kv_blocks=256)).generate(prompts, params)]
    spec = SpeculativeConfig(method="draft_model", draft_model=str(MODELS / "draft"), num_speculative_tokens=4)
    a = Engine(EngineConfig(model=target, num_kv_blocks=256))
    b = Engine(EngineConfig(model=target, num_kv_blocks=256, speculative=spec, max_num_batched_tokens=64))
    outs = run_split(a, b, prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert b.spec_stats.num_draft_tokens > 50 and b.spec_stats.num_accepted_tokens > 0
    assert_clean(a, b)


def test_draft_catches_up_on_a_prompt_it_never_saw(ckpt_dir: Callable[..., Path]) -> None:
    """Only the target's pages are shipped. An admitted request starts with
    ``draft_num_computed`` = 0, so the first proposal runs the whole prompt through the draft
    model. With draft == target every draft is then accepted; a draft blind to the prompt
    (stale pages) would be rejected at once."""
    path = ckpt_dir("qwen3")
    prompts = mixed_prompts(8, 512, seed=31, max_len=150)
    expected = [o.token_ids for o in make_engine(path).generate(prompts, GREEDY)]
    spec = SpeculativeConfig(method="draft_model", draft_model=str(path), num_speculative_tokens=3)
    a, b = make_engine(path), make_engine(path, speculative=spec)
    outs = run_split(a, b, prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    stats = b.spec_stats
    assert stats.num_draft_tokens > 30 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert_clean(a, b)


# -- seeded sampling ---------------------------------------------------------------------
SEEDED = [
    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, seed=12, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.2, seed=13, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=14, max_tokens=16, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, seed=15, max_tokens=16, ignore_eos=True),  # greedy: no draws
]


def test_seeded_sampling_identical_across_split(ckpt_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    path = ckpt_dir("llama")
    prompts = mixed_prompts(len(SEEDED), 512, seed=23, max_len=120)
    expected = make_engine(path).generate(prompts, SEEDED)
    outs = run_split(make_engine(path), make_engine(path, max_num_batched_tokens=64), prompts, list(SEEDED))
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    got_lp, want_lp = outs[3].logprobs, expected[3].logprobs
    assert got_lp is not None and want_lp is not None and len(got_lp) == 16
    assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(got_lp, want_lp))
    assert outs[3].top_logprobs is not None and len(outs[3].top_logprobs) == 16
    # The test has power: without skipping the prefill worker's draw, the tokens differ.
    monkeypatch.setattr("engine.engine.skip_sampled_draws", lambda *args, **kwargs: None)
    unskipped = run_split(make_engine(path), make_engine(path), prompts[:4], list(SEEDED[:4]))
    assert [o.token_ids for o in unskipped] != [o.token_ids for o in expected[:4]]


# -- prefix caching ----------------------------------------------------------------------
PREFIX = [(7 * i) % 500 + 3 for i in range(200)]


def test_held_blocks_keep_prefill_prefix_cache_correct(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    first, second, third = PREFIX + [11, 12, 13, 14, 15], PREFIX + [21, 22, 23], PREFIX + [31]
    a = make_engine(path)
    rid = a.add_request(first, GREEDY.for_prefill(), "held", hold_kv=True)
    while a.has_unfinished_requests():
        a.step()
    held = a.handoff.held_block_ids(rid)
    assert len(held) == num_blocks_for(205) == 13 and a.num_free_blocks == 512 - 13
    packed = a.handoff.pack_kv(held)
    # While held, the 12 full prefix blocks are shared with a new request (prefix hit).
    out = a.generate([second], GREEDY)[0]
    assert out.num_cached_tokens == 192
    assert out.token_ids == make_engine(path).generate([second], GREEDY)[0].token_ids
    a.check_integrity()
    assert a.handoff.held_block_ids(rid) == held and torch.equal(a.handoff.pack_kv(held), packed)  # pages untouched
    assert a.handoff.release_kv(rid)
    # After release the prefix is still cached (freed blocks keep their hashes).
    out = a.generate([third], GREEDY)[0]
    assert out.num_cached_tokens == 192
    assert_clean(a)


def test_decode_publishes_received_blocks(ckpt_dir: Callable[..., Path]) -> None:
    """B publishes the full prompt blocks it received; a hash B published while the pages were
    on their way (after the reservation took its hits) stays with B's own block and the
    received copy stays private."""
    path = ckpt_dir("llama")
    local_first = PREFIX[:192] + [41, 42, 43]  # 12 full blocks: the shared prefix
    shipped = PREFIX[:192] + list(range(50, 70))  # 13 full blocks: 12 already cached on B + 1 new
    later = shipped[:208] + [99, 98]  # hits all 13
    ref = make_engine(path)
    expected = [o.token_ids for o in ref.generate([local_first, shipped, later], GREEDY)]
    a, b = make_engine(path), make_engine(path)
    transfer = prefill(a, {"s": shipped}, GREEDY)["s"]
    ids = b.handoff.reserve_kv("s", len(shipped), shipped)  # nothing cached on B yet: no hits
    assert ids is not None and b.handoff.reserved_num_cached_blocks("s") == 0
    assert b.generate([local_first], GREEDY)[0].token_ids == expected[0]
    cached_before = dict(b.kv.pool.cached)
    assert len(cached_before) == 12
    b.handoff.unpack_kv("s", transfer.packed)
    b.handoff.admit_prefilled("s", shipped, transfer.first_token_id, GREEDY)
    done = Completions()
    done.expect("s", shipped, transfer.first_token_id)
    cached = b.kv.pool.cached
    assert {h: blk.block_id for h, blk in cached.items() if h in cached_before} == {
        h: blk.block_id for h, blk in cached_before.items()
    }
    cached_ids = {blk.block_id for blk in cached.values()}
    assert not cached_ids & set(ids[:12])  # duplicates of B's own blocks stay private
    assert ids[12] in cached_ids  # the new full block is published
    assert ids[13] not in cached_ids  # the partial block is not
    b.check_integrity()
    rid = b.add_request(later, GREEDY)
    final = drain(b, done)
    assert final["s"].token_ids == expected[1]
    assert final[rid].token_ids == expected[2] and final[rid].num_cached_tokens == 208
    assert_clean(a, b)


# -- finished on the first token ---------------------------------------------------------
@pytest.mark.parametrize("case", ["max_tokens_1", "stop_token", "eos"])
def test_first_token_finishes_on_admission(case: str, ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    prompt = list(range(3, 40))
    a, b = make_engine(path), make_engine(path)
    transfer = prefill(a, {"x": prompt}, GREEDY)["x"]
    first = transfer.first_token_id
    if case == "max_tokens_1":
        params, reason = replace(GREEDY, max_tokens=1), "length"
    elif case == "stop_token":
        params, reason = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(first,)), "stop"
    else:
        first = transfer.first_token_id = b.eos_token_ids[0]
        params, reason = SamplingParams(temperature=0.0, max_tokens=8), "stop"
    other = b.add_request(list(range(100, 130)), replace(GREEDY, max_tokens=3))
    b.step()
    admit(b, transfer, params)
    assert b.num_free_blocks == 512 - num_blocks_for(30)  # only the other request holds blocks
    b.check_integrity()
    assert b.has_unfinished_requests()
    outs = {o.request_id: o for o in b.step()}
    done = outs["x"]
    assert done.finished and done.finish_reason == reason
    assert done.new_token_ids == [] and done.num_output_tokens == 1
    assert outs[other].new_token_ids and not outs[other].finished
    while b.has_unfinished_requests():
        assert all(o.request_id == other for o in b.step())
    assert_clean(a, b)


def test_min_tokens_keeps_a_stop_first_token_running(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    a, b = make_engine(path), make_engine(path)
    transfer = prefill(a, {"x": list(range(3, 40))}, GREEDY)["x"]
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2, stop_token_ids=(transfer.first_token_id,))
    done = Completions()
    admit(b, transfer, params, done)
    out = drain(b, done)["x"]
    assert len(out.token_ids) >= 2 and out.token_ids[0] == transfer.first_token_id
    assert_clean(a, b)


# -- lifecycle ---------------------------------------------------------------------------
def test_held_request_abort_release_and_id_reuse(ckpt_dir: Callable[..., Path]) -> None:
    a = make_engine(ckpt_dir("llama"))
    # Aborted while running: nothing is held.
    rid = a.add_request(list(range(3, 90)), GREEDY.for_prefill(), "running", hold_kv=True)
    assert a.abort(rid) and not a.abort(rid)
    with pytest.raises(ValueError, match="request_id"):
        a.handoff.held_block_ids(rid)
    assert not a.handoff.release_kv(rid)
    assert_clean(a)
    # Finished and held: the id stays in use until abort (or release) frees the blocks.
    rid = a.add_request(list(range(3, 90)), GREEDY.for_prefill(), "held", hold_kv=True)
    while a.has_unfinished_requests():
        a.step()
    assert len(a.handoff.held_block_ids(rid)) == 6 and a.num_free_blocks == 512 - 6
    with pytest.raises(ValueError, match="request_id"):
        a.add_request([5, 6, 7], GREEDY, rid)
    a.check_integrity()
    assert a.abort(rid) and not a.abort(rid) and not a.handoff.release_kv(rid)
    assert_clean(a)
    # More than one token: only the prompt's blocks are held (the rest are freed at finish).
    rid = a.add_request(list(range(3, 43)), replace(GREEDY, max_tokens=30), "longer", hold_kv=True)
    while a.has_unfinished_requests():
        a.step()
    assert len(a.handoff.held_block_ids(rid)) == num_blocks_for(40) and a.num_free_blocks == 512 - 3
    a.check_integrity()
    assert a.handoff.release_kv(rid) and not a.handoff.release_kv(rid)
    a.add_request([5, 6, 7], GREEDY, rid)  # the id is free again
    while a.has_unfinished_requests():
        a.step()
    assert_clean(a)


def test_reservation_lifecycle(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    b = make_engine(path, num_kv_blocks=16)
    running = b.add_request(list(range(3, 40)), replace(GREEDY, max_tokens=20))
    done = Completions()
    done.feed(b.step())
    running_ids = set(b.kv.block_ids(running))
    assert len(running_ids) == 3
    ids = b.handoff.reserve_kv("r", 150, [7] * 150)  # 10 blocks
    assert ids is not None and len(ids) == 10 and not running_ids & set(ids)
    assert b.num_free_blocks == 3
    b.check_integrity()
    assert b.handoff.reserve_kv("s", 60, [7] * 60) is None  # 4 blocks: not now
    assert "s" not in b.scheduler.requests and b.num_free_blocks == 3
    with pytest.raises(ValueError, match="request_id"):
        b.handoff.reserve_kv("r", 10, [7] * 10)
    assert b.handoff.free_reserved_kv("r") and not b.handoff.free_reserved_kv("r")
    assert b.handoff.reserve_kv("s", 60, [7] * 60) is not None  # after the free, it fits
    with pytest.raises(ValueError, match="request_id"):
        b.handoff.unpack_kv(running, torch.zeros(b.kv_layout.packed_shape(3)))  # not a reservation
    assert b.abort("s") and not b.abort("s")  # abort cancels a reservation too
    params = replace(GREEDY, max_tokens=20)
    assert drain(b, done)[running].token_ids == make_engine(path).generate([list(range(3, 40))], params)[0].token_ids
    # Cached but unreferenced blocks are evicted for a reservation; referenced ones never.
    assert len(b.kv.pool.cached) == (37 + 19) // 16
    assert b.handoff.reserve_kv("all", 255, [7] * 255) is not None and b.num_free_blocks == 0  # 16 blocks
    assert not b.kv.pool.cached
    assert b.handoff.free_reserved_kv("all")
    assert_clean(b)


def test_abort_admitted_request(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    a, b = make_engine(path), make_engine(path)
    prompts = {"mid": list(range(3, 80)), "queued": list(range(5, 60)), "early": list(range(9, 30))}
    transfers = prefill(a, prompts, GREEDY)
    long = replace(GREEDY, max_tokens=40)
    admit(b, transfers["mid"], long)
    for _ in range(4):
        b.step()
    assert b.abort("mid")
    admit(b, transfers["queued"], long)  # admitted, not yet in the batch
    assert b.abort("queued") and not b.abort("queued")
    admit(b, transfers["early"], replace(GREEDY, max_tokens=1))  # finished on admission
    assert b.abort("early")  # its undelivered output is dropped
    assert not b.has_unfinished_requests() and b.step() == []
    assert_clean(a, b)


def test_admitted_request_preempted_recomputes_locally(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("qwen2")
    prompts = mixed_prompts(8, 512, seed=29, min_len=30, max_len=90)
    params = replace(GREEDY, max_tokens=40)
    expected = [o.token_ids for o in make_engine(path).generate(prompts, params)]
    a = make_engine(path)
    b = make_engine(path, num_kv_blocks=24, max_num_batched_tokens=128)
    outs = run_split(a, b, prompts, params, local_every=3)
    assert [o.token_ids for o in outs] == expected
    assert any(o.num_preemptions > 0 for i, o in enumerate(outs) if i % 3 != 2)
    assert_clean(a, b)


def test_admitted_requests_never_wait_on_each_other(ckpt_dir: Callable[..., Path]) -> None:
    """Two admitted 32-token prompts fill a 4-block pool; each needs a third block for its
    first token. The newer one is preempted (recomputed later), the older one runs."""
    path = ckpt_dir("llama")
    prompts = {"p1": list(range(3, 35)), "p2": list(range(40, 72))}
    expected = make_engine(path).generate(list(prompts.values()), GREEDY)
    a, b = make_engine(path), make_engine(path, num_kv_blocks=4)
    transfers = prefill(a, prompts, GREEDY)
    done = Completions()
    admit(b, transfers["p1"], GREEDY, done)
    admit(b, transfers["p2"], GREEDY, done)
    assert b.num_free_blocks == 0
    final = drain(b, done)
    assert [final["p1"].token_ids, final["p2"].token_ids] == [o.token_ids for o in expected]
    assert final["p1"].num_preemptions == 0 and final["p2"].num_preemptions == 1
    assert_clean(a, b)


# -- bad input ---------------------------------------------------------------------------
def test_bad_input_names_the_field(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    a, b = make_engine(path), make_engine(path, max_model_len=256, num_kv_blocks=64)
    prompt = list(range(3, 40))
    transfer = prefill(a, {"x": prompt}, GREEDY)["x"]
    for n in (0, -3, 256, 1000, 2.5):
        with pytest.raises(ValueError, match="num_prompt_tokens"):
            b.handoff.reserve_kv("x", n, [7])  # type: ignore[arg-type]
    small = make_engine(path, num_kv_blocks=4)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        small.handoff.reserve_kv("x", 64, [7] * 64)  # 65 tokens need 5 blocks: never fits
    with pytest.raises(ValueError, match="request_id"):
        b.handoff.admit_prefilled("x", prompt, 5, GREEDY)  # nothing reserved
    ids = b.handoff.reserve_kv("x", len(prompt), prompt)
    assert ids is not None
    with pytest.raises(ValueError, match="request_id"):
        b.handoff.reserve_kv("x", 10, [7] * 10)
    b.add_request([4, 5, 6], GREEDY, "local")
    with pytest.raises(ValueError, match="request_id"):
        b.handoff.reserve_kv("local", 10, [7] * 10)
    layout = b.kv_layout
    assert layout == KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")
    for bad in (torch.zeros(layout.packed_shape(4)), torch.zeros(1, *layout.packed_shape(3)[1:]),
                torch.zeros(layout.packed_shape(3), dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="packed"):
            b.handoff.unpack_kv("x", bad)
    with pytest.raises(ValueError, match="request_id"):
        b.handoff.unpack_kv("local", transfer.packed)  # a running request's blocks are never written
    with pytest.raises(ValueError, match="block_ids"):
        a.handoff.pack_kv([0, 512])
    b.handoff.unpack_kv("x", transfer.packed)
    bad_admits = [
        (dict(first_token_id=512), "first_token_id"),
        (dict(first_token_id=-1), "first_token_id"),
        (dict(prompt_token_ids=prompt[:-1]), "prompt_token_ids"),
        (dict(prompt_token_ids=prompt[:-1] + [512]), "prompt_token_ids"),
        (dict(params=SamplingParams(stop_token_ids=(600,))), "stop_token_ids"),
        (dict(params="greedy"), "params"),
        (dict(params=SamplingParams(temperature=0.0, logprobs=0)), "first_logprob"),
        (dict(params=SamplingParams(temperature=0.0, logprobs=2), first_logprob=-0.5), "first_top_logprobs"),
    ]
    good = dict(prompt_token_ids=prompt, first_token_id=transfer.first_token_id, params=GREEDY)
    for override, field in bad_admits:
        kwargs = {**good, **override}
        with pytest.raises(ValueError, match=field):
            b.handoff.admit_prefilled("x", kwargs.pop("prompt_token_ids"), kwargs.pop("first_token_id"),
                              kwargs.pop("params"), **kwargs)
        request = b.scheduler.requests["x"]  # the reservation is untouched
        assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS and request.num_output_tokens == 0
        b.check_integrity()
    with pytest.raises(ValueError, match="request_id"):
        a.handoff.held_block_ids("x")  # released by prefill()
    assert b.handoff.free_reserved_kv("x")
    assert b.abort("local")
    assert_clean(a, b, small)
