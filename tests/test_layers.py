"""The dependency rule of docs/architecture.md, enforced by import-linter (contracts in
pyproject.toml): command line -> services -> plumbing -> engine -> kernels, benchmarks on
top; the engine knows nothing of gRPC; the gateway never imports torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def _copy_of_the_product(dest: Path) -> None:
    """The packages and pyproject.toml (the contracts) in ``dest``, generated modules included."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests"}
    for name in packages:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def test_an_import_up_a_layer_breaks_the_check(tmp_path: Path) -> None:
    """The wrong-way demo: the engine importing the gateway fails the layers contract."""
    _copy_of_the_product(tmp_path)
    module = tmp_path / "engine" / "block_pool.py"
    module.write_text(module.read_text() + "\nimport gateway.routing  # up a layer, on purpose\n")
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([str(lint), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 1, out.stdout[-2000:]
    assert "engine.block_pool -> gateway.routing" in out.stdout
