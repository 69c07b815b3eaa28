"""splitserve/process_env.py: the defaults a splitserve process sets in its own environment,
and that it sets them before gRPC or torch has loaded (else they do nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from splitserve import process_env

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_fill_only_what_the_environment_leaves_unset() -> None:
    assert process_env.defaults({}) == {"GRPC_VERBOSITY": "ERROR", "GOMP_SPINCOUNT": "20000", "MALLOC_ARENA_MAX": "1"}
    assert process_env.defaults({"GRPC_VERBOSITY": "DEBUG", "GOMP_SPINCOUNT": "5", "MALLOC_ARENA_MAX": "4"}) == {}
    # OMP_WAIT_POLICY has its own spin count: libgomp's reading of it is left alone
    assert process_env.defaults({"OMP_WAIT_POLICY": "passive"}) == {"GRPC_VERBOSITY": "ERROR", "MALLOC_ARENA_MAX": "1"}


def test_apply_sets_the_defaults_and_keeps_the_rest() -> None:
    environ = {"GOMP_SPINCOUNT": "7", "PATH": "/bin", "MALLOC_ARENA_MAX": "2"}
    process_env.apply(environ)
    assert environ == {"GOMP_SPINCOUNT": "7", "PATH": "/bin", "MALLOC_ARENA_MAX": "2", "GRPC_VERBOSITY": "ERROR"}


def test_main_applies_them_before_grpc_or_torch_loads() -> None:
    """A fresh interpreter: importing the command line loads neither library, and ``main``
    (here ``--help``, which exits in argument parsing) has set the defaults by then."""
    code = (
        "import json, os, sys\n"
        "import splitserve.cli as cli\n"
        "loaded = sorted(m for m in ('grpc', 'torch') if m in sys.modules)\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(json.dumps({{'loaded': loaded, 'env': {{k: os.environ.get(k) for k in {VARIABLES!r}}}}}))\n"
    )
    result = json.loads(_fresh_python(code).stdout.strip().splitlines()[-1])
    assert result == {"loaded": [], "env": {"GRPC_VERBOSITY": "ERROR", "GOMP_SPINCOUNT": "20000", "MALLOC_ARENA_MAX": "1"}}


VARIABLES = ("GRPC_VERBOSITY", "GOMP_SPINCOUNT", "MALLOC_ARENA_MAX")
# Three threads alive at once, each allocating, then glibc's own account of its arenas (one
# "Arena N:" block each, on stderr).
_THREADS_THEN_ARENAS = (
    "import ctypes, threading\n"
    "libc = ctypes.CDLL(None)\n"
    "libc.malloc.restype = ctypes.c_void_p\n"
    "libc.free.argtypes = [ctypes.c_void_p]\n"
    "barrier = threading.Barrier(4)\n"
    "def run():\n"
    "    libc.free(libc.malloc(1 << 20))\n"
    "    barrier.wait()\n"
    "threads = [threading.Thread(target=run) for _ in range(3)]\n"
    "[t.start() for t in threads]\n"
    "barrier.wait()\n"
    "[t.join() for t in threads]\n"
    "libc.malloc_stats()\n"
)


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (*VARIABLES, "OMP_WAIT_POLICY")}
    return subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)


def test_main_leaves_glibc_one_arena_for_every_thread() -> None:
    """``main`` asks glibc for one malloc arena in its own process (the variable is read only
    at start): threads started afterwards share it. Without that, the same threads get arenas
    of their own (the control)."""
    control = _fresh_python(_THREADS_THEN_ARENAS).stderr
    after_main = _fresh_python("import splitserve.cli as cli\n"
                               "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
                               + _THREADS_THEN_ARENAS).stderr
    assert control.count("Arena ") >= 2
    assert after_main.count("Arena ") == 1
