"""Every benchmark's requests, and the seeded random-weight model they can run on.

Each workload is a pure function of its arguments, so every system (and every run) sees the
same requests; decoding is greedy with EOS ignored everywhere, so every request produces
exactly its output length.

* The **engine workload** (:class:`Workload`): a seeded random-weight Llama saved on disk
  (:func:`ensure_model`) and ``num_requests`` random token-id prompts (:func:`make_prompts`,
  torch's generator). ``benchmarks.throughput``, ``bench.disagg``, the peers (``benchmarks.peers``) of
  ``splitserve bench``; a small shape of the same model is the tiny profile's model.
* The **online workloads** (lists of :class:`RequestSpec`, ``random.Random``):

  * **synthetic**: random token ids (ids below ``FIRST_ORDINARY_ID`` — pad, BOS, EOS — are
    avoided); prompt and output lengths uniform in ``[lo, hi]`` or log-normal (median,
    sigma) clipped to ``[lo, hi]``;
  * **long_mix**: mostly short prompts (kind ``short``) with a fraction of long ones (kind
    ``long``);
  * **code**: code completion on held-out Python source (:func:`code_source_files`), cut at
    seeded offsets and lengths; ``bench.spec_decode`` takes its prompts from here too.
  * **conversations** (:class:`Conversation`): multi-turn chat whose every turn resends the
    whole conversation (system prompt, earlier turns, the model's own answers), over a few
    system prompts that conversations share; one turn each is the shared-system-prompt
    workload. ``bench.routing`` runs them.

Nothing here imports torch or transformers until a function needs them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

FIRST_ORDINARY_ID = 3  # 0 pad, 1 BOS, 2 EOS in the bundled tokenizer
# Where benchmarks keep the random models they make, relative to the working directory (as
# their reports are): a wheel install has no source tree to put them in.
CACHE_DIR = Path(".cache")
ENGINE_MODEL_DIR = CACHE_DIR / "bench-llama-32m"
# Packages whose source is the fallback held-out text (the bundled model never saw it).
SOURCE_PACKAGES = ("engine", "splitserve_kernels", "gateway", "prefill_worker", "decode_worker", "plumbing",
                   "splitserve")


# -- the engine workload ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of the random-weight Llama (about 32M parameters at the defaults)."""

    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 1408
    vocab_size: int = 8192
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02  # transformers' default; wider keeps greedy logits apart


@dataclass(frozen=True)
class Workload:
    """What is generated: ``num_requests`` prompts of ``min_prompt_len..max_prompt_len`` random
    token ids (uniform, both ends included), ``output_len`` greedy tokens each, EOS ignored."""

    num_requests: int = 64
    output_len: int = 128
    min_prompt_len: int = 16
    max_prompt_len: int = 256
    seed: int = 0
    model: ModelShape = ModelShape()

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if not 1 <= self.min_prompt_len <= self.max_prompt_len:
            raise ValueError(
                f"need 1 <= min_prompt_len <= max_prompt_len, got {self.min_prompt_len}, "
                f"{self.max_prompt_len}"
            )
        if self.max_model_len > self.model.max_position_embeddings:
            raise ValueError(
                f"max_prompt_len + output_len = {self.max_model_len} exceeds the model's "
                f"max_position_embeddings = {self.model.max_position_embeddings}"
            )

    @property
    def max_model_len(self) -> int:
        return self.max_prompt_len + self.output_len

    def to_dict(self) -> dict:
        return asdict(self)


def _saved_shape_matches(model_dir: Path, shape: ModelShape) -> bool:
    config_path = model_dir / "config.json"
    if not config_path.is_file() or not any(model_dir.glob("*.safetensors")):
        return False
    saved = json.loads(config_path.read_text())
    return all(saved.get(key) == value for key, value in asdict(shape).items())


def ensure_model(model_dir: Path, shape: ModelShape, seed: int) -> Path:
    """Create the random-weight Llama in ``model_dir`` (seeded), or reuse the one saved there.

    A saved model is reused when its config has the same dimensions; the seed is recorded in
    ``bench_seed.txt`` and also has to match. Returns the absolute path.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = Path(model_dir).resolve()
    seed_path = model_dir / "bench_seed.txt"
    if _saved_shape_matches(model_dir, shape) and seed_path.is_file():
        if seed_path.read_text().strip() == str(seed):
            return model_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**asdict(shape), dtype="float32")).to(torch.float32)
    model.save_pretrained(model_dir)
    seed_path.write_text(f"{seed}\n")
    return model_dir


def make_prompts(workload: Workload) -> list[list[int]]:
    """Seeded random prompts: lengths uniform in [min_prompt_len, max_prompt_len], token ids
    uniform over the vocabulary."""
    import torch

    generator = torch.Generator().manual_seed(workload.seed)
    prompt_lens = torch.randint(
        workload.min_prompt_len, workload.max_prompt_len + 1, (workload.num_requests,),
        generator=generator,
    )
    return [
        torch.randint(0, workload.model.vocab_size, (int(n),), generator=generator).tolist()
        for n in prompt_lens
    ]


def count_parameters(model_dir: Path) -> int:
    """Number of parameters in the saved checkpoint (read from the safetensors headers)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                total += math.prod(handle.get_slice(name).get_shape())
    return total


# -- the online workloads -----------------------------------------------------------------------


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


def _package_sources() -> list[Path]:
    """The ``.py`` files of the installed project packages (a checkout or a wheel alike)."""
    files: list[Path] = []
    for name in SOURCE_PACKAGES:
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            files.extend(Path(root).rglob("*.py"))
    return sorted(files)


def code_source_files(model_dir: Path) -> tuple[list[Path], str]:
    """The held-out stdlib files named in the model's training report (``train_report.json``
    beside the model, as the bundled model has), or (fallback) this project's own Python
    source. Returns the files and a description of the source."""
    report_path = Path(model_dir).parent / "train_report.json"
    if report_path.is_file():
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        names = json.loads(report_path.read_text())["corpus"]["heldout_files"]
        files = [stdlib / name for name in names if (stdlib / name).is_file()]
        if files:
            return files, f"held-out stdlib files listed in {report_path.name} ({len(files)} files)"
    files = _package_sources()
    return files, f"this project's own Python source ({len(files)} files)"


def tokenize_files(model_dir: Path, files: list[Path]) -> list[list[int]]:
    """Each file's token ids under the model's ``tokenizer.json`` (a clear error without one)."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"the code workload needs a tokenizer: {model_dir} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path))
    return [tokenizer.encode(file.read_text(errors="replace")).ids for file in files]


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


def code_prompts(model_dir: Path, num_requests: int, seed: int, prompt: LengthDist,
                 output: LengthDist) -> tuple[list[RequestSpec], str]:
    """The code-completion workload of the model at ``model_dir``, and where its text came from."""
    files, source = code_source_files(model_dir)
    docs = tokenize_files(model_dir, files)
    return code_completion(num_requests, seed, docs, prompt, output), source


# -- conversations (multi-turn chat, shared system prompts) ----------------------------------------


@dataclass(frozen=True)
class Conversation:
    """A chat as token ids. Turn ``t``'s prompt is the conversation so far: ``system``, then for
    each earlier turn its user message and the model's actual answer, then
    ``user_turns[t]``; the answer is ``answer_lens[t]`` greedy tokens (EOS ignored), so every
    prompt's length is fixed by the workload whatever the model answers."""

    index: int
    system_index: int  # which of the shared system prompts
    system: tuple[int, ...]
    user_turns: tuple[tuple[int, ...], ...]
    answer_lens: tuple[int, ...]

    def prompt(self, turn: int, answers: list[list[int]]) -> tuple[int, ...]:
        """Turn ``turn``'s prompt, given the answers of the turns before it."""
        if len(answers) != turn:
            raise ValueError(f"turn {turn} needs the {turn} earlier answers, got {len(answers)}")
        tokens = list(self.system)
        for user, answer in zip(self.user_turns, answers):
            tokens += [*user, *answer]
        return (*tokens, *self.user_turns[turn])

    def max_tokens(self) -> int:
        """The longest sequence the conversation reaches (last prompt + its answer)."""
        return len(self.system) + sum(map(len, self.user_turns)) + sum(self.answer_lens)


def conversations(num_conversations: int, num_turns: int, num_system_prompts: int, seed: int,
                  vocab_size: int, system: LengthDist, user: LengthDist, answer: LengthDist) -> list[Conversation]:
    """Seeded conversations over ``num_system_prompts`` distinct system prompts, assigned round
    robin (conversation ``i`` uses prompt ``i mod num_system_prompts``)."""
    if num_conversations < 1 or num_turns < 1:
        raise ValueError("need at least one conversation of at least one turn")
    if not 1 <= num_system_prompts <= num_conversations:
        raise ValueError(f"num_system_prompts must be in [1, {num_conversations}], got {num_system_prompts}")
    rng = random.Random(seed)
    systems = [_random_prompt(rng, system.draw(rng), vocab_size) for _ in range(num_system_prompts)]
    out = []
    for i in range(num_conversations):
        users = tuple(_random_prompt(rng, user.draw(rng), vocab_size) for _ in range(num_turns))
        answers = tuple(answer.draw(rng) for _ in range(num_turns))
        k = i % num_system_prompts
        out.append(Conversation(i, k, systems[k], users, answers))
    return out
