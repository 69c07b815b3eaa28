"""A house a newcomer reads in an hour: no import cycle between modules, no function over 60
lines (Triton kernels aside). Imports that run up a layer are import-linter's job
(tests/test_layers.py). A long module that reads straight is fine; a cycle is not: two
modules that import each other cannot be read, tested or replaced one at a time."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
# Every package and its folder: the top-level ones (a folder with an __init__.py: the product,
# bench, benchmarks), the kernels' package inside kernels/, the scripts, and the packages of the
# test tree that are programs too (the chaos and fuzz campaigns).
FOLDERS = ({p.parent.name: p.parent for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests"}
           | {p.parent.name: p.parent for p in ROOT.glob("kernels/*/__init__.py")} | {"tools": ROOT / "tools"}
           | {f"tests.{p.parent.name}": p.parent for p in ROOT.glob("tests/*/__init__.py")})
PACKAGES = sorted(FOLDERS)
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    return sorted(p for folder in FOLDERS.values() for p in folder.rglob("*.py") if "_pb2" not in p.name)


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def import_cycles(modules: Iterable[str], imports: Callable[[str], set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative): each is a
    set of modules that all reach each other through imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(imports(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(imports(child)))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return cycles


def test_the_product_packages_are_all_checked() -> None:
    assert {"engine", "gateway", "splitserve_kernels", "plumbing", "splitserve", "tools", "bench", "benchmarks",
            "tests.chaos", "tests.fuzz"} <= set(PACKAGES), PACKAGES


def test_import_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert import_cycles(graph, graph.__getitem__) == [["a", "b", "c"]]


def test_no_import_cycle_between_modules() -> None:
    # Imports under TYPE_CHECKING count: a reader follows them just the same.
    packages = [p for p in PACKAGES if (FOLDERS[p] / "__init__.py").exists()]
    graph = grimp.build_graph(*packages, exclude_type_checking_imports=False)
    cycles = import_cycles(graph.modules, graph.find_modules_directly_imported_by)
    assert not cycles, cycles


def test_no_function_over_60_lines() -> None:
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                num_lines = node.end_lineno - node.lineno + 1
                if num_lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = num_lines
    assert not long, long
