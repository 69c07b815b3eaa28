"""Comparisons with other systems and choices between libraries (``benchmarks/README.md``).

Not installed: the wheel is the product, and ``splitserve bench`` (load, report, cost) is in it
as the ``bench`` package. Run from the repository root: ``python -m benchmarks.<name>``. These
modules may import anything; nothing imports them (import-linter, ``pyproject.toml``).
"""
