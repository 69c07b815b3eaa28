"""The dependency rule of docs/architecture.md, enforced by import-linter (contracts in
pyproject.toml): command line -> services -> plumbing -> engine -> kernels, bench above them
and benchmarks/ on top (nothing imports it; the installed packages never import the tests);
the engine knows nothing of gRPC; the gateway never imports torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def _copy_of_the_product(dest: Path) -> None:
    """The packages (benchmarks/ among them, and kernels/ with the kernels' package) and
    pyproject.toml (the contracts) in ``dest``, generated modules included."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests"} | {"kernels"}
    for name in packages:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


@pytest.mark.parametrize("module, imported", [
    ("engine/block_pool.py", "gateway.routing"),  # the engine importing the gateway
    ("bench/report.py", "benchmarks.peers"),  # the installed harness importing what is not installed
])
def test_an_import_up_a_layer_breaks_the_check(tmp_path: Path, module: str, imported: str) -> None:
    """The wrong-way demo: an import up a layer fails the check."""
    _copy_of_the_product(tmp_path)
    path = tmp_path / module
    path.write_text(path.read_text() + f"\nimport {imported}  # up a layer, on purpose\n")
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(tmp_path / "kernels")])}
    out = subprocess.run([str(lint), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 1, out.stdout[-2000:]
    importer = module.removesuffix(".py").replace("/", ".")
    assert f"{importer} -> {imported}" in out.stdout
