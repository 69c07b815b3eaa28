"""Every decoder layer in one native call (``splitserve::decoder_layers``) against the Python
route it replaces (``LlamaModel._layer`` per layer): the same logits and the same KV cache, bit
for bit."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.model_runner import SeqSlice, make_forward_batch
from engine.models import linear, llama
from engine.models.linear import panel_gemm
from tests.engine.gguf_files import checkpoint_to_gguf

BLOCK = 16

needs_panels = pytest.mark.skipif(not panel_gemm(), reason="fused layers need the panel GEMM (a native library)")


def _panels_everywhere(model: object) -> None:
    """Both routes on the panel GEMM at every row count (the AVX-512 library hands 129 rows and
    more to oneDNN, and the fused route to the Python one), so that they are compared bit for bit."""
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if isinstance(lin, linear.Linear):
                lin.panel_rows = math.inf
    model.fused_rows = math.inf


def _runner(path: Path, fused: bool, **config: object) -> object:
    runner = Engine(EngineConfig(model=str(path), num_kv_blocks=64, block_size=BLOCK, **config)).runner
    assert runner.model.fused_layers, "every op of these layers is native: the fused route applies"
    _panels_everywhere(runner.model)
    runner.model.fused_layers = fused
    return runner


@needs_panels
# qwen2: the qkv bias; int8 KV: the cache's rows quantized by the native write (kv_int8.cpp);
# int8 / int4 weights: GGUF blocks, Q8_0 / Q4_1 (kernels/csrc/quant_matmul.cpp; with qwen2, the
# bias added after the blocks' product)
@pytest.mark.parametrize("arch, config", [
    ("llama", {}), ("qwen2", {}), ("llama", {"kv_cache_dtype": "int8"}), ("llama", {"quantization": "int8"}),
    ("qwen2", {"quantization": "int4", "quant_group_size": 32}),
])
def test_one_call_per_layer_gives_the_same_bits(arch: str, config: dict, ckpt_dir: Callable[..., Path]) -> None:
    fused = _runner(ckpt_dir(arch), True, **config)
    python = _runner(ckpt_dir(arch), False, **config)
    kv_cache_dtype = config.get("kv_cache_dtype", "auto")
    assert fused.kv_cache.dtype == (torch.int8 if kv_cache_dtype == "int8" else torch.float32)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, fused.spec.vocab_size, (45,), generator=gen).tolist() for _ in range(3)]
    tables = [[9, 3, 40, 17], [5, 6, 30, 31], [2, 50]]
    done = [0, 0, 0]
    # Prefill chunks of all three, then chunks and decodes mixed in one ragged batch.
    for ends in ((20, 33, 7), (29, 40, 8), (30, 41, 9), (31, 42, 10)):
        pieces = [SeqSlice(seq[d:e], d, t) for seq, d, e, t in zip(seqs, done, ends, tables)]
        rows = [sum(e - d for d, e in zip(done[: i + 1], ends[: i + 1])) - 1 for i in range(3)]
        batch = make_forward_batch(pieces, rows, BLOCK, torch.device("cpu"))
        with torch.inference_mode():
            want = python.model.forward(batch, python.kv_cache)
            got = fused.model.forward(batch, fused.kv_cache)
        assert torch.equal(got, want)
        done = list(ends)
    assert torch.equal(fused.kv_cache, python.kv_cache)


@needs_panels
def test_the_weights_held_for_a_call_are_the_forms_its_row_count_takes(tmp_path: Path,
                                                                        ckpt_dir: Callable[..., Path]) -> None:
    # decoder_layers reads every layer's weights from an object made once per answer of
    # block_rows (LlamaModel._decoder_weights): each must hold the forms the linears give at the
    # row counts that answer so, Q4_1 block panels for one and float32 panels for the other.
    path = str(checkpoint_to_gguf(ckpt_dir("llama"), tmp_path / "m.gguf", qtype="Q4_1"))
    engine = Engine(EngineConfig(model=path, num_kv_blocks=64, block_size=BLOCK))
    model = engine.runner.model
    model.block_rows.table = (False, True, False, False, False)  # 1 row: block panels; 2 to 4: float32 panels
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.generate([[5, 6, 7], [8, 9, 10]], params)  # decode steps of 2 rows
    engine.generate([[5, 6, 7]], params)  # of 1 row
    for use_blocks, rows, dtype in ((True, 1, torch.uint8), (False, 2, torch.float32)):
        held = model._held_weights[use_blocks].tensors()
        want = [t for layer in model.layers for t in (layer.input_norm, layer.qkv.fused_weight(rows), layer.qkv.bias,
                                                       layer.o.fused_weight(rows), layer.post_norm,
                                                       layer.gate_up.fused_weight(rows), layer.down.fused_weight(rows))]
        assert len(held) == len(want) == 7 * len(model.layers)
        assert all(h is w for h, w in zip(held, want))
        assert {held[i].dtype for i in range(len(held)) if i % 7 in (1, 3, 5, 6)} == {dtype}


@needs_panels
def test_decoder_weights_refuse_a_missing_tensor() -> None:
    w = torch.ones(4)
    with pytest.raises(ValueError, match="7 tensors per layer"):
        torch.classes.splitserve.DecoderWeights([w] * 6)
    with pytest.raises(ValueError, match="tensor 3 of layer 1 is missing"):
        torch.classes.splitserve.DecoderWeights([w] * 7 + [w, w, None, None, w, w, w])
    assert torch.classes.splitserve.DecoderWeights([w, w, None, w, w, w, w]).num_layers() == 1


@needs_panels
def test_the_lean_sequence_forward_takes_it_too(ckpt_dir: Callable[..., Path]) -> None:
    fused, python = _runner(ckpt_dir("llama"), True), _runner(ckpt_dir("llama"), False)
    tokens = list(range(5, 45))
    with torch.inference_mode():
        for start, end in ((0, 30), (30, 31), (31, 35)):
            want = python.model.forward_sequence(tokens[start:end], start, [7, 2, 11], python.kv_cache)
            got = fused.model.forward_sequence(tokens[start:end], start, [7, 2, 11], fused.kv_cache)
            assert torch.equal(got, want)
    assert torch.equal(fused.kv_cache, python.kv_cache)


@needs_panels
def test_greedy_generation_is_the_same(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 33, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = []
    for fused in (True, False):
        engine = Engine(EngineConfig(model=str(path), num_kv_blocks=64, block_size=BLOCK))
        _panels_everywhere(engine.runner.model)
        engine.runner.model.fused_layers = fused
        outputs.append([o.token_ids for o in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]


@needs_panels
def test_layers_it_cannot_serve_keep_the_python_route(ckpt_dir: Callable[..., Path]) -> None:
    # q/k norms (Qwen3) have no native op here; int4 in groups of 64 runs PyTorch's int4 kernel.
    assert not Engine(EngineConfig(model=str(ckpt_dir("qwen3")), num_kv_blocks=8)).runner.model.fused_layers
    int4_g64 = EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=8, quantization="int4", quant_group_size=64)
    assert not Engine(int4_g64).runner.model.fused_layers


@needs_panels
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_gguf_block_layers_take_it_at_every_row_count(quantization: str, ckpt_dir: Callable[..., Path]) -> None:
    config = EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=8, quantization=quantization,
                          quant_group_size=32)
    model = Engine(config).runner.model
    assert model.fused_layers and model.fused_rows == math.inf


@needs_panels
def test_a_forward_of_more_rows_than_the_panels_serve_takes_the_python_route(
        ckpt_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    runner = Engine(EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=64, block_size=BLOCK)).runner
    assert runner.model.fused_rows == linear.panel_rows()
    runner.model.fused_rows = 16  # a limit like the AVX-512 library's, on any library
    calls: list[int] = []
    real = torch.ops.splitserve.decoder_layers
    monkeypatch.setattr(torch.ops.splitserve, "decoder_layers", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    with torch.inference_mode():
        runner.model.forward_sequence(list(range(5, 21)), 0, [7, 2], runner.kv_cache)  # 16 tokens: Python
        assert calls == []
        runner.model.forward_sequence(list(range(21, 36)), 16, [7, 2], runner.kv_cache)  # 15 tokens: fused
    assert calls == [15]  # one call for every layer


@needs_panels
@pytest.mark.parametrize("config", [{}, {"kv_cache_dtype": "int8"}])
def test_sequence_groups_give_the_same_bits(config: dict, ckpt_dir: Callable[..., Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # From GROUP_MIN_ROWS rows a thread decoder_layers runs the sequences in groups, one per thread, each
    # through every layer on its own rows (kernels/csrc/decoder_layer.cpp): its slices of x, the
    # step metadata and query_start_loc rebased to the group. Against the Python route, decode
    # rows and chunks mixed, at 2 threads' groups whatever this machine has (fewer threads run
    # the groups one after the other: the same slicing).
    fused = _runner(ckpt_dir("llama"), True, **config)
    python = _runner(ckpt_dir("llama"), False, **config)
    groups_taken: list[list[int]] = []
    real = llama.seq_groups
    monkeypatch.setattr(llama, "seq_groups", lambda q, n, threads: groups_taken.append(real(q, n, 2)) or groups_taken[-1])
    gen = torch.Generator().manual_seed(3)
    num_seqs = 50
    seqs = [torch.randint(3, fused.spec.vocab_size, (16,), generator=gen).tolist() for _ in range(num_seqs)]
    tables = [[i + 1] for i in range(num_seqs)]
    done = [0] * num_seqs
    # 50 prompts of 2-9 tokens (past GROUP_MAX_ROWS: no groups), then steps of decode rows with
    # a 4-token chunk in one.
    for step in range(4):
        ends = [d + (2 + (i * 7) % 8 if step == 0 else 1 + (3 if i == step * 7 else 0)) for i, d in enumerate(done)]
        pieces = [SeqSlice(seq[d:e], d, t) for seq, d, e, t in zip(seqs, done, ends, tables)]
        rows = list(itertools.accumulate(e - d for d, e in zip(done, ends)))
        batch = make_forward_batch(pieces, [r - 1 for r in rows], BLOCK, torch.device("cpu"))
        with torch.inference_mode():
            want = python.model.forward(batch, python.kv_cache)
            got = fused.model.forward(batch, fused.kv_cache)
        assert torch.equal(got, want), step
        done = ends
    assert torch.equal(fused.kv_cache, python.kv_cache)
    assert groups_taken[0] == [] and all(len(g) == 1 for g in groups_taken[1:]), groups_taken


def test_seq_groups_split_whole_sequences_by_cost() -> None:
    def groups(rows: list[int], lens: list[int], threads: int = 2) -> list[int]:
        starts = torch.tensor([0, *itertools.accumulate(rows)])
        return llama.seq_groups(starts, torch.tensor(lens), threads)

    assert groups([1] * 64, [100] * 64) == [32]
    assert groups([1] * 96, [100] * 96, threads=4) == [24, 48, 72]
    assert groups([1] * 64, [100] * 64, threads=4) == []  # 16 rows a thread: below GROUP_MIN_ROWS
    assert groups([1] * 40, [100] * 40) == []  # 20 rows a thread
    assert groups([1] * 64, [100] * 64, threads=1) == []
    # the longer contexts first: the first group takes fewer of them
    assert groups([1] * 48, [400] * 24 + [20] * 24) == [16]
    assert groups([1] * 48, [100] * 48) == [24]
    assert groups([1] * 47, [100] * 47) == []  # below GROUP_MIN_ROWS a thread
    assert groups([1] * 129, [100] * 129) == []  # above GROUP_MAX_ROWS a thread
    assert groups([60, 1, 1], [60, 90, 90]) == []  # no split near an equal share
    assert groups([30, 30], [30, 30]) == [1]


@needs_panels
def test_decoder_layers_refuse_groups_that_do_not_rise_within_the_sequences(ckpt_dir: Callable[..., Path]) -> None:
    runner = _runner(ckpt_dir("llama"), True)
    model, spec = runner.model, runner.spec
    pieces = [SeqSlice([5, 6], 0, [1]), SeqSlice([7, 8], 0, [2]), SeqSlice([9], 0, [3])]
    batch = make_forward_batch(pieces, [1, 3, 4], BLOCK, torch.device("cpu"))
    x = torch.zeros(5, spec.hidden_size)
    cos, sin = model.cos[batch.positions].unsqueeze(1), model.signed_sin[batch.positions].unsqueeze(1)
    for bad in ([0], [3], [2, 1], [1, 1]):
        with pytest.raises(ValueError, match="seq_groups must rise strictly within"):
            torch.ops.splitserve.decoder_layers(
                x, model._decoder_weights(5), cos, sin, runner.kv_cache, batch.slot_mapping, batch.block_tables,
                batch.seq_lens, batch.query_start_loc, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                spec.intermediate_size, spec.rms_norm_eps, model.scale, False, bad)
