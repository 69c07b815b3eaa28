"""benchmarks/serve_vs_vllm.py's pure parts: ``pair_summary`` (the paired c=1 ITL ratio over
pairs whose in-process requests took turns on several engine processes) and the wait for the
workers' preparation."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serve_vs_vllm import PREPARED, main, pair_summary, prepared_count, wait_prepared


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


def test_the_wait_is_for_one_more_prepared_line_than_each_log_had(tmp_path: Path) -> None:
    old, new = tmp_path / "decode-0.log", tmp_path / "prefill-0.log"
    assert prepared_count(old) == 0  # no file yet
    old.write_text(f'{{"event": "{PREPARED}"}}\n{{"event": "worker.stopped"}}\n')
    new.write_text("")
    before = {old: prepared_count(old), new: prepared_count(new)}
    assert before == {old: 1, new: 0}
    with pytest.raises(TimeoutError, match=PREPARED):
        wait_prepared(before, timeout_s=0.0)  # the line from the earlier run does not count
    with old.open("a") as f:
        f.write(f'{{"event": "{PREPARED}"}}\n')
    new.write_text(f'{{"event": "{PREPARED}"}}\n')
    wait_prepared(before, timeout_s=0.0)


def test_pairs_without_a_stepper_are_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--itl-pairs", "2", "--itl-steppers", "0"])
    assert exc.value.code == 2
    assert "--itl-steppers must be >= 1" in capsys.readouterr().err
