"""The fuzz campaign's small profile (tests/fuzz): a few hundred hostile requests (structured,
wire-level, raw bytes, floods) to every RPC of the gateway and both workers, and the HTTP
family to the OpenAI front. No status a method does not document (never UNKNOWN/INTERNAL), no
HTTP 5xx, no error body that is not OpenAI's, no hang, no crash, no leaked block."""

from __future__ import annotations

import json

import pytest

from tests.fuzz.profile import SMALL
from tests.fuzz.run import run_fuzz

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fuzz")]


def test_small_fuzz_profile_finds_no_undocumented_status(tmp_path_factory: pytest.TempPathFactory) -> None:
    report = run_fuzz(SMALL, seed=0, log_dir=str(tmp_path_factory.mktemp("fuzz-logs")))
    figures = {k: report[k] for k in ("cases", "statuses", "undocumented_examples", "crashes", "leaked_blocks", "http")}
    assert report["cases"] >= 300
    assert report["undocumented"] == 0, json.dumps(figures, indent=1)
    assert not report["crashes"] and report["leaked_blocks"] == 0, json.dumps(figures, indent=1)
    assert report["statuses"].get("OK", 0) > 50  # valid requests got through, not only rejections
    http = report["http"]
    assert http["cases"] >= 60 and http["huge_bodies"] >= 2, json.dumps(figures, indent=1)
    assert http["problems"] == {"5xx": 0, "not_openai": 0, "hang": 0, "no_answer": 0, "not_413": 0}, \
        json.dumps(figures, indent=1)
    assert http["by_kind"]["huge"] == {"413": http["huge_bodies"]}
    assert http["by_kind"]["valid"].get("200", 0) >= 3 and http["by_kind"]["stream_cut"].get("200", 0) >= 3
    timing = {"heartbeat_never_late"}  # a timing on a shared machine: reported, not asserted here
    assert all(ok for name, ok in report["checks"].items() if name not in timing), json.dumps(report["checks"])
