"""Generated protobuf/gRPC modules for ``protos/splitserve_api/v1/*.proto``.

The ``*_pb2*.py`` files here are written by ``splitserve_api.protogen`` during install
(``setup.py``'s build_py hook, and ``make setup``); they are never committed or edited.
"""
