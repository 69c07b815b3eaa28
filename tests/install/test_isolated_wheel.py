"""A wheel built as users build it carries the native CPU kernels, and they load.

``pip wheel .`` with build isolation: pip installs pyproject.toml's build requirements (torch
among them; here the CPU wheel 2.13.0) into a throwaway environment, and setup.py compiles
kernels/csrc against that torch. The wheel then goes into a fresh venv with torch==2.13.0,
which loads the library and runs an operator against its torch reference, from outside the
source tree.

Kept cheap for CI (minutes on two cores): only the library this CPU loads is compiled
(``SPLITSERVE_NATIVE_VARIANTS``; the wheel a release ships, and tools/wheel_check.sh, build
them all), and the venv gets torch and structlog, what ``splitserve_kernels`` imports, not the wheel's
other dependencies. pip's cache serves torch to both environments.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TORCH_VERSION = "2.13.0"
CHECK = """
import torch
import splitserve_kernels
from splitserve_kernels import ops
from splitserve_kernels.elementwise import rms_norm_ref
from splitserve_kernels.native import _library_path, built_against, native_kernels
loaded = native_kernels()
assert loaded.available, loaded.reason
x, w = torch.randn(4, 64), torch.randn(64)
torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
print(loaded.variant, built_against(_library_path(loaded.variant)), torch.__version__, splitserve_kernels.__file__)
"""


def copy_tree(dest: Path) -> Path:
    """This checkout's tracked and untracked-but-not-ignored files (no build/ folder, no .so)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def run(cmd: list[str], **kwargs) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "SPLITSERVE_CPU_ISA")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**env, **kwargs.pop("env", {})}, **kwargs)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_a_wheel_built_with_build_isolation_loads_its_native_kernels(tmp_path: Path) -> None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}): the build could not compile the kernels")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the sources to build are the tracked files")
    variant = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "default")
    src = copy_tree(tmp_path / "src")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(src)],
        env={"SPLITSERVE_NATIVE_VARIANTS": variant}, timeout=1800)
    (wheel,) = (tmp_path / "dist").glob("splitserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert f"splitserve_kernels/_native_{variant}.torch" in names
    assert [n for n in names if n.startswith(f"splitserve_kernels/_native_{variant}.") and n.endswith(".so")]

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    run([*pip, f"torch=={TORCH_VERSION}", "structlog"], timeout=1200)
    run([*pip, "--no-deps", str(wheel)], timeout=300)
    out = run([str(venv / "bin" / "python"), "-c", CHECK], cwd=tmp_path, timeout=300).split()
    loaded, built, running, where = out
    assert loaded == variant
    assert built.split(".")[:2] == running.split(".")[:2] == TORCH_VERSION.split(".")[:2]  # the ABI it needs
    assert Path(where).is_relative_to(venv)
