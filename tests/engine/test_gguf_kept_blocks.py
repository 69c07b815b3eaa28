"""A GGUF file's Q4_1 / Q8_0 tensors kept as blocks (engine/quant/linear.py), under --quantization and in float32:
the loader hands over exactly the file's weights, and the quantized engine computes with them:
its greedy tokens equal those of its torch reference (only float rounding order differs:
logprobs within a tolerance). And the GGUF config path of a cold start."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.models.loader import load_weights
from engine.quant.linear import BlockWeight, GGUFLinear
from splitserve_kernels.native import native_kernels
from tests.engine.gguf_files import checkpoint_to_gguf

needs_native = pytest.mark.skipif(not native_kernels().available, reason="block weights are kept only with the native kernels")
PROMPTS = [[5, 17, 300, 42, 7, 99, 1, 250], list(range(40, 75)), [3] * 20]


@needs_native
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_kept_blocks_are_the_files_weights(qtype: str, tmp_path: Path, ckpt_dir: Callable[..., Path]) -> None:
    path = str(checkpoint_to_gguf(ckpt_dir("llama"), tmp_path / "m.gguf", qtype=qtype))
    dense = load_weights(path, torch.float32)
    kept = load_weights(path, torch.float32, frozenset((qtype,)))
    assert set(kept) == set(dense)
    blocks = {name: w for name, w in kept.items() if isinstance(w, BlockWeight)}
    assert blocks and all(name.endswith(".weight") for name in blocks)
    assert len(blocks) == sum(t.dim() == 2 for t in dense.values())  # every matrix, q/k rows restored
    for name, w in blocks.items():
        assert torch.equal(w.dequantize(), dense[name]), name


def _gguf_linears(model: object) -> list[GGUFLinear]:
    found = [model.lm_head] if isinstance(model.lm_head, GGUFLinear) else []
    for layer in model.layers:
        found += [v for v in vars(layer).values() if isinstance(v, GGUFLinear)]
    return found


@needs_native
@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["batch", "batch-1"])
@pytest.mark.parametrize(("qtype", "quant_args"), [("Q4_1", {"quantization": "int4", "quant_group_size": 32}),
                                                   ("Q8_0", {"quantization": "int8"})])
def test_quantized_engine_on_kept_blocks_equals_its_torch_reference(
        prompts: list[list[int]], qtype: str, quant_args: dict, tmp_path: Path, ckpt_dir: Callable[..., Path]) -> None:
    # Q4_1 and Q8_0 weights take activations rounded to 8 bits per block
    # (kernels/splitserve_kernels/quant_matmul.py): the same engine with every block linear on
    # the torch reference (the file's weights dequantized, round_activations_q8) gives the
    # same tokens, logprobs up to rounding order. "batch-1" decodes one sequence, the
    # kernel's integer-dot path.
    path = str(checkpoint_to_gguf(ckpt_dir("llama"), tmp_path / "m.gguf", qtype=qtype))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    quant = Engine(EngineConfig(model=path, num_kv_blocks=64, **quant_args))
    linears = _gguf_linears(quant.runner.model)
    assert {lin.qtype for lin in linears} == {qtype}  # the projections and the LM head, as the file has them
    assert len(linears) == 4 * len(quant.runner.model.layers) + 1
    got = quant.generate(prompts, params)
    for lin in linears:
        lin._dense = lin.weight.dequantize()  # the torch reference path from here on
    want = quant.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-4)


@needs_native
@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["batch", "batch-1"])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_float32_engine_on_block_panels_gives_the_dequantized_weights_bits(
        prompts: list[list[int]], qtype: str, tmp_path: Path, ckpt_dir: Callable[..., Path]) -> None:
    # Unquantized float32 keeps the file's Q4_1 / Q8_0 tensors and computes with them as block
    # panels below BLOCK_PANEL_ROWS rows (engine/models/linear.py: here every decode step, 1
    # or 3 rows, and the LM head's logits): the same tokens and the same logprobs, bit for bit,
    # as the engine built from the dequantized weights (float32 panels only).
    path = str(checkpoint_to_gguf(ckpt_dir("llama"), tmp_path / "m.gguf", qtype=qtype))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    blocks = Engine(EngineConfig(model=path, num_kv_blocks=64))
    got = blocks.generate(prompts, params)
    model = blocks.runner.model
    linears = [model.lm_head] + [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(lin.block_panels is not None and lin.block_panels.dtype == torch.uint8 for lin in linears)
    floats = Engine(EngineConfig(model=path, num_kv_blocks=64, keep_gguf_blocks=False))
    assert all(lin.blocks is None and lin.block_panels is None for lin in (floats.runner.model.layers[0].qkv,
                                                                           floats.runner.model.lm_head))
    want = floats.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]


def test_default_rope_of_a_gguf_file_needs_no_transformers_config(tmp_path: Path, ckpt_dir: Callable[..., Path]) -> None:
    # Cold start: transformers' AutoConfig import took most of a worker's start on a busy
    # machine; the default RoPE is computed from the file's own config, the same frequencies.
    from transformers import AutoConfig

    from engine.models.loader import load_hf_config, rope_inv_freq
    from engine.models.spec import read_config

    path = str(checkpoint_to_gguf(ckpt_dir("llama"), tmp_path / "m.gguf"))
    light = load_hf_config(path)
    assert not hasattr(light, "to_dict")  # not a transformers config
    want = rope_inv_freq(AutoConfig.for_model(**read_config(path)))
    got = rope_inv_freq(light)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
