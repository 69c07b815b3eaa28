"""Waiting on processes for as long as they make progress, not for a fixed time.

A worker loading a model burns CPU the whole time; a busy machine slows it (63 s once, where
33 s another time), it does not stop it. So ``splitserve up`` waits for its services, and
``splitserve generate --wait-for-up`` for ``up``, while the processes are alive and their CPU
time keeps moving, and gives up at once when one exits, or when none has used any CPU for
``STALL_S`` (stuck, not slow). Where ``/proc`` is missing only exits count.

``up``'s status file (``--status-file``) is how a client sees that progress: JSON with
``state`` (``starting``, ``ready``, ``failed``, ``stopped``), ``pid`` and, once ready, the
``gateway`` address; written atomically, so a reader never sees half of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

STALL_S = 120.0  # no CPU time used by any watched process for this long: stuck


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds ``pid`` has used (Linux ``/proc``); None where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ProgressWatch:
    """``check()`` raises ``RuntimeError`` once a watched process has exited, and
    ``TimeoutError`` once none of them has used CPU time for ``stall_s``."""

    def __init__(self, procs: dict[str, subprocess.Popen[bytes]], stall_s: float | None = None) -> None:
        self.procs = procs
        self.stall_s = STALL_S if stall_s is None else stall_s
        self._cpu: float | None = None
        self._moved_at = time.monotonic()

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} before it was ready")
        used = [cpu_seconds(proc.pid) for proc in self.procs.values()]
        if None in used:
            return  # no /proc: alive is all we know
        total = sum(used)  # type: ignore[arg-type]
        now = time.monotonic()
        if total != self._cpu:
            self._cpu, self._moved_at = total, now
        elif now - self._moved_at > self.stall_s:
            raise TimeoutError(f"{', '.join(self.procs)} used no CPU for {self.stall_s:.0f} s: stuck")


def write_status(path: str | None, state: str, **fields: object) -> None:
    """Replace ``up``'s status file (when it has one) with ``state`` and ``fields``."""
    if path is None:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"state": state, "pid": os.getpid(), **fields}) + "\n")
    os.replace(tmp, path)


def read_status(path: str) -> dict | None:
    """``up``'s status, or None while its file is not there yet."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
