"""KV-aware routing at the gateway: the per-worker prefix index fed by KV events on
heartbeats, the routing costs and their imbalance guard, and what is never done because of
cache affinity."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.block_hash import prompt_block_hashes
from engine.kv_events import KVEventLog
from gateway.registry import Registry
from gateway.routing import REASON_IMBALANCE, REASON_LOAD, REASON_PREFIX
from plumbing.config import RoutingConfig
from plumbing.kv_event_sender import KVEventSender
from plumbing.metrics import GatewayMetrics
from splitserve_api.v1 import common_pb2, gateway_pb2

DECODE, PREFILL = common_pb2.WORKER_ROLE_DECODE, common_pb2.WORKER_ROLE_PREFILL
MODEL = str(Path(__file__).resolve().parents[2] / "models" / "target")
BS = 16


@dataclass
class Req:
    """What the router reads of a request (``GatewayRequest``'s fields)."""

    attempt_prompt: list[int]
    excluded: set[int] = field(default_factory=set)
    block_hashes: dict[tuple[int, int], list[bytes]] = field(default_factory=dict)


def _load(total: int = 100, free: int = 100, queued: int = 0) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(kv_blocks_total=total, kv_blocks_free=free, num_queued_prefill_tokens=queued)


async def _register(reg: Registry, role: int, port: int, total: int = 100,
                    incarnation: int | None = None) -> tuple[int, gateway_pb2.RegisterWorkerResponse]:
    resp = await reg.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
        role=role, address=f"127.0.0.1:{port}", model="m", load=_load(total, total),
        kv_layout=common_pb2.KVLayout(block_size=BS), incarnation=incarnation or 1000 + port), None)
    return resp.worker_id, resp


async def _beat(reg: Registry, worker_id: int, port: int, events: gateway_pb2.KVEvents | None = None,
                load: common_pb2.WorkerLoad | None = None, state: int = common_pb2.WORKER_STATE_SERVING,
                incarnation: int | None = None) -> gateway_pb2.HeartbeatResponse:
    request = gateway_pb2.HeartbeatRequest(worker_id=worker_id, load=load or _load(), state=state,
                                           incarnation=incarnation or 1000 + port)
    if events is not None:
        request.kv_events.CopyFrom(events)
    return await reg.Heartbeat(request, None)


def _holds(tokens: list[int], seq: int, reset: bool = False) -> gateway_pb2.KVEvents:
    """The events of a worker that computed ``tokens``: every full block is published."""
    full_blocks = prompt_block_hashes([*tokens, 0], BS)  # one more token: the last full block counts too
    return gateway_pb2.KVEvents(seq=seq, reset=reset, stored=full_blocks)


def _tokens(start: int, n: int) -> list[int]:
    return [3 + (start + i) % 4000 for i in range(n)]


async def _sync(reg: Registry, worker_id: int, sender: KVEventSender) -> int:
    """Heartbeats, as the worker's registration client sends them, until the log is drained;
    the number of evictions they carried."""
    num_removed = 0
    while sender.log.has_pending():
        request = gateway_pb2.HeartbeatRequest(worker_id=worker_id, load=_load(12, 12), incarnation=1001)
        batch = sender.attach(request)
        assert (await reg.Heartbeat(request, None)).known
        sender.delivered(batch)
        num_removed += len(batch.removed)
    return num_removed


def test_the_index_predicts_exactly_the_hits_the_engine_then_reports() -> None:
    """A scripted sequence on a real engine whose 12-block pool evicts: before each request
    the gateway predicts the hit from the events it was sent; the engine's hit is that."""
    system, other = _tokens(0, 64), _tokens(500, 150)
    script = [system + _tokens(100, 6), system + _tokens(200, 20), other, system + _tokens(100, 6),
              other[:100] + _tokens(700, 30), system + _tokens(200, 20), other + _tokens(900, 8)]

    async def run() -> tuple[list[int], list[int], int]:
        engine = Engine(EngineConfig(model=MODEL, num_kv_blocks=12, block_size=BS, num_threads=1))
        reg = Registry("m", 500, 3, routing=RoutingConfig(kv_events_max_per_beat=5))  # several beats per sync
        worker_id, resp = await _register(reg, PREFILL, 1, total=12)
        sender = KVEventSender(engine.kv_events)
        sender.configure(resp)
        predicted, actual, num_removed = [], [], 0
        index = reg.workers[worker_id].prefix
        for prompt in script:
            num_removed += await _sync(reg, worker_id, sender)
            assert len(index) == len(engine.kv.pool.cached) and all(h in index for h in engine.kv.pool.cached)
            predicted.append(reg.router.num_hit_blocks(reg.workers[worker_id], Req(prompt)))
            (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
            actual.append(out.num_cached_tokens // BS)
            engine.check_integrity()
        await reg.stop()
        return predicted, actual, num_removed

    predicted, actual, num_removed = asyncio.run(run())
    assert predicted == actual
    # By hand (LRU, tails evicted first): `other` evicts the system prompt's last two blocks,
    # the rerun of script[0] then finds two, script[4] shares 6 blocks of `other`, ...
    assert actual == [0, 4, 0, 2, 6, 3, 6]
    assert num_removed > 0


def test_bad_kv_events_are_refused_naming_the_field_and_do_not_refresh_the_worker() -> None:
    async def run() -> None:
        reg = Registry("m", 500, 3, routing=RoutingConfig(kv_events_max_per_beat=8))
        worker_id, _ = await _register(reg, PREFILL, 1, total=4)
        entry = reg.workers[worker_id]
        before = entry.last_beat
        cases = [
            (gateway_pb2.KVEvents(seq=1, stored=[b"short"]), "kv_events.stored: every block hash must be 16"),
            (gateway_pb2.KVEvents(seq=1, stored=[bytes(16)] * 9), "at most 8"),
            (gateway_pb2.KVEvents(seq=1, stored=[bytes(16)], removed=[bytes(16)]), "listed twice"),
            (gateway_pb2.KVEvents(seq=1, stored=[bytes([i]) * 16 for i in range(5)]), "the pool has 4 blocks"),
        ]
        for events, message in cases:
            with pytest.raises(ValueError, match=message):
                await _beat(reg, worker_id, 1, events, load=_load(4, 4))
        assert entry.last_beat == before and len(entry.prefix) == 0
        load_only = Registry("m", 500, 3, routing=RoutingConfig(policy="load"))
        other_id, resp = await _register(load_only, PREFILL, 2)
        assert resp.kv_events_max_per_beat == 0  # the worker sends none
        with pytest.raises(ValueError, match="at most 0"):
            await _beat(load_only, other_id, 2, _holds(_tokens(0, 40), 1))
        await reg.stop()
        await load_only.stop()

    asyncio.run(run())


def test_a_late_batch_is_ignored_and_a_reset_starts_from_scratch() -> None:
    async def run() -> None:
        reg = Registry("m", 500, 3)
        worker_id, _ = await _register(reg, PREFILL, 1)
        a, b = _tokens(0, 40), _tokens(100, 40)
        await _beat(reg, worker_id, 1, _holds(a, seq=2))
        await _beat(reg, worker_id, 1, gateway_pb2.KVEvents(seq=1, removed=prompt_block_hashes(a, BS)))
        index = reg.workers[worker_id].prefix
        assert index.num_hit_blocks(prompt_block_hashes(a, BS)) == 2  # seq 1 arrived late: ignored
        await _beat(reg, worker_id, 1, _holds(b, seq=3, reset=True))
        assert index.num_hit_blocks(prompt_block_hashes(a, BS)) == 0 and len(index) == 2
        await reg.stop()

    asyncio.run(run())


def test_a_restarted_worker_is_relearned_and_its_old_entries_are_dropped() -> None:
    async def run() -> None:
        reg = Registry("m", 500, 3)
        prompt = _tokens(0, 100)
        old_id, _ = await _register(reg, DECODE, 1, incarnation=1)
        other_id, _ = await _register(reg, DECODE, 2)
        await _beat(reg, old_id, 1, _holds(prompt, 1), incarnation=1)
        assert reg.router.pick_decode(Req(prompt)).worker.worker_id == old_id
        new_id, _ = await _register(reg, DECODE, 1, incarnation=2)  # restarted: empty cache
        assert old_id not in reg.workers and len(reg.workers[new_id].prefix) == 0
        pick = reg.router.pick_decode(Req(prompt))
        assert pick.num_hit_blocks == 0 and pick.reason == REASON_LOAD
        assert (await _beat(reg, old_id, 1, _holds(prompt, 2), incarnation=1)).known is False
        log = KVEventLog(max_pending=64)  # the new process's cache, re-learned from scratch
        sender = KVEventSender(log)
        sender.configure((await _register(reg, DECODE, 1, incarnation=3))[1])
        new_id = next(w for w, e in reg.workers.items() if e.incarnation == 3)
        for h in prompt_block_hashes(prompt[:40], BS):
            log.stored(h)
        request = gateway_pb2.HeartbeatRequest(worker_id=new_id, load=_load(), incarnation=3)
        batch = sender.attach(request)
        assert batch.reset and (await reg.Heartbeat(request, None)).known
        assert reg.router.pick_decode(Req(prompt)).num_hit_blocks == 2
        await reg.stop()

    asyncio.run(run())


def test_affinity_never_picks_a_dead_draining_or_failed_worker() -> None:
    async def run() -> None:
        reg = Registry("m", 300, 2)  # silent for 600 ms: dropped (a spare beats every 30 ms, so a loaded
        # machine must stall this loop for 600 ms before a spare is dropped too)
        reg.start()
        prompt = _tokens(0, 200)
        for role, ports in ((DECODE, (1, 2)), (PREFILL, (3, 4))):
            holder, _ = await _register(reg, role, ports[0])
            spare, _ = await _register(reg, role, ports[1])
            await _beat(reg, holder, ports[0], _holds(prompt, 1))
            pick = reg.router.pick_decode if role == DECODE else reg.router.pick_prefill
            assert pick(Req(prompt)).worker.worker_id == holder
            assert pick(Req(prompt, excluded={holder})).worker.worker_id == spare  # failed this request
            await _beat(reg, holder, ports[0], state=common_pb2.WORKER_STATE_DRAINING)
            assert pick(Req(prompt)).worker.worker_id == spare
            await _beat(reg, holder, ports[0], state=common_pb2.WORKER_STATE_SERVING)
            assert pick(Req(prompt)).worker.worker_id == holder
        spares = {port: next(e.worker_id for e in reg.workers.values() if e.address.endswith(f":{port}"))
                  for port in (2, 4)}
        deadline = asyncio.get_running_loop().time() + 30
        while len(reg.workers) > 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.03)  # the holders fall silent and are dropped; the spares keep beating
            for port, worker_id in spares.items():
                await _beat(reg, worker_id, port)
        assert {e.address for e in reg.workers.values()} == {"127.0.0.1:2", "127.0.0.1:4"}
        assert reg.router.pick_decode(Req(prompt)).num_hit_blocks == 0
        assert reg.router.pick_prefill(Req(prompt)).num_hit_blocks == 0
        await reg.stop()

    asyncio.run(run())


def test_two_conversations_stick_to_their_decode_workers_within_the_imbalance_bound() -> None:
    """Turn after turn, each conversation returns to the decode worker holding it, and no
    pick is ever more than the bound fuller than the emptiest worker: while a's worker is
    busy (turns 3-4) a goes by load, and then stays where its history now is."""
    async def run() -> None:
        config = RoutingConfig(decode_imbalance=0.25)
        metrics = GatewayMetrics.create().routing
        reg = Registry("m", 500, 3, routing=config, routing_metrics=metrics)
        ids = [(await _register(reg, DECODE, port))[0] for port in (1, 2)]
        workers = [reg.workers[i] for i in ids]
        convs = {"a": _tokens(0, 300), "b": _tokens(1000, 300)}
        homes: dict[str, list[int]] = {"a": [], "b": []}
        seq = 0
        for turn in range(8):
            for w in workers:  # a's first worker has other work in turns 3-4 (40 % of its pool)
                busy = turn in (3, 4) and homes["a"] and w.worker_id == homes["a"][0]
                w.load, w.num_routed = _load(free=60 if busy else 95), 0
            for name, history in convs.items():
                prompt = history + _tokens(2000 + 97 * turn, 40)
                pressures = [w.kv_pressure() for w in workers]
                pick = reg.router.pick_decode(Req(prompt))
                assert pick.worker.kv_pressure() - min(pressures) <= config.decode_imbalance
                if max(pressures) - min(pressures) > config.decode_imbalance:
                    assert pick.reason == REASON_IMBALANCE and pick.worker.kv_pressure() == min(pressures)
                elif homes[name]:
                    assert pick.worker.worker_id == homes[name][-1] and pick.reason == REASON_PREFIX
                    assert pick.num_hit_blocks == len(history) // BS  # all it computed so far
                homes[name].append(pick.worker.worker_id)
                pick.worker.num_routed += 1  # in flight while the other conversation's turn is routed
                convs[name] = prompt + _tokens(3000 + 89 * turn, 20)  # its answer joins the history
                seq += 1
                await _beat(reg, pick.worker.worker_id, 1 + ids.index(pick.worker.worker_id),
                            _holds(convs[name], seq), pick.worker.load)
        first_a, first_b = homes["a"][0], homes["b"][0]
        assert first_a != first_b and homes["b"] == [first_b] * 8
        assert homes["a"] == [first_a] * 3 + [first_b] * 5
        decisions = {s.labels["reason"]: s.value for m in metrics.decisions.collect() for s in m.samples
                     if s.name.endswith("_total")}
        assert decisions == {REASON_LOAD: 2.0, REASON_PREFIX: 10.0, REASON_IMBALANCE: 4.0}
        await reg.stop()

    asyncio.run(run())


def test_prefill_cost_weighs_uncached_tokens_against_queued_ones_and_local_prefill() -> None:
    async def run() -> None:
        reg = Registry("m", 500, 3, routing=RoutingConfig(prefill_imbalance_tokens=1000))
        holder, _ = await _register(reg, PREFILL, 1)
        empty, _ = await _register(reg, PREFILL, 2)
        prompt = _tokens(0, 100)  # 6 hashable blocks
        await _beat(reg, holder, 1, _holds(prompt[:64], 1))  # 4 blocks = 64 tokens cached
        reg.workers[holder].num_routed_prefill_tokens = 35  # cost 36 + 35 = 71 < 100
        pick = reg.router.pick_prefill(Req(prompt))
        assert (pick.worker.worker_id, pick.num_hit_blocks, pick.num_hit_tokens) == (holder, 4, 64)
        reg.workers[holder].num_routed_prefill_tokens = 65  # 36 + 65 = 101 > 100
        assert reg.router.pick_prefill(Req(prompt)).worker.worker_id == empty
        reg.workers[holder].num_routed_prefill_tokens = 0
        reg.workers[empty].load = _load(queued=0)
        reg.workers[holder].load = _load(queued=1001)  # beyond the guard, whatever it holds
        assert reg.router.pick_prefill(Req(prompt)).reason == REASON_IMBALANCE
        decode_id, _ = await _register(reg, DECODE, 3)
        await _beat(reg, decode_id, 3, _holds(prompt[:64], 1))
        decode = reg.router.pick_decode(Req(prompt))
        assert decode.num_hit_tokens == 64
        assert reg.router.prefill_locally(Req(prompt), decode, local_prefill_max_tokens=32)  # 64 >= 0.5 * 100
        assert not reg.router.prefill_locally(Req(_tokens(0, 140)), decode, 32)  # 64 < 70
        assert reg.router.prefill_locally(Req(_tokens(0, 90)), decode, 32)  # 26 uncached < 32
        assert reg.router.prefill_locally(Req(_tokens(0, 140), excluded={holder, empty}), decode, 32)
        assert not reg.router.prefill_locally(Req(prompt), decode, 0)  # 0: disaggregation forced
        assert reg.router.prefill_locally(Req(prompt, excluded={holder, empty}), decode, 0)
        await reg.stop()

    asyncio.run(run())


def test_a_backed_up_prefill_pool_spills_to_a_decode_worker_with_a_shorter_queue() -> None:
    async def run() -> None:
        metrics = GatewayMetrics.create()
        reg = Registry("m", 500, 3, routing=RoutingConfig(local_prefill_spill_tokens=1000),
                       routing_metrics=metrics.routing)
        p1, _ = await _register(reg, PREFILL, 1)
        p2, _ = await _register(reg, PREFILL, 2)
        d, _ = await _register(reg, DECODE, 3)
        prompt = _tokens(0, 300)
        for worker, queued in ((p1, 1200), (p2, 1000)):
            reg.workers[worker].load = _load(queued=queued)
        decode = reg.router.pick_decode(Req(prompt))
        assert reg.router.prefill_locally(Req(prompt), decode, 32)  # 0 + 300 <= 1000, the shortest
        reg.workers[d].load = _load(queued=500)
        reg.workers[d].num_routed_prefill_tokens = 200  # 500 + 200 + 300 = 1000: still no longer
        assert reg.router.prefill_locally(Req(prompt), decode, 32)
        reg.workers[d].num_routed_prefill_tokens = 201
        assert not reg.router.prefill_locally(Req(prompt), decode, 32)  # 1001 > 1000
        reg.workers[d].load, reg.workers[d].num_routed_prefill_tokens = _load(), 0
        assert not reg.router.prefill_locally(Req(prompt), decode, 0)  # disaggregation forced
        reg.workers[p2].load = _load(queued=999)  # one prefill worker keeps up: no spill
        assert not reg.router.prefill_locally(Req(prompt), decode, 32)
        # Admission tickets not yet charged to a worker count, spread over the pool: 999 + 2 / 2.
        assert reg.router.prefill_locally(Req(prompt), decode, 32, pending_prefill_tokens=2)
        assert reg.router.prefill_locally(Req(prompt, excluded={p1, p2}), decode, 0)  # none left
        reasons = {s.labels["reason"]: s.value for m in metrics.registry.collect()
                   if m.name == "splitserve_routing_local_prefills" for s in m.samples if s.name.endswith("_total")}
        assert reasons == {"spill": 3.0, "no_prefill_worker": 1.0}
        await reg.stop()

    asyncio.run(run())


def test_spill_off_never_spills() -> None:
    async def run() -> None:
        reg = Registry("m", 500, 3, routing=RoutingConfig(local_prefill_spill_tokens=0))
        p, _ = await _register(reg, PREFILL, 1)
        await _register(reg, DECODE, 2)
        reg.workers[p].load = _load(queued=100_000)
        prompt = _tokens(0, 300)
        assert not reg.router.prefill_locally(Req(prompt), reg.router.pick_decode(Req(prompt)), 32)
        await reg.stop()

    asyncio.run(run())
