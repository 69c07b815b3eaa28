"""The chaos campaign's small profile (tests/chaos): a 2-prefill + 2-decode cluster under load,
every fault type once (SIGSTOP of each role; kill -9 of each role at each phase, restarted on
its address). The zeros: no leaked block, no reply differing from its golden reply, no hang,
no UNKNOWN/INTERNAL, no crash, every restarted process back in routing within 2 s."""

from __future__ import annotations

import json

import pytest

from tests.chaos.profile import SMALL
from tests.chaos.run import run_chaos

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("chaos")]


def test_small_chaos_profile_shows_the_zeros(tmp_path_factory: pytest.TempPathFactory) -> None:
    report = run_chaos(SMALL, seed=0, log_dir=str(tmp_path_factory.mktemp("chaos-logs")))
    figures = {k: report[k] for k in ("requests", "statuses", "hangs", "leaked_blocks", "mismatches",
                                      "mismatch_examples", "crashes", "faults", "migration", "errors_by_detail")}
    assert report["checks"] == dict.fromkeys(report["checks"], True), json.dumps(figures, indent=1, default=str)
    assert report["requests"]["chaos"] >= SMALL.min_requests
    assert report["faults"]["fired"] == SMALL.num_faults
    assert report["migration"]["completed_ok"] >= 1  # the mid-decode kill of a decode worker migrated streams
