"""Build hook: generate the protobuf/gRPC modules from protos/ before packaging.

Everything else lives in pyproject.toml. Generated code is never committed; it is
written here at build time (wheel, sdist, editable install) and by ``make setup``.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        spec = importlib.util.spec_from_file_location("_protogen", ROOT / "splitserve" / "protogen.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.generate(ROOT)
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
