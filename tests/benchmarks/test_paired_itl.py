"""benchmarks/serve_vs_vllm.py's ``pair_summary``: the paired c=1 ITL ratio over pairs whose
in-process requests took turns on several engine processes."""

from __future__ import annotations

import pytest

from benchmarks.serve_vs_vllm import pair_summary


def test_the_ratio_pools_every_pair_and_each_stepper_is_reported_apart() -> None:
    # Stepper 0 ran pairs 0 and 2, stepper 1 pair 1; seconds in, ms out.
    pairs = [(0, [0.007, 0.008, 0.009], [0.006, 0.006]),
             (1, [0.010], [0.005, 0.007, 0.009]),
             (0, [0.007], [0.008])]
    summary = pair_summary(pairs)
    assert [p["stepper"] for p in summary["pairs"]] == [0, 1, 0]
    assert [p["itl_p50_ms"] for p in summary["pairs"]] == pytest.approx([8.0, 10.0, 7.0])
    assert [p["step_p50_ms"] for p in summary["pairs"]] == pytest.approx([6.0, 7.0, 8.0])
    # stepper 0: steps 6, 6, 8 -> 6; stepper 1: 5, 7, 9 -> 7
    assert summary["stepper_step_p50_ms"] == pytest.approx([6.0, 7.0])
    # every ITL (7, 8, 9, 10, 7 -> 8) against every step (6, 6, 5, 7, 9, 8 -> 6.5)
    assert summary["itl_p50_ms"] == pytest.approx(8.0)
    assert summary["step_p50_ms"] == pytest.approx(6.5)
    assert summary["ratio"] == pytest.approx(8.0 / 6.5)
