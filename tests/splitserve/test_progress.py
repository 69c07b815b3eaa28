"""Waiting for as long as processes make progress (splitserve/progress.py): ``up`` for its
services, ``generate --wait-for-up`` for ``up``; no fixed time, an exit or a stall ends it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plumbing.servers import read_ready_file, write_ready_file
from splitserve import cli, progress
from splitserve.client import wait_for_up
from splitserve.cluster import Cluster, wait_ready
from splitserve.progress import ProgressWatch, write_status


def spawn(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


def check_until_raises(watch: ProgressWatch, within_s: float) -> Exception:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            watch.check()
        except (RuntimeError, TimeoutError) as exc:
            return exc
        time.sleep(0.05)
    pytest.fail(f"no error within {within_s} s")


def test_an_exited_process_ends_the_wait_with_its_code() -> None:
    proc = spawn("import sys; sys.exit(3)")
    proc.wait(60)
    exc = check_until_raises(ProgressWatch({"prefill-0": proc}), 1)
    assert isinstance(exc, RuntimeError) and str(exc) == "prefill-0 exited with code 3 before it was ready"


def test_a_process_using_no_cpu_is_stuck() -> None:
    proc = spawn("import time; time.sleep(60)")
    try:
        time.sleep(0.5)  # past its start-up
        exc = check_until_raises(ProgressWatch({"decode-0": proc}, stall_s=1.0), 30)
        assert isinstance(exc, TimeoutError) and str(exc) == "decode-0 used no CPU for 1 s: stuck"
    finally:
        proc.kill()
        proc.wait()


def test_a_busy_process_is_waited_for_past_the_stall_time() -> None:
    proc = spawn("while True: pass")
    try:
        watch = ProgressWatch({"decode-0": proc}, stall_s=1.0)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            watch.check()  # raises if it ever looked stuck
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()


def test_wait_ready_has_no_fixed_time_but_gives_up_on_a_stuck_service(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(progress, "STALL_S", 1.0)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "gateway"])
    try:
        with pytest.raises(TimeoutError, match="gateway used no CPU for 1 s: stuck"):
            wait_ready(tmp_path / "never", proc)
    finally:
        proc.kill()
        proc.wait()


def test_wait_for_up_follows_the_status_file(tmp_path: Path) -> None:
    status = str(tmp_path / "up.status")
    with pytest.raises(TimeoutError, match="no status from splitserve up within 0.2 s"):
        wait_for_up(status, 0.2)
    write_status(status, "ready", gateway="127.0.0.1:5")
    assert wait_for_up(status, 0.2) == "127.0.0.1:5"
    write_status(status, "failed", error="decode-0 exited with code 1 before it was ready")
    with pytest.raises(RuntimeError, match=rf"up \(pid {os.getpid()}\) failed before it was ready: decode-0 exited"):
        wait_for_up(status, 0.2)


def test_wait_for_up_ends_when_up_died_starting(tmp_path: Path) -> None:
    dead = spawn("pass")
    dead.wait(60)
    status = tmp_path / "up.status"
    status.write_text(f'{{"state": "starting", "pid": {dead.pid}}}\n')
    with pytest.raises(RuntimeError, match=rf"up \(pid {dead.pid}\) exited before it was ready: see its log"):
        wait_for_up(str(status), 0.2)


def test_generate_reports_a_failed_up_and_exits_1(tmp_path: Path, capsys) -> None:
    status = str(tmp_path / "up.status")
    write_status(status, "failed", error="gateway exited with code 2 before it was ready")
    assert cli.main(["generate", "--wait-for-up", status, "--gateway", "127.0.0.1:1", "hello"]) == 1
    assert "failed before it was ready: gateway exited with code 2" in capsys.readouterr().err


def test_a_ready_file_names_each_surface_and_leaves_out_those_not_served(tmp_path: Path) -> None:
    path = tmp_path / "ready"
    write_ready_file(str(path), {"public": "127.0.0.1:5", "internal": "127.0.0.1:6", "health": None,
                                 "metrics": "[::1]:7"})
    assert read_ready_file(path.read_text()) == {"public": "127.0.0.1:5", "internal": "127.0.0.1:6",
                                                 "metrics": "[::1]:7"}
    assert not (tmp_path / "ready.tmp").exists()


def test_a_service_that_exits_before_it_is_ready_fails_the_start_with_its_log_end(tmp_path: Path) -> None:
    cluster = Cluster("unused", log_dir=str(tmp_path))
    proc, ready = cluster._spawn("decode-0", "no-such-role", [])  # the CLI refuses it and exits 2
    with pytest.raises(RuntimeError, match=r"(?s)no-such-role exited with code 2 before it was ready; "
                                           r"its log ends:\n.*invalid choice: 'no-such-role'"):
        cluster._ready("decode-0", proc, ready, 60)
