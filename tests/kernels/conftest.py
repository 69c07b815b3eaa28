"""Kernel tests run the Triton kernels on CPU tensors under Triton's interpreter.

Triton 3.x reads ``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``) in ``triton.jit``,
i.e. whenever a jit function is *defined*: Triton's own library functions (``tl.zeros``,
``tl.sum``, ...) when ``triton`` is imported, our kernels when ``kernels.*`` is imported.
So it must be set before anything imports triton in this process. It is set here; when a
test module collected earlier has already imported triton without it, collection stops
with an error saying so (set ``TRITON_INTERPRET=1`` in tests/conftest.py or the shell).
test_paged_attention.py::test_kernel_is_interpreted checks that it took effect.
"""

import os
import sys
from collections.abc import Callable

os.environ["TRITON_INTERPRET"] = "1"


def _triton_imported_without_interpreter() -> bool:
    standard = sys.modules.get("triton.language.standard")
    return standard is not None and type(standard.zeros).__name__ != "InterpretedFunction"


if _triton_imported_without_interpreter():
    raise RuntimeError(
        "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1, so the "
        "kernels cannot run on CPU; set TRITON_INTERPRET=1 earlier (tests/conftest.py or the shell)"
    )

import pytest  # noqa: E402

from splitserve_kernels.testing import PagedBatch, make_paged_batch  # noqa: E402  (shared with bench.gpu)


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    return make_paged_batch
