"""Triton, imported once and guarded, for the kernel files.

On a machine without Triton the kernel files must still import (their torch references
are the CPU path), so a missing Triton is replaced by stand-ins: ``triton.jit`` returns a
kernel that refuses to launch, and ``tl.constexpr`` exists for the annotations.

``TRITON_INTERPRET`` is read by ``triton.jit`` when a kernel is *defined*, i.e. when a
kernel module is imported: set it before importing ``kernels.*`` (tests/kernels/conftest.py
does, and reloads kernel modules imported before it).
"""

from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install: only the torch references are usable
    HAS_TRITON = False

    class _MissingKernel:
        def __init__(self, fn: Callable[..., Any]) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            raise RuntimeError(f"triton is not installed: cannot launch {self.fn.__name__}")

    class _MissingLanguage:
        constexpr = Any

    class _MissingTriton:
        language = _MissingLanguage()

        @staticmethod
        def jit(fn: Callable[..., Any] | None = None, **_: Any) -> Any:
            if fn is None:
                return _MissingKernel
            return _MissingKernel(fn)

    triton = _MissingTriton()  # type: ignore[assignment]
    tl = triton.language  # type: ignore[assignment]


def require_triton() -> None:
    """Raise a clear error in a Triton launcher when Triton is not installed."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the *_ref function instead")


__all__ = ["HAS_TRITON", "require_triton", "tl", "triton"]
