"""The dependency rule of docs/architecture.md, enforced by import-linter (contracts in
pyproject.toml): command line -> services -> plumbing -> engine -> kernels, benchmarks on
top; the engine knows nothing of gRPC; the gateway never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout
