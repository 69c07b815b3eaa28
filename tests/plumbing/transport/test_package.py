"""``import plumbing.transport`` stays light: no torch, no NCCL library loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_import_loads_neither_torch_nor_nccl() -> None:
    code = (
        "import sys, plumbing.transport as t\n"
        "assert t.TransportKind.NCCL.value == 'nccl'\n"
        "heavy = [m for m in ('torch', 'plumbing.transport.gloo', 'plumbing.transport.nccl')\n"
        "         if m in sys.modules]\n"
        "nccl = [l for l in open('/proc/self/maps') if 'libnccl' in l]\n"
        "print(heavy, len(nccl))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[] 0"
