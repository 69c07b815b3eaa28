"""``splitserve bench`` flags, and the frozen :class:`BenchConfig` built from them once."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from bench.cost import DEFAULT_API_USD_PER_M, DEFAULT_CPU_CORE_HOUR_USD, Pricing
from bench.loadgen import LoadPlan
from bench.metrics import Slo
from bench.profiles import PROFILES, WORKLOADS, Profile
from bench.workload import CACHE_DIR, ModelShape

SECTIONS = ("online", "interference")


@dataclass(frozen=True)
class CustomOnline:
    """An online plan from the flags, replacing the profile's: one workload under one or
    more load plans (a closed loop, one Poisson rate, or a sweep of rates)."""

    workload: str
    num_requests: int
    plans: tuple[LoadPlan, ...]


@dataclass(frozen=True)
class BenchConfig:
    """One run's settings. ``random_model``: ``model`` is a seeded random Llama of this shape
    that the run makes (or reuses) before anything else; None: ``model`` must exist."""

    profile: Profile
    out_dir: Path
    model: Path
    draft_model: Path
    gateway: str | None
    sections: tuple[str, ...]
    seed: int
    threads: int
    progress: bool
    speculative: str
    slo: Slo
    pricing: Pricing
    custom_online: CustomOnline | None
    num_kv_blocks: int = 0
    # The peers section, read from --peers-json (``bench.peers_file``); None: not given.
    peers: dict | None = None
    random_model: ModelShape | None = None

    def __post_init__(self) -> None:
        unknown = set(self.sections) - set(SECTIONS)
        if unknown or not self.sections:
            raise ValueError(f"--sections takes a comma list of {SECTIONS}, got {sorted(unknown) or 'nothing'}")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.speculative not in ("none", "ngram", "draft_model"):
            raise ValueError(f"--speculative must be none, ngram or draft_model, got {self.speculative!r}")
        if self.num_kv_blocks < 0:
            raise ValueError(f"--num-kv-blocks must be >= 0, got {self.num_kv_blocks}")
        if self.random_model is None and not (self.model / "config.json").is_file():
            raise ValueError(f"--model {self.model} has no config.json (an installed wheel has no bundled "
                             "model: pass --model DIR, or use --profile tiny, which makes its own)")

    def kv_flags(self) -> tuple[str, ...]:
        """Worker flags of every deployment of ``--model`` started here."""
        return ("--num-kv-blocks", str(self.num_kv_blocks)) if self.num_kv_blocks else ()

    def speculative_flags(self) -> tuple[str, ...]:
        if self.speculative == "none":
            return ()
        flags = ("--speculative", self.speculative)
        return flags + (("--draft-model", str(self.draft_model)) if self.speculative == "draft_model" else ())


def add_bench_flags(p: argparse.ArgumentParser, default_model: str) -> None:
    """``default_model``: the full profile's model when ``--model`` is not given."""
    p.add_argument("--profile", choices=sorted(PROFILES), default="full",
                   help="full: the README's report (<= 15 min on 2 cores); tiny: a minute (CI)")
    p.add_argument("--out", type=Path, default=Path("bench/results/report"), help="output folder")
    p.add_argument("--model", default=None,
                   help=f"model for the online load and the interference run (default: {default_model} for "
                        f"the full profile; a seeded random Llama made in {CACHE_DIR}/ for tiny)")
    p.set_defaults(bench_default_model=default_model)
    p.add_argument("--draft-model", default=None, help="draft for --speculative draft_model (default: models/draft)")
    p.add_argument("--gateway", default=None,
                   help="load a running deployment at this address instead of starting one (online section)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU cores a deployment started here splits between its workers")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--num-kv-blocks", type=int, default=512,
                   help="KV pool of each worker of the --model deployments started here, in blocks of 16 "
                        "tokens (small enough that KV utilisation shows; 0: the workers' default)")
    p.add_argument("--speculative", default=None, choices=["none", "ngram", "draft_model"],
                   help="speculative decoding on the online deployment's decode worker "
                        "(default: draft_model for full, none for tiny)")
    g = p.add_argument_group("online plan (any of these replaces the profile's plan)")
    g.add_argument("--workload", choices=WORKLOADS, default=None)
    g.add_argument("--mode", choices=["closed", "open"], default=None)
    g.add_argument("--concurrency", type=int, default=None, help="closed loop: clients")
    g.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    g.add_argument("--rates", default=None, help="open loop: a sweep, comma list of req/s")
    g.add_argument("--num-requests", type=int, default=None, help="requests per run")
    s = p.add_argument_group("goodput SLOs (defaults scaled to the bundled model on two cores)")
    s.add_argument("--ttft-slo-ms", type=float, default=250.0)
    s.add_argument("--tpot-slo-ms", type=float, default=15.0)
    c = p.add_argument_group("cost")
    price = c.add_mutually_exclusive_group()
    price.add_argument("--gpu-hour-price", type=float, default=None, help="USD per GPU-hour")
    price.add_argument("--cpu-hour-price", type=float, default=None,
                       help=f"USD per CPU-core-hour (default {DEFAULT_CPU_CORE_HOUR_USD})")
    c.add_argument("--num-devices", type=int, default=None,
                   help="GPUs (or CPU cores) the deployment occupies (default: 1 GPU, or --threads cores)")
    c.add_argument("--api-price-per-m", type=float, default=DEFAULT_API_USD_PER_M,
                   help="the API's USD per million output tokens, for the break-even volume")
    c.add_argument("--api-input-price-per-m", type=float, default=0.0,
                   help="the API's USD per million input tokens")
    p.add_argument("--peers-json", type=Path, default=None,
                   help="the peers section (other systems on the same model and prompts), as written by "
                        "`python -m benchmarks.peers` in the repository (not installed); without it the "
                        "section says how to get one")


def _custom_online(args: argparse.Namespace, profile: Profile) -> CustomOnline | None:
    given = [args.workload, args.mode, args.concurrency, args.rate, args.rates, args.num_requests]
    if all(v is None for v in given):
        return None
    rates = [float(r) for r in args.rates.split(",")] if args.rates else ([args.rate] if args.rate else [])
    mode = args.mode or ("open" if rates else "closed")
    if mode == "open" and not rates:
        raise ValueError("--mode open needs --rate or --rates")
    if mode == "closed" and rates:
        raise ValueError("--rate/--rates are for --mode open")
    plans = (tuple(LoadPlan("open", rate_rps=r, seed=args.seed + i) for i, r in enumerate(rates)) if mode == "open"
             else (LoadPlan("closed", concurrency=args.concurrency or profile.online.capacity_concurrency),))
    return CustomOnline(args.workload or profile.online.sweep_workload,
                        args.num_requests or profile.online.capacity_requests, plans)


def _pricing(args: argparse.Namespace) -> Pricing:
    if args.gpu_hour_price is not None:
        return Pricing(args.gpu_hour_price, args.num_devices or 1, "gpu", args.api_price_per_m,
                       args.api_input_price_per_m)
    return Pricing(args.cpu_hour_price or DEFAULT_CPU_CORE_HOUR_USD, args.num_devices or args.threads,
                   "cpu-core", args.api_price_per_m, args.api_input_price_per_m)


def model_for(model: str | None, profile: Profile, default_model: str) -> tuple[Path, ModelShape | None]:
    """``--model``, else the profile's random model (made in the cache), else the default."""
    if model:
        return Path(model), None
    if profile.random_model is not None:
        return CACHE_DIR / f"bench-{profile.name}-llama", profile.random_model
    return Path(default_model), None


def build_config(args: argparse.Namespace) -> BenchConfig:
    """Raises ``ValueError`` naming the bad flag."""
    from bench.peers_file import read_peers

    profile = PROFILES[args.profile]
    model, random_model = model_for(args.model, profile, args.bench_default_model)
    speculative = args.speculative or ("draft_model" if profile.name == "full" else "none")
    return BenchConfig(
        profile=profile, out_dir=args.out, model=model, random_model=random_model,
        draft_model=Path(args.draft_model) if args.draft_model else model.parent / "draft",
        gateway=args.gateway, sections=tuple(s.strip() for s in args.sections.split(",") if s.strip()),
        seed=args.seed, threads=args.threads, progress=not args.no_progress, speculative=speculative,
        slo=Slo(args.ttft_slo_ms / 1000.0, args.tpot_slo_ms / 1000.0), pricing=_pricing(args),
        custom_online=_custom_online(args, profile), num_kv_blocks=args.num_kv_blocks,
        peers=read_peers(args.peers_json) if args.peers_json is not None else None,
    )
