"""The OpenAI-compatible HTTP front: ``/v1/completions``, ``/v1/chat/completions`` (SSE or
not), ``/v1/models``, ``/health``, ``/metrics``, as a client of the gateway's public gRPC API
(``splitserve http``). Importing this package imports nothing heavy."""
