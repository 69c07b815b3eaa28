"""The deployments a benchmark run starts on this machine, each started once and reused.

Two modes, each a :class:`splitserve.cluster.Cluster` of real processes:

* **disaggregated**: gateway + 1 prefill worker + 1 decode worker; the gateway sends *every*
  prompt to the prefill worker (``--local-prefill-max-tokens 0``), so each request's KV pages
  cross the transport.
* **colocated**: gateway + 1 decode worker and no prefill worker; the gateway then prefills
  every prompt on the decode worker (prefill and decode share its batches).

Both get the same CPU budget: disaggregated splits ``threads`` between the prefill and the
decode worker (``prefill_threads`` + ``decode_threads``), colocated gives its one worker
``colocated_threads``. The gateway and the load generator run beside them on the same cores.

:func:`send_all` is the offline measurement every benchmark makes of a deployment: all
prompts at once, timed from the first send to the last final chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.loadgen import LoadGenerator
from bench.metrics import RequestRecord, window_s
from bench.workload import RequestSpec

if TYPE_CHECKING:
    from bench.engine_run import EngineSettings

MODES = ("disaggregated", "colocated")
WARMUP = RequestSpec((5,) * 16, 8, "warmup")


def engine_flags(settings: EngineSettings) -> tuple[str, ...]:
    """Worker flags that give a deployment the in-process engine's limits."""
    return ("--num-kv-blocks", str(settings.num_kv_blocks), "--max-num-seqs", str(settings.max_num_seqs),
            "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
            "--max-model-len", str(settings.max_model_len), "--block-size", str(settings.block_size))


@dataclass(frozen=True)
class DeploymentSpec:
    """What to start. ``worker_flags`` go to every worker (engine limits, speculation)."""

    model: str
    mode: str
    prefill_threads: int = 1
    decode_threads: int = 1
    colocated_threads: int = 2
    worker_flags: tuple[str, ...] = ()
    decode_flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if min(self.prefill_threads, self.decode_threads, self.colocated_threads) < 1:
            raise ValueError("thread counts must be >= 1")

    def cluster_kwargs(self) -> dict:
        if self.mode == "disaggregated":
            return {"num_prefill": 1, "num_decode": 1, "threads": self.prefill_threads,
                    "gateway_flags": ["--local-prefill-max-tokens", "0"],
                    "decode_flags": ["--threads", str(self.decode_threads), *self.decode_flags]}
        return {"num_prefill": 0, "num_decode": 1, "threads": self.colocated_threads,
                "decode_flags": list(self.decode_flags)}

    def describe(self) -> dict:
        threads = ({"prefill": self.prefill_threads, "decode": self.decode_threads}
                   if self.mode == "disaggregated" else {"decode": self.colocated_threads})
        return {"mode": self.mode, "model": self.model, "threads": threads,
                "cluster": {k: v for k, v in self.cluster_kwargs().items() if k != "threads"},
                "worker_flags": list(self.worker_flags)}


def deployment_spec(threads: int, mode: str, model: Path | str, extra: tuple[str, ...] = ()) -> DeploymentSpec:
    """``mode`` on ``threads`` cores: disaggregated splits them prefill / decode."""
    prefill = max(1, threads // 2)
    return DeploymentSpec(model=str(model), mode=mode, prefill_threads=prefill,
                          decode_threads=max(1, threads - prefill), colocated_threads=threads, worker_flags=extra)


@dataclass
class DeploymentPool:
    """Starts each distinct :class:`DeploymentSpec` once; :meth:`close` stops them all."""

    log_dir: Path
    clusters: dict[DeploymentSpec, object] = field(default_factory=dict)

    def address(self, spec: DeploymentSpec) -> str:
        from splitserve.cluster import Cluster

        if spec not in self.clusters:
            name = f"{spec.mode}-{Path(spec.model).name}-{len(self.clusters)}"
            cluster = Cluster(spec.model, worker_flags=list(spec.worker_flags),
                              log_dir=str(self.log_dir / name), log_level="warning",
                              **spec.cluster_kwargs())
            try:
                cluster.start()
            except BaseException:
                cluster.stop(grace_s=5)
                raise
            self.clusters[spec] = cluster
        return self.clusters[spec].addresses["gateway"]

    def release(self, spec: DeploymentSpec) -> None:
        """Stop one deployment (frees its cores and memory for what runs next)."""
        cluster = self.clusters.pop(spec, None)
        if cluster is not None:
            cluster.stop()

    def retain(self, keep: set[DeploymentSpec]) -> None:
        """Stop every deployment not in ``keep``."""
        for spec in [s for s in self.clusters if s not in keep]:
            self.release(spec)

    def close(self) -> None:
        for spec in list(self.clusters):
            self.release(spec)


async def _send(address: str, requests: list[RequestSpec], concurrency: int) -> list[RequestRecord]:
    async with LoadGenerator(address, keep_token_ids=True) as gen:
        await gen.closed_loop([WARMUP] * 2, 2)  # untimed: channel set-up, first forwards
        return await gen.closed_loop(requests, concurrency)


def send_all(address: str, requests: Sequence[RequestSpec],
             concurrency: int | None = None) -> tuple[float, list[RequestRecord]]:
    """Two untimed warm-up requests, then ``requests`` on ``concurrency`` closed-loop clients
    (default: all at once). Returns the seconds from the first send to the last final chunk
    and the records (token ids kept) in request order; raises if any request failed."""
    records = asyncio.run(_send(address, list(requests), concurrency or len(requests)))
    failed = [r.error for r in records if r.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0]}")
    return window_s(records), records
