"""`buf lint` over protos/ with protos/buf.yaml: clean, and the linter really runs (a
contract that breaks a kept rule fails it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = shutil.which("buf") or next((str(p) for p in [ROOT / ".cache/buf/node_modules/.bin/buf"] if p.exists()), None)

pytestmark = pytest.mark.skipif(BUF is None, reason="buf not installed (make test installs it from npm)")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BUF, "lint", str(root)], capture_output=True, text=True, timeout=120, check=False)


def test_the_contracts_are_buf_lint_clean() -> None:
    result = _lint(ROOT / "protos")
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_rule_the_config_keeps_still_fails(tmp_path: Path) -> None:
    shutil.copy(ROOT / "protos" / "buf.yaml", tmp_path / "buf.yaml")
    proto = tmp_path / "splitserve_api" / "v1" / "extra.proto"
    proto.parent.mkdir(parents=True)
    proto.write_text('syntax = "proto3";\npackage splitserve.v1;\nmessage Extra {\n  uint32 camelCase = 1;\n}\n')
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert 'Field name "camelCase" should be lower_snake_case' in result.stdout, result.stdout
