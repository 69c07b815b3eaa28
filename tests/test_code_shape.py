"""A house a newcomer reads in an hour: no function over 60 lines (Triton kernels aside)
and no module over 400 lines in the product's packages."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Every top-level package of the product (a folder with an __init__.py), tests aside, and the scripts.
PACKAGES = sorted({p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests"} | {"tools"})
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name)


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def test_the_product_packages_are_all_checked() -> None:
    assert {"engine", "gateway", "kernels", "plumbing", "splitserve", "tools"} <= set(PACKAGES), PACKAGES


def test_no_module_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_no_function_over_60_lines() -> None:
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                num_lines = node.end_lineno - node.lineno + 1
                if num_lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = num_lines
    assert not long, long
