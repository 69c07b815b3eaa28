"""The bookkeeping every benchmark shares: load average around a measurement, the commit,
the report header and the JSON writer."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.machine import git_commit, load_average, load_window
from bench.report import header, write_json

ROOT = Path(__file__).resolve().parents[2]


def test_load_window_records_before_and_after_even_on_failure() -> None:
    with load_window() as load:
        assert set(load) == {"before"}
    assert set(load) == {"before", "after"} and all(isinstance(v, float) for v in load.values())
    with pytest.raises(RuntimeError), load_window() as failed:
        raise RuntimeError("the measured system failed")
    assert isinstance(failed["after"], float)
    assert isinstance(load_average(), float)


def test_git_commit_is_this_checkouts_head() -> None:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert git_commit() == head.stdout.strip()


def test_header_and_json_report(tmp_path: Path) -> None:
    head = header("unit", 3, ["python", "-m", "bench.unit"])
    assert {"benchmark", "command", "timestamp", "git_commit", "splitserve_version", "machine"} <= set(head)
    assert head["benchmark"] == "unit" and head["command"] == ["python", "-m", "bench.unit"]
    assert head["machine"]["torch_num_threads"] == 3 and head["machine"]["cpu_count"] >= 1
    path = write_json({**head, "figures": {"x": 1.5}}, tmp_path / "new" / "r.json")
    assert path == tmp_path / "new" / "r.json"
    assert json.loads(path.read_text())["figures"] == {"x": 1.5}
