"""The ``parity`` step: greedy tokens of our engine against ``transformers`` ``generate``
(``do_sample=False``, one prompt at a time, EOS ignored), both on the same device, in
float32 and bfloat16, on

* ``random``: a seeded random Llama of SmolLM2-135M's shape (30 layers, hidden 576, 9 / 3
  heads; tiny in a dry run), the hidden-shape-style model;
* ``bundled``: models/target, the project's small trained Llama (real weights);
* ``smollm2``: with ``--smollm2``, a checkpoint sliced from the SmolLM2 GGUF
  (``bench.gpu.models.slice_gguf``; real weights, first layers, first vocabulary rows).

float32 must be token-identical. bfloat16 rounds differently in every kernel, so two
implementations drift apart at near-ties; each divergence is recorded with the
``transformers`` logits of its token and ours at that position (a small margin is drift,
a large one a bug).
"""

from __future__ import annotations

import random
import time
import traceback
from pathlib import Path

import torch

from bench.gpu.device import device_for, free_memory
from bench.gpu.models import random_checkpoint, slice_gguf
from bench.gpu.options import GpuCheckOptions
from bench.metrics import match_outputs

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "target"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prompts_for(vocab_size: int, num: int, max_len: int, seed: int) -> list[list[int]]:
    """Mixed lengths, always 1 and ``max_len``; token ids from 3 up (0-2: special ids)."""
    rng = random.Random(seed)
    lengths = [1, max_len] + [rng.randint(2, max_len) for _ in range(num - 2)]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths[:num]]


def ours(model_dir: Path, dtype: str, device: torch.device, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from engine import Engine, EngineConfig, SamplingParams

    max_len = max(len(p) for p in prompts) + new_tokens
    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, device=str(device), num_kv_blocks=64 * len(prompts),
                                 max_num_seqs=len(prompts), max_model_len=max_len, detokenize=False))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    engine.check_integrity()
    return [list(o.token_ids) for o in outs]


def theirs(model_dir: Path, dtype: str, device: torch.device, prompts: list[list[int]],
           new_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """``generate``'s tokens, and its logits of every step ([new_tokens, vocab] a prompt)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype]).to(device).eval()
    model.generation_config.eos_token_id = None
    gen = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True)
    tokens, logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt], device=device), generation_config=gen)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            logits.append(torch.cat(out.logits).float().cpu())
    del model
    return tokens, logits


def _divergences(got: list[list[int]], want: list[list[int]], logits: list[torch.Tensor]) -> list[dict]:
    out = []
    for i, position in match_outputs(got, want).first_divergence.items():
        if position >= min(len(got[i]), len(want[i])):
            out.append({"prompt": i, "position": position, "margin": None})
            continue
        row = logits[i][position]
        theirs_logit, ours_logit = float(row[want[i][position]]), float(row[got[i][position]])
        spread = float(row.max() - row.min())
        out.append({"prompt": i, "position": position, "hf_logit_of_hf_token": theirs_logit,
                    "hf_logit_of_our_token": ours_logit, "margin": theirs_logit - ours_logit,
                    "margin_of_spread": (theirs_logit - ours_logit) / spread if spread else None})
    return out


def _compare_dtype(model_dir: Path, dtype: str, device: torch.device, prompts: list[list[int]],
                   new_tokens: int) -> dict:
    got = ours(model_dir, dtype, device, prompts, new_tokens)
    free_memory(device)
    want, logits = theirs(model_dir, dtype, device, prompts, new_tokens)
    match = match_outputs(got, want)
    common = [match.first_divergence.get(i, len(w)) for i, w in enumerate(want)]
    return {"identical": match.num_equal == match.num_compared, "matches": match.fraction,
            "mean_common_prefix": sum(common) / len(common), "divergences": _divergences(got, want, logits)}


def compare_model(model_dir: Path, options: GpuCheckOptions, device: torch.device) -> dict:
    vocab = _vocab_size(model_dir)
    p = options.profile
    prompts = prompts_for(vocab, p.parity_prompts, 24 if options.dry_run else 300, options.seed)
    result: dict = {"model": str(model_dir), "num_prompts": len(prompts),
                    "prompt_lens": [len(x) for x in prompts], "new_tokens": p.parity_new_tokens}
    for dtype in DTYPES:
        try:
            result[dtype] = _compare_dtype(model_dir, dtype, device, prompts, p.parity_new_tokens)
        except Exception as exc:  # the other dtype's figures still count
            result[dtype] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        free_memory(device)
    return result


def _vocab_size(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _models(options: GpuCheckOptions) -> dict[str, Path]:
    models = {"random": random_checkpoint(options.cache_dir / f"parity-random-{options.profile.name}",
                                          options.profile.parity_model, options.seed),
              "bundled": BUNDLED}
    if not (BUNDLED / "config.json").is_file():  # an installed wheel has no models/ folder
        del models["bundled"]
    if options.smollm2:
        source = Path(options.smollm2)
        models["smollm2"] = slice_gguf(str(source), options.cache_dir / "smollm2-slice") if source.is_file() else source
    return models


def parity_step(options: GpuCheckOptions, deadline: float) -> dict:
    device = device_for(options)
    out: dict = {"device": str(device)}
    if not options.smollm2:
        out["smollm2"] = {"skipped": "no --smollm2: its GGUF (98 MB) does not fit the device's 64 MiB tree; "
                                     "carry a slice (bench/README.md) to check real SmolLM2 weights"}
    for name, model_dir in _models(options).items():
        if time.monotonic() > deadline:
            out[name] = {"skipped": "the step's deadline passed"}
            continue
        try:
            out[name] = compare_model(model_dir, options, device)
        except Exception as exc:  # one model's failure keeps the others' figures
            out[name] = {"model": str(model_dir), "error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()}
        free_memory(device)
    return out
