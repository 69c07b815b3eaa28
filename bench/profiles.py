"""What a benchmark run does: the ``full`` profile (the README's report, ≤ 15 min on two
cores) and the ``tiny`` one (CI: about a minute). Frozen dataclasses, built once from the flags.

Lengths are in tokens and sized for the bundled model (512 positions): a prompt plus its
output always fits. The full profile runs on ``--model`` (the bundled model by default); the
tiny one needs no model files: unless ``--model`` is given, it makes a small seeded
random-weight Llama (``TINY_MODEL``), so it runs from an installed wheel anywhere. That model
has no tokenizer, so the tiny sweep uses the synthetic workload, not code completion.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.workload import LengthDist, ModelShape

WORKLOADS = ("synthetic", "code", "long_mix")


@dataclass(frozen=True)
class WorkloadShapes:
    """Prompt and output lengths of the three online workloads."""

    synthetic_prompt: LengthDist
    synthetic_output: LengthDist
    code_prompt: LengthDist
    code_output: LengthDist
    short_prompt: LengthDist
    long_prompt: LengthDist
    mix_output: LengthDist
    long_fraction: float = 0.2

    def max_len(self) -> int:
        return max(self.synthetic_prompt.hi + self.synthetic_output.hi,
                   self.code_prompt.hi + self.code_output.hi,
                   max(self.short_prompt.hi, self.long_prompt.hi) + self.mix_output.hi)


@dataclass(frozen=True)
class OnlineProfile:
    """The online section: a closed-loop run (its request rate is the deployment's capacity),
    a Poisson sweep at fractions of that capacity, and a closed-loop long-prompt mix."""

    shapes: WorkloadShapes
    capacity_workload: str = "synthetic"
    capacity_requests: int = 64
    capacity_concurrency: int = 16
    sweep_workload: str = "code"
    sweep_fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
    sweep_rates: tuple[float, ...] = ()  # explicit rates (req/s) replace the fractions
    sweep_requests: int = 32
    mix_requests: int = 40
    mix_concurrency: int = 8

    def __post_init__(self) -> None:
        for name in (self.capacity_workload, self.sweep_workload):
            if name not in WORKLOADS:
                raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")
        if min(self.capacity_requests, self.capacity_concurrency, self.sweep_requests,
               self.mix_requests, self.mix_concurrency) < 1:
            raise ValueError("request counts and concurrencies must be >= 1")
        if any(f <= 0 for f in self.sweep_fractions) or any(r <= 0 for r in self.sweep_rates):
            raise ValueError("sweep fractions and rates must be > 0")


@dataclass(frozen=True)
class InterferenceProfile:
    """Steady decode traffic (closed loop) plus a Poisson stream of long prompts."""

    decode_clients: int = 4
    decode_prompt: LengthDist = LengthDist(16, 32)
    decode_output: int = 128
    long_prompt: LengthDist = LengthDist(400, 440)
    long_output: int = 8
    long_rate_rps: float = 4.0
    num_long: int = 40
    baseline_s: float = 2.0  # decode traffic alone before the long prompts start
    colocated_one_thread: bool = True  # also run colocated on one thread (when --threads > 1)

    def __post_init__(self) -> None:
        if self.decode_clients < 1 or self.num_long < 1 or not self.long_rate_rps > 0:
            raise ValueError("decode_clients, num_long and long_rate_rps must be > 0")


@dataclass(frozen=True)
class Profile:
    """``random_model``: the model when ``--model`` is not given (None: the bundled one)."""

    name: str
    online: OnlineProfile
    interference: InterferenceProfile
    random_model: ModelShape | None = None


FULL = Profile(
    name="full",
    online=OnlineProfile(shapes=WorkloadShapes(
        synthetic_prompt=LengthDist(16, 320, "lognormal", median=96, sigma=0.6),
        synthetic_output=LengthDist(16, 160, "lognormal", median=96, sigma=0.4),
        code_prompt=LengthDist(64, 320), code_output=LengthDist(128, 128),
        short_prompt=LengthDist(16, 64), long_prompt=LengthDist(320, 400),
        mix_output=LengthDist(32, 96))),
    interference=InterferenceProfile(),
)

# About 0.6M parameters; a wider init than transformers' 0.02 keeps the top greedy logits far
# apart, so batching's last-bit rounding differences cannot flip a token between systems.
TINY_MODEL = ModelShape(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=256, vocab_size=1024, max_position_embeddings=512,
                        initializer_range=0.15)

TINY = Profile(
    name="tiny",
    online=OnlineProfile(
        shapes=WorkloadShapes(
            synthetic_prompt=LengthDist(8, 64, "lognormal", median=24, sigma=0.6),
            synthetic_output=LengthDist(4, 12, "lognormal", median=8, sigma=0.4),
            code_prompt=LengthDist(32, 96), code_output=LengthDist(8, 8),
            short_prompt=LengthDist(8, 24), long_prompt=LengthDist(200, 240),
            mix_output=LengthDist(4, 8), long_fraction=0.3),
        capacity_requests=8, capacity_concurrency=4, sweep_workload="synthetic", sweep_fractions=(0.5, 1.0),
        sweep_requests=6, mix_requests=8, mix_concurrency=4),
    interference=InterferenceProfile(decode_clients=2, decode_output=24, long_prompt=LengthDist(200, 240),
                                     long_output=2, long_rate_rps=4.0, num_long=4, baseline_s=0.5,
                                     colocated_one_thread=False),
    random_model=TINY_MODEL,
)

PROFILES = {"full": FULL, "tiny": TINY}

