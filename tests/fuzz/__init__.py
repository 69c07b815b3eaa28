"""Fuzz campaign against a local gateway + prefill + decode worker (real processes on 127.0.0.1).

    python -m tests.fuzz --profile large --seed 0

Hostile requests to every RPC of every service: structured (hypothesis: messages built from
each request type's descriptor with fields at and past their edges, and gateway requests that
are often valid with one thing wrong: huge or odd prompts, unicode, many stop strings),
wire-level (truncated and garbled protobuf, unknown fields, field number 0, invalid UTF-8,
wrong wire types, deep nesting) and raw bytes, all sent with a raw generic gRPC call; floods
(valid requests past ``max_in_flight``, multi-MB prompts, garbage); the registry's RPCs last.
Counted: statuses by family and method, statuses a method does not document, crashes, the
workers' pools after a drain, and how late the gateway answers heartbeats meanwhile.

Needs the dev extras (hypothesis). Modules: ``profile``, ``methods`` (RPCs and their
documented statuses), ``strategies``, ``wire``, ``cases``, ``send``, ``run``.
"""
