"""An exception Python can only report, not raise (a ``__del__`` or a finalizer that failed,
e.g. while the process exits), comes out as one JSON line like every other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
from plumbing.logs import configure_logging

configure_logging("test", "info", json=True)

class Finalizer:
    def __del__(self):
        raise RuntimeError("raised in __del__")

Finalizer()
"""


def test_an_unraisable_exception_is_a_json_line() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (line,) = [json.loads(line) for line in out.stderr.splitlines() if line.strip()]
    assert line["event"] == "unraisable_exception" and "RuntimeError: raised in __del__" in line["exception"]
