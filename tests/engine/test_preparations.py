"""Engine.prepare_some (what an idle engine thread runs): every packed form of every linear
made ahead of its first call, and not one output bit changed by it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.models.linear import CALIBRATED_ROWS, BlockRows, Linear, measure_block_rows
from splitserve_kernels.native import native_kernels
from tests.engine.gguf_files import checkpoint_to_gguf

needs_native = pytest.mark.skipif(not native_kernels().available, reason="the packed forms are the native kernels'")
# Each form of the weight serves some of these steps (engine/models/linear.py): six short prompts
# (a 71-row prefill and 6-row decodes: float32 panels), one of 160 tokens (oneDNN from 129 rows
# on AVX-512) decoded alone (1 row: block panels).
SHORT = [[5, 17, 300, 42, 7, 99, 1, 250], [3] * 20, list(range(40, 52)), [9] * 9, list(range(100, 115)), [11] * 7]
LONG = [[(7 * i) % 500 + 3 for i in range(160)]]


def _linears(engine: Engine) -> list[Linear]:
    model = engine.runner.model
    found = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return [lin for lin in [*found, model.lm_head] if isinstance(lin, Linear)]


def _prepare_all(engine: Engine) -> int:
    pieces = 0
    while engine.prepare_some():
        pieces += 1
        assert pieces < 10_000
    return pieces + 1


@needs_native
def test_prepared_engine_has_every_form_and_the_same_outputs(tmp_path: Path, ckpt_dir: Callable[..., Path]) -> None:
    path = str(checkpoint_to_gguf(ckpt_dir("llama"), tmp_path / "m.gguf", qtype="Q4_1"))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    prepared = Engine(EngineConfig(model=path, num_kv_blocks=64))
    linears = _linears(prepared)
    assert linears and all(lin.panels is None and lin.block_panels is None and lin.packed is None for lin in linears)
    pieces = _prepare_all(prepared)
    for lin in linears:
        assert lin.panels is not None  # float32 panels (rows from BLOCK_PANEL_ROWS)
        assert lin.block_panels is not None and lin.blocks is None  # the file's Q4_1 blocks (fewer rows)
        assert (lin.packed is not None) == lin.packable  # oneDNN's packing where it serves some rows
    head = prepared.runner.model.greedy_head
    assert head is None or head.panels16 is not None
    table = prepared.runner.model.block_rows.table  # measured: which form serves each row count
    assert table is not None and len(table) == max(CALIBRATED_ROWS) + 1 and not table[0]
    assert all(lin.block_rows is prepared.runner.model.block_rows for lin in linears)
    assert pieces >= 2 * len(linears)
    assert not prepared.prepare_some()  # nothing is made twice
    fresh = Engine(EngineConfig(model=path, num_kv_blocks=64))
    for prompts in (SHORT, LONG):
        got, want = prepared.generate(prompts, params), fresh.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.logprobs for o in got] == [o.logprobs for o in want]  # bit for bit


def test_a_checkpoint_without_blocks_gets_panels_and_no_block_panels(ckpt_dir: Callable[..., Path]) -> None:
    engine = Engine(EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=64))  # safetensors: no GGUF blocks
    engine.prepare()  # every piece at once
    assert not engine.prepare_some()
    for lin in _linears(engine):
        assert lin.block_panels is None
        assert (lin.panels is not None) == (lin.panel_rows > 0)
        assert (lin.packed is not None) == lin.packable


@needs_native
def test_the_block_rows_table_picks_the_form_and_either_gives_the_same_bits(
        tmp_path: Path, ckpt_dir: Callable[..., Path]) -> None:
    # Whatever the measurement picks, the outputs are the same: an engine running block
    # panels at every row count the table covers and one running float32 panels there.
    path = str(checkpoint_to_gguf(ckpt_dir("llama"), tmp_path / "m.gguf", qtype="Q4_1"))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    engines = [Engine(EngineConfig(model=path, num_kv_blocks=64)) for _ in range(2)]
    for engine, use_blocks in zip(engines, (True, False)):
        engine.runner.model.block_rows.table = (False, *([use_blocks] * max(CALIBRATED_ROWS)))
    lin = _linears(engines[0])[0]
    assert lin.fused_weight(6).dtype == torch.uint8 and lin.fused_weight(max(CALIBRATED_ROWS) + 1).dtype == torch.float32
    assert _linears(engines[1])[0].fused_weight(1).dtype == torch.float32
    got, want = (engine.generate(SHORT + LONG, params) for engine in engines)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]


def test_block_rows_default_and_no_measurement_without_both_forms(ckpt_dir: Callable[..., Path]) -> None:
    policy = BlockRows()
    assert [policy(r) for r in (1, 4, 5, 64)] == [True, True, False, False]  # BLOCK_PANEL_ROWS = 5
    engine = Engine(EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=64))  # no GGUF blocks
    assert list(measure_block_rows(_linears(engine), policy)) == [] and policy.table is None
    policy.table = (False, False, True)
    assert [policy(r) for r in (1, 2, 3, 64)] == [False, True, False, False]


@needs_native
def test_row_counts_between_those_timed_take_the_next_one_timed(
        tmp_path: Path, ckpt_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(checkpoint_to_gguf(ckpt_dir("llama"), tmp_path / "m.gguf", qtype="Q4_1"))
    linears = [lin for lin in _linears(Engine(EngineConfig(model=path, num_kv_blocks=64))) if lin.blocks is not None]
    for lin in linears:
        lin.packed_panels()
        lin.fused_weight(1)  # the block panels
    # A clock under which block panels take 2 s and float32 panels 1 s at 6 rows, the reverse
    # at 9: rows 5-6 take 6's answer, 7-9 take 9's, and 1-4 run the block panels whatever was
    # timed (a clock that favoured float32 panels there, as another process on the same cores
    # once made it, is not asked).
    ticks = iter([0, 2, 2, 3, 3, 4, 4, 6])
    monkeypatch.setattr("engine.models.linear.time.perf_counter", lambda: next(ticks))
    policy = BlockRows()
    assert list(measure_block_rows(linears, policy, row_counts=(6, 9), rounds=1)) == ["block_rows"] * 4
    assert policy.table == (False, True, True, True, True, False, False, True, True, True)
