"""Generate the Python protobuf and gRPC modules from ``protos/`` (build time, not import time).

``setup.py`` loads this file by path in its build_py hook; ``make setup`` runs it with
the virtualenv's grpcio-tools so the generated code matches the installed protobuf
runtime. Output lands next to the package (``splitserve_api/v1/*_pb2*.py``), git-ignored.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
DESCRIPTOR_SET = Path("splitserve_api") / "v1" / "descriptors.binpb"


def proto_files(proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Every ``.proto`` under ``proto_dir``, sorted."""
    return sorted(proto_dir.rglob("*.proto"))


def generate(out_dir: Path = ROOT, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc (from grpcio-tools) over ``proto_dir``; return the files written."""
    from importlib import resources

    from grpc_tools import protoc

    well_known = str(resources.files("grpc_tools") / "_proto")
    files = proto_files(proto_dir)
    if not files:
        raise RuntimeError(f"no .proto files under {proto_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        # The descriptors again, with their comments (source info), for server reflection
        # (plumbing/reflection.py): the generated modules carry none.
        f"--descriptor_set_out={out_dir / DESCRIPTOR_SET}",
        "--include_source_info",
        *[str(f) for f in files],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + ", ".join(f.name for f in files))
    written = []
    for f in files:
        stem = out_dir / f.relative_to(proto_dir).with_suffix("")
        written += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2_grpc.py"), Path(f"{stem}_pb2.pyi")]
    return [*written, out_dir / DESCRIPTOR_SET]


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        sys.stdout.write(f"generated {path.relative_to(out)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
