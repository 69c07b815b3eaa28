"""Train the bundled default model pair (target + draft) on the Python stdlib.

Everything is derived from a seed and from the Python standard library's own
``.py`` source, so every machine with the same Python version reproduces the
same tokenizer exactly and the same weights to within float tolerance.

Pipeline::

    stdlib .py files --sorted rel paths--> train / held-out split (hash of path)
          |                                         |
          v                                         |
    byte-level BPE tokenizer (tokenizers)           |
          |                                         |
          v                                         v
    packed stream <s> file </s> <s> file </s> ... (train)   (held-out)
          |
          +--> target: LlamaForCausalLM, cross-entropy
          +--> draft:  LlamaForCausalLM, cross-entropy + KL to target soft labels
          |
          v
    bf16 save_pretrained -> <out>/target, <out>/draft, <out>/train_report.json

Usage::

    python tools/train_default_model.py --out-dir models            # full run
    python tools/train_default_model.py --out-dir /tmp/x --quick    # seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from default_model_corpus import BOS_ID, EOS_ID, PAD_ID, load_corpus, pack, to_hf_tokenizer, train_tokenizer

logger = logging.getLogger("train_default_model")
FIB_PROMPT = "def fibonacci(n):"



# Directory names never used as corpus: tests (not ordinary library code),
# generated tables (encodings/*, pydoc_data/topics.py), bundled wheels, and
# the machine-specific _sysconfigdata module.



@dataclass(frozen=True)
class ModelSpec:
    """Shape of one Llama model; the vocabulary comes from the tokenizer."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}")


@dataclass(frozen=True)
class StageConfig:
    """Optimisation schedule of one model (AdamW, linear warmup, cosine decay)."""

    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    distill_weight: float = 0.0  # weight of KL(target || draft); 0 = plain cross-entropy

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"distill_weight must be in [0, 1], got {self.distill_weight}")


@dataclass(frozen=True)
class TrainConfig:
    seed: int
    vocab_size: int
    context_len: int
    heldout_percent: int
    max_train_files: int | None  # None = all; the --quick run takes a small prefix
    max_eval_tokens: int
    rope_theta: float
    target: ModelSpec
    draft: ModelSpec
    target_stage: StageConfig
    draft_stage: StageConfig

    def __post_init__(self) -> None:
        if not 0 < self.heldout_percent < 50:
            raise ValueError(f"heldout_percent must be in (0, 50), got {self.heldout_percent}")
        if self.context_len < 8:
            raise ValueError(f"context_len must be >= 8, got {self.context_len}")


FULL_CONFIG = TrainConfig(
    seed=0,
    vocab_size=4096,
    context_len=512,
    heldout_percent=3,
    max_train_files=None,
    max_eval_tokens=65536,
    rope_theta=10000.0,
    target=ModelSpec(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=640),
    draft=ModelSpec(hidden_size=96, num_layers=3, num_heads=3, num_kv_heads=1, intermediate_size=256),
    target_stage=StageConfig(steps=1000, batch_size=4, lr=3e-3, warmup_steps=30),
    draft_stage=StageConfig(steps=1200, batch_size=4, lr=4e-3, warmup_steps=30, distill_weight=0.9),
)

QUICK_CONFIG = TrainConfig(
    seed=0,
    vocab_size=384,
    context_len=64,
    heldout_percent=10,
    max_train_files=12,
    max_eval_tokens=2048,
    rope_theta=10000.0,
    target=ModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64),
    draft=ModelSpec(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32),
    target_stage=StageConfig(steps=6, batch_size=4, lr=3e-3, warmup_steps=2),
    draft_stage=StageConfig(steps=4, batch_size=4, lr=3e-3, warmup_steps=1, distill_weight=0.7),
)


# --------------------------------------------------------------------------- models


def build_model(spec: ModelSpec, cfg: TrainConfig, vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=cfg.context_len,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
    )
    return LlamaForCausalLM(config)


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() dedups tied weights


def lr_at(step: int, stage: StageConfig) -> float:
    if step < stage.warmup_steps:
        return stage.lr * (step + 1) / stage.warmup_steps
    progress = (step - stage.warmup_steps) / max(1, stage.steps - stage.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return stage.lr * (stage.min_lr_ratio + (1.0 - stage.min_lr_ratio) * cosine)


def sample_batch(stream: torch.Tensor, batch_size: int, context_len: int, gen: torch.Generator) -> torch.Tensor:
    """[batch_size, context_len + 1] windows at seeded random offsets."""
    starts = torch.randint(0, stream.numel() - context_len - 1, (batch_size,), generator=gen)
    return torch.stack([stream[s : s + context_len + 1] for s in starts.tolist()])


def make_optimizer(model: torch.nn.Module, stage: StageConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": stage.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=stage.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def train_stage(
    name: str,
    model: LlamaForCausalLM,
    stream: torch.Tensor,
    stage: StageConfig,
    context_len: int,
    seed: int,
    teacher: LlamaForCausalLM | None = None,
) -> float:
    """Train ``model`` in place; returns the wall time in seconds."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = make_optimizer(model, stage)
    model.train()
    started = time.monotonic()
    for step in range(stage.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, stage)
        batch = sample_batch(stream, stage.batch_size, context_len, gen)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=inputs).logits  # [B, T, V]
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss = ce
        if teacher is not None and stage.distill_weight > 0:
            with torch.no_grad():
                teacher_logp = F.log_softmax(teacher(input_ids=inputs).logits, dim=-1)
            draft_logp = F.log_softmax(logits, dim=-1)
            kl = F.kl_div(draft_logp.flatten(0, 1), teacher_logp.flatten(0, 1), log_target=True, reduction="batchmean")
            loss = (1.0 - stage.distill_weight) * ce + stage.distill_weight * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == stage.steps - 1:
            logger.info(
                "%s step %d/%d ce %.4f loss %.4f lr %.2e %.0fs",
                name, step, stage.steps, ce.item(), loss.item(), lr_at(step, stage), time.monotonic() - started,
            )
    model.eval()
    return time.monotonic() - started


def round_to_bf16(model: LlamaForCausalLM) -> None:
    """Make the fp32 weights equal to what the bf16 checkpoint will hold."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))



@torch.no_grad()
def evaluate(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, stream: torch.Tensor, context_len: int, unigram_logp: torch.Tensor
) -> dict[str, float]:
    """Teacher-forced CE of both models, unigram CE and greedy agreement."""
    num_windows = (stream.numel() - 1) // context_len
    sums = {"target": 0.0, "draft": 0.0, "unigram": 0.0, "agree": 0.0}
    num_tokens = 0
    for w in range(num_windows):
        chunk = stream[w * context_len : (w + 1) * context_len + 1]
        inputs, labels = chunk[None, :-1], chunk[1:]
        target_logits = target(input_ids=inputs).logits[0]  # [T, V]
        draft_logits = draft(input_ids=inputs).logits[0]
        sums["target"] += F.cross_entropy(target_logits, labels, reduction="sum").item()
        sums["draft"] += F.cross_entropy(draft_logits, labels, reduction="sum").item()
        sums["unigram"] += -unigram_logp[labels].sum().item()
        sums["agree"] += (target_logits.argmax(-1) == draft_logits.argmax(-1)).sum().item()
        num_tokens += labels.numel()
    report = {"num_tokens": num_tokens, "greedy_agreement": sums["agree"] / num_tokens}
    for name in ("target", "draft", "unigram"):
        ce = sums[name] / num_tokens
        report[f"{name}_ce"] = ce
        report[f"{name}_ppl"] = math.exp(ce)
    return report


def unigram_log_probs(stream: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Add-one smoothed token frequencies of the training stream."""
    counts = torch.bincount(stream, minlength=vocab_size).double() + 1.0
    return (counts / counts.sum()).log()


@torch.no_grad()
def complete(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str, max_new_tokens: int) -> str:
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)



def save_model(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.to(torch.float32)
    tokenizer.save_pretrained(out_dir)
    write_portable_tokenizer_class(out_dir)


def write_portable_tokenizer_class(out_dir: Path) -> None:
    """Name the tokenizer class that both transformers 4.x and 5.x resolve.

    transformers 5 writes ``TokenizersBackend``, which 4.x cannot load; both
    load ``PreTrainedTokenizerFast`` from the same ``tokenizer.json``.
    """
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def dir_size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


# ----------------------------------------------------------------------------- main


def set_determinism(seed: int, num_threads: int) -> None:
    torch.manual_seed(seed)
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)


def run(cfg: TrainConfig, out_dir: Path, num_threads: int, skip_sample: bool = False) -> dict:
    set_determinism(cfg.seed, num_threads)
    wall_start = time.monotonic()
    train_texts, heldout_texts = load_corpus(cfg.heldout_percent, cfg.max_train_files)

    tokenizer = train_tokenizer(list(train_texts.values()), cfg.vocab_size)
    vocab_size = tokenizer.get_vocab_size()
    train_stream = pack(tokenizer, list(train_texts.values()))
    eval_stream = pack(tokenizer, list(heldout_texts.values()))[: cfg.max_eval_tokens + 1]
    logger.info("tokens: %d train, %d eval, vocab %d", train_stream.numel(), eval_stream.numel(), vocab_size)

    torch.manual_seed(cfg.seed)
    target = build_model(cfg.target, cfg, vocab_size)
    torch.manual_seed(cfg.seed + 1)
    draft = build_model(cfg.draft, cfg, vocab_size)
    target_s = train_stage("target", target, train_stream, cfg.target_stage, cfg.context_len, cfg.seed)
    round_to_bf16(target)
    draft_s = train_stage("draft", draft, train_stream, cfg.draft_stage, cfg.context_len, cfg.seed + 1, teacher=target)
    round_to_bf16(draft)

    metrics = evaluate(target, draft, eval_stream, cfg.context_len, unigram_log_probs(train_stream, vocab_size))
    hf_tokenizer = to_hf_tokenizer(tokenizer, cfg.context_len)
    max_new_tokens = min(64, cfg.context_len // 2)
    sample = "" if skip_sample else complete(target, hf_tokenizer, FIB_PROMPT, max_new_tokens)
    draft_sample = "" if skip_sample else complete(draft, hf_tokenizer, FIB_PROMPT, max_new_tokens)
    save_model(target, hf_tokenizer, out_dir / "target")
    save_model(draft, hf_tokenizer, out_dir / "draft")

    report = {
        "seed": cfg.seed,
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "num_threads": num_threads,
        "config": dataclasses.asdict(cfg),
        "corpus": {
            "num_train_files": len(train_texts),
            "num_heldout_files": len(heldout_texts),
            "heldout_files": sorted(heldout_texts),
            "num_train_tokens": train_stream.numel(),
            "num_eval_tokens": metrics["num_tokens"],
            "vocab_size": vocab_size,
        },
        "params": {"target": count_params(target), "draft": count_params(draft)},
        "checkpoint_bytes": {
            "target": dir_size_bytes(out_dir / "target"),
            "draft": dir_size_bytes(out_dir / "draft"),
        },
        "train_seconds": {"target": target_s, "draft": draft_s, "total_wall": time.monotonic() - wall_start},
        "heldout": metrics,
        "samples": {FIB_PROMPT: {"target": sample, "draft": draft_sample}},
    }
    (out_dir / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, required=True, help="writes <out>/target, <out>/draft, report")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny corpus subset, tiny models, few steps")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (fixed for determinism)")
    parser.add_argument("--skip-sample", action="store_true", help="skip the greedy sample completions")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    base = QUICK_CONFIG if args.quick else FULL_CONFIG
    cfg = dataclasses.replace(base, seed=args.seed)
    report = run(cfg, args.out_dir, args.threads, skip_sample=args.skip_sample)
    summary = {k: report[k] for k in ("params", "checkpoint_bytes", "train_seconds", "heldout", "samples")}
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")  # the final JSON summary
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
