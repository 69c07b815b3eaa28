"""Seeded request sets for the load generator: synthetic, code completion, long-prompt mix.

Every workload is a pure function of its arguments (``random.Random(seed)``), so two runs,
or two systems in one run, see the same requests. Prompts are token ids (the gateway does not
tokenize during a measurement); decoding is greedy and ignores EOS, so every request produces
exactly its ``max_new_tokens``.

* **synthetic**: random token ids (ids below ``FIRST_ORDINARY_ID`` — pad, BOS, EOS — are
  avoided); prompt and output lengths drawn uniform in ``[lo, hi]`` or log-normal (median,
  sigma) clipped to ``[lo, hi]``.
* **code**: code completion. Prefixes of the Python standard-library files the bundled model
  held out of training (``models/train_report.json``, the same selection as
  ``bench/spec_decode.py``), cut at seeded offsets and lengths. When those files are missing
  (another Python version has another stdlib), this repository's own Python source is used:
  the model never trained on it either.
* **long_mix**: mostly short prompts (kind ``short``) with a fraction of long ones (kind
  ``long``) near the context limit.
"""

from __future__ import annotations

import json
import math
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

FIRST_ORDINARY_ID = 3  # 0 pad, 1 BOS, 2 EOS in the bundled tokenizer
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RequestSpec:
    """One request to send."""

    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    kind: str = "default"

    def __post_init__(self) -> None:
        if not self.prompt_token_ids or self.max_new_tokens < 1:
            raise ValueError("a request needs a prompt and max_new_tokens >= 1")


@dataclass(frozen=True)
class LengthDist:
    """Lengths uniform in ``[lo, hi]``, or log-normal with ``median`` and ``sigma`` clipped to
    ``[lo, hi]``."""

    lo: int
    hi: int
    kind: str = "uniform"  # or "lognormal"
    median: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"need 1 <= lo <= hi, got {self.lo}, {self.hi}")
        if self.kind not in ("uniform", "lognormal"):
            raise ValueError(f"length distribution must be uniform or lognormal, got {self.kind!r}")
        if self.kind == "lognormal" and not (self.median > 0 and self.sigma > 0):
            raise ValueError("a log-normal length needs median > 0 and sigma > 0")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            return rng.randint(self.lo, self.hi)
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.hi, max(self.lo, value))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "lo": self.lo, "hi": self.hi,
                **({"median": self.median, "sigma": self.sigma} if self.kind == "lognormal" else {})}


def _random_prompt(rng: random.Random, length: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(length))


def synthetic(num_requests: int, seed: int, vocab_size: int, prompt: LengthDist,
              output: LengthDist, kind: str = "synthetic") -> list[RequestSpec]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len, output_len = prompt.draw(rng), output.draw(rng)
        requests.append(RequestSpec(_random_prompt(rng, prompt_len, vocab_size), output_len, kind))
    return requests


def long_mix(num_requests: int, seed: int, vocab_size: int, short: LengthDist, long: LengthDist,
             output: LengthDist, long_fraction: float) -> list[RequestSpec]:
    """Short prompts with a ``long_fraction`` of long ones, interleaved at random."""
    if not 0.0 < long_fraction < 1.0:
        raise ValueError(f"long_fraction must be in (0, 1), got {long_fraction}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        is_long = rng.random() < long_fraction
        dist = long if is_long else short
        prompt_len, output_len = dist.draw(rng), output.draw(rng)
        requests.append(RequestSpec(_random_prompt(rng, prompt_len, vocab_size), output_len,
                                    "long" if is_long else "short"))
    return requests


def code_source_files(model_dir: Path) -> tuple[list[Path], str]:
    """The held-out stdlib files named in the model's training report, or (fallback) this
    repository's own Python source. Returns the files and a description of the source."""
    report_path = model_dir.parent / "train_report.json"
    if report_path.is_file():
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        names = json.loads(report_path.read_text())["corpus"]["heldout_files"]
        files = [stdlib / name for name in names if (stdlib / name).is_file()]
        if files:
            return files, f"held-out stdlib files listed in {report_path.name} ({len(files)} files)"
    roots = ("engine", "kernels", "gateway", "prefill_worker", "decode_worker", "splitserve")
    files = sorted(p for root in roots for p in (REPO_ROOT / root).rglob("*.py"))
    return files, f"this repository's own Python source ({len(files)} files)"


def tokenize_files(model_dir: Path, files: list[Path]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tokenizer.encode(path.read_text(errors="replace")).ids for path in files]


def code_completion(num_requests: int, seed: int, docs: list[list[int]], prompt: LengthDist,
                    output: LengthDist) -> list[RequestSpec]:
    """Prefixes cut from tokenized source files: request i takes a window of a seeded length
    at a seeded offset of document ``i mod len(docs)`` (documents shorter than ``prompt.hi``
    are skipped)."""
    usable = [doc for doc in docs if len(doc) > prompt.hi]
    if not usable:
        raise ValueError(f"no source document is longer than {prompt.hi} tokens")
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        doc = usable[i % len(usable)]
        length = prompt.draw(rng)
        start = rng.randint(0, len(doc) - length)
        requests.append(RequestSpec(tuple(doc[start:start + length]), output.draw(rng), "code"))
    return requests
