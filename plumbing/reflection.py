"""gRPC server reflection, ``v1`` beside ``v1alpha``, with the protos' comments.

The reference servicer (grpcio-reflection) serves each file as ``CopyToProto`` rebuilds it
from the generated module, which carries no source info: ``grpcurl describe`` then shows no
documentation. This servicer answers for our own files with the descriptors protoc wrote
with ``--include_source_info`` (``splitserve_api/v1/descriptors.binpb``, generated beside the
modules by ``splitserve_api/protogen.py``), and for the rest (health, well-known types) as the
reference does. A method's full name (``splitserve.v1.Gateway.Generate``) is looked up as
its service, which the Python pool does not do by itself (grpc/grpc#34743).

``grpc.reflection.v1`` is the same protocol as ``v1alpha`` under another package, message for
message and field for field, so the one servicer answers both with the ``v1alpha`` message
classes (grpcio-reflection ships no ``v1`` module).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

V1 = "grpc.reflection.v1.ServerReflection"
V1ALPHA = reflection.SERVICE_NAME
_DESCRIPTOR_SET = Path(__file__).resolve().parents[1] / "splitserve_api" / "v1" / "descriptors.binpb"


@cache
def documented_files(path: Path = _DESCRIPTOR_SET) -> dict[str, bytes]:
    """File name -> serialized ``FileDescriptorProto`` with source info; empty when the
    descriptor set was not generated (reflection then serves the files without comments)."""
    if not path.exists():
        return {}
    files = descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes())
    return {f.name: f.SerializeToString() for f in files.file}


class DocumentedReflection(ReflectionServicer):
    """The reference aio servicer, answering file requests with documented descriptors."""

    def __init__(self, service_names: list[str]) -> None:
        super().__init__(service_names)
        self._documented = documented_files()
        self._default = descriptor_pool.Default()

    def _file_by_filename(self, request: Any, filename: str) -> Any:
        try:
            return self._files(request, self._default.FindFileByName(filename))
        except KeyError:
            return super()._file_by_filename(request, filename)

    def _file_containing_symbol(self, request: Any, fully_qualified_name: str) -> Any:
        for name in (fully_qualified_name, fully_qualified_name.rpartition(".")[0]):  # a method: its service
            try:
                return self._files(request, self._default.FindFileContainingSymbol(name))
            except KeyError:
                continue
        return super()._file_containing_symbol(request, fully_qualified_name)

    def _files(self, request: Any, file: Any) -> Any:
        """``file`` and every file it imports, ours with their comments."""
        seen: dict[str, Any] = {}
        stack = [file]
        while stack:
            f = stack.pop()
            if f.name not in seen:
                seen[f.name] = f
                stack += list(f.dependencies)
        serialized = []
        for name, f in seen.items():
            if name in self._documented:
                serialized.append(self._documented[name])
            else:
                proto = descriptor_pb2.FileDescriptorProto()
                f.CopyToProto(proto)
                serialized.append(proto.SerializeToString())
        return reflection_pb2.ServerReflectionResponse(
            file_descriptor_response=reflection_pb2.FileDescriptorResponse(file_descriptor_proto=serialized),
            original_request=request)


def add_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """Serve reflection ``v1`` and ``v1alpha`` for ``service_names`` (both listed too)."""
    servicer = DocumentedReflection([*service_names, V1, V1ALPHA])
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler(V1ALPHA, {"ServerReflectionInfo": handler}),
        grpc.method_handlers_generic_handler(V1, {"ServerReflectionInfo": handler}),
    ])
