"""Build hooks: protobuf modules from protos/, and the native CPU kernels from kernels/csrc/.

Everything else lives in pyproject.toml. Generated code is never committed; it is
written here at build time (wheel, sdist, editable install) and by ``make setup``.

The native kernels are a torch C++ extension, built against the torch of the build
environment: in an isolated build (``pip install .``, ``pip wheel .``) the one pip installs
from ``[build-system] requires`` (torch>=2.5,<2.14), with ``--no-build-isolation`` the one
already installed (the Makefile's way). One library is built per CPU capability from the
same source (``splitserve_kernels._native_avx512``, ``splitserve_kernels._native_avx2`` on x86-64,
``splitserve_kernels._native_default`` elsewhere), each beside a ``.torch`` file naming that torch
version; ``kernels/splitserve_kernels/native.py`` loads the best one the CPU runs and refuses a library built
against another torch minor version. ``SPLITSERVE_NATIVE_VARIANTS=avx2`` (comma-separated)
builds only those. A build failure, or no torch at build time, is a warning, never a failed
install: the torch references serve, and tests/kernels fail where a compiler was there.
"""

import importlib.util
import os
import platform
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
NATIVE_SOURCES = [
    "kernels/csrc/argmax.cpp",
    "kernels/csrc/attention_plan.cpp",
    "kernels/csrc/decoder_layer.cpp",
    "kernels/csrc/elementwise.cpp",
    "kernels/csrc/greedy_head.cpp",
    "kernels/csrc/kv_int8.cpp",
    "kernels/csrc/paged_attention.cpp",
    "kernels/csrc/paged_attention_args.cpp",
    "kernels/csrc/panel_gemm.cpp",
    "kernels/csrc/quant_matmul.cpp",
    "kernels/csrc/write_kv.cpp",
    "kernels/csrc/register.cpp",
    "kernels/csrc/threads.cpp",
]
# Per variant: the defines ATen's vector headers select on, and the instruction sets.
NATIVE_VARIANTS = {
    "avx512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw",
               "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "default": ["-DCPU_CAPABILITY=DEFAULT"],
}


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        spec = importlib.util.spec_from_file_location("_protogen", ROOT / "splitserve_api" / "protogen.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.generate(ROOT)
        super().run()


def native_extensions() -> list:
    """The kernel libraries this machine's compiler can target; none without torch."""
    if os.environ.get("SPLITSERVE_SKIP_NATIVE") == "1":
        return []
    try:
        from torch.utils.cpp_extension import CppExtension
    except ImportError:
        return []
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    names = ["avx512", "avx2"] if x86 else ["default"]
    wanted = os.environ.get("SPLITSERVE_NATIVE_VARIANTS")
    if wanted:
        names = [name for name in names if name in wanted.split(",")]
    return [
        CppExtension(
            f"splitserve_kernels._native_{name}",
            NATIVE_SOURCES,
            # No FMA contraction: the elementwise ops round as their torch references do.
            extra_compile_args=["-O3", "-g0", "-DNDEBUG", "-fopenmp", "-ffp-contract=off",
                                *NATIVE_VARIANTS[name]],
            extra_link_args=["-fopenmp"],
        )
        for name in names
    ]


def _build_ext_base() -> type:
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        return build_ext
    return BuildExtension.with_options(use_ninja=True)


class OptionalBuildExt(_build_ext_base()):
    """Builds each kernel library in its own temp dir (the variants share sources); a
    library that fails to build is skipped with a warning."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler, wrong toolchain: the references serve
            self.warn(f"native CPU kernels not built ({exc}); the torch references will serve")

    def build_extension(self, ext) -> None:
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name)
        try:
            super().build_extension(ext)
            self._record_torch_version(ext)
        except Exception as exc:
            self.warn(f"{ext.name} not built ({exc}); kernels/splitserve_kernels/native.py will try the others")
        finally:
            self.build_temp = base

    def _record_torch_version(self, ext) -> None:
        """``splitserve_kernels/_native_<variant>.torch``: the torch this library was compiled against."""
        import torch

        library = Path(self.get_ext_fullpath(ext.name))
        stem = ext.name.rsplit(".", 1)[-1]
        (library.parent / f"{stem}.torch").write_text(torch.__version__ + "\n")


setup(
    cmdclass={"build_py": BuildPyWithProtos, "build_ext": OptionalBuildExt},
    ext_modules=native_extensions(),
)
