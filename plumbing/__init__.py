"""What the three services share: gRPC plumbing (``rpc``), configuration (``config``),
protobuf conversions (``convert``), the engine servicer base (``engine_service``),
registration with the gateway, metrics, logs, and the KV transport (``transport/``).

Kept light: importing the package imports nothing else.
"""
