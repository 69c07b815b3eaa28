"""benchmarks.cold_start's own pieces: the ready wait on ``up``'s status file, the phases from
the services' logs, the clean stop, the busy core and the summary (no cluster or vLLM runs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import cold_start
from splitserve.progress import process_alive, write_status


class FakeUp:
    """What ``wait_ready`` asks of ``up``'s process."""

    def __init__(self, returncode: int | None = None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def test_wait_ready_returns_the_ready_status(tmp_path: Path) -> None:
    status = tmp_path / "up.status"
    write_status(str(status), "ready", gateway="127.0.0.1:7")
    assert cold_start.wait_ready(FakeUp(), status, timeout_s=1.0)["gateway"] == "127.0.0.1:7"


def test_wait_ready_raises_on_failed_exited_and_timed_out(tmp_path: Path) -> None:
    status = tmp_path / "up.status"
    write_status(str(status), "failed", error="decode-0 exited with code 1 before it was ready")
    with pytest.raises(RuntimeError, match="up failed: decode-0 exited with code 1"):
        cold_start.wait_ready(FakeUp(), status, timeout_s=1.0)
    write_status(str(status), "starting")
    with pytest.raises(RuntimeError, match="up exited with code 3 before it was ready"):
        cold_start.wait_ready(FakeUp(3), status, timeout_s=1.0)
    with pytest.raises(TimeoutError, match="not ready within 0.1 s"):
        cold_start.wait_ready(FakeUp(), status, timeout_s=0.1)


def _log(path: Path, *events: tuple[str, str, dict]) -> None:
    lines = ["not json: a library's line"]
    lines += [json.dumps({"event": name, "timestamp": ts, **fields}) for name, ts, fields in events]
    path.write_text("\n".join(lines) + "\n")


def test_phases_split_the_time_from_the_logs(tmp_path: Path) -> None:
    spawned_at = 1_800_000_000.0  # 2027-01-15T08:00:00Z
    _log(tmp_path / "gateway.log", ("gateway.listening", "2027-01-15T08:00:02.000000Z", {}))
    _log(tmp_path / "decode-0.log", ("worker.serving", "2027-01-15T08:00:07.500000Z", {"engine_load_s": 3.0}))
    _log(tmp_path / "prefill-0.log", ("worker.serving", "2027-01-15T08:00:08.000000Z", {"engine_load_s": 4.5}))
    _log(tmp_path / "up.log", ("up.ready", "2027-01-15T08:00:08.100000Z", {}))
    started = {"gateway": 0.25, "decode-0": 0.5, "prefill-0": 0.75}  # seconds after up started
    out = cold_start.phases(tmp_path, spawned_at, ready_s=8.25, started=started)
    assert out["gateway_started_s"] == 0.25 and out["gateway_listening_s"] == pytest.approx(2.0)
    assert out["workers"]["decode-0"] == pytest.approx(
        {"started_s": 0.5, "serving_s": 7.5, "engine_load_s": 3.0, "imports_s": 4.0})
    assert out["workers"]["prefill-0"] == pytest.approx(
        {"started_s": 0.75, "serving_s": 8.0, "engine_load_s": 4.5, "imports_s": 2.75})
    assert set(out["workers"]) == {"decode-0", "prefill-0"}
    assert out["last_worker_serving_s"] == pytest.approx(8.0)
    assert out["registration_s"] == pytest.approx(0.25)


def test_phases_of_a_start_that_never_got_far(tmp_path: Path) -> None:
    out = cold_start.phases(tmp_path, 0.0, ready_s=0.0)
    assert out == {"gateway_started_s": None, "gateway_listening_s": None, "workers": {},
                   "last_worker_serving_s": None, "registration_s": None}


# Like ``up``: a service process spawned a while after it, named by its role on its command line.
LIKE_UP = """
import subprocess, sys, time
time.sleep(0.5)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "splitserve.cli", "decode"])
time.sleep(30)
"""


def test_service_starts_finds_each_service_and_when_it_started() -> None:
    up = subprocess.Popen([sys.executable, "-c", LIKE_UP])
    try:
        deadline = time.monotonic() + 20
        while not cold_start.child_pids(up.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        children = cold_start.child_pids(up.pid)
        starts = cold_start.service_starts(up.pid, children)
    finally:
        for pid in cold_start.child_pids(up.pid):
            os.kill(pid, signal.SIGKILL)
        up.kill()
        up.wait()
    assert list(starts) == ["decode-0"] and len(children) == 1
    assert 0.5 <= starts["decode-0"] < 20


# A parent like ``up`` whose child ignores SIGINT and outlives it, as a leaked service would.
LEAKY_UP = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
child = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_stop_reports_and_kills_a_process_left_behind() -> None:
    proc = subprocess.Popen([sys.executable, "-c", LEAKY_UP], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    deadline = time.monotonic() + 10
    while child not in cold_start.child_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cold_start.child_pids(proc.pid) == [child]
    result = cold_start.stop(proc, [child], grace_s=10)
    assert result["exit_code"] == 0 and result["left_behind"] == [child]
    deadline = time.monotonic() + 10
    while process_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(child)
    assert not cold_start.round_ok({"ready_s": 1.0, "generate": {"ok": True}, "stop": result})
    assert cold_start.round_ok({"ready_s": 1.0, "generate": {"ok": True},
                                "stop": {**result, "left_behind": []}})


def test_busy_core_runs_a_busy_loop_and_ends_it() -> None:
    with cold_start.busy_core() as pid:
        assert process_alive(pid)
    assert not process_alive(pid)


def _round(ready_s: float, load: float, ok: bool = True) -> dict:
    return {"ok": ok, "ready_s": ready_s, "load_before": load - 0.5, "load_at_ready": load}


def test_summary_gives_the_spread_loads_and_goal() -> None:
    rounds = {"ours": [_round(6.0, 1.0), _round(12.0, 1.5), _round(8.0, 2.0), _round(1.0, 2.5, ok=False)],
              "ours_busy": [_round(14.0, 3.0)],
              "vllm": [{**_round(52.0, 2.0), "compile_cache": "hit"}]}
    figures, lines = cold_start.summary(rounds)
    assert figures["ours"]["ready_s"] == {"min": 6.0, "median": 8.0, "max": 12.0, "n": 3}
    assert figures["ours"]["ok"] == 3 and figures["ours"]["rounds"] == 4
    assert figures["ours"]["load_1m"] == [1.0, 1.5, 2.0, 2.5]
    assert figures["ours_busy"]["ready_s"]["median"] == 14.0
    assert figures["vllm"]["ready_s"]["median"] == 52.0
    assert figures["goal"] == {"what": "ours ready within 10 s (median)", "goal_s": 10.0, "median_s": 8.0,
                               "met": True}
    assert "| ours | 3/4 | 6.0 / 8.0 / 12.0 | 1.00, 1.50, 2.00, 2.50 |" in lines
    assert "| vllm (compile cache: hit) | 1/1 | 52.0 / 52.0 / 52.0 | 2.00 |" in lines
    assert figures["vllm"]["compile_cache"] == ["hit"] and "compile_cache" not in figures["ours"]
    assert lines[-1] == "goal: ours ready within 10 s: median 8.0 s -- met (load 1m 1.00, 1.50, 2.00, 2.50)"


def test_summary_of_a_missed_and_of_an_unmeasured_goal() -> None:
    figures, lines = cold_start.summary({"ours": [_round(11.0, 1.0)]})
    assert figures["goal"]["met"] is False and "MISSED" in lines[-1]
    assert "vllm" not in figures
    figures, lines = cold_start.summary({"ours": [_round(5.0, 1.0, ok=False)]})
    assert figures["ours"]["ready_s"] is None and figures["goal"]["met"] is None
    assert "| ours | 0/1 | failed | 1.00 |" in lines and "not measured" in lines[-1]


def test_flags() -> None:
    args = cold_start.parse_args(["--busy-core", "--skip-vllm"])
    assert args.rounds == 3 and args.busy_core and args.skip_vllm and args.vllm_rounds == 1
    with pytest.raises(SystemExit):
        cold_start.parse_args(["--rounds", "0"])


def test_the_compile_cache_is_read_from_vllms_log() -> None:
    saved = ("(Worker pid=11758) INFO 12-02 07:30:15 [decorators.py:743] [backbone] saved AOT compiled function "
             "to /root/.cache/vllm/torch_compile_cache/torch_aot_compile/42a38d/rank_0_0/model")
    loaded = "(Worker pid=9) INFO [decorators.py:320] [backbone] Directly load AOT compilation from path /root/.cache/x"
    assert cold_start.compile_cache_use(f"Starting to load model\n{saved}\n") == "miss"
    assert cold_start.compile_cache_use(f"Starting to load model\n{loaded}\n") == "hit"
    assert cold_start.compile_cache_use("Starting vLLM server on http://127.0.0.1:1\n") == "unknown"
