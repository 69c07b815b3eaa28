"""Linear layers: the native panel GEMM and prepacked oneDNN GEMMs.

A float32 layer runs ``panel_linear`` (kernels/csrc/panel_gemm.cpp) on inputs of fewer rows
than :func:`panel_rows`: its weight is copied once, at the first such call, into column panels
read front to back by a register-blocked kernel.

* The AVX2 library: at every row count. On an AMD EPYC Zen 3 (2 cores, AVX2) the default
  model's 120 projections and LM head took, against the paths below, 17.2 ms against the
  GEMV's 18.8 at 1 row, 35 against oneDNN's 48 at 16 rows, 102 against 127 at 64, and 3.1 s
  against 3.5 s at 2048 (weights from memory as in a step).
* The AVX-512 library (12 rows x 32 columns per block): below 129 rows. On an AMD EPYC Zen 4
  (2 cores, AVX-512 executed as two 256-bit halves), the same layers took 13.1 ms against the
  GEMV's 19.9 at 1 row and 13.1 against oneDNN's 17.7 at 4. With the panel prefetched into
  L2 (2026-12-04, two runs each): 28-30 against 34 at 16 rows, 48-56 against 60-63 at 32,
  90-92 against 93-94 at 64, 176-192 against 197-200 at 128; from 144 rows on oneDNN's
  AVX-512 GEMM is as fast or faster (193-204 against 204-216 at 144, 349-364 against 368-371
  at 256), so it serves those. Such a layer keeps three copies of its weight (plain, panels,
  oneDNN's).

A weight a GGUF file stores in Q8_0 or Q4_1 blocks (the default model's) is handed over as a
``BlockWeight`` (engine/quant/linear.py), and calls of fewer than ``BLOCK_PANEL_ROWS`` rows
run it as block panels: per group of 32 keys the columns' scales and 8-bit integers, turned
back into float32 inside the kernel (kernels/csrc/panel_gemm.cpp). The numbers and the order
of the sums are the float32 panels', so the outputs are the same bits, from 1.25 bytes a
weight instead of 4. The conversion costs FMA-port time that more rows no longer repay: the
default model's decode step on the engine (Zen 4, AVX-512, medians, block / float32 panels)
at 1 thread took 21.0 / 25.0 ms at 4 rows, 29.0 / 27.3 at 6, 37.2 / 33.0 at 8, 62 / 59 at 16;
at 2 threads 25 / 27 at 8, 40 / 38.5 at 16; the 120 projections alone at 1 row 14.7 -> 5.2
ms (AVX-512), 14.3 -> 6.9 (AVX2). So from 5 rows the float32 panels serve, and such a layer
holds both (its block panels a third of the float32 panels' bytes). That crossover is the
CPU's: on an AMD EPYC Zen 5 (2 threads, the 120 projections, block / float32 panels) AVX-512
took 8.3 / 11.5 ms at 5 rows, 14.5 / 13.5 at 12 (one row block: conversion in registers),
13.4 / 15.2 at 16, and AVX2 9.5 / 14.1 at 5, 21.0 / 20.6 at 16. So the model's linears share a
``BlockRows`` choice per row count: below 5 rows until an idle engine has timed both forms on
them at 5 to 128 rows (``CALIBRATED_ROWS``, ``measure_block_rows``), then the faster there and
block panels below 5 always. Below 5 rows block panels took a third to a half of the float32
panels' time on every CPU measured (Zen 3 AVX2, Zen 4, Zen 5), and a timing taken while another
process computes on the same cores can still pick the float32 panels: two colocated clusters
started together, each worker timing both forms at once, left one worker with float32 panels
at 1 row in 3 of 4 starts, its c=1 ITL 13.8 ms against the other's 7.4 for its whole life.

Otherwise:

``F.linear`` on CPU runs MKL's sgemm, which repacks the whole weight into its blocked
layout on every call; at decode batch sizes that copy costs about as much as the
arithmetic (a quarter of a batch-64 decode step on the bench model, measured). Here the
weight is reordered into oneDNN's layout once, at its first packed call, and each call runs
oneDNN's GEMM on it (``torch.ops.mkldnn._linear_pointwise``, the op inductor uses for prepacked linears).

Without a panel route (no native library, or ``prepack=False``), a float32 input of fewer
rows than ``MIN_PACKED_ROWS`` runs ``F.linear``. (A native GEMV served those once; the panel
GEMM took its place at every row count it served, and it was removed.)

Where neither pays, the plain ``F.linear`` runs: float16, CUDA tensors, builds without
oneDNN or the native kernels, and bfloat16 on a CPU where oneDNN has no bfloat16 path (AVX2
only: :func:`onednn_has_bf16`). A float32 layer therefore keeps two copies of its weight
(the plain one and its panels or oneDNN's packing: twice the weight memory; three on AVX-512,
where a layer has both); a packed
bfloat16 layer keeps only the packed one.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator

import structlog
import torch
import torch.nn.functional as F

from engine.quant.linear import BlockWeight
from splitserve_kernels.native import native_kernels

# float32 rows below which the panel GEMM serves, per native library (module docstring); a
# library not named here has no panel route.
PANEL_ROWS: dict[str, float] = {"avx2": math.inf, "avx512": 129}
# Input rows below which a layer with GGUF blocks runs its block panels, not its float32
# panels, until its model has measured which serves each row count faster (BlockRows).
BLOCK_PANEL_ROWS = 5
# The row counts measure_block_rows times, and its rounds: every count from BLOCK_PANEL_ROWS to
# 24 (fewer rows always run the block panels: module docstring), then samples to 128, each
# standing for the counts above the sample before it; more rows run the float32 panels. On the
# Zen 5 (AVX-512, 2 threads, the default model's 120 projections, block / float32 panels) block
# panels were still 5-11% faster at 32-64 rows (17.5 / 19.7 ms at 32, 31.6 / 33.5 at 64) and
# 1-2% at 96-128.
CALIBRATED_ROWS = (*range(BLOCK_PANEL_ROWS, 25), 32, 48, 64, 96, 128)
CALIBRATION_ROUNDS = 3
# float32 rows from which oneDNN's packed GEMM serves where the panel GEMM does not; fewer run
# F.linear (MKL, 0.77x of oneDNN at 1-3 rows).
MIN_PACKED_ROWS = 4
log = structlog.get_logger(__name__)


def panel_rows(batch_invariant: bool = False) -> float:
    """float32 inputs of fewer rows than this run the native panel GEMM (0: none); with
    ``batch_invariant`` every row count, where the library has the panel GEMM at all
    (``EngineConfig.batch_invariant``)."""
    rows = PANEL_ROWS.get(native_kernels().variant or "", 0)
    return math.inf if batch_invariant and rows > 0 else rows


def panel_gemm() -> bool:
    """Whether float32 layers run the native panel GEMM at some row counts (module docstring)."""
    return panel_rows() > 0


def can_prepack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return onednn_has_bf16()
    return weight.dtype == torch.float32


@functools.cache
def onednn_has_bf16() -> bool:
    """Whether oneDNN runs bfloat16 on this CPU: it needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT
    (``ONEDNN_MAX_CPU_ISA=AVX2`` takes them away). Without, its reorder refuses bfloat16
    weights, so they stay unpacked and ``F.linear`` (ATen's own bfloat16 GEMM) serves them:
    slower, never a crash. Logged once."""
    supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if not supported:
        log.warning("bfloat16 linears unpacked: oneDNN has no bfloat16 path on this CPU "
                    "(it needs avx512bw/vl/dq or avx_ne_convert); ATen's GEMM serves them")
    return supported


class BlockRows:
    """Which input row counts run a model's GGUF block panels rather than its float32 panels:
    below ``BLOCK_PANEL_ROWS`` until ``table`` is set, then ``table[rows]`` for the rows it
    covers and the float32 panels beyond. Either form gives the same bits (module
    docstring), so this decides speed only. An idle engine measures both forms on the
    model's own linears and sets the table (``LlamaModel.preparations``): where the
    crossover lies depends on the CPU (Zen 4 and Zen 5 differ, and AVX2 from AVX-512)."""

    def __init__(self) -> None:
        self.table: tuple[bool, ...] | None = None

    def __call__(self, rows: int) -> bool:
        if self.table is None:
            return rows < BLOCK_PANEL_ROWS
        return rows < len(self.table) and self.table[rows]


def measure_block_rows(linears: list[Linear], policy: BlockRows, row_counts: tuple[int, ...] = CALIBRATED_ROWS,
                       rounds: int = CALIBRATION_ROUNDS) -> Iterator[str]:
    """Time ``linears``' block panels against their float32 panels at each of ``row_counts``
    (ascending) input rows, one form at one row count per step (the two forms alternate,
    ``rounds`` rounds), then set ``policy.table`` to the faster one per row count (each form's
    least time), a count that was not timed taking the next one timed above it, and fewer
    than ``BLOCK_PANEL_ROWS`` rows the block panels whatever was timed (module docstring).
    Linears without both forms are left out; with none, nothing is measured. The inputs are
    constants: the time does not depend on the values."""
    both = [lin for lin in linears if lin.block_panels is not None and lin.panels is not None]
    if not both:
        return
    least: dict[tuple[int, bool], float] = {}
    for _ in range(rounds):
        for rows in row_counts:
            inputs = {k: torch.full((rows, k), 0.5) for k in {lin.in_features for lin in both}}
            for blocks in (True, False):
                start = time.perf_counter()
                for lin in both:
                    weight = lin.block_panels if blocks else lin.panels
                    torch.ops.splitserve.panel_linear(inputs[lin.in_features], weight, lin.out_features, lin.bias)
                took = time.perf_counter() - start
                least[rows, blocks] = min(least.get((rows, blocks), math.inf), took)
                yield "block_rows"
    faster = {rows: least[rows, True] < least[rows, False] for rows in row_counts}
    policy.table = (False, *(rows < BLOCK_PANEL_ROWS or faster[min(n for n in row_counts if n >= rows)]
                             for rows in range(1, max(row_counts) + 1)))
    log.info("linear.block_rows", rows=[rows for rows in sorted({*range(1, BLOCK_PANEL_ROWS), *row_counts})
                                         if policy.table[rows]])


class Linear:
    """``y = x @ weight.T + bias`` for ``x [rows, in_features]``; ``weight [out, in]``.

    The weight is reordered for oneDNN at the first call that runs the packed GEMM, not at load:
    a worker is ready sooner (the reorders of every layer were the largest part of building the
    default model's engine after the GGUF fixes) and a layer only batch-1 decode reaches never
    pays it. Calls come from the one engine thread, so the lazy reorder needs no lock."""

    def __init__(self, weight: torch.Tensor | BlockWeight, bias: torch.Tensor | None = None,
                 prepack: bool = True, batch_invariant: bool = False) -> None:
        blocks = weight if isinstance(weight, BlockWeight) else None
        weight = blocks.dequantize() if blocks is not None else weight
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed: torch.Tensor | None = None  # set by the first packed call
        self.panels: torch.Tensor | None = None  # set by the first panel call
        self.block_panels: torch.Tensor | None = None  # set by the first block panel call
        self.weight: torch.Tensor | None = weight
        float32_cpu = weight.dtype == torch.float32 and weight.device.type == "cpu"
        self.panel_rows = panel_rows(batch_invariant) if prepack and float32_cpu else 0  # fewer rows: panels
        # GGUF blocks whose groups of 32 tile the input, where panels serve: block panels below
        # BLOCK_PANEL_ROWS rows (module docstring).
        self.blocks = blocks if self.panel_rows > 0 and self.in_features % 32 == 0 else None
        self.block_rows = BlockRows()  # the model shares one among its linears
        self.packable = prepack and can_prepack(weight) and self.panel_rows < math.inf
        self.min_packed_rows = MIN_PACKED_ROWS if float32_cpu else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        rows = x.shape[0]
        if rows < self.panel_rows and x.dim() == 2 and x.dtype == torch.float32:
            x = x if x.stride(-1) == 1 else x.contiguous()
            return torch.ops.splitserve.panel_linear(x, self.fused_weight(rows), self.out_features, self.bias)
        if self.packable and rows >= self.min_packed_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed(), self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def fused_rows(self) -> float:
        """Forwards of fewer rows than this can run the layer inside ``decoder_layers``
        (engine/models/llama.py): those the panel GEMM serves."""
        return self.panel_rows

    def fused_weight(self, rows: int) -> torch.Tensor:
        """The weight as the panel GEMM (and ``decoder_layers``) takes it for ``rows`` input
        rows: block panels where the layer has GGUF blocks and ``block_rows`` says so, else its
        float32 column panels. Either is made at its first call."""
        if not self.block_rows(rows) or (self.blocks is None and self.block_panels is None):
            return self.packed_panels()
        return self._block_panels()

    def _block_panels(self) -> torch.Tensor:
        """The GGUF blocks as block panels, made at the first call (the blocks then go)."""
        if self.block_panels is None:
            assert self.blocks is not None
            self.block_panels = torch.ops.splitserve.pack_block_panels(*self.blocks.parts())
            self.blocks = None
        return self.block_panels

    def packed_panels(self) -> torch.Tensor:
        """The weight in the panel GEMM's float32 column panels (``panel_rows``), copied at the
        first call."""
        if self.panels is None:
            self.panels = torch.ops.splitserve.pack_panels(self.weight)
        return self.panels

    def preparations(self) -> Iterator[str]:
        """Make, one per step, every form of the weight some row count's call would make at
        its first use (module docstring): oneDNN's packing, the block panels, the float32
        panels. Yields each form's name once it is made; the forms are the first call's, so the
        outputs are the same bits whether a form was made here or by a call."""
        if self.packable and self.weight is not None and self.packed is None:
            self._packed()
            yield "onednn"
        if self.blocks is not None and self.block_panels is None:
            self._block_panels()
            yield "block_panels"
        if self.panel_rows > 0 and self.weight is not None and self.panels is None:
            self.packed_panels()
            yield "panels"

    def _packed(self) -> torch.Tensor:
        if self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
            if self.weight.dtype == torch.bfloat16:
                self.weight = None  # oneDNN serves every row count
        return self.packed
