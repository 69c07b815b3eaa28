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
    assert process_env.defaults({}) == {"GRPC_VERBOSITY": "ERROR", "GOMP_SPINCOUNT": "20000"}
    assert process_env.defaults({"GRPC_VERBOSITY": "DEBUG", "GOMP_SPINCOUNT": "5"}) == {}
    # OMP_WAIT_POLICY has its own spin count: libgomp's reading of it is left alone
    assert process_env.defaults({"OMP_WAIT_POLICY": "passive"}) == {"GRPC_VERBOSITY": "ERROR"}


def test_apply_sets_the_defaults_and_keeps_the_rest() -> None:
    environ = {"GOMP_SPINCOUNT": "7", "PATH": "/bin"}
    process_env.apply(environ)
    assert environ == {"GOMP_SPINCOUNT": "7", "PATH": "/bin", "GRPC_VERBOSITY": "ERROR"}


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
        "print(json.dumps({'loaded': loaded, 'env': {k: os.environ.get(k) for k in ('GRPC_VERBOSITY', 'GOMP_SPINCOUNT')}}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_VERBOSITY", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"loaded": [], "env": {"GRPC_VERBOSITY": "ERROR", "GOMP_SPINCOUNT": "20000"}}
