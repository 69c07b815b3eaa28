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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MODES = ("disaggregated", "colocated")


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
