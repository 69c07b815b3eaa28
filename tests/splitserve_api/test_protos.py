"""The contracts: generated at build time (never committed), documented, well-formed."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve_api import protogen

ROOT = Path(__file__).resolve().parents[2]
PROTOS = protogen.proto_files()
MODULES = ["common", "gateway", "prefill", "decode", "kv_transfer"]


def test_every_proto_is_generated_into_a_fresh_directory(tmp_path: Path) -> None:
    written = protogen.generate(tmp_path)
    assert {p.name for p in written} == {
        f"{m}{suffix}" for m in MODULES for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
    } | {"descriptors.binpb"}
    assert all(p.is_file() and p.stat().st_size > 0 for p in written)
    # The fresh copy imports on its own (what a clean clone's install produces).
    code = "import splitserve_api.v1.gateway_pb2_grpc as g; print(g.GatewayStub.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "GatewayStub"
    # The descriptors again, with their comments, for server reflection (plumbing/reflection.py).
    from google.protobuf import descriptor_pb2

    files = descriptor_pb2.FileDescriptorSet.FromString((tmp_path / protogen.DESCRIPTOR_SET).read_bytes()).file
    assert {f.name for f in files} == {f"splitserve_api/v1/{m}.proto" for m in MODULES}
    assert all(any(loc.leading_comments for loc in f.source_code_info.location) for f in files)


def test_generated_code_is_not_committed() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert not [f for f in tracked if re.search(r"_pb2(_grpc)?\.pyi?$", f)]


@pytest.mark.parametrize("module", MODULES)
def test_generated_modules_import(module: str) -> None:
    importlib.import_module(f"splitserve_api.v1.{module}_pb2")
    importlib.import_module(f"splitserve_api.v1.{module}_pb2_grpc")


def _undocumented(text: str) -> list[str]:
    """rpc and field declarations without a comment on the line above (or trailing)."""
    lines = text.splitlines()
    missing = []
    decl = re.compile(r"^\s*(rpc\s+\w+|(optional\s+|repeated\s+)?[\w.<>, ]+\s+\w+\s*=\s*\d+;)")
    for i, line in enumerate(lines):
        if not decl.match(line) or line.strip().startswith("//"):
            continue
        prev = lines[i - 1].strip() if i else ""
        if not prev.startswith("//") and "//" not in line:
            missing.append(line.strip())
    return missing


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_every_rpc_and_field_has_a_comment(proto: Path) -> None:
    assert _undocumented(proto.read_text()) == []


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_enums_start_with_unspecified_and_are_prefixed(proto: Path) -> None:
    text = proto.read_text()
    for name, body in re.findall(r"enum (\w+) \{(.*?)\}", text, re.S):
        values = re.findall(r"(\w+)\s*=\s*(\d+);", body)
        prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper() + "_"
        assert values[0] == (prefix + "UNSPECIFIED", "0"), name
        assert all(v.startswith(prefix) for v, _ in values), name


def test_ids_are_uint64() -> None:
    for proto in PROTOS:
        for type_, field in re.findall(r"^\s*(\w+)\s+(\w+_id)\s*=", proto.read_text(), re.M):
            if field.endswith("token_id") or field == "nccl_unique_id":
                continue
            assert type_ == "uint64", f"{proto.name}: {field} is {type_}"


def test_nccl_unique_id_round_trips_through_the_handshake() -> None:
    from splitserve_api.v1 import common_pb2, kv_transfer_pb2

    unique_id = bytes(range(128))
    msg = kv_transfer_pb2.KVChannelHandshake(
        prefill_worker_id=2**63 + 5, transport=kv_transfer_pb2.TRANSPORT_KIND_NCCL,
        nccl_unique_id=unique_id,
        kv_layout=common_pb2.KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32"),
    )
    back = kv_transfer_pb2.KVChannelHandshake.FromString(msg.SerializeToString())
    assert back.nccl_unique_id == unique_id and back.prefill_worker_id == 2**63 + 5
    assert back.kv_layout.dtype == "float32"
