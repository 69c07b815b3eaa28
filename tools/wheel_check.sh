#!/usr/bin/env bash
# `splitserve bench --profile tiny` from the wheel, in a fresh venv, outside the source tree.
#
#   tools/wheel_check.sh            (or: make wheel-check)
#
# Builds the wheel as users do, with build isolation (pip installs pyproject.toml's build
# requirements, torch among them, into a throwaway environment and compiles the native CPU
# kernels against it), from this tree's tracked and untracked-but-not-ignored files (a copy,
# so no stale build/ folder leaks in), installs torch's CPU wheel and the wheel with all its
# dependencies into a new venv under a temporary folder, then, from that folder, runs
# `splitserve bench --help` and `splitserve bench --profile tiny`, and checks that the
# project's packages were imported from the venv, that the native kernels loaded (where a C++
# compiler is here to build them) and that the report has no figure problems.
# Takes a few minutes and ~3 GB (torch, triton, NCCL); the test suite runs the same path with
# the dependencies shared (tests/bench/test_bench_e2e.py). KEEP=1 keeps the folder.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/splitserve-wheel-XXXXXX")
if [[ "${KEEP:-0}" != 1 ]]; then trap 'rm -rf "$WORK"' EXIT; fi
say() { echo "[wheel-check] $*" >&2; }

say "copying the tree to $WORK/src"
mkdir -p "$WORK/src"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do if [[ -e "$f" ]]; then cp --parents "$f" "$WORK/src/"; fi; done)
say "building the wheel (build isolation)"
"$PYTHON" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
say "installing torch==$TORCH_VERSION and the wheel into a fresh venv"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "torch==$TORCH_VERSION"
"$WORK/venv/bin/pip" install -q "$WORK"/dist/splitserve-*.whl

cd "$WORK"
unset PYTHONPATH SPLITSERVE_MODEL
"$WORK/venv/bin/splitserve" bench --help > /dev/null
say "splitserve bench --profile tiny (from $WORK)"
"$WORK/venv/bin/splitserve" bench --profile tiny --no-progress --out "$WORK/report"
"$WORK/venv/bin/python" - "$WORK" <<'EOF'
import json
import sys
from pathlib import Path

import os
import shutil

import bench
import engine
from bench.report import figure_problems
from splitserve_kernels.native import native_kernels

work = Path(sys.argv[1])
for module in (bench, engine):
    assert Path(module.__file__).is_relative_to(work / "venv"), module.__file__
if shutil.which(os.environ.get("CXX", "c++")):
    assert native_kernels().available, native_kernels().reason
report = json.loads((work / "report" / "report.json").read_text())
problems = figure_problems(report) + report["failures"]
assert not problems, problems
print(f"[wheel-check] ok: splitserve {report['splitserve_version']} from {Path(bench.__file__).parent}, "
      f"native kernels {native_kernels().variant}, "
      f"report {work / 'report' / 'report.md'}", file=sys.stderr)
EOF
