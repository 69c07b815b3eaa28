"""The fuzz campaign's small profile (bench/fuzz): a few hundred hostile requests (structured,
wire-level, raw bytes, floods) to every RPC of the gateway and both workers. No status a
method does not document (never UNKNOWN/INTERNAL), no crash, no leaked block."""

from __future__ import annotations

import json

import pytest

from bench.fuzz.profile import SMALL
from bench.fuzz.run import run_fuzz

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fuzz")]


def test_small_fuzz_profile_finds_no_undocumented_status(tmp_path_factory: pytest.TempPathFactory) -> None:
    report = run_fuzz(SMALL, seed=0, log_dir=str(tmp_path_factory.mktemp("fuzz-logs")))
    figures = {k: report[k] for k in ("cases", "statuses", "undocumented_examples", "crashes", "leaked_blocks")}
    assert report["cases"] >= 300
    assert report["undocumented"] == 0, json.dumps(figures, indent=1)
    assert not report["crashes"] and report["leaked_blocks"] == 0, json.dumps(figures, indent=1)
    assert report["statuses"].get("OK", 0) > 50  # valid requests got through, not only rejections
