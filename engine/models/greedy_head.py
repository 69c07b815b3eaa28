"""Greedy tokens from a float32 LM head without every logit: a bfloat16 screen.

A greedy row's token is the argmax of its float32 logits. On a CPU with AVX512_BF16 the LM
head (the default model's 49152 x 576, a seventh of a decode step's FLOPs at batch 64, a
fifth of batch 1's weight bytes) first runs in bfloat16, at twice float32's rate and half its
bytes; a rigorous bound on that screen's error leaves the few tokens that could still be the
argmax, and only their float32 logits are computed, in the order the panel GEMM computes
them. The token is therefore the one ``argmax_rows(panel_linear(...))`` gives, bit for bit,
ties to the first (kernels/csrc/greedy_head.cpp has the bound and its proof).

It serves a float32 ``Linear`` on the native panel route with no bias; the bfloat16 copy of
the weight (half its memory again) and the norms of its rows are made at the first call, as
the layer's own panels are. Anything else, or a row the kernel declines (a hidden state or a
candidate's logit that is not finite), takes the logits and ``argmax``.
"""

from __future__ import annotations

import torch

from engine.models.linear import Linear
from splitserve_kernels.native import native_kernels

_COLS = 32  # tokens per bfloat16 panel (greedy_head.cpp)


def screen_available() -> bool:
    """Whether the loaded native library and this CPU run the screen (AVX512_BF16)."""
    lib = native_kernels()
    return lib.available and lib.variant == "avx512" and bool(torch.ops.splitserve.greedy_head_available())


class GreedyHead:
    """The screen over one LM head; ``tokens(x)`` is ``argmax(head(x))`` per row, or None."""

    def __init__(self, head: Linear) -> None:
        self.head = head
        self.panels16: torch.Tensor | None = None  # [P, ceil(K / 2), 32, 2] bfloat16, at the first call
        self.norms: torch.Tensor | None = None  # [vocab] float32: each row's L2 norm
        self.usable = True  # until the first call finds a weight that is not finite

    @classmethod
    def for_head(cls, head: object) -> GreedyHead | None:
        """A screen for ``head`` where one serves it (module docstring), else None."""
        if not isinstance(head, Linear) or head.bias is not None or head.fused_rows <= 0:
            return None
        weight = head.weight
        if weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        return cls(head) if screen_available() else None

    def _prepare(self) -> None:
        weight = self.head.weight
        assert weight is not None
        vocab, k = weight.shape
        k2, panels = (k + 1) // 2, -(-vocab // _COLS)
        padded = torch.zeros(panels * _COLS, 2 * k2, dtype=torch.bfloat16)
        padded[:vocab, :k] = weight  # rounded to nearest even, as the kernel's bound assumes
        self.panels16 = padded.view(panels, _COLS, k2, 2).permute(0, 2, 1, 3).contiguous()
        self.norms = weight.double().norm(dim=1).float()
        # A weight that is not finite gives logits argmax would pick as NaN: no screen for it.
        self.usable = bool(torch.isfinite(self.norms).all())

    def prepare(self) -> None:
        """Make the bfloat16 copy and the norms now (what the first call would)."""
        if self.panels16 is None:
            self._prepare()

    def tokens(self, x: torch.Tensor) -> torch.Tensor | None:  # [rows, K] -> [rows] int64
        """Each row's greedy token, or None when a row needs the logits (then none is given)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] >= self.head.fused_rows:
            return None  # more rows than the panels serve: the logits' bits come from oneDNN there
        self.prepare()
        if not self.usable:
            return None
        x = x.contiguous()
        tokens = torch.ops.splitserve.greedy_head(
            x, self.panels16, self.norms, self.head.packed_panels(), self.head.out_features
        )
        return None if bool((tokens < 0).any()) else tokens
