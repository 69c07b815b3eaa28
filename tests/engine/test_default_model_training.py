"""The bundled default model pair: reproducible training and loadable checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "tools" / "train_default_model.py"
MODELS_DIR = REPO_ROOT / "models"
FIB_PROMPT = "def fibonacci(n):"


def _start_quick_training(out_dir: Path) -> subprocess.Popen:
    """One single-threaded --quick run in its own process (fresh hash seeds)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    args = [sys.executable, str(SCRIPT), "--quick", "--seed", "0", "--threads", "1", "--out-dir", str(out_dir)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two independent runs, side by side so that they fit the 60 s budget on 2 cores."""
    out_dirs = (tmp_path_factory.mktemp("run_a"), tmp_path_factory.mktemp("run_b"))
    procs = [_start_quick_training(out_dir) for out_dir in out_dirs]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-4000:]
        assert "heldout" in json.loads(stdout)
    return out_dirs


@pytest.mark.parametrize("role", ["target", "draft"])
def test_quick_training_is_reproducible(quick_runs: tuple[Path, Path], role: str) -> None:
    first, second = (run / role for run in quick_runs)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    assert json.loads((first / "config.json").read_text()) == json.loads((second / "config.json").read_text())
    weights_a = load_file(first / "model.safetensors")
    weights_b = load_file(second / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for name, tensor in weights_a.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.allclose(tensor.float(), weights_b[name].float(), rtol=1e-2, atol=1e-3), name


def test_quick_training_writes_report(quick_runs: tuple[Path, Path]) -> None:
    report = json.loads((quick_runs[0] / "train_report.json").read_text())
    heldout = report["heldout"]
    assert heldout["num_tokens"] > 0
    assert 0.0 <= heldout["greedy_agreement"] <= 1.0
    for key in ("target_ce", "draft_ce", "unigram_ce"):
        assert heldout[key] > 0.0
    assert report["params"]["draft"] < report["params"]["target"]


# ----------------------------------------------------------------- committed checkpoints


@pytest.fixture(scope="module")
def committed_pair():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (MODELS_DIR / "target" / "model.safetensors").exists():
        pytest.fail("models/target is missing: the default model pair must be committed")
    loaded = {}
    for role in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(MODELS_DIR / role, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(MODELS_DIR / role)
        loaded[role] = (model.eval(), tokenizer)
    return loaded


def test_committed_pair_shares_tokenizer_and_ids(committed_pair) -> None:
    target_tok = (MODELS_DIR / "target" / "tokenizer.json").read_bytes()
    assert target_tok == (MODELS_DIR / "draft" / "tokenizer.json").read_bytes()
    target_cfg, draft_cfg = committed_pair["target"][0].config, committed_pair["draft"][0].config
    tokenizer = committed_pair["target"][1]
    for cfg in (target_cfg, draft_cfg):
        assert cfg.model_type == "llama"
        assert cfg.vocab_size == len(tokenizer)
        assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
            tokenizer.bos_token_id,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
        )
    assert target_cfg.num_key_value_heads < target_cfg.num_attention_heads  # exercises GQA
    assert committed_pair["target"][0].generation_config.eos_token_id == tokenizer.eos_token_id


def test_committed_checkpoints_are_small_and_half_precision() -> None:
    total = sum(f.stat().st_size for role in ("target", "draft") for f in (MODELS_DIR / role).iterdir())
    assert total <= 60 * 1024 * 1024
    for role in ("target", "draft"):
        weights = load_file(MODELS_DIR / role / "model.safetensors")
        assert {t.dtype for t in weights.values()} == {torch.bfloat16}


@pytest.mark.parametrize("role", ["target", "draft"])
def test_committed_model_completes_fibonacci(committed_pair, role: str) -> None:
    model, tokenizer = committed_pair[role]
    inputs = tokenizer(FIB_PROMPT, return_tensors="pt")
    assert inputs["input_ids"][0, 0].item() == tokenizer.bos_token_id
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    completion = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert completion.strip() != ""
